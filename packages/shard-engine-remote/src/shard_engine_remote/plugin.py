"""The ``remote`` plugin of the ``shard_engine`` entry-point group: hook implementations only."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

from shard_engine_api import EngineSpec, InvalidRequest, ModelFixture, hookimpl

ENGINE_NAME = "remote"
SERVED_ENGINE_ENV = "SHARD_ENGINE_REMOTE_SERVE"
"""The engine the conformance fixture serves remotely (default ``fake``)."""
ISOLATION_ENV = "SHARD_ENGINE_REMOTE_ISOLATION"
"""How the conformance fixture serves it: ``spawn`` (a child process, the default) or
``in_process`` (a server in the test process)."""


@hookimpl
def shard_engine_register() -> EngineSpec:
    from shard_engine_remote._client import RemoteEngine

    return EngineSpec(
        name=ENGINE_NAME,
        factory=RemoteEngine,
        # Results carry the served engine's evidence class; the plugin itself claims nothing.
        evidence="fixture",
        description="Another engine in a supervised child process or on another machine (gRPC)",
    )


@hookimpl
def shard_engine_model_fixture(engine_name: str, workdir: Path) -> ModelFixture | None:
    if engine_name != ENGINE_NAME:
        return None
    from shard_engine_api._plugins import get_plugin_manager, model_fixture

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


@hookimpl
def shard_engine_add_cli_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    from shard_engine_remote import _commands

    _commands.add_commands(subparsers)
