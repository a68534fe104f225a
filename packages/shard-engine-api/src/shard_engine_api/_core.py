"""The engine core: session ledger, lifecycle, admission, cancellation and rollback.

Every engine builds on :class:`EngineCore` so that the session semantics of the contract are
implemented once. An engine supplies only the backend steps (``_open``, ``_forward``,
``_rollback``, ``_commit``, ``_drop``, ``_close``); the core decides what may run, keeps the
committed lengths, epochs, tombstones and LRU order, and makes every operation atomic: when a
backend step fails or is cancelled, the core asks the backend to restore the committed state
and the ledger is left untouched.

Threading: operations on one engine are serialised by a compute lock (a model context is not
re-entrant); ``cancel``, ``health`` and ``metrics`` never wait for it.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    UnsupportedFeature,
    WrongRole,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    EvidenceClass,
    Features,
    Health,
    LifecycleState,
    Limits,
    LoadConfig,
    LogitsResult,
    Metrics,
    MtpState,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ReservedHooks,
    SessionRef,
    ShardInput,
    ShardResult,
    Timings,
    TokenInput,
)

__all__ = [
    "CancelToken",
    "EngineCore",
    "ForwardItem",
    "ModelInfo",
    "OutputMode",
]

OutputMode = Literal["hidden", "last", "all"]
"""What a backend forward returns: hidden states of every row, or logits of the last / all rows."""

TOMBSTONE_LIMIT: Final = 65536
"""How many released or evicted sessions are remembered (oldest forgotten first)."""

_SERVING: Final[frozenset[LifecycleState]] = frozenset({"ready", "degraded"})
_F16_MAX: Final = 65504.0


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend reports once its shard is open."""

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


class CancelToken:
    """Set by ``cancel`` from any thread; backends poll it at safe points."""

    __slots__ = ("_event", "request_id", "session_ids")

    def __init__(self, request_id: str, session_ids: frozenset[str]) -> None:
        self._event = threading.Event()
        self.request_id = request_id
        self.session_ids = session_ids

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def event(self) -> threading.Event:
        """The underlying event, for backends whose abort callback polls it."""
        return self._event

    def check(self) -> None:
        """Raise Cancelled if cancellation was requested."""
        if self._event.is_set():
            raise Cancelled(f"request {self.request_id!r} was cancelled")

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a cancel ends the sleep at once with Cancelled."""
        if self._event.wait(seconds):
            raise Cancelled(f"request {self.request_id!r} was cancelled")


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


@dataclass(slots=True)
class _Session:
    session_id: str
    epoch: int
    slot: int
    length: int
    last_used: int


@dataclass(slots=True)
class _Plan:
    """What an admitted request will do to the ledger when it succeeds."""

    session_id: str
    epoch: int
    slot: int
    start_pos: int
    committed_length: int
    new_length: int
    is_new: bool
    evict: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    batch_requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cancelled: int = 0
    evictions: int = 0
    releases: int = 0
    compute_ms: float = 0.0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


class EngineCore(abc.ABC):
    """Base class of engines: implements the whole :class:`ShardEngine` protocol on top of
    a handful of backend steps. Subclasses set ``engine_name`` and implement the abstract
    methods; they never touch the ledger."""

    engine_name: ClassVar[str] = "unnamed"

    def __init__(self) -> None:
        self._state: LifecycleState = "loading"
        self._detail = "not loaded"
        self._degraded_reasons: dict[str, str] = {}
        self._config: LoadConfig | None = None
        self._info: ModelInfo | None = None
        self._capabilities: Capabilities | None = None
        self._sessions: dict[str, _Session] = {}
        self._tombstones: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._free_slots: list[int] = []
        self._kv_used = 0
        self._kv_budget = 0
        self._tick = 0
        self._counters = _Counters()
        self._compute_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._in_flight: dict[str, CancelToken] = {}

    # ----------------------------------------------------------------- backend steps

    @abc.abstractmethod
    def _open(self, config: LoadConfig) -> ModelInfo:
        """Open the shard described by ``config``. Raise a ShardEngineError (InvalidRequest,
        UnsupportedFeature, ResourceExhausted) for anything that cannot be loaded."""

    @abc.abstractmethod
    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        """Run the shard over ``item`` and return hidden states ``(n, hidden)`` or logits
        (``(1, vocab)`` for "last", ``(n, vocab)`` for "all"). Poll ``token`` at safe points.
        Must keep enough to undo itself until ``_commit`` or ``_rollback`` is called."""

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[npt.NDArray[np.float32]]:
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
        """Free everything cached for ``slot`` (release, eviction, epoch change)."""

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

    def _set_kv_budget(self, tokens: int) -> None:
        """Change the KV budget (memory pressure). Sessions over it are evicted or new work is
        refused on the next admission, per the eviction policy."""
        with self._state_lock:
            self._kv_budget = max(0, tokens)

    @property
    def config(self) -> LoadConfig:
        if self._config is None:
            raise NotReady(f"{self.engine_name} engine is not loaded")
        return self._config

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise NotReady(f"{self.engine_name} engine is not loaded")
        return self._info

    # ----------------------------------------------------------------- the protocol

    @property
    def name(self) -> str:
        return self.engine_name

    def load(self, config: LoadConfig) -> Capabilities:
        """Open the shard; the engine becomes ready. Raises InvalidRequest on a second load."""
        with self._compute_lock:
            if self._state != "loading" or self._config is not None:
                raise InvalidRequest(f"engine is {self._state}; load() is called once per engine")
            try:
                info = self._open(config)
            except ShardEngineError:
                raise
            except Exception as error:
                raise InvalidRequest(f"could not load shard: {error}") from error
            max_sessions = min(config.max_sessions, info.max_sessions or config.max_sessions)
            max_context = min(config.max_context, info.max_context or config.max_context)
            if config.boundary_dtype not in info.boundary_dtypes:
                raise UnsupportedFeature(
                    f"boundary dtype {config.boundary_dtype} not supported; "
                    f"supported: {info.boundary_dtypes}"
                )
            self._capabilities = Capabilities(
                engine=self.engine_name,
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
                    max_sessions=max_sessions,
                    max_context=max_context,
                    max_batch_tokens=config.max_batch_tokens,
                    kv_budget_tokens=config.kv_budget_tokens,
                ),
                features=msgspec.structs.replace(info.features, eviction=config.eviction == "lru"),
                determinism=info.determinism,
                reserved=ReservedHooks(),
            )
            with self._state_lock:
                self._config = config
                self._info = info
                self._free_slots = list(range(max_sessions - 1, -1, -1))
                self._kv_budget = config.kv_budget_tokens
                self._state = "degraded" if self._degraded_reasons else "ready"
                self._detail = "; ".join(self._degraded_reasons.values())
            return self._capabilities

    def capabilities(self) -> Capabilities:
        """What the loaded engine is and can do. Raises NotReady before load."""
        if self._capabilities is None:
            raise NotReady(f"{self.engine_name} engine is not loaded")
        return self._capabilities

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """Process a run of tokens or boundary rows; see the contract's session semantics."""
        with self._operation(request.request_id, (request.session.session_id,)) as token:
            caps = self._require_serving()
            with self._state_lock:
                self._counters.prefill_requests += 1
            self._check_reserved(request.mtp, request.aux)
            self._check_reserved_inputs(request.inputs)
            item_tokens, item_hidden = self._decode_inputs(
                caps, request.inputs, request.session, request.start_pos, single_row=False
            )
            n_tokens = _n_rows(item_tokens, item_hidden)
            if n_tokens > caps.limits.max_batch_tokens:
                raise InvalidRequest(
                    f"prefill of {n_tokens} tokens exceeds max_batch_tokens "
                    f"{caps.limits.max_batch_tokens}; send it in chunks"
                )
            output: OutputMode = "hidden" if not caps.shard.emits_logits else request.logits
            return self._run_one(
                caps,
                token,
                request.request_id,
                request.session,
                request.start_pos,
                item_tokens,
                item_hidden,
                output,
                lambda: self._plan_prefill(caps, request.session, request.start_pos, n_tokens),
                decode=False,
            )

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Process one row at ``pos`` (which must equal the committed length)."""
        with self._operation(request.request_id, (request.session.session_id,)) as token:
            caps = self._require_serving()
            with self._state_lock:
                self._counters.decode_requests += 1
            self._check_reserved(request.mtp, request.aux)
            self._check_reserved_inputs(request.inputs)
            tokens, hidden = self._decode_inputs(
                caps, request.inputs, request.session, request.pos, single_row=True
            )
            output: OutputMode = "last" if caps.shard.emits_logits else "hidden"
            return self._run_one(
                caps,
                token,
                request.request_id,
                request.session,
                request.pos,
                tokens,
                hidden,
                output,
                lambda: self._plan_decode(caps, request.session, request.pos, 0),
                decode=True,
            )

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """One decode step for several distinct sessions; one result or error per item."""
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
            outcomes: list[BoundaryResult | LogitsResult | ErrorInfo | None] = [None] * len(
                request.items
            )
            decoded: dict[int, tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]]
            decoded = {}
            seen: set[str] = set()
            for index, item in enumerate(request.items):
                try:
                    if item.session.session_id in seen:
                        raise InvalidRequest(
                            f"session {item.session.session_id!r} appears twice in one batch"
                        )
                    seen.add(item.session.session_id)
                    self._check_reserved(item.mtp, item.aux)
                    self._check_reserved_inputs(item.inputs)
                    decoded[index] = self._decode_inputs(
                        caps, item.inputs, item.session, item.pos, single_row=True
                    )
                except ShardEngineError as error:
                    self._count_error(error)
                    outcomes[index] = error.to_info()
            started = time.perf_counter()
            with self._compute_lock:
                queue_ms = (time.perf_counter() - started) * 1000.0
                token.check()
                self._require_serving()
                plans: list[tuple[int, _Plan]] = []
                planned_tokens = 0
                for index in decoded:
                    item = request.items[index]
                    try:
                        plan = self._plan_decode(caps, item.session, item.pos, planned_tokens)
                        self._apply_evictions(plan, protect={p.session_id for _, p in plans})
                        plans.append((index, plan))
                        planned_tokens += 1
                    except ShardEngineError as error:
                        self._count_error(error)
                        outcomes[index] = error.to_info()
                compute_ms = 0.0
                if plans:
                    forward_items = [
                        ForwardItem(
                            slot=plan.slot,
                            start_pos=plan.start_pos,
                            committed_length=plan.committed_length,
                            tokens=decoded[index][0],
                            hidden=decoded[index][1],
                        )
                        for index, plan in plans
                    ]
                    compute_started = time.perf_counter()
                    rows_list = self._run_guarded(
                        [plan for _, plan in plans],
                        lambda: self._checked_batch(
                            caps,
                            self._forward_batch(forward_items, output, token),
                            output,
                            len(forward_items),
                        ),
                    )
                    compute_ms = (time.perf_counter() - compute_started) * 1000.0
                    for _, plan in plans:
                        self._commit_plan(plan)
                    self._counters.decode_tokens += len(plans)
                    self._counters.compute_ms += compute_ms
            total_ms = (time.perf_counter() - started) * 1000.0
            timings = Timings(queue_ms=queue_ms, compute_ms=compute_ms, total_ms=total_ms)
            if plans:
                for (index, _), rows in zip(plans, rows_list, strict=True):
                    item = request.items[index]
                    outcomes[index] = self._make_result(
                        caps, item.request_id, item.session, item.pos, rows, output, timings, 1
                    )
            return DecodeBatchResult(
                request_id=request.request_id,
                items=tuple(outcome for outcome in outcomes if outcome is not None),
            )

    def cancel(self, request: CancelRequest) -> CancelResult:
        """Tell in-flight requests to stop. Never raises for unknown or finished requests."""
        if (request.request_id is None) == (request.session_id is None):
            raise InvalidRequest("cancel needs exactly one of request_id and session_id")
        with self._state_lock:
            if request.request_id is not None:
                tokens = [t for rid, t in self._in_flight.items() if rid == request.request_id]
            else:
                tokens = [
                    t for t in self._in_flight.values() if request.session_id in t.session_ids
                ]
            tokens = [t for t in tokens if not t.cancelled]
            for cancel_token in tokens:
                cancel_token.cancel()
        return CancelResult(cancelled=bool(tokens), n_requests=len(tokens))

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Free a session and tombstone its epoch. Unknown sessions are a no-op that says so."""
        session = request.session
        self._require_serving()
        with self._compute_lock:
            self._require_serving()
            with self._state_lock:
                current = self._sessions.get(session.session_id)
                fenced = self._fence_epoch(session.session_id)
                if current is None:
                    if fenced is not None and session.epoch < fenced:
                        raise StaleEpoch(
                            f"session {session.session_id!r} epoch {session.epoch} is older "
                            f"than released/evicted epoch {fenced}"
                        )
                    # A no-op, as the contract says: no tombstone for a session never seen.
                    detail = (
                        "already released or evicted; nothing to free"
                        if fenced is not None
                        else "unknown session; nothing to free"
                    )
                    return ReleaseResult(released=False, detail=detail)
                if session.epoch < current.epoch:
                    raise StaleEpoch(
                        f"session {session.session_id!r} is at epoch {current.epoch}; "
                        f"release names epoch {session.epoch}"
                    )
                del self._sessions[session.session_id]
                self._kv_used -= current.length
                self._free_slots.append(current.slot)
                self._remember(self._tombstones, session.session_id, session.epoch)
                self._counters.releases += 1
            self._drop(current.slot)
            return ReleaseResult(released=True, detail=f"freed {current.length} positions")

    def health(self) -> Health:
        """The lifecycle state and occupancy now. Never raises."""
        with self._state_lock:
            return Health(
                state=self._state,
                detail=self._detail,
                sessions=len(self._sessions),
                in_flight=len(self._in_flight),
                kv_used_tokens=self._kv_used,
                kv_budget_tokens=self._kv_budget,
            )

    def metrics(self) -> Metrics:
        """Counters since load. Never raises."""
        with self._state_lock:
            counters = self._counters
            return Metrics(
                requests=counters.requests,
                prefill_requests=counters.prefill_requests,
                decode_requests=counters.decode_requests,
                batch_requests=counters.batch_requests,
                prefill_tokens=counters.prefill_tokens,
                decode_tokens=counters.decode_tokens,
                cancelled=counters.cancelled,
                evictions=counters.evictions,
                releases=counters.releases,
                sessions_active=len(self._sessions),
                tombstones=len(self._tombstones),
                kv_used_tokens=self._kv_used,
                compute_ms=counters.compute_ms,
                errors=dict(counters.errors),
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
                self._state = "closed"
                self._detail = "closed"
                self._sessions.clear()
                self._kv_used = 0
            if was_loaded:
                self._close()

    # ----------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _operation(self, request_id: str, session_ids: Sequence[str]) -> Iterator[CancelToken]:
        if not request_id:
            raise InvalidRequest("request_id must be non-empty")
        token = CancelToken(request_id, frozenset(session_ids))
        with self._state_lock:
            if request_id in self._in_flight:
                error = InvalidRequest(f"request_id {request_id!r} is already in flight")
                self._counters.errors[error.code] += 1
                raise error
            self._in_flight[request_id] = token
            self._counters.requests += 1
        try:
            yield token
        except ShardEngineError as error:
            self._count_error(error)
            if isinstance(error, EngineCrashed):
                self._fail(error.message)
            raise
        except Exception as error:
            crashed = EngineCrashed(f"backend failure: {type(error).__name__}: {error}")
            self._count_error(crashed)
            self._fail(crashed.message)
            raise crashed from error
        finally:
            with self._state_lock:
                self._in_flight.pop(request_id, None)

    def _count_error(self, error: ShardEngineError) -> None:
        with self._state_lock:
            self._counters.errors[error.code] += 1
            if isinstance(error, Cancelled):
                self._counters.cancelled += 1

    def _require_serving(self) -> Capabilities:
        state = self._state
        if state in _SERVING and self._capabilities is not None:
            return self._capabilities
        if state == "failed":
            raise EngineCrashed(f"{self.engine_name} engine has failed: {self._detail}")
        raise NotReady(f"{self.engine_name} engine is {state}", retryable=state == "loading")

    @staticmethod
    def _check_reserved(mtp: tuple[MtpState, ...], aux: tuple[AuxState, ...]) -> None:
        if mtp:
            raise UnsupportedFeature("multi-token prediction (mtp) is reserved and not enabled")
        if aux:
            raise UnsupportedFeature("auxiliary state (aux) is reserved and not enabled")

    def _check_reserved_inputs(self, inputs: ShardInput) -> None:
        if isinstance(inputs, BoundaryBundle):
            self._check_reserved(inputs.mtp, inputs.aux)

    def _decode_inputs(
        self,
        caps: Capabilities,
        inputs: ShardInput,
        session: SessionRef,
        start_pos: int,
        *,
        single_row: bool,
    ) -> tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]:
        """Check the inputs against the role and the request; return tokens or hidden rows."""
        if start_pos < 0:
            raise InvalidRequest(f"position must be >= 0, got {start_pos}")
        shard = caps.shard
        if isinstance(inputs, TokenInput):
            if not shard.takes_tokens:
                raise WrongRole(f"a {shard.role} shard takes a boundary bundle, not token ids")
            n_tokens = len(inputs.token_ids)
            if n_tokens == 0:
                raise InvalidRequest("no token ids")
            if single_row and n_tokens != 1:
                raise InvalidRequest(f"decode takes exactly one token, got {n_tokens}")
            # Checked on the Python ints (before any int32 conversion could wrap them): for the
            # one-token decode hot path this is several numpy calls cheaper.
            token_ids = inputs.token_ids
            if min(token_ids) < 0 or max(token_ids) >= caps.vocab_size:
                raise InvalidRequest(f"token ids must lie in [0, {caps.vocab_size})")
            return np.array(token_ids, dtype=np.int32), None
        if shard.takes_tokens:
            raise WrongRole(f"a {shard.role} shard takes token ids, not a boundary bundle")
        bundle = inputs
        if bundle.contract_version != CONTRACT_VERSION:
            raise ContractVersionMismatch(
                f"bundle speaks contract version {bundle.contract_version}; "
                f"this engine speaks {CONTRACT_VERSION}"
            )
        if bundle.model_fingerprint != caps.model_fingerprint:
            raise ShardMismatch(
                f"bundle is for model {bundle.model_fingerprint!r}; "
                f"this shard runs {caps.model_fingerprint!r}"
            )
        if bundle.layer != shard.start:
            raise ShardMismatch(
                f"bundle enters layer {bundle.layer}; this shard starts at layer {shard.start}"
            )
        if bundle.hidden_size != caps.hidden_size:
            raise ShardMismatch(
                f"bundle hidden size {bundle.hidden_size} != shard hidden size {caps.hidden_size}"
            )
        if bundle.dtype not in caps.boundary_dtypes:
            raise InvalidRequest(f"bundle dtype {bundle.dtype} is not accepted")
        if bundle.session != session:
            raise InvalidRequest(
                f"bundle belongs to session {bundle.session.session_id!r} epoch "
                f"{bundle.session.epoch}; request names {session.session_id!r} "
                f"epoch {session.epoch}"
            )
        if bundle.first_pos != start_pos:
            raise InvalidRequest(
                f"bundle starts at position {bundle.first_pos}, request at {start_pos}"
            )
        if bundle.n_tokens < 1:
            raise InvalidRequest("bundle carries no rows")
        if single_row and bundle.n_tokens != 1:
            raise InvalidRequest(f"decode takes exactly one row, bundle has {bundle.n_tokens}")
        if len(bundle.payload) != bundle.expected_payload_bytes:
            raise InvalidRequest(
                f"bundle payload has {len(bundle.payload)} bytes; header promises "
                f"{bundle.expected_payload_bytes}"
            )
        if payload_checksum(bundle.payload) != bundle.checksum:
            raise ChecksumMismatch("bundle payload does not match its checksum")
        hidden = np.asarray(bundle.array(), dtype=np.float32)
        if not np.isfinite(hidden).all():
            raise InvalidRequest("bundle hidden states contain NaN or Inf")
        return None, hidden

    def _fence_epoch(self, session_id: str) -> int | None:
        """The newest released or evicted epoch of a session that has no live state."""
        released = self._tombstones.get(session_id)
        evicted = self._evicted.get(session_id)
        candidates = [epoch for epoch in (released, evicted) if epoch is not None]
        return max(candidates) if candidates else None

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> _Plan:
        with self._state_lock:
            sid = session.session_id
            current = self._sessions.get(sid)
            new_length = start_pos + n_tokens
            if new_length > caps.limits.max_context:
                raise ResourceExhausted(
                    f"positions up to {new_length} exceed max_context {caps.limits.max_context}",
                    retryable=False,
                    details={"resource": "context"},
                )
            if current is not None:
                if session.epoch < current.epoch:
                    raise StaleEpoch(
                        f"session {sid!r} is at epoch {current.epoch}; request has {session.epoch}"
                    )
                length = current.length if session.epoch == current.epoch else 0
                if start_pos > length:
                    raise CacheMiss(
                        f"prefill at {start_pos} would leave a gap after {length} cached positions",
                        committed_length=length,
                        reason="gap" if session.epoch == current.epoch else "new_epoch",
                    )
                plan = _Plan(
                    session_id=sid,
                    epoch=session.epoch,
                    slot=current.slot,
                    start_pos=start_pos,
                    committed_length=current.length,
                    new_length=new_length,
                    is_new=False,
                )
                self._plan_budget(plan, extra_tokens=new_length - current.length)
                return plan
            fenced = self._tombstones.get(sid)
            if fenced is not None and session.epoch <= fenced:
                raise StaleEpoch(
                    f"session {sid!r} epoch {session.epoch} was released (released epoch {fenced})"
                )
            evicted = self._evicted.get(sid)
            if evicted is not None and session.epoch < evicted:
                raise StaleEpoch(f"session {sid!r} epoch {session.epoch} is older than {evicted}")
            if start_pos > 0:
                reason = (
                    "evicted"
                    if evicted is not None and evicted == session.epoch
                    else "unknown_session"
                )
                raise CacheMiss(
                    f"session {sid!r} has no cached positions ({reason}); prefill from 0",
                    committed_length=0,
                    reason=reason,
                )
            plan = _Plan(
                session_id=sid,
                epoch=session.epoch,
                slot=-1,
                start_pos=0,
                committed_length=0,
                new_length=new_length,
                is_new=True,
            )
            self._plan_budget(plan, extra_tokens=new_length)
            return plan

    def _plan_decode(
        self, caps: Capabilities, session: SessionRef, pos: int, pending_tokens: int
    ) -> _Plan:
        with self._state_lock:
            sid = session.session_id
            current = self._sessions.get(sid)
            if current is None:
                fenced = self._tombstones.get(sid)
                if fenced is not None and session.epoch <= fenced:
                    raise StaleEpoch(
                        f"session {sid!r} epoch {session.epoch} was released (epoch {fenced})"
                    )
                evicted = self._evicted.get(sid)
                if evicted is not None and session.epoch < evicted:
                    raise StaleEpoch(
                        f"session {sid!r} epoch {session.epoch} is older than {evicted}"
                    )
                reason = (
                    "evicted"
                    if evicted is not None and evicted == session.epoch
                    else "unknown_session"
                )
                raise CacheMiss(
                    f"session {sid!r} has no cached state ({reason})",
                    committed_length=0,
                    reason=reason,
                )
            if session.epoch < current.epoch:
                raise StaleEpoch(
                    f"session {sid!r} is at epoch {current.epoch}; request has {session.epoch}"
                )
            if session.epoch > current.epoch:
                raise CacheMiss(
                    f"session {sid!r} epoch {session.epoch} has not been prefilled",
                    committed_length=0,
                    reason="new_epoch",
                )
            if pos != current.length:
                raise CacheMiss(
                    f"decode at {pos} but session {sid!r} has {current.length} cached positions",
                    committed_length=current.length,
                    reason="position_mismatch",
                )
            if pos + 1 > caps.limits.max_context:
                raise ResourceExhausted(
                    f"position {pos} reaches max_context {caps.limits.max_context}",
                    retryable=False,
                    details={"resource": "context"},
                )
            plan = _Plan(
                session_id=sid,
                epoch=session.epoch,
                slot=current.slot,
                start_pos=pos,
                committed_length=current.length,
                new_length=pos + 1,
                is_new=False,
            )
            self._plan_budget(plan, extra_tokens=1 + pending_tokens)
            return plan

    def _plan_budget(self, plan: _Plan, *, extra_tokens: int) -> None:
        """Decide which idle sessions to evict (LRU) so the plan fits; or refuse. Called with
        the state lock held; nothing is changed here."""
        config = self.config
        need_slot = plan.is_new and not self._free_slots
        over = self._kv_used + extra_tokens - self._kv_budget
        if not need_slot and over <= 0:
            return
        if config.eviction != "lru":
            if need_slot:
                raise ResourceExhausted(
                    f"all {len(self._sessions)} session slots are in use",
                    details={"resource": "sessions"},
                )
            raise ResourceExhausted(
                f"KV budget of {self._kv_budget} positions would be exceeded by {over}",
                details={"resource": "kv", "kv_used": self._kv_used, "kv_budget": self._kv_budget},
            )
        candidates = sorted(
            (s for s in self._sessions.values() if s.session_id != plan.session_id),
            key=lambda s: s.last_used,
        )
        freed = 0
        for candidate in candidates:
            if not need_slot and over - freed <= 0:
                break
            plan.evict.append(candidate.session_id)
            freed += candidate.length
            need_slot = False
        if need_slot or over - freed > 0:
            plan.evict.clear()
            raise ResourceExhausted(
                f"KV budget of {self._kv_budget} positions cannot fit the request even after "
                "evicting every idle session",
                details={"resource": "kv", "kv_used": self._kv_used, "kv_budget": self._kv_budget},
            )

    def _apply_evictions(self, plan: _Plan, protect: set[str] | None = None) -> None:
        for sid in plan.evict:
            if protect and sid in protect:
                raise ResourceExhausted(
                    "batch does not fit the KV budget", details={"resource": "kv"}
                )
        for sid in plan.evict:
            with self._state_lock:
                victim = self._sessions.pop(sid)
                self._kv_used -= victim.length
                self._free_slots.append(victim.slot)
                self._remember(self._evicted, sid, victim.epoch)
                self._counters.evictions += 1
            self._drop(victim.slot)
        plan.evict.clear()
        if plan.is_new and plan.slot < 0:
            with self._state_lock:
                plan.slot = self._free_slots.pop()

    def _run_guarded(
        self,
        plans: Sequence[_Plan],
        step: collections.abc.Callable[[], list[npt.NDArray[np.float32]]],
    ) -> list[npt.NDArray[np.float32]]:
        """Run backend work; on any failure restore every plan's slot and re-raise."""
        try:
            return step()
        except BaseException:
            self._rollback_plans(plans)
            raise

    def _rollback_plans(self, plans: Sequence[_Plan]) -> None:
        for plan in plans:
            try:
                self._rollback(plan.slot, plan.start_pos, plan.committed_length)
            except Exception as error:
                self._fail(f"rollback failed: {error}")
                raise EngineCrashed(f"rollback of slot {plan.slot} failed: {error}") from error
            if plan.is_new:
                with self._state_lock:
                    self._free_slots.append(plan.slot)

    def _commit_plan(self, plan: _Plan) -> None:
        self._commit(plan.slot)
        with self._state_lock:
            self._tick += 1
            current = self._sessions.get(plan.session_id)
            if current is None:
                self._sessions[plan.session_id] = _Session(
                    session_id=plan.session_id,
                    epoch=plan.epoch,
                    slot=plan.slot,
                    length=plan.new_length,
                    last_used=self._tick,
                )
                self._kv_used += plan.new_length
                self._tombstones.pop(plan.session_id, None)
                self._evicted.pop(plan.session_id, None)
            else:
                self._kv_used += plan.new_length - current.length
                current.length = plan.new_length
                current.epoch = plan.epoch
                current.last_used = self._tick

    def _checked_rows(
        self, caps: Capabilities, rows: npt.NDArray[np.float32], output: OutputMode, n_tokens: int
    ) -> npt.NDArray[np.float32]:
        """The backend's rows, checked before anything is committed (the caller rolls back
        on an error): the shape, and that hidden states fit the boundary dtype."""
        width = caps.hidden_size if output == "hidden" else caps.vocab_size
        expected_rows = 1 if output == "last" else n_tokens
        if rows.shape != (expected_rows, width):
            raise EngineCrashed(
                f"backend returned shape {rows.shape}, expected {(expected_rows, width)}"
            )
        if output == "hidden" and self.config.boundary_dtype == "f16":
            largest = float(np.max(np.abs(rows))) if rows.size else 0.0
            if not largest <= _F16_MAX:
                raise ResourceExhausted(
                    f"hidden states reach {largest:.4g}, beyond the f16 range; load the shard "
                    "with boundary_dtype='f32'",
                    retryable=False,
                    details={"resource": "boundary_dtype_range"},
                )
        return rows

    def _checked_batch(
        self,
        caps: Capabilities,
        rows_list: list[npt.NDArray[np.float32]],
        output: OutputMode,
        n_items: int,
    ) -> list[npt.NDArray[np.float32]]:
        if len(rows_list) != n_items:
            raise EngineCrashed(f"backend returned {len(rows_list)} results for {n_items} items")
        return [self._checked_rows(caps, rows, output, 1) for rows in rows_list]

    def _make_result(
        self,
        caps: Capabilities,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        rows: npt.NDArray[np.float32],
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

    def _run_one(
        self,
        caps: Capabilities,
        token: CancelToken,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        tokens: npt.NDArray[np.int32] | None,
        hidden: npt.NDArray[np.float32] | None,
        output: OutputMode,
        plan_for: collections.abc.Callable[[], _Plan],
        *,
        decode: bool,
    ) -> ShardResult:
        """Admit, run, check and commit one validated prefill or decode under the compute
        lock; any failure after admission rolls the session back."""
        n_tokens = _n_rows(tokens, hidden)
        started = time.perf_counter()
        with self._compute_lock:
            queue_ms = (time.perf_counter() - started) * 1000.0
            token.check()
            self._require_serving()
            plan = plan_for()
            self._apply_evictions(plan)
            item = ForwardItem(
                slot=plan.slot,
                start_pos=plan.start_pos,
                committed_length=plan.committed_length,
                tokens=tokens,
                hidden=hidden,
            )
            compute_started = time.perf_counter()
            rows = self._run_guarded(
                [plan],
                lambda: [
                    self._checked_rows(caps, self._forward(item, output, token), output, n_tokens)
                ],
            )[0]
            compute_ms = (time.perf_counter() - compute_started) * 1000.0
            self._commit_plan(plan)
            if decode:
                self._counters.decode_tokens += n_tokens
            else:
                self._counters.prefill_tokens += n_tokens
            self._counters.compute_ms += compute_ms
        timings = Timings(
            queue_ms=queue_ms,
            compute_ms=compute_ms,
            total_ms=(time.perf_counter() - started) * 1000.0,
        )
        return self._make_result(
            caps, request_id, session, start_pos, rows, output, timings, n_tokens
        )

    @staticmethod
    def _remember(table: collections.OrderedDict[str, int], session_id: str, epoch: int) -> None:
        previous = table.pop(session_id, None)
        table[session_id] = epoch if previous is None else max(previous, epoch)
        while len(table) > TOMBSTONE_LIMIT:
            table.popitem(last=False)


def _n_rows(tokens: npt.NDArray[np.int32] | None, hidden: npt.NDArray[np.float32] | None) -> int:
    if tokens is not None:
        return int(tokens.shape[0])
    assert hidden is not None
    return int(hidden.shape[0])
