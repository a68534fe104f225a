"""Threads against one fake engine: several threads making their first requests at once in a
fresh process (a new worker: no request checker compiled yet) get exactly what one thread gets
serially, with no stray exception from shared state built on first use."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Final

import msgspec
import pytest

import shard_engine_api as api
from shard_engine_fake import FakeEngine

THREADS: Final = 4
STEPS: Final = 12
PROMPT: Final = (3, 1, 4, 1, 5)


def _load(*, wrapped: bool) -> api.ShardEngine:
    engine: api.ShardEngine = api.ValidatingEngine(FakeEngine()) if wrapped else FakeEngine()
    engine.load(
        api.LoadConfig(
            shard=api.ShardSpec(model="fake", n_layers=6, start=0, end=6), max_sessions=THREADS
        )
    )
    return engine


def _generate(engine: api.ShardEngine, index: int) -> list[bytes]:
    """A prompt then greedy decode steps on session ``index``; every logits payload."""
    ref = api.SessionRef(session_id=f"s{index}", epoch=1)
    tokens = (*PROMPT, index)
    result = engine.prefill(
        api.PrefillRequest(
            request_id=f"p{index}",
            session=ref,
            start_pos=0,
            inputs=api.TokenInput(token_ids=tokens),
        )
    )
    outputs: list[bytes] = []
    pos = len(tokens)
    for step in range(STEPS):
        assert isinstance(result, api.LogitsResult)
        outputs.append(bytes(result.payload))
        token = int(result.array()[-1].argmax())
        result = engine.decode(
            api.DecodeRequest(
                request_id=f"d{index}-{step}",
                session=ref,
                pos=pos,
                inputs=api.TokenInput(token_ids=(token,)),
            )
        )
        pos += 1
    return outputs


def run_threads_first(wrapped: bool) -> None:
    """In a process of its own: every thread's first request at once, with compiling slowed so
    that each arrives while another thread is still compiling; prints what happened as JSON."""
    type_info = msgspec.inspect.type_info

    def slow_type_info(cls: object) -> msgspec.inspect.Type:
        time.sleep(0.002)
        return type_info(cls)

    patch = pytest.MonkeyPatch()
    patch.setattr(msgspec.inspect, "type_info", slow_type_info)
    engine = _load(wrapped=wrapped)
    barrier = threading.Barrier(THREADS)
    outputs: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            outputs[index] = _generate(engine, index)
        except BaseException as error:  # noqa: BLE001 (collected and reported)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    metrics = engine.metrics()
    engine.close()
    report = {
        "errors": [repr(error) for error in errors],
        "outputs": [
            [output.hex() for output in outputs.get(index, [])] for index in range(THREADS)
        ],
        "metric_errors": dict(metrics.errors),
        "decode_tokens": metrics.decode_tokens,
    }
    print(json.dumps(report))


@pytest.mark.parametrize("wrapped", [False, True], ids=["core", "validating"])
def test_first_requests_from_many_threads_match_serial(wrapped: bool) -> None:
    serial_engine = _load(wrapped=wrapped)
    serial = [
        [output.hex() for output in _generate(serial_engine, index)] for index in range(THREADS)
    ]
    serial_engine.close()
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from {Path(__file__).stem} import run_threads_first; run_threads_first({wrapped!r})"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert report["errors"] == []
    assert report["outputs"] == serial
    assert report["metric_errors"] == {}
    assert report["decode_tokens"] == THREADS * STEPS
