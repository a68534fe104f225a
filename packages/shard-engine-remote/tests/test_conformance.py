"""The standard conformance suite against remote engines: the fake served from this process
(gRPC) and from a spawned child speaking gRPC (the tests of the process boundary), and the
llama engine (generated tiny model) from a spawned child (framed) when llama-cpp-python is
installed. The fake in a spawned child over the framed transport is the conformance session of
the remote plugin (see below)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest

from shard_engine_api import ShardEngine
from shard_engine_api.conformance import STANDARD_TESTS, ShardEngineConformance
from shard_engine_api.engine import ModelFixture, get_plugin_manager, model_fixture
from shard_engine_remote import RemoteEngine


class _RemoteSuite(ShardEngineConformance):
    engine_name = "remote"
    served: ClassVar[str] = "fake"
    isolation: ClassVar[str] = "spawn"
    transport: ClassVar[str] = "auto"

    @classmethod
    def model_fixture(cls, name: str, workdir: Path) -> ModelFixture:
        fixture = model_fixture(get_plugin_manager(), cls.served, workdir)
        return msgspec.structs.replace(
            fixture,
            options={cls.isolation: cls.served, "transport": cls.transport, **fixture.options},
        )


class TestFakeInProcessServer(_RemoteSuite):
    """Every operation crosses gRPC and the codec; the server runs in this process."""

    isolation = "in_process"


# The fake in a spawned child over the framed transport (spawn's default) is the remote
# plugin's own model fixture: ``nox -s "conformance(engine='remote')"`` runs the suite on it
# (through the entry point, in a venv of the API and this plugin only), so it is not run again
# here.


class TestFakeSpawnedChildGrpc(_RemoteSuite):
    """Every engine of these tests runs in its own supervised child process speaking gRPC
    (``"transport": "grpc"``).

    Only the standard tests below run here (the conftest deselects the others): every call of
    the suite crosses the same gRPC client and server code, with the same served fake, in
    ``TestFakeInProcessServer``; the spawned child and its supervision run the whole suite in
    the remote plugin's conformance session (framed), and every failure of a child (killed,
    aborted, stopped, exiting, failing to start, restarted, drained) is tested on both
    transports in test_faults.py and test_supervisor.py. What only a gRPC child reaches is
    its start (the child serving gRPC, the token on every call) and the process boundary
    under the gRPC link: a load, a crash, a cancel, an error, a snapshot's stream, a close."""

    isolation = "spawn"
    transport = "grpc"
    standard_tests_run: ClassVar[frozenset[str]] = frozenset(
        {
            "test_batched_decode_matches_single",
            "test_cancel_running_decode",
            "test_crash_is_permanent",
            "test_error_codes_match_taxonomy",
            "test_health_metrics_consistent",
            "test_migration_source_unchanged",
            "test_not_ready_after_close",
        }
    )


@pytest.mark.skipif(
    importlib.util.find_spec("shard_engine_llama") is None
    or importlib.util.find_spec("llama_cpp") is None,
    reason="shard-engine-llama (llama-cpp-python) is not installed",
)
class TestLlamaSpawnedChild(_RemoteSuite):
    """The llama engine on the generated tiny GGUF model, each shard in its own process.

    The engine is made directly rather than through the entry point: the ``remote`` plugin
    registers ``fixture`` evidence (it claims nothing itself) while results carry the served
    engine's class, here ``real``; the suite compares the registered class with the
    capabilities only for engines it makes through their entry point."""

    served = "llama"
    isolation = "spawn"
    standard_tests_left_out: ClassVar[frozenset[str]] = frozenset(
        {
            "test_state_machine_every_role",
            "test_state_machine_full_shard",
            "test_thousands_of_releases_keep_every_fence",
        }
    )
    """The suite's model-based and scale tests: the engine's own bookkeeping over long random
    runs of the calls every other test makes. The llama engine runs them in process (its
    conformance session), and the remote transport carries them to the fake in a child
    (framed, the remote plugin's conformance session) and in this process (gRPC, above). The
    remote layer treats every engine alike but for the import admission bound and the
    migration feature (the migration and import tests, all run here) and the child's
    environment (every test): no path of it is reached only by these three."""

    @classmethod
    def make_engine(cls, name: str) -> ShardEngine:
        return RemoteEngine()


def test_the_tests_named_to_run_or_not_are_standard_tests() -> None:
    """The tests named to run (or not) are standard tests (a renamed one would silently run
    everywhere or nowhere)."""
    assert TestFakeSpawnedChildGrpc.standard_tests_run <= set(STANDARD_TESTS)
    assert TestLlamaSpawnedChild.standard_tests_left_out <= set(STANDARD_TESTS)
