"""The model-based conformance test: a hypothesis ``RuleBasedStateMachine`` that drives the
engine under test and the reference model (:mod:`._model`) side by side.

Every step (prefill, truncation, decode, decode_batch, release, cancel, new and huge epochs,
eviction; several sessions, long session ids) is sent to the engine and predicted by the model.
After each step the machine compares the outcome (success, or the error code with its fields),
the committed lengths, health and metrics; and it compares every output with a fresh replay of
the session's successful history on another engine of the same shard (bit for bit or within the
declared tolerance; NaN or infinity never matches). Shards of every role run: a non-head shard's
inputs are the rows of a fresh upstream shard run over the session's token history.

A failure reads as the call sequence of the (shrunk) example, the expectation, what came, and a
"Fix:" hint.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import CacheMiss, ErrorInfo, ShardEngineError
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeRequest,
    EvictionPolicy,
    LogitsMode,
    LogitsResult,
    OutputKind,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
    numpy_dtype,
)
from shard_engine_api.conformance._harness import Harness, Tolerances, assert_matches
from shard_engine_api.conformance._model import (
    Admission,
    ContractModel,
    ExpectedError,
    ModelLimits,
    Refusal,
)

__all__ = ["DEEP_EXAMPLES", "DEFAULT_EXAMPLES", "MachineConfig", "run_machine"]

DEFAULT_EXAMPLES: Final = 8
"""Examples per shard configuration by default (``--shard-engine-examples N`` for more)."""
_STEPS: Final = 24
_LIMITS: Final = {
    "max_sessions": 3,
    "max_context": 20,
    "max_batch_tokens": 16,
    "kv_budget_tokens": 26,
}
_DEEP_STEPS: Final = 60
_DEEP_LIMITS: Final = {
    "max_sessions": 5,
    "max_context": 320,
    "max_batch_tokens": 64,
    "kv_budget_tokens": 400,
}
"""The deep profile (``--shard-engine-profile deep``): longer sessions (hundreds of positions,
prefills of up to 64 rows), more sessions, batches of up to 12 items in any order, a KV budget
that batches evict through."""
DEEP_EXAMPLES: Final = 48
"""Examples per shard configuration in the deep profile (unless --shard-engine-examples)."""
_UPSTREAM_LIMITS: Final = {
    "max_sessions": 2,
    "max_context": 64,
    "max_batch_tokens": 64,
    "kv_budget_tokens": 128,
}
_HUGE_EPOCH: Final = 2**40
EpochChoice = Literal["current", "newer", "older", "huge"]
StartChoice = Literal["append", "zero", "truncate", "gap"]
PosChoice = Literal["exact", "ahead", "behind", "zero"]

_FIX_ERROR: Final = {
    "stale_epoch": "keep each session's epoch and the tombstone of a released one; refuse an "
    "older epoch (or a released one) with StaleEpoch before touching any state",
    "cache_miss": "decode only at pos == committed length, prefill only at start_pos <= it; "
    "an unknown, evicted or newer-epoch session has length 0; the error carries "
    "committed_length (and reason 'evicted' for an evicted session)",
    "resource_exhausted": "count every session's cached positions against kv_budget_tokens, "
    "admit a new session only while a slot is free, refuse positions past max_context; with "
    "eviction 'lru' evict idle sessions by last use instead",
    "invalid_request": "validate inputs (token ids in range, row counts, max_batch_tokens) "
    "before any state is touched",
    "checksum_mismatch": "verify the bundle payload against its checksum",
    "success": "the request is valid under the session semantics: serve it",
}
_FIX_OUTPUT: Final = (
    "an output must equal a fresh replay of the session's committed history: keep one cache "
    "per session, truncate at start_pos, start a newer epoch empty, roll back whatever fails, "
    "and never let other sessions or batching change a session's numbers beyond the declared "
    "tolerance"
)
_FIX_CANCEL: Final = (
    "cancel() marks in-flight work, which stops at its next safe point, raises Cancelled and "
    "rolls back; cancelled=True exactly when the named request will not commit; a request that "
    "committed first stands and cancel() reports nothing cancelled"
)
_FIX_METRICS: Final = (
    "report health and metrics as the ledger is: sessions, KV positions, requests and tokens "
    "of successful operations only, errors by code, evictions and releases"
)


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """One shard configuration the machine runs on."""

    start: int
    end: int
    n_layers: int
    dtype: BoundaryDtype
    eviction: EvictionPolicy

    @property
    def label(self) -> str:
        return f"[{self.start}, {self.end}) of {self.n_layers}, {self.dtype}, {self.eviction}"


@dataclass(slots=True)
class _Segment:
    """A committed run of positions of a session and the inputs that produced it."""

    kind: Literal["prefill", "decode"]
    start: int
    inputs: ShardInput

    @property
    def n(self) -> int:
        return _n_rows(self.inputs)


@dataclass(slots=True)
class _History:
    tokens: list[int] = field(default_factory=list)
    segments: list[_Segment] = field(default_factory=list)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        kept: list[_Segment] = []
        for segment in self.segments:
            if segment.start + segment.n <= length:
                kept.append(segment)
            elif segment.start < length:
                rows = length - segment.start
                kept.append(_Segment("prefill", segment.start, _head_rows(segment.inputs, rows)))
        self.segments = kept


class _ContractViolation(AssertionError):
    pass


def _n_rows(inputs: ShardInput) -> int:
    return len(inputs.token_ids) if isinstance(inputs, TokenInput) else inputs.n_tokens


def _row_bytes(bundle: BoundaryBundle) -> int:
    return bundle.hidden_size * numpy_dtype(bundle.dtype).itemsize


def _bundle_rows(
    bundle: BoundaryBundle, first: int, count: int, session: SessionRef, first_pos: int
) -> BoundaryBundle:
    """Rows ``first..first+count-1`` of ``bundle``, addressed to ``session`` at ``first_pos``."""
    width = _row_bytes(bundle)
    payload = memoryview(bytes(bundle.payload[first * width : (first + count) * width]))
    return msgspec.structs.replace(
        bundle,
        session=session,
        first_pos=first_pos,
        n_tokens=count,
        payload=payload,
        checksum=payload_checksum(payload),
    )


def _head_rows(inputs: ShardInput, rows: int) -> ShardInput:
    if isinstance(inputs, TokenInput):
        return TokenInput(token_ids=inputs.token_ids[:rows])
    return _bundle_rows(inputs, 0, rows, inputs.session, inputs.first_pos)


def _readdressed(inputs: ShardInput, session: SessionRef) -> ShardInput:
    if isinstance(inputs, TokenInput):
        return inputs
    return msgspec.structs.replace(inputs, session=session)


def _joined(segments: list[_Segment], session: SessionRef) -> BoundaryBundle:
    """The bundles of ``segments`` (consecutive, from position 0) as one bundle."""
    bundles = [segment.inputs for segment in segments]
    assert all(isinstance(bundle, BoundaryBundle) for bundle in bundles)
    first = bundles[0]
    assert isinstance(first, BoundaryBundle)
    payload = memoryview(
        b"".join(bytes(bundle.payload) for bundle in bundles if isinstance(bundle, BoundaryBundle))
    )
    return msgspec.structs.replace(
        first,
        session=session,
        first_pos=0,
        n_tokens=sum(_n_rows(bundle) for bundle in bundles),
        payload=payload,
        checksum=payload_checksum(payload),
    )


def _output(result: ShardResult) -> npt.NDArray[np.floating]:
    if isinstance(result, LogitsResult):
        return np.array(result.array())
    return np.array(result.bundle.array())


def run_machine(
    harness: Harness,
    config: MachineConfig,
    *,
    examples: int,
    upstream: ShardEngine | None,
    replay: ShardEngine,
    shrink: bool = True,
    deep: bool = False,
) -> None:
    """Run the state machine on ``config`` for ``examples`` examples (derandomized); a
    failure is shrunk to a short call sequence unless ``shrink`` is false."""
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, settings
        from hypothesis import strategies as st
        from hypothesis.stateful import (
            RuleBasedStateMachine,
            initialize,
            invariant,
            precondition,
            rule,
            run_state_machine_as_test,
        )
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise AssertionError(
            "the model-based conformance test needs hypothesis: pip install 'hypothesis>=6.100'"
        ) from error

    h = harness
    probe_caps = replay.capabilities()
    vocab = probe_caps.vocab_size
    determinism = probe_caps.determinism
    exact = determinism.deterministic and determinism.batch_invariant
    tolerance = Tolerances.declared(determinism, h.record)
    kind: OutputKind = "logits" if probe_caps.shard.emits_logits else "hidden"
    example_ids = itertools.count()
    takes_tokens = config.start == 0
    session_names: tuple[str, ...] = ("a", "b", "L" * 200 + "-1", "L" * 200 + "-2")
    if deep:
        session_names += ("c", "\u00e9" * 240 + "d")
    limits_of_shard = _DEEP_LIMITS if deep else _LIMITS
    prefill_sizes = [16, 17, 40, 63, 64] if deep else [16, 17]
    batch_size = 12 if deep else 4

    def tokens_of(n: int, seed: int) -> tuple[int, ...]:
        return tuple((seed * 7919 + index * 104729 + 17) % vocab for index in range(n))

    class ConformanceMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.example = next(example_ids)
            self.engine = h.load(
                config.start,
                config.end,
                boundary_dtype=config.dtype,
                eviction=config.eviction,
                **limits_of_shard,
            )
            self.caps: Capabilities = self.engine.capabilities()
            limits = self.caps.limits
            policy: EvictionPolicy = (
                "lru" if config.eviction == "lru" and self.caps.features.eviction else "reject"
            )
            self.model = ContractModel(
                ModelLimits(
                    max_sessions=limits.max_sessions,
                    max_context=limits.max_context,
                    max_batch_tokens=limits.max_batch_tokens,
                    kv_budget_tokens=limits.kv_budget_tokens,
                    eviction=policy,
                )
            )
            self.histories: dict[str, _History] = {}
            self.epoch_hint: dict[str, int] = {}
            self.log: list[str] = []
            self.failed = False
            self.finished: list[str] = []
            self.request_ids = itertools.count()
            self.replays = itertools.count()

        # ------------------------------------------------------------- helpers

        def sid(self, index: int) -> str:
            return f"m{self.example}-{session_names[index]}"

        def request_id(self) -> str:
            rid = f"machine-{self.example}-{next(self.request_ids)}"
            return rid

        def epoch(self, sid: str, choice: EpochChoice) -> int:
            hint = self.epoch_hint.get(sid, 1)
            current = self.model.epoch_of(sid)
            if choice == "current":
                epoch = current if current is not None else hint
            elif choice == "newer":
                epoch = hint + 1
            elif choice == "older":
                epoch = max(0, (current if current is not None else hint) - 1)
            else:
                epoch = max(hint, _HUGE_EPOCH) + 1
            self.epoch_hint[sid] = max(hint, epoch)
            return epoch

        def fail(self, what: str, fix: str) -> None:
            self.failed = True
            steps = "\n".join(f"  {n}. {line}" for n, line in enumerate(self.log, start=1))
            raise _ContractViolation(
                f"{what}\nshard {config.label}; the calls of this example (a fresh engine):\n"
                f"{steps}\nFix: {fix}"
            ) from None

        def upstream_rows(
            self, history: list[int], new_tokens: tuple[int, ...], session: SessionRef, pos: int
        ) -> BoundaryBundle:
            """Hidden states entering this shard for ``new_tokens`` at ``pos`` after
            ``history``: rows of a fresh upstream run over the whole sequence."""
            assert upstream is not None
            sequence = tuple(history[:pos]) + new_tokens
            ref = SessionRef(session_id=f"upstream-{self.example}-{next(self.replays)}", epoch=1)
            result = upstream.prefill(
                PrefillRequest(
                    request_id=self.request_id(),
                    session=ref,
                    start_pos=0,
                    inputs=TokenInput(token_ids=sequence),
                )
            )
            upstream.release(ReleaseRequest(session=ref))
            if not isinstance(result, BoundaryResult):
                raise AssertionError(f"the upstream shard returned {type(result).__name__}")
            return _bundle_rows(result.bundle, pos, len(new_tokens), session, pos)

        def inputs(
            self, sid: str, session: SessionRef, pos: int, tokens: tuple[int, ...], bad: bool
        ) -> ShardInput:
            if takes_tokens:
                if bad:
                    return TokenInput(token_ids=(*tokens[:-1], vocab))
                return TokenInput(token_ids=tokens)
            history = self.histories.get(sid, _History()).tokens
            if session.epoch != self.model.epoch_of(sid):
                history = []
            padded = history + [0] * max(0, pos - len(history))
            bundle = self.upstream_rows(padded, tokens, session, pos)
            if bad:
                return msgspec.structs.replace(bundle, checksum=bundle.checksum ^ 1)
            return bundle

        def bad_code(self) -> str:
            return "invalid_request" if takes_tokens else "checksum_mismatch"

        def check_refusal(
            self, call: str, refusal: Refusal, error: ShardEngineError | ErrorInfo
        ) -> str:
            code = error.code
            matching = [expected for expected in refusal.errors if expected.code == code]
            if not matching:
                self.fail(
                    f"{call}: expected {refusal.describe()}; got {code}: {_message(error)}",
                    _FIX_ERROR.get(refusal.errors[0].code, _FIX_ERROR["success"]),
                )
            if code == "cache_miss":
                details = error.details
                length = details.get("committed_length")
                reason = details.get("reason")
                if isinstance(error, CacheMiss):
                    length, reason = error.committed_length, error.reason
                if not any(length == expected.committed_length for expected in matching):
                    self.fail(
                        f"{call}: CacheMiss carries committed_length {length!r}; expected "
                        f"{refusal.describe()}",
                        _FIX_ERROR["cache_miss"],
                    )
                must_evicted = all(expected.evicted for expected in matching)
                may_evicted = any(expected.evicted for expected in matching)
                if must_evicted and reason != "evicted":
                    self.fail(
                        f"{call}: the session was evicted; CacheMiss reason is {reason!r}",
                        _FIX_ERROR["cache_miss"],
                    )
                if not may_evicted and reason == "evicted":
                    self.fail(
                        f"{call}: CacheMiss says 'evicted' but the session was not evicted",
                        _FIX_ERROR["cache_miss"],
                    )
            return code

        def check_result(
            self,
            call: str,
            result: ShardResult,
            request_id: str,
            session: SessionRef,
            start: int,
            n: int,
            logits: LogitsMode,
        ) -> None:
            h.observe(result)
            caps = self.caps
            problems: list[str] = []
            if result.request_id != request_id:
                problems.append(f"request_id {result.request_id!r} != {request_id!r}")
            if result.session != session:
                problems.append(f"session {result.session} != {session}")
            if result.evidence != caps.evidence:
                problems.append(f"evidence {result.evidence!r} != capabilities' {caps.evidence!r}")
            if isinstance(result, LogitsResult):
                if not caps.shard.emits_logits:
                    problems.append("a non-tail shard returned logits")
                first, rows = (start, n) if logits == "all" else (start + n - 1, 1)
                if (result.first_pos, result.n_rows) != (first, rows):
                    problems.append(
                        f"first_pos/n_rows {result.first_pos}/{result.n_rows} != {first}/{rows}"
                    )
                if payload_checksum(result.payload) != result.checksum:
                    problems.append("logits checksum does not match the payload")
            else:
                bundle = result.bundle
                if caps.shard.emits_logits:
                    problems.append("a tail shard returned a bundle")
                header = (bundle.first_pos, bundle.n_tokens, bundle.layer, bundle.dtype)
                want = (start, n, caps.shard.end, config.dtype)
                if header != want or (result.first_pos, result.n_tokens) != (start, n):
                    problems.append(f"bundle first_pos/n_tokens/layer/dtype {header} != {want}")
                if bundle.session != session:
                    problems.append(f"bundle session {bundle.session} != {session}")
                if bundle.model_fingerprint != caps.model_fingerprint:
                    problems.append("bundle fingerprint differs from the capabilities'")
                if payload_checksum(bundle.payload) != bundle.checksum:
                    problems.append("bundle checksum does not match the payload")
                if len(bundle.payload) != bundle.expected_payload_bytes:
                    problems.append("bundle payload length disagrees with its header")
            if problems:
                self.fail(f"{call}: result fields wrong: {'; '.join(problems)}", _FIX_OUTPUT)
            values = _output(result)
            if not np.isfinite(values).all():
                self.fail(f"{call}: the output holds NaN or infinity", _FIX_OUTPUT)

        def replay_and_compare(
            self, call: str, sid: str, result: ShardResult, start: int, n: int, logits: LogitsMode
        ) -> None:
            """Replay the session's committed history (its last rows are the operation just
            checked) as one prefill of a fresh session on the replay engine, and compare the
            rows of the operation: so decode steps, chunks and truncations must all agree
            with one straight run."""
            history = self.histories[sid]
            ref = SessionRef(session_id=f"replay-{self.example}-{next(self.replays)}", epoch=1)
            inputs: ShardInput
            if takes_tokens:
                inputs = TokenInput(token_ids=tuple(history.tokens))
            else:
                inputs = _joined(history.segments, ref)
            try:
                expected = replay.prefill(
                    PrefillRequest(
                        request_id=self.request_id(),
                        session=ref,
                        start_pos=0,
                        inputs=inputs,
                        logits="all",
                    )
                )
            except ShardEngineError as error:
                self.fail(
                    f"{call}: replaying the session's history on a fresh engine failed: {error!r}",
                    _FIX_OUTPUT,
                )
                return
            finally:
                replay.release(ReleaseRequest(session=ref))
            rows = _output(expected)
            first = start if logits == "all" or not self.caps.shard.emits_logits else start + n - 1
            last = start + n
            try:
                assert_matches(
                    _output(result),
                    rows[first:last],
                    exact=exact,
                    tolerance=tolerance,
                    what=f"{call}: output vs a fresh replay of the session's history "
                    f"({len(rows)} positions in one prefill)",
                    kind=kind,
                )
            except AssertionError as error:
                self.fail(str(error), _FIX_OUTPUT)

        def forget(self, evicted: tuple[str, ...]) -> None:
            for victim in evicted:
                self.histories.pop(victim, None)

        def record_success(
            self,
            sid: str,
            admission: Admission,
            kind: Literal["prefill", "decode"],
            inputs: ShardInput,
            tokens: tuple[int, ...],
        ) -> None:
            self.forget(admission.evict)
            previous_epoch = self.model.epoch_of(sid)
            history = self.histories.setdefault(sid, _History())
            if previous_epoch is not None and previous_epoch != admission.epoch:
                history = self.histories[sid] = _History()
            history.truncate(admission.start_pos)
            history.tokens.extend(tokens)
            history.segments.append(_Segment(kind, admission.start_pos, inputs))
            self.model.commit(admission)

        # ------------------------------------------------------------- rules

        @rule(
            index=st.integers(0, len(session_names) - 1),
            epoch_choice=st.sampled_from(
                ["current", "current", "current", "newer", "older", "huge"]
            ),
            start_choice=st.sampled_from(["append", "append", "zero", "truncate", "gap"]),
            n=st.one_of(st.integers(1, 5), st.sampled_from(prefill_sizes)),
            seed=st.integers(0, 1000),
            logits=st.sampled_from(["last", "all"]),
            bad=st.sampled_from([False] * 7 + [True]),
        )
        def prefill(
            self,
            index: int,
            epoch_choice: EpochChoice,
            start_choice: StartChoice,
            n: int,
            seed: int,
            logits: LogitsMode,
            bad: bool,
        ) -> None:
            sid = self.sid(index)
            epoch = self.epoch(sid, epoch_choice)
            length = self.model.committed_length(sid)
            if start_choice == "truncate" and not self.caps.features.truncate:
                start_choice = "append"
            start = {"append": length, "zero": 0, "truncate": length // 2, "gap": length + 1}[
                start_choice
            ]
            tokens = tokens_of(n, seed)
            session = SessionRef(session_id=sid, epoch=epoch)
            inputs = self.inputs(sid, session, start, tokens, bad)
            request_id = self.request_id()
            call = (
                f"prefill(session={session_names[index][:8]!r}, epoch={epoch}, start_pos={start}, "
                f"{n} {'tokens' if takes_tokens else 'rows'}, logits={logits!r}"
                f"{', bad input' if bad else ''})"
            )
            plan = self.model.plan_prefill(sid, epoch, start, n)
            if bad:
                bad_error = ExpectedError(self.bad_code(), "the input is invalid")
                plan = Refusal(
                    (bad_error, *plan.errors) if isinstance(plan, Refusal) else (bad_error,)
                )
            counters = self.model.counters
            counters.requests += 1
            counters.prefill_requests += 1
            try:
                result = self.engine.prefill(
                    PrefillRequest(
                        request_id=request_id,
                        session=session,
                        start_pos=start,
                        inputs=inputs,
                        logits=logits,
                    )
                )
            except ShardEngineError as error:
                self.log.append(f"{call} -> {error.code}")
                if isinstance(plan, Admission):
                    self.fail(
                        f"{call}: expected success, got {error.code}: {error.message}",
                        _FIX_ERROR["success"],
                    )
                assert isinstance(plan, Refusal)
                counters.errors[self.check_refusal(call, plan, error)] += 1
                return
            self.log.append(f"{call} -> ok")
            self.finished.append(request_id)
            if isinstance(plan, Refusal):
                self.fail(f"{call}: expected {plan.describe()}; it succeeded", _fix_for(plan))
            assert isinstance(plan, Admission)
            self.check_result(call, result, request_id, session, start, n, logits)
            counters.prefill_tokens += n
            self.record_success(sid, plan, "prefill", inputs, tokens)
            self.replay_and_compare(call, sid, result, start, n, logits)

        @initialize(n=st.integers(3, 6), seed=st.integers(0, 1000))
        def open_first(self, n: int, seed: int) -> None:
            """Start with two live sessions so every example has state to work on."""
            self.prefill(0, "current", "append", n, seed, "last", False)

        @initialize(n=st.integers(2, 5), seed=st.integers(0, 1000))
        def open_long_id(self, n: int, seed: int) -> None:
            self.prefill(2, "current", "append", n, seed, "all", False)

        @rule(
            index=st.integers(0, len(session_names) - 1),
            n=st.integers(1, 4),
            seed=st.integers(0, 1000),
        )
        def extend(self, index: int, n: int, seed: int) -> None:
            """A well-formed prefill: append to the session at its epoch (from 0 when new)."""
            self.prefill(index, "current", "append", n, seed, "last", False)

        @rule(index=st.integers(0, len(session_names) - 1), seed=st.integers(0, 1000))
        def step(self, index: int, seed: int) -> None:
            """A well-formed decode at the session's committed length and epoch."""
            self.decode(index, "current", "exact", seed, False)

        def decode_item(
            self, index: int, epoch_choice: EpochChoice, pos_choice: PosChoice, seed: int, bad: bool
        ) -> tuple[str, SessionRef, int, ShardInput, tuple[int, ...], str]:
            sid = self.sid(index)
            epoch = self.epoch(sid, epoch_choice)
            length = self.model.committed_length(sid)
            pos = {"exact": length, "ahead": length + 1, "behind": max(0, length - 1), "zero": 0}[
                pos_choice
            ]
            session = SessionRef(session_id=sid, epoch=epoch)
            token = tokens_of(1, seed)
            inputs = self.inputs(sid, session, pos, token, bad)
            call = (
                f"decode(session={session_names[index][:8]!r}, epoch={epoch}, pos={pos}"
                f"{', bad input' if bad else ''})"
            )
            return sid, session, pos, inputs, token, call

        @rule(
            index=st.integers(0, len(session_names) - 1),
            epoch_choice=st.sampled_from(["current"] * 6 + ["newer", "older", "huge"]),
            pos_choice=st.sampled_from(["exact"] * 6 + ["ahead", "behind", "zero"]),
            seed=st.integers(0, 1000),
            bad=st.sampled_from([False] * 9 + [True]),
        )
        def decode(
            self, index: int, epoch_choice: EpochChoice, pos_choice: PosChoice, seed: int, bad: bool
        ) -> None:
            sid, session, pos, inputs, token, call = self.decode_item(
                index, epoch_choice, pos_choice, seed, bad
            )
            plan = self.model.plan_decode(sid, session.epoch, pos)
            if bad:
                bad_error = ExpectedError(self.bad_code(), "the input is invalid")
                plan = Refusal(
                    (bad_error, *plan.errors) if isinstance(plan, Refusal) else (bad_error,)
                )
            counters = self.model.counters
            counters.requests += 1
            counters.decode_requests += 1
            request_id = self.request_id()
            try:
                result = self.engine.decode(
                    DecodeRequest(request_id=request_id, session=session, pos=pos, inputs=inputs)
                )
            except ShardEngineError as error:
                self.log.append(f"{call} -> {error.code}")
                if isinstance(plan, Admission):
                    self.fail(
                        f"{call}: expected success, got {error.code}: {error.message}",
                        _FIX_ERROR["success"],
                    )
                assert isinstance(plan, Refusal)
                counters.errors[self.check_refusal(call, plan, error)] += 1
                return
            self.log.append(f"{call} -> ok")
            self.finished.append(request_id)
            if isinstance(plan, Refusal):
                self.fail(f"{call}: expected {plan.describe()}; it succeeded", _fix_for(plan))
            assert isinstance(plan, Admission)
            self.check_result(call, result, request_id, session, pos, 1, "last")
            counters.decode_tokens += 1
            self.record_success(sid, plan, "decode", inputs, token)
            self.replay_and_compare(call, sid, result, pos, 1, "last")

        @precondition(lambda self: self.caps.features.batched_decode)
        @rule(
            items=st.lists(
                st.tuples(
                    st.integers(0, len(session_names) - 1),
                    st.sampled_from(["current"] * 6 + ["newer", "older"]),
                    st.sampled_from(["exact"] * 6 + ["ahead", "zero"]),
                    st.integers(0, 1000),
                    st.sampled_from([False] * 9 + [True]),
                ),
                min_size=1,
                max_size=batch_size,
            )
        )
        def decode_batch(self, items: list[tuple[int, EpochChoice, PosChoice, int, bool]]) -> None:
            built = [self.decode_item(*item) for item in items]
            bad = [item[4] for item in items]
            sids = [entry[0] for entry in built]
            duplicated = {sid for sid in sids if sids.count(sid) > 1}
            calls = [entry[5] for entry in built]
            call = f"decode_batch([{', '.join(calls)}])"
            # The contract: the first item naming a session is served as a single decode;
            # every later item naming it fails alone with invalid_request. Admission evicts
            # idle sessions only: never a session named by a valid item of the batch.
            refused = {
                position
                for position, sid in enumerate(sids)
                if sid in duplicated and sids.index(sid) != position
            }
            outcomes_by_variant: list[tuple[str, ContractModel, list[Admission | Refusal]]] = []
            for name in ("later duplicates refused",):
                scratch = self.model.copy()
                planned: list[Admission | Refusal] = []
                members = frozenset(
                    sid
                    for position, sid in enumerate(sids)
                    if position not in refused and not bad[position]
                )
                for position, (sid, session, pos, _inputs, _token, _call) in enumerate(built):
                    if position in refused:
                        planned.append(
                            Refusal((ExpectedError("invalid_request", "session named twice"),))
                        )
                        continue
                    plan = scratch.plan_decode(sid, session.epoch, pos, members)
                    if bad[position]:
                        bad_error = ExpectedError(self.bad_code(), "the input is invalid")
                        plan = Refusal(
                            (bad_error, *plan.errors) if isinstance(plan, Refusal) else (bad_error,)
                        )
                    if isinstance(plan, Admission):
                        scratch.commit(plan)
                    planned.append(plan)
                outcomes_by_variant.append((name, scratch, planned))
            counters = self.model.counters
            counters.requests += 1
            counters.batch_requests += 1
            counters.batch_items += len(items)
            request = DecodeBatchRequest(
                request_id=self.request_id(),
                items=tuple(
                    DecodeRequest(
                        request_id=self.request_id(), session=session, pos=pos, inputs=inputs
                    )
                    for (_sid, session, pos, inputs, _token, _call) in built
                ),
            )
            try:
                batch = self.engine.decode_batch(request)
            except ShardEngineError as error:
                self.log.append(f"{call} -> raised {error.code}")
                self.fail(
                    f"{call}: the batch raised {error.code} ({error.message}); per-item errors "
                    "must be returned in place",
                    "plan and validate each item separately; only a malformed batch as a whole "
                    "may raise",
                )
                return
            self.finished.append(request.request_id)
            outcomes = batch.items
            summary = ", ".join(o.code if isinstance(o, ErrorInfo) else "ok" for o in outcomes)
            self.log.append(f"{call} -> [{summary}]")
            if batch.request_id != request.request_id or len(outcomes) != len(items):
                self.fail(
                    f"{call}: {len(outcomes)} outcomes for {len(items)} items (request id "
                    f"{batch.request_id!r})",
                    "return one outcome per item, in item order",
                )
            chosen: tuple[str, ContractModel, list[Admission | Refusal]] | None = None
            for variant in outcomes_by_variant:
                fits = all(
                    isinstance(outcome, ErrorInfo) == isinstance(plan, Refusal)
                    and (
                        not isinstance(outcome, ErrorInfo)
                        or not isinstance(plan, Refusal)
                        or outcome.code in plan.codes()
                    )
                    for outcome, plan in zip(outcomes, variant[2], strict=True)
                )
                if fits:
                    chosen = variant
                    break
            if chosen is None:
                name, _scratch, planned = outcomes_by_variant[0]
                expected = ", ".join(
                    "ok" if isinstance(plan, Admission) else plan.describe() for plan in planned
                )
                self.fail(
                    f"{call}: item outcomes [{summary}]; expected [{expected}]"
                    + (" (a session's later items refused)" if duplicated else ""),
                    "each item succeeds or fails on its own, in item order, as a single decode "
                    "would; a session named twice is refused (not decoded twice)",
                )
                return
            _name, scratch, planned = chosen
            for position, (outcome, plan) in enumerate(zip(outcomes, planned, strict=True)):
                item_call = f"{call} item {position}"
                if isinstance(outcome, ErrorInfo):
                    assert isinstance(plan, Refusal)
                    counters.errors[self.check_refusal(item_call, plan, outcome)] += 1
            for position, (outcome, plan) in enumerate(zip(outcomes, planned, strict=True)):
                if isinstance(outcome, ErrorInfo):
                    continue
                assert isinstance(plan, Admission)
                sid, session, pos, inputs, token, _item = built[position]
                self.check_result(
                    f"{call} item {position}",
                    outcome,
                    request.items[position].request_id,
                    session,
                    pos,
                    1,
                    "last",
                )
                counters.decode_tokens += 1
                self.record_success(sid, plan, "decode", inputs, token)
                self.replay_and_compare(f"{call} item {position}", sid, outcome, pos, 1, "last")
            # record_success committed, in item order, what the chosen variant planned.
            del scratch

        @rule(
            index=st.integers(0, len(session_names) - 1),
            epoch_choice=st.sampled_from(["current", "current", "newer", "older"]),
        )
        def release(self, index: int, epoch_choice: EpochChoice) -> None:
            sid = self.sid(index)
            epoch = self.epoch(sid, epoch_choice)
            call = f"release(session={session_names[index][:8]!r}, epoch={epoch})"
            expected = self.model.copy().release(sid, epoch)
            try:
                result = self.engine.release(
                    ReleaseRequest(session=SessionRef(session_id=sid, epoch=epoch))
                )
            except ShardEngineError as error:
                self.log.append(f"{call} -> {error.code}")
                if not isinstance(expected, Refusal):
                    self.fail(
                        f"{call}: expected released={expected}, got {error.code}: {error.message}",
                        "release frees a live session at its epoch or a newer one; an unknown "
                        "or already released session is a no-op that says so",
                    )
                assert isinstance(expected, Refusal)
                self.model.counters.errors[self.check_refusal(call, expected, error)] += 1
                return
            self.log.append(f"{call} -> released={result.released}")
            if isinstance(expected, Refusal):
                self.fail(
                    f"{call}: expected {expected.describe()}; got {result}",
                    _FIX_ERROR["stale_epoch"],
                )
            if result.released != expected:
                self.fail(
                    f"{call}: released={result.released}, expected {expected}",
                    "free exactly the live sessions; a second release frees nothing",
                )
            if expected:
                self.histories.pop(sid, None)
            self.model.release(sid, epoch)

        @rule(
            aim=st.sampled_from(["finished", "unknown", "session"]),
            index=st.integers(0, len(session_names) - 1),
        )
        def cancel_idle(self, aim: str, index: int) -> None:
            if aim == "finished" and self.finished:
                request = CancelRequest(request_id=self.finished[-1])
            elif aim == "session":
                request = CancelRequest(session_id=self.sid(index))
            else:
                request = CancelRequest(request_id=f"never-sent-{self.example}")
            call = f"cancel({aim})"
            try:
                result = self.engine.cancel(request)
            except ShardEngineError as error:
                self.log.append(f"{call} -> {error.code}")
                self.fail(f"{call} raised {error!r}", "cancel of nothing in flight returns False")
                return
            self.log.append(f"{call} -> cancelled={result.cancelled}")
            if (result.cancelled, result.n_requests) != (False, 0):
                self.fail(
                    f"{call}: nothing is in flight, yet cancel returned {result}",
                    "look the target up among in-flight requests only",
                )

        def cancel_in_flight(self, pick: int, n: int, seed: int, by_session: bool) -> None:
            """An appending prefill of a live session runs on another thread while this one
            cancels it (by request id or by session id) as soon as the engine reports it in
            flight. Either the caller sees Cancelled, the cancel said so, and nothing changed;
            or the prefill committed first, the cancel said nothing was cancelled, and the
            result is checked as any prefill's. Which of the two happens depends on timing, so
            it runs once at the end of each example (from the state the steps left), where its
            outcome cannot change what the example explores."""
            live = sorted(self.model.sessions)
            sid = live[pick % len(live)]
            index = next(i for i in range(len(session_names)) if self.sid(i) == sid)
            current = self.model.sessions[sid]
            start = current.length
            tokens = tokens_of(n, seed)
            session = SessionRef(session_id=sid, epoch=current.epoch)
            inputs = self.inputs(sid, session, start, tokens, False)
            request_id = self.request_id()
            target = "session" if by_session else "request id"
            call = (
                f"prefill(session={session_names[index][:8]!r}, epoch={current.epoch}, "
                f"start_pos={start}, {n} {'tokens' if takes_tokens else 'rows'}) on another "
                f"thread, cancelled by {target} while in flight"
            )
            plan = self.model.plan_prefill(sid, current.epoch, start, n)
            if not isinstance(plan, Admission) or plan.evict:
                return  # decided by the model alone: the same for every run
            counters = self.model.counters
            counters.requests += 1
            counters.prefill_requests += 1
            outcome: dict[str, object] = {}

            def run() -> None:
                try:
                    outcome["result"] = self.engine.prefill(
                        PrefillRequest(
                            request_id=request_id, session=session, start_pos=start, inputs=inputs
                        )
                    )
                except BaseException as error:  # noqa: BLE001 - judged by the machine thread
                    outcome["error"] = error

            worker = threading.Thread(target=run, name="conformance-in-flight", daemon=True)
            worker.start()
            cancel = (
                CancelRequest(session_id=sid)
                if by_session
                else CancelRequest(request_id=request_id)
            )
            cancelled = CancelResult(cancelled=False, n_requests=0)
            while worker.is_alive():
                if self.engine.health().in_flight:
                    cancelled = self.engine.cancel(cancel)
                    break
                time.sleep(0)
            worker.join(timeout=60.0)
            if worker.is_alive():
                self.fail(f"{call}: the prefill did not return within 60 s", _FIX_CANCEL)
            error = outcome.get("error")
            if isinstance(error, ShardEngineError) and error.code == "cancelled":
                self.log.append(f"{call} -> cancelled")
                if (cancelled.cancelled, cancelled.n_requests) != (True, 1):
                    self.fail(
                        f"{call}: the caller saw Cancelled but cancel() returned {cancelled}",
                        _FIX_CANCEL,
                    )
                counters.errors["cancelled"] += 1
                counters.cancelled += 1
                return
            if error is not None:
                self.log.append(f"{call} -> {getattr(error, 'code', type(error).__name__)}")
                self.fail(f"{call}: expected success or Cancelled, got {error!r}", _FIX_CANCEL)
                return
            self.log.append(f"{call} -> ok (committed before the cancel)")
            self.finished.append(request_id)
            if cancelled.cancelled:
                self.fail(
                    f"{call}: cancel() returned {cancelled}, yet the prefill committed",
                    _FIX_CANCEL,
                )
            result = outcome.get("result")
            assert isinstance(result, BoundaryResult | LogitsResult)
            self.check_result(call, result, request_id, session, start, n, "last")
            counters.prefill_tokens += n
            self.record_success(sid, plan, "prefill", inputs, tokens)
            self.replay_and_compare(call, sid, result, start, n, "last")

        # ------------------------------------------------------------- invariants

        @invariant()
        def health_and_metrics_match_the_model(self) -> None:
            model = self.model
            counters = model.counters
            health = self.engine.health()
            metrics = self.engine.metrics()
            problems: list[str] = []

            def equal(name: str, have: object, want: object) -> None:
                if have != want:
                    problems.append(f"{name} is {have!r}, expected {want!r}")

            equal("health.state", health.state, "ready")
            equal("health.sessions", health.sessions, len(model.sessions))
            equal("health.kv_used_tokens", health.kv_used_tokens, model.kv_used)
            equal("health.in_flight", health.in_flight, 0)
            equal("health.kv_budget_tokens", health.kv_budget_tokens, model.limits.kv_budget_tokens)
            equal("metrics.requests", metrics.requests, counters.requests)
            equal("metrics.prefill_requests", metrics.prefill_requests, counters.prefill_requests)
            equal("metrics.decode_requests", metrics.decode_requests, counters.decode_requests)
            equal("metrics.batch_requests", metrics.batch_requests, counters.batch_requests)
            equal("metrics.prefill_tokens", metrics.prefill_tokens, counters.prefill_tokens)
            equal("metrics.decode_tokens", metrics.decode_tokens, counters.decode_tokens)
            equal("metrics.evictions", metrics.evictions, counters.evictions)
            equal("metrics.releases", metrics.releases, counters.releases)
            equal("metrics.sessions_active", metrics.sessions_active, len(model.sessions))
            equal("metrics.kv_used_tokens", metrics.kv_used_tokens, model.kv_used)
            equal("metrics.cancelled", metrics.cancelled, counters.cancelled)
            if metrics.tombstones < model.tombstones():
                problems.append(
                    f"metrics.tombstones is {metrics.tombstones}; {model.tombstones()} released "
                    "sessions are fenced"
                )
            for code in sorted(set(metrics.errors) | set(counters.errors)):
                equal(
                    f"metrics.errors[{code!r}]",
                    metrics.errors.get(code, 0),
                    counters.errors.get(code, 0),
                )
            if problems:
                self.fail("after the last call: " + "; ".join(problems), _FIX_METRICS)

        def teardown(self) -> None:
            try:
                if self.model.sessions and self.caps.features.cancel and not self.failed:
                    self.cancel_in_flight(
                        self.example, 4, self.example, by_session=self.example % 2 == 1
                    )
                    self.health_and_metrics_match_the_model()
            finally:
                self.engine.close()

    ConformanceMachine.__name__ = "ConformanceMachine"
    run_state_machine_as_test(
        ConformanceMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=_DEEP_STEPS if deep else _STEPS,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.generate, Phase.shrink)
            if shrink
            else (Phase.explicit, Phase.generate),
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
            print_blob=False,
        ),
    )


def _fix_for(refusal: Refusal) -> str:
    return _FIX_ERROR.get(refusal.errors[0].code, _FIX_ERROR["success"])


def _message(error: ShardEngineError | ErrorInfo) -> str:
    return error.message


def upstream_limits(deep: bool = False) -> dict[str, int]:
    """Load overrides of the upstream and replay shards: room for any history (of the deep
    profile's longer sessions too)."""
    if deep:
        return {
            "max_sessions": 2,
            "max_context": 400,
            "max_batch_tokens": 400,
            "kv_budget_tokens": 800,
        }
    return dict(_UPSTREAM_LIMITS)


def machine_limits() -> dict[str, int]:
    return dict(_LIMITS)
