"""The ``remote`` plugin of the ``shard_engine`` entry-point group: its one registration hook.

grpc is imported only when a remote engine is made or a command runs, so listing engines stays
cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from shard_engine_api import InvalidRequest, ShardEngine
from shard_engine_api.engine import (
    CliSubparsers,
    EngineDescription,
    ModelFixture,
    get_plugin_manager,
    hookimpl,
)

ENGINE_NAME = "remote"
SERVED_ENGINE_ENV = "SHARD_ENGINE_REMOTE_SERVE"
"""The engine the model fixture serves remotely (default ``fake``)."""
ISOLATION_ENV = "SHARD_ENGINE_REMOTE_ISOLATION"
"""How the model fixture serves it: ``spawn`` (a child process, the default) or ``in_process``
(a server in the calling process)."""


def _new_engine() -> ShardEngine:
    from shard_engine_remote._client import RemoteEngine

    return RemoteEngine()


def _model_fixture(workdir: Path) -> ModelFixture:
    """The served engine's own fixture, loaded through a remote engine: the conformance suite
    and ``shard-engine run --engine remote`` then cross the transport for every call."""
    from shard_engine_api.engine import model_fixture

    served = os.environ.get(SERVED_ENGINE_ENV, "fake")
    isolation = os.environ.get(ISOLATION_ENV, "spawn")
    if isolation not in ("spawn", "in_process"):
        raise InvalidRequest(f"${ISOLATION_ENV} must be 'spawn' or 'in_process', not {isolation!r}")
    if served == ENGINE_NAME:
        raise InvalidRequest(f"${SERVED_ENGINE_ENV} names an engine to serve, not {ENGINE_NAME!r}")
    fixture = model_fixture(get_plugin_manager(), served, workdir)
    return msgspec.structs.replace(
        fixture,
        options={isolation: served, **fixture.options},
        description=f"{fixture.description}; served by the {served} engine ({isolation})",
        # Tokenizers belong to the served engine's plugin.
        has_tokenizer=False,
    )


def _add_cli_commands(subparsers: CliSubparsers) -> None:
    from shard_engine_remote import _commands

    _commands.add_commands(subparsers)


@hookimpl
def shard_engine_register() -> EngineDescription:
    return EngineDescription(
        name=ENGINE_NAME,
        factory=_new_engine,
        # Results carry the served engine's evidence class; the plugin itself claims nothing.
        evidence="fixture",
        summary=(
            "Another engine in a supervised child process (framed codec on a private socket) "
            "or on another machine (gRPC)"
        ),
        model_fixture=_model_fixture,
        add_cli_commands=_add_cli_commands,
    )
