"""What every command shares: argument value types, the parser and help classes, the model a
command runs on, and its one-line errors (:class:`UsageError`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import msgspec
import pluggy

from shard_engine_api._hookspecs import ModelFixture
from shard_engine_api._pipeline import split_layers
from shard_engine_api._plugins import (
    describe_model,
    engine_description,
    install_command,
    installed_engines,
    model_fixture,
    plugin_problems,
)
from shard_engine_api._sampling import Sampling
from shard_engine_api._store import model_store, unchecked_model_store

__all__ = [
    "DEFAULT_PROMPT",
    "MAX_NEW_TOKENS",
    "Command",
    "HelpFormatter",
    "Parser",
    "UsageError",
    "at_least",
    "check_isolation",
    "command_fixture",
    "finite_at_least_zero",
    "integer_list",
    "isolated",
    "new_tokens",
    "non_negative",
    "one_line",
    "positive",
    "print_json",
    "print_shards",
    "probability",
    "raise_if_broken",
    "sampling",
    "shard_ranges",
    "utf8_text",
]

DEFAULT_PROMPT = "The quick brown fox"
Command = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A bad command-line value found after parsing (reported like an argparse error)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or not action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- value types


def _integer(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
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


def finite_at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8: bytes on the command line that do not decode become lone
    surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(
            f"is not valid UTF-8 (undecodable byte at character {error.start})"
        ) from None
    return text


def probability(text: str) -> float:
    value = finite_at_least_zero(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text!r}")
    return value


def integer_list(minimum: int) -> Callable[[str], list[int]]:
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


positive = at_least(1)
# A session of more positions than this is no demo or benchmark (and no engine's context).
MAX_NEW_TOKENS = 1 << 20
new_tokens = at_least(1, MAX_NEW_TOKENS)
non_negative = at_least(0)


# --------------------------------------------------------------------------- helpers


def _workdir(explicit: str | None) -> Path:
    """Where engines may generate fixture models: --workdir (checked now), else the model store
    (checked by the engine if it writes there: the fake never does). Nothing is created here;
    an engine that writes a fixture creates the directory it writes into."""
    return model_store(explicit) if explicit else unchecked_model_store()


def command_fixture(
    manager: pluggy.PluginManager, engine: str, model: str | None, workdir: str | None
) -> ModelFixture:
    """The model a command runs on: ``--model`` described by the engine, else its built-in."""
    engine_description(engine, manager=manager)  # an unknown engine is the first thing to say
    if model:
        return describe_model(manager, engine, model)
    return model_fixture(manager, engine, _workdir(workdir))


def shard_ranges(fixture: ModelFixture, shards: int) -> list[tuple[int, int]]:
    if shards > fixture.n_layers:
        raise UsageError(
            f"argument --shards: {shards} shards of a {fixture.n_layers}-layer model; choose 1 "
            f"to {fixture.n_layers}"
        )
    return split_layers(fixture.n_layers, shards)


def sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


def raise_if_broken(manager: pluggy.PluginManager, engine: str) -> None:
    """BrokenPlugin, naming its failure, when ``engine`` is installed but its plugin failed."""
    if any(problem.plugin == engine for problem in plugin_problems(manager)):
        engine_description(engine, manager=manager)


def check_isolation(manager: pluggy.PluginManager, args: argparse.Namespace) -> None:
    if args.isolation == "process" and "remote" not in {
        engine.name for engine in installed_engines(manager)
    }:
        raise_if_broken(manager, "remote")
        raise UsageError(
            "argument --isolation: process isolation runs each shard through the remote "
            f"engine, which is not installed: {install_command('remote')}"
        )


def isolated(
    manager: pluggy.PluginManager, args: argparse.Namespace, fixture: ModelFixture
) -> ModelFixture:
    """``fixture`` as the remote engine loads it with ``--isolation process``: each shard in
    its own supervised child process (the remote engine passes every other option on to the
    engine it spawns)."""
    check_isolation(manager, args)
    return msgspec.structs.replace(fixture, options={"spawn": args.engine, **fixture.options})


def print_json(value: object) -> None:
    print(msgspec.json.encode(value).decode())


def print_shards(
    args: argparse.Namespace, fixture: ModelFixture, ranges: Sequence[tuple[int, int]]
) -> None:
    print(f"engine: {args.engine}   model: {fixture.description or fixture.model}")
    print(f"shards: {' '.join(f'[{s}:{e})' for s, e in ranges)} of {fixture.n_layers} layers")


def one_line(text: str) -> str:
    return " ".join(text.split())
