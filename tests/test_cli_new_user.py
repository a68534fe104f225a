"""A new user's trip-ups, checked once more across every command: -v on either side of every
subcommand, one error prefix for every command, the top-level help's example lines as written,
``python -m shard_engine_api``, and a shard file given as ``--model`` named for what it is."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from shard_engine_api.cli import build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    action = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    choices: dict[str, argparse.ArgumentParser] = action.choices
    return choices


# The smallest valid arguments of each command (the -v tests parse, nothing runs).
_MINIMAL = {
    "engines": [],
    "run": [],
    "bench": [],
    "conformance": ["--engine", "fake"],
    "inspect": ["model.gguf"],
    "split": ["model.gguf", "--parts", "2"],
}
"""(serve's: the remote package's test_cli_verbose.py, where serve is installed.)"""


@pytest.mark.parametrize("command", sorted(_MINIMAL))
def test_verbose_before_and_after_every_command(command: str) -> None:
    assert command in _commands()
    parser = build_parser()
    before = parser.parse_args(["-v", command, *_MINIMAL[command]])
    after = parser.parse_args([command, *_MINIMAL[command], "-vv"])
    assert before.verbose == 1
    assert after.verbose_after_command == 2


# One bad input of each command: its one line on stderr starts with "shard-engine COMMAND: ".
_BAD = {
    "engines": ["engines", "--yaml"],
    "run": ["run", "--shards", "0"],
    "bench": ["bench", "--splits", "x"],
    "conformance": ["conformance", "--engine", "nosuch"],
    "inspect": ["inspect", "{tmp}/missing.gguf"],
    "split": ["split", "{tmp}/missing.gguf", "--parts", "2"],
    "serve": ["serve", "--engine", "fake", "--layers", "0:2", "--listen", "0.0.0.0:0"],
}


@pytest.mark.parametrize("command", sorted(_BAD))
def test_every_command_prefixes_its_errors_alike(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command in _commands()
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in _BAD[command]]
    try:
        code: int | str | None = main(arguments)
    except SystemExit as exit_:  # argparse exits by itself
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"shard-engine {command}: "), line
    assert "Traceback" not in captured.err


def test_an_unknown_option_before_the_command_is_the_top_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus", "engines"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(
        "shard-engine: error: unrecognized arguments: --bogus"
    )


def test_the_top_level_help_keeps_its_example_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert (
        "    shard-engine run [--engine fake]      a sharded generation, verified against one "
        "shard" in lines
    )
    assert "Each command's options: shard-engine COMMAND --help" in lines
    assert not any("``" in line for line in lines)


def test_python_dash_m_runs_the_command_line() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "shard_engine_api", "engines"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "fake" in completed.stdout


def test_a_middle_shard_given_as_the_model_is_named_a_shard_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file written by split has no tokenizer; what run reports first is that it is a shard
    (ShardMismatch with its range), not the missing tokenizer."""
    from shard_engine_llama._fixtures import tiny_model_path
    from shard_engine_llama._gguf import split_model

    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "store"))
    manifest = split_model(tiny_model_path(tmp_path), [(0, 2), (2, 4), (4, 6)], tmp_path / "out")
    assert main(["run", "--engine", "llama", "--model", str(manifest.shard_path(1))]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("shard-engine run: ShardMismatch [shard_mismatch]: "), line
    assert "is a shard file (layers [2, 4) of a 6-layer model" in line
