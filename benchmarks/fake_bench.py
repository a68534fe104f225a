"""Throughput of the fake engine through the full API (validation wrapper on).

Run: ``python benchmarks/fake_bench.py [--steps N] [--repeats R]``. Prints a table of medians:
single-session decode steps per second at hidden size 64 and 1024 (full shard), and one
batched decode step over 32 sessions (steps per second and tokens per second per session).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import shard_engine_api as api
from shard_engine_fake import FakeEngine

BATCH_SESSIONS = 32


def _engine(hidden: int) -> api.ValidatingEngine:
    engine = api.ValidatingEngine(FakeEngine())
    engine.load(
        api.LoadConfig(
            shard=api.ShardSpec(model=f"fake:hidden={hidden}", n_layers=6, start=0, end=6),
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


def single_decode(hidden: int, steps: int, repeats: int) -> float:
    """Median decode steps per second of one session."""
    engine = _engine(hidden)
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
    parser.add_argument("--steps", type=int, default=5000, help="decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (median is reported)")
    args = parser.parse_args()
    steps, repeats = args.steps, args.repeats
    print(f"fake engine via ValidatingEngine; medians of {repeats} repeats")
    print(f"{'benchmark':<40} {'hidden':>6} {'steps/s':>12} {'tok/s/session':>14}")
    for hidden in (64, 1024):
        rate = single_decode(hidden, steps if hidden == 64 else steps // 5, repeats)
        print(f"{'single-session decode':<40} {hidden:>6} {rate:>12,.0f} {rate:>14,.0f}")
    for hidden in (64, 1024):
        batch_steps = max(1, steps // (10 if hidden == 64 else 50))
        rate = batched_decode(hidden, batch_steps, repeats)
        label = f"batched decode, {BATCH_SESSIONS} sessions"
        print(f"{label:<40} {hidden:>6} {rate:>12,.0f} {rate:>14,.0f}")
        print(f"{'  (tokens/s over all sessions)':<40} {hidden:>6} {rate * BATCH_SESSIONS:>12,.0f}")
    seconds = conformance_wall_time()
    print(
        f"conformance suite on the fake (shard-engine conformance, whole process): {seconds:.1f} s"
    )
    print("targets: >= 20,000 decode steps/s at hidden 64; conformance < 30 s")


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
