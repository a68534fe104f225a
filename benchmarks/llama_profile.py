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
phase. Without ``--model`` it generates the benchmark's F16 model (n_embd 512, 8 layers).
Counts say where instructions go, not time: a ``rep movsb`` copy counts per chunk, and thread
wake-ups cost time without instructions; timings come from ``llama_bench.py`` on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from shard_engine_api import LoadConfig, Pipeline, SessionRef, ShardSpec
from shard_engine_llama import LlamaEngine, split_model, write_tiny_model

WARMUP = 2
PROMPT_TOKENS = 16
PHASES = ("raw", "engine", "3-way", "3-way python callbacks")


def _config(spec: ShardSpec, native: bool) -> LoadConfig:
    options: dict[str, object] = {"n_ubatch": 512, "self_test": False}
    if not native:
        options["native_callbacks"] = False
    return LoadConfig(
        shard=spec,
        n_threads=1,
        max_sessions=1,
        max_context=512,
        max_batch_tokens=512,
        kv_budget_tokens=512,
        options=options,
    )


class _Raw:
    """Greedy decode through llama-cpp-python's raw API, the engine's context settings."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self._llama = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(os.fsencode(path), model_params)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 1024
        params.n_seq_max = 2
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_threads = 1
        params.n_threads_batch = 1
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = 0
        params.type_v = 0
        params.swa_full = True
        params.kv_unified = False
        params.no_perf = True
        params.n_outputs_max = 512
        self._context = llama_cpp.llama_init_from_model(self._model, params)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)

    def step(self, pos: int, tokens: Sequence[int]) -> int:
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        if self._llama.llama_decode(self._context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        pointer = self._llama.llama_get_logits_ith(self._context, -1)
        return int(np.argmax(np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))))


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
    steppers = {"raw": _Raw(model).step, **steppers}
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


def _totals(directory: Path) -> list[int]:
    dumps = sorted(directory.glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
    totals: list[int] = []
    for dump in dumps:
        for line in dump.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                totals.append(int(line.split()[1]))
                break
    return totals


def _ranges(text: str) -> list[tuple[int, int]]:
    pairs = [part.split(":") for part in text.split(",") if part]
    return [(int(a), int(b)) for a, b in pairs]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="GGUF to profile (default: a generated F16 model)")
    parser.add_argument("--layers", type=int, help="its layer count (default: read from it)")
    parser.add_argument("--ranges", default="0:3,3:6,6:8", help="the 3-way split")
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
            model = directory / "profile-llama-512d-8l-f16.gguf"
            write_tiny_model(
                model,
                n_layers=8,
                n_embd=512,
                n_head=8,
                n_head_kv=4,
                n_ff=1536,
                vocab=4096,
                dtype="f16",
                seed=11,
                context_length=4096,
            )
            layers = 8
        child = msgspec.json.encode(
            {"model": str(model), "layers": layers, "ranges": args.ranges, "steps": args.steps}
        ).decode()
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--dump-before=getppid",
                f"--callgrind-out-file={directory / 'callgrind.out'}",
                sys.executable,
                __file__,
                "--child",
                child,
            ],
            check=True,
            capture_output=True,
        )
        totals = _totals(directory)
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
