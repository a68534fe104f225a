"""The fake engine: the deterministic model of ``_model`` behind :class:`EngineCore`, with the
fault plan of ``_faults`` applied around the core's operations.

The core owns every session rule (epochs, CacheMiss, StaleEpoch, budgets, cancellation,
rollback); this module only keeps one cache per slot and per layer and makes each forward
undoable until the core commits or rolls it back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar, Final, TypeVar

import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    BoundaryDtype,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    EngineCrashed,
    ExportSessionRequest,
    Features,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    LoadConfig,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ResourceExhausted,
    SessionSnapshot,
    ShardResult,
)
from shard_engine_api.engine import (
    TEST_OPTIONS_ENV,
    CancelToken,
    EngineCore,
    ForwardItem,
    ModelInfo,
    OutputMode,
    test_options_enabled,
)
from shard_engine_fake._corrupt import corrupt_result
from shard_engine_fake._faults import (
    Crash,
    Delay,
    FaultEvent,
    FaultInjector,
    FaultPlan,
    FaultRule,
    Malformed,
    MemoryPressure,
    MemoryRelief,
    Operation,
    StateFailure,
    fault_plan_from_options,
)
from shard_engine_fake._model import LOGIT_BOUND, FakeModel, FakeModelSpec, resolve_model

__all__ = ["ENGINE_VERSION", "FakeEngine"]

ENGINE_VERSION: Final = "0.1.0"
_KNOWN_OPTIONS: Final = frozenset({"seed", "hidden_size", "vocab_size", "faults"})
_MEMORY_KEY: Final = "fault:memory_pressure"
_LANE_DTYPE: Final = np.dtype("<u2")
# Exported state: every cache entry of every layer as its packed lanes (little-endian uint16,
# each below 2048), layer-major: n_shard_layers x length x hidden_size lanes.
_STATE_LAYOUT: Final = "cum-u16-layer-major-v1"
_Result = TypeVar("_Result")


BF16_LOGIT_TOLERANCE: Final = 2 * LOGIT_BOUND
"""The fake's declared tolerance with bf16 boundaries: the width of its logit range, i.e. no
useful bound (see :func:`_determinism`)."""


def _determinism(boundary_dtype: BoundaryDtype) -> Determinism:
    """What the fake promises with ``boundary_dtype`` boundaries.

    Hidden states are integers in [-1024, 1024): exact in f32 and f16, so with those dtypes
    any split gives bitwise the logits of one full shard. bf16 keeps 8 significant bits: a
    bf16 boundary carries each value rounded to nearest even (exact for |v| <= 256, even
    integers up to 512, multiples of 4 up to 1024), and the receiving shard reads the nearest
    integer wrapped into 11 bits (so 1024 becomes -1024). That is deterministic and
    batch-invariant, but the model's mixing spreads the rounding over every later value, so a
    bf16 pipeline is not split-exact and its logits may differ from a full shard's anywhere
    within their range: the declared tolerance is that range's width. Compare splits with f32
    or f16 boundaries; bf16 exercises the dtype's conversions and checks end to end.
    """
    if boundary_dtype == "bf16":
        return Determinism(
            deterministic=True,
            split_exact=False,
            tolerance=BF16_LOGIT_TOLERANCE,
            batch_invariant=True,
        )
    return Determinism(deterministic=True, split_exact=True, batch_invariant=True)


class _CallFaults(threading.local):
    """The injected delay of the operation running on this thread: the core calls the backend
    on the caller's thread, so a thread-local hands it from the public method to ``_forward``."""

    delay_seconds: float = 0.0
    state_failure: str | None = None


class FakeEngine(EngineCore):
    """A deterministic shard engine with no model files, no GPU and injectable faults.

    Load options (``LoadConfig.options``): ``seed``, ``hidden_size``, ``vocab_size`` (integers,
    completing or repeating the model reference) and ``faults`` (a :class:`FaultPlan` or its
    JSON-compatible form). Unknown options are refused with InvalidRequest.
    """

    engine_name: ClassVar[str] = "fake"
    # Every array _forward and _forward_batch return is new and never written again.
    rows_private: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._model: FakeModel | None = None
        self._caches: dict[int, list[list[int]]] = {}
        # Per slot, the cache entries its uncommitted forward replaced (from its start_pos on,
        # per layer); none for a forward that only appended (every decode).
        self._undo: dict[int, list[list[int]]] = {}
        self._injector = FaultInjector(FaultPlan(), "full")
        self._faults_on = False  # whether a rule can fire (the plan is fixed at load)
        self._call_faults = _CallFaults()

    # ----------------------------------------------------------------- introspection

    @property
    def model_spec(self) -> FakeModelSpec:
        """The loaded model's parameters. Raises NotReady before load."""
        return self._loaded_model().spec

    @property
    def fault_plan(self) -> FaultPlan:
        """The fault plan in force (empty when none was given)."""
        return self._injector.plan

    def fault_events(self) -> tuple[FaultEvent, ...]:
        """Every injected fault so far, in firing order."""
        return self._injector.events()

    # ----------------------------------------------------------------- backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
        unknown = sorted(set(config.options) - _KNOWN_OPTIONS)
        if unknown:
            raise InvalidRequest(
                f"unknown fake engine options {unknown}; known: {sorted(_KNOWN_OPTIONS)}"
            )
        spec = resolve_model(config.shard, config.options)
        plan = fault_plan_from_options(config.options)
        if "faults" in config.options and not test_options_enabled():
            _refuse_process_ending_rules(plan)
        self._model = FakeModel(spec, config.shard.start, config.shard.end)
        self._injector = FaultInjector(plan, config.shard.role)
        self._faults_on = self._injector.active
        return ModelInfo(
            engine_version=ENGINE_VERSION,
            evidence="fixture",
            model_fingerprint=spec.fingerprint,
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            determinism=_determinism(config.boundary_dtype),
            features=Features(cancel=True, cancel_latency_ms=10.0, session_migration=True),
            boundary_dtypes=("f32", "f16", "bf16"),
            # Caches are per-slot dicts, so one slot beyond max_sessions costs nothing and lets
            # an LRU eviction wait for the new session's commit.
            spare_slot=True,
            settings=(("state_layout", _STATE_LAYOUT),),
        )

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        model = self._loaded_model()
        states = self._run(model, item, token)
        if self._faults_on:
            self._injected_delay(token)
        if output == "hidden":
            return model.unpack(states)
        return model.logits(states if output == "all" or len(states) == 1 else states[-1:])

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[npt.NDArray[np.float32]]:
        model = self._loaded_model()
        states = [self._run(model, item, token)[0] for item in items]
        if self._faults_on:
            self._injected_delay(token)
        # Integer-exact, so each row is bitwise what a single decode gives. Each item gets an
        # array of its own, not a view: a result's payload is then memory it alone owns (which
        # is what lets the core's finiteness mark stand, see rows_private).
        return model.unpack_each(states) if output == "hidden" else model.logits_each(states)

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        replaced = self._undo.pop(slot, None)
        caches = self._caches.get(slot)
        if caches is None:
            return
        for layer, cache in enumerate(caches):
            del cache[start_pos:]
            if replaced is not None:
                cache.extend(replaced[layer])
            if len(cache) != committed_length:
                raise EngineCrashed(
                    f"fake cache of slot {slot} holds {len(cache)} positions after rollback, "
                    f"expected {committed_length}"
                )
        if committed_length == 0:
            del self._caches[slot]

    def _commit(self, slot: int) -> None:
        self._undo.pop(slot, None)

    def _drop(self, slot: int) -> None:
        self._caches.pop(slot, None)
        self._undo.pop(slot, None)

    def _export_state(self, slot: int, length: int) -> bytes:
        model = self._loaded_model()
        caches = self._caches.get(slot)
        if caches is None or any(len(cache) != length for cache in caches):
            held = None if caches is None else [len(cache) for cache in caches]
            raise EngineCrashed(f"fake cache of slot {slot} holds {held} positions, not {length}")
        size = model.row_bytes
        state = b"".join([entry.to_bytes(size, "little") for cache in caches for entry in cache])
        if self._faults_on:
            self._state_faults()
        return state

    def max_state_bytes(self, length: int) -> int:
        """The size of an exported state of ``length`` positions (exact: one row per position
        per layer), which a server checks an import stream's header against before reading
        its body."""
        model = self._loaded_model()
        return (model.end - model.start) * length * model.row_bytes

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        model = self._loaded_model()
        if slot in self._caches:
            raise EngineCrashed(f"fake slot {slot} is not empty at import")
        n_layers = model.end - model.start
        size = model.row_bytes
        expected = n_layers * length * size
        if len(state) != expected:
            raise InvalidRequest(
                f"fake session state holds {len(state)} bytes; {length} positions of "
                f"{n_layers} layers take {expected}"
            )
        if int(np.max(np.frombuffer(state, dtype=_LANE_DTYPE))) >= 2048:
            raise InvalidRequest("fake session state holds a lane value outside [0, 2048)")
        view = memoryview(state)
        entries = [
            int.from_bytes(view[at : at + size], "little") for at in range(0, expected, size)
        ]
        self._caches[slot] = [
            entries[layer * length : (layer + 1) * length] for layer in range(n_layers)
        ]
        if self._faults_on:
            self._state_faults()  # after the slot was written: the core must drop it

    def _close(self) -> None:
        self._caches.clear()
        self._undo.clear()
        self._model = None

    # ----------------------------------------------------------------- the operations, with faults

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """The core's prefill, with the fault plan applied (see :class:`FaultRule`)."""
        if not self._faults_on:
            return super().prefill(request)
        session_id = request.session.session_id
        rules = self._before("prefill", (session_id,), request.request_id)
        result = self._with_delay(rules, lambda: super(FakeEngine, self).prefill(request))
        return _corrupt(result, rules, session_id)

    def decode(self, request: DecodeRequest) -> ShardResult:
        """The core's decode, with the fault plan applied (see :class:`FaultRule`)."""
        if not self._faults_on:
            return super().decode(request)
        session_id = request.session.session_id
        rules = self._before("decode", (session_id,), request.request_id)
        result = self._with_delay(rules, lambda: super(FakeEngine, self).decode(request))
        return _corrupt(result, rules, session_id)

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """The core's batched decode, with the fault plan applied; malformed-output rules
        corrupt the items of their session (every item when the rule names none)."""
        if not self._faults_on:
            return super().decode_batch(request)
        sessions = tuple(item.session.session_id for item in request.items)
        rules = self._before("decode_batch", sessions, request.request_id)
        batch = self._with_delay(rules, lambda: super(FakeEngine, self).decode_batch(request))
        items = list(batch.items)
        for index, outcome in enumerate(items):
            if isinstance(outcome, ShardResult):
                items[index] = _corrupt(outcome, rules, outcome.session.session_id)
        return DecodeBatchResult(request_id=batch.request_id, items=tuple(items))

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """The core's release, with the fault plan applied (delays sleep uncancellably:
        release has no cancel handle)."""
        if not self._faults_on:
            return super().release(request)
        rules = self._before("release", (request.session.session_id,), "release")
        delay = sum(rule.action.milliseconds for rule in rules if isinstance(rule.action, Delay))
        if delay:
            threading.Event().wait(delay / 1000.0)
        return super().release(request)

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """The core's export, with the fault plan applied (delays sleep uncancellably before
        the state is read; a cancel meanwhile still ends it with Cancelled)."""
        if not self._faults_on:
            return super().export_session(request)
        rules = self._before("export_session", (request.session.session_id,), request.request_id)
        return self._with_state_faults(
            rules, lambda: super(FakeEngine, self).export_session(request)
        )

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """The core's import, with the fault plan applied (see :class:`StateFailure`)."""
        if not self._faults_on:
            return super().import_session(request)
        rules = self._before(
            "import_session", (request.snapshot.session.session_id,), request.request_id
        )
        return self._with_state_faults(
            rules, lambda: super(FakeEngine, self).import_session(request)
        )

    # ----------------------------------------------------------------- internals

    def _with_state_faults(
        self, rules: Sequence[FaultRule], call: Callable[[], _Result]
    ) -> _Result:
        delay = sum(rule.action.milliseconds for rule in rules if isinstance(rule.action, Delay))
        failure = next(
            (rule.action.detail for rule in rules if isinstance(rule.action, StateFailure)), None
        )
        self._call_faults.state_failure = failure
        self._call_faults.delay_seconds = delay / 1000.0
        try:
            return call()
        finally:
            self._call_faults.state_failure = None
            self._call_faults.delay_seconds = 0.0

    def _state_faults(self) -> None:
        """Apply the injected faults of the running export or import to its state step: the
        delay sleeps while the request is in flight (a cancel meanwhile makes the core answer
        Cancelled and drop what was written), then the failure raises."""
        faults = self._call_faults
        seconds, faults.delay_seconds = faults.delay_seconds, 0.0
        if seconds:
            threading.Event().wait(seconds)
        if faults.state_failure is not None:
            raise ResourceExhausted(faults.state_failure, details={"resource": "memory"})

    def _loaded_model(self) -> FakeModel:
        model = self._model
        if model is None:
            raise EngineCrashed("fake engine has no model (not loaded or closed)")
        return model

    def _prepare(self, model: FakeModel, item: ForwardItem) -> list[list[int]]:
        """The slot's layer caches, cut to ``item.start_pos``; what the cut removed is kept
        for a rollback (nothing for a plain append, every decode)."""
        caches = self._caches.get(item.slot)
        if caches is None:
            caches = self._caches[item.slot] = [[] for _ in range(model.end - model.start)]
        start = item.start_pos
        if start < len(caches[0]):
            self._undo[item.slot] = [cache[start:] for cache in caches]
            for cache in caches:
                del cache[start:]
        return caches

    def _run(self, model: FakeModel, item: ForwardItem, token: CancelToken) -> list[int]:
        caches = self._prepare(model, item)
        if item.tokens is not None:
            inputs = model.embed(item.tokens)
        else:
            assert item.hidden is not None
            inputs = model.pack(item.hidden)
        if len(inputs) == 1:
            token.check()
            return [model.run_row(inputs[0], caches)]
        run_row = model.run_row
        states: list[int] = []
        for state in inputs:
            # A safe point per row: cancellation of a long prefill takes effect within one row.
            token.check()
            states.append(run_row(state, caches))
        return states

    def _injected_delay(self, token: CancelToken) -> None:
        seconds = self._call_faults.delay_seconds
        if seconds:
            self._call_faults.delay_seconds = 0.0
            token.sleep(seconds)

    def _before(
        self, operation: Operation, session_ids: Sequence[str], request_id: str
    ) -> list[FaultRule]:
        rules = self._injector.fire(operation, session_ids, request_id)
        for rule in rules:
            action = rule.action
            if isinstance(action, MemoryPressure):
                self._set_kv_budget(action.kv_budget_tokens)
                self._set_degraded(
                    _MEMORY_KEY,
                    f"injected memory pressure: KV budget {action.kv_budget_tokens} positions",
                )
            elif isinstance(action, MemoryRelief):
                self._set_kv_budget(self.config.kv_budget_tokens)
                self._clear_degraded(_MEMORY_KEY)
            elif isinstance(action, Crash):
                if action.abort:
                    os.abort()
                if action.exit_code is not None:
                    os._exit(action.exit_code)
                # The core then refuses this very call with EngineCrashed (and counts it).
                self._fail(action.detail)
        return rules

    def _with_delay(self, rules: Sequence[FaultRule], call: Callable[[], _Result]) -> _Result:
        delay = sum(rule.action.milliseconds for rule in rules if isinstance(rule.action, Delay))
        self._call_faults.delay_seconds = delay / 1000.0
        try:
            return call()
        finally:
            self._call_faults.delay_seconds = 0.0


def _corrupt(result: ShardResult, rules: Sequence[FaultRule], session_id: str) -> ShardResult:
    for rule in rules:
        action = rule.action
        if isinstance(action, Malformed) and rule.session_id in (None, session_id):
            result = corrupt_result(result, action.defect)
    return result


def _refuse_process_ending_rules(plan: FaultPlan) -> None:
    """A crash rule with ``exit_code`` or ``abort`` ends the whole process, not just this
    engine. A LoadConfig may come from whoever asks a worker (or a served engine) to load a
    shard, and only whoever starts the process may let it end: such rules in
    ``options["faults"]`` need the process to run with SHARD_ENGINE_TEST_OPTIONS=1 (a plan
    file named by SHARD_ENGINE_FAKE_FAULTS is the process owner's own). Raises
    InvalidRequest."""
    for index, rule in enumerate(plan.rules):
        action = rule.action
        if isinstance(action, Crash) and (action.exit_code is not None or action.abort):
            raise InvalidRequest(
                f"fault rule {index} ends the process (crash with exit_code or abort): refused "
                f"in options['faults'] unless the process runs with {TEST_OPTIONS_ENV}=1",
                details={"field": "LoadConfig.options.faults"},
            )
