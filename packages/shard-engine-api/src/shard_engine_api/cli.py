"""The ``shard-engine`` command line.

    shard-engine engines                  list installed engines
    shard-engine run [--engine fake]      a sharded greedy generation, verified against one shard
    shard-engine bench [--engine fake]    prefill/decode throughput, unsplit vs split
    shard-engine conformance --engine N   run the conformance suite on an installed engine

Engines add their own subcommands through the ``shard_engine_add_cli_commands`` hook.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pluggy

from shard_engine_api._errors import ShardEngineError
from shard_engine_api._hookspecs import ModelFixture
from shard_engine_api._pipeline import GenerationResult, Pipeline, split_layers
from shard_engine_api._plugins import (
    add_cli_commands,
    describe_model,
    detokenize,
    get_plugin_manager,
    installed_engines,
    load_engine,
    model_fixture,
    plugin_problems,
    tokenize,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._store import model_store, unchecked_model_store
from shard_engine_api._types import BoundaryDtype, SessionRef
from shard_engine_api._validation import ValidatingEngine

__all__ = ["main"]

_DEFAULT_PROMPT = "The quick brown fox"
Command = Callable[[argparse.Namespace], int]


def _workdir(explicit: str | None) -> Path:
    """Where engines may generate fixture models: --workdir (checked now), else the model store
    (checked by the engine if it writes there: the fake never does). Nothing is created here;
    an engine that writes a fixture creates the directory it writes into."""
    return model_store(explicit) if explicit else unchecked_model_store()


def _fixture(
    manager: pluggy.PluginManager, engine: str, model: str | None, workdir: str | None
) -> ModelFixture:
    if model:
        return describe_model(manager, engine, model)
    return model_fixture(manager, engine, _workdir(workdir))


def _load_pipeline(
    manager: pluggy.PluginManager,
    engine_name: str,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    *,
    boundary_dtype: BoundaryDtype,
    n_threads: int,
    max_context: int,
) -> list[ShardEngine]:
    engines: list[ShardEngine] = []
    try:
        for start, end in ranges:
            # One session of known length: size the KV cache for it, not for a server's load.
            config = fixture.config(
                start,
                end,
                boundary_dtype=boundary_dtype,
                n_threads=n_threads,
                max_sessions=1,
                max_context=max_context,
            )
            # Validated from before load, as a worker would: every result is checked against
            # the contract, so the demo cannot print a result that breaks it.
            validated = ValidatingEngine(load_engine(engine_name, manager=manager))
            engines.append(validated)
            validated.load(config)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def _prompt_ids(
    manager: pluggy.PluginManager, engine: str, fixture: ModelFixture, args: argparse.Namespace
) -> list[int]:
    if args.tokens:
        return [int(part) for part in args.tokens.split(",") if part.strip()]
    ids = tokenize(manager, engine, fixture.model, args.prompt)
    if ids is None:
        raise SystemExit(f"engine {engine!r} has no tokenizer for this model; pass --tokens 1,2,3")
    return ids


def _format_text(
    manager: pluggy.PluginManager, engine: str, fixture: ModelFixture, ids: Sequence[int]
) -> str | None:
    return detokenize(manager, engine, fixture.model, ids)


def _generate(
    manager: pluggy.PluginManager,
    args: argparse.Namespace,
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    prompt: Sequence[int],
) -> tuple[GenerationResult, list[ShardEngine]]:
    engines = _load_pipeline(
        manager,
        args.engine,
        fixture,
        ranges,
        boundary_dtype=args.boundary_dtype,
        n_threads=args.threads,
        max_context=max(256, len(prompt) + args.max_new_tokens + 1),
    )
    try:
        pipeline = Pipeline(engines, wire=True)
        result = pipeline.generate(
            prompt, args.max_new_tokens, session=SessionRef(session_id="cli-run", epoch=1)
        )
        result = msgspec.structs.replace(result, wire_bytes=pipeline.wire_bytes)
    finally:
        for engine in engines:
            engine.close()
    return result, engines


def _command_engines(args: argparse.Namespace) -> int:
    manager = get_plugin_manager()
    engines = installed_engines(manager)
    problems = plugin_problems(manager)
    if args.json:
        print(msgspec.json.encode({"engines": engines, "broken": problems}).decode())
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


def _command_run(args: argparse.Namespace) -> int:
    manager = get_plugin_manager()
    fixture = _fixture(manager, args.engine, args.model, args.workdir)
    ranges = split_layers(fixture.n_layers, min(args.shards, fixture.n_layers))
    prompt = _prompt_ids(manager, args.engine, fixture, args)
    print(f"engine: {args.engine}   model: {fixture.description or fixture.model}")
    print(f"shards: {' '.join(f'[{s}:{e})' for s, e in ranges)} of {fixture.n_layers} layers")
    print(f"prompt ids ({len(prompt)}): {list(prompt)}")
    result, _ = _generate(manager, args, fixture, ranges, prompt)
    print(f"generated ids ({len(result.token_ids)}): {list(result.token_ids)}")
    text = _format_text(manager, args.engine, fixture, result.token_ids)
    if text is not None:
        print(f"generated text: {text!r}")
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
    if not args.verify:
        return 0
    full, _ = _generate(manager, args, fixture, [(0, fixture.n_layers)], prompt)
    same_tokens = full.token_ids == result.token_ids
    difference = float(np.max(np.abs(full.logits() - result.logits())))
    bitwise = full.step_logits == result.step_logits
    verdict = "bitwise identical" if bitwise else f"max |delta logits| = {difference:.3g}"
    status = "PASS" if same_tokens and (bitwise or args.tolerance >= difference) else "FAIL"
    print(
        f"verify against one full shard: {status} (tokens {'equal' if same_tokens else 'DIFFER'}"
        f", logits {verdict} over {len(result.step_logits)} steps)"
    )
    return 0 if status == "PASS" else 1


def _command_bench(args: argparse.Namespace) -> int:
    manager = get_plugin_manager()
    fixture = _fixture(manager, args.engine, args.model, args.workdir)
    prompt = list(range(1, args.prompt_tokens + 1))
    ids = tokenize(manager, args.engine, fixture.model, "x" * args.prompt_tokens)
    if ids:
        prompt = ids[: args.prompt_tokens]
    splits = [int(part) for part in args.splits.split(",")]
    print(
        f"engine {args.engine}, model {fixture.description or fixture.model}, prompt "
        f"{len(prompt)} tokens, {args.max_new_tokens} decode steps, {args.repeat} repeats (medians)"
    )
    print(
        f"{'shards':>6} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'prefill ratio':>14} {'decode ratio':>13}"
    )
    baseline: tuple[float, float] | None = None
    for parts in splits:
        ranges = split_layers(fixture.n_layers, min(parts, fixture.n_layers))
        prefill_rates: list[float] = []
        decode_rates: list[float] = []
        for _ in range(args.repeat):
            result, _ = _generate(manager, args, fixture, ranges, prompt)
            prefill_rates.append(len(prompt) / (result.prefill_ms / 1000.0))
            decode_rates.append(
                1000.0 / result.decode_ms_median if result.decode_ms_median else 0.0
            )
        prefill_rate = statistics.median(prefill_rates)
        decode_rate = statistics.median(decode_rates)
        if baseline is None:
            baseline = (prefill_rate, decode_rate)
        print(
            f"{parts:>6} {prefill_rate:>14.1f} {decode_rate:>13.1f} "
            f"{prefill_rate / baseline[0]:>14.3f} {decode_rate / baseline[1]:>13.3f}"
        )
    return 0


def _command_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest
    except ImportError:
        print("the conformance suite needs pytest: pip install pytest", file=sys.stderr)
        return 2
    from shard_engine_api.conformance import pytest_arguments

    return int(pytest.main(pytest_arguments(args.engine, args.report, args.pytest_args)))


def build_parser(manager: pluggy.PluginManager | None = None) -> argparse.ArgumentParser:
    """The argument parser, with every installed plugin's subcommands."""
    parser = argparse.ArgumentParser(prog="shard-engine", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)

    engines = subparsers.add_parser("engines", help="list installed engines")
    engines.add_argument("--json", action="store_true", help="print JSON")
    engines.set_defaults(func=_command_engines)

    def pipeline_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--engine", default="fake", help="engine entry-point name (default fake)")
        sub.add_argument("--model", help="model reference (e.g. a GGUF path); default: built-in")
        sub.add_argument("--workdir", help="where fixture models are generated")
        sub.add_argument("--max-new-tokens", type=int, default=16)
        sub.add_argument("--boundary-dtype", choices=["f32", "f16"], default="f32")
        sub.add_argument("--threads", type=int, default=0, help="0 = engine default")

    run = subparsers.add_parser("run", help="greedy generation through a sharded pipeline")
    pipeline_options(run)
    run.add_argument("--shards", type=int, default=3, help="number of shards (default 3)")
    run.add_argument("--prompt", default=_DEFAULT_PROMPT)
    run.add_argument("--tokens", help="comma-separated prompt token ids (instead of --prompt)")
    run.add_argument("--no-verify", dest="verify", action="store_false")
    run.add_argument("--tolerance", type=float, default=0.0, help="allowed max |delta logits|")
    run.set_defaults(func=_command_run)

    bench = subparsers.add_parser("bench", help="throughput unsplit vs split")
    pipeline_options(bench)
    bench.add_argument("--splits", default="1,2,3", help="shard counts to compare")
    bench.add_argument("--prompt-tokens", type=int, default=32)
    bench.add_argument("--repeat", type=int, default=3)
    bench.set_defaults(func=_command_bench, max_new_tokens=16)

    conformance = subparsers.add_parser("conformance", help="run the conformance suite")
    conformance.add_argument("--engine", required=True)
    conformance.add_argument("--report", help="write the JSON report here")
    conformance.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    conformance.set_defaults(func=_command_conformance)

    add_cli_commands(manager or get_plugin_manager(), subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shard-engine``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command = args.func
    try:
        return func(args)
    except ShardEngineError as error:
        print(
            f"shard-engine: {type(error).__name__} [{error.code}]: {error.message}", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
