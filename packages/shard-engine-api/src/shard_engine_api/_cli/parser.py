"""The ``shard-engine`` argument parser: one small function per subcommand, then the commands
engines add, the commands of engines that are not installed, and ``-v``/``--log-format`` after
every subcommand."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import cast

import pluggy

from shard_engine_api import __version__
from shard_engine_api._cli.commands import (
    ENGINE_COMMANDS,
    command_bench,
    command_conformance,
    command_engines,
    not_installed,
)
from shard_engine_api._cli.common import (
    DEFAULT_PROMPT,
    Command,
    HelpFormatter,
    Parser,
    at_least,
    finite_at_least_zero,
    integer_list,
    new_tokens,
    non_negative,
    positive,
    probability,
    utf8_text,
)
from shard_engine_api._cli.logs import LOG_FORMAT_HELP, LOG_FORMATS, VERBOSE_HELP
from shard_engine_api._cli.run import command_run
from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._hookspecs import CliSubparsers
from shard_engine_api._plugins import PROJECT_DISTRIBUTIONS, add_cli_commands

__all__ = ["build", "command_parser"]


class _TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``shard-engine --help``: its example lines kept as written, defaults shown."""


def build(
    manager: pluggy.PluginManager, description: str, examples: str
) -> argparse.ArgumentParser:
    """The argument parser, with every installed engine's subcommands; ``examples`` (lines
    kept as they are) end ``shard-engine --help``."""
    parser = Parser(
        prog="shard-engine",
        description=description,
        epilog=f"{examples}\n\nEach command's options: shard-engine COMMAND --help",
        formatter_class=_TopHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shard-engine {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text", help=LOG_FORMAT_HELP)
    # Typed as plain ArgumentParser subparsers: what engines' add_cli_commands receive.
    subparsers = cast(
        "CliSubparsers",
        parser.add_subparsers(dest="command", required=True, parser_class=Parser),
    )

    def command(function: Callable[..., int]) -> Command:
        return functools.partial(function, manager=manager)

    _add_engines(subparsers, command(command_engines))
    _add_run(subparsers, command(command_run))
    _add_bench(subparsers, command(command_bench))
    _add_conformance(subparsers, command(command_conformance))
    add_cli_commands(manager, subparsers)
    _add_missing_engine_commands(subparsers, manager)
    _add_options_after_the_command(subparsers)
    return parser


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (``parser`` itself when there is none): the one whose
    prefix an error about that command's arguments carries."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices.get(name, parser)
            return found
    return parser


def _add_engines(subparsers: CliSubparsers, run: Command) -> None:
    engines = subparsers.add_parser(
        "engines", help="list installed engines", formatter_class=HelpFormatter
    )
    engines.add_argument("--json", action="store_true", help="print JSON")
    engines.set_defaults(func=run)


def _add_pipeline_options(sub: argparse.ArgumentParser) -> None:
    """The options of every command that loads a pipeline (run, bench)."""
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
    sub.add_argument("--max-new-tokens", type=new_tokens, default=16, help="tokens to generate")
    sub.add_argument(
        "--boundary-dtype",
        choices=sorted(BOUNDARY_DTYPES),
        default="f32",
        help="dtype of the hidden states crossing each boundary (bf16: f32's range in "
        "16 bits; f16 overflows on models whose hidden states exceed 65504)",
    )
    sub.add_argument("--threads", type=non_negative, default=0, help="0 = engine default")
    sub.add_argument(
        "--isolation",
        choices=["none", "process"],
        default="none",
        help="process: every shard in its own supervised process (shard-engine-remote)",
    )
    sub.add_argument("--json", action="store_true", help="print one JSON object")


def _add_run(subparsers: CliSubparsers, run_command: Command) -> None:
    run = subparsers.add_parser(
        "run", help="a generation through a sharded pipeline", formatter_class=HelpFormatter
    )
    _add_pipeline_options(run)
    run.add_argument("--shards", type=positive, default=3, help="number of shards")
    run.add_argument(
        "--prompt",
        type=utf8_text,
        default=None,
        help=f"prompt text; default {DEFAULT_PROMPT!r}",
    )
    run.add_argument(
        "--tokens", type=integer_list(0), help="comma-separated prompt token ids (not --prompt)"
    )
    run.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message in the model's own chat template (the "
        "GGUF's tokenizer.chat_template, applied by llama.cpp) and stop at its end-of-turn "
        "tokens; for chat models (not the fake engine)",
    )
    run.add_argument("--temperature", type=finite_at_least_zero, default=0.0, help="0 = greedy")
    run.add_argument("--top-k", type=non_negative, default=0, help="0 = no cut")
    run.add_argument("--top-p", type=probability, default=1.0, help="1 = no cut")
    run.add_argument("--seed", type=non_negative, default=0, help="sampling seed")
    run.add_argument("--stop-tokens", type=integer_list(0), help="comma-separated token ids")
    run.add_argument(
        "--sessions",
        type=at_least(1, 4096),
        default=1,
        help="generate for N sessions at once through the shards (Pipeline.generate_many): "
        "session i of 1..N prompts with '<--prompt> #i' (with --tokens: the same ids) and "
        "samples with seed --seed + i - 1; prints each session's text and the aggregate tokens/s",
    )
    run.add_argument(
        "--groups",
        type=at_least(1, 4096),
        help="with --sessions: groups of sessions circulating through the shards at once "
        "(default: as many as the cores run without oversubscription, cores // threads per "
        "shard, at most one per shard; every shard here shares this machine's cores)",
    )
    run.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare the split's tokens and logits with one full, unsplit shard: loads one "
        "more full copy of the model (its memory and load time again)",
    )
    run.add_argument(
        "--tolerance", type=finite_at_least_zero, default=0.0, help="allowed max |delta logits|"
    )
    run.set_defaults(func=run_command)


def _add_bench(subparsers: CliSubparsers, bench_command: Command) -> None:
    bench = subparsers.add_parser(
        "bench", help="throughput unsplit vs split", formatter_class=HelpFormatter
    )
    _add_pipeline_options(bench)
    bench.add_argument("--splits", type=integer_list(1), default="1,2,3", help="shard counts")
    bench.add_argument("--prompt-tokens", type=positive, default=32, help="prompt length")
    bench.add_argument("--repeat", type=positive, default=3, help="repeats (medians reported)")
    bench.set_defaults(
        func=bench_command, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_tokens=(), chat=False
    )


def _add_conformance(subparsers: CliSubparsers, conformance_command: Command) -> None:
    conformance = subparsers.add_parser(
        "conformance", help="run the conformance suite", formatter_class=HelpFormatter
    )
    conformance.add_argument("--engine", required=True, help="engine entry-point name")
    conformance.add_argument("--report", help="write the JSON report to this file")
    conformance.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    conformance.set_defaults(func=conformance_command)


def _add_missing_engine_commands(subparsers: CliSubparsers, manager: pluggy.PluginManager) -> None:
    """The command of a project engine that is not installed: it says how to install it."""
    for name, (engine, summary) in ENGINE_COMMANDS.items():
        if name in subparsers.choices:
            continue
        # No option prefix: whatever follows the command is taken, not refused.
        missing = subparsers.add_parser(
            name,
            help=f"{summary} (needs {PROJECT_DISTRIBUTIONS[engine]}: not installed)",
            prefix_chars="\0",
            add_help=False,
        )
        missing.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)
        missing.set_defaults(func=functools.partial(not_installed, name, engine, manager=manager))


def _add_options_after_the_command(subparsers: CliSubparsers) -> None:
    """-v and --log-format where users type them too, after the subcommand (`shard-engine run
    -v`, as the README writes it); -v is counted together with any -v before it."""
    for sub in subparsers.choices.values():
        if sub.prefix_chars != "-":
            continue
        if not {"-v", "--verbose"} & set(sub._option_string_actions):
            sub.add_argument(
                "-v",
                "--verbose",
                dest="verbose_after_command",
                action="count",
                default=0,
                help=VERBOSE_HELP,
            )
        if "--log-format" not in sub._option_string_actions:
            sub.add_argument(
                "--log-format",
                dest="log_format_after_command",
                choices=LOG_FORMATS,
                help=LOG_FORMAT_HELP,
            )
