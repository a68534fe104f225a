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

Each rule is written once. A scalar's rule (int, float, str, bool, None, literal) is the source
of a test (:class:`_Rule`); a struct's checker is one function generated from
``msgspec.inspect.type_info`` that writes those tests, and the checks of its nested structs
and sequences, inline (:class:`_Source`), so the per-token path (a decode request, a result)
needs no hand-written shortcut that could drift from the rules.

Cost: a checker is compiled once per Struct class (under a lock, published only when
complete: a worker's threads may all make their first request at once); checking a
single-token decode request is about a microsecond, with no allocation on success (the field
path is only assembled when a check fails).
"""

from __future__ import annotations

import reprlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Final, cast

import msgspec

from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._errors import InvalidRequest
from shard_engine_api._types import (
    BoundaryResult,
    LogitsResult,
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
#
# A scalar rule is written once, as the source of a test that is true for a sound value. The
# checker of a scalar field compiles that test into a function of its own; the checker of a
# struct writes the same test into its own generated function (see _StructSource), so the
# hot path calls no function per field and still runs nothing but these rules.


class _Rule:
    """A scalar rule: ``test`` is the source of an expression over ``{v}`` that is true when the
    value is sound; names it uses are in ``names`` (referenced as ``{name}``); ``expected``
    says what a sound value is; ``explain``, if given, returns a more precise reason for a
    refused value (or None)."""

    __slots__ = ("expected", "explain", "names", "test")

    def __init__(
        self,
        test: str,
        expected: str,
        names: dict[str, object] | None = None,
        explain: Callable[[object], str | None] | None = None,
    ) -> None:
        self.test = test
        self.expected = expected
        self.names = names or {}
        self.explain = explain


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


def _int_rule(info: msgspec.inspect.IntType, limit: int = _INT64_MAX) -> _Rule:
    # Exactly int: not bool, not 1.5 or 5.0, not a numpy integer.
    low, high = _int_bounds(info, limit)
    return _Rule(
        f"type({{v}}) is int and {low} <= {{v}} <= {high}", "int" + _bounds_text(low, high)
    )


def _float_rule(info: msgspec.inspect.FloatType) -> _Rule:
    # An int stands for a float (msgpack carries it as an int: within 64 bits). Bounds are
    # inclusive comparisons that NaN fails, as in msgspec's decoders.
    number = (
        f"(type({{v}}) is float or (type({{v}}) is int and {_INT64_MIN} <= {{v}} <= {_UINT64_MAX}))"
    )
    low = info.ge if info.ge is not None else info.gt
    high = info.le if info.le is not None else info.lt
    if low is None and high is None:
        return _Rule(number, "float")
    strict_low, strict_high = info.gt is not None, info.lt is not None
    test = number
    if low is not None:
        test += f" and {{v}} {'>' if strict_low else '>='} {float(low)!r}"
    if high is not None:
        test += f" and {{v}} {'<' if strict_high else '<='} {float(high)!r}"
    return _Rule(test, "float" + _float_bounds_text(low, high, strict_low, strict_high))


def _float_bounds_text(
    low: float | None, high: float | None, strict_low: bool, strict_high: bool
) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if strict_low else '>='} {low}")
    if high is not None:
        parts.append("finite" if high == _FLOAT_MAX else f"{'<' if strict_high else '<='} {high}")
    return " " + ", ".join(parts)


def _str_rule(info: msgspec.inspect.StrType) -> _Rule:
    # Exactly str, as for int: a subclass may redefine __eq__ and __hash__, and ids are
    # dictionary keys of the session ledger (two different ids must never be one session).
    low = info.min_length or 0
    high = info.max_length
    if high is None:
        expected = "str" if low == 0 else "non-empty str"
        length = "" if low == 0 else f" and {low} <= len({{v}})"
    else:
        expected = f"str of {low} to {high} characters"
        length = f" and {low} <= len({{v}}) <= {high}"
    return _Rule(
        f"type({{v}}) is str{length} and ({{v}}.isascii() or {{utf8}}({{v}}))",
        expected,
        {"utf8": _utf8},
        _explain_str,
    )


def _explain_str(value: object) -> str | None:
    if type(value) is str and not _utf8(value):
        return "a lone surrogate: not encodable as UTF-8"
    return None


def _utf8(value: str) -> bool:
    """Whether ``value`` can travel: the wire carries strings as UTF-8, which has no lone
    surrogates (``"\\ud800"``). An id that cannot be encoded would be served in process and
    then fail at the first hop, after its state changed."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _literal_rule(info: msgspec.inspect.LiteralType) -> _Rule:
    # The value's type first: only then is it certainly hashable.
    kinds = frozenset(type(item) for item in info.values)
    allowed = frozenset((type(item), item) for item in info.values)
    expected = "one of " + ", ".join(repr(item) for item in info.values)
    return _Rule(
        "type({v}) in {kinds} and (type({v}), {v}) in {allowed}",
        expected,
        {"kinds": kinds, "allowed": allowed},
    )


_BOOL_RULE: Final = _Rule("type({v}) is bool", "bool")
_NONE_RULE: Final = _Rule("{v} is None", "None")


def _rule(info: msgspec.inspect.Type) -> _Rule | None:
    """The scalar rule of ``info``, or None for a type that is not a scalar."""
    match info:
        case msgspec.inspect.IntType():
            return _int_rule(info)
        case msgspec.inspect.Metadata(type=msgspec.inspect.IntType() as inner, extra=extra) if (
            extra is not None and extra.get("uint64") is True
        ):
            # An unsigned 64-bit field (checksums): msgspec bounds only int64, so the marker
            # in the type's metadata carries the upper bound the wire allows (2**64 - 1).
            return _int_rule(inner, _UINT64_MAX)
        case msgspec.inspect.Metadata(type=inner):
            return _rule(inner)
        case msgspec.inspect.FloatType():
            return _float_rule(info)
        case msgspec.inspect.StrType():
            return _str_rule(info)
        case msgspec.inspect.BoolType():
            return _BOOL_RULE
        case msgspec.inspect.NoneType():
            return _NONE_RULE
        case msgspec.inspect.LiteralType():
            return _literal_rule(info)
        case _:
            return None


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
    return _staged(cls, _STAGED_FIELDS, _FIELD_CHECKERS, check_type=False)


def _struct_checker(cls: type) -> _Check:
    """A checker of a value that must be exactly a ``cls`` with sound fields. Only while
    compiling (see :func:`_compiled`)."""
    return _staged(cls, _STAGED_STRUCTS, _STRUCT_CHECKERS, check_type=True)


def _staged(
    cls: type, staged: dict[type, _Check], published: dict[type, _Check], *, check_type: bool
) -> _Check:
    found = published.get(cls) or staged.get(cls)
    if found is not None:
        return found
    # Placeholder first: a struct type may (indirectly) contain itself.
    pending: list[_Check] = []

    def forward(value: object) -> None:
        pending[0](value)

    staged[cls] = forward
    check = _Source().struct_checker(cls, check_type=check_type)
    pending.append(check)
    staged[cls] = check
    return check


_MAX_INLINE_STRUCTS: Final = 4
"""How many levels of nested structs one generated checker writes out inline."""
_MAX_INLINE_INDENT: Final = 12
"""How deeply generated code may indent (Python allows 20 nested blocks); deeper values are
checked by a call to their own checker."""


def _position(sequence: Sequence[object], item: object) -> int:
    """The index of ``item`` in ``sequence`` (for the path of a failure only)."""
    return next(index for index, other in enumerate(sequence) if other is item)


class _Source:
    """A checker function generated from type information, as Python source.

    Scalars are checked by their rule (:class:`_Rule`) written inline; a nested struct (a
    field typed as a struct, or a union of structs, or either or None) and a sequence (a
    ``tuple[X, ...]`` or ``list[X]``) are written inline too: a struct's exact class (a union
    takes one of its classes), then its fields; a sequence's type and length, then a loop
    over its items. Anything else (fixed tuples, dicts, buffers, options, other unions) calls
    the checker :func:`_checker` compiles for its type. So checking a single-token decode
    request is one call that runs only these rules: there is no hand-written fast path to
    keep in step with them. Each field's and item's check sits in a ``try`` (free unless it
    raises) that adds the field name or the index to the path of a failure.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, object] = {"_Bad": _Bad, "_position": _position}
        self.count = 0

    def struct_checker(self, cls: type, *, check_type: bool) -> _Check:
        self.emit(0, "def check(value):")
        if check_type:
            self._class_test(1, "value", cls)
        self._fields(1, "value", cls, (cls,))
        self.emit(1, "return None")
        return self._function(f"<check {cls.__qualname__}>")

    def checker(self, info: msgspec.inspect.Type) -> _Check:
        self.emit(0, "def check(value):")
        self._value(1, "value", info, ())
        self.emit(1, "return None")
        return self._function(f"<check {type(info).__name__}>")

    def _name(self, value: object) -> str:
        """A fresh global name of the generated function, bound to ``value``."""
        self.count += 1
        name = f"_n{self.count}"
        self.names[name] = value
        return name

    def _local(self) -> str:
        self.count += 1
        return f"_v{self.count}"

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def _function(self, title: str) -> _Check:
        namespace: dict[str, object] = {}
        # The source is generated here, from type information only.
        exec(compile("\n".join(self.lines), title, "exec"), self.names, namespace)
        check = namespace["check"]
        assert callable(check)
        return cast(_Check, check)

    def _refuse(self, depth: int, rule: _Rule, var: str) -> None:
        """Raise _Bad for the value in ``var`` unless ``rule`` holds."""
        names = {key: self._name(value) for key, value in rule.names.items()}
        self.emit(depth, f"if not ({rule.test.format(v=var, **names)}):")
        reason = f"{self._name(rule.explain)}({var})" if rule.explain is not None else "None"
        self.emit(depth + 1, f"raise _Bad({rule.expected!r}, {var}, {reason})")

    def _class_test(self, depth: int, var: str, cls: type) -> None:
        self.emit(depth, f"if type({var}) is not {self._name(cls)}:")
        self.emit(depth + 1, f"raise _Bad({cls.__name__!r}, {var})")

    def _fields(self, depth: int, var: str, cls: type, inlined: tuple[type, ...]) -> None:
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        for field in info.fields:
            value = self._local()
            self.emit(depth, f"{value} = {var}.{field.name}")
            self.emit(depth, "try:")
            self._value(depth + 1, value, field.type, inlined)
            self.emit(depth, "except _Bad as bad:")
            self.emit(depth + 1, f"bad.path.append({'.' + field.name!r})")
            self.emit(depth + 1, "raise")

    def _inline(self, info: msgspec.inspect.Type, inlined: tuple[type, ...]) -> bool:
        return (
            isinstance(info, msgspec.inspect.StructType)
            and info.cls not in inlined
            and len(inlined) < _MAX_INLINE_STRUCTS
        )

    def _value(
        self, depth: int, var: str, info: msgspec.inspect.Type, inlined: tuple[type, ...]
    ) -> None:
        rule = _rule(info)
        if rule is not None:
            self._refuse(depth, rule, var)
            return
        if depth <= _MAX_INLINE_INDENT:
            if isinstance(info, msgspec.inspect.StructType) and self._inline(info, inlined):
                self._class_test(depth, var, info.cls)
                self._fields(depth, var, info.cls, (*inlined, info.cls))
                return
            if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
                self._sequence(depth, var, info, inlined)
                return
            if isinstance(info, msgspec.inspect.UnionType) and self._union(
                depth, var, info, inlined
            ):
                return
        self.emit(depth, f"{self._name(_checker(info))}({var})")

    def _sequence(
        self,
        depth: int,
        var: str,
        info: msgspec.inspect.VarTupleType | msgspec.inspect.ListType,
        inlined: tuple[type, ...],
    ) -> None:
        kind = tuple if isinstance(info, msgspec.inspect.VarTupleType) else list
        low = info.min_length or 0
        high = info.max_length
        expected = kind.__name__ + ("" if high is None else f" of {low} to {high} items")
        size = f"{low} <= len({var})" + ("" if high is None else f" <= {high}")
        self.emit(depth, f"if type({var}) is not {self._name(kind)} or not {size}:")
        self.emit(depth + 1, f"raise _Bad({expected!r}, {var})")
        item = self._local()
        self.emit(depth, f"for {item} in {var}:")
        self.emit(depth + 1, "try:")
        self._value(depth + 2, item, info.item_type, inlined)
        self.emit(depth + 1, "except _Bad as bad:")
        self.emit(depth + 2, f'bad.path.append("[" + str(_position({var}, {item})) + "]")')
        self.emit(depth + 2, "raise")

    def _union(
        self, depth: int, var: str, info: msgspec.inspect.UnionType, inlined: tuple[type, ...]
    ) -> bool:
        """Write the check of a union of structs (or None), or of ``X | None``; False (nothing
        written) for any other union."""
        optional = [m for m in info.types if not isinstance(m, msgspec.inspect.NoneType)]
        allows_none = len(optional) < len(info.types)
        if not all(self._inline(member, inlined) for member in optional):
            if not (allows_none and len(optional) == 1):
                return False
            # "X | None", the common optional field: X's own check when not None.
            self.emit(depth, f"if {var} is not None:")
            self._value(depth + 1, var, optional[0], inlined)
            return True
        kind = self._local()
        self.emit(depth, f"{kind} = type({var})")
        keyword = "if"
        if allows_none:
            self.emit(depth, f"if {var} is None:")
            self.emit(depth + 1, "pass")
            keyword = "elif"
        names = []
        for member in optional:
            assert isinstance(member, msgspec.inspect.StructType)
            names.append(member.cls.__name__)
            self.emit(depth, f"{keyword} {kind} is {self._name(member.cls)}:")
            self.emit(depth + 1, "pass")
            self._fields(depth + 1, var, member.cls, (*inlined, member.cls))
            keyword = "elif"
        expected = " | ".join([*names, "None"] if allows_none else names)
        self.emit(depth, "else:")
        self.emit(depth + 1, f"raise _Bad({expected!r}, {var})")
        return True


def _checker(info: msgspec.inspect.Type) -> _Check:
    """The checker of a value of type ``info``. Only while compiling (see :func:`_compiled`)."""
    if _rule(info) is not None or isinstance(
        info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType
    ):
        return _Source().checker(info)
    match info:
        case msgspec.inspect.StructType(cls=cls):
            return _struct_checker(cls)
        case msgspec.inspect.UnionType():
            return _union_checker(info)
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


# ----------------------------------------------------------------------------- public


def check_request(request: object, expected: type) -> None:
    """Check that ``request`` is exactly an ``expected`` Struct whose every field, recursively,
    matches its declared type, bounds and literals (see the module docstring).

    Raises InvalidRequest naming the field path (also in ``details["field"]``).
    """
    check = _STRUCT_CHECKERS.get(expected) or _compiled(expected, fields_only=False)
    try:
        check(request)
    except _Bad as bad:
        raise _invalid(expected.__name__, bad) from None


def result_ok(result: object) -> bool:
    """Whether ``result`` is a well-typed BoundaryResult or LogitsResult: the check of
    :func:`check_request`, answered as a bool. False means "not certain": run
    :func:`check_request` for the error that names the field."""
    kind = type(result)
    if kind is not BoundaryResult and kind is not LogitsResult:
        return False
    check = _STRUCT_CHECKERS.get(kind) or _compiled(kind, fields_only=False)
    try:
        check(result)
    except _Bad:
        return False
    return True


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
