"""The entry point of a spawned engine process: ``python -m shard_engine_remote._child``.

It builds the named engine (unloaded), serves it on the given private unix socket with the
bearer token from ``$SHARD_ENGINE_REMOTE_TOKEN``, lets the first call load it, prints one line
``ready <address>`` (or ``error <message>``) on stdout (later output to stdout is discarded),
and serves until SIGTERM or until its
stdin closes (the supervising process died), then drains and exits. Given
``--private-directory`` (the supervisor's directory holding the socket and its stderr), a
child whose supervisor died removes it on the way out: no one else is left to.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import shard_engine_api as api
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._security import ServerSecurity, read_token
from shard_engine_remote._server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EngineServer,
    Serving,
    serve_until_signalled,
)

__all__ = ["main"]


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
    args = parser.parse_args(argv)
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
    print(f"ready {address}", flush=True)
    # No one reads stdout past that line: an engine printing there would fill the pipe and
    # block for good. It goes nowhere instead (not to the stderr log, whose tail quotes a
    # crash: ggml's abort backtrace, written to stdout, would push the assertion out of it).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    serve_until_signalled(serving, drain_seconds=args.drain_seconds, stop=stop)
    if orphaned.is_set() and args.private_directory is not None:
        shutil.rmtree(args.private_directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine is closed and the server drained; skip interpreter finalization, where
    # gRPC's and a native engine's threads may still hold locks.
    os._exit(code)
