"""Mutated sequence states into a llama engine, in a process of its own (an abort inside
llama.cpp would end only this process; the test checks that it exits normally).

    python state_fuzz.py MODEL_DIR CASES SEED

For each family's generated model in MODEL_DIR (``<family>.gguf``), for a full shard and a
middle shard, a state is exported at two lengths and mutated CASES times: bytes flipped
(mostly in the header and cell records, where llama.cpp reads sizes and positions), 32-bit
fields set to boundary values, truncated, extended, replaced by another length's state, or
replaced by a state of other settings or another layer range (KV type f16, flash attention, a
longer context, a neighbouring range) under this engine's identity prefix: a peer that knows
the prefix (a digest of public facts) and sends llama.cpp bytes of another layout.
Each goes to ``import_session`` in a snapshot whose header and checksum are right (a lying
peer); an accepted one is decoded one step further and released.
Every outcome must be a ShardEngineError or success. Prints one JSON object of counts.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from migration_support import export_snapshot, forged, import_snapshot

from shard_engine_api import (
    BoundaryBundle,
    DecodeRequest,
    LoadConfig,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardEngineError,
    ShardInput,
    ShardSpec,
    TokenInput,
)
from shard_engine_llama import LlamaEngine

N_LAYERS = 6
INTERESTING = (0, 1, 2, 7, 0xFF, 0x100, 0x101, 0x200, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


# Other settings (and ranges) whose states a target of (start, end) must refuse or read safely.
FOREIGN: tuple[tuple[dict[str, object], int], ...] = (
    ({"kv_type": "f16"}, 0),
    ({"flash_attn": True}, 0),
    ({"max_context": 512}, 0),
    ({}, 1),  # the range shifted by one layer (shortened at the top for a full shard)
)


def _load(model: Path, start: int, end: int, **settings: object) -> LlamaEngine:
    engine = LlamaEngine()
    max_context = settings.pop("max_context", 256)
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=end),
            max_sessions=3,
            max_context=max_context,  # type: ignore[arg-type]
            options={"n_ubatch": 4, "model_store": str(model.parent / "store"), **settings},
        )
    )
    return engine


def _foreign_states(model: Path, start: int, end: int, length: int) -> list[bytes]:
    """States of ``length`` positions from engines of other settings or ranges, without their
    identity prefix."""
    states = []
    for settings, shift in FOREIGN:
        first, last = (start + shift, min(end + shift, N_LAYERS)) if start else (start, end - shift)
        engine = _load(model, first, last, **settings)
        try:
            session = SessionRef(session_id="foreign", epoch=1)
            _prefill(engine, session, length)
            states.append(
                b"".join(export_snapshot(engine, session).chunks)[len(engine._state_identity) :]
            )
        finally:
            engine.close()
    return states


def _inputs(engine: LlamaEngine, session: SessionRef, start: int, n: int) -> ShardInput:
    caps = engine.capabilities()
    if caps.role in ("head", "full"):
        return TokenInput(token_ids=tuple((start + index) * 13 % 250 for index in range(n)))
    rows = np.random.default_rng(start).standard_normal((n, caps.hidden_size)).astype(np.float32)
    return BoundaryBundle.from_array(
        rows,
        session=session,
        first_pos=start,
        layer=caps.shard.start,
        model_fingerprint=caps.model_fingerprint,
    )


def _prefill(engine: LlamaEngine, session: SessionRef, n: int) -> None:
    engine.prefill(
        PrefillRequest(
            request_id=f"p-{session.session_id}",
            session=session,
            start_pos=0,
            inputs=_inputs(engine, session, 0, n),
        )
    )


def _mutate(
    state: bytes,
    identity: int,
    header_bytes: int,
    other: bytes,
    foreign: list[bytes],
    rng: random.Random,
) -> tuple[str, bytes]:
    data = bytearray(state)
    kind = rng.choice(("flip", "flip", "field", "field", "truncate", "extend", "other", "foreign"))
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            limit = header_bytes if rng.random() < 0.8 else len(data)
            data[rng.randrange(limit)] ^= 1 << rng.randrange(8)
    elif kind == "field":
        offset = rng.randrange(0, header_bytes - 4) & ~3
        struct.pack_into("<I", data, offset, rng.choice(INTERESTING))
    elif kind == "truncate":
        del data[rng.randrange(len(data)) :]
    elif kind == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "other":
        data = bytearray(other)
    else:
        # The target's own identity prefix, another layout's state behind it.
        data = bytearray(state[:identity] + rng.choice(foreign))
    return kind, bytes(data)


def fuzz(model_dir: Path, cases: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts: dict[str, int] = {"cases": 0, "accepted": 0, "refused": 0}
    for model in sorted(model_dir.glob("*.gguf")):
        for start, end in ((0, N_LAYERS), (2, 4)):
            source, target = _load(model, start, end), _load(model, start, end)
            try:
                snapshots = []
                foreign = [_foreign_states(model, start, end, length) for length in (1, 21)]
                for length in (1, 21):
                    session = SessionRef(session_id=f"s{length}", epoch=1)
                    _prefill(source, session, length)
                    snapshots.append(export_snapshot(source, session))
                identity = len(target._state_identity)
                for case in range(cases):
                    session = SessionRef(session_id=f"case-{case}", epoch=1)
                    template = msgspec.structs.replace(snapshots[case % 2], session=session)
                    state, length = b"".join(template.chunks), template.length
                    other = b"".join(snapshots[1 - case % 2].chunks)
                    header = min(len(state), identity + 64 + 12 * length)
                    kind, mutated = _mutate(state, identity, header, other, foreign[case % 2], rng)
                    counts["cases"] += 1
                    counts[f"kind_{kind}"] = counts.get(f"kind_{kind}", 0) + 1
                    try:
                        import_snapshot(target, forged(template, mutated))
                    except ShardEngineError as error:
                        counts["refused"] += 1
                        key = f"refused_{error.code}"
                        counts[key] = counts.get(key, 0) + 1
                        continue
                    counts["accepted"] += 1
                    counts[f"accepted_{kind}"] = counts.get(f"accepted_{kind}", 0) + 1
                    try:
                        target.decode(
                            DecodeRequest(
                                request_id=f"d-{case}",
                                session=session,
                                pos=length,
                                inputs=_inputs(target, session, length, 1),
                            )
                        )
                    except ShardEngineError as error:
                        key = f"accepted_then_{error.code}"
                        counts[key] = counts.get(key, 0) + 1
                    target.release(ReleaseRequest(session=session))
                # The engine serves on: a fresh session on it works.
                _prefill(target, SessionRef(session_id="after", epoch=1), 3)
                assert target.health().state in ("ready", "degraded"), target.health()
            finally:
                source.close()
                target.close()
    return counts


if __name__ == "__main__":
    print(json.dumps(fuzz(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])), sort_keys=True))
