"""The wire codec: msgpack (via msgspec) for every request, result, error and boundary bundle.

Every message is a tagged ``msgspec.Struct`` encoded as a msgpack map whose ``"type"`` key is
the type's explicit tag. One decoder is prebuilt per union (decoders are reusable and
thread-safe), and a decoded message is checked before it is returned, so a caller gets either a
complete, verified object or a typed :class:`~shard_engine_api.InvalidRequest` (or subclass),
never a partial object and never a raw msgspec exception.

Payloads (bundle hidden states and logits) decode zero-copy: the ``payload`` memoryview is a
view into the input buffer, and ``array()`` is ``np.frombuffer`` on it. The decoded object keeps
the input buffer alive. Decoding verifies, in this order, cheapest first: contract version, header
values, payload size limit (before any hashing), payload length against the header, the
receiver's expected model fingerprint and layer, checksum, and finiteness.

Checksums are computed once, by the engine that creates a bundle, so encoding never recomputes
them; decoding always verifies them.

Alignment: a large payload (64 KiB and up) of a bundle, a bundle-carrying request or result, or a
logits result is placed at a 16-byte-aligned offset of the message by inserting an ignored
``"_pad"`` entry (a short bin) right after the tag. numpy reads unaligned memory through a
buffered slow path, which made checksum and finiteness verification of a view into the message
~2x slower; with the padding they run at full speed on any buffer that itself starts aligned
(bytes objects and allocator-returned buffers do). The padding is plain msgpack: any msgspec
decoder of these types ignores the unknown field, so it is not a wire change.
"""

from __future__ import annotations

import threading
from typing import Final, Literal, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import (
    ChecksumMismatch,
    ContractVersionMismatch,
    ErrorInfo,
    InvalidRequest,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    error_from_info,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Health,
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    numpy_dtype,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "Codec",
    "NonFinitePolicy",
    "WireMessage",
    "WireReply",
    "WireRequest",
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

WireRequest: TypeAlias = (
    LoadConfig
    | PrefillRequest
    | DecodeRequest
    | DecodeBatchRequest
    | CancelRequest
    | ReleaseRequest
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
)
"""Every successful answer an engine sends back (an error travels as :class:`ErrorInfo`)."""

WireMessage: TypeAlias = (
    LoadConfig
    | PrefillRequest
    | DecodeRequest
    | DecodeBatchRequest
    | CancelRequest
    | ReleaseRequest
    | Capabilities
    | BoundaryResult
    | LogitsResult
    | DecodeBatchResult
    | CancelResult
    | ReleaseResult
    | Health
    | Metrics
    | ErrorInfo
    | BoundaryBundle
)
"""Every top-level message of the wire: requests, replies, errors and bare bundles.
(``TokenInput``, ``MtpState`` and ``AuxState`` are tagged too, but only travel nested.)"""

_ENCODER: Final = msgspec.msgpack.Encoder()
_ALIGNMENT: Final = 16
_ALIGN_FROM_BYTES: Final = 64 * 1024
_EMPTY_PAYLOAD: Final = memoryview(b"")
# The empty payload as msgspec writes it: the "payload" key, then a zero-length bin8.
_EMPTY_PAYLOAD_ENTRY: Final = _ENCODER.encode("payload") + b"\xc4\x00"
_PAYLOAD_KEY: Final = _ENCODER.encode("payload")
_PAD_KEY: Final = _ENCODER.encode("_pad")
_TAG_KEY: Final = _ENCODER.encode("type")
# msgspec's stubs type a decoder built from a union as Decoder[Any]; pin the real types.
_MESSAGE_DECODER: Final[msgspec.msgpack.Decoder[WireMessage]] = msgspec.msgpack.Decoder(WireMessage)
_REQUEST_DECODER: Final[msgspec.msgpack.Decoder[WireRequest]] = msgspec.msgpack.Decoder(WireRequest)
_REPLY_DECODER: Final[msgspec.msgpack.Decoder[WireReply | ErrorInfo]] = msgspec.msgpack.Decoder(
    WireReply | ErrorInfo
)
_BUNDLE_DECODER: Final = msgspec.msgpack.Decoder(BoundaryBundle)
_ERROR_DECODER: Final = msgspec.msgpack.Decoder(ErrorInfo)

Buffer: TypeAlias = bytes | bytearray | memoryview


class _VersionProbe(msgspec.Struct):
    """Reads only the contract versions of a message and of the bundles nested in it. Unknown
    fields are ignored, so it still reads a newer version whose shape this library does not
    know; that is what lets a version mismatch be reported as such."""

    contract_version: int | None = None
    inputs: _VersionProbe | None = None
    bundle: _VersionProbe | None = None
    items: tuple[_VersionProbe, ...] = ()


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
        pending.extend(node.items)
    return None


def _decode_failure(buf: Buffer, error: msgspec.MsgspecError) -> InvalidRequest:
    """The typed error for bytes the full decoder refused: a version mismatch when the bytes
    name another contract version, else InvalidRequest with msgspec's reason."""
    try:
        foreign = _probe_versions(_PROBE_DECODER.decode(buf))
    except msgspec.MsgspecError:
        foreign = None
    if foreign is not None:
        return ContractVersionMismatch(
            f"message speaks contract version {foreign}; this library speaks {CONTRACT_VERSION}",
            details={"contract_version": foreign, "supported": CONTRACT_VERSION},
        )
    return InvalidRequest(f"undecodable message: {error}")


def _check_version(version: int, what: str) -> None:
    if version != CONTRACT_VERSION:
        raise ContractVersionMismatch(
            f"{what} speaks contract version {version}; this library speaks {CONTRACT_VERSION}",
            details={"contract_version": version, "supported": CONTRACT_VERSION},
        )


# Finiteness of f16 is checked on the raw bits: numpy's isfinite on float16 runs an unvectorised
# loop (~30x slower than a memory copy), while an f16 value is NaN or infinite iff its five
# exponent bits are all ones, which two vectorised integer passes find. Work runs in bounded
# chunks through a per-thread scratch buffer so a large payload never allocates a temporary of
# its own size (and never pays page faults for one).
_FINITE_CHUNK_ITEMS: Final = 1 << 19
_SMALL_ARRAY_ITEMS: Final = 256
_F16_EXPONENT: Final = 0x7C00
_scratch = threading.local()


def all_finite(values: npt.NDArray[np.floating]) -> bool:
    """Whether every value of a float array is finite (no NaN, no infinity)."""
    flat = values.reshape(-1)
    if flat.size <= _SMALL_ARRAY_ITEMS or flat.dtype != np.dtype("<f2"):
        # numpy's isfinite is vectorised for f32; chunking only bounds the temporary.
        for start in range(0, flat.size, 2 * _FINITE_CHUNK_ITEMS):
            if not np.isfinite(flat[start : start + 2 * _FINITE_CHUNK_ITEMS]).all():
                return False
        return True
    bits = flat.view("<u2")
    scratch: npt.NDArray[np.uint16] | None = getattr(_scratch, "f16_bits", None)
    if scratch is None:
        scratch = np.empty(_FINITE_CHUNK_ITEMS, dtype="<u2")
        _scratch.f16_bits = scratch
    for start in range(0, bits.size, _FINITE_CHUNK_ITEMS):
        chunk = bits[start : start + _FINITE_CHUNK_ITEMS]
        masked = scratch[: chunk.size]
        np.bitwise_and(chunk, _F16_EXPONENT, out=masked)
        if int(masked.max()) == _F16_EXPONENT:
            return False
    return True


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
    found = _large_payload(message)
    if found is None:
        return _ENCODER.encode(message)
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
        return _ENCODER.encode(message)
    at = skeleton.index(_EMPTY_PAYLOAD_ENTRY)
    size = payload.nbytes
    payload_header = _PAYLOAD_KEY + b"\xc6" + size.to_bytes(4, "big")
    # Offset of the payload with an empty pad: the skeleton up to the payload key, plus the pad
    # entry's key and bin8 header, plus the payload key and bin32 header.
    unpadded = at + len(_PAD_KEY) + 2 + len(payload_header)
    pad = -unpadded % _ALIGNMENT
    return b"".join(
        (
            bytes((skeleton[0] + 1,)),
            skeleton[1:header_end],
            _PAD_KEY,
            bytes((0xC4, pad)),
            bytes(pad),
            skeleton[header_end:at],
            payload_header,
            payload,
            skeleton[at + len(_EMPTY_PAYLOAD_ENTRY) :],
        )
    )


class Codec:
    """A receiver's decoding policy: payload size limit, non-finite policy and, optionally,
    the model fingerprint and layer index every received bundle must carry.

    Encoding needs no policy; the methods are here so one object serves both directions.
    A Codec is immutable and thread-safe.
    """

    __slots__ = ("expected_fingerprint", "expected_layer", "max_payload_bytes", "nonfinite")

    def __init__(
        self,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        nonfinite: NonFinitePolicy = "reject",
        expected_fingerprint: str | None = None,
        expected_layer: int | None = None,
    ) -> None:
        """Raises InvalidRequest for a non-positive size limit or an unknown policy."""
        if max_payload_bytes < 1:
            raise InvalidRequest(f"max_payload_bytes must be >= 1, got {max_payload_bytes}")
        if nonfinite not in ("reject", "allow"):
            raise InvalidRequest(f"nonfinite must be 'reject' or 'allow', got {nonfinite!r}")
        self.max_payload_bytes = max_payload_bytes
        self.nonfinite: NonFinitePolicy = nonfinite
        self.expected_fingerprint = expected_fingerprint
        self.expected_layer = expected_layer

    def __repr__(self) -> str:
        return (
            f"Codec(max_payload_bytes={self.max_payload_bytes}, nonfinite={self.nonfinite!r}, "
            f"expected_fingerprint={self.expected_fingerprint!r}, "
            f"expected_layer={self.expected_layer!r})"
        )

    # ----------------------------------------------------------------- encoding

    @staticmethod
    def encode(message: WireMessage) -> bytes:
        """Encode any wire message. Raises InvalidRequest when a value cannot be encoded
        (e.g. an engine option that is not JSON-like)."""
        try:
            return _encode_aligned(message)
        except (msgspec.MsgspecError, TypeError, ValueError) as error:
            raise InvalidRequest(f"cannot encode {type(message).__name__}: {error}") from error

    @staticmethod
    def encode_bundle(bundle: BoundaryBundle) -> bytes:
        """Encode a bundle as is (its checksum was computed by its producer)."""
        return _encode_aligned(bundle)

    @staticmethod
    def encode_error(error: ShardEngineError) -> bytes:
        """Encode an error as its :class:`ErrorInfo` wire form."""
        return _ENCODER.encode(error.to_info())

    # ----------------------------------------------------------------- decoding

    def decode_bundle(self, buf: Buffer) -> BoundaryBundle:
        """Decode and verify one bundle; its payload is a view into ``buf``.

        Raises ContractVersionMismatch, InvalidRequest (undecodable bytes, wrong tag, bad header
        values, unsupported dtype, payload length disagreeing with the header, non-finite values
        under the "reject" policy), ResourceExhausted (payload above ``max_payload_bytes``),
        ShardMismatch (fingerprint or layer other than expected), ChecksumMismatch.
        """
        try:
            bundle = _BUNDLE_DECODER.decode(buf)
        except msgspec.MsgspecError as error:
            raise _decode_failure(buf, error) from None
        self.verify_bundle(bundle)
        return bundle

    def decode_message(self, buf: Buffer) -> WireMessage:
        """Decode any wire message (an error comes back as :class:`ErrorInfo`, not raised) and
        verify every payload in it as :meth:`decode_bundle` does.

        Raises InvalidRequest (undecodable bytes, unknown tag, bad values),
        ContractVersionMismatch, ResourceExhausted, ShardMismatch, ChecksumMismatch.
        """
        try:
            message = _MESSAGE_DECODER.decode(buf)
        except msgspec.MsgspecError as error:
            raise _decode_failure(buf, error) from None
        self._verify_message(message)
        return message

    def decode_request(self, buf: Buffer) -> WireRequest:
        """Decode a message an engine receives (load, prefill, decode, batch, cancel, release).

        Raises what :meth:`decode_message` raises; a reply or error tag is InvalidRequest.
        """
        try:
            request = _REQUEST_DECODER.decode(buf)
        except msgspec.MsgspecError as error:
            raise _decode_failure(buf, error) from None
        self._verify_message(request)
        return request

    def decode_reply(self, buf: Buffer) -> WireReply:
        """Decode an engine's answer. An :class:`ErrorInfo` is turned back into its typed error
        (via :func:`error_from_info`) and raised, so a remote engine fails like a local one.

        Raises the engine's error, or what :meth:`decode_message` raises; a request tag is
        InvalidRequest.
        """
        try:
            reply = _REPLY_DECODER.decode(buf)
        except msgspec.MsgspecError as error:
            raise _decode_failure(buf, error) from None
        if isinstance(reply, ErrorInfo):
            raise error_from_info(reply)
        self._verify_message(reply)
        return reply

    @staticmethod
    def decode_error(buf: Buffer) -> ShardEngineError:
        """Decode an :class:`ErrorInfo` and return (not raise) the typed error it stands for.

        Raises InvalidRequest when the bytes are not an ErrorInfo.
        """
        try:
            info = _ERROR_DECODER.decode(buf)
        except msgspec.MsgspecError as error:
            raise InvalidRequest(f"undecodable error: {error}") from None
        return error_from_info(info)

    # ----------------------------------------------------------------- verification

    def verify_bundle(self, bundle: BoundaryBundle) -> None:
        """Check a bundle against the contract and this policy (see :meth:`decode_bundle` for
        what is raised). Usable on bundles that did not come through this codec."""
        _check_version(bundle.contract_version, "bundle")
        if bundle.n_tokens < 1 or bundle.hidden_size < 1 or bundle.first_pos < 0:
            raise InvalidRequest(
                f"bundle header out of range: n_tokens={bundle.n_tokens} (>= 1), "
                f"hidden_size={bundle.hidden_size} (>= 1), first_pos={bundle.first_pos} (>= 0)"
            )
        if bundle.layer < 1:
            raise InvalidRequest(
                f"bundle layer must be >= 1 (the producer's end), got {bundle.layer}"
            )
        size = len(bundle.payload)
        self._check_size(size, "bundle")
        if size != bundle.expected_payload_bytes:
            raise InvalidRequest(
                f"bundle payload has {size} bytes; header promises {bundle.n_tokens} x "
                f"{bundle.hidden_size} x {bundle.dtype} = {bundle.expected_payload_bytes}"
            )
        if (
            self.expected_fingerprint is not None
            and bundle.model_fingerprint != self.expected_fingerprint
        ):
            raise ShardMismatch(
                f"bundle is for model {bundle.model_fingerprint!r}; expected "
                f"{self.expected_fingerprint!r}"
            )
        if self.expected_layer is not None and bundle.layer != self.expected_layer:
            raise ShardMismatch(
                f"bundle enters layer {bundle.layer}; expected layer {self.expected_layer}"
            )
        if payload_checksum(bundle.payload) != bundle.checksum:
            raise ChecksumMismatch("bundle payload does not match its checksum")
        if self.nonfinite == "reject":
            values = np.frombuffer(bundle.payload, dtype=numpy_dtype(bundle.dtype))
            if not all_finite(values):
                raise InvalidRequest("bundle hidden states contain NaN or Inf")

    def verify_logits(self, result: LogitsResult) -> None:
        """Check a logits result's header, payload length, checksum and (under "reject")
        finiteness. Raises InvalidRequest, ResourceExhausted, ChecksumMismatch."""
        if result.n_rows < 1 or result.vocab_size < 1 or result.first_pos < 0:
            raise InvalidRequest(
                f"logits header out of range: n_rows={result.n_rows} (>= 1), "
                f"vocab_size={result.vocab_size} (>= 1), first_pos={result.first_pos} (>= 0)"
            )
        size = len(result.payload)
        self._check_size(size, "logits")
        expected = result.n_rows * result.vocab_size * 4
        if size != expected:
            raise InvalidRequest(
                f"logits payload has {size} bytes; header promises {result.n_rows} x "
                f"{result.vocab_size} x f32 = {expected}"
            )
        if payload_checksum(result.payload) != result.checksum:
            raise ChecksumMismatch("logits payload does not match its checksum")
        if self.nonfinite == "reject" and not all_finite(
            np.frombuffer(result.payload, dtype=np.dtype("<f4"))
        ):
            raise InvalidRequest("logits contain NaN or Inf")

    def _check_size(self, size: int, what: str) -> None:
        # Checked before hashing so an oversized payload costs nothing to refuse. It is a
        # receiver limit, not a malformed message, hence ResourceExhausted; retrying the same
        # payload cannot succeed, hence not retryable.
        if size > self.max_payload_bytes:
            raise ResourceExhausted(
                f"{what} payload of {size} bytes exceeds the limit of {self.max_payload_bytes}",
                retryable=False,
                details={
                    "resource": "payload_bytes",
                    "payload_bytes": size,
                    "limit": self.max_payload_bytes,
                },
            )

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
            case _:
                pass


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
    return Codec(
        max_payload_bytes=max_payload_bytes,
        nonfinite=nonfinite,
        expected_fingerprint=expected_fingerprint,
        expected_layer=expected_layer,
    )


def encode(message: WireMessage) -> bytes:
    """Encode any wire message to msgpack bytes. Raises InvalidRequest for unencodable values."""
    return Codec.encode(message)


def encode_bundle(bundle: BoundaryBundle) -> bytes:
    """Encode a bundle (its producer already computed the checksum). Never raises."""
    return Codec.encode_bundle(bundle)


def encode_error(error: ShardEngineError) -> bytes:
    """Encode an error as its ErrorInfo wire form. Never raises."""
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
    return Codec.decode_error(buf)
