"""The package surface: pinned exports, the plugin module and the entry point."""

from __future__ import annotations

import argparse
import inspect
import stat
from pathlib import Path

import pytest

import shard_engine_api as api
import shard_engine_remote
from shard_engine_api import wire
from shard_engine_api.engine import EngineDescription, check_pending, get_plugin_manager
from shard_engine_remote import RemoteEngine, is_loopback, plugin

EXPECTED_ALL = [
    "CALL_METHOD",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENGINE_VERSION",
    "SERVICE_NAME",
    "TOKEN_ENV_VAR",
    "ChildProcess",
    "ClientSecurity",
    "EngineServer",
    "OutcomeUnknown",
    "RateLimit",
    "RemoteEngine",
    "RemoteOptions",
    "RemoteUnavailable",
    "ServerCounters",
    "ServerSecurity",
    "ServerStats",
    "Unauthenticated",
    "__version__",
    "is_loopback",
    "serve_until_signalled",
]


def test_all_is_sorted_and_pinned() -> None:
    assert shard_engine_remote.__all__ == EXPECTED_ALL

    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)

    assert shard_engine_remote.__all__ == sorted(shard_engine_remote.__all__, key=kind)
    for name in shard_engine_remote.__all__:
        assert hasattr(shard_engine_remote, name), name


def test_link_errors_a_worker_catches_without_this_package() -> None:
    """OutcomeUnknown and Unauthenticated are the API's classes (a worker catches them, and
    they keep their class across another hop's wire); RemoteUnavailable is NotReady."""
    assert shard_engine_remote.OutcomeUnknown is api.OutcomeUnknown
    assert shard_engine_remote.Unauthenticated is api.Unauthenticated
    assert issubclass(shard_engine_remote.RemoteUnavailable, api.NotReady)
    assert shard_engine_remote.RemoteUnavailable.code == api.NotReady.code
    unknown = api.OutcomeUnknown("lost", details={"reason": "connection_lost"})
    back = wire.error_from_info(unknown.to_info())
    assert type(back) is api.OutcomeUnknown
    assert back.retryable
    assert back.details == {"reason": "connection_lost"}


def test_plugin_module_holds_one_registration_hook() -> None:
    hooks = {
        name
        for name, value in vars(plugin).items()
        if inspect.isfunction(value)
        and value.__module__ == plugin.__name__
        and hasattr(value, "shard_engine_impl")
    }
    assert hooks == {"shard_engine_register"}
    description = plugin.shard_engine_register()
    assert isinstance(description, EngineDescription)
    assert (description.name, description.evidence) == ("remote", "fixture")
    assert description.model_fixture is not None
    assert description.add_cli_commands is not None


def test_entry_point_and_unloaded_engine() -> None:
    manager = get_plugin_manager()
    check_pending(manager)
    engines = {engine.name: engine for engine in api.installed_engines(manager)}
    assert engines["remote"].distribution == "shard-engine-remote"
    engine = api.load_engine("remote", manager=manager)
    assert isinstance(engine, RemoteEngine)
    assert isinstance(engine, api.ShardEngine)
    assert engine.name == "remote"
    assert engine.health().state == "unloaded"
    with pytest.raises(api.NotReady):
        engine.capabilities()
    engine.close()
    assert engine.health().state == "closed"


def test_model_fixture_serves_the_fake_in_a_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(plugin.SERVED_ENGINE_ENV, raising=False)
    monkeypatch.delenv(plugin.ISOLATION_ENV, raising=False)
    make_fixture = plugin.shard_engine_register().model_fixture
    assert make_fixture is not None
    fixture = make_fixture(tmp_path)
    assert fixture.options["spawn"] == "fake"
    assert fixture.cancel_options, "the served engine's cancel options are kept"
    monkeypatch.setenv(plugin.ISOLATION_ENV, "thread")
    with pytest.raises(api.InvalidRequest, match="spawn"):
        make_fixture(tmp_path)


def test_serve_command_is_added() -> None:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    add_commands = plugin.shard_engine_register().add_cli_commands
    assert add_commands is not None
    add_commands(subparsers)
    args = parser.parse_args(
        ["serve", "--engine", "fake", "--layers", "2:4", "--option", "seed=7", "--option", "x=y"]
    )
    assert args.layers == (2, 4)
    assert args.option == [("seed", 7), ("x", "y")]
    assert args.listen == "127.0.0.1:7450"


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.9.9.9:1", True),
        ("localhost:1", True),
        ("[::1]:1", True),
        ("unix:/tmp/x.sock", True),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.0.0.2:1", False),
        ("example.org:1", False),
    ],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_options_are_checked() -> None:
    engine = RemoteEngine()
    base = {"model": "fake", "n_layers": 6, "start": 0, "end": 6}
    shard = api.ShardSpec(**base)  # type: ignore[arg-type]
    with pytest.raises(api.InvalidRequest, match="exactly one"):
        engine.load(api.LoadConfig(shard=shard))
    with pytest.raises(api.InvalidRequest, match="exactly one"):
        engine.load(api.LoadConfig(shard=shard, options={"spawn": "fake", "target": "unix:/x"}))
    with pytest.raises(api.InvalidRequest, match="timeout_s"):
        engine.load(api.LoadConfig(shard=shard, options={"spawn": "fake", "timeout_s": "soon"}))
    with pytest.raises(api.InvalidRequest, match="for a served engine"):
        engine.load(api.LoadConfig(shard=shard, options={"target": "unix:/x", "seed": 1}))
    assert engine.health().state == "unloaded", "a refused load leaves it loadable"


def test_private_socket_directory(tmp_path: Path) -> None:
    child = shard_engine_remote.ChildProcess("fake")
    try:
        mode = stat.S_IMODE(child.directory.stat().st_mode)
        assert mode == 0o700
        assert child.address == f"unix:{child.directory / 'engine.sock'}"
        environment = child.environment()
        assert environment[shard_engine_remote.TOKEN_ENV_VAR] == child.token
    finally:
        child.stop()
    assert not child.directory.exists()
