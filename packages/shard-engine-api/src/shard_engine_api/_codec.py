"""The wire codec: msgpack (via msgspec) for every request, result, error and boundary bundle.

Every message is a tagged ``msgspec.Struct`` encoded as a msgpack map whose ``"type"`` key is
the type's explicit tag. One decoder is prebuilt per union (decoders are reusable and
thread-safe), and a decoded message is checked before it is returned, so a caller gets either a
complete, verified object or a typed :class:`~shard_engine_api.InvalidRequest` (or subclass),
never a partial object and never a raw msgspec exception.

Decoding is bounded by the codec's limits before anything large is built: the message size
(``max_payload_bytes`` plus :data:`MESSAGE_OVERHEAD_BYTES`; :data:`MAX_STRUCTURE_BYTES` for a
message type that carries no payload, read from its tag), every container's length (the
``msgspec.Meta`` bounds of shard_engine_api._types, checked from the length header before any
element is decoded), the nesting depth (no decoder recurses without bound: a nested-array bomb
is InvalidRequest, never RecursionError), and engine options (``LoadConfig.options`` is decoded
only after its encoded size passed :data:`MAX_OPTIONS_BYTES`, then held to the bounds of
:func:`shard_engine_api._typecheck.check_option_value`).

Payloads (bundle hidden states and logits) decode zero-copy: the ``payload`` memoryview is a
view into the input buffer, and ``array()`` is ``np.frombuffer`` on it. The decoded object keeps
the input buffer alive. Decoding verifies every bundle and logits payload with the checks of
shard_engine_api._bundle_checks (cheapest first: contract version, reserved state, header values,
dtype, the receiver's expected hidden size, model fingerprint and layer, payload size limit
before any hashing, payload length, checksum, finiteness); a bundle verified here is marked so
the engine core that receives it does not scan its payload again.

Session snapshots (alone or inside an import request) are verified on decode too, by
shard_engine_api._snapshot: contract version, at least one position, state size within
``max_payload_bytes`` (before hashing), every chunk within ``SNAPSHOT_CHUNK_BYTES`` (refused
from its length header), chunks adding up to ``state_bytes`` and matching the checksum.

Checksums are computed once, by the engine that creates a bundle or snapshot, so encoding never
recomputes them; decoding always verifies them.

Alignment: a large payload (64 KiB and up) of a bundle, a bundle-carrying request or result, or a
logits result is placed at a 16-byte-aligned offset of the message by inserting an ignored
``"_pad"`` entry (a short bin) right after the tag. numpy reads unaligned memory through a
buffered slow path, which made checksum and finiteness verification of a view into the message
~2x slower; with the padding they run at full speed on any buffer that itself starts aligned
(bytes objects and allocator-returned buffers do). The padding is plain msgpack: any msgspec
decoder of these types ignores the unknown field, so it is not a wire change.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Annotated, Final, Literal, TypeAlias, TypeVar, get_args

import msgspec

from shard_engine_api._bundle_checks import (
    BundleExpectation,
    all_finite,
    check_bundle,
    check_logits,
    violation_error,
)
from shard_engine_api._errors import (
    MAX_ERROR_CODE_CHARS,
    MAX_ERROR_DETAIL_CHARS,
    MAX_ERROR_DETAILS,
    MAX_ERROR_MESSAGE_CHARS,
    ContractVersionMismatch,
    ErrorDetail,
    ErrorInfo,
    InvalidRequest,
    ResourceExhausted,
    ShardEngineError,
    clamp_text,
    error_from_info,
)
from shard_engine_api._snapshot import verify_snapshot_integrity
from shard_engine_api._typecheck import check_option_value
from shard_engine_api._types import (
    CONTRACT_VERSION,
    MAX_BATCH_ITEMS,
    BoundaryBundle,
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
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionSnapshot,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_OPTIONS_BYTES",
    "MAX_STRUCTURE_BYTES",
    "MESSAGE_OVERHEAD_BYTES",
    "Codec",
    "NonFinitePolicy",
    "WireMessage",
    "WireReply",
    "WireRequest",
    "all_finite",
    "decode_bundle",
    "decode_error",
    "decode_message",
    "decode_reply",
    "decode_request",
    "encode",
    "encode_bundle",
    "encode_error",
]

NonFinitePolicy = Literal["reject", "allow"]
"""What to do with NaN or infinite values in hidden states and logits: refuse them with
InvalidRequest (``"reject"``, the default) or pass them through (``"allow"``)."""

DEFAULT_MAX_PAYLOAD_BYTES: Final = 256 * 1024 * 1024
"""The default limit on one payload (256 MiB: 16k rows of hidden size 4096 in f32)."""
MESSAGE_OVERHEAD_BYTES: Final = 64 * 1024 * 1024
"""How much more than ``max_payload_bytes`` a whole message may be (headers, token ids, the
items of a batch): a longer message is refused before it is decoded."""
MAX_OPTIONS_BYTES: Final = 64 * 1024
"""The largest encoded ``LoadConfig.options``: decoded, that is at most a few MiB of objects
(msgpack's one-byte empty containers are the worst case), and the decoded options must then
also pass the depth and count bounds of the edge checks."""

MAX_STRUCTURE_BYTES: Final = 1 << 20
"""The largest message of a type that carries no payload: capabilities, health, metrics, an
error, a cancel or release request or result, an export request, an import result, a load
config. Decoded, msgpack's small containers become Python objects up to ~15 times their
encoded size (a 23 MB metrics map of short error codes took 337 MB), so a larger one is refused
from its size and tag, before anything of it is built."""

# Each set of message types is written once, in these aliases; the decoders and the set of
# encodable types are derived from them (typing.get_args), so a new message type is added here.
WireRequest: TypeAlias = (
    LoadConfig
    | PrefillRequest
    | DecodeRequest
    | DecodeBatchRequest
    | CancelRequest
    | ReleaseRequest
    | ExportSessionRequest
    | ImportSessionRequest
)
"""Every message a worker sends to an engine."""

WireReply: TypeAlias = (
    Capabilities
    | BoundaryResult
    | LogitsResult
    | DecodeBatchResult
    | CancelResult
    | ReleaseResult
    | Health
    | Metrics
    | SessionSnapshot
    | ImportSessionResult
)
"""Every successful answer an engine sends back (an error travels as :class:`ErrorInfo`)."""

WireMessage: TypeAlias = WireRequest | WireReply | ErrorInfo | BoundaryBundle
"""Every top-level message of the wire: requests, replies, errors and bare bundles.
(``TokenInput``, ``MtpState`` and ``AuxState`` are tagged too, but only travel nested.)"""


def _wire_load_config() -> type[msgspec.Struct]:
    """LoadConfig as the decoders see it: ``options`` stays raw msgpack until its size is
    checked (an ``Any`` field would otherwise build whatever the bytes describe). Derived from
    LoadConfig's own fields, so the two cannot drift apart."""
    fields: list[tuple[str, object, object]] = []
    for info in msgspec.structs.fields(LoadConfig):
        if info.name == "options":
            # An empty Raw stands for "absent" (an encoded value is never empty).
            fields.append((info.name, msgspec.Raw, msgspec.Raw()))
        elif info.required:
            fields.append((info.name, info.type, msgspec.NODEFAULT))
        else:
            fields.append((info.name, info.type, info.default))
    return msgspec.defstruct(
        "LoadConfig", fields, tag="load", frozen=True, kw_only=True, module=__name__
    )


_WireLoadConfig: Final = _wire_load_config()
_WIRE_TYPES: Final[frozenset[type]] = frozenset(get_args(WireMessage))
_OPTIONS_DECODER: Final = msgspec.msgpack.Decoder(dict[str, object])

_ENCODER: Final = msgspec.msgpack.Encoder()
_ALIGNMENT: Final = 16
_ALIGN_FROM_BYTES: Final = 64 * 1024
_EMPTY_PAYLOAD: Final = memoryview(b"")
# The empty payload as msgspec writes it: the "payload" key, then a zero-length bin8.
_EMPTY_PAYLOAD_ENTRY: Final = _ENCODER.encode("payload") + b"\xc4\x00"
_PAYLOAD_KEY: Final = _ENCODER.encode("payload")
_PAD_KEY: Final = _ENCODER.encode("_pad")
_TAG_KEY: Final = _ENCODER.encode("type")


def _union(types: Iterable[type]) -> object:
    """The union of ``types`` as a runtime object msgspec builds a decoder for."""
    return functools.reduce(operator.or_, types)


def _decoded_as(alias: object) -> object:
    """The union a decoder of ``alias`` reads: each member type as its wire form is decoded
    (LoadConfig as :data:`_WireLoadConfig`, see :func:`_wire_load_config`)."""
    return _union(_WireLoadConfig if cls is LoadConfig else cls for cls in get_args(alias))


# msgspec's stubs type a decoder built from a union as Decoder[Any]; pin the real types.
_MESSAGE_DECODER: Final[msgspec.msgpack.Decoder[WireMessage]] = msgspec.msgpack.Decoder(
    _decoded_as(WireMessage)
)
_REQUEST_DECODER: Final[msgspec.msgpack.Decoder[WireRequest]] = msgspec.msgpack.Decoder(
    _decoded_as(WireRequest)
)
_REPLY_DECODER: Final[msgspec.msgpack.Decoder[WireReply | ErrorInfo]] = msgspec.msgpack.Decoder(
    WireReply | ErrorInfo
)
_BUNDLE_DECODER: Final = msgspec.msgpack.Decoder(BoundaryBundle)
_ERROR_DECODER: Final = msgspec.msgpack.Decoder(ErrorInfo)

Buffer: TypeAlias = bytes | bytearray | memoryview
_T = TypeVar("_T")


class _VersionProbe(msgspec.Struct):
    """Reads only the contract versions of a message and of the bundles nested in it. Unknown
    fields are ignored, so it still reads a newer version whose shape this library does not
    know; that is what lets a version mismatch be reported as such."""

    contract_version: int | None = None
    inputs: _VersionProbe | None = None
    bundle: _VersionProbe | None = None
    snapshot: _VersionProbe | None = None
    # Bounded like the batches it reads: it runs on bytes the real decoder refused, and an
    # unbounded array of empty maps would build one probe per byte (a 10 MB message took
    # 889 MB and 20 s before this bound).
    items: Annotated[tuple[_VersionProbe, ...], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = ()


_PROBE_DECODER: Final = msgspec.msgpack.Decoder(_VersionProbe)


def _probe_versions(probe: _VersionProbe) -> int | None:
    """The first contract version found in ``probe`` that is not ours, if any."""
    pending = [probe]
    while pending:
        node = pending.pop()
        if node.contract_version is not None and node.contract_version != CONTRACT_VERSION:
            return node.contract_version
        if node.inputs is not None:
            pending.append(node.inputs)
        if node.bundle is not None:
            pending.append(node.bundle)
        if node.snapshot is not None:
            pending.append(node.snapshot)
        pending.extend(node.items)
    return None


def _decode_failure(buf: Buffer, error: Exception) -> InvalidRequest:
    """The typed error for bytes the full decoder refused: a version mismatch when the bytes
    name another contract version, else InvalidRequest with msgspec's reason."""
    if isinstance(error, RecursionError):
        return InvalidRequest("undecodable message: nested too deeply")
    try:
        foreign = _probe_versions(_PROBE_DECODER.decode(buf))
    except (msgspec.MsgspecError, RecursionError):
        foreign = None
    if foreign is not None:
        return ContractVersionMismatch(
            f"message speaks contract version {foreign}; this library speaks {CONTRACT_VERSION}",
            details={"contract_version": foreign, "supported": CONTRACT_VERSION},
        )
    return InvalidRequest(f"undecodable message: {error}")


def _message_too_large(size: int, max_bytes: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"message of {size} bytes exceeds the limit of {max_bytes}",
        retryable=False,
        details={"resource": "message_bytes", "message_bytes": size, "limit": max_bytes},
    )


def _skeleton(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A struct with ``cls``'s tag and no fields: decoding one reads the tag as the real
    decoders do (the first ``type`` key) and skips every value without building it."""
    return msgspec.defstruct(
        f"{cls.__name__}Skeleton", [], tag=cls.__struct_config__.tag, module=__name__
    )


_STRUCTURE_ONLY: Final = (
    Capabilities,
    Health,
    Metrics,
    ErrorInfo,
    CancelRequest,
    CancelResult,
    ReleaseRequest,
    ReleaseResult,
    ExportSessionRequest,
    ImportSessionResult,
    LoadConfig,
)
_STRUCTURE_ONLY_TAGS: Final = frozenset(cls.__struct_config__.tag for cls in _STRUCTURE_ONLY)
_SKELETON_DECODER: Final[msgspec.msgpack.Decoder[msgspec.Struct]] = msgspec.msgpack.Decoder(
    _union(_skeleton(cls) for cls in get_args(WireMessage))
)


def _refuse_bulky_structure(buf: Buffer, size: int) -> None:
    """Refuse a message above MAX_STRUCTURE_BYTES whose tag says it carries no payload."""
    try:
        skeleton = _SKELETON_DECODER.decode(buf)
    except (msgspec.MsgspecError, RecursionError) as error:
        raise _decode_failure(buf, error) from None
    tag = type(skeleton).__struct_config__.tag
    if tag in _STRUCTURE_ONLY_TAGS:
        raise ResourceExhausted(
            f"a {tag!r} message of {size} bytes exceeds the limit of {MAX_STRUCTURE_BYTES} for "
            "messages without a payload",
            retryable=False,
            details={
                "resource": "message_bytes",
                "message_bytes": size,
                "limit": MAX_STRUCTURE_BYTES,
            },
        )


def _buffer_size(buf: object) -> int:
    """The byte length of ``buf``; InvalidRequest for anything but a contiguous buffer (a str,
    None, a strided view), which msgspec would refuse with TypeError or BufferError."""
    if type(buf) is bytes:
        return len(buf)
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
        contiguous = view.c_contiguous
    except TypeError:
        raise InvalidRequest(
            f"can only decode bytes, bytearray or memoryview, got {type(buf).__name__}"
        ) from None
    except ValueError:  # a released view
        raise InvalidRequest("can only decode a live buffer, got a released memoryview") from None
    if not contiguous:
        raise InvalidRequest("can only decode a contiguous buffer, got a strided view")
    return view.nbytes


def _decode(decoder: msgspec.msgpack.Decoder[_T], buf: Buffer, max_bytes: int) -> _T:
    """``decoder.decode(buf)`` within the size bounds, every failure typed."""
    size = _buffer_size(buf)
    if size > max_bytes:
        raise _message_too_large(size, max_bytes)
    if size > MAX_STRUCTURE_BYTES:
        _refuse_bulky_structure(buf, size)
    try:
        return decoder.decode(buf)
    except (msgspec.MsgspecError, RecursionError) as error:
        # msgspec unwinds cleanly from its recursion guard (it is raised before any frame is
        # corrupted), so a depth bomb is just another undecodable message.
        raise _decode_failure(buf, error) from None


def _load_config(wire: msgspec.Struct) -> LoadConfig:
    """The LoadConfig a decoded wire form stands for, its options decoded within bounds."""
    raw: msgspec.Raw = getattr(wire, "options")  # noqa: B009 (a defstruct field)
    options: dict[str, object] = {}
    if len(raw):
        if len(raw) > MAX_OPTIONS_BYTES:
            raise InvalidRequest(
                f"LoadConfig.options: {len(raw)} encoded bytes exceed the limit of "
                f"{MAX_OPTIONS_BYTES}",
                details={"field": "LoadConfig.options"},
            )
        try:
            options = _OPTIONS_DECODER.decode(raw)
        except (msgspec.MsgspecError, RecursionError) as error:
            reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
            raise InvalidRequest(
                f"LoadConfig.options: undecodable: {reason}",
                details={"field": "LoadConfig.options"},
            ) from None
        try:
            check_option_value(options)
        except InvalidRequest as error:
            raise InvalidRequest(
                f"LoadConfig.options: {error.message}", details={"field": "LoadConfig.options"}
            ) from None
    fields = {name: getattr(wire, name) for name in wire.__struct_fields__ if name != "options"}
    # The constructor runs the edge checks (types, bounds) once more on Python values.
    return LoadConfig(**fields, options=options)


def _check_version(version: int, what: str) -> None:
    if version != CONTRACT_VERSION:
        raise ContractVersionMismatch(
            f"{what} speaks contract version {version}; this library speaks {CONTRACT_VERSION}",
            details={"contract_version": version, "supported": CONTRACT_VERSION},
        )


_Carrier: TypeAlias = (
    BoundaryBundle | PrefillRequest | DecodeRequest | BoundaryResult | LogitsResult
)


def _large_payload(message: WireMessage) -> tuple[memoryview, _Carrier] | None:
    """The one payload worth aligning in ``message`` and the message with that payload
    emptied, or None (no payload, a small one, or several as in batches)."""
    match message:
        case BoundaryBundle(payload=payload) | LogitsResult(payload=payload):
            if payload.nbytes < _ALIGN_FROM_BYTES:
                return None
            return payload, msgspec.structs.replace(message, payload=_EMPTY_PAYLOAD)
        case (
            PrefillRequest(inputs=BoundaryBundle() as bundle)
            | DecodeRequest(inputs=BoundaryBundle() as bundle)
        ):
            if bundle.payload.nbytes < _ALIGN_FROM_BYTES:
                return None
            emptied = msgspec.structs.replace(bundle, payload=_EMPTY_PAYLOAD)
            return bundle.payload, msgspec.structs.replace(message, inputs=emptied)
        case BoundaryResult(bundle=bundle):
            if bundle.payload.nbytes < _ALIGN_FROM_BYTES:
                return None
            emptied = msgspec.structs.replace(bundle, payload=_EMPTY_PAYLOAD)
            return bundle.payload, msgspec.structs.replace(message, bundle=emptied)
        case _:
            return None


def _encode_aligned(message: WireMessage) -> bytes:
    """msgspec's encoding of ``message``, with its large payload (if any) moved to an aligned
    offset by an ignored ``"_pad"`` entry. Falls back to the plain encoding whenever the layout
    is not the expected one, so it can never produce a message that decodes differently."""
    if type(message) is BoundaryBundle:
        # The common case of a decode step's bundle, without the match below.
        payload = message.payload
        if type(payload) is memoryview and payload.nbytes < _ALIGN_FROM_BYTES:
            return _ENCODER.encode(message)
    parts = _aligned_parts(message)
    return _ENCODER.encode(message) if parts is None else b"".join(parts)


def _aligned_parts(message: WireMessage) -> list[bytes | memoryview] | None:
    """The pieces of :func:`_encode_aligned`'s bytes, in order, the payload among them
    uncopied; None when the message has no large payload to align (or an unexpected layout)."""
    found = _large_payload(message)
    if found is None:
        return None
    payload, emptied = found
    skeleton = _ENCODER.encode(emptied)
    tag = type(message).__struct_config__.tag
    tag_entry = _TAG_KEY + _ENCODER.encode(tag)
    header_end = 1 + len(tag_entry)
    if (
        not 0x80 <= skeleton[0] < 0x8F  # a fixmap that can take one more entry
        or skeleton[1:header_end] != tag_entry
        or skeleton.count(_EMPTY_PAYLOAD_ENTRY) != 1
    ):
        return None
    at = skeleton.index(_EMPTY_PAYLOAD_ENTRY)
    size = payload.nbytes
    payload_header = _PAYLOAD_KEY + b"\xc6" + size.to_bytes(4, "big")
    # Offset of the payload with an empty pad: the skeleton up to the payload key, plus the pad
    # entry's key and bin8 header, plus the payload key and bin32 header.
    unpadded = at + len(_PAD_KEY) + 2 + len(payload_header)
    pad = -unpadded % _ALIGNMENT
    return [
        bytes((skeleton[0] + 1,)),
        skeleton[1:header_end],
        _PAD_KEY,
        bytes((0xC4, pad)),
        bytes(pad),
        skeleton[header_end:at],
        payload_header,
        payload,
        skeleton[at + len(_EMPTY_PAYLOAD_ENTRY) :],
    ]


def _require_wire_type(message: object) -> None:
    """InvalidRequest for anything but a wire message (whose bytes no decoder would accept)."""
    if type(message) not in _WIRE_TYPES:
        raise InvalidRequest(
            f"cannot encode {type(message).__name__}: not a wire message "
            f"({', '.join(sorted(cls.__name__ for cls in _WIRE_TYPES))})"
        )


class Codec:
    """A receiver's decoding policy: payload size limit, non-finite policy and, optionally,
    the model fingerprint, layer index and hidden size every received bundle must carry.

    Encoding needs no policy; the methods are here so one object serves both directions.
    A Codec is immutable and thread-safe.
    """

    __slots__ = (
        "_expectation",
        "expected_fingerprint",
        "expected_hidden_size",
        "expected_layer",
        "max_message_bytes",
        "max_payload_bytes",
        "nonfinite",
    )

    def __init__(
        self,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        nonfinite: NonFinitePolicy = "reject",
        expected_fingerprint: str | None = None,
        expected_layer: int | None = None,
        expected_hidden_size: int | None = None,
    ) -> None:
        """Raises InvalidRequest for a non-positive size limit, an unknown policy, or an
        expectation of the wrong type (a fingerprint that is not a str, a negative layer, a
        hidden size below 1)."""
        if type(max_payload_bytes) is not int or max_payload_bytes < 1:
            raise InvalidRequest(f"max_payload_bytes must be >= 1, got {max_payload_bytes!r}")
        if nonfinite not in ("reject", "allow"):
            raise InvalidRequest(f"nonfinite must be 'reject' or 'allow', got {nonfinite!r}")
        if expected_fingerprint is not None and type(expected_fingerprint) is not str:
            raise InvalidRequest(
                f"expected_fingerprint must be a str or None, got {expected_fingerprint!r}"
            )
        for name, value, low in (
            ("expected_layer", expected_layer, 0),
            ("expected_hidden_size", expected_hidden_size, 1),
        ):
            if value is not None and (type(value) is not int or value < low):
                raise InvalidRequest(f"{name} must be an integer >= {low} or None, got {value!r}")
        self.max_payload_bytes = max_payload_bytes
        self.max_message_bytes = max_payload_bytes + MESSAGE_OVERHEAD_BYTES
        self.nonfinite: NonFinitePolicy = nonfinite
        self.expected_fingerprint = expected_fingerprint
        self.expected_layer = expected_layer
        self.expected_hidden_size = expected_hidden_size
        self._expectation = BundleExpectation(
            fingerprint=expected_fingerprint,
            layer=expected_layer,
            hidden_size=expected_hidden_size,
            max_payload_bytes=max_payload_bytes,
            check_finite=nonfinite == "reject",
        )

    def __repr__(self) -> str:
        return (
            f"Codec(max_payload_bytes={self.max_payload_bytes}, nonfinite={self.nonfinite!r}, "
            f"expected_fingerprint={self.expected_fingerprint!r}, "
            f"expected_layer={self.expected_layer!r}, "
            f"expected_hidden_size={self.expected_hidden_size!r})"
        )

    # ----------------------------------------------------------------- encoding

    @staticmethod
    def encode(message: WireMessage) -> bytes:
        """Encode any wire message. Raises InvalidRequest for anything but a wire message
        (whose bytes no decoder would accept) and when a value cannot be encoded (an integer
        beyond 64 bits, a value of a type the wire does not carry)."""
        _require_wire_type(message)
        try:
            return _encode_aligned(message)
        except (msgspec.MsgspecError, TypeError, ValueError, OverflowError) as error:
            raise InvalidRequest(f"cannot encode {type(message).__name__}: {error}") from error

    @staticmethod
    def encode_into(message: WireMessage, out: memoryview) -> int | None:
        """Encode a wire message into the start of the writable byte buffer ``out`` (shared
        memory, say), with the same bytes :meth:`encode` returns; the large payload is copied
        once, straight into ``out``. Returns the bytes written, or None when the encoding is
        larger than ``out`` (nothing written: use :meth:`encode`). Raises InvalidRequest like
        :meth:`encode`, and for an ``out`` that is not a writable 1-dimensional byte buffer."""
        if out.readonly or out.format not in ("B", "b", "c") or out.ndim != 1:
            raise InvalidRequest("encode_into needs a writable 1-dimensional byte buffer")
        _require_wire_type(message)
        try:
            parts = _aligned_parts(message)
            views = [memoryview(part).cast("B") for part in (parts or [Codec.encode(message)])]
        except (msgspec.MsgspecError, TypeError, ValueError, OverflowError) as error:
            raise InvalidRequest(f"cannot encode {type(message).__name__}: {error}") from error
        if sum(view.nbytes for view in views) > out.nbytes:
            return None
        at = 0
        for view in views:
            out[at : at + view.nbytes] = view
            at += view.nbytes
        return at

    @staticmethod
    def encode_bundle(bundle: BoundaryBundle) -> bytes:
        """Encode a bundle as is (its checksum was computed by its producer). Raises
        InvalidRequest only for a bundle built with values the wire cannot carry (which the
        edge checks refuse before any engine sees it)."""
        return Codec.encode(bundle)

    @staticmethod
    def encode_error(error: ShardEngineError) -> bytes:
        """Encode an error as its :class:`ErrorInfo` wire form. Never raises for a
        ShardEngineError: a detail the wire cannot carry (an integer beyond 64 bits, a value
        that is not a scalar) travels as its string form, and an over-long message is cut.
        Raises InvalidRequest for anything else (no error code could be given to it)."""
        if not isinstance(error, ShardEngineError):
            raise InvalidRequest(
                f"encode_error takes a ShardEngineError, got {type(error).__name__}"
            )
        info = error.to_info()
        if all(map(_wire_detail, info.details.values())):
            try:
                return _ENCODER.encode(info)
            except (msgspec.MsgspecError, TypeError, ValueError, OverflowError):
                pass
        return _ENCODER.encode(_sanitized(info))

    # ----------------------------------------------------------------- decoding

    def decode_bundle(self, buf: Buffer) -> BoundaryBundle:
        """Decode and verify one bundle; its payload is a view into ``buf``.

        Raises ContractVersionMismatch, InvalidRequest (undecodable bytes, too deeply nested,
        wrong tag, bad header values, unsupported dtype, empty fingerprint, payload length
        disagreeing with the header, non-finite values under the "reject" policy),
        UnsupportedFeature (reserved MTP/aux state), ResourceExhausted (message or payload
        above the limits), ShardMismatch (fingerprint, layer or hidden size other than
        expected), ChecksumMismatch.
        """
        # _decode and verify_bundle inlined: a decode step's bundle is small, so the calls
        # are a visible part of its cost.
        size = len(buf) if type(buf) is bytes else _buffer_size(buf)
        if size > self.max_message_bytes:
            raise _message_too_large(size, self.max_message_bytes)
        try:
            bundle = _BUNDLE_DECODER.decode(buf)
        except (msgspec.MsgspecError, RecursionError) as error:
            raise _decode_failure(buf, error) from None
        violation = check_bundle(bundle, self._expectation)
        if violation is not None:
            raise violation_error(violation)
        return bundle

    def decode_message(self, buf: Buffer) -> WireMessage:
        """Decode any wire message (an error comes back as :class:`ErrorInfo`, not raised) and
        verify every payload in it as :meth:`decode_bundle` does.

        Raises InvalidRequest (undecodable bytes, unknown tag, bad values, too deeply nested,
        options beyond their bounds), ContractVersionMismatch, UnsupportedFeature,
        ResourceExhausted, ShardMismatch, ChecksumMismatch.
        """
        message: WireMessage = _decode(_MESSAGE_DECODER, buf, self.max_message_bytes)
        if type(message) is _WireLoadConfig:
            return _load_config(message)
        self._verify_message(message)
        return message

    def decode_request(self, buf: Buffer) -> WireRequest:
        """Decode a message an engine receives (load, prefill, decode, batch, cancel, release).

        Raises what :meth:`decode_message` raises; a reply or error tag is InvalidRequest.
        """
        request: WireRequest = _decode(_REQUEST_DECODER, buf, self.max_message_bytes)
        if type(request) is _WireLoadConfig:
            return _load_config(request)
        self._verify_message(request)
        return request

    def decode_reply(self, buf: Buffer) -> WireReply:
        """Decode an engine's answer. An :class:`ErrorInfo` is turned back into its typed error
        (via :func:`error_from_info`) and raised, so a remote engine fails like a local one.

        Raises the engine's error, or what :meth:`decode_message` raises; a request tag is
        InvalidRequest.
        """
        reply = _decode(_REPLY_DECODER, buf, self.max_message_bytes)
        if isinstance(reply, ErrorInfo):
            raise error_from_info(reply)
        self._verify_message(reply)
        return reply

    def decode_error(self, buf: Buffer) -> ShardEngineError:
        """Decode an :class:`ErrorInfo` and return (not raise) the typed error it stands for.

        Raises InvalidRequest when the bytes are not an ErrorInfo.
        """
        try:
            info = _decode(_ERROR_DECODER, buf, self.max_message_bytes)
        except InvalidRequest as error:
            raise InvalidRequest(f"undecodable error: {error.message}") from None
        return error_from_info(info)

    # ----------------------------------------------------------------- verification

    def verify_bundle(self, bundle: BoundaryBundle) -> None:
        """Check a bundle against the contract and this policy (see :meth:`decode_bundle` for
        what is raised). Usable on bundles that did not come through this codec."""
        violation = check_bundle(bundle, self._expectation)
        if violation is not None:
            raise violation_error(violation)

    def verify_logits(self, result: LogitsResult) -> None:
        """Check a logits result's header, payload length, checksum and (under "reject")
        finiteness. Raises InvalidRequest, ResourceExhausted, ChecksumMismatch."""
        violation = check_logits(
            result,
            max_payload_bytes=self.max_payload_bytes,
            check_finite=self.nonfinite == "reject",
        )
        if violation is not None:
            raise violation_error(violation)

    def verify_snapshot(self, snapshot: SessionSnapshot) -> None:
        """Check a session snapshot's contract version and integrity: at least one position,
        state within ``max_payload_bytes`` (ResourceExhausted, before hashing), chunks adding
        up to ``state_bytes`` and matching the checksum (ChecksumMismatch). Whether it fits
        the receiving engine (ShardMismatch) is that engine's check."""
        _check_version(snapshot.contract_version, "snapshot")
        verify_snapshot_integrity(snapshot, max_state_bytes=self.max_payload_bytes)

    def _verify_message(self, message: WireMessage) -> None:
        match message:
            case BoundaryBundle():
                self.verify_bundle(message)
            case (
                PrefillRequest(inputs=BoundaryBundle() as bundle)
                | DecodeRequest(inputs=BoundaryBundle() as bundle)
            ):
                self.verify_bundle(bundle)
            case DecodeBatchRequest(items=items):
                for item in items:
                    self._verify_message(item)
            case BoundaryResult(bundle=bundle):
                self.verify_bundle(bundle)
            case LogitsResult():
                self.verify_logits(message)
            case DecodeBatchResult(items=results):
                for result in results:
                    if not isinstance(result, ErrorInfo):
                        self._verify_message(result)
            case Capabilities(contract_version=version):
                _check_version(version, "capabilities")
            case SessionSnapshot():
                self.verify_snapshot(message)
            case ImportSessionRequest(snapshot=snapshot):
                self.verify_snapshot(snapshot)
            case _:
                pass


def _wire_detail(value: object) -> bool:
    """Whether an error detail travels as is (the decoder's ErrorDetail types and ranges)."""
    kind = type(value)
    if kind is int:
        return -(2**63) <= value < 2**63  # type: ignore[operator]
    return value is None or kind is bool or kind is float or kind is str


def _sanitized(info: ErrorInfo) -> ErrorInfo:
    """``info`` with every detail the wire carries as is, the others as strings."""
    details: dict[str, ErrorDetail] = {}
    for key, value in list(info.details.items())[:MAX_ERROR_DETAILS]:
        carried: ErrorDetail = value if _wire_detail(value) else _safe_str(value)
        if type(carried) is str:
            carried = clamp_text(carried, MAX_ERROR_DETAIL_CHARS)
        details[clamp_text(_safe_str(key), MAX_ERROR_CODE_CHARS)] = carried
    return ErrorInfo(
        code=_safe_str(info.code)[:MAX_ERROR_CODE_CHARS],
        message=clamp_text(_safe_str(info.message), MAX_ERROR_MESSAGE_CHARS),
        retryable=info.retryable is True,
        details=details,
    )


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 (a hostile __str__ must not stop the error)
        return f"<unprintable {type(value).__name__}>"


_DEFAULT_CODEC: Final = Codec()


def _codec_for(
    max_payload_bytes: int,
    nonfinite: NonFinitePolicy,
    expected_fingerprint: str | None,
    expected_layer: int | None,
) -> Codec:
    if (
        max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES
        and nonfinite == "reject"
        and expected_fingerprint is None
        and expected_layer is None
    ):
        return _DEFAULT_CODEC
    return _cached_codec(max_payload_bytes, nonfinite, expected_fingerprint, expected_layer)


@functools.lru_cache(maxsize=64, typed=True)
def _cached_codec(
    max_payload_bytes: int,
    nonfinite: NonFinitePolicy,
    expected_fingerprint: str | None,
    expected_layer: int | None,
) -> Codec:
    """A Codec per policy the module functions are called with (Codecs are immutable, so one
    can serve every call; ``typed`` keeps ``True`` from standing for ``1``). A policy the
    constructor refuses raises every time: exceptions are not cached."""
    return Codec(
        max_payload_bytes=max_payload_bytes,
        nonfinite=nonfinite,
        expected_fingerprint=expected_fingerprint,
        expected_layer=expected_layer,
    )


def encode(message: WireMessage) -> bytes:
    """Encode any wire message to msgpack bytes. Raises InvalidRequest for unencodable values."""
    return Codec.encode(message)


def encode_into(message: WireMessage, out: memoryview) -> int | None:
    """Encode a wire message into the start of ``out``; the bytes written, or None when it does
    not fit (see Codec.encode_into)."""
    return Codec.encode_into(message, out)


def encode_bundle(bundle: BoundaryBundle) -> bytes:
    """Encode a bundle (its producer already computed the checksum). Raises InvalidRequest
    only for values the wire cannot carry."""
    return Codec.encode(bundle)


def encode_error(error: ShardEngineError) -> bytes:
    """Encode an error as its ErrorInfo wire form. Never raises (see Codec.encode_error)."""
    return Codec.encode_error(error)


def decode_bundle(
    buf: Buffer,
    *,
    expected_fingerprint: str | None = None,
    expected_layer: int | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    nonfinite: NonFinitePolicy = "reject",
) -> BoundaryBundle:
    """Decode and verify a bundle zero-copy; see :meth:`Codec.decode_bundle` for what it raises."""
    if (
        expected_fingerprint is None
        and expected_layer is None
        and nonfinite == "reject"
        and max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES
    ):
        return _DEFAULT_CODEC.decode_bundle(buf)
    codec = _codec_for(max_payload_bytes, nonfinite, expected_fingerprint, expected_layer)
    return codec.decode_bundle(buf)


def decode_message(
    buf: Buffer,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    nonfinite: NonFinitePolicy = "reject",
) -> WireMessage:
    """Decode and verify any wire message; see :meth:`Codec.decode_message` for what it raises."""
    return _codec_for(max_payload_bytes, nonfinite, None, None).decode_message(buf)


def decode_request(
    buf: Buffer,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    nonfinite: NonFinitePolicy = "reject",
) -> WireRequest:
    """Decode and verify a request; see :meth:`Codec.decode_request` for what it raises."""
    return _codec_for(max_payload_bytes, nonfinite, None, None).decode_request(buf)


def decode_reply(
    buf: Buffer,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    nonfinite: NonFinitePolicy = "reject",
) -> WireReply:
    """Decode and verify an engine's reply, raising a carried error as its typed exception;
    see :meth:`Codec.decode_reply`."""
    return _codec_for(max_payload_bytes, nonfinite, None, None).decode_reply(buf)


def decode_error(buf: Buffer) -> ShardEngineError:
    """Decode an ErrorInfo into its typed error (returned, not raised). Raises InvalidRequest
    when the bytes are not an ErrorInfo."""
    return _DEFAULT_CODEC.decode_error(buf)
