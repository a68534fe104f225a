"""The noxfile finds every engine plugin and offers one conformance session per plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import noxfile

ROOT = Path(__file__).resolve().parent.parent


def test_engine_plugins_are_discovered_from_pyprojects() -> None:
    """Each packages/*/pyproject.toml declaring a shard_engine entry point is a plugin."""
    assert noxfile.engine_plugins() == {
        "fake": "packages/shard-engine-fake",
        "llama": "packages/shard-engine-llama",
        "remote": "packages/shard-engine-remote",
    }


def test_one_conformance_session_per_plugin() -> None:
    """`nox -l` lists conformance(engine=...) for fake, llama and remote, and the
    default sessions run tests, conformance, typecheck and lint."""
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    for name in ("fake", "llama", "remote"):
        assert f"* conformance(engine='{name}')" in listing
    for session in ("tests(package='api')", "tests(package='remote')", "typecheck", "lint"):
        assert f"* {session}" in listing
    assert "- certify" in listing, "certify must be opt-in (not a default session)"
    assert "- fuzz" in listing, "fuzz must be opt-in (not a default session)"


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run executes the README's test command verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = 'python3 -m pip install "nox>=2025.2.9" && python3 -m nox'
    assert command in readme
    assert command in ci


def test_sessions_that_run_the_conformance_suite_install_its_requirements() -> None:
    """`shard-engine conformance` needs pytest and hypothesis (its state machine): every
    session that runs it installs both, so an opt-in run (certify) cannot fail on a missing
    tool. Fix: install TEST_TOOLS in the session."""
    source = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert "hypothesis" in " ".join(noxfile.TEST_TOOLS)
    for session in ("conformance", "certify"):
        body = source.split(f"def {session}(", 1)[1].split("\n@nox.session", 1)[0]
        assert "TEST_TOOLS" in body, f"the {session} session does not install TEST_TOOLS"


def test_sessions_run_on_the_interpreter_that_runs_nox() -> None:
    """No session pins a Python version (nox would refuse to run it where that version is
    missing, e.g. with only 3.12 installed): each builds its venv from the interpreter running
    nox. Fix: drop ``python=`` from the ``@nox.session`` decorator."""
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json", "-f", str(ROOT / "noxfile.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    sessions = json.loads(listing)
    assert sessions
    pinned = {session["session"]: session["python"] for session in sessions if session["python"]}
    assert not pinned, f"sessions pinned to a Python version: {pinned}"
    source = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert "nox.options.error_on_missing_interpreters = True" in source


def test_ci_runs_nox_on_the_oldest_supported_python() -> None:
    """.ci/run puts Python 3.11 (the packages' requires-python floor) first on PATH as the
    `python3` of the README's command."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3.11 -c 'import sys; print(sys.executable)'" in ci
    assert 'export PATH="$bin:$PATH"' in ci
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        assert 'requires-python = ">=3.11"' in pyproject.read_text(encoding="utf-8")
