"""Cancellation tokens: set by ``cancel`` from any thread, polled by backends at safe points,
and sealed by the core at the commit point so that a cancel either stops the commit or is
refused."""

from __future__ import annotations

import threading

from shard_engine_api._errors import Cancelled

__all__ = ["CancelToken"]


class CancelToken:
    """One in-flight request's cancellation flag.

    The owner of both decisions (``EngineCore``) calls :meth:`try_cancel` and :meth:`seal` under
    one lock: once sealed the operation commits and a cancel answers False; once cancelled the
    seal raises Cancelled and the operation rolls back.
    """

    __slots__ = ("_event", "_sealed", "request_id", "session_ids")

    def __init__(self, request_id: str, session_ids: frozenset[str]) -> None:
        self._event = threading.Event()
        self._sealed = False
        self.request_id = request_id
        self.session_ids = session_ids

    def cancel(self) -> None:
        """Request cancellation unconditionally (closing the engine)."""
        self._event.set()

    def try_cancel(self) -> bool:
        """Request cancellation unless the operation is already committing or cancelled;
        True when this call is what stops it."""
        if self._sealed or self._event.is_set():
            return False
        self._event.set()
        return True

    def seal(self) -> None:
        """The commit point: raise Cancelled if cancellation was requested, else refuse every
        later cancel."""
        if self._event.is_set():
            raise Cancelled(f"request {self.request_id!r} was cancelled")
        self._sealed = True

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def event(self) -> threading.Event:
        """The underlying event, for backends whose abort callback polls it."""
        return self._event

    def check(self) -> None:
        """Raise Cancelled if cancellation was requested."""
        if self._event.is_set():
            raise Cancelled(f"request {self.request_id!r} was cancelled")

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a cancel ends the sleep at once with Cancelled."""
        if self._event.wait(seconds):
            raise Cancelled(f"request {self.request_id!r} was cancelled")
