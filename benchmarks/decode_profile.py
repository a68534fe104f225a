"""Where the time of one decode step through the API goes, in instructions (immune to load).

    python benchmarks/decode_profile.py [--steps N] [--wall] [--evict MIB]

Runs each phase below N times under ``valgrind --tool=callgrind`` and prints instructions per
call. Phases are separated by ``os.getppid()``, on which callgrind is told to dump its counters
(``--dump-before=getppid``), so one run yields one count per phase. With ``--wall`` (or without
valgrind) it prints wall-clock microseconds per call instead: only comparable side by side
within one run on a quiet machine.

With ``--evict MIB`` each call is timed alone, warm and again right after MIB MiB have been
streamed through the caches, and both medians are printed. That is what a call costs after a
forward has pushed its code and data out of the caches, as every decode through llama.cpp does.

The phases split a ``ValidatingEngine(FakeEngine())`` decode (the figure ``fake_bench.py``
reports) into the wrapper, the core (``EngineCore`` over a backend that returns a fixed
array) and the fake's own arithmetic, and time the pieces those are built from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from _callgrind import callgrind_dump_totals

import shard_engine_api as api
from shard_engine_api.engine import (
    CancelToken,
    EngineCore,
    ForwardItem,
    ModelInfo,
    OutputMode,
    build_result,
)
from shard_engine_api.wire import payload_checksum
from shard_engine_fake import FakeEngine

VOCAB = 512
WARMUP = 20


class NullEngine(EngineCore):
    """A backend that does no work: what is left is the core's own cost."""

    engine_name: ClassVar[str] = "null"

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self._hidden = hidden
        self._logits = np.zeros((1, VOCAB), np.float32)
        self._states = np.zeros((1, hidden), np.float32)

    def _open(self, config: api.LoadConfig) -> ModelInfo:
        return ModelInfo(
            engine_version="0",
            evidence="fixture",
            model_fingerprint="null",
            hidden_size=self._hidden,
            vocab_size=VOCAB,
            determinism=api.Determinism(deterministic=True, split_exact=True),
        )

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        return self._states if output == "hidden" else self._logits

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        pass

    def _commit(self, slot: int) -> None:
        pass

    def _drop(self, slot: int) -> None:
        pass

    def _close(self) -> None:
        pass


def _config(model: str, start: int = 0, end: int = 6) -> api.LoadConfig:
    return api.LoadConfig(
        shard=api.ShardSpec(model=model, n_layers=6, start=start, end=end),
        max_sessions=4,
        max_context=1 << 22,
        max_batch_tokens=4,
        kv_budget_tokens=1 << 24,
    )


def _decoder(engine: api.ShardEngine, session_id: str) -> Callable[[], None]:
    """One decode step per call, on a session prefilled with one token."""
    token = api.TokenInput(token_ids=(5,))
    ref = api.SessionRef(session_id=session_id, epoch=1)
    engine.prefill(api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=token))
    position = [1]

    def step() -> None:
        engine.decode(api.DecodeRequest(request_id="d", session=ref, pos=position[0], inputs=token))
        position[0] += 1

    return step


def _bundle_decoder(hidden: int, steps: int) -> Callable[[], None]:
    """One decode step of a tail shard [3, 6) per call: what a received bundle costs."""
    engine = api.ValidatingEngine(FakeEngine())
    engine.load(_config(f"fake:hidden={hidden}", 3, 6))
    caps = engine.capabilities()
    ref = api.SessionRef(session_id="tail", epoch=1)
    rows = np.ones((1, hidden), np.float32)

    def bundle(pos: int) -> api.BoundaryBundle:
        return api.BoundaryBundle.from_array(
            rows, session=ref, first_pos=pos, layer=3, model_fingerprint=caps.model_fingerprint
        )

    engine.prefill(api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=bundle(0)))
    # Bundles are made outside the timed calls, as a receiving worker gets them.
    bundles = [bundle(pos) for pos in range(1, steps + WARMUP + 2)]
    position = [1]

    def step() -> None:
        pos = position[0]
        engine.decode(
            api.DecodeRequest(request_id="d", session=ref, pos=pos, inputs=bundles[pos - 1])
        )
        position[0] += 1

    return step


def phases(hidden: int, steps: int) -> dict[str, Callable[[], object]]:
    """Name -> one call, for every phase (engines are loaded here, outside any phase)."""
    validating = api.ValidatingEngine(FakeEngine())
    validating.load(_config(f"fake:hidden={hidden}"))
    fake = FakeEngine()
    fake.load(_config(f"fake:hidden={hidden}"))
    null = NullEngine(hidden)
    null.load(_config("null"))
    validating_null = api.ValidatingEngine(NullEngine(hidden))
    validating_null.load(_config("null"))
    model = fake._model
    assert model is not None
    caches: list[list[int]] = [[] for _ in range(6)]
    state = model.embed(np.array([5], np.int32))[0]
    logits = model.logits([state])
    payload = logits.data.cast("B")
    ref = api.SessionRef(session_id="x", epoch=1)
    caps = fake.capabilities()
    return {
        "ValidatingEngine(FakeEngine) decode": _decoder(validating, "a"),
        "FakeEngine decode": _decoder(fake, "b"),
        "EngineCore decode, null backend": _decoder(null, "c"),
        "ValidatingEngine(null) decode": _decoder(validating_null, "d"),
        "tail [3,6) decode of a bundle": _bundle_decoder(hidden, steps),
        "DecodeRequest(...)": lambda: api.DecodeRequest(
            request_id="d", session=ref, pos=3, inputs=api.TokenInput(token_ids=(5,))
        ),
        "CancelToken(...)": lambda: CancelToken("d", ("x",)),
        "fake: run_row (all layers)": lambda: model.run_row(state, caches),
        "fake: logits (one row)": lambda: model.logits([state]),
        "LogitsResult.from_array": lambda: api.LogitsResult.from_array(
            logits, request_id="d", session=ref, first_pos=3, evidence="fixture"
        ),
        # What the core builds instead: one copy, checksum, finiteness check and mark.
        "core: logits result (build_result)": lambda: build_result(
            caps,
            "f32",
            logits,
            "last",
            request_id="d",
            session=ref,
            start_pos=3,
            n_tokens=1,
            timings=api.Timings(),
        ),
        f"payload_checksum ({len(payload)} B)": lambda: payload_checksum(payload),
        "np.isfinite(logits).all()": lambda: bool(np.isfinite(logits).all()),
        "empty call (loop overhead)": lambda: None,
    }


def run_phases(steps: int, hidden: int, wall: bool) -> list[tuple[str, float]]:
    """Run every phase; with ``wall`` return microseconds per call, else only the markers
    (the counts are read from callgrind's dumps by the parent)."""
    table = phases(hidden, steps)
    results: list[tuple[str, float]] = []
    for name, call in table.items():
        for _ in range(WARMUP):
            call()
        os.getppid()
        started = time.perf_counter()
        for _ in range(steps):
            call()
        elapsed = time.perf_counter() - started
        os.getppid()
        results.append((name, elapsed / steps * 1e6))
    return results


def run_evicted(steps: int, hidden: int, mebibytes: int) -> list[tuple[str, float, float]]:
    """Median microseconds per call of every phase, warm and right after ``mebibytes`` MiB
    were streamed through the caches (the eviction itself is not timed)."""
    table = phases(hidden, 2 * steps)  # two calls a step
    flood = np.ones(mebibytes * (1 << 20) // 8)
    results: list[tuple[str, float, float]] = []
    for name, call in table.items():
        for _ in range(WARMUP):
            call()
        warm: list[float] = []
        evicted: list[float] = []
        for _ in range(steps):
            started = time.perf_counter()
            call()
            warm.append(time.perf_counter() - started)
            flood.sum()
            started = time.perf_counter()
            call()
            evicted.append(time.perf_counter() - started)
        results.append((name, statistics.median(warm) * 1e6, statistics.median(evicted) * 1e6))
    return results


def under_callgrind(steps: int, hidden: int) -> list[tuple[str, float]]:
    """Instructions per call of every phase, from one callgrind run of this script."""
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as scratch:
        directory = Path(scratch)
        names_file = directory / "names.json"
        child = ["--child", str(names_file), "--steps", str(steps), "--hidden", str(hidden)]
        totals = callgrind_dump_totals([__file__, *child], directory)
        names: list[str] = json.loads(names_file.read_text(encoding="utf-8"))
    # Dump 2k is the warm-up before phase k, dump 2k+1 the phase itself.
    return [(name, totals[2 * index + 1] / steps) for index, name in enumerate(names)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="calls per phase")
    parser.add_argument("--hidden", type=int, default=64, help="fake model hidden size")
    parser.add_argument("--wall", action="store_true", help="wall-clock microseconds instead")
    parser.add_argument(
        "--evict",
        type=int,
        metavar="MIB",
        help="time each call warm and after MIB MiB streamed through the caches",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.evict is not None:
        if args.evict < 1:
            parser.error("--evict takes a positive number of MiB")
        evicted = run_evicted(args.steps, args.hidden, args.evict)
        print(f"decode profile, fake hidden {args.hidden}, {args.steps} calls per phase")
        print(f"{'phase':<40} {'warm us':>10} {f'after {args.evict} MiB us':>18} {'ratio':>7}")
        for name, warm, cold in evicted:
            print(f"{name:<40} {warm:>10,.1f} {cold:>18,.1f} {cold / warm:>7.1f}")
        return 0
    if args.child:
        results = run_phases(args.steps, args.hidden, wall=False)
        Path(args.child).write_text(json.dumps([name for name, _ in results]), encoding="utf-8")
        return 0
    if args.wall or shutil.which("valgrind") is None:
        unit = "us/call (wall clock)"
        results = run_phases(args.steps, args.hidden, wall=True)
    else:
        unit = "instructions/call"
        results = under_callgrind(args.steps, args.hidden)
    print(f"decode profile, fake hidden {args.hidden}, {args.steps} calls per phase")
    print(f"{'phase':<40} {unit:>24}")
    for name, value in results:
        print(f"{name:<40} {value:>24,.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
