"""How many groups of sessions ``run --sessions`` keeps in flight when every shard shares this
machine's cores (``shard_engine_api._cli.sessions.local_groups``)."""

from __future__ import annotations

import pytest

from shard_engine_api._cli.sessions import local_groups


@pytest.mark.parametrize(
    ("shards", "threads", "cores", "groups"),
    [
        (3, 0, 2, 1),  # every core per shard: one shard computes at a time
        (3, 2, 2, 1),
        (3, 1, 2, 2),  # two single-threaded shards at once on two cores
        (3, 1, 8, 3),  # never more groups than shards
        (3, 4, 16, 3),
        (3, 3, 8, 2),
        (1, 0, 64, 1),
        (4, 5, 4, 1),  # more threads than cores: still one group
    ],
)
def test_local_groups_never_oversubscribe_the_cores(
    shards: int, threads: int, cores: int, groups: int
) -> None:
    assert local_groups(shards, threads, cores) == groups
