"""Serving until a signal: the loop ``serve`` and a spawned child run in their main thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Final

from shard_engine_remote._server import Serving

__all__ = ["serve_until_signalled"]

_SIGNAL_POLL_S: Final = 0.05
"""How often the serving loop looks for a signal its handler recorded."""


def serve_until_signalled(
    server: Serving,
    *,
    drain_seconds: float = 10.0,
    stop: threading.Event | None = None,
    on_stopped: Callable[[], None] | None = None,
) -> int | None:
    """Block until SIGTERM, SIGHUP or SIGINT (or ``stop`` is set), then drain in-flight calls
    for up to ``drain_seconds``, close the engine and return the first signal received (None
    when ``stop`` ended it). Call from the main thread. SIGHUP drains too: a closed terminal or
    a service manager's hang-up must not kill a server mid-call."""
    stop = stop or threading.Event()
    signalled: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        # No lock here (not even Event.set's): a second signal runs this handler again on
        # the same thread, inside the first, and would wait for good on a lock it holds (a
        # supervisor sends SIGTERM twice: once to ask, once from its stop).
        signalled.append(signum)

    previous = {
        sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    }
    try:
        while not signalled and not stop.wait(_SIGNAL_POLL_S):
            pass
        server.stop(drain_seconds)
    finally:
        # The handlers stay until the engine is closed: a repeated SIGTERM must not kill the
        # process halfway through closing it.
        try:
            server.engine.close()
            if on_stopped is not None:
                on_stopped()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return signalled[0] if signalled else None
