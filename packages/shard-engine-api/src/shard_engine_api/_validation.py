"""The validation wrapper: a worker's defence against an engine that breaks the contract.

:class:`ValidatingEngine` implements :class:`~shard_engine_api.ShardEngine` by delegating every
call to an inner engine and checking what comes back against the request and the engine's own
capabilities. A result that breaks the contract is never handed on; the caller gets
:class:`~shard_engine_api.MalformedOutput` whose message (and ``details["check"]``) names the
check that failed, so a broken engine is diagnosed at the hop where it broke, not three shards
later as wrong logits.

It runs on every decode step, so everything that can be derived once is derived when the
capabilities are first seen (at ``load``, or at the first call if the inner engine was loaded
before it was wrapped), and each result costs a few attribute comparisons plus one checksum and
one finiteness pass over its payload. The payload checks are those of
shard_engine_api._bundle_checks (shared with the engine core and the codec); a bundle that passes
them is marked, so the next shard's core in an in-process pipeline does not scan it again.

Both paths catch the same defects: the loaded boundary dtype comes from
``Capabilities.boundary_dtype`` when the engine was loaded before it was wrapped (and, for an
engine that does not report it, the first bundle's dtype is pinned and every later bundle must
match it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Final, NoReturn

import msgspec

from shard_engine_api._bundle_checks import BundleExpectation, Violation, check_bundle, check_logits
from shard_engine_api._checksum import SCANNED_FINITE, scanned
from shard_engine_api._codec import NonFinitePolicy
from shard_engine_api._core import EngineCore
from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._errors import ErrorInfo, InvalidRequest, MalformedOutput, ShardEngineError
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._snapshot import verify_snapshot_integrity
from shard_engine_api._typecheck import check_request, result_ok
from shard_engine_api._types import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryDtype,
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
    Limits,
    LoadConfig,
    LogitsMode,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    SessionSnapshot,
    ShardInput,
    ShardResult,
)

__all__ = ["ValidatingEngine", "health_problem", "metrics_problem"]

_MAX_SNAPSHOT_BYTES: Final = 1 << 36
"""The largest snapshot state this wrapper hashes (the engine's own limit is usually lower)."""
_KNOWN_DTYPES: Final[frozenset[str]] = BOUNDARY_DTYPES
_INFINITY: Final = math.inf
_EVIDENCE_CLASSES: Final[frozenset[str]] = frozenset({"fixture", "real"})


def _violation(check: str, message: str) -> NoReturn:
    raise MalformedOutput(f"{check}: {message}", details={"check": check})


def _boundary_violation(violation: Violation) -> NoReturn:
    _violation(violation.kind.value, violation.message)


class _Contract:
    """What every result must match, derived once from the capabilities."""

    __slots__ = (
        "bundle_expectations",
        "capabilities",
        "emits_logits",
        "evidence",
        "role",
        "vocab_size",
    )

    def __init__(self, capabilities: Capabilities, loaded_dtype: BoundaryDtype | None) -> None:
        self.capabilities = capabilities
        self.role = capabilities.role
        self.emits_logits = capabilities.shard.emits_logits
        self.evidence = capabilities.evidence
        self.vocab_size = capabilities.vocab_size
        # The one dtype bundles must have: from the load the wrapper saw, else from what the
        # loaded engine reports. An engine reporting neither gets its first bundle's dtype
        # pinned (see _expectation_for).
        dtype = loaded_dtype or capabilities.boundary_dtype
        self.bundle_expectations: dict[bool, BundleExpectation] = {}
        for check_finite in (True, False):
            self.bundle_expectations[check_finite] = BundleExpectation(
                fingerprint=capabilities.model_fingerprint,
                layer=capabilities.shard.end,
                hidden_size=capabilities.hidden_size,
                dtypes=frozenset(capabilities.boundary_dtypes if dtype is None else (dtype,)),
                check_finite=check_finite,
            )

    def pin_dtype(self, dtype: str) -> None:
        """Require ``dtype`` of every later bundle (an engine that did not report its own)."""
        for key, expectation in self.bundle_expectations.items():
            if expectation.dtypes is not None and len(expectation.dtypes) > 1:
                self.bundle_expectations[key] = BundleExpectation(
                    fingerprint=expectation.fingerprint,
                    layer=expectation.layer,
                    hidden_size=expectation.hidden_size,
                    dtypes=frozenset({dtype}),
                    check_finite=expectation.check_finite,
                )


def _check_capabilities(capabilities: object, config: LoadConfig | None) -> Capabilities:
    if not isinstance(capabilities, Capabilities):
        _violation("capabilities_type", f"expected Capabilities, got {type(capabilities).__name__}")
    # A field of the wrong type makes the value checks fail oddly: the field check names it.
    with contextlib.suppress(AttributeError, TypeError, ValueError, KeyError):
        _check_capability_values(capabilities, config)
    try:
        check_request(capabilities, Capabilities)
    except InvalidRequest as error:
        _violation("capabilities_fields", error.message)
    return _check_capability_values(capabilities, config)


def _check_capability_values(capabilities: Capabilities, config: LoadConfig | None) -> Capabilities:
    if capabilities.contract_version != CONTRACT_VERSION:
        _violation(
            "contract_version",
            f"engine speaks contract version {capabilities.contract_version}, "
            f"this library {CONTRACT_VERSION}",
        )
    if capabilities.role != capabilities.shard.role:
        _violation(
            "role",
            f"capabilities say role {capabilities.role!r}, shard "
            f"[{capabilities.shard.start}, {capabilities.shard.end}) of "
            f"{capabilities.shard.n_layers} is {capabilities.shard.role!r}",
        )
    if config is not None and capabilities.shard != config.shard:
        _violation("shard", f"loaded {config.shard}, capabilities say {capabilities.shard}")
    if capabilities.evidence not in _EVIDENCE_CLASSES:
        _violation("evidence", f"unknown evidence class {capabilities.evidence!r}")
    if capabilities.hidden_size < 1 or capabilities.vocab_size < 1:
        _violation(
            "shape",
            f"hidden_size {capabilities.hidden_size} and vocab_size {capabilities.vocab_size} "
            "must be >= 1",
        )
    limits = capabilities.limits
    low = min(
        limits.max_sessions, limits.max_context, limits.max_batch_tokens, limits.kv_budget_tokens
    )
    if low < 1:
        _violation("limits", f"limits {limits} must all be >= 1 (nothing could be admitted)")
    latency = capabilities.features.cancel_latency_ms
    # Comparisons false for NaN: a worker sets deadlines from this bound.
    if not 0.0 <= latency < _INFINITY:
        _violation("cancel_latency", f"cancel_latency_ms {latency!r} is not finite and >= 0")
    if not capabilities.boundary_dtypes or not set(capabilities.boundary_dtypes) <= _KNOWN_DTYPES:
        _violation(
            "dtype",
            f"boundary dtypes {capabilities.boundary_dtypes} are not a subset of "
            f"{'/'.join(sorted(_KNOWN_DTYPES))}",
        )
    if config is not None and config.boundary_dtype not in capabilities.boundary_dtypes:
        _violation(
            "dtype",
            f"loaded with boundary dtype {config.boundary_dtype}, capabilities advertise "
            f"{capabilities.boundary_dtypes}",
        )
    loaded = capabilities.boundary_dtype
    if loaded is not None and (
        loaded not in capabilities.boundary_dtypes
        or (config is not None and loaded != config.boundary_dtype)
    ):
        _violation(
            "dtype",
            f"capabilities say bundles carry {loaded}, advertise {capabilities.boundary_dtypes}"
            + ("" if config is None else f", loaded with {config.boundary_dtype}"),
        )
    return capabilities


def _input_rows(inputs: ShardInput) -> int:
    if isinstance(inputs, BoundaryBundle):
        return inputs.n_tokens
    return len(inputs.token_ids)


class ValidatingEngine:
    """A :class:`~shard_engine_api.ShardEngine` that checks every result of ``inner``.

    Checked for each prefill/decode result (and each successful item of a batch): the result
    type fits the role (a bundle from head/middle, logits from tail/full); request id and
    session echo the request; evidence class equals the capabilities'; positions and row counts
    (bundles and all-rows logits start at the request's position with one row per input row;
    last-row logits are one row at ``start_pos + n - 1``); hidden size and vocabulary size; the
    bundle's dtype is the loaded one (or an advertised one if the load was not seen); layer is
    the shard's end; model fingerprint and contract version; reserved MTP/aux fields empty;
    payload length, checksum and, under ``nonfinite="reject"``, finiteness; timings finite and
    >= 0. A batch result must
    echo the batch's request id and hold one entry per item, in item order.

    Cancel and release results, health and metrics must be well typed and within their bounds
    (a cancel result says ``cancelled`` exactly when it counts a stopped request, and at most
    one for a request id; health and
    metrics never report more sessions than ``max_sessions`` nor more KV positions than the
    configured budget: see :func:`health_problem` and :func:`metrics_problem`).

    Every violation raises :class:`~shard_engine_api.MalformedOutput`; so does any exception
    of the inner engine that is not a :class:`~shard_engine_api.ShardEngineError` (the protocol
    allows no other), ``health``, ``metrics`` and ``close`` included. Errors the inner engine
    raises within the contract pass through unchanged, and so do good results (the very same
    objects), except that a payload anyone can still write (a bytearray, a writable
    memoryview) is copied before it is checked, and the copy is handed on.
    """

    def __init__(self, inner: ShardEngine, *, nonfinite: NonFinitePolicy = "reject") -> None:
        """Wrap ``inner``. Raises InvalidRequest for an unknown policy or an ``inner`` that is
        not a ShardEngine."""
        given: object = inner
        if not isinstance(given, ShardEngine):
            raise InvalidRequest(
                f"ValidatingEngine wraps a ShardEngine, got {type(given).__name__}"
            )
        if nonfinite not in ("reject", "allow"):
            raise InvalidRequest(f"nonfinite must be 'reject' or 'allow', got {nonfinite!r}")
        self._inner = inner
        self._check_finite = nonfinite == "reject"
        self._contract: _Contract | None = None
        # An EngineCore checks every request at its own edge; any other engine (a remote one, a
        # hand-written one) gets the same check here, so it never sees a badly typed request
        # and this wrapper never trips over one.
        self._check_requests = not isinstance(inner, EngineCore)

    @property
    def inner(self) -> ShardEngine:
        """The wrapped engine."""
        return self._inner

    @property
    def name(self) -> str:
        """The inner engine's name."""
        return self._inner.name

    # ----------------------------------------------------------------- lifecycle

    def load(self, config: LoadConfig) -> Capabilities:
        """Load the inner engine and check its capabilities against ``config``.

        Raises what the inner ``load`` raises, or MalformedOutput for capabilities that break
        the contract (wrong version, role, shard, dtypes, shapes, evidence class).
        """
        if self._check_requests:
            check_request(config, LoadConfig)
        try:
            capabilities = self._inner.load(config)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("load", error) from error
        checked = _check_capabilities(capabilities, config)
        self._contract = _Contract(checked, config.boundary_dtype)
        return checked

    def capabilities(self) -> Capabilities:
        """The inner engine's capabilities, checked once and then required not to change.

        Raises NotReady before load, MalformedOutput for invalid or changed capabilities.
        """
        try:
            capabilities = self._inner.capabilities()
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("capabilities", error) from error
        contract = self._contract
        if contract is None:
            checked = _check_capabilities(capabilities, None)
            self._contract = _Contract(checked, None)
            return checked
        if capabilities is not contract.capabilities and capabilities != contract.capabilities:
            _violation("capabilities_changed", "capabilities changed after load")
        return capabilities

    def health(self) -> Health:
        """The inner engine's health. Never raises for an engine that keeps the contract;
        MalformedOutput when the inner ``health`` raises or returns anything but a well-typed
        Health (a worker polling health must get a typed answer from a broken engine)."""
        try:
            health = self._inner.health()
        except Exception as error:
            raise self._query_error("health", error) from error
        problem = health_problem(health, self._loaded_limits())
        if problem is not None:
            _violation(*problem)
        return health

    def metrics(self) -> Metrics:
        """The inner engine's metrics. Never raises for an engine that keeps the contract;
        MalformedOutput as :meth:`health` does."""
        try:
            metrics = self._inner.metrics()
        except Exception as error:
            raise self._query_error("metrics", error) from error
        problem = metrics_problem(metrics, self._loaded_limits())
        if problem is not None:
            _violation(*problem)
        return metrics

    def close(self) -> None:
        """Close the inner engine. Idempotent. Raises what the inner ``close`` raises within
        the contract, MalformedOutput for any other exception."""
        try:
            self._inner.close()
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("close", error) from error

    # ----------------------------------------------------------------- requests

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """Delegate and check the result (see the class docstring).

        Raises what the inner ``prefill`` raises, or MalformedOutput.
        """
        if self._check_requests:
            check_request(request, PrefillRequest)
        try:
            result = self._inner.prefill(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("prefill", error) from error
        return self._check_result(
            self._contract or self._adopt(),
            result,
            request.request_id,
            request.session,
            request.start_pos,
            _input_rows(request.inputs),
            request.logits,
        )

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Delegate and check the result (one row at ``pos``).

        Raises what the inner ``decode`` raises, or MalformedOutput.
        """
        if self._check_requests:
            check_request(request, DecodeRequest)
        try:
            result = self._inner.decode(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("decode", error) from error
        return self._check_result(
            self._contract or self._adopt(),
            result,
            request.request_id,
            request.session,
            request.pos,
            1,
            "last",
        )

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """Delegate and check the batch: request id and one entry per item in item order
        (else the whole batch is MalformedOutput), and each successful entry as a single
        decode. A bad entry becomes that item's MalformedOutput (as an ErrorInfo whose
        details name the check and the item), the others are handed on: they committed.

        Raises what the inner ``decode_batch`` raises, or MalformedOutput.
        """
        if self._check_requests:
            check_request(request, DecodeBatchRequest)
        try:
            result = self._inner.decode_batch(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("decode_batch", error) from error
        if type(result) is not DecodeBatchResult:
            _violation("result_type", f"expected DecodeBatchResult, got {type(result).__name__}")
        if result.request_id != request.request_id:
            _violation(
                "request_id",
                f"batch result has {result.request_id!r}, request {request.request_id!r}",
            )
        if type(result.items) is not tuple or len(result.items) != len(request.items):
            _violation(
                "batch_count",
                f"batch of {len(request.items)} items returned "
                f"{len(result.items) if isinstance(result.items, tuple) else result.items!r} "
                "entries",
            )
        contract = self._contract or self._adopt()
        replaced: dict[int, ShardResult | ErrorInfo] = {}
        for index, (item, outcome) in enumerate(zip(request.items, result.items, strict=True)):
            if type(outcome) is ErrorInfo:
                if not _error_info_ok(outcome):
                    replaced[index] = _item_error(index, "error_fields", "malformed ErrorInfo")
                continue
            try:
                checked = self._check_result(
                    contract, outcome, item.request_id, item.session, item.pos, 1, "last"
                )
                if checked is not outcome:
                    replaced[index] = checked
            except MalformedOutput as error:
                check = error.details.get("check")
                replaced[index] = _item_error(index, str(check), error.message)
        if not replaced:
            return result
        items = tuple(replaced.get(index, outcome) for index, outcome in enumerate(result.items))
        return msgspec.structs.replace(result, items=items)

    def cancel(self, request: CancelRequest) -> CancelResult:
        """Delegate. Raises what the inner ``cancel`` raises, or MalformedOutput for a result
        that is not a CancelResult."""
        if self._check_requests:
            check_request(request, CancelRequest)
        try:
            result = self._inner.cancel(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("cancel", error) from error
        if type(result) is not CancelResult:
            _violation("result_type", f"expected CancelResult, got {type(result).__name__}")
        _check_fields(result, CancelResult, "cancel result")
        if result.cancelled != (result.n_requests > 0):
            _violation(
                "cancel_count",
                f"cancel result says cancelled={result.cancelled} for "
                f"{result.n_requests} stopped requests",
            )
        if request.request_id is not None and result.n_requests > 1:
            # Request ids are unique among in-flight requests (a batch is one request).
            _violation(
                "cancel_count",
                f"cancelling one request id stopped {result.n_requests} requests",
            )
        return result

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Delegate. Raises what the inner ``release`` raises, or MalformedOutput for a result
        that is not a ReleaseResult."""
        if self._check_requests:
            check_request(request, ReleaseRequest)
        try:
            result = self._inner.release(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("release", error) from error
        if type(result) is not ReleaseResult:
            _violation("result_type", f"expected ReleaseResult, got {type(result).__name__}")
        _check_fields(result, ReleaseResult, "release result")
        return result

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """Delegate and check the snapshot: an engine that does not advertise
        ``session_migration`` exports nothing; the snapshot's fields are well typed, it names
        the requested session, this engine, version, model, layer range and loaded boundary
        dtype, speaks this contract version, carries a settings fingerprint, cuts its state
        into chunks of SNAPSHOT_CHUNK_BYTES (the last one shorter, none empty) that add up to
        ``state_bytes`` and match the checksum.

        Raises what the inner ``export_session`` raises, or MalformedOutput.
        """
        if self._check_requests:
            check_request(request, ExportSessionRequest)
        try:
            snapshot = self._inner.export_session(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("export_session", error) from error
        contract = self._contract or self._adopt()
        caps = contract.capabilities
        if type(snapshot) is not SessionSnapshot:
            _violation("result_type", f"expected SessionSnapshot, got {type(snapshot).__name__}")
        try:
            check_request(snapshot, SessionSnapshot)
        except InvalidRequest as error:
            _violation("result_fields", f"snapshot has a field of the wrong type: {error}")
        if not caps.features.session_migration:
            _violation(
                "capabilities",
                "the engine exported a session but does not advertise session_migration",
            )
        if snapshot.session != request.session:
            _violation(
                "session", f"snapshot belongs to {snapshot.session}, request to {request.session}"
            )
        if snapshot.contract_version != CONTRACT_VERSION:
            _violation(
                "contract_version",
                f"snapshot speaks contract version {snapshot.contract_version}, this library "
                f"{CONTRACT_VERSION}",
            )
        expected: tuple[tuple[str, object, object], ...] = (
            ("engine", snapshot.engine, caps.engine),
            ("engine_version", snapshot.engine_version, caps.engine_version),
            ("shard", snapshot.shard, caps.shard),
            ("model_fingerprint", snapshot.model_fingerprint, caps.model_fingerprint),
        )
        for check, theirs, ours in expected:
            if theirs != ours:
                _violation(check, f"snapshot says {theirs!r}, capabilities say {ours!r}")
        dtypes = contract.bundle_expectations[True].dtypes
        if dtypes is not None and snapshot.boundary_dtype not in dtypes:
            _violation(
                "dtype", f"snapshot says boundary dtype {snapshot.boundary_dtype}, loaded {dtypes}"
            )
        if not snapshot.settings_fingerprint:
            _violation("settings_fingerprint", "snapshot carries no settings fingerprint")
        if snapshot.length < 1 or snapshot.length > caps.limits.max_context:
            _violation(
                "length",
                f"snapshot length {snapshot.length} outside [1, {caps.limits.max_context}]",
            )
        try:
            verify_snapshot_integrity(snapshot, max_state_bytes=_MAX_SNAPSHOT_BYTES)
        except ShardEngineError as error:
            _violation("snapshot_integrity", error.message)
        return snapshot

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """Check what the caller sends (types; the snapshot's integrity: truncated or corrupted
        state is ChecksumMismatch before the engine sees it), delegate, and check the result:
        request id echoed, the snapshot's session under the requested epoch (the snapshot's
        when none was asked for), the snapshot's length.

        Raises what the inner ``import_session`` raises, the caller's typed errors, or
        MalformedOutput.
        """
        # Always checked here (not only for engines without their own edge): the integrity
        # check below must see well-typed chunks.
        check_request(request, ImportSessionRequest)
        verify_snapshot_integrity(request.snapshot, max_state_bytes=_MAX_SNAPSHOT_BYTES)
        try:
            result = self._inner.import_session(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("import_session", error) from error
        if type(result) is not ImportSessionResult:
            _violation("result_type", f"expected ImportSessionResult, got {type(result).__name__}")
        try:
            check_request(result, ImportSessionResult)
        except InvalidRequest as error:
            _violation("result_fields", f"import result has a field of the wrong type: {error}")
        snapshot = request.snapshot
        epoch = snapshot.session.epoch if request.epoch is None else request.epoch
        session = SessionRef(session_id=snapshot.session.session_id, epoch=epoch)
        if result.request_id != request.request_id:
            _violation(
                "request_id", f"result has {result.request_id!r}, request {request.request_id!r}"
            )
        if result.session != session:
            _violation("session", f"result installed {result.session}, request asked {session}")
        if result.length != snapshot.length:
            _violation(
                "length", f"result says {result.length} positions, snapshot holds {snapshot.length}"
            )
        return result

    # ----------------------------------------------------------------- checks

    def _adopt(self) -> _Contract:
        """Derive the contract from the capabilities of an engine loaded before wrapping."""
        self.capabilities()
        assert self._contract is not None
        return self._contract

    def _loaded_limits(self) -> Limits | None:
        """The limits health and metrics are held to: those of the capabilities seen, if any
        (health and metrics never raise, so they do not ask for them)."""
        contract = self._contract
        return None if contract is None else contract.capabilities.limits

    @classmethod
    def _query_error(cls, operation: str, error: Exception) -> MalformedOutput:
        if isinstance(error, ShardEngineError):
            return MalformedOutput(
                f"exception_type: {operation} raised {type(error).__name__} ({error.message}); "
                f"{operation} never raises",
                details={"check": "exception_type"},
            )
        return cls._foreign_error(operation, error)

    @staticmethod
    def _foreign_error(operation: str, error: Exception) -> MalformedOutput:
        return MalformedOutput(
            f"exception_type: {operation} raised {type(error).__name__} ({error}), which is "
            "not a ShardEngineError",
            details={"check": "exception_type"},
        )

    def _check_result(
        self,
        contract: _Contract,
        result: object,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        n_inputs: int,
        logits: LogitsMode,
    ) -> ShardResult:
        """Check ``result``; return it, or, if its payload is a buffer anyone can still
        write, a copy holding the payload's bytes as checked (what the engine writes into its
        buffer later must not change a result that was handed on)."""
        # Types first: a broken engine can build Structs holding anything, and a result whose
        # fields have the wrong types must end as MalformedOutput, not as a stray error here or
        # at the next hop's decoder.
        if not result_ok(result):
            expected = LogitsResult if contract.emits_logits else BoundaryResult
            if type(result) is not expected:
                _violation(
                    "result_type",
                    f"a {contract.role} shard must return {expected.__name__}, got "
                    f"{type(result).__name__}",
                )
            try:
                check_request(result, expected)
            except InvalidRequest as error:
                if ".timings." in str(error.details.get("field", "")):
                    _violation("timings", f"result timings are not finite, >= 0: {error}")
                _violation("result_fields", f"result has a field of the wrong type: {error}")
        if contract.emits_logits:
            if type(result) is not LogitsResult:
                _violation(
                    "result_type",
                    f"a {contract.role} shard must return LogitsResult, got "
                    f"{type(result).__name__}",
                )
            self._check_common(contract, result, request_id, session)
            if _writable(result.payload):
                result = msgspec.structs.replace(result, payload=_frozen(result.payload))
            if logits == "last":
                first_pos, n_rows = start_pos + n_inputs - 1, 1
            else:
                first_pos, n_rows = start_pos, n_inputs
            violation = check_logits(
                result,
                vocab_size=contract.vocab_size,
                first_pos=first_pos,
                n_rows=n_rows,
                # The engine core checks the finiteness of the logits it builds and marks them.
                check_finite=self._check_finite and scanned(result) < SCANNED_FINITE,
            )
            if violation is not None:
                _boundary_violation(violation)
            return result
        if type(result) is not BoundaryResult:
            _violation(
                "result_type",
                f"a {contract.role} shard must return BoundaryResult, got {type(result).__name__}",
            )
        self._check_common(contract, result, request_id, session)
        if result.first_pos != start_pos:
            _violation("position", f"result starts at {result.first_pos}, request at {start_pos}")
        if result.n_tokens != n_inputs:
            _violation("rows", f"result carries {result.n_tokens} rows for {n_inputs} input rows")
        bundle = result.bundle
        if _writable(bundle.payload):
            bundle = msgspec.structs.replace(bundle, payload=_frozen(bundle.payload))
            result = msgspec.structs.replace(result, bundle=bundle)
        expectation = contract.bundle_expectations[self._check_finite]
        violation = check_bundle(
            bundle, expectation, session=session, first_pos=start_pos, n_tokens=n_inputs
        )
        if violation is not None:
            _boundary_violation(violation)
        if expectation.dtypes is not None and len(expectation.dtypes) > 1:
            contract.pin_dtype(bundle.dtype)
        return result

    @staticmethod
    def _check_common(
        contract: _Contract,
        result: BoundaryResult | LogitsResult,
        request_id: str,
        session: SessionRef,
    ) -> None:
        if result.request_id != request_id:
            _violation("request_id", f"result has {result.request_id!r}, request {request_id!r}")
        if result.session != session:
            _violation("session", f"result belongs to {result.session}, request to {session}")
        if result.evidence != contract.evidence:
            _violation(
                "evidence",
                f"result says {result.evidence!r}, capabilities say {contract.evidence!r}",
            )
        timings = result.timings
        # Comparisons false for NaN: wall-clock milliseconds are finite and >= 0.
        if not (
            0.0 <= timings.queue_ms < _INFINITY
            and 0.0 <= timings.compute_ms < _INFINITY
            and 0.0 <= timings.total_ms < _INFINITY
        ):
            _violation(
                "timings",
                f"result timings {timings} are not finite, non-negative milliseconds",
            )


def _writable(payload: object) -> bool:
    """Whether anyone can still write ``payload`` (a read-only view may only be changed by its
    owner, and an engine that changes what it returned is caught by the conformance suite)."""
    return type(payload) is not bytes and not (type(payload) is memoryview and payload.readonly)


def _frozen(payload: memoryview | bytes | bytearray) -> memoryview:
    try:
        return memoryview(bytes(payload))
    except ValueError as error:  # a released buffer
        _violation("result_fields", f"result payload is unreadable: {error}")


def health_problem(health: object, limits: Limits | None) -> tuple[str, str] | None:
    """What is wrong with ``health`` as an engine's answer, as (check, message), or None:
    not a Health, a field of the wrong type or out of its bounds (counts are non-negative
    64-bit integers), or, given the engine's ``limits``, more sessions than ``max_sessions``
    or a budget or a usage above the configured ``kv_budget_tokens``."""
    if type(health) is not Health:
        return "result_type", f"expected Health, got {type(health).__name__}"
    try:
        check_request(health, Health)
    except InvalidRequest as error:
        return "result_fields", f"health has a field of the wrong type: {error}"
    if limits is None:
        return None
    if health.sessions > limits.max_sessions:
        return (
            "health_bounds",
            f"health reports {health.sessions} sessions, max_sessions is {limits.max_sessions}",
        )
    for name in ("kv_used_tokens", "kv_budget_tokens"):
        value = getattr(health, name)
        if value > limits.kv_budget_tokens:
            return (
                "health_bounds",
                f"health reports {name}={value}, over the configured KV budget of "
                f"{limits.kv_budget_tokens}",
            )
    return None


def metrics_problem(metrics: object, limits: Limits | None) -> tuple[str, str] | None:
    """What is wrong with ``metrics`` as an engine's answer, as (check, message), or None:
    not a Metrics, a field of the wrong type or out of its bounds (counters are non-negative
    64-bit integers, ``compute_ms`` finite and >= 0, error codes non-empty), or, given the
    engine's ``limits``, more active sessions than ``max_sessions`` or more cached positions
    than the configured ``kv_budget_tokens``."""
    if type(metrics) is not Metrics:
        return "result_type", f"expected Metrics, got {type(metrics).__name__}"
    try:
        check_request(metrics, Metrics)
    except InvalidRequest as error:
        return "result_fields", f"metrics has a field of the wrong type: {error}"
    if limits is None:
        return None
    if metrics.sessions_active > limits.max_sessions:
        return (
            "metrics_bounds",
            f"metrics report {metrics.sessions_active} active sessions, max_sessions is "
            f"{limits.max_sessions}",
        )
    if metrics.kv_used_tokens > limits.kv_budget_tokens:
        return (
            "metrics_bounds",
            f"metrics report kv_used_tokens={metrics.kv_used_tokens}, over the configured KV "
            f"budget of {limits.kv_budget_tokens}",
        )
    return None


def _check_fields(result: object, expected: type, what: str) -> None:
    try:
        check_request(result, expected)
    except InvalidRequest as error:
        _violation("result_fields", f"{what} has a field of the wrong type: {error}")


def _error_info_ok(info: ErrorInfo) -> bool:
    try:
        check_request(info, ErrorInfo)
    except InvalidRequest:
        return False
    return True


def _item_error(index: int, check: str, message: str) -> ErrorInfo:
    text = message if message.startswith(f"{check}:") else f"{check}: {message}"
    return MalformedOutput(
        f"batch item {index}: {text}", details={"check": check, "item": index}
    ).to_info()
