"""What a server sends besides the engine's replies is bounded too: its counters decode only as
non-negative 64-bit integers and a bounded threading map, the map it builds always fits, and
the caller id a client sends costs the server a bounded key however long it is."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import pytest

import shard_engine_api as api
from shard_engine_remote._callers import CALLER_METADATA_KEY, caller_key
from shard_engine_remote._counters import ServerCounters
from shard_engine_remote._wire import (
    MAX_ENV_VALUE_CHARS,
    MAX_THREADING_ENTRIES,
    Rejected,
    ServerStats,
    decode_reply,
    encode_reply,
)


def _stats(**fields: object) -> bytes:
    return msgspec.msgpack.encode({"type": "server_stats", **fields})


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"calls": -1}, id="negative count"),
        pytest.param({"in_flight": 2**63}, id="count beyond int64"),
        pytest.param({"threading": {"X": "v" * (MAX_ENV_VALUE_CHARS + 1)}}, id="long value"),
        pytest.param({"threading": {"X" * 257: "1"}}, id="long name"),
        pytest.param(
            {"threading": {f"V{i}": "1" for i in range(MAX_THREADING_ENTRIES + 1)}},
            id="many entries",
        ),
    ],
)
def test_a_servers_stats_beyond_their_bounds_are_malformed(fields: dict[str, object]) -> None:
    """A server answering the stats query with a negative or beyond-64-bit count or an
    endless threading map: the client gets MalformedOutput, not the object."""
    reply = decode_reply(_stats(**fields))
    assert isinstance(reply, Rejected)
    assert isinstance(reply.error, api.MalformedOutput)


def test_the_servers_own_stats_fit_their_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment value longer than the wire carries is cut, so the stats still decode."""
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0 " * 50_000)
    stats = ServerCounters().stats()
    assert len(stats.threading["GOMP_CPU_AFFINITY"]) == MAX_ENV_VALUE_CHARS
    back = decode_reply(encode_reply(stats))
    assert isinstance(back, ServerStats)
    assert back == stats


class _Context:
    def __init__(self, caller: str) -> None:
        self._caller = caller

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True

    def peer(self) -> str:
        return "unix:"

    def peer_identities(self) -> Iterable[bytes] | None:
        return None

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None:
        return ((CALLER_METADATA_KEY, self._caller),)


def test_a_long_caller_id_costs_a_bounded_key() -> None:
    """The server keeps each in-flight call's caller id: one of any length is kept as a
    digest, still telling callers apart; an ordinary one is kept as sent."""
    ordinary = "ab" * 16
    assert caller_key(_Context(ordinary)) == f"unix:/{ordinary}"
    long_a, long_b = "a" * 1_000_000, "a" * 999_999 + "b"
    key_a, key_b = caller_key(_Context(long_a)), caller_key(_Context(long_b))
    assert len(key_a) <= 128
    assert len(key_b) <= 128
    assert key_a != key_b
    assert key_a == caller_key(_Context(long_a))
