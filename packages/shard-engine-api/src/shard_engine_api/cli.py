"""The ``shard-engine`` command line.

    shard-engine engines                  list installed engines (and broken plugins)
    shard-engine run [--engine fake]      a sharded generation, verified against one shard
    shard-engine bench [--engine fake]    prefill/decode throughput, unsplit vs split
    shard-engine conformance --engine N   run the conformance suite on an installed engine

Engines add their own subcommands through ``EngineDescription.add_cli_commands``. Every bad
input ends in one line on stderr naming the problem, and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import logging
import math
import statistics
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, cast

import msgspec
import numpy as np
import pluggy

from shard_engine_api import Pipeline, __version__
from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._errors import ShardEngineError
from shard_engine_api._hookspecs import CliSubparsers, EngineDescription, ModelFixture, Tokenizer
from shard_engine_api._pipeline import (
    GeneratedToken,
    GenerationResult,
    load_pipeline,
    split_layers,
)
from shard_engine_api._plugins import (
    PROJECT_DISTRIBUTIONS,
    add_cli_commands,
    describe_model,
    engine_description,
    get_plugin_manager,
    install_command,
    installed_engines,
    model_fixture,
    plugin_problems,
    tokenizer,
)
from shard_engine_api._sampling import Sampling
from shard_engine_api._stages import GenerationRequest, ManyGenerationResult
from shard_engine_api._store import model_store, unchecked_model_store
from shard_engine_api._types import Determinism, SessionRef
from shard_engine_api._validation import ValidatingEngine

__all__ = ["build_parser", "main"]

_DEFAULT_PROMPT = "The quick brown fox"
_LOG_HANDLER = "shard-engine-cli"
Command = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command-line value found after parsing (reported like an argparse error)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or not action.help:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- value types


def _integer(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _integer(text)
        if maximum is not None and not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{minimum}, {maximum}], got {value}"
            )
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _finite_at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _utf8_text(text: str) -> str:
    """Text that is valid UTF-8: bytes on the command line that do not decode become lone
    surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(
            f"is not valid UTF-8 (undecodable byte at character {error.start})"
        ) from None
    return text


def _probability(text: str) -> float:
    value = _finite_at_least_zero(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text!r}")
    return value


def _integer_list(minimum: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        parts = text.split(",")
        values: list[int] = []
        for index, part in enumerate(parts, start=1):
            if not part.strip():
                raise argparse.ArgumentTypeError(
                    f"{text!r}: item {index} is empty; use comma-separated integers like 1,2,3"
                )
            value = _integer(part)
            if value < minimum:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: item {index} is {value}; every item must be >= {minimum}"
                )
            values.append(value)
        return values

    parse.__name__ = "comma-separated integers"
    return parse


_positive = _at_least(1)
# A session of more positions than this is no demo or benchmark (and no engine's context).
_MAX_NEW_TOKENS = 1 << 20
_new_tokens = _at_least(1, _MAX_NEW_TOKENS)
_non_negative = _at_least(0)


# --------------------------------------------------------------------------- helpers


def _workdir(explicit: str | None) -> Path:
    """Where engines may generate fixture models: --workdir (checked now), else the model store
    (checked by the engine if it writes there: the fake never does). Nothing is created here;
    an engine that writes a fixture creates the directory it writes into."""
    return model_store(explicit) if explicit else unchecked_model_store()


def _fixture(
    manager: pluggy.PluginManager, engine: str, model: str | None, workdir: str | None
) -> ModelFixture:
    engine_description(engine, manager=manager)  # an unknown engine is the first thing to say
    if model:
        return describe_model(manager, engine, model)
    return model_fixture(manager, engine, _workdir(workdir))


def _ranges(fixture: ModelFixture, shards: int) -> list[tuple[int, int]]:
    if shards > fixture.n_layers:
        raise UsageError(
            f"argument --shards: {shards} shards of a {fixture.n_layers}-layer model; choose 1 "
            f"to {fixture.n_layers}"
        )
    return split_layers(fixture.n_layers, shards)


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


def _generate(
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
        # Each shard in its own supervised child process, through the remote engine (which
        # passes every other option on to the engine it spawns).
        _check_isolation(manager, args)
        description = engine_description("remote", manager=manager)
        fixture = msgspec.structs.replace(
            fixture, options={"spawn": args.engine, **fixture.options}
        )
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
            sampling=_sampling(args),
            stop_tokens=args.stop_tokens or (),
            tokenizer=found_tokenizer,
            session=SessionRef(session_id="cli-run", epoch=1),
            on_token=on_token,
        )


def _raise_if_broken(manager: pluggy.PluginManager, engine: str) -> None:
    """BrokenPlugin, naming its failure, when ``engine`` is installed but its plugin failed."""
    if any(problem.plugin == engine for problem in plugin_problems(manager)):
        engine_description(engine, manager=manager)


def _check_isolation(manager: pluggy.PluginManager, args: argparse.Namespace) -> None:
    if args.isolation == "process" and "remote" not in {
        engine.name for engine in installed_engines(manager)
    }:
        _raise_if_broken(manager, "remote")
        raise UsageError(
            "argument --isolation: process isolation runs each shard through the remote "
            f"engine, which is not installed: {install_command('remote')}"
        )


def _print_json(value: object) -> None:
    print(msgspec.json.encode(value).decode())


# --------------------------------------------------------------------------- commands


def _command_engines(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    engines = installed_engines(manager)
    problems = plugin_problems(manager)
    if args.json:
        _print_json({"engines": engines, "broken": problems})
        return 0
    if not engines:
        print("no shard engines installed (entry-point group 'shard_engine')")
    else:
        print(f"{'name':<10} {'distribution':<22} {'version':<10} {'evidence':<9} summary")
    for engine in engines:
        print(
            f"{engine.name:<10} {engine.distribution:<22} {engine.version:<10} "
            f"{engine.evidence:<9} {engine.summary}"
        )
    for problem in problems:
        print(
            f"broken plugin {problem.plugin!r} ({problem.distribution} {problem.version}): "
            f"{problem.problem}"
        )
    return 0


def _prompt_text(args: argparse.Namespace) -> str:
    # None (not the default text) when --prompt is absent, so that --prompt with --tokens is
    # refused while --tokens alone is not.
    return _DEFAULT_PROMPT if args.prompt is None else str(args.prompt)


def _prompt_ids(
    args: argparse.Namespace, engine: str, found_tokenizer: Tokenizer | None
) -> list[int]:
    if args.tokens is not None:
        return list(args.tokens)
    if found_tokenizer is None:
        raise UsageError(
            f"engine {engine!r} has no tokenizer for this model; pass --tokens 1,2,3 instead "
            "of --prompt"
        )
    ids = found_tokenizer.encode(_prompt_text(args))
    if not ids:
        raise UsageError("argument --prompt: the prompt has no tokens")
    return ids


def _verify(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    prompt: Sequence[int],
    found_tokenizer: Tokenizer | None,
    result: GenerationResult,
    split: Determinism | None = None,
) -> dict[str, object]:
    full = _generate(manager, args, fixture, [(0, fixture.n_layers)], prompt, found_tokenizer)
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
        differing = next(
            (
                index
                for index, (a, b) in enumerate(zip(full.token_ids, result.token_ids, strict=False))
                if a != b
            ),
            min(len(full.token_ids), len(result.token_ids)),
        )
        steps = min(steps, differing + 1)
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


def _command_run(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    if args.tokens is not None and args.prompt is not None:
        raise UsageError("argument --tokens: give --prompt or --tokens, not both")
    _check_isolation(manager, args)
    fixture = _fixture(manager, args.engine, args.model, args.workdir)
    ranges = _ranges(fixture, args.shards)
    description = engine_description(args.engine, manager=manager)
    found_tokenizer = tokenizer(manager, args.engine, fixture.model)
    prompt = _prompt_ids(args, args.engine, found_tokenizer)
    prompt_text = _prompt_text(args) if args.tokens is None else None
    if args.sessions > 1:
        return _command_run_sessions(
            manager, args, fixture, ranges, description, found_tokenizer, prompt, prompt_text
        )
    declared: list[Determinism] = []
    printer = None if args.json else _TokenPrinter()
    if printer is not None:
        _print_run_header(args, fixture, ranges, prompt, prompt_text)
    try:
        result = _generate(
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
        _verify(manager, args, fixture, prompt, found_tokenizer, result, declared[0])
        if args.verify
        else None
    )
    if args.json:
        _print_json(
            {
                "engine": args.engine,
                "evidence": description.evidence,
                "model": fixture.model,
                "model_description": fixture.description,
                "n_layers": fixture.n_layers,
                "shards": [list(pair) for pair in ranges],
                "prompt": prompt_text,
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
    prompt_text: str | None,
) -> None:
    print(f"engine: {args.engine}   model: {fixture.description or fixture.model}")
    print(f"shards: {' '.join(f'[{s}:{e})' for s, e in ranges)} of {fixture.n_layers} layers")
    if prompt_text is not None:
        print(f"prompt: {prompt_text!r}")
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
    if verification is None:
        return
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


def _command_run_sessions(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    description: EngineDescription,
    found_tokenizer: Tokenizer | None,
    prompt: Sequence[int],
    prompt_text: str | None,
) -> int:
    """``run --sessions N``: N sessions through one validated pipeline over the wire at once;
    each is verified against its own run alone on the same shards (unless --no-verify)."""
    count = int(args.sessions)
    texts: list[str | None] = [None] * count
    prompts: list[tuple[int, ...]] = [tuple(prompt)] * count
    if prompt_text is not None and found_tokenizer is not None:
        suffixed = [f"{prompt_text} #{number}" for number in range(1, count + 1)]
        prompts = [tuple(found_tokenizer.encode(text)) for text in suffixed]
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
    engine = description
    if args.isolation == "process":
        engine = engine_description("remote", manager=manager)
        fixture = msgspec.structs.replace(
            fixture, options={"spawn": args.engine, **fixture.options}
        )
    context = max(256, max(len(ids) for ids in prompts) + args.max_new_tokens + 1)
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
    with pipeline:
        many = pipeline.generate_many(requests, args.max_new_tokens, tokenizer=found_tokenizer)
        verification = (
            _verify_sessions(pipeline, requests, many, found_tokenizer, args.tolerance)
            if args.verify
            else None
        )
    sessions = [
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
        _print_json(
            {
                "engine": args.engine,
                "evidence": description.evidence,
                "model": fixture.model,
                "n_layers": fixture.n_layers,
                "shards": [list(pair) for pair in ranges],
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
        print(f"engine: {args.engine}   model: {fixture.description or fixture.model}")
        print(f"shards: {' '.join(f'[{s}:{e})' for s, e in ranges)} of {fixture.n_layers} layers")
        for entry, session in zip(many.sessions, sessions, strict=True):
            said = f"{session['prompt']!r} " if session["prompt"] is not None else ""
            if entry.error is not None:
                ended = f"ERROR {entry.error.code}: {_one_line(entry.error.message)}"
            else:
                ended = f"({entry.result.finish_reason})"
            generated = (
                repr(entry.result.text)
                if entry.result.text is not None
                else str(list(entry.result.token_ids))
            )
            print(f"session {entry.index + 1}: {said}-> {generated} {ended}")
        print(
            f"aggregate: {len(many.sessions)} sessions, {many.generated_tokens} tokens in "
            f"{many.wall_ms:.1f} ms: {many.tokens_per_s:.1f} tokens/s"
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
                f"({verification['equal']}/{count} equal, {verification['bitwise']} bitwise, "
                f"max |delta logits| = {verification['max_abs_logit_difference']:.3g})"
            )
    failed = bool(many.failed()) or (verification is not None and not verification["passed"])
    return 1 if failed else 0


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


def _command_bench(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    fixture = _fixture(manager, args.engine, args.model, args.workdir)
    for parts in args.splits:
        if parts > fixture.n_layers:
            raise UsageError(
                f"argument --splits: {parts} shards of a {fixture.n_layers}-layer model; "
                f"choose 1 to {fixture.n_layers}"
            )
    found_tokenizer = tokenizer(manager, args.engine, fixture.model)
    prompt = list(range(1, args.prompt_tokens + 1))
    if found_tokenizer is not None:
        prompt = found_tokenizer.encode("x" * args.prompt_tokens)[: args.prompt_tokens] or prompt
    rows: list[dict[str, float | int]] = []
    if not args.json:
        print(
            f"engine {args.engine}, model {fixture.description or fixture.model}, prompt "
            f"{len(prompt)} tokens, {args.max_new_tokens} decode steps, {args.repeat} repeats "
            "(medians)"
        )
        print(
            f"{'shards':>6} {'prefill tok/s':>14} {'decode tok/s':>13} "
            f"{'prefill ratio':>14} {'decode ratio':>13}"
        )
    baseline: tuple[float, float] | None = None
    for parts in args.splits:
        ranges = split_layers(fixture.n_layers, parts)
        prefill_rates: list[float] = []
        decode_rates: list[float] = []
        for _ in range(args.repeat):
            result = _generate(manager, args, fixture, ranges, prompt, None)
            prefill_rates.append(len(prompt) / max(result.prefill_ms / 1000.0, 1e-9))
            decode_rates.append(1000.0 / max(result.decode_ms_median, 1e-9))
        prefill_rate = statistics.median(prefill_rates)
        decode_rate = statistics.median(decode_rates)
        if baseline is None:
            baseline = (prefill_rate, decode_rate)
        row = {
            "shards": parts,
            "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
            "prefill_ratio": prefill_rate / baseline[0],
            "decode_ratio": decode_rate / baseline[1],
        }
        rows.append(row)
        if not args.json:
            print(
                f"{parts:>6} {prefill_rate:>14.1f} {decode_rate:>13.1f} "
                f"{row['prefill_ratio']:>14.3f} {row['decode_ratio']:>13.3f}"
            )
    if args.json:
        _print_json(
            {
                "engine": args.engine,
                "model": fixture.model,
                "prompt_tokens": len(prompt),
                "decode_steps": args.max_new_tokens,
                "repeat": args.repeat,
                "rows": rows,
            }
        )
    return 0


def _check_report_path(report: str) -> None:
    path = Path(report)
    if path.is_dir():
        raise UsageError(f"argument --report: {report!r} is a directory; name a JSON file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"argument --report: directory {str(parent)!r} does not exist")
    if path.exists() and not path.is_file():
        raise UsageError(f"argument --report: {report!r} is not a regular file")


def _command_conformance(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    # Everything that can be checked is checked before the suite spends minutes running.
    if args.report:
        _check_report_path(args.report)
    engine_description(args.engine, manager=manager)
    missing = [name for name in ("pytest", "hypothesis") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"the conformance suite needs {' and '.join(missing)}: "
            "pip install 'shard-engine-api[conformance]'"
        )
    import pytest

    from shard_engine_api.conformance import pytest_arguments

    return int(pytest.main(pytest_arguments(args.engine, args.report, args.pytest_args)))


# --------------------------------------------------------------------------- the parser


def build_parser(manager: pluggy.PluginManager | None = None) -> argparse.ArgumentParser:
    """The argument parser, with every installed engine's subcommands."""
    manager = manager or get_plugin_manager()
    formatter = _Formatter
    parser = _Parser(
        prog="shard-engine", description=(__doc__ or "").split("\n\n")[0], formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"shard-engine {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what happens to stderr (-v: loads, files, evictions; -vv: debug)",
    )
    parser.add_argument("--log-format", choices=_LOG_FORMATS, default="text", help=_LOG_FORMAT_HELP)
    # Typed as plain ArgumentParser subparsers: what engines' add_cli_commands receive.
    subparsers = cast(
        "CliSubparsers",
        parser.add_subparsers(dest="command", required=True, parser_class=_Parser),
    )

    def command(function: Callable[..., int]) -> Command:
        return functools.partial(function, manager=manager)

    engines = subparsers.add_parser(
        "engines", help="list installed engines", formatter_class=formatter
    )
    engines.add_argument("--json", action="store_true", help="print JSON")
    engines.set_defaults(func=command(_command_engines))

    def pipeline_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--engine", default="fake", help="engine entry-point name")
        sub.add_argument(
            "--model",
            help="model reference (a GGUF path, fake:layers=4); default: the engine's built-in",
        )
        sub.add_argument(
            "--workdir",
            help="where a built-in model may be generated; default: the model store "
            "($SHARD_ENGINE_MODEL_STORE, else a private per-user directory in $TMPDIR or "
            "/var/tmp; -v shows it)",
        )
        sub.add_argument(
            "--max-new-tokens", type=_new_tokens, default=16, help="tokens to generate"
        )
        sub.add_argument(
            "--boundary-dtype",
            choices=sorted(BOUNDARY_DTYPES),
            default="f32",
            help="dtype of the hidden states crossing each boundary (bf16: f32's range in "
            "16 bits; f16 overflows on models whose hidden states exceed 65504)",
        )
        sub.add_argument("--threads", type=_non_negative, default=0, help="0 = engine default")
        sub.add_argument(
            "--isolation",
            choices=["none", "process"],
            default="none",
            help="process: every shard in its own supervised process (shard-engine-remote)",
        )
        sub.add_argument("--json", action="store_true", help="print one JSON object")

    run = subparsers.add_parser(
        "run", help="a generation through a sharded pipeline", formatter_class=formatter
    )
    pipeline_options(run)
    run.add_argument("--shards", type=_positive, default=3, help="number of shards")
    run.add_argument(
        "--prompt",
        type=_utf8_text,
        default=None,
        help=f"prompt text; default {_DEFAULT_PROMPT!r}",
    )
    run.add_argument(
        "--tokens", type=_integer_list(0), help="comma-separated prompt token ids (not --prompt)"
    )
    run.add_argument("--temperature", type=_finite_at_least_zero, default=0.0, help="0 = greedy")
    run.add_argument("--top-k", type=_non_negative, default=0, help="0 = no cut")
    run.add_argument("--top-p", type=_probability, default=1.0, help="1 = no cut")
    run.add_argument("--seed", type=_non_negative, default=0, help="sampling seed")
    run.add_argument("--stop-tokens", type=_integer_list(0), help="comma-separated token ids")
    run.add_argument(
        "--sessions",
        type=_at_least(1, 4096),
        default=1,
        help="generate for N sessions at once through the shards (Pipeline.generate_many): "
        "session i of 1..N prompts with '<--prompt> #i' (with --tokens: the same ids) and "
        "samples with seed --seed + i - 1; prints each session's text and the aggregate tokens/s",
    )
    run.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare the split's tokens and logits with one full, unsplit shard: loads one "
        "more full copy of the model (its memory and load time again)",
    )
    run.add_argument(
        "--tolerance", type=_finite_at_least_zero, default=0.0, help="allowed max |delta logits|"
    )
    run.set_defaults(func=command(_command_run))

    bench = subparsers.add_parser(
        "bench", help="throughput unsplit vs split", formatter_class=formatter
    )
    pipeline_options(bench)
    bench.add_argument("--splits", type=_integer_list(1), default="1,2,3", help="shard counts")
    bench.add_argument("--prompt-tokens", type=_positive, default=32, help="prompt length")
    bench.add_argument("--repeat", type=_positive, default=3, help="repeats (medians reported)")
    bench.set_defaults(
        func=command(_command_bench), temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_tokens=()
    )

    conformance = subparsers.add_parser(
        "conformance", help="run the conformance suite", formatter_class=formatter
    )
    conformance.add_argument("--engine", required=True, help="engine entry-point name")
    conformance.add_argument("--report", help="write the JSON report to this file")
    conformance.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    conformance.set_defaults(func=command(_command_conformance))

    add_cli_commands(manager, subparsers)
    for name, (engine, summary) in _ENGINE_COMMANDS.items():
        if name not in subparsers.choices:
            # The command of a project engine that is not installed: say how to install it.
            # No option prefix: whatever follows the command is taken, not refused.
            missing = subparsers.add_parser(
                name,
                help=f"{summary} (needs {PROJECT_DISTRIBUTIONS[engine]}: not installed)",
                prefix_chars="\0",
                add_help=False,
            )
            missing.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)
            missing.set_defaults(
                func=functools.partial(_not_installed, name, engine, manager=manager)
            )
    # -v where users type it too, after the subcommand (`shard-engine run -v`, as the README
    # writes it); counted together with any -v before it.
    for sub in subparsers.choices.values():
        if sub.prefix_chars == "-" and not {"-v", "--verbose"} & set(sub._option_string_actions):
            sub.add_argument(
                "-v",
                "--verbose",
                dest="verbose_after_command",
                action="count",
                default=0,
                help="log what happens to stderr (-v: loads, files, evictions; -vv: debug)",
            )
        if sub.prefix_chars == "-" and "--log-format" not in sub._option_string_actions:
            sub.add_argument(
                "--log-format",
                dest="log_format_after_command",
                choices=_LOG_FORMATS,
                help=_LOG_FORMAT_HELP,
            )
    return parser


_LOG_FORMATS = ("text", "json")
_LOG_FORMAT_HELP = (
    "json: each log line one JSON object (time, level, logger, message), warnings logged "
    "even without -v"
)


_ENGINE_COMMANDS = {
    "serve": ("remote", "host one loaded engine for remote engines"),
    "split": ("llama", "write shard GGUF files and a manifest"),
    "inspect": ("llama", "describe a GGUF model and its shardability"),
}
"""Commands that this project's engines add, by the engine whose distribution adds them."""


def _not_installed(
    command: str, engine: str, args: argparse.Namespace, *, manager: pluggy.PluginManager
) -> int:
    _raise_if_broken(manager, engine)
    raise UsageError(
        f"{command} comes with {PROJECT_DISTRIBUTIONS[engine]}, which is not installed: "
        f"{install_command(engine)}"
    )


class _JsonLines(logging.Formatter):
    """One JSON object a line, for log collectors: UTC time, level, logger, message (and the
    exception's traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(entry).decode()


def _configure_logging(verbosity: int, log_format: str = "text") -> None:
    if verbosity <= 0 and log_format == "text":
        return
    root = logging.getLogger("shard_engine")
    root.setLevel(
        logging.DEBUG if verbosity > 1 else logging.INFO if verbosity == 1 else logging.WARNING
    )
    for handler in root.handlers[:]:
        if handler.get_name() == _LOG_HANDLER:
            root.removeHandler(handler)  # main() called again in the same process
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_LOG_HANDLER)
    handler.setFormatter(
        _JsonLines()
        if log_format == "json"
        else logging.Formatter("shard-engine: %(name)s: %(message)s")
    )
    root.addHandler(handler)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shard-engine``; returns the exit code (2 for every bad input)."""
    manager = get_plugin_manager()
    parser = build_parser(manager)
    args = parser.parse_args(argv)
    args.verbose += getattr(args, "verbose_after_command", 0)
    args.log_format = getattr(args, "log_format_after_command", None) or args.log_format
    _configure_logging(args.verbose, args.log_format)
    func: Command = args.func
    prog = f"{parser.prog} {args.command}"
    try:
        return func(args)
    except UsageError as error:
        print(f"{prog}: error: {_one_line(str(error))}", file=sys.stderr)
    except ShardEngineError as error:
        print(
            f"{prog}: {type(error).__name__} [{error.code}]: {_one_line(error.message)}",
            file=sys.stderr,
        )
    except (OSError, ValueError, RuntimeError) as error:
        # An engine's or plugin's own exception that escaped its mapping to the contract's
        # errors: still one line (the traceback with -vv).
        if args.verbose > 1:
            traceback.print_exc()
        print(f"{prog}: {type(error).__name__}: {_one_line(str(error))}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
