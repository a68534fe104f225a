"""Addresses a server listens on and a client dials: a port out of range or an address that is
not HOST:PORT is InvalidRequest. gRPC itself takes a port past 65535 modulo 65536, so
``--listen 127.0.0.1:99999`` used to serve on port 34463 and a client dialled it too."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import config

import shard_engine_api as api
from shard_engine_remote import RemoteEngine, ServerSecurity

_BAD_PORTS = ["99999", "65536", "-1", "", "7x", "0x10", "\uff11\uff12\uff13", "7450 "]


@pytest.mark.parametrize("port", _BAD_PORTS)
def test_a_listen_port_out_of_range_is_refused(port: str) -> None:
    with pytest.raises(api.InvalidRequest, match="the port must be a number from 0 to 65535"):
        ServerSecurity().check_listen(f"127.0.0.1:{port}")


@pytest.mark.parametrize("address", ["127.0.0.1", ":7450", "[::1:7450", "::1]:7450", "localhost"])
def test_a_listen_address_that_is_not_host_and_port_is_refused(address: str) -> None:
    with pytest.raises(api.InvalidRequest, match="HOST:PORT"):
        ServerSecurity().check_listen(address)


@pytest.mark.parametrize(
    "address", ["127.0.0.1:0", "127.0.0.1:65535", "[::1]:7450", "localhost:1", "unix:/x/y.sock"]
)
def test_good_listen_addresses_pass(address: str) -> None:
    ServerSecurity().check_listen(address)


@pytest.mark.parametrize("port", [*_BAD_PORTS, "0"])
def test_a_target_port_out_of_range_is_refused_at_load(port: str) -> None:
    engine = RemoteEngine()
    try:
        with pytest.raises(api.InvalidRequest, match="the port must be a number from 1 to 65535"):
            engine.load(config(target=f"127.0.0.1:{port}", timeout_s=2))
    finally:
        engine.close()


def test_serve_refuses_a_port_out_of_range_without_serving() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shard_engine_api.cli",
            "serve",
            "--engine",
            "fake",
            "--layers",
            "0:6",
            "--listen",
            "127.0.0.1:99999",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "the port must be a number from 0 to 65535" in done.stderr
    assert "serving" not in done.stdout
