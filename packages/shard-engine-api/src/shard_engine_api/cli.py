"""The ``shard-engine`` command line.

    shard-engine engines                  list installed engines (and broken plugins)
    shard-engine run [--engine fake]      a sharded generation, verified against one shard
    shard-engine run --engine llama --model M.gguf --chat --prompt "Hi"
                                          a chat model's reply (its own chat template)
    shard-engine bench [--engine fake]    prefill/decode throughput, unsplit vs split
    shard-engine conformance --engine N   run the conformance suite on an installed engine

Engines add their own subcommands through ``EngineDescription.add_cli_commands``. Every bad
input ends in one line on stderr naming the problem, and exit status 2. The commands live in
``shard_engine_api._cli`` (its docstring maps the modules); this module is the entry point.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

import pluggy

from shard_engine_api._cli import parser as _parser
from shard_engine_api._cli.common import Command, UsageError, one_line
from shard_engine_api._cli.logs import configure_logging
from shard_engine_api._errors import ShardEngineError
from shard_engine_api._plugins import get_plugin_manager

__all__ = ["build_parser", "main"]


def build_parser(manager: pluggy.PluginManager | None = None) -> argparse.ArgumentParser:
    """The argument parser, with every installed engine's subcommands."""
    description = "Run, verify, benchmark and check sharded inference engines."
    examples = (__doc__ or "").split("\n\n")[1]
    return _parser.build(manager or get_plugin_manager(), description, examples)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shard-engine``; returns the exit code (2 for every bad input)."""
    manager = get_plugin_manager()
    parser = build_parser(manager)
    arguments = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(arguments)
    if unknown:
        # Said by the command they follow (argparse would say "shard-engine: error" for all).
        before_command = unknown[0] in arguments and (
            arguments.index(unknown[0]) < arguments.index(args.command)
        )
        command = parser if before_command else _parser.command_parser(parser, args.command)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.verbose += getattr(args, "verbose_after_command", 0)
    args.log_format = getattr(args, "log_format_after_command", None) or args.log_format
    configure_logging(args.verbose, args.log_format)
    func: Command = args.func
    prog = f"{parser.prog} {args.command}"
    try:
        return func(args)
    except UsageError as error:
        print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)
    except ShardEngineError as error:
        print(
            f"{prog}: {type(error).__name__} [{error.code}]: {one_line(error.message)}",
            file=sys.stderr,
        )
    except (OSError, ValueError, RuntimeError) as error:
        # An engine's or plugin's own exception that escaped its mapping to the contract's
        # errors: still one line (the traceback with -vv).
        if args.verbose > 1:
            traceback.print_exc()
        print(f"{prog}: {type(error).__name__}: {one_line(str(error))}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
