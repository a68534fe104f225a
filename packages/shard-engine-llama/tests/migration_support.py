"""Moving a session between two llama engines at the backend-hook level: the source's
``_export_state`` and the target's ``_import_state``, with the target's ledger told the
session's length as an import does."""

from __future__ import annotations

from shard_engine_api import SessionRef
from shard_engine_api._ledger import SessionEntry
from shard_engine_llama import LlamaEngine


def export_state(engine: LlamaEngine, session: SessionRef) -> tuple[bytes, int]:
    """The session's state and committed length."""
    entry = engine._ledger.sessions[session.session_id]
    return engine._export_state(entry.slot, entry.length), entry.length


def import_into(engine: LlamaEngine, session: SessionRef, state: bytes, length: int) -> int:
    """Install ``state`` into a free slot of ``engine`` (the one the ledger would give a new
    session) and enter the session in the ledger; returns the slot. A failure leaves the slot
    empty and the ledger without the session."""
    ledger = engine._ledger
    slot = ledger._free_slots[-1] if ledger._free_slots else ledger._next_slot
    try:
        engine._import_state(slot, length, state)
    except BaseException:
        engine._drop(slot)
        raise
    if slot == ledger._next_slot:
        ledger._next_slot += 1
    else:
        ledger._free_slots.remove(slot)
    ledger._tick += 1
    ledger.kv_used += length
    ledger.sessions[session.session_id] = SessionEntry(
        session_id=session.session_id,
        epoch=session.epoch,
        slot=slot,
        length=length,
        last_used=ledger._tick,
    )
    return slot


def move_session(source: LlamaEngine, target: LlamaEngine, session: SessionRef) -> int:
    """Export ``session`` from ``source`` and import it into ``target``; returns the slot."""
    state, length = export_state(source, session)
    return import_into(target, session, state, length)
