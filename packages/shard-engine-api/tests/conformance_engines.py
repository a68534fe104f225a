"""Engines the conformance suite is tested with: a small correct reference engine and broken
variants, each violating one rule of the contract.

The reference model is a toy that is deterministic, exactly split-invariant and depends on
the whole history: each layer maps a row ``x`` at position ``p`` to
``softsign(a * x + b * mean(x[0..p]) + c)``, with the running sums cached per layer and
position. Only IEEE-exact elementwise operations and same-shape reductions are used, so any
split, chunking or batching reproduces the same bits.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar, Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    BoundaryResult,
    Capabilities,
    Determinism,
    EvidenceClass,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    Metrics,
    SessionRef,
    ShardInput,
    Timings,
    WrongRole,
)
from shard_engine_api._fences import Fence, FenceTable
from shard_engine_api._ledger import Admission
from shard_engine_api.engine import (
    CancelToken,
    EngineCore,
    EngineDescription,
    ForwardItem,
    ModelFixture,
    ModelInfo,
    OutputMode,
    hookimpl,
)

__all__ = [
    "BROKEN_ENGINES",
    "CANCEL_OPTIONS",
    "CRASH_OPTIONS",
    "ReferenceEngine",
    "ReferencePlugin",
    "reference_fixture",
]

REFERENCE_LAYERS: Final = 4
CANCEL_OPTIONS: Final[dict[str, object]] = {"forward_delay_ms": 1.0}
"""Load options that make a forward slow enough (1 ms per row) to be cancelled mid-way."""
CRASH_OPTIONS: Final[dict[str, object]] = {"crash": True}
"""Load options under which the first forward fails as a backend would (an exception)."""

Array = npt.NDArray[np.float32]


def reference_fixture(
    workdir: Path, n_layers: int = REFERENCE_LAYERS, evidence: EvidenceClass = "fixture"
) -> ModelFixture:
    """Write the toy model file under ``workdir`` and describe it. ``evidence="real"`` makes
    the engine claim real evidence everywhere (a consistent claim the suite cannot refute)."""
    path = workdir / "toy-model.json"
    path.write_text(json.dumps({"seed": 7, "n_layers": n_layers, "hidden": 8, "vocab": 32}))
    return ModelFixture(
        model=str(path),
        n_layers=n_layers,
        options={"evidence": evidence} if evidence != "fixture" else {},
        description=f"toy history-dependent model, {n_layers} layers, hidden 8, vocab 32",
        # Claiming real evidence stands in for a real model in these tests of the report.
        synthetic=evidence == "fixture",
        cancel_options=dict(CANCEL_OPTIONS),
        crash_options=dict(CRASH_OPTIONS),
        splits=((0, 1, 4), (0, 1, 3, 4), (0, 3, 4)),
    )


class ReferencePlugin:
    """A ``shard_engine`` plugin providing the reference engine as ``name``, registering
    ``evidence`` in its EngineDescription and claiming ``engine_evidence`` in its capabilities."""

    def __init__(
        self,
        name: str = "reference",
        evidence: EvidenceClass = "fixture",
        engine_evidence: EvidenceClass | None = None,
    ) -> None:
        self.name = name
        self.evidence = evidence
        self.engine_evidence: EvidenceClass = engine_evidence or evidence

    @hookimpl
    def shard_engine_register(self) -> EngineDescription:
        return EngineDescription(
            name=self.name,
            factory=ReferenceEngine,
            evidence=self.evidence,
            summary="conformance reference engine",
            model_fixture=self.model_fixture,
        )

    def model_fixture(self, workdir: Path) -> ModelFixture:
        return reference_fixture(workdir, evidence=self.engine_evidence)


class _ToyModel:
    def __init__(self, path: Path) -> None:
        spec = json.loads(path.read_text())
        self.n_layers = int(spec["n_layers"])
        self.hidden = int(spec["hidden"])
        self.vocab = int(spec["vocab"])
        self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        generator = np.random.default_rng(int(spec["seed"]))

        def draw(*shape: int) -> Array:
            return generator.uniform(-1.0, 1.0, size=shape).astype(np.float32)

        self.embedding = draw(self.vocab, self.hidden)
        self.scale = draw(self.n_layers, self.hidden)
        self.history_scale = draw(self.n_layers, self.hidden)
        self.bias = draw(self.n_layers, self.hidden)
        self.output = draw(self.vocab, self.hidden)


class ReferenceEngine(EngineCore):
    """A correct engine on EngineCore. Options: ``forward_delay_ms`` (cancellable sleep per
    row, for the cancellation test), ``crash`` (the first forward raises, for the crash test)
    and ``evidence`` ("fixture" by default)."""

    engine_name: ClassVar[str] = "reference"

    def __init__(self) -> None:
        super().__init__()
        self._model: _ToyModel | None = None
        self._sums: dict[int, Array] = {}
        self._undo: dict[int, tuple[int, Array]] = {}
        self._delay_s = 0.0
        self._crash = False

    # ----------------------------------------------------------------- backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
        unknown = set(config.options) - {"forward_delay_ms", "evidence", "crash"}
        if unknown:
            raise InvalidRequest(f"unknown options {sorted(unknown)}")
        model = _ToyModel(Path(config.shard.model))
        if model.n_layers != config.shard.n_layers:
            raise InvalidRequest(f"model has {model.n_layers} layers, spec says otherwise")
        self._model = model
        delay_ms = config.options.get("forward_delay_ms", 0.0)
        if not isinstance(delay_ms, int | float):
            raise InvalidRequest(f"forward_delay_ms must be a number, got {delay_ms!r}")
        self._delay_s = float(delay_ms) / 1000.0
        self._crash = config.options.get("crash") is True
        evidence = config.options.get("evidence", "fixture")
        if evidence not in ("fixture", "real"):
            raise InvalidRequest(f"evidence must be fixture or real, got {evidence!r}")
        return ModelInfo(
            engine_version="0.0-test",
            evidence="real" if evidence == "real" else "fixture",
            model_fingerprint=model.fingerprint,
            hidden_size=model.hidden,
            vocab_size=model.vocab,
            determinism=Determinism(deterministic=True, split_exact=True),
        )

    @property
    def toy(self) -> _ToyModel:
        assert self._model is not None
        return self._model

    def _slot_sums(self, slot: int) -> Array:
        sums = self._sums.get(slot)
        if sums is None:
            shard = self.config.shard
            sums = np.zeros(
                (shard.n_shard_layers, self.config.max_context, self.toy.hidden), np.float32
            )
            self._sums[slot] = sums
        return sums

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        """The running sum of this layer's inputs before ``pos`` (what history means here)."""
        if pos == 0:
            return np.zeros(self.toy.hidden, np.float32)
        return np.asarray(sums[layer, pos - 1], dtype=np.float32)

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        if self._crash:
            raise RuntimeError("injected backend failure")
        toy = self.toy
        shard = self.config.shard
        sums = self._slot_sums(item.slot)
        n = item.n_tokens
        end = item.start_pos + n
        self._undo[item.slot] = (item.start_pos, sums[:, item.start_pos : end].copy())
        rows: list[Array] = []
        for index in range(n):
            if self._delay_s:
                token.sleep(self._delay_s)
            token.check()
            pos = item.start_pos + index
            if item.tokens is not None:
                x = toy.embedding[int(item.tokens[index])].copy()
            else:
                assert item.hidden is not None
                x = item.hidden[index].astype(np.float32)
            for local, layer in enumerate(range(shard.start, shard.end)):
                running = self._history(item, local, pos, sums) + x
                sums[local, pos] = running
                mean = running / np.float32(pos + 1)
                y = toy.scale[layer] * x + toy.history_scale[layer] * mean + toy.bias[layer]
                x = y / (np.float32(1.0) + np.abs(y))
            rows.append(x)
        hidden = np.stack(rows).astype(np.float32)
        if output == "hidden":
            return hidden
        logits = np.stack([(toy.output * row).sum(axis=1) for row in hidden]).astype(np.float32)
        return logits[-1:] if output == "last" else logits

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        undo = self._undo.pop(slot, None)
        if undo is not None:
            first, saved = undo
            self._slot_sums(slot)[:, first : first + saved.shape[1]] = saved

    def _commit(self, slot: int) -> None:
        self._undo.pop(slot, None)

    def _drop(self, slot: int) -> None:
        self._sums.pop(slot, None)
        self._undo.pop(slot, None)

    def _close(self) -> None:
        self._sums.clear()
        self._model = None


# --------------------------------------------------------------------- broken engines


class IgnoresEpochs(ReferenceEngine):
    """Serves an older epoch with the session's current state instead of StaleEpoch."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        return super()._plan_prefill(caps, self._current_epoch(session), start_pos, n_tokens)

    def _plan_decode(self, caps: Capabilities, session: SessionRef, pos: int) -> Admission:
        return super()._plan_decode(caps, self._current_epoch(session), pos)

    def _current_epoch(self, session: SessionRef) -> SessionRef:
        current = self._ledger.sessions.get(session.session_id)
        if current is not None and session.epoch < current.epoch:
            return SessionRef(session_id=session.session_id, epoch=current.epoch)
        return session


class SharedCache(ReferenceEngine):
    """Keeps one cache for every session (slot), so sessions overwrite each other."""

    def _slot_sums(self, slot: int) -> Array:
        return super()._slot_sums(0)

    def _drop(self, slot: int) -> None:
        """Dropping would wipe every session's cache; a shared cache simply never frees."""


class NoRollback(ReferenceEngine):
    """Leaves a cancelled or failed forward's partial writes in the cache."""

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        self._undo.pop(slot, None)


class WrongPositions(ReferenceEngine):
    """Reports logits "last" at the first position of the run instead of the last."""

    def _make_result(
        self,
        caps: Capabilities,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        rows: Array,
        output: OutputMode,
        timings: Timings,
        n_tokens: int,
    ) -> BoundaryResult | LogitsResult:
        result = super()._make_result(
            caps, request_id, session, start_pos, rows, output, timings, n_tokens
        )
        if isinstance(result, LogitsResult) and output == "last":
            return msgspec.structs.replace(result, first_pos=start_pos)
        return result


class _MislabelsResults(ReferenceEngine):
    result_evidence: ClassVar[EvidenceClass] = "real"

    def _make_result(
        self,
        caps: Capabilities,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        rows: Array,
        output: OutputMode,
        timings: Timings,
        n_tokens: int,
    ) -> BoundaryResult | LogitsResult:
        result = super()._make_result(
            caps, request_id, session, start_pos, rows, output, timings, n_tokens
        )
        return msgspec.structs.replace(result, evidence=self.result_evidence)


class ResultsSayReal(_MislabelsResults):
    """Fixture capabilities, but every result claims real evidence."""


class ResultsSayFixture(_MislabelsResults):
    """Capabilities claim real evidence, but every result says fixture."""

    result_evidence = "fixture"

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(info, evidence="real")


class _ReleasesForgotten(FenceTable):
    def get(self, session_id: str) -> Fence | None:
        fence = super().get(session_id)
        return None if fence is None or fence.released else fence


class RecreatesReleased(ReferenceEngine):
    """Forgets tombstones: a released epoch silently gets a fresh session."""

    def __init__(self) -> None:
        super().__init__()
        self._ledger.fences = _ReleasesForgotten()


class DecodeIgnoresHistory(ReferenceEngine):
    """A single-row forward after position 0 ignores the cached positions."""

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        if item.n_tokens == 1 and item.start_pos == item.committed_length and pos > 0:
            return np.zeros(self.toy.hidden, np.float32)
        return super()._history(item, layer, pos, sums)


class WrongErrorForRole(ReferenceEngine):
    """Raises a plain InvalidRequest where the contract says WrongRole."""

    def _decode_inputs(
        self,
        caps: Capabilities,
        inputs: ShardInput,
        session: SessionRef,
        start_pos: int,
        *,
        single_row: bool,
    ) -> tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]:
        try:
            return super()._decode_inputs(caps, inputs, session, start_pos, single_row=single_row)
        except WrongRole as error:
            raise InvalidRequest(error.message) from error


class MetricsNotCounting(ReferenceEngine):
    """Reports request counts but never counts tokens or errors."""

    def metrics(self) -> Metrics:
        metrics = super().metrics()
        return msgspec.structs.replace(metrics, prefill_tokens=0, decode_tokens=0, errors={})


_MACHINE: Final = ("test_state_machine_every_role", "test_state_machine_full_shard")
"""The model-based tests: they catch every bug that shows in outcomes, metrics or outputs."""

BROKEN_ENGINES: Final[dict[str, tuple[type[ReferenceEngine], tuple[str, ...]]]] = {
    # Without StaleEpoch errors the error counters differ too.
    "ignores_epochs": (
        IgnoresEpochs,
        (
            "test_error_codes_match_taxonomy",
            "test_health_metrics_consistent",
            "test_newer_epoch_sees_no_old_cache",
            "test_stale_epoch",
            "test_truncate_and_new_epoch_every_role",
            "test_wire_round_trip_of_every_returned_object",
            *_MACHINE,
        ),
    ),
    "shared_cache": (
        SharedCache,
        (
            "test_batched_decode_same_session_twice",
            "test_cancel_running_batch",
            "test_long_and_shared_prefix_session_ids",
            "test_session_isolation",
            *_MACHINE,
        ),
    ),
    "no_rollback": (NoRollback, ("test_cancel_rolls_back",)),
    "wrong_positions": (WrongPositions, ("test_result_fields", *_MACHINE)),
    "results_say_real": (ResultsSayReal, ("test_evidence_class", *_MACHINE)),
    "results_say_fixture": (ResultsSayFixture, ("test_evidence_class", *_MACHINE)),
    "recreates_released": (
        RecreatesReleased,
        (
            "test_fence_holds_after_slot_reuse",
            "test_newer_epoch_sees_no_old_cache",
            "test_release_tombstone",
            *_MACHINE,
        ),
    ),
    "decode_ignores_history": (
        DecodeIgnoresHistory,
        ("test_decode_consistency", "test_long_prefill_vs_chunked_and_decode", *_MACHINE),
    ),
    "wrong_error_for_role": (
        WrongErrorForRole,
        ("test_wrong_role_tokens_to_bundle_shard", "test_wrong_role_bundle_to_token_shard"),
    ),
    "metrics_not_counting": (
        MetricsNotCounting,
        ("test_batched_decode_metrics", "test_health_metrics_consistent", *_MACHINE),
    ),
}
"""Each broken engine and the standard tests that must fail on it."""
