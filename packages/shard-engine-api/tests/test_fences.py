"""Fences are keyed with a secret of their table: no session id can be computed to share
another's fence (issue 28, "fences can be aimed")."""

from __future__ import annotations

import hashlib

from shard_engine_api._fences import BYTES_PER_FENCE, FenceTable

_MAX_EPOCH = (1 << 63) - 1


def _unkeyed(session_id: str) -> int:
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def test_keys_are_secret_per_table() -> None:
    """Two tables (as two processes) hash one id differently, and neither as the unkeyed
    BLAKE2b an outsider could compute: a collision found offline collides in no table."""
    first, second = FenceTable(), FenceTable()
    ids = [f"session-{n}" for n in range(64)]
    assert [first._key(i) for i in ids] != [second._key(i) for i in ids]
    assert all(first._key(i) != _unkeyed(i) for i in ids)
    # Stable within a table: the same id always finds its own fence.
    assert [first._key(i) for i in ids] == [first._key(i) for i in ids]


def test_fences_hold_across_merges_and_generations() -> None:
    """The keyed table keeps every guarantee: the newest fence per id, through merges, and at
    least ``generation_size`` most recent fences, each in BYTES_PER_FENCE bytes."""
    table = FenceTable(generation_size=5000)
    for n in range(6000):
        table.put(f"s{n}", n + 1, released=n % 2 == 0)
    table.put("s5999", 3, released=False)  # an older fence never replaces a newer
    for n in range(1000, 6000):
        fence = table.get(f"s{n}")
        assert fence is not None
        assert (fence.epoch, fence.released) == (n + 1, n % 2 == 0)
    assert table.nbytes <= BYTES_PER_FENCE * 2 * 5000


def test_a_released_id_at_the_largest_epoch_fences_only_itself() -> None:
    """A caller releasing many ids of its choosing at the largest epoch fences nobody else:
    other sessions' ids (a predictable sequence among them) stay unfenced."""
    table = FenceTable(generation_size=1 << 16)
    for n in range(20_000):
        table.put(f"attacker-{n}", _MAX_EPOCH, released=True)
    assert all(table.get(f"victim-{n}") is None for n in range(20_000))
    assert table.get("attacker-7") is not None
