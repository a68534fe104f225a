"""docs/several-machines.md, followed step by step on loopback: its marked blocks are taken
from the guide as they are written (certificates script, certificates, token, serve, worker
script, run) and run in order in a fresh folder; the three hosts are 127.0.0.1, .2 and .3, each
with its own certificate, and every server and metrics endpoint takes a free port. The worker's
tokens must equal an unsplit run of the model in this process."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from prometheus_client.parser import text_string_to_metric_families

import shard_engine_api as api

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "several-machines.md"
STEPS = ("make_certs.py", "certificates", "token", "serve", "worker.py", "run")
HOSTS = {  # the guide's host name -> this test's loopback address, and its shard's layers
    "shard-a.example": ("127.0.0.1", "0:2"),
    "shard-b.example": ("127.0.0.2", "2:4"),
    "shard-c.example": ("127.0.0.3", "4:6"),
}
_STEP = re.compile(r"<!-- guide-step: (\S+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)
_TIMEOUT_S = 60.0


def guide_steps() -> dict[str, str]:
    """Each marked block of the guide by its name, in the guide's order."""
    found = {name: body for name, _, body in _STEP.findall(GUIDE.read_text(encoding="utf-8"))}
    assert list(found) == list(STEPS), "the guide's steps changed: update this test with it"
    return found


def _substituted(text: str, replacements: dict[str, str]) -> str:
    """``text`` with each key replaced by its value; every key must be in it (the guide did not
    move away from what this test replaces)."""
    for old, new in replacements.items():
        assert old in text, f"{old!r} is no longer in the guide's step"
        text = text.replace(old, new)
    return text


def _shell(command: str, folder: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{command!r} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


class _Served:
    """One ``shard-engine serve`` process and the lines it prints."""

    def __init__(self, command: str, folder: Path, env: dict[str, str], name: str) -> None:
        self.stderr_path = folder / f"serve-{name}.stderr"
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", f"exec {command}"],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert self.process.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)

    def line(self, starting: str) -> str:
        """The next printed line starting with ``starting``."""
        while True:
            try:
                line = self._lines.get(timeout=_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"serve printed no {starting!r} line") from None
            if line is None:
                raise AssertionError(
                    f"serve exited {self.process.wait()}: {self.stderr_path.read_text()}"
                )
            if line.startswith(starting):
                return line.strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=_TIMEOUT_S)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def served() -> Iterator[list[_Served]]:
    """Serve processes, stopped after the test whatever its outcome."""
    started: list[_Served] = []
    yield started
    for server in started:
        server.stop()


def _unsplit_tokens() -> list[int]:
    shard = api.ShardSpec(model="fake", n_layers=6, start=0, end=6)
    with api.Pipeline([api.load_engine("fake", api.LoadConfig(shard=shard))]) as pipeline:
        return list(pipeline.generate([1, 2, 3], 8).token_ids)


def test_the_guide_runs_on_loopback(tmp_path: Path, served: list[_Served]) -> None:
    steps = guide_steps()
    env = {
        **os.environ,
        # The guide's python3 and shard-engine are this environment's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("SHARD_ENGINE_REMOTE_TOKEN", None)
    addresses = {name: address for name, (address, _) in HOSTS.items()}

    (tmp_path / "make_certs.py").write_text(steps["make_certs.py"], encoding="utf-8")
    _shell(_substituted(steps["certificates"], addresses), tmp_path, env)
    _shell(steps["token"], tmp_path, env)
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    for address, _ in HOSTS.values():
        assert (tmp_path / f"{address}.pem").is_file()
        assert (tmp_path / f"{address}.key").stat().st_mode & 0o777 == 0o600

    serve = _substituted(
        steps["serve"], {"0.0.0.0:7450": '"$HOST:0"', "127.0.0.1:9450": "127.0.0.1:0"}
    )
    targets: dict[str, str] = {}
    metrics: list[str] = []
    for name, (address, layers) in HOSTS.items():
        assert f"`{name}` and `{layers}`" in " ".join(GUIDE.read_text(encoding="utf-8").split())
        server = _Served(serve, tmp_path, {**env, "HOST": address, "LAYERS": layers}, address)
        served.append(server)
        line = server.line("serving ")
        assert line.endswith("with TLS, bearer token required"), line
        bound = re.search(r" on (\S+:\d+) ", line)
        assert bound is not None, line
        targets[f"{name}:7450"] = bound.group(1)
        metrics.append(server.line("metrics ").rsplit(" ", 1)[1])

    (tmp_path / "worker.py").write_text(steps["worker.py"], encoding="utf-8")
    printed = _shell(_substituted(steps["run"], targets), tmp_path, env)
    assert printed.split() == [str(token) for token in _unsplit_tokens()]

    decodes: list[float] = []
    for url in metrics:  # every shard served the worker's prefill and each of its decodes
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as answer:
            text = answer.read().decode("utf-8")
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        count = "shard_engine_server_call_duration_seconds_count"
        assert samples[(count, (("operation", "prefill"),))] == 1
        decodes.append(samples[(count, (("operation", "decode"),))])
    assert decodes[0] >= 7  # a step per token after the prefill's
    assert decodes == [decodes[0]] * len(HOSTS)
