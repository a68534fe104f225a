"""Cancellation tokens: set by ``cancel`` from any thread, polled by backends at safe points,
and sealed by the core at the commit point so that a cancel either stops the commit or is
refused."""

from __future__ import annotations

import threading
from collections.abc import Collection

from shard_engine_api._errors import Cancelled

__all__ = ["CancelToken"]


class CancelToken:
    """One in-flight request's cancellation flag.

    The owner of both decisions (``EngineCore``) calls :meth:`try_cancel` and :meth:`seal` under
    one lock: once sealed the operation commits and a cancel answers False; once cancelled the
    seal raises Cancelled and the operation rolls back.

    The flag is a plain attribute; a :class:`threading.Event` (costly to make, and most requests
    never wait) is created only when a backend sleeps on the token or asks for :attr:`event`.
    ``session_ids`` is kept as given (a tuple of one for single operations: making a frozenset
    on every decode step costs more than the rare cancel-by-session scan it would speed up).
    """

    __slots__ = ("_cancelled", "_event", "_sealed", "linked", "request_id", "session_ids")

    def __init__(self, request_id: str, session_ids: Collection[str]) -> None:
        self._cancelled = False
        self._sealed = False
        self._event: threading.Event | None = None
        self.request_id = request_id
        self.session_ids = session_ids
        # The token of a forward this request shares with others (a coalesced decode): a
        # cancel of this request stops that forward too; the others then run again.
        self.linked: CancelToken | None = None

    def cancel(self) -> None:
        """Request cancellation unconditionally (closing the engine)."""
        # Flag first, then wake a waiter: a waiter that appears in between sees the flag.
        self._cancelled = True
        event = self._event
        if event is not None:
            event.set()
        linked = self.linked
        if linked is not None:
            linked.cancel()

    def try_cancel(self) -> bool:
        """Request cancellation unless the operation is already committing or cancelled;
        True when this call is what stops it."""
        if self._sealed or self._cancelled:
            return False
        self.cancel()
        return True

    def seal(self) -> None:
        """The commit point: raise Cancelled if cancellation was requested, else refuse every
        later cancel."""
        if self._cancelled:
            raise Cancelled(f"request {self.request_id!r} was cancelled")
        self._sealed = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def sealed(self) -> bool:
        """Whether the operation passed its commit point (it commits; cancels answer False)."""
        return self._sealed

    @property
    def event(self) -> threading.Event:
        """An event set on cancellation, for backends whose abort callback polls it."""
        event = self._event
        if event is None:
            event = self._event = threading.Event()
            if self._cancelled:  # cancelled before the event existed
                event.set()
        return event

    def check(self) -> None:
        """Raise Cancelled if cancellation was requested."""
        if self._cancelled:
            raise Cancelled(f"request {self.request_id!r} was cancelled")

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a cancel ends the sleep at once with Cancelled."""
        if self.event.wait(seconds):
            raise Cancelled(f"request {self.request_id!r} was cancelled")
