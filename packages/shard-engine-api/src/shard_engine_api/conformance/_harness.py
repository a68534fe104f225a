"""The helpers the standard tests are written with: load engines for layer ranges, make
requests with unique ids, run pipelines of shards, compare outputs by the engine's declared
determinism, and cancel from another thread.

:class:`SuiteHelpers` is the base of every test mixin of the suite: the helpers tests of
several subjects share (skips for a missing capability, declared exactness, batch items,
committed lengths, long sessions, pipeline inputs). The private module-level helpers
(``_raises``, ``_rows``, ``_PROMPT``, ...) are likewise shared by the suite's test modules and
live only here."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NoReturn

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    InvalidRequest,
    ShardEngineError,
    UnsupportedFeature,
)
from shard_engine_api._hookspecs import ModelFixture
from shard_engine_api._pipeline import Pipeline
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._typecheck import check_request, result_ok
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    LoadConfig,
    LogitsMode,
    LogitsResult,
    OptionValue,
    OutputKind,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    ShardInput,
    ShardResult,
    Timings,
    TokenInput,
    Tolerance,
)
from shard_engine_api.conformance._recorder import SuiteRecord, suite_skip
from shard_engine_api.conformance._report import DeclaredValue

__all__ = [
    "IN_FLIGHT_GRACE_S",
    "Canceller",
    "EngineUnderTest",
    "Harness",
    "SuiteHelpers",
    "Tolerances",
    "assert_cancelled",
    "assert_matches",
    "assert_timings",
    "assert_well_typed",
    "split_ranges",
]


@dataclass(frozen=True, slots=True)
class EngineUnderTest:
    """What one suite class runs against: a factory of new unloaded engines, the model
    fixture they load, and the record the report is built from."""

    name: str
    fixture: ModelFixture
    factory: Callable[[], ShardEngine]
    record: SuiteRecord
    cancel_load_options: Mapping[str, OptionValue]


def split_ranges(n_layers: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous layer ranges covering ``[0, n_layers)``, the first ones one layer
    shorter when it does not divide (uneven splits are the interesting ones)."""
    base, extra = divmod(n_layers, parts)
    sizes = [base] * (parts - extra) + [base + 1] * extra
    ranges: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass(frozen=True, slots=True)
class Tolerances:
    """The tolerance an engine declared for each output kind, and the record the measured
    differences go to (the report shows them next to the declaration)."""

    logits: Tolerance
    hidden: Tolerance
    record: SuiteRecord | None = None

    @classmethod
    def declared(cls, determinism: Determinism, record: SuiteRecord | None = None) -> Tolerances:
        return cls(
            logits=determinism.tolerance_for("logits"),
            hidden=determinism.tolerance_for("hidden"),
            record=record,
        )

    def of(self, kind: OutputKind) -> Tolerance:
        return self.logits if kind == "logits" else self.hidden


def assert_cancelled(error: Cancelled, what: str) -> None:
    """A cancelled operation raised the contract's Cancelled itself, retryable: the call changed
    nothing, so re-issuing it can succeed (a worker that sees retryable=False gives up on a
    request that a retry would have served)."""
    assert type(error) is Cancelled, f"{what}: raised {type(error).__name__}, not Cancelled"
    assert error.code == Cancelled.code, f"{what}: Cancelled with code {error.code!r}"
    assert error.retryable, f"{what}: Cancelled.retryable is False; the contract says True"


def assert_well_typed(result: object, what: str) -> None:
    """``result`` is exactly a BoundaryResult or LogitsResult whose every field has its
    declared type and bounds: what ``ValidatingEngine`` and the codec's decoders require of
    it. A numpy scalar where an int or float belongs (``np.float64`` timings, ``np.int64``
    positions), a str subclass, a bool position compare equal to the right values, so no other
    check sees them; a worker's ValidatingEngine refuses every such result as MalformedOutput."""
    kind = type(result)
    assert kind in (BoundaryResult, LogitsResult), (
        f"{what} is a {kind.__name__}, not exactly a BoundaryResult or LogitsResult"
    )
    if result_ok(result):
        return
    try:
        check_request(result, kind)
    except InvalidRequest as error:
        raise AssertionError(f"{what} has a field of the wrong type: {error.message}") from None


def assert_timings(timings: Timings, what: str) -> None:
    """Timings are wall-clock milliseconds: finite and >= 0 (a negative or NaN duration comes
    from mixing clocks or from an unset start, and breaks every latency figure a worker keeps),
    and the whole call (``total_ms``) lasts at least as long as each of its parts (waiting,
    ``queue_ms``, and computing, ``compute_ms``): a total of 0 or one measured on another
    clock makes every latency a worker derives from it wrong."""
    for name in ("queue_ms", "compute_ms", "total_ms"):
        value = getattr(timings, name)
        assert math.isfinite(value), f"{what}: timings.{name} is {value!r}, not finite"
        assert value >= 0, f"{what}: timings.{name} is {value!r}; durations are >= 0"
    for part in ("queue_ms", "compute_ms"):
        value = getattr(timings, part)
        # A relative slack of 1e-9 for a total rounded after its parts (the same durations).
        assert timings.total_ms >= value * (1.0 - 1e-9), (
            f"{what}: timings.total_ms is {timings.total_ms!r}, less than timings.{part} "
            f"{value!r}; the whole call lasts at least as long as each of its parts"
        )


def assert_matches(
    actual: npt.NDArray[np.floating],
    expected: npt.NDArray[np.floating],
    *,
    exact: bool,
    tolerance: Tolerances,
    what: str,
    kind: OutputKind = "logits",
) -> None:
    """Equal bytes when ``exact``; else equal shapes and, in every row, max |difference| <=
    the declared tolerance of ``kind`` (``absolute + relative * max |expected row|``), plus
    one unit in the last place for f16 values (a difference within the tolerance may round to
    the neighbouring f16 number). NaN or infinity on either side never matches (two NaNs are
    not equal outputs). Tolerance comparisons are recorded for the report."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape} != expected {expected.shape}")
    for side, values in (("output", actual), ("expected output", expected)):
        if not np.isfinite(values).all():
            raise AssertionError(
                f"{what}: the {side} holds NaN or infinity (outputs must be finite)"
            )
    if exact:
        if actual.tobytes() != expected.tobytes():
            difference = float(np.max(np.abs(actual.astype(np.float64) - expected)))
            raise AssertionError(
                f"{what}: not bit-identical although the engine declares exactness "
                f"(max |difference| = {difference:.3g})"
            )
        return
    if expected.size == 0:
        return
    want = np.atleast_2d(expected.astype(np.float64))
    gap = np.abs(np.atleast_2d(actual.astype(np.float64)) - want)
    if expected.dtype == np.float16:
        gap = np.maximum(gap - np.atleast_2d(np.spacing(np.abs(expected)).astype(np.float64)), 0.0)
    declared = tolerance.of(kind)
    row_gap = gap.reshape(len(want), -1).max(axis=1)
    magnitude = np.abs(want).reshape(len(want), -1).max(axis=1)
    bound = declared.absolute + declared.relative * magnitude
    tiny = np.finfo(np.float64).tiny
    fraction = np.where(
        bound > 0, row_gap / np.maximum(bound, tiny), np.where(row_gap > 0, np.inf, 0.0)
    )
    if tolerance.record is not None:
        tolerance.record.add_differences(
            kind,
            rows=len(row_gap),
            max_abs=float(row_gap.max()),
            max_relative=float((row_gap / np.maximum(magnitude, tiny)).max()),
            max_fraction=float(fraction.max()),
            max_magnitude=float(magnitude.max()),
        )
    worst = int(np.argmax(fraction))
    if not row_gap[worst] <= bound[worst]:
        raise AssertionError(
            f"{what}: row {worst}: max |difference| = {row_gap[worst]:.3g} exceeds the declared "
            f"{kind} tolerance {declared.absolute:.3g} + {declared.relative:.3g} x "
            f"{magnitude[worst]:.3g} (the row's magnitude) = {bound[worst]:.3g}"
        )


def assert_threads_match_serial(
    engine: ShardEngine,
    serial: ShardEngine,
    script: Callable[[ShardEngine, int], list[npt.NDArray[np.floating]]],
    n_threads: int,
    *,
    exact: bool,
    tolerance: Tolerances,
    join_s: float,
) -> None:
    """Run ``script(engine, i)`` on ``n_threads`` threads at once (released together by a
    barrier) and compare every output of thread ``i`` with ``script(serial, i)`` run first,
    one thread after another, on a fresh engine: exactly, or within ``tolerance``."""
    expected = [script(serial, index) for index in range(n_threads)]
    results: list[list[npt.NDArray[np.floating]] | BaseException | None] = [None] * n_threads
    barrier = threading.Barrier(n_threads)

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=10.0)
            results[index] = script(engine, index)
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            results[index] = error

    threads = [
        threading.Thread(target=worker, args=(index,), daemon=True) for index in range(n_threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_s)
    for index, outcome in enumerate(results):
        if isinstance(outcome, BaseException):
            raise AssertionError(f"thread {index} failed: {outcome!r}") from outcome
        assert outcome is not None, f"thread {index} did not finish in {join_s:g} s"
        for step, (have, want) in enumerate(zip(outcome, expected[index], strict=True)):
            assert_matches(
                have,
                want,
                exact=exact,
                tolerance=tolerance,
                what=f"thread {index} output {step} vs the serial run",
            )


def _declared(value: msgspec.Struct) -> dict[str, DeclaredValue]:
    """A declared capabilities struct as report fields (nested tolerances as mappings)."""
    fields = msgspec.to_builtins(value)
    assert isinstance(fields, dict)
    return fields


class Harness:
    """Per-test helper: every engine it loads is closed when the test ends."""

    def __init__(self, target: EngineUnderTest, test_name: str) -> None:
        self.target = target
        self.fixture = target.fixture
        self.record = target.record
        self._test_name = test_name
        self._engines: list[ShardEngine] = []
        self._ids = itertools.count()
        self._vocab_size: int | None = None

    @property
    def n_layers(self) -> int:
        return self.fixture.n_layers

    # ----------------------------------------------------------------- engines

    def config(self, start: int = 0, end: int | None = None, **overrides: object) -> LoadConfig:
        return self.fixture.config(start, end, **overrides)

    def new_engine(self) -> ShardEngine:
        """A new, unloaded engine (closed at the end of the test)."""
        engine = self.target.factory()
        self._engines.append(engine)
        return engine

    def load(self, start: int = 0, end: int | None = None, **overrides: object) -> ShardEngine:
        """A new engine loaded with layers ``[start, end)`` of the fixture model."""
        engine = self.new_engine()
        config = self.config(start, end, **overrides)
        caps = engine.load(config)
        self.note_capabilities(caps)
        self.record.add_shard(config.shard)
        return engine

    def note_capabilities(self, caps: Capabilities) -> None:
        record = self.record
        with record.lock:
            record.capability_evidence.add(caps.evidence)
            record.engine_version = caps.engine_version
            record.contract_version = caps.contract_version
            if not record.declared_determinism:
                record.declared_determinism = _declared(caps.determinism)
                record.declared_features = _declared(caps.features)
                record.boundary_dtypes = tuple(caps.boundary_dtypes)
        if self._vocab_size is None:
            self._vocab_size = caps.vocab_size

    def load_pipeline(self, parts: int, **overrides: object) -> list[ShardEngine]:
        return [
            self.load(start, end, **overrides) for start, end in split_ranges(self.n_layers, parts)
        ]

    def close_all(self) -> None:
        for engine in self._engines:
            engine.close()
        self._engines.clear()

    # ----------------------------------------------------------------- requests

    def request_id(self) -> str:
        return f"conformance-{self._test_name}-{next(self._ids)}"

    def session(self, name: str, epoch: int = 1) -> SessionRef:
        return SessionRef(session_id=f"{self._test_name}-{name}", epoch=epoch)

    def no_cancel_landed(self, what: str) -> NoReturn:
        """A cancellation test landed no cancel mid-operation. With the fixture's (or the suite
        class's) cancellation options the operations are slow enough to cancel, so that is a
        failure: ``health().in_flight`` did not count the running request, or ``cancel`` did not
        stop it. Without them the engine may simply be faster than the canceller: skipped."""
        if self.target.cancel_load_options:
            raise AssertionError(
                f"{what}, although the engine was loaded with the cancellation options "
                f"{dict(self.target.cancel_load_options)!r}, which must make operations slow "
                "enough to cancel mid-way: health().in_flight must count a running request and "
                "cancel() must stop it (Cancelled to its caller)"
            )
        suite_skip(f"{what}; supply cancellation options that slow the engine down")

    def tokens(self, n: int, seed: int) -> tuple[int, ...]:
        """``n`` token ids in the fixture's vocabulary, a different sequence for each seed."""
        if self._vocab_size is None:
            raise RuntimeError("load an engine before asking for tokens")
        vocab = self._vocab_size
        return tuple((seed * 7919 + index * 104729 + 17) % vocab for index in range(n))

    def observe(self, result: ShardResult) -> ShardResult:
        """Every result the suite sees is well typed (see :func:`assert_well_typed`) and feeds
        the report's evidence class."""
        assert_well_typed(result, "a result")
        self.record.add_result_evidence(result.evidence)
        return result

    def prefill(
        self,
        engine: ShardEngine,
        session: SessionRef,
        start_pos: int,
        inputs: ShardInput | Sequence[int],
        *,
        logits: LogitsMode = "last",
        request_id: str | None = None,
    ) -> ShardResult:
        request = PrefillRequest(
            request_id=self.request_id() if request_id is None else request_id,
            session=session,
            start_pos=start_pos,
            inputs=_as_input(inputs),
            logits=logits,
        )
        return self.observe(engine.prefill(request))

    def decode(
        self, engine: ShardEngine, session: SessionRef, pos: int, inputs: ShardInput | Sequence[int]
    ) -> ShardResult:
        request = DecodeRequest(
            request_id=self.request_id(), session=session, pos=pos, inputs=_as_input(inputs)
        )
        return self.observe(engine.decode(request))

    def release(self, engine: ShardEngine, session: SessionRef) -> ReleaseResult:
        return engine.release(ReleaseRequest(session=session))

    # ----------------------------------------------------------------- pipelines

    def pipeline(self, engines: Sequence[ShardEngine]) -> Pipeline:
        """The API's pipeline driver over ``engines``, recording every result's evidence."""
        return Pipeline(engines, observe=self.observe, request_prefix=self.request_id())

    def pipeline_prefill(
        self,
        engines: Sequence[ShardEngine],
        session: SessionRef,
        start_pos: int,
        tokens: Sequence[int],
        *,
        logits: LogitsMode = "last",
    ) -> LogitsResult:
        """Tokens into the first shard, each bundle into the next; the last shard's logits."""
        return self.pipeline(engines).prefill(session, start_pos, tokens, logits=logits)

    def pipeline_decode(
        self, engines: Sequence[ShardEngine], session: SessionRef, pos: int, token: int
    ) -> LogitsResult:
        return self.pipeline(engines).decode(session, pos, token)

    def head_bundle(
        self, head: ShardEngine, session: SessionRef, start_pos: int, tokens: Sequence[int]
    ) -> BoundaryBundle:
        return bundle_of(self.prefill(head, session, start_pos, tokens))


IN_FLIGHT_GRACE_S: Final = 0.5
"""How long a canceller waits for ``health().in_flight`` to report the request before it
cancels anyway: an engine whose health hides running requests still has its cancel tested."""


class Canceller(threading.Thread):
    """Cancels from another thread: waits until the engine has work in flight (at most
    :data:`IN_FLIGHT_GRACE_S`; ``saw_in_flight`` says whether it was reported), sleeps
    ``delay`` seconds (so the cancel can land mid-computation rather than before it), then
    repeats ``cancel`` until the engine reports a cancelled request or ``stop`` is called."""

    def __init__(self, engine: ShardEngine, request: CancelRequest, delay: float) -> None:
        super().__init__(name="conformance-canceller", daemon=True)
        self._engine = engine
        self._request = request
        self._delay = delay
        self._done = threading.Event()
        self.result: CancelResult | None = None
        self.error: BaseException | None = None
        self.saw_in_flight = False

    def run(self) -> None:
        try:
            deadline = time.monotonic() + IN_FLIGHT_GRACE_S
            while not self._done.is_set() and time.monotonic() < deadline:
                if self._engine.health().in_flight > 0:
                    self.saw_in_flight = True
                    break
                time.sleep(0)
            if self._delay and self.saw_in_flight:
                time.sleep(self._delay)
            while not self._done.is_set():
                result = self._engine.cancel(self._request)
                if result.cancelled:
                    self.result = result
                    return
                time.sleep(0)
        except BaseException as error:  # noqa: BLE001 - re-raised by the test thread
            self.error = error

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10.0)


def _as_input(inputs: ShardInput | Sequence[int]) -> ShardInput:
    if isinstance(inputs, TokenInput | BoundaryBundle):
        return inputs
    return TokenInput(token_ids=tuple(inputs))


def bundle_of(result: ShardResult) -> BoundaryBundle:
    if not isinstance(result, BoundaryResult):
        raise AssertionError(f"expected a BoundaryResult from a non-tail shard, got {result!r}")
    return result.bundle


def logits_of(result: ShardResult) -> LogitsResult:
    if not isinstance(result, LogitsResult):
        raise AssertionError(
            f"expected a LogitsResult from a tail/full shard, got {type(result).__name__}"
        )
    return result


def logits_array(result: ShardResult) -> npt.NDArray[np.float32]:
    return np.array(logits_of(result).array())


def replace_bundle(bundle: BoundaryBundle, **changes: object) -> BoundaryBundle:
    """A copy of ``bundle`` with header fields changed (checksum left as it was)."""
    return msgspec.structs.replace(bundle, **changes)


def rebuilt_bundle(bundle: BoundaryBundle, **changes: object) -> BoundaryBundle:
    """A copy with changed fields and a checksum that matches the (possibly new) payload."""
    changed = msgspec.structs.replace(bundle, **changes)
    return msgspec.structs.replace(changed, checksum=payload_checksum(changed.payload))


_PROMPT: Final = 6
"""Prompt length used by most tests: long enough for history to matter, short to stay fast."""
_LONG: Final = 300
"""Positions of a long session: past 256 (a byte-sized index, a 256-bit map) and past any
micro-batch of up to a few hundred rows."""


def _raises(
    expected: type[ShardEngineError], call: Callable[[], object], what: str
) -> ShardEngineError:
    """Run ``call``; it must raise ``expected`` (or a subclass). Say what came instead."""
    try:
        outcome = call()
    except ShardEngineError as error:
        if isinstance(error, expected):
            return error
        raise AssertionError(
            f"{what}: expected {expected.__name__} (code {expected.code!r}), got "
            f"{type(error).__name__} (code {error.code!r}): {error}"
        ) from error
    raise AssertionError(f"{what}: expected {expected.__name__}, but it returned {outcome!r}")


def _raises_exactly(
    expected: type[ShardEngineError], call: Callable[[], object], what: str
) -> ShardEngineError:
    """As :func:`_raises`, but the error must be of class ``expected`` itself (its code)."""
    error = _raises(expected, call, what)
    if type(error) is not expected:
        raise AssertionError(
            f"{what}: expected {expected.__name__} (code {expected.code!r}) itself, got "
            f"{type(error).__name__} (code {error.code!r}): {error}"
        )
    return error


def _rows(result: ShardResult) -> npt.NDArray[np.floating]:
    if isinstance(result, LogitsResult):
        return np.array(result.array())
    return np.array(bundle_of(result).array())


def _chunks(total: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``[0, total)`` cut at ``cuts`` (those inside it)."""
    points = [0, *sorted(c for c in set(cuts) if 0 < c < total), total]
    return list(itertools.pairwise(points))


def _wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.0002)
    return condition()


def _assert_addressed_to(result: ShardResult, session: SessionRef, what: str) -> None:
    addressed = [result.session]
    if isinstance(result, BoundaryResult):
        addressed.append(result.bundle.session)
    assert all(ref == session for ref in addressed), (
        f"{what}: the result is addressed to {addressed}, not to the request's {session}"
    )


class SuiteHelpers:
    """The helpers the standard tests of every subject share: every mixin of the suite
    inherits them, and a subclass of the suite may not replace them."""

    harness: Harness

    def _need_layers(self, n_layers: int, purpose: str) -> None:
        if self.harness.n_layers < n_layers:
            suite_skip(
                f"{purpose} needs a model fixture with >= {n_layers} layers; this one has "
                f"{self.harness.n_layers}"
            )

    def _tolerances(self, caps: Capabilities) -> Tolerances:
        """The engine's declared tolerance per output kind, recording what is measured."""
        return Tolerances.declared(caps.determinism, self.harness.record)

    def _shape_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """The same positions computed through other batch shapes (decode vs. a longer
        prefill, chunks, logits of all rows vs. the last, replays after rollback or eviction):
        bit-exact only when the engine declares batch_invariant; else within its tolerance."""
        determinism = caps.determinism
        exact = determinism.batch_invariant and determinism.deterministic
        return exact, self._tolerances(caps)

    def _repeat_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """The same calls repeated: bit-exact when the engine declares deterministic."""
        return caps.determinism.deterministic, self._tolerances(caps)

    def _batch_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """Batched vs. single decode: bit-exact when the engine declares batch_invariant."""
        determinism = caps.determinism
        exact = determinism.batch_invariant and determinism.deterministic
        return exact, self._tolerances(caps)

    def _isolation_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """A session run alone vs. interleaved with others (other cache layouts, other
        batches around it): bit-exact when the engine declares deterministic and
        batch_invariant; else within its tolerance."""
        return self._shape_exactness(caps)

    def _split_boundaries(self) -> list[tuple[int, ...]]:
        """The pipelines split tests run: the fixture's own splits (uneven ones) and, when it
        has none, even 2- and 3-way splits."""
        n = self.harness.n_layers
        splits: list[tuple[int, ...]] = []
        for split in self.harness.fixture.splits:
            if (
                len(split) < 3
                or split[0] != 0
                or split[-1] != n
                or list(split) != sorted(set(split))
            ):
                raise AssertionError(
                    f"model fixture split {split} is not 0 < ... < {n} with >= 2 parts"
                )
            splits.append(tuple(split))
        return splits

    def _slow(self, **overrides: object) -> ShardEngine:
        """An engine with the fixture's cancellation options (operations slow enough to be
        cancelled mid-way)."""
        h = self.harness
        options = dict(h.target.cancel_load_options)
        return h.load(0, None, options=options, **overrides)

    def _batch(self, engine: ShardEngine, items: Sequence[DecodeRequest]) -> DecodeBatchResult:
        return engine.decode_batch(
            DecodeBatchRequest(request_id=self.harness.request_id(), items=tuple(items))
        )

    def _item(
        self, session: SessionRef, pos: int, inputs: ShardInput | Sequence[int], **fields: object
    ) -> DecodeRequest:
        request = DecodeRequest(
            request_id=self.harness.request_id(),
            session=session,
            pos=pos,
            inputs=inputs
            if isinstance(inputs, TokenInput | BoundaryBundle)
            else TokenInput(token_ids=tuple(inputs)),
        )
        return msgspec.structs.replace(request, **fields) if fields else request

    def _need_batches(self, engine: ShardEngine) -> None:
        """Skip unless ``engine`` advertises batched decode; one that does not must refuse
        ``decode_batch`` with UnsupportedFeature and change nothing (a batch it serves
        anyway would otherwise never be checked)."""
        caps = engine.capabilities()
        if caps.features.batched_decode:
            return
        h = self.harness
        session = h.session(f"unbatched-{h.request_id()}")
        length = 0
        if caps.shard.takes_tokens:
            length = 2
            h.prefill(engine, session, 0, h.tokens(length, seed=3))
        _raises_exactly(
            UnsupportedFeature,
            lambda: self._batch(engine, [self._item(session, length, (1,))]),
            "decode_batch on an engine that declares features.batched_decode = False",
        )
        if length:
            assert self._committed_length(engine, session) == length, (
                "a refused decode_batch changed the session"
            )
            h.release(engine, session)
        suite_skip("engine declares features.batched_decode = False (and refuses batches)")

    def _committed_length(self, engine: ShardEngine, session: SessionRef) -> int:
        """The committed length as the engine reports it: a decode at a position the session
        cannot be at (max_context - 1) must miss and carry it."""
        h = self.harness
        probe = engine.capabilities().limits.max_context - 1
        try:
            h.decode(engine, session, probe, self._probe_row(engine, session, probe))
        except CacheMiss as miss:
            return miss.committed_length
        raise AssertionError(f"a decode of {session.session_id} at {probe} did not miss")

    def _probe_row(self, engine: ShardEngine, session: SessionRef, pos: int) -> ShardInput:
        """A well-formed one-row input for ``engine`` at ``pos`` (a token, or a zero row)."""
        caps = engine.capabilities()
        if caps.shard.takes_tokens:
            return TokenInput(token_ids=(0,))
        return BoundaryBundle.from_array(
            np.zeros((1, caps.hidden_size), np.float32),
            session=session,
            first_pos=pos,
            layer=caps.shard.start,
            model_fingerprint=caps.model_fingerprint,
            dtype=engine.capabilities().boundary_dtypes[0],
        )

    def _cancel_mid_flight(
        self, engine: ShardEngine, cancel: CancelRequest, run: Callable[[], object]
    ) -> tuple[bool, Canceller]:
        """Run ``run`` while a canceller cancels ``cancel``; True if it raised Cancelled."""
        canceller = Canceller(engine, cancel, 0.0)
        canceller.start()
        try:
            run()
            cancelled = False
        except Cancelled as error:
            assert_cancelled(error, "a call cancelled mid-flight")
            cancelled = True
        finally:
            canceller.stop()
        if canceller.error is not None:
            raise AssertionError(f"cancel() raised {canceller.error!r}") from canceller.error
        return cancelled, canceller

    def _row_sources(self, start: int) -> ShardEngine | None:
        """A fresh upstream shard ``[0, start)`` (None for a token-taking shard)."""
        return self.harness.load(0, start, max_batch_tokens=64) if start > 0 else None

    def _inputs_for(
        self,
        upstream: ShardEngine | None,
        session: SessionRef,
        sequence: Sequence[int],
        first: int,
    ) -> ShardInput:
        """The inputs of positions ``first..`` of ``sequence`` for a shard whose upstream is
        ``upstream``: token ids, or rows of a fresh upstream run over the whole sequence."""
        h = self.harness
        if upstream is None:
            return TokenInput(token_ids=tuple(sequence[first:]))
        scratch = SessionRef(session_id=f"upstream-{h.request_id()}", epoch=1)
        bundle = bundle_of(h.prefill(upstream, scratch, 0, tuple(sequence)))
        h.release(upstream, scratch)
        width = len(bundle.payload) // bundle.n_tokens
        payload = memoryview(bytes(bundle.payload[first * width :]))
        return rebuilt_bundle(
            bundle,
            session=session,
            first_pos=first,
            n_tokens=len(sequence) - first,
            payload=payload,
        )

    def _long_engine(self) -> tuple[ShardEngine, int]:
        """A full shard with room for a session of :data:`_LONG` positions and prefills of
        that many rows; the length it allows (skipped when an engine lowers it below 260)."""
        h = self.harness
        engine = h.load(
            max_context=2 * _LONG, max_batch_tokens=_LONG + 8, kv_budget_tokens=8 * _LONG
        )
        limits = engine.capabilities().limits
        length = min(_LONG, limits.max_batch_tokens, limits.max_context - 8)
        if length < 260:
            suite_skip(
                f"the engine lowered max_batch_tokens/max_context to {limits.max_batch_tokens}/"
                f"{limits.max_context}: no session of 260 positions fits"
            )
        return engine, length

    def _fill(
        self,
        engine: ShardEngine,
        session: SessionRef,
        tokens: Sequence[int],
        cuts: Sequence[int],
    ) -> list[npt.NDArray[np.floating]]:
        """Prefill ``tokens`` in the chunks ``cuts`` make (logits "all"); their rows."""
        h = self.harness
        return [
            _rows(h.prefill(engine, session, start, tuple(tokens[start:end]), logits="all"))
            for start, end in _chunks(len(tokens), cuts)
        ]

    def _error_of(self, call: Callable[[], object], what: str) -> ShardEngineError:
        return _raises(ShardEngineError, call, what)
