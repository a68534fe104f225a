"""The msgspec types of the ShardEngine contract.

Every type is a frozen, keyword-only ``msgspec.Struct``. Types that travel inside a union carry
an explicit string tag, never derived from the class name, so a rename never breaks the wire.
New fields get defaults; tags are never reused.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Final, Literal, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import mark_checksummed, payload_checksum
from shard_engine_api._dtypes import (
    BOUNDARY_DTYPES,
    ITEMSIZE,
    f32_to_bf16_bits,
    payload_rows,
    storage_dtype,
)
from shard_engine_api._errors import ErrorInfo, InvalidRequest

__all__ = [
    "CONTRACT_VERSION",
    "AuxState",
    "BoundaryBundle",
    "BoundaryDtype",
    "BoundaryResult",
    "CancelRequest",
    "CancelResult",
    "Capabilities",
    "Checksum",
    "DecodeBatchRequest",
    "DecodeBatchResult",
    "DecodeRequest",
    "Determinism",
    "EvictionPolicy",
    "EvidenceClass",
    "ExportSessionRequest",
    "Features",
    "Health",
    "HookStatus",
    "ImportSessionRequest",
    "ImportSessionResult",
    "LifecycleState",
    "Limits",
    "LoadConfig",
    "LogitsMode",
    "LogitsResult",
    "Metrics",
    "MtpState",
    "OptionValue",
    "OutputKind",
    "PrefillRequest",
    "ReleaseRequest",
    "ReleaseResult",
    "ReservedHooks",
    "Role",
    "SessionRef",
    "SessionSnapshot",
    "ShardInput",
    "ShardResult",
    "ShardSpec",
    "Timings",
    "TokenInput",
    "Tolerance",
]

CONTRACT_VERSION: Final = 2
"""The version of this contract. Bundles and messages of another version are refused.

Version 2: payload checksums are xxh3-64 (version 1's were "gsum64-crc32"), bundles may carry
bf16."""

Role = Literal["head", "middle", "tail", "full"]
EvidenceClass = Literal["fixture", "real"]
BoundaryDtype = Literal["f32", "f16", "bf16"]
"""How hidden states travel: IEEE binary32, binary16, or bfloat16 (f32's range with 8
significant bits; see shard_engine_api._dtypes)."""
LifecycleState = Literal["unloaded", "loading", "ready", "degraded", "failed", "closed"]
LogitsMode = Literal["last", "all"]
EvictionPolicy = Literal["reject", "lru"]
OptionValue = object
"""An engine option: any JSON-compatible value (engines convert it to their own types)."""

INT64_MAX: Final = 2**63 - 1
"""The largest integer the wire carries, except checksums: every other wire integer is a signed
64-bit value (checksums are unsigned 64-bit, see ``Checksum``)."""
INT32_MAX: Final = 2**31 - 1
"""The largest token id (token ids are int32 on every backend)."""
MAX_ID_CHARS: Final = 256
"""The longest session id, request id, model fingerprint or option name."""
MAX_MODEL_CHARS: Final = 4096
"""The longest model reference (a path or a fake model name)."""
MAX_TOKENS_PER_REQUEST: Final = 1 << 20
"""The most token ids one request carries (an engine's ``max_batch_tokens`` is lower)."""
MAX_BATCH_ITEMS: Final = 1 << 16
"""The most items one batched decode carries."""
MAX_RESERVED_ITEMS: Final = 64
"""The most reserved MTP/aux entries a message may carry (any non-empty use is refused)."""
MAX_OPTIONS: Final = 256
"""The most entries of ``LoadConfig.options``."""
MAX_SESSIONS: Final = INT32_MAX
"""The largest ``LoadConfig.max_sessions``: session slots are int32 indices on every backend.
The core allocates per session in use, never per configured slot, so a large limit costs
nothing until sessions exist (a backend with a smaller limit reports it in ModelInfo)."""
MAX_CONTEXT: Final = 1 << 24
"""The largest ``LoadConfig.max_context`` (16M positions)."""
MAX_KV_BUDGET_TOKENS: Final = 1 << 36
"""The largest ``LoadConfig.kv_budget_tokens`` (64G positions: beyond any machine's memory
for any model, so only nonsense is refused)."""
MAX_THREADS: Final = 4096
"""The largest ``LoadConfig.n_threads``."""
SNAPSHOT_CHUNK_BYTES: Final = 1 << 20
"""The largest chunk of a session snapshot's state (1 MiB). Engines cut the state into chunks of
exactly this size (the last one shorter), so a transport can stream a snapshot chunk by chunk
instead of holding one giant message."""
MAX_SNAPSHOT_CHUNKS: Final = 1 << 16
"""The most chunks one snapshot carries (64 GiB of state at most; the codec's
``max_payload_bytes`` is the practical bound, see shard_engine_api._codec)."""

# Wire bounds as msgspec constraints: the decoders enforce them in C while decoding (container
# lengths before any element is built), and the edge checks of shard_engine_api._typecheck read them
# from the same annotations for structs built in Python.
Count: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
"""A non-negative wire integer: positions, epochs, counts, sizes."""
Int64: TypeAlias = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""A signed wire integer (contract versions)."""
Checksum: TypeAlias = Annotated[int, msgspec.Meta(ge=0, extra={"uint64": True})]
"""A payload checksum (:func:`~shard_engine_api._checksum.payload_checksum`): an unsigned
64-bit value in ``[0, CHECKSUM_MAX]``, a msgpack uint64 on the wire (``Count`` stops at
INT64_MAX and cannot hold it). msgspec bounds integers only within int64, so the upper bound is
the one msgpack itself imposes when decoding, and the edge checks (which read the ``uint64``
marker) for structs built in Python."""
TokenId: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Identifier: TypeAlias = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
"""A non-empty id of at most MAX_ID_CHARS characters."""
Fingerprint: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
FLOAT_MAX: Final = sys.float_info.max
"""The largest finite float."""
Milliseconds: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT_MAX)]
"""A duration: finite and >= 0 (NaN and infinities are refused, on the wire and at the edge)."""
MAX_ERROR_CODES: Final = 256
"""The most distinct error codes ``Metrics.errors`` may hold (the contract defines fewer than
twenty)."""
ErrorCode: TypeAlias = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
"""An error's stable code, as a key of ``Metrics.errors``."""
MAX_DETAIL_CHARS: Final = 16384
"""The longest ``Health.detail`` or ``ReleaseResult.detail`` (room for a peer's longest error
message and a note on it)."""
Detail: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)]
"""A human-readable explanation: at most MAX_DETAIL_CHARS characters."""
MAX_BOUNDARY_DTYPES: Final = 16
"""The most entries of ``Capabilities.boundary_dtypes`` (the contract defines three dtypes)."""


def numpy_dtype(dtype: BoundaryDtype) -> np.dtype[np.generic]:
    """The little-endian numpy dtype a payload of ``dtype`` is stored as (``<f4``, ``<f2``;
    bf16, which numpy lacks, as its ``<u2`` bits: use ``BoundaryBundle.array()`` for values)."""
    return storage_dtype(dtype)


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A contiguous, half-open layer range ``[start, end)`` of a model with ``n_layers`` layers."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_CHARS)]
    n_layers: Count
    start: Count
    end: Count

    def __post_init__(self) -> None:
        from shard_engine_api._typecheck import check_fields

        check_fields(self)
        if self.n_layers < 1:
            raise InvalidRequest(f"n_layers must be >= 1, got {self.n_layers}")
        if not 0 <= self.start < self.end <= self.n_layers:
            raise InvalidRequest(
                f"layer range [{self.start}, {self.end}) is not a non-empty range within "
                f"[0, {self.n_layers})"
            )

    @property
    def role(self) -> Role:
        """head (starts at 0), tail (ends at n_layers), middle, or full (both)."""
        if self.start == 0:
            return "full" if self.end == self.n_layers else "head"
        return "tail" if self.end == self.n_layers else "middle"

    @property
    def takes_tokens(self) -> bool:
        """Whether this shard's input is token ids (head and full) rather than a bundle."""
        return self.start == 0

    @property
    def emits_logits(self) -> bool:
        """Whether this shard's output is logits (tail and full) rather than a bundle."""
        return self.end == self.n_layers

    @property
    def n_shard_layers(self) -> int:
        """How many layers this shard runs."""
        return self.end - self.start


class SessionRef(msgspec.Struct, frozen=True, kw_only=True):
    """A session and the epoch (fencing token) the caller believes current."""

    session_id: Identifier
    epoch: Count

    def __post_init__(self) -> None:
        # Runs for every SessionRef built or decoded, so the common case costs two type tests
        # and two comparisons; anything else gets the full check, which names the field.
        session_id, epoch = self.session_id, self.epoch
        if (
            type(session_id) is not str
            or type(epoch) is not int
            or not 0 < len(session_id) <= MAX_ID_CHARS
            or not 0 <= epoch <= INT64_MAX
            or not session_id.isascii()
        ):
            from shard_engine_api._typecheck import check_fields

            check_fields(self)


class MtpState(msgspec.Struct, frozen=True, kw_only=True, tag="mtp"):
    """Reserved: multi-token-prediction state crossing a boundary. No engine enables it; any
    non-empty use is rejected with UnsupportedFeature."""

    n_draft_tokens: Count = 0
    payload: bytes = b""


class AuxState(msgspec.Struct, frozen=True, kw_only=True, tag="aux"):
    """Reserved: architecture auxiliary state (e.g. recurrent state) crossing a boundary. No
    engine enables it; any non-empty use is rejected with UnsupportedFeature."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    payload: bytes = b""


class TokenInput(msgspec.Struct, frozen=True, kw_only=True, tag="tokens"):
    """Token ids: the input of a head or full shard."""

    token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_TOKENS_PER_REQUEST)]


class BoundaryBundle(msgspec.Struct, frozen=True, kw_only=True, tag="boundary", dict=True):
    """Hidden states crossing a shard boundary: the output of a head or middle shard and the
    input of a middle or tail shard.

    ``payload`` holds ``n_tokens x hidden_size`` values of ``dtype``, row-major, little-endian;
    ``checksum`` is :func:`payload_checksum` of those bytes. ``layer`` is the index of the layer
    these states enter (the producer's ``end``).

    (``dict=True`` gives an instance room for the private mark that records a completed
    payload verification, so a bundle is scanned once per hop; see shard_engine_api._bundle_checks.
    The mark is not a field: it is never encoded and never compared.)
    """

    session: SessionRef
    first_pos: Count
    n_tokens: Count
    hidden_size: Count
    dtype: BoundaryDtype
    layer: Count
    model_fingerprint: Fingerprint
    payload: memoryview
    checksum: Checksum
    contract_version: Int64 = CONTRACT_VERSION
    mtp: Annotated[tuple[MtpState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()
    aux: Annotated[tuple[AuxState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()

    @classmethod
    def from_array(
        cls,
        hidden: npt.NDArray[np.floating],
        *,
        session: SessionRef,
        first_pos: int,
        layer: int,
        model_fingerprint: str,
        dtype: BoundaryDtype = "f32",
    ) -> BoundaryBundle:
        """Build a bundle from an ``(n_tokens, hidden_size)`` array, converting it to ``dtype``
        (bf16: rounded to nearest even, see shard_engine_api._dtypes) and computing the
        checksum. The payload is a read-only view of a private copy."""
        _check_array("hidden states", hidden)
        if dtype not in BOUNDARY_DTYPES:
            raise InvalidRequest(f"dtype must be one of {sorted(BOUNDARY_DTYPES)}, got {dtype!r}")
        data: npt.NDArray[np.generic]
        if dtype == "bf16":
            data = f32_to_bf16_bits(hidden)
        else:
            data = np.ascontiguousarray(hidden, dtype=storage_dtype(dtype))
            if data is hidden:
                data = data.copy()
        data.setflags(write=False)
        payload = data.data.cast("B")
        bundle = cls(
            session=session,
            first_pos=first_pos,
            n_tokens=int(data.shape[0]),
            hidden_size=int(data.shape[1]),
            dtype=dtype,
            layer=layer,
            model_fingerprint=model_fingerprint,
            payload=payload,
            checksum=payload_checksum(payload),
        )
        mark_checksummed(bundle)
        return bundle

    @property
    def expected_payload_bytes(self) -> int:
        """The payload length the header promises: n_tokens x hidden_size x dtype size."""
        return self.n_tokens * self.hidden_size * ITEMSIZE[self.dtype]

    def array(self) -> npt.NDArray[np.floating]:
        """The hidden states as an ``(n_tokens, hidden_size)`` array: a read-only view of the
        payload (no copy) for f32 and f16; for bf16, which numpy has no type for, the values
        as f32 (exact, a new array). Raises InvalidRequest when the payload length disagrees
        with the header."""
        if len(self.payload) != self.expected_payload_bytes:
            raise InvalidRequest(
                f"payload has {len(self.payload)} bytes, header promises "
                f"{self.expected_payload_bytes}"
            )
        if self.dtype == "bf16":
            return payload_rows(self.payload, "bf16", self.n_tokens, self.hidden_size)
        view = np.frombuffer(self.payload, dtype=storage_dtype(self.dtype))
        return view.reshape(self.n_tokens, self.hidden_size)


ShardInput = TokenInput | BoundaryBundle


def _check_array(what: str, values: object) -> None:
    """Refuse, as InvalidRequest, anything from_array cannot turn into a non-empty 2-D payload
    (instead of the AttributeError, IndexError or ValueError numpy would raise)."""
    if not isinstance(values, np.ndarray):
        raise InvalidRequest(f"{what} must be a numpy array, got {type(values).__name__}")
    shape = values.shape
    if len(shape) != 2:
        raise InvalidRequest(f"{what} must be 2-D (rows, width), got shape {shape}")
    if not (shape[0] and shape[1]):
        raise InvalidRequest(f"{what} must have at least one row and column, got {shape}")
    if values.dtype.kind not in "fiu":
        raise InvalidRequest(f"{what} must be a real numeric array, got dtype {values.dtype}")


class PrefillRequest(msgspec.Struct, frozen=True, kw_only=True, tag="prefill"):
    """Process ``inputs`` at positions ``start_pos..start_pos+n-1`` of a session. A
    ``start_pos`` below the committed length truncates the session there first."""

    request_id: Identifier
    session: SessionRef
    start_pos: Count
    inputs: ShardInput
    logits: LogitsMode = "last"
    mtp: Annotated[tuple[MtpState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()
    aux: Annotated[tuple[AuxState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()


class DecodeRequest(msgspec.Struct, frozen=True, kw_only=True, tag="decode"):
    """Process exactly one token (or one boundary row) at position ``pos``, which must equal
    the session's committed length."""

    request_id: Identifier
    session: SessionRef
    pos: Count
    inputs: ShardInput
    mtp: Annotated[tuple[MtpState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()
    aux: Annotated[tuple[AuxState, ...], msgspec.Meta(max_length=MAX_RESERVED_ITEMS)] = ()


class DecodeBatchRequest(msgspec.Struct, frozen=True, kw_only=True, tag="decode_batch"):
    """One decode step for several distinct sessions at once. Each item succeeds or fails on
    its own; cancelling ``request_id`` cancels every item."""

    request_id: Identifier
    items: Annotated[tuple[DecodeRequest, ...], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]


class CancelRequest(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    """Cancel one in-flight request (``request_id``) or every in-flight request of a session
    (``session_id``). Exactly one of the two must be given."""

    request_id: Identifier | None = None
    session_id: Identifier | None = None


class CancelResult(msgspec.Struct, frozen=True, kw_only=True, tag="cancel_result"):
    """How many in-flight requests were told to stop; ``cancelled`` is false when none was."""

    cancelled: bool
    n_requests: Count = 0


class ReleaseRequest(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """Free a session's state and leave a tombstone fencing its epoch and older ones."""

    session: SessionRef


class ReleaseResult(msgspec.Struct, frozen=True, kw_only=True, tag="release_result"):
    """Whether state was freed; ``detail`` says why not (unknown session, already released)."""

    released: bool
    detail: Detail = ""


class ExportSessionRequest(msgspec.Struct, frozen=True, kw_only=True, tag="export_session"):
    """Snapshot a live session (at exactly its current epoch) so another engine holding the
    same shard can continue it. The source is left unchanged."""

    request_id: Identifier
    session: SessionRef


SnapshotChunk: TypeAlias = Annotated[bytes, msgspec.Meta(max_length=SNAPSHOT_CHUNK_BYTES)]
"""One chunk of a snapshot's opaque state: at most SNAPSHOT_CHUNK_BYTES bytes."""


class SessionSnapshot(msgspec.Struct, frozen=True, kw_only=True, tag="session_snapshot"):
    """A session's cached state, portable to another engine of the same engine, version, model,
    layer range and result-affecting settings.

    ``chunks`` are the engine's opaque state of positions ``0..length-1``, cut into chunks of
    at most :data:`SNAPSHOT_CHUNK_BYTES`; ``state_bytes`` is their total length and
    ``checksum`` is :func:`payload_checksum` of their concatenation. ``settings_fingerprint``
    hashes everything that affects results (see ``EngineCore``); ``shard.model`` is the
    exporter's model reference (a path), informative only: the model is identified by
    ``model_fingerprint``.
    """

    engine: Identifier
    engine_version: Fingerprint
    shard: ShardSpec
    model_fingerprint: Fingerprint
    settings_fingerprint: Fingerprint
    session: SessionRef
    length: Count
    boundary_dtype: BoundaryDtype
    state_bytes: Count
    chunks: Annotated[tuple[SnapshotChunk, ...], msgspec.Meta(max_length=MAX_SNAPSHOT_CHUNKS)]
    checksum: Checksum
    contract_version: Int64 = CONTRACT_VERSION


class ImportSessionRequest(msgspec.Struct, frozen=True, kw_only=True, tag="import_session"):
    """Install ``snapshot`` as a live session. ``epoch`` (at least the snapshot's) installs it
    under a newer epoch, so the exporter's epoch is fenced at the importer; None keeps the
    snapshot's epoch."""

    request_id: Identifier
    snapshot: SessionSnapshot
    epoch: Count | None = None


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """Wall-clock milliseconds: waiting for the shard, computing, and the whole call."""

    queue_ms: Milliseconds = 0.0
    compute_ms: Milliseconds = 0.0
    total_ms: Milliseconds = 0.0


class BoundaryResult(msgspec.Struct, frozen=True, kw_only=True, tag="boundary_result"):
    """The result of a head or middle shard: the bundle for the next shard."""

    request_id: Identifier
    session: SessionRef
    first_pos: Count
    n_tokens: Count
    evidence: EvidenceClass
    bundle: BoundaryBundle
    timings: Timings = Timings()


class LogitsResult(msgspec.Struct, frozen=True, kw_only=True, tag="logits_result", dict=True):
    """The result of a tail or full shard: ``n_rows`` rows of ``vocab_size`` f32 logits for
    positions ``first_pos..first_pos+n_rows-1`` (the last position only, unless all rows were
    asked for). ``checksum`` is :func:`payload_checksum` of ``payload``."""

    request_id: Identifier
    session: SessionRef
    first_pos: Count
    n_rows: Count
    vocab_size: Count
    evidence: EvidenceClass
    payload: memoryview
    checksum: Checksum
    timings: Timings = Timings()

    @classmethod
    def from_array(
        cls,
        logits: npt.NDArray[np.floating],
        *,
        request_id: str,
        session: SessionRef,
        first_pos: int,
        evidence: EvidenceClass,
        timings: Timings | None = None,
    ) -> LogitsResult:
        """Build a result from an ``(n_rows, vocab_size)`` array (stored as f32). Raises
        InvalidRequest for anything but a non-empty 2-D numeric array."""
        _check_array("logits", logits)
        data = np.ascontiguousarray(logits, dtype=np.dtype("<f4"))
        if data is logits:
            data = data.copy()
        data.setflags(write=False)
        payload = data.data.cast("B")
        result = cls(
            request_id=request_id,
            session=session,
            first_pos=first_pos,
            n_rows=int(data.shape[0]),
            vocab_size=int(data.shape[1]),
            evidence=evidence,
            payload=payload,
            checksum=payload_checksum(payload),
            timings=timings or Timings(),
        )
        mark_checksummed(result)
        return result

    def array(self) -> npt.NDArray[np.float32]:
        """The logits as a read-only ``(n_rows, vocab_size)`` f32 view of the payload."""
        expected = self.n_rows * self.vocab_size * 4
        if len(self.payload) != expected:
            raise InvalidRequest(
                f"logits payload has {len(self.payload)} bytes, header promises {expected}"
            )
        return np.frombuffer(self.payload, dtype=np.dtype("<f4")).reshape(
            self.n_rows, self.vocab_size
        )


ShardResult = BoundaryResult | LogitsResult


class ImportSessionResult(msgspec.Struct, frozen=True, kw_only=True, tag="import_session_result"):
    """An installed session: its reference (the epoch it now has), committed length, whether it
    replaced an older live epoch of the same session, and how many idle sessions were evicted
    to make room."""

    request_id: Identifier
    session: SessionRef
    length: Count
    replaced: bool = False
    evicted: Count = 0
    timings: Timings = Timings()


class DecodeBatchResult(msgspec.Struct, frozen=True, kw_only=True, tag="decode_batch_result"):
    """One entry per request item, in item order: its result or its typed error."""

    request_id: Identifier
    items: Annotated[
        tuple[BoundaryResult | LogitsResult | ErrorInfo, ...],
        msgspec.Meta(max_length=MAX_BATCH_ITEMS),
    ]


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Admission limits. ``kv_budget_tokens`` bounds the cached positions of all sessions."""

    max_sessions: Count
    max_context: Count
    max_batch_tokens: Count
    kv_budget_tokens: Count


class Features(msgspec.Struct, frozen=True, kw_only=True):
    """Optional behaviours and their bounds."""

    cancel: bool = True
    cancel_latency_ms: Milliseconds = 50.0
    batched_decode: bool = True
    truncate: bool = True
    eviction: bool = True
    session_migration: bool = False
    """``export_session``/``import_session`` are supported (see the package README, "Session
    migration")."""


OutputKind = Literal["logits", "hidden"]
"""The two kinds of output rows: a tail's logits, a non-tail shard's hidden states."""


class Tolerance(msgspec.Struct, frozen=True, kw_only=True):
    """How far one output row may move when the same positions are computed another way
    (other batch shapes, chunks, splits): for every element ``i`` of a row ``e`` and its
    recomputation ``a``, ``|a[i] - e[i]| <= absolute + relative * max(|e|)``.

    The relative part scales with the row's own magnitude, so one declaration fits logits of
    ~20 and hidden states of ~1e5 alike; ``absolute`` covers rows near zero. Both are finite
    and >= 0; a ``relative`` of 1 or more would accept an all-zero row for any row, so it is
    refused (InvalidRequest) as a declaration that promises nothing."""

    absolute: float = 0.0
    relative: float = 0.0

    def __post_init__(self) -> None:
        for name in ("absolute", "relative"):
            value = getattr(self, name)
            if type(value) not in (float, int) or not math.isfinite(value) or value < 0:
                raise InvalidRequest(f"Tolerance.{name} must be finite and >= 0, got {value!r}")
        if self.relative >= 1.0:
            raise InvalidRequest(
                f"Tolerance.relative must be < 1 (a bound of the row's whole magnitude accepts "
                f"any output), got {self.relative!r}"
            )

    def bound(self, magnitude: float) -> float:
        """The largest difference allowed in a row whose largest magnitude is ``magnitude``."""
        return self.absolute + self.relative * magnitude


class Determinism(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine promises about repeatability: same inputs give the same outputs
    (``deterministic``); a pipeline of shards equals one full shard bit for bit
    (``split_exact``); batching and chunking do not change outputs (``batch_invariant``).

    Where an engine is not exact it declares how far outputs may move, per output kind:
    ``logits_tolerance`` and ``hidden_tolerance`` (:class:`Tolerance`, relative to each row's
    magnitude). ``tolerance`` is the older single absolute bound for both kinds; it applies to
    a kind whose own tolerance is not declared, so engines built before the per-kind fields
    keep exactly their behaviour. The conformance suite reports what was declared next to the
    largest difference it observed."""

    deterministic: bool
    split_exact: bool
    tolerance: float = 0.0
    batch_invariant: bool = True
    logits_tolerance: Tolerance | None = None
    hidden_tolerance: Tolerance | None = None

    def tolerance_for(self, kind: OutputKind) -> Tolerance:
        """The tolerance that applies to outputs of ``kind``."""
        declared = self.logits_tolerance if kind == "logits" else self.hidden_tolerance
        if declared is not None:
            return declared
        return Tolerance(absolute=self.tolerance) if _valid_bound(self.tolerance) else _VACUOUS


def _valid_bound(value: float) -> bool:
    return math.isfinite(value) and value >= 0


_VACUOUS: Final = Tolerance()
"""Stand-in for an invalid legacy ``tolerance`` (NaN, negative): exactness; the conformance
suite fails such a declaration on its own."""


class HookStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A reserved hook: present in the contract, enabled or not."""

    present: bool = True
    enabled: bool = False


class ReservedHooks(msgspec.Struct, frozen=True, kw_only=True):
    """The reserved extension points (multi-token prediction, auxiliary state)."""

    mtp: HookStatus = HookStatus()
    aux: HookStatus = HookStatus()


class Capabilities(msgspec.Struct, frozen=True, kw_only=True, tag="capabilities"):
    """What a loaded engine is and can do."""

    engine: Identifier
    engine_version: Fingerprint
    contract_version: Int64
    evidence: EvidenceClass
    shard: ShardSpec
    role: Role
    model_fingerprint: Fingerprint
    hidden_size: Count
    vocab_size: Count
    boundary_dtypes: Annotated[
        tuple[BoundaryDtype, ...], msgspec.Meta(max_length=MAX_BOUNDARY_DTYPES)
    ]
    limits: Limits
    features: Features
    determinism: Determinism
    reserved: ReservedHooks = ReservedHooks()
    boundary_dtype: BoundaryDtype | None = None
    """The dtype this loaded shard's bundles carry (``LoadConfig.boundary_dtype``); None from
    an engine that does not say, in which case any of ``boundary_dtypes`` may appear."""


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True, tag="load"):
    """How to load a shard. ``model`` is engine-specific (a GGUF path, a fake model name);
    ``options`` carries engine-specific settings, each engine documents and validates them."""

    shard: ShardSpec
    boundary_dtype: BoundaryDtype = "f32"
    max_sessions: Annotated[int, msgspec.Meta(ge=1, le=MAX_SESSIONS)] = 16
    max_context: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT)] = 2048
    max_batch_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_REQUEST)] = 512
    kv_budget_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_KV_BUDGET_TOKENS)] = 16384
    eviction: EvictionPolicy = "reject"
    n_threads: Annotated[int, msgspec.Meta(ge=0, le=MAX_THREADS)] = 0
    options: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)], OptionValue],
        msgspec.Meta(max_length=MAX_OPTIONS),
    ] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        from shard_engine_api._typecheck import check_fields

        # Types, ranges, literals and options (JSON-like, bounded) with the field path named.
        check_fields(self)
        for name in ("max_sessions", "max_context", "max_batch_tokens", "kv_budget_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise InvalidRequest(f"{name} must be >= 1, got {value}")
        if self.n_threads < 0:
            raise InvalidRequest(
                f"n_threads must be >= 0 (0 = engine default), got {self.n_threads}"
            )


class Health(msgspec.Struct, frozen=True, kw_only=True, tag="health"):
    """The engine's state now. Ready and degraded serve requests; the others raise.

    Every count is a non-negative 64-bit integer (the decoders refuse anything else). Against
    the engine's capabilities (checked by ``ValidatingEngine`` and the conformance suite):
    ``sessions <= limits.max_sessions``, and ``kv_budget_tokens`` and ``kv_used_tokens`` are at
    most ``limits.kv_budget_tokens`` (the configured budget). ``kv_budget_tokens`` is the budget
    now: memory pressure may shrink it below ``kv_used_tokens`` until the next admission
    evicts or refuses, so ``kv_used_tokens <= kv_budget_tokens`` is not an invariant."""

    state: LifecycleState
    detail: Detail = ""
    sessions: Count = 0
    in_flight: Count = 0
    kv_used_tokens: Count = 0
    kv_budget_tokens: Count = 0
    queued: Count = 0
    """Requests waiting for their turn on the backend now (see the API README, "Many
    callers"); ``in_flight`` counts them too."""


class Metrics(msgspec.Struct, frozen=True, kw_only=True, tag="metrics"):
    """Counters since load.

    ``requests`` counts the requests that reached the engine with a request id (prefill,
    decode, decode_batch, export_session and import_session calls, a batch once), failed and
    cancelled ones included; ``release``, ``cancel`` and the queries are not requests
    (releases are counted in ``releases``).
    ``decode_requests`` counts single decodes only (a batch counts in ``batch_requests``).
    ``errors`` counts, by code, every error a caller received: raised by any operation
    (release included) or returned as an item of a batch result. ``fences_dropped`` counts
    tombstones forgotten early (their old epochs would be accepted again).

    Every counter is a non-negative 64-bit integer, ``compute_ms`` is finite and >= 0, and
    ``errors`` maps at most MAX_ERROR_CODES non-empty codes to counts (the decoders refuse
    anything else). Against the capabilities: ``sessions_active <= limits.max_sessions`` and
    ``kv_used_tokens <= limits.kv_budget_tokens``."""

    requests: Count = 0
    prefill_requests: Count = 0
    decode_requests: Count = 0
    batch_requests: Count = 0
    prefill_tokens: Count = 0
    decode_tokens: Count = 0
    cancelled: Count = 0
    evictions: Count = 0
    releases: Count = 0
    exports: Count = 0
    imports: Count = 0
    sessions_active: Count = 0
    tombstones: Count = 0
    fences_dropped: Count = 0
    kv_used_tokens: Count = 0
    compute_ms: Milliseconds = 0.0
    errors: Annotated[dict[ErrorCode, Count], msgspec.Meta(max_length=MAX_ERROR_CODES)] = (
        msgspec.field(default_factory=dict)
    )
    queued: Count = 0
    """Requests waiting for their turn on the backend now."""
    queue_peak: Count = 0
    """The most requests that waited at once."""
    queue_waits: Count = 0
    """Requests that found the backend busy and waited (the rest ran at once)."""
    queue_wait_ms: Milliseconds = 0.0
    """Their total wait; ``queue_wait_ms / queue_waits`` is the mean wait."""
    queue_wait_max_ms: Milliseconds = 0.0
    """The longest single wait."""
    coalesced_forwards: Count = 0
    """Forwards that ran single decodes of several callers together (continuous batching)."""
    coalesced_requests: Count = 0
    """The single decodes those forwards ran; over ``coalesced_forwards``: the mean size."""
    coalesced_max: Count = 0
    """The largest such forward, in requests."""
