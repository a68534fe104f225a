"""Bounded waiting places for gRPC calls that hold a server thread while they wait on their
peer (see :class:`Waiting`)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

__all__ = ["Waiting"]


class Waiting:
    """Calls that hold one of the server's threads while they wait on their peer (for their
    request message, or a health Watch for as long as it lasts): at most ``capacity`` at once,
    for at most ``limit_s`` each (a Watch: no limit).

    gRPC's sync server gives each call a pool thread as it starts and waits there for the
    request message, without a timeout. Here that wait is bounded: a call whose message is
    ``limit_s`` late is cancelled, and when ``capacity`` calls wait, a new call cancels the
    oldest waiter of the peer holding the most places among those whose oldest has waited
    ``grace_s`` (a message that late is not merely queued behind a burst of others); when
    there is none, the new call is refused (None: the caller answers busy, retryable, nothing
    ran). A well-behaved client's message follows its headers at once: whoever keeps calls
    waiting loses them, and can keep others out only by opening ``capacity`` new calls every
    ``grace_s``. One sweeper thread (started with the server) enforces the time limit;
    entering and leaving cost a lock and dict updates, no thread or timer per call."""

    def __init__(self, capacity: int, limit_s: float, on_cut: Callable[[], None]) -> None:
        self.capacity = capacity
        self.limit_s = limit_s
        self.grace_s = min(1.0, limit_s / 2)
        self._on_cut = on_cut
        self._condition = threading.Condition()
        # peer -> ticket -> (entered, deadline, context), oldest first; and ticket -> peer.
        self._peers: dict[str, OrderedDict[int, tuple[float, float, grpc.ServicerContext]]] = {}
        self._owners: dict[int, str] = {}
        self._tickets = itertools.count()
        self._running = False
        self._sweeper: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._owners)

    def enter(self, context: grpc.ServicerContext, peer: str, *, timed: bool = True) -> int | None:
        """Count ``context`` as waiting for ``peer``; returns the ticket :meth:`leave` takes,
        or None when the call is refused (every place taken, none by a waiter ``grace_s``
        old)."""
        now = time.monotonic()
        deadline = now + self.limit_s if timed else float("inf")
        evicted: grpc.ServicerContext | None = None
        ticket = next(self._tickets)
        with self._condition:
            if len(self._owners) >= self.capacity:
                stale = now - self.grace_s
                holders = [
                    key
                    for key, waiters in self._peers.items()
                    if next(iter(waiters.values()))[0] <= stale
                ]
                if not holders:
                    return None
                biggest = max(holders, key=lambda key: len(self._peers[key]))
                victims = self._peers[biggest]
                victim, (_, _, evicted) = victims.popitem(last=False)
                del self._owners[victim]
                if not victims:
                    del self._peers[biggest]
            mine = self._peers.get(peer)
            if mine is None:
                mine = self._peers[peer] = OrderedDict()
            mine[ticket] = (now, deadline, context)
            self._owners[ticket] = peer
        if evicted is not None:
            self._cut(evicted)
        return ticket

    def leave(self, ticket: int) -> bool:
        """Stop counting a waiter; False when it was cut off already (it is being cancelled:
        the call must not go on, even when its message arrived meanwhile)."""
        with self._condition:
            return self._pop(ticket) is not None

    def _pop(self, ticket: int) -> grpc.ServicerContext | None:
        peer = self._owners.pop(ticket, None)
        if peer is None:
            return None
        waiters = self._peers[peer]
        _, _, context = waiters.pop(ticket)
        if not waiters:
            del self._peers[peer]
        return context

    def _cut(self, context: grpc.ServicerContext) -> None:
        self._on_cut()
        context.cancel()

    def start(self) -> None:
        with self._condition:
            if self._running:
                return
            self._running = True
        self._sweeper = threading.Thread(target=self._sweep, name="engine-rpc-waiting", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        with self._condition:
            self._running = False
            self._condition.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()

    def _sweep(self) -> None:
        while True:
            expired: list[grpc.ServicerContext] = []
            with self._condition:
                if not self._running:
                    return
                now = time.monotonic()
                due = now + self.limit_s
                late: list[int] = []
                for waiters in self._peers.values():
                    for ticket, (_, deadline, _) in waiters.items():
                        if deadline <= now:
                            late.append(ticket)
                        else:
                            due = min(due, deadline)
                for ticket in late:
                    context = self._pop(ticket)
                    if context is not None:
                        expired.append(context)
                # A waiter entering later is due no earlier than now + limit_s: sleeping
                # until the earliest deadline known (or limit_s) never oversleeps one.
                if not expired:
                    self._condition.wait(due - now)
            for context in expired:
                self._cut(context)
