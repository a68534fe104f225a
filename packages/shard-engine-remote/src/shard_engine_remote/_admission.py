"""Admission of a served engine's compute calls: a bounded queue, fair per client.

A server lets at most ``slots`` compute calls into its engine at once (the engine's own
scheduler orders and batches what it is given); further calls wait here instead of being
refused. The queue is fair between clients (a client is a connection or a mutual-TLS identity,
see ``client_key``): each client's calls wait in their arrival order, and a freed slot goes to
the clients with calls waiting in turn (round robin), so one client's flood delays another
client's call by at most one call per client waiting, never by the flood's length.

A server may add *decode slots* once its engine is loaded (:meth:`Admission.widen`): slots
only single decodes take, so that every session's decode can reach the engine's scheduler and
join one forward. Each is one place fewer in the queue, so the calls that may hold a thread
stay as many; half the queue's places are never taken (:attr:`Admission.queue_floor`), so an
engine of many sessions still has a queue for its other calls (taking every place left a
server of 268 or more sessions refusing a prefill as soon as its 12 slots were busy). Other
calls (prefills, batches) still get only ``slots`` at once: a client's flood of them waits
here, fair per client, not in the engine's own first-come queue. A decode takes a decode slot
first, and a slot when none is free; a freed decode slot goes to the next client in turn whose
oldest waiting call is a decode.

At most ``max_queued`` calls wait, all clients together. A call arriving at a full queue takes
the place of the newest call of the client with the most waiting, when that client holds at
least two more than the newcomer's own (that call is refused instead: nothing of it ran);
otherwise the newcomer is refused. A refusal is a retryable ResourceExhausted whose
``retry_after_s`` estimates when the queue will have room, from recent calls' durations.

A waiting call leaves the queue at once when its RPC ends (deadline, abandon, lost
connection) or its client cancels it: it never reaches the engine. While a server drains
(SIGTERM), new calls are refused naming the drain; calls already waiting are served within
the drain's grace, and those still waiting when it nearly ends are refused naming the drain.
Nothing here touches the engine: the server runs a granted call and hands its slot back.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Final, Literal, TypeAlias

__all__ = ["DEFAULT_MAX_QUEUED", "Admission", "Outcome", "Ticket"]

DEFAULT_MAX_QUEUED: Final = 256
"""Compute calls a server holds waiting for a compute slot, all clients together."""
_FIRST_ESTIMATE_S: Final = 0.05
"""What a compute call is assumed to take before one was measured."""
_MIN_RETRY_AFTER_S: Final = 0.001
_MAX_RETRY_AFTER_S: Final = 60.0
_SMOOTHING: Final = 0.2
"""Weight of the latest call's duration in the running estimate."""
_IDLE_POLL_S: Final = 0.01

Outcome: TypeAlias = Literal["granted", "ended", "cancelled", "evicted", "draining"]
"""How a wait ended: the call holds a slot, or it left the queue without running (its RPC
ended, its client cancelled it, another client's call took its place, the server drains)."""
_QUEUED: Final = "queued"


class Ticket:
    """One compute call's place: granted (it holds a slot) or waiting in its client's queue."""

    __slots__ = (
        "_event",
        "abandoned",
        "client",
        "decode",
        "granted_at",
        "in_decode_slot",
        "queued_at",
        "state",
    )

    def __init__(self, client: str, now: float, decode: bool = False) -> None:
        self.client = client
        self.decode = decode
        """A single decode: it may take a decode slot."""
        self.in_decode_slot = False
        self.queued_at = now
        self.granted_at = now
        self.state: Outcome | Literal["queued"] = "granted"
        self.abandoned = False
        """Its RPC ended or its client cancelled it after it was granted, before it ran."""
        self._event: threading.Event | None = None


class Admission:
    """``slots`` compute slots and the fair queue of calls waiting for one (see the module
    docstring). ``acquire``/``release`` take and return a slot without queueing (a snapshot
    stream's, which is refused when none is free)."""

    def __init__(
        self, slots: int, max_queued: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.slots = slots
        self.decode_slots = 0
        """Slots beyond ``slots`` that only single decodes take (see :meth:`widen`)."""
        self.max_queued = max_queued
        self.queue_floor = max_queued // 2
        """Places the queue keeps whatever :meth:`widen` takes for decode slots."""
        self._clock = clock
        self._lock = threading.Lock()
        self._free = slots
        self._free_decode = 0
        self._queues: dict[str, collections.deque[Ticket]] = {}
        self._turns: collections.deque[str] = collections.deque()
        """Clients with calls waiting, in the order their next call is granted (each once)."""
        self._queued = 0
        self._closed = False
        self._estimate_s = _FIRST_ESTIMATE_S
        self._waited = 0
        self._evicted = 0
        self._wait_s = 0.0
        self._wait_max_s = 0.0

    @property
    def widenable(self) -> int:
        """How many decode slots :meth:`widen` may still add."""
        with self._lock:
            return self._widenable()

    def _widenable(self) -> int:
        return max(0, self.max_queued - self.queue_floor)

    def widen(self, decodes: int) -> int:
        """Let up to ``decodes`` single decodes in at once (never fewer than before): decode
        slots make up what ``slots`` lacks, each taken from the queue's places (``slots +
        decode_slots + max_queued``, the calls that may hold a thread, stays the same) down to
        :attr:`queue_floor`.
        Decodes waiting at their client's turn get the new slots at once. Returns how many
        decodes may be in at once now."""
        with self._lock:
            extra = min(max(0, decodes - self.slots - self.decode_slots), self._widenable())
            self.decode_slots += extra
            self.max_queued -= extra
            granted = []
            for _ in range(extra):  # each new decode slot: granted, or free
                event = self._hand_over_decode()
                if event is not None:
                    granted.append(event)
            now = self.slots + self.decode_slots
        for event in granted:
            event.set()
        return now

    # ----------------------------------------------------------------- slots without a queue

    def acquire(self, blocking: bool = False) -> bool:
        """A slot now, when one is free and no call waits for one (never blocks)."""
        with self._lock:
            if self._free == 0 or self._queued:
                return False
            self._free -= 1
            return True

    def release(self) -> None:
        """Give back a slot taken with :meth:`acquire` (the next waiting call gets it)."""
        with self._lock:
            granted = self._hand_over()
        if granted is not None:
            granted.set()

    # ----------------------------------------------------------------- queued calls

    def enter(self, client: str, decode: bool = False) -> Ticket | None:
        """A place for one of ``client``'s compute calls (``decode``: a single decode, which
        may take a decode slot): granted at once when a slot is free and nobody waits, or a
        decode slot is free, else queued (:meth:`wait` for it). None: refused (the queue is
        full and holds no client's call this one may take the place of, or the server
        drains: :attr:`draining`)."""
        now = self._clock()
        ticket = Ticket(client, now, decode)
        evicted: Ticket | None = None
        with self._lock:
            if self._closed:
                return None
            if decode and self._free_decode:
                self._free_decode -= 1
                ticket.in_decode_slot = True
                return ticket
            if self._free and not self._queued:
                self._free -= 1
                return ticket
            if self._queued >= self.max_queued:
                evicted = self._make_room(client)
                if evicted is None:
                    return None
            ticket.state = _QUEUED
            ticket._event = threading.Event()
            mine = self._queues.get(client)
            if mine is None:
                mine = self._queues[client] = collections.deque()
                self._turns.append(client)
            mine.append(ticket)
            self._queued += 1
        if evicted is not None and evicted._event is not None:
            evicted._event.set()
        return ticket

    def _make_room(self, client: str) -> Ticket | None:
        """Under the lock, the queue full: take out the newest call of the client holding the
        most, when it holds at least two more than ``client``; None when there is none."""
        if not self._queues:
            return None
        biggest = max(self._queues, key=lambda key: len(self._queues[key]))
        victims = self._queues[biggest]
        mine = self._queues.get(client)
        if len(victims) < (0 if mine is None else len(mine)) + 2:
            return None
        victim = victims.pop()  # two or more waited: the client stays in its turn
        victim.state = "evicted"
        self._queued -= 1
        self._evicted += 1
        return victim

    def wait(self, ticket: Ticket) -> Outcome:
        """Block until ``ticket`` holds a slot ("granted") or left the queue (the reason)."""
        event = ticket._event
        if event is not None:
            event.wait()
        with self._lock:
            state = ticket.state
            if state == "granted" and ticket.abandoned:
                state = "ended"
                granted = self._hand_back(ticket)
            else:
                granted = None
        if granted is not None:
            granted.set()
        assert state != _QUEUED
        return state

    def withdraw(self, ticket: Ticket, reason: Literal["ended", "cancelled"]) -> bool:
        """Take ``ticket`` out of the queue (its RPC ended, or its client cancelled it). True
        when it was waiting (it never runs); False when it holds a slot already (it is marked
        abandoned: a call not yet running does not start) or left the queue before."""
        with self._lock:
            if ticket.state != _QUEUED:
                if ticket.state == "granted":
                    ticket.abandoned = True
                return False
            self._unqueue(ticket)
            ticket.state = reason
        if ticket._event is not None:
            ticket._event.set()
        return True

    def done(self, ticket: Ticket) -> None:
        """A granted call ended: its slot goes to the next waiting call, and its duration
        joins the estimate :meth:`retry_after_s` gives."""
        held = max(0.0, self._clock() - ticket.granted_at)
        with self._lock:
            self._estimate_s += _SMOOTHING * (held - self._estimate_s)
            granted = self._hand_back(ticket)
        if granted is not None:
            granted.set()

    def close(self) -> None:
        """The server drains: refuse new calls from now on (waiting ones stay queued)."""
        with self._lock:
            self._closed = True

    def drain(self) -> int:
        """Refuse every waiting call ("draining") and every later one; how many were
        waiting."""
        with self._lock:
            self._closed = True
            tickets = [ticket for queue in self._queues.values() for ticket in queue]
            self._queues.clear()
            self._turns.clear()
            self._queued = 0
            for ticket in tickets:
                ticket.state = "draining"
        for ticket in tickets:
            if ticket._event is not None:
                ticket._event.set()
        return len(tickets)

    @property
    def draining(self) -> bool:
        return self._closed

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no slot is taken and no call waits, or ``deadline`` (the clock's time)
        passed; False then."""
        while True:
            with self._lock:
                if (
                    self._free == self.slots
                    and self._free_decode == self.decode_slots
                    and not self._queued
                ):
                    return True
            now = self._clock()
            if now >= deadline:
                return False
            time.sleep(min(_IDLE_POLL_S, deadline - now))

    def retry_after_s(self) -> float:
        """When a refused call may find room: the time the calls waiting now take to be
        granted, at the recent rate (``slots`` calls of the running estimate's length at
        once), at least a millisecond and at most a minute."""
        with self._lock:
            waiting = max(1, self._queued)
            estimate = self._estimate_s
        wait = waiting * estimate / self.slots
        return min(_MAX_RETRY_AFTER_S, max(_MIN_RETRY_AFTER_S, wait))

    def waiting(self) -> int:
        """How many calls wait now."""
        with self._lock:
            return self._queued

    def stats(self) -> dict[str, int | float]:
        """The queue for ``ServerStats``: its depth now and bound, calls that waited, calls
        that lost their place to another client's, and their waits (milliseconds)."""
        with self._lock:
            return {
                "queued": self._queued,
                "max_queued": self.max_queued,
                "computing": self.slots - self._free + self.decode_slots - self._free_decode,
                "queued_calls": self._waited,
                "queue_evicted": self._evicted,
                "queue_wait_ms": self._wait_s * 1000.0,
                "queue_wait_max_ms": self._wait_max_s * 1000.0,
            }

    # ----------------------------------------------------------------- under the lock

    def _hand_over(self) -> threading.Event | None:
        """A slot came free: grant it to the next client's oldest waiting call (that client
        then goes last in turn), or keep it free. Returns the event to set, outside the
        lock."""
        if self._turns:
            return self._grant(self._take_turn(self._turns[0]))
        self._free += 1
        return None

    def _hand_back(self, ticket: Ticket) -> threading.Event | None:
        """``ticket``'s slot came free: :meth:`_hand_over` a slot, or a decode slot to the
        next client in turn whose oldest waiting call is a decode (kept free when none is)."""
        if not ticket.in_decode_slot:
            return self._hand_over()
        return self._hand_over_decode()

    def _hand_over_decode(self) -> threading.Event | None:
        """A decode slot came free (under the lock): grant it as :meth:`_hand_over` grants a
        slot, to the first client in turn whose oldest waiting call is a decode (each client's
        calls keep their order), or keep it free."""
        for client in self._turns:
            if self._queues[client][0].decode:
                ticket = self._take_turn(client)
                ticket.in_decode_slot = True
                return self._grant(ticket)
        self._free_decode += 1
        return None

    def _take_turn(self, client: str) -> Ticket:
        """Take ``client``'s oldest waiting call out of its queue (under the lock); the client
        goes last in turn when it has more waiting, else leaves the turns."""
        queue = self._queues[client]
        ticket = queue.popleft()
        self._turns.remove(client)
        if queue:
            self._turns.append(client)
        else:
            del self._queues[client]
        return ticket

    def _grant(self, ticket: Ticket) -> threading.Event | None:
        """``ticket`` (out of its queue) holds a slot now; its event, to set outside the lock."""
        self._queued -= 1
        now = self._clock()
        ticket.state = "granted"
        ticket.granted_at = now
        waited = max(0.0, now - ticket.queued_at)
        self._waited += 1
        self._wait_s += waited
        self._wait_max_s = max(self._wait_max_s, waited)
        return ticket._event

    def _unqueue(self, ticket: Ticket) -> None:
        queue = self._queues[ticket.client]
        queue.remove(ticket)
        self._queued -= 1
        if not queue:
            del self._queues[ticket.client]
            self._turns.remove(ticket.client)
