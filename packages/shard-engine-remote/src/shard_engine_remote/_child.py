"""The entry point of a spawned engine process: ``python -m shard_engine_remote._child``.

It builds the named engine (unloaded), serves it on the given private unix socket with the
bearer token from ``$SHARD_ENGINE_REMOTE_TOKEN``, lets the first call load it, prints one line
``ready <address>`` (or ``error <message>``) on stdout, and serves until SIGTERM or until its
stdin closes (the supervising process died), then drains and exits.
"""

from __future__ import annotations

import argparse
import os
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


def _watch_stdin(stop: threading.Event) -> None:
    # The parent holds the other end of this pipe: EOF means it is gone, and so should we be.
    # Raw reads: a daemon thread blocked in a buffered read would hold the buffer's lock at
    # interpreter shutdown, which aborts the process.
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    finally:
        stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_engine_remote._child")
    parser.add_argument("--engine", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--drain-seconds", type=float, default=5.0)
    parser.add_argument("--transport", choices=["grpc", "framed"], default="grpc")
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
    stop = threading.Event()
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True, name="parent-watch").start()
    print(f"ready {address}", flush=True)
    serve_until_signalled(serving, drain_seconds=args.drain_seconds, stop=stop)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine is closed and the server drained; skip interpreter finalization, where
    # gRPC's and a native engine's threads may still hold locks.
    os._exit(code)
