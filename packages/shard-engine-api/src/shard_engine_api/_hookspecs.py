"""Hook specification of the ``shard_engine`` plugin project, and what a plugin registers.

An engine distribution names a module under the entry-point group ``shard_engine``; the
entry-point name is the engine name. The module holds one ``@hookimpl`` function,
``shard_engine_register``, returning an :class:`EngineDescription`: everything the project
asks of an engine (a factory, its evidence class, optionally a model fixture, a model
describer, a tokenizer and CLI subcommands) in one object, so no hook is keyed by engine name.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

import msgspec
import pluggy

from shard_engine_api._errors import InvalidRequest
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import EvidenceClass, LoadConfig, OptionValue, ShardSpec

__all__ = [
    "PROJECT_NAME",
    "TEST_OPTIONS_ENV",
    "ChatMessage",
    "ChatTokenizer",
    "CliSubparsers",
    "EngineDescription",
    "EngineHookSpecs",
    "ModelFixture",
    "Tokenizer",
    "hookimpl",
    "hookspec",
    "test_options_enabled",
]

PROJECT_NAME = "shard_engine"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

TEST_OPTIONS_ENV = "SHARD_ENGINE_TEST_OPTIONS"
"""The environment variable that lets an engine accept its test-only load options (injected
crashes, aborts, delays: a fixture's ``cancel_options`` and ``crash_options``). Whoever starts
the process decides, never whoever sends a LoadConfig: a worker that loads configurations a
coordinator sends cannot be told to abort. The conformance suite sets it to ``1`` in its own
process (spawned engine processes inherit it); production processes leave it unset."""


def test_options_enabled() -> bool:
    """Whether this process accepts engines' test-only load options (see
    :data:`TEST_OPTIONS_ENV`)."""
    return os.environ.get(TEST_OPTIONS_ENV) == "1"


CliSubparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What ``shard-engine`` hands to :attr:`EngineDescription.add_cli_commands`."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, for one model."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (ids without text render as the engine chooses)."""
        ...


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One message of a conversation: who says it (``role``: "system", "user", "assistant")
    and what (``content``)."""

    role: str
    content: str


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A :class:`Tokenizer` that also applies its model's chat template: an optional feature,
    checked with ``isinstance(tokenizer, ChatTokenizer)``. A tokenizer of this type whose model
    has no chat template raises UnsupportedFeature, naming why, from each method."""

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        """``messages`` as the model's chat template writes them, with the assistant's turn
        opened (the text a generation continues)."""
        ...

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The token ids of :meth:`apply_chat_template`, its turn markers as the model's
        special tokens (never spelled out as text)."""
        ...

    def end_of_turn_tokens(self) -> tuple[int, ...]:
        """The ids of the tokens that end the assistant's turn: a generation stops at any."""
        ...


class ModelFixture(msgspec.Struct, frozen=True, kw_only=True):
    """A model an engine can run without downloads: what the conformance suite and the ``run``
    command use. ``model`` is the engine's model reference (a path, a built-in name)."""

    model: str
    n_layers: int
    options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    description: str = ""
    has_tokenizer: bool = False
    cancel_options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    """Extra load options that make operations (prefill, decode, decode_batch) slow enough
    for the conformance suite's cancellation tests to land a cancel mid-operation (e.g. an
    injected delay). With them, a cancellation test that lands no cancel fails rather than
    being skipped. Test-only options belong behind :data:`TEST_OPTIONS_ENV`, which the suite
    sets."""
    synthetic: bool = True
    """True for a generated or built-in model: results on it are never a real-model
    certification, whatever the engine's evidence class."""
    crash_options: dict[str, OptionValue] = msgspec.field(default_factory=dict)
    """Extra load options under which the engine's backend fails on its next prefill or decode
    (an injected crash): the conformance suite checks that the call and every later one raise
    EngineCrashed and that health says "failed". Empty: the crash test is skipped. An engine
    should accept such options only when :func:`test_options_enabled`."""
    splits: tuple[tuple[int, ...], ...] = ()
    """Pipelines the suite checks for split invariance besides its own even 2- and 3-way splits,
    each as its layer boundaries from 0 to ``n_layers`` (``(0, 1, 6)`` is ``[0, 1) + [1, 6)``).
    Uneven splits are the interesting ones."""

    def shard(self, start: int, end: int) -> ShardSpec:
        """The spec of layers ``[start, end)`` of this model."""
        return ShardSpec(model=self.model, n_layers=self.n_layers, start=start, end=end)

    def config(self, start: int = 0, end: int | None = None, **overrides: object) -> LoadConfig:
        """A LoadConfig for layers ``[start, end)`` (default: all) with this fixture's options;
        ``overrides`` replace LoadConfig fields (options are merged). Raises InvalidRequest
        for a value LoadConfig refuses."""
        options = dict(self.options)
        extra = overrides.pop("options", None)
        if isinstance(extra, dict):
            options.update(extra)
        fields: dict[str, object] = {
            "shard": self.shard(start, self.n_layers if end is None else end),
            "options": options,
        }
        fields.update(overrides)
        try:
            return msgspec.convert(fields, LoadConfig, from_attributes=True, strict=False)
        except msgspec.ValidationError as error:
            # The contract's error at the API edge, as for a LoadConfig built directly.
            raise InvalidRequest(f"LoadConfig: {error}") from None


class EngineDescription(msgspec.Struct, frozen=True, kw_only=True):
    """What a plugin's ``shard_engine_register`` returns: one engine and what it supplies.

    Required: ``name`` (equal to the entry-point name), ``factory`` (returns a new, unloaded
    engine; called once per engine instance), ``evidence`` (the class every result carries).
    Optional (None = not supplied):

    - ``summary``: one line for ``shard-engine engines``.
    - ``model_fixture(workdir) -> ModelFixture``: the small model the conformance suite and
      ``shard-engine run`` use when no model is given; files it generates go under
      ``workdir`` (created by the engine if needed, checked with ``model_store(workdir)``).
    - ``describe_model(model) -> ModelFixture``: what a user-given model reference (a GGUF
      path, ``fake:layers=4``) is: its layer count and options. Raises InvalidRequest or
      UnsupportedFeature for a model the engine cannot run.
    - ``tokenizer(model) -> Tokenizer | None``: text in and out for ``model``; None when that
      model has no tokenizer.
    - ``add_cli_commands(subparsers)``: add subcommands to ``shard-engine``; each sets
      ``func`` (``Callable[[argparse.Namespace], int]``) with ``set_defaults``.
    """

    name: str
    factory: Callable[[], ShardEngine]
    evidence: EvidenceClass
    summary: str = ""
    model_fixture: Callable[[Path], ModelFixture] | None = None
    describe_model: Callable[[str], ModelFixture] | None = None
    tokenizer: Callable[[str], Tokenizer | None] | None = None
    add_cli_commands: Callable[[CliSubparsers], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"EngineDescription.name must be a non-empty string: {self.name!r}")
        if self.evidence not in ("fixture", "real"):
            raise TypeError(
                f"EngineDescription.evidence must be 'fixture' or 'real', got {self.evidence!r}"
            )
        for field in ("factory", "model_fixture", "describe_model", "tokenizer"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"EngineDescription.{field} must be callable, got {value!r}")
        if self.add_cli_commands is not None and not callable(self.add_cli_commands):
            raise TypeError("EngineDescription.add_cli_commands must be callable")


class EngineHookSpecs:
    """The hook an engine plugin implements (the only one: everything else is a field of the
    description it returns)."""

    @hookspec
    def shard_engine_register(self) -> EngineDescription:  # type: ignore[empty-body]
        """Return the engine this plugin provides. Called once per plugin manager; keep it
        cheap (import heavy backends inside ``factory``, not at module level)."""
