"""The llama bench's process-per-shard configuration (benchmarks/_process_shard.py) is a
faithful ShardEngine: a pipeline of fake shards, each in its own process behind pipes and the
wire codec, gives bitwise the logits of the same shards in this process, and errors come back
typed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import shard_engine_api as api

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _process_shard  # benchmarks/ is not a package: found through the path above


def _config(start: int, end: int) -> api.LoadConfig:
    return api.LoadConfig(shard=api.ShardSpec(model="fake", n_layers=6, start=start, end=end))


def test_process_shards_match_in_process_shards_bitwise() -> None:
    """Prefill and two greedy decode steps through three process shards equal the same
    three shards loaded here; health and metrics travel too."""
    ranges = [(0, 2), (2, 4), (4, 6)]
    remote = [_process_shard.ProcessShard("fake", _config(s, e)) for s, e in ranges]
    local = [api.load_engine("fake", _config(s, e)) for s, e in ranges]
    session = api.SessionRef(session_id="s", epoch=1)
    try:
        outputs = []
        for engines in (remote, local):
            with api.Pipeline(engines) as pipeline:
                step = pipeline.step(session, 0, [1, 2, 3])
                logits = [step.logits.array().copy()]
                for pos in (3, 4):
                    token = int(np.argmax(logits[-1][-1]))
                    logits.append(pipeline.step(session, pos, [token], decode=True).logits.array())
                outputs.append(np.concatenate(logits))
                assert engines[0].health().sessions == 1
                assert engines[-1].metrics().decode_requests == 2
        assert outputs[0].tobytes() == outputs[1].tobytes()
    finally:
        for engine in remote + local:
            engine.close()


def test_process_shard_errors_arrive_typed() -> None:
    """An engine error in the child is raised in the parent as the same class and code."""
    shard = _process_shard.ProcessShard("fake", _config(0, 6))
    try:
        with pytest.raises(api.CacheMiss) as caught:
            shard.decode(
                api.DecodeRequest(
                    request_id="d",
                    session=api.SessionRef(session_id="nobody", epoch=1),
                    pos=0,
                    inputs=api.TokenInput(token_ids=(1,)),
                )
            )
        assert caught.value.code == "cache_miss"
    finally:
        shard.close()
