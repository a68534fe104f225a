"""What a new user meets first: the default model store as a user whose home is under /home,
`run` streaming its tokens, `-v` after the subcommand, progress bars and error prefixes,
install hints for engines that are not installed, and README figures that match the code."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shard_engine_api import Pipeline, PipelineStep, installed_engines
from shard_engine_api.cli import build_parser, main
from shard_engine_api.engine import get_plugin_manager

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``shard-engine ARGS`` in a fresh interpreter, stdout and stderr redirected (no terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "shard_engine_api.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def _home_user(tmp_path: Path) -> dict[str, str]:
    """The environment of a user whose home is under /home and who chose no model store."""
    env = {key: value for key, value in os.environ.items() if key != "SHARD_ENGINE_MODEL_STORE"}
    env["HOME"] = "/home/someone-new"
    env["TMPDIR"] = str(tmp_path)
    return env


@pytest.fixture
def verbose_logging() -> Iterator[None]:
    """main(-v) adds a handler to the shard_engine logger: removed afterwards."""
    yield
    logger = logging.getLogger("shard_engine")
    for handler in logger.handlers[:]:
        if not isinstance(handler, logging.NullHandler):
            logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


def test_the_llama_engine_runs_out_of_the_box_for_a_home_user(tmp_path: Path) -> None:
    """`shard-engine run --engine llama -v` as a user whose HOME is under /home: the generated
    model lands in a private per-user store in the temporary area, -v says where, and the text
    is flagged as not a language model's."""
    completed = _cli(
        "run", "--engine", "llama", "--shards", "2", "--max-new-tokens", "2", "-v",
        env=_home_user(tmp_path),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    store = tmp_path.resolve() / f"shard-engine-{os.getuid()}"
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert any(store.glob("*.gguf")), sorted(store.iterdir())
    assert f"model store {store} (from the default: shard-engine-{os.getuid()} in $TMPDIR)" in (
        completed.stderr
    )
    assert "/home" not in completed.stderr
    assert "not a language model" in completed.stdout
    assert "verify against one full shard: PASS" in completed.stdout


def test_an_unusable_default_store_names_its_path_and_source(tmp_path: Path) -> None:
    """The default store in a temporary area under /home is refused in one line that names the
    path and that it is the default (not "an explicit path")."""
    env = _home_user(tmp_path)
    env["TMPDIR"] = "/home/someone-new/tmp"
    completed = _cli("run", "--engine", "llama", "--max-new-tokens", "1", env=env)
    assert completed.returncode == 2
    line = completed.stderr.strip()
    assert "\n" not in line
    assert line.startswith("shard-engine run: ModelStoreRefused [model_store_refused]: "), line
    assert f"model store /home/someone-new/tmp/shard-engine-{os.getuid()} (from the default" in line
    assert "an explicit path" not in line
    assert "SHARD_ENGINE_MODEL_STORE" in line


def test_run_prints_each_token_as_it_is_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two decode steps the previous token's text is already on stdout (flushed); then
    the summary, and the verification says what it costs before it runs."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    seen: list[str] = []
    step = Pipeline.step

    def recording_step(self: Pipeline, *args: object, **kwargs: object) -> PipelineStep:
        seen.append(out.getvalue())
        return step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Pipeline, "step", recording_step)
    assert main(["run", "--max-new-tokens", "4"]) == 0
    text = out.getvalue()
    generation = seen[: len(seen) // 2]  # then the same steps again, for the verification
    assert len(generation) == 5  # prefill and four decodes (the last one for its logits)
    lengths = [len(stdout) for stdout in generation]
    assert lengths[0] < lengths[1]
    assert lengths == sorted(lengths)
    assert "generating: " in generation[1]
    assert "generated ids (4)" not in generation[-1], "the summary comes after the tokens"
    assert text.index("generating: ") < text.index("verifying against one full shard (loads one")
    assert text.index("verifying against") < text.index("generated ids (4)")
    assert "--no-verify skips it" in text


def test_no_verify_loads_no_full_copy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--max-new-tokens", "2", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "verifying against" not in out
    assert "verify against one full shard" not in out
    assert "generating: " in out


def test_verify_is_a_boolean_option_whose_true_default_is_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--verify, --no-verify" in help_text
    assert "loads one more full copy of the model" in help_text
    assert help_text.count("(default: True)") == 1
    assert build_parser().parse_args(["run"]).verify is True
    assert build_parser().parse_args(["run", "--no-verify"]).verify is False


def test_verbose_after_the_subcommand(
    capsys: pytest.CaptureFixture[str], verbose_logging: None
) -> None:
    """`shard-engine run -v` logs as `shard-engine -v run` does."""
    assert main(["run", "--max-new-tokens", "1", "--no-verify", "-v"]) == 0
    assert "shard-engine: shard_engine.pipeline: loaded fake" in capsys.readouterr().err
    assert build_parser().parse_args(["-v", "run", "-v"]).verbose_after_command == 1


def test_json_log_lines(capsys: pytest.CaptureFixture[str], verbose_logging: None) -> None:
    """--log-format json (before or after the subcommand): every log line one JSON object."""
    for arguments in (
        ["--log-format", "json", "run", "-v"],
        ["run", "-v", "--log-format", "json"],
    ):
        assert main([*arguments, "--max-new-tokens", "1", "--no-verify"]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert lines
        entries = [json.loads(line) for line in lines]
        assert {entry["level"] for entry in entries} == {"info"}
        loaded = [entry for entry in entries if entry["message"].startswith("loaded fake")]
        assert len(loaded) == 3
        assert loaded[0]["logger"] == "shard_engine.pipeline"
        assert loaded[0]["time"].endswith("+00:00")


def test_split_draws_no_progress_bar_into_a_redirected_log(tmp_path: Path) -> None:
    """Without a terminal, split writes no carriage-return updates; its errors start with the
    same prefix as every other command's."""
    from shard_engine_llama._fixtures import tiny_model_path

    model = tiny_model_path(tmp_path)
    done = _cli("split", str(model), "--parts", "2", "--out", str(tmp_path / "shards"))
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    assert done.stderr == ""
    refused = _cli("split", str(model), "--shards", "0:99", "--out", str(tmp_path / "other"))
    assert refused.returncode == 2
    assert refused.stderr.startswith("shard-engine split: "), refused.stderr
    missing = _cli("inspect", str(tmp_path / "missing.gguf"))
    assert missing.stderr.startswith("shard-engine inspect: "), missing.stderr


def test_every_option_of_every_command_has_help() -> None:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    for name, command in commands.choices.items():
        for action in command._actions:
            if action.help != "==SUPPRESS==" and command.prefix_chars == "-":
                assert action.help, f"shard-engine {name} {action.option_strings or action.dest}"


@pytest.mark.skipif(
    "remote" in {engine.name for engine in installed_engines(get_plugin_manager())},
    reason="the remote engine is installed here",
)
def test_commands_of_an_engine_that_is_not_installed_name_the_pip_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve` and `run --isolation process` without shard-engine-remote: one line naming the
    pip command, before any work."""
    install = "python3 -m pip install ./packages/shard-engine-remote"
    assert main(["serve", "--engine", "fake", "--layers", "0:2"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "shard-engine serve: error: serve comes with shard-engine-remote"
    )
    assert install in captured.err
    assert main(["run", "--isolation", "process"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("shard-engine run: error: argument --isolation:")
    assert install in captured.err
    assert main(["run", "--engine", "remote"]) == 2
    assert install in capsys.readouterr().err


def test_the_readme_counts_the_conformance_tests_that_run() -> None:
    """The README's "N-test conformance suite" is what the suite collects on the fake."""
    collected = _cli("conformance", "--engine", "fake", "--", "--collect-only", "-q")
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr
    count = int(re.findall(r"(\d+) tests? collected", collected.stdout)[-1])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"The {count}-test conformance suite" in readme, (
        f"the suite has {count} tests: say so in the README's exactness paragraph"
    )


def test_the_readme_states_the_fake_default_model_layers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--max-new-tokens", "1", "--no-verify"]) == 0
    layers = re.search(r"of (\d+) layers", capsys.readouterr().out)
    assert layers is not None
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"for the fake {layers.group(1)} layers" in readme
