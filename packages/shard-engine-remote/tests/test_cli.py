"""The command line: `shard-engine serve` hosts an engine until SIGTERM, and
`shard-engine run --isolation process` runs every shard of the pipeline in its own process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RemoteFactory, config, decode, prefill

import shard_engine_api as api
from shard_engine_api import cli


def test_serve_until_sigterm(tmp_path: Path, remote: RemoteFactory) -> None:
    """serve prints where it listens, serves remote engines, and on SIGTERM drains, closes
    the engine and exits 0."""
    listen = f"unix:{tmp_path}/engine.sock"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "shard_engine_api.cli", "serve", "--engine", "fake"),
            *("--layers", "0:3", "--listen", listen),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert "serving" in banner
        assert listen in banner
        engine = remote(config(0, 3, target=listen))
        assert engine.capabilities().role == "head"
        prefill(engine)
        decode(engine, 3)
        with pytest.raises(api.ShardMismatch):
            remote(config(0, 6, target=listen))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "stopped" in process.stdout.read()
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_serve_refuses_beyond_loopback_without_tls(capsys: pytest.CaptureFixture[str]) -> None:
    """Any address other than loopback without TLS and a token: exit 2, nothing loaded."""
    code = cli.main(["serve", "--engine", "fake", "--layers", "0:6", "--listen", "0.0.0.0:0"])
    assert code == 2
    assert "needs TLS" in capsys.readouterr().err


def test_run_with_a_process_per_shard(capsys: pytest.CaptureFixture[str]) -> None:
    """run --isolation process: three shards in three child processes, verified against one
    full shard (also in a child)."""
    code = cli.main(["run", "--engine", "fake", "--isolation", "process", "--max-new-tokens", "3"])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "remote[2:4] (middle)" in output
    assert "verify against one full shard: PASS" in output
