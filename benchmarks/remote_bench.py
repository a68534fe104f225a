"""What running shards out of process costs: per-hop overhead and a process-per-shard pipeline.

    python benchmarks/remote_bench.py [--quick] [--model GEMMA3.gguf] [--child-env KEY=VALUE]

Side by side in one run:

* per-hop overhead of a remote engine against the same engine in this process, for one decode
  row and for a 512-row prefill bundle (a middle shard of the fake engine, hidden size 2048 by
  default): median microseconds per call in-process, through a server in this process and
  through a spawned child, each over both transports (gRPC and the framed transport, on a unix
  socket, codec both ways; spawn's default is framed); the added microseconds and the
  ratio; beside them the transport's floors on the same bytes, server in a child process: a
  bare gRPC unary echo and a framed echo on a plain unix socket. Target: a remote decode hop
  adds <= 0.3 ms on loopback;
* a 3-shard llama pipeline with every shard in its own child process against the unsplit model
  and the same 3 shards in this process: prefill and decode tokens/s and their ratios
  (gemma3-270m when present, else a generated llama, n_embd 512, 8 layers, F16). Targets:
  >= 0.95 of unsplit decode, >= 0.97 of prefill. The configurations alternate within every
  repetition so machine noise hits them alike, and each configuration's ratio is also given per
  repetition, against the unsplit run of the same repetition (median and range).

Threads: llama.cpp's OpenMP workers spin-wait after each graph (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY``), so an idle shard process keeps burning the cores the active one needs;
with 3 processes on one machine that, not the transport, can dominate decode. The llama engine
sets its own default (``shard_engine_llama._threading``: ``GOMP_SPINCOUNT=10000`` unless the
environment says otherwise) and children inherit this process's environment, so the default
run measures those defaults; ``--child-env GOMP_SPINCOUNT=300000`` (libgomp's own) or
``--child-env OMP_WAIT_POLICY=passive`` overrides them in the children only, and
``--threads`` sets each shard's thread count.

Numbers are printed, never asserted: a benchmark that fails on a noisy machine teaches nothing.
"""

from __future__ import annotations

import argparse
import operator
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from _results import Results, add_results_option, add_size_options

import shard_engine_api as api
from shard_engine_remote import RemoteEngine

MODEL_ENV: Final = "SHARD_ENGINE_LLAMA_MODEL"
GEMMA3_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
PREFILL_ROWS: Final = 512
N_LAYERS: Final = 6


@dataclass(frozen=True)
class Settings:
    quick: bool
    hidden: int
    repeat: int
    hop_calls: int
    prompt_tokens: int
    decode_tokens: int
    threads: int
    child_env: dict[str, str | None]
    pipeline_repeat: int = 1


# ----------------------------------------------------------------- per-hop overhead


def _fake_config(
    start: int, end: int, hidden: int, options: dict[str, object] | None = None
) -> api.LoadConfig:
    return api.LoadConfig(
        shard=api.ShardSpec(model=f"fake:hidden={hidden}", n_layers=N_LAYERS, start=start, end=end),
        max_sessions=2,
        max_context=PREFILL_ROWS * 4,
        max_batch_tokens=PREFILL_ROWS,
        kv_budget_tokens=PREFILL_ROWS * 8,
        options=dict(options or {}),
    )


ENGINE_KINDS: Final = (
    "in-process",
    "server grpc",
    "server framed",
    "child grpc",
    "child framed",
    "child socket",
)
"""``child socket``: the framed transport without its shared memory (every byte on the
socket), beside ``child framed`` (large bodies in the shared memory)."""


def _middle(kind: str, hidden: int, child_env: dict[str, str | None]) -> api.ShardEngine:
    """The measured shard, layers [2, 4): in this process, or behind a server in this process,
    or in a child process, over either transport."""
    if kind == "in-process":
        return api.load_engine("fake", _fake_config(2, 4, hidden))
    where, transport = kind.split()
    options: dict[str, object] = {"transport": transport}
    if transport == "socket":
        options.update(transport="framed", shared_memory=False)
    if where == "server":
        options["in_process"] = "fake"
    else:
        options.update(spawn="fake", env=child_env)
    engine = RemoteEngine()
    engine.load(_fake_config(2, 4, hidden, options))
    return engine


def _median_us(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e6


# The transport's own floor, measured on the same bytes in a child process: a bare gRPC unary
# echo (no codec, no engine, no project code on the server) and a length-prefixed echo on a
# plain unix socket (what any transport needs at least: two syscalls each way).


def _serve_echo(directory: str) -> None:
    """Child process: gRPC echo on ``directory/grpc.sock``, framed echo on ``raw.sock``."""
    import socket
    import struct
    import threading
    from concurrent import futures

    import grpc

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    limit = 1 << 28
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("echo.Echo", {"Call": handler}),)
    )
    server.add_insecure_port(f"unix:{directory}/grpc.sock")
    server.start()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{directory}/raw.sock")
    listener.listen(4)

    def serve_raw(connection: socket.socket) -> None:
        with connection:
            while header := connection.recv(4, socket.MSG_WAITALL):
                (size,) = struct.unpack("<I", header)
                connection.sendall(header + connection.recv(size, socket.MSG_WAITALL))

    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=serve_raw, args=(connection,), daemon=True).start()


class _EchoFloor:
    """Clients of the echo child: ``grpc(payload)`` and ``socket(payload)`` round trips."""

    def __init__(self) -> None:
        import socket
        import subprocess
        import sys

        import grpc

        self._directory = tempfile.TemporaryDirectory(prefix="remote-bench-echo-")
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--echo-server", self._directory.name],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != b"ready":
            raise RuntimeError("the echo server did not start")
        limit = 1 << 28
        self._channel = grpc.insecure_channel(
            f"unix:{self._directory.name}/grpc.sock",
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        self._call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
            "/echo.Echo/Call"
        )
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(f"{self._directory.name}/raw.sock")

    def grpc(self, payload: bytes) -> None:
        self._call(payload, timeout=60)

    def socket(self, payload: bytes) -> None:
        import socket
        import struct

        self._socket.sendall(struct.pack("<I", len(payload)) + payload)
        (size,) = struct.unpack("<I", self._socket.recv(4, socket.MSG_WAITALL))
        self._socket.recv(size, socket.MSG_WAITALL)

    def close(self) -> None:
        self._socket.close()
        self._channel.close()
        self._process.kill()
        self._process.wait()
        self._directory.cleanup()


def _take_turns(
    engines: dict[str, api.ShardEngine],
    call: Callable[[api.ShardEngine], object],
    floors: dict[str, Callable[[bytes], None]],
    payload: bytes,
    times: dict[str, list[float]],
    *,
    reverse: bool,
) -> None:
    """One call on every engine (in turn, reversed every other time so no configuration always
    goes first) and the same bytes through every echo floor, each timed into ``times``."""
    order = list(engines.items())
    if reverse:
        order.reverse()
    for name, engine in order:
        started = time.perf_counter()
        call(engine)
        times[name].append(time.perf_counter() - started)
    for name, send in floors.items():
        started = time.perf_counter()
        send(payload)
        times[name].append(time.perf_counter() - started)


def bench_hops(settings: Settings, results: Results) -> None:
    """Every configuration takes each call in turn (alternating order), so load on the machine
    falls on all of them alike; medians over all calls of all repetitions."""
    from shard_engine_api import wire

    hidden = settings.hidden
    head = api.load_engine("fake", _fake_config(0, 2, hidden))
    session = api.SessionRef(session_id="hop", epoch=1)
    rng = np.random.default_rng(0)
    prompt = tuple(int(t) for t in rng.integers(1, 500, size=PREFILL_ROWS))
    first = head.prefill(
        api.PrefillRequest(
            request_id="p", session=session, start_pos=0, inputs=api.TokenInput(token_ids=prompt)
        )
    )
    assert isinstance(first, api.BoundaryResult)
    rows: list[api.BoundaryBundle] = []
    for index in range(settings.hop_calls):
        step = head.decode(
            api.DecodeRequest(
                request_id=f"h{index}",
                session=session,
                pos=PREFILL_ROWS + index,
                inputs=api.TokenInput(token_ids=(int(rng.integers(1, 500)),)),
            )
        )
        assert isinstance(step, api.BoundaryResult)
        rows.append(step.bundle)
    head.close()
    engines = {kind: _middle(kind, hidden, settings.child_env) for kind in ENGINE_KINDS}
    floor = _EchoFloor()
    decode_bytes = wire.encode(
        api.DecodeRequest(request_id="d", session=session, pos=PREFILL_ROWS, inputs=rows[0])
    )
    prefill_bytes = wire.encode(
        api.PrefillRequest(request_id="p", session=session, start_pos=0, inputs=first.bundle)
    )
    floors: dict[str, Callable[[bytes], None]] = {
        "grpc echo": floor.grpc,
        "socket echo": floor.socket,
    }
    decode_times: dict[str, list[float]] = {name: [] for name in [*engines, *floors]}
    prefill_times: dict[str, list[float]] = {name: [] for name in decode_times}
    prefill_calls = max(3, settings.hop_calls // 20)
    try:
        for repetition in range(settings.repeat):
            for engine in engines.values():
                engine.prefill(
                    api.PrefillRequest(
                        request_id="warm", session=session, start_pos=0, inputs=first.bundle
                    )
                )
            for index, row in enumerate(rows):
                request = api.DecodeRequest(
                    request_id=f"d{index}", session=session, pos=PREFILL_ROWS + index, inputs=row
                )
                _take_turns(
                    engines,
                    operator.methodcaller("decode", request),
                    floors,
                    decode_bytes,
                    decode_times,
                    reverse=bool((index + repetition) % 2),
                )
            for index in range(prefill_calls):
                prefill = api.PrefillRequest(
                    request_id=f"p{index}", session=session, start_pos=0, inputs=first.bundle
                )
                _take_turns(
                    engines,
                    operator.methodcaller("prefill", prefill),
                    floors,
                    prefill_bytes,
                    prefill_times,
                    reverse=bool((index + repetition) % 2),
                )
    finally:
        for engine in engines.values():
            engine.close()
        floor.close()
    print(
        f"\nper-hop overhead: fake middle shard [2:4), hidden {hidden}, f32 boundaries; medians "
        f"of {len(decode_times['in-process'])} decode calls ({len(decode_bytes)} B) and "
        f"{len(prefill_times['in-process'])} 512-row prefills ({len(prefill_bytes)} B), every "
        "configuration taking each call in turn"
    )
    print(
        f"{'where':<14} {'decode us':>10} {'+us':>8} {'ratio':>6}   "
        f"{'prefill-512 us':>14} {'+us':>9} {'ratio':>6}"
    )
    base_decode = statistics.median(decode_times["in-process"])
    base_prefill = statistics.median(prefill_times["in-process"])
    for name, decode_samples in decode_times.items():
        decode_s = statistics.median(decode_samples)
        prefill_s = statistics.median(prefill_times[name])
        if name in floors:
            print(f"{name:<14} {decode_s * 1e6:>10.1f} {'':>8} {'':>6}   {prefill_s * 1e6:>14.1f}")
            results.record(f"{name.replace(' ', '_')}_decode_us", round(decode_s * 1e6, 1), "us")
            results.record(
                f"{name.replace(' ', '_')}_prefill_512_us", round(prefill_s * 1e6, 1), "us"
            )
            continue
        added_decode, added_prefill = decode_s - base_decode, prefill_s - base_prefill
        print(
            f"{name:<14} {decode_s * 1e6:>10.1f} {added_decode * 1e6:>8.1f} "
            f"{decode_s / base_decode:>6.2f}   {prefill_s * 1e6:>14.1f} "
            f"{added_prefill * 1e6:>9.1f} {prefill_s / base_prefill:>6.2f}"
        )
        key = name.replace("-", "_").replace(" ", "_")
        results.record(f"{key}_decode_us", round(decode_s * 1e6, 1), "us")
        results.record(f"{key}_prefill_512_us", round(prefill_s * 1e6, 1), "us")
        if name != "in-process":
            results.record(f"{key}_decode_added_us", round(added_decode * 1e6, 1), "us")
            results.record(f"{key}_prefill_512_ratio", round(prefill_s / base_prefill, 3), "x")
    framed = statistics.median(decode_times["child framed"]) - base_decode
    grpc_added = statistics.median(decode_times["child grpc"]) - base_decode
    print(f"child decode hop: framed adds {framed * 1e6:.1f} us, gRPC {grpc_added * 1e6:.1f} us")
    if grpc_added > 0:
        print(f"framed / gRPC added time: {framed / grpc_added:.2f}")
        results.record("child_framed_over_grpc_added_ratio", round(framed / grpc_added, 3), "x")
    print(
        "target: a remote decode hop adds <= 300 us on loopback. The echo rows are floors on "
        "the same bytes, server in a child process: bare gRPC (no project code) and a framed "
        "unix socket"
    )


# ----------------------------------------------------------------- process-per-shard pipeline


@dataclass(frozen=True)
class PipelineModel:
    name: str
    path: Path
    n_layers: int
    three_way: tuple[tuple[int, int], ...]


def _generated_model(directory: Path, quick: bool) -> PipelineModel:
    from shard_engine_llama import write_tiny_model

    if quick:
        path = directory / "remote-bench-llama-64d-6l-f32.gguf"
        config = write_tiny_model(path, n_layers=6, seed=11)
        name = "generated llama (n_embd 64, 6 layers, F32; --quick)"
        n = config.n_layers
    else:
        # The llama bench's dense model (imported here: shard-engine-llama may be absent).
        from _models import generated_model

        generated = generated_model(directory)
        path, name, n = generated.path, generated.name, generated.n_layers
    third = n // 3
    return PipelineModel(
        name=name,
        path=path,
        n_layers=n,
        three_way=((0, third), (third, n - third), (n - third, n)),
    )


def _gemma3(explicit: str | None) -> PipelineModel | None:
    from shard_engine_api.engine import describe_model, get_plugin_manager, model_store

    candidate = explicit or os.environ.get(MODEL_ENV)
    path = Path(candidate) if candidate else model_store() / "models" / GEMMA3_FILE
    if not path.is_file():
        return None
    described = describe_model(get_plugin_manager(), "llama", str(path))
    return PipelineModel(
        name=f"gemma3-270m ({described.n_layers} layers)",
        path=path,
        n_layers=described.n_layers,
        three_way=((0, 6), (6, 12), (12, 18)),
    )


def _llama_engines(
    model: PipelineModel,
    ranges: Sequence[tuple[int, int]],
    settings: Settings,
    *,
    spawn: bool,
    shared_memory: bool = True,
) -> list[api.ShardEngine]:
    engines: list[api.ShardEngine] = []
    max_context = settings.prompt_tokens + settings.decode_tokens + 8
    try:
        for start, end in ranges:
            options: dict[str, object] = {"n_ubatch": 64}
            if spawn:
                options.update(spawn="llama", env=settings.child_env, shared_memory=shared_memory)
            config = api.LoadConfig(
                shard=api.ShardSpec(
                    model=str(model.path), n_layers=model.n_layers, start=start, end=end
                ),
                max_sessions=1,
                max_context=max(256, max_context),
                max_batch_tokens=max(512, settings.prompt_tokens),
                n_threads=settings.threads,
                options=options,
            )
            engine: api.ShardEngine = RemoteEngine() if spawn else api.load_engine("llama")
            engines.append(engine)
            engine.load(config)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def _rates(
    engines: Sequence[api.ShardEngine], prompt: Sequence[int], decode_tokens: int, epoch: int
) -> tuple[float, float]:
    """Prefill and decode tokens/s of one greedy generation through the project's pipeline."""
    pipeline = api.Pipeline(list(engines))
    result = pipeline.generate(
        list(prompt), decode_tokens, session=api.SessionRef(session_id="bench", epoch=epoch)
    )
    prefill_rate = len(prompt) / (result.prefill_ms / 1000.0)
    decode_rate = 1000.0 / result.decode_ms_median if result.decode_ms_median else 0.0
    return prefill_rate, decode_rate


def bench_pipeline(settings: Settings, model: PipelineModel, results: Results) -> None:
    configurations: dict[str, Callable[[], list[api.ShardEngine]]] = {
        "unsplit, this process": lambda: _llama_engines(
            model, [(0, model.n_layers)], settings, spawn=False
        ),
        "3 shards, this process": lambda: _llama_engines(
            model, model.three_way, settings, spawn=False
        ),
        "3 shards, 3 processes": lambda: _llama_engines(
            model, model.three_way, settings, spawn=True
        ),
        "3 processes, socket only": lambda: _llama_engines(
            model, model.three_way, settings, spawn=True, shared_memory=False
        ),
    }
    loaded = {name: make() for name, make in configurations.items()}
    children = loaded["3 shards, 3 processes"]
    child_threading = [
        engine.server_stats().threading for engine in children if isinstance(engine, RemoteEngine)
    ]
    vocab_size = loaded["unsplit, this process"][0].capabilities().vocab_size
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, min(vocab_size, 4096), size=settings.prompt_tokens)]
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in loaded}
    try:
        for repetition in range(settings.pipeline_repeat):
            names = list(loaded)
            if repetition % 2:
                names.reverse()
            for name in names:
                samples[name].append(
                    _rates(loaded[name], prompt, settings.decode_tokens, repetition + 1)
                )
    finally:
        for engines in loaded.values():
            for engine in engines:
                engine.close()
    splits = " ".join(f"[{s}:{e})" for s, e in model.three_way)
    print(
        f"\nprocess per shard: {model.name}, splits {splits}, prompt {len(prompt)} tokens, "
        f"{settings.decode_tokens} decode steps, {settings.pipeline_repeat} repetitions (medians), "
        f"threads {settings.threads or 'engine default'}, "
        f"child env {settings.child_env or 'inherited'}; threading in force in the children: "
        f"{child_threading[0] if len({str(t) for t in child_threading}) == 1 else child_threading}"
    )
    print(
        f"{'configuration':<24} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'prefill x':>10} {'decode x':>9}   paired x per repetition: prefill, decode "
        "(median [min-max])"
    )
    unsplit = samples[next(iter(samples))]
    baseline: tuple[float, float] | None = None
    for name, values in samples.items():
        prefill = statistics.median(v[0] for v in values)
        decode = statistics.median(v[1] for v in values)
        if baseline is None:
            baseline = (prefill, decode)
        # Each repetition against the unsplit run of the same repetition: the host's speed
        # drifts between repetitions, and a ratio of medians mixes those drifts in.
        paired = [
            [mine[i] / theirs[i] for mine, theirs in zip(values, unsplit, strict=True)]
            for i in (0, 1)
        ]
        print(
            f"{name:<24} {prefill:>14.1f} {decode:>13.1f} {prefill / baseline[0]:>10.3f} "
            f"{decode / baseline[1]:>9.3f}   {_spread(paired[0])}, {_spread(paired[1])}"
        )
        key = name.replace(",", "").replace(" ", "_")
        results.record(f"pipeline_{key}_prefill_tok_s", round(prefill, 1), "tok/s")
        results.record(f"pipeline_{key}_decode_tok_s", round(decode, 1), "tok/s")
        results.record(f"pipeline_{key}_prefill_x", round(prefill / baseline[0], 3), "x")
        results.record(f"pipeline_{key}_decode_x", round(decode / baseline[1], 3), "x")
        for kind, ratios in zip(("prefill", "decode"), paired, strict=True):
            results.record(
                f"pipeline_{key}_{kind}_x_paired", round(statistics.median(ratios), 3), "x"
            )
            results.record(f"pipeline_{key}_{kind}_x_paired_min", round(min(ratios), 3), "x")
            results.record(f"pipeline_{key}_{kind}_x_paired_max", round(max(ratios), 3), "x")
    print("targets: >= 0.97 of unsplit prefill, >= 0.95 of unsplit decode")


def _spread(ratios: Sequence[float]) -> str:
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"


# ----------------------------------------------------------------- main


def _environment_override(text: str) -> tuple[str, str | None]:
    key, separator, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"bad --child-env {text!r}; use KEY=VALUE or KEY=")
    return key, value if separator and value else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    add_size_options(parser, quick="tiny sizes: checks that it runs")
    parser.add_argument(
        "--repeat",
        type=int,
        help="repetitions (default 5 for the hops and 9 for the pipeline, quick 1)",
    )
    parser.add_argument("--hidden", type=int, help="fake hidden size (default 2048, quick 64)")
    parser.add_argument("--model", help=f"gemma3-270m GGUF (default: ${MODEL_ENV} or the store)")
    parser.add_argument("--threads", type=int, default=0, help="threads per shard (0 = default)")
    parser.add_argument(
        "--child-env",
        type=_environment_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment override of the spawned children (KEY= removes KEY); repeatable",
    )
    parser.add_argument("--skip-llama", action="store_true", help="only the per-hop overhead")
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.echo_server:
        _serve_echo(args.echo_server)
        return 0
    # This benchmark has one small size: --smoke (which `nox -s bench -- --smoke` hands to every
    # benchmark) is --quick, and either run is recorded as a smoke run.
    args.quick = args.quick or args.smoke
    # No figure of this benchmark is in the README yet: its section records how it ran.
    results = Results(args.results, "remote", mode="smoke" if args.quick else "full")
    settings = Settings(
        quick=args.quick,
        hidden=args.hidden or (64 if args.quick else 2048),
        repeat=args.repeat or (1 if args.quick else 5),
        hop_calls=10 if args.quick else 200,
        prompt_tokens=16 if args.quick else 128,
        decode_tokens=4 if args.quick else 64,
        threads=args.threads,
        child_env=dict(args.child_env),
        # The pipeline's ratios move by more than their gaps between runs on a noisy host:
        # more repetitions, each compared with the unsplit run of the same repetition.
        pipeline_repeat=args.repeat or (1 if args.quick else 9),
    )
    bench_hops(settings, results)
    if args.skip_llama:
        results.save()
        return 0
    try:
        import shard_engine_llama  # noqa: F401
    except ImportError:
        print("\nprocess per shard: skipped (shard-engine-llama is not installed)")
        results.save()
        return 0
    model = None if args.quick else _gemma3(args.model)
    results.record("pipeline_gemma3", model is not None)
    with tempfile.TemporaryDirectory(prefix="remote-bench-") as directory:
        bench_pipeline(settings, model or _generated_model(Path(directory), args.quick), results)
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
