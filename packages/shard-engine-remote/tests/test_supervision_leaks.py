"""Supervision that cannot leak (issue 28): a stopped child still ends with its worker,
``child_pid`` never raises, a child started by a thread that ended keeps serving, a child
ended by a signal is reported as ended by that signal, and ``serve`` drains on SIGHUP."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import PARENT_SCRIPT, RemoteFactory, config, decode, prefill, process_gone, wait_until

import shard_engine_api as api
from shard_engine_remote import RemoteEngine


def test_a_stopped_child_ends_with_its_worker(transport: str) -> None:
    """SIGSTOP the child, then SIGKILL its worker: the kernel resumes the child (its parent
    death signal), which sees its stdin closed, exits and removes its private directory; no
    one has to send SIGCONT."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, transport], stdout=subprocess.PIPE, text=True
    )
    pid = 0
    try:
        assert parent.stdout is not None
        pid_text, directory = parent.stdout.readline().split()
        pid = int(pid_text)
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _stat(pid) == "T", timeout=60)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    try:
        wait_until(lambda: process_gone(pid), timeout=60)
        wait_until(lambda: not Path(directory).exists(), timeout=60)
    finally:
        if pid and not process_gone(pid):
            os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_child_started_by_a_thread_that_ended_keeps_serving(transport: str) -> None:
    """The parent death signal follows the thread that started the child: a load (or a
    restart) on a pool thread that ends afterwards must not end the child."""
    engine = RemoteEngine()
    loader = threading.Thread(target=engine.load, args=(config(spawn="fake", transport=transport),))
    loader.start()
    loader.join()
    try:
        pid = engine.child_pid
        assert pid is not None
        prefill(engine)
        assert decode(engine, 3).first_pos == 3
        assert engine.child_pid == pid
        assert _stat(pid) in ("S", "R")
    finally:
        engine.close()


def test_a_child_ended_by_sigterm_is_reported_as_such(remote: RemoteFactory) -> None:
    """Someone else's SIGTERM drains the child, which then ends by that signal: the crash
    names SIGTERM, not "exited with code 0"."""
    engine = remote(config(spawn="fake"))
    prefill(engine)
    child = engine._child
    assert child is not None
    os.kill(child.pid, signal.SIGTERM)
    wait_until(lambda: child.exited, timeout=30)
    with pytest.raises(api.EngineCrashed) as caught:
        decode(engine, 3)
    assert "SIGTERM" in caught.value.message
    assert "code 0" not in caught.value.message
    assert caught.value.details["signal"] == "SIGTERM"
    assert engine.health().state == "failed"


def test_child_pid_never_raises_across_restarts(remote: RemoteFactory) -> None:
    """``child_pid`` read in a tight loop while children are killed and replaced is always an
    int or None (it used to raise AssertionError while a restart started its child), and
    None once the engine is closed."""
    engine = remote(config(spawn="fake", restart="on-crash", max_restarts=10))
    seen: list[object] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.append(engine.child_pid)
            except BaseException as error:  # noqa: BLE001 - the test reports it
                failures.append(error)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            pid = engine.child_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_until(functools.partial(process_gone, pid), timeout=30)
            with pytest.raises(api.EngineCrashed):
                prefill(engine)
            prefill(engine)  # restarted
    finally:
        done.set()
        reader.join()
    assert not failures
    assert {type(pid) for pid in seen} <= {int, type(None)}
    engine.close()
    assert engine.child_pid is None


def test_serve_drains_on_sighup(tmp_path: Path, remote: RemoteFactory) -> None:
    """A hang-up (a closed terminal, a service manager) drains like SIGTERM: serve closes
    the engine and exits 0 instead of dying mid-call."""
    listen = f"unix:{tmp_path}/engine.sock"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "shard_engine_api.cli", "serve", "--engine", "fake"),
            *("--layers", "0:3", "--listen", listen),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert "serving" in process.stdout.readline()
        engine = remote(config(0, 3, target=listen))
        prefill(engine)
        process.send_signal(signal.SIGHUP)
        assert process.wait(timeout=30) == 0
        assert "stopped" in process.stdout.read()
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
