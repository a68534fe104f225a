"""Engines the conformance suite is tested with: a small correct reference engine and broken
variants, each violating one rule of the contract.

The reference model is a toy that is deterministic, exactly split-invariant and depends on
the whole history: each layer maps a row ``x`` at position ``p`` to
``softsign(a * x + b * mean(x[0..p]) + c)``, with the running sums cached per layer and
position. Only IEEE-exact elementwise operations and same-shape reductions are used, so any
split, chunking or batching reproduces the same bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    BoundaryBundle,
    BoundaryResult,
    CacheMiss,
    Cancelled,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    Determinism,
    EngineCrashed,
    ErrorInfo,
    EvidenceClass,
    ExportSessionRequest,
    Features,
    Health,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    Metrics,
    NotReady,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ResourceExhausted,
    SessionRef,
    SessionSnapshot,
    ShardEngineError,
    ShardInput,
    ShardResult,
    StaleEpoch,
    Timings,
    TokenInput,
    Tolerance,
    WrongRole,
)
from shard_engine_api._checksum import payload_checksum
from shard_engine_api._fences import Fence, FenceTable
from shard_engine_api._ledger import Admission, LedgerLimits, Release, SessionEntry, SessionLedger
from shard_engine_api._metrics import Counters
from shard_engine_api._scheduler import Scheduler
from shard_engine_api.conformance import STANDARD_TESTS
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
    "CORRECT_ENGINES",
    "CRASH_OPTIONS",
    "Broken",
    "ReferenceEngine",
    "ReferencePlugin",
    "reference_fixture",
]

REFERENCE_LAYERS: Final = 4
CANCEL_OPTIONS: Final[dict[str, object]] = {"hold_ms": 150.0}
"""Load options under which every forward, after writing its rows to the cache, waits 150 ms
(ended at once by a cancel) before it returns: a cancel the suite sends while the request is
in flight always lands mid-operation, after the cache was touched, however loaded the machine
(the suite's cancellers act within microseconds of seeing the request in flight), so the
cancellation expectations of the broken engines do not depend on timing."""
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
    row), ``hold_ms`` (a cancellable pause after the rows were written, for the cancellation
    tests), ``crash`` (the first forward raises, for the crash test) and ``evidence``
    ("fixture" by default)."""

    engine_name: ClassVar[str] = "reference"
    ledger_type: ClassVar[type[SessionLedger]] = SessionLedger
    """The session ledger (built with ``fence_generation``): a broken engine whose bug is in
    its bookkeeping names its broken ledger here."""
    counters_type: ClassVar[type[Counters]] = Counters
    """The metrics counters, likewise."""

    def __init__(self) -> None:
        super().__init__()
        self._ledger = self.ledger_type(self.fence_generation)
        self._counters = self.counters_type()
        self._model: _ToyModel | None = None
        self._sums: dict[int, Array] = {}
        self._undo: dict[int, tuple[int, Array]] = {}
        self._delay_s = 0.0
        self._hold_s = 0.0
        self._crash = False

    # ----------------------------------------------------------------- backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
        unknown = set(config.options) - {"forward_delay_ms", "hold_ms", "evidence", "crash"}
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
        hold_ms = config.options.get("hold_ms", 0.0)
        if not isinstance(hold_ms, int | float):
            raise InvalidRequest(f"hold_ms must be a number, got {hold_ms!r}")
        self._hold_s = float(hold_ms) / 1000.0
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
            features=Features(session_migration=True),
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
        self._hold(token)
        hidden = np.stack(rows).astype(np.float32)
        if output == "hidden":
            return hidden
        logits = np.stack([(toy.output * row).sum(axis=1) for row in hidden]).astype(np.float32)
        return logits[-1:] if output == "last" else logits

    def _hold(self, token: CancelToken) -> None:
        """The ``hold_ms`` pause: the cache is written, the result not yet returned."""
        if self._hold_s:
            token.sleep(self._hold_s)

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

    def _export_state(self, slot: int, length: int) -> bytes:
        return np.ascontiguousarray(self._slot_sums(slot)[:, :length], dtype="<f4").tobytes()

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        shard = self.config.shard
        shape = (shard.n_shard_layers, length, self.toy.hidden)
        if len(state) != int(np.prod(shape)) * 4:
            raise InvalidRequest(f"state of {len(state)} bytes is not {length} positions")
        self._slot_sums(slot)[:, :length] = np.frombuffer(state, "<f4").reshape(shape)


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


_Result = BoundaryResult | LogitsResult


@dataclasses.dataclass(frozen=True)
class _Built:
    """What the core built a result from."""

    caps: Capabilities
    session: SessionRef
    start_pos: int
    rows: Array
    output: OutputMode
    timings: Timings


class _RewritesResults(ReferenceEngine):
    """Changes the results the core built, as ``_rewrite`` says: the bugs of an engine that
    post-processes its results."""

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
        return self._rewrite(result, _Built(caps, session, start_pos, rows, output, timings))

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        raise NotImplementedError


class WrongPositions(_RewritesResults):
    """Reports logits "last" at the first position of the run instead of the last."""

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        if isinstance(result, LogitsResult) and built.output == "last":
            return msgspec.structs.replace(result, first_pos=built.start_pos)
        return result


class _MislabelsResults(_RewritesResults):
    result_evidence: ClassVar[EvidenceClass] = "real"

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        return msgspec.structs.replace(result, evidence=self.result_evidence)


class ResultsSayReal(_MislabelsResults):
    """Fixture capabilities, but every result claims real evidence."""


class ResultsSayFixture(_MislabelsResults):
    """Capabilities claim real evidence, but every result says fixture."""

    result_evidence = "fixture"

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(info, evidence="real")


class NumpyPositionsInLongRuns(_RewritesResults):
    """Computes the first position of a long run (more than 8 rows) with numpy: an
    ``np.int64`` equal to the right position, so every comparison passes, but a worker's
    ValidatingEngine refuses the result and the codec cannot encode it."""

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        if len(built.rows) <= 8:
            return result
        return msgspec.structs.replace(result, first_pos=np.int64(result.first_pos))


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


class MetricsUnknownAsMinusOne(ReferenceEngine):
    """Reports a counter it does not keep (dropped fences) as -1, "unknown"."""

    def metrics(self) -> Metrics:
        return msgspec.structs.replace(super().metrics(), fences_dropped=-1)


# --------------------------------------------------------------------- more broken engines
# Each is the reference engine with one bug a real engine author could make.


class BatchSuccessesFirst(ReferenceEngine):
    """Returns a batch's successes first and its errors after them (not in item order)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        ok = [item for item in result.items if not isinstance(item, ErrorInfo)]
        failed = [item for item in result.items if isinstance(item, ErrorInfo)]
        return DecodeBatchResult(request_id=result.request_id, items=(*ok, *failed))


class BatchAllowsDuplicates(ReferenceEngine):
    """Runs a batch naming a session twice as two batches instead of refusing the repeat."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        seen: set[str] = set()
        first: list[int] = []
        rest: list[int] = []
        for index, item in enumerate(request.items):
            (rest if item.session.session_id in seen else first).append(index)
            seen.add(item.session.session_id)
        if not rest:
            return super().decode_batch(request)
        outcomes: dict[int, BoundaryResult | LogitsResult | ErrorInfo] = {}
        for indices in (first, rest):
            part = DecodeBatchRequest(
                request_id=f"{request.request_id}/{indices[0]}",
                items=tuple(request.items[index] for index in indices),
            )
            for index, outcome in zip(indices, super().decode_batch(part).items, strict=True):
                outcomes[index] = outcome
        return DecodeBatchResult(
            request_id=request.request_id, items=tuple(outcomes[i] for i in sorted(outcomes))
        )


class BatchIgnoresReservedFields(ReferenceEngine):
    """Checks mtp/aux on single requests but silently drops them from batch items."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        items = tuple(msgspec.structs.replace(item, mtp=(), aux=()) for item in request.items)
        return super().decode_batch(msgspec.structs.replace(request, items=items))


class BatchCountsFailedTokens(ReferenceEngine):
    """Counts a decode token for every batch item, failed ones included."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        failed = sum(isinstance(item, ErrorInfo) for item in result.items)
        with self._state_lock:
            self._counters.decode_tokens += failed
        return result


class BatchIgnoresSessionCancel(ReferenceEngine):
    """``cancel(session_id=...)`` reaches single requests but not batches."""

    def cancel(self, request: CancelRequest) -> CancelResult:
        failed = self.health().state == "failed"
        if request.session_id is None or request.request_id is not None or failed:
            return super().cancel(request)
        with self._state_lock:
            self._lifecycle.require_alive()
            tokens = [
                token
                for token in self._in_flight.values()
                if set(token.session_ids) == {request.session_id}
            ]
            stopped = sum(1 for token in tokens if token.try_cancel())
        return CancelResult(cancelled=stopped > 0, n_requests=stopped)


class BatchIgnoresRequestCancel(ReferenceEngine):
    """Runs a batch under an internal request id, so ``cancel(request_id=...)`` naming the
    batch finds nothing (a cancel by session id still works)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        internal = msgspec.structs.replace(request, request_id=f"{request.request_id}/batch")
        result = super().decode_batch(internal)
        return msgspec.structs.replace(result, request_id=request.request_id)


class _RewritesBundles(ReferenceEngine):
    """Base of engines whose bundle checks have a hole: ``_patched`` may repair a bundle
    before the core checks it."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        return bundle

    def _decode_inputs(
        self,
        caps: Capabilities,
        inputs: ShardInput,
        session: SessionRef,
        start_pos: int,
        *,
        single_row: bool,
    ) -> tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]:
        if isinstance(inputs, BoundaryBundle):
            inputs = self._patched(inputs, caps, single_row)
        return super()._decode_inputs(caps, inputs, session, start_pos, single_row=single_row)


class DecodeSkipsChecksum(_RewritesBundles):
    """Verifies bundle checksums on prefill only, not on (batched) decode."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if single_row:
            return msgspec.structs.replace(bundle, checksum=payload_checksum(bundle.payload))
        return bundle


class DecodeSkipsFingerprint(_RewritesBundles):
    """Compares the model fingerprint of prefill bundles only."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if single_row:
            return msgspec.structs.replace(bundle, model_fingerprint=caps.model_fingerprint)
        return bundle


class AcceptsEmptyFingerprint(_RewritesBundles):
    """Treats an empty model fingerprint as "unknown, accept"."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if not bundle.model_fingerprint:
            return msgspec.structs.replace(bundle, model_fingerprint=caps.model_fingerprint)
        return bundle


class AcceptsLayerBelowStart(_RewritesBundles):
    """Checks ``layer <= start`` and ``layer >= start - 1`` (an off-by-one range)."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if bundle.layer == caps.shard.start - 1:
            return msgspec.structs.replace(bundle, layer=caps.shard.start)
        return bundle


class AcceptsLayerAboveStart(_RewritesBundles):
    """Accepts bundles entering one layer later (``layer in (start, start + 1)``)."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if bundle.layer == caps.shard.start + 1:
            return msgspec.structs.replace(bundle, layer=caps.shard.start)
        return bundle


class RefusesF16Bundles(_RewritesBundles):
    """Advertises f16 but refuses to consume f16 bundles."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if bundle.dtype == "f16":
            raise InvalidRequest("f16 bundles are not supported")
        return bundle


class SendsF32WhenF16(_RewritesResults):
    """Loaded with boundary_dtype f16, still sends f32 bundles."""

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        if isinstance(result, BoundaryResult) and result.bundle.dtype == "f16":
            bundle = BoundaryBundle.from_array(
                built.rows,
                session=built.session,
                first_pos=built.start_pos,
                layer=built.caps.shard.end,
                model_fingerprint=built.caps.model_fingerprint,
                dtype="f32",
            )
            return msgspec.structs.replace(result, bundle=bundle)
        return result


class TruncateAppendsOnBundleShards(ReferenceEngine):
    """On bundle-taking shards, a truncating prefill continues from the old end's history
    (the author assumed middle and tail shards only ever append)."""

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        truncating = item.hidden is not None and 0 < item.start_pos < item.committed_length
        if truncating and pos == item.start_pos:
            return np.asarray(sums[layer, item.committed_length - 1], dtype=np.float32)
        return super()._history(item, layer, pos, sums)


class LongPrefillLosesHistory(ReferenceEngine):
    """Splits long prefills into internal chunks of 16 rows and drops the history at each
    chunk boundary."""

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        offset = pos - item.start_pos
        if offset >= 16 and offset % 16 == 0:
            return np.zeros(self.toy.hidden, np.float32)
        return super()._history(item, layer, pos, sums)


class _NewEpochKeepsLengthLedger(SessionLedger):
    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        current = self.sessions.get(session_id)
        if current is not None and epoch > current.epoch:
            admission = super().admit_prefill(
                session_id, current.epoch, start_pos, n_tokens, limits
            )
            return dataclasses.replace(admission, epoch=epoch)
        return super().admit_prefill(session_id, epoch, start_pos, n_tokens, limits)

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits, **batch: Any
    ) -> Admission:
        current = self.sessions.get(session_id)
        if current is not None and epoch > current.epoch:
            admission = super().admit_decode(session_id, current.epoch, pos, limits, **batch)
            return dataclasses.replace(admission, epoch=epoch)
        return super().admit_decode(session_id, epoch, pos, limits, **batch)


class NewEpochKeepsLength(ReferenceEngine):
    """A newer epoch of a live session inherits the old committed length (and cache)."""

    ledger_type = _NewEpochKeepsLengthLedger


class _WrappingLedger(SessionLedger):
    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        return super().admit_prefill(session_id, epoch & 0xFFFFFFFF, start_pos, n_tokens, limits)

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits, **batch: Any
    ) -> Admission:
        return super().admit_decode(session_id, epoch & 0xFFFFFFFF, pos, limits, **batch)

    def release(self, session_id: str, epoch: int) -> Release:
        return super().release(session_id, epoch & 0xFFFFFFFF)


class EpochsWrapAt32Bits(ReferenceEngine):
    """Stores epochs in 32 bits: 2**40 wraps to 0."""

    ledger_type = _WrappingLedger


class _ForgettingFences(FenceTable):
    def __init__(self) -> None:
        super().__init__()
        self.forgotten: set[str] = set()

    def get(self, session_id: str) -> Fence | None:
        return None if session_id in self.forgotten else super().get(session_id)

    def put(self, session_id: str, epoch: int, *, released: bool) -> None:
        self.forgotten.discard(session_id)
        super().put(session_id, epoch, released=released)


class _SlotFencesLedger(SessionLedger):
    """Keeps the fence with the slot: a new session in the slot forgets the old fence."""

    def __init__(self, fence_generation: int) -> None:
        super().__init__(fence_generation)
        self.fences = self.slot_fences = _ForgettingFences()
        self._released_in: dict[int, str] = {}

    def release(self, session_id: str, epoch: int) -> Release:
        decision = super().release(session_id, epoch)
        if decision.slot is not None:
            self._released_in[decision.slot] = session_id
        return decision

    def commit(self, admissions: Sequence[Admission]) -> tuple[int, ...]:
        for admission in admissions:
            previous = self._released_in.pop(admission.slot, None)
            if admission.is_new and previous is not None:
                self.slot_fences.forgotten.add(previous)
        return super().commit(admissions)


class FenceDroppedOnSlotReuse(ReferenceEngine):
    """Keeps tombstones per slot: a new session in the slot drops the old session's fence."""

    ledger_type = _SlotFencesLedger


class _DoubleFreeLedger(SessionLedger):
    def __init__(self, fence_generation: int) -> None:
        super().__init__(fence_generation)
        self._released_slots: dict[str, int] = {}

    def release(self, session_id: str, epoch: int) -> Release:
        decision = super().release(session_id, epoch)
        if decision.slot is not None:
            self._released_slots[session_id] = decision.slot
        elif session_id in self._released_slots:
            self._free_slots.append(self._released_slots[session_id])
        return decision


class DoubleReleaseFreesSlot(ReferenceEngine):
    """A second release of a released session returns its slot to the free list again."""

    ledger_type = _DoubleFreeLedger


class _LeakyLedger(SessionLedger):
    def release(self, session_id: str, epoch: int) -> Release:
        decision = super().release(session_id, epoch)
        self.kv_used += decision.length
        return decision


class ReleaseLeaksKv(ReferenceEngine):
    """Forgets to subtract a released session's positions from the KV count."""

    ledger_type = _LeakyLedger


class _EagerLedger(SessionLedger):
    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        admission = super().admit_prefill(session_id, epoch, start_pos, n_tokens, limits)
        if admission.is_new and admission.evict_first is None:
            self._take_slot(admission.slot)
            self.sessions[session_id] = SessionEntry(
                session_id=session_id, epoch=epoch, slot=admission.slot, length=0, last_used=0
            )
            return dataclasses.replace(admission, is_new=False)
        return admission


class AdmitsBeforeForward(ReferenceEngine):
    """Enters a new session in the ledger when it is admitted, before its forward ran, and
    does not remove it when that first forward is cancelled."""

    ledger_type = _EagerLedger


class BadFirstPrefillCreatesSession(ReferenceEngine):
    """Creates a new session's entry before validating its tokens; a refused first prefill
    leaves an empty session holding a slot."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        sid = request.session.session_id
        try:
            return super().prefill(request)
        except InvalidRequest:
            ledger = self._ledger
            with self._state_lock:
                slot = ledger._peek_slot(self._limits())
                if sid not in ledger.sessions and slot is not None:
                    ledger._take_slot(slot)
                    ledger.sessions[sid] = SessionEntry(
                        session_id=sid,
                        epoch=request.session.epoch,
                        slot=slot,
                        length=0,
                        last_used=0,
                    )
            raise


NON_POLLING_HOLD_S: Final = 2.0
"""How long a forward of an engine whose kernel does not poll its cancel token runs."""


class _AdvertisesFastCancel(ReferenceEngine):
    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        features = msgspec.structs.replace(info.features, cancel_latency_ms=5.0)
        return msgspec.structs.replace(info, features=features)


class CancelOnlyBetweenForwards(_AdvertisesFastCancel):
    """Advertises a 5 ms cancel latency but checks the token only before and after a whole
    forward (its per-row work does not poll)."""

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        delay, self._delay_s = self._delay_s, 0.0
        try:
            if delay:
                time.sleep(delay * item.n_tokens)
            rows = super()._forward(item, output, token)
        finally:
            self._delay_s = delay
        token.check()
        return rows

    def _hold(self, token: CancelToken) -> None:
        # The author's kernel does not poll. It runs 2 s rather than the 150 ms hold: the
        # suite's canceller, however late a loaded machine schedules it, still lands inside.
        if self._hold_s:
            time.sleep(max(self._hold_s, NON_POLLING_HOLD_S))


class LateCancelRollsBack(ReferenceEngine):
    """A cancel naming a request that already finished rolls its session back and says it
    cancelled something."""

    def __init__(self) -> None:
        super().__init__()
        self._finished: dict[str, tuple[str, int]] = {}

    def prefill(self, request: PrefillRequest) -> ShardResult:
        sid = request.session.session_id
        before = self._ledger.sessions.get(sid)
        result = super().prefill(request)
        self._finished[request.request_id] = (sid, before.length if before is not None else 0)
        return result

    def cancel(self, request: CancelRequest) -> CancelResult:
        result = super().cancel(request)
        finished = self._finished.pop(request.request_id or "", None)
        if result.cancelled or finished is None:
            return result
        sid, length = finished
        with self._state_lock:
            current = self._ledger.sessions.get(sid)
            if current is not None:
                self._ledger.kv_used -= current.length - length
                current.length = length
        return CancelResult(cancelled=True, n_requests=1)


class CancelStopsEverything(ReferenceEngine):
    """``cancel(request_id=...)`` stops every in-flight request, not just the one named."""

    def cancel(self, request: CancelRequest) -> CancelResult:
        result = super().cancel(request)
        if request.request_id is None or not result.cancelled:
            return result
        with self._state_lock:
            for token in list(self._in_flight.values()):
                token.try_cancel()
        return result


class _NoScheduler(Scheduler[Any]):
    """Lets every operation onto the backend at once ("the GIL protects us")."""

    def enter(self, token: CancelToken | None, session_ids: Collection[str] | None) -> None:
        return None

    def try_enter_alone(self) -> bool:
        return True

    def leave(self) -> None:
        return None


class NotThreadSafe(ReferenceEngine):
    """Drops the scheduler ("the GIL protects us") and keeps one scratch row buffer for
    every call. While other requests are in flight, each use of the buffer waits (up to 1 s)
    for another thread to reach the same point, so calls that overlap always overwrite each
    other's buffer, not only when the scheduler happens to switch threads there."""

    def __init__(self) -> None:
        super().__init__()
        self._scheduler = _NoScheduler()
        self._scratch: Array | None = None
        self._meeting = threading.Barrier(2)

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        history = super()._history(item, layer, pos, sums)
        self._scratch = history
        time.sleep(0)  # lets the other threads in, as any I/O or allocation would
        if len(self._in_flight) > 1:
            try:
                self._meeting.wait(timeout=1.0)
            except threading.BrokenBarrierError:
                self._meeting.reset()
        assert self._scratch is not None
        return self._scratch


class _FifoLedger(SessionLedger):
    def commit(self, admissions: Sequence[Admission]) -> tuple[int, ...]:
        kept = {
            admission.session_id: self.sessions[admission.session_id].last_used
            for admission in admissions
            if admission.session_id in self.sessions
        }
        dropped = super().commit(admissions)
        for session_id, last_used in kept.items():
            if session_id in self.sessions:
                self.sessions[session_id].last_used = last_used
        return dropped


class EvictsByCreation(ReferenceEngine):
    """Evicts in creation order (FIFO): using a session does not refresh it."""

    ledger_type = _FifoLedger


class _VictimLedger(SessionLedger):
    """The core's eviction with another choice of victims (``order``) and stopping rule."""

    def __init__(
        self, order: Callable[[list[SessionEntry]], list[SessionEntry]], greedy: bool
    ) -> None:
        super().__init__()
        self._order = order
        self._greedy = greedy

    def _room_for(
        self, session_id: str, extra_tokens: int, *, is_new: bool, limits: LedgerLimits
    ) -> tuple[str, ...]:
        need_session = is_new and len(self.sessions) >= limits.max_sessions
        over = self.kv_used + extra_tokens - limits.kv_budget
        if (not need_session and over <= 0) or not limits.evict_lru:
            return super()._room_for(session_id, extra_tokens, is_new=is_new, limits=limits)
        excluded = {session_id}
        idle = self._order(
            sorted(
                (s for s in self.sessions.values() if s.session_id not in excluded),
                key=lambda s: s.last_used,
            )
        )
        chosen: list[str] = []
        for candidate in idle:
            if not self._greedy and not need_session and over <= 0:
                break
            chosen.append(candidate.session_id)
            over -= candidate.length
            need_session = False
        if need_session or over > 0:
            raise ResourceExhausted("KV budget exceeded", details={"resource": "kv"})
        return tuple(chosen)


class EvictsLargestFirst(ReferenceEngine):
    """Evicts the largest idle session first ("frees the most memory")."""

    def __init__(self) -> None:
        super().__init__()
        self._ledger = _VictimLedger(lambda idle: sorted(idle, key=lambda s: -s.length), False)


class EvictsEveryIdleSession(ReferenceEngine):
    """Evicts every idle session once the budget is exceeded, not only as many as needed."""

    def __init__(self) -> None:
        super().__init__()
        self._ledger = _VictimLedger(lambda idle: idle, True)


class NumpyScalarTimings(_RewritesResults):
    """Puts numpy scalars into result timings (they do not survive the wire codec)."""

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        timings = built.timings
        numpy_timings = Timings(
            queue_ms=np.float32(timings.queue_ms),  # type: ignore[arg-type]
            compute_ms=np.float32(timings.compute_ms),  # type: ignore[arg-type]
            total_ms=np.float32(timings.total_ms),  # type: ignore[arg-type]
        )
        return msgspec.structs.replace(result, timings=numpy_timings)


class CapabilitiesWithLists(ReferenceEngine):
    """Returns capabilities whose boundary_dtypes is a list (the wire gives a tuple back)."""

    def load(self, config: LoadConfig) -> Capabilities:
        caps = super().load(config)
        self._capabilities = msgspec.structs.replace(
            caps,
            boundary_dtypes=list(caps.boundary_dtypes),
        )
        return self._capabilities


class EngineCacheMiss(CacheMiss):
    """An engine's own CacheMiss subclass with its own code."""

    code = "engine_cache_miss"


class _OwnMissLedger(SessionLedger):
    # The check every decode row goes through, single or batched (admit_batch no longer
    # calls admit_decode).
    def _decode_entry(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits
    ) -> SessionEntry:
        try:
            return super()._decode_entry(session_id, epoch, pos, limits)
        except CacheMiss as miss:
            raise EngineCacheMiss(
                miss.message, committed_length=miss.committed_length, reason=miss.reason
            ) from miss


class OwnErrorSubclass(ReferenceEngine):
    """Raises its own CacheMiss subclass with its own code for decode misses."""

    ledger_type = _OwnMissLedger


class RetryableStaleEpoch(ReferenceEngine):
    """Marks StaleEpoch retryable (a retry with the same epoch can never succeed)."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        try:
            return super()._plan_prefill(caps, session, start_pos, n_tokens)
        except StaleEpoch as error:
            raise StaleEpoch(error.message, retryable=True) from error


class NanAtPositionSix(ReferenceEngine):
    """Returns NaN logits for position 6 (a numerically broken kernel at one length)."""

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        rows = super()._forward(item, output, token)
        if output == "hidden":
            return rows
        positions = (
            [item.start_pos + item.n_tokens - 1]
            if output == "last"
            else list(range(item.start_pos, item.start_pos + item.n_tokens))
        )
        rows = rows.copy()
        for index, pos in enumerate(positions):
            if pos == 6:
                rows[index] = np.nan
        return rows


class _ShortIdLedger(SessionLedger):
    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        return super().admit_prefill(session_id[:64], epoch, start_pos, n_tokens, limits)

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits, **batch: Any
    ) -> Admission:
        return super().admit_decode(session_id[:64], epoch, pos, limits, **batch)

    def release(self, session_id: str, epoch: int) -> Release:
        return super().release(session_id[:64], epoch)


class TruncatesSessionIds(ReferenceEngine):
    """Keys sessions by the first 64 characters of their id."""

    ledger_type = _ShortIdLedger


class CrashRecovers(ReferenceEngine):
    """Treats a backend failure as a one-off: it stays "ready" and keeps serving."""

    def _fail(self, detail: str) -> None:
        return None


class CrashSaysDegraded(ReferenceEngine):
    """Reports a failed engine as "degraded" in health."""

    def health(self) -> Health:
        health = super().health()
        if health.state == "failed":
            return msgspec.structs.replace(health, state="degraded")
        return health


class _DoubleCounters(Counters):
    def count_error(self, error: ShardEngineError) -> None:
        super().count_error(error)
        super().count_error(error)


class ErrorsCountedTwice(ReferenceEngine):
    """Counts every error twice in metrics.errors."""

    counters_type = _DoubleCounters


class ContextOffByOne(ReferenceEngine):
    """Admits a prefill reaching max_context + 1 positions (``>`` where ``>=`` belongs)."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        if start_pos + n_tokens == caps.limits.max_context + 1 and n_tokens > 1:
            admission = super()._plan_prefill(caps, session, start_pos, n_tokens - 1)
            return dataclasses.replace(admission, new_length=admission.new_length + 1)
        return super()._plan_prefill(caps, session, start_pos, n_tokens)

    def _slot_sums(self, slot: int) -> Array:
        sums = self._sums.get(slot)
        if sums is None:
            shard = self.config.shard
            sums = np.zeros(
                (shard.n_shard_layers, self.config.max_context + 1, self.toy.hidden), np.float32
            )
            self._sums[slot] = sums
        return sums


class BatchTokensOffByOne(ReferenceEngine):
    """Lets prefills and batches of max_batch_tokens + 1 rows through."""

    def load(self, config: LoadConfig) -> Capabilities:
        caps = super().load(config)
        limits = msgspec.structs.replace(
            caps.limits, max_batch_tokens=caps.limits.max_batch_tokens + 1
        )
        self._capabilities = msgspec.structs.replace(caps, limits=limits)
        self._advertised = caps
        return caps

    def capabilities(self) -> Capabilities:
        super().capabilities()
        return self._advertised


class SessionsOffByOne(ReferenceEngine):
    """Has one more session slot than max_sessions."""

    def _limits(self) -> LedgerLimits:
        limits = super()._limits()
        return dataclasses.replace(limits, max_sessions=limits.max_sessions + 1)


class KvBudgetOffByOne(ReferenceEngine):
    """Admits one position more than the KV budget."""

    def load(self, config: LoadConfig) -> Capabilities:
        caps = super().load(config)
        with self._state_lock:  # past the core's own setter, which never exceeds the config
            self._kv_budget = config.kv_budget_tokens + 1
        return caps

    def health(self) -> Health:
        health = super().health()
        return msgspec.structs.replace(health, kv_budget_tokens=health.kv_budget_tokens - 1)


class TruncationStillCounted(ReferenceEngine):
    """Budgets a truncating prefill as if the truncated positions stayed cached."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        admission = super()._plan_prefill(caps, session, start_pos, n_tokens)
        if not admission.is_new and start_pos < admission.committed_length:
            self._ledger._room_for(
                session.session_id, n_tokens, is_new=False, limits=self._limits()
            )
        return admission


# --------------------------------------------------------------------- where the contract was
# silent: each of these passed the suite before the contract defined the behaviour.


class VacuousTolerance(DecodeIgnoresHistory):
    """Hides a decode that ignores the cache behind a declared tolerance of 1e9 (split_exact
    and batch_invariant False): every comparison within it passes."""

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(
            info,
            determinism=Determinism(
                deterministic=True, split_exact=False, tolerance=1e9, batch_invariant=False
            ),
        )


class ReleaseCountsAsRequest(ReferenceEngine):
    """Counts every release in metrics.requests."""

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        result = super().release(request)
        with self._state_lock:
            self._counters.requests += 1
        return result


class BatchItemsCountAsDecodes(ReferenceEngine):
    """Counts each item of a batch in metrics.decode_requests (besides batch_requests)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        with self._state_lock:
            self._counters.decode_requests += len(request.items)
        return result


class BatchItemErrorsUncounted(ReferenceEngine):
    """Leaves the error items of a batch result out of metrics.errors."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        with self._state_lock:
            errors = self._counters.errors
            for item in result.items:
                if isinstance(item, ErrorInfo):
                    errors[item.code] -= 1
                    if not errors[item.code]:
                        del errors[item.code]
        return result


def _decoded_twice(engine: ReferenceEngine, request: DecodeBatchRequest) -> set[str]:
    """Sessions that two items of the batch would each decode (no reserved field, the
    committed length as position, token ids in range): the case its author handled."""
    vocab = engine.capabilities().vocab_size
    counts: dict[str, int] = {}
    for item in request.items:
        entry = engine._ledger.sessions.get(item.session.session_id)
        inputs = item.inputs
        if isinstance(inputs, TokenInput):
            plain = all(token < vocab for token in inputs.token_ids)
        else:
            plain = not inputs.mtp + inputs.aux
        if entry is not None and item.pos == entry.length and plain and not item.mtp + item.aux:
            counts[item.session.session_id] = counts.get(item.session.session_id, 0) + 1
    return {session_id for session_id, count in counts.items() if count > 1}


class BatchRefusesDuplicatesWhole(ReferenceEngine):
    """Refuses a whole batch in which two items would decode the same session
    (InvalidRequest, counted)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        if not _decoded_twice(self, request):
            return super().decode_batch(request)
        with self._state_lock:
            self._counters.requests += 1
            self._counters.batch_requests += 1
        raise self._caller_sees(InvalidRequest("a batch may name each session once"))


class BatchRefusesEveryDuplicate(ReferenceEngine):
    """Refuses every item naming a session that two items would decode, the first one
    included."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        duplicated = _decoded_twice(self, request)
        if not duplicated:
            return super().decode_batch(request)
        refused = InvalidRequest("session named twice in one batch")
        keep = [
            index
            for index, item in enumerate(request.items)
            if item.session.session_id not in duplicated
        ]
        outcomes: dict[int, BoundaryResult | LogitsResult | ErrorInfo] = {
            index: refused.to_info() for index in range(len(request.items)) if index not in keep
        }
        if keep:
            part = msgspec.structs.replace(
                request, items=tuple(request.items[index] for index in keep)
            )
            outcomes.update(zip(keep, super().decode_batch(part).items, strict=True))
        else:
            with self._state_lock:
                self._counters.requests += 1
                self._counters.batch_requests += 1
        with self._state_lock:
            for _ in range(len(request.items) - len(keep)):
                self._counters.count_error(refused)
        return DecodeBatchResult(
            request_id=request.request_id,
            items=tuple(outcomes[index] for index in range(len(request.items))),
        )


class _EarlierMembersLedger(SessionLedger):
    """Protects only the batch items admitted so far from eviction."""

    def admit_batch(
        self,
        items: Sequence[tuple[str, int, int]],
        limits: LedgerLimits,
        *,
        protect: Collection[str] = (),
        reserved: int = 0,
    ) -> list[Admission | ShardEngineError]:
        decisions: list[Admission | ShardEngineError] = []
        chosen: list[str] = []
        admitted: list[str] = []
        for session_id, epoch, pos in items:
            if session_id in chosen:
                decisions.append(
                    CacheMiss(
                        f"session {session_id!r} was evicted",
                        committed_length=0,
                        reason="evicted",
                    )
                )
                continue
            try:
                current = self._decode_entry(session_id, epoch, pos, limits)
            except ShardEngineError as error:
                decisions.append(error)
                continue
            gone = sum(self.sessions[victim].length for victim in chosen)
            over = self.kv_used - gone + len(admitted) + reserved + 1 - limits.kv_budget
            evict: list[str] = []
            if over > 0 and not limits.evict_lru:
                decisions.append(self._over_budget(over, limits))
                continue
            if over > 0:
                excluded = {session_id, *admitted, *chosen, *protect}
                for victim in sorted(self.sessions.values(), key=lambda s: s.last_used):
                    if over <= 0:
                        break
                    if victim.session_id not in excluded:
                        evict.append(victim.session_id)
                        over -= victim.length
                if over > 0:
                    decisions.append(ResourceExhausted("KV budget exceeded"))
                    continue
            chosen.extend(evict)
            admitted.append(session_id)
            decisions.append(
                Admission(
                    session_id,
                    epoch,
                    current.slot,
                    pos,
                    current.length,
                    pos + 1,
                    False,
                    tuple(evict),
                )
            )
        return decisions


class BatchEvictsLaterMembers(ReferenceEngine):
    """A batch's first items may evict sessions its later items name (only the items
    admitted so far are protected)."""

    ledger_type = _EarlierMembersLedger


class EmptyFingerprintInvalid(_RewritesBundles):
    """Refuses a bundle with an empty fingerprint as a plain InvalidRequest, not as
    ShardMismatch."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if not bundle.model_fingerprint:
            raise InvalidRequest("bundle carries no model fingerprint")
        return bundle


class LayerZeroInvalid(_RewritesBundles):
    """Refuses a bundle entering layer 0 as a plain InvalidRequest, not as ShardMismatch."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if bundle.layer == 0:
            raise InvalidRequest("layer 0 is no producer's end")
        return bundle


def _with_retryable(error: ResourceExhausted, resource: str, retryable: bool) -> None:
    if error.details.get("resource") == resource:
        raise ResourceExhausted(
            error.message, retryable=retryable, details=dict(error.details)
        ) from error


class ContextOverflowRetryable(ReferenceEngine):
    """Marks a context overflow (positions past max_context) retryable."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        try:
            return super()._plan_prefill(caps, session, start_pos, n_tokens)
        except ResourceExhausted as error:
            _with_retryable(error, "context", True)
            raise

    def _plan_decode(self, caps: Capabilities, session: SessionRef, pos: int) -> Admission:
        try:
            return super()._plan_decode(caps, session, pos)
        except ResourceExhausted as error:
            _with_retryable(error, "context", True)
            raise


class SlotsFullNotRetryable(ReferenceEngine):
    """Marks "every session slot is in use" not retryable (a release frees one)."""

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        try:
            return super()._plan_prefill(caps, session, start_pos, n_tokens)
        except ResourceExhausted as error:
            _with_retryable(error, "sessions", False)
            raise


class ClosedEngineRetryable(ReferenceEngine):
    """Says NotReady after close is retryable (no retry reopens a closed engine)."""

    def _require_serving(self) -> Capabilities:
        try:
            return super()._require_serving()
        except NotReady as error:
            if self._lifecycle.state == "closed":
                raise NotReady(error.message, retryable=True) from error
            raise


class ReusesOutputBuffer(_RewritesResults):
    """Returns every payload as a view of one scratch buffer that the next call overwrites
    (saving an allocation per step): a result's checksum goes stale as soon as another
    request runs."""

    def __init__(self) -> None:
        super().__init__()
        self._scratch = bytearray(1 << 22)

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        if isinstance(result, LogitsResult):
            size = result.payload.nbytes
            self._scratch[:size] = result.payload
            return msgspec.structs.replace(result, payload=memoryview(self._scratch)[:size])
        bundle = result.bundle
        size = bundle.payload.nbytes
        self._scratch[:size] = bundle.payload
        reused = msgspec.structs.replace(bundle, payload=memoryview(self._scratch)[:size])
        return msgspec.structs.replace(result, bundle=reused)


class CrashRetryable(ReferenceEngine):
    """Says EngineCrashed is retryable once failed (no retry revives a failed engine)."""

    def _require_serving(self) -> Capabilities:
        try:
            return super()._require_serving()
        except EngineCrashed as error:
            raise EngineCrashed(error.message, retryable=True) from error


class CancelledNotRetryable(ReferenceEngine):
    """Its forward answers a cancel with its own Cancelled(retryable=False) ("the request is
    dead"), although a cancelled call changed nothing and may be re-issued."""

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        try:
            return super()._forward(item, output, token)
        except Cancelled as error:
            raise Cancelled(error.message, retryable=False) from None


class SwappedClockTimings(_RewritesResults):
    """Computes total_ms as start minus end (the operands swapped): always negative."""

    def _rewrite(self, result: _Result, built: _Built) -> _Result:
        timings = result.timings
        swapped = msgspec.structs.replace(timings, total_ms=-max(timings.total_ms, 0.001))
        return msgspec.structs.replace(result, timings=swapped)


class MemoizesPrefills(ReferenceEngine):
    """Remembers prefill results by start position, tokens and logits mode, across sessions: a
    session whose history differs gets another session's outputs for the same chunk."""

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple[int, tuple[int, ...], str], ShardResult] = {}

    def prefill(self, request: PrefillRequest) -> ShardResult:
        result = super().prefill(request)
        if not isinstance(request.inputs, TokenInput):
            return result
        key = (request.start_pos, request.inputs.token_ids, request.logits)
        remembered = self._memo.setdefault(key, result)
        return msgspec.structs.replace(
            remembered, request_id=request.request_id, session=request.session
        )


def _perturbation(rows: Array, scale: float, item: ForwardItem, shard_start: int) -> Array:
    """A deterministic, shape-dependent change of ``scale`` order: what other kernels for
    other batch shapes or layer ranges do to real engines' numbers."""
    factor = 1.0 + scale * ((item.n_tokens % 5) + 1 + (shard_start % 3))
    return (rows * np.float32(factor)).astype(np.float32)


class _Perturbed(ReferenceEngine):
    scale: ClassVar[float] = 1e-6
    declared: ClassVar[Determinism] = Determinism(
        deterministic=True, split_exact=False, tolerance=1e-3, batch_invariant=False
    )

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(info, determinism=self.declared)

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        rows = super()._forward(item, output, token)
        return _perturbation(rows, self.scale, item, self.config.shard.start)


class HonestToleranceEngine(_Perturbed):
    """Correct: its numbers depend slightly on batch shape and layer range, and it says so
    (split_exact False, batch_invariant False, tolerance 1e-3 for changes of ~1e-5)."""


class ExceedsDeclaredTolerance(_Perturbed):
    """Declares tolerance 1e-3 but its shape-dependent error is ~1e-2."""

    scale = 2e-3


class HonestRelativeTolerance(_Perturbed):
    """Correct: declares per-kind tolerances relative to each row's magnitude (1e-4 of it,
    for shape-dependent changes of ~1e-5) instead of one absolute bound."""

    declared = Determinism(
        deterministic=True,
        split_exact=False,
        batch_invariant=False,
        logits_tolerance=Tolerance(relative=1e-4),
        hidden_tolerance=Tolerance(relative=1e-4),
    )


class ExceedsRelativeTolerance(_Perturbed):
    """Declares relative tolerances of 1e-6 but its shape-dependent changes reach ~6e-6."""

    declared = Determinism(
        deterministic=True,
        split_exact=False,
        batch_invariant=False,
        logits_tolerance=Tolerance(relative=1e-6),
        hidden_tolerance=Tolerance(relative=1e-6),
    )


class ClaimsSplitExact(_Perturbed):
    """Declares split_exact and batch_invariant although its numbers depend on the shape."""

    declared = Determinism(deterministic=True, split_exact=True, tolerance=0.0)


class _RekeyedLedger(SessionLedger):
    """Keys sessions and fences by ``key(session_id)``, not by the id itself."""

    @staticmethod
    def key(session_id: str) -> str:
        return session_id

    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        return super().admit_prefill(self.key(session_id), epoch, start_pos, n_tokens, limits)

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits, **batch: Any
    ) -> Admission:
        return super().admit_decode(self.key(session_id), epoch, pos, limits, **batch)

    def release(self, session_id: str, epoch: int) -> Release:
        return super().release(self.key(session_id), epoch)


class _CaseFoldingLedger(_RekeyedLedger):
    @staticmethod
    def key(session_id: str) -> str:
        return session_id.casefold()


class CaseFoldsSessionIds(ReferenceEngine):
    """Keys sessions by their case-folded id ("ids are case-insensitive"): "Case" and "case"
    share one cache."""

    ledger_type = _CaseFoldingLedger


class _FloatEpochLedger(SessionLedger):
    """Compares epochs as float64 (as after a trip through JSON numbers)."""

    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        return super().admit_prefill(session_id, int(float(epoch)), start_pos, n_tokens, limits)

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits, **batch: Any
    ) -> Admission:
        return super().admit_decode(session_id, int(float(epoch)), pos, limits, **batch)

    def release(self, session_id: str, epoch: int) -> Release:
        return super().release(session_id, int(float(epoch)))


class EpochsAsFloats(ReferenceEngine):
    """Stores and compares epochs as float64: 2**53 + 1 and 2**53 are one epoch, so the
    older owner is served instead of refused."""

    ledger_type = _FloatEpochLedger


class ResultsKeepFirstEpoch(ReferenceEngine):
    """Addresses every result to the epoch its session was first prefilled with (a cached
    SessionRef), also after a newer epoch restarted the session."""

    def __init__(self) -> None:
        super().__init__()
        self._first_epochs: dict[str, int] = {}

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
        epoch = self._first_epochs.setdefault(session.session_id, session.epoch)
        cached = SessionRef(session_id=session.session_id, epoch=epoch)
        result = super()._make_result(
            caps, request_id, session, start_pos, rows, output, timings, n_tokens
        )
        if isinstance(result, BoundaryResult):
            bundle = msgspec.structs.replace(result.bundle, session=cached)
            return msgspec.structs.replace(result, session=cached, bundle=bundle)
        return msgspec.structs.replace(result, session=cached)


class CancelsBySessionPrefix(ReferenceEngine):
    """``cancel(session_id=...)`` stops every request whose session id starts with the one
    named (a "session group" feature nobody asked for)."""

    def cancel(self, request: CancelRequest) -> CancelResult:
        named = request.session_id
        if named is None or request.request_id is not None or self.health().state == "failed":
            return super().cancel(request)
        with self._state_lock:
            self._lifecycle.require_alive()
            tokens = [
                token
                for token in self._in_flight.values()
                if any(session_id.startswith(named) for session_id in token.session_ids)
            ]
            stopped = sum(1 for token in tokens if token.try_cancel())
        return CancelResult(cancelled=stopped > 0, n_requests=stopped)


class ComputeTimeGoesBack(ReferenceEngine):
    """Reports compute_ms minus the time spent in metrics() itself (an accounting slip): the
    counter shrinks and goes negative."""

    def __init__(self) -> None:
        super().__init__()
        self._reads = 0

    def metrics(self) -> Metrics:
        self._reads += 1
        metrics = super().metrics()
        return msgspec.structs.replace(
            metrics, compute_ms=metrics.compute_ms - 1000.0 * self._reads
        )


class ExportsAtNewerEpoch(ReferenceEngine):
    """Exports the live state when asked for a newer epoch than the live one (the newer epoch
    has no state yet: CacheMiss "new_epoch"), stamping the snapshot with the live epoch."""

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        live = self._ledger.sessions.get(request.session.session_id)
        if live is not None and request.session.epoch > live.epoch:
            current = SessionRef(session_id=live.session_id, epoch=live.epoch)
            request = msgspec.structs.replace(request, session=current)
        return super().export_session(request)


class BatchItemsKeepFirstEpoch(ReferenceEngine):
    """Addresses every result of a batch to its own session but the first item's epoch."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        epoch = request.items[0].session.epoch
        items: list[BoundaryResult | LogitsResult | ErrorInfo] = []
        for item, outcome in zip(request.items, result.items, strict=True):
            ref = SessionRef(session_id=item.session.session_id, epoch=epoch)
            if isinstance(outcome, BoundaryResult):
                bundle = msgspec.structs.replace(outcome.bundle, session=ref)
                items.append(msgspec.structs.replace(outcome, session=ref, bundle=bundle))
            elif isinstance(outcome, LogitsResult):
                items.append(msgspec.structs.replace(outcome, session=ref))
            else:
                items.append(outcome)
        return msgspec.structs.replace(result, items=tuple(items))


class Broken(NamedTuple):
    """A broken engine, the standard tests that must fail on it, and those that may (their
    failure depends on thread timing)."""

    engine: type[ReferenceEngine]
    fails: tuple[str, ...]
    may_fail: tuple[str, ...] = ()


_MACHINE: Final = ("test_state_machine_every_role", "test_state_machine_full_shard")
"""The model-based tests: they catch every bug that shows in outcomes, metrics or outputs."""

_NO_RESULT: Final = (
    "test_cache_miss_unknown_session",
    "test_cancel_latency_within_advertised_bound",
    "test_capabilities_fields",
    "test_crash_is_permanent",
    "test_health_states",
    "test_not_ready_before_load",
    "test_reserved_hooks_present_but_disabled",
    "test_role_derived_from_shard",
    "test_wrong_role_tokens_to_bundle_shard",
)
"""The standard tests that never see a prefill or decode result."""
_EVERY_RESULT: Final = tuple(name for name in STANDARD_TESTS if name not in _NO_RESULT)
"""The standard tests that check every result they see: all fail on an engine whose every
result has a field of the wrong type."""

BROKEN_ENGINES: Final[dict[str, Broken]] = {
    "ignores_epochs": Broken(
        IgnoresEpochs,
        (
            "test_batch_error_items_carry_their_fields",
            "test_error_codes_match_taxonomy",
            "test_health_metrics_consistent",
            "test_migration_epoch_fencing",
            "test_newer_epoch_sees_no_old_cache",
            "test_refused_first_prefill_of_a_newer_epoch",
            "test_retryable_on_every_path",
            "test_stale_epoch",
            "test_truncate_and_new_epoch_every_role",
            "test_wire_round_trip_of_every_returned_object",
            *_MACHINE,
        ),
    ),
    "shared_cache": Broken(
        SharedCache,
        (
            "test_batched_decode_same_session_twice",
            "test_cancel_one_of_queued_requests",
            "test_long_and_shared_prefix_session_ids",
            "test_many_threads_many_sessions_match_serial",
            "test_session_ids_across_characters_and_lengths",
            "test_session_isolation",
            *_MACHINE,
        ),
        may_fail=("test_cancel_running_batch", "test_concurrent_threads_match_serial"),
    ),
    "no_rollback": Broken(
        NoRollback,
        ("test_cancel_rolls_back",),
    ),
    "wrong_positions": Broken(
        WrongPositions,
        ("test_result_fields", *_MACHINE),
    ),
    "results_say_real": Broken(
        ResultsSayReal,
        ("test_evidence_class", *_MACHINE),
    ),
    "numpy_positions_in_long_runs": Broken(
        NumpyPositionsInLongRuns,
        (
            "test_chunked_prefill",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_long_session_migrates_exactly",
            "test_migration_continues_exactly_every_role",
            "test_narrow_boundary_dtypes_match_f32_rows",
            "test_truncate_at_large_positions",
        ),
        may_fail=_MACHINE,
    ),
    "results_say_fixture": Broken(
        ResultsSayFixture,
        ("test_evidence_class", *_MACHINE),
    ),
    "recreates_released": Broken(
        RecreatesReleased,
        (
            "test_fence_holds_after_slot_reuse",
            "test_migration_epoch_fencing",
            "test_newer_epoch_sees_no_old_cache",
            "test_release_tombstone",
            "test_release_while_a_request_runs",
            "test_stale_epoch",
            "test_thousands_of_releases_keep_every_fence",
            *_MACHINE,
        ),
    ),
    "decode_ignores_history": Broken(
        DecodeIgnoresHistory,
        (
            "test_decode_consistency",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            *_MACHINE,
        ),
    ),
    "wrong_error_for_role": Broken(
        WrongErrorForRole,
        ("test_wrong_role_bundle_to_token_shard", "test_wrong_role_tokens_to_bundle_shard"),
    ),
    "metrics_not_counting": Broken(
        MetricsNotCounting,
        (
            "test_batched_decode_metrics",
            "test_health_metrics_consistent",
            "test_migration_metrics_and_health",
            "test_thousands_of_releases_keep_every_fence",
            *_MACHINE,
        ),
    ),
    "metrics_unknown_as_minus_one": Broken(
        MetricsUnknownAsMinusOne,
        (
            "test_health_metrics_consistent",
            "test_health_states",
            "test_thousands_of_releases_keep_every_fence",
            "test_wire_round_trip_of_every_returned_object",
        ),
    ),
    "batch_successes_first": Broken(
        BatchSuccessesFirst,
        (
            "test_batched_decode_metrics",
            "test_batched_decode_order_with_interleaved_errors",
            "test_batched_decode_reserved_fields",
        ),
    ),
    "batch_allows_duplicates": Broken(
        BatchAllowsDuplicates,
        ("test_batched_decode_same_session_twice",),
    ),
    "batch_ignores_reserved_fields": Broken(
        BatchIgnoresReservedFields,
        (
            "test_batched_decode_reserved_fields",
            "test_empty_reserved_values_refused",
        ),
    ),
    "batch_counts_failed_tokens": Broken(
        BatchCountsFailedTokens,
        ("test_batched_decode_metrics", *_MACHINE),
    ),
    "batch_ignores_session_cancel": Broken(
        BatchIgnoresSessionCancel,
        ("test_cancel_running_batch",),
    ),
    "batch_ignores_request_cancel": Broken(
        BatchIgnoresRequestCancel,
        ("test_cancel_running_batch",),
    ),
    "decode_skips_checksum": Broken(
        DecodeSkipsChecksum,
        (
            "test_boundary_checks_on_every_path",
            "test_retryable_on_every_path",
        ),
        may_fail=("test_state_machine_every_role",),
    ),
    "decode_skips_fingerprint": Broken(
        DecodeSkipsFingerprint,
        ("test_boundary_checks_on_every_path",),
    ),
    "accepts_empty_fingerprint": Broken(
        AcceptsEmptyFingerprint,
        ("test_boundary_checks_on_every_path",),
    ),
    "accepts_layer_below_start": Broken(
        AcceptsLayerBelowStart,
        ("test_boundary_checks_on_every_path",),
    ),
    "accepts_layer_above_start": Broken(
        AcceptsLayerAboveStart,
        ("test_boundary_checks_on_every_path", "test_shard_mismatch"),
    ),
    "refuses_f16_bundles": Broken(
        RefusesF16Bundles,
        ("test_every_boundary_dtype", "test_state_machine_every_role"),
    ),
    "sends_f32_when_f16": Broken(
        SendsF32WhenF16,
        (
            "test_every_boundary_dtype",
            "test_narrow_boundary_dtypes_match_f32_rows",
            "test_state_machine_every_role",
        ),
    ),
    "truncate_appends_on_bundle_shards": Broken(
        TruncateAppendsOnBundleShards,
        ("test_truncate_and_new_epoch_every_role",),
    ),
    "long_prefill_loses_history": Broken(
        LongPrefillLosesHistory,
        (
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_truncate_at_large_positions",
            *_MACHINE,
        ),
    ),
    "new_epoch_keeps_length": Broken(
        NewEpochKeepsLength,
        (
            "test_batch_error_items_carry_their_fields",
            "test_newer_epoch_sees_no_old_cache",
            *_MACHINE,
        ),
    ),
    "epochs_wrap_at32_bits": Broken(
        EpochsWrapAt32Bits,
        ("test_newer_epoch_sees_no_old_cache", *_MACHINE),
    ),
    "fence_dropped_on_slot_reuse": Broken(
        FenceDroppedOnSlotReuse,
        (
            "test_fence_holds_after_slot_reuse",
            "test_thousands_of_releases_keep_every_fence",
        ),
        may_fail=_MACHINE,
    ),
    "double_release_frees_slot": Broken(
        DoubleReleaseFreesSlot,
        ("test_double_release_frees_once",),
    ),
    "release_leaks_kv": Broken(
        ReleaseLeaksKv,
        (
            "test_cancel_one_of_two_in_flight",
            "test_double_release_frees_once",
            "test_health_metrics_consistent",
            "test_release_while_a_request_runs",
            "test_thousands_of_releases_keep_every_fence",
            *_MACHINE,
        ),
    ),
    "admits_before_forward": Broken(
        AdmitsBeforeForward,
        ("test_cancel_one_of_two_in_flight", "test_failed_first_prefill_leaves_nothing"),
    ),
    "bad_first_prefill_creates_session": Broken(
        BadFirstPrefillCreatesSession,
        (
            "test_boundary_checks_on_every_path",
            "test_contract_version_at_its_edges",
            "test_failed_first_prefill_leaves_nothing",
            "test_limit_max_batch_tokens",
        ),
        may_fail=_MACHINE,
    ),
    "cancel_only_between_forwards": Broken(
        CancelOnlyBetweenForwards,
        ("test_cancel_latency_within_advertised_bound",),
    ),
    "late_cancel_rolls_back": Broken(
        LateCancelRollsBack,
        (
            "test_cancel_after_completion_result_stands",
            "test_cancel_unknown_or_finished",
            "test_state_machine_full_shard",
        ),
        may_fail=("test_state_machine_every_role",),
    ),
    "cancel_stops_everything": Broken(
        CancelStopsEverything,
        (
            "test_cancel_one_of_queued_requests",
            "test_cancel_one_of_two_in_flight",
        ),
    ),
    "not_thread_safe": Broken(
        NotThreadSafe,
        (
            "test_concurrent_threads_match_serial",
            "test_many_threads_many_sessions_match_serial",
        ),
        may_fail=(
            "test_cancel_one_of_queued_requests",
            "test_cancel_one_of_two_in_flight",
            "test_cancel_running_batch",
            "test_long_and_shared_prefix_session_ids",
            "test_migration_cancelled_import_and_export",
            "test_release_while_a_request_runs",
        ),
    ),
    "evicts_by_creation": Broken(
        EvictsByCreation,
        ("test_lru_by_last_use_unequal_sizes",),
    ),
    "evicts_largest_first": Broken(
        EvictsLargestFirst,
        (
            "test_lru_by_last_use_unequal_sizes",
            "test_state_machine_full_shard",
        ),
    ),
    "evicts_every_idle_session": Broken(
        EvictsEveryIdleSession,
        (
            "test_lru_by_last_use_unequal_sizes",
            "test_lru_eviction",
            "test_migration_source_unchanged",
            "test_state_machine_full_shard",
        ),
    ),
    "numpy_scalar_timings": Broken(
        NumpyScalarTimings,
        _EVERY_RESULT,
    ),
    "capabilities_with_lists": Broken(
        CapabilitiesWithLists,
        ("test_wire_round_trip_of_every_returned_object",),
    ),
    "own_error_subclass": Broken(
        OwnErrorSubclass,
        (
            "test_batch_error_items_carry_their_fields",
            "test_batched_decode_item_errors",
            "test_batched_decode_metrics",
            "test_batched_decode_order_with_interleaved_errors",
            "test_error_codes_match_taxonomy",
            "test_health_metrics_consistent",
            *_MACHINE,
        ),
    ),
    "retryable_stale_epoch": Broken(
        RetryableStaleEpoch,
        ("test_error_codes_match_taxonomy",),
    ),
    # The core refuses the NaN rows before committing them (MalformedOutput), so every test
    # whose steps reach position 6 fails on that error.
    "nan_at_position_six": Broken(
        NanAtPositionSix,
        (
            "test_batched_decode_matches_single",
            "test_chunked_prefill",
            "test_concurrent_threads_match_serial",
            "test_decode_consistency",
            "test_deterministic",
            "test_large_shuffled_batches_match_single_decodes",
            "test_long_and_shared_prefix_session_ids",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_long_session_migrates_exactly",
            "test_many_threads_many_sessions_match_serial",
            "test_migration_continues_exactly_every_role",
            "test_migration_source_unchanged",
            "test_no_starvation_behind_a_decode_loop",
            "test_outputs_finite",
            "test_resource_exhausted_kv_budget",
            "test_result_fields",
            "test_session_ids_across_characters_and_lengths",
            "test_session_isolation",
            "test_split_invariance_fixture_splits",
            "test_split_invariance_three_way",
            "test_split_invariance_two_way",
            "test_truncate",
            "test_truncate_and_new_epoch_every_role",
            "test_truncate_at_large_positions",
            *_MACHINE,
        ),
    ),
    "truncates_session_ids": Broken(
        TruncatesSessionIds,
        (
            "test_long_and_shared_prefix_session_ids",
            "test_session_ids_across_characters_and_lengths",
            *_MACHINE,
        ),
    ),
    "crash_recovers": Broken(
        CrashRecovers,
        ("test_crash_is_permanent",),
    ),
    "crash_says_degraded": Broken(
        CrashSaysDegraded,
        ("test_crash_is_permanent",),
    ),
    "errors_counted_twice": Broken(
        ErrorsCountedTwice,
        (
            "test_batched_decode_metrics",
            "test_health_metrics_consistent",
            "test_migration_metrics_and_health",
            "test_thousands_of_releases_keep_every_fence",
            *_MACHINE,
        ),
    ),
    "context_off_by_one": Broken(
        ContextOffByOne,
        ("test_limit_max_context",),
    ),
    "batch_tokens_off_by_one": Broken(
        BatchTokensOffByOne,
        (
            "test_limit_max_batch_tokens",
            "test_state_machine_full_shard",
        ),
    ),
    "sessions_off_by_one": Broken(
        SessionsOffByOne,
        (
            "test_double_release_frees_once",
            "test_error_codes_match_taxonomy",
            "test_limit_max_sessions",
            "test_migration_atomic_under_budget_pressure",
            "test_resource_exhausted_session_slots",
            "test_state_machine_full_shard",
        ),
    ),
    "kv_budget_off_by_one": Broken(
        KvBudgetOffByOne,
        (
            "test_batch_at_the_kv_budget",
            "test_batch_use_refreshes_lru_order",
            "test_failed_first_prefill_leaves_nothing",
            "test_failed_request_is_atomic",
            "test_health_states",
            "test_limit_kv_budget",
            "test_migration_atomic_under_budget_pressure",
            "test_refused_first_prefill_of_a_newer_epoch",
            "test_resource_exhausted_kv_budget",
            "test_retryable_on_every_path",
        ),
        may_fail=_MACHINE,
    ),
    "truncation_still_counted": Broken(
        TruncationStillCounted,
        (
            "test_limit_kv_budget",
            "test_refused_first_prefill_of_a_newer_epoch",
        ),
    ),
    "exceeds_declared_tolerance": Broken(
        ExceedsDeclaredTolerance,
        (
            "test_chunked_prefill",
            "test_decode_consistency",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_split_invariance_fixture_splits",
            "test_split_invariance_three_way",
            "test_split_invariance_two_way",
            "test_truncate",
            "test_truncate_and_new_epoch_every_role",
            "test_truncate_at_large_positions",
            *_MACHINE,
        ),
    ),
    "exceeds_relative_tolerance": Broken(
        ExceedsRelativeTolerance,
        (
            "test_chunked_prefill",
            "test_decode_consistency",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_split_invariance_fixture_splits",
            "test_split_invariance_three_way",
            "test_split_invariance_two_way",
            "test_truncate",
            "test_truncate_and_new_epoch_every_role",
            "test_truncate_at_large_positions",
            *_MACHINE,
        ),
    ),
    "claims_split_exact": Broken(
        ClaimsSplitExact,
        (
            "test_chunked_prefill",
            "test_decode_consistency",
            "test_long_prefill_vs_chunked_and_decode",
            "test_long_session_decode_and_chunks_match_one_prefill",
            "test_split_invariance_fixture_splits",
            "test_split_invariance_three_way",
            "test_split_invariance_two_way",
            "test_truncate",
            "test_truncate_and_new_epoch_every_role",
            "test_truncate_at_large_positions",
            *_MACHINE,
        ),
    ),
    "vacuous_tolerance": Broken(
        VacuousTolerance,
        ("test_capabilities_fields",),
    ),
    "release_counts_as_request": Broken(
        ReleaseCountsAsRequest,
        (
            "test_health_metrics_consistent",
            "test_thousands_of_releases_keep_every_fence",
            *_MACHINE,
        ),
    ),
    "batch_items_count_as_decodes": Broken(
        BatchItemsCountAsDecodes,
        ("test_batched_decode_metrics", *_MACHINE),
    ),
    "batch_item_errors_uncounted": Broken(
        BatchItemErrorsUncounted,
        ("test_batched_decode_metrics", *_MACHINE),
    ),
    "batch_refuses_duplicates_whole": Broken(
        BatchRefusesDuplicatesWhole,
        ("test_batched_decode_same_session_twice",),
        may_fail=("test_state_machine_every_role",),
    ),
    "batch_refuses_every_duplicate": Broken(
        BatchRefusesEveryDuplicate,
        ("test_batched_decode_same_session_twice",),
        may_fail=("test_state_machine_every_role",),
    ),
    "batch_evicts_later_members": Broken(
        BatchEvictsLaterMembers,
        ("test_lru_eviction",),
    ),
    "empty_fingerprint_invalid": Broken(
        EmptyFingerprintInvalid,
        ("test_boundary_checks_on_every_path",),
    ),
    "layer_zero_invalid": Broken(
        LayerZeroInvalid,
        ("test_boundary_checks_on_every_path",),
    ),
    "context_overflow_retryable": Broken(
        ContextOverflowRetryable,
        (
            "test_batch_error_items_carry_their_fields",
            "test_error_codes_match_taxonomy",
            "test_retryable_on_every_path",
        ),
    ),
    "slots_full_not_retryable": Broken(
        SlotsFullNotRetryable,
        (
            "test_error_codes_match_taxonomy",
            "test_retryable_on_every_path",
        ),
    ),
    "closed_engine_retryable": Broken(
        ClosedEngineRetryable,
        ("test_error_codes_match_taxonomy",),
    ),
    "reuses_output_buffer": Broken(
        ReusesOutputBuffer,
        (
            "test_batched_decode_matches_single",
            "test_batched_decode_order_with_interleaved_errors",
            "test_boundary_checks_on_every_path",
            "test_evidence_class",
            "test_result_fields",
            "test_wire_round_trip_of_every_returned_object",
        ),
        may_fail=("test_state_machine_every_role",),
    ),
    "crash_retryable": Broken(
        CrashRetryable,
        ("test_crash_is_permanent",),
    ),
    "cancelled_not_retryable": Broken(
        CancelledNotRetryable,
        (
            "test_cancel_rolls_back",
            "test_cancel_running_batch",
            "test_cancel_running_decode",
            "test_cancel_session_stops_all_its_requests",
        ),
        may_fail=("test_failed_first_prefill_leaves_nothing",),
    ),
    "swapped_clock_timings": Broken(
        SwappedClockTimings,
        _EVERY_RESULT,
    ),
    "memoizes_prefills": Broken(
        MemoizesPrefills,
        ("test_session_isolation",),
    ),
    "case_folds_session_ids": Broken(
        CaseFoldsSessionIds,
        ("test_long_and_shared_prefix_session_ids",),
    ),
    "epochs_as_floats": Broken(
        EpochsAsFloats,
        ("test_stale_epoch",),
    ),
    "results_keep_first_epoch": Broken(
        ResultsKeepFirstEpoch,
        ("test_stale_epoch",),
        may_fail=_MACHINE,
    ),
    "cancels_by_session_prefix": Broken(
        CancelsBySessionPrefix,
        ("test_cancel_one_of_two_in_flight",),
    ),
    "compute_time_goes_back": Broken(
        ComputeTimeGoesBack,
        (
            "test_health_metrics_consistent",
            "test_health_states",
            "test_wire_round_trip_of_every_returned_object",
        ),
        may_fail=_MACHINE,
    ),
    "exports_at_newer_epoch": Broken(
        ExportsAtNewerEpoch,
        ("test_migration_epoch_fencing",),
    ),
    "batch_items_keep_first_epoch": Broken(
        BatchItemsKeepFirstEpoch,
        (
            "test_batched_decode_matches_single",
            "test_large_shuffled_batches_match_single_decodes",
        ),
        may_fail=("test_state_machine_full_shard",),
    ),
}
"""Each broken engine and the standard tests that must fail on it (and no others)."""

_ALSO_FAILS_SCALE_TESTS: Final[dict[str, tuple[str, ...]]] = {
    "batch_ignores_session_cancel": ("test_session_ids_at_and_past_the_length_limit",),
    "cancels_by_session_prefix": ("test_session_ids_at_and_past_the_length_limit",),
    "context_off_by_one": ("test_newer_epoch_refused_on_every_path_keeps_the_older",),
    "decode_skips_checksum": ("test_retryable_at_every_contract_version_and_path",),
    "evicts_largest_first": (
        "test_export_of_an_evicted_session",
        "test_import_over_an_eviction_fence_and_a_tombstone",
    ),
    "ignores_epochs": (
        "test_import_over_an_eviction_fence_and_a_tombstone",
        "test_newer_epoch_refused_on_every_path_keeps_the_older",
    ),
    "kv_budget_off_by_one": (
        "test_export_of_an_evicted_session",
        "test_import_over_an_eviction_fence_and_a_tombstone",
        "test_retryable_at_every_contract_version_and_path",
    ),
    "nan_at_position_six": ("test_narrow_rows_round_the_f32_rows_to_nearest_even",),
    "new_epoch_keeps_length": ("test_newer_epoch_refused_on_every_path_keeps_the_older",),
    "not_thread_safe": ("test_release_while_a_decode_runs_keeps_the_others",),
    "numpy_positions_in_long_runs": ("test_narrow_rows_round_the_f32_rows_to_nearest_even",),
    "recreates_released": (
        "test_import_over_an_eviction_fence_and_a_tombstone",
        "test_release_while_a_decode_runs_keeps_the_others",
    ),
    "refuses_f16_bundles": ("test_narrow_rows_round_the_f32_rows_to_nearest_even",),
    "release_leaks_kv": (
        "test_import_over_an_eviction_fence_and_a_tombstone",
        "test_release_while_a_decode_runs_keeps_the_others",
    ),
    "reuses_output_buffer": (
        "test_empty_reserved_values_inside_bundles_refused",
        "test_narrow_rows_round_the_f32_rows_to_nearest_even",
        "test_retryable_at_every_contract_version_and_path",
    ),
    "sends_f32_when_f16": ("test_narrow_rows_round_the_f32_rows_to_nearest_even",),
    "shared_cache": ("test_release_while_a_decode_runs_keeps_the_others",),
    "truncates_session_ids": (
        "test_session_ids_at_and_past_the_length_limit",
        "test_timings_of_batches_and_imports_against_the_wall_clock",
    ),
}
"""Standard tests of conformance/_scale.py that also fail on these engines, found by running
them on every broken engine: allowed in the full pins run, not pinned (each _scale test has
broken engines of its own in scale_mutants)."""
for _name, _tests in _ALSO_FAILS_SCALE_TESTS.items():
    _entry = BROKEN_ENGINES[_name]
    BROKEN_ENGINES[_name] = _entry._replace(may_fail=_entry.may_fail + _tests)


CORRECT_ENGINES: Final[dict[str, type[ReferenceEngine]]] = {
    "reference": ReferenceEngine,
    "honest_tolerance": HonestToleranceEngine,
    "honest_relative_tolerance": HonestRelativeTolerance,
}
"""Correct engines: every standard test passes on them."""
