"""Every llama_decode of a process runs on the lowest idle compute thread, whichever thread
calls the engine: calls made one after another share one compute thread and so one libgomp
team; calls that overlap get another compute thread, which ends when idle. (With a team per
calling thread, libgomp throttles its barriers once the process holds more team threads than
CPUs: a head shard of gemma3-270m decoded 5x slower called from two alternating threads.)

The probes run in fresh processes: libgomp teams live as long as the threads that made them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from shard_engine_llama._threading import ComputeThreads

PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import shard_engine_api as api
    from shard_engine_llama import _llama_library

    MODEL = sys.argv[1]
    MODE = sys.argv[2]

    def load(name):
        engine = api.load_engine("llama")
        engine.load(api.LoadConfig(
            shard=api.ShardSpec(model=MODEL, n_layers=6, start=0, end=6),
            max_sessions=2, max_context=64, max_batch_tokens=64, n_threads=2,
            options={"self_test": False}))
        session = api.SessionRef(session_id=name, epoch=1)
        engine.prefill(api.PrefillRequest(request_id=name + "-p", session=session, start_pos=0,
            inputs=api.TokenInput(token_ids=(1, 2, 3))))
        return engine, session

    def decode(engine, session, pos):
        engine.decode(api.DecodeRequest(request_id=f"{session.session_id}-{pos}",
            session=session, pos=pos, inputs=api.TokenInput(token_ids=(4 + pos % 5,))))

    engine, session = load("a")
    for pos in range(3, 6):
        decode(engine, session, pos)
    report = {"one_caller": _llama_library.compute_threads()}
    # Four long-lived callers taking turns, as a server's threads do: eight decodes.
    turns = [threading.Semaphore(0) for _ in range(4)]
    done = threading.Semaphore(0)
    positions = iter(range(6, 14))
    def caller(index):
        while True:
            turns[index].acquire()
            pos = next(positions, None)
            if pos is None:
                return
            decode(engine, session, pos)
            done.release()
    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in callers: thread.start()
    for call in range(8):
        turns[call % 4].release()
        done.acquire()
    for turn in turns: turn.release()
    for thread in callers: thread.join()
    report["sequential"] = _llama_library.compute_threads()
    if MODE == "overlap":
        other, other_session = load("b")
        engine.capabilities()
        # A slow forward on one engine while another thread decodes on a second engine.
        barrier = threading.Barrier(2)
        def run(eng, sess, start):
            barrier.wait()
            for pos in range(start, start + 20):
                decode(eng, sess, pos)
        threads = [threading.Thread(target=run, args=(engine, session, 14)),
                   threading.Thread(target=run, args=(other, other_session, 3))]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        report["overlap"] = _llama_library.compute_threads()
        deadline = time.monotonic() + 30
        while _llama_library.compute_threads()[1] > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        report["after_idle"] = _llama_library.compute_threads()
        # Compute thread 0 still serves; another one starts on the next overlap only.
        decode(engine, session, 34)
        report["after_idle_decode"] = _llama_library.compute_threads()
    if MODE == "fork":
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child_engine, child_session = load("c")
                decode(child_engine, child_session, 3)
                code = 0 if _llama_library.compute_threads()[1:3] == (1, 1) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        report["fork_child_status"] = status
        decode(engine, session, 14)
        report["after_fork"] = _llama_library.compute_threads()
    print(json.dumps(report))
    """
)


def _probe(model: Path, mode: str, **env: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-c", PROBE, str(model), mode],
        env={**os.environ, **env},
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("native", ["1", "0"])
def test_callers_taking_turns_share_one_compute_thread(tiny_model: Path, native: str) -> None:
    """The loading thread's calls, then four threads taking turns at eight decodes (as a
    server's threads do): one compute thread ever started (native C and the Python fallback
    alike), so one libgomp team, not a team per caller. Fix: hand llama_decode to the compute
    threads in ShardRuntime."""
    report = _probe(tiny_model, "sequential", SHARD_ENGINE_LLAMA_NATIVE=native)
    mode = "native" if native == "1" else "python"
    assert report["one_caller"] == [mode, 1, 1]
    assert report["sequential"] == [mode, 1, 1]


def test_compute_threads_can_be_turned_off(tiny_model: Path) -> None:
    """SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0 runs each call on its caller's thread (for
    comparisons): no compute thread starts."""
    report = _probe(tiny_model, "sequential", SHARD_ENGINE_LLAMA_COMPUTE_THREADS="0")
    assert report["sequential"] == ["caller", 0, 0]


def test_overlapping_calls_get_a_second_compute_thread_that_ends_when_idle(
    tiny_model: Path,
) -> None:
    """Two engines decoding at the same time from two threads run at the same time (two
    compute threads); the second ends after its idle time, and compute thread 0 serves on."""
    report = _probe(tiny_model, "overlap")
    mode, alive, started = report["overlap"]
    assert mode == "native"
    assert started == 2
    assert alive in (1, 2)
    assert report["after_idle"] == ["native", 1, 2]
    assert report["after_idle_decode"] == ["native", 1, 2]


def test_a_forked_child_starts_its_own_compute_thread(tiny_model: Path) -> None:
    """After fork() the child has none of the parent's compute threads: its first decode
    starts one there (instead of waiting forever for a thread that did not fork), and the
    parent's keeps serving."""
    report = _probe(tiny_model, "fork")
    assert report["fork_child_status"] == 0
    assert report["after_fork"] == ["native", 1, 1]


def test_python_compute_threads_return_results_and_raise_errors_in_the_caller() -> None:
    threads = ComputeThreads(idle_exit_s=0.2)
    callers = {threading.get_ident()}
    ran_on: set[int] = set()

    def work(value: int) -> int:
        ran_on.add(threading.get_ident())
        return value * 2

    assert threads.run(lambda: work(21)) == 42
    results: list[int] = []
    for value in range(5):
        caller = threading.Thread(
            target=lambda v=value: results.append(threads.run(lambda: work(v)))
        )
        caller.start()
        callers.add(caller.ident or 0)
        caller.join()
    assert results == [0, 2, 4, 6, 8]
    assert len(ran_on) == 1
    assert not ran_on & callers
    assert threads.started == 1

    def fail() -> int:
        raise KeyError("from the compute thread")

    with pytest.raises(KeyError, match="from the compute thread"):
        threads.run(fail)
    # Overlapping calls: a second thread, which ends after its idle time.
    gate = threading.Event()
    first = threading.Thread(target=lambda: threads.run(gate.wait))
    first.start()
    deadline = time.monotonic() + 10
    while threads.alive() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads.run(lambda: work(1)) == 2
    gate.set()
    first.join()
    assert threads.started == 2
    deadline = time.monotonic() + 10
    while threads.alive() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads.alive() == 1
