"""The validation wrapper: every kind of contract-breaking result from a deliberately broken
inner engine becomes MalformedOutput naming the check; good results pass through untouched."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    CacheMiss,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    ErrorInfo,
    ExportSessionRequest,
    Features,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    LoadConfig,
    LogitsMode,
    LogitsResult,
    MalformedOutput,
    Metrics,
    MtpState,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    SessionSnapshot,
    ShardEngine,
    ShardResult,
    ShardSpec,
    Timings,
    TokenInput,
    ValidatingEngine,
)
from shard_engine_api.engine import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_api.wire import decode_message, encode

HIDDEN = 8
VOCAB = 12
N_LAYERS = 4
FINGERPRINT = "fp-tiny"


class TinyEngine(EngineCore):
    """A minimal correct engine: row i of a forward is filled with (position + 1) / 100."""

    engine_name = "tiny"

    def _open(self, config: LoadConfig) -> ModelInfo:
        return ModelInfo(
            engine_version="0",
            evidence="fixture",
            model_fingerprint=FINGERPRINT,
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            determinism=Determinism(deterministic=True, split_exact=True),
        )

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        positions = np.arange(item.start_pos, item.start_pos + item.n_tokens, dtype=np.float32)
        if output == "last":
            positions = positions[-1:]
        width = HIDDEN if output == "hidden" else VOCAB
        return np.repeat(((positions + 1) / 100)[:, None], width, axis=1)

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        pass

    def _commit(self, slot: int) -> None:
        pass

    def _drop(self, slot: int) -> None:
        pass

    def _close(self) -> None:
        pass


Mutation = Callable[[Any], Any]


class Tamper:
    """An engine that hands on ``inner``'s results after passing them through ``mutate``."""

    def __init__(self, inner: ShardEngine, mutate: Mutation = lambda r: r) -> None:
        self.inner = inner
        self.mutate = mutate
        self.capabilities_override: Capabilities | None = None
        self.raise_instead: Exception | None = None
        self.last: object = None

    @property
    def name(self) -> str:
        return "tamper"

    def _hand_on(self, result: Any) -> Any:
        if self.raise_instead is not None:
            raise self.raise_instead
        self.last = self.mutate(result)
        return self.last

    def load(self, config: LoadConfig) -> Capabilities:
        capabilities = self.inner.load(config)
        return self.capabilities_override or capabilities

    def capabilities(self) -> Capabilities:
        return self.capabilities_override or self.inner.capabilities()

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._hand_on(self.inner.prefill(request))  # type: ignore[no-any-return]

    def decode(self, request: DecodeRequest) -> ShardResult:
        return self._hand_on(self.inner.decode(request))  # type: ignore[no-any-return]

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        return self._hand_on(self.inner.decode_batch(request))  # type: ignore[no-any-return]

    def cancel(self, request: CancelRequest) -> CancelResult:
        return self._hand_on(self.inner.cancel(request))  # type: ignore[no-any-return]

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        return self._hand_on(self.inner.release(request))  # type: ignore[no-any-return]

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        return self._hand_on(self.inner.export_session(request))  # type: ignore[no-any-return]

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        return self._hand_on(self.inner.import_session(request))  # type: ignore[no-any-return]

    def health(self) -> Health:
        return self.inner.health()

    def metrics(self) -> Metrics:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()


def session(name: str = "s") -> SessionRef:
    return SessionRef(session_id=name, epoch=1)


def config(start: int, end: int, dtype: str = "f32") -> LoadConfig:
    spec = ShardSpec(model="tiny", n_layers=N_LAYERS, start=start, end=end)
    return LoadConfig(shard=spec, boundary_dtype=dtype)  # type: ignore[arg-type]


def hidden_bundle(n: int, first_pos: int = 0, layer: int = 2) -> BoundaryBundle:
    return BoundaryBundle.from_array(
        np.ones((n, HIDDEN), dtype=np.float32),
        session=session(),
        first_pos=first_pos,
        layer=layer,
        model_fingerprint=FINGERPRINT,
    )


def make(
    start: int,
    end: int,
    mutate: Mutation = lambda r: r,
    *,
    nonfinite: str = "reject",
    loaded_before: bool = False,
) -> tuple[ValidatingEngine, Tamper]:
    """A wrapped tampering engine, loaded through the wrapper or (``loaded_before``) loaded
    first and wrapped afterwards, as a worker that adopts a running engine does."""
    tamper = Tamper(TinyEngine(), mutate)
    if loaded_before:
        tamper.load(config(start, end))
    engine = ValidatingEngine(tamper, nonfinite=nonfinite)  # type: ignore[arg-type]
    if not loaded_before:
        engine.load(config(start, end))
    return engine, tamper


def head_prefill(n: int = 3) -> PrefillRequest:
    return PrefillRequest(
        request_id="p", session=session(), start_pos=0, inputs=TokenInput(token_ids=(1,) * n)
    )


def replace_bundle(**changes: Any) -> Mutation:
    def mutate(result: BoundaryResult) -> BoundaryResult:
        bundle = msgspec.structs.replace(result.bundle, **changes)
        return msgspec.structs.replace(result, bundle=bundle)

    return mutate


def rebuild_bundle(values: Callable[[np.ndarray], np.ndarray], dtype: str = "f32") -> Mutation:
    def mutate(result: BoundaryResult) -> BoundaryResult:
        bundle = result.bundle
        rebuilt = BoundaryBundle.from_array(
            values(bundle.array().astype(np.float32)),
            session=bundle.session,
            first_pos=bundle.first_pos,
            layer=bundle.layer,
            model_fingerprint=bundle.model_fingerprint,
            dtype=dtype,  # type: ignore[arg-type]
        )
        return msgspec.structs.replace(result, bundle=rebuilt)

    return mutate


def with_nan(values: np.ndarray) -> np.ndarray:
    values[-1, 0] = np.nan
    return values


def logits_from(values: Callable[[np.ndarray], np.ndarray]) -> Mutation:
    def mutate(result: LogitsResult) -> LogitsResult:
        return LogitsResult.from_array(
            values(result.array().copy()),
            request_id=result.request_id,
            session=result.session,
            first_pos=result.first_pos,
            evidence=result.evidence,
        )

    return mutate


def a_logits_result(result: BoundaryResult) -> LogitsResult:
    return LogitsResult.from_array(
        np.zeros((1, VOCAB)),
        request_id=result.request_id,
        session=result.session,
        first_pos=result.first_pos,
        evidence=result.evidence,
    )


def a_boundary_result(result: LogitsResult) -> BoundaryResult:
    bundle = hidden_bundle(1, result.first_pos, layer=N_LAYERS)
    return BoundaryResult(
        request_id=result.request_id,
        session=result.session,
        first_pos=result.first_pos,
        n_tokens=1,
        evidence=result.evidence,
        bundle=bundle,
    )


# ----------------------------------------------------------------------------- good results


def test_wrapper_is_a_shard_engine() -> None:
    engine: ShardEngine = ValidatingEngine(TinyEngine())
    assert isinstance(engine, ShardEngine)
    assert engine.name == "tiny"


@pytest.mark.parametrize(("start", "end"), [(0, 2), (1, 3), (2, 4), (0, 4)])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_good_results_pass_through_unchanged(start: int, end: int, dtype: str) -> None:
    tamper = Tamper(TinyEngine())
    engine = ValidatingEngine(tamper)
    capabilities = engine.load(config(start, end, dtype))
    assert engine.capabilities() is capabilities
    if start == 0:
        inputs: TokenInput | BoundaryBundle = TokenInput(token_ids=(1, 2, 3))
        step: TokenInput | BoundaryBundle = TokenInput(token_ids=(4,))
    else:
        inputs, step = hidden_bundle(3, 0, start), hidden_bundle(1, 3, start)
    modes: tuple[LogitsMode, ...] = ("last", "all")
    for mode in modes:
        request = PrefillRequest(
            request_id=f"p-{mode}", session=session(), start_pos=0, inputs=inputs, logits=mode
        )
        assert engine.prefill(request) is tamper.last
    result = engine.decode(DecodeRequest(request_id="d", session=session(), pos=3, inputs=step))
    assert result is tamper.last
    if end == N_LAYERS:
        assert isinstance(result, LogitsResult)
        assert (result.first_pos, result.n_rows) == (3, 1)
    else:
        assert isinstance(result, BoundaryResult)
        assert result.bundle.dtype == dtype
        assert result.bundle.layer == end


def test_batch_with_errors_and_results_passes() -> None:
    engine, tamper = make(0, 4)
    engine.prefill(head_prefill(2))
    items = (
        DecodeRequest(request_id="a", session=session(), pos=2, inputs=TokenInput(token_ids=(1,))),
        DecodeRequest(
            request_id="b", session=session("x"), pos=5, inputs=TokenInput(token_ids=(1,))
        ),
    )
    result = engine.decode_batch(DecodeBatchRequest(request_id="batch", items=items))
    assert result is tamper.last
    assert isinstance(result.items[0], LogitsResult)
    assert isinstance(result.items[1], ErrorInfo)
    assert result.items[1].code == "cache_miss"


def test_contract_errors_pass_through_unchanged() -> None:
    engine, tamper = make(0, 2)
    error = CacheMiss("evicted", committed_length=4, reason="evicted")
    tamper.raise_instead = error
    with pytest.raises(CacheMiss) as caught:
        engine.prefill(head_prefill())
    assert caught.value is error


def test_cancel_release_health_metrics_delegate() -> None:
    engine, _ = make(0, 2)
    assert engine.cancel(CancelRequest(request_id="nothing")) == CancelResult(cancelled=False)
    engine.prefill(head_prefill())
    assert engine.release(ReleaseRequest(session=session())).released
    assert engine.health().state == "ready"
    assert engine.metrics().prefill_requests == 1
    engine.close()
    assert engine.health().state == "closed"


def test_engine_loaded_before_wrapping_is_adopted() -> None:
    inner = TinyEngine()
    inner.load(config(0, 2, "f16"))
    engine = ValidatingEngine(inner)
    result = engine.prefill(head_prefill())
    assert isinstance(result, BoundaryResult)
    assert result.bundle.dtype == "f16"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        ValidatingEngine(TinyEngine(), nonfinite="ignore")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- broken bundles


NON_TAIL_BREAKAGES: list[tuple[str, Mutation, str]] = [
    ("wrong type", a_logits_result, "result_type"),
    ("request id", lambda r: msgspec.structs.replace(r, request_id="other"), "request_id"),
    ("result session", lambda r: msgspec.structs.replace(r, session=session("o")), "session"),
    ("evidence", lambda r: msgspec.structs.replace(r, evidence="real"), "evidence"),
    ("result first_pos", lambda r: msgspec.structs.replace(r, first_pos=1), "position"),
    ("result n_tokens", lambda r: msgspec.structs.replace(r, n_tokens=2), "rows"),
    ("bundle first_pos", replace_bundle(first_pos=1), "position"),
    ("bundle n_tokens", replace_bundle(n_tokens=4), "rows"),
    ("bundle session", replace_bundle(session=session("o")), "session"),
    ("hidden size", rebuild_bundle(lambda v: np.hstack([v, v])), "hidden_size"),
    ("dtype not loaded", rebuild_bundle(lambda v: v, "f16"), "dtype"),
    ("dtype unknown", replace_bundle(dtype="f8"), "result_fields"),
    ("layer", replace_bundle(layer=1), "layer"),
    ("fingerprint", replace_bundle(model_fingerprint="fp-other"), "fingerprint"),
    ("contract version", replace_bundle(contract_version=CONTRACT_VERSION + 1), "contract_version"),
    ("reserved mtp", replace_bundle(mtp=(MtpState(n_draft_tokens=1),)), "reserved"),
    ("short payload", lambda r: replace_bundle(payload=r.bundle.payload[:-4])(r), "payload_length"),
    ("checksum", lambda r: replace_bundle(checksum=r.bundle.checksum ^ 1)(r), "checksum"),
    ("non-finite", rebuild_bundle(with_nan), "finite"),
    ("payload not a buffer", replace_bundle(payload="text"), "result_fields"),
    ("bundle not a bundle", lambda r: msgspec.structs.replace(r, bundle=None), "result_fields"),
    ("negative timing", lambda r: msgspec.structs.replace(r, timings=Timings(total_ms=-2.0)),
     "timings"),
]  # fmt: skip


@pytest.mark.parametrize("loaded_before", [False, True], ids=["wrapped, loaded", "loaded, wrapped"])
@pytest.mark.parametrize(
    ("mutate", "check"),
    [pytest.param(m, c, id=name) for name, m, c in NON_TAIL_BREAKAGES],
)
def test_broken_boundary_results_are_caught(
    mutate: Mutation, check: str, loaded_before: bool
) -> None:
    engine, _ = make(0, 2, mutate, loaded_before=loaded_before)
    with pytest.raises(MalformedOutput) as caught:
        engine.prefill(head_prefill())
    assert caught.value.details["check"] == check
    assert caught.value.message.startswith(f"{check}:")


def test_broken_decode_result_is_caught() -> None:
    engine, tamper = make(1, 3)
    engine.prefill(PrefillRequest(request_id="p", session=session(), start_pos=0,
                                  inputs=hidden_bundle(2, 0, 1)))  # fmt: skip
    tamper.mutate = replace_bundle(first_pos=0)
    with pytest.raises(MalformedOutput, match="position"):
        engine.decode(
            DecodeRequest(request_id="d", session=session(), pos=2, inputs=hidden_bundle(1, 2, 1))
        )


def test_non_finite_allowed_by_policy() -> None:
    engine, _ = make(0, 2, rebuild_bundle(with_nan), nonfinite="allow")
    result = engine.prefill(head_prefill())
    assert isinstance(result, BoundaryResult)
    assert np.isnan(result.bundle.array()).any()


def test_foreign_exception_becomes_malformed_output() -> None:
    engine, tamper = make(0, 2)
    tamper.raise_instead = KeyError("slot")
    with pytest.raises(MalformedOutput, match="KeyError") as caught:
        engine.prefill(head_prefill())
    assert caught.value.details["check"] == "exception_type"
    assert isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(MalformedOutput):
        engine.cancel(CancelRequest(request_id="x"))


# ----------------------------------------------------------------------------- broken logits


TAIL_BREAKAGES: list[tuple[str, Mutation, str]] = [
    ("wrong type", a_boundary_result, "result_type"),
    ("request id", lambda r: msgspec.structs.replace(r, request_id="x"), "request_id"),
    ("evidence", lambda r: msgspec.structs.replace(r, evidence="real"), "evidence"),
    ("first_pos", lambda r: msgspec.structs.replace(r, first_pos=r.first_pos + 1), "position"),
    ("all rows", logits_from(lambda v: np.vstack([v, v])), "rows"),
    ("vocab", logits_from(lambda v: v[:, :-1]), "vocab_size"),
    ("n_rows header", lambda r: msgspec.structs.replace(r, n_rows=2), "rows"),
    ("short payload", lambda r: msgspec.structs.replace(r, payload=r.payload[:-1]),
     "payload_length"),
    ("checksum", lambda r: msgspec.structs.replace(r, checksum=r.checksum ^ 1), "checksum"),
    ("non-finite", logits_from(lambda v: v * np.inf), "finite"),
    ("NaN timing", lambda r: msgspec.structs.replace(r, timings=Timings(queue_ms=math.nan)),
     "timings"),
    ("infinite timing", lambda r: msgspec.structs.replace(r, timings=Timings(compute_ms=math.inf)),
     "timings"),
]  # fmt: skip


@pytest.mark.parametrize("loaded_before", [False, True], ids=["wrapped, loaded", "loaded, wrapped"])
@pytest.mark.parametrize(
    ("mutate", "check"), [pytest.param(m, c, id=name) for name, m, c in TAIL_BREAKAGES]
)
def test_broken_logits_results_are_caught(
    mutate: Mutation, check: str, loaded_before: bool
) -> None:
    engine, _ = make(2, 4, mutate, loaded_before=loaded_before)
    request = PrefillRequest(
        request_id="p", session=session(), start_pos=0, inputs=hidden_bundle(3, 0, 2)
    )
    with pytest.raises(MalformedOutput) as caught:
        engine.prefill(request)
    assert caught.value.details["check"] == check


def test_all_rows_logits_positions_are_checked() -> None:
    engine, _ = make(0, 4, lambda r: msgspec.structs.replace(r, first_pos=2))
    request = msgspec.structs.replace(head_prefill(3), logits="all")
    with pytest.raises(MalformedOutput, match="position"):
        engine.prefill(request)


# ----------------------------------------------------------------------------- broken batches


def batch_request() -> DecodeBatchRequest:
    return DecodeBatchRequest(
        request_id="batch",
        items=tuple(
            DecodeRequest(
                request_id=f"i{n}", session=session(f"s{n}"), pos=1,
                inputs=TokenInput(token_ids=(1,)),
            )
            for n in range(3)
        ),
    )  # fmt: skip


def prime(engine: ValidatingEngine) -> None:
    for n in range(3):
        engine.prefill(
            PrefillRequest(request_id=f"p{n}", session=session(f"s{n}"), start_pos=0,
                           inputs=TokenInput(token_ids=(1,)))
        )  # fmt: skip


def _items(change: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Mutation:
    return lambda r: msgspec.structs.replace(r, items=change(r.items))


BATCH_BREAKAGES: list[tuple[str, Mutation, str]] = [
    ("not a batch", lambda r: r.items[0], "result_type"),
    ("batch id", lambda r: msgspec.structs.replace(r, request_id="x"), "request_id"),
    ("missing item", _items(lambda items: items[:-1]), "batch_count"),
    ("extra item", _items(lambda items: (*items, items[0])), "batch_count"),
]  # fmt: skip

# A bad entry fails only its own item: the other items committed and are handed on.
BATCH_ITEM_BREAKAGES: list[tuple[str, Mutation, dict[int, str]]] = [
    ("reordered", _items(lambda items: items[::-1]), {0: "request_id", 2: "request_id"}),
    ("item not a result", _items(lambda items: (*items[:2], "text")), {2: "result_type"}),
    ("bad item", _items(lambda items: (items[0], replace_bundle(layer=9)(items[1]), items[2])),
     {1: "layer"}),
    ("wrong dtype", _items(lambda items: (rebuild_bundle(lambda v: v, "f16")(items[0]),
                                           *items[1:])), {0: "dtype"}),
    ("field type", _items(lambda items: (*items[:2], msgspec.structs.replace(items[2],
                                                                             first_pos=1.0))),
     {2: "result_fields"}),
    ("bad error entry", _items(lambda items: (*items[:2], ErrorInfo(code="x", message="m",
                                                                     retryable="no"))),  # type: ignore[arg-type]
     {2: "error_fields"}),
    ("endless error message", _items(lambda items: (*items[:2], ErrorInfo(
        code="x", message="m" * 8193, retryable=False))), {2: "error_fields"}),
    ("endless error detail", _items(lambda items: (*items[:2], ErrorInfo(
        code="x", message="m", retryable=False, details={"d": "v" * 8193}))), {2: "error_fields"}),
    ("too many error details", _items(lambda items: (*items[:2], ErrorInfo(
        code="x", message="m", retryable=False, details={f"d{i}": i for i in range(65)}))),
     {2: "error_fields"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "bad"), [pytest.param(m, b, id=name) for name, m, b in BATCH_ITEM_BREAKAGES]
)
@pytest.mark.parametrize("loaded_before", [False, True], ids=["wrapped, loaded", "loaded, wrapped"])
def test_bad_batch_items_fail_alone(
    mutate: Mutation, bad: dict[int, str], loaded_before: bool
) -> None:
    engine, tamper = make(0, 2, loaded_before=loaded_before)
    prime(engine)
    tamper.mutate = mutate
    result = engine.decode_batch(batch_request())
    for index, outcome in enumerate(result.items):
        if index in bad:
            assert isinstance(outcome, ErrorInfo)
            assert outcome.code == "malformed_output"
            assert outcome.details == {"check": bad[index], "item": index}
            assert outcome.message.startswith(f"batch item {index}: {bad[index]}:")
        else:
            assert isinstance(tamper.last, DecodeBatchResult)
            assert outcome is tamper.last.items[index]
    assert engine.metrics().decode_tokens == 3


@pytest.mark.parametrize(
    ("mutate", "check"), [pytest.param(m, c, id=name) for name, m, c in BATCH_BREAKAGES]
)
def test_broken_batches_are_caught(mutate: Mutation, check: str) -> None:
    engine, tamper = make(0, 2)
    prime(engine)
    tamper.mutate = mutate
    with pytest.raises(MalformedOutput) as caught:
        engine.decode_batch(batch_request())
    assert caught.value.details["check"] == check


def test_bad_batch_item_names_its_index() -> None:
    engine, tamper = make(0, 2)
    prime(engine)
    tamper.mutate = _items(lambda items: (items[0], items[1], replace_bundle(checksum=0)(items[2])))
    outcome = engine.decode_batch(batch_request()).items[2]
    assert isinstance(outcome, ErrorInfo)
    assert outcome.message.startswith("batch item 2: checksum:")
    assert outcome.details == {"check": "checksum", "item": 2}


@pytest.mark.parametrize("method", ["cancel", "release"])
def test_wrong_result_types_of_cancel_and_release(method: str) -> None:
    engine, tamper = make(0, 2)
    engine.prefill(head_prefill())
    tamper.mutate = lambda r: Health(state="ready")
    call: Callable[[], object] = (
        (lambda: engine.cancel(CancelRequest(request_id="x")))
        if method == "cancel"
        else (lambda: engine.release(ReleaseRequest(session=session())))
    )
    with pytest.raises(MalformedOutput, match="result_type"):
        call()


def _unchecked(struct: Any, **fields: object) -> Any:
    """A copy of ``struct`` holding values its constructor refuses, as a broken engine's C
    code can build (the slot descriptors write past the frozen guard)."""
    made = msgspec.structs.replace(struct)
    for name, value in fields.items():
        type(made).__dict__[name].__set__(made, value)
    return made


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"n_requests": -1}, "result_fields"),
        ({"n_requests": 2**70}, "result_fields"),
        ({"cancelled": "yes"}, "result_fields"),
        ({"cancelled": 1, "n_requests": 1}, "result_fields"),
        ({"cancelled": True, "n_requests": 0}, "cancel_count"),
        ({"cancelled": False, "n_requests": 3}, "cancel_count"),
        ({"cancelled": True, "n_requests": 2}, "cancel_count"),  # one request id, two stopped
    ],
)
def test_broken_cancel_results_are_caught(fields: dict[str, object], check: str) -> None:
    engine, tamper = make(0, 2)
    tamper.mutate = lambda r: _unchecked(r, **fields)
    with pytest.raises(MalformedOutput) as caught:
        engine.cancel(CancelRequest(request_id="x"))
    assert caught.value.details["check"] == check


def test_a_session_cancel_may_stop_several_requests() -> None:
    """Cancelling by session stops each of its in-flight requests: any count is honest."""
    engine, tamper = make(0, 2)
    tamper.mutate = lambda r: _unchecked(r, cancelled=True, n_requests=3)
    assert engine.cancel(CancelRequest(session_id="s")).n_requests == 3


@pytest.mark.parametrize(
    "fields", [{"released": "no"}, {"detail": None}, {"detail": 5}, {"detail": "x" * 16385}]
)
def test_broken_release_results_are_caught(fields: dict[str, object]) -> None:
    engine, tamper = make(0, 2)
    engine.prefill(head_prefill())
    tamper.mutate = lambda r: _unchecked(r, **fields)
    with pytest.raises(MalformedOutput) as caught:
        engine.release(ReleaseRequest(session=session()))
    assert caught.value.details["check"] == "result_fields"


def _raise(error: Exception) -> Callable[[], Any]:
    def call() -> Any:
        raise error

    return call


@pytest.mark.parametrize(
    ("method", "replacement", "check"),
    [
        ("health", _raise(ValueError("boom")), "exception_type"),
        ("health", Metrics, "result_type"),
        ("health", lambda: _unchecked(Health(state="ready"), state="fine"), "result_fields"),
        ("health", lambda: _unchecked(Health(state="ready"), sessions=1.5), "result_fields"),
        ("metrics", _raise(RuntimeError("boom")), "exception_type"),
        ("metrics", lambda: Health(state="ready"), "result_type"),
        ("metrics", lambda: _unchecked(Metrics(), errors={"x": "1"}), "result_fields"),
        ("health", _raise(InvalidRequest("health never raises")), "exception_type"),
        ("close", _raise(OSError("boom")), "exception_type"),
    ],
)
def test_broken_health_metrics_and_close_are_caught(
    monkeypatch: pytest.MonkeyPatch, method: str, replacement: Callable[[], Any], check: str
) -> None:
    """A worker polling a broken engine gets a typed MalformedOutput, not a stray exception
    or a Health it cannot read."""
    engine, tamper = make(0, 2)
    monkeypatch.setattr(tamper, method, replacement)
    with pytest.raises(MalformedOutput) as caught:
        getattr(engine, method)()
    assert caught.value.details["check"] == check


_HEALTH_LIES: list[tuple[dict[str, object], str]] = [
    ({"sessions": -1}, "result_fields"),
    ({"in_flight": -5}, "result_fields"),
    ({"kv_used_tokens": 2**80}, "result_fields"),
    ({"kv_budget_tokens": 2**63}, "result_fields"),
    ({"sessions": True}, "result_fields"),
    ({"detail": "d" * 16385}, "result_fields"),
    ({"sessions": 17}, "health_bounds"),  # max_sessions is 16
    ({"kv_used_tokens": 16385}, "health_bounds"),  # the configured budget is 16384
    ({"kv_budget_tokens": 1 << 20}, "health_bounds"),
]
_METRICS_LIES: list[tuple[dict[str, object], str]] = [
    ({"requests": -1}, "result_fields"),
    ({"decode_tokens": 2**80}, "result_fields"),
    ({"fences_dropped": 2**64}, "result_fields"),
    ({"compute_ms": math.nan}, "result_fields"),
    ({"compute_ms": -1.0}, "result_fields"),
    ({"compute_ms": math.inf}, "result_fields"),
    ({"compute_ms": 2**70}, "result_fields"),
    ({"errors": {"cache_miss": -2}}, "result_fields"),
    ({"errors": {"": 1}}, "result_fields"),
    ({"errors": {f"code{i}": 1 for i in range(257)}}, "result_fields"),
    ({"sessions_active": 17}, "metrics_bounds"),
    ({"kv_used_tokens": 16385}, "metrics_bounds"),
]


@pytest.mark.parametrize(("fields", "check"), _HEALTH_LIES)
def test_health_out_of_bounds_is_malformed(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, object], check: str
) -> None:
    """A lying engine's health (a negative or beyond-64-bit count, more sessions than
    max_sessions, a budget or usage above the configured KV budget) is MalformedOutput at the
    wrapper, and the same values do not decode from the wire."""
    engine, tamper = make(0, 2)
    honest = tamper.health()
    monkeypatch.setattr(tamper, "health", lambda: _unchecked(honest, **fields))
    with pytest.raises(MalformedOutput) as caught:
        engine.health()
    assert caught.value.details["check"] == check
    lie = _encodable({"type": "health", "state": "ready", **fields})
    if check == "result_fields" and fields != {"sessions": True} and lie is not None:
        with pytest.raises(InvalidRequest):
            decode_message(lie)


@pytest.mark.parametrize(("fields", "check"), _METRICS_LIES)
def test_metrics_out_of_bounds_are_malformed(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, object], check: str
) -> None:
    """As for health: counters are non-negative 64-bit integers, compute_ms a finite duration,
    error codes non-empty and few, and nothing exceeds the advertised limits."""
    engine, tamper = make(0, 2)
    monkeypatch.setattr(tamper, "metrics", lambda: _unchecked(Metrics(), **fields))
    with pytest.raises(MalformedOutput) as caught:
        engine.metrics()
    assert caught.value.details["check"] == check
    lie = _encodable({"type": "metrics", **fields})
    if check == "result_fields" and lie is not None:
        with pytest.raises(InvalidRequest):
            decode_message(lie)


def _encodable(message: dict[str, object]) -> bytes | None:
    """``message`` as msgpack, or None when msgpack cannot carry it (beyond 64 bits)."""
    try:
        return msgspec.msgpack.encode(message)
    except OverflowError:
        return None


def test_health_and_metrics_of_a_busy_engine_pass() -> None:
    """An honest engine at its limits passes: a full KV budget, every session slot used."""
    engine = ValidatingEngine(TinyEngine())
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=N_LAYERS, start=0, end=N_LAYERS),
                           max_sessions=2, kv_budget_tokens=6))  # fmt: skip
    for n in range(2):
        engine.prefill(
            PrefillRequest(request_id=f"r{n}", session=session(f"s{n}"), start_pos=0,
                           inputs=TokenInput(token_ids=(1, 2, 3)))
        )  # fmt: skip
    health = engine.health()
    assert (health.sessions, health.kv_used_tokens, health.kv_budget_tokens) == (2, 6, 6)
    metrics = engine.metrics()
    assert (metrics.sessions_active, metrics.kv_used_tokens) == (2, 6)
    assert decode_message(encode(health)) == health
    assert decode_message(encode(metrics)) == metrics


def test_a_payload_the_engine_can_still_write_is_copied_before_it_is_checked() -> None:
    """An engine that hands out a writable buffer and writes it again later (a reused output
    buffer) cannot change, or make invalid, a result the wrapper already checked."""
    buffers: list[bytearray] = []

    def writable(result: Any) -> Any:
        buffer = bytearray(bytes(result.payload))
        buffers.append(buffer)
        return _unchecked(result, payload=memoryview(buffer))

    engine, tamper = make(0, N_LAYERS, writable)
    result = engine.prefill(head_prefill())
    assert isinstance(result, LogitsResult)
    assert result.payload.readonly
    kept = np.array(result.array())
    buffers[0][:] = bytes(len(buffers[0]))
    np.testing.assert_array_equal(result.array(), kept)

    def writable_bundle(result: Any) -> Any:
        buffer = bytearray(bytes(result.bundle.payload))
        buffers.append(buffer)
        return msgspec.structs.replace(
            result, bundle=_unchecked(result.bundle, payload=memoryview(buffer))
        )

    head, _ = make(0, 2, writable_bundle)
    boundary = head.prefill(head_prefill())
    assert isinstance(boundary, BoundaryResult)
    assert boundary.bundle.payload.readonly
    kept = np.array(boundary.bundle.array())
    buffers[-1][:] = b"\xff" * len(buffers[-1])
    np.testing.assert_array_equal(boundary.bundle.array(), kept)

    def writable_items(result: Any) -> Any:
        return msgspec.structs.replace(result, items=tuple(writable(i) for i in result.items))

    tail, tamper = make(0, N_LAYERS)
    prime(tail)
    tamper.mutate = writable_items
    batch = tail.decode_batch(batch_request())
    assert all(isinstance(i, LogitsResult) and i.payload.readonly for i in batch.items)
    kept_rows = [np.array(i.array()) for i in batch.items if isinstance(i, LogitsResult)]
    for buffer in buffers[-3:]:
        buffer[:] = bytes(len(buffer))
    for item, rows in zip(batch.items, kept_rows, strict=True):
        assert isinstance(item, LogitsResult)
        np.testing.assert_array_equal(item.array(), rows)


# ----------------------------------------------------------------------------- capabilities


def _caps_change(**changes: Any) -> Callable[[Capabilities], Capabilities]:
    return lambda caps: msgspec.structs.replace(caps, **changes)


CAPABILITY_BREAKAGES: list[tuple[str, Callable[[Capabilities], Capabilities], str]] = [
    ("version", _caps_change(contract_version=99), "contract_version"),
    ("role", _caps_change(role="tail"), "role"),
    ("shard", _caps_change(shard=ShardSpec(model="tiny", n_layers=4, start=0, end=3)), "shard"),
    ("evidence", _caps_change(evidence="certified"), "evidence"),
    ("hidden", _caps_change(hidden_size=0), "shape"),
    ("dtypes", _caps_change(boundary_dtypes=("f16",)), "dtype"),
    ("dtype names", _caps_change(boundary_dtypes=("f32", "f8")), "dtype"),
    ("no sessions", lambda caps: msgspec.structs.replace(
        caps, limits=msgspec.structs.replace(caps.limits, max_sessions=0)), "limits"),
    ("NaN cancel latency", lambda caps: msgspec.structs.replace(
        caps, features=Features(cancel_latency_ms=math.nan)), "cancel_latency"),
    ("negative cancel latency", lambda caps: msgspec.structs.replace(
        caps, features=Features(cancel_latency_ms=-5.0)), "cancel_latency"),
    ("infinite cancel latency", lambda caps: msgspec.structs.replace(
        caps, features=Features(cancel_latency_ms=math.inf)), "cancel_latency"),
    ("endless engine name", _caps_change(engine="e" * 257), "capabilities_fields"),
    ("endless engine version", _caps_change(engine_version="v" * 257), "capabilities_fields"),
    ("endless dtype list", _caps_change(boundary_dtypes=("f32",) * 17), "capabilities_fields"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "check"), [pytest.param(c, k, id=name) for name, c, k in CAPABILITY_BREAKAGES]
)
def test_broken_capabilities_are_caught_at_load(
    change: Callable[[Capabilities], Capabilities], check: str
) -> None:
    inner = TinyEngine()
    tamper = Tamper(inner)
    probe = TinyEngine()
    tamper.capabilities_override = change(probe.load(config(0, 2)))
    with pytest.raises(MalformedOutput) as caught:
        ValidatingEngine(tamper).load(config(0, 2))
    assert caught.value.details["check"] == check


def test_capabilities_must_not_change_after_load() -> None:
    engine, tamper = make(0, 2)
    tamper.capabilities_override = msgspec.structs.replace(
        engine.capabilities(), engine_version="2"
    )
    with pytest.raises(MalformedOutput, match="capabilities_changed"):
        engine.capabilities()


def test_an_engine_that_does_not_report_its_dtype_gets_its_first_dtype_pinned() -> None:
    # Capabilities from an engine that predates Capabilities.boundary_dtype: the first bundle's
    # dtype becomes the one every later bundle must carry.
    tamper = Tamper(TinyEngine())
    capabilities = tamper.load(config(0, 2))
    tamper.capabilities_override = msgspec.structs.replace(capabilities, boundary_dtype=None)
    engine = ValidatingEngine(tamper)
    engine.prefill(head_prefill())
    tamper.mutate = rebuild_bundle(lambda v: v, "f16")
    with pytest.raises(MalformedOutput) as caught:
        engine.decode(
            DecodeRequest(
                request_id="d", session=session(), pos=3, inputs=TokenInput(token_ids=(1,))
            )
        )
    assert caught.value.details["check"] == "dtype"


def test_capabilities_with_fields_of_the_wrong_type_are_caught() -> None:
    tamper = Tamper(TinyEngine())
    capabilities = tamper.load(config(0, 2))
    tamper.capabilities_override = msgspec.structs.replace(capabilities, hidden_size="8")
    with pytest.raises(MalformedOutput) as caught:
        ValidatingEngine(tamper).capabilities()
    assert caught.value.details["check"] == "capabilities_fields"


def test_requests_are_checked_for_an_engine_that_does_not_check_them() -> None:
    # Tamper is not an EngineCore: the wrapper is its edge, so a badly typed request never
    # reaches it (and the wrapper does not trip over the request's fields itself).
    engine, tamper = make(0, 2)
    bad = PrefillRequest(request_id="p", session=session(), start_pos=0, inputs=None)  # type: ignore[arg-type]
    tamper.last = "untouched"
    with pytest.raises(InvalidRequest) as caught:
        engine.prefill(bad)
    assert caught.value.details["field"] == "PrefillRequest.inputs"
    assert tamper.last == "untouched"
    with pytest.raises(InvalidRequest, match="items"):
        engine.decode_batch(DecodeBatchRequest(request_id="b", items=None))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="session"):
        engine.release(ReleaseRequest(session=None))  # type: ignore[arg-type]


@pytest.mark.parametrize("inner", [None, "fake", object()])
def test_wrapping_what_is_not_an_engine_is_invalid_request(inner: object) -> None:
    """It used to be accepted, then every call ended as MalformedOutput."""
    with pytest.raises(InvalidRequest):
        ValidatingEngine(inner)  # type: ignore[arg-type]
