"""The engine core: lifecycle, threads, backend steps and results, on top of the session ledger.

Every engine builds on :class:`EngineCore` so that the session semantics of the contract are
implemented once. An engine supplies only the backend steps (``_open``, ``_forward``,
``_rollback``, ``_commit``, ``_drop``, ``_close``), and, for session migration, the two optional
state hooks ``_export_state`` and ``_import_state``. The pure :class:`~._ledger.SessionLedger`
decides what may run (epochs, fences, committed lengths, LRU evictions); the core runs every
prefill, decode and batch through one admit-run-commit step: admit (ledger decision, nothing
changed), run the backend, check its rows, then commit ledger and backend together. A failure or a
cancel anywhere before the commit point rolls the backend back and leaves the ledger, evictions
included, exactly as it was.

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
(shard_engine_api._edge, one call, before any state or counter is touched), so a badly typed
request is InvalidRequest and changes nothing; only a backend's own failure can fail the engine.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from types import TracebackType
from typing import ClassVar, Final, Literal, Self

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import ForwardItem, ModelInfo, OutputMode, describe
from shard_engine_api._cancel import CancelToken
from shard_engine_api._errors import (
    Cancelled,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    ShardEngineError,
    UnsupportedFeature,
    clamp_text,
)
from shard_engine_api._fences import DEFAULT_GENERATION_SIZE
from shard_engine_api._inputs import InputRows, batch_rows, check_reserved, decode_inputs, n_rows
from shard_engine_api._ledger import Admission, LedgerLimits, SessionLedger
from shard_engine_api._lifecycle import Lifecycle
from shard_engine_api._metrics import Counters
from shard_engine_api._results import build_result, check_rows, scan_rows
from shard_engine_api._scheduler import Scheduler
from shard_engine_api._snapshot import (
    SnapshotTarget,
    build_snapshot,
    check_snapshot_integrity,
    check_snapshot_target,
)
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


Rows = npt.NDArray[np.float32]
_SERVING: Final[frozenset[LifecycleState]] = frozenset({"ready", "degraded"})


@dataclasses.dataclass(slots=True)
class _Work:
    """A checked operation ready for the admit-run-commit step: the input rows of each item
    and how the ledger admits them (single operations raise, a batch returns per-item errors).
    """

    kind: Literal["prefill", "decode"]
    output: OutputMode
    rows: Sequence[InputRows]
    admit: Callable[[], Sequence[Admission | ShardEngineError]]
    batched: bool = False


@dataclasses.dataclass(slots=True)
class _DecodeJob:
    """A single decode waiting to run, possibly in another caller's coalesced forward; the
    leader that runs it sets ``outcome`` (rows and timings, or the error its caller raises)."""

    token: CancelToken
    output: OutputMode
    tokens: npt.NDArray[np.int32] | None
    hidden: Rows | None
    session: SessionRef
    pos: int
    started: float
    outcome: tuple[Rows, Timings] | BaseException | None = None


_DIGEST_ENTRIES: Final = 1024
"""How many recorded row digests :meth:`EngineCore._record_digest` keeps before it first drops
those of rows that no longer exist."""


class EngineCore(abc.ABC):
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

    def _record_digest(self, rows: Rows, checksum: int, finite: bool) -> None:
        """Say that ``rows``, an array ``_forward`` or ``_forward_batch`` returns, hash to
        ``checksum`` (payload_checksum of its bytes) and are all finite or not, as computed when
        the backend wrote them. Used only with ``rows_private`` (the rows cannot change after);
        the entry is consumed by the result built from them (an entry whose rows died first is
        never used: the lookup checks identity; such entries are swept out in bulk)."""
        if self.rows_private:
            if len(self._digests) >= self._digest_limit:
                self._sweep_digests()
            self._digests[id(rows)] = (weakref.ref(rows), checksum, finite)

    def _scanned_rows(self, rows: Rows) -> tuple[Rows, bool]:
        """The rows a result will be built from and whether every value is finite, known
        before the commit point: what the backend recorded while writing them, else one pass
        that is recorded in turn, so the result is not scanned again. Rows a backend may still
        change (``rows_private`` False) are copied first, as the result would copy them
        anyway: the copy is what is scanned and what the result carries."""
        if self._digests:
            entry = self._digests.get(id(rows))
            if entry is not None and entry[0]() is rows:
                return rows, entry[2]
        if not self.rows_private:
            rows = np.array(rows, order="C")  # a copy that is the core's own
        checksum, finite = scan_rows(rows)
        if checksum is not None:
            if len(self._digests) >= self._digest_limit:
                self._sweep_digests()
            self._digests[id(rows)] = (weakref.ref(rows), checksum, finite)
        return rows, finite

    def _sweep_digests(self) -> None:
        """Drop the digests of rows that died unconsumed (a failed step): swept here rather
        than by a weakref callback, a closure on every row of every step. The next sweep waits
        until the table has doubled, so a batch of many live rows costs one sweep per
        doubling, not one per row."""
        digests = self._digests
        for key, (ref, _, _) in list(digests.items()):
            if ref() is None:
                digests.pop(key, None)
        self._digest_limit = max(_DIGEST_ENTRIES, 2 * len(digests))

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

    def _seal(self, token: CancelToken) -> None:
        """The commit point (under the state lock): raise Cancelled if the request was
        cancelled, else refuse every later cancel and end its registration, so the request's
        ``finally`` need not take the lock again."""
        token.seal()
        if self._in_flight.get(token.request_id) is token:
            del self._in_flight[token.request_id]

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

    def _limits(self) -> LedgerLimits:
        """What admission may use now (read under the state lock: the budget may change)."""
        limits = self._admission_limits
        if limits is None:
            raise NotReady(f"{self.engine_name} engine is not loaded", retryable=False)
        if limits.kv_budget != self._kv_budget:  # memory pressure changed the budget
            limits = self._admission_limits = dataclasses.replace(limits, kv_budget=self._kv_budget)
        return limits

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        return self._ledger.admit_prefill(
            session.session_id, session.epoch, start_pos, n_tokens, self._limits()
        )

    def _plan_decode(self, caps: Capabilities, session: SessionRef, pos: int) -> Admission:
        return self._ledger.admit_decode(session.session_id, session.epoch, pos, self._limits())

    # ----------------------------------------------------------------- admit, run, commit

    def _admit_run_commit(
        self, caps: Capabilities, token: CancelToken, work: _Work, session_ids: Collection[str]
    ) -> tuple[list[Rows | ShardEngineError], Timings]:
        """Admit, run, check and commit in the backend's turn; any failure or cancel before
        the commit point rolls every admitted item back and changes nothing in the ledger."""
        started = time.perf_counter()
        scheduler = self._scheduler
        scheduler.enter(token, session_ids)
        try:
            compute_started = time.perf_counter()
            token.check()
            self._require_serving()
            decisions = work.admit()  # reads the ledger only (see _admit_run_commit_one)
            admitted = [d for d in decisions if isinstance(d, Admission)]
            if len(admitted) == len(decisions):
                outputs = self._run_and_commit(caps, token, work, admitted, work.rows)
                results: list[Rows | ShardEngineError] = list(outputs)
            else:
                rows = [
                    r for d, r in zip(decisions, work.rows, strict=True) if isinstance(d, Admission)
                ]
                ran = iter(self._run_and_commit(caps, token, work, admitted, rows))
                results = [d if isinstance(d, ShardEngineError) else next(ran) for d in decisions]
            finished = time.perf_counter()
        finally:
            scheduler.leave()
        timings = Timings(
            queue_ms=(compute_started - started) * 1000.0,
            compute_ms=(finished - compute_started) * 1000.0,
            total_ms=(time.perf_counter() - started) * 1000.0,
        )
        return results, timings

    def _run_and_commit(
        self,
        caps: Capabilities,
        token: CancelToken,
        work: _Work,
        admitted: Sequence[Admission],
        rows: Sequence[InputRows],
    ) -> list[Rows | ShardEngineError]:
        if not admitted:
            return []
        for admission in admitted:
            if admission.evict_first is not None:
                self._hand_over(admission, token)
        items = [
            ForwardItem(
                slot=admission.slot,
                start_pos=admission.start_pos,
                committed_length=admission.committed_length,
                tokens=tokens,
                hidden=hidden,
            )
            for admission, (tokens, hidden) in zip(admitted, rows, strict=True)
        ]
        started = time.perf_counter()
        try:
            if work.batched:
                outputs = self._forward_batch(items, work.output, token)
            else:
                outputs = [self._forward(items[0], work.output, token)]
            if len(outputs) != len(items):
                raise EngineCrashed(f"backend returned {len(outputs)} results for {len(items)}")
            outputs = list(outputs)
            dtype = self.config.boundary_dtype
            rows_each = 1 if work.batched else items[0].n_tokens
            # An item whose rows are not finite is that item's error (MalformedOutput, rolled
            # back below); the others commit as usual.
            refused: dict[int, ShardEngineError] = {}
            for index, output_rows in enumerate(outputs):
                outputs[index], finite = self._scanned_rows(output_rows)
                try:
                    check_rows(caps, dtype, outputs[index], work.output, rows_each, finite=finite)
                except MalformedOutput as error:
                    refused[index] = error
            committing = (
                [a for index, a in enumerate(admitted) if index not in refused]
                if refused
                else admitted
            )
            compute_ms = (time.perf_counter() - started) * 1000.0
            with self._state_lock:
                self._seal(token)  # the commit point: a cancel from now on answers False
                dropped = self._ledger.commit(committing)
                counters = self._counters
                if work.kind == "prefill":
                    counters.prefill_tokens += rows_each
                else:
                    counters.decode_tokens += rows_each * len(committing)
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            self._rollback_all(admitted)
            raise
        if refused:
            self._rollback_all([admitted[index] for index in sorted(refused)])
        for admission in committing:
            self._commit(admission.slot)
        for slot in dropped:
            self._drop(slot)
        if dropped:
            _log.info("%s evicted %d idle session(s) (LRU)", self.engine_name, len(dropped))
        return [refused.get(index, rows) for index, rows in enumerate(outputs)]

    def _hand_over(self, admission: Admission, token: CancelToken) -> None:
        """The one eviction that precedes the forward: every slot is in use and the backend
        has no spare slot, so the LRU victim's slot goes to the new session now (not after a
        cancel)."""
        token.check()
        with self._state_lock:
            slot = self._ledger.hand_over(admission)
            self._counters.evictions += 1
        if slot is not None:
            self._drop(slot)
            _log.info("%s evicted 1 idle session (LRU) for a slot", self.engine_name)

    def _prefill_step(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        start_pos: int,
        n_prefill: int,
    ) -> tuple[Rows, Timings]:
        """One prefill, in its turn (a prefill is never coalesced)."""
        started = time.perf_counter()
        scheduler = self._scheduler
        scheduler.enter(token, (session.session_id,))
        try:
            return self._run_one(
                caps, token, output, tokens, hidden, session, start_pos, n_prefill, started
            )
        finally:
            scheduler.leave()

    def _decode_step(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        pos: int,
    ) -> tuple[Rows, Timings]:
        """One decode row, run alone when the backend is idle, else queued: a decode that
        waits may be run by the leader of a coalesced forward (continuous batching: the
        thread whose request reaches the front runs every waiting single decode of other
        sessions as one ``_forward_batch``, see ``_scheduler``), and its outcome handed back.
        Alone or coalesced, a request keeps its own admission, result or error, timings,
        cancel and rollback (:meth:`_run_group`)."""
        started = time.perf_counter()
        scheduler = self._scheduler
        if scheduler.try_enter_alone():  # idle: at once, alone
            try:
                return self._run_one(
                    caps, token, output, tokens, hidden, session, pos, None, started
                )
            finally:
                scheduler.leave()
        job = _DecodeJob(token, output, tokens, hidden, session, pos, started)
        ticket = scheduler.enter_decode(token, session.session_id, job)
        if scheduler.leads(ticket):
            try:
                group = scheduler.gather(ticket, caps.limits.max_batch_tokens)
                forward_started = time.perf_counter()
                try:
                    if len(group) == 1:
                        job.outcome = self._run_one(
                            caps, token, output, tokens, hidden, session, pos, None, started
                        )
                    else:
                        self._run_group(caps, [member.payload for member in group])
                finally:
                    scheduler.finish_group(group, time.perf_counter() - forward_started)
            finally:
                scheduler.leave()
        return _job_outcome(job)

    def _run_group(
        self,
        caps: Capabilities,
        payloads: Sequence[_DecodeJob | None],
        *,
        protect: Collection[str] = (),
        reserved: int = 0,
    ) -> None:
        """Run coalesced single decodes as one batched forward and set each job's outcome.
        Each job is admitted on its own (an item the ledger refuses gets its own error). The
        forward runs under a token of its own that a cancel of any member also sets: the
        forward then stops, is rolled back whole, and the members not cancelled run again
        without the cancelled ones, so a cancel never fails or changes another request. A
        member cancelled too late to stop the forward is rolled back alone at the commit
        point. A backend failure is every member's error. ``protect`` and ``reserved``: what a
        chunked prefill running between its chunks holds (see ``SessionLedger.admit_batch``)."""
        jobs = [job for job in payloads if job is not None]
        try:
            self._run_group_until_done(caps, jobs, protect, reserved)
        except BaseException as error:
            for job in jobs:
                if job.outcome is None:
                    job.outcome = error
            if not isinstance(error, Exception):
                raise

    def _run_group_until_done(
        self, caps: Capabilities, jobs: list[_DecodeJob], protect: Collection[str], reserved: int
    ) -> None:
        pending = jobs
        while pending:
            compute_started = time.perf_counter()
            live: list[_DecodeJob] = []
            for job in pending:
                if job.token.cancelled:
                    job.outcome = Cancelled(f"request {job.token.request_id!r} was cancelled")
                else:
                    live.append(job)
            if not live:
                return
            self._require_serving()
            decisions = self._ledger.admit_batch(
                [(job.session.session_id, job.session.epoch, job.pos) for job in live],
                self._limits(),
                protect=protect,
                reserved=reserved,
            )
            running: list[_DecodeJob] = []
            admitted: list[Admission] = []
            for job, decision in zip(live, decisions, strict=True):
                if isinstance(decision, ShardEngineError):
                    job.outcome = decision
                else:
                    running.append(job)
                    admitted.append(decision)
            if not running:
                return
            pending = self._forward_group(caps, running, admitted, compute_started)

    def _forward_group(
        self,
        caps: Capabilities,
        jobs: list[_DecodeJob],
        admitted: list[Admission],
        compute_started: float,
    ) -> list[_DecodeJob]:
        """One batched forward of admitted jobs; returns the jobs to run again (a member's
        cancel stopped the forward), else sets every outcome and returns []."""
        output = jobs[0].output
        forward_token = CancelToken(
            f"coalesced decode of {len(jobs)} requests", [job.session.session_id for job in jobs]
        )
        with self._state_lock:
            for job in jobs:
                job.token.linked = forward_token
                if job.token.cancelled:
                    forward_token.cancel()
        items = [
            ForwardItem(
                slot=admission.slot,
                start_pos=admission.start_pos,
                committed_length=admission.committed_length,
                tokens=job.tokens,
                hidden=job.hidden,
            )
            for job, admission in zip(jobs, admitted, strict=True)
        ]
        forward_started = time.perf_counter()
        try:
            try:
                outputs = list(self._forward_batch(items, output, forward_token))
            except Cancelled:
                if not any(job.token.cancelled for job in jobs):
                    raise  # the engine is closing: every member's error
                self._rollback_all(admitted)
                return jobs  # without the cancelled ones, which hear Cancelled
            if len(outputs) != len(items):
                raise EngineCrashed(f"backend returned {len(outputs)} results for {len(items)}")
            dtype = self.config.boundary_dtype
            refused: dict[int, ShardEngineError] = {}
            for index, output_rows in enumerate(outputs):
                outputs[index], finite = self._scanned_rows(output_rows)
                try:
                    check_rows(caps, dtype, outputs[index], output, 1, finite=finite)
                except MalformedOutput as error:
                    refused[index] = error
            compute_ms = (time.perf_counter() - forward_started) * 1000.0
            with self._state_lock:
                committing: list[int] = []
                for index, job in enumerate(jobs):
                    job.token.linked = None
                    if index in refused:
                        continue
                    if job.token.cancelled:  # too late to stop the forward: rolled back alone
                        refused[index] = Cancelled(
                            f"request {job.token.request_id!r} was cancelled"
                        )
                        continue
                    self._seal(job.token)  # the commit point: a cancel from now on answers False
                    committing.append(index)
                dropped = self._ledger.commit([admitted[index] for index in committing])
                counters = self._counters
                counters.decode_tokens += len(committing)
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            with self._state_lock:
                for job in jobs:
                    job.token.linked = None
            self._rollback_all(admitted)
            raise
        if refused:
            self._rollback_all([admitted[index] for index in sorted(refused)])
        for index in committing:
            self._commit(admitted[index].slot)
        for slot in dropped:
            self._drop(slot)
        if dropped:
            _log.info("%s evicted %d idle session(s) (LRU)", self.engine_name, len(dropped))
        finished = time.perf_counter()
        for index, job in enumerate(jobs):
            failed = refused.get(index)
            if failed is not None:
                job.outcome = failed
                continue
            job.outcome = (
                outputs[index],
                Timings(
                    queue_ms=(compute_started - job.started) * 1000.0,
                    compute_ms=(finished - compute_started) * 1000.0,
                    total_ms=(finished - job.started) * 1000.0,
                ),
            )
        return []

    def _run_one(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        start_pos: int,
        n_prefill: int | None,
        started: float,
    ) -> tuple[Rows, Timings]:
        """One prefill of ``n_prefill`` rows (a decode when None), in the backend's turn,
        through exactly the steps of :meth:`_admit_run_commit` and :meth:`_run_and_commit`,
        without their lists: every lone decode step goes this way, and the lists cost more
        than the checks."""
        compute_started = time.perf_counter()
        token.check()
        self._require_serving()
        # Admission only reads the ledger, and every change to it happens in the backend's
        # turn too: no state lock needed.
        admission = (
            self._plan_decode(caps, session, start_pos)
            if n_prefill is None
            else self._plan_prefill(caps, session, start_pos, n_prefill)
        )
        if admission.evict_first is not None:
            self._hand_over(admission, token)
        admitted = (admission,)
        item = ForwardItem(
            slot=admission.slot,
            start_pos=admission.start_pos,
            committed_length=admission.committed_length,
            tokens=tokens,
            hidden=hidden,
        )
        forward_started = time.perf_counter()
        try:
            chunk = self.prefill_chunk_tokens
            if (
                n_prefill is not None
                and 0 < chunk < n_prefill
                and not admission.evict
                and admission.evict_first is None
            ):
                rows = self._forward_chunks(caps, token, item, output, admission, chunk)
            else:
                rows = self._forward(item, output, token)
            rows, finite = self._scanned_rows(rows)
            n_rows = 1 if n_prefill is None else n_prefill
            check_rows(caps, self.config.boundary_dtype, rows, output, n_rows, finite=finite)
            compute_ms = (time.perf_counter() - forward_started) * 1000.0
            with self._state_lock:
                self._seal(token)  # the commit point: a cancel from now on answers False
                dropped = self._ledger.commit(admitted)
                counters = self._counters
                if n_prefill is None:
                    counters.decode_tokens += n_rows
                else:
                    counters.prefill_tokens += n_rows
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            self._rollback_all(admitted)
            raise
        self._commit(admission.slot)
        for slot in dropped:
            self._drop(slot)
        if dropped:
            _log.info("%s evicted %d idle session(s) (LRU)", self.engine_name, len(dropped))
        finished = time.perf_counter()
        timings = Timings(
            queue_ms=(compute_started - started) * 1000.0,
            compute_ms=(finished - compute_started) * 1000.0,
            total_ms=(time.perf_counter() - started) * 1000.0,
        )
        return rows, timings

    def _forward_chunks(
        self,
        caps: Capabilities,
        token: CancelToken,
        item: ForwardItem,
        output: OutputMode,
        admission: Admission,
        chunk: int,
    ) -> Rows:
        """A long prefill as forwards of ``chunk`` rows (see ``prefill_chunk_tokens``), the
        waiting single decodes of other sessions run between two chunks; returns the rows the
        whole prefill returns. A prefill that evicts runs whole (its victims could otherwise be
        decoded meanwhile), as does anything else (:meth:`_run_one` decides)."""
        start, end = item.start_pos, item.start_pos + item.n_tokens
        parts: list[Rows] = []
        session_id = admission.session_id
        growth = max(0, admission.new_length - admission.committed_length)
        for first in range(start, end, chunk):
            last = min(first + chunk, end)
            part = ForwardItem(
                slot=item.slot,
                start_pos=first,
                committed_length=item.committed_length if first == start else first,
                tokens=None if item.tokens is None else item.tokens[first - start : last - start],
                hidden=None if item.hidden is None else item.hidden[first - start : last - start],
            )
            rows = self._forward(part, output, token)
            if output != "last" or last == end:
                parts.append(rows if self.rows_private else np.array(rows))
            if last < end:
                token.check()
                self._between_chunks(caps, session_id, growth)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _between_chunks(self, caps: Capabilities, session_id: str, reserved: int) -> None:
        """Run the single decodes of other sessions that wait as one forward, while a chunked
        prefill of ``session_id`` holds the backend and ``reserved`` positions of the budget."""
        scheduler = self._scheduler
        members = scheduler.take_decodes(caps.limits.max_batch_tokens, session_id)
        if not members:
            return
        try:
            self._run_group(
                caps,
                [member.payload for member in members],
                protect=(session_id,),
                reserved=reserved,
            )
        finally:
            scheduler.finish_members(members)

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


def _job_outcome(job: _DecodeJob) -> tuple[Rows, Timings]:
    """What the leader that ran ``job`` handed back: its rows and timings, or its error."""
    outcome = job.outcome
    if isinstance(outcome, BaseException):
        raise outcome
    if outcome is None:  # every leader path sets it; a lost outcome is the engine's failure
        raise EngineCrashed(f"decode {job.token.request_id!r} ran without an outcome")
    return outcome
