"""An asyncio adapter: runs any engine's blocking calls on a thread pool, and makes task
cancellation mean what it says.

A cancelled task always ends cancelled, and never before its call has ended:

- a call still queued in the executor is withdrawn before it runs, and one a worker picks up
  after the cancellation never starts: ``CancelledError``, nothing happened;
- a running prefill, decode, batch, export or import is cancelled in the engine (by request id;
  a cancel that finds no such request yet, because the call is still on its way to the engine,
  is repeated for ~30 ms until one stops it or the call ends), and the task waits until the
  call has ended, so the caller never races a half-finished operation; then it ends with
  ``CancelledError``, whatever the call did. A call that rolled
  back (or failed with a contract error that says nothing changed) leaves no trace. A call that
  committed before the cancel reached it, or ended in an error that does not say "nothing
  changed" (OutcomeUnknown, MalformedOutput, EngineCrashed, any exception outside the taxonomy),
  is recorded: :meth:`AsyncShardEngine.take_outcome` with its request id returns the committed
  result or that error (which is also the ``CancelledError``'s ``__cause__``). Its effect is in
  the engine either way: a committed step advanced the session, so the next decode at the old
  position gets CacheMiss carrying the committed length;
- a running call that has no request id (``release``, ``load``, ``close``) cannot be stopped:
  the task waits for it, then ends with ``CancelledError``; what it did is visible in the
  engine (a released session answers a repeated release with ``released=False``).

A cancel by request id reaches whatever the engine runs under that id, so a task's
cancellation must never name another call's request: a second call with the request id of a
call still in flight through the same adapter is refused at once with InvalidRequest ("already
in flight", what the engine itself answers; it never reaches the engine), and a call that has
ended is never cancelled by id after the fact. Calls made around the adapter (other adapters or
threads on the same engine) must keep their request ids distinct from the adapter's, as the
contract asks of every caller of one engine.

This is asyncio's own rule for work that cannot be interrupted (``asyncio.shield``,
``asyncio.to_thread``): a cancellation is never swallowed. Absorbing it and returning the
result would lose it: ``asyncio.timeout()`` would let its block run on past the deadline with
no TimeoutError, ``TaskGroup`` would wait for a task it had cancelled, and ``task.cancel()``
would have no effect. So ``CancelledError`` from a call means "the call has ended; it changed
nothing unless ``take_outcome`` says what it did".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable
from types import TracebackType
from typing import ClassVar, Final, Self, TypeAlias, TypeVar, cast

from shard_engine_api._errors import (
    EngineCrashed,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    OutcomeUnknown,
    ShardEngineError,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ExportSessionRequest,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    LoadConfig,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionSnapshot,
    ShardResult,
)

__all__ = ["AsyncShardEngine", "CallOutcome"]

_T = TypeVar("_T")
_MAY_HAVE_CHANGED: Final = (OutcomeUnknown, MalformedOutput, EngineCrashed)
"""The contract errors that do not mean "the call changed nothing" (see the module docstring)."""
MAX_OUTCOMES: Final = 1024
"""How many outcomes of cancelled calls an adapter keeps for :meth:`AsyncShardEngine.take_outcome`
(the oldest is forgotten first)."""

_CANCEL_ATTEMPTS: Final = 5
_CONTROL_WORKERS: Final = 4
_CANCEL_RETRY_SECONDS: Final = 0.001


class _Withdrawn(Exception):
    """A call a worker picked up after its task was cancelled: it never started."""


CommittedResult: TypeAlias = ShardResult | DecodeBatchResult | SessionSnapshot | ImportSessionResult


@dataclasses.dataclass(frozen=True, slots=True)
class CallOutcome:
    """What a call did although its task was cancelled: it committed (``result``), or it ended
    in an error that may have changed state (``error``). Exactly one of the two is set."""

    request_id: str
    result: CommittedResult | None = None
    error: BaseException | None = None


class AsyncShardEngine:
    """Await an engine's operations (see the module docstring for cancellation).

    ``executor`` defaults to a private thread pool whose size bounds how many calls wait on the
    engine at once (the engine serialises compute). ``async with`` closes the engine on exit.
    """

    Outcome: ClassVar[type[CallOutcome]] = CallOutcome

    def __init__(
        self, engine: ShardEngine, *, executor: concurrent.futures.Executor | None = None
    ) -> None:
        """Raises InvalidRequest for an ``engine`` that is not a ShardEngine or an
        ``executor`` that is not a ``concurrent.futures.Executor``."""
        given: object = engine
        if not isinstance(given, ShardEngine):
            raise InvalidRequest(
                f"AsyncShardEngine wraps a ShardEngine, got {type(given).__name__}"
            )
        pool: object = executor
        if pool is not None and not isinstance(pool, concurrent.futures.Executor):
            raise InvalidRequest(
                f"executor must be a concurrent.futures.Executor, got {type(pool).__name__}"
            )
        self.engine = engine
        self._closed = False
        self._outcomes: collections.OrderedDict[str, CallOutcome] = collections.OrderedDict()
        self._outcomes_lock = threading.Lock()
        # Request ids of the calls in flight through this adapter (see _run).
        self._running: set[str] = set()
        self._running_lock = threading.Lock()
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix=f"shard-engine-{engine.name}"
        )
        # cancel, health and metrics never wait for compute, but an engine reached over a
        # transport answers them with a round trip: run on the event loop's thread, a stalled
        # peer would stall every task. Their own small pool keeps them off the loop and out of
        # the queue of the work they cancel.
        self._control = concurrent.futures.ThreadPoolExecutor(
            max_workers=_CONTROL_WORKERS, thread_name_prefix=f"shard-engine-{engine.name}-control"
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _run(self, call: Callable[[], _T], request_id: str | None = None) -> _T:
        if request_id is None:
            return await self._call(call, None)
        # One call per request id at a time: a cancel of this call's task cancels by id, and
        # must not stop another call that uses the same id. Every exit of _call comes after the
        # call ended or was withdrawn unstarted, so the id is free again only then.
        with self._running_lock:
            duplicate = request_id in self._running
            if not duplicate:
                self._running.add(request_id)
        if duplicate:
            raise InvalidRequest(
                f"request_id {request_id!r} is already in flight",
                details={"field": "request_id"},
            )
        try:
            return await self._call(call, request_id)
        finally:
            with self._running_lock:
                self._running.discard(request_id)

    async def _call(self, call: Callable[[], _T], request_id: str | None) -> _T:
        if request_id is not None and self._outcomes:
            # An outcome recorded for an earlier call of this id must not be taken for this
            # call's (which may change nothing).
            self.take_outcome(request_id)
        withdrawn = threading.Event()

        def guarded() -> _T:
            # A worker may pick the call up after the task was cancelled (the executor's own
            # cancel then fails): it must not start it.
            if withdrawn.is_set():
                raise _Withdrawn
            return call()

        try:
            submitted = self._executor.submit(guarded)
        except RuntimeError:  # the executor was shut down (by close(), or by its owner)
            raise NotReady(
                "the engine is closed: AsyncShardEngine.close() shut its executor down",
                retryable=False,
            ) from None
        future = asyncio.wrap_future(submitted)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError as cancelled:
            withdrawn.set()
            if submitted.cancel():
                raise  # still queued: withdrawn before it ran
            if request_id is not None:
                await self._stop(request_id, submitted, future)
            await _settled(future)
            if future.cancelled():
                raise
            error = future.exception()
            if error is None:
                # It committed before the cancel could stop it: the result stands (recorded),
                # and the cancellation is delivered all the same.
                if request_id is not None:
                    result = cast(CommittedResult, future.result())
                    self._record(CallOutcome(request_id, result=result))
                raise
            if isinstance(error, _Withdrawn) or (
                isinstance(error, ShardEngineError) and not isinstance(error, _MAY_HAVE_CHANGED)
            ):
                raise  # never started, rolled back, or refused: nothing changed
            # It may have changed something: recorded, and the cancellation's cause.
            if request_id is not None:
                self._record(CallOutcome(request_id, error=error))
            raise cancelled from error

    async def _stop(
        self,
        request_id: str,
        submitted: concurrent.futures.Future[_T],
        future: asyncio.Future[_T],
    ) -> None:
        """Cancel ``request_id`` in the engine while the call runs. A cancel that finds no
        such request may have come before the call reached the engine (a worker that just
        picked it up, a remote engine's request still on the wire): it is repeated, a few
        times over ~30 ms, until one stops the request or the call ends."""
        delay = _CANCEL_RETRY_SECONDS
        cancel = CancelRequest(request_id=request_id)
        for _ in range(_CANCEL_ATTEMPTS):
            if submitted.done():
                # Ended (committed, failed, or refused because another caller's request has
                # this id): a cancel now could only reach someone else's request.
                return
            # A failed engine ends the call by itself; a cancel that fails in any other way
            # (a third-party engine's bug) must not end the wait either: the call is still
            # running, and the caller must not race it. Nor may another cancellation of the
            # task: it is delivered once the call has ended.
            try:
                answer = await self._control_call(lambda: self.engine.cancel(cancel))
                if answer.cancelled is True:
                    return
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 (see above)
                pass
            if submitted.done():
                return
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future], timeout=delay)
            if submitted.done():
                return
            delay *= 2

    def take_outcome(self, request_id: str) -> CallOutcome | None:
        """What the call ``request_id`` did although its task was cancelled (and forget it):
        its committed result, or an error that may have changed state. None when it changed
        nothing (or is older than the last MAX_OUTCOMES recorded, or a later call reused the
        id). Thread-safe."""
        with self._outcomes_lock:
            return self._outcomes.pop(request_id, None)

    def _record(self, outcome: CallOutcome) -> None:
        with self._outcomes_lock:
            self._outcomes.pop(outcome.request_id, None)
            self._outcomes[outcome.request_id] = outcome
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.popitem(last=False)

    async def load(self, config: LoadConfig) -> Capabilities:
        """Await ShardEngine.load on the executor."""
        return await self._run(lambda: self.engine.load(config))

    async def capabilities(self) -> Capabilities:
        """Await ShardEngine.capabilities on the executor."""
        return await self._run(self.engine.capabilities)

    async def prefill(self, request: PrefillRequest) -> ShardResult:
        """Await ShardEngine.prefill; cancelling the task cancels the request (see above)."""
        return await self._run(lambda: self.engine.prefill(request), _request_id(request))

    async def decode(self, request: DecodeRequest) -> ShardResult:
        """Await ShardEngine.decode; cancelling the task cancels the request (see above)."""
        return await self._run(lambda: self.engine.decode(request), _request_id(request))

    async def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """Await ShardEngine.decode_batch; cancelling the task cancels the batch (see above)."""
        return await self._run(lambda: self.engine.decode_batch(request), _request_id(request))

    async def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """Await ShardEngine.export_session; cancelling the task cancels the export (see
        above: a snapshot taken before the cancel reached it is kept for ``take_outcome``)."""
        return await self._run(lambda: self.engine.export_session(request), _request_id(request))

    async def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """Await ShardEngine.import_session; cancelling the task cancels the import (see
        above: after ``CancelledError``, ``take_outcome`` says whether it was installed)."""
        return await self._run(lambda: self.engine.import_session(request), _request_id(request))

    async def cancel(self, request: CancelRequest) -> CancelResult:
        """Await ShardEngine.cancel on the adapter's control threads: never behind the work
        it cancels, never on the event loop's thread (a remote engine's cancel is a round
        trip)."""
        return await self._control_call(lambda: self.engine.cancel(request))

    async def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Await ShardEngine.release on the executor. A cancelled release is withdrawn if still
        queued; once running it completes, then the task ends with ``CancelledError`` (a
        repeated release says whether it ran: ``released=False``, "already released")."""
        return await self._run(lambda: self.engine.release(request))

    async def health(self) -> Health:
        """Await ShardEngine.health on the control threads (see :meth:`cancel`)."""
        return await self._control_call(self.engine.health)

    async def metrics(self) -> Metrics:
        """Await ShardEngine.metrics on the control threads (see :meth:`cancel`)."""
        return await self._control_call(self.engine.metrics)

    async def _control_call(self, call: Callable[[], _T]) -> _T:
        try:
            submitted = self._control.submit(call)
        except RuntimeError:  # closed: what is left to ask answers at once
            return call()
        return await asyncio.wrap_future(submitted)

    async def close(self) -> None:
        """Close the engine, then the private executor; a second close does nothing. Once
        closed, every awaited operation raises NotReady (``retryable=False``), as the engine's
        own do. A close withdrawn before it ran (its task cancelled while it was queued) leaves
        the engine and the executor open: ``CancelledError``, nothing changed."""
        if self._closed:
            return
        ran = False

        def close_engine() -> None:
            nonlocal ran
            ran = True
            self.engine.close()

        try:
            await self._run(close_engine)
        finally:
            if ran:
                self._closed = True
                self._control.shutdown(wait=False)
                if self._owns_executor:
                    self._executor.shutdown(wait=False)


def _request_id(request: object) -> str | None:
    """The request id to cancel by, read without trusting ``request``: anything but a request
    with a str id gives None, and the engine's own edge refuses it (InvalidRequest) when the
    call runs, instead of an AttributeError here."""
    try:
        request_id = getattr(request, "request_id", None)
    except Exception:  # noqa: BLE001 (a hostile __getattr__: the engine refuses the request)
        return None
    return request_id if type(request_id) is str else None


async def _settled(future: asyncio.Future[_T]) -> None:
    """Wait until ``future`` is done, however often the waiting task is cancelled meanwhile:
    leaving early would let the caller race an operation that is still running."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
