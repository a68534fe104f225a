"""`shard-engine serve` as an operator meets it: a port already in use is one line, the help
is complete, and the boundary dtypes are run's."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import msgspec
import pytest
from conftest import FramedPeer, free_port

from shard_engine_api import InvalidRequest
from shard_engine_api.cli import build_parser
from shard_engine_api.wire import BOUNDARY_DTYPES
from shard_engine_remote._framed import frames
from shard_engine_remote._security import check_port_free


def _serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["serve"]
            return parser
    raise AssertionError("shard-engine has no subcommands")


def test_a_port_in_use_is_one_line_without_grpc_log_noise() -> None:
    """Another socket listens on the port: serve exits 2 with the CLI's one line, and gRPC's
    C core never gets to log its own bind failure."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["serve", "--engine", "fake", "--layers", "0:2", "--listen", f"127.0.0.1:{port}"]
        completed = subprocess.run(
            [sys.executable, "-m", "shard_engine_api.cli", *command],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    assert completed.returncode == 2
    assert completed.stderr.count("\n") == 1, completed.stderr
    assert completed.stderr.startswith(
        f"shard-engine serve: InvalidRequest [invalid_request]: cannot listen on 127.0.0.1:{port}: "
        "the port is in use"
    ), completed.stderr


def test_a_free_port_and_port_zero_pass_the_check() -> None:
    check_port_free(f"127.0.0.1:{free_port()}")
    check_port_free("127.0.0.1:0")
    check_port_free("unix:/nonexistent/engine.sock")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InvalidRequest, match="the port is in use"):
            check_port_free(f"127.0.0.1:{taken.getsockname()[1]}")


def test_serve_with_a_metrics_endpoint_until_sigterm() -> None:
    """serve --metrics-listen prints the endpoint after the serving line; a scrape there has
    the engine's state, and SIGTERM still ends the server (and the endpoint) with status 0."""
    command = ["serve", "--engine", "fake", "--layers", "0:2", "--listen", "127.0.0.1:0"]
    with subprocess.Popen(
        [sys.executable, "-m", "shard_engine_api.cli", *command, "--metrics-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline().startswith("serving fake [0:2)")
            announced = process.stdout.readline()
            assert announced.startswith("metrics (Prometheus text format) on http://127.0.0.1:")
            url = announced.split(" on ", 1)[1].strip()
            with urllib.request.urlopen(url, timeout=30) as answer:
                text = answer.read().decode("utf-8")
            assert 'shard_engine_state{state="ready"} 1.0' in text
            assert "shard_engine_requests_total 0.0" in text
            process.send_signal(signal.SIGTERM)
            _, errors = process.communicate(timeout=120)
            assert process.returncode == 0, errors
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()


def test_serve_help_is_complete() -> None:
    """Each option says what it is; the framed example keeps its line break; bf16 is offered
    as in run."""
    serve = _serve_parser()
    help_text = serve.format_help()
    assert "--transport framed \\\n        --listen unix:" in help_text
    for action in serve._actions:
        assert action.help, action.option_strings
        if "--boundary-dtype" in action.option_strings:
            assert action.choices is not None
            assert sorted(action.choices) == sorted(BOUNDARY_DTYPES)


def test_max_connections_below_one_is_refused_before_the_engine_loads() -> None:
    command = ["serve", "--engine", "fake", "--layers", "0:2", "--listen", "127.0.0.1:0"]
    completed = subprocess.run(
        [sys.executable, "-m", "shard_engine_api.cli", *command, "--max-connections", "0"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 2
    assert completed.stderr == (
        "shard-engine serve: InvalidRequest [invalid_request]: --max-connections must be >= 1, "
        "got 0\n"
    )


def test_max_connections_bounds_a_framed_server(tmp_path: Path) -> None:
    """serve --transport framed --max-connections 1: a first connection is greeted, a second
    refused retryably (RESOURCE_EXHAUSTED) while the first holds its place."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    address = f"unix:{private / 'engine.sock'}"
    command = ["serve", "--engine", "fake", "--layers", "0:2", "--listen", address]
    options = ["--transport", "framed", "--max-connections", "1"]
    with subprocess.Popen(
        [sys.executable, "-m", "shard_engine_api.cli", *command, *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        peers: list[FramedPeer] = []
        try:
            assert process.stdout is not None
            assert process.stdout.readline().startswith("serving fake [0:2)")
            peers.append(FramedPeer(address, token=""))
            assert peers[0].greeting()[0] == frames.HELLO
            peers.append(FramedPeer(address, token=""))
            kind, _, body = peers[1].greeting()
            assert kind == frames.ERROR
            assert msgspec.msgpack.decode(body)[0] == "RESOURCE_EXHAUSTED"
            process.send_signal(signal.SIGTERM)
            _, errors = process.communicate(timeout=120)
            assert process.returncode == 0, errors
        finally:
            for peer in peers:
                peer.close()
            if process.poll() is None:
                process.kill()
                process.communicate()
