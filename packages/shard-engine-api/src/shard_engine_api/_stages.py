"""Many sessions through one pipeline at once (:meth:`Pipeline.generate_many`).

One thread per shard (a *stage*) and a few *groups* of sessions circulating head -> tail ->
head. A stage takes the group in front of it, runs its new sessions' prefills one by one and
the decodes of all the others as one ``decode_batch``, and hands the group on; the tail's stage
draws each session's next token and sends the group back to the head. With one group per
shard, shard ``k`` works on one group while shard ``k + 1`` works on another, so no shard idles
while there is work, and the decodes that meet at a shard are one backend forward.

Why stages rather than a thread per session: each engine is called by its own stage only, one
call at a time and in an order fixed by the prompts (not by thread timing), so a batch is
explicit, runs on any engine (with or without a scheduler that coalesces concurrent callers),
costs one call per group per shard instead of one per session, and a fault plan that counts
calls fires at the same call every run. Sessions leave a group when they end; a waiting prompt
takes the free place the next time the group passes the head. A session's release travels with
its group, so each engine releases it on its own stage's thread too.

Each session is sampled with its own seeded :class:`Sampler`, in its own order, so its tokens
are what it would draw alone; a batch changes its logits only within the engine's declared
batch tolerance (not at all on a batch-invariant engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import msgspec

from shard_engine_api._asyncio import _settled
from shard_engine_api._codec import encode_bundle
from shard_engine_api._errors import (
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    ShardEngineError,
    error_from_info,
)
from shard_engine_api._hookspecs import Tokenizer
from shard_engine_api._pipeline import (
    _LOG,
    FinishReason,
    GeneratedToken,
    GenerationResult,
    Pipeline,
    _check_session_and_tokenizer,
    _decoded,
    _describe,
    _Generation,
    _generation_result,
    _log_failure,
    _misplaced,
    _stop_set,
)
from shard_engine_api._sampling import GREEDY, Sampling
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
)

__all__ = [
    "GenerationRequest",
    "ManyGenerationResult",
    "SessionGeneration",
    "SessionsRun",
    "StageTimings",
]

_MS: Final = 1000.0
_T = TypeVar("_T")


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One session of :meth:`Pipeline.generate_many` with settings of its own: its prompt,
    how many tokens, its sampling (and seed), its stop tokens, and optionally its session
    (default: a fresh one)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_tokens: tuple[int, ...] = ()
    session: SessionRef | None = None


class StageTimings(msgspec.Struct, frozen=True, kw_only=True):
    """What one shard did during a :meth:`Pipeline.generate_many`: its prefill and decode
    calls, the session steps they carried (``items / calls`` is the mean batch), the largest
    batch, and the wall time spent in those calls (``busy_ms / wall_ms`` of the run is how busy
    the shard was kept). Releases are not counted."""

    shard: str
    calls: int
    items: int
    max_batch: int
    busy_ms: float


class SessionGeneration(msgspec.Struct, frozen=True, kw_only=True):
    """One session of a :meth:`Pipeline.generate_many`: what it generated (``result``, as
    :meth:`Pipeline.generate` returns it alone; up to the failure when ``error`` is set), the
    error that ended it (None when it ended by ``finish_reason``) and which shard raised it
    (None for a failure at sampling or in the tokenizer).

    Latencies, in milliseconds: ``queued_ms`` from the call to the session's start (it waits
    while ``max_in_flight`` sessions run), ``first_token_ms`` from its start to its first
    token, ``token_ms`` between each token and the next (one per token after the first: the
    per-token latency a reader of the stream sees, waits behind other groups included)."""

    index: int
    session: SessionRef
    result: GenerationResult
    error: ErrorInfo | None = None
    error_shard: int | None = None
    queued_ms: float = 0.0
    first_token_ms: float = 0.0
    token_ms: tuple[float, ...] = ()

    def raise_error(self) -> None:
        """Raise the session's error (its own class, code and details), if it has one."""
        if self.error is not None:
            raise error_from_info(self.error)


class ManyGenerationResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a :meth:`Pipeline.generate_many` produced: every session in the order of the
    prompts, what each shard did, the wall time of the whole run, the tokens generated by all
    sessions (failed ones included) and their aggregate rate, and the bytes of bundles that
    crossed boundaries over the wire (0 in process)."""

    sessions: tuple[SessionGeneration, ...]
    stages: tuple[StageTimings, ...]
    wall_ms: float
    generated_tokens: int
    tokens_per_s: float
    wire_bytes: int = 0

    def token_ms(self) -> tuple[float, ...]:
        """Every session's per-token latencies (``SessionGeneration.token_ms``), together."""
        return tuple(latency for entry in self.sessions for latency in entry.token_ms)

    def failed(self) -> tuple[SessionGeneration, ...]:
        """The sessions that ended with an error."""
        return tuple(entry for entry in self.sessions if entry.error is not None)


@dataclasses.dataclass(eq=False, slots=True)
class _Member:
    """A session in flight: where it stands, what its next stage receives, and its timings."""

    index: int
    state: _Generation
    queued_s: float
    started_s: float
    pos: int = 0
    prefill: bool = True
    inputs: ShardInput | None = None
    logits: LogitsResult | None = None
    step_started_s: float = 0.0
    step_shard_ms: list[float] = dataclasses.field(default_factory=list)
    last_token_s: float = 0.0
    first_token_ms: float = 0.0
    token_ms: list[float] = dataclasses.field(default_factory=list)
    wire_bytes: int = 0
    error: ShardEngineError | None = None
    error_shard: int | None = None


@dataclasses.dataclass(eq=False, slots=True)
class _Release:
    """A session to release on the stages that have not released it yet."""

    session: SessionRef
    remaining: set[int]


@dataclasses.dataclass(eq=False, slots=True)
class _Group:
    capacity: int
    members: list[_Member] = dataclasses.field(default_factory=list)
    releases: list[_Release] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _StageCounters:
    calls: int = 0
    items: int = 0
    max_batch: int = 0
    busy_s: float = 0.0

    def add(self, items: int, seconds: float) -> None:
        self.calls += 1
        self.items += items
        self.max_batch = max(self.max_batch, items)
        self.busy_s += seconds


def _inputs(member: _Member) -> ShardInput:
    """What the member's next shard receives (set at admission and by every shard's result)."""
    if member.inputs is None:
        raise AssertionError(f"session {member.state.session.session_id} has no inputs")
    return member.inputs


def _positive_or_none(name: str, value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise InvalidRequest(f"{name} must be an integer >= 1 or None, got {value!r}")
    return value


class SessionsRun:
    """One :meth:`Pipeline.generate_many`: checks everything at construction (InvalidRequest,
    nothing started), then :meth:`run` or :meth:`arun` drives the stages once."""

    def __init__(
        self,
        pipeline: Pipeline,
        prompts: Sequence[Sequence[int] | GenerationRequest],
        max_new_tokens: int,
        *,
        sampling: Sampling,
        stop_tokens: Sequence[int],
        tokenizer: Tokenizer | None,
        max_in_flight: int | None,
        groups: int | None,
        keep_logits: bool,
        on_token: Callable[[int, GeneratedToken], object] | None,
    ) -> None:
        given: object = prompts
        if isinstance(given, str | bytes | bytearray | memoryview) or not isinstance(
            given, Sequence
        ):
            raise InvalidRequest(
                f"prompts must be a sequence of prompts, got {type(given).__name__}"
            )
        if type(keep_logits) is not bool:
            raise InvalidRequest(f"keep_logits must be a bool, got {keep_logits!r}")
        if on_token is not None and not callable(on_token):
            raise InvalidRequest(f"on_token must be callable or None, got {on_token!r}")
        in_flight = _positive_or_none("max_in_flight", max_in_flight)
        group_count = _positive_or_none("groups", groups)
        _check_session_and_tokenizer(None, tokenizer)
        self.pipeline = pipeline
        self.engines = list(pipeline.engines)
        self._tokenizer = tokenizer
        self._on_token = on_token
        self._waiting: deque[tuple[int, _Generation]] = deque()
        names: set[str] = set()
        for index, prompt in enumerate(prompts):
            state = self._prepare(
                prompt, max_new_tokens, sampling, stop_tokens, tokenizer, keep_logits
            )
            if state.session.session_id in names:
                raise InvalidRequest(
                    f"prompt {index} names session {state.session.session_id!r} again: each "
                    "session of one run must be distinct"
                )
            names.add(state.session.session_id)
            self._waiting.append((index, state))
        capabilities = [engine.capabilities() for engine in self.engines]
        admitted = min(caps.limits.max_sessions for caps in capabilities)
        self._in_flight = max(1, min(in_flight or admitted, len(self._waiting)))
        self._group_count = min(group_count or len(self.engines), self._in_flight)
        # A decode batch never exceeds what a shard admits; a shard without batched decode
        # gets one decode per session.
        self._batch_limit = [
            max(1, caps.limits.max_batch_tokens) if caps.features.batched_decode else 1
            for caps in capabilities
        ]
        self._shards = [_describe(engine) for engine in self.engines]
        self._last = len(self.engines) - 1
        self._queues: list[queue.SimpleQueue[_Group | None]] = [
            queue.SimpleQueue() for _ in self.engines
        ]
        self._counters = [_StageCounters() for _ in self.engines]
        self._lock = threading.Lock()
        self._current: list[str | None] = [None] * len(self.engines)
        self._stopping = False
        self._fatal: BaseException | None = None
        self._live_groups = 0
        self._running_stages = 0
        self._members: list[_Member] = []
        self._released: dict[str, set[int]] = {}
        self._done = threading.Event()
        self._go = threading.Event()
        """Set once every stage thread was started: no stage touches an engine before, so a
        run stopped before it has nothing to release (see :meth:`run`)."""
        self._on_done: Callable[[], object] | None = None
        self._started_s = 0.0
        self._ended_s = 0.0
        self._used = False

    def _prepare(
        self,
        prompt: Sequence[int] | GenerationRequest,
        max_new_tokens: int,
        sampling: Sampling,
        stop_tokens: Sequence[int],
        tokenizer: Tokenizer | None,
        keep_logits: bool,
    ) -> _Generation:
        session: SessionRef | None = None
        if isinstance(prompt, GenerationRequest):
            _check_session_and_tokenizer(prompt.session, None)
            session = prompt.session
            prompt_ids: Sequence[int] = prompt.prompt_ids
            max_new_tokens = prompt.max_new_tokens
            sampling = prompt.sampling
            stop_tokens = prompt.stop_tokens
        else:
            prompt_ids = prompt
        pipeline = self.pipeline
        checked = pipeline._check_length(prompt_ids, max_new_tokens, final_decode=keep_logits)
        state = _Generation(
            pipeline,
            checked,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_tokens=_stop_set(stop_tokens, sampling),
            tokenizer=tokenizer,
            session=session or SessionRef(session_id=f"generate-{pipeline._request_id()}", epoch=1),
            record=keep_logits,
        )
        # The run releases the session itself, stage by stage: the state's own release (for
        # streams) must never run.
        state.started = state.released = True
        return state

    # ----------------------------------------------------------------- driving

    def run(self) -> ManyGenerationResult:
        """Drive every session to its end; see :meth:`Pipeline.generate_many`."""
        try:
            self._start()
            self._go.set()
            self._done.wait()
        except BaseException:
            # KeyboardInterrupt (or another exception delivered to this thread), wherever it
            # lands: stop the stages, and return only once every session is released. Before
            # ``_go`` no stage has touched an engine (and some may never have started): the
            # started ones see the stop and end, with nothing to release.
            self.stop()
            began = self._go.is_set()
            self._go.set()
            if began:
                self._done.wait()
            raise
        return self._result()

    async def arun(self) -> ManyGenerationResult:
        """:meth:`run` without blocking the event loop; see
        :meth:`Pipeline.agenerate_many`."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        self._on_done = lambda: loop.call_soon_threadsafe(finished)
        self._start()
        self._go.set()
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            self.stop()
            await _settled(done)
            raise
        return self._result()

    def stop(self) -> None:
        """Stop the run: cancel each shard's call in flight, let each stage end after it, and
        release every session (the run's :meth:`run` then raises what stopped it). Thread-safe
        and idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            current = list(self._current)
        for index, request_id in enumerate(current):
            if request_id is None:
                continue
            try:
                self.engines[index].cancel(CancelRequest(request_id=request_id))
            except Exception:  # noqa: BLE001 - stopping goes on; the stage ends after its call
                _LOG.warning("cancelling %s on shard %d failed", request_id, index, exc_info=True)
        for stage in self._queues:
            stage.put(None)

    def _start(self) -> None:
        if self._used:
            raise InvalidRequest("a SessionsRun runs once")
        self._used = True
        self._started_s = time.perf_counter()
        if not self._waiting:
            self._ended_s = self._started_s
            self._done.set()
            return
        sizes = [
            self._in_flight // self._group_count
            + (1 if index < self._in_flight % self._group_count else 0)
            for index in range(self._group_count)
        ]
        # Every group starts at the head, in order, before any stage runs: the order in which
        # each engine sees calls depends only on the prompts.
        self._live_groups = len(sizes)
        for size in sizes:
            self._queues[0].put(_Group(capacity=size))
        self._running_stages = len(self.engines)
        for index in range(len(self.engines)):
            threading.Thread(
                target=self._stage,
                args=(index,),
                name=f"shard-engine-stage-{index}",
                daemon=True,
            ).start()

    def _stage(self, index: int) -> None:
        inbox = self._queues[index]
        following = self._queues[(index + 1) % len(self._queues)]
        try:
            self._go.wait()
            while True:
                group = inbox.get()
                if group is None or self._stopping:
                    return
                self._release_pending(index, group)
                if index == 0:
                    self._admit(group)
                self._advance(index, group)
                if index == self._last:
                    self._sample(group)
                self._release_pending(index, group)
                if group.members or group.releases or self._waiting:
                    following.put(group)
                else:
                    self._group_ended()
        except BaseException as error:  # noqa: BLE001 - a bug or the caller's callback: the run ends
            with self._lock:
                if self._fatal is None:
                    self._fatal = error
            self.stop()
        finally:
            self._stage_ended()

    def _group_ended(self) -> None:
        with self._lock:
            self._live_groups -= 1
            last = self._live_groups == 0
        if last:
            for stage in self._queues:
                stage.put(None)

    def _stage_ended(self) -> None:
        with self._lock:
            self._running_stages -= 1
            if self._running_stages:
                return
        # The last stage out: every engine is idle now. Release what a stopped run left
        # behind, from this thread, so the caller's wait ends only when all is released.
        try:
            for member in self._members:
                done = self._released.get(member.state.session.session_id, set())
                for index in range(len(self.engines)):
                    if index not in done:
                        self._release(index, member.state.session)
        finally:
            self._ended_s = time.perf_counter()
            self._done.set()
            if self._on_done is not None:
                self._on_done()

    # ----------------------------------------------------------------- one stage's work

    def _admit(self, group: _Group) -> None:
        while len(group.members) < group.capacity and self._waiting:
            index, state = self._waiting.popleft()
            now = time.perf_counter()
            member = _Member(
                index=index,
                state=state,
                queued_s=now - self._started_s,
                started_s=now,
                inputs=TokenInput(token_ids=state.prompt_ids),
                step_started_s=now,
            )
            group.members.append(member)
            with self._lock:
                self._members.append(member)

    def _release(self, index: int, session: SessionRef) -> None:
        with self._lock:
            self._released.setdefault(session.session_id, set()).add(index)
        try:
            self.engines[index].release(ReleaseRequest(session=session))
        except ShardEngineError as error:
            # A release that fails must not hide how the session ended; a crashed engine lost
            # the session anyway.
            _LOG.warning(
                "releasing session %s on shard %d failed: %s", session.session_id, index, error
            )

    def _release_pending(self, index: int, group: _Group) -> None:
        for pending in group.releases:
            if index in pending.remaining:
                pending.remaining.discard(index)
                self._release(index, pending.session)
        group.releases = [pending for pending in group.releases if pending.remaining]

    def _leave(self, group: _Group, member: _Member) -> None:
        group.members.remove(member)
        group.releases.append(_Release(member.state.session, set(range(len(self.engines)))))

    def _fail(self, member: _Member, shard: int | None, error: ShardEngineError) -> None:
        if member.error is None:
            member.error = error
            member.error_shard = shard

    def _call(self, index: int, request_id: str, call: Callable[[], _T]) -> _T:
        with self._lock:
            self._current[index] = request_id
        try:
            return call()
        finally:
            with self._lock:
                self._current[index] = None

    def _cross(self, index: int, member: _Member) -> ShardInput:
        inputs = _inputs(member)
        codec = self.pipeline._codecs[index]
        if codec is None or not isinstance(inputs, BoundaryBundle):
            return inputs
        encoded = encode_bundle(inputs)
        member.wire_bytes += len(encoded)
        return codec.decode_bundle(encoded)

    def _advance(self, index: int, group: _Group) -> None:
        ready: list[_Member] = []
        for member in group.members:
            # Each bundle is decoded from the wire on its own: one that fails its checks is
            # its session's error, not its batch's.
            try:
                member.inputs = self._cross(index, member)
            except ShardEngineError as error:
                self._fail(member, index, error)
            else:
                ready.append(member)
        prefills = [member for member in ready if member.prefill]
        decodes = [member for member in ready if not member.prefill]
        for member in prefills:
            self._prefill(index, member)
        limit = self._batch_limit[index]
        for start in range(0, len(decodes), limit):
            chunk = decodes[start : start + limit]
            if len(chunk) == 1:
                self._decode(index, chunk[0])
            else:
                self._decode_batch(index, chunk)
        for member in list(group.members):
            if member.error is not None:
                self._end_text(member)
                self._leave(group, member)

    def _prefill(self, index: int, member: _Member) -> None:
        engine = self.engines[index]

        def call(request_id: str) -> ShardResult:
            return engine.prefill(
                PrefillRequest(
                    request_id=request_id,
                    session=member.state.session,
                    start_pos=member.pos,
                    inputs=_inputs(member),
                )
            )

        self._step(index, member, call)

    def _decode(self, index: int, member: _Member) -> None:
        engine = self.engines[index]

        def call(request_id: str) -> ShardResult:
            return engine.decode(
                DecodeRequest(
                    request_id=request_id,
                    session=member.state.session,
                    pos=member.pos,
                    inputs=_inputs(member),
                )
            )

        self._step(index, member, call)

    def _step(self, index: int, member: _Member, call: Callable[[str], ShardResult]) -> None:
        """One member's own call at shard ``index`` (a prefill, or a lone decode), timed and
        counted; a failure is that member's error."""
        started = time.perf_counter()
        request_id = f"{self.pipeline._request_id()}/{index}"
        try:
            result = self._call(index, request_id, lambda: call(request_id))
        except ShardEngineError as error:
            _log_failure(index, request_id, error)
            self._fail(member, index, error)
            return
        seconds = time.perf_counter() - started
        self._counters[index].add(1, seconds)
        self._accept(index, member, result, seconds)

    def _decode_batch(self, index: int, chunk: list[_Member]) -> None:
        started = time.perf_counter()
        request_id = f"{self.pipeline._request_id()}/{index}"
        try:
            items = tuple(
                DecodeRequest(
                    request_id=f"{self.pipeline._request_id()}/{index}",
                    session=member.state.session,
                    pos=member.pos,
                    inputs=_inputs(member),
                )
                for member in chunk
            )
            request = DecodeBatchRequest(request_id=request_id, items=items)
            reply = self._call(index, request_id, lambda: self.engines[index].decode_batch(request))
        except ShardEngineError as error:
            # The whole batch failed (the engine crashed, the batch was cancelled): it failed
            # for each of its sessions.
            _log_failure(index, request_id, error)
            for member in chunk:
                self._fail(member, index, error)
            return
        seconds = time.perf_counter() - started
        self._counters[index].add(len(chunk), seconds)
        outcomes = reply.items
        if len(outcomes) != len(chunk):
            malformed = MalformedOutput(
                f"shard {index} answered a batch of {len(chunk)} with {len(outcomes)} items"
            )
            for member in chunk:
                self._fail(member, index, malformed)
            return
        for member, outcome in zip(chunk, outcomes, strict=True):
            if isinstance(outcome, ErrorInfo):
                item_error = error_from_info(outcome)
                _log_failure(index, request_id, item_error)
                self._fail(member, index, item_error)
            else:
                self._accept(index, member, outcome, seconds)

    def _accept(self, index: int, member: _Member, result: ShardResult, seconds: float) -> None:
        member.step_shard_ms.append(seconds * _MS)
        observe = self.pipeline._observe
        if observe is not None:
            observe(result)
        if isinstance(result, BoundaryResult) and index < self._last:
            member.inputs = result.bundle
        elif isinstance(result, LogitsResult) and index == self._last:
            member.logits = result
        else:
            self._fail(member, index, _misplaced(index, self._last, result))

    def _sample(self, group: _Group) -> None:
        """The tail's part: each session's next token, as :meth:`Pipeline.stream` draws it."""
        for member in list(group.members):
            logits, member.logits = member.logits, None
            if logits is None:  # pragma: no cover - every member left the tail with logits
                continue
            state = member.state
            now = time.perf_counter()
            step_ms = (now - member.step_started_s) * _MS
            if member.prefill:
                state.prefill_ms = step_ms
                state.shard_prefill = tuple(member.step_shard_ms)
            else:
                state.decode_ms.append(step_ms)
                state.shard_decode.append(tuple(member.step_shard_ms))
            member.step_shard_ms = []
            width = len(member.state.prompt_ids) if member.prefill else 1
            position = member.pos + width
            try:
                row = logits.array()[-1]
                if state.record:
                    state.step_logits.append(row.tobytes())
                if len(state.token_ids) == state.max_new_tokens:
                    self._finish(group, member, "length")
                    continue
                token = state.sampler(row)
                if token in state.stop_tokens:
                    self._finish(group, member, "stop")
                    continue
                state.token_ids.append(token)
                piece = state.piece()
            except ShardEngineError as error:
                self._fail(member, None, error)
                self._end_text(member)
                self._leave(group, member)
                continue
            if len(state.token_ids) == 1:
                member.first_token_ms = (now - member.started_s) * _MS
            else:
                member.token_ms.append((now - member.last_token_s) * _MS)
            member.last_token_s = now
            if self._on_token is not None:
                self._on_token(
                    member.index, GeneratedToken(token_id=token, position=position, text=piece)
                )
            if len(state.token_ids) == state.max_new_tokens and not state.record:
                self._finish(group, member, "length")
                continue
            member.prefill = False
            member.pos = position
            member.inputs = TokenInput(token_ids=(token,))
            member.step_started_s = time.perf_counter()

    def _finish(self, group: _Group, member: _Member, reason: FinishReason) -> None:
        member.state.finish_reason = reason
        self._end_text(member)
        self._leave(group, member)

    def _end_text(self, member: _Member) -> None:
        state = member.state
        if state.tokenizer is None or not state.token_ids:
            return
        try:
            state.text = _decoded(state.tokenizer, state.token_ids)
        except MalformedOutput as error:
            self._fail(member, None, error)

    # ----------------------------------------------------------------- the result

    def _result(self) -> ManyGenerationResult:
        if self._fatal is not None:
            raise self._fatal
        wall_ms = (self._ended_s - self._started_s) * _MS
        entries: list[SessionGeneration] = []
        wire_bytes = 0
        for member in sorted(self._members, key=lambda entry: entry.index):
            state = member.state
            state.wire_bytes = member.wire_bytes
            wire_bytes += member.wire_bytes
            entries.append(
                SessionGeneration(
                    index=member.index,
                    session=state.session,
                    result=_generation_result(state, self._shards),
                    error=None if member.error is None else member.error.to_info(),
                    error_shard=member.error_shard,
                    queued_ms=member.queued_s * _MS,
                    first_token_ms=member.first_token_ms,
                    token_ms=tuple(member.token_ms),
                )
            )
        self.pipeline.wire_bytes += wire_bytes
        generated = sum(len(entry.result.token_ids) for entry in entries)
        return ManyGenerationResult(
            sessions=tuple(entries),
            stages=tuple(
                StageTimings(
                    shard=shard,
                    calls=counters.calls,
                    items=counters.items,
                    max_batch=counters.max_batch,
                    busy_ms=counters.busy_s * _MS,
                )
                for shard, counters in zip(self._shards, self._counters, strict=True)
            ),
            wall_ms=wall_ms,
            generated_tokens=generated,
            tokens_per_s=generated / (wall_ms / _MS) if wall_ms > 0 else 0.0,
            wire_bytes=wire_bytes,
        )
