"""An asyncio adapter: runs any engine's blocking calls off the event loop, and turns task
cancellation into an engine cancel so the session is rolled back before the task ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import TypeVar

from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Health,
    LoadConfig,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ShardResult,
)

__all__ = ["AsyncShardEngine"]

_T = TypeVar("_T")


class AsyncShardEngine:
    """Await an engine's operations. ``executor`` defaults to a private thread pool whose
    size bounds how many calls wait on the engine at once (the engine serialises compute)."""

    def __init__(
        self, engine: ShardEngine, *, executor: concurrent.futures.Executor | None = None
    ) -> None:
        self.engine = engine
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix=f"shard-engine-{engine.name}"
        )

    async def _run(self, call: Callable[[], _T], request_id: str | None = None) -> _T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if request_id is not None:
                self.engine.cancel(CancelRequest(request_id=request_id))
                # Wait for the engine to stop and roll back, so the caller never races a
                # half-finished operation on the same session.
                with contextlib.suppress(BaseException):
                    await future
            raise

    async def load(self, config: LoadConfig) -> Capabilities:
        """See ShardEngine.load."""
        return await self._run(lambda: self.engine.load(config))

    async def capabilities(self) -> Capabilities:
        """See ShardEngine.capabilities."""
        return await self._run(self.engine.capabilities)

    async def prefill(self, request: PrefillRequest) -> ShardResult:
        """See ShardEngine.prefill; cancelling the awaiting task cancels the request."""
        return await self._run(lambda: self.engine.prefill(request), request.request_id)

    async def decode(self, request: DecodeRequest) -> ShardResult:
        """See ShardEngine.decode; cancelling the awaiting task cancels the request."""
        return await self._run(lambda: self.engine.decode(request), request.request_id)

    async def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """See ShardEngine.decode_batch; cancelling the awaiting task cancels the batch."""
        return await self._run(lambda: self.engine.decode_batch(request), request.request_id)

    async def cancel(self, request: CancelRequest) -> CancelResult:
        """See ShardEngine.cancel (runs inline: it never blocks)."""
        return self.engine.cancel(request)

    async def release(self, request: ReleaseRequest) -> ReleaseResult:
        """See ShardEngine.release."""
        return await self._run(lambda: self.engine.release(request))

    async def health(self) -> Health:
        """See ShardEngine.health (runs inline: it never blocks)."""
        return self.engine.health()

    async def metrics(self) -> Metrics:
        """See ShardEngine.metrics (runs inline: it never blocks)."""
        return self.engine.metrics()

    async def close(self) -> None:
        """Close the engine and the private executor."""
        await self._run(self.engine.close)
        if self._owns_executor:
            self._executor.shutdown(wait=False)
