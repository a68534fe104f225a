"""The engine core: lifecycle, threads, backend steps and results, on top of the session ledger.

Every engine builds on :class:`EngineCore` so that the session semantics of the contract are
implemented once. An engine supplies only the backend steps (``_open``, ``_forward``,
``_rollback``, ``_commit``, ``_drop``, ``_close``), and, for session migration, the two optional
state hooks ``_export_state`` and ``_import_state``. The pure :class:`~._ledger.SessionLedger`
decides what may run (epochs, fences, committed lengths, LRU evictions); the core runs every
prefill, decode and batch through one admit-run-commit step: admit (ledger decision, nothing
changed), run the backend, check its rows, then commit ledger and backend together. A failure or a
cancel anywhere before the commit point rolls the backend back and leaves the ledger, evictions
included, exactly as it was. Those steps, and the backend steps they call, live in
``shard_engine_api._steps`` (:class:`~._steps.CoreSteps`, this class's base); this module keeps
the entry points, the lifecycle and the operation frame (request registration, errors counted).

Threading: operations on one engine take turns on the backend (a model context is not
re-entrant) through the scheduler (``shard_engine_api._scheduler``): in arrival order, with
single decodes of different sessions that wait together run as one batched forward
(continuous batching, see :meth:`EngineCore._decode_step`). ``cancel``, ``health`` and
``metrics`` never wait for it, and a request waiting for its turn leaves as soon as it is
cancelled (Cancelled within the cancel latency, however long the operation ahead of it runs).
Every counter and the ledger change only under the state lock, which is also where ``cancel``
and the commit point decide, so ``cancel`` answers ``cancelled=True`` only for an operation that
will not commit. The ledger changes only while its changer holds the backend too, so admission,
which only reads it, needs just the turn.

The edge: each public entry point first checks its request's types, ranges and literals
(shard_engine_api._typecheck, one call, before any state or counter is touched), so a badly typed
request is InvalidRequest and changes nothing; only a backend's own failure can fail the engine.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Collection, Iterator
from types import TracebackType
from typing import ClassVar, Final, Literal, Self

from shard_engine_api._backend import ForwardItem, ModelInfo, OutputMode, describe
from shard_engine_api._cancel import CancelToken
from shard_engine_api._errors import (
    Cancelled,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ShardEngineError,
    UnsupportedFeature,
    clamp_text,
)
from shard_engine_api._fences import DEFAULT_GENERATION_SIZE
from shard_engine_api._inputs import InputRows, batch_rows, check_reserved, decode_inputs, n_rows
from shard_engine_api._ledger import LedgerLimits, SessionLedger
from shard_engine_api._lifecycle import Lifecycle
from shard_engine_api._metrics import Counters
from shard_engine_api._results import build_result
from shard_engine_api._scheduler import Scheduler
from shard_engine_api._snapshot import (
    SnapshotTarget,
    build_snapshot,
    check_snapshot_integrity,
    check_snapshot_target,
)
from shard_engine_api._steps import _DIGEST_ENTRIES, CoreSteps, Rows, _DecodeJob, _Work
from shard_engine_api._typecheck import check_request
from shard_engine_api._types import (
    MAX_DETAIL_CHARS,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ExportSessionRequest,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    LifecycleState,
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    SessionSnapshot,
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


class EngineCore(CoreSteps):
    """Base class of engines: implements the whole :class:`ShardEngine` protocol on top of
    a handful of backend steps. Subclasses set ``engine_name`` and implement the abstract
    methods; they never touch the ledger. ``with engine:`` closes it on exit.

    ``fence_generation``: the fences (tombstones) of at least this many most recently released
    or evicted sessions are kept, at 17 bytes each (see ``_fences``).

    ``max_snapshot_bytes``: the largest session state ``import_session`` accepts (larger ones
    are ResourceExhausted before anything is hashed or installed).

    ``rows_private``: a backend sets it True when every array ``_forward`` and
    ``_forward_batch`` return (or the arrays they are views of) is allocated for that call and
    never written again. The core then makes the rows read-only and uses their memory as the
    result's payload instead of copying it (one copy of a 262k-vocabulary logits row saved per
    token). With False (the default) the core copies, so a backend may reuse its buffers. A
    private backend that copies its output out of its own buffers can hash it on the way
    (``shard_engine_api._dtypes.copy_checksum_and_finite``) and say so with
    :meth:`_record_digest`: the payload is then not read a second time."""

    engine_name: ClassVar[str] = "unnamed"
    prefill_chunk_tokens: int = 0
    """A prefill longer than this many rows (0: never) runs as chunks of it, one forward each,
    and the single decodes of other sessions that wait run as one forward between two chunks:
    a decode waits for at most one chunk, not the whole prefill. The chunks' forwards share one
    commit or rollback, so a backend that opts in (set it in ``_open``) must take several
    forwards of one slot before ``_commit``/``_rollback``: chunk ``k > 0`` comes with
    ``start_pos == committed_length`` (where the previous chunk ended), and the rollback names
    the first chunk's ``start_pos`` and ``committed_length``. Chunks start at multiples of it
    from the prefill's start: set it to the backend's own micro-batch so chunked results equal
    unchunked ones bit for bit."""
    fence_generation: ClassVar[int] = DEFAULT_GENERATION_SIZE
    max_snapshot_bytes: ClassVar[int] = 1 << 32
    rows_private: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lifecycle = Lifecycle(self.engine_name)
        self._config: LoadConfig | None = None
        self._info: ModelInfo | None = None
        self._capabilities: Capabilities | None = None
        self._ledger = SessionLedger(self.fence_generation)
        self._kv_budget = 0
        self._admission_limits: LedgerLimits | None = None
        self._snapshot_target: SnapshotTarget | None = None
        self._counters = Counters()
        self._scheduler: Scheduler[_DecodeJob] = Scheduler()
        self._state_lock = threading.Lock()
        self._in_flight: dict[str, CancelToken] = {}
        self._digests: dict[int, tuple[weakref.ref[Rows], int, bool]] = {}
        self._digest_limit = _DIGEST_ENTRIES

    # ----------------------------------------------------------------- backend steps
    # (``_forward``, ``_forward_batch``, ``_rollback``, ``_commit`` and ``_drop`` are declared,
    # with the steps that call them, in ``_steps.CoreSteps``)

    @abc.abstractmethod
    def _open(self, config: LoadConfig) -> ModelInfo:
        """Open the shard described by ``config``. Raise a ShardEngineError (InvalidRequest,
        UnsupportedFeature, ResourceExhausted) for anything that cannot be loaded."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Free the backend. Called once."""

    def _export_state(self, slot: int, length: int) -> bytes:
        """The opaque state of positions ``0..length-1`` of the session in ``slot`` (what
        :meth:`_import_state` of an engine with the same settings fingerprint installs). Must
        not change the slot. Called under the compute lock with no uncommitted forward on the
        slot. Engines that implement both hooks set ``Features(session_migration=True)``;
        the default raises UnsupportedFeature."""
        raise UnsupportedFeature(f"{self.engine_name} engine cannot export session state")

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        """Install ``state`` (from :meth:`_export_state`, verified against its checksum) as
        positions ``0..length-1`` of the EMPTY ``slot``. Raise a ShardEngineError on failure
        (InvalidRequest for state that does not decode, ResourceExhausted when the backend
        has no room); the core drops the slot after any failure, so partial work needs no
        undo. Any other exception is reported as InvalidRequest once the slot is dropped.
        The default raises UnsupportedFeature."""
        raise UnsupportedFeature(f"{self.engine_name} engine cannot import session state")

    # ----------------------------------------------------------------- lifecycle helpers

    def _set_degraded(self, key: str, detail: str) -> None:
        """Mark the engine degraded (still serving) for ``key``; cleared by _clear_degraded."""
        with self._state_lock:
            self._lifecycle.degrade(key, detail)

    def _clear_degraded(self, key: str) -> None:
        with self._state_lock:
            self._lifecycle.recover(key)

    def _fail(self, detail: str) -> None:
        """Enter the failed state: every later call raises EngineCrashed. The first failure's
        detail is kept: later calls re-enter here with messages that quote it."""
        with self._state_lock:
            entered = self._lifecycle.fail(detail)
        if entered:
            _log.error("%s engine failed: %s", self.engine_name, detail)

    def _set_kv_budget(self, tokens: int) -> None:
        """Change the KV budget (memory pressure) within ``[0, the configured budget]``: the
        configured budget is the one advertised in ``Limits``, so pressure can only shrink it.
        Sessions over it are evicted or new work is refused on the next admission, per the
        eviction policy."""
        with self._state_lock:
            configured = self._config.kv_budget_tokens if self._config is not None else 0
            self._kv_budget = min(max(0, tokens), configured)

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
        with self._computing():
            with self._state_lock:
                self._lifecycle.begin_load()
            try:
                info = self._open(config)
                capabilities = describe(self.engine_name, config, info)
            except BaseException as error:
                with self._state_lock:
                    self._lifecycle.load_failed()
                if isinstance(error, ShardEngineError) or not isinstance(error, Exception):
                    raise
                raise InvalidRequest(f"could not load shard: {error}") from error
            with self._state_lock:
                self._config = config
                self._info = info
                self._capabilities = capabilities
                self._kv_budget = config.kv_budget_tokens
                self._admission_limits = LedgerLimits(
                    max_sessions=capabilities.limits.max_sessions,
                    max_context=capabilities.limits.max_context,
                    kv_budget=self._kv_budget,
                    evict_lru=capabilities.features.eviction,
                    spare_slot=info.spare_slot,
                )
                self._snapshot_target = SnapshotTarget.of(
                    capabilities, config.boundary_dtype, info.settings
                )
                self._lifecycle.loaded()
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
        token = self._begin(request.request_id, (session.session_id,), "prefill")
        try:
            caps = self._require_serving()
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
            tokens, hidden = rows
            result_rows, timings = self._prefill_step(
                caps, token, output, tokens, hidden, session, request.start_pos, n_tokens
            )
            return self._make_result(
                caps,
                request.request_id,
                session,
                request.start_pos,
                result_rows,
                output,
                timings,
                n_tokens,
            )
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error
        finally:
            self._end(token)

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Process one row at ``pos`` (which must equal the committed length)."""
        check_request(request, DecodeRequest)
        session = request.session
        token = self._begin(request.request_id, (session.session_id,), "decode")
        try:
            caps = self._require_serving()
            if request.mtp or request.aux:
                check_reserved(request.mtp, request.aux)
            tokens, hidden = self._decode_inputs(
                caps, request.inputs, session, request.pos, single_row=True
            )
            output: OutputMode = "last" if caps.shard.emits_logits else "hidden"
            rows, timings = self._decode_step(
                caps, token, output, tokens, hidden, session, request.pos
            )
            return self._make_result(
                caps, request.request_id, session, request.pos, rows, output, timings, 1
            )
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error
        finally:
            self._end(token)

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """One decode step for several distinct sessions; one result or error per item."""
        check_request(request, DecodeBatchRequest)
        sessions = tuple(item.session.session_id for item in request.items)
        token = self._begin(request.request_id, frozenset(sessions), "batch")
        try:
            caps = self._require_serving()
            if not request.items:
                raise InvalidRequest("decode batch has no items")
            if len(request.items) > caps.limits.max_batch_tokens:
                raise InvalidRequest(
                    f"decode batch of {len(request.items)} items exceeds max_batch_tokens "
                    f"{caps.limits.max_batch_tokens}"
                )
            output: OutputMode = "last" if caps.shard.emits_logits else "hidden"
            rows, errors = batch_rows(
                request.items,
                lambda item: self._decode_inputs(
                    caps, item.inputs, item.session, item.pos, single_row=True
                ),
            )
            outcomes: dict[int, Rows | ShardEngineError] = dict(errors)
            valid = sorted(rows)
            keys = [
                (item.session.session_id, item.session.epoch, item.pos)
                for item in (request.items[i] for i in valid)
            ]
            work = _Work(
                kind="decode",
                output=output,
                rows=[rows[i] for i in valid],
                admit=lambda: self._ledger.admit_batch(keys, self._limits()),
                batched=True,
            )
            ran, timings = self._admit_run_commit(caps, token, work, sessions)
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
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error
        finally:
            self._end(token)

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
                self._lifecycle.require_alive()
                if request.request_id is not None:
                    found = self._in_flight.get(request.request_id)
                    tokens = [] if found is None else [found]
                else:
                    tokens = [
                        t for t in self._in_flight.values() if request.session_id in t.session_ids
                    ]
                stopped = 0
                for cancel_token in tokens:
                    if cancel_token.try_cancel():
                        stopped += 1
                        self._scheduler.wake(cancel_token)  # a waiting request leaves now
            return CancelResult(cancelled=stopped > 0, n_requests=stopped)

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Free a session and tombstone its epoch. Unknown sessions are a no-op that says so;
        a second release frees nothing."""
        check_request(request, ReleaseRequest)
        session = request.session
        with self._errors_counted():
            self._require_serving()
            with self._computing(None, (session.session_id,)):
                self._require_serving()
                with self._state_lock:
                    decision = self._ledger.release(session.session_id, session.epoch)
                    if decision.slot is not None:
                        self._counters.releases += 1
                if decision.slot is None:
                    return ReleaseResult(
                        released=False, detail=clamp_text(decision.detail, MAX_DETAIL_CHARS)
                    )
                self._drop(decision.slot)
                return ReleaseResult(released=True, detail=f"freed {decision.length} positions")

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """Snapshot a live session at exactly its epoch. Changes nothing: not the session,
        not its LRU position (being moved away is not a use)."""
        check_request(request, ExportSessionRequest)
        session = request.session
        token = self._begin(request.request_id, (session.session_id,))
        try:
            caps = self._require_serving()
            target = self._migration_target(caps)
            with self._computing(token, (session.session_id,)):
                token.check()
                self._require_serving()
                with self._state_lock:
                    entry = self._ledger.check_export(session.session_id, session.epoch)
                    slot, length = entry.slot, entry.length
                state = self._export_state(slot, length)
                if not isinstance(state, bytes | bytearray | memoryview):
                    raise EngineCrashed(
                        f"backend exported {type(state).__name__}, not bytes, for slot {slot}"
                    )
                with self._state_lock:
                    token.check()
                    self._seal(token)
                    self._counters.exports += 1
            return build_snapshot(target, caps, session, length, bytes(state))
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error
        finally:
            self._end(token)

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """Install a snapshot as a live session, atomically (see the package README, "Session
        migration"): every check runs before any state is touched, the state goes into an
        empty slot, and the ledger (a replaced older epoch, evictions) changes only at the
        commit point, after the backend succeeded."""
        check_request(request, ImportSessionRequest)
        snapshot = request.snapshot
        session_id = snapshot.session.session_id
        token = self._begin(request.request_id, (session_id,))
        try:
            caps = self._require_serving()
            check_snapshot_target(snapshot, self._migration_target(caps))
            epoch = snapshot.session.epoch if request.epoch is None else request.epoch
            if epoch < snapshot.session.epoch:
                raise InvalidRequest(
                    f"import epoch {epoch} is older than the snapshot's epoch "
                    f"{snapshot.session.epoch}",
                    details={"field": "ImportSessionRequest.epoch"},
                )
            state = check_snapshot_integrity(snapshot, max_state_bytes=self.max_snapshot_bytes)
            started = time.perf_counter()
            with self._computing(token, (session_id,)):
                compute_started = time.perf_counter()
                token.check()
                self._require_serving()
                with self._state_lock:
                    admission = self._ledger.admit_import(
                        session_id, epoch, snapshot.length, self._limits()
                    )
                try:
                    try:
                        self._import_state(admission.slot, admission.length, state)
                    except ShardEngineError:
                        raise
                    except Exception as error:
                        raise InvalidRequest(
                            f"snapshot state could not be installed: {type(error).__name__}: "
                            f"{error}"
                        ) from error
                    with self._state_lock:
                        token.check()
                        self._seal(token)  # the commit point: a cancel from now on answers False
                        dropped = self._ledger.commit_import(admission)
                        self._counters.imports += 1
                        self._counters.evictions += len(admission.evict)
                except BaseException:
                    self._discard_slot(admission.slot)
                    raise
                for slot in dropped:
                    self._drop(slot)
                finished = time.perf_counter()
            if admission.evict:
                _log.info(
                    "%s evicted %d idle session(s) (LRU) for an import",
                    self.engine_name,
                    len(admission.evict),
                )
            return ImportSessionResult(
                request_id=request.request_id,
                session=SessionRef(session_id=session_id, epoch=epoch),
                length=admission.length,
                replaced=admission.replaces is not None,
                evicted=len(admission.evict),
                timings=Timings(
                    queue_ms=(compute_started - started) * 1000.0,
                    compute_ms=(finished - compute_started) * 1000.0,
                    total_ms=(time.perf_counter() - started) * 1000.0,
                ),
            )
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error
        finally:
            self._end(token)

    def health(self) -> Health:
        """The lifecycle state and occupancy now. Never raises."""
        with self._state_lock:
            detail = "; ".join(filter(None, (self._lifecycle.detail, self._ledger.fences.note)))
            return Health(
                state=self._lifecycle.state,
                # A backend's failure message may be of any length; the wire's bound is not.
                detail=clamp_text(detail, MAX_DETAIL_CHARS),
                sessions=len(self._ledger.sessions),
                in_flight=len(self._in_flight),
                kv_used_tokens=self._ledger.kv_used,
                kv_budget_tokens=self._kv_budget,
                queued=self._scheduler.queued,
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
                queue=self._scheduler.stats_now(),
            )

    def close(self) -> None:
        """Free everything; later calls raise NotReady. Idempotent."""
        with self._state_lock:
            if self._lifecycle.state == "closed":
                return
            for cancel_token in self._in_flight.values():
                cancel_token.cancel()
        self._scheduler.wake_all()
        with self._computing():
            with self._state_lock:
                was_loaded = self._config is not None
                self._lifecycle.close()
                self._ledger.clear()
            if was_loaded:
                self._close()

    # ----------------------------------------------------------------- operation frame

    def _caller_sees(self, error: Exception) -> ShardEngineError:
        """Count an error a caller is about to see; a non-library exception is a backend
        crash (only a backend's own failure fails the engine)."""
        seen = (
            error
            if isinstance(error, ShardEngineError)
            else EngineCrashed(f"backend failure: {type(error).__name__}: {error}")
        )
        with self._state_lock:
            self._counters.count_error(seen)
        if isinstance(seen, EngineCrashed):
            self._fail(seen.message)
        elif isinstance(seen, Cancelled):
            _log.info("%s: %s; rolled back", self.engine_name, seen.message)
        return seen

    @contextlib.contextmanager
    def _errors_counted(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            seen = self._caller_sees(error)
            if seen is error:
                raise
            raise seen from error

    def _begin(
        self,
        request_id: str,
        session_ids: Collection[str],
        operation: Literal["prefill", "decode", "batch"] | None = None,
    ) -> CancelToken:
        """Register a request for cancel() while it runs (ended by :meth:`_seal` or
        :meth:`_end`) and count it; an ``operation`` is also counted by kind when the engine
        is serving (the caller's next step refuses it otherwise)."""
        if not request_id:
            raise self._caller_sees(InvalidRequest("request_id must be non-empty"))
        token = CancelToken(request_id, session_ids)
        with self._state_lock:
            duplicate = request_id in self._in_flight
            if not duplicate:
                self._in_flight[request_id] = token
                counters = self._counters
                counters.requests += 1
                if (
                    operation is not None
                    and self._capabilities is not None
                    and self._lifecycle.state in _SERVING
                ):
                    if operation == "decode":
                        counters.decode_requests += 1
                    elif operation == "prefill":
                        counters.prefill_requests += 1
                    else:
                        counters.batch_requests += 1
        if duplicate:
            raise self._caller_sees(
                InvalidRequest(f"request_id {request_id!r} is already in flight")
            )
        return token

    def _end(self, token: CancelToken) -> None:
        """End a request's registration, unless its commit point already did."""
        if token.sealed:
            return
        with self._state_lock:
            if self._in_flight.get(token.request_id) is token:
                del self._in_flight[token.request_id]

    @contextlib.contextmanager
    def _computing(
        self, token: CancelToken | None = None, session_ids: Collection[str] | None = None
    ) -> Iterator[None]:
        """Take the backend for one operation on ``session_ids`` (None: on everything), in
        arrival order. With a request's ``token``, a cancel ends the wait (Cancelled; nothing
        was touched before, so nothing needs undoing); without one (load, release, close) the
        wait is not cancellable."""
        scheduler = self._scheduler
        scheduler.enter(token, session_ids)
        try:
            yield
        finally:
            scheduler.leave()

    def _require_serving(self) -> Capabilities:
        capabilities = self._capabilities
        if capabilities is not None and self._lifecycle.state in _SERVING:
            return capabilities
        self._lifecycle.require_serving()
        if capabilities is None:  # serving implies loaded
            raise NotReady(f"{self.engine_name} engine is not loaded", retryable=False)
        return capabilities

    def _migration_target(self, caps: Capabilities) -> SnapshotTarget:
        """What snapshots of this engine say; UnsupportedFeature without session migration."""
        target = self._snapshot_target
        if not caps.features.session_migration or target is None:
            raise UnsupportedFeature(
                f"{self.engine_name} engine does not support session migration "
                "(Features.session_migration is false)"
            )
        return target

    def _discard_slot(self, slot: int) -> None:
        """Drop whatever a failed import left in ``slot``; a backend that cannot is failed."""
        try:
            self._drop(slot)
        except Exception as error:
            self._fail(f"dropping slot {slot} after a failed import failed: {error}")
            raise EngineCrashed(
                f"dropping slot {slot} after a failed import failed: {error}"
            ) from (error)

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
        digest: tuple[int, bool] | None = None
        if self._digests:
            entry = self._digests.pop(id(rows), None)
            if entry is not None and entry[0]() is rows:
                digest = entry[1], entry[2]
        return build_result(
            caps,
            self.config.boundary_dtype,
            rows,
            output,
            # Rows with a digest are the backend's private rows or the core's own copy.
            rows_private=self.rows_private or digest is not None,
            digest=digest,
            request_id=request_id,
            session=session,
            start_pos=start_pos,
            n_tokens=n_tokens,
            timings=timings,
        )
