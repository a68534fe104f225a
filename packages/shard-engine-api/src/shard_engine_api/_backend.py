"""What a backend and the engine core exchange: the model a backend opened (and the
capabilities that follow from it) and one forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._errors import UnsupportedFeature
from shard_engine_api._types import (
    CONTRACT_VERSION,
    BoundaryDtype,
    Capabilities,
    Determinism,
    EvidenceClass,
    Features,
    Limits,
    LoadConfig,
    ReservedHooks,
)

__all__ = ["ForwardItem", "ModelInfo", "OutputMode", "describe"]

OutputMode = Literal["hidden", "last", "all"]
"""What a backend forward returns: hidden states of every row, or logits of the last / all rows."""


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend reports once its shard is open.

    ``spare_slot``: the backend accepts slot ``max_sessions`` too (one more than sessions are
    admitted). Then an LRU eviction that frees a slot for a new session happens only when the
    new session commits; without it the victim is dropped just before the forward.

    ``settings``: the backend's result-affecting settings as ``(name, value)`` pairs (a KV
    cache type, a micro-batch size, flash attention on or off, a context size...). The core
    fingerprints them, with the engine and its version, the model, the layer range, the
    boundary dtype and the context limit, into a session snapshot's ``settings_fingerprint``:
    a snapshot only moves between engines whose fingerprints agree, because only then does a
    moved session continue bit for bit. An engine that implements ``_export_state`` and
    ``_import_state`` also sets ``features=Features(session_migration=True)``.
    """

    engine_version: str
    evidence: EvidenceClass
    model_fingerprint: str
    hidden_size: int
    vocab_size: int
    determinism: Determinism
    features: Features = Features()
    boundary_dtypes: tuple[BoundaryDtype, ...] = ("f32", "f16")
    max_context: int | None = None
    max_sessions: int | None = None
    spare_slot: bool = False
    settings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ForwardItem:
    """One backend forward: rows ``start_pos..start_pos+n-1`` of the session in ``slot``.

    ``committed_length`` positions are cached now; positions from ``start_pos`` on are replaced.
    Exactly one of ``tokens`` (int32, shape (n,)) and ``hidden`` (float32, shape (n, hidden))
    is set.
    """

    slot: int
    start_pos: int
    committed_length: int
    tokens: npt.NDArray[np.int32] | None
    hidden: npt.NDArray[np.float32] | None

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return int(self.tokens.shape[0])
        assert self.hidden is not None
        return int(self.hidden.shape[0])


def describe(engine_name: str, config: LoadConfig, info: ModelInfo) -> Capabilities:
    """The capabilities of a shard opened with ``config`` whose backend reported ``info``."""
    if config.boundary_dtype not in info.boundary_dtypes:
        raise UnsupportedFeature(
            f"boundary dtype {config.boundary_dtype} not supported; "
            f"supported: {info.boundary_dtypes}"
        )
    return Capabilities(
        engine=engine_name,
        engine_version=info.engine_version,
        contract_version=CONTRACT_VERSION,
        evidence=info.evidence,
        shard=config.shard,
        role=config.shard.role,
        model_fingerprint=info.model_fingerprint,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        boundary_dtypes=info.boundary_dtypes,
        limits=Limits(
            max_sessions=min(config.max_sessions, info.max_sessions or config.max_sessions),
            max_context=min(config.max_context, info.max_context or config.max_context),
            max_batch_tokens=config.max_batch_tokens,
            kv_budget_tokens=config.kv_budget_tokens,
        ),
        features=msgspec.structs.replace(info.features, eviction=config.eviction == "lru"),
        determinism=info.determinism,
        reserved=ReservedHooks(),
        boundary_dtype=config.boundary_dtype,
    )
