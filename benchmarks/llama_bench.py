"""Benchmarks of the llama engine: split vs unsplit, batched decode, shard memory, cancellation.

    python benchmarks/llama_bench.py [--quick | --smoke] [--model GEMMA3.gguf] [--repeat N]
        [--skip-gemma3] [--skip-smollm2] [--skip-moe] [--sections raw,split,...]
        [--spin-counts 300000,passive]
        [--results PATH]

Measured side by side in one process, on a generated model large enough for compute to dominate
(n_embd 512, 8 layers, F16), on gemma3-270m when it is present (SHARD_ENGINE_LLAMA_MODEL or the
model store's ``models/gemma-3-270m-q4_k_m.gguf``), on a generated mixture-of-experts model
(qwen3moe of the same width and depth, as much feed-forward work per token; measured against
llama.cpp, split in one process and batched, under the ``moe`` keys) and on SmolLM2-135M, a
llama-family model, when ``nox -s certify`` has put it in the model store (against llama.cpp
and split, under the ``smollm2`` keys). ``_models`` makes them:

* the engine against llama.cpp itself: the same file decoded through llama-cpp-python's raw
  batch API (``llama_batch`` + ``llama_decode`` + a view of the logits, same threads, KV type,
  context and batch sizes, no callbacks) vs the engine unsplit through the API, single-session
  and ``batch_sessions``-session batched; next to it the 3-way split in one process, with the
  native llama.cpp callbacks and with the Python ones, so the per-shard overhead is a ratio
  in the same run;
* prefill and decode tokens/s, unsplit vs 2-way vs 3-way, through the ShardEngine API, in one
  process and with one process per shard (``_process_shard``: each engine in its own process
  behind pipes speaking the wire codec; also the unsplit model alone behind the same pipes,
  which isolates the transport); the configurations are interleaved within every repetition
  (in rotating order) so that machine noise hits all of them alike, and medians are reported.
  A breakdown separates the time spent inside llama.cpp (the engines' ``compute_ms``) from the
  per-hop overhead (Python, and pipes plus codec for the process configurations).
  ``--spin-counts`` adds process-per-shard configurations whose workers run with another
  ``GOMP_SPINCOUNT`` (``passive``: ``OMP_WAIT_POLICY=PASSIVE``), side by side;
* the CPU time a process burns in the 50 ms after a decode returns, per spin count (OpenMP
  threads that keep spinning take the cores from the next shard; see
  ``shard_engine_llama._threading``);
* decode time on a head shard when one thread, two threads taking turns or a 4-thread pool
  make the calls, with the engine's compute threads and with every ``llama_decode`` on its
  caller's thread (``SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0``), each in a fresh process;
* 8 sessions decoded with one ``decode_batch`` per step vs 8 single decodes per step, every
  configuration and mode interleaved; the batched rate of a split next to the unsplit one;
* peak RSS of every shard vs the full model, each in a fresh subprocess, above the RSS of a
  process that imports everything but loads no model;
* the latency from ``cancel()`` to the ``Cancelled`` exception during a long prefill.

Targets are printed next to the numbers, never asserted: a benchmark that fails on a noisy
machine teaches nothing, the numbers and the breakdown do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
from _models import (
    GENERATED_THREE_WAY,
    MODEL_ENV,
    GeneratedModel,
    find_gemma3,
    find_smollm2,
    generated_model,
    generated_moe_model,
)
from _process_shard import ProcessShard
from _raw_llama import N_UBATCH, RawLlama
from _results import Results, add_results_option, add_size_options, run_mode

from shard_engine_api import (
    BoundaryBundle,
    Cancelled,
    CancelRequest,
    DecodeRequest,
    LoadConfig,
    Pipeline,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardEngine,
    ShardInput,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.engine import model_store
from shard_engine_api.wire import payload_checksum
from shard_engine_llama import (
    COMPUTE_THREADS_ENV,
    DEFAULT_SPIN_COUNT,
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    LlamaEngine,
    Manifest,
    inspect_gguf,
    split_model,
    threading_report,
)
from shard_engine_llama._abi import BatchItem, ContextSettings, ShardRuntime

N_THREADS: Final = 2

TARGET_PREFILL_RATIO: Final = 0.97
TARGET_DECODE_RATIO: Final = 0.93
TARGET_BATCH_SPEEDUP: Final = 3.0
TARGET_RAW_RATIO: Final = 0.97

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
SMOKE: Final = Settings(
    repeat=1,
    prompt_tokens=8,
    decode_tokens=2,
    batch_sessions=2,
    batch_prompt_tokens=4,
    batch_steps=2,
    batch_repeat=1,
    cancel_repeat=1,
    cancel_prompt_tokens=256,
)
"""Only proves every section runs to completion: its figures are not measurements."""
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


@dataclass(frozen=True)
class Recorder:
    """Records figures of one model under a key prefix ("generated", "gemma3")."""

    results: Results
    prefix: str

    def record(self, key: str, value: float | int | str | bool, unit: str = "") -> None:
        self.results.record(f"{self.prefix}_{key}", value, unit)


def _ratio_mark(value: float, target: float) -> str:
    return "ok" if value >= target else "MISSED"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------------------------
# Driving engines through the API
# --------------------------------------------------------------------------------------------


Driver = Pipeline
"""The API's pipeline driver: ``step`` keeps each hop's wall time and the engines' own compute
time apart; ``decode_batch`` is one ``decode_batch`` per shard."""


def _load_config(
    spec: ShardSpec,
    *,
    max_sessions: int,
    max_context: int,
    max_batch_tokens: int = N_UBATCH,
    self_test: bool = True,
) -> LoadConfig:
    options: dict[str, object] = {"n_ubatch": min(N_UBATCH, max_batch_tokens)}
    if not self_test:
        # The parent process already proved the split recipe on this machine.
        options["self_test"] = False
    return LoadConfig(
        shard=spec,
        n_threads=N_THREADS,
        max_sessions=max_sessions,
        max_context=max_context,
        max_batch_tokens=max_batch_tokens,
        kv_budget_tokens=max_sessions * max_context,
        options=options,
    )


def _load_engine(
    spec: ShardSpec,
    *,
    max_sessions: int,
    max_context: int,
    max_batch_tokens: int = N_UBATCH,
    native_callbacks: bool = True,
) -> LlamaEngine:
    config = _load_config(
        spec,
        max_sessions=max_sessions,
        max_context=max_context,
        max_batch_tokens=max_batch_tokens,
    )
    if not native_callbacks:
        config = msgspec.structs.replace(
            config, options={**config.options, "native_callbacks": False}
        )
    engine = LlamaEngine()
    engine.load(config)
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
    model: BenchModel,
    ranges: Ranges,
    *,
    max_sessions: int,
    max_context: int,
    processes: Mapping[str, str | None] | None = None,
    native_callbacks: bool = True,
) -> Driver:
    """In-process engines, or with ``processes`` (environment overrides for the children)
    one child process per shard."""
    engines: list[ShardEngine] = []
    try:
        for spec in _shard_specs(model, ranges):
            if processes is None:
                engines.append(
                    _load_engine(
                        spec,
                        max_sessions=max_sessions,
                        max_context=max_context,
                        native_callbacks=native_callbacks,
                    )
                )
            else:
                config = _load_config(
                    spec, max_sessions=max_sessions, max_context=max_context, self_test=False
                )
                engines.append(ProcessShard("llama", config, env=processes))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return Driver(engines, request_prefix="bench")


def _spin_env(spin: str) -> dict[str, str | None]:
    """Child environment for a spin-count setting: a number, or "passive"."""
    if spin == "passive":
        return {SPIN_COUNT_ENV: None, WAIT_POLICY_ENV: "PASSIVE"}
    return {SPIN_COUNT_ENV: spin, WAIT_POLICY_ENV: None}


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_").replace("__", "_")


# --------------------------------------------------------------------------------------------
# 0. the engine against raw llama.cpp
# --------------------------------------------------------------------------------------------


def _raw_sequential(
    raw: RawLlama, prompt: Sequence[int], n_decode: int
) -> tuple[float, tuple[int, ...]]:
    raw.clear()
    (token,) = raw.prefill_rows(
        [(0, pos, t) for pos, t in enumerate(prompt)], outputs=[len(prompt) - 1]
    )
    generated = [token]
    pos = len(prompt)
    started = time.perf_counter()
    for _ in range(n_decode):
        (token,) = raw.decode([(0, pos, token)])
        generated.append(token)
        pos += 1
    elapsed = time.perf_counter() - started
    return n_decode / elapsed, tuple(generated)


def _engine_sequential(
    driver: Driver, prompt: Sequence[int], n_decode: int, session_id: str
) -> tuple[float, tuple[int, ...]]:
    session = SessionRef(session_id=session_id, epoch=1)
    token = int(np.argmax(driver.prefill(session, 0, prompt).array()[-1]))
    generated = [token]
    pos = len(prompt)
    started = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(driver.decode(session, pos, token).array()[-1]))
        generated.append(token)
        pos += 1
    elapsed = time.perf_counter() - started
    driver.release(session)
    return n_decode / elapsed, tuple(generated)


def _raw_batched(
    raw: RawLlama, prompts: Sequence[Sequence[int]], n_steps: int
) -> tuple[float, tuple[int, ...]]:
    raw.clear()
    tokens = [
        raw.prefill_rows([(seq, pos, t) for pos, t in enumerate(prompt)], [len(prompt) - 1])[0]
        for seq, prompt in enumerate(prompts)
    ]
    pos = len(prompts[0])
    started = time.perf_counter()
    for _ in range(n_steps):
        tokens = raw.decode([(seq, pos, token) for seq, token in enumerate(tokens)])
        pos += 1
    elapsed = time.perf_counter() - started
    return len(prompts) * n_steps / elapsed, tuple(tokens)


def _engine_batched(
    driver: Driver, prompts: Sequence[Sequence[int]], n_steps: int, tag: str
) -> tuple[float, tuple[int, ...]]:
    sessions = [SessionRef(session_id=f"{tag}-{i}", epoch=1) for i in range(len(prompts))]
    tokens = [
        int(np.argmax(driver.prefill(session, 0, prompt).array()[-1]))
        for session, prompt in zip(sessions, prompts, strict=True)
    ]
    pos = len(prompts[0])
    started = time.perf_counter()
    for _ in range(n_steps):
        results = driver.decode_batch(sessions, [pos] * len(sessions), tokens)
        tokens = [int(np.argmax(result.array()[-1])) for result in results]
        pos += 1
    elapsed = time.perf_counter() - started
    for session in sessions:
        driver.release(session)
    return len(prompts) * n_steps / elapsed, tuple(tokens)


Lockstep = dict[str, list[float]]
"""Per-step seconds of each side of a lockstep comparison (:data:`LOCKSTEP_SIDES`)."""
LOCKSTEP_SIDES: Final = ("raw", "runtime", "engine")


def _new_lockstep() -> Lockstep:
    return {side: [] for side in LOCKSTEP_SIDES}


def _turns(step: int) -> tuple[str, ...]:
    """The sides in the order they run at ``step``: rotating, so none is always first."""
    shift = step % len(LOCKSTEP_SIDES)
    return LOCKSTEP_SIDES[shift:] + LOCKSTEP_SIDES[:shift]


def _bare_runtime(model: BenchModel, *, max_sessions: int, max_context: int) -> ShardRuntime:
    """The engine's own llama.cpp layer (``ShardRuntime``: the batch, the compute thread, the
    logits copied and hashed) over the whole model, with no contract above it: the engine
    minus this is what sessions, admission, commit and results cost."""
    settings = ContextSettings(
        n_ctx=max_context * (max_sessions + 1),
        n_seq_max=max_sessions + 1,
        n_threads=N_THREADS,
        n_batch=N_UBATCH,
        n_ubatch=N_UBATCH,
    )
    return ShardRuntime(model.path, settings=settings)


def _greedy_rows(rows: np.ndarray) -> list[int]:
    return [int(np.argmax(row)) for row in rows]


def _lockstep_single(
    raw: RawLlama,
    runtime: ShardRuntime,
    driver: Driver,
    prompt: Sequence[int],
    n_decode: int,
    session_id: str,
) -> tuple[Lockstep, bool]:
    """Raw llama.cpp, the engine's bare runtime and the engine decoding the same prompt in
    lockstep: each step of one right before or after the same step of the others (the order
    rotating), on the same compute thread, so the machine's noise falls on all alike.
    Per-step seconds of each, and whether their greedy tokens agreed throughout."""
    raw.clear()
    runtime.seq_rm(0)
    (raw_token,) = raw.prefill_rows(
        [(0, pos, t) for pos, t in enumerate(prompt)], outputs=[len(prompt) - 1]
    )
    (runtime_token,) = _greedy_rows(runtime.run(0, 0, tokens=list(prompt)))
    session = SessionRef(session_id=session_id, epoch=1)
    engine_token = int(np.argmax(driver.prefill(session, 0, prompt).array()[-1]))
    same = raw_token == runtime_token == engine_token
    times = _new_lockstep()
    pos = len(prompt)
    for step in range(n_decode):
        for side in _turns(step):
            started = time.perf_counter()
            if side == "raw":
                (raw_token,) = raw.decode([(0, pos, raw_token)])
            elif side == "runtime":
                (runtime_token,) = _greedy_rows(runtime.run(0, pos, tokens=[runtime_token]))
            else:
                engine_token = int(np.argmax(driver.decode(session, pos, engine_token).array()[-1]))
            times[side].append(time.perf_counter() - started)
        same = same and raw_token == runtime_token == engine_token
        pos += 1
    driver.release(session)
    return times, same


def _lockstep_batched(
    raw: RawLlama,
    runtime: ShardRuntime,
    driver: Driver,
    prompts: Sequence[Sequence[int]],
    n_steps: int,
    tag: str,
) -> tuple[Lockstep, bool]:
    """:func:`_lockstep_single` for one batched step of every session."""
    raw.clear()
    raw_tokens = [
        raw.prefill_rows([(seq, pos, t) for pos, t in enumerate(prompt)], [len(prompt) - 1])[0]
        for seq, prompt in enumerate(prompts)
    ]
    runtime_tokens = []
    for seq, prompt in enumerate(prompts):
        runtime.seq_rm(seq)
        runtime_tokens += _greedy_rows(runtime.run(seq, 0, tokens=list(prompt)))
    sessions = [SessionRef(session_id=f"{tag}-{i}", epoch=1) for i in range(len(prompts))]
    engine_tokens = [
        int(np.argmax(driver.prefill(session, 0, prompt).array()[-1]))
        for session, prompt in zip(sessions, prompts, strict=True)
    ]
    same = raw_tokens == runtime_tokens == engine_tokens
    times = _new_lockstep()
    pos = len(prompts[0])
    for step in range(n_steps):
        for side in _turns(step):
            started = time.perf_counter()
            if side == "raw":
                raw_tokens = raw.decode([(seq, pos, token) for seq, token in enumerate(raw_tokens)])
            elif side == "runtime":
                items = [BatchItem(seq, pos, token=t) for seq, t in enumerate(runtime_tokens)]
                runtime_tokens = _greedy_rows(runtime.run_batch(items))
            else:
                results = driver.decode_batch(sessions, [pos] * len(sessions), engine_tokens)
                engine_tokens = [int(np.argmax(result.array()[-1])) for result in results]
            times[side].append(time.perf_counter() - started)
        same = same and raw_tokens == runtime_tokens == engine_tokens
        pos += 1
    for session in sessions:
        driver.release(session)
    return times, same


def _print_lockstep(label: str, times: Lockstep, key: str, results: Recorder) -> None:
    raw_ms, runtime_ms, engine_ms = (_median(times[side]) * 1e3 for side in LOCKSTEP_SIDES)
    ratio = raw_ms / engine_ms
    results.record(f"{key}_raw_step_ms", round(raw_ms, 4), "ms")
    results.record(f"{key}_runtime_step_ms", round(runtime_ms, 4), "ms")
    results.record(f"{key}_engine_step_ms", round(engine_ms, 4), "ms")
    results.record(f"{key}_runtime_of_raw", round(raw_ms / runtime_ms, 3), "x")
    results.record(f"{key}_of_raw", round(ratio, 3), "x")
    print(
        f"{label}, in lockstep ({len(times['raw'])} steps each): raw {raw_ms:.3f} ms, the "
        f"engine's bare runtime {runtime_ms:.3f} ms ({raw_ms / runtime_ms:.3f} of raw), engine "
        f"{engine_ms:.3f} ms a step (medians), engine at {ratio:.3f} of raw "
        f"({(engine_ms - raw_ms) * 1e3:+.0f} us a step, {(engine_ms - runtime_ms) * 1e3:+.0f} us "
        f"over its runtime)   {_ratio_mark(ratio, TARGET_RAW_RATIO)}"
    )


def _print_spread(
    name: str, engine: Sequence[float], raw: Sequence[float], key: str, results: Recorder
) -> None:
    """The engine-over-raw ratio of each repetition (the two ran back to back in it): how far
    one repetition's ratio lies from the ratio of the medians on this machine."""
    ratios = [e / r for e, r in zip(engine, raw, strict=True)]
    if not ratios:
        return
    low, high = min(ratios), max(ratios)
    results.record(f"{key}_rep_min", round(low, 3), "x")
    results.record(f"{key}_rep_max", round(high, 3), "x")
    print(
        f"{name}: engine/raw of each of the {len(ratios)} repetitions {low:.3f} to {high:.3f} "
        f"(median {_median(ratios):.3f})"
    )


def bench_raw(model: BenchModel, settings: Settings, results: Recorder) -> None:
    n = settings.batch_sessions
    print(
        f"\n## {model.name}: the engine vs raw llama.cpp ({N_THREADS} threads, F32 KV, "
        f"n_ubatch {N_UBATCH}; {settings.decode_tokens} decode steps after a "
        f"{settings.prompt_tokens}-token prompt, and {n} sessions x {settings.batch_steps} "
        f"batched steps; {settings.repeat} interleaved repetitions, medians)"
    )
    prompt = model.prompt_source(settings.prompt_tokens, 0)
    prompts = [model.prompt_source(settings.batch_prompt_tokens, 1 + i) for i in range(n)]
    drivers: dict[str, Driver] = {}
    raws: list[RawLlama] = []
    runtimes: list[ShardRuntime] = []
    try:
        drivers["engine"] = _load_driver(
            model, model.splits["unsplit"], max_sessions=1, max_context=512
        )
        drivers["3-way"] = _load_driver(
            model, model.splits["3-way"], max_sessions=1, max_context=512
        )
        drivers["3-way python callbacks"] = _load_driver(
            model, model.splits["3-way"], max_sessions=1, max_context=512, native_callbacks=False
        )
        drivers["engine batched"] = _load_driver(
            model, model.splits["unsplit"], max_sessions=n, max_context=256
        )
        # After the engines: their first load silenced llama.cpp's log.
        raw_single = RawLlama(model.path, max_sessions=1, max_context=512, n_threads=N_THREADS)
        raws.append(raw_single)
        raw_batch = RawLlama(model.path, max_sessions=n, max_context=256, n_threads=N_THREADS)
        raws.append(raw_batch)
        runtime_single = _bare_runtime(model, max_sessions=1, max_context=512)
        runtimes.append(runtime_single)
        runtime_batch = _bare_runtime(model, max_sessions=n, max_context=256)
        runtimes.append(runtime_batch)
        single: dict[str, list[float]] = {
            "raw": [],
            **{name: [] for name in drivers if name != "engine batched"},
        }
        batched: dict[str, list[float]] = {"raw": [], "engine": []}
        tokens: dict[str, set[tuple[int, ...]]] = {}

        def run(name: str, rep: int) -> None:
            if name == "raw":
                rate, seq = _raw_sequential(raw_single, prompt, settings.decode_tokens)
            elif name == "raw batched":
                rate, seq = _raw_batched(raw_batch, prompts, settings.batch_steps)
            elif name == "engine batched":
                rate, seq = _engine_batched(drivers[name], prompts, settings.batch_steps, f"b{rep}")
            else:
                rate, seq = _engine_sequential(
                    drivers[name], prompt, settings.decode_tokens, f"s{rep}"
                )
            tokens.setdefault(name, set()).add(seq)
            if rep >= 0:
                if name == "raw batched":
                    batched["raw"].append(rate)
                elif name == "engine batched":
                    batched["engine"].append(rate)
                else:
                    single[name].append(rate)

        names = [
            "raw",
            *[name for name in drivers if name != "engine batched"],
            "raw batched",
            "engine batched",
        ]
        for name in names:  # warm-up: compute buffers, weight pages
            run(name, -1)
        for rep in range(settings.repeat):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                run(name, rep)
        # Whole runs above, one configuration after another: a noisy host moves a run's rate
        # by more than the gap measured. The same comparison in lockstep, step by step:
        lockstep = {kind: _new_lockstep() for kind in ("single", "batched")}
        lockstep_same = True
        steps = min(4 * settings.decode_tokens, 512 - settings.prompt_tokens - 1)
        batch_steps = min(4 * settings.batch_steps, 256 - settings.batch_prompt_tokens - 1)
        for rep in range(settings.repeat):
            times, same = _lockstep_single(
                raw_single, runtime_single, drivers["engine"], prompt, steps, f"l{rep}"
            )
            for side, values in times.items():
                lockstep["single"][side].extend(values)
            times, same_batched = _lockstep_batched(
                raw_batch,
                runtime_batch,
                drivers["engine batched"],
                prompts,
                batch_steps,
                f"lb{rep}",
            )
            for side, values in times.items():
                lockstep["batched"][side].extend(values)
            lockstep_same = lockstep_same and same and same_batched
    finally:
        for driver in drivers.values():
            driver.close()
        for raw in raws:
            raw.close()
        for runtime in runtimes:
            runtime.close()
    raw_rate = _median(single["raw"])
    unsplit_rate = _median(single["engine"])
    print(
        f"{'decode':<28} {'tok/s':>9} {'of raw':>7} {'of unsplit':>10}   "
        f"target: engine >= {TARGET_RAW_RATIO} of raw"
    )
    for name, rates in single.items():
        rate = _median(rates)
        verdict = f"   {_ratio_mark(rate / raw_rate, TARGET_RAW_RATIO)}" if name == "engine" else ""
        print(
            f"{name:<28} {rate:>9.1f} {rate / raw_rate:>7.3f} {rate / unsplit_rate:>10.3f}{verdict}"
        )
        key = _slug(name)
        results.record(f"raw_cmp_{key}_decode_tok_s", round(rate, 1), "tokens/s")
        results.record(f"raw_cmp_{key}_of_raw", round(rate / raw_rate, 3), "x")
        results.record(f"raw_cmp_{key}_of_unsplit", round(rate / unsplit_rate, 3), "x")
    _print_spread("engine", single["engine"], single["raw"], "raw_cmp_engine_of_raw", results)
    three_way = _median(single["3-way"])
    per_shard_ms = (1000.0 / three_way - 1000.0 / unsplit_rate) / 2
    results.record("raw_cmp_3way_extra_ms_per_extra_shard", round(per_shard_ms, 3), "ms")
    print(f"3-way in one process costs {per_shard_ms:+.3f} ms per token per extra shard")
    raw_b, engine_b = _median(batched["raw"]), _median(batched["engine"])
    results.record("raw_cmp_batched_raw_tok_s", round(raw_b, 1), "tokens/s")
    results.record("raw_cmp_batched_engine_tok_s", round(engine_b, 1), "tokens/s")
    results.record("raw_cmp_batched_of_raw", round(engine_b / raw_b, 3), "x")
    print(
        f"{n} sessions batched: raw {raw_b:.1f} tok/s, engine {engine_b:.1f} tok/s, "
        f"{engine_b / raw_b:.3f} of raw   {_ratio_mark(engine_b / raw_b, TARGET_RAW_RATIO)}"
    )
    label = f"{n} sessions batched"
    _print_spread(label, batched["engine"], batched["raw"], "raw_cmp_batched_of_raw", results)
    _print_lockstep("decode", lockstep["single"], "raw_cmp_lockstep", results)
    _print_lockstep(label, lockstep["batched"], "raw_cmp_lockstep_batched", results)
    results.record("raw_cmp_lockstep_tokens_identical", lockstep_same)
    print(
        "greedy tokens identical in lockstep (raw, runtime and engine, single and batched): "
        f"{lockstep_same}"
    )
    same = (
        len(tokens["raw"] | tokens["engine"] | tokens["3-way"] | tokens["3-way python callbacks"])
        == 1
    )
    same_batched = len(tokens["raw batched"] | tokens["engine batched"]) == 1
    identical = same and same_batched
    results.record("raw_cmp_greedy_tokens_identical", identical)
    print(f"greedy tokens identical, raw vs engine (single and batched) vs 3-way: {identical}")


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
    step = driver.step(session, 0, prompt)
    logits, wall_ms, compute_ms = step.logits, step.wall_ms, step.compute_ms
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
        step = driver.step(session, pos, [token], decode=True)
        logits, wall_ms, compute_ms = step.logits, step.wall_ms, step.compute_ms
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


def _split_configs(
    model: BenchModel, spin_counts: Sequence[str], processes: bool
) -> dict[str, tuple[Ranges, Mapping[str, str | None] | None]]:
    """Configuration name -> (ranges, child environment or None for in-process); without
    ``processes`` the in-process ones only."""
    three_way = model.splits["3-way"]
    configs: dict[str, tuple[Ranges, Mapping[str, str | None] | None]] = {
        name: (ranges, None) for name, ranges in model.splits.items()
    }
    if not processes:
        return configs
    # The children inherit this process's environment, where importing shard_engine_llama
    # put the default spin count (or the user's own).
    configs["unsplit/proc"] = (model.splits["unsplit"], {})
    configs["3-way/proc"] = (three_way, {})
    for spin in spin_counts:
        configs[f"3-way/proc spin={spin}"] = (three_way, _spin_env(spin))
    return configs


def bench_split(
    model: BenchModel,
    settings: Settings,
    results: Recorder,
    spin_counts: Sequence[str],
    *,
    processes: bool = True,
) -> None:
    print(
        f"\n## {model.name}: unsplit vs split (through the API, {N_THREADS} threads, "
        f"n_ubatch {N_UBATCH}, prompt {settings.prompt_tokens} tokens, "
        f"{settings.decode_tokens} decode steps, {settings.repeat} interleaved repetitions)"
    )
    if processes:
        print(
            "'/proc' = one process per shard behind pipes and the wire codec (default checks); "
            f"{SPIN_COUNT_ENV}={os.environ.get(SPIN_COUNT_ENV)} in this process and its "
            "children unless the name says otherwise"
        )
    configs = _split_configs(model, spin_counts, processes)
    drivers: dict[str, Driver] = {}
    try:
        for name, (ranges, child_env) in configs.items():
            drivers[name] = _load_driver(
                model, ranges, max_sessions=1, max_context=512, processes=child_env
            )
        samples = {name: SplitSamples() for name in drivers}
        prompt = model.prompt_source(settings.prompt_tokens, 0)
        names = list(drivers)
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
    in_process_decode = _median(samples["3-way"].decode_tok_s)
    print(
        f"{'config':<24} {'shards':<22} {'prefill tok/s':>13} {'ratio':>6} "
        f"{'decode tok/s':>13} {'ratio':>6}   targets: prefill >= {TARGET_PREFILL_RATIO}, "
        f"decode >= {TARGET_DECODE_RATIO}"
    )
    for name in names:
        s = samples[name]
        prefill = _median(s.prefill_tok_s)
        decode = _median(s.decode_tok_s)
        shards = " ".join(f"{a}:{b}" for a, b in configs[name][0])
        verdict = ""
        if name != names[0]:
            verdict = (
                f"  prefill {_ratio_mark(prefill / base_prefill, TARGET_PREFILL_RATIO)}, "
                f"decode {_ratio_mark(decode / base_decode, TARGET_DECODE_RATIO)}"
            )
        if name.startswith("3-way/proc"):
            verdict += f"; {decode / in_process_decode:.3f} of 3-way in one process"
            results.record(
                f"{_slug(name)}_decode_over_in_process", round(decode / in_process_decode, 3), "x"
            )
        key = _slug(name)
        results.record(f"{key}_prefill_tok_s", round(prefill, 1), "tokens/s")
        results.record(f"{key}_decode_tok_s", round(decode, 1), "tokens/s")
        results.record(f"{key}_prefill_ratio", round(prefill / base_prefill, 3), "x")
        results.record(f"{key}_decode_ratio", round(decode / base_decode, 3), "x")
        print(
            f"{name:<24} {shards:<22} {prefill:>13.1f} {prefill / base_prefill:>6.3f} "
            f"{decode:>13.1f} {decode / base_decode:>6.3f}{verdict}"
        )
    print(
        "where the time goes (medians; compute = inside llama.cpp as the engines report it, "
        "overhead = wall - compute = the API/Python side of every hop, plus pipes and codec "
        "for /proc):"
    )
    print(
        f"{'config':<24} {'prefill compute ms':>18} {'prefill overhead ms':>19} "
        f"{'decode compute ms':>17} {'decode overhead ms':>18} {'overhead/hop ms':>15}"
    )
    for name in names:
        s = samples[name]
        hops = len(configs[name][0])
        decode_overhead = _median(s.decode_overhead_ms)
        results.record(
            f"{_slug(name)}_decode_overhead_per_hop_ms", round(decode_overhead / hops, 3)
        )
        print(
            f"{name:<24} {_median(s.prefill_compute_ms):>18.2f} "
            f"{_median(s.prefill_overhead_ms):>19.3f} {_median(s.decode_compute_ms):>17.3f} "
            f"{decode_overhead:>18.3f} {decode_overhead / hops:>15.3f}"
        )
    reference = base.tokens[0]
    consistent = all(t == reference for s in samples.values() for t in s.tokens)
    results.record("greedy_tokens_identical", consistent)
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
# 1b. OpenMP spin-wait: what a finished decode leaves running
# --------------------------------------------------------------------------------------------

IDLE_WINDOW_S: Final = 0.05


def _timed_decode(
    engine: LlamaEngine, session: SessionRef, pos: int, token: int, request_id: str
) -> float:
    """One decode of ``token`` at ``pos``; its wall time in ms."""
    started = time.perf_counter()
    engine.decode(
        DecodeRequest(
            request_id=request_id, session=session, pos=pos, inputs=TokenInput(token_ids=(token,))
        )
    )
    return (time.perf_counter() - started) * 1000.0


def _run_child(flag: str, spec: Mapping[str, object], env: Mapping[str, str]) -> dict[str, float]:
    """Run this benchmark's ``flag`` subprocess body on ``spec`` with ``env``; the JSON object
    it prints last."""
    completed = subprocess.run(
        [sys.executable, __file__, flag, json.dumps(spec)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(env),
    )
    measured: dict[str, float] = json.loads(completed.stdout.strip().splitlines()[-1])
    return measured


def spin_child(spec_json: str) -> int:
    """Subprocess body: decode on the unsplit model; after each decode returns, measure the
    CPU time the whole process burns while this thread sleeps (spinning OpenMP threads)."""
    spec = json.loads(spec_json)
    engine = _load_engine(
        ShardSpec(model=spec["model"], n_layers=spec["n_layers"], start=0, end=spec["n_layers"]),
        max_sessions=1,
        max_context=512,
    )
    session = SessionRef(session_id="spin", epoch=1)
    prompt = [int(token) for token in spec["prompt"]]
    engine.prefill(
        PrefillRequest(
            request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=tuple(prompt))
        )
    )
    idle_cpu_ms: list[float] = []
    decode_ms: list[float] = []
    for step in range(spec["steps"]):
        decode_ms.append(_timed_decode(engine, session, len(prompt) + step, prompt[-1], f"d{step}"))
        cpu = time.process_time()
        time.sleep(IDLE_WINDOW_S)
        idle_cpu_ms.append((time.process_time() - cpu) * 1000.0)
    engine.close()
    print(json.dumps({"idle_cpu_ms": _median(idle_cpu_ms), "decode_ms": _median(decode_ms)}))
    return 0


def bench_spin(
    model: BenchModel, settings: Settings, results: Recorder, spin_counts: Sequence[str]
) -> None:
    chosen = [str(DEFAULT_SPIN_COUNT), "300000", "passive"]
    chosen += [spin for spin in spin_counts if spin not in chosen]
    print(
        f"\n## {model.name}: OpenMP spin-wait ({N_THREADS} threads, unsplit, fresh process per "
        f"setting, {settings.decode_tokens} decodes): CPU time the process burns in the "
        f"{IDLE_WINDOW_S * 1000:.0f} ms after each decode returns (median)"
    )
    print(f"{'setting':<34} {'idle CPU ms':>11} {'decode ms':>10}")
    for spin in chosen:
        spec = {
            "model": str(model.path),
            "n_layers": model.n_layers,
            "prompt": model.prompt_source(8, 0),
            "steps": max(settings.decode_tokens, 2),
        }
        env = dict(os.environ)
        for key, value in _spin_env(spin).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        measured = _run_child("--spin-child", spec, env)
        label = "OMP_WAIT_POLICY=PASSIVE" if spin == "passive" else f"{SPIN_COUNT_ENV}={spin}"
        if spin == str(DEFAULT_SPIN_COUNT):
            label += " (the default)"
        elif spin == "300000":
            label += " (libgomp's own)"
        key = _slug(f"spin_{spin}")
        results.record(f"{key}_idle_cpu_ms", round(measured["idle_cpu_ms"], 2), "ms")
        results.record(f"{key}_decode_ms", round(measured["decode_ms"], 3), "ms")
        print(f"{label:<34} {measured['idle_cpu_ms']:>11.2f} {measured['decode_ms']:>10.3f}")
    print(
        "idle CPU is stolen from whatever runs next on these cores (the next shard's process); "
        "decode ms is the one engine alone, where spinning helps a little"
    )


# --------------------------------------------------------------------------------------------
# 1c. who calls: one thread, threads taking turns, a thread pool; compute threads on and off
# --------------------------------------------------------------------------------------------

CALLER_PATTERNS: Final = ("one thread", "2 threads taking turns", "pool of 4 threads")


def callers_child(spec_json: str) -> int:
    """Subprocess body: decode on one shard with every call made by one thread, by two threads
    taking turns (a server's readers) or by a 4-thread pool (an asyncio executor, gRPC); prints
    the median decode ms of each pattern."""
    spec = json.loads(spec_json)
    engine = _load_engine(
        ShardSpec(
            model=spec["model"], n_layers=spec["n_layers"], start=spec["start"], end=spec["end"]
        ),
        max_sessions=1,
        max_context=512,
    )
    prompt = [int(token) for token in spec["prompt"]]
    # Warm up (first decodes pay for buffers and page faults) before any pattern is timed.
    warm = SessionRef(session_id="callers-warm-up", epoch=1)
    engine.prefill(
        PrefillRequest(
            request_id="warm", session=warm, start_pos=0, inputs=TokenInput(token_ids=tuple(prompt))
        )
    )
    for step in range(8):
        _timed_decode(engine, warm, len(prompt) + step, prompt[0], f"warm-{step}")
    engine.release(ReleaseRequest(session=warm))
    medians: dict[str, float] = {}
    for index, pattern in enumerate(CALLER_PATTERNS):
        session = SessionRef(session_id=f"callers-{index}", epoch=1)
        engine.prefill(
            PrefillRequest(
                request_id=f"p{index}",
                session=session,
                start_pos=0,
                inputs=TokenInput(token_ids=tuple(prompt)),
            )
        )

        def decode(step: int, session: SessionRef = session, index: int = index) -> float:
            token = prompt[step % len(prompt)]
            return _timed_decode(engine, session, len(prompt) + step, token, f"d{index}-{step}")

        steps = range(spec["steps"])
        if pattern == "one thread":
            times = [decode(step) for step in steps]
        else:
            workers = 2 if pattern.startswith("2") else 4
            pools = [concurrent.futures.ThreadPoolExecutor(max_workers=1) for _ in range(workers)]
            if pattern.startswith("pool"):
                shared = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
                times = [shared.submit(decode, step).result() for step in steps]
                shared.shutdown()
            else:
                times = [pools[step % workers].submit(decode, step).result() for step in steps]
            for pool in pools:
                pool.shutdown()
        engine.release(ReleaseRequest(session=session))
        medians[pattern] = _median(times[2:])
    engine.close()
    print(json.dumps(medians))
    return 0


def bench_callers(model: BenchModel, settings: Settings, results: Recorder) -> None:
    """Decode ms per calling pattern with the engine's compute threads (the default) and with
    every llama_decode on its caller's thread (SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0), each
    configuration in a fresh process, in alternating order over the repetitions."""
    start, end = model.splits["3-way"][0]
    print(
        f"\n## {model.name}: who calls llama_decode (head shard [{start}:{end}), {N_THREADS} "
        f"threads, {max(settings.decode_tokens, 16)} decodes per pattern, fresh process per "
        f"configuration, {settings.repeat} repetitions, medians)"
    )
    spec = {
        "model": str(model.path),
        "n_layers": model.n_layers,
        "start": start,
        "end": end,
        "prompt": model.prompt_source(8, 0),
        "steps": max(settings.decode_tokens, 16),
    }
    policies = {"compute": "1", "caller": "0"}
    samples: dict[str, dict[str, list[float]]] = {
        name: {pattern: [] for pattern in CALLER_PATTERNS} for name in policies
    }
    for repetition in range(settings.repeat):
        names = list(policies)
        names = names[repetition % len(names) :] + names[: repetition % len(names)]
        for name in names:
            measured = _run_child(
                "--callers-child", spec, {**os.environ, COMPUTE_THREADS_ENV: policies[name]}
            )
            for pattern in CALLER_PATTERNS:
                samples[name][pattern].append(float(measured[pattern]))
    print(f"{'pattern':<24} {'compute thread ms':>17} {'caller thread ms':>16} {'ratio':>6}")
    for pattern in CALLER_PATTERNS:
        medians = {name: _median(samples[name][pattern]) for name in policies}
        for name, value in medians.items():
            results.record(_slug(f"callers_{pattern}_{name}_ms"), round(value, 3), "ms")
        print(
            f"{pattern:<24} {medians['compute']:>17.3f} {medians['caller']:>16.3f} "
            f"{medians['caller'] / medians['compute']:>6.2f}"
        )
    print(
        "compute thread (the default): every llama_decode on the lowest idle compute thread; "
        "caller thread: on the calling thread, a libgomp team per calling thread (libgomp "
        "throttles every barrier's spin once the teams' threads outnumber the CPUs). ratio: "
        "caller / compute; one thread shows what the hand-off costs"
    )


# --------------------------------------------------------------------------------------------
# 2. batched vs sequential decode
# --------------------------------------------------------------------------------------------


def bench_batched(
    model: BenchModel, settings: Settings, configs: Sequence[str], results: Recorder
) -> None:
    """Per configuration, ``batch_sessions`` sessions decoded with one ``decode_batch`` per
    step and with single decodes; every (configuration, mode) pair runs once per repetition,
    in rotating order, so that machine noise hits them alike. The first configuration (the
    unsplit model) is what the batched rate of the others is a ratio of."""
    n = settings.batch_sessions
    print(
        f"\n## {model.name}: {n} sessions, one decode_batch per step vs {n} single decodes "
        f"({settings.batch_steps} steps, {settings.batch_repeat} interleaved repetitions)"
    )
    rounds = [(name, mode) for name in configs for mode in ("sequential", "batched")]
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in rounds}
    drivers: dict[str, Driver] = {}
    try:
        for name in configs:
            drivers[name] = _load_driver(model, model.splits[name], max_sessions=n, max_context=256)
        for rep in range(settings.batch_repeat + 1):
            shift = rep % len(rounds)
            for name, mode in rounds[shift:] + rounds[:shift]:
                rate = _batched_round(drivers[name], model, settings, mode, rep)
                if rep > 0:  # repetition 0 is the warm-up
                    rates[name, mode].append(rate)
    finally:
        for driver in drivers.values():
            driver.close()
    base = _median(rates[configs[0], "batched"])
    print(
        f"{'config':<9} {'sequential tok/s':>16} {'batched tok/s':>14} {'speedup':>8} "
        f"{'batched ratio':>13}   target: speedup >= {TARGET_BATCH_SPEEDUP}x"
    )
    for name in configs:
        sequential = _median(rates[name, "sequential"])
        batched = _median(rates[name, "batched"])
        speedup = batched / sequential
        key = _slug(name)
        results.record(f"{key}_batched_speedup", round(speedup, 2), "x")
        results.record(f"{key}_sequential_tok_s", round(sequential, 1), "tokens/s")
        results.record(f"{key}_batched_tok_s", round(batched, 1), "tokens/s")
        results.record(f"{key}_batched_ratio", round(batched / base, 3), "x")
        print(
            f"{name:<9} {sequential:>16.1f} {batched:>14.1f} {speedup:>7.2f}x "
            f"{batched / base:>13.3f}   {_ratio_mark(speedup, TARGET_BATCH_SPEEDUP)}"
        )
    print(f"batched ratio = batched tok/s over {configs[0]}'s batched tok/s in the same run")


def _batched_round(
    driver: Driver, model: BenchModel, settings: Settings, mode: str, rep: int
) -> float:
    n = settings.batch_sessions
    sessions = [SessionRef(session_id=f"{mode}-{rep}-{i}", epoch=1) for i in range(n)]
    tokens: list[int] = []
    for index, session in enumerate(sessions):
        prompt = model.prompt_source(settings.batch_prompt_tokens, 1 + index)
        logits = driver.prefill(session, 0, prompt)
        tokens.append(int(np.argmax(logits.array()[-1])))
    pos = settings.batch_prompt_tokens
    started = time.perf_counter()
    for _ in range(settings.batch_steps):
        if mode == "batched":
            results = driver.decode_batch(sessions, [pos] * n, tokens)
        else:
            results = [
                driver.decode(session, pos, token)
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
                # Resident now, split into private memory (KV cache, compute and output
                # buffers, repacked weights, Python objects) and mapped file pages (weights).
                "rss_anon_kb": _proc_status_kb("RssAnon"),
                "rss_file_kb": _proc_status_kb("RssFile"),
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
        f"{baseline['maxrss_kb'] / 1024:.1f} MiB (VmHWM {baseline['vmhwm_kb'] / 1024:.1f} MiB; "
        f"private {baseline['rss_anon_kb'] / 1024:.1f}, file-backed "
        f"{baseline['rss_file_kb'] / 1024:.1f})"
    )
    print(
        f"{'shard':<10} {'layers':>6} {'file MiB':>9} {'peak MiB':>9} {'VmHWM':>7} "
        f"{'above base':>10} {'RSS frac':>8} {'layer frac':>10} {'file frac':>9} "
        f"{'above - file':>12} {'private+':>8} {'mapped+':>7}"
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
                f"{size / info.file_size:>9.3f} {above - size / 2**20:>12.1f} "
                f"{(measured['rss_anon_kb'] - baseline['rss_anon_kb']) / 1024:>8.1f} "
                f"{(measured['rss_file_kb'] - baseline['rss_file_kb']) / 1024:>7.1f}"
            )
    print(
        "target: shard memory proportional to its layers. RSS follows the shard FILE (llama.cpp "
        "maps and populates every tensor), plus a few MiB of context (KV, compute buffers) per "
        "engine ('above - file'). Non-layer tensors (token_embd, output) take "
        f"{info.non_layer_bytes / 2**20:.1f} of {info.file_size / 2**20:.1f} MiB of the full "
        "model and every head and tail shard carries them (the tail of a tied-embedding model "
        "needs token_embd as its lm-head), so RSS is proportional to layers only above that floor. "
        "'private+' / 'mapped+' = RssAnon / RssFile above the empty process after the prefill: "
        "the engine's own floor (context, KV, buffers) vs the weights it maps"
    )


# --------------------------------------------------------------------------------------------
# 4. cancellation latency
# --------------------------------------------------------------------------------------------


def bench_cancel(model: BenchModel, settings: Settings, results: Recorder) -> None:
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
    results.record("cancel_latency_median_ms", round(_median(latencies), 2), "ms")
    results.record("cancel_latency_max_ms", round(max(latencies, default=float("nan")), 2), "ms")
    results.record("cancel_rolled_back", rolled_back)
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


def generated(model: GeneratedModel, directory: Path) -> BenchModel:
    """A generated model (``_models``), split like every benchmark splits it."""
    return BenchModel(
        name=model.name,
        path=model.path,
        n_layers=model.n_layers,
        splits=_splits(model.n_layers, list(GENERATED_THREE_WAY)),
        shard_dir=directory / "shards" / model.path.stem,
        vocab_size=model.vocab,
        prompt_source=model.prompt,
    )


_PROMPT_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met "
    "to exchange grain, salt and cloth. Over the centuries the market grew into a town, the "
    "town into a city, and the city into the capital of a kingdom whose roads reached the sea. "
)


def gemma3_model(path: Path) -> BenchModel:
    return _real_model(path, "gemma3-270m Q4_K_M", [(0, 6), (6, 12), (12, 18)])


def smollm2_model(path: Path) -> BenchModel:
    return _real_model(path, "SmolLM2-135M-Instruct Q4_1", [(0, 10), (10, 20), (20, 30)])


def _real_model(path: Path, title: str, three_way: Ranges) -> BenchModel:
    """A real GGUF model measured on prompts cut from its own tokenization of a fixed text."""
    from shard_engine_api import load_tokenizer

    info = inspect_gguf(path)
    tokenizer = load_tokenizer("llama", str(path))
    ids = tokenizer.encode(_PROMPT_TEXT * 40) if tokenizer is not None else []
    if not ids:
        raise RuntimeError(f"the llama plugin returned no tokens for {title}")

    def prompt(n: int, seed: int) -> list[int]:
        offset = (seed * 37) % max(len(ids) - n, 1)
        return ids[offset : offset + n]

    store = model_store()
    return BenchModel(
        name=f"{title} ({info.n_layers} layers, n_embd {info.n_embd})",
        path=path,
        n_layers=info.n_layers,
        splits=_splits(info.n_layers, three_way),
        shard_dir=store / "shards" / "bench" / path.stem,
        vocab_size=info.vocab_size,
        prompt_source=prompt,
    )


SECTIONS: Final = ("raw", "split", "spin", "callers", "batched", "memory", "cancel", "hops")
MOE_SECTIONS: Final = frozenset({"raw", "split", "batched"})
"""What the mixture-of-experts model is measured on: the engine against llama.cpp, the split
overhead in one process and batched decode (spin-wait, memory and cancellation do not depend
on the feed-forward, and the dense model measures them)."""
REAL_SECOND_SECTIONS: Final = frozenset({"raw", "split"})
"""What the second real model (SmolLM2-135M, llama family) is measured on: the engine against
llama.cpp and the split overhead; gemma3-270m and the generated models measure the rest."""


def run_sections(
    model: BenchModel,
    settings: Settings,
    sections: set[str],
    results: Recorder,
    *,
    batched: Sequence[str],
    memory: Sequence[str] | None = None,
    spin_counts: Sequence[str] = (),
    processes: bool = True,
) -> None:
    if "raw" in sections:
        bench_raw(model, settings, results)
    if "split" in sections:
        bench_split(model, settings, results, spin_counts, processes=processes)
    if "spin" in sections:
        bench_spin(model, settings, results, spin_counts)
    if "callers" in sections:
        bench_callers(model, settings, results)
    if "batched" in sections:
        bench_batched(model, settings, batched, results)
    if "memory" in sections:
        bench_memory(model, list(model.splits) if memory is None else memory)
    if "cancel" in sections:
        bench_cancel(model, settings, results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(parser, quick="fewer repetitions, shorter runs")
    parser.add_argument("--repeat", type=int, help="repetitions of the split comparison")
    parser.add_argument("--model", help=f"gemma3-270m GGUF (default: ${MODEL_ENV} or the store)")
    parser.add_argument("--skip-gemma3", action="store_true")
    parser.add_argument(
        "--skip-smollm2", action="store_true", help="not SmolLM2-135M even when it is stored"
    )
    parser.add_argument("--skip-moe", action="store_true", help="no mixture-of-experts model")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--spin-counts",
        default="",
        help="comma-separated extra GOMP_SPINCOUNT values (or 'passive') for process-per-shard "
        "configurations side by side",
    )
    add_results_option(parser)
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--spin-child", help=argparse.SUPPRESS)
    parser.add_argument("--callers-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        return rss_child(args.rss_child)
    if args.spin_child:
        return spin_child(args.spin_child)
    if args.callers_child:
        return callers_child(args.callers_child)
    settings = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.repeat:
        settings = dataclasses.replace(settings, repeat=args.repeat)
    spin_counts = [spin for spin in args.spin_counts.split(",") if spin]
    mode = run_mode(args)
    report = threading_report()
    results = Results(
        args.results,
        "llama",
        mode=mode,
        repeat=settings.repeat,
        batch_sessions=settings.batch_sessions,
        n_threads=N_THREADS,
        gomp_spincount=str(report["gomp_spincount"]),
        omp_wait_policy=str(report["omp_wait_policy"]),
        spin_source=str(report["source"]),
    )
    started = time.perf_counter()
    print(f"# llama engine benchmarks ({mode} run, pid {os.getpid()}, {os.cpu_count()} CPUs)")
    print(f"threading: {report}")
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="shard-engine-bench-") as scratch:
        directory = Path(scratch)
        run_sections(
            generated(generated_model(directory), directory),
            settings,
            sections,
            Recorder(results, "generated"),
            batched=["unsplit", "3-way"],
            spin_counts=spin_counts,
        )
        if "hops" in sections:
            bench_hop_costs(512)
        moe_sections = set() if args.skip_moe else sections & MOE_SECTIONS
        results.record("moe_measured", bool(moe_sections))
        if moe_sections:
            run_sections(
                generated(generated_moe_model(directory), directory),
                settings,
                moe_sections,
                Recorder(results, "moe"),
                batched=["unsplit", "2-way", "3-way"],
                processes=False,
            )
        else:
            print(
                "\n## generated mixture-of-experts model: skipped (--skip-moe, or none of "
                f"{','.join(sorted(MOE_SECTIONS))} in --sections)"
            )
    gemma3 = None if args.skip_gemma3 else find_gemma3(args.model)
    results.record("gemma3_measured", gemma3 is not None)
    if gemma3 is None:
        print(
            f"\n## gemma3-270m: skipped ({'--skip-gemma3' if args.skip_gemma3 else 'not found'};"
            f" set {MODEL_ENV} or run `nox -s certify` to assemble it into the model store)"
        )
    else:
        # A 512-token prefill already takes about a second on this model.
        gemma_settings = dataclasses.replace(settings, cancel_prompt_tokens=512)
        run_sections(
            gemma3_model(gemma3),
            gemma_settings,
            sections - {"spin"},
            Recorder(results, "gemma3"),
            batched=["unsplit"],
            memory=["unsplit", "3-way"],
            spin_counts=spin_counts,
        )
    smollm2 = None if args.skip_smollm2 else find_smollm2()
    results.record("smollm2_measured", smollm2 is not None)
    real_sections = sections & REAL_SECOND_SECTIONS
    if smollm2 is None or not real_sections:
        print(
            "\n## SmolLM2-135M: skipped (--skip-smollm2, none of "
            f"{','.join(sorted(REAL_SECOND_SECTIONS))} in --sections, or not in the model store: "
            "`nox -s certify` puts it there)"
        )
    else:
        run_sections(
            smollm2_model(smollm2),
            settings,
            real_sections,
            Recorder(results, "smollm2"),
            batched=["unsplit"],
        )
    total = time.perf_counter() - started
    results.record("total_seconds", round(total))
    print(f"\ntotal {total:.0f} s")
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
