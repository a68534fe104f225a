"""The engine core: lifecycle, threads, backend steps and results, on top of the session ledger.

Every engine builds on :class:`EngineCore` so that the session semantics of the contract are
implemented once. An engine supplies only the backend steps (``_open``, ``_forward``,
``_rollback``, ``_commit``, ``_drop``, ``_close``). The pure :class:`~._ledger.SessionLedger`
decides what may run (epochs, fences, committed lengths, LRU evictions); the core runs every
prefill, decode and batch through one admit-run-commit step: admit (ledger decision, nothing
changed), run the backend, check its rows, then commit ledger and backend together. A failure
or a cancel anywhere before the commit point rolls the backend back and leaves the ledger,
evictions included, exactly as it was.

Threading: operations on one engine are serialised by a compute lock (a model context is not
re-entrant); ``cancel``, ``health`` and ``metrics`` never wait for it. Every counter and the
ledger change only under the state lock, which is also where ``cancel`` and the commit point
decide, so ``cancel`` answers ``cancelled=True`` only for an operation that will not commit.

The edge: each public entry point first checks its request's types, ranges and literals
(shard_engine_api._edge, one call, before any state or counter is touched), so a badly typed
request is InvalidRequest and changes nothing; only a backend's own failure can fail the engine.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, Final, Literal, Self

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import ForwardItem, ModelInfo, OutputMode, check_rows, describe
from shard_engine_api._cancel import CancelToken
from shard_engine_api._edge import check_request
from shard_engine_api._errors import (
    Cancelled,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ShardEngineError,
)
from shard_engine_api._fences import DEFAULT_GENERATION_SIZE
from shard_engine_api._inputs import InputRows, check_reserved, decode_inputs, n_rows
from shard_engine_api._ledger import Admission, LedgerLimits, SessionLedger
from shard_engine_api._metrics import Counters
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Health,
    LifecycleState,
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    ShardInput,
    ShardResult,
    Timings,
)

__all__ = [
    "CancelToken",
    "EngineCore",
    "ForwardItem",
    "ModelInfo",
    "OutputMode",
]

_log = logging.getLogger("shard_engine.core")

_SERVING: Final[frozenset[LifecycleState]] = frozenset({"ready", "degraded"})

Rows = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class _Work:
    """A checked operation ready for the admit-run-commit step: the input rows of each item
    and how the ledger admits them (single operations raise, a batch returns per-item errors).
    """

    kind: Literal["prefill", "decode"]
    output: OutputMode
    rows: Sequence[InputRows]
    admit: Callable[[], Sequence[Admission | ShardEngineError]]
    batched: bool = False


class EngineCore(abc.ABC):
    """Base class of engines: implements the whole :class:`ShardEngine` protocol on top of
    a handful of backend steps. Subclasses set ``engine_name`` and implement the abstract
    methods; they never touch the ledger. ``with engine:`` closes it on exit.

    ``fence_generation``: the fences (tombstones) of at least this many most recently released
    or evicted sessions are kept, at 17 bytes each (see ``_fences``)."""

    engine_name: ClassVar[str] = "unnamed"
    fence_generation: ClassVar[int] = DEFAULT_GENERATION_SIZE

    def __init__(self) -> None:
        self._state: LifecycleState = "unloaded"
        self._detail = "not loaded"
        self._degraded_reasons: dict[str, str] = {}
        self._config: LoadConfig | None = None
        self._info: ModelInfo | None = None
        self._capabilities: Capabilities | None = None
        self._ledger = SessionLedger(self.fence_generation)
        self._kv_budget = 0
        self._counters = Counters()
        self._compute_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._in_flight: dict[str, CancelToken] = {}

    # ----------------------------------------------------------------- backend steps

    @abc.abstractmethod
    def _open(self, config: LoadConfig) -> ModelInfo:
        """Open the shard described by ``config``. Raise a ShardEngineError (InvalidRequest,
        UnsupportedFeature, ResourceExhausted) for anything that cannot be loaded."""

    @abc.abstractmethod
    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Rows:
        """Run the shard over ``item`` and return hidden states ``(n, hidden)`` or logits
        (``(1, vocab)`` for "last", ``(n, vocab)`` for "all"). Poll ``token`` at safe points.
        Must keep enough to undo itself until ``_commit`` or ``_rollback`` is called."""

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[Rows]:
        """Run one decode row for each item (distinct slots). The default runs them one by
        one; engines with a real batched step override it. Results are in item order."""
        return [self._forward(item, output, token) for item in items]

    @abc.abstractmethod
    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        """Restore ``slot`` to exactly its state before the last uncommitted forward, which
        started at ``start_pos`` while ``committed_length`` positions were cached."""

    @abc.abstractmethod
    def _commit(self, slot: int) -> None:
        """Make the last forward on ``slot`` final (drop whatever was kept to undo it)."""

    @abc.abstractmethod
    def _drop(self, slot: int) -> None:
        """Free everything cached for ``slot`` (release, eviction)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Free the backend. Called once."""

    # ----------------------------------------------------------------- lifecycle helpers

    def _set_degraded(self, key: str, detail: str) -> None:
        """Mark the engine degraded (still serving) for ``key``; cleared by _clear_degraded."""
        with self._state_lock:
            self._degraded_reasons[key] = detail
            if self._state == "ready":
                self._state = "degraded"
            self._detail = "; ".join(self._degraded_reasons.values())

    def _clear_degraded(self, key: str) -> None:
        with self._state_lock:
            self._degraded_reasons.pop(key, None)
            if self._state == "degraded" and not self._degraded_reasons:
                self._state = "ready"
                self._detail = ""
            elif self._degraded_reasons:
                self._detail = "; ".join(self._degraded_reasons.values())

    def _fail(self, detail: str) -> None:
        """Enter the failed state: every later call raises EngineCrashed. The first failure's
        detail is kept: later calls re-enter here with messages that quote it."""
        with self._state_lock:
            if self._state not in ("closed", "failed"):
                self._state = "failed"
                self._detail = detail
                _log.error("%s engine failed: %s", self.engine_name, detail)

    def _set_kv_budget(self, tokens: int) -> None:
        """Change the KV budget (memory pressure). Sessions over it are evicted or new work is
        refused on the next admission, per the eviction policy."""
        with self._state_lock:
            self._kv_budget = max(0, tokens)

    @property
    def config(self) -> LoadConfig:
        if self._config is None:
            raise NotReady(f"{self.engine_name} engine is not loaded", retryable=False)
        return self._config

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise NotReady(f"{self.engine_name} engine is not loaded", retryable=False)
        return self._info

    # ----------------------------------------------------------------- the protocol

    @property
    def name(self) -> str:
        return self.engine_name

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def load(self, config: LoadConfig) -> Capabilities:
        """Open the shard; the engine becomes ready. Raises InvalidRequest on a second load
        (a failed load may be retried) and EngineCrashed after a crash."""
        check_request(config, LoadConfig)
        with self._compute_lock:
            with self._state_lock:
                if self._state == "failed":
                    raise EngineCrashed(f"{self.engine_name} engine has failed: {self._detail}")
                if self._state != "unloaded":
                    raise InvalidRequest(
                        f"engine is {self._state}; load() is called once per engine"
                    )
                self._state, self._detail = "loading", "loading"
            try:
                info = self._open(config)
                capabilities = describe(self.engine_name, config, info)
            except BaseException as error:
                with self._state_lock:
                    if self._state == "loading":
                        self._state, self._detail = "unloaded", "not loaded (last load failed)"
                if isinstance(error, ShardEngineError) or not isinstance(error, Exception):
                    raise
                raise InvalidRequest(f"could not load shard: {error}") from error
            with self._state_lock:
                self._config = config
                self._info = info
                self._capabilities = capabilities
                self._kv_budget = config.kv_budget_tokens
                if self._state == "loading":
                    self._state = "degraded" if self._degraded_reasons else "ready"
                    self._detail = "; ".join(self._degraded_reasons.values())
            return capabilities

    def capabilities(self) -> Capabilities:
        """What the loaded engine is and can do. Raises NotReady when not serving (before load,
        while loading, after close) and EngineCrashed after a crash."""
        with self._errors_counted():
            return self._require_serving()

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """Process a run of tokens or boundary rows; see the contract's session semantics."""
        check_request(request, PrefillRequest)
        session = request.session
        with self._operation(request.request_id, (session.session_id,)) as token:
            caps = self._require_serving()
            with self._state_lock:
                self._counters.prefill_requests += 1
            check_reserved(request.mtp, request.aux)
            rows = self._decode_inputs(
                caps, request.inputs, session, request.start_pos, single_row=False
            )
            n_tokens = n_rows(rows)
            if n_tokens > caps.limits.max_batch_tokens:
                raise InvalidRequest(
                    f"prefill of {n_tokens} tokens exceeds max_batch_tokens "
                    f"{caps.limits.max_batch_tokens}; send it in chunks"
                )
            output: OutputMode = request.logits if caps.shard.emits_logits else "hidden"
            work = _Work(
                kind="prefill",
                output=output,
                rows=(rows,),
                admit=lambda: [self._plan_prefill(caps, session, request.start_pos, n_tokens)],
            )
            outcomes, timings = self._admit_run_commit(caps, token, work)
            return self._make_result(
                caps,
                request.request_id,
                session,
                request.start_pos,
                _only_rows(outcomes),
                output,
                timings,
                n_tokens,
            )

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Process one row at ``pos`` (which must equal the committed length)."""
        check_request(request, DecodeRequest)
        session = request.session
        with self._operation(request.request_id, (session.session_id,)) as token:
            caps = self._require_serving()
            with self._state_lock:
                self._counters.decode_requests += 1
            check_reserved(request.mtp, request.aux)
            rows = self._decode_inputs(caps, request.inputs, session, request.pos, single_row=True)
            output: OutputMode = "last" if caps.shard.emits_logits else "hidden"
            work = _Work(
                kind="decode",
                output=output,
                rows=(rows,),
                admit=lambda: [self._plan_decode(caps, session, request.pos)],
            )
            outcomes, timings = self._admit_run_commit(caps, token, work)
            return self._make_result(
                caps,
                request.request_id,
                session,
                request.pos,
                _only_rows(outcomes),
                output,
                timings,
                1,
            )

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """One decode step for several distinct sessions; one result or error per item."""
        check_request(request, DecodeBatchRequest)
        sessions = tuple(item.session.session_id for item in request.items)
        with self._operation(request.request_id, sessions) as token:
            caps = self._require_serving()
            with self._state_lock:
                self._counters.batch_requests += 1
            if not request.items:
                raise InvalidRequest("decode batch has no items")
            if len(request.items) > caps.limits.max_batch_tokens:
                raise InvalidRequest(
                    f"decode batch of {len(request.items)} items exceeds max_batch_tokens "
                    f"{caps.limits.max_batch_tokens}"
                )
            output: OutputMode = "last" if caps.shard.emits_logits else "hidden"
            outcomes: dict[int, Rows | ShardEngineError] = {}
            rows: dict[int, InputRows] = {}
            seen: set[str] = set()
            for index, item in enumerate(request.items):
                try:
                    if item.session.session_id in seen:
                        raise InvalidRequest(
                            f"session {item.session.session_id!r} appears twice in one batch"
                        )
                    seen.add(item.session.session_id)
                    check_reserved(item.mtp, item.aux)
                    rows[index] = self._decode_inputs(
                        caps, item.inputs, item.session, item.pos, single_row=True
                    )
                except ShardEngineError as error:
                    outcomes[index] = error
            valid = sorted(rows)
            keys = [
                (item.session.session_id, item.session.epoch, item.pos)
                for item in (request.items[i] for i in valid)
            ]
            work = _Work(
                kind="decode",
                output=output,
                rows=[rows[i] for i in valid],
                admit=lambda: self._ledger.admit_batch(keys, self._limits(caps)),
                batched=True,
            )
            ran, timings = self._admit_run_commit(caps, token, work)
            outcomes.update(zip(valid, ran, strict=True))
            with self._state_lock:
                # Counted only now: errors of a batch that was cancelled reach no caller.
                for outcome in outcomes.values():
                    if isinstance(outcome, ShardEngineError):
                        self._counters.count_error(outcome)
            items: list[BoundaryResult | LogitsResult | ErrorInfo] = []
            for index, outcome in sorted(outcomes.items()):
                item = request.items[index]
                items.append(
                    outcome.to_info()
                    if isinstance(outcome, ShardEngineError)
                    else self._make_result(
                        caps, item.request_id, item.session, item.pos, outcome, output, timings, 1
                    )
                )
            return DecodeBatchResult(request_id=request.request_id, items=tuple(items))

    def cancel(self, request: CancelRequest) -> CancelResult:
        """Stop in-flight requests before their commit point. ``cancelled=True`` means each
        counted request will not commit (its caller gets Cancelled); False for unknown,
        finished or already committing requests. Raises InvalidRequest (neither or both of
        request_id and session_id) and EngineCrashed after a crash."""
        check_request(request, CancelRequest)
        with self._errors_counted():
            if (request.request_id is None) == (request.session_id is None):
                raise InvalidRequest("cancel needs exactly one of request_id and session_id")
            with self._state_lock:
                if self._state == "failed":
                    raise EngineCrashed(f"{self.engine_name} engine has failed: {self._detail}")
                if request.request_id is not None:
                    found = self._in_flight.get(request.request_id)
                    tokens = [] if found is None else [found]
                else:
                    tokens = [
                        t for t in self._in_flight.values() if request.session_id in t.session_ids
                    ]
                stopped = sum(1 for cancel_token in tokens if cancel_token.try_cancel())
            return CancelResult(cancelled=stopped > 0, n_requests=stopped)

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Free a session and tombstone its epoch. Unknown sessions are a no-op that says so;
        a second release frees nothing."""
        check_request(request, ReleaseRequest)
        session = request.session
        with self._errors_counted():
            self._require_serving()
            with self._compute_lock:
                self._require_serving()
                with self._state_lock:
                    fences_dropped = self._ledger.fences.dropped
                    decision = self._ledger.release(session.session_id, session.epoch)
                    self._note_fences(fences_dropped)
                    if decision.slot is not None:
                        self._counters.releases += 1
                if decision.slot is None:
                    return ReleaseResult(released=False, detail=decision.detail)
                self._drop(decision.slot)
                return ReleaseResult(released=True, detail=f"freed {decision.length} positions")

    def health(self) -> Health:
        """The lifecycle state and occupancy now. Never raises."""
        with self._state_lock:
            detail = self._detail
            dropped = self._ledger.fences.dropped
            if dropped:
                note = (
                    f"{dropped} session fences dropped early (only the newest "
                    f"{self._ledger.fences.generation_size} are guaranteed)"
                )
                detail = f"{detail}; {note}" if detail else note
            return Health(
                state=self._state,
                detail=detail,
                sessions=len(self._ledger.sessions),
                in_flight=len(self._in_flight),
                kv_used_tokens=self._ledger.kv_used,
                kv_budget_tokens=self._kv_budget,
            )

    def metrics(self) -> Metrics:
        """Counters since load. Never raises."""
        with self._state_lock:
            ledger = self._ledger
            return self._counters.snapshot(
                sessions_active=len(ledger.sessions),
                tombstones=len(ledger.fences),
                fences_dropped=ledger.fences.dropped,
                kv_used_tokens=ledger.kv_used,
            )

    def close(self) -> None:
        """Free everything; later calls raise NotReady. Idempotent."""
        with self._state_lock:
            if self._state == "closed":
                return
            for cancel_token in self._in_flight.values():
                cancel_token.cancel()
        with self._compute_lock:
            with self._state_lock:
                was_loaded = self._config is not None
                self._state, self._detail = "closed", "closed"
                self._ledger.clear()
            if was_loaded:
                self._close()

    # ----------------------------------------------------------------- operation frame

    @contextlib.contextmanager
    def _errors_counted(self) -> Iterator[None]:
        """Count every error a caller sees; a non-library exception is a backend crash."""
        try:
            yield
        except ShardEngineError as error:
            with self._state_lock:
                self._counters.count_error(error)
            if isinstance(error, EngineCrashed):
                self._fail(error.message)
            elif isinstance(error, Cancelled):
                _log.info("%s: %s; rolled back", self.engine_name, error.message)
            raise
        except Exception as error:
            crashed = EngineCrashed(f"backend failure: {type(error).__name__}: {error}")
            with self._state_lock:
                self._counters.count_error(crashed)
            self._fail(crashed.message)
            raise crashed from error

    @contextlib.contextmanager
    def _operation(self, request_id: str, session_ids: Sequence[str]) -> Iterator[CancelToken]:
        with self._errors_counted():
            if not request_id:
                raise InvalidRequest("request_id must be non-empty")
            token = CancelToken(request_id, frozenset(session_ids))
            with self._state_lock:
                if request_id in self._in_flight:
                    raise InvalidRequest(f"request_id {request_id!r} is already in flight")
                self._in_flight[request_id] = token
                self._counters.requests += 1
            try:
                yield token
            finally:
                with self._state_lock:
                    if self._in_flight.get(request_id) is token:
                        del self._in_flight[request_id]

    def _require_serving(self) -> Capabilities:
        state, capabilities = self._state, self._capabilities
        if state in _SERVING and capabilities is not None:
            return capabilities
        if state == "failed":
            raise EngineCrashed(f"{self.engine_name} engine has failed: {self._detail}")
        if state == "unloaded":
            raise NotReady(
                f"{self.engine_name} engine is not loaded; call load() first", retryable=False
            )
        raise NotReady(f"{self.engine_name} engine is {state}", retryable=state == "loading")

    # ----------------------------------------------------------------- admission

    def _decode_inputs(
        self,
        caps: Capabilities,
        inputs: ShardInput,
        session: SessionRef,
        start_pos: int,
        *,
        single_row: bool,
    ) -> InputRows:
        """Check the inputs against the role and the request; return tokens or hidden rows."""
        return decode_inputs(caps, inputs, session, start_pos, single_row=single_row)

    def _limits(self, caps: Capabilities) -> LedgerLimits:
        """What admission may use now (called under the state lock: the budget may change)."""
        return LedgerLimits(
            max_sessions=caps.limits.max_sessions,
            max_context=caps.limits.max_context,
            kv_budget=self._kv_budget,
            evict_lru=caps.features.eviction,
            spare_slot=self.model_info.spare_slot,
        )

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        return self._ledger.admit_prefill(
            session.session_id, session.epoch, start_pos, n_tokens, self._limits(caps)
        )

    def _plan_decode(self, caps: Capabilities, session: SessionRef, pos: int) -> Admission:
        return self._ledger.admit_decode(session.session_id, session.epoch, pos, self._limits(caps))

    # ----------------------------------------------------------------- admit, run, commit

    def _admit_run_commit(
        self, caps: Capabilities, token: CancelToken, work: _Work
    ) -> tuple[list[Rows | ShardEngineError], Timings]:
        """Admit, run, check and commit under the compute lock; any failure or cancel before
        the commit point rolls every admitted item back and changes nothing in the ledger."""
        started = time.perf_counter()
        with self._compute_lock:
            queue_ms = (time.perf_counter() - started) * 1000.0
            token.check()
            self._require_serving()
            with self._state_lock:
                decisions = list(work.admit())
            admitted = [(i, d) for i, d in enumerate(decisions) if isinstance(d, Admission)]
            compute_started = time.perf_counter()
            outputs = self._run_and_commit(caps, token, work, admitted)
            compute_ms = (time.perf_counter() - compute_started) * 1000.0
        results: list[Rows | ShardEngineError] = []
        ran = iter(outputs)
        for decision in decisions:
            results.append(decision if isinstance(decision, ShardEngineError) else next(ran))
        total_ms = (time.perf_counter() - started) * 1000.0
        return results, Timings(queue_ms=queue_ms, compute_ms=compute_ms, total_ms=total_ms)

    def _run_and_commit(
        self,
        caps: Capabilities,
        token: CancelToken,
        work: _Work,
        indexed: Sequence[tuple[int, Admission]],
    ) -> list[Rows]:
        if not indexed:
            return []
        admitted = [admission for _, admission in indexed]
        token.check()
        for admission in admitted:
            self._hand_over(admission)
        items = [
            ForwardItem(
                slot=admission.slot,
                start_pos=admission.start_pos,
                committed_length=admission.committed_length,
                tokens=work.rows[index][0],
                hidden=work.rows[index][1],
            )
            for index, admission in indexed
        ]
        started = time.perf_counter()
        try:
            if work.batched:
                outputs = self._forward_batch(items, work.output, token)
            else:
                outputs = [self._forward(items[0], work.output, token)]
            if len(outputs) != len(items):
                raise EngineCrashed(f"backend returned {len(outputs)} results for {len(items)}")
            dtype = self.config.boundary_dtype
            for rows, item in zip(outputs, items, strict=True):
                check_rows(caps, dtype, rows, work.output, item.n_tokens)
            compute_ms = (time.perf_counter() - started) * 1000.0
            with self._state_lock:
                token.seal()  # the commit point: a cancel from now on answers False
                fences_dropped = self._ledger.fences.dropped
                dropped = self._ledger.commit(admitted)
                self._note_fences(fences_dropped)
                counters = self._counters
                n_tokens = sum(item.n_tokens for item in items)
                if work.kind == "prefill":
                    counters.prefill_tokens += n_tokens
                else:
                    counters.decode_tokens += n_tokens
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            self._rollback_all(admitted)
            raise
        for admission in admitted:
            self._commit(admission.slot)
        for slot in dropped:
            self._drop(slot)
        if dropped:
            _log.info("%s evicted %d idle session(s) (LRU)", self.engine_name, len(dropped))
        return outputs

    def _note_fences(self, dropped_before: int) -> None:
        """Say so when fences were forgotten early (also counted in metrics and health)."""
        dropped = self._ledger.fences.dropped - dropped_before
        if dropped:
            _log.warning(
                "%s dropped %d session fences early: their old epochs are accepted again",
                self.engine_name,
                dropped,
            )

    def _hand_over(self, admission: Admission) -> None:
        """The one eviction that precedes the forward: every slot is in use and the backend
        has no spare slot, so the LRU victim's slot goes to the new session now."""
        if admission.evict_first is None:
            return
        with self._state_lock:
            fences_dropped = self._ledger.fences.dropped
            slot = self._ledger.hand_over(admission)
            self._note_fences(fences_dropped)
            self._counters.evictions += 1
        if slot is not None:
            self._drop(slot)
            _log.info("%s evicted 1 idle session (LRU) for a slot", self.engine_name)

    def _rollback_all(self, admitted: Sequence[Admission]) -> None:
        for admission in admitted:
            try:
                self._rollback(admission.slot, admission.start_pos, admission.committed_length)
            except Exception as error:
                self._fail(f"rollback failed: {error}")
                raise EngineCrashed(f"rollback of slot {admission.slot} failed: {error}") from error

    # ----------------------------------------------------------------- results

    def _make_result(
        self,
        caps: Capabilities,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        rows: Rows,
        output: OutputMode,
        timings: Timings,
        n_tokens: int,
    ) -> BoundaryResult | LogitsResult:
        if output == "hidden":
            bundle = BoundaryBundle.from_array(
                rows,
                session=session,
                first_pos=start_pos,
                layer=caps.shard.end,
                model_fingerprint=caps.model_fingerprint,
                dtype=self.config.boundary_dtype,
            )
            return BoundaryResult(
                request_id=request_id,
                session=session,
                first_pos=start_pos,
                n_tokens=bundle.n_tokens,
                evidence=caps.evidence,
                bundle=bundle,
                timings=timings,
            )
        first_pos = start_pos if output == "all" else start_pos + n_tokens - 1
        return LogitsResult.from_array(
            rows,
            request_id=request_id,
            session=session,
            first_pos=first_pos,
            evidence=caps.evidence,
            timings=timings,
        )


def _only_rows(outcomes: Sequence[Rows | ShardEngineError]) -> Rows:
    """The rows of a single operation (its admission raises rather than returning an error)."""
    (outcome,) = outcomes
    if isinstance(outcome, ShardEngineError):
        raise outcome
    return outcome
