"""Instructions per decoded token of the llama engine against raw llama.cpp (immune to load).

    python benchmarks/llama_profile.py [--model GGUF --ranges 0:6,6:12,12:18] [--steps N]

Runs, under ``valgrind --tool=callgrind`` with one thread, the same greedy decode four ways:

* ``raw``: llama-cpp-python's raw batch API (``llama_batch`` + ``llama_decode`` + a view of the
  logits) with the context settings the engine uses, no callbacks;
* ``engine``: the model unsplit through the ShardEngine API (one engine, the API's pipeline);
* ``3-way``: the same split into shards in one process (native llama.cpp callbacks);
* ``3-way python callbacks``: the split with ``native_callbacks=False``.

Phases are separated by ``os.getppid()``, on which callgrind dumps its counters
(``--dump-before=getppid``, as ``decode_profile.py`` does), so one run yields one count per
phase (``_callgrind``). Without ``--model`` it generates the benchmarks' F16 model (n_embd 512,
8 layers; ``_models``).
Counts say where instructions go, not time: a ``rep movsb`` copy counts per chunk, and thread
wake-ups cost time without instructions; timings come from ``llama_bench.py`` on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
from _callgrind import callgrind_dump_totals
from _models import GENERATED_THREE_WAY, generated_model
from _raw_llama import N_UBATCH, RawLlama

from shard_engine_api import LoadConfig, Pipeline, SessionRef, ShardSpec
from shard_engine_llama import LlamaEngine, split_model

WARMUP = 2
PROMPT_TOKENS = 16
PHASES = ("raw", "engine", "3-way", "3-way python callbacks")


def _config(spec: ShardSpec, native: bool) -> LoadConfig:
    options: dict[str, object] = {"n_ubatch": N_UBATCH, "self_test": False}
    if not native:
        options["native_callbacks"] = False
    return LoadConfig(
        shard=spec,
        n_threads=1,
        max_sessions=1,
        max_context=512,
        max_batch_tokens=N_UBATCH,
        kv_budget_tokens=512,
        options=options,
    )


def _raw_stepper(model: Path) -> Callable[[int, Sequence[int]], int]:
    """Greedy steps through llama.cpp itself (the benchmark's raw baseline), one thread."""
    raw = RawLlama(model, max_sessions=1, max_context=512, n_threads=1)

    def step(pos: int, tokens: Sequence[int]) -> int:
        rows = [(0, pos + index, token) for index, token in enumerate(tokens)]
        return raw.prefill_rows(rows, outputs=[len(tokens) - 1])[0]

    return step


def _engine_stepper(
    specs: Sequence[ShardSpec], native: bool
) -> Callable[[int, Sequence[int]], int]:
    engines = []
    for spec in specs:
        engine = LlamaEngine()
        engine.load(_config(spec, native))
        engines.append(engine)
    pipeline = Pipeline(engines, request_prefix="profile")
    session = SessionRef(session_id="profile", epoch=1)

    def step(pos: int, tokens: Sequence[int]) -> int:
        result = pipeline.step(session, pos, tokens, decode=len(tokens) == 1)
        return int(np.argmax(result.logits.array()[-1]))

    return step


def run_phases(model: Path, n_layers: int, ranges: list[tuple[int, int]], steps: int) -> None:
    """Child body: every phase prefills, warms up, then decodes ``steps`` tokens between two
    getppid() markers."""
    manifest = split_model(model, ranges, Path(tempfile.mkdtemp(prefix="llama-profile-")))
    split = [
        ShardSpec(model=str(manifest.shard_path(i)), n_layers=n_layers, start=s, end=e)
        for i, (s, e) in enumerate(ranges)
    ]
    full = [ShardSpec(model=str(model), n_layers=n_layers, start=0, end=n_layers)]
    # Engines first: their first load silences llama.cpp's log for the raw context too.
    steppers: dict[str, Callable[[int, Sequence[int]], int]] = {
        "engine": _engine_stepper(full, True),
        "3-way": _engine_stepper(split, True),
        "3-way python callbacks": _engine_stepper(split, False),
    }
    steppers = {"raw": _raw_stepper(model), **steppers}
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, size=PROMPT_TOKENS)]
    for name in PHASES:
        step = steppers[name]
        token = step(0, prompt)
        pos = len(prompt)
        for _ in range(WARMUP):
            token = step(pos, [token])
            pos += 1
        os.getppid()
        for _ in range(steps):
            token = step(pos, [token])
            pos += 1
        os.getppid()


def _ranges(text: str) -> list[tuple[int, int]]:
    pairs = [part.split(":") for part in text.split(",") if part]
    return [(int(a), int(b)) for a, b in pairs]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="GGUF to profile (default: a generated F16 model)")
    parser.add_argument("--layers", type=int, help="its layer count (default: read from it)")
    parser.add_argument(
        "--ranges",
        default=",".join(f"{start}:{end}" for start, end in GENERATED_THREE_WAY),
        help="the 3-way split",
    )
    parser.add_argument("--steps", type=int, default=5, help="decode steps per phase")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        run_phases(Path(spec["model"]), spec["layers"], _ranges(spec["ranges"]), spec["steps"])
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing measured", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llama-profile-") as scratch:
        directory = Path(scratch)
        if args.model:
            model = Path(args.model)
            from shard_engine_llama import inspect_gguf

            layers = args.layers or inspect_gguf(model).n_layers
        else:
            generated = generated_model(directory)
            model, layers = generated.path, generated.n_layers
        child = msgspec.json.encode(
            {"model": str(model), "layers": layers, "ranges": args.ranges, "steps": args.steps}
        ).decode()
        totals = callgrind_dump_totals([__file__, "--child", child], directory)
    # Dump 2k + 1 is phase k's warm-up and load, dump 2k + 2 the phase itself.
    per_token = {name: totals[2 * index + 1] / args.steps for index, name in enumerate(PHASES)}
    raw, unsplit = per_token["raw"], per_token["engine"]
    print(f"llama decode profile: {model.name}, 3-way {args.ranges}, {args.steps} steps, 1 thread")
    print(f"{'phase':<24} {'instructions/token':>19} {'raw/phase':>10} {'unsplit/phase':>14}")
    for name, count in per_token.items():
        print(f"{name:<24} {count:>19,.0f} {raw / count:>10.3f} {unsplit / count:>14.3f}")
    extra = (per_token["3-way"] - unsplit) / 2
    print(f"3-way: {extra:,.0f} instructions per token per extra shard")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
