"""``shard-engine engines``, ``bench`` and ``conformance``, and the commands of this project's
engines when their distribution is not installed (one line naming the pip command)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

import pluggy

from shard_engine_api._cli.common import UsageError, command_fixture, print_json, raise_if_broken
from shard_engine_api._cli.run import generate
from shard_engine_api._pipeline import split_layers
from shard_engine_api._plugins import (
    PROJECT_DISTRIBUTIONS,
    engine_description,
    install_command,
    installed_engines,
    plugin_problems,
    tokenizer,
)

__all__ = [
    "ENGINE_COMMANDS",
    "command_bench",
    "command_conformance",
    "command_engines",
    "not_installed",
]

ENGINE_COMMANDS = {
    "serve": ("remote", "host one loaded engine for remote engines"),
    "split": ("llama", "write shard GGUF files and a manifest"),
    "inspect": ("llama", "describe a GGUF model and its shardability"),
}
"""Commands that this project's engines add, by the engine whose distribution adds them."""


def command_engines(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    engines = installed_engines(manager)
    problems = plugin_problems(manager)
    if args.json:
        print_json({"engines": engines, "broken": problems})
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


def command_bench(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
    fixture = command_fixture(manager, args.engine, args.model, args.workdir)
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
            result = generate(manager, args, fixture, ranges, prompt, None)
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
        print_json(
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


def command_conformance(args: argparse.Namespace, *, manager: pluggy.PluginManager) -> int:
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


def not_installed(
    command: str, engine: str, args: argparse.Namespace, *, manager: pluggy.PluginManager
) -> int:
    """The command of a project engine whose distribution is not installed: how to install it."""
    raise_if_broken(manager, engine)
    raise UsageError(
        f"{command} comes with {PROJECT_DISTRIBUTIONS[engine]}, which is not installed: "
        f"{install_command(engine)}"
    )
