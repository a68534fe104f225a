"""An asyncio adapter: runs any engine's blocking calls on a thread pool, and makes task
cancellation mean what it says.

Cancelling a task that awaits one of the adapter's calls:

- a call still queued in the executor is withdrawn before it runs: ``CancelledError``, nothing
  happened;
- a running prefill, decode, batch, export or import is cancelled in the engine (by request id),
  and the task waits until the call has ended, so the caller never races a half-finished operation.
  If it rolled back (or failed with a contract error, which rolls back), the task ends with
  ``CancelledError``; if it committed before the cancel reached it, **the result stands and is
  returned**: the cancellation is absorbed rather than reported as a rollback that did not
  happen. An error that does not say "nothing changed" is raised as it is, never turned into
  ``CancelledError``: OutcomeUnknown (a transport lost the request, which may have committed),
  MalformedOutput (a validating wrapper refused the result of a step that committed),
  EngineCrashed, and any exception outside the taxonomy;
- a running call that has no request id (``release``, ``load``, ``close``) cannot be stopped:
  the task waits for it and returns its result (a release that ran says so), or ends with
  ``CancelledError`` if it failed.

So ``CancelledError`` always means "this call changed nothing".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Final, Self, TypeVar

from shard_engine_api._errors import (
    EngineCrashed,
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

__all__ = ["AsyncShardEngine"]

_T = TypeVar("_T")
_MAY_HAVE_CHANGED: Final = (OutcomeUnknown, MalformedOutput, EngineCrashed)
"""The contract errors that do not mean "the call changed nothing" (see the module docstring)."""


class AsyncShardEngine:
    """Await an engine's operations (see the module docstring for cancellation).

    ``executor`` defaults to a private thread pool whose size bounds how many calls wait on the
    engine at once (the engine serialises compute). ``async with`` closes the engine on exit.
    """

    def __init__(
        self, engine: ShardEngine, *, executor: concurrent.futures.Executor | None = None
    ) -> None:
        self.engine = engine
        self._closed = False
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix=f"shard-engine-{engine.name}"
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
        try:
            submitted = self._executor.submit(call)
        except RuntimeError:  # the executor was shut down (by close(), or by its owner)
            raise NotReady(
                "the engine is closed: AsyncShardEngine.close() shut its executor down",
                retryable=False,
            ) from None
        future = asyncio.wrap_future(submitted)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if submitted.cancel():
                raise  # still queued: withdrawn before it ran
            if request_id is not None:
                # A failed engine ends the call by itself; a cancel that fails in any other way
                # (a third-party engine's bug) must not end the wait either: the call is still
                # running, and the caller must not race it.
                with contextlib.suppress(Exception):
                    self.engine.cancel(CancelRequest(request_id=request_id))
            await _settled(future)
            if future.cancelled():
                raise
            error = future.exception()
            if error is None:
                # It committed before the cancel could stop it: the result stands.
                return future.result()
            if isinstance(error, ShardEngineError) and not isinstance(error, _MAY_HAVE_CHANGED):
                raise  # rolled back, or refused: nothing changed
            # It may have changed something: CancelledError would say it did not.
            raise error from None

    async def load(self, config: LoadConfig) -> Capabilities:
        """Await ShardEngine.load on the executor."""
        return await self._run(lambda: self.engine.load(config))

    async def capabilities(self) -> Capabilities:
        """Await ShardEngine.capabilities on the executor."""
        return await self._run(self.engine.capabilities)

    async def prefill(self, request: PrefillRequest) -> ShardResult:
        """Await ShardEngine.prefill; cancelling the task cancels the request (see above)."""
        return await self._run(lambda: self.engine.prefill(request), request.request_id)

    async def decode(self, request: DecodeRequest) -> ShardResult:
        """Await ShardEngine.decode; cancelling the task cancels the request (see above)."""
        return await self._run(lambda: self.engine.decode(request), request.request_id)

    async def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """Await ShardEngine.decode_batch; cancelling the task cancels the batch (see above)."""
        return await self._run(lambda: self.engine.decode_batch(request), request.request_id)

    async def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """Await ShardEngine.export_session; cancelling the task cancels the export (see
        above: a snapshot taken before the cancel reached it is returned)."""
        return await self._run(lambda: self.engine.export_session(request), request.request_id)

    async def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """Await ShardEngine.import_session; cancelling the task cancels the import (see
        above: ``CancelledError`` means nothing was installed)."""
        return await self._run(lambda: self.engine.import_session(request), request.request_id)

    async def cancel(self, request: CancelRequest) -> CancelResult:
        """ShardEngine.cancel, called on the event loop's thread without an executor hop:
        it never waits for compute, so it cannot be stuck behind the work it cancels."""
        return self.engine.cancel(request)

    async def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Await ShardEngine.release on the executor. A cancelled release is withdrawn if still
        queued; once running it completes and its result is returned."""
        return await self._run(lambda: self.engine.release(request))

    async def health(self) -> Health:
        """ShardEngine.health, called on the event loop's thread (it never blocks)."""
        return self.engine.health()

    async def metrics(self) -> Metrics:
        """ShardEngine.metrics, called on the event loop's thread (it never blocks)."""
        return self.engine.metrics()

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
                if self._owns_executor:
                    self._executor.shutdown(wait=False)


async def _settled(future: asyncio.Future[_T]) -> None:
    """Wait until ``future`` is done, however often the waiting task is cancelled meanwhile:
    leaving early would let the caller race an operation that is still running."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
