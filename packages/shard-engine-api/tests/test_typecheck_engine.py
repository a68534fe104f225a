"""Nothing a caller sends can break an engine: any request built from arbitrary (wrongly typed,
out-of-range, unknown-literal) field values yields a result, a typed contract error, or an
InvalidRequest that left the engine exactly as it was (health, metrics, committed lengths).

Runs on the conformance reference engine (an EngineCore) as a full shard (token input) and as a
tail shard (bundle input). Bounded by default; ``SHARD_ENGINE_FUZZ_EXAMPLES`` deepens it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pytest
from conformance_engines import ReferenceEngine, reference_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_engine_api import (
    BoundaryBundle,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    EngineCrashed,
    Health,
    InvalidRequest,
    LoadConfig,
    Metrics,
    MtpState,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardEngineError,
    ShardSpec,
    TokenInput,
)
from shard_engine_api._typecheck import check_request

EXAMPLES: Final = int(os.environ.get("SHARD_ENGINE_FUZZ_EXAMPLES", "0")) or None
PROPERTIES = settings(
    derandomize=EXAMPLES is None,
    deadline=None,
    database=None,
    max_examples=EXAMPLES or 120,
    suppress_health_check=[HealthCheck.too_slow],
)
N_LAYERS: Final = 4
SESSION: Final = SessionRef(session_id="s", epoch=2)
OTHER: Final = SessionRef(session_id="t", epoch=1)
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def model_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(reference_fixture(Path(folder), n_layers=N_LAYERS).model)


class Prepared:
    """A loaded engine with two sessions: "s" at epoch 2 holding 3 positions, "t" holding 1."""

    def __init__(self, model: Path, start: int) -> None:
        self.engine = ReferenceEngine()
        self.start = start
        self.caps = self.engine.load(
            LoadConfig(
                shard=ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=N_LAYERS),
                max_sessions=4,
                max_context=64,
                max_batch_tokens=16,
                kv_budget_tokens=256,
            )
        )
        self.engine.prefill(
            PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=self.inputs(0, 3))
        )
        self.engine.prefill(
            PrefillRequest(
                request_id="q", session=OTHER, start_pos=0, inputs=self.inputs(0, 1, OTHER)
            )
        )

    def inputs(self, first_pos: int, rows: int, session: SessionRef = SESSION) -> Any:
        if self.start == 0:
            return TokenInput(token_ids=tuple(range(1, rows + 1)))
        return BoundaryBundle.from_array(
            np.full((rows, self.caps.hidden_size), 0.25, dtype=np.float32),
            session=session,
            first_pos=first_pos,
            layer=self.start,
            model_fingerprint=self.caps.model_fingerprint,
        )

    def snapshot(self) -> tuple[Health, Metrics]:
        return self.engine.health(), self.engine.metrics()

    def committed(self) -> tuple[int, int]:
        """The committed lengths of "s" and "t", read through CacheMiss of a decode far ahead
        (which changes nothing but the metrics)."""
        lengths = []
        for session in (SESSION, OTHER):
            request = DecodeRequest(
                request_id="probe", session=session, pos=63, inputs=self.inputs(63, 1, session)
            )
            try:
                self.engine.decode(request)
            except ShardEngineError as error:
                lengths.append(int(error.details.get("committed_length", -1)))  # type: ignore[arg-type]
        return lengths[0], lengths[1]


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([1.5, 5.0, -0.0, float("nan"), float("inf")]),
    st.text(max_size=4),
    st.sampled_from(["", "bogus", "last", "all", "f16", "x" * 300]),
    st.binary(max_size=4),
    st.just(()),
    st.lists(st.integers(-1, 40), max_size=3),
    st.tuples(st.sampled_from(["a", 1.7, True, -1, 2**31, None, 3])),
    st.just(SESSION),
    st.just(TokenInput(token_ids=(1,))),
    st.just(object()),
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly valid values, sometimes anything at all."""
    return st.integers(0, 9).flatmap(lambda n: junk if n == 0 else valid)


def sessions() -> st.SearchStrategy[Any]:
    return maybe(st.sampled_from([SESSION, OTHER, SessionRef(session_id="new", epoch=1)]))


@st.composite
def inputs_for(draw: st.DrawFn, prepared: Prepared, pos: object, rows: int) -> Any:
    if draw(st.integers(0, 4)) == 0:
        return draw(junk)
    first = pos if type(pos) is int and 0 <= pos < 64 else 0
    good = prepared.inputs(first, rows)
    if isinstance(good, TokenInput):
        ids = draw(maybe(st.just(good.token_ids)))
        return TokenInput(token_ids=ids)
    field = draw(
        st.sampled_from(["", "first_pos", "layer", "dtype", "checksum", "session", "payload"])
    )
    if not field:
        return good
    return msgspec.structs.replace(good, **{field: draw(junk)})


@st.composite
def operations(draw: st.DrawFn, prepared: Prepared) -> tuple[str, object]:
    kind = draw(st.sampled_from(["prefill", "decode", "decode_batch", "cancel", "release"]))
    if kind == "prefill":
        start_pos = draw(maybe(st.integers(0, 4)))
        rows = draw(st.integers(1, 3))
        return kind, PrefillRequest(
            request_id=draw(maybe(st.sampled_from(["r1", "r2"]))),
            session=draw(sessions()),
            start_pos=start_pos,
            inputs=draw(inputs_for(prepared, start_pos, rows)),
            logits=draw(maybe(st.sampled_from(["last", "all"]))),
            mtp=draw(maybe(st.just(()))),
        )
    if kind in ("decode", "decode_batch"):
        items = []
        for index in range(draw(st.integers(1, 3)) if kind == "decode_batch" else 1):
            pos = draw(maybe(st.sampled_from([1, 3])))
            items.append(
                DecodeRequest(
                    request_id=draw(maybe(st.just(f"d{index}"))),
                    session=draw(sessions()),
                    pos=pos,
                    inputs=draw(inputs_for(prepared, pos, 1)),
                    aux=draw(maybe(st.just(()))),
                )
            )
        if kind == "decode":
            return kind, items[0]
        return kind, DecodeBatchRequest(
            request_id=draw(maybe(st.just("b"))), items=draw(maybe(st.just(tuple(items))))
        )
    if kind == "cancel":
        return kind, CancelRequest(
            request_id=draw(maybe(st.none() | st.just("r1"))),
            session_id=draw(maybe(st.none() | st.just("s"))),
        )
    return kind, ReleaseRequest(session=draw(sessions()))


REQUEST_TYPES: Final[dict[str, type]] = {
    "prefill": PrefillRequest,
    "decode": DecodeRequest,
    "decode_batch": DecodeBatchRequest,
    "cancel": CancelRequest,
    "release": ReleaseRequest,
}


def run(prepared: Prepared, kind: str, request: object) -> None:
    well_typed = True
    try:
        check_request(request, REQUEST_TYPES[kind])
    except InvalidRequest:
        well_typed = False
    lengths = prepared.committed()
    before = prepared.snapshot()
    call: Callable[[Any], object] = getattr(prepared.engine, kind)
    outcome: ShardEngineError | None = None
    try:
        call(request)
    except ShardEngineError as error:
        outcome = error
    assert not isinstance(outcome, EngineCrashed), f"{kind} crashed the engine: {outcome}"
    if isinstance(outcome, InvalidRequest) and not well_typed:
        COUNTS["refused at the edge"] = COUNTS.get("refused at the edge", 0) + 1
        assert "field" in outcome.details, outcome
        assert prepared.snapshot() == before, "a refused request changed the engine"
        assert prepared.committed() == lengths
        return
    assert well_typed, f"a badly typed {kind} ended as {outcome!r}, not InvalidRequest"
    label = "result" if outcome is None else outcome.code
    COUNTS[label] = COUNTS.get(label, 0) + 1
    assert prepared.engine.health().state in ("ready", "degraded")


@pytest.mark.parametrize("start", [0, 2], ids=["full shard (tokens)", "tail shard (bundles)"])
def test_arbitrary_requests_never_break_the_engine(model_path: Path, start: int) -> None:
    @PROPERTIES
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        prepared = Prepared(model_path, start)
        for _ in range(data.draw(st.integers(1, 3))):
            kind, request = data.draw(operations(prepared))
            run(prepared, kind, request)
        prepared.engine.close()

    check()
    print(f"edge property outcomes: {dict(sorted(COUNTS.items()))}")
    assert COUNTS.get("refused at the edge", 0) > 0


def _prefill(p: Prepared, **changes: Any) -> PrefillRequest:
    fields: dict[str, Any] = {
        "request_id": "x",
        "session": SESSION,
        "start_pos": 0,
        "inputs": p.inputs(0, 1),
    }
    return PrefillRequest(**(fields | changes))


def _decode(p: Prepared, **changes: Any) -> DecodeRequest:
    fields: dict[str, Any] = {
        "request_id": "x",
        "session": SESSION,
        "pos": 3,
        "inputs": p.inputs(3, 1),
    }
    return DecodeRequest(**(fields | changes))


BAD_CALLS: Final[list[tuple[str, str, Callable[[Prepared], object]]]] = [
    ("prefill start_pos='0'", "prefill", lambda p: _prefill(p, start_pos="0")),
    ("prefill start_pos=None", "prefill", lambda p: _prefill(p, start_pos=None)),
    ("prefill start_pos=5.0", "prefill", lambda p: _prefill(p, start_pos=5.0)),
    ("prefill start_pos=2**64", "prefill", lambda p: _prefill(p, start_pos=2**64)),
    ("prefill inputs=None", "prefill", lambda p: _prefill(p, inputs=None)),
    ("prefill session=None", "prefill", lambda p: _prefill(p, session=None)),
    ("prefill logits='bogus'", "prefill", lambda p: _prefill(p, logits="bogus")),
    ("prefill mtp of bad entries", "prefill",
     lambda p: _prefill(p, mtp=(MtpState(n_draft_tokens=1.5),))),  # type: ignore[arg-type]
    ("prefill request_id=None", "prefill", lambda p: _prefill(p, request_id=None)),
    ("decode pos=3.0", "decode", lambda p: _decode(p, pos=3.0)),
    ("decode pos=True", "decode", lambda p: _decode(p, pos=True)),
    ("decode mtp=None", "decode", lambda p: _decode(p, mtp=None)),
    ("decode inputs=object()", "decode", lambda p: _decode(p, inputs=object())),
    ("decode_batch items=None", "decode_batch",
     lambda p: DecodeBatchRequest(request_id="b", items=None)),  # type: ignore[arg-type]
    ("decode_batch item pos=True", "decode_batch",
     lambda p: DecodeBatchRequest(request_id="b", items=(_decode(p, pos=True),))),
    ("decode_batch items a list", "decode_batch",
     lambda p: DecodeBatchRequest(request_id="b", items=[_decode(p)])),  # type: ignore[arg-type]
    ("release session=None", "release", lambda p: ReleaseRequest(session=None)),  # type: ignore[arg-type]
    ("cancel request_id=5", "cancel", lambda p: CancelRequest(request_id=5)),  # type: ignore[arg-type]
    ("cancel session_id=b's'", "cancel", lambda p: CancelRequest(session_id=b"s")),  # type: ignore[arg-type]
]  # fmt: skip


@pytest.mark.parametrize("start", [0, 2], ids=["full", "tail"])
@pytest.mark.parametrize(("kind", "build"), [pytest.param(k, b, id=n) for n, k, b in BAD_CALLS])
def test_each_issue_case_is_invalid_request_and_changes_nothing(
    model_path: Path, start: int, kind: str, build: Callable[[Prepared], object]
) -> None:
    prepared = Prepared(model_path, start)
    before = prepared.snapshot()
    with pytest.raises(InvalidRequest) as caught:
        getattr(prepared.engine, kind)(build(prepared))
    assert "field" in caught.value.details
    assert prepared.snapshot() == before
    assert prepared.committed() == (3, 1)


def test_token_ids_from_the_wrong_role_and_range_stay_typed(model_path: Path) -> None:
    prepared = Prepared(model_path, 0)
    before = prepared.snapshot()
    for token_ids in [(1.7,), (True,), (2**31,), (-1,), ("a",), ((1,),)]:
        request = DecodeRequest(
            request_id="x",
            session=SESSION,
            pos=3,
            inputs=TokenInput(token_ids=token_ids),  # type: ignore[arg-type]
        )
        with pytest.raises(InvalidRequest, match="token_ids"):
            prepared.engine.decode(request)
    assert prepared.snapshot() == before
