"""Session snapshots: how they are built, fingerprinted and verified.

One module for the checks the engine core (before an import touches any state), the codec
(when a snapshot arrives) and ``ValidatingEngine`` (what an engine exports, what a caller sends)
share, cheapest first:

1. contract version (ContractVersionMismatch);
2. the target: engine name and version, model fingerprint, layer range, boundary dtype and the
   settings fingerprint (ShardMismatch; each named in the message and ``details["field"]``);
3. the header: at least one position, ``state_bytes`` within the receiver's limit
   (ResourceExhausted, before anything is hashed);
4. integrity: the chunks add up to ``state_bytes`` (else ChecksumMismatch: truncated or
   extended) and the checksum of their concatenation is the carried one (ChecksumMismatch).

The checksum is :func:`shard_engine_api._checksum.payload_checksum`, the one every payload of the
contract uses. The settings fingerprint is a SHA-256 (hashlib) of a canonical JSON document of
everything that affects results.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

import msgspec

from shard_engine_api._checksum import chunks_checksum, payload_checksum
from shard_engine_api._errors import (
    ChecksumMismatch,
    ContractVersionMismatch,
    InvalidRequest,
    ResourceExhausted,
    ShardMismatch,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
    SNAPSHOT_CHUNK_BYTES,
    BoundaryDtype,
    Capabilities,
    SessionRef,
    SessionSnapshot,
)

__all__ = [
    "SETTINGS_SCHEME",
    "SnapshotTarget",
    "build_snapshot",
    "check_snapshot_integrity",
    "check_snapshot_target",
    "settings_fingerprint",
    "split_chunks",
    "verify_snapshot_integrity",
]

SETTINGS_SCHEME: Final = "shard-engine-settings-v1"
"""Part of every settings fingerprint: bump it when the fingerprinted document changes."""


def settings_fingerprint(
    capabilities: Capabilities,
    boundary_dtype: BoundaryDtype,
    settings: tuple[tuple[str, str], ...],
) -> str:
    """The fingerprint of everything that affects a shard's results: engine and version, model
    fingerprint, layer range, hidden and vocabulary size, boundary dtype, context limit and the
    backend's own ``settings`` (order-insensitive). 32 hex digits of SHA-256."""
    document = {
        "scheme": SETTINGS_SCHEME,
        "engine": capabilities.engine,
        "engine_version": capabilities.engine_version,
        "model_fingerprint": capabilities.model_fingerprint,
        "n_layers": capabilities.shard.n_layers,
        "start": capabilities.shard.start,
        "end": capabilities.shard.end,
        "hidden_size": capabilities.hidden_size,
        "vocab_size": capabilities.vocab_size,
        "boundary_dtype": boundary_dtype,
        "max_context": capabilities.limits.max_context,
        "settings": sorted([str(name), str(value)] for name, value in settings),
    }
    encoded = msgspec.json.encode(document, order="sorted")
    return hashlib.sha256(encoded).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class SnapshotTarget:
    """What a snapshot must say to be installed in (or to come from) one loaded engine."""

    engine: str
    engine_version: str
    model_fingerprint: str
    n_layers: int
    start: int
    end: int
    boundary_dtype: BoundaryDtype
    settings_fingerprint: str

    @classmethod
    def of(
        cls,
        capabilities: Capabilities,
        boundary_dtype: BoundaryDtype,
        settings: tuple[tuple[str, str], ...],
    ) -> SnapshotTarget:
        return cls(
            engine=capabilities.engine,
            engine_version=capabilities.engine_version,
            model_fingerprint=capabilities.model_fingerprint,
            n_layers=capabilities.shard.n_layers,
            start=capabilities.shard.start,
            end=capabilities.shard.end,
            boundary_dtype=boundary_dtype,
            settings_fingerprint=settings_fingerprint(capabilities, boundary_dtype, settings),
        )


def split_chunks(state: bytes) -> tuple[bytes, ...]:
    """``state`` cut into chunks of SNAPSHOT_CHUNK_BYTES (the last one shorter; none when
    empty)."""
    size = SNAPSHOT_CHUNK_BYTES
    if len(state) <= size:
        return (state,) if state else ()
    view = memoryview(state)
    return tuple(bytes(view[at : at + size]) for at in range(0, len(state), size))


def build_snapshot(
    target: SnapshotTarget,
    capabilities: Capabilities,
    session: SessionRef,
    length: int,
    state: bytes,
) -> SessionSnapshot:
    """The snapshot of ``state`` (positions ``0..length-1`` of ``session``) for ``target``."""
    return SessionSnapshot(
        engine=target.engine,
        engine_version=target.engine_version,
        shard=capabilities.shard,
        model_fingerprint=target.model_fingerprint,
        settings_fingerprint=target.settings_fingerprint,
        session=session,
        length=length,
        boundary_dtype=target.boundary_dtype,
        state_bytes=len(state),
        chunks=split_chunks(state),
        checksum=payload_checksum(state),
    )


def _mismatch(field: str, theirs: object, ours: object) -> ShardMismatch:
    return ShardMismatch(
        f"snapshot {field} is {theirs!r}, this engine's is {ours!r}",
        details={"field": f"SessionSnapshot.{field}"},
    )


def check_snapshot_target(snapshot: SessionSnapshot, target: SnapshotTarget) -> None:
    """Refuse a snapshot of another contract version (ContractVersionMismatch) or made for
    another engine, engine version, model, layer range, boundary dtype or settings
    (ShardMismatch). The model reference (a path) may differ: the fingerprint identifies the
    model."""
    if snapshot.contract_version != CONTRACT_VERSION:
        raise ContractVersionMismatch(
            f"snapshot speaks contract version {snapshot.contract_version}; this library "
            f"speaks {CONTRACT_VERSION}",
            details={"contract_version": snapshot.contract_version, "supported": CONTRACT_VERSION},
        )
    shard = snapshot.shard
    checks: tuple[tuple[str, object, object], ...] = (
        ("engine", snapshot.engine, target.engine),
        ("engine_version", snapshot.engine_version, target.engine_version),
        ("model_fingerprint", snapshot.model_fingerprint, target.model_fingerprint),
        ("shard.n_layers", shard.n_layers, target.n_layers),
        ("shard.start", shard.start, target.start),
        ("shard.end", shard.end, target.end),
        ("boundary_dtype", snapshot.boundary_dtype, target.boundary_dtype),
        ("settings_fingerprint", snapshot.settings_fingerprint, target.settings_fingerprint),
    )
    for field, theirs, ours in checks:
        if theirs != ours:
            raise _mismatch(field, theirs, ours)


def _check_header(snapshot: SessionSnapshot, max_state_bytes: int) -> None:
    if snapshot.length < 1:
        raise InvalidRequest(
            "a snapshot holds at least one position, got length 0",
            details={"field": "SessionSnapshot.length"},
        )
    if snapshot.state_bytes > max_state_bytes:
        raise ResourceExhausted(
            f"snapshot state of {snapshot.state_bytes} bytes exceeds the limit of "
            f"{max_state_bytes}",
            retryable=False,
            details={
                "resource": "snapshot_bytes",
                "snapshot_bytes": snapshot.state_bytes,
                "limit": max_state_bytes,
            },
        )
    total = 0
    sizes: list[int] = []
    for index, chunk in enumerate(snapshot.chunks):
        # Bytes, not items: a memoryview chunk of another format counts its items in len().
        size = memoryview(chunk).nbytes
        sizes.append(size)
        if size > SNAPSHOT_CHUNK_BYTES:
            raise InvalidRequest(
                f"snapshot chunk {index} holds {size} bytes, more than {SNAPSHOT_CHUNK_BYTES}",
                details={"field": f"SessionSnapshot.chunks[{index}]"},
            )
        total += size
    if total != snapshot.state_bytes:
        kind = "truncated" if total < snapshot.state_bytes else "extended"
        raise ChecksumMismatch(
            f"snapshot state is {kind}: its chunks hold {total} bytes, its header promises "
            f"{snapshot.state_bytes}",
            details={"received_bytes": total, "state_bytes": snapshot.state_bytes},
        )
    last = len(sizes) - 1
    for index, size in enumerate(sizes):
        # The layout transports stream: fixed-size chunks, the last one shorter, none empty.
        if size == 0 or (index < last and size != SNAPSHOT_CHUNK_BYTES):
            raise InvalidRequest(
                f"snapshot chunk {index} of {len(sizes)} holds {size} bytes; every chunk but "
                f"the last holds exactly {SNAPSHOT_CHUNK_BYTES} bytes and none is empty",
                details={"field": f"SessionSnapshot.chunks[{index}]"},
            )


def _corrupted(snapshot: SessionSnapshot) -> ChecksumMismatch:
    return ChecksumMismatch(
        "snapshot state does not match its checksum (corrupted in transit or at rest)",
        details={"state_bytes": snapshot.state_bytes},
    )


def verify_snapshot_integrity(snapshot: SessionSnapshot, *, max_state_bytes: int) -> None:
    """Check a snapshot as :func:`check_snapshot_integrity` does, hashing its chunks in place
    (no joined copy): for receivers that only pass a snapshot on (the codec, the validation
    wrapper)."""
    _check_header(snapshot, max_state_bytes)
    if chunks_checksum(snapshot.chunks) != snapshot.checksum:
        raise _corrupted(snapshot)


def check_snapshot_integrity(snapshot: SessionSnapshot, *, max_state_bytes: int) -> bytes:
    """The snapshot's state, once its header and bytes check out: at least one position,
    ``state_bytes`` within ``max_state_bytes`` (ResourceExhausted, before hashing), every
    chunk within SNAPSHOT_CHUNK_BYTES (InvalidRequest), chunks adding up to ``state_bytes``
    (ChecksumMismatch), every chunk but the last exactly SNAPSHOT_CHUNK_BYTES and none empty
    (InvalidRequest: the layout :func:`split_chunks` makes and transports stream), and the
    carried checksum (ChecksumMismatch)."""
    _check_header(snapshot, max_state_bytes)
    # A private immutable copy is hashed, so what was verified is what gets installed.
    chunks = snapshot.chunks
    state = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
    if payload_checksum(state) != snapshot.checksum:
        raise _corrupted(snapshot)
    return state
