"""One boundary-check module, three consumers: the same defect of a bundle gets the same named
violation from the engine core (as input), the codec (as bytes) and ValidatingEngine (as a
result), each mapped to its own error; and a payload is scanned once per hop."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pytest
from conformance_engines import ReferenceEngine, reference_fixture

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    Capabilities,
    ChecksumMismatch,
    ContractVersionMismatch,
    DecodeRequest,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    MalformedOutput,
    MtpState,
    PrefillRequest,
    SessionRef,
    ShardEngineError,
    ShardMismatch,
    ShardResult,
    ShardSpec,
    TokenInput,
    UnsupportedFeature,
    ValidatingEngine,
)
from shard_engine_api import _bundle_checks as boundary
from shard_engine_api import _results as results
from shard_engine_api._bundle_checks import BundleExpectation, ViolationKind, check_bundle
from shard_engine_api._dtypes import checksum_and_finite, payload_finite
from shard_engine_api.wire import Codec, encode

N_LAYERS: Final = 4
SESSION: Final = SessionRef(session_id="s", epoch=1)


@pytest.fixture(scope="module")
def model_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield Path(reference_fixture(Path(folder), n_layers=N_LAYERS).model)


def load(model: Path, start: int, end: int, engine: ReferenceEngine | None = None) -> Any:
    engine = engine or ReferenceEngine()
    spec = ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=end)
    engine.load(LoadConfig(shard=spec))
    return engine


class HandsOnBundle(ReferenceEngine):
    """A head shard that hands on ``replacement`` as its result's bundle."""

    replacement: BoundaryBundle | None = None

    def prefill(self, request: PrefillRequest) -> ShardResult:
        result = super().prefill(request)
        assert isinstance(result, BoundaryResult)
        if self.replacement is None:
            return result
        return msgspec.structs.replace(result, bundle=self.replacement)


def good_bundle(caps: Capabilities, rows: int = 2, layer: int = 2) -> BoundaryBundle:
    return BoundaryBundle.from_array(
        np.full((rows, caps.hidden_size), 0.5, dtype=np.float32),
        session=SESSION,
        first_pos=0,
        layer=layer,
        model_fingerprint=caps.model_fingerprint,
    )


def _rebuilt(bundle: BoundaryBundle, values: np.ndarray) -> BoundaryBundle:
    return BoundaryBundle.from_array(
        values,
        session=bundle.session,
        first_pos=bundle.first_pos,
        layer=bundle.layer,
        model_fingerprint=bundle.model_fingerprint,
    )


def _with_nan(bundle: BoundaryBundle) -> BoundaryBundle:
    values = bundle.array().copy()
    values[-1, -1] = np.nan
    return _rebuilt(bundle, values)


Defect = Callable[[BoundaryBundle], BoundaryBundle]
DEFECTS: Final[list[tuple[str, Defect, ViolationKind, type[ShardEngineError]]]] = [
    ("contract version",
     lambda b: msgspec.structs.replace(b, contract_version=CONTRACT_VERSION + 1),
     ViolationKind.CONTRACT_VERSION, ContractVersionMismatch),
    ("reserved mtp", lambda b: msgspec.structs.replace(b, mtp=(MtpState(n_draft_tokens=1),)),
     ViolationKind.RESERVED, UnsupportedFeature),
    ("no rows", lambda b: msgspec.structs.replace(b, n_tokens=0), ViolationKind.HEADER,
     InvalidRequest),
    ("layer 0", lambda b: msgspec.structs.replace(b, layer=0), ViolationKind.LAYER,
     ShardMismatch),
    ("layer one below the start", lambda b: msgspec.structs.replace(b, layer=1),
     ViolationKind.LAYER, ShardMismatch),
    ("hidden size", lambda b: _rebuilt(b, np.hstack([b.array(), b.array()])),
     ViolationKind.HIDDEN_SIZE, ShardMismatch),
    ("fingerprint", lambda b: msgspec.structs.replace(b, model_fingerprint="other"),
     ViolationKind.FINGERPRINT, ShardMismatch),
    ("empty fingerprint", lambda b: msgspec.structs.replace(b, model_fingerprint=""),
     ViolationKind.FINGERPRINT, ShardMismatch),
    ("layer", lambda b: msgspec.structs.replace(b, layer=3), ViolationKind.LAYER, ShardMismatch),
    ("short payload", lambda b: msgspec.structs.replace(b, payload=b.payload[:-4]),
     ViolationKind.PAYLOAD_LENGTH, InvalidRequest),
    ("checksum", lambda b: msgspec.structs.replace(b, checksum=b.checksum ^ 1),
     ViolationKind.CHECKSUM, ChecksumMismatch),
    ("non-finite", _with_nan, ViolationKind.FINITE, InvalidRequest),
]  # fmt: skip
IDS: Final = [name for name, *_ in DEFECTS]


@pytest.mark.parametrize(("defect", "kind", "error"), [d[1:] for d in DEFECTS], ids=IDS)
def test_core_codec_and_wrapper_name_the_same_violation(
    model_path: Path, defect: Defect, kind: ViolationKind, error: type[ShardEngineError]
) -> None:
    tail = load(model_path, 2, N_LAYERS)
    caps = tail.capabilities()
    bad = defect(good_bundle(caps))

    # The core, receiving it as input.
    request = PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=bad)
    with pytest.raises(ShardEngineError) as by_core:
        tail.prefill(request)
    assert type(by_core.value) is error
    assert by_core.value.details["violation"] == kind.value
    assert tail.metrics().prefill_requests == 1
    assert tail.health().sessions == 0

    # The codec, receiving it as bytes.
    codec = Codec(
        expected_fingerprint=caps.model_fingerprint, expected_layer=2, expected_hidden_size=8
    )
    with pytest.raises(ShardEngineError) as by_codec:
        codec.decode_bundle(encode(bad))
    assert type(by_codec.value) is error
    assert by_codec.value.details["violation"] == kind.value

    # ValidatingEngine, handed it as a head shard's result.
    head = HandsOnBundle()
    wrapped = ValidatingEngine(head)
    load(model_path, 0, 2, engine=head)
    head.replacement = bad
    tokens = TokenInput(token_ids=(1, 2))
    with pytest.raises(MalformedOutput) as by_wrapper:
        wrapped.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=tokens))
    assert by_wrapper.value.details["check"] == kind.value


def test_the_request_context_is_checked_too(model_path: Path) -> None:
    tail = load(model_path, 2, N_LAYERS)
    bundle = good_bundle(tail.capabilities())
    expect = BundleExpectation()
    other = SessionRef(session_id="o", epoch=1)
    cases = [
        (check_bundle(bundle, expect, session=other), ViolationKind.SESSION),
        (check_bundle(bundle, expect, first_pos=1), ViolationKind.POSITION),
        (check_bundle(bundle, expect, n_tokens=1), ViolationKind.ROWS),
        (check_bundle(bundle, BundleExpectation(dtypes=frozenset({"f16"}))), ViolationKind.DTYPE),
        (check_bundle(bundle, BundleExpectation(max_payload_bytes=8)), ViolationKind.PAYLOAD_LIMIT),
    ]
    for violation, kind in cases:
        assert violation is not None
        assert violation.kind is kind
    assert check_bundle(bundle, expect) is None


# ----------------------------------------------------------------------------- one scan per hop


class Scans:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checksums = 0
        self.finite = 0
        verify, finite = boundary.verify_payload, payload_finite

        def counted_verify(payload: Any, checksum: int, finite_kind: int) -> int:
            # One pass that verifies the checksum and (for a non-zero kind) finiteness.
            self.checksums += 1
            self.finite += bool(finite_kind)
            return verify(payload, checksum, finite_kind)

        def counted_finite(payload: Any, dtype: Any) -> bool:
            self.finite += 1
            return finite(payload, dtype)

        monkeypatch.setattr(boundary, "verify_payload", counted_verify)
        monkeypatch.setattr(boundary, "payload_finite", counted_finite)
        # The core checks the finiteness of the results it builds (and marks them): with
        # their checksum, in one pass.
        self.built = 0
        built_both = checksum_and_finite

        def counted_built_both(payload: Any, dtype: Any) -> tuple[int, bool]:
            self.built += 1
            return built_both(payload, dtype)

        monkeypatch.setattr(results, "checksum_and_finite", counted_built_both)


def test_a_decoded_bundle_is_scanned_once_per_hop(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tail = load(model_path, 2, N_LAYERS)
    buf = encode(good_bundle(tail.capabilities()))
    scans = Scans(monkeypatch)
    bundle = Codec().decode_bundle(buf)
    assert (scans.checksums, scans.finite) == (1, 1)
    tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=bundle))
    assert (scans.checksums, scans.finite) == (1, 1), "the core scanned a verified bundle again"


def test_a_bundle_checked_by_the_wrapper_is_not_rescanned_by_the_next_core(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = ValidatingEngine(load(model_path, 0, 2))
    tail = load(model_path, 2, N_LAYERS)
    scans = Scans(monkeypatch)
    tokens = TokenInput(token_ids=(1, 2, 3))
    result = head.prefill(
        PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=tokens)
    )
    assert isinstance(result, BoundaryResult)
    # from_array computed the checksum and the core checked finiteness as it built the
    # bundle: the wrapper scans nothing again.
    assert (scans.checksums, scans.finite, scans.built) == (0, 0, 1)
    tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=result.bundle))
    # Neither does the next core; it only checks the logits it builds.
    assert (scans.checksums, scans.finite, scans.built) == (0, 0, 2)


def test_a_bundle_over_a_mutable_buffer_is_always_rescanned(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tail = load(model_path, 2, N_LAYERS)
    buf = bytearray(encode(good_bundle(tail.capabilities())))
    scans = Scans(monkeypatch)
    bundle = Codec().decode_bundle(buf)
    tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=bundle))
    assert (scans.checksums, scans.finite) == (2, 2)


def test_each_received_bundle_is_scanned_once_on_the_decode_path(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's tail: every decode step receives a bundle from the wire, decodes it with the
    # codec and hands it to its (validated) engine. Each bundle's payload is read once for
    # its checksum and once for finiteness, by the codec; neither the wrapper nor the core
    # reads it again.
    tail = ValidatingEngine(load(model_path, 2, N_LAYERS))
    caps = tail.capabilities()
    codec = Codec()
    rows = np.full((1, caps.hidden_size), 0.25, dtype=np.float32)

    def received(pos: int) -> BoundaryBundle:
        bundle = BoundaryBundle.from_array(
            rows, session=SESSION, first_pos=pos, layer=2, model_fingerprint=caps.model_fingerprint
        )
        return codec.decode_bundle(encode(bundle))

    tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=received(0)))
    scans = Scans(monkeypatch)
    steps = 5
    for pos in range(1, steps + 1):
        bundle = received(pos)
        assert (scans.checksums, scans.finite) == (pos, pos)
        result = tail.decode(DecodeRequest(request_id="d", session=SESSION, pos=pos, inputs=bundle))
        assert isinstance(result, LogitsResult)
        assert (scans.checksums, scans.finite) == (pos, pos), "a received bundle was rescanned"
    # The logits of each step are checked for finiteness once, by the core that built them.
    assert scans.built == steps


def test_a_pipeline_scans_each_boundary_once_per_decode_step(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In one process the head's result bundle is the tail's input: built and checked once by
    # the head's core, then neither wrapper nor the tail's core reads it again.
    head = ValidatingEngine(load(model_path, 0, 2))
    tail = ValidatingEngine(load(model_path, 2, N_LAYERS))
    token = TokenInput(token_ids=(1,))
    first = head.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=token))
    assert isinstance(first, BoundaryResult)
    tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=first.bundle))
    scans = Scans(monkeypatch)
    for pos in range(1, 4):
        hidden = head.decode(DecodeRequest(request_id="d", session=SESSION, pos=pos, inputs=token))
        assert isinstance(hidden, BoundaryResult)
        tail.decode(DecodeRequest(request_id="d", session=SESSION, pos=pos, inputs=hidden.bundle))
        # Per step: the head's bundle and the tail's logits, each checked once as it was built.
        assert (scans.checksums, scans.finite, scans.built) == (0, 0, 2 * pos)


def test_a_changed_copy_carries_no_mark(model_path: Path) -> None:
    tail = load(model_path, 2, N_LAYERS)
    bundle = Codec().decode_bundle(encode(good_bundle(tail.capabilities())))
    tampered = msgspec.structs.replace(bundle, checksum=bundle.checksum ^ 1)
    with pytest.raises(ChecksumMismatch):
        tail.prefill(PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=tampered))
