"""Admission of a served import stream from its header, before its body is read.

An import stream's header already says what the snapshot is for (engine, version, model
fingerprint, layer range, boundary dtype), how long the session is, at which epoch it is to be
installed and how many bytes follow. :func:`check_import_header` refuses, from those alone,
every stream the engine would refuse once it had the whole body: another engine or model
(ShardMismatch), another contract (ContractVersionMismatch), a length over ``max_context`` or
over the whole KV budget (ResourceExhausted, not retryable: no retry can cure it), an epoch
older than the snapshot's (InvalidRequest), a chunk count that cannot carry the byte count
(InvalidRequest), and a byte count over what ``length`` positions of this shard can take
(ResourceExhausted). That last bound is the engine's own when it offers one
(:class:`StateBounded`: the llama engine from its KV geometry, the fake exactly), else the
server's ``max_snapshot_bytes``. What a stream may hold is therefore bounded by the largest
state the shard could legitimately hold for that length, and :class:`ImportBudget` bounds the
sum over every stream at once (``serve --max-import-bytes``).

What the header cannot show without the engine's own ledger (the session's live or fenced
epoch, a free slot, the settings fingerprint) the engine still checks when the stream is
complete.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Final, Protocol, runtime_checkable

import shard_engine_api as api
from shard_engine_api import CONTRACT_VERSION
from shard_engine_api.wire import SNAPSHOT_CHUNK_BYTES

__all__ = [
    "DEFAULT_MAX_IMPORT_BYTES",
    "ImportBudget",
    "StateBounded",
    "check_import_header",
    "return_freed_memory",
]

DEFAULT_MAX_IMPORT_BYTES: Final = 1 << 30
"""The most bytes all import streams of one server may hold at once (``--max-import-bytes``).
The engine joins a complete stream's chunks into one state before installing it, so a stream
costs about twice its bytes at its peak."""

_TRIM_AFTER_BYTES: Final = 8 << 20
"""A stream that held more than this gives the freed heap back to the system when it ends."""


@runtime_checkable
class StateBounded(Protocol):
    """An engine that can bound the size of its sessions' exported states."""

    def max_state_bytes(self, length: int) -> int:
        """The most bytes ``export_session`` of this engine gives for a session of ``length``
        positions (an upper bound; a state larger than it is not of this shard)."""
        ...


def _mismatch(field: str, theirs: object, ours: object) -> api.ShardMismatch:
    return api.ShardMismatch(
        f"snapshot {field} is {theirs!r}, this engine's is {ours!r}; nothing was read",
        details={"field": f"SessionSnapshot.{field}"},
    )


def check_import_header(
    engine: api.ShardEngine,
    request: api.ImportSessionRequest,
    n_chunks: int,
    *,
    max_snapshot_bytes: int,
) -> None:
    """Refuse an import stream whose header alone shows it cannot be installed (see the module
    docstring); return when the body may be read. Raises what the engine would raise for the
    whole snapshot: ContractVersionMismatch, ShardMismatch, UnsupportedFeature, InvalidRequest,
    ResourceExhausted (not retryable), and NotReady for an engine not serving."""
    snapshot = request.snapshot
    if snapshot.contract_version != CONTRACT_VERSION:
        raise api.ContractVersionMismatch(
            f"snapshot speaks contract version {snapshot.contract_version}; this server "
            f"speaks {CONTRACT_VERSION}",
            details={"contract_version": snapshot.contract_version, "supported": CONTRACT_VERSION},
        )
    caps = engine.capabilities()
    if not caps.features.session_migration:
        raise api.UnsupportedFeature(
            f"the served {caps.engine} engine does not support session migration "
            "(Features.session_migration is false)"
        )
    if caps.engine != "remote":  # a served remote engine names itself; its own server checks
        shard = snapshot.shard
        checks: tuple[tuple[str, object, object], ...] = (
            ("engine", snapshot.engine, caps.engine),
            ("engine_version", snapshot.engine_version, caps.engine_version),
            ("model_fingerprint", snapshot.model_fingerprint, caps.model_fingerprint),
            ("shard.n_layers", shard.n_layers, caps.shard.n_layers),
            ("shard.start", shard.start, caps.shard.start),
            ("shard.end", shard.end, caps.shard.end),
        )
        for field, theirs, ours in checks:
            if theirs != ours:
                raise _mismatch(field, theirs, ours)
        ours_dtype = caps.boundary_dtype
        if ours_dtype is not None and snapshot.boundary_dtype != ours_dtype:
            raise _mismatch("boundary_dtype", snapshot.boundary_dtype, ours_dtype)
    length = snapshot.length
    if length < 1:
        raise api.InvalidRequest(
            "a snapshot holds at least one position, got length 0",
            details={"field": "SessionSnapshot.length"},
        )
    epoch = snapshot.session.epoch if request.epoch is None else request.epoch
    if epoch < snapshot.session.epoch:
        raise api.InvalidRequest(
            f"import epoch {epoch} is older than the snapshot's epoch {snapshot.session.epoch}",
            details={"field": "ImportSessionRequest.epoch"},
        )
    limits = caps.limits
    if length > limits.max_context:
        raise api.ResourceExhausted(
            f"snapshot of {length} positions exceeds max_context {limits.max_context}; "
            "nothing was read",
            retryable=False,
            details={"resource": "context", "length": length, "limit": limits.max_context},
        )
    if length > limits.kv_budget_tokens:
        raise api.ResourceExhausted(
            f"snapshot of {length} positions exceeds the whole KV budget of "
            f"{limits.kv_budget_tokens} tokens; nothing was read",
            retryable=False,
            details={"resource": "kv_budget", "length": length, "limit": limits.kv_budget_tokens},
        )
    fewest = -(-snapshot.state_bytes // SNAPSHOT_CHUNK_BYTES)
    if not fewest <= n_chunks <= snapshot.state_bytes:
        # Fewer chunks cannot carry the bytes announced; more would leave one empty.
        raise api.InvalidRequest(
            f"the import header announces {n_chunks} chunks for {snapshot.state_bytes} bytes; "
            f"chunks of at most {SNAPSHOT_CHUNK_BYTES} bytes, none empty, make {fewest} or more "
            f"and at most {snapshot.state_bytes}",
            details={"field": "ImportHeader.n_chunks"},
        )
    limit = max_snapshot_bytes
    bound = engine.max_state_bytes(length) if isinstance(engine, StateBounded) else None
    if bound is not None:
        limit = min(limit, bound)
    if snapshot.state_bytes > limit:
        whose = (
            f"{length} positions of this shard take at most"
            if bound == limit
            else ("over this server's limit of")
        )
        raise api.ResourceExhausted(
            f"the snapshot announces {snapshot.state_bytes} bytes of state; {whose} {limit}; "
            "nothing was read",
            retryable=False,
            details={
                "resource": "snapshot_bytes",
                "snapshot_bytes": snapshot.state_bytes,
                "limit": limit,
                "length": length,
            },
        )


class ImportBudget:
    """The bytes every import stream of a server may hold at once. A stream reserves what its
    header announces before it reads any of it and gives it back when it ends."""

    def __init__(self, limit: int) -> None:
        if limit < SNAPSHOT_CHUNK_BYTES:
            raise api.InvalidRequest(
                f"max_import_bytes must be at least one chunk ({SNAPSHOT_CHUNK_BYTES}), got {limit}"
            )
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def reserve(self, n_bytes: int) -> None:
        """Hold ``n_bytes`` or refuse: ResourceExhausted, not retryable when one stream alone
        is over the limit, retryable (other streams will end) otherwise."""
        if n_bytes > self.limit:
            raise api.ResourceExhausted(
                f"the snapshot announces {n_bytes} bytes of state, over this server's import "
                f"limit of {self.limit}; nothing was read",
                retryable=False,
                details={
                    "resource": "import_bytes",
                    "snapshot_bytes": n_bytes,
                    "limit": self.limit,
                },
            )
        with self._lock:
            if self._held + n_bytes > self.limit:
                held = self._held
            else:
                self._held += n_bytes
                return
        raise api.ResourceExhausted(
            f"import streams in flight hold {held} of this server's {self.limit} bytes; "
            f"{n_bytes} more do not fit now; nothing was read; retry",
            retryable=True,
            details={"resource": "import_bytes", "retry_after_s": 1.0, "limit": self.limit},
        )

    def release(self, n_bytes: int) -> None:
        with self._lock:
            self._held -= n_bytes
        if n_bytes > _TRIM_AFTER_BYTES:
            return_freed_memory()


def _load_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM: Final = _load_trim()


def return_freed_memory() -> None:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``). A stream's chunks
    are freed when it ends, but glibc keeps freed blocks of 1 MiB in its heaps once it has
    raised its mmap threshold, so the server's memory stayed at its peak after every large
    import; trimmed, it returns to what it was."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
