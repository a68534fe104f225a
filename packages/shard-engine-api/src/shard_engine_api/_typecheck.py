"""Edge checks: every struct that enters an engine is checked against its declared types.

msgspec checks types, ranges and literals while *decoding*, but a Struct built in Python holds
whatever it was given: ``start_pos="0"``, ``token_ids=("a",)``, ``epoch=2**64``,
``logits="bogus"`` or ``session=None`` all construct. Such a value must never reach an engine's
state, where it would fail as a backend crash, be silently coerced (token id 1.7 becoming 1) or
be taken for another value (``eviction="bogus"`` acting as reject); and it must never reach the
encoder, which would fail with an untyped error.

:func:`check_request` is the one check an engine's public entry point makes, before any state is
touched: the request's exact type, then every field, recursively, against the annotations of
shard_engine_api._types, including their ``msgspec.Meta`` bounds (the same bounds the decoders
enforce). A violation raises :class:`~shard_engine_api.InvalidRequest` whose message and
``details["field"]`` name the field path, e.g. ``DecodeBatchRequest.items[3].session.epoch``.

Rules, identical to what the msgpack decoders accept:

- an ``int`` field takes exactly ``int`` (not ``bool``, not ``1.5`` or ``5.0``, not a numpy
  integer) within its bounds; every wire integer is within signed 64 bits;
- a ``float`` field takes ``float`` or a 64-bit ``int`` (not ``bool``) within its bounds
  (durations: finite and >= 0, so NaN and infinities are refused);
- a ``str`` field takes exactly ``str`` (not a subclass) within its length bounds and
  encodable as UTF-8 (no lone surrogates: the wire could not carry it); a literal takes one
  of its strings;
- a ``tuple[...]`` field takes a ``tuple`` (not a list) within its length bounds;
- a ``memoryview`` or ``bytes`` field takes a contiguous ``bytes``, ``bytearray`` or
  ``memoryview`` (not a released one; within its byte bound, for a bounded ``bytes`` field:
  snapshot chunks);
- a Struct field takes exactly that Struct class; a tagged union takes one of its classes;
- ``None`` only where the annotation says ``| None``;
- an engine option (``LoadConfig.options`` values) is JSON-like: None, bool, int (64-bit),
  float, str, list/tuple and str-keyed dict, nested at most :data:`MAX_OPTION_DEPTH` deep with at
  most :data:`MAX_OPTION_ITEMS` values in all; in process it may also be a msgspec Struct (an
  engine's own typed option, which travels as a map and is the engine's to check).

Cost: a checker is compiled once per Struct class from ``msgspec.inspect.type_info`` into
closures (under a lock, published only when complete: a worker's threads may all make their
first request at once); checking a single-token decode request is about a microsecond, with
no allocation on success (the field path is only assembled when a check fails).
"""

from __future__ import annotations

import operator
import reprlib
import sys
import threading
from collections.abc import Callable
from typing import Final

import msgspec

from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._errors import InvalidRequest
from shard_engine_api._types import (
    INT32_MAX,
    MAX_BATCH_ITEMS,
    MAX_ID_CHARS,
    BoundaryBundle,
    BoundaryResult,
    DecodeBatchRequest,
    DecodeRequest,
    LogitsResult,
    SessionRef,
    Timings,
    TokenInput,
)

__all__ = [
    "MAX_OPTION_DEPTH",
    "MAX_OPTION_ITEMS",
    "check_fields",
    "check_option_value",
    "check_request",
    "result_ok",
]

MAX_OPTION_DEPTH: Final = 32
"""How deeply an engine option value may nest lists and dicts."""
MAX_OPTION_ITEMS: Final = 4096
"""How many values (scalars and containers) all engine options of one LoadConfig hold."""

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_UINT64_MAX: Final = 2**64 - 1
_FLOAT_MAX: Final = sys.float_info.max
_BUFFER_TYPES: Final = (bytes, bytearray, memoryview)
_DTYPES: Final = BOUNDARY_DTYPES
_EVIDENCE: Final = frozenset({"fixture", "real"})

_Check = Callable[[object], None]


class _Bad(Exception):
    """A failed check, raised inside a checker; the path is collected while it unwinds."""

    def __init__(self, expected: str, value: object, reason: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.value = value
        self.reason = reason
        self.path: list[str] = []


_REPR: Final = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = 4
_REPR.maxstring = _REPR.maxother = 30


def _describe(value: object) -> str:
    # reprlib: a bad value may be a million-element tuple or a self-referencing list.
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 (a hostile __repr__ must not replace the InvalidRequest
        text = "<unprintable>"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _invalid(root: str, bad: _Bad) -> InvalidRequest:
    path = root + "".join(reversed(bad.path))
    reason = bad.reason or f"expected {bad.expected}, got {_describe(bad.value)}"
    return InvalidRequest(f"{path}: {reason}", details={"field": path})


def _bounds_text(low: int | None, high: int | None) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" >= {low}"
    if low is None:
        return f" <= {high}"
    return f" in [{low}, {high}]"


# ----------------------------------------------------------------------------- scalars


def _int_bounds(info: msgspec.inspect.IntType, limit: int = _INT64_MAX) -> tuple[int, int]:
    low = _INT64_MIN
    high = limit
    if info.ge is not None:
        low = max(low, info.ge)
    if info.gt is not None:
        low = max(low, info.gt + 1)
    if info.le is not None:
        high = min(high, info.le)
    if info.lt is not None:
        high = min(high, info.lt - 1)
    return low, high


def _int_checker(info: msgspec.inspect.IntType, limit: int = _INT64_MAX) -> _Check:
    low, high = _int_bounds(info, limit)
    expected = "int" + _bounds_text(low, high)

    def check(value: object) -> None:
        if type(value) is not int or not low <= value <= high:
            raise _Bad(expected, value)

    return check


def _float_checker(info: msgspec.inspect.FloatType) -> _Check:
    # An int stands for a float (msgpack carries it as an int: within 64 bits). Bounds are
    # inclusive comparisons that NaN fails, as in msgspec's decoders.
    low = info.ge if info.ge is not None else info.gt
    high = info.le if info.le is not None else info.lt
    if low is None and high is None:

        def check(value: object) -> None:
            kind = type(value)
            if kind is float:
                return
            if kind is not int or not _INT64_MIN <= value <= _UINT64_MAX:  # type: ignore[operator]
                raise _Bad("float", value)

        return check
    strict_low, strict_high = info.gt is not None, info.lt is not None
    expected = "float" + _float_bounds_text(low, high, strict_low, strict_high)

    def check_bounded(value: object) -> None:
        kind = type(value)
        if kind is int:
            if not _INT64_MIN <= value <= _UINT64_MAX:  # type: ignore[operator]
                raise _Bad(expected, value)
        elif kind is not float:
            raise _Bad(expected, value)
        number: float = value  # type: ignore[assignment]
        if low is not None and not (number > low if strict_low else number >= low):
            raise _Bad(expected, value)
        if high is not None and not (number < high if strict_high else number <= high):
            raise _Bad(expected, value)

    return check_bounded


def _float_bounds_text(
    low: float | None, high: float | None, strict_low: bool, strict_high: bool
) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if strict_low else '>='} {low}")
    if high is not None:
        parts.append("finite" if high == _FLOAT_MAX else f"{'<' if strict_high else '<='} {high}")
    return " " + ", ".join(parts)


def _str_checker(info: msgspec.inspect.StrType) -> _Check:
    low = info.min_length or 0
    high = info.max_length
    if high is None:
        expected = "str" if low == 0 else "non-empty str"
    else:
        expected = f"str of {low} to {high} characters"

    def check(value: object) -> None:
        # Exactly str, as for int: a subclass may redefine __eq__ and __hash__, and ids are
        # dictionary keys of the session ledger (two different ids must never be one session).
        if type(value) is not str:
            raise _Bad(expected, value)
        size = len(value)
        if size < low or (high is not None and size > high):
            raise _Bad(expected, value)
        if not value.isascii() and not _utf8(value):
            raise _Bad(expected, value, "a lone surrogate: not encodable as UTF-8")

    return check


def _utf8(value: str) -> bool:
    """Whether ``value`` can travel: the wire carries strings as UTF-8, which has no lone
    surrogates (``"\\ud800"``). An id that cannot be encoded would be served in process and
    then fail at the first hop, after its state changed."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bool_check(value: object) -> None:
    if type(value) is not bool:
        raise _Bad("bool", value)


def _none_check(value: object) -> None:
    if value is not None:
        raise _Bad("None", value)


def _literal_checker(info: msgspec.inspect.LiteralType) -> _Check:
    allowed = frozenset((type(item), item) for item in info.values)
    expected = "one of " + ", ".join(repr(item) for item in info.values)

    def check(value: object) -> None:
        try:
            if (type(value), value) in allowed:
                return
        except TypeError:  # unhashable
            pass
        raise _Bad(expected, value)

    return check


def _buffer_check(value: object) -> None:
    if type(value) is memoryview:
        try:
            contiguous = value.c_contiguous
        except ValueError:  # released: every use of the view would raise ValueError
            raise _Bad("a contiguous buffer", value, reason="got a released memoryview") from None
        if not contiguous:
            raise _Bad("a contiguous buffer", value)
        return
    if not isinstance(value, _BUFFER_TYPES):
        raise _Bad("bytes, bytearray or memoryview", value)


def _bounded_buffer_checker(high: int) -> _Check:
    expected = f"a buffer of at most {high} bytes"

    def check(value: object) -> None:
        _buffer_check(value)
        assert isinstance(value, _BUFFER_TYPES)
        if memoryview(value).nbytes > high:
            raise _Bad(
                expected, value, reason=f"expected {expected}, got {memoryview(value).nbytes}"
            )

    return check


def _any_check(value: object) -> None:
    return None


# ----------------------------------------------------------------------------- containers


def _sequence_checker(
    kind: type[tuple[object, ...]] | type[list[object]],
    item_info: msgspec.inspect.Type,
    min_length: int | None,
    max_length: int | None,
) -> _Check:
    low = min_length or 0
    expected = kind.__name__ + ("" if max_length is None else f" of {low} to {max_length} items")
    item_check = _checker(item_info)
    if isinstance(item_info, msgspec.inspect.IntType) and item_info.multiple_of is None:
        # Token ids: one C-level pass for the types, then min and max for the range.
        item_low, item_high = _int_bounds(item_info)

        def check_ints(value: object) -> None:
            if type(value) is not kind:
                raise _Bad(expected, value)
            assert isinstance(value, tuple | list)
            size = len(value)
            if size < low or (max_length is not None and size > max_length):
                raise _Bad(expected, value)
            if not size:
                return
            if set(map(type, value)) == {int} and (
                item_low <= min(value) and max(value) <= item_high
            ):
                return
            for index, item in enumerate(value):
                try:
                    item_check(item)
                except _Bad as bad:
                    bad.path.append(f"[{index}]")
                    raise

        return check_ints

    def check(value: object) -> None:
        if type(value) is not kind:
            raise _Bad(expected, value)
        assert isinstance(value, tuple | list)
        size = len(value)
        if size < low or (max_length is not None and size > max_length):
            raise _Bad(expected, value)
        for index, item in enumerate(value):
            try:
                item_check(item)
            except _Bad as bad:
                bad.path.append(f"[{index}]")
                raise

    return check


def _fixed_tuple_checker(info: msgspec.inspect.TupleType) -> _Check:
    checks = [_checker(item) for item in info.item_types]
    expected = f"tuple of {len(checks)} items"

    def check(value: object) -> None:
        if type(value) is not tuple or len(value) != len(checks):
            raise _Bad(expected, value)
        for index, (item_check, item) in enumerate(zip(checks, value, strict=True)):
            try:
                item_check(item)
            except _Bad as bad:
                bad.path.append(f"[{index}]")
                raise

    return check


def _dict_checker(info: msgspec.inspect.DictType) -> _Check:
    key_check = _checker(info.key_type)
    value_check = _checker(info.value_type)
    is_options = _is_any(info.value_type)
    low = info.min_length or 0
    high = info.max_length
    expected = "dict" + ("" if high is None else f" of at most {high} entries")

    def check(value: object) -> None:
        if type(value) is not dict:
            raise _Bad(expected, value)
        size = len(value)
        if size < low or (high is not None and size > high):
            raise _Bad(expected, value)
        for key, item in value.items():
            try:
                key_check(key)
            except _Bad as bad:
                bad.path.append(f"[{key!r}] (key)")
                raise
            try:
                value_check(item)
            except _Bad as bad:
                bad.path.append(f"[{key!r}]")
                raise
        if is_options:
            try:
                check_option_value(value)
            except InvalidRequest as error:
                raise _Bad("JSON-like options", value, reason=error.message) from None

    return check


def _union_checker(info: msgspec.inspect.UnionType) -> _Check:
    members = info.types
    structs = [m for m in members if isinstance(m, msgspec.inspect.StructType)]
    others = [m for m in members if not isinstance(m, msgspec.inspect.StructType)]
    by_class: dict[type, _Check] = {m.cls: _struct_checker(m.cls) for m in structs}
    other_checks = [_checker(m) for m in others]
    names = [m.cls.__name__ for m in structs] + [_type_name(m) for m in others]
    expected = " | ".join(names)
    allows_none = any(isinstance(m, msgspec.inspect.NoneType) for m in others)

    def check(value: object) -> None:
        if value is None and allows_none:
            return
        struct_check = by_class.get(type(value))
        if struct_check is not None:
            struct_check(value)
            return
        for other in other_checks:
            try:
                other(value)
            except _Bad:
                continue
            return
        if len(other_checks) == 1 and not structs:
            other_checks[0](value)  # re-raise the one member's own, more precise, reason
        raise _Bad(expected, value)

    if allows_none and len(members) == 2:
        # "X | None", the common optional field: no loop over the members.
        inner = _checker(next(m for m in members if not isinstance(m, msgspec.inspect.NoneType)))

        def check_optional(value: object) -> None:
            if value is not None:
                inner(value)

        return check_optional
    return check


def _is_any(info: msgspec.inspect.Type) -> bool:
    # ``object`` (OptionValue) is reported as a custom type; msgspec decodes it as Any.
    return isinstance(info, msgspec.inspect.AnyType) or (
        isinstance(info, msgspec.inspect.CustomType) and info.cls is object
    )


def _type_name(info: msgspec.inspect.Type) -> str:
    return {
        msgspec.inspect.IntType: "int",
        msgspec.inspect.FloatType: "float",
        msgspec.inspect.StrType: "str",
        msgspec.inspect.BoolType: "bool",
        msgspec.inspect.NoneType: "None",
    }.get(type(info), type(info).__name__.removesuffix("Type").lower())


# ----------------------------------------------------------------------------- structs

# Compiled checkers, published only once complete: the entry points read these without a lock.
_STRUCT_CHECKERS: dict[type, _Check] = {}
_FIELD_CHECKERS: dict[type, _Check] = {}
# Checkers being compiled, under _COMPILE_LOCK only. A checker of a struct type that contains
# itself calls a placeholder until its own compilation ends, so no other thread may see it
# before then (one that did would call the empty placeholder: IndexError on first use by
# several threads at once).
_STAGED_STRUCTS: dict[type, _Check] = {}
_STAGED_FIELDS: dict[type, _Check] = {}
_COMPILE_LOCK: Final = threading.RLock()


def _compiled(cls: type, *, fields_only: bool) -> _Check:
    """The checker of ``cls`` (of its fields only, with ``fields_only``), compiled on first
    use under a lock and published complete."""
    with _COMPILE_LOCK:
        published = _FIELD_CHECKERS if fields_only else _STRUCT_CHECKERS
        found = published.get(cls)
        if found is not None:
            return found
        try:
            check = _fields_checker(cls) if fields_only else _struct_checker(cls)
            _FIELD_CHECKERS.update(_STAGED_FIELDS)
            _STRUCT_CHECKERS.update(_STAGED_STRUCTS)
        finally:
            _STAGED_FIELDS.clear()
            _STAGED_STRUCTS.clear()
        return check


def _fields_checker(cls: type) -> _Check:
    """A checker of the fields of an instance of ``cls`` (its type is not checked). Only while
    compiling (see :func:`_compiled`)."""
    found = _FIELD_CHECKERS.get(cls) or _STAGED_FIELDS.get(cls)
    if found is not None:
        return found
    # Placeholder first: a struct type may (indirectly) contain itself.
    pending: list[_Check] = []

    def forward(value: object) -> None:
        pending[0](value)

    _STAGED_FIELDS[cls] = forward
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    names = tuple(field.name for field in info.fields)
    checks = tuple(_checker(field.type) for field in info.fields)
    getter = operator.attrgetter(*names) if len(names) > 1 else None
    labels = tuple(f".{name}" for name in names)

    def check(value: object) -> None:
        values = getter(value) if getter is not None else (getattr(value, names[0]),)
        index = 0
        try:
            for index, item in enumerate(values):
                checks[index](item)
        except _Bad as bad:
            bad.path.append(labels[index])
            raise

    pending.append(check)
    _STAGED_FIELDS[cls] = check
    return check


def _struct_checker(cls: type) -> _Check:
    found = _STRUCT_CHECKERS.get(cls) or _STAGED_STRUCTS.get(cls)
    if found is not None:
        return found
    fields = _fields_checker(cls)
    expected = cls.__name__

    def check(value: object) -> None:
        if type(value) is not cls:
            raise _Bad(expected, value)
        fields(value)

    _STAGED_STRUCTS[cls] = check
    return check


def _checker(info: msgspec.inspect.Type) -> _Check:
    match info:
        case msgspec.inspect.StructType(cls=cls):
            return _struct_checker(cls)
        case msgspec.inspect.IntType():
            return _int_checker(info)
        case msgspec.inspect.Metadata(type=msgspec.inspect.IntType() as inner, extra=extra) if (
            extra is not None and extra.get("uint64") is True
        ):
            # An unsigned 64-bit field (checksums): msgspec bounds only int64, so the marker
            # in the type's metadata carries the upper bound the wire allows (2**64 - 1).
            return _int_checker(inner, _UINT64_MAX)
        case msgspec.inspect.Metadata(type=inner):
            return _checker(inner)
        case msgspec.inspect.FloatType():
            return _float_checker(info)
        case msgspec.inspect.StrType():
            return _str_checker(info)
        case msgspec.inspect.BoolType():
            return _bool_check
        case msgspec.inspect.NoneType():
            return _none_check
        case msgspec.inspect.LiteralType():
            return _literal_checker(info)
        case msgspec.inspect.UnionType():
            return _union_checker(info)
        case msgspec.inspect.VarTupleType(item_type=item, min_length=low, max_length=high):
            return _sequence_checker(tuple, item, low, high)
        case msgspec.inspect.ListType(item_type=item, min_length=low, max_length=high):
            return _sequence_checker(list, item, low, high)
        case msgspec.inspect.TupleType():
            return _fixed_tuple_checker(info)
        case msgspec.inspect.DictType():
            return _dict_checker(info)
        case msgspec.inspect.BytesType(max_length=int() as high):
            return _bounded_buffer_checker(high)
        case (
            msgspec.inspect.BytesType()
            | msgspec.inspect.ByteArrayType()
            | msgspec.inspect.MemoryViewType()
        ):
            return _buffer_check
        case msgspec.inspect.AnyType():
            return _any_check
        case _:
            # No field of the contract has another type; a future one is checked by msgspec
            # at the wire and accepted here rather than refused by mistake.
            return _any_check


# ----------------------------------------------------------------------------- the hot path
#
# A decode step is checked on every token, so its common shapes (one token id, or one bundle
# without reserved state) have a hand-written test that accepts only values the general
# checker would accept; anything it does not recognise goes through the general checker,
# which either accepts it too or names the bad field.


def _session_ok(session: object) -> bool:
    if type(session) is not SessionRef:
        return False
    session_id = session.session_id
    epoch = session.epoch
    return (
        type(session_id) is str
        and 0 < len(session_id) <= MAX_ID_CHARS
        and session_id.isascii()
        and type(epoch) is int
        and 0 <= epoch <= _INT64_MAX
    )


def _bundle_ok(bundle: BoundaryBundle) -> bool:
    first_pos, n_tokens, hidden_size = bundle.first_pos, bundle.n_tokens, bundle.hidden_size
    layer, checksum, version = bundle.layer, bundle.checksum, bundle.contract_version
    fingerprint, payload = bundle.model_fingerprint, bundle.payload
    dtype: object = bundle.dtype
    return (
        _session_ok(bundle.session)
        and type(first_pos) is int
        and 0 <= first_pos <= _INT64_MAX
        and type(n_tokens) is int
        and 0 <= n_tokens <= _INT64_MAX
        and type(hidden_size) is int
        and 0 <= hidden_size <= _INT64_MAX
        and type(layer) is int
        and 0 <= layer <= _INT64_MAX
        and type(checksum) is int
        and 0 <= checksum <= _UINT64_MAX
        and type(version) is int
        and _INT64_MIN <= version <= _INT64_MAX
        and type(dtype) is str
        and dtype in _DTYPES
        and type(fingerprint) is str
        and len(fingerprint) <= MAX_ID_CHARS
        and fingerprint.isascii()
        and type(payload) is memoryview
        and payload.c_contiguous
        and bundle.mtp == ()
        and bundle.aux == ()
    )


def _decode_ok(request: object) -> bool:
    if type(request) is not DecodeRequest:
        return False
    request_id, pos, inputs = request.request_id, request.pos, request.inputs
    if not (
        type(request_id) is str
        and 0 < len(request_id) <= MAX_ID_CHARS
        and request_id.isascii()
        and type(pos) is int
        and 0 <= pos <= _INT64_MAX
        and _session_ok(request.session)
        and request.mtp == ()
        and request.aux == ()
    ):
        return False
    if type(inputs) is TokenInput:
        token_ids = inputs.token_ids
        if type(token_ids) is not tuple or len(token_ids) != 1:
            return False
        token = token_ids[0]
        return type(token) is int and 0 <= token <= INT32_MAX
    return type(inputs) is BoundaryBundle and _bundle_ok(inputs)


def _batch_ok(request: object) -> bool:
    if type(request) is not DecodeBatchRequest:
        return False
    request_id, items = request.request_id, request.items
    return (
        type(request_id) is str
        and 0 < len(request_id) <= MAX_ID_CHARS
        and request_id.isascii()
        and type(items) is tuple
        and len(items) <= MAX_BATCH_ITEMS
        and all(map(_decode_ok, items))
    )


def _result_head_ok(result: BoundaryResult | LogitsResult) -> bool:
    # Inlined (no helper calls): this runs on every result a ValidatingEngine checks.
    request_id, first_pos, session, timings = (
        result.request_id,
        result.first_pos,
        result.session,
        result.timings,
    )
    evidence: object = result.evidence
    if type(session) is not SessionRef or type(timings) is not Timings:
        return False
    session_id, epoch = session.session_id, session.epoch
    return (
        type(request_id) is str
        and 0 < len(request_id) <= MAX_ID_CHARS
        and request_id.isascii()
        and type(session_id) is str
        and 0 < len(session_id) <= MAX_ID_CHARS
        and session_id.isascii()
        and type(epoch) is int
        and 0 <= epoch <= _INT64_MAX
        and type(first_pos) is int
        and 0 <= first_pos <= _INT64_MAX
        and type(evidence) is str
        and evidence in _EVIDENCE
        and type(timings.queue_ms) is float
        and type(timings.compute_ms) is float
        and type(timings.total_ms) is float
        # Comparisons false for NaN: durations are finite and >= 0.
        and 0.0 <= timings.queue_ms <= _FLOAT_MAX
        and 0.0 <= timings.compute_ms <= _FLOAT_MAX
        and 0.0 <= timings.total_ms <= _FLOAT_MAX
    )


def result_ok(result: object) -> bool:
    """Whether ``result`` is certainly a well-typed BoundaryResult or LogitsResult (the
    common shapes, tested fast). False means "not certain": run :func:`check_request`."""
    try:
        return _result_fields_ok(result)
    except ValueError:  # a released memoryview payload: check_request names it
        return False


def _result_fields_ok(result: object) -> bool:
    kind = type(result)
    if kind is LogitsResult:
        assert isinstance(result, LogitsResult)
        n_rows, vocab_size, checksum, payload = (
            result.n_rows,
            result.vocab_size,
            result.checksum,
            result.payload,
        )
        return (
            type(n_rows) is int
            and 0 <= n_rows <= _INT64_MAX
            and type(vocab_size) is int
            and 0 <= vocab_size <= _INT64_MAX
            and type(checksum) is int
            and 0 <= checksum <= _UINT64_MAX
            and type(payload) is memoryview
            and payload.c_contiguous
            and _result_head_ok(result)
        )
    if kind is BoundaryResult:
        assert isinstance(result, BoundaryResult)
        bundle, n_tokens = result.bundle, result.n_tokens
        return (
            type(n_tokens) is int
            and 0 <= n_tokens <= _INT64_MAX
            and type(bundle) is BoundaryBundle
            and _result_head_ok(result)
            and _bundle_ok(bundle)
        )
    return False


_FAST: Final[dict[type, Callable[[object], bool]]] = {
    DecodeRequest: _decode_ok,
    DecodeBatchRequest: _batch_ok,
}


# ----------------------------------------------------------------------------- public


def check_request(request: object, expected: type) -> None:
    """Check that ``request`` is exactly an ``expected`` Struct whose every field, recursively,
    matches its declared type, bounds and literals (see the module docstring).

    Raises InvalidRequest naming the field path (also in ``details["field"]``).
    """
    fast = _FAST.get(expected)
    if fast is not None:
        try:
            if fast(request):
                return
        except ValueError:  # a released memoryview payload: the general checker names it
            pass
    check = _STRUCT_CHECKERS.get(expected) or _compiled(expected, fields_only=False)
    try:
        check(request)
    except _Bad as bad:
        raise _invalid(expected.__name__, bad) from None


def check_fields(struct: msgspec.Struct) -> None:
    """Check every field of ``struct`` (its class is taken as given); for ``__post_init__``.

    Raises InvalidRequest naming the field path.
    """
    cls = type(struct)
    check = _FIELD_CHECKERS.get(cls) or _compiled(cls, fields_only=True)
    try:
        check(struct)
    except _Bad as bad:
        raise _invalid(cls.__name__, bad) from None


def check_option_value(
    value: object,
    *,
    max_depth: int = MAX_OPTION_DEPTH,
    max_items: int = MAX_OPTION_ITEMS,
) -> None:
    """Check that an engine option value is JSON-like and bounded (see the module docstring).

    Walks iteratively, so no nesting depth can exhaust the stack. Raises InvalidRequest.
    """
    pending: list[tuple[object, int]] = [(value, 0)]
    seen = 0
    while pending:
        item, depth = pending.pop()
        seen += 1
        if seen > max_items:
            raise InvalidRequest(f"options hold more than {max_items} values")
        kind = type(item)
        if kind is str:
            assert isinstance(item, str)
            if not item.isascii() and not _utf8(item):
                raise InvalidRequest(
                    "option strings must be encodable as UTF-8 (no lone surrogates)"
                )
            continue
        if item is None or kind is bool or kind is float:
            continue
        if kind is int:
            if not _INT64_MIN <= item <= _INT64_MAX:  # type: ignore[operator]
                raise InvalidRequest(f"option integer {item} does not fit in 64 bits")
            continue
        if kind is list or kind is tuple or kind is dict:
            if depth >= max_depth:
                raise InvalidRequest(f"options nest deeper than {max_depth} levels")
            if kind is dict:
                assert isinstance(item, dict)
                for key, child in item.items():
                    if type(key) is not str:
                        raise InvalidRequest(f"option keys must be str, got {_describe(key)}")
                    if not key.isascii() and not _utf8(key):
                        raise InvalidRequest(
                            "option keys must be encodable as UTF-8 (no lone surrogates)"
                        )
                    pending.append((child, depth + 1))
            else:
                assert isinstance(item, list | tuple)
                pending.extend((child, depth + 1) for child in item)
            continue
        if isinstance(item, msgspec.Struct):
            continue
        raise InvalidRequest(
            f"option values must be JSON-like (None, bool, int, float, str, list, dict), "
            f"got {_describe(item)}"
        )
