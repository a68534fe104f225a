"""The entry point of a spawned engine process: ``python -m shard_engine_remote._child``.

It builds the named engine (unloaded), serves it on the given private unix socket with the
bearer token from ``$SHARD_ENGINE_REMOTE_TOKEN``, lets the first call load it, prints one line
``ready <address>`` (or ``error <message>``) on stdout (later output to stdout is discarded),
and serves until SIGTERM or until its
stdin closes (the supervising process died), then drains and exits. Given
``--private-directory`` (the supervisor's directory holding the socket and its stderr), a
child whose supervisor died removes it on the way out: no one else is left to.

A stopped child (SIGSTOP) would not see its stdin close until someone resumed it, so it asks
the kernel for SIGCONT when its parent dies (``PR_SET_PDEATHSIG``): resumed, it sees the
closed pipe and goes. SIGCONT, not SIGKILL, because the kernel sends that signal when the
*thread* that started the child ends, which in a worker may be any thread of a pool while the
worker lives on (SIGCONT to a running child does nothing), and because a child killed outright
could not remove its directory. An orphaned child that has not exited ``drain_seconds`` +
:data:`_ORPHAN_GRACE_S` later (an engine stuck in native code) removes its directory and ends
itself. A child given ``--parent-pid`` that finds another parent at start-up (the worker died
before the request for SIGCONT) is orphaned at once.

Asked to stop by a signal (SIGTERM, SIGHUP, SIGINT), the child drains, closes the engine and
then ends by that same signal, so its supervisor reports how it ended (not "exited with code
0").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import shard_engine_api as api
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._security import ServerSecurity, read_token
from shard_engine_remote._server import DEFAULT_MAX_MESSAGE_BYTES, EngineServer, Serving
from shard_engine_remote._signals import serve_until_signalled

__all__ = ["main"]

_PR_SET_PDEATHSIG: Final = 1
_ORPHAN_GRACE_S: Final = 10.0
"""How long past its drain an orphaned child may take to exit before it ends itself."""


def _continue_when_orphaned() -> None:
    """Ask the kernel for SIGCONT when the parent (thread) dies; best effort (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(
            ctypes.c_int(_PR_SET_PDEATHSIG),
            ctypes.c_ulong(signal.SIGCONT),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        )
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _orphan_deadline(orphaned: threading.Event, seconds: float, directory: Path | None) -> None:
    """Once orphaned, give the drain ``seconds``; then remove ``directory`` and end."""
    orphaned.wait()
    time.sleep(seconds)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    os._exit(3)


def _watch_stdin(stop: threading.Event, orphaned: threading.Event) -> None:
    # The parent holds the other end of this pipe: EOF means it is gone, and so should we be.
    # Raw reads: a daemon thread blocked in a buffered read would hold the buffer's lock at
    # interpreter shutdown, which aborts the process.
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    finally:
        orphaned.set()
        stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_engine_remote._child")
    parser.add_argument("--engine", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--drain-seconds", type=float, default=5.0)
    parser.add_argument("--transport", choices=["grpc", "framed"], default="grpc")
    parser.add_argument("--private-directory", type=Path, default=None)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    _continue_when_orphaned()
    try:
        engine = api.load_engine(args.engine)
        server = EngineServer(
            engine,
            security=ServerSecurity(token=read_token(None)),
            max_message_bytes=args.max_message_bytes,
            allow_load=True,
        )
        serving: Serving = server
        if args.transport == "framed":
            serving = FramedServer(server)
            address = serving.start(Path(args.listen.removeprefix("unix:")))
        else:
            address = server.start(args.listen)
    except api.ShardEngineError as error:
        print(f"error {error.code} {error.message}", flush=True)
        return 2
    stop, orphaned = threading.Event(), threading.Event()
    threading.Thread(
        target=_watch_stdin, args=(stop, orphaned), daemon=True, name="parent-watch"
    ).start()
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        orphaned.set()
        stop.set()
    print(f"ready {address}", flush=True)
    # No one reads stdout past that line: an engine printing there would fill the pipe and
    # block for good. It goes nowhere instead (not to the stderr log, whose tail quotes a
    # crash: ggml's abort backtrace, written to stdout, would push the assertion out of it).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    threading.Thread(
        target=_orphan_deadline,
        args=(orphaned, args.drain_seconds + _ORPHAN_GRACE_S, args.private_directory),
        daemon=True,
        name="orphan-deadline",
    ).start()
    signalled = serve_until_signalled(serving, drain_seconds=args.drain_seconds, stop=stop)
    if orphaned.is_set() and args.private_directory is not None:
        shutil.rmtree(args.private_directory, ignore_errors=True)
    return 0 if signalled is None else -signalled


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        # Stopped by a signal: end by it, so whoever waits for this process sees which.
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
    # The engine is closed and the server drained; skip interpreter finalization, where
    # gRPC's and a native engine's threads may still hold locks.
    os._exit(code)
