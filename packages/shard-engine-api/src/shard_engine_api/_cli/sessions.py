"""``shard-engine run --sessions N``: N sessions through one validated pipeline over the wire at
once (``Pipeline.generate_many``), each verified against its own run alone on the same shards."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence

import numpy as np
import pluggy

from shard_engine_api._cli.common import isolated, one_line, print_json, print_shards
from shard_engine_api._hookspecs import EngineDescription, ModelFixture, Tokenizer
from shard_engine_api._pipeline import Pipeline, load_pipeline
from shard_engine_api._plugins import engine_description
from shard_engine_api._sampling import Sampling
from shard_engine_api._stages import GenerationRequest, ManyGenerationResult
from shard_engine_api._types import SessionRef
from shard_engine_api._validation import ValidatingEngine

__all__ = ["command_run_sessions"]


def _requests(
    args: argparse.Namespace,
    encode: Callable[[str], list[int]] | None,
    prompt: Sequence[int],
    prompt_text: str | None,
) -> tuple[list[GenerationRequest], list[str | None]]:
    """Session i of 1..N prompts with '<prompt> #i' (or the same ids) and seed --seed + i - 1."""
    count = int(args.sessions)
    texts: list[str | None] = [None] * count
    prompts: list[tuple[int, ...]] = [tuple(prompt)] * count
    if prompt_text is not None and encode is not None:
        suffixed = [f"{prompt_text} #{number}" for number in range(1, count + 1)]
        prompts = [tuple(encode(text)) for text in suffixed]
        texts = list(suffixed)
    requests = [
        GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=args.max_new_tokens,
            sampling=Sampling(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + number,
            ),
            stop_tokens=tuple(args.stop_tokens or ()),
            session=SessionRef(session_id=f"cli-run-{number + 1}", epoch=1),
        )
        for number, ids in enumerate(prompts)
    ]
    return requests, texts


def local_groups(shards: int, threads: int, cores: int | None = None) -> int:
    """How many groups of sessions ``run --sessions`` keeps in flight when every shard runs on
    this machine: as many shards compute at once as the cores hold without oversubscription
    (``cores // threads`` per shard, ``threads`` 0 meaning every core, as the llama engine
    does), at least one and at most one per shard. One group on 2 cores: 3 shards of
    gemma3-270m computing at once with 2 threads each ran 8 sessions at 0.21 of llama.cpp's
    batch(8), one group at 0.85 (``benchmarks/concurrency_bench.py``); llama.cpp's threads
    spin at barriers, so a shared core costs far more than its share."""
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    per_shard = threads if threads > 0 else available
    return max(1, min(shards, available // max(1, per_shard)))


def command_run_sessions(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    description: EngineDescription,
    found_tokenizer: Tokenizer | None,
    encode: Callable[[str], list[int]] | None,
    prompt: Sequence[int],
    prompt_text: str | None,
) -> int:
    """``run --sessions N``: N sessions through one validated pipeline over the wire at once;
    each is verified against its own run alone on the same shards (unless --no-verify)."""
    requests, texts = _requests(args, encode, prompt, prompt_text)
    count = len(requests)
    engine = description
    if args.isolation == "process":
        engine = engine_description("remote", manager=manager)
        fixture = isolated(manager, args, fixture)
    longest = max(len(request.prompt_ids) for request in requests)
    context = max(256, longest + args.max_new_tokens + 1)
    pipeline = load_pipeline(
        engine.factory,
        fixture,
        ranges,
        wire=True,
        wrap=ValidatingEngine,
        boundary_dtype=args.boundary_dtype,
        n_threads=args.threads,
        max_sessions=count,
        max_context=context,
        kv_budget_tokens=context * count,
    )
    groups = args.groups or local_groups(len(ranges), args.threads)
    with pipeline:
        many = pipeline.generate_many(
            requests, args.max_new_tokens, tokenizer=found_tokenizer, groups=groups
        )
        verification = (
            _verify_sessions(pipeline, requests, many, found_tokenizer, args.tolerance)
            if args.verify
            else None
        )
    sessions: list[dict[str, object]] = [
        {
            "session": entry.session.session_id,
            "prompt": text,
            "prompt_ids": list(entry.result.prompt_ids),
            "token_ids": list(entry.result.token_ids),
            "text": entry.result.text,
            "finish_reason": entry.result.finish_reason,
            "error": entry.error,
            "first_token_ms": entry.first_token_ms,
            "token_ms_median": statistics.median(entry.token_ms) if entry.token_ms else 0.0,
        }
        for entry, text in zip(many.sessions, texts, strict=True)
    ]
    if args.json:
        print_json(
            {
                "engine": args.engine,
                "evidence": description.evidence,
                "model": fixture.model,
                "n_layers": fixture.n_layers,
                "shards": [list(pair) for pair in ranges],
                "chat": args.chat,
                "groups": groups,
                "sessions": sessions,
                "generated_tokens": many.generated_tokens,
                "wall_ms": many.wall_ms,
                "tokens_per_s": many.tokens_per_s,
                "wire_bytes": many.wire_bytes,
                "stages": many.stages,
                "verify": verification,
            }
        )
    else:
        _print_sessions(args, fixture, ranges, many, sessions, verification, groups)
    failed = bool(many.failed()) or (verification is not None and not verification["passed"])
    return 1 if failed else 0


def _print_sessions(
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    many: ManyGenerationResult,
    sessions: Sequence[dict[str, object]],
    verification: dict[str, object] | None,
    groups: int,
) -> None:
    print_shards(args, fixture, ranges)
    for entry, session in zip(many.sessions, sessions, strict=True):
        said = f"{session['prompt']!r} " if session["prompt"] is not None else ""
        if entry.error is not None:
            ended = f"ERROR {entry.error.code}: {one_line(entry.error.message)}"
        else:
            ended = f"({entry.result.finish_reason})"
        generated = (
            repr(entry.result.text)
            if entry.result.text is not None
            else str(list(entry.result.token_ids))
        )
        print(f"session {entry.index + 1}: {said}-> {generated} {ended}")
    print(
        f"aggregate: {len(many.sessions)} sessions in {groups} group(s), "
        f"{many.generated_tokens} tokens in {many.wall_ms:.1f} ms: "
        f"{many.tokens_per_s:.1f} tokens/s"
    )
    for stage in many.stages:
        mean = stage.items / stage.calls if stage.calls else 0.0
        busy = stage.busy_ms / many.wall_ms if many.wall_ms > 0 else 0.0
        print(
            f"  {stage.shard:<34} {stage.calls:>5} calls, mean batch {mean:.1f} (max "
            f"{stage.max_batch}), busy {busy:.0%}"
        )
    if verification is not None:
        print(
            f"verify each session against its run alone: "
            f"{'PASS' if verification['passed'] else 'FAIL'} "
            f"({verification['equal']}/{len(sessions)} equal, {verification['bitwise']} bitwise, "
            f"max |delta logits| = {verification['max_abs_logit_difference']:.3g})"
        )


def _verify_sessions(
    pipeline: Pipeline,
    requests: Sequence[GenerationRequest],
    many: ManyGenerationResult,
    found_tokenizer: Tokenizer | None,
    tolerance: float,
) -> dict[str, object]:
    """Each session against its own run alone on the same shards: the same tokens, and logits
    bitwise or within ``tolerance`` and what the shards declare for batching."""
    determinism = pipeline.engines[0].capabilities().determinism
    declared = determinism.tolerance_for("logits")
    equal = bitwise = 0
    worst = 0.0
    passed = True
    for request, entry in zip(requests, many.sessions, strict=True):
        alone = pipeline.generate(
            request.prompt_ids,
            request.max_new_tokens,
            sampling=request.sampling,
            stop_tokens=request.stop_tokens,
            tokenizer=found_tokenizer,
        )
        if entry.error is not None:
            passed = False
            continue
        same = alone.token_ids == entry.result.token_ids
        steps = min(len(alone.step_logits), len(entry.result.step_logits))
        expected, got = alone.logits()[:steps], entry.result.logits()[:steps]
        difference = float(np.max(np.abs(expected - got))) if steps else 0.0
        bound = tolerance
        if not determinism.batch_invariant and steps:
            bound = max(
                bound, declared.absolute + declared.relative * float(np.max(np.abs(expected)))
            )
        equal += same
        bitwise += alone.step_logits == entry.result.step_logits
        worst = max(worst, difference)
        passed = passed and same and difference <= bound
    return {
        "passed": passed,
        "equal": equal,
        "bitwise": bitwise,
        "max_abs_logit_difference": worst,
        "sessions": len(requests),
    }
