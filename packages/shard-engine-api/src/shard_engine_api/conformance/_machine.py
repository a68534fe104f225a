"""The model-based conformance machine: a hypothesis ``RuleBasedStateMachine`` that drives the
engine under test and the reference model (:mod:`._model`) side by side.

Every step (prefill, truncation, decode, decode_batch, release, cancel, new and huge epochs,
eviction; several sessions, long session ids) is sent to the engine and predicted by the model.
After each step the machine compares the outcome (success, or the error code with its fields),
the committed lengths, health and metrics; and it compares every output with a fresh replay of
the session's successful history on another engine of the same shard (bit for bit or within the
declared tolerance; NaN or infinity never matches). Shards of every role run: a non-head shard's
inputs are the rows of a fresh upstream shard run over the session's token history.

Each step is recorded with :func:`hypothesis.note` (its outcome also as an :func:`event`), so a
failure reads as the numbered calls of the (shrunk) example, the expectation, what came, and a
"Fix:" hint. The machine takes a :class:`MachineContext` (``run_machine`` in :mod:`._stateful`
builds it); this module imports hypothesis, which only the model-based tests need.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

import msgspec
import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import CacheMiss, ErrorInfo, ShardEngineError
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeRequest,
    EvictionPolicy,
    LogitsMode,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
)
from shard_engine_api.conformance._harness import assert_matches
from shard_engine_api.conformance._machine_context import (
    BATCH_SIZE,
    DEEP_BATCH_SIZE,
    DEEP_PREFILL_SIZES,
    DEEP_SESSION_NAMES,
    FIX_CANCEL,
    FIX_ERROR,
    FIX_METRICS,
    FIX_OUTPUT,
    HUGE_EPOCH,
    PREFILL_SIZES,
    SESSION_NAMES,
    ContractViolation,
    EpochChoice,
    History,
    MachineContext,
    PosChoice,
    Segment,
    StartChoice,
    bundle_rows,
    fix_for,
    joined,
    message_of,
    output_rows,
)
from shard_engine_api.conformance._model import (
    Admission,
    ContractModel,
    ExpectedError,
    ModelLimits,
    Refusal,
)

__all__ = ["ConformanceMachine", "DeepConformanceMachine"]

BatchDraw = tuple[int, EpochChoice, PosChoice, int, bool]
"""One drawn batch item: session index, epoch, position, seed, bad input."""
_Rule = Callable[[Callable[..., None]], Callable[..., None]]
_SESSIONS: Final = st.integers(0, len(SESSION_NAMES) - 1)
_DEEP_SESSIONS: Final = st.integers(0, len(DEEP_SESSION_NAMES) - 1)

# The rules' draws, one factory per rule: the default machine and the deep one (more
# sessions, larger prefills and batches) draw from the same rules with other bounds.


def _prefill_rule(sessions: st.SearchStrategy[int], sizes: tuple[int, ...]) -> _Rule:
    return rule(
        index=sessions,
        epoch_choice=st.sampled_from(["current", "current", "current", "newer", "older", "huge"]),
        start_choice=st.sampled_from(["append", "append", "zero", "truncate", "gap"]),
        n=st.one_of(st.integers(1, 5), st.sampled_from(sizes)),
        seed=st.integers(0, 1000),
        logits=st.sampled_from(["last", "all"]),
        bad=st.sampled_from([False] * 7 + [True]),
    )


def _extend_rule(sessions: st.SearchStrategy[int]) -> _Rule:
    return rule(index=sessions, n=st.integers(1, 4), seed=st.integers(0, 1000))


def _step_rule(sessions: st.SearchStrategy[int]) -> _Rule:
    return rule(index=sessions, seed=st.integers(0, 1000))


def _decode_rule(sessions: st.SearchStrategy[int]) -> _Rule:
    return rule(
        index=sessions,
        epoch_choice=st.sampled_from(["current"] * 6 + ["newer", "older", "huge"]),
        pos_choice=st.sampled_from(["exact"] * 6 + ["ahead", "behind", "zero"]),
        seed=st.integers(0, 1000),
        bad=st.sampled_from([False] * 9 + [True]),
    )


def _batch_rule(sessions: st.SearchStrategy[int], size: int) -> _Rule:
    batched = precondition(lambda self: self.caps.features.batched_decode)
    draw = rule(
        items=st.lists(
            st.tuples(
                sessions,
                st.sampled_from(["current"] * 6 + ["newer", "older"]),
                st.sampled_from(["exact"] * 6 + ["ahead", "zero"]),
                st.integers(0, 1000),
                st.sampled_from([False] * 9 + [True]),
            ),
            min_size=1,
            max_size=size,
        )
    )
    return lambda function: batched(draw(function))


def _release_rule(sessions: st.SearchStrategy[int]) -> _Rule:
    return rule(
        index=sessions, epoch_choice=st.sampled_from(["current", "current", "newer", "older"])
    )


def _cancel_idle_rule(sessions: st.SearchStrategy[int]) -> _Rule:
    return rule(aim=st.sampled_from(["finished", "unknown", "session"]), index=sessions)


class ConformanceMachine(RuleBasedStateMachine):
    """Drives one fresh engine under test (of ``context.config``) and the reference model side
    by side; hypothesis makes one machine per example."""

    def __init__(self, context: MachineContext) -> None:
        super().__init__()
        self.ctx = context
        self.example = next(self.ctx.example_ids)
        self.engine = self.ctx.harness.load(
            self.ctx.config.start,
            self.ctx.config.end,
            boundary_dtype=self.ctx.config.dtype,
            eviction=self.ctx.config.eviction,
            **self.ctx.profile.limits,
        )
        self.caps: Capabilities = self.engine.capabilities()
        limits = self.caps.limits
        policy: EvictionPolicy = (
            "lru" if self.ctx.config.eviction == "lru" and self.caps.features.eviction else "reject"
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
        self.histories: dict[str, History] = {}
        self.epoch_hint: dict[str, int] = {}
        self.steps = 0
        self.failed = False
        self.finished: list[str] = []
        self.request_ids = itertools.count()
        self.replays = itertools.count()

    # ------------------------------------------------------------- helpers

    def __repr__(self) -> str:
        return f"ConformanceMachine(shard {self.ctx.config.label})"

    def name(self, index: int) -> str:
        """The drawn session's name as a step shows it (long ids cut to 8 characters)."""
        return repr(self.ctx.profile.name(index)[:8])

    def sid(self, index: int) -> str:
        return f"m{self.example}-{self.ctx.profile.name(index)}"

    def record_step(self, step: str) -> None:
        """Number the call and its outcome into the example's log (hypothesis prints it with
        a failing example) and count the outcome as an event."""
        self.steps += 1
        note(f"  {self.steps}. {step}")
        call, _arrow, outcome = step.rpartition(" -> ")
        event(f"{call.partition('(')[0]} -> {outcome.partition(' ')[0]}")

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
            epoch = max(hint, HUGE_EPOCH) + 1
        self.epoch_hint[sid] = max(hint, epoch)
        return epoch

    def fail(self, what: str, fix: str) -> None:
        self.failed = True
        raise ContractViolation(
            f"{what}\nshard {self.ctx.config.label}; the {self.steps} calls of this example (on "
            f"a fresh engine) follow the message.\nFix: {fix}"
        ) from None

    def upstream_rows(
        self, history: list[int], new_tokens: tuple[int, ...], session: SessionRef, pos: int
    ) -> BoundaryBundle:
        """Hidden states entering this shard for ``new_tokens`` at ``pos`` after
        ``history``: rows of a fresh upstream run over the whole sequence."""
        assert self.ctx.upstream is not None
        sequence = tuple(history[:pos]) + new_tokens
        ref = SessionRef(session_id=f"upstream-{self.example}-{next(self.replays)}", epoch=1)
        result = self.ctx.upstream.prefill(
            PrefillRequest(
                request_id=self.request_id(),
                session=ref,
                start_pos=0,
                inputs=TokenInput(token_ids=sequence),
            )
        )
        self.ctx.upstream.release(ReleaseRequest(session=ref))
        if not isinstance(result, BoundaryResult):
            raise AssertionError(f"the upstream shard returned {type(result).__name__}")
        return bundle_rows(result.bundle, pos, len(new_tokens), session, pos)

    def inputs(
        self, sid: str, session: SessionRef, pos: int, tokens: tuple[int, ...], bad: bool
    ) -> ShardInput:
        if self.ctx.takes_tokens:
            if bad:
                return TokenInput(token_ids=(*tokens[:-1], self.ctx.vocab))
            return TokenInput(token_ids=tokens)
        history = self.histories.get(sid, History()).tokens
        if session.epoch != self.model.epoch_of(sid):
            history = []
        padded = history + [0] * max(0, pos - len(history))
        bundle = self.upstream_rows(padded, tokens, session, pos)
        if bad:
            return msgspec.structs.replace(bundle, checksum=bundle.checksum ^ 1)
        return bundle

    def bad_code(self) -> str:
        return "invalid_request" if self.ctx.takes_tokens else "checksum_mismatch"

    def check_refusal(
        self, call: str, refusal: Refusal, error: ShardEngineError | ErrorInfo
    ) -> str:
        code = error.code
        matching = [expected for expected in refusal.errors if expected.code == code]
        if not matching:
            self.fail(
                f"{call}: expected {refusal.describe()}; got {code}: {message_of(error)}",
                FIX_ERROR.get(refusal.errors[0].code, FIX_ERROR["success"]),
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
                    FIX_ERROR["cache_miss"],
                )
            must_evicted = all(expected.evicted for expected in matching)
            may_evicted = any(expected.evicted for expected in matching)
            if must_evicted and reason != "evicted":
                self.fail(
                    f"{call}: the session was evicted; CacheMiss reason is {reason!r}",
                    FIX_ERROR["cache_miss"],
                )
            if not may_evicted and reason == "evicted":
                self.fail(
                    f"{call}: CacheMiss says 'evicted' but the session was not evicted",
                    FIX_ERROR["cache_miss"],
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
        self.ctx.harness.observe(result)
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
            want = (start, n, caps.shard.end, self.ctx.config.dtype)
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
            self.fail(f"{call}: result fields wrong: {'; '.join(problems)}", FIX_OUTPUT)
        values = output_rows(result)
        if not np.isfinite(values).all():
            self.fail(f"{call}: the output holds NaN or infinity", FIX_OUTPUT)

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
        if self.ctx.takes_tokens:
            inputs = TokenInput(token_ids=tuple(history.tokens))
        else:
            inputs = joined(history.segments, ref)
        try:
            expected = self.ctx.replay.prefill(
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
                FIX_OUTPUT,
            )
            return
        finally:
            self.ctx.replay.release(ReleaseRequest(session=ref))
        rows = output_rows(expected)
        first = start if logits == "all" or not self.caps.shard.emits_logits else start + n - 1
        last = start + n
        try:
            assert_matches(
                output_rows(result),
                rows[first:last],
                exact=self.ctx.exact,
                tolerance=self.ctx.tolerance,
                what=f"{call}: output vs a fresh replay of the session's history "
                f"({len(rows)} positions in one prefill)",
                kind=self.ctx.output_kind,
            )
        except AssertionError as error:
            self.fail(str(error), FIX_OUTPUT)

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
        history = self.histories.setdefault(sid, History())
        if previous_epoch is not None and previous_epoch != admission.epoch:
            history = self.histories[sid] = History()
        history.truncate(admission.start_pos)
        history.tokens.extend(tokens)
        history.segments.append(Segment(kind, admission.start_pos, inputs))
        self.model.commit(admission)

    # ------------------------------------------------------------- rules

    @_prefill_rule(_SESSIONS, PREFILL_SIZES)
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
        tokens = self.ctx.tokens_of(n, seed)
        session = SessionRef(session_id=sid, epoch=epoch)
        inputs = self.inputs(sid, session, start, tokens, bad)
        request_id = self.request_id()
        call = (
            f"prefill(session={self.name(index)}, epoch={epoch}, start_pos={start}, "
            f"{n} {'tokens' if self.ctx.takes_tokens else 'rows'}, logits={logits!r}"
            f"{', bad input' if bad else ''})"
        )
        plan = self.model.plan_prefill(sid, epoch, start, n)
        if bad:
            bad_error = ExpectedError(self.bad_code(), "the input is invalid")
            plan = Refusal((bad_error, *plan.errors) if isinstance(plan, Refusal) else (bad_error,))
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
            self.record_step(f"{call} -> {error.code}")
            if isinstance(plan, Admission):
                self.fail(
                    f"{call}: expected success, got {error.code}: {error.message}",
                    FIX_ERROR["success"],
                )
            assert isinstance(plan, Refusal)
            counters.errors[self.check_refusal(call, plan, error)] += 1
            return
        self.record_step(f"{call} -> ok")
        self.finished.append(request_id)
        if isinstance(plan, Refusal):
            self.fail(f"{call}: expected {plan.describe()}; it succeeded", fix_for(plan))
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

    @_extend_rule(_SESSIONS)
    def extend(self, index: int, n: int, seed: int) -> None:
        """A well-formed prefill: append to the session at its epoch (from 0 when new)."""
        self.prefill(index, "current", "append", n, seed, "last", False)

    @_step_rule(_SESSIONS)
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
        token = self.ctx.tokens_of(1, seed)
        inputs = self.inputs(sid, session, pos, token, bad)
        call = (
            f"decode(session={self.name(index)}, epoch={epoch}, pos={pos}"
            f"{', bad input' if bad else ''})"
        )
        return sid, session, pos, inputs, token, call

    @_decode_rule(_SESSIONS)
    def decode(
        self, index: int, epoch_choice: EpochChoice, pos_choice: PosChoice, seed: int, bad: bool
    ) -> None:
        sid, session, pos, inputs, token, call = self.decode_item(
            index, epoch_choice, pos_choice, seed, bad
        )
        plan = self.model.plan_decode(sid, session.epoch, pos)
        if bad:
            bad_error = ExpectedError(self.bad_code(), "the input is invalid")
            plan = Refusal((bad_error, *plan.errors) if isinstance(plan, Refusal) else (bad_error,))
        counters = self.model.counters
        counters.requests += 1
        counters.decode_requests += 1
        request_id = self.request_id()
        try:
            result = self.engine.decode(
                DecodeRequest(request_id=request_id, session=session, pos=pos, inputs=inputs)
            )
        except ShardEngineError as error:
            self.record_step(f"{call} -> {error.code}")
            if isinstance(plan, Admission):
                self.fail(
                    f"{call}: expected success, got {error.code}: {error.message}",
                    FIX_ERROR["success"],
                )
            assert isinstance(plan, Refusal)
            counters.errors[self.check_refusal(call, plan, error)] += 1
            return
        self.record_step(f"{call} -> ok")
        self.finished.append(request_id)
        if isinstance(plan, Refusal):
            self.fail(f"{call}: expected {plan.describe()}; it succeeded", fix_for(plan))
        assert isinstance(plan, Admission)
        self.check_result(call, result, request_id, session, pos, 1, "last")
        counters.decode_tokens += 1
        self.record_success(sid, plan, "decode", inputs, token)
        self.replay_and_compare(call, sid, result, pos, 1, "last")

    @_batch_rule(_SESSIONS, BATCH_SIZE)
    def decode_batch(self, items: list[BatchDraw]) -> None:
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
                DecodeRequest(request_id=self.request_id(), session=session, pos=pos, inputs=inputs)
                for (_sid, session, pos, inputs, _token, _call) in built
            ),
        )
        try:
            batch = self.engine.decode_batch(request)
        except ShardEngineError as error:
            self.record_step(f"{call} -> raised {error.code}")
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
        self.record_step(f"{call} -> [{summary}]")
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

    @_release_rule(_SESSIONS)
    def release(self, index: int, epoch_choice: EpochChoice) -> None:
        sid = self.sid(index)
        epoch = self.epoch(sid, epoch_choice)
        call = f"release(session={self.name(index)}, epoch={epoch})"
        expected = self.model.copy().release(sid, epoch)
        try:
            result = self.engine.release(
                ReleaseRequest(session=SessionRef(session_id=sid, epoch=epoch))
            )
        except ShardEngineError as error:
            self.record_step(f"{call} -> {error.code}")
            if not isinstance(expected, Refusal):
                self.fail(
                    f"{call}: expected released={expected}, got {error.code}: {error.message}",
                    "release frees a live session at its epoch or a newer one; an unknown "
                    "or already released session is a no-op that says so",
                )
            assert isinstance(expected, Refusal)
            self.model.counters.errors[self.check_refusal(call, expected, error)] += 1
            return
        self.record_step(f"{call} -> released={result.released}")
        if isinstance(expected, Refusal):
            self.fail(
                f"{call}: expected {expected.describe()}; got {result}",
                FIX_ERROR["stale_epoch"],
            )
        if result.released != expected:
            self.fail(
                f"{call}: released={result.released}, expected {expected}",
                "free exactly the live sessions; a second release frees nothing",
            )
        if expected:
            self.histories.pop(sid, None)
        self.model.release(sid, epoch)

    @_cancel_idle_rule(_SESSIONS)
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
            self.record_step(f"{call} -> {error.code}")
            self.fail(f"{call} raised {error!r}", "cancel of nothing in flight returns False")
            return
        self.record_step(f"{call} -> cancelled={result.cancelled}")
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
        index = next(i for i in range(len(self.ctx.profile.session_names)) if self.sid(i) == sid)
        current = self.model.sessions[sid]
        start = current.length
        tokens = self.ctx.tokens_of(n, seed)
        session = SessionRef(session_id=sid, epoch=current.epoch)
        inputs = self.inputs(sid, session, start, tokens, False)
        request_id = self.request_id()
        target = "session" if by_session else "request id"
        call = (
            f"prefill(session={self.name(index)}, epoch={current.epoch}, "
            f"start_pos={start}, {n} {'tokens' if self.ctx.takes_tokens else 'rows'}) on another "
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
            CancelRequest(session_id=sid) if by_session else CancelRequest(request_id=request_id)
        )
        cancelled = CancelResult(cancelled=False, n_requests=0)
        while worker.is_alive():
            if self.engine.health().in_flight:
                cancelled = self.engine.cancel(cancel)
                break
            time.sleep(0)
        worker.join(timeout=60.0)
        if worker.is_alive():
            self.fail(f"{call}: the prefill did not return within 60 s", FIX_CANCEL)
        error = outcome.get("error")
        if isinstance(error, ShardEngineError) and error.code == "cancelled":
            self.record_step(f"{call} -> cancelled")
            if (cancelled.cancelled, cancelled.n_requests) != (True, 1):
                self.fail(
                    f"{call}: the caller saw Cancelled but cancel() returned {cancelled}",
                    FIX_CANCEL,
                )
            counters.errors["cancelled"] += 1
            counters.cancelled += 1
            return
        if error is not None:
            self.record_step(f"{call} -> {getattr(error, 'code', type(error).__name__)}")
            self.fail(f"{call}: expected success or Cancelled, got {error!r}", FIX_CANCEL)
            return
        self.record_step(f"{call} -> ok (committed before the cancel)")
        self.finished.append(request_id)
        if cancelled.cancelled:
            self.fail(
                f"{call}: cancel() returned {cancelled}, yet the prefill committed",
                FIX_CANCEL,
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
            self.fail("after the last call: " + "; ".join(problems), FIX_METRICS)

    def teardown(self) -> None:
        try:
            if self.model.sessions and self.caps.features.cancel and not self.failed:
                self.cancel_in_flight(
                    self.example, 4, self.example, by_session=self.example % 2 == 1
                )
                self.health_and_metrics_match_the_model()
        finally:
            self.engine.close()


class DeepConformanceMachine(ConformanceMachine):
    """The machine of the deep profile (``--shard-engine-profile deep``): the same rules
    drawing from six sessions, prefills of up to 64 rows and batches of up to 12 items."""

    @_prefill_rule(_DEEP_SESSIONS, DEEP_PREFILL_SIZES)
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
        super().prefill(index, epoch_choice, start_choice, n, seed, logits, bad)

    @_extend_rule(_DEEP_SESSIONS)
    def extend(self, index: int, n: int, seed: int) -> None:
        super().extend(index, n, seed)

    @_step_rule(_DEEP_SESSIONS)
    def step(self, index: int, seed: int) -> None:
        super().step(index, seed)

    @_decode_rule(_DEEP_SESSIONS)
    def decode(
        self, index: int, epoch_choice: EpochChoice, pos_choice: PosChoice, seed: int, bad: bool
    ) -> None:
        super().decode(index, epoch_choice, pos_choice, seed, bad)

    @_batch_rule(_DEEP_SESSIONS, DEEP_BATCH_SIZE)
    def decode_batch(self, items: list[BatchDraw]) -> None:
        super().decode_batch(items)

    @_release_rule(_DEEP_SESSIONS)
    def release(self, index: int, epoch_choice: EpochChoice) -> None:
        super().release(index, epoch_choice)

    @_cancel_idle_rule(_DEEP_SESSIONS)
    def cancel_idle(self, aim: str, index: int) -> None:
        super().cancel_idle(aim, index)
