"""``shard-engine serve``: host one loaded engine for remote engines.

    shard-engine serve --engine llama --model m.gguf --layers 0:8 --listen 127.0.0.1:7450
    shard-engine serve --engine fake --layers 2:4 --listen unix:/run/shard/engine.sock
    shard-engine serve --engine llama --model m.gguf --layers 8:16 --listen 0.0.0.0:7450 \\
        --tls-cert server.pem --tls-key server.key --token-file token [--tls-client-ca ca.pem]

    shard-engine serve --engine fake --layers 0:6 --transport framed \\
        --listen unix:/run/user/1000/shard/engine.sock   # a 0700 directory; framed transport

Loopback and unix sockets need nothing more; any other address is refused without TLS and a
bearer token. Each client (mTLS identity, else connection) may make ``--rate-limit`` calls/s
(bursts of ``--rate-burst``); beyond, calls get a retryable ResourceExhausted with
``retry_after_s`` while other clients are served. Compute calls beyond what the engine is
given at once (``--workers`` - 4; without ``--workers``, 12, and as many single decodes as
``--max-sessions`` when that is more, so that every session's decode can join one forward)
wait in a queue fair per client, ``--max-queued`` of them at most; beyond, they are refused
(retryable ResourceExhausted with ``retry_after_s``, which a remote engine waits out and
retries). SIGTERM (or Ctrl-C) drains in-flight calls (new compute calls are refused naming the
drain, queued ones are served within ``--drain-seconds``), closes the engine and exits 0.
``--transport framed`` serves length-prefixed codec frames instead of gRPC (a fraction of
gRPC's per-call cost) on a unix socket whose directory only this user may enter; clients then
set ``"transport": "framed"``. ``--max-connections`` bounds the connections held at once
(1000 over gRPC, 256 framed); one beyond is refused, retryably, and its remote engine connects
again until a place frees or its call's deadline passes.

Sessions: ``--max-sessions``, ``--max-context``, ``--kv-budget-tokens`` and ``--eviction`` are
the engine's session policy; a session no call was served on for ``--session-idle-s`` (600 s;
0 = never) is released with a fence (a client back after that gets StaleEpoch and starts a new
epoch), so clients that died cannot hold every slot. An import stream is refused from its
header when the shard could not hold it, and all streams hold at most ``--max-import-bytes``.
SIGHUP drains like SIGTERM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_commands"]


def _layers(text: str) -> tuple[int, int]:
    start, separator, end = text.partition(":")
    try:
        if not separator:
            raise ValueError(text)
        return int(start), int(end)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"bad layer range {text!r}; use START:END") from error


def _option(text: str) -> tuple[str, object]:
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"bad option {text!r}; use KEY=VALUE (VALUE as JSON)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _command_serve(args: argparse.Namespace) -> int:
    import shard_engine_api as api
    from shard_engine_api.engine import (
        describe_model,
        get_plugin_manager,
        model_fixture,
        model_store,
        unchecked_model_store,
    )
    from shard_engine_remote._framed.server import DEFAULT_FRAMED_CONNECTIONS
    from shard_engine_remote._grpc_options import DEFAULT_MAX_CONNECTIONS
    from shard_engine_remote._prometheus import MetricsEndpoint, start_metrics_endpoint
    from shard_engine_remote._ratelimit import RateLimit
    from shard_engine_remote._security import (
        ServerSecurity,
        check_port_free,
        read_pem,
        read_token,
    )
    from shard_engine_remote._server import EngineServer, Serving
    from shard_engine_remote._signals import serve_until_signalled

    manager = get_plugin_manager()
    if args.model:
        fixture = describe_model(manager, args.engine, args.model)
    else:
        # As `run` does: --workdir is checked now, the model store by an engine that writes
        # into it (the fake never does), so its message names where the path came from.
        workdir = model_store(args.workdir) if args.workdir else unchecked_model_store()
        fixture = model_fixture(manager, args.engine, workdir)
    start, end = args.layers
    config = fixture.config(
        start,
        end,
        options=dict(args.option or []),
        boundary_dtype=args.boundary_dtype,
        n_threads=args.threads,
        max_sessions=args.max_sessions,
        max_context=args.max_context,
        kv_budget_tokens=args.kv_budget_tokens,
        eviction=args.eviction,
    )
    security = ServerSecurity(
        tls_cert=read_pem(args.tls_cert, "TLS certificate"),
        tls_key=read_pem(args.tls_key, "TLS key"),
        client_ca=read_pem(args.tls_client_ca, "TLS client CA"),
        token=read_token(args.token_file),
    )
    rate_limit = (
        RateLimit(
            calls_per_s=args.rate_limit, burst=args.rate_burst or int(2 * args.rate_limit) or 1
        )
        if args.rate_limit
        else None
    )
    # Refuse a bad address or bound before spending minutes loading a model.
    security.check_listen(args.listen)
    if args.max_connections is not None and args.max_connections < 1:
        raise api.InvalidRequest(f"--max-connections must be >= 1, got {args.max_connections}")
    if args.transport == "framed":
        from shard_engine_remote._framed import FramedServer, check_private_socket

        if not args.listen.startswith("unix:") or security.tls_cert is not None:
            raise api.InvalidRequest(
                "--transport framed serves only a unix socket (unix:PATH), without TLS"
            )
        check_private_socket(Path(args.listen.removeprefix("unix:")))
    max_connections = args.max_connections or (
        DEFAULT_FRAMED_CONNECTIONS if args.transport == "framed" else DEFAULT_MAX_CONNECTIONS
    )
    engine = api.load_engine(args.engine, config, manager=manager)
    server = EngineServer(
        engine,
        security=security,
        max_message_bytes=args.max_payload_bytes + (1 << 20),
        max_workers=args.workers,
        rate_limit=rate_limit,
        max_queued=args.max_queued,
        max_connections=max_connections,
        max_import_bytes=args.max_import_bytes,
        session_idle_s=args.session_idle_s or None,
    )
    serving: Serving = server
    metrics: MetricsEndpoint | None = None
    try:
        if args.metrics_listen:
            metrics = start_metrics_endpoint(args.metrics_listen, server)
        if args.transport == "framed":
            serving = FramedServer(server, max_connections=max_connections)
            address = serving.start(Path(args.listen.removeprefix("unix:")))
        else:
            check_port_free(args.listen)
            address = server.start(args.listen)
    except BaseException:
        if metrics is not None:
            metrics.stop()
        engine.close()
        raise
    caps = engine.capabilities()
    print(
        f"serving {caps.engine} [{start}:{end}) of {fixture.description or fixture.model} "
        f"({caps.role}, evidence {caps.evidence}) on {address}"
        + ("" if args.transport == "grpc" else " (framed)")
        + ("" if security.tls_cert is None else " with TLS")
        + ("" if not security.token else ", bearer token required"),
        flush=True,
    )
    if metrics is not None:
        print(f"metrics (Prometheus text format) on http://{metrics.address}/metrics", flush=True)
    try:
        serve_until_signalled(serving, drain_seconds=args.drain_seconds)
    finally:
        if metrics is not None:
            metrics.stop()
    print(f"stopped; server counters: {server.counters.snapshot()}", flush=True)
    return 0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the ``shard-engine`` CLI."""
    from shard_engine_api import wire
    from shard_engine_api.wire import BOUNDARY_DTYPES
    from shard_engine_remote._idle import DEFAULT_SESSION_IDLE_S
    from shard_engine_remote._import_limits import DEFAULT_MAX_IMPORT_BYTES

    serve = subparsers.add_parser(
        "serve",
        help="host one loaded engine for remote engines (gRPC)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--engine", required=True, help="engine entry-point name")
    serve.add_argument("--layers", type=_layers, required=True, help="layer range START:END")
    serve.add_argument("--model", help="model reference (e.g. a GGUF path); default: built-in")
    serve.add_argument(
        "--workdir",
        help="where a built-in model may be generated (default: the model store, "
        "$SHARD_ENGINE_MODEL_STORE or a private per-user directory in $TMPDIR or /var/tmp)",
    )
    serve.add_argument(
        "--option",
        type=_option,
        action="append",
        metavar="KEY=VALUE",
        help="an engine load option (VALUE parsed as JSON when it is JSON); repeatable",
    )
    serve.add_argument(
        "--boundary-dtype",
        choices=sorted(BOUNDARY_DTYPES),
        default="f32",
        help="dtype of the hidden states this shard sends on (default f32; bf16: f32's range "
        "in 16 bits; f16 overflows on models whose hidden states exceed 65504)",
    )
    serve.add_argument("--threads", type=int, default=0, help="0 = engine default")
    serve.add_argument(
        "--max-sessions", type=int, default=16, help="sessions held at once (default 16)"
    )
    serve.add_argument(
        "--max-context", type=int, default=2048, help="positions per session (default 2048)"
    )
    serve.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=16384,
        help="positions cached across all sessions (default 16384)",
    )
    serve.add_argument(
        "--eviction",
        choices=["reject", "lru"],
        default="reject",
        help="a new session when every slot or the KV budget is taken: refused (reject, the "
        "default) or the least recently used idle session evicted (lru)",
    )
    serve.add_argument(
        "--session-idle-s",
        type=float,
        default=DEFAULT_SESSION_IDLE_S,
        metavar="SECONDS",
        help="release (with a fence) a session no call was served on for this long, so dead "
        f"clients cannot hold every slot (default {DEFAULT_SESSION_IDLE_S:g}; 0 = never)",
    )
    serve.add_argument(
        "--max-import-bytes",
        type=int,
        default=DEFAULT_MAX_IMPORT_BYTES,
        metavar="BYTES",
        help="session state all import streams may hold at once (each is also refused from "
        "its header when over what its length takes on this shard; default "
        f"{DEFAULT_MAX_IMPORT_BYTES})",
    )
    serve.add_argument(
        "--listen",
        default="127.0.0.1:7450",
        help="HOST:PORT or unix:PATH (default 127.0.0.1:7450; beyond loopback needs TLS+token)",
    )
    serve.add_argument(
        "--token-file", help="bearer token file (default $SHARD_ENGINE_REMOTE_TOKEN)"
    )
    serve.add_argument("--tls-cert", help="PEM certificate chain of this server")
    serve.add_argument("--tls-key", help="PEM private key of this server")
    serve.add_argument("--tls-client-ca", help="PEM CA of accepted client certificates (mTLS)")
    serve.add_argument(
        "--max-payload-bytes",
        type=int,
        default=wire.DEFAULT_MAX_PAYLOAD_BYTES,
        help="largest payload accepted (the codec's limit; default 256 MiB)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads serving calls; the engine is given --workers - 4 compute calls at once "
        "(default 16 threads, and as many single decodes as --max-sessions when that is more)",
    )
    from shard_engine_remote._admission import DEFAULT_MAX_QUEUED

    serve.add_argument(
        "--max-queued",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        metavar="CALLS",
        help="compute calls that may wait for the engine, all clients together (fair per "
        f"client; beyond, a retryable refusal with retry_after_s; default {DEFAULT_MAX_QUEUED})",
    )
    from shard_engine_remote._framed.server import DEFAULT_FRAMED_CONNECTIONS
    from shard_engine_remote._grpc_options import DEFAULT_MAX_CONNECTIONS

    serve.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="CONNECTIONS",
        help="connections held at once, never more than half the process's descriptors "
        f"(default {DEFAULT_MAX_CONNECTIONS} over gRPC, {DEFAULT_FRAMED_CONNECTIONS} framed: two "
        "threads each); one beyond is refused, retryably, and its remote engine connects "
        "again until a place frees or its call's deadline passes",
    )
    serve.add_argument(
        "--rate-limit",
        type=float,
        default=2000.0,
        metavar="CALLS_PER_S",
        help="calls per second each client may make (default 2000; 0 = no limit)",
    )
    serve.add_argument(
        "--rate-burst", type=int, default=0, help="calls a client may make at once (default 2x)"
    )
    serve.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="also serve the engine's metrics and health and the server's stats over HTTP "
        "(GET /metrics, Prometheus text format; needs prometheus-client; no authentication: "
        "keep it on loopback or a trusted network)",
    )
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM or Ctrl-C, how long calls in flight may finish (default 10)",
    )
    serve.add_argument(
        "--transport",
        choices=["grpc", "framed"],
        default="grpc",
        help="grpc (default; the network transport) or framed (unix socket in a 0700 directory)",
    )
    serve.set_defaults(func=_command_serve)
