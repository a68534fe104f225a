"""The one pipeline driver: engines ordered head -> middle... -> tail, driven for one or more
sessions in one process. The ``run`` and ``bench`` commands, the fake's helpers, the benchmarks,
the conformance suite and worker code all step through :class:`Pipeline`; workers generate with
:meth:`Pipeline.stream` (an iterator of tokens that always releases its session), and many
sessions at once with :meth:`Pipeline.generate_many` (its stage loop is in ``_stages``)."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._codec import Codec, encode_bundle
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    ShardEngineError,
    error_from_info,
)
from shard_engine_api._hookspecs import ModelFixture, Tokenizer
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._sampling import GREEDY, Sampler, Sampling
from shard_engine_api._types import (
    INT32_MAX,
    MAX_ID_CHARS,
    BoundaryBundle,
    BoundaryResult,
    DecodeBatchRequest,
    DecodeRequest,
    LogitsMode,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
)

if TYPE_CHECKING:
    from shard_engine_api._stages import GenerationRequest, ManyGenerationResult

__all__ = [
    "FinishReason",
    "GeneratedToken",
    "GenerationResult",
    "Pipeline",
    "PipelineStep",
    "ShardTimings",
    "TokenStream",
    "load_pipeline",
    "split_layers",
]

_LOG = logging.getLogger("shard_engine.pipeline")

FinishReason = Literal["stop", "length"]
"""Why a generation ended: a stop token was drawn, or ``max_new_tokens`` were generated."""


_MAX_PREFIX_CHARS: Final = MAX_ID_CHARS - 40
"""The longest request prefix: a step's ids append "-<counter>/<shard index>"."""


def split_layers(n_layers: int, n_parts: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_parts`` contiguous ranges as evenly as possible (earlier
    ranges get the extra layer). Raises InvalidRequest unless ``1 <= n_parts <= n_layers``."""
    for name, value in (("n_layers", n_layers), ("n_parts", n_parts)):
        # Exactly int: 6.0 would make float layer bounds, True would split as 1.
        if type(value) is not int:
            raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if not 1 <= n_parts <= n_layers:
        raise InvalidRequest(
            f"cannot split {n_layers} layers into {n_parts} shards (choose 1 to {n_layers})"
        )
    base, extra = divmod(n_layers, n_parts)
    ranges: list[tuple[int, int]] = []
    start = 0
    for index in range(n_parts):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class PipelineStep(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill or decode through every shard: the tail's logits, the wall time of each
    shard's call, and the compute time the shards reported (all in milliseconds)."""

    logits: LogitsResult
    shard_ms: tuple[float, ...]
    wall_ms: float
    compute_ms: float


class ShardTimings(msgspec.Struct, frozen=True, kw_only=True):
    """Per-shard wall time of one generation, in milliseconds."""

    shard: str
    prefill_ms: float
    decode_ms_median: float
    decode_ms_total: float


class GeneratedToken(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token: its id, the position it occupies, and the text it adds (None
    without a tokenizer; possibly empty while a multi-byte character is incomplete)."""

    token_id: int
    position: int
    text: str | None = None


class GenerationResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a whole generation produced: the new token ids (and text where a tokenizer
    exists), the last logits row of every step (prefill then each decode), timings, and the
    bytes of bundles that crossed boundaries over the wire (0 in process)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    step_logits: tuple[bytes, ...]
    shard_timings: tuple[ShardTimings, ...]
    prefill_ms: float
    decode_ms_median: float
    wire_bytes: int = 0
    finish_reason: FinishReason = "length"
    text: str | None = None

    def logits(self) -> npt.NDArray[np.float32]:
        """``(steps, vocab)`` array of the last-row logits of every step."""
        return np.stack([np.frombuffer(row, dtype="<f4") for row in self.step_logits])


class Pipeline:
    """Engines ordered head to tail (one engine of role "full" is a pipeline too).

    With ``wire=True`` every bundle crosses each boundary as msgpack bytes, decoded by a
    :class:`~shard_engine_api.wire.Codec` that expects the next shard's fingerprint and layer,
    as it would between machines; ``wire_bytes`` counts what crossed. ``observe`` sees every
    shard result (the conformance suite records evidence with it). The pipeline does not own
    its engines unless used as a context manager or closed with :meth:`close`.
    """

    def __init__(
        self,
        engines: Sequence[ShardEngine],
        *,
        wire: bool = False,
        observe: Callable[[ShardResult], object] | None = None,
        request_prefix: str | None = None,
    ) -> None:
        given: object = engines
        if not isinstance(given, Sequence):
            raise InvalidRequest(
                f"a pipeline takes a sequence of engines, got {type(given).__name__}"
            )
        if not engines:
            raise InvalidRequest("a pipeline needs at least one engine")
        # Checked now: a bad observer would fail after the first shard committed a step.
        if type(wire) is not bool:
            raise InvalidRequest(f"wire must be a bool, got {wire!r}")
        if observe is not None and not callable(observe):
            raise InvalidRequest(f"observe must be callable or None, got {observe!r}")
        prefix: object = request_prefix
        if prefix is not None and (
            type(prefix) is not str or not 0 < len(prefix) <= _MAX_PREFIX_CHARS
        ):
            raise InvalidRequest(
                f"request_prefix must be a str of 1 to {_MAX_PREFIX_CHARS} characters (request "
                f"ids add a counter and a shard index), got {prefix!r}"
            )
        for index, engine in enumerate(engines):
            if not isinstance(engine, ShardEngine):
                raise InvalidRequest(
                    f"pipeline stage {index} is a {type(engine).__name__}, not a ShardEngine"
                )
        capabilities = [engine.capabilities() for engine in engines]
        specs = [caps.shard for caps in capabilities]
        if specs[0].start != 0 or specs[-1].end != specs[-1].n_layers:
            raise InvalidRequest("a pipeline must start at layer 0 and end at the last layer")
        for before, after in itertools.pairwise(specs):
            if before.end != after.start:
                raise InvalidRequest(
                    f"shards [{before.start},{before.end}) and [{after.start},{after.end}) "
                    "are not contiguous"
                )
        self.engines = list(engines)
        self.max_context = min(caps.limits.max_context for caps in capabilities)
        """The longest session every shard admits (prompt plus generated tokens)."""
        self.wire_bytes = 0
        self._observe = observe
        self._prefix = request_prefix or f"pipeline-{id(self):x}"
        self._counter = itertools.count(1)
        self._codecs: list[Codec | None] = [None] * len(self.engines)
        if wire:
            for index, engine in enumerate(self.engines[1:], start=1):
                caps = engine.capabilities()
                self._codecs[index] = Codec(
                    expected_fingerprint=caps.model_fingerprint, expected_layer=caps.shard.start
                )

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Close every engine (each is closed even if another's close raises)."""
        errors: list[BaseException] = []
        for engine in self.engines:
            try:
                engine.close()
            except Exception as error:  # noqa: BLE001 - re-raised after the others closed
                errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- steps

    def _request_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"

    def _cross(self, index: int, inputs: ShardInput) -> ShardInput:
        codec = self._codecs[index]
        if codec is None or not isinstance(inputs, BoundaryBundle):
            return inputs
        encoded = encode_bundle(inputs)
        self.wire_bytes += len(encoded)
        return codec.decode_bundle(encoded)

    def step(
        self,
        session: SessionRef,
        pos: int,
        inputs: Sequence[int] | TokenInput,
        *,
        decode: bool = False,
        logits: LogitsMode = "last",
        request_id: str | None = None,
    ) -> PipelineStep:
        """Run tokens at ``pos`` through every shard (a prefill, or with ``decode`` a decode
        of one token) and return the tail's logits with timings. Shard ``i`` gets request id
        ``f"{request_id}/{i}"``. Raises whatever a shard raises, and MalformedOutput when a
        shard returns the wrong kind of result for its place.

        A step is not atomic across shards: one that fails at shard ``i`` leaves shards before
        ``i`` committed (the error's log line names the shard). Re-issue it as a prefill at the
        same position, which truncates those shards first; a decode at the same position would
        be CacheMiss on them."""
        base = request_id or self._request_id()
        current: ShardInput = (
            inputs if isinstance(inputs, TokenInput) else TokenInput(token_ids=tuple(inputs))
        )
        shard_ms: list[float] = []
        compute_ms = 0.0
        started = time.perf_counter()
        last = len(self.engines) - 1
        for index, engine in enumerate(self.engines):
            shard_started = time.perf_counter()
            current = self._cross(index, current)
            shard_request = f"{base}/{index}"
            result: ShardResult
            try:
                if decode:
                    result = engine.decode(
                        DecodeRequest(
                            request_id=shard_request, session=session, pos=pos, inputs=current
                        )
                    )
                else:
                    result = engine.prefill(
                        PrefillRequest(
                            request_id=shard_request,
                            session=session,
                            start_pos=pos,
                            inputs=current,
                            logits=logits if index == last else "last",
                        )
                    )
            except ShardEngineError as error:
                _log_failure(index, shard_request, error)
                raise
            shard_ms.append((time.perf_counter() - shard_started) * 1000.0)
            compute_ms += result.timings.compute_ms
            if self._observe is not None:
                self._observe(result)
            if isinstance(result, BoundaryResult) and index < last:
                current = result.bundle
            elif isinstance(result, LogitsResult) and index == last:
                return PipelineStep(
                    logits=result,
                    shard_ms=tuple(shard_ms),
                    wall_ms=(time.perf_counter() - started) * 1000.0,
                    compute_ms=compute_ms,
                )
            else:
                raise _misplaced(index, last, result)
        raise AssertionError("unreachable: a pipeline has at least one engine")

    def prefill(
        self,
        session: SessionRef,
        start_pos: int,
        tokens: Sequence[int],
        *,
        logits: LogitsMode = "last",
    ) -> LogitsResult:
        """Prefill ``tokens`` at ``start_pos`` on every shard; the tail's logits."""
        return self.step(session, start_pos, tokens, logits=logits).logits

    def decode(self, session: SessionRef, pos: int, token: int) -> LogitsResult:
        """Decode one token at ``pos`` on every shard; the tail's logits. What
        ``step(session, pos, (token,), decode=True)`` does, without its timings: the step
        between two forwards is the engine's overhead, and each call and clock read costs
        several microseconds there once the forward has evicted the caches. Not atomic across
        shards (see :meth:`step`): after a failure, re-issue it as ``prefill(session, pos,
        (token,))``."""
        base = f"{self._prefix}-{next(self._counter)}"
        current: ShardInput = TokenInput(token_ids=(token,))
        codecs = self._codecs
        observe = self._observe
        last = len(self.engines) - 1
        for index, engine in enumerate(self.engines):
            if codecs[index] is not None:
                current = self._cross(index, current)
            shard_request = f"{base}/{index}"
            try:
                result = engine.decode(
                    DecodeRequest(
                        request_id=shard_request, session=session, pos=pos, inputs=current
                    )
                )
            except ShardEngineError as error:
                _log_failure(index, shard_request, error)
                raise
            if observe is not None:
                observe(result)
            if isinstance(result, BoundaryResult) and index < last:
                current = result.bundle
            elif isinstance(result, LogitsResult) and index == last:
                return result
            else:
                raise _misplaced(index, last, result)
        raise AssertionError("unreachable: a pipeline has at least one engine")

    def decode_batch(
        self, sessions: Sequence[SessionRef], positions: Sequence[int], tokens: Sequence[int]
    ) -> list[LogitsResult]:
        """One decode step of several sessions: one ``decode_batch`` per shard. Raises the
        first item's error (as its own class) when any item fails."""
        if not len(sessions) == len(positions) == len(tokens):
            raise InvalidRequest(
                f"a batch needs one position and one token per session: {len(sessions)} "
                f"sessions, {len(positions)} positions, {len(tokens)} tokens"
            )
        inputs: list[ShardInput] = [TokenInput(token_ids=(token,)) for token in tokens]
        last = len(self.engines) - 1
        results: list[LogitsResult] = []
        for index, engine in enumerate(self.engines):
            items = tuple(
                DecodeRequest(
                    request_id=self._request_id(),
                    session=session,
                    pos=position,
                    inputs=self._cross(index, item),
                )
                for session, position, item in zip(sessions, positions, inputs, strict=True)
            )
            reply = engine.decode_batch(
                DecodeBatchRequest(request_id=self._request_id(), items=items)
            )
            next_inputs: list[ShardInput] = []
            results = []
            for outcome in reply.items:
                if isinstance(outcome, ErrorInfo):
                    raise error_from_info(outcome)
                if self._observe is not None:
                    self._observe(outcome)
                if isinstance(outcome, BoundaryResult) and index < last:
                    next_inputs.append(outcome.bundle)
                elif isinstance(outcome, LogitsResult) and index == last:
                    results.append(outcome)
                else:
                    raise _misplaced(index, last, outcome)
            inputs = next_inputs
        return results

    def release(self, session: SessionRef) -> None:
        """Release ``session`` on every shard, even when one of them fails (the first error
        is raised after the others were released)."""
        errors: list[ShardEngineError] = []
        for engine in self.engines:
            try:
                engine.release(ReleaseRequest(session=session))
            except ShardEngineError as error:
                errors.append(error)
        if errors:
            raise errors[0]

    # ----------------------------------------------------------------- generation

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        session: SessionRef | None = None,
    ) -> TokenStream:
        """Prefill ``prompt_ids`` and generate up to ``max_new_tokens`` tokens, one at a time.

        The stream ends after ``max_new_tokens`` tokens (``finish_reason == "length"``) or
        when a token in ``stop_tokens`` is drawn (``"stop"``; the stop token is not yielded).
        Its session (a fresh one unless ``session`` is given) is released on every exit: the
        end, an exception, an early ``break`` inside ``with``, or :meth:`TokenStream.close`.
        Raises InvalidRequest for an empty prompt or a negative ``max_new_tokens``."""
        _check_session_and_tokenizer(session, tokenizer)
        return TokenStream(
            _Generation(
                self,
                self._check_length(prompt_ids, max_new_tokens, final_decode=False),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop_tokens=_stop_set(stop_tokens, sampling),
                tokenizer=tokenizer,
                session=session or SessionRef(session_id=f"generate-{self._request_id()}", epoch=1),
                record=False,
            )
        )

    def _check_length(
        self, prompt_ids: Sequence[int], max_new_tokens: int, *, final_decode: bool
    ) -> tuple[int, ...]:
        """The prompt as a tuple, once it and ``max_new_tokens`` fit every shard's context:
        a generation that cannot fit is refused before any work, not after a minute of it."""
        # A str, bytes or mapping iterates as something other than token ids (characters,
        # byte values, keys), and a generator has no length: each is refused, not guessed at.
        if isinstance(prompt_ids, str | bytes | bytearray | memoryview) or not isinstance(
            prompt_ids, Sequence | np.ndarray
        ):
            raise InvalidRequest(
                f"the prompt must be a sequence of token ids, got {type(prompt_ids).__name__}"
            )
        # len(), not truth: a numpy array of ids has no truth value (its ids are refused as
        # numpy integers, typed, by the edge checks of the first prefill).
        if len(prompt_ids) == 0:
            raise InvalidRequest("the prompt has no tokens")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise InvalidRequest(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        # The last generated token is cached only when it is decoded too.
        needed = len(prompt_ids) + max(0, max_new_tokens - (0 if final_decode else 1))
        if needed > self.max_context:
            raise InvalidRequest(
                f"a prompt of {len(prompt_ids)} tokens and {max_new_tokens} new tokens need "
                f"{needed} positions; these shards hold at most {self.max_context} per session"
            )
        return tuple(prompt_ids)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        session: SessionRef | None = None,
        on_token: Callable[[GeneratedToken], None] | None = None,
    ) -> GenerationResult:
        """The whole of :meth:`stream`, with the logits of every step (the last generated
        token is decoded too, so its logits are there to compare) and timings. ``on_token``
        (when given) receives each token as it is generated, e.g. to print its text."""
        _check_session_and_tokenizer(session, tokenizer)
        stream = TokenStream(
            _Generation(
                self,
                self._check_length(prompt_ids, max_new_tokens, final_decode=True),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop_tokens=_stop_set(stop_tokens, sampling),
                tokenizer=tokenizer,
                session=session or SessionRef(session_id=f"generate-{self._request_id()}", epoch=1),
                record=True,
            )
        )
        with stream:
            for token in stream:
                if on_token is not None:
                    on_token(token)
        return stream.result()

    def generate_many(
        self,
        prompts: Sequence[Sequence[int] | GenerationRequest],
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        max_in_flight: int | None = None,
        groups: int | None = None,
        keep_logits: bool = True,
        on_token: Callable[[int, GeneratedToken], object] | None = None,
    ) -> ManyGenerationResult:
        """Generate for many sessions at once, keeping every shard busy: while shard ``k``
        works on one group of sessions, shard ``k + 1`` works on another, and the decodes of
        a group meet at each shard as one ``decode_batch``.

        Each prompt is one session. A plain prompt takes ``max_new_tokens``, ``sampling`` and
        ``stop_tokens``; a :class:`GenerationRequest` carries its own (and may name its
        session). Each session's tokens, text and (with ``keep_logits``) step logits are what
        :meth:`generate` gives for it alone, within the engines' declared batch tolerance
        (bit-identical on a batch-invariant engine). With ``keep_logits=False`` no logits are
        kept and the last token is not decoded, as :meth:`stream` does.

        At most ``max_in_flight`` sessions (default: as many as every shard admits) hold
        engine state at once; the next prompt starts when one ends. They travel in
        ``groups`` groups (default one per shard, so each shard has one to work on: right
        when each shard has cores of its own; shards that share one machine's cores should
        take fewer, e.g. ``cores // threads per shard``, or llama.cpp's spinning threads
        oversubscribe them, see the README's "Many sessions at once").
        ``on_token(index, token)`` is called on the tail shard's thread for each token of
        ``prompts[index]`` as it is drawn; it should not block (the tail waits for it).

        A session that fails (a step raises on some shard, its logits cannot be sampled, the
        tokenizer fails) ends with that error in :attr:`SessionGeneration.error` and leaves
        the others running; nothing is replayed, as in :meth:`generate`. Every session is
        released on every shard before this returns or raises. An exception of another kind
        (``on_token`` raising, an engine's own exception outside the taxonomy) or a
        KeyboardInterrupt cancels the calls in flight and ends the whole run with it.

        Raises InvalidRequest for an invalid prompt or setting, before any work."""
        from shard_engine_api._stages import SessionsRun

        return SessionsRun(
            self,
            prompts,
            max_new_tokens,
            sampling=sampling,
            stop_tokens=stop_tokens,
            tokenizer=tokenizer,
            max_in_flight=max_in_flight,
            groups=groups,
            keep_logits=keep_logits,
            on_token=on_token,
        ).run()

    async def agenerate_many(
        self,
        prompts: Sequence[Sequence[int] | GenerationRequest],
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        max_in_flight: int | None = None,
        groups: int | None = None,
        keep_logits: bool = True,
        on_token: Callable[[int, GeneratedToken], object] | None = None,
    ) -> ManyGenerationResult:
        """:meth:`generate_many` for asyncio: the shards run on their own threads and the event
        loop only waits. Cancelling the task cancels the calls in flight, waits until every
        session is released on every shard, then ends with ``CancelledError``."""
        from shard_engine_api._stages import SessionsRun

        return await SessionsRun(
            self,
            prompts,
            max_new_tokens,
            sampling=sampling,
            stop_tokens=stop_tokens,
            tokenizer=tokenizer,
            max_in_flight=max_in_flight,
            groups=groups,
            keep_logits=keep_logits,
            on_token=on_token,
        ).arun()


class _Generation:
    """The state of one generation. The token generator holds this, not the TokenStream, so
    dropping an unfinished stream frees the generator at once (no reference cycle), which
    closes it and releases the session."""

    def __init__(
        self,
        pipeline: Pipeline,
        prompt_ids: tuple[int, ...],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop_tokens: frozenset[int],
        tokenizer: Tokenizer | None,
        session: SessionRef,
        record: bool,
    ) -> None:
        self.pipeline = pipeline
        self.session = session
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.sampler = Sampler(sampling)
        self.stop_tokens = stop_tokens
        self.tokenizer = tokenizer
        self.record = record
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.text = ""
        self.step_logits: list[bytes] = []
        self.shard_prefill: tuple[float, ...] = ()
        self.shard_decode: list[tuple[float, ...]] = []
        self.prefill_ms = 0.0
        self.decode_ms: list[float] = []
        self.wire_bytes_before = pipeline.wire_bytes
        self.wire_bytes = 0
        self.started = False
        self.released = False

    def release(self) -> None:
        if self.released or not self.started:
            return
        self.released = True
        self.wire_bytes = self.pipeline.wire_bytes - self.wire_bytes_before
        try:
            self.pipeline.release(self.session)
        except ShardEngineError as error:
            # Releasing must not hide why the generation ended; a crashed engine lost the
            # session anyway.
            _LOG.warning("releasing session %s failed: %s", self.session.session_id, error)

    def piece(self) -> str | None:
        if self.tokenizer is None:
            return None
        # An incomplete multi-byte character decodes to U+FFFD: hold it back until the next
        # token completes it. A tokenizer that rewrites earlier text yields "" here; the
        # stream's ``text`` is always the decode of every token.
        stable = _decoded(self.tokenizer, self.token_ids).rstrip("\ufffd")
        if not stable.startswith(self.text):
            return ""
        piece, self.text = stable[len(self.text) :], stable
        return piece


def _tokens(state: _Generation) -> Generator[GeneratedToken, None, None]:
    pipeline, session = state.pipeline, state.session
    state.started = True
    try:
        step = pipeline.step(session, 0, state.prompt_ids)
        state.prefill_ms = step.wall_ms
        state.shard_prefill = step.shard_ms
        pos = len(state.prompt_ids)
        while True:
            row = step.logits.array()[-1]
            if state.record:
                state.step_logits.append(row.tobytes())
            if len(state.token_ids) == state.max_new_tokens:
                state.finish_reason = "length"
                return
            token = state.sampler(row)
            if token in state.stop_tokens:
                state.finish_reason = "stop"
                return
            state.token_ids.append(token)
            yield GeneratedToken(token_id=token, position=pos, text=state.piece())
            if len(state.token_ids) == state.max_new_tokens and not state.record:
                # A stream does not pay for a decode whose logits nobody reads.
                state.finish_reason = "length"
                return
            step = pipeline.step(session, pos, (token,), decode=True)
            state.decode_ms.append(step.wall_ms)
            state.shard_decode.append(step.shard_ms)
            pos += 1
    finally:
        # Released first: a tokenizer that fails here must not keep the session held.
        state.release()
        if state.tokenizer is not None and state.token_ids:
            state.text = _decoded(state.tokenizer, state.token_ids)


class TokenStream:
    """An iterator of :class:`GeneratedToken` over one session; see :meth:`Pipeline.stream`.

    Use it in a ``with`` block (or call :meth:`close`) so that leaving early releases the
    session at once. After the end, ``finish_reason``, ``token_ids`` and ``text`` say what was
    generated."""

    def __init__(self, state: _Generation) -> None:
        self._state = state
        self._tokens = _tokens(state)

    @property
    def session(self) -> SessionRef:
        return self._state.session

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._state.prompt_ids

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The tokens generated so far."""
        return tuple(self._state.token_ids)

    @property
    def finish_reason(self) -> FinishReason | None:
        """ "stop" or "length" once the stream has ended; None before."""
        return self._state.finish_reason

    @property
    def text(self) -> str | None:
        """The text generated so far (None without a tokenizer)."""
        return None if self._state.tokenizer is None else self._state.text

    def __iter__(self) -> Iterator[GeneratedToken]:
        return self

    def __next__(self) -> GeneratedToken:
        return next(self._tokens)

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop generating and release the session (idempotent)."""
        self._tokens.close()
        self._state.release()

    def result(self) -> GenerationResult:
        """What was generated, with timings (complete once the stream has ended)."""
        return _generation_result(self._state)


def _generation_result(state: _Generation, shards: Sequence[str] | None = None) -> GenerationResult:
    """What ``state`` generated, with its timings (a stream's, or one of generate_many's
    sessions', which names the ``shards`` once: an engine that crashed meanwhile cannot)."""
    names = shards if shards is not None else [_describe(e) for e in state.pipeline.engines]
    timings: list[ShardTimings] = []
    for index, name in enumerate(names):
        per_step = [shard_ms[index] for shard_ms in state.shard_decode]
        timings.append(
            ShardTimings(
                shard=name,
                prefill_ms=state.shard_prefill[index] if state.shard_prefill else 0.0,
                decode_ms_median=statistics.median(per_step) if per_step else 0.0,
                decode_ms_total=sum(per_step),
            )
        )
    return GenerationResult(
        prompt_ids=state.prompt_ids,
        token_ids=tuple(state.token_ids),
        step_logits=tuple(state.step_logits),
        shard_timings=tuple(timings),
        prefill_ms=state.prefill_ms,
        decode_ms_median=statistics.median(state.decode_ms) if state.decode_ms else 0.0,
        wire_bytes=state.wire_bytes,
        finish_reason=state.finish_reason or "length",
        text=None if state.tokenizer is None else state.text,
    )


def load_pipeline(
    factory: Callable[[], ShardEngine],
    fixture: ModelFixture,
    ranges: Sequence[tuple[int, int]],
    *,
    wire: bool = False,
    wrap: Callable[[ShardEngine], ShardEngine] | None = None,
    **overrides: object,
) -> Pipeline:
    """New engines from ``factory`` (each passed through ``wrap``, e.g. ValidatingEngine),
    loaded with layers ``ranges`` of ``fixture`` and ``overrides`` of its LoadConfig; every
    engine already loaded is closed again if one load fails."""
    engines: list[ShardEngine] = []
    try:
        for start, end in ranges:
            config = fixture.config(start, end, **overrides)
            engine = factory()
            engines.append(wrap(engine) if wrap is not None else engine)
            engines[-1].load(config)
            _LOG.info("loaded %s layers [%d, %d)", fixture.model, start, end)
        return Pipeline(engines, wire=wire)
    except BaseException:
        for engine in engines:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - the load failure is what the caller must see
                _LOG.warning("closing an engine after a failed load raised", exc_info=True)
        raise


def _misplaced(index: int, last: int, result: object) -> MalformedOutput:
    """A shard returned the wrong kind of result for its place in the pipeline."""
    return MalformedOutput(f"shard {index} of {last + 1} returned a {type(result).__name__}")


def _log_failure(index: int, request_id: str, error: ShardEngineError) -> None:
    # Cancellations, crashes and evictions as the driver meets them; silent unless the
    # application configures the "shard_engine" loggers.
    if isinstance(error, EngineCrashed):
        _LOG.error("shard %d crashed on %s: %s", index, request_id, error.message)
    elif isinstance(error, Cancelled):
        _LOG.info("shard %d: %s was cancelled", index, request_id)
    elif isinstance(error, CacheMiss) and error.reason == "evicted":
        _LOG.info("shard %d evicted the session of %s", index, request_id)
    else:
        _LOG.debug("shard %d: %s raised %s", index, request_id, error.code)


def _describe(engine: ShardEngine) -> str:
    caps = engine.capabilities()
    return f"{caps.engine}[{caps.shard.start}:{caps.shard.end}] ({caps.role})"


def _check_session_and_tokenizer(session: SessionRef | None, tokenizer: Tokenizer | None) -> None:
    """Refuse a session that is not a SessionRef and a tokenizer without ``decode`` before
    any work (they would otherwise fail untyped mid-generation). Raises InvalidRequest."""
    if session is not None and type(session) is not SessionRef:
        raise InvalidRequest(f"session must be a SessionRef, got {type(session).__name__}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise InvalidRequest(
            f"tokenizer must have a decode(token_ids) method, got {type(tokenizer).__name__}"
        )


def _decoded(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """``tokenizer.decode(token_ids)``, which must be a str: a plugin's tokenizer that fails or
    returns something else is MalformedOutput naming it (the caller's KeyboardInterrupt and
    the like pass through)."""
    try:
        text = tokenizer.decode(token_ids)
    except Exception as error:
        raise MalformedOutput(
            f"tokenizer {type(tokenizer).__name__}.decode failed: {type(error).__name__}: {error}"
        ) from error
    if type(text) is not str:
        raise MalformedOutput(
            f"tokenizer {type(tokenizer).__name__}.decode returned a {type(text).__name__}, "
            "not a str"
        )
    return text


def _stop_set(stop_tokens: Sequence[int], sampling: Sampling) -> frozenset[int]:
    """The stop tokens as a set, once they are token ids (exactly ``int``, within int32) and
    ``sampling`` is a Sampling: ``int()`` would make 1.7 stop at 1, and a string or None fail
    untyped mid-generation. Raises InvalidRequest."""
    if type(sampling) is not Sampling:
        raise InvalidRequest(f"sampling must be a Sampling, got {type(sampling).__name__}")
    if isinstance(stop_tokens, str | bytes | bytearray | memoryview) or not isinstance(
        stop_tokens, Collection
    ):
        raise InvalidRequest(
            f"stop tokens must be a collection of token ids, got {type(stop_tokens).__name__}"
        )
    for token in stop_tokens:
        if type(token) is not int or not 0 <= token <= INT32_MAX:
            raise InvalidRequest(
                f"stop tokens must be token ids (int in [0, 2**31)), got {token!r}"
            )
    return frozenset(stop_tokens)
