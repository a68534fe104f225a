"""Edge checks: every wrongly typed, out-of-range or unknown-literal value of every request
type is InvalidRequest naming the field path; well-typed requests pass, and what the checks
accept travels over the wire unchanged."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_engine_api import (
    AuxState,
    BoundaryBundle,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    MtpState,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardSpec,
    TokenInput,
)
from shard_engine_api._typecheck import check_option_value, check_request, result_ok

EXAMPLES: Final = int(os.environ.get("SHARD_ENGINE_FUZZ_EXAMPLES", "0")) or None
PROPERTIES = settings(
    derandomize=EXAMPLES is None, deadline=None, database=None, max_examples=EXAMPLES or 200
)

SESSION = SessionRef(session_id="s", epoch=1)
TOKENS = TokenInput(token_ids=(1, 2))
SPEC = ShardSpec(model="m", n_layers=4, start=0, end=2)


def bundle(**changes: Any) -> BoundaryBundle:
    made = BoundaryBundle.from_array(
        np.ones((1, 4), dtype=np.float32),
        session=SESSION,
        first_pos=0,
        layer=2,
        model_fingerprint="fp",
    )
    return msgspec.structs.replace(made, **changes) if changes else made


def prefill(**changes: Any) -> PrefillRequest:
    fields: dict[str, Any] = {
        "request_id": "p",
        "session": SESSION,
        "start_pos": 0,
        "inputs": TOKENS,
    }
    return PrefillRequest(**(fields | changes))


def decode(**changes: Any) -> DecodeRequest:
    fields: dict[str, Any] = {
        "request_id": "d",
        "session": SESSION,
        "pos": 2,
        "inputs": TokenInput(token_ids=(3,)),
    }
    return DecodeRequest(**(fields | changes))


def batch(**changes: Any) -> DecodeBatchRequest:
    fields: dict[str, Any] = {"request_id": "b", "items": (decode(), decode(request_id="e"))}
    return DecodeBatchRequest(**(fields | changes))


def unchecked_session(session_id: object = "s", epoch: object = 1) -> SessionRef:
    """A SessionRef holding values its constructor refuses, as a struct built by C code or a
    buggy library can: the slot descriptors write past the frozen guard."""
    made = SessionRef(session_id="s", epoch=1)
    SessionRef.__dict__["session_id"].__set__(made, session_id)
    SessionRef.__dict__["epoch"].__set__(made, epoch)
    return made


class _Id(str):
    """A str subclass that makes every id equal to every other: never an id."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


def released_view() -> memoryview:
    """A memoryview whose buffer was released: every use of it raises ValueError."""
    view = memoryview(bytearray(16))
    view.release()
    return view


# fmt: off
WRONG_INTS: Final[list[object]] = ["0", None, 1.5, 5.0, True, 2**63, 2**64, -1, np.int64(1), b"1"]
WRONG_IDS: Final[list[object]] = [5, None, b"s", "", "x" * 257, ("s",), _Id("s"), "\ud800",
                                  "caf\u00e9\udfff"]

CASES: list[tuple[str, Callable[[], object], type, str]] = []


def case(name: str, build: Callable[[], object], kind: type, field: str) -> None:
    CASES.append((name, build, kind, field))


def built(value: object) -> Callable[[], object]:
    return lambda: value


for wrong in WRONG_INTS:
    case(f"start_pos={wrong!r}", partial(prefill, start_pos=wrong), PrefillRequest,
         "PrefillRequest.start_pos")
    case(f"pos={wrong!r}", partial(decode, pos=wrong), DecodeRequest, "DecodeRequest.pos")
    case(f"epoch={wrong!r}", partial(decode, session=unchecked_session(epoch=wrong)),
         DecodeRequest, "DecodeRequest.session.epoch")
for wrong in WRONG_IDS:
    case(f"request_id={wrong!r}", partial(decode, request_id=wrong), DecodeRequest,
         "DecodeRequest.request_id")
    case(f"session_id={wrong!r}", partial(prefill, session=unchecked_session(wrong)),
         PrefillRequest, "PrefillRequest.session.session_id")
for wrong in ["a", 1.7, True, -1, 2**31, None, (1,)]:
    case(f"token id {wrong!r}", partial(prefill, inputs=TokenInput(token_ids=(1, wrong))),  # type: ignore[arg-type]
         PrefillRequest, "PrefillRequest.inputs.token_ids[1]")
for wrong in [[1], None, "12", b"\x01", 3]:
    case(f"token_ids={wrong!r}", partial(decode, inputs=TokenInput(token_ids=wrong)),  # type: ignore[arg-type]
         DecodeRequest, "DecodeRequest.inputs.token_ids")
for wrong in ["bogus", "ALL", None, 1, ("last",)]:
    case(f"logits={wrong!r}", partial(prefill, logits=wrong), PrefillRequest,
         "PrefillRequest.logits")
for wrong in [None, object(), {"token_ids": [1]}, (1, 2), SESSION]:
    case(f"inputs={wrong!r}", partial(decode, inputs=wrong), DecodeRequest,
         "DecodeRequest.inputs")
for wrong in [None, ("s", 1), {"session_id": "s", "epoch": 1}, "s"]:
    case(f"session={wrong!r}", partial(prefill, session=wrong), PrefillRequest,
         "PrefillRequest.session")
case("mtp item", partial(decode, mtp=(object(),)), DecodeRequest, "DecodeRequest.mtp[0]")
for wrong in [None, [MtpState()], "x"]:
    case(f"mtp={wrong!r}", partial(decode, mtp=wrong), DecodeRequest, "DecodeRequest.mtp")
case("mtp of 65 entries", partial(prefill, mtp=(MtpState(),) * 65), PrefillRequest,
     "PrefillRequest.mtp")
case("aux name not str", partial(prefill, aux=(AuxState(name=3),)), PrefillRequest,  # type: ignore[arg-type]
     "PrefillRequest.aux[0].name")
case("item None", partial(batch, items=(None,)), DecodeBatchRequest,
     "DecodeBatchRequest.items[0]")
case("item a prefill", partial(batch, items=(prefill(),)), DecodeBatchRequest,
     "DecodeBatchRequest.items[0]")
case("item an int", partial(batch, items=(3,)), DecodeBatchRequest,
     "DecodeBatchRequest.items[0]")
for wrong in [None, [decode()], "items"]:
    case(f"items={wrong!r}", partial(batch, items=wrong), DecodeBatchRequest,
         "DecodeBatchRequest.items")
case("item pos", partial(batch, items=(decode(), decode(pos=1.0))), DecodeBatchRequest,
     "DecodeBatchRequest.items[1].pos")
case("item token", partial(batch, items=(decode(inputs=TokenInput(token_ids=("a",))),)),  # type: ignore[arg-type]
     DecodeBatchRequest, "DecodeBatchRequest.items[0].inputs.token_ids[0]")
for wrong in [5, b"r", "", ("r",)]:
    case(f"cancel request_id={wrong!r}", partial(CancelRequest, request_id=wrong),  # type: ignore[arg-type]
         CancelRequest, "CancelRequest.request_id")
case("release session None", partial(ReleaseRequest, session=None),  # type: ignore[arg-type]
     ReleaseRequest, "ReleaseRequest.session")
BUNDLE_BAD: list[tuple[str, object]] = [
    ("payload", "text"), ("payload", None), ("payload", [1, 2]),
    ("payload", memoryview(np.ones((4, 4), np.float32)[:, :1])),  # type: ignore[arg-type,unused-ignore]
    ("payload", released_view()), ("model_fingerprint", _Id("fp")),
    ("dtype", "f8"), ("dtype", None), ("checksum", -1), ("checksum", 2**64), ("checksum", 1.0),
    ("layer", "2"), ("model_fingerprint", None), ("model_fingerprint", "f" * 300),
    ("session", None), ("first_pos", 1.5), ("n_tokens", True), ("hidden_size", None),
    ("contract_version", None), ("contract_version", 2**64), ("mtp", None),
    ("model_fingerprint", "fp\ud800"),
]
for name, wrong in BUNDLE_BAD:
    bad_bundle = bundle(**{name: wrong})
    case(f"bundle {name}={wrong!r}", partial(decode, inputs=bad_bundle), DecodeRequest,
         f"DecodeRequest.inputs.{name}")
    case(f"prefill bundle {name}={wrong!r}", partial(prefill, inputs=bad_bundle),
         PrefillRequest, f"PrefillRequest.inputs.{name}")
case("not a request", built(None), DecodeRequest, "DecodeRequest")
case("another request type", prefill, DecodeRequest, "DecodeRequest")
# fmt: on


@pytest.mark.parametrize(
    ("build", "kind", "field"),
    # Ids without the memory addresses some reprs carry: pytest-xdist workers must collect the
    # same test names.
    [pytest.param(b, k, f, id=re.sub(r" at 0x[0-9a-f]+", "", n)) for n, b, k, f in CASES],
)
def test_bad_field_is_invalid_request_naming_it(
    build: Callable[[], object], kind: type, field: str
) -> None:
    request = build()
    with pytest.raises(InvalidRequest) as caught:
        check_request(request, kind)
    assert caught.value.details["field"] == field
    assert caught.value.message.startswith(field)
    assert type(caught.value) is InvalidRequest


GOOD: Final = [
    (prefill(), PrefillRequest),
    (prefill(inputs=bundle(), logits="all"), PrefillRequest),
    (prefill(mtp=(MtpState(n_draft_tokens=1),)), PrefillRequest),  # reserved: engine's to refuse
    (decode(), DecodeRequest),
    (decode(inputs=bundle()), DecodeRequest),
    (decode(inputs=bundle(payload=b"\x00" * 16)), DecodeRequest),  # bytes are a buffer too
    (decode(session=SessionRef(session_id="s" * 256, epoch=2**63 - 1)), DecodeRequest),
    (decode(inputs=TokenInput(token_ids=(2**31 - 1,))), DecodeRequest),
    (batch(), DecodeBatchRequest),
    (batch(items=()), DecodeBatchRequest),  # empty: the engine's to refuse, typed
    (CancelRequest(request_id="r"), CancelRequest),
    (CancelRequest(session_id="s"), CancelRequest),
    (ReleaseRequest(session=SESSION), ReleaseRequest),
    (LoadConfig(shard=SPEC, options={"a": [1, {"b": None}], "c": 2.5}), LoadConfig),
]


@pytest.mark.parametrize(("request_", "kind"), GOOD)
def test_well_typed_requests_pass(request_: object, kind: type) -> None:
    check_request(request_, kind)


# ----------------------------------------------------------------------------- construction


CONSTRUCTION: list[tuple[str, Callable[[], object], str]] = [
    ("ShardSpec n_layers='6'", lambda: ShardSpec(model="m", n_layers="6", start=0, end=1),  # type: ignore[arg-type]
     "ShardSpec.n_layers"),
    ("ShardSpec model None", lambda: ShardSpec(model=None, n_layers=6, start=0, end=1),  # type: ignore[arg-type]
     "ShardSpec.model"),
    ("ShardSpec end 1.0", lambda: ShardSpec(model="m", n_layers=6, start=0, end=1.0),  # type: ignore[arg-type]
     "ShardSpec.end"),
    ("SessionRef session_id=5", lambda: SessionRef(session_id=5, epoch=1),  # type: ignore[arg-type]
     "SessionRef.session_id"),
    ("SessionRef epoch=2**64", lambda: SessionRef(session_id="s", epoch=2**64), "SessionRef.epoch"),
    ("SessionRef epoch=1.5", lambda: SessionRef(session_id="s", epoch=1.5),  # type: ignore[arg-type]
     "SessionRef.epoch"),
    ("SessionRef epoch=None", lambda: SessionRef(session_id="s", epoch=None),  # type: ignore[arg-type]
     "SessionRef.epoch"),
    ("LoadConfig eviction='fifo'", lambda: LoadConfig(shard=SPEC, eviction="fifo"),  # type: ignore[arg-type]
     "LoadConfig.eviction"),
    ("LoadConfig eviction='bogus'", lambda: LoadConfig(shard=SPEC, eviction="bogus"),  # type: ignore[arg-type]
     "LoadConfig.eviction"),
    ("LoadConfig dtype", lambda: LoadConfig(shard=SPEC, boundary_dtype="f8"),  # type: ignore[arg-type]
     "LoadConfig.boundary_dtype"),
    ("LoadConfig max_sessions=2**31", lambda: LoadConfig(shard=SPEC, max_sessions=2**31),
     "LoadConfig.max_sessions"),
    ("LoadConfig max_sessions='16'", lambda: LoadConfig(shard=SPEC, max_sessions="16"),  # type: ignore[arg-type]
     "LoadConfig.max_sessions"),
    ("LoadConfig max_context=2**40", lambda: LoadConfig(shard=SPEC, max_context=2**40),
     "LoadConfig.max_context"),
    ("LoadConfig kv_budget 0", lambda: LoadConfig(shard=SPEC, kv_budget_tokens=0),
     "LoadConfig.kv_budget_tokens"),
    ("LoadConfig n_threads -1", lambda: LoadConfig(shard=SPEC, n_threads=-1),
     "LoadConfig.n_threads"),
    ("LoadConfig shard None", lambda: LoadConfig(shard=None),  # type: ignore[arg-type]
     "LoadConfig.shard"),
    ("LoadConfig options None", lambda: LoadConfig(shard=SPEC, options=None),  # type: ignore[arg-type]
     "LoadConfig.options"),
    ("options key int", lambda: LoadConfig(shard=SPEC, options={1: 2}),  # type: ignore[dict-item]
     "LoadConfig.options[1] (key)"),
    ("options set", lambda: LoadConfig(shard=SPEC, options={"a": {1}}), "LoadConfig.options"),
    ("options int 2**64", lambda: LoadConfig(shard=SPEC, options={"a": [2**64]}),
     "LoadConfig.options"),
    ("options nested key", lambda: LoadConfig(shard=SPEC, options={"a": {"b": {3: 1}}}),
     "LoadConfig.options"),
    ("options too deep", lambda: LoadConfig(shard=SPEC, options={"a": _deep(40)}),
     "LoadConfig.options"),
    ("options too many", lambda: LoadConfig(shard=SPEC, options={"a": [0] * 5000}),
     "LoadConfig.options"),
    ("SessionRef lone surrogate", lambda: SessionRef(session_id="s\ud800", epoch=1),
     "SessionRef.session_id"),
    ("ShardSpec model lone surrogate",
     lambda: ShardSpec(model="\udc80.gguf", n_layers=6, start=0, end=1), "ShardSpec.model"),
    ("options value lone surrogate",
     lambda: LoadConfig(shard=SPEC, options={"a": ["ok", "\ud800"]}), "LoadConfig.options"),
    ("options key lone surrogate", lambda: LoadConfig(shard=SPEC, options={"\ud800": 1}),
     "LoadConfig.options['\\ud800'] (key)"),
]  # fmt: skip


def _deep(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("build", "field"), [pytest.param(b, f, id=n) for n, b, f in CONSTRUCTION])
def test_construction_refuses_bad_fields(build: Callable[[], object], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        build()
    assert caught.value.details["field"] == field


def test_self_referencing_options_are_refused_not_looped() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(InvalidRequest, match="options"):
        LoadConfig(shard=SPEC, options={"loop": loop})


def test_option_value_check_is_iterative() -> None:
    with pytest.raises(InvalidRequest, match="deeper"):
        check_option_value(_deep(100_000), max_depth=1_000, max_items=10**6)
    with pytest.raises(InvalidRequest, match="deeper"):
        check_option_value(_deep(100_000))


@pytest.mark.parametrize(
    "values",
    [np.zeros((0, 4)), np.zeros((4, 0)), np.zeros(4), np.zeros((1, 2, 3)), [[1.0]],
     np.array([[1 + 2j]]), np.array([["a"]]), None],
    ids=["no rows", "no columns", "1-D", "3-D", "list", "complex", "strings", "None"],
)  # fmt: skip
def test_from_array_refuses_what_it_cannot_carry(values: Any) -> None:
    with pytest.raises(InvalidRequest):
        BoundaryBundle.from_array(
            values, session=SESSION, first_pos=0, layer=1, model_fingerprint="f"
        )
    with pytest.raises(InvalidRequest):
        LogitsResult.from_array(
            values, request_id="r", session=SESSION, first_pos=0, evidence="fixture"
        )


def test_from_array_refuses_an_unknown_dtype() -> None:
    with pytest.raises(InvalidRequest, match="dtype"):
        BoundaryBundle.from_array(
            np.ones((1, 2)), session=SESSION, first_pos=0, layer=1, model_fingerprint="f",
            dtype="f8",  # type: ignore[arg-type]
        )  # fmt: skip


# ----------------------------------------------------------------------------- fast path parity

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.just(()),
    st.tuples(st.integers(-2, 2**32)),
    st.just(SESSION),
    st.just(TokenInput(token_ids=(1,))),
)


def _sometimes(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, junk)


@st.composite
def decode_like(draw: st.DrawFn) -> object:
    session = draw(
        st.one_of(
            st.just(SESSION),
            st.builds(unchecked_session, _sometimes(st.text(min_size=1, max_size=4)),
                      _sometimes(st.integers(0, 2**63 - 1))),
            junk,
        )
    )  # fmt: skip
    token = st.builds(
        TokenInput, token_ids=_sometimes(st.tuples(_sometimes(st.integers(0, 2**31 - 1))))
    )
    inputs = draw(st.one_of(token, st.just(bundle()), st.builds(lambda c: bundle(checksum=c),
                                                                 _sometimes(st.integers(0, 9))),
                            junk))  # fmt: skip
    return DecodeRequest(
        request_id=draw(_sometimes(st.text(min_size=1, max_size=4))),
        session=session,
        pos=draw(_sometimes(st.integers(0, 2**63 - 1))),
        inputs=inputs,
        mtp=draw(st.one_of(st.just(()), junk)),
    )


@PROPERTIES
@given(decode_like())
def test_what_the_check_accepts_travels_unchanged(request_: DecodeRequest) -> None:
    """The checks are the decoders' rules: a decode request they accept encodes and decodes
    (msgspec's own bounds, read from the same annotations) to an equal request, and a batch
    of it is accepted too; one they refuse is refused naming a field of the request."""
    refused: InvalidRequest | None = None
    try:
        check_request(request_, DecodeRequest)
    except InvalidRequest as error:
        refused = error
    if refused is not None:
        assert str(refused.details["field"]).startswith("DecodeRequest.")
        return
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request_), type=DecodeRequest)
    assert decoded == request_
    check_request(DecodeBatchRequest(request_id="b", items=(request_,)), DecodeBatchRequest)


@PROPERTIES
@given(decode_like())
def test_result_ok_agrees_with_the_check(request_: DecodeRequest) -> None:
    # Results built around the drawn session and bundle: result_ok accepts exactly the results
    # the check accepts.
    from shard_engine_api import BoundaryResult

    inputs = request_.inputs if isinstance(request_.inputs, BoundaryBundle) else bundle()
    result = BoundaryResult(
        request_id=request_.request_id,
        session=request_.session,
        first_pos=request_.pos,
        n_tokens=1,
        evidence="fixture",
        bundle=inputs,
    )
    try:
        check_request(result, BoundaryResult)
    except InvalidRequest:
        assert not result_ok(result)
    else:
        assert result_ok(result)
