"""The typed error taxonomy of the ShardEngine contract.

Every error an engine raises is a :class:`ShardEngineError`, which carries a stable string
``code`` (the wire identity: never renamed, never reused), whether a retry can succeed
(``retryable``) and structured ``details``. The tree::

    ShardEngineError                 root; never raised itself
    ├── InvalidRequest               malformed request, bundle or wire bytes (also a ValueError)
    │   ├── WrongRole                input kind does not fit the shard's role
    │   ├── ShardMismatch            bundle made for another model fingerprint or layer index
    │   ├── ContractVersionMismatch  bundle or message speaks another contract version
    │   └── ChecksumMismatch         payload bytes do not match the carried checksum
    ├── UnsupportedFeature           a reserved hook (MTP, auxiliary state) or feature was requested
    ├── NotReady                     the engine is loading, closed, or was never loaded
    ├── CacheMiss                    the cache cannot serve it (carries committed_length, reason)
    ├── StaleEpoch                   the epoch is older than the session's or a released one
    ├── ResourceExhausted            KV budget, session slots or context length exceeded
    ├── Cancelled                    the operation was cancelled; the session was rolled back
    ├── MalformedOutput              an engine produced a result that breaks the contract
    ├── EngineCrashed                the engine failed; every later call raises this too
    ├── OutcomeUnknown               the link to an engine broke mid-request: it may have run
    └── Unauthenticated              an engine's server refused the caller's credentials

Engines reached over a transport (``shard-engine-remote``) raise the last two: a worker must be
able to tell "may have run" (re-issue; a committed decode answers CacheMiss with the committed
length) from "did not run" (NotReady: the server could not be reached) and from "will never run
with these credentials" without importing the transport, and both must keep their class when
an error crosses another hop's wire.

Backend exceptions (llama.cpp return codes, ctypes failures) are mapped to these at the engine
edge; ``msgspec.ValidationError`` becomes :class:`InvalidRequest` at the API edge.

The wire form is bounded (a peer's error is at most a few hundred KiB of text, whatever it
sends): a code of at most MAX_ERROR_CODE_CHARS, a message of at most MAX_ERROR_MESSAGE_CHARS,
at most MAX_ERROR_DETAILS details with names of at most MAX_ERROR_CODE_CHARS and string values
of at most MAX_ERROR_DETAIL_CHARS. The decoders refuse more; :meth:`ShardEngineError.to_info`
cuts a longer message or detail of this process's own errors to fit, saying how much it cut.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Final, TypeAlias

import msgspec

__all__ = [
    "CacheMiss",
    "Cancelled",
    "ChecksumMismatch",
    "ContractVersionMismatch",
    "EngineCrashed",
    "ErrorDetail",
    "ErrorInfo",
    "InvalidRequest",
    "MalformedOutput",
    "NotReady",
    "OutcomeUnknown",
    "ResourceExhausted",
    "ShardEngineError",
    "ShardMismatch",
    "StaleEpoch",
    "Unauthenticated",
    "UnsupportedFeature",
    "WrongRole",
    "error_from_info",
]

ErrorDetail = str | int | float | bool | None

MAX_ERROR_CODE_CHARS: Final = 256
"""The longest error code, and the longest name of an error detail."""
MAX_ERROR_MESSAGE_CHARS: Final = 8192
"""The longest error message on the wire."""
MAX_ERROR_DETAILS: Final = 64
"""The most details one error carries on the wire."""
MAX_ERROR_DETAIL_CHARS: Final = 8192
"""The longest string value of an error detail on the wire (a crash's stderr tail is 4 KiB)."""

_WireDetail: TypeAlias = (
    Annotated[str, msgspec.Meta(max_length=MAX_ERROR_DETAIL_CHARS)] | int | float | bool | None
)
_DetailName: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CODE_CHARS)]


def clamp_text(text: str, limit: int) -> str:
    """``text``, or when it is longer than ``limit`` characters its start and a note of how
    much was cut, ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    note = f" ... [{len(text) - limit} more characters cut]"
    keep = max(0, limit - len(note))
    note = f" ... [{len(text) - keep} more characters cut]"
    return (text[:keep] + note)[:limit]


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """The wire form of a :class:`ShardEngineError` (also one item of a batched decode result).
    Bounded: see the module docstring."""

    code: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CODE_CHARS)]
    message: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_MESSAGE_CHARS)]
    retryable: bool
    details: Annotated[
        dict[_DetailName, _WireDetail], msgspec.Meta(max_length=MAX_ERROR_DETAILS)
    ] = msgspec.field(default_factory=dict)


class ShardEngineError(Exception):
    """Root of every error the contract defines. Catch this to catch them all."""

    code: ClassVar[str] = "shard_engine_error"
    default_retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        retryable: bool | None = None,
        details: dict[str, ErrorDetail] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable
        self.details: dict[str, ErrorDetail] = dict(details or {})

    def to_info(self) -> ErrorInfo:
        """The wire form: code, message, retryable and details, each within the wire's bounds
        (a longer message or string detail is cut, saying so; details past
        MAX_ERROR_DETAILS are left out)."""
        details: dict[str, ErrorDetail] = {}
        for name, value in list(self.details.items())[:MAX_ERROR_DETAILS]:
            key = clamp_text(name, MAX_ERROR_CODE_CHARS) if isinstance(name, str) else name
            details[key] = (
                clamp_text(value, MAX_ERROR_DETAIL_CHARS) if isinstance(value, str) else value
            )
        return ErrorInfo(
            code=self.code,
            message=clamp_text(self.message, MAX_ERROR_MESSAGE_CHARS)
            if isinstance(self.message, str)
            else self.message,
            retryable=self.retryable,
            details=details,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r})"


class InvalidRequest(ShardEngineError, ValueError):
    """Raised when a request, bundle or wire message is malformed: bad field values, wrong
    shapes, undecodable bytes. Retrying the same request cannot succeed."""

    code = "invalid_request"


class WrongRole(InvalidRequest):
    """Raised when the input kind does not fit the shard's role: token ids sent to a middle or
    tail shard, a boundary bundle sent to a head or full shard, logits asked of a non-tail."""

    code = "wrong_role"


class ShardMismatch(InvalidRequest):
    """Raised when a boundary bundle was produced for another model (fingerprint) or enters
    another layer than this shard's start, or has another hidden size."""

    code = "shard_mismatch"


class ContractVersionMismatch(InvalidRequest):
    """Raised when a bundle or message carries a contract version this library does not speak."""

    code = "contract_version_mismatch"


class ChecksumMismatch(InvalidRequest):
    """Raised when a payload's bytes do not match the checksum it carries (corruption in
    transit). The sender may retransmit, so it is retryable."""

    code = "checksum_mismatch"
    default_retryable = True


class UnsupportedFeature(ShardEngineError):
    """Raised when a request uses a feature the engine does not enable: a non-empty reserved
    MTP or auxiliary-state field, or an architecture/feature outside the engine's allow-list."""

    code = "unsupported_feature"


class NotReady(ShardEngineError):
    """Raised when the engine is not in a serving state (loading, closed, never loaded).
    Retryable only while the engine is loading (it becomes ready); ``retryable=False`` for an
    engine never loaded or closed, which no retry brings back."""

    code = "not_ready"
    default_retryable = True


class CacheMiss(ShardEngineError):
    """Raised when the session's cache cannot serve the request: unknown or evicted session, a
    decode position other than the committed length, or a prefill that would leave a gap.
    ``committed_length`` says how many positions are cached; the caller replays from there."""

    code = "cache_miss"
    default_retryable = True

    def __init__(
        self,
        message: str,
        *,
        committed_length: int,
        reason: str,
        retryable: bool | None = None,
        details: dict[str, ErrorDetail] | None = None,
    ) -> None:
        merged: dict[str, ErrorDetail] = dict(details or {})
        merged.update(committed_length=committed_length, reason=reason)
        super().__init__(message, retryable=retryable, details=merged)
        self.committed_length = committed_length
        self.reason = reason


class StaleEpoch(ShardEngineError):
    """Raised when a request's epoch is older than the session's current epoch, or not newer
    than a released epoch (tombstone). The caller holds an outdated fencing token."""

    code = "stale_epoch"


class ResourceExhausted(ShardEngineError):
    """Raised when admitting the request would exceed the KV budget, the session slots or the
    context length, and eviction is off or cannot free enough. Retryable for occupancy that a
    release or an eviction can free (KV budget, session slots); ``retryable=False`` when the
    request itself cannot fit (positions past max_context, a payload above the limit)."""

    code = "resource_exhausted"
    default_retryable = True


class Cancelled(ShardEngineError):
    """Raised to the caller of an operation that was cancelled; the session was rolled back
    to its committed length."""

    code = "cancelled"
    default_retryable = True


class MalformedOutput(ShardEngineError):
    """Raised by the validation wrapper when an engine's result breaks the contract (shape,
    dtype, positions, non-finite values, checksum, evidence class, session reference)."""

    code = "malformed_output"
    default_retryable = True


class EngineCrashed(ShardEngineError):
    """Raised when the engine has failed (backend crash, injected crash); the engine stays in
    the failed state and raises this for every later call until it is reloaded."""

    code = "engine_crashed"


class OutcomeUnknown(ShardEngineError):
    """Raised by an engine reached over a transport when the connection broke, or the deadline
    passed, while a state-changing request (prefill, decode, decode_batch, release, import) was
    in flight: the engine may or may not have committed it, and it is never reported as a
    success. ``details["reason"]`` says what happened (``connection_lost``,
    ``deadline_exceeded``, ``cancelled``, ``transport_error``). Retryable: re-issue the request;
    a decode that did commit answers CacheMiss carrying the committed length to resume from."""

    code = "outcome_unknown"
    default_retryable = True


class Unauthenticated(ShardEngineError):
    """Raised by an engine reached over a transport when its server refused the call's
    credentials (no bearer token, a wrong one, a client certificate it does not accept).
    Nothing ran. Not retryable with the same credentials."""

    code = "unauthenticated"


_BY_CODE: Final[dict[str, type[ShardEngineError]]] = {
    cls.code: cls
    for cls in (
        ShardEngineError,
        InvalidRequest,
        WrongRole,
        ShardMismatch,
        ContractVersionMismatch,
        ChecksumMismatch,
        UnsupportedFeature,
        NotReady,
        CacheMiss,
        StaleEpoch,
        ResourceExhausted,
        Cancelled,
        MalformedOutput,
        EngineCrashed,
        OutcomeUnknown,
        Unauthenticated,
    )
}


_RETRYABLE_VARIES: Final[frozenset[type[ShardEngineError]]] = frozenset(
    {ResourceExhausted, NotReady, ShardEngineError}
)
"""The classes whose ``retryable`` the contract lets an engine choose (occupancy or a context
overflow; loading or closed; an unknown code). Every other class is retryable exactly when its
default says so."""


def error_from_info(info: ErrorInfo) -> ShardEngineError:
    """Rebuild the typed error from its wire form; an unknown code gives the root class.

    ``retryable`` is the wire's only where the contract lets an engine choose it
    (ResourceExhausted, NotReady, an unknown code); for every other class it is the class's
    own: a peer claiming a retryable StaleEpoch or InvalidRequest would send a worker's retry
    loop round forever, and a non-retryable Cancelled or CacheMiss would make it give up on a
    request that can succeed."""
    cls = _BY_CODE.get(info.code, ShardEngineError)
    retryable = info.retryable if cls in _RETRYABLE_VARIES else cls.default_retryable
    if cls is CacheMiss:
        length = info.details.get("committed_length")
        reason = info.details.get("reason")
        # A peer's damaged length (a bool, a negative count) is no position to replay from:
        # 0, replay everything, is always safe.
        return CacheMiss(
            info.message,
            committed_length=length if type(length) is int and length >= 0 else 0,
            reason=reason if isinstance(reason, str) else "unknown",
            retryable=retryable,
            details=dict(info.details),
        )
    error = cls(info.message, retryable=retryable, details=dict(info.details))
    if cls is ShardEngineError and info.code != ShardEngineError.code:
        error.details.setdefault("unknown_code", info.code)
    return error
