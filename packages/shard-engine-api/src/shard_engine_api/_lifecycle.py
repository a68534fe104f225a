"""The lifecycle state machine of an engine: unloaded -> loading -> ready/degraded -> closed,
with failed reachable from anywhere but closed. Pure: the core holds it under its state lock
and asks it whether an operation may run."""

from __future__ import annotations

from shard_engine_api._errors import EngineCrashed, InvalidRequest, NotReady
from shard_engine_api._types import LifecycleState

__all__ = ["Lifecycle"]


class Lifecycle:
    """The state, its human-readable detail, and the reasons the engine is degraded."""

    def __init__(self, engine_name: str) -> None:
        self.engine_name = engine_name
        self.state: LifecycleState = "unloaded"
        self.detail = "not loaded"
        self._degraded: dict[str, str] = {}

    def require_serving(self) -> None:
        """Raise unless requests may run: EngineCrashed after a failure; NotReady otherwise
        (retryable only while loading: a never-loaded engine needs ``load()`` first)."""
        state = self.state
        if state in ("ready", "degraded"):
            return
        self.require_alive()
        if state == "unloaded":
            raise NotReady(
                f"{self.engine_name} engine is not loaded; call load() first", retryable=False
            )
        raise NotReady(f"{self.engine_name} engine is {state}", retryable=state == "loading")

    def require_alive(self) -> None:
        """Raise EngineCrashed after a failure."""
        if self.state == "failed":
            raise EngineCrashed(f"{self.engine_name} engine has failed: {self.detail}")

    def begin_load(self) -> None:
        self.require_alive()
        if self.state != "unloaded":
            raise InvalidRequest(f"engine is {self.state}; load() is called once per engine")
        self.state, self.detail = "loading", "loading"

    def load_failed(self) -> None:
        if self.state == "loading":
            self.state, self.detail = "unloaded", "not loaded (last load failed)"

    def loaded(self) -> None:
        if self.state == "loading":
            self.state = "degraded" if self._degraded else "ready"
            self.detail = "; ".join(self._degraded.values())

    def degrade(self, key: str, detail: str) -> None:
        """Still serving, but degraded for ``key`` until :meth:`recover`."""
        self._degraded[key] = detail
        if self.state == "ready":
            self.state = "degraded"
        self.detail = "; ".join(self._degraded.values())

    def recover(self, key: str) -> None:
        self._degraded.pop(key, None)
        if self.state == "degraded" and not self._degraded:
            self.state, self.detail = "ready", ""
        elif self._degraded:
            self.detail = "; ".join(self._degraded.values())

    def fail(self, detail: str) -> bool:
        """Enter the failed state; True if this call did. The first failure's detail is kept."""
        if self.state in ("closed", "failed"):
            return False
        self.state, self.detail = "failed", detail
        return True

    def close(self) -> None:
        self.state, self.detail = "closed", "closed"
