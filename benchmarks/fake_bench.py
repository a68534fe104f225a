"""Throughput of the fake engine through the full API (validation wrapper on, its defaults).

Run: ``python benchmarks/fake_bench.py [--quick | --smoke] [--steps N] [--repeats R]
[--results PATH]``. Prints a table of medians: single-session decode steps per second at
hidden size 64 and 1024 (full shard), the same without the wrapper, a tail shard decoding
received bundles (the received-bundle checks), and one batched decode step over 32 sessions
(steps per second and tokens per second per session); then the wall time of the whole
conformance run on the fake (needs pytest).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
from _results import Results, add_results_option, add_size_options, run_mode

import shard_engine_api as api
from shard_engine_fake import FakeEngine

BATCH_SESSIONS = 32


def _engine(
    hidden: int, *, wrapped: bool = True, start: int = 0
) -> api.ValidatingEngine | FakeEngine:
    engine: api.ValidatingEngine | FakeEngine = (
        api.ValidatingEngine(FakeEngine()) if wrapped else FakeEngine()
    )
    engine.load(
        api.LoadConfig(
            shard=api.ShardSpec(model=f"fake:hidden={hidden}", n_layers=6, start=start, end=6),
            max_sessions=BATCH_SESSIONS,
            max_context=1 << 20,
            max_batch_tokens=BATCH_SESSIONS,
            kv_budget_tokens=1 << 30,
        )
    )
    return engine


def _median_rate(run: Callable[[int], None], steps: int, repeats: int) -> float:
    rates = []
    for repeat in range(repeats):
        started = time.perf_counter()
        run(repeat)
        rates.append(steps / (time.perf_counter() - started))
    return statistics.median(rates)


def single_decode(hidden: int, steps: int, repeats: int, *, wrapped: bool = True) -> float:
    """Median decode steps per second of one session (full shard: token in, logits out)."""
    engine = _engine(hidden, wrapped=wrapped)
    token = api.TokenInput(token_ids=(5,))

    def run(repeat: int) -> None:
        ref = api.SessionRef(session_id="bench", epoch=repeat + 1)
        engine.prefill(api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=token))
        decode = engine.decode
        for pos in range(1, steps + 1):
            decode(api.DecodeRequest(request_id="d", session=ref, pos=pos, inputs=token))

    rate = _median_rate(run, steps, repeats)
    engine.close()
    return rate


def bundle_decode(hidden: int, steps: int, repeats: int) -> float:
    """Median decode steps per second of a tail shard [3, 6) fed one received bundle per
    step: every received bundle is checked (checksum, finiteness) on the engine path."""
    engine = _engine(hidden, start=3)
    fingerprint = engine.capabilities().model_fingerprint
    rows = np.ones((1, hidden), np.float32)

    def run(repeat: int) -> None:
        ref = api.SessionRef(session_id="bench", epoch=repeat + 1)
        # Bundles arrive made: building them is the sender's cost, outside the timing.
        bundles = [
            api.BoundaryBundle.from_array(
                rows, session=ref, first_pos=pos, layer=3, model_fingerprint=fingerprint
            )
            for pos in range(steps + 1)
        ]
        engine.prefill(
            api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=bundles[0])
        )
        started = time.perf_counter()
        decode = engine.decode
        for pos in range(1, steps + 1):
            decode(api.DecodeRequest(request_id="d", session=ref, pos=pos, inputs=bundles[pos]))
        timed[repeat] = time.perf_counter() - started

    timed: dict[int, float] = {}
    for repeat in range(repeats):
        run(repeat)
    engine.close()
    return statistics.median(steps / seconds for seconds in timed.values())


def batched_decode(hidden: int, steps: int, repeats: int) -> float:
    """Median batched decode steps per second over BATCH_SESSIONS sessions."""
    engine = _engine(hidden)
    token = api.TokenInput(token_ids=(5,))

    def run(repeat: int) -> None:
        refs = [
            api.SessionRef(session_id=f"s{index}", epoch=repeat + 1)
            for index in range(BATCH_SESSIONS)
        ]
        for ref in refs:
            engine.prefill(
                api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=token)
            )
        for pos in range(1, steps + 1):
            items = tuple(
                api.DecodeRequest(request_id=f"d{i}", session=ref, pos=pos, inputs=token)
                for i, ref in enumerate(refs)
            )
            engine.decode_batch(api.DecodeBatchRequest(request_id="b", items=items))

    rate = _median_rate(run, steps, repeats)
    engine.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser, quick="1,000 steps, 3 repeats")
    parser.add_argument("--steps", type=int, help="decode steps per repeat (default 5,000)")
    parser.add_argument("--repeats", type=int, help="repeats, median reported (default 5)")
    add_results_option(parser)
    args = parser.parse_args()
    mode = run_mode(args)
    steps = args.steps or {"smoke": 100, "quick": 1000, "full": 5000}[mode]
    repeats = args.repeats or {"smoke": 1, "quick": 3, "full": 5}[mode]
    results = Results(args.results, "fake", mode=mode, steps=steps, repeats=repeats)
    print(f"fake engine via ValidatingEngine (nonfinite='reject'); medians of {repeats} repeats")
    print(f"{'benchmark':<44} {'hidden':>6} {'steps/s':>12} {'tok/s/session':>14}")
    for hidden in (64, 1024):
        n = steps if hidden == 64 else steps // 5
        rate = single_decode(hidden, n, repeats)
        results.record(f"decode_steps_per_s_hidden_{hidden}", round(rate), "steps/s")
        print(f"{'single-session decode':<44} {hidden:>6} {rate:>12,.0f} {rate:>14,.0f}")
    rate = single_decode(64, steps, repeats, wrapped=False)
    results.record(
        "decode_unwrapped_steps_per_s_hidden_64", round(rate), "steps/s", "no ValidatingEngine"
    )
    print(f"{'  same, FakeEngine without the wrapper':<44} {64:>6} {rate:>12,.0f} {rate:>14,.0f}")
    rate = bundle_decode(64, steps, repeats)
    results.record("tail_bundle_decode_steps_per_s_hidden_64", round(rate), "steps/s")
    print(
        f"{'tail shard [3,6) decoding received bundles':<44} {64:>6} {rate:>12,.0f} {rate:>14,.0f}"
    )
    for hidden in (64, 1024):
        batch_steps = max(1, steps // (10 if hidden == 64 else 50))
        rate = batched_decode(hidden, batch_steps, repeats)
        results.record(f"batched_steps_per_s_hidden_{hidden}", round(rate), "steps/s")
        results.record(
            f"batched_tokens_per_s_hidden_{hidden}", round(rate * BATCH_SESSIONS), "tokens/s"
        )
        label = f"batched decode, {BATCH_SESSIONS} sessions"
        print(f"{label:<44} {hidden:>6} {rate:>12,.0f} {rate:>14,.0f}")
        print(f"{'  (tokens/s over all sessions)':<44} {hidden:>6} {rate * BATCH_SESSIONS:>12,.0f}")
    seconds = conformance_wall_time()
    results.record("conformance_seconds", round(seconds, 1), "s")
    print(
        f"conformance suite on the fake (shard-engine conformance, whole process): {seconds:.1f} s"
    )
    print("targets: >= 20,000 decode steps/s at hidden 64 (aim: 50,000); conformance < 30 s")
    results.save()


def conformance_wall_time() -> float:
    """Wall time of the whole conformance run on the fake, as a user runs it (new process)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "shard_engine_api.cli", "conformance", "--engine", "fake"],
            cwd=scratch,
            check=True,
            capture_output=True,
        )
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
