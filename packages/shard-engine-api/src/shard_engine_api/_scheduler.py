"""The scheduler: who runs on an engine's backend next, and which single decodes run together.

A backend (a model context) runs one forward at a time. :class:`EngineCore` hands every
operation that touches it to one :class:`Scheduler`, which replaces a bare lock:

- **Arrival order.** Requests wait in one FIFO queue; when the backend frees, the oldest
  waiting request runs next (its caller's thread runs it). A caller that loops cannot overtake
  one that is already waiting, so nobody starves behind a tight loop.
- **Continuous batching.** A single decode that reaches the front takes with it every other
  waiting single decode (oldest first, one per session, up to ``max_group`` rows) and runs them
  as one batched forward: the path ``decode_batch`` uses. Its caller's thread (the *leader*)
  runs the group; every other member's thread waits for its own outcome, which the leader
  hands it. A decode is never moved ahead of an earlier waiting request on its own session.
- **Idle means at once.** A request that finds the backend free and nobody waiting runs at once,
  with one uncontended lock round trip: a single caller pays nothing for the scheduler. The one
  exception is a *gather*: right after a forward of several decodes, their callers are about to
  send their next steps, so a decode that starts then waits until as many decodes are ready
  again (the group's members, plus the decodes of other sessions that were waiting when it
  ended: one that missed it leads the next), or at most ``gather_window`` (a quarter of that
  forward's duration, capped at :data:`GATHER_CAP_S`), before the group is formed. A single
  caller never gathers (its last group had one member).

Bounds (documented in the API README, "Many callers"): a request waits at most for the
requests queued before it, each of which runs (or is batched into a forward) once; every group
forms after at most one gather window. So the longest wait behind other work is (requests ahead
at arrival) x (the longest forward) + one gather window per forward, whatever other callers do
meanwhile. A waiting request leaves at once when it is cancelled (the core wakes it).

Threads: the scheduler's own lock is a leaf (nothing is called while it is held), so the core
may call :meth:`Scheduler.wake` under its state lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Collection
from typing import Final, Generic, Literal, TypeVar

from shard_engine_api._cancel import CancelToken
from shard_engine_api._errors import Cancelled

__all__ = ["GATHER_CAP_S", "QueueStats", "Scheduler", "Ticket"]

WAIT_BACKSTOP_S: Final = 0.05
"""How long a waiting request sleeps before it looks again without being woken: only a
backstop, every hand-over and every cancel wakes it."""

GATHER_CAP_S: Final = 0.010
"""The longest a decode waits for companions before its group forms (see the module doc). At 2
ms, 8 callers of a spawned child (gemma3-270m, 47 ms forwards of 8) split into alternating
groups of 4 (0.42 of llama.cpp's batch(8)); at 10 ms they stay together (0.81)."""

GATHER_FRACTION: Final = 0.25
"""The gather window as a fraction of the last grouped forward's duration (under the cap)."""

_EXPECTED_CAP: Final = 1 << 16
"""Waiting decodes counted toward the next group's size at most (the gather caps the target
at the backend's batch limit anyway); keeps the count bounded under a deep queue."""

Payload = TypeVar("Payload")

_WAITING: Final = 0
_RUNNING: Final = 1  # granted: the ticket's thread runs (alone, or leads a group)
_MEMBER: Final = 2  # taken into another ticket's group: its leader runs it
_DONE: Final = 3  # a member whose outcome the leader handed over


class Ticket(Generic[Payload]):
    """One request's place in the queue. ``session_ids`` None means every session (the
    request may not be overtaken by anything, e.g. ``close``). ``payload`` is what a leader
    needs to run a coalesced decode; ``outcome`` is what it hands back."""

    __slots__ = (
        "arrived",
        "event",
        "kind",
        "outcome",
        "payload",
        "session_ids",
        "state",
        "token",
    )

    def __init__(
        self,
        kind: Literal["decode", "exclusive"],
        token: CancelToken | None,
        session_ids: Collection[str] | None,
        payload: Payload | None,
    ) -> None:
        self.kind = kind
        self.token = token
        self.session_ids = session_ids
        self.payload = payload
        self.outcome: object = None
        self.state = _WAITING
        self.event = threading.Event()
        self.arrived = time.perf_counter()


@dataclasses.dataclass(slots=True)
class QueueStats:
    """What the queue has seen since load (read under the scheduler's lock)."""

    queued_now: int = 0
    queue_peak: int = 0
    waited: int = 0
    wait_ms_total: float = 0.0
    wait_ms_max: float = 0.0
    groups: int = 0
    grouped_requests: int = 0
    group_max: int = 0


class Scheduler(Generic[Payload]):
    """FIFO admission to one backend with continuous batching of single decodes."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._arrivals = threading.Condition(self._mutex)
        self._busy = False
        self._queue: collections.deque[Ticket[Payload]] = collections.deque()
        self._by_token: dict[CancelToken, Ticket[Payload]] = {}
        self._gathering = 0
        self._last_group = 1
        self._last_group_s = 0.0
        self.stats = QueueStats()

    # ----------------------------------------------------------------- entering

    def try_enter_alone(self) -> bool:
        """Take the backend at once for a decode if it is free, nobody waits and the last
        forward was not a group (whose callers are about to come back): the idle fast path."""
        with self._mutex:
            if self._busy or self._queue or self._last_group > 1:
                return False
            self._busy = True
            return True

    def enter(self, token: CancelToken | None, session_ids: Collection[str] | None) -> None:
        """Take the backend for an exclusive operation, in arrival order. With a ``token``
        a cancel ends the wait (Cancelled, nothing was touched); without one the wait is not
        cancellable (load, release, close)."""
        with self._mutex:
            if not self._busy and not self._queue:
                self._busy = True
                return
            ticket: Ticket[Payload] = Ticket("exclusive", token, session_ids, None)
            self._enqueue(ticket)
        self._wait(ticket)

    def enter_decode(
        self, token: CancelToken, session_id: str, payload: Payload
    ) -> Ticket[Payload]:
        """Queue a single decode (after :meth:`try_enter_alone` said no). Returns its ticket
        once it either runs (``leads()`` is True: call :meth:`gather`, run the group,
        :meth:`finish_group`, :meth:`leave`) or was run by another leader (its ``outcome`` is
        set). Raises Cancelled when cancelled while it waits."""
        ticket: Ticket[Payload] = Ticket("decode", token, (session_id,), payload)
        with self._mutex:
            if not self._busy and not self._queue:
                self._busy = True
                ticket.state = _RUNNING
                return ticket
            self._enqueue(ticket)
        self._wait(ticket)
        return ticket

    def _enqueue(self, ticket: Ticket[Payload]) -> None:
        self._queue.append(ticket)
        if ticket.token is not None:
            self._by_token[ticket.token] = ticket
        stats = self.stats
        stats.queued_now = len(self._queue)
        stats.queue_peak = max(stats.queue_peak, stats.queued_now)
        if self._gathering:
            self._arrivals.notify_all()

    def _wait(self, ticket: Ticket[Payload]) -> None:
        token = ticket.token
        event = ticket.event
        while True:
            event.wait(None if token is None else WAIT_BACKSTOP_S)
            with self._mutex:
                event.clear()
                state = ticket.state
                if state in (_RUNNING, _DONE):
                    return
                # A member waits for its leader whatever happens: the leader answers it.
                if state != _WAITING or token is None or not token.cancelled:
                    continue
                self._queue.remove(ticket)
                self._forget(ticket)
                # The backend may have been left while this request was passed over as
                # cancelled, and others have queued behind it since: they run now.
                following = None if self._busy else self._hand_on()
            if following is not None:
                following.event.set()
            raise Cancelled(f"request {token.request_id!r} was cancelled")

    def _forget(self, ticket: Ticket[Payload]) -> None:
        """``ticket`` left the queue (it runs, joined a group or was cancelled)."""
        self.stats.queued_now = len(self._queue)
        if ticket.token is not None:
            self._by_token.pop(ticket.token, None)
        waited_ms = (time.perf_counter() - ticket.arrived) * 1000.0
        stats = self.stats
        stats.waited += 1
        stats.wait_ms_total += waited_ms
        stats.wait_ms_max = max(stats.wait_ms_max, waited_ms)

    def wake(self, token: CancelToken) -> None:
        """``token`` was cancelled: a request waiting under it looks at once."""
        with self._mutex:
            ticket = self._by_token.get(token)
        if ticket is not None:
            ticket.event.set()

    def wake_all(self) -> None:
        """Every waiting request looks at once (the engine is closing)."""
        with self._mutex:
            tickets = list(self._queue)
        for ticket in tickets:
            ticket.event.set()

    @property
    def queued(self) -> int:
        """Requests waiting now (members of a running group excluded)."""
        with self._mutex:
            return len(self._queue)

    def stats_now(self) -> QueueStats:
        """A copy of the stats, consistent with each other."""
        with self._mutex:
            return dataclasses.replace(self.stats)

    # ----------------------------------------------------------------- groups

    @staticmethod
    def leads(ticket: Ticket[Payload]) -> bool:
        """Whether ``ticket``'s thread runs (it may lead a group), rather than having been run."""
        return ticket.state == _RUNNING

    def gather(self, leader: Ticket[Payload], limit: int) -> list[Ticket[Payload]]:
        """The group ``leader`` (a running decode) runs: itself first, then waiting single
        decodes oldest first, at most one per session and ``limit`` in all, none moved ahead
        of an earlier waiting request on its session. Right after a forward of several
        decodes, waits up to the gather window for as many to be ready (see the module doc)."""
        with self._mutex:
            target = min(limit, self._last_group)
            if target > 1 and len(self._queue) + 1 < target:
                deadline = time.perf_counter() + min(
                    GATHER_CAP_S, GATHER_FRACTION * self._last_group_s
                )
                self._gathering += 1
                try:
                    while len(self._queue) + 1 < target:
                        left = deadline - time.perf_counter()
                        if left <= 0 or not self._arrivals.wait(left):
                            break
                finally:
                    self._gathering -= 1
            return [leader, *self._take(set(leader.session_ids or ()), limit - 1)]

    def _take(self, taken: set[str], limit: int) -> list[Ticket[Payload]]:
        """Waiting single decodes for a group (under the lock): oldest first, at most one per
        session and none of ``taken``, at most ``limit``, none moved ahead of an earlier
        waiting request on its session; they leave the queue as members."""
        group: list[Ticket[Payload]] = []
        if limit < 1 or not self._queue:
            return group
        blocked: set[str] = set()  # sessions of waiting requests passed over
        keep: collections.deque[Ticket[Payload]] = collections.deque()
        queue = self._queue
        while queue:
            ticket = queue.popleft()
            sessions = ticket.session_ids
            if sessions is None:  # nothing overtakes it, nor anything after it
                keep.append(ticket)
                keep.extend(queue)
                break
            if (
                len(group) < limit
                and ticket.kind == "decode"
                and not (ticket.token is not None and ticket.token.cancelled)
            ):
                (session_id,) = sessions
                if session_id not in taken and session_id not in blocked:
                    taken.add(session_id)
                    ticket.state = _MEMBER
                    group.append(ticket)
                    continue
            keep.append(ticket)
            blocked.update(sessions)
        self._queue = keep
        for member in group:
            self._forget(member)
        return group

    def take_decodes(self, limit: int, busy_session: str) -> list[Ticket[Payload]]:
        """Waiting single decodes (oldest first, one per session, ``limit`` at most, none of
        ``busy_session`` and none ahead of an earlier waiting request on its session), taken
        into a group that the running operation itself runs: a chunked prefill between two
        of its chunks. Wake them with :meth:`finish_members`."""
        with self._mutex:
            return self._take({busy_session}, limit)

    def finish_members(self, members: list[Ticket[Payload]]) -> None:
        """Wake ``members``, whose ``outcome`` is set (see :meth:`take_decodes`)."""
        if not members:
            return
        with self._mutex:
            stats = self.stats
            stats.groups += 1
            stats.grouped_requests += len(members)
            stats.group_max = max(stats.group_max, len(members))
            for member in members:
                member.state = _DONE
        for member in members:
            member.event.set()

    def finish_group(self, group: list[Ticket[Payload]], forward_s: float) -> None:
        """The leader ran ``group`` (``forward_s`` of backend time): record it for the next
        gather and wake every other member, whose ``outcome`` is set."""
        with self._mutex:
            self._last_group = self._expected_group(group)
            self._last_group_s = forward_s
            if len(group) > 1:
                stats = self.stats
                stats.groups += 1
                stats.grouped_requests += len(group)
                stats.group_max = max(stats.group_max, len(group))
            for member in group[1:]:
                member.state = _DONE
        for member in group[1:]:
            member.event.set()

    def _expected_group(self, group: list[Ticket[Payload]]) -> int:
        """How many decodes the next group should gather (under the lock): the members of
        ``group``, whose callers are about to send their next steps, and the single decodes
        of other sessions already waiting (one that missed this group will lead the next).
        Counting only the members let one late caller split the callers for good: a group
        of 7 set the next target to 7, which formed without the 7th caller to come back, and
        so on, each step leaving one session a whole forward behind."""
        expected = len(group)
        if expected < 2:
            return expected
        seen = {session for member in group for session in member.session_ids or ()}
        for ticket in self._queue:
            sessions = ticket.session_ids
            if ticket.kind == "decode" and sessions is not None and not seen.issuperset(sessions):
                seen.update(sessions)
                expected += 1
                if expected >= _EXPECTED_CAP:
                    break
        return expected

    # ----------------------------------------------------------------- leaving

    def leave(self) -> None:
        """The running operation is done: the oldest waiting request that is not cancelled
        runs next (a cancelled one is leaving by itself, and hands on in turn if the backend
        is free by then)."""
        with self._mutex:
            chosen = self._hand_on()
        if chosen is not None:
            chosen.event.set()

    def _hand_on(self) -> Ticket[Payload] | None:
        """With the backend free (under the lock): the oldest waiting request that is not
        cancelled takes it (returned, to be woken once the lock is released); None leaves the
        backend free."""
        for ticket in self._queue:
            if ticket.token is None or not ticket.token.cancelled:
                self._queue.remove(ticket)
                self._forget(ticket)
                ticket.state = _RUNNING
                self._busy = True
                return ticket
        self._busy = False
        return None
