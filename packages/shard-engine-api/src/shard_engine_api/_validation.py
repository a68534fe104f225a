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
one finiteness pass over its payload.
"""

from __future__ import annotations

from typing import Final, NoReturn

import numpy as np

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._codec import NonFinitePolicy, all_finite
from shard_engine_api._errors import ErrorInfo, InvalidRequest, MalformedOutput, ShardEngineError
from shard_engine_api._protocol import ShardEngine
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
    Health,
    LoadConfig,
    LogitsMode,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    ShardInput,
    ShardResult,
    numpy_dtype,
)

__all__ = ["ValidatingEngine"]

_KNOWN_DTYPES: Final[frozenset[str]] = frozenset({"f32", "f16"})
_EVIDENCE_CLASSES: Final[frozenset[str]] = frozenset({"fixture", "real"})
_LOGITS_DTYPE: Final = np.dtype("<f4")


def _violation(check: str, message: str) -> NoReturn:
    raise MalformedOutput(f"{check}: {message}", details={"check": check})


class _Contract:
    """What every result must match, derived once from the capabilities."""

    __slots__ = (
        "capabilities",
        "dtypes",
        "emits_logits",
        "evidence",
        "fingerprint",
        "hidden_size",
        "layer",
        "role",
        "vocab_size",
    )

    def __init__(self, capabilities: Capabilities, loaded_dtype: BoundaryDtype | None) -> None:
        self.capabilities = capabilities
        self.role = capabilities.role
        self.emits_logits = capabilities.shard.emits_logits
        self.evidence = capabilities.evidence
        self.fingerprint = capabilities.model_fingerprint
        self.hidden_size = capabilities.hidden_size
        self.vocab_size = capabilities.vocab_size
        self.layer = capabilities.shard.end
        # When the wrapper saw the load it knows the one dtype bundles must have; otherwise any
        # advertised dtype is accepted.
        advertised = frozenset(capabilities.boundary_dtypes)
        self.dtypes = advertised if loaded_dtype is None else frozenset({loaded_dtype})


def _check_capabilities(capabilities: object, config: LoadConfig | None) -> Capabilities:
    if not isinstance(capabilities, Capabilities):
        _violation("capabilities_type", f"expected Capabilities, got {type(capabilities).__name__}")
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
    if not capabilities.boundary_dtypes or not set(capabilities.boundary_dtypes) <= _KNOWN_DTYPES:
        _violation(
            "dtype", f"boundary dtypes {capabilities.boundary_dtypes} are not a subset of f32/f16"
        )
    if config is not None and config.boundary_dtype not in capabilities.boundary_dtypes:
        _violation(
            "dtype",
            f"loaded with boundary dtype {config.boundary_dtype}, capabilities advertise "
            f"{capabilities.boundary_dtypes}",
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
    payload length, checksum and, under ``nonfinite="reject"``, finiteness. A batch result must
    echo the batch's request id and hold one entry per item, in item order.

    Every violation raises :class:`~shard_engine_api.MalformedOutput`; so does any exception
    of the inner engine that is not a :class:`~shard_engine_api.ShardEngineError` (the protocol
    allows no other). Errors the inner engine raises within the contract pass through unchanged,
    and so do good results (the very same objects).
    """

    def __init__(self, inner: ShardEngine, *, nonfinite: NonFinitePolicy = "reject") -> None:
        """Wrap ``inner``. Raises InvalidRequest for an unknown policy."""
        if nonfinite not in ("reject", "allow"):
            raise InvalidRequest(f"nonfinite must be 'reject' or 'allow', got {nonfinite!r}")
        self._inner = inner
        self._check_finite = nonfinite == "reject"
        self._contract: _Contract | None = None

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
        """The inner engine's health. Never raises."""
        return self._inner.health()

    def metrics(self) -> Metrics:
        """The inner engine's metrics. Never raises."""
        return self._inner.metrics()

    def close(self) -> None:
        """Close the inner engine. Idempotent."""
        self._inner.close()

    # ----------------------------------------------------------------- requests

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """Delegate and check the result (see the class docstring).

        Raises what the inner ``prefill`` raises, or MalformedOutput.
        """
        try:
            result = self._inner.prefill(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("prefill", error) from error
        self._check_result(
            self._contract or self._adopt(),
            result,
            request.request_id,
            request.session,
            request.start_pos,
            _input_rows(request.inputs),
            request.logits,
        )
        return result

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Delegate and check the result (one row at ``pos``).

        Raises what the inner ``decode`` raises, or MalformedOutput.
        """
        try:
            result = self._inner.decode(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("decode", error) from error
        self._check_result(
            self._contract or self._adopt(),
            result,
            request.request_id,
            request.session,
            request.pos,
            1,
            "last",
        )
        return result

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """Delegate and check the batch: request id, one entry per item in item order, and
        each successful entry as a single decode.

        Raises what the inner ``decode_batch`` raises, or MalformedOutput.
        """
        try:
            result = self._inner.decode_batch(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("decode_batch", error) from error
        if not isinstance(result, DecodeBatchResult):
            _violation("result_type", f"expected DecodeBatchResult, got {type(result).__name__}")
        if result.request_id != request.request_id:
            _violation(
                "request_id",
                f"batch result has {result.request_id!r}, request {request.request_id!r}",
            )
        if len(result.items) != len(request.items):
            _violation(
                "batch_count",
                f"batch of {len(request.items)} items returned {len(result.items)} entries",
            )
        contract = self._contract or self._adopt()
        for index, (item, outcome) in enumerate(zip(request.items, result.items, strict=True)):
            if isinstance(outcome, ErrorInfo):
                continue
            try:
                self._check_result(
                    contract, outcome, item.request_id, item.session, item.pos, 1, "last"
                )
            except MalformedOutput as error:
                check = error.details.get("check")
                raise MalformedOutput(
                    f"batch item {index}: {error.message}",
                    details={"check": check, "item": index},
                ) from None
        return result

    def cancel(self, request: CancelRequest) -> CancelResult:
        """Delegate. Raises what the inner ``cancel`` raises, or MalformedOutput for a result
        that is not a CancelResult."""
        try:
            result = self._inner.cancel(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("cancel", error) from error
        if not isinstance(result, CancelResult):
            _violation("result_type", f"expected CancelResult, got {type(result).__name__}")
        return result

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Delegate. Raises what the inner ``release`` raises, or MalformedOutput for a result
        that is not a ReleaseResult."""
        try:
            result = self._inner.release(request)
        except ShardEngineError:
            raise
        except Exception as error:
            raise self._foreign_error("release", error) from error
        if not isinstance(result, ReleaseResult):
            _violation("result_type", f"expected ReleaseResult, got {type(result).__name__}")
        return result

    # ----------------------------------------------------------------- checks

    def _adopt(self) -> _Contract:
        """Derive the contract from the capabilities of an engine loaded before wrapping."""
        self.capabilities()
        assert self._contract is not None
        return self._contract

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
    ) -> None:
        try:
            self._check_result_fields(
                contract, result, request_id, session, start_pos, n_inputs, logits
            )
        except (AttributeError, TypeError, ValueError, KeyError) as error:
            # A result whose fields have the wrong types (a broken engine can build Structs
            # with anything in them) must still end as MalformedOutput, not as a stray error.
            raise MalformedOutput(
                f"result_fields: result has fields of the wrong type or shape: "
                f"{type(error).__name__}: {error}",
                details={"check": "result_fields"},
            ) from error

    def _check_result_fields(
        self,
        contract: _Contract,
        result: object,
        request_id: str,
        session: SessionRef,
        start_pos: int,
        n_inputs: int,
        logits: LogitsMode,
    ) -> None:
        if contract.emits_logits:
            if not isinstance(result, LogitsResult):
                _violation(
                    "result_type",
                    f"a {contract.role} shard must return LogitsResult, got "
                    f"{type(result).__name__}",
                )
            self._check_common(contract, result, request_id, session)
            if logits == "last":
                first_pos, n_rows = start_pos + n_inputs - 1, 1
            else:
                first_pos, n_rows = start_pos, n_inputs
            if result.first_pos != first_pos:
                _violation(
                    "position",
                    f"logits ({logits} rows) start at {result.first_pos}, expected {first_pos}",
                )
            if result.n_rows != n_rows:
                _violation("rows", f"{result.n_rows} logits rows ({logits}), expected {n_rows}")
            if result.vocab_size != contract.vocab_size:
                _violation(
                    "vocab_size",
                    f"logits vocab size {result.vocab_size}, capabilities say "
                    f"{contract.vocab_size}",
                )
            self._check_payload(
                "logits", result.payload, n_rows * contract.vocab_size * 4, result.checksum
            )
            if self._check_finite and not all_finite(
                np.frombuffer(result.payload, dtype=_LOGITS_DTYPE)
            ):
                _violation("finite", "logits contain NaN or Inf")
            return
        if not isinstance(result, BoundaryResult):
            _violation(
                "result_type",
                f"a {contract.role} shard must return BoundaryResult, got {type(result).__name__}",
            )
        self._check_common(contract, result, request_id, session)
        bundle = result.bundle
        if result.first_pos != start_pos or bundle.first_pos != start_pos:
            _violation(
                "position",
                f"result/bundle start at {result.first_pos}/{bundle.first_pos}, "
                f"request at {start_pos}",
            )
        if result.n_tokens != n_inputs or bundle.n_tokens != n_inputs:
            _violation(
                "rows",
                f"result/bundle carry {result.n_tokens}/{bundle.n_tokens} rows for "
                f"{n_inputs} input rows",
            )
        if bundle.session != session:
            _violation("session", f"bundle belongs to {bundle.session}, request to {session}")
        if bundle.hidden_size != contract.hidden_size:
            _violation(
                "hidden_size",
                f"bundle hidden size {bundle.hidden_size}, capabilities say {contract.hidden_size}",
            )
        if bundle.dtype not in contract.dtypes:
            _violation(
                "dtype", f"bundle dtype {bundle.dtype!r}, expected one of {sorted(contract.dtypes)}"
            )
        if bundle.layer != contract.layer:
            _violation(
                "layer", f"bundle enters layer {bundle.layer}, shard ends at {contract.layer}"
            )
        if bundle.model_fingerprint != contract.fingerprint:
            _violation(
                "fingerprint",
                f"bundle fingerprint {bundle.model_fingerprint!r}, capabilities say "
                f"{contract.fingerprint!r}",
            )
        if bundle.contract_version != CONTRACT_VERSION:
            _violation(
                "contract_version",
                f"bundle speaks version {bundle.contract_version}, expected {CONTRACT_VERSION}",
            )
        if bundle.mtp or bundle.aux:
            _violation("reserved", "bundle carries reserved MTP/aux state, which is not enabled")
        dtype = numpy_dtype(bundle.dtype)
        self._check_payload(
            "bundle",
            bundle.payload,
            n_inputs * contract.hidden_size * dtype.itemsize,
            bundle.checksum,
        )
        if self._check_finite and not all_finite(np.frombuffer(bundle.payload, dtype=dtype)):
            _violation("finite", "bundle hidden states contain NaN or Inf")

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

    @staticmethod
    def _check_payload(what: str, payload: memoryview, expected: int, checksum: int) -> None:
        size = memoryview(payload).nbytes
        if size != expected:
            _violation("payload_length", f"{what} payload has {size} bytes, expected {expected}")
        if payload_checksum(payload) != checksum:
            _violation("checksum", f"{what} payload does not match its checksum")
