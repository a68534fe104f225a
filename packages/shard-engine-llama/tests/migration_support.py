"""Moving sessions between llama engines through the contract (``export_session``, the wire
codec, ``import_session``), and snapshots a hostile peer could send: a well-formed header and
checksum around state bytes of its choosing."""

from __future__ import annotations

import msgspec

from shard_engine_api import (
    ExportSessionRequest,
    ImportSessionRequest,
    SessionRef,
    SessionSnapshot,
)
from shard_engine_api.wire import Codec, payload_checksum, split_chunks
from shard_engine_llama import LlamaEngine


def export_snapshot(engine: LlamaEngine, session: SessionRef) -> SessionSnapshot:
    return engine.export_session(
        ExportSessionRequest(request_id=f"export-{session.session_id}", session=session)
    )


def export_state(engine: LlamaEngine, session: SessionRef) -> tuple[bytes, int]:
    """The session's opaque state (the snapshot's chunks joined) and committed length."""
    snapshot = export_snapshot(engine, session)
    return b"".join(snapshot.chunks), snapshot.length


def over_the_wire(snapshot: SessionSnapshot, target: LlamaEngine) -> SessionSnapshot:
    """``snapshot`` encoded and decoded by the wire codec (integrity checked on decode)."""
    caps = target.capabilities()
    codec = Codec(expected_fingerprint=caps.model_fingerprint, expected_layer=caps.shard.start)
    received = codec.decode_message(codec.encode(snapshot))
    assert isinstance(received, SessionSnapshot)
    return received


def import_snapshot(engine: LlamaEngine, snapshot: SessionSnapshot) -> int:
    """Import ``snapshot``; returns the slot it went to."""
    engine.import_session(
        ImportSessionRequest(request_id=f"import-{snapshot.session.session_id}", snapshot=snapshot)
    )
    return engine._ledger.sessions[snapshot.session.session_id].slot


def forged(template: SessionSnapshot, state: bytes, length: int | None = None) -> SessionSnapshot:
    """``template``'s header around ``state``, with a checksum that matches: what a peer that
    lies about the state (or its header) can send."""
    return msgspec.structs.replace(
        template,
        chunks=split_chunks(state),
        state_bytes=len(state),
        checksum=payload_checksum(state),
        length=template.length if length is None else length,
    )


def move_session(source: LlamaEngine, target: LlamaEngine, session: SessionRef) -> int:
    """Export ``session`` from ``source``, carry it through the wire codec and import it into
    ``target``; returns the target's slot."""
    return import_snapshot(target, over_the_wire(export_snapshot(source, session), target))
