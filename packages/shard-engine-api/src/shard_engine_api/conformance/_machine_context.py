"""What the model-based conformance machine (:mod:`._machine`) runs on: the shard
configuration, the profile (default or deep: how many sessions, how long, how large a batch),
and the context one run shares between its examples (the engine supply, the replay and
upstream shards, the declared tolerance); plus the session history the machine replays and the
"Fix:" hints of its failures.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import ErrorInfo, ShardEngineError
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryDtype,
    EvictionPolicy,
    LogitsResult,
    OutputKind,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
    numpy_dtype,
)
from shard_engine_api.conformance._harness import Harness, Tolerances
from shard_engine_api.conformance._model import Refusal

__all__ = [
    "MachineConfig",
    "MachineContext",
    "MachineProfile",
    "machine_limits",
    "upstream_limits",
]

_LIMITS: Final = {
    "max_sessions": 3,
    "max_context": 20,
    "max_batch_tokens": 16,
    "kv_budget_tokens": 26,
}
_DEEP_LIMITS: Final = {
    "max_sessions": 5,
    "max_context": 320,
    "max_batch_tokens": 64,
    "kv_budget_tokens": 400,
}
"""The deep profile (``--shard-engine-profile deep``): longer sessions (hundreds of positions,
prefills of up to 64 rows), more sessions, batches of up to 12 items in any order, a KV budget
that batches evict through."""
_UPSTREAM_LIMITS: Final = {
    "max_sessions": 2,
    "max_context": 64,
    "max_batch_tokens": 64,
    "kv_budget_tokens": 128,
}
_DEEP_UPSTREAM_LIMITS: Final = {
    "max_sessions": 2,
    "max_context": 400,
    "max_batch_tokens": 400,
    "kv_budget_tokens": 800,
}
HUGE_EPOCH: Final = 2**40
SESSION_NAMES: Final = ("a", "b", "L" * 200 + "-1", "L" * 200 + "-2")
"""The sessions of an example (two long ids sharing a 200-character prefix)."""
DEEP_SESSION_NAMES: Final = (*SESSION_NAMES, "c", "\u00e9" * 240 + "d")
PREFILL_SIZES: Final = (16, 17)
"""The large prefills a rule draws besides 1 to 5 rows (at and past max_batch_tokens)."""
DEEP_PREFILL_SIZES: Final = (16, 17, 40, 63, 64)
BATCH_SIZE: Final = 4
"""The most items of a drawn batch."""
DEEP_BATCH_SIZE: Final = 12
EpochChoice = Literal["current", "newer", "older", "huge"]
StartChoice = Literal["append", "zero", "truncate", "gap"]
PosChoice = Literal["exact", "ahead", "behind", "zero"]

FIX_ERROR: Final = {
    "stale_epoch": "keep each session's epoch and the tombstone of a released one; refuse an "
    "older epoch (or a released one) with StaleEpoch before touching any state",
    "cache_miss": "decode only at pos == committed length, prefill only at start_pos <= it; "
    "an unknown, evicted or newer-epoch session has length 0; the error carries "
    "committed_length (and reason 'evicted' for an evicted session)",
    "resource_exhausted": "count every session's cached positions against kv_budget_tokens, "
    "admit a new session only while a slot is free, refuse positions past max_context; with "
    "eviction 'lru' evict idle sessions by last use instead",
    "invalid_request": "validate inputs (token ids in range, row counts, max_batch_tokens) "
    "before any state is touched",
    "checksum_mismatch": "verify the bundle payload against its checksum",
    "success": "the request is valid under the session semantics: serve it",
}
FIX_OUTPUT: Final = (
    "an output must equal a fresh replay of the session's committed history: keep one cache "
    "per session, truncate at start_pos, start a newer epoch empty, roll back whatever fails, "
    "and never let other sessions or batching change a session's numbers beyond the declared "
    "tolerance"
)
FIX_CANCEL: Final = (
    "cancel() marks in-flight work, which stops at its next safe point, raises Cancelled and "
    "rolls back; cancelled=True exactly when the named request will not commit; a request that "
    "committed first stands and cancel() reports nothing cancelled"
)
FIX_METRICS: Final = (
    "report health and metrics as the ledger is: sessions, KV positions, requests and tokens "
    "of successful operations only, errors by code, evictions and releases"
)


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """One shard configuration the machine runs on."""

    start: int
    end: int
    n_layers: int
    dtype: BoundaryDtype
    eviction: EvictionPolicy

    @property
    def label(self) -> str:
        return f"[{self.start}, {self.end}) of {self.n_layers}, {self.dtype}, {self.eviction}"


@dataclass(frozen=True, slots=True)
class MachineProfile:
    """How far the machine looks: its sessions (long ids sharing a prefix among them), the
    limits the engine under test is loaded with and the steps of an example (48 by default:
    enough for budget pressure after truncations, releases and re-prefills); the draws of
    the deep profile (more sessions, larger prefills and batches) are
    :class:`~._machine.DeepConformanceMachine`'s rules."""

    session_names: tuple[str, ...]
    limits: dict[str, int]
    steps: int

    @classmethod
    def of(cls, deep: bool) -> MachineProfile:
        if deep:
            return cls(session_names=DEEP_SESSION_NAMES, limits=dict(_DEEP_LIMITS), steps=60)
        return cls(session_names=SESSION_NAMES, limits=dict(_LIMITS), steps=48)

    def name(self, index: int) -> str:
        return self.session_names[index]


@dataclass(slots=True)
class MachineContext:
    """What every example of one run shares: the harness that loads engines under test, the
    configuration and profile, the upstream shard (non-head shards) and the replay shard the
    outputs are compared with, and what the replay shard declares."""

    harness: Harness
    config: MachineConfig
    profile: MachineProfile
    upstream: ShardEngine | None
    replay: ShardEngine
    vocab: int
    exact: bool
    tolerance: Tolerances
    output_kind: OutputKind
    example_ids: Iterator[int] = field(default_factory=itertools.count)

    @classmethod
    def create(
        cls,
        harness: Harness,
        config: MachineConfig,
        *,
        upstream: ShardEngine | None,
        replay: ShardEngine,
        deep: bool,
    ) -> MachineContext:
        caps = replay.capabilities()
        determinism = caps.determinism
        return cls(
            harness=harness,
            config=config,
            profile=MachineProfile.of(deep),
            upstream=upstream,
            replay=replay,
            vocab=caps.vocab_size,
            exact=determinism.deterministic and determinism.batch_invariant,
            tolerance=Tolerances.declared(determinism, harness.record),
            output_kind="logits" if caps.shard.emits_logits else "hidden",
        )

    @property
    def takes_tokens(self) -> bool:
        return self.config.start == 0

    def tokens_of(self, n: int, seed: int) -> tuple[int, ...]:
        return tuple((seed * 7919 + index * 104729 + 17) % self.vocab for index in range(n))


@dataclass(slots=True)
class Segment:
    """A committed run of positions of a session and the inputs that produced it."""

    kind: Literal["prefill", "decode"]
    start: int
    inputs: ShardInput

    @property
    def n(self) -> int:
        return n_rows(self.inputs)


@dataclass(slots=True)
class History:
    tokens: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        kept: list[Segment] = []
        for segment in self.segments:
            if segment.start + segment.n <= length:
                kept.append(segment)
            elif segment.start < length:
                rows = length - segment.start
                kept.append(Segment("prefill", segment.start, head_rows(segment.inputs, rows)))
        self.segments = kept


class ContractViolation(AssertionError):
    pass


def n_rows(inputs: ShardInput) -> int:
    return len(inputs.token_ids) if isinstance(inputs, TokenInput) else inputs.n_tokens


def row_bytes(bundle: BoundaryBundle) -> int:
    return bundle.hidden_size * numpy_dtype(bundle.dtype).itemsize


def bundle_rows(
    bundle: BoundaryBundle, first: int, count: int, session: SessionRef, first_pos: int
) -> BoundaryBundle:
    """Rows ``first..first+count-1`` of ``bundle``, addressed to ``session`` at ``first_pos``."""
    width = row_bytes(bundle)
    payload = memoryview(bytes(bundle.payload[first * width : (first + count) * width]))
    return msgspec.structs.replace(
        bundle,
        session=session,
        first_pos=first_pos,
        n_tokens=count,
        payload=payload,
        checksum=payload_checksum(payload),
    )


def head_rows(inputs: ShardInput, rows: int) -> ShardInput:
    if isinstance(inputs, TokenInput):
        return TokenInput(token_ids=inputs.token_ids[:rows])
    return bundle_rows(inputs, 0, rows, inputs.session, inputs.first_pos)


def joined(segments: list[Segment], session: SessionRef) -> BoundaryBundle:
    """The bundles of ``segments`` (consecutive, from position 0) as one bundle."""
    bundles = [segment.inputs for segment in segments]
    assert all(isinstance(bundle, BoundaryBundle) for bundle in bundles)
    first = bundles[0]
    assert isinstance(first, BoundaryBundle)
    payload = memoryview(
        b"".join(bytes(bundle.payload) for bundle in bundles if isinstance(bundle, BoundaryBundle))
    )
    return msgspec.structs.replace(
        first,
        session=session,
        first_pos=0,
        n_tokens=sum(n_rows(bundle) for bundle in bundles),
        payload=payload,
        checksum=payload_checksum(payload),
    )


def output_rows(result: ShardResult) -> npt.NDArray[np.floating]:
    if isinstance(result, LogitsResult):
        return np.array(result.array())
    return np.array(result.bundle.array())


def fix_for(refusal: Refusal) -> str:
    return FIX_ERROR.get(refusal.errors[0].code, FIX_ERROR["success"])


def message_of(error: ShardEngineError | ErrorInfo) -> str:
    return error.message


def upstream_limits(deep: bool = False) -> dict[str, int]:
    """Load overrides of the upstream and replay shards: room for any history (of the deep
    profile's longer sessions too)."""
    return dict(_DEEP_UPSTREAM_LIMITS if deep else _UPSTREAM_LIMITS)


def machine_limits() -> dict[str, int]:
    return dict(_LIMITS)
