"""The standard tests of an engine's life: refused before ``load`` and after ``close``, a
second load refused, a refused load that leaves the engine loadable, health going unloaded ->
ready -> closed, the capabilities it advertises (fields, roles, reserved hooks, declared
tolerances), health and metrics agreeing with the operations performed, and an injected crash
that is permanent. :class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`LIFECYCLE_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import msgspec

from shard_engine_api._errors import (
    CacheMiss,
    EngineCrashed,
    InvalidRequest,
    NotReady,
    ShardEngineError,
    StaleEpoch,
    UnsupportedFeature,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    ExportSessionRequest,
    ImportSessionRequest,
    Limits,
    Metrics,
    OutputKind,
    PrefillRequest,
    TokenInput,
)
from shard_engine_api._validation import health_problem, metrics_problem
from shard_engine_api.conformance._harness import (
    _PROMPT,
    SuiteHelpers,
    Tolerances,
    _raises,
    _rows,
    assert_matches,
    logits_of,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["LIFECYCLE_TESTS", "LifecycleTests"]

LIFECYCLE_TESTS: Final[tuple[str, ...]] = (
    "test_capabilities_fields",
    "test_crash_is_permanent",
    "test_health_metrics_consistent",
    "test_health_states",
    "test_load_after_a_refused_load",
    "test_load_twice_rejected",
    "test_not_ready_after_close",
    "test_not_ready_before_load",
    "test_reserved_hooks_present_but_disabled",
    "test_role_derived_from_shard",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""


MAX_RELATIVE_TOLERANCE: Final = 0.5
"""The largest relative tolerance (of a row's magnitude) the suite accepts as a declaration."""


class LifecycleTests(SuiteHelpers):
    """The standard tests of an engine's life (module docstring)."""

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

    def _check_declared_tolerances(self, engine: ShardEngine) -> None:
        """The declared tolerances are numbers a comparison can fail: finite, >= 0, a
        relative part of at most ``MAX_RELATIVE_TOLERANCE``, and (when any comparison uses
        them) too tight to accept the outputs of a different prompt as the same."""
        h = self.harness
        determinism = engine.capabilities().determinism
        legacy = determinism.tolerance
        if not (math.isfinite(legacy) and legacy >= 0.0):
            raise AssertionError(f"determinism.tolerance is {legacy!r}; it must be finite and >= 0")
        kinds: tuple[OutputKind, ...] = ("logits", "hidden")
        for kind in kinds:
            declared = determinism.tolerance_for(kind)
            assert declared.relative <= MAX_RELATIVE_TOLERANCE, (
                f"the declared {kind} tolerance {declared} allows {declared.relative:.0%} of a "
                f"row's magnitude; at most {MAX_RELATIVE_TOLERANCE:.0%} is a bound a wrong output "
                "can fail"
            )
        if determinism.deterministic and determinism.split_exact and determinism.batch_invariant:
            return  # every comparison is bit for bit; no tolerance is ever applied
        tolerances = Tolerances.declared(determinism)
        first, second = h.tokens(_PROMPT, seed=1), h.tokens(_PROMPT, seed=2)
        engines: list[tuple[ShardEngine, OutputKind]] = [(engine, "logits")]
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            engines.append((h.load(*head_range), "hidden"))
        for shard, kind in engines:
            outputs = [
                _rows(h.prefill(shard, h.session(f"tolerance-{seed}"), 0, tokens, logits="all"))
                for seed, tokens in ((1, first), (2, second))
            ]
            try:
                assert_matches(
                    outputs[1], outputs[0], exact=False, tolerance=tolerances, what="", kind=kind
                )
            except AssertionError:
                continue  # some row of the other prompt lies outside the tolerance
            raise AssertionError(
                f"the declared {kind} tolerance {tolerances.of(kind)} accepts the outputs of "
                f"another prompt ({_PROMPT} positions) as equal: comparisons within it cannot "
                "fail, so the tests that rely on it would pass any output"
            )

    def test_crash_is_permanent(self) -> None:
        """With the fixture's crash options the next operation fails the engine: that call
        and every later prefill, decode, decode_batch, release, cancel and capabilities raise
        EngineCrashed, health says "failed", metrics still answer, and close works. Skipped when
        the fixture supplies no crash options. Every one of those errors is not retryable.

        Fix: map backend failures to EngineCrashed (retryable=False, its default), enter the
        failed state, and check it at the top of every operation."""
        h = self.harness
        options = dict(h.fixture.crash_options)
        if not options:
            suite_skip("the model fixture supplies no crash_options")
        engine = h.load(options=options)
        session = h.session("crash")
        calls: list[tuple[str, Callable[[], object]]] = [
            ("the crashing prefill", lambda: h.prefill(engine, session, 0, h.tokens(3, seed=1))),
            ("prefill after the crash", lambda: h.prefill(engine, h.session("other"), 0, (1,))),
            ("decode after the crash", lambda: h.decode(engine, session, 0, (1,))),
            (
                "decode_batch after the crash",
                lambda: self._batch(engine, [self._item(session, 0, (1,))]),
            ),
            ("release after the crash", lambda: h.release(engine, session)),
            (
                "cancel after the crash",
                lambda: engine.cancel(CancelRequest(session_id=session.session_id)),
            ),
            ("capabilities after the crash", engine.capabilities),
        ]
        for what, call in calls:
            error = _raises(EngineCrashed, call, what)
            # A failed engine stays failed until it is reloaded: a worker told "retryable"
            # would retry against it forever instead of replacing it.
            assert not error.retryable, f"{what}: EngineCrashed.retryable is True"
        health = engine.health()
        assert health.state == "failed", f"health after a crash says {health.state!r}"
        engine.metrics()
        engine.close()
        assert engine.health().state == "closed"

    def test_load_after_a_refused_load(self) -> None:
        """A load refused for a model that does not exist leaves the engine unloaded (health
        "unloaded", capabilities NotReady); a following load of the fixture's model succeeds
        and the engine serves as a freshly loaded one.

        Fix: on a failed load, release what it opened and return to the initial state (a
        failed load may be retried)."""
        h = self.harness
        engine = h.new_engine()
        good = h.config()
        missing = msgspec.structs.replace(
            good,
            shard=msgspec.structs.replace(good.shard, model=f"{good.shard.model}.no-such-model"),
        )
        try:
            engine.load(missing)
        except ShardEngineError:
            pass
        else:
            suite_skip("the engine loaded a model reference that names no model")
        assert engine.health().state == "unloaded", (
            f"after a refused load health says {engine.health().state!r}"
        )
        _raises(NotReady, engine.capabilities, "capabilities() after a refused load")
        caps = engine.load(good)
        h.note_capabilities(caps)
        exact, tolerance = self._repeat_exactness(caps)
        tokens = h.tokens(4, seed=1)
        got = _rows(h.prefill(engine, h.session("a"), 0, tokens))
        want = _rows(h.prefill(h.load(), h.session("a"), 0, tokens))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="a prefill after a refused load"
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
