"""Idle expiry of a served engine's sessions: a client that dies holds its sessions for good.

A served engine with ``eviction="reject"`` keeps every session until someone releases it; 16
workers killed after a prefill each left a default ``serve`` refusing every new session, for
as long as it ran. :class:`IdleSessions` remembers, per session, the newest epoch a served
call left it at and when the server last served a call on it; a session no call touched for
``idle_s`` seconds (and none is running on) is released at that epoch, through the engine's
own ``release``, which leaves its fence: a client that comes back late gets StaleEpoch (its
session is gone, not silently recreated) and starts a new epoch. ``serve`` turns it on
(``--session-idle-s``, 600 s by default; 0 turns it off); an engine used in-process has none.

While sessions are refused for lack of room (ResourceExhausted for session slots or the KV
budget), :attr:`IdleSessions.short_of_room` says why, and the server's health reports
``degraded`` with it, until a new session is admitted or one is released (by its client or by
expiry): an operator sees a shard that is full, not a ``ready`` one refusing everybody.

Memory: one entry per session the engine admitted through this server, at most
:data:`_ENTRIES_PER_SESSION` times ``max_sessions`` (the oldest beyond that, sessions an LRU
engine must have evicted long before, are forgotten).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeVar

import shard_engine_api as api

__all__ = ["DEFAULT_SESSION_IDLE_S", "IdleSessions", "served_max_sessions"]

DEFAULT_SESSION_IDLE_S: Final = 600.0
"""``serve``'s default: a session no call touched for 10 minutes is released with a fence."""
_ENTRIES_PER_SESSION: Final = 4
_ROOM: Final = frozenset({"sessions", "kv"})
"""The ``resource`` of a ResourceExhausted that means the shard is full."""
_LOG: Final = logging.getLogger("shard_engine.remote")
_Request = TypeVar("_Request")
_Answer = TypeVar("_Answer")


def served_max_sessions(engine: api.ShardEngine) -> int:
    """The served engine's session limit (16 before it is loaded: a child's engine loads
    through its first call)."""
    try:
        return engine.capabilities().limits.max_sessions
    except api.ShardEngineError:
        return 16


@dataclass(slots=True)
class _Entry:
    epoch: int
    last_used: float
    running: int = 0


def _sessions_of(request: object) -> tuple[api.SessionRef, ...]:
    match request:
        case api.PrefillRequest() | api.DecodeRequest():
            return (request.session,)
        case api.DecodeBatchRequest():
            return tuple(item.session for item in request.items)
        case api.ImportSessionRequest():
            return (request.snapshot.session,)
        case _:
            return ()


def _results_of(answer: object) -> tuple[api.SessionRef, ...]:
    match answer:
        case api.DecodeBatchResult():
            return tuple(_results_of(item)[0] for item in answer.items if _results_of(item))
        case api.BoundaryResult() | api.LogitsResult() | api.ImportSessionResult():
            return (answer.session,)
        case _:
            return ()


class IdleSessions:
    """Releases, with a fence, sessions a server has not served a call on for ``idle_s``
    seconds. ``clock`` is the monotonic clock (tests); :meth:`expire` does one pass and is
    what the background thread runs."""

    def __init__(
        self,
        engine: api.ShardEngine,
        idle_s: float,
        *,
        max_sessions: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not idle_s > 0:
            raise api.InvalidRequest(f"session_idle_s must be > 0, got {idle_s}")
        self.engine = engine
        self.idle_s = idle_s
        self.expired = 0
        """Sessions released for idleness so far."""
        self.short_of_room: str | None = None
        """Why new work was last refused for lack of room, until room is seen again."""
        self._clock = clock
        self._limit = _ENTRIES_PER_SESSION * max_sessions + 64
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, operation: Callable[[_Request], _Answer]) -> Callable[[_Request], _Answer]:
        """``operation`` (an engine's compute call), recording the sessions it serves."""

        def run(request: _Request) -> _Answer:
            sessions = _sessions_of(request)
            self._begin(sessions)
            served: tuple[api.SessionRef, ...] = ()
            try:
                answer = operation(request)
                served = _results_of(answer)
                if isinstance(answer, api.DecodeBatchResult):
                    for item in answer.items:
                        if isinstance(item, api.ErrorInfo):
                            self._refused(item.code, item.details, item.message)
                return answer
            except api.ResourceExhausted as error:
                self._refused(error.code, error.details, error.message)
                raise
            finally:
                self._end(sessions, served)

        return run

    def forget(self, session_id: str) -> None:
        """A client released the session itself."""
        with self._lock:
            self._entries.pop(session_id, None)
            self.short_of_room = None

    def _refused(self, code: str, details: object, message: str) -> None:
        resource = details.get("resource") if isinstance(details, dict) else None
        if code == api.ResourceExhausted.code and resource in _ROOM:
            self.short_of_room = f"refusing new work for lack of room ({resource}): {message}"

    def _begin(self, sessions: Iterable[api.SessionRef]) -> None:
        with self._lock:
            for session in sessions:
                entry = self._entries.get(session.session_id)
                if entry is not None:
                    entry.running += 1

    def _end(self, sessions: Iterable[api.SessionRef], served: tuple[api.SessionRef, ...]) -> None:
        now = self._clock()
        with self._lock:
            for session in sessions:
                entry = self._entries.get(session.session_id)
                if entry is not None:
                    entry.running = max(0, entry.running - 1)
                    entry.last_used = now
                    self._entries.move_to_end(session.session_id)
            for session in served:
                entry = self._entries.get(session.session_id)
                if entry is None:
                    self._entries[session.session_id] = _Entry(session.epoch, now)
                    self.short_of_room = None  # a new session got in
                    self._trim()
                else:
                    entry.epoch = max(entry.epoch, session.epoch)
                    entry.last_used = now
                    self._entries.move_to_end(session.session_id)
        if served:
            self._start()

    def _trim(self) -> None:
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def expire(self) -> list[api.SessionRef]:
        """Release every session idle for ``idle_s`` with no call running on it, at the newest
        epoch served; return them. An engine that is no longer serving ends the pass."""
        now = self._clock()
        due: list[api.SessionRef] = []
        with self._lock:
            for session_id, entry in self._entries.items():
                if now - entry.last_used < self.idle_s:
                    break  # ordered by last use: the rest are younger
                if entry.running == 0:
                    due.append(api.SessionRef(session_id=session_id, epoch=entry.epoch))
        released: list[api.SessionRef] = []
        for session in due:
            with self._lock:
                current = self._entries.get(session.session_id)
                if current is None or current.running or now - current.last_used < self.idle_s:
                    continue  # touched meanwhile
                del self._entries[session.session_id]
            try:
                result = self.engine.release(api.ReleaseRequest(session=session))
            except (api.NotReady, api.EngineCrashed):
                raise
            except api.ShardEngineError as error:
                _LOG.info("idle session %r not released: %s", session.session_id, error)
                continue
            if result.released:
                self.short_of_room = None
                self.expired += 1
                released.append(session)
                _LOG.info(
                    "released session %r (epoch %d): no call for %g s",
                    session.session_id,
                    session.epoch,
                    self.idle_s,
                )
        return released

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, daemon=True, name="idle-sessions")
        self._thread.start()

    def _run(self) -> None:
        period = min(max(self.idle_s / 4, 0.05), 30.0)
        while not self._stop.wait(period):
            try:
                self.expire()
            except (api.NotReady, api.EngineCrashed):
                return  # closed or failed: nothing left to release

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
