"""``shard-engine run``: one generation through a sharded pipeline, each token printed as it is
generated, then verified against one full, unsplit shard (``--sessions N``: sessions.py)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np
import pluggy

from shard_engine_api._cli import sessions
from shard_engine_api._cli.chat import chat_tokenizer, user_turn
from shard_engine_api._cli.common import (
    DEFAULT_PROMPT,
    UsageError,
    check_isolation,
    command_fixture,
    isolated,
    print_json,
    print_shards,
    sampling,
    shard_ranges,
)
from shard_engine_api._hookspecs import EngineDescription, ModelFixture, Tokenizer
from shard_engine_api._pipeline import GeneratedToken, GenerationResult, load_pipeline
from shard_engine_api._plugins import engine_description, tokenizer
from shard_engine_api._types import Determinism, SessionRef
from shard_engine_api._validation import ValidatingEngine

__all__ = ["Encoder", "command_run", "generate", "prompt_encoder", "prompt_ids", "prompt_text"]


def generate(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    prompt: Sequence[int],
    found_tokenizer: Tokenizer | None,
    declared: list[Determinism] | None = None,
    on_token: Callable[[GeneratedToken], None] | None = None,
) -> GenerationResult:
    """One generation through a validated pipeline over the wire; ``declared`` (when given)
    receives what the head shard declares about determinism, ``on_token`` each token as it is
    generated."""
    description = engine_description(args.engine, manager=manager)
    if args.isolation == "process":
        description = engine_description("remote", manager=manager)
        fixture = isolated(manager, args, fixture)
    context = max(256, len(prompt) + args.max_new_tokens + 1)
    # Validated from before load, as a worker would: every result is checked against the
    # contract, so the demo cannot print a result that breaks it. Every bundle crosses the
    # wire codec. One session of known length: size the context and the KV budget for it.
    pipeline = load_pipeline(
        description.factory,
        fixture,
        ranges,
        wire=True,
        wrap=ValidatingEngine,
        boundary_dtype=args.boundary_dtype,
        n_threads=args.threads,
        max_sessions=1,
        max_context=context,
        kv_budget_tokens=context,
    )
    with pipeline:
        if declared is not None:
            declared.append(pipeline.engines[0].capabilities().determinism)
        return pipeline.generate(
            prompt,
            args.max_new_tokens,
            sampling=sampling(args),
            stop_tokens=args.stop_tokens or (),
            tokenizer=found_tokenizer,
            session=SessionRef(session_id="cli-run", epoch=1),
            on_token=on_token,
        )


def prompt_text(args: argparse.Namespace) -> str:
    # None (not the default text) when --prompt is absent, so that --prompt with --tokens is
    # refused while --tokens alone is not.
    return DEFAULT_PROMPT if args.prompt is None else str(args.prompt)


Encoder = Callable[[str], list[int]]
"""Prompt text to token ids."""


def prompt_encoder(
    args: argparse.Namespace, engine: str, found_tokenizer: Tokenizer | None
) -> Encoder | None:
    """How prompt text becomes token ids: the tokenizer's ``encode``; with --chat, one user
    message in the model's chat template (its end-of-turn tokens join --stop-tokens)."""
    if not args.chat:
        return None if found_tokenizer is None else found_tokenizer.encode
    chat = chat_tokenizer(engine, found_tokenizer)
    args.stop_tokens = [*(args.stop_tokens or ()), *chat.end_of_turn_tokens()]
    return user_turn(chat)


def prompt_ids(args: argparse.Namespace, engine: str, encode: Encoder | None) -> list[int]:
    if args.tokens is not None:
        return list(args.tokens)
    if encode is None:
        raise UsageError(
            f"engine {engine!r} has no tokenizer for this model; pass --tokens 1,2,3 instead "
            "of --prompt"
        )
    ids = encode(prompt_text(args))
    if not ids:
        raise UsageError("argument --prompt: the prompt has no tokens")
    return ids


def _first_difference(first: Sequence[int], second: Sequence[int]) -> int:
    return next(
        (index for index, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
        min(len(first), len(second)),
    )


def verify(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    prompt: Sequence[int],
    found_tokenizer: Tokenizer | None,
    result: GenerationResult,
    split: Determinism | None = None,
) -> dict[str, object]:
    full = generate(manager, args, fixture, [(0, fixture.n_layers)], prompt, found_tokenizer)
    same_tokens = full.token_ids == result.token_ids
    bitwise = full.step_logits == result.step_logits
    # A split that declares itself not split-exact (16-bit boundaries round the hidden states)
    # is held to its declared tolerance, over the steps whose inputs agree (up to and including
    # the step whose logits chose the first differing token: a lossy boundary may flip a near
    # tie, after which the two generations are different texts, not a drift).
    exact = split is None or split.split_exact
    tolerance = args.tolerance if split is None or exact else max(args.tolerance, split.tolerance)
    steps = min(len(full.step_logits), len(result.step_logits))
    if not exact and not same_tokens:
        steps = min(steps, _first_difference(full.token_ids, result.token_ids) + 1)
    comparable = (exact and len(full.step_logits) == len(result.step_logits)) or not exact
    difference = (
        float(np.max(np.abs(full.logits()[:steps] - result.logits()[:steps])))
        if comparable and steps
        else math.inf
    )
    passed = (same_tokens or not exact) and (bitwise or difference <= tolerance)
    return {
        "passed": passed,
        "tokens_equal": same_tokens,
        "bitwise": bitwise,
        "max_abs_logit_difference": 0.0 if bitwise else difference,
        "steps": steps,
        "tolerance": tolerance,
        "declared_split_exact": exact,
    }


def command_run(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    if args.tokens is not None and args.prompt is not None:
        raise UsageError("argument --tokens: give --prompt or --tokens, not both")
    if args.tokens is not None and args.chat:
        raise UsageError(
            "argument --chat: the chat template applies to --prompt text, not --tokens"
        )
    check_isolation(manager, args)
    fixture = command_fixture(manager, args.engine, args.model, args.workdir)
    ranges = shard_ranges(fixture, args.shards)
    description = engine_description(args.engine, manager=manager)
    found_tokenizer = tokenizer(manager, args.engine, fixture.model)
    encode = prompt_encoder(args, args.engine, found_tokenizer)
    prompt = prompt_ids(args, args.engine, encode)
    text = prompt_text(args) if args.tokens is None else None
    if args.sessions > 1:
        return sessions.command_run_sessions(
            manager, args, fixture, ranges, description, found_tokenizer, encode, prompt, text
        )
    declared: list[Determinism] = []
    printer = None if args.json else _TokenPrinter()
    if printer is not None:
        _print_run_header(args, fixture, ranges, prompt, text)
    try:
        result = generate(
            manager, args, fixture, ranges, prompt, found_tokenizer, declared, on_token=printer
        )
        if printer is not None:
            printer.end(result.text)
    finally:
        if printer is not None:
            printer.end()
    if args.verify and printer is not None:
        print(
            "verifying against one full shard (loads one more, full copy of the model; "
            "--no-verify skips it)...",
            flush=True,
        )
    verification = (
        verify(manager, args, fixture, prompt, found_tokenizer, result, declared[0])
        if args.verify
        else None
    )
    if args.json:
        print_json(
            {
                "engine": args.engine,
                "evidence": description.evidence,
                "model": fixture.model,
                "model_description": fixture.description,
                "n_layers": fixture.n_layers,
                "shards": [list(pair) for pair in ranges],
                "prompt": text,
                "chat": args.chat,
                "prompt_ids": list(prompt),
                "token_ids": list(result.token_ids),
                "text": result.text,
                "finish_reason": result.finish_reason,
                "prefill_ms": result.prefill_ms,
                "decode_ms_median": result.decode_ms_median,
                "wire_bytes": result.wire_bytes,
                "shard_timings": result.shard_timings,
                "verify": verification,
            }
        )
    else:
        _print_run(args, description, fixture, ranges, result, verification)
    return 0 if verification is None or verification["passed"] else 1


class _TokenPrinter:
    """Prints each token as it is generated (its text, or its id without a tokenizer), so a
    slow model shows progress instead of silence; control characters are escaped."""

    def __init__(self) -> None:
        self._started = False
        self._text = ""

    def __call__(self, token: GeneratedToken) -> None:
        if not self._started:
            self._started = True
            sys.stdout.write("generating: ")
        if token.text is None:
            sys.stdout.write(f"{token.token_id} ")
        else:
            self._text += token.text
            sys.stdout.write(_escaped(token.text))
        sys.stdout.flush()

    def end(self, text: str | None = None) -> None:
        """End the line, after what the final ``text`` holds beyond the pieces printed (a
        character whose bytes were still incomplete at the last token)."""
        if not self._started:
            return
        if text is not None and text.startswith(self._text):
            sys.stdout.write(_escaped(text[len(self._text) :]))
        self._started, self._text = False, ""
        sys.stdout.write("\n")
        sys.stdout.flush()


def _escaped(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _print_run_header(
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    prompt: Sequence[int],
    text: str | None,
) -> None:
    print_shards(args, fixture, ranges)
    if text is not None:
        chat = " (a user message in the model's chat template)" if args.chat else ""
        print(f"prompt: {text!r}{chat}")
    print(f"prompt ids ({len(prompt)}): {list(prompt)}", flush=True)


def _print_run(
    args: argparse.Namespace,
    description: EngineDescription,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    result: GenerationResult,
    verification: dict[str, object] | None,
) -> None:
    print(f"generated ids ({len(result.token_ids)}): {list(result.token_ids)}")
    if result.text is not None:
        print(f"generated text: {result.text!r}")
        if description.evidence == "fixture":
            print(
                "note: a fixture engine is deterministic arithmetic, not a language model; "
                "its text is meaningless by design"
            )
        elif fixture.synthetic:
            print(
                "note: the built-in model is generated with random weights, not a language "
                "model; its text is meaningless by design (--model PATH runs a real GGUF)"
            )
    print(f"prefill: {result.prefill_ms:.2f} ms   decode: {result.decode_ms_median:.3f} ms/token")
    if len(ranges) > 1:
        print(
            f"boundaries: {len(ranges) - 1}, {result.wire_bytes:,} bytes of msgpack bundles "
            "crossed them (encoded, decoded and verified at every hop)"
        )
    print(f"{'shard':<34} {'prefill ms':>11} {'decode ms (median)':>19} {'decode ms (total)':>18}")
    for timing in result.shard_timings:
        print(
            f"{timing.shard:<34} {timing.prefill_ms:>11.3f} {timing.decode_ms_median:>19.4f} "
            f"{timing.decode_ms_total:>18.3f}"
        )
    if verification is not None:
        _print_verification(args, verification)


def _print_verification(args: argparse.Namespace, verification: dict[str, object]) -> None:
    verdict = (
        "bitwise identical"
        if verification["bitwise"]
        else f"max |delta logits| = {verification['max_abs_logit_difference']:.3g}"
    )
    declared = (
        ""
        if verification["declared_split_exact"]
        else f"; {args.boundary_dtype} boundaries, declared not split-exact: within the declared "
        f"tolerance {verification['tolerance']:.3g} over the steps before tokens differ"
    )
    print(
        f"verify against one full shard: {'PASS' if verification['passed'] else 'FAIL'} "
        f"(tokens {'equal' if verification['tokens_equal'] else 'DIFFER'}, logits {verdict} "
        f"over {verification['steps']} steps{declared})"
    )
