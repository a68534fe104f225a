"""Hook specifications of the ``shard_engine`` plugin project.

An engine distribution registers a module under the entry-point group ``shard_engine``; the
entry-point name is the engine name. The module holds only ``@hookimpl`` functions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pluggy

from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import EvidenceClass, LoadConfig, OptionValue, ShardSpec

__all__ = [
    "PROJECT_NAME",
    "EngineSpec",
    "ModelFixture",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "shard_engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An engine a plugin provides: its name (equal to its entry-point name), a factory that
    returns a new, unloaded engine, the evidence class its results carry, a one-line summary."""

    name: str
    factory: Callable[[], ShardEngine]
    evidence: EvidenceClass
    description: str = ""


class ModelFixture(msgspec.Struct, frozen=True, kw_only=True):
    """A model an engine can run without downloads: what the conformance suite and the ``run``
    command use. ``model`` is the engine's model reference (a path, a built-in name)."""

    model: str
    n_layers: int
    options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    description: str = ""
    has_tokenizer: bool = False
    cancel_options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    """Extra load options that make operations slow enough for the conformance suite's
    cancellation test to land a cancel mid-operation (e.g. an injected delay)."""
    synthetic: bool = True
    """True for a generated or built-in model: results on it are never a real-model
    certification, whatever the engine's evidence class."""
    crash_options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    """Extra load options under which the engine's backend fails on its next prefill or decode
    (an injected crash): the conformance suite checks that the call and every later one raise
    EngineCrashed and that health says "failed". Empty: the crash test is skipped."""
    splits: tuple[tuple[int, ...], ...] = ()
    """Pipelines the suite checks for split invariance besides its own even 2- and 3-way splits,
    each as its layer boundaries from 0 to ``n_layers`` (``(0, 1, 6)`` is ``[0, 1) + [1, 6)``).
    Uneven splits are the interesting ones."""

    def shard(self, start: int, end: int) -> ShardSpec:
        """The spec of layers ``[start, end)`` of this model."""
        return ShardSpec(model=self.model, n_layers=self.n_layers, start=start, end=end)

    def config(self, start: int = 0, end: int | None = None, **overrides: object) -> LoadConfig:
        """A LoadConfig for layers ``[start, end)`` (default: all) with this fixture's options;
        ``overrides`` replace LoadConfig fields (options are merged)."""
        options = dict(self.options)
        extra = overrides.pop("options", None)
        if isinstance(extra, dict):
            options.update(extra)
        fields: dict[str, object] = {
            "shard": self.shard(start, self.n_layers if end is None else end),
            "options": options,
        }
        fields.update(overrides)
        return msgspec.convert(fields, LoadConfig, from_attributes=True, strict=False)


class EngineHookSpecs:
    """The hooks engines implement. Every hook is optional except ``shard_engine_register``."""

    @hookspec
    def shard_engine_register(self) -> EngineSpec:  # type: ignore[empty-body]
        """Return the engine this plugin provides."""

    @hookspec(firstresult=True)
    def shard_engine_model_fixture(self, engine_name: str, workdir: Path) -> ModelFixture | None:
        """Return the small model that ``engine_name`` runs the conformance suite and the
        ``run`` command on, generating files under ``workdir`` if needed; None if this plugin
        does not provide ``engine_name``."""

    @hookspec(firstresult=True)
    def shard_engine_describe_model(self, engine_name: str, model: str) -> ModelFixture | None:
        """Describe a user-given model reference (e.g. a GGUF path passed to ``run --model``):
        its layer count and options; None if this plugin does not provide ``engine_name``.
        Raise InvalidRequest/UnsupportedFeature for a model the engine cannot run."""

    @hookspec(firstresult=True)
    def shard_engine_tokenize(self, engine_name: str, model: str, text: str) -> list[int] | None:
        """Return the token ids of ``text`` for ``model``, or None if not this plugin's."""

    @hookspec(firstresult=True)
    def shard_engine_detokenize(
        self, engine_name: str, model: str, token_ids: Sequence[int]
    ) -> str | None:
        """Return the text of ``token_ids`` for ``model``, or None if not this plugin's."""

    @hookspec
    def shard_engine_add_cli_commands(
        self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
    ) -> None:
        """Add the plugin's own subcommands to the ``shard-engine`` CLI. A subcommand sets
        ``func`` (``Callable[[argparse.Namespace], int]``) with ``set_defaults``."""
