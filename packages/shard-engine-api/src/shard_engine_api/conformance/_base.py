"""``ShardEngineConformance``: the standard suite every engine must pass.

An engine's test module subclasses it in one line::

    from shard_engine_api.conformance import ShardEngineConformance

    class TestMyEngine(ShardEngineConformance):
        engine_name = "mine"

The engine is found through its ``shard_engine`` entry point and runs on the model the
``model_fixture`` of its registered EngineDescription supplies. A subclass may instead override
the ``make_engine`` and ``model_fixture`` classmethods (no entry point needed).

Optional class attributes:

- ``cancel_load_options``: extra ``LoadConfig.options`` for the cancellation test, to make an
  operation slow enough to be cancelled mid-way (for example an engine's artificial per-token
  delay). Without it the suite uses the longest prefill the limits allow.

Standard tests may not be deleted or silently replaced: a subclass that defines a method with
a standard test's name must mark it ``@conformance_override(reason="...")``, else the class
fails to be created; the reason is written to the report. The standard test names are pinned
in :data:`STANDARD_TESTS`.

Tests are skipped, with the reason, when a capability they need is not advertised (batched
decode, cancellation, truncation, eviction, determinism) or the fixture model has too few
layers for a split.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import ClassVar, Final, TypeVar

import numpy as np
import numpy.typing as npt
import pluggy
import pytest

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    UnsupportedFeature,
    WrongRole,
)
from shard_engine_api._hookspecs import TEST_OPTIONS_ENV, ModelFixture
from shard_engine_api._plugins import (
    engine_description,
    get_plugin_manager,
    installed_engines,
    load_engine,
)
from shard_engine_api._plugins import (
    model_fixture as plugin_model_fixture,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    EvictionPolicy,
    ExportSessionRequest,
    ImportSessionRequest,
    Limits,
    LogitsResult,
    Metrics,
    MtpState,
    OptionValue,
    PrefillRequest,
    SessionRef,
    ShardResult,
    TokenInput,
)
from shard_engine_api._validation import health_problem, metrics_problem
from shard_engine_api.conformance._concurrency import CONCURRENCY_TESTS, ConcurrencyTests
from shard_engine_api.conformance._harness import (
    Canceller,
    EngineUnderTest,
    Harness,
    assert_cancelled,
    assert_matches,
    assert_timings,
    bundle_of,
    logits_array,
    logits_of,
    rebuilt_bundle,
    replace_bundle,
    split_ranges,
)
from shard_engine_api.conformance._migration import MIGRATION_TESTS, MigrationTests
from shard_engine_api.conformance._reach import REACH_TESTS, ReachTests
from shard_engine_api.conformance._recorder import RECORDER_KEY, Recorder, suite_skip
from shard_engine_api.conformance._report import model_report
from shard_engine_api.conformance._stateful import (
    MachineConfig,
    run_machine,
    upstream_limits,
)
from shard_engine_api.conformance._targeted import _PROMPT, _raises

__all__ = ["STANDARD_TESTS", "ShardEngineConformance", "conformance_override"]

_CORE_TESTS: Final[tuple[str, ...]] = (
    "test_batched_decode_item_errors",
    "test_batched_decode_matches_single",
    "test_batched_decode_metrics",
    "test_batched_decode_order_with_interleaved_errors",
    "test_batched_decode_reserved_fields",
    "test_batched_decode_same_session_twice",
    "test_boundary_checks_on_every_path",
    "test_cache_miss_decode_position",
    "test_cache_miss_prefill_gap",
    "test_cache_miss_unknown_session",
    "test_cancel_after_completion_result_stands",
    "test_cancel_latency_within_advertised_bound",
    "test_cancel_one_of_two_in_flight",
    "test_cancel_rolls_back",
    "test_cancel_running_batch",
    "test_cancel_running_decode",
    "test_cancel_session_stops_all_its_requests",
    "test_cancel_unknown_or_finished",
    "test_capabilities_fields",
    "test_checksum_mismatch",
    "test_chunked_prefill",
    "test_concurrent_threads_match_serial",
    "test_contract_version_mismatch",
    "test_crash_is_permanent",
    "test_decode_consistency",
    "test_deterministic",
    "test_double_release_frees_once",
    "test_error_codes_match_taxonomy",
    "test_every_boundary_dtype",
    "test_evidence_class",
    "test_failed_first_prefill_leaves_nothing",
    "test_failed_request_is_atomic",
    "test_fence_holds_after_slot_reuse",
    "test_health_metrics_consistent",
    "test_health_states",
    "test_in_flight_while_running",
    "test_invalid_request_bad_token_ids",
    "test_invalid_request_empty_request_id",
    "test_invalid_request_malformed_bundle",
    "test_limit_kv_budget",
    "test_limit_max_batch_tokens",
    "test_limit_max_context",
    "test_limit_max_sessions",
    "test_load_twice_rejected",
    "test_long_and_shared_prefix_session_ids",
    "test_long_prefill_vs_chunked_and_decode",
    "test_lru_by_last_use_unequal_sizes",
    "test_lru_eviction",
    "test_newer_epoch_sees_no_old_cache",
    "test_not_ready_after_close",
    "test_not_ready_before_load",
    "test_outputs_finite",
    "test_release_tombstone",
    "test_release_unknown_session",
    "test_reserved_hooks_present_but_disabled",
    "test_resource_exhausted_kv_budget",
    "test_resource_exhausted_session_slots",
    "test_result_fields",
    "test_role_derived_from_shard",
    "test_session_isolation",
    "test_shard_mismatch",
    "test_split_invariance_fixture_splits",
    "test_split_invariance_three_way",
    "test_split_invariance_two_way",
    "test_stale_epoch",
    "test_state_machine_every_role",
    "test_state_machine_full_shard",
    "test_truncate",
    "test_truncate_and_new_epoch_every_role",
    "test_unsupported_feature_on_bundles",
    "test_unsupported_feature_on_requests",
    "test_wire_round_trip_of_every_returned_object",
    "test_wrong_role_bundle_to_token_shard",
    "test_wrong_role_tokens_to_bundle_shard",
)
STANDARD_TESTS: Final[tuple[str, ...]] = tuple(
    sorted(_CORE_TESTS + MIGRATION_TESTS + REACH_TESTS + CONCURRENCY_TESTS)
)
"""Every standard test, sorted. Pinned: the suite refuses to import if its methods differ."""

_EVICTION_POLICIES: Final[tuple[EvictionPolicy, ...]] = ("reject", "lru")
_OVERRIDE_ATTRIBUTE: Final = "__conformance_override__"
_CANCEL_DELAYS: Final = (0.0, 0.0002, 0.001, 0.003, 0.008, 0.02)
"""Seconds the canceller waits after the request is in flight: from "before compute starts" to
well into a slow operation, so at least one attempt lands mid-computation."""

_CANCEL_RETRY_SECONDS: Final = 2.0
"""After one round of delays, how long to keep retrying while no cancel has landed: a fast
engine leaves only a short window between accepting a request and starting to compute."""


_Function = TypeVar("_Function", bound=Callable[..., object])


def conformance_override(*, reason: str) -> Callable[[_Function], _Function]:
    """Mark a method that replaces a standard test; ``reason`` goes into the report."""
    if not reason.strip():
        raise ValueError("conformance_override needs a non-empty reason")

    def mark(function: _Function) -> _Function:
        setattr(function, _OVERRIDE_ATTRIBUTE, reason)
        return function

    return mark


@functools.cache
def _entry_point_manager() -> pluggy.PluginManager:
    # Scanning entry points costs milliseconds; the suite asks for a manager per class.
    return get_plugin_manager()


_CUSTOMIZABLE: Final = (
    "engine_name",
    "cancel_load_options",
    "make_engine",
    "model_fixture",
    "plugin_manager",
)
"""What a subclass may set or override (besides standard tests marked with
``@conformance_override``; ``conformance_overrides`` is computed from those marks)."""


@functools.cache
def _internals() -> frozenset[str]:
    """Every attribute of the suite's classes a subclass may not replace: helpers and fixtures
    (not the standard tests, guarded on their own, nor the customization points)."""
    return frozenset(
        name
        for klass in ShardEngineConformance.__mro__
        if klass is not object
        for name in vars(klass)
        if not name.startswith("__")
        and not name.startswith("test_")
        and name not in _CUSTOMIZABLE
        and name != "conformance_overrides"
    )


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ShardEngineConformance(ReachTests, ConcurrencyTests, MigrationTests):
    """The standard conformance suite. Subclass it with ``engine_name`` set (or leave it None
    to take the engine from ``--shard-engine``)."""

    engine_name: ClassVar[str | None] = None
    cancel_load_options: ClassVar[Mapping[str, OptionValue]] = {}
    conformance_overrides: ClassVar[Mapping[str, str]] = {}
    """Standard tests this class replaced, with reasons (filled in at class creation)."""

    harness: Harness

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        overrides = dict(cls.conformance_overrides)
        suite_classes = frozenset(ShardEngineConformance.__mro__)
        for name in _internals():
            owner = next(klass for klass in cls.__mro__ if name in vars(klass))
            if owner not in suite_classes:
                # A helper every standard test relies on (_batch, _need_layers, the harness
                # fixture) would change what the tests check without replacing any of them.
                raise TypeError(
                    f"{cls.__qualname__} replaces {name}, an internal of the conformance suite; "
                    f"only {', '.join(_CUSTOMIZABLE)} may be customized (and a standard test "
                    "with @conformance_override)"
                )
        for name in STANDARD_TESTS:
            # The class the test resolves to, not only this one's own namespace: a mixin
            # listed before the suite (class TestMine(Mixin, ShardEngineConformance)) would
            # otherwise replace a standard test unseen.
            owner = next(klass for klass in cls.__mro__ if name in vars(klass))
            if owner in suite_classes:
                continue
            value = vars(owner)[name]
            reason = getattr(value, _OVERRIDE_ATTRIBUTE, None)
            if not callable(value) or not isinstance(reason, str):
                raise TypeError(
                    f"{cls.__qualname__}.{name} replaces a standard conformance test; a standard "
                    "test may not be deleted or silently overridden. Mark the replacement with "
                    "@conformance_override(reason=...) so the report shows why."
                )
            overrides[name] = reason
        cls.conformance_overrides = overrides

    # ----------------------------------------------------------------- engine supply

    @classmethod
    def plugin_manager(cls) -> pluggy.PluginManager:
        """The plugin manager engines and model fixtures are found through (the installed
        ``shard_engine`` entry points)."""
        return _entry_point_manager()

    @classmethod
    def make_engine(cls, name: str) -> ShardEngine:
        """A new, unloaded engine. Override to test an engine without an entry point."""
        return load_engine(name, manager=cls.plugin_manager())

    @classmethod
    def model_fixture(cls, name: str, workdir: Path) -> ModelFixture:
        """The small model the suite runs on, generated under ``workdir``. Override to
        supply one without an EngineDescription ``model_fixture``."""
        return plugin_model_fixture(cls.plugin_manager(), name, workdir)

    @classmethod
    def _uses_entry_point(cls) -> bool:
        for klass in cls.__mro__:
            if klass is ShardEngineConformance:
                return True
            if "make_engine" in vars(klass):
                return False
        return True

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_target(
        cls, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> EngineUnderTest:
        """The engine and model fixture of this suite class (built once per class)."""
        # The class the test runs in (a subclass), which is where overrides live.
        suite = request.cls
        assert suite is not None
        assert issubclass(suite, ShardEngineConformance)
        name = suite.engine_name or request.config.getoption("shard_engine", default=None)
        if not name:
            pytest.skip("no engine selected: pass --shard-engine NAME or set engine_name")
        # The suite loads engines with the fixture's test-only options (crash_options,
        # cancel_options); engines accept those only in a process that allows them, and this
        # is a test process. Set before any engine exists, so spawned ones inherit it.
        os.environ[TEST_OPTIONS_ENV] = "1"
        recorder = request.config.stash.get(RECORDER_KEY, None) or Recorder()
        record = recorder.suite(request.node.nodeid)
        record.engine = str(name)
        record.overrides = dict(suite.conformance_overrides)
        record.distributions["shard-engine-api"] = _distribution_version("shard-engine-api")
        if suite._uses_entry_point():
            manager = suite.plugin_manager()
            for installed in installed_engines(manager):
                if installed.name == name:
                    record.distributions[installed.distribution] = installed.version
            record.spec_evidence = [engine_description(str(name), manager=manager).evidence]
            factory: Callable[[], ShardEngine] = functools.partial(suite.make_engine, str(name))
        else:
            factory = functools.partial(suite.make_engine, str(name))
            probe = factory()
            package = type(probe).__module__.split(".")[0]
            record.distributions[package.replace("_", "-")] = _distribution_version(
                package.replace("_", "-")
            )
            probe.close()
        workdir = tmp_path_factory.mktemp(f"model-fixture-{name}")
        fixture = suite.model_fixture(str(name), workdir)
        record.model = model_report(
            fixture.model,
            description=fixture.description,
            n_layers=fixture.n_layers,
            synthetic=fixture.synthetic,
        )
        return EngineUnderTest(
            name=str(name),
            fixture=fixture,
            factory=factory,
            record=record,
            cancel_load_options=dict(suite.cancel_load_options or fixture.cancel_options),
        )

    @pytest.fixture(autouse=True)
    def _conformance_harness(
        self, conformance_target: EngineUnderTest, request: pytest.FixtureRequest
    ) -> Iterator[None]:
        self.harness = Harness(conformance_target, request.node.name)
        try:
            yield
        finally:
            self.harness.close_all()

    # ================================================================= model-based

    def test_state_machine_full_shard(self, request: pytest.FixtureRequest) -> None:
        """Model-based: random sequences of prefill, truncation, decode, decode_batch (with
        duplicate sessions and mixed errors), release, cancel, newer and huge (>= 2**40)
        epochs and LRU eviction over several sessions (long ids sharing a prefix) on a full
        shard, with eviction "reject" and "lru". After every step the outcome (error code,
        CacheMiss committed_length and reason), the committed lengths, health and metrics
        must equal the reference model's, and every output a fresh replay of the session's
        history. A failure prints the shrunk call sequence.

        Fix: follow the session semantics of ARCHITECTURE.md as the message says; build on
        EngineCore, which keeps them."""
        h = self.harness
        n = h.n_layers
        deep = _deep(request)
        examples = self._examples(request)
        for eviction in _EVICTION_POLICIES:
            replay = h.load(0, n, **upstream_limits(deep))
            run_machine(
                h,
                MachineConfig(start=0, end=n, n_layers=n, dtype="f32", eviction=eviction),
                examples=examples,
                upstream=None,
                replay=replay,
                shrink=not request.config.getoption("shard_engine_no_shrink", default=False),
                deep=deep,
            )

    def test_state_machine_every_role(self, request: pytest.FixtureRequest) -> None:
        """Model-based, as the full-shard test, on a head, a middle and a tail shard and with
        every boundary dtype the engine advertises (f16 included): non-head inputs are the
        rows of a fresh upstream shard run over the session's tokens.

        Fix: the session semantics do not depend on the role; a shard that takes or emits
        bundles must truncate, fence epochs, evict and roll back as a full one does."""
        h = self.harness
        self._need_layers(2, "shards of every role")
        n = h.n_layers
        splits = self._split_boundaries()
        boundaries = next(
            (split for split in splits if len(split) >= 4),
            (0, *(end for _start, end in split_ranges(n, 3 if n >= 3 else 2))),
        )
        ranges = list(itertools.pairwise(boundaries))
        if len(ranges) > 3:
            ranges = [ranges[0], ranges[1], ranges[-1]]
        dtypes = h.load(*ranges[0]).capabilities().boundary_dtypes
        policies = itertools.cycle(_EVICTION_POLICIES)
        deep = _deep(request)
        examples = max(1, self._examples(request, budget_s=6.0) // 2)
        for start, end in ranges:
            for dtype in dtypes:
                upstream = (
                    h.load(0, start, boundary_dtype=dtype, **upstream_limits(deep))
                    if start > 0
                    else None
                )
                replay = h.load(start, end, boundary_dtype=dtype, **upstream_limits(deep))
                run_machine(
                    h,
                    MachineConfig(
                        start=start, end=end, n_layers=n, dtype=dtype, eviction=next(policies)
                    ),
                    examples=examples,
                    upstream=upstream,
                    replay=replay,
                    shrink=not request.config.getoption("shard_engine_no_shrink", default=False),
                    deep=deep,
                )

    # ================================================================= lifecycle

    def test_not_ready_before_load(self) -> None:
        """Before ``load``: capabilities and every request raise NotReady; health says
        "unloaded" and metrics answer without raising.

        Fix: check the lifecycle state at the top of every operation (EngineCore does)."""
        h = self.harness
        engine = h.new_engine()
        session = h.session("a")
        _raises(NotReady, engine.capabilities, "capabilities() before load")
        _raises(
            NotReady,
            lambda: engine.prefill(
                PrefillRequest(
                    request_id=h.request_id(),
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=(0,)),
                )
            ),
            "prefill before load",
        )
        _raises(
            NotReady,
            lambda: engine.decode(
                DecodeRequest(
                    request_id=h.request_id(),
                    session=session,
                    pos=0,
                    inputs=TokenInput(token_ids=(0,)),
                )
            ),
            "decode before load",
        )
        _raises(NotReady, lambda: h.release(engine, session), "release before load")
        assert engine.health().state == "unloaded", "health() before load must say 'unloaded'"
        engine.metrics()

    def test_not_ready_after_close(self) -> None:
        """After ``close``: capabilities and every request (prefill, decode, decode_batch,
        export_session, import_session) raise NotReady, health says "closed", and ``close`` is
        idempotent.

        Fix: enter the closed state in close() and check it in every operation (capabilities
        included: a closed engine serves nothing, so it must not look loaded)."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        migrating = engine.capabilities().features.session_migration
        snapshot = (
            engine.export_session(ExportSessionRequest(request_id=h.request_id(), session=session))
            if migrating
            else None
        )
        engine.close()
        engine.close()
        _raises(NotReady, engine.capabilities, "capabilities() after close")
        error = _raises(
            ShardEngineError,
            lambda: engine.export_session(
                ExportSessionRequest(request_id=h.request_id(), session=session)
            ),
            "export_session after close",
        )
        # An engine without session migration may refuse it as unsupported before anything.
        allowed = (NotReady,) if migrating else (NotReady, UnsupportedFeature)
        assert isinstance(error, allowed), (
            f"export_session after close raised {type(error).__name__} ({error}), not NotReady"
        )
        if snapshot is not None:
            _raises(
                NotReady,
                lambda: engine.import_session(
                    ImportSessionRequest(request_id=h.request_id(), snapshot=snapshot)
                ),
                "import_session after close",
            )
        _raises(NotReady, lambda: h.prefill(engine, session, 3, (1,)), "prefill after close")
        _raises(NotReady, lambda: h.decode(engine, session, 3, (1,)), "decode after close")
        _raises(
            NotReady,
            lambda: engine.decode_batch(
                DecodeBatchRequest(
                    request_id=h.request_id(),
                    items=(
                        DecodeRequest(
                            request_id=h.request_id(),
                            session=session,
                            pos=3,
                            inputs=TokenInput(token_ids=(1,)),
                        ),
                    ),
                )
            ),
            "decode_batch after close",
        )
        assert engine.health().state == "closed", "health() after close must say 'closed'"
        engine.metrics()

    def test_load_twice_rejected(self) -> None:
        """A second ``load`` raises InvalidRequest and leaves the loaded engine serving.

        Fix: refuse load() unless the engine is in its initial state."""
        h = self.harness
        engine = h.load()
        _raises(InvalidRequest, lambda: engine.load(h.config()), "second load()")
        result = logits_of(h.prefill(engine, h.session("a"), 0, h.tokens(3, seed=1)))
        assert result.n_rows == 1, "the engine must still serve after a refused second load"

    def test_health_states(self) -> None:
        """Health goes unloaded -> ready -> closed and reports occupancy consistently; health
        and metrics are well typed and within bounds in every state (non-negative 64-bit
        counts, finite compute_ms, no more sessions or KV positions than advertised).

        Fix: keep Health.state in step with the lifecycle; count sessions and KV positions;
        report counts as plain non-negative ints (never -1 for "unknown")."""
        h = self.harness
        engine = h.new_engine()
        assert engine.health().state == "unloaded"
        _assert_health_metrics_within(engine, None)
        caps = engine.load(h.config())
        h.note_capabilities(caps)
        health = engine.health()
        _assert_health_metrics_within(engine, caps.limits)
        assert health.state == "ready", f"after load health must be 'ready', got {health.state!r}"
        assert health.sessions == 0
        assert health.in_flight == 0
        assert health.kv_used_tokens == 0
        assert health.kv_budget_tokens == caps.limits.kv_budget_tokens, (
            "health.kv_budget_tokens must equal the advertised KV budget"
        )
        engine.close()
        assert engine.health().state == "closed"
        _assert_health_metrics_within(engine, None)

    def test_capabilities_fields(self) -> None:
        """Capabilities name the engine, speak this contract version, carry a valid evidence
        class, echo the loaded shard, and advertise limits within the requested config. A
        declared tolerance is finite, >= 0, at most half a row's magnitude, and tells apart
        the outputs of two different prompts (logits, and hidden states of a head shard), so
        that no tolerance can make the comparisons of other tests vacuous.

        Fix: build Capabilities from the LoadConfig (EngineCore.load does); declare the
        tolerance measured on the engine's own numbers (with a margin), not a bound that
        accepts anything."""
        h = self.harness
        config = h.config()
        engine = h.new_engine()
        caps = engine.load(config)
        h.note_capabilities(caps)
        assert caps == engine.capabilities(), "capabilities() must equal what load() returned"
        assert caps.engine == h.target.name, (
            f"capabilities.engine is {caps.engine!r}; the engine is selected as "
            f"{h.target.name!r} (the entry-point name must be the engine name)"
        )
        assert caps.engine_version, "engine_version must be non-empty"
        assert caps.contract_version == CONTRACT_VERSION
        assert caps.evidence in ("fixture", "real")
        assert caps.shard == config.shard, "capabilities.shard must echo the loaded ShardSpec"
        assert caps.model_fingerprint, "model_fingerprint must be non-empty"
        assert caps.hidden_size > 0
        assert caps.vocab_size > 0
        assert config.boundary_dtype in caps.boundary_dtypes
        limits = caps.limits
        assert 1 <= limits.max_sessions <= config.max_sessions
        assert 1 <= limits.max_context <= config.max_context
        assert 1 <= limits.max_batch_tokens <= config.max_batch_tokens
        assert 1 <= limits.kv_budget_tokens <= config.kv_budget_tokens
        if caps.features.cancel:
            assert caps.features.cancel_latency_ms > 0.0, "a cancel latency bound must be > 0"
        self._check_declared_tolerances(engine)

    def test_role_derived_from_shard(self) -> None:
        """The role is derived from the layer range: full [0, n), head [0, k), tail [k, n),
        middle otherwise; every shard of one model reports the same fingerprint.

        Fix: report ``config.shard.role``; derive the fingerprint from the model, not the
        shard."""
        h = self.harness
        n = h.n_layers
        ranges: list[tuple[int, int]] = [(0, n)]
        if n >= 2:
            ranges += split_ranges(n, 2)
        if n >= 3:
            ranges += split_ranges(n, 3)
        fingerprints = set()
        for start, end in ranges:
            caps = h.load(start, end).capabilities()
            expected = h.fixture.shard(start, end).role
            assert caps.role == expected, f"[{start}, {end}) of {n}: role {caps.role!r}"
            fingerprints.add(caps.model_fingerprint)
        assert len(fingerprints) == 1, f"shards of one model disagree: {fingerprints}"

    def test_reserved_hooks_present_but_disabled(self) -> None:
        """The reserved hooks (MTP, auxiliary state) are advertised present and disabled.

        Fix: report ``ReservedHooks()``; no engine enables them in this contract version."""
        caps = self.harness.load().capabilities()
        for hook_name, status in (("mtp", caps.reserved.mtp), ("aux", caps.reserved.aux)):
            assert status.present, f"reserved hook {hook_name} must be reported present"
            assert not status.enabled, f"reserved hook {hook_name} must be reported disabled"

    # ================================================================= error paths

    def test_invalid_request_empty_request_id(self) -> None:
        """An empty request id is refused with InvalidRequest (prefill, decode, batch).

        Fix: validate request_id before doing anything (EngineCore._operation does)."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        _raises(
            InvalidRequest,
            lambda: h.prefill(engine, session, 0, h.tokens(2, seed=1), request_id=""),
            "prefill with request_id ''",
        )
        h.prefill(engine, session, 0, h.tokens(2, seed=1))
        decode = DecodeRequest(
            request_id="", session=session, pos=2, inputs=TokenInput(token_ids=(1,))
        )
        _raises(InvalidRequest, lambda: engine.decode(decode), "decode with request_id ''")
        _raises(
            InvalidRequest,
            lambda: engine.decode_batch(DecodeBatchRequest(request_id="", items=(decode,))),
            "decode_batch with request_id ''",
        )

    def test_invalid_request_bad_token_ids(self) -> None:
        """Token ids outside [0, vocab), an empty token list, and a decode with more than one
        token are refused with InvalidRequest.

        Fix: validate token ids against the vocabulary before running the model."""
        h = self.harness
        engine = h.load()
        vocab = engine.capabilities().vocab_size
        session = h.session("a")
        for bad in ((), (-1,), (vocab,), (0, vocab + 5)):
            _raises(InvalidRequest, partial(h.prefill, engine, session, 0, bad), f"tokens {bad}")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        _raises(InvalidRequest, lambda: h.decode(engine, session, 3, (vocab,)), "decode token")
        _raises(InvalidRequest, lambda: h.decode(engine, session, 3, (1, 2)), "decode 2 tokens")

    def test_invalid_request_malformed_bundle(self) -> None:
        """A bundle whose header disagrees with its payload or its request (row count, session,
        first position, multi-row decode) is refused with InvalidRequest.

        Fix: check n_tokens x hidden_size x dtype size == len(payload), and that the bundle's
        session and first_pos equal the request's."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        other = h.session("b")
        cases: list[tuple[str, BoundaryBundle, SessionRef, int]] = [
            (
                "n_tokens one larger than the payload",
                replace_bundle(bundle, n_tokens=4),
                session,
                0,
            ),
            (
                "payload one value short",
                rebuilt_bundle(bundle, payload=bundle.payload[:-4]),
                session,
                0,
            ),
            ("bundle of another session", bundle, other, 0),
            ("bundle first_pos differs from the request", bundle, session, 1),
        ]
        for what, candidate, ref, start in cases:
            _raises(
                InvalidRequest,
                partial(h.prefill, tail, ref, start, candidate),
                f"prefill with {what}",
            )
        h.prefill(tail, session, 0, bundle)
        three_rows = rebuilt_bundle(bundle, first_pos=3)
        _raises(InvalidRequest, lambda: h.decode(tail, session, 3, three_rows), "decode 3 rows")

    def test_wrong_role_tokens_to_bundle_shard(self) -> None:
        """Token ids sent to a tail (and middle) shard raise WrongRole, for prefill and decode.

        Fix: a shard that does not start at layer 0 takes only boundary bundles; raise
        WrongRole (not a plain InvalidRequest) so the caller knows it routed wrongly."""
        h = self.harness
        self._need_layers(2, "a tail shard")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)[1:]
        for start, end in ranges:
            engine = h.load(start, end)
            session = h.session(f"a{start}")
            tokens = h.tokens(2, seed=1)
            _raises(
                WrongRole,
                partial(h.prefill, engine, session, 0, tokens),
                f"tokens to [{start}, {end})",
            )
            _raises(
                WrongRole,
                partial(h.decode, engine, session, 0, (1,)),
                f"decode tokens to [{start}, {end})",
            )

    def test_wrong_role_bundle_to_token_shard(self) -> None:
        """A boundary bundle sent to a head or full shard raises WrongRole.

        Fix: a shard that starts at layer 0 takes only token ids; raise WrongRole."""
        h = self.harness
        self._need_layers(2, "a head shard producing a bundle")
        (head_range, _tail) = split_ranges(h.n_layers, 2)
        producer = h.load(*head_range)
        session = h.session("a")
        bundle = h.head_bundle(producer, session, 0, h.tokens(2, seed=1))
        for start, end in ((0, h.n_layers), head_range):
            engine = h.load(start, end)
            _raises(
                WrongRole,
                partial(h.prefill, engine, session, 0, bundle),
                f"bundle to [{start}, {end})",
            )

    def test_shard_mismatch(self) -> None:
        """A bundle of another model fingerprint, entering another layer, or of another
        hidden size raises ShardMismatch.

        Fix: compare bundle.model_fingerprint, bundle.layer (== this shard's start) and
        bundle.hidden_size with the loaded shard before using the payload."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        wider = rebuilt_bundle(
            bundle,
            hidden_size=bundle.hidden_size + 1,
            payload=memoryview(bytes(bundle.n_tokens * (bundle.hidden_size + 1) * 4)),
        )
        cases = [
            ("another model fingerprint", replace_bundle(bundle, model_fingerprint="other")),
            ("another layer", replace_bundle(bundle, layer=bundle.layer + 1)),
            ("another hidden size", wider),
        ]
        for what, candidate in cases:
            _raises(ShardMismatch, partial(h.prefill, tail, session, 0, candidate), what)

    def test_contract_version_mismatch(self) -> None:
        """A bundle speaking another contract version raises ContractVersionMismatch.

        Fix: compare bundle.contract_version with CONTRACT_VERSION first."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        for version in (CONTRACT_VERSION + 1, 0):
            candidate = replace_bundle(bundle, contract_version=version)
            _raises(
                ContractVersionMismatch,
                partial(h.prefill, tail, session, 0, candidate),
                f"contract_version {version}",
            )

    def test_checksum_mismatch(self) -> None:
        """A bundle whose payload does not match its checksum raises ChecksumMismatch, and
        the error is retryable (the sender may retransmit).

        Fix: verify payload_checksum(payload) == bundle.checksum before using the payload."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        corrupted = bytearray(bundle.payload)
        corrupted[0] ^= 0x01
        cases = [
            ("checksum off by one bit", replace_bundle(bundle, checksum=bundle.checksum ^ 1)),
            ("payload bit flipped", replace_bundle(bundle, payload=memoryview(bytes(corrupted)))),
        ]
        for what, candidate in cases:
            error = _raises(ChecksumMismatch, partial(h.prefill, tail, session, 0, candidate), what)
            assert error.retryable, "ChecksumMismatch must be retryable"

    def test_unsupported_feature_on_requests(self) -> None:
        """Non-empty reserved fields (mtp, aux) on prefill and decode requests raise
        UnsupportedFeature.

        Fix: reject any non-empty mtp/aux; the hooks are reserved and disabled."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        tokens = TokenInput(token_ids=h.tokens(3, seed=1))
        mtp = (MtpState(n_draft_tokens=1),)
        aux = (AuxState(name="recurrent"),)
        prefills = [
            PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens, mtp=mtp
            ),
            PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens, aux=aux
            ),
        ]
        for prefill in prefills:
            _raises(
                UnsupportedFeature,
                partial(engine.prefill, prefill),
                f"prefill with mtp={prefill.mtp} aux={prefill.aux}",
            )
        h.prefill(engine, session, 0, tokens)
        step = TokenInput(token_ids=(1,))
        decodes = [
            DecodeRequest(request_id=h.request_id(), session=session, pos=3, inputs=step, mtp=mtp),
            DecodeRequest(request_id=h.request_id(), session=session, pos=3, inputs=step, aux=aux),
        ]
        for decode in decodes:
            _raises(
                UnsupportedFeature,
                partial(engine.decode, decode),
                f"decode with mtp={decode.mtp} aux={decode.aux}",
            )
        h.decode(engine, session, 3, step)

    def test_unsupported_feature_on_bundles(self) -> None:
        """Non-empty reserved fields (mtp, aux) on a boundary bundle raise UnsupportedFeature.

        Fix: reject any bundle with non-empty mtp/aux."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        cases = [
            ("bundle.mtp", replace_bundle(bundle, mtp=(MtpState(n_draft_tokens=1),))),
            ("bundle.aux", replace_bundle(bundle, aux=(AuxState(name="recurrent"),))),
        ]
        for what, candidate in cases:
            _raises(UnsupportedFeature, partial(h.prefill, tail, session, 0, candidate), what)

    def test_cache_miss_unknown_session(self) -> None:
        """Decoding an unknown session, or prefilling it at a position > 0, raises CacheMiss
        with committed_length 0.

        Fix: a session with no state has committed length 0; only a prefill at 0 creates it."""
        h = self.harness
        engine = h.load()
        session = h.session("never-seen")
        miss = _raises(CacheMiss, lambda: h.decode(engine, session, 0, (1,)), "decode unknown")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 0
        miss = _raises(CacheMiss, lambda: h.prefill(engine, session, 2, (1, 2)), "prefill at 2")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 0

    def test_cache_miss_decode_position(self) -> None:
        """A decode at a position other than the committed length raises CacheMiss carrying
        that committed length, and leaves the session usable at it.

        Fix: decode only at pos == committed length; report the length in the error."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(5, seed=1))
        for pos in (3, 6, 0):
            miss = _raises(
                CacheMiss, partial(h.decode, engine, session, pos, (1,)), f"decode at {pos}"
            )
            assert isinstance(miss, CacheMiss)
            assert miss.committed_length == 5, (
                f"CacheMiss must carry committed_length 5, got {miss.committed_length}"
            )
        h.decode(engine, session, 5, (1,))

    def test_cache_miss_prefill_gap(self) -> None:
        """A prefill starting beyond the committed length (a gap) raises CacheMiss with the
        committed length.

        Fix: allow start_pos <= committed length only (equal appends, lower truncates)."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(4, seed=1))
        miss = _raises(CacheMiss, lambda: h.prefill(engine, session, 6, (1, 2)), "prefill gap")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 4
        h.decode(engine, session, 4, (1,))

    def test_stale_epoch(self) -> None:
        """Epochs fence: a newer epoch starts the session fresh (its output equals a brand
        new session's, and its results name the newer epoch), after which prefill, decode
        and release with the older epoch raise StaleEpoch. Epochs are exact 64-bit integers:
        2**53 is older than 2**53 + 1, and 2**63 - 1 (the largest) fences like any other.

        Fix: keep the session's current epoch; drop its state on a newer epoch; refuse older
        ones with StaleEpoch (not CacheMiss, not success); store and compare epochs as
        integers (never as floats, never narrower than 64 bits); address every result to the
        session and epoch of its request."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        exact, tolerance = self._shape_exactness(caps)
        old = h.session("a", epoch=1)
        new = h.session("a", epoch=2)
        h.prefill(engine, old, 0, h.tokens(5, seed=1))
        newer = h.prefill(engine, new, 0, h.tokens(3, seed=2))
        _assert_addressed_to(newer, new, "prefill at the newer epoch")
        fresh = logits_array(newer)
        reference = logits_array(h.prefill(engine, h.session("ref"), 0, h.tokens(3, seed=2)))
        assert_matches(
            fresh,
            reference,
            exact=exact,
            tolerance=tolerance,
            what="a newer epoch must start from an empty cache",
        )
        _raises(
            StaleEpoch,
            lambda: h.prefill(engine, old, 0, h.tokens(2, seed=3)),
            "prefill with the older epoch",
        )
        _raises(StaleEpoch, lambda: h.decode(engine, old, 5, (1,)), "decode with older epoch")
        _raises(
            StaleEpoch,
            lambda: h.decode(engine, old, 3, (1,)),
            "decode with older epoch at the current length",
        )
        _raises(StaleEpoch, lambda: h.release(engine, old), "release with the older epoch")
        _assert_addressed_to(h.decode(engine, new, 3, (1,)), new, "decode at the newer epoch")
        for first, second in ((2**53, 2**53 + 1), (2**63 - 2, 2**63 - 1)):
            older, younger = h.session(f"big-{second}", first), h.session(f"big-{second}", second)
            h.prefill(engine, older, 0, h.tokens(2, seed=4))
            _assert_addressed_to(
                h.prefill(engine, younger, 0, h.tokens(2, seed=5)), younger, f"epoch {second}"
            )
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, older, 0, h.tokens(2, seed=6)),
                f"prefill with epoch {first} after {second}",
            )
            _raises(
                StaleEpoch,
                partial(h.decode, engine, older, 2, (1,)),
                f"decode with epoch {first} after {second}",
            )
            h.release(engine, younger)
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, younger, 0, h.tokens(2, seed=7)),
                f"prefill with the released epoch {second}",
            )

    def test_resource_exhausted_kv_budget(self) -> None:
        """With eviction "reject", a prefill that would exceed the KV budget raises
        ResourceExhausted and leaves the sessions already admitted intact.

        Fix: count cached positions of all sessions against kv_budget_tokens at admission."""
        h = self.harness
        engine = h.load(kv_budget_tokens=10, eviction="reject")
        caps = engine.capabilities()
        if caps.limits.kv_budget_tokens != 10:
            suite_skip(f"engine lowered the KV budget to {caps.limits.kv_budget_tokens}")
        first = h.session("a")
        h.prefill(engine, first, 0, h.tokens(7, seed=1))
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, h.session("b"), 0, h.tokens(7, seed=2)),
            "second session",
        )
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, first, 7, h.tokens(4, seed=3)),
            "growing the first session past the budget",
        )
        assert engine.health().kv_used_tokens == 7
        h.decode(engine, first, 7, (1,))

    def test_resource_exhausted_session_slots(self) -> None:
        """With eviction "reject", a new session beyond max_sessions raises ResourceExhausted;
        releasing one frees its slot.

        Fix: admit a new session only while a slot is free."""
        h = self.harness
        engine = h.load(max_sessions=1, eviction="reject")
        first = h.session("a")
        h.prefill(engine, first, 0, h.tokens(3, seed=1))
        second = h.session("b")
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, second, 0, h.tokens(3, seed=2)),
            "a second session with one slot",
        )
        h.decode(engine, first, 3, (1,))
        h.release(engine, first)
        h.prefill(engine, second, 0, h.tokens(3, seed=2))

    def test_cancel_rolls_back(self) -> None:
        """``cancel`` from another thread (by request id and by session id) while a
        truncating prefill runs: the caller sees Cancelled and the session is exactly as
        before (the committed length is unchanged and a decode there equals a clean run), or,
        if the cancel came too late, the prefill completed consistently. Skipped when no
        attempt could be cancelled (the engine is faster than the canceller): supply
        ``cancel_load_options`` that slow it down.

        Fix: poll the cancel token at safe points, raise Cancelled, and restore the slot in
        ``_rollback`` (positions from start_pos on must be put back, not just forgotten)."""
        h = self.harness
        engine = h.load(options=dict(h.target.cancel_load_options))
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        limits = caps.limits
        prefix = h.tokens(8, seed=1)
        follow = h.tokens(1, seed=2)[0]
        truncate_at = 4 if caps.features.truncate else len(prefix)
        budget_room = limits.kv_budget_tokens // 3 - truncate_at
        length = max(
            1, min(limits.max_batch_tokens, limits.max_context - truncate_at - 1, budget_room, 64)
        )
        suffix = h.tokens(length, seed=3)
        reference = h.session("reference")
        h.prefill(engine, reference, 0, prefix)
        expected_rolled_back = logits_array(h.decode(engine, reference, len(prefix), (follow,)))
        h.release(engine, reference)
        # A fast engine finishes a prefill within one GIL switch interval (5 ms), before the
        # canceller thread ever runs; switching often gives the cancel a chance to land.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            observed = self._cancel_attempts(
                engine, prefix, follow, truncate_at, suffix, expected_rolled_back
            )
        finally:
            sys.setswitchinterval(switch_interval)
        metrics = engine.metrics()
        assert metrics.cancelled >= observed, (
            f"metrics.cancelled is {metrics.cancelled}; {observed} requests were cancelled"
        )
        assert engine.health().in_flight == 0
        if observed == 0:
            h.no_cancel_landed("no cancel landed while a prefill ran (each finished first)")

    def _cancel_attempts(
        self,
        engine: ShardEngine,
        prefix: tuple[int, ...],
        follow: int,
        truncate_at: int,
        suffix: tuple[int, ...],
        expected_rolled_back: npt.NDArray[np.float32],
    ) -> int:
        """Cancel a truncating prefill once per delay; check the state after each; return how
        many attempts were cancelled."""
        h = self.harness
        exact, tolerance = self._shape_exactness(engine.capabilities())
        length = len(suffix)
        expected_completed: npt.NDArray[np.float32] | None = None
        observed = 0
        deadline = time.monotonic() + _CANCEL_RETRY_SECONDS
        for attempt, delay in enumerate(itertools.cycle(_CANCEL_DELAYS)):
            if attempt >= len(_CANCEL_DELAYS) and (observed or time.monotonic() > deadline):
                break
            session = h.session(f"attempt-{attempt}")
            h.prefill(engine, session, 0, prefix)
            request_id = h.request_id()
            cancel = (
                CancelRequest(request_id=request_id)
                if attempt % 2
                else CancelRequest(session_id=session.session_id)
            )
            canceller = Canceller(engine, cancel, delay)
            canceller.start()
            try:
                h.prefill(engine, session, truncate_at, suffix, request_id=request_id)
                cancelled = False
            except Cancelled as error:
                assert_cancelled(error, f"a cancelled prefill (attempt {attempt})")
                cancelled = True
            finally:
                canceller.stop()
            if canceller.error is not None:
                raise AssertionError(f"cancel() raised {canceller.error!r}") from canceller.error
            if not cancelled and canceller.result is not None:
                raise AssertionError(
                    f"cancel() returned {canceller.result} while the prefill ran (attempt "
                    f"{attempt}), yet the prefill committed and returned its result; "
                    "cancelled=True means the operation will not commit"
                )
            if cancelled:
                observed += 1
                reported = canceller.result.n_requests if canceller.result else 0
                assert reported >= 1, (
                    "the caller saw Cancelled but cancel() did not report a cancelled request"
                )
                got = logits_array(h.decode(engine, session, len(prefix), (follow,)))
                assert_matches(
                    got,
                    expected_rolled_back,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"after a cancelled prefill (attempt {attempt}) the session "
                    "must be rolled back to its committed state",
                )
            else:
                if expected_completed is None:
                    clean = h.session("clean")
                    h.prefill(engine, clean, 0, prefix[:truncate_at] + suffix)
                    expected_completed = logits_array(
                        h.decode(engine, clean, truncate_at + length, (follow,))
                    )
                    h.release(engine, clean)
                got = logits_array(h.decode(engine, session, truncate_at + length, (follow,)))
                assert_matches(
                    got,
                    expected_completed,
                    exact=exact,
                    tolerance=tolerance,
                    what="a prefill that completed despite a late cancel must "
                    "leave the session as a clean run does",
                )
            h.release(engine, session)
        return observed

    def test_cancel_unknown_or_finished(self) -> None:
        """Cancelling an unknown request, a finished request, or an idle session returns
        cancelled=False and never raises; naming neither or both targets is InvalidRequest.

        Fix: look the target up among in-flight requests only; return False when none."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        finished = h.request_id()
        h.prefill(engine, session, 0, h.tokens(3, seed=1), request_id=finished)
        for request in (
            CancelRequest(request_id="no-such-request"),
            CancelRequest(request_id=finished),
            CancelRequest(session_id=session.session_id),
            CancelRequest(session_id="no-such-session"),
        ):
            result = engine.cancel(request)
            assert (result.cancelled, result.n_requests) == (False, 0), f"{request}: {result}"
        _raises(InvalidRequest, lambda: engine.cancel(CancelRequest()), "cancel of nothing")
        _raises(
            InvalidRequest,
            lambda: engine.cancel(CancelRequest(request_id="x", session_id="y")),
            "cancel naming both a request and a session",
        )
        h.decode(engine, session, 3, (1,))

    # ================================================================= semantics

    def test_deterministic(self) -> None:
        """The same requests give bit-identical results: on two sessions of one engine and
        on two freshly loaded engines (prefill of all rows, then decodes; bundles too).

        Fix: remove any dependence on uninitialised memory, thread scheduling or global
        state; or declare determinism.deterministic = False."""
        h = self.harness
        first = h.load()
        if not first.capabilities().determinism.deterministic:
            suite_skip("engine declares determinism.deterministic = False")
        second = h.load()
        tokens = h.tokens(_PROMPT, seed=1)
        steps = h.tokens(2, seed=2)
        runs: list[list[bytes]] = []
        for engine, name in ((first, "a"), (first, "b"), (second, "a")):
            session = h.session(name)
            outputs = [
                bytes(logits_of(h.prefill(engine, session, 0, tokens, logits="all")).payload)
            ]
            for offset, token in enumerate(steps):
                outputs.append(
                    bytes(logits_of(h.decode(engine, session, _PROMPT + offset, (token,))).payload)
                )
            runs.append(outputs)
        assert runs[0] == runs[1], "two sessions of one engine gave different bytes"
        assert runs[0] == runs[2], "two fresh engines gave different bytes"
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            bundles = [
                bytes(h.head_bundle(h.load(*head_range), h.session("h"), 0, tokens).payload)
                for _ in range(2)
            ]
            assert bundles[0] == bundles[1], "two fresh head shards gave different bundles"

    def test_split_invariance_two_way(self) -> None:
        """A 2-way pipeline (head -> tail) gives the logits of one full shard, for prefill
        (all rows) and decode steps: bit for bit when the engine declares split_exact, else
        within its tolerance.

        Fix: carry hidden states across the boundary without loss (f32), apply per-layer
        rules by absolute layer index, and keep numerics identical across shards."""
        self._check_split(2)

    def test_split_invariance_three_way(self) -> None:
        """A 3-way (uneven when it does not divide) pipeline head -> middle -> tail gives
        the full shard's logits (exact or within the declared tolerance).

        Fix: as for the 2-way split; a middle shard takes and emits bundles."""
        self._check_split(3)

    def test_decode_consistency(self) -> None:
        """Prefill N tokens then decode token N gives the last logits of prefilling N+1
        tokens (exact or within tolerance), for several consecutive decodes.

        Fix: decode must attend to the cached history at positions 0..N-1 and write
        position N; a decode that ignores the cache or the position fails this."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        tokens = h.tokens(_PROMPT + 3, seed=1)
        session = h.session("incremental")
        h.prefill(engine, session, 0, tokens[:_PROMPT])
        for pos in range(_PROMPT, len(tokens)):
            got = logits_array(h.decode(engine, session, pos, (tokens[pos],)))
            whole = logits_array(h.prefill(engine, h.session(f"whole-{pos}"), 0, tokens[: pos + 1]))
            assert_matches(
                got,
                whole,
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} vs prefill of {pos + 1} tokens",
            )

    def test_chunked_prefill(self) -> None:
        """A prefill sent in chunks (each at the previous committed length) gives the rows of
        one prefill (logits "all") and the same following decode.

        Fix: a prefill at start_pos == committed length must append to the cache."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        tokens = h.tokens(9, seed=1)
        one = h.session("one")
        whole = logits_array(h.prefill(engine, one, 0, tokens, logits="all"))
        chunked = h.session("chunked")
        rows = [
            logits_array(h.prefill(engine, chunked, start, tokens[start:end], logits="all"))
            for start, end in ((0, 2), (2, 7), (7, 9))
        ]
        assert_matches(
            np.concatenate(rows),
            whole,
            exact=exact,
            tolerance=tolerance,
            what="chunks (0-2, 2-7, 7-9) vs one prefill of 9 tokens",
        )
        follow = h.tokens(1, seed=2)
        assert_matches(
            logits_array(h.decode(engine, chunked, 9, follow)),
            logits_array(h.decode(engine, one, 9, follow)),
            exact=exact,
            tolerance=tolerance,
            what="decode after chunked prefill",
        )

    def test_truncate(self) -> None:
        """A prefill at start_pos below the committed length truncates there and continues:
        the result and the following decodes equal a fresh run of the new sequence.

        With features.truncate = False a truncating prefill must raise UnsupportedFeature and
        change nothing (then the rest is skipped).

        Fix: drop cached positions >= start_pos before appending (or declare
        features.truncate = False and refuse truncation with UnsupportedFeature)."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        if not caps.features.truncate:
            self._check_truncate_refused(engine)
            suite_skip("engine declares features.truncate = False (and refuses truncation)")
        exact, tolerance = self._shape_exactness(caps)
        original = h.tokens(8, seed=1)
        replacement = h.tokens(3, seed=2)
        edited = h.session("edited")
        h.prefill(engine, edited, 0, original)
        h.decode(engine, edited, 8, (1,))
        got = logits_array(h.prefill(engine, edited, 4, replacement, logits="all"))
        fresh = h.session("fresh")
        want = logits_array(h.prefill(engine, fresh, 0, original[:4] + replacement, logits="all"))
        assert_matches(
            got,
            want[4:],
            exact=exact,
            tolerance=tolerance,
            what="prefill at 4 over 9 cached positions vs a fresh run",
        )
        for pos, token in enumerate(h.tokens(2, seed=3), start=7):
            assert_matches(
                logits_array(h.decode(engine, edited, pos, (token,))),
                logits_array(h.decode(engine, fresh, pos, (token,))),
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} after truncate",
            )

    def test_session_isolation(self) -> None:
        """Interleaving other sessions (prefills, decodes, truncations, releases) does not
        change a session's outputs compared with running it alone on a fresh engine, also when
        two sessions with different histories get the same inputs at the same positions.

        Fix: keep every cache per session; never share or reuse a slot's state, and never
        reuse outputs keyed by inputs and positions without the session's history."""
        h = self.harness
        alone = h.load()
        caps = alone.capabilities()
        exact, tolerance = self._isolation_exactness(caps)
        tokens = h.tokens(_PROMPT, seed=1)
        steps = h.tokens(3, seed=2)
        session = h.session("a")
        expected = [logits_array(h.prefill(alone, session, 0, tokens))]
        expected += [
            logits_array(h.decode(alone, session, _PROMPT + i, (t,))) for i, t in enumerate(steps)
        ]
        shared = h.load()
        b, c = h.session("b"), h.session("c")
        h.prefill(shared, b, 0, h.tokens(9, seed=3))
        got = [logits_array(h.prefill(shared, session, 0, tokens))]
        h.prefill(shared, c, 0, h.tokens(4, seed=4))
        h.decode(shared, b, 9, (2,))
        got.append(logits_array(h.decode(shared, session, _PROMPT, (steps[0],))))
        h.prefill(shared, b, 2, h.tokens(5, seed=5))
        h.release(shared, c)
        got.append(logits_array(h.decode(shared, session, _PROMPT + 1, (steps[1],))))
        h.prefill(shared, h.session("d"), 0, h.tokens(7, seed=6))
        got.append(logits_array(h.decode(shared, session, _PROMPT + 2, (steps[2],))))
        for index, (have, want) in enumerate(zip(got, expected, strict=True)):
            assert_matches(
                have,
                want,
                exact=exact,
                tolerance=tolerance,
                what=f"output {index} of a session interleaved with others",
            )
        # Two sessions with different histories given the same inputs at the same positions (a
        # prefill chunk, then a decode): an engine that reuses outputs or state keyed by inputs
        # and positions, not by session, gives the second one the first one's outputs.
        continuation = h.tokens(2, seed=8)
        for name, seed in (("x", 9), ("y", 10)):
            other = h.session(name)
            prompt = h.tokens(_PROMPT, seed=seed)
            runs: list[list[npt.NDArray[np.float32]]] = []
            for engine in (h.load(), shared):
                runs.append(
                    [
                        logits_array(h.prefill(engine, other, 0, prompt)),
                        logits_array(h.prefill(engine, other, _PROMPT, continuation)),
                        logits_array(h.decode(engine, other, _PROMPT + 2, (steps[0],))),
                    ]
                )
            for index, (have, want) in enumerate(zip(runs[1], runs[0], strict=True)):
                assert_matches(
                    have,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"output {index} of session {name!r}, whose history differs from "
                    "another session's that got the same inputs at the same positions",
                )

    def test_batched_decode_matches_single(self) -> None:
        """``decode_batch`` over several sessions (at different epochs) gives, per item and
        in item order, what a single decode gives (exact when the engine declares
        batch_invariant and split_exact, else within tolerance), addressed to the item's own
        request id, session and epoch.

        Fix: keep rows in item order; make batching not change numerics, or declare
        batch_invariant = False and a tolerance; build each item's result from its own
        request."""
        h = self.harness
        batched = h.load()
        caps = batched.capabilities()
        self._need_batches(batched)
        exact, tolerance = self._batch_exactness(caps)
        single = h.load()
        lengths = (3, 7, 5)
        sessions = [h.session(f"s{i}", epoch=i + 1) for i in range(len(lengths))]
        for index, (session, length) in enumerate(zip(sessions, lengths, strict=True)):
            for engine in (batched, single):
                h.prefill(engine, session, 0, h.tokens(length, seed=index))
        for step in range(2):
            items = tuple(
                DecodeRequest(
                    request_id=h.request_id(),
                    session=session,
                    pos=length + step,
                    inputs=TokenInput(token_ids=(index + step,)),
                )
                for index, (session, length) in enumerate(zip(sessions, lengths, strict=True))
            )
            result = batched.decode_batch(
                DecodeBatchRequest(request_id=h.request_id(), items=items)
            )
            assert len(result.items) == len(items), "one outcome per item"
            for item, outcome in zip(items, result.items, strict=True):
                if isinstance(outcome, ErrorInfo):
                    raise AssertionError(f"batch item {item.session.session_id} failed: {outcome}")
                h.observe(outcome)
                assert outcome.session == item.session, "batch outcomes must be in item order"
                assert outcome.request_id == item.request_id
                _assert_addressed_to(outcome, item.session, f"batch item {item.request_id}")
                want = logits_array(h.decode(single, item.session, item.pos, item.inputs))
                assert_matches(
                    logits_array(outcome),
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"batched vs single decode of {item.session.session_id} at {item.pos}",
                )

    def test_batched_decode_item_errors(self) -> None:
        """A bad item of a batch fails alone, as an ErrorInfo in its place (CacheMiss with
        the committed length for a wrong position or unknown session, InvalidRequest for a bad
        token); the good items succeed and only they advance.

        Fix: plan and validate each item separately; never fail or advance the others."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        self._need_batches(engine)
        good, wrong_pos, bad_token = h.session("good"), h.session("wrong"), h.session("bad")
        for session in (good, wrong_pos, bad_token):
            h.prefill(engine, session, 0, h.tokens(4, seed=1))
        items = (
            DecodeRequest(
                request_id=h.request_id(), session=good, pos=4, inputs=TokenInput(token_ids=(1,))
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=wrong_pos,
                pos=6,
                inputs=TokenInput(token_ids=(1,)),
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=h.session("unknown"),
                pos=0,
                inputs=TokenInput(token_ids=(1,)),
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=bad_token,
                pos=4,
                inputs=TokenInput(token_ids=(caps.vocab_size,)),
            ),
        )
        result = engine.decode_batch(DecodeBatchRequest(request_id=h.request_id(), items=items))
        assert len(result.items) == len(items), "one outcome per item, in item order"
        first, second, third, fourth = result.items
        assert isinstance(first, LogitsResult | BoundaryResult), f"good item failed: {first}"
        h.observe(first)
        for outcome, code, committed in (
            (second, "cache_miss", 4),
            (third, "cache_miss", 0),
            (fourth, "invalid_request", None),
        ):
            assert isinstance(outcome, ErrorInfo), f"expected an ErrorInfo, got {outcome!r}"
            assert outcome.code == code, f"expected code {code!r}, got {outcome.code!r}"
            if committed is not None:
                assert outcome.details.get("committed_length") == committed, outcome.details
        h.decode(engine, good, 5, (1,))
        h.decode(engine, wrong_pos, 4, (1,))
        h.decode(engine, bad_token, 4, (1,))

    def test_release_tombstone(self) -> None:
        """``release`` frees a session and fences its epoch: prefill and decode with that
        epoch or an older one raise StaleEpoch (never a silent fresh session); a newer epoch
        starts fresh and equals a brand-new session.

        Fix: keep a tombstone of the released epoch and check it before creating state."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        released = h.session("a", epoch=3)
        h.prefill(engine, released, 0, h.tokens(5, seed=1))
        result = h.release(engine, released)
        assert result.released, f"releasing a live session must say released: {result}"
        assert engine.health().sessions == 0
        for epoch in (3, 2):
            stale = h.session("a", epoch=epoch)
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, stale, 0, h.tokens(2, seed=2)),
                f"prefill with released epoch {epoch}",
            )
            _raises(
                StaleEpoch,
                partial(h.decode, engine, stale, 5, (1,)),
                f"decode with released epoch {epoch}",
            )
        newer = h.session("a", epoch=4)
        _raises(
            CacheMiss,
            lambda: h.decode(engine, newer, 5, (1,)),
            "decode of a newer epoch that has no state",
        )
        got = logits_array(h.prefill(engine, newer, 0, h.tokens(3, seed=3)))
        want = logits_array(h.prefill(engine, h.session("b"), 0, h.tokens(3, seed=3)))
        assert_matches(
            got,
            want,
            exact=exact,
            tolerance=tolerance,
            what="a newer epoch after release must start fresh",
        )

    def test_release_unknown_session(self) -> None:
        """Releasing a session the engine does not hold is a no-op that says so
        (released=False, a detail) and never raises; live sessions are untouched.

        Fix: return ReleaseResult(released=False, detail=...) for unknown sessions."""
        h = self.harness
        engine = h.load()
        live = h.session("live")
        h.prefill(engine, live, 0, h.tokens(3, seed=1))
        result = h.release(engine, h.session("never-seen"))
        assert not result.released, f"an unknown session cannot be released: {result}"
        assert result.detail, "the release result must say why nothing was freed"
        assert engine.health().sessions == 1
        h.decode(engine, live, 3, (1,))

    def test_lru_eviction(self) -> None:
        """With eviction "lru", admitting past the KV budget evicts the least recently used
        idle session; its next decode raises CacheMiss with reason "evicted", and the
        evicted epoch can restart with a prefill at 0. Others are untouched. A decode_batch
        never evicts a session it names, even one used less recently than an idle session.

        Fix: evict by last use, remember the evicted epoch, report reason "evicted"; when
        admitting a batch, exclude every session the batch names from the candidates."""
        h = self.harness
        engine = h.load(kv_budget_tokens=12, eviction="lru")
        caps = engine.capabilities()
        if not caps.features.eviction:
            suite_skip("engine does not support eviction (features.eviction is False)")
        exact, tolerance = self._shape_exactness(caps)
        oldest, recent, newcomer = h.session("oldest"), h.session("recent"), h.session("new")
        h.prefill(engine, oldest, 0, h.tokens(5, seed=1))
        h.prefill(engine, recent, 0, h.tokens(5, seed=2))
        h.prefill(engine, newcomer, 0, h.tokens(5, seed=3))
        miss = _raises(CacheMiss, lambda: h.decode(engine, oldest, 5, (1,)), "decode evicted")
        reason = miss.reason if isinstance(miss, CacheMiss) else None
        assert reason == "evicted", f"CacheMiss reason must be 'evicted', got {reason!r}"
        assert engine.metrics().evictions >= 1
        h.decode(engine, recent, 5, (1,))
        h.decode(engine, newcomer, 5, (1,))
        h.release(engine, recent)
        got = logits_array(h.prefill(engine, oldest, 0, h.tokens(5, seed=1)))
        fresh = h.load()
        want = logits_array(h.prefill(fresh, oldest, 0, h.tokens(5, seed=1)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="re-prefill of an evicted session"
        )
        if caps.features.batched_decode:
            self._check_batch_spares_its_members()

    def _check_batch_spares_its_members(self) -> None:
        """A full budget, three sessions (the batch's second member used least recently):
        admitting the batch's first item must evict the idle third session, never the
        batch's own later member."""
        h = self.harness
        engine = h.load(kv_budget_tokens=12, eviction="lru")
        later, first, idle = h.session("later"), h.session("first"), h.session("idle")
        for seed, session in enumerate((later, first, idle)):
            h.prefill(engine, session, 0, h.tokens(4, seed=seed))
        items = tuple(
            DecodeRequest(
                request_id=h.request_id(), session=session, pos=4, inputs=TokenInput(token_ids=(1,))
            )
            for session in (first, later)
        )
        outcomes = engine.decode_batch(DecodeBatchRequest(request_id=h.request_id(), items=items))
        for name, outcome in zip(("first", "later"), outcomes.items, strict=True):
            assert not isinstance(outcome, ErrorInfo), (
                f"batch item of {name!r} failed ({outcome}): admitting a batch may evict only "
                "idle sessions, never one the batch names"
            )
            h.observe(outcome)
        miss = _raises(CacheMiss, lambda: h.decode(engine, idle, 4, (1,)), "decode of the idle")
        assert isinstance(miss, CacheMiss)
        assert miss.reason == "evicted", f"the idle session must be the one evicted: {miss}"

    def test_failed_request_is_atomic(self) -> None:
        """Failed requests (bad token mid-truncation, context overflow, KV budget, reserved
        field, wrong decode position, gap) leave the session unchanged: afterwards a decode at
        the old committed length succeeds and equals a clean run.

        Fix: validate and admit everything before touching the cache, and roll back on any
        error after that."""
        h = self.harness
        engine = h.load(max_context=16, kv_budget_tokens=14, max_batch_tokens=16)
        exact, tolerance = self._shape_exactness(engine.capabilities())
        vocab = engine.capabilities().vocab_size
        tokens = h.tokens(8, seed=1)
        session = h.session("a")
        h.prefill(engine, session, 0, tokens)
        failures: list[tuple[str, type[ShardEngineError], Callable[[], object]]] = [
            (
                "truncating prefill with a bad token",
                InvalidRequest,
                lambda: h.prefill(engine, session, 2, (1, vocab)),
            ),
            (
                "truncating prefill past max_context",
                ResourceExhausted,
                lambda: h.prefill(engine, session, 2, h.tokens(15, seed=2)),
            ),
            (
                "truncating prefill past the KV budget",
                ResourceExhausted,
                lambda: h.prefill(engine, session, 2, h.tokens(13, seed=2)),
            ),
            (
                "truncating prefill with a reserved field",
                UnsupportedFeature,
                lambda: engine.prefill(
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=session,
                        start_pos=2,
                        inputs=TokenInput(token_ids=(1, 2)),
                        mtp=(MtpState(n_draft_tokens=1),),
                    )
                ),
            ),
            ("decode at the wrong position", CacheMiss, lambda: h.decode(engine, session, 3, (1,))),
            ("prefill with a gap", CacheMiss, lambda: h.prefill(engine, session, 9, (1,))),
        ]
        for what, error, call in failures:
            _raises(error, call, what)
            health = engine.health()
            assert health.kv_used_tokens == len(tokens), (
                f"after a failed {what} the session holds {health.kv_used_tokens} positions"
            )
        got = logits_array(h.decode(engine, session, len(tokens), (3,)))
        clean = h.load()
        h.prefill(clean, session, 0, tokens)
        want = logits_array(h.decode(clean, session, len(tokens), (3,)))
        assert_matches(
            got,
            want,
            exact=exact,
            tolerance=tolerance,
            what="decode after failed requests vs a clean run",
        )

    def test_result_fields(self) -> None:
        """Results echo the request id and session and carry the right positions: logits
        "last" is one row at start+n-1, "all" is n rows from start (whose last row equals
        "last"), a decode is at pos; bundles enter layer == the shard's end, with the shard's
        fingerprint, matching positions and a valid checksum; every result's timings (batch
        items' too) are finite and >= 0.

        Fix: build results from the request's positions (EngineCore._make_result does), and
        timings from one monotonic clock (time.perf_counter)."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        tokens = h.tokens(5, seed=1)
        last_id = h.request_id()
        session = h.session("a")
        last = logits_of(h.prefill(engine, session, 0, tokens, request_id=last_id))
        assert last.request_id == last_id
        assert last.session == session
        assert (last.first_pos, last.n_rows, last.vocab_size) == (4, 1, caps.vocab_size), (
            f"logits 'last' of a 5-token prefill at 0: first_pos {last.first_pos}, "
            f"n_rows {last.n_rows} (expected 4, 1)"
        )
        assert payload_checksum(last.payload) == last.checksum, "logits checksum is wrong"
        every = logits_of(h.prefill(engine, h.session("b"), 0, tokens, logits="all"))
        assert (every.first_pos, every.n_rows) == (0, 5), (
            f"logits 'all': first_pos {every.first_pos}, n_rows {every.n_rows} (expected 0, 5)"
        )
        exact, tolerance = self._shape_exactness(caps)
        assert_matches(
            np.array(every.array())[-1:],
            np.array(last.array()),
            exact=exact,
            tolerance=tolerance,
            what="the last row of logits 'all' vs. logits 'last'",
        )
        step = logits_of(h.decode(engine, session, 5, (1,)))
        assert (step.first_pos, step.n_rows) == (5, 1), (
            f"decode at 5: first_pos {step.first_pos}, n_rows {step.n_rows}"
        )
        extended = logits_of(h.prefill(engine, session, 6, (2, 3), logits="all"))
        assert (extended.first_pos, extended.n_rows) == (6, 2)
        results: list[tuple[str, ShardResult]] = [
            ("a prefill (logits 'last')", last),
            ("a prefill (logits 'all')", every),
            ("a decode", step),
            ("a truncating prefill", extended),
        ]
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            head = h.load(*head_range)
            head_caps = head.capabilities()
            result = h.prefill(head, session, 0, tokens)
            assert isinstance(result, BoundaryResult), "a head shard returns a BoundaryResult"
            bundle = result.bundle
            assert (result.first_pos, result.n_tokens) == (0, 5)
            assert result.session == session
            assert bundle.session == session
            assert (bundle.first_pos, bundle.n_tokens) == (0, 5)
            assert bundle.layer == head_range[1], (
                f"bundle.layer must be the producer's end {head_range[1]}, got {bundle.layer}"
            )
            assert bundle.model_fingerprint == head_caps.model_fingerprint
            assert bundle.hidden_size == head_caps.hidden_size
            assert bundle.contract_version == CONTRACT_VERSION
            assert payload_checksum(bundle.payload) == bundle.checksum, "bundle checksum wrong"
            assert len(bundle.payload) == bundle.expected_payload_bytes
            head_step = h.decode(head, session, 5, (1,))
            step_bundle = bundle_of(head_step)
            assert (step_bundle.first_pos, step_bundle.n_tokens) == (5, 1)
            results += [("a head prefill", result), ("a head decode", head_step)]
        for what, timed in results:
            assert_timings(timed.timings, what)
        if caps.features.batched_decode:
            for item in self._batch(engine, [self._item(session, 8, (4,))]).items:
                assert not isinstance(item, ErrorInfo), f"a batched decode failed: {item}"
                assert_timings(item.timings, "a batch item")

    def test_evidence_class(self) -> None:
        """Every result (logits, bundles, batch items) carries the evidence class of the
        capabilities, and the capabilities carry the class the engine registered; a fixture
        engine's run is therefore never reported as a real-model certification.

        Fix: stamp ``capabilities.evidence`` on every result; register the same class in
        the EngineDescription."""
        h = self.harness
        engines = [h.load()]
        if h.n_layers >= 2:
            engines += h.load_pipeline(2)
        full_caps = engines[0].capabilities()
        spec_evidence = h.record.spec_evidence
        if spec_evidence:
            assert set(spec_evidence) == {full_caps.evidence}, (
                f"the registered EngineDescription says {spec_evidence}, capabilities say "
                f"{full_caps.evidence!r}"
            )
        for engine in engines:
            caps = engine.capabilities()
            assert caps.evidence == full_caps.evidence, "shards disagree on evidence"
            session = h.session("a")
            inputs: TokenInput | BoundaryBundle
            if caps.shard.takes_tokens:
                inputs = TokenInput(token_ids=h.tokens(3, seed=1))
                step: TokenInput | BoundaryBundle = TokenInput(token_ids=(1,))
            else:
                producer = engines[1]
                inputs = bundle_of(h.prefill(producer, h.session("p"), 0, h.tokens(3, seed=1)))
                inputs = rebuilt_bundle(inputs, session=session)
                step = rebuilt_bundle(
                    bundle_of(h.decode(producer, h.session("p"), 3, (1,))), session=session
                )
            results: list[ShardResult] = [
                h.prefill(engine, session, 0, inputs),
                h.decode(engine, session, 3, step),
            ]
            if caps.features.batched_decode and caps.shard.takes_tokens:
                batch = engine.decode_batch(
                    DecodeBatchRequest(
                        request_id=h.request_id(),
                        items=(
                            DecodeRequest(
                                request_id=h.request_id(),
                                session=session,
                                pos=4,
                                inputs=TokenInput(token_ids=(2,)),
                            ),
                        ),
                    )
                )
                for outcome in batch.items:
                    assert not isinstance(outcome, ErrorInfo), outcome
                    results.append(h.observe(outcome))
            for result in results:
                assert result.evidence == caps.evidence, (
                    f"{type(result).__name__} says evidence {result.evidence!r}; capabilities "
                    f"of {caps.role} shard say {caps.evidence!r}"
                )

    def test_health_metrics_consistent(self) -> None:
        """Health and metrics agree with the operations performed: request counts (failed
        ones included; prefill, decode and decode_batch calls are requests, releases are
        not), prefill/decode token counts (successful ones only), errors by code (a release's
        StaleEpoch included), sessions, KV positions used, releases and tombstones;
        compute_ms grows once results report time spent computing.

        Fix: count in the shared ledger (EngineCore does) and report the counters as they
        are; do not count tokens of failed or cancelled requests, nor releases as requests;
        never reset a counter when it is read (every counter, compute_ms included, only
        grows)."""
        h = self.harness
        engine = h.load()
        start = engine.metrics()
        assert start.requests == 0
        a, b = h.session("a"), h.session("b", epoch=2)
        results = [
            h.prefill(engine, a, 0, h.tokens(5, seed=1)),
            h.decode(engine, a, 5, (1,)),
            h.prefill(engine, b, 0, h.tokens(3, seed=2)),
        ]
        _raises(CacheMiss, lambda: h.decode(engine, b, 7, (1,)), "decode at a wrong position")
        _raises(
            StaleEpoch,
            lambda: h.prefill(engine, h.session("b", epoch=1), 0, (1,)),
            "prefill with an older epoch",
        )
        metrics = engine.metrics()
        _assert_counters_grew(start, metrics)
        reported_ms = sum(result.timings.compute_ms for result in results)
        assert reported_ms == 0.0 or metrics.compute_ms > start.compute_ms, (
            f"metrics.compute_ms stayed {metrics.compute_ms!r} while three requests reported "
            f"{reported_ms:.3f} ms of compute in their timings; it counts the time spent "
            "computing"
        )
        health = engine.health()
        _assert_health_metrics_within(engine, engine.capabilities().limits)
        expected = {
            "requests": 5,
            "prefill_requests": 3,
            "decode_requests": 2,
            "prefill_tokens": 8,
            "decode_tokens": 1,
            "sessions_active": 2,
            "kv_used_tokens": 9,
        }
        observed = {name: getattr(metrics, name) for name in expected}
        assert observed == expected, f"metrics {observed} != expected {expected}"
        assert metrics.errors == {"cache_miss": 1, "stale_epoch": 1}, (
            f"metrics.errors {metrics.errors} != {{'cache_miss': 1, 'stale_epoch': 1}}"
        )
        assert (health.sessions, health.kv_used_tokens, health.in_flight) == (2, 9, 0), (
            f"health: sessions {health.sessions}, kv {health.kv_used_tokens}, "
            f"in flight {health.in_flight} (expected 2, 9, 0)"
        )
        h.release(engine, b)
        _raises(StaleEpoch, lambda: h.release(engine, h.session("a", epoch=0)), "stale release")
        h.release(engine, h.session("never-seen"))
        before, metrics = metrics, engine.metrics()
        _assert_counters_grew(before, metrics)
        assert (metrics.releases, metrics.sessions_active, metrics.kv_used_tokens) == (1, 1, 6)
        assert metrics.tombstones >= 1
        assert engine.health().kv_used_tokens == 6
        assert metrics.requests == 5, (
            f"metrics.requests is {metrics.requests} after three releases; requests count "
            "prefill, decode and decode_batch calls only (releases are counted in releases)"
        )
        assert metrics.errors == {"cache_miss": 1, "stale_epoch": 2}, (
            f"metrics.errors {metrics.errors}: the StaleEpoch a release raised counts too"
        )


_CUMULATIVE: Final = (
    "requests",
    "prefill_requests",
    "decode_requests",
    "batch_requests",
    "prefill_tokens",
    "decode_tokens",
    "cancelled",
    "evictions",
    "releases",
    "exports",
    "imports",
    "fences_dropped",
    "compute_ms",
)


def _assert_health_metrics_within(engine: ShardEngine, limits: Limits | None) -> None:
    """Health and metrics are well typed, within their wire bounds (non-negative 64-bit
    counts, a finite compute_ms, non-empty error codes) and, once loaded, within the
    advertised limits (sessions, KV positions)."""
    for problem in (
        health_problem(engine.health(), limits),
        metrics_problem(engine.metrics(), limits),
    ):
        assert problem is None, f"{problem[0]}: {problem[1]}"


def _assert_counters_grew(before: Metrics, after: Metrics) -> None:
    """Counters since load never go back, and time spent computing is a finite number."""
    for metrics in (before, after):
        problem = metrics_problem(metrics, None)
        assert problem is None, f"metrics break the contract: {problem[1]}"
    duration = after.compute_ms
    assert math.isfinite(duration), f"metrics.compute_ms is {duration}: a duration is finite"
    assert duration >= 0.0, f"metrics.compute_ms is {duration}: a duration is not negative"
    shrunk = {
        name: (getattr(before, name), getattr(after, name))
        for name in _CUMULATIVE
        if getattr(after, name) < getattr(before, name)
    }
    shrunk.update(
        (f"errors[{code!r}]", (count, after.errors.get(code, 0)))
        for code, count in before.errors.items()
        if after.errors.get(code, 0) < count
    )
    assert not shrunk, f"metrics counters went back between two reads: {shrunk}"


def _deep(request: pytest.FixtureRequest) -> bool:
    """Whether ``--shard-engine-profile deep`` asks the model-based tests to reach further."""
    return bool(request.config.getoption("shard_engine_profile", default="default") == "deep")


def _assert_addressed_to(result: ShardResult, session: SessionRef, what: str) -> None:
    addressed = [result.session]
    if isinstance(result, BoundaryResult):
        addressed.append(result.bundle.session)
    assert all(ref == session for ref in addressed), (
        f"{what}: the result is addressed to {addressed}, not to the request's {session}"
    )


def _check_pinned() -> None:
    defined = sorted(name for name in dir(ShardEngineConformance) if name.startswith("test_"))
    if tuple(defined) != STANDARD_TESTS:
        raise RuntimeError(
            f"ShardEngineConformance defines {defined}, STANDARD_TESTS pins {STANDARD_TESTS}"
        )
    for name in defined:
        if not getattr(ShardEngineConformance, name).__doc__:
            raise RuntimeError(f"standard test {name} has no docstring")


_check_pinned()
