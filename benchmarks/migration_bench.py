"""Moving a live session vs rebuilding it: the llama engine's session export/import against
replaying the prompt through a 3-shard pipeline.

    python benchmarks/migration_bench.py [--quick | --smoke] [--model GEMMA3.gguf]
        [--repeat N] [--results PATH]

On gemma3-270m when it is present (SHARD_ENGINE_LLAMA_MODEL or the model store's
``models/gemma-3-270m-q4_k_m.gguf``), else on a generated model (n_embd 512, 8 layers, F16);
the output says which. For a session of 128, 512 and 2,048 committed positions:

* replay: prefilling those positions through the 3-shard pipeline (what a replacement worker
  needs today: the prompt through every shard up to its own);
* move: for each shard, ``export_session`` on the worker that holds it, the snapshot encoded
  and decoded by the wire codec (integrity verified), ``import_session`` on a fresh engine of
  the same shard; reported per shard and for the whole pipeline, with the state's bytes per
  position;
* the ratio move / replay, one shard (the worker that moves) and all three, against the
  target (moving 2,048 positions costs at most 0.2x their replay).

Medians of N runs, replay and move interleaved in each run. After the measured runs the moved
pipeline decodes one step next to the unmoved one and the logits are compared bit for bit.
Targets are printed next to the numbers, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from _models import GENERATED_THREE_WAY, MODEL_ENV, find_gemma3, generated_model
from _results import Results, add_results_option, add_size_options, run_mode

from shard_engine_api import (
    ExportSessionRequest,
    ImportSessionRequest,
    LoadConfig,
    Pipeline,
    ReleaseRequest,
    SessionRef,
    SessionSnapshot,
    ShardSpec,
)
from shard_engine_api.wire import Codec
from shard_engine_llama import LlamaEngine, inspect_gguf

N_THREADS: Final = 2
TARGET_RATIO: Final = 0.2


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]
    repeat: int


FULL: Final = Settings(lengths=(128, 512, 2048), repeat=5)
QUICK: Final = Settings(lengths=(128, 512, 2048), repeat=2)
SMOKE: Final = Settings(lengths=(8, 32), repeat=1)


@dataclass(frozen=True)
class BenchModel:
    name: str
    key: str
    path: Path
    n_layers: int
    ranges: list[tuple[int, int]]
    vocab: int
    store: Path | None


def generated(directory: Path) -> BenchModel:
    """The generated model every llama benchmark measures (``_models``)."""
    model = generated_model(directory)
    return BenchModel(
        name=model.name,
        key="generated",
        path=model.path,
        n_layers=model.n_layers,
        ranges=list(GENERATED_THREE_WAY),
        vocab=model.vocab,
        store=directory / "store",
    )


def gemma3_model(path: Path) -> BenchModel:
    info = inspect_gguf(path)
    return BenchModel(
        name=f"gemma3-270m Q4_K_M ({info.n_layers} layers, n_embd {info.n_embd})",
        key="gemma3",
        path=path,
        n_layers=info.n_layers,
        ranges=[(0, 6), (6, 12), (12, 18)],
        vocab=info.vocab_size,
        store=None,
    )


def _load(model: BenchModel, start: int, end: int, max_context: int) -> LlamaEngine:
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model.path), n_layers=model.n_layers, start=start, end=end),
            max_sessions=2,
            max_context=max_context,
            max_batch_tokens=512,
            kv_budget_tokens=4 * max_context,
            n_threads=N_THREADS,
            options={
                "n_ubatch": 512,
                "self_test": False,
                **({} if model.store is None else {"model_store": str(model.store)}),
            },
        )
    )
    return engine


def _prompt(model: BenchModel, n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return [int(token) for token in rng.integers(259, model.vocab, size=n)]


def _replay(pipeline: Pipeline, session: SessionRef, prompt: Sequence[int]) -> float:
    started = time.perf_counter()
    for start in range(0, len(prompt), 512):
        pipeline.prefill(session, start, prompt[start : start + 512])
    return (time.perf_counter() - started) * 1000.0


@dataclass
class MoveTimes:
    export_ms: float
    wire_ms: float
    import_ms: float
    state_bytes: int

    @property
    def total_ms(self) -> float:
        return self.export_ms + self.wire_ms + self.import_ms


def _move(source: LlamaEngine, target: LlamaEngine, session: SessionRef, run: int) -> MoveTimes:
    caps = target.capabilities()
    codec = Codec(expected_fingerprint=caps.model_fingerprint, expected_layer=caps.shard.start)
    started = time.perf_counter()
    snapshot = source.export_session(
        ExportSessionRequest(request_id=f"export-{run}", session=session)
    )
    exported = time.perf_counter()
    received = codec.decode_message(codec.encode(snapshot))
    assert isinstance(received, SessionSnapshot)
    transferred = time.perf_counter()
    target.import_session(ImportSessionRequest(request_id=f"import-{run}", snapshot=received))
    imported = time.perf_counter()
    return MoveTimes(
        export_ms=(exported - started) * 1000.0,
        wire_ms=(transferred - exported) * 1000.0,
        import_ms=(imported - transferred) * 1000.0,
        state_bytes=snapshot.state_bytes,
    )


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _mark(ratio: float) -> str:
    return "meets" if ratio <= TARGET_RATIO else "misses"


def bench(model: BenchModel, settings: Settings, results: Results) -> None:
    max_context = max(settings.lengths) + 1
    sources = [_load(model, start, end, max_context) for start, end in model.ranges]
    targets = [_load(model, start, end, max_context) for start, end in model.ranges]
    roles = [engine.capabilities().role for engine in sources]
    try:
        pipeline = Pipeline(sources)
        print(
            f"\n## {model.name}: 3 shards {model.ranges}, {N_THREADS} threads, median of "
            f"{settings.repeat}"
        )
        print(
            f"{'positions':>9} {'replay ms':>10} {'move ms':>9} {'export':>8} {'wire':>8} "
            f"{'import':>8} {'bytes/pos':>10} {'ratio':>6}  shard"
        )
        # One untimed round: llama.cpp builds its graphs and buffers on first use.
        warm = SessionRef(session_id="bench-warm-up", epoch=1)
        _replay(pipeline, warm, _prompt(model, 8))
        for source, target in zip(sources, targets, strict=True):
            _move(source, target, warm, -1)
        for engine in (*sources, *targets):
            engine.release(ReleaseRequest(session=warm))
        for length in settings.lengths:
            prompt = _prompt(model, length)
            replays: list[float] = []
            moves: list[list[MoveTimes]] = [[] for _ in sources]
            for run in range(settings.repeat):
                session = SessionRef(session_id=f"bench-{length}-{run}", epoch=1)
                replays.append(_replay(pipeline, session, prompt))
                for index, (source, target) in enumerate(zip(sources, targets, strict=True)):
                    moves[index].append(_move(source, target, session, run))
                # Every session is released except the last one, whose continuation is checked.
                if (length, run) != (settings.lengths[-1], settings.repeat - 1):
                    for engine in (*sources, *targets):
                        engine.release(ReleaseRequest(session=session))
            replay = _median(replays)
            key = f"{model.key}_{length}"
            results.record(f"{key}_replay_ms", round(replay, 2), "ms")
            whole = 0.0
            whole_bytes = 0
            for index, times in enumerate(moves):
                total = _median([t.total_ms for t in times])
                whole += total
                whole_bytes += times[0].state_bytes
                per_position = times[0].state_bytes / length
                print(
                    f"{length:>9} {replay:>10.1f} {total:>9.2f} "
                    f"{_median([t.export_ms for t in times]):>8.2f} "
                    f"{_median([t.wire_ms for t in times]):>8.2f} "
                    f"{_median([t.import_ms for t in times]):>8.2f} {per_position:>10.0f} "
                    f"{total / replay:>6.3f}  {roles[index]} {model.ranges[index]}"
                )
                results.record(f"{key}_{roles[index]}_move_ms", round(total, 3), "ms")
                results.record(f"{key}_{roles[index]}_bytes_per_position", round(per_position), "B")
            tail = _median([t.total_ms for t in moves[-1]])
            print(
                f"{length:>9} {replay:>10.1f} {whole:>9.2f} {'':>8} {'':>8} {'':>8} "
                f"{whole_bytes / length:>10.0f} {whole / replay:>6.3f}  all 3 shards; "
                f"target <= {TARGET_RATIO} for one shard: {_mark(tail / replay)} "
                f"({tail / replay:.3f}, tail)"
            )
            results.record(f"{key}_all_move_ms", round(whole, 3), "ms")
            results.record(f"{key}_all_bytes_per_position", round(whole_bytes / length), "B")
            results.record(f"{key}_tail_ratio", round(tail / replay, 4))
            results.record(f"{key}_all_ratio", round(whole / replay, 4))
        _check_continuation(sources, targets, settings, model)
    finally:
        for engine in (*sources, *targets):
            engine.close()


def _check_continuation(
    sources: Sequence[LlamaEngine],
    targets: Sequence[LlamaEngine],
    settings: Settings,
    model: BenchModel,
) -> None:
    length = settings.lengths[-1]
    session = SessionRef(session_id=f"bench-{length}-{settings.repeat - 1}", epoch=1)
    token = _prompt(model, 1)[0]
    unmoved = Pipeline(sources).decode(session, length, token).array()
    moved = Pipeline(targets).decode(session, length, token).array()
    print(
        f"continuation after the move equals the unmoved pipeline: {np.array_equal(unmoved, moved)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(parser, quick="fewer repetitions")
    parser.add_argument("--repeat", type=int, help="runs per length (median reported)")
    parser.add_argument("--model", help=f"gemma3-270m GGUF (default: ${MODEL_ENV} or the store)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.repeat:
        settings = Settings(lengths=settings.lengths, repeat=args.repeat)
    mode = run_mode(args)
    gemma3 = find_gemma3(args.model)
    results = Results(args.results, "migration", mode=mode, repeat=settings.repeat)
    print(f"# session migration vs replay ({mode} run, {os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="shard-engine-migration-") as scratch:
        if gemma3 is None:
            print(
                f"gemma3-270m not found (set {MODEL_ENV} or run `nox -s certify`): "
                "measuring the generated model"
            )
            model = generated(Path(scratch))
        else:
            model = gemma3_model(gemma3)
        results.run["model"] = model.key
        bench(model, settings, results)
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
