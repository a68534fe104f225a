"""What a supervised child leaves behind: nothing. After close, after crashes and restarts,
and after the supervising process itself is killed, no child process (nor zombie), no
descriptor and no private directory (socket, stderr log) remains."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    PARENT_SCRIPT,
    Background,
    RemoteFactory,
    config,
    decode,
    prefill,
    process_gone,
    wait_until,
)

import shard_engine_api as api
from shard_engine_remote import RemoteEngine


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _directory(engine: RemoteEngine) -> Path:
    child = engine._child
    assert child is not None
    return child.directory


def test_a_child_outliving_its_supervisor_exits_and_removes_its_directory(
    transport: str,
) -> None:
    """SIGKILL the supervising process: its child sees its stdin close, drains, exits and
    removes its private directory (socket and stderr log) itself."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, transport], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pid_text, directory = parent.stdout.readline().split()
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    pid = int(pid_text)
    wait_until(lambda: process_gone(pid), timeout=30)
    wait_until(lambda: not Path(directory).exists(), timeout=10)


def test_close_crashes_and_restarts_leave_nothing(remote: RemoteFactory, transport: str) -> None:
    """Load, crash (SIGKILL, SIGSEGV, SIGABRT) and restart, then close: every child is reaped,
    every private directory removed, and this process holds the descriptors it held before
    (one warm-up engine first: grpc opens its own for good on first use)."""
    warm = RemoteEngine()
    warm.load(config(spawn="fake", transport=transport))
    warm.close()
    before = _descriptors()
    engine = RemoteEngine()
    engine.load(config(spawn="fake", transport=transport, restart="on-crash", max_restarts=3))
    pids: list[int] = []
    directories: list[Path] = []
    try:
        for sig in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT):
            prefill(engine)
            pid = engine.child_pid
            assert pid is not None
            pids.append(pid)
            directories.append(_directory(engine))
            os.kill(pid, sig)
            # A core-dumping signal stops one thread first: let it end the process before
            # the next call, which another thread could otherwise still serve.
            wait_until(functools.partial(process_gone, pid))
            with pytest.raises(api.EngineCrashed, match=signal.Signals(sig).name):
                decode(engine, 3)
        prefill(engine)
        assert engine.restarts == 3
        pid = engine.child_pid
        assert pid is not None
        pids.append(pid)
        directories.append(_directory(engine))
    finally:
        engine.close()
    assert all(process_gone(pid) for pid in pids)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # no child of this process is left, zombie or not
    assert not any(directory.exists() for directory in directories)
    wait_until(lambda: _descriptors() <= before)


def test_closing_a_stopped_child_does_not_wait_out_the_grace(transport: str) -> None:
    """close() of a SIGSTOP'd child resumes it with its SIGTERM, so it drains and exits at
    once instead of being killed when the 5 s grace runs out; nothing is left behind."""
    engine = RemoteEngine()
    engine.load(config(spawn="fake", transport=transport, timeout_s=0.5, control_timeout_s=0.5))
    prefill(engine)
    pid = engine.child_pid
    assert pid is not None
    directory = _directory(engine)
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 4.0, "the child was killed at the end of its grace"
    assert process_gone(pid)
    assert not directory.exists()


def _started_child(engine: RemoteEngine, other_than: int | None = None) -> int:
    """The pid of the child ``engine`` is starting (not ``other_than``), once it exists."""
    found: list[int] = []

    def started() -> bool:
        child = engine._child
        process = None if child is None else child._process
        if process is not None and process.pid != other_than:
            found.append(process.pid)
        return bool(found)

    wait_until(started, timeout=30)
    return found[0]


def test_close_ends_a_load_whose_child_stopped_starting(transport: str) -> None:
    """close() from another thread while load waits for a child that was SIGSTOP'd during
    start-up returns at once (it does not wait out the two-minute start-up timeout): the load
    ends with NotReady, and no child or directory is left."""
    engine = RemoteEngine()
    loading = Background(
        lambda: engine.load(config(spawn="fake", transport=transport, startup_timeout_s=120))
    )
    pid = _started_child(engine)
    directory = engine._child.directory if engine._child is not None else None
    os.kill(pid, signal.SIGSTOP)
    closing = Background(engine.close)
    closing.result(timeout=30)
    with pytest.raises(api.NotReady, match="closed"):
        loading.result(timeout=30)
    assert engine.health().state == "closed"
    wait_until(lambda: process_gone(pid))
    assert directory is not None
    assert not directory.exists()


def test_close_ends_a_restart_whose_child_stopped_starting(transport: str) -> None:
    """The same for the fresh child a restart is starting: the call that triggered the restart
    gets NotReady (closed), not a crash, and close returns at once."""
    engine = RemoteEngine()
    engine.load(
        config(spawn="fake", transport=transport, restart="on-crash", startup_timeout_s=120)
    )
    try:
        prefill(engine)
        first = engine.child_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_until(functools.partial(process_gone, first))
        with pytest.raises(api.EngineCrashed, match="SIGKILL"):
            decode(engine, 3)
        restarting = Background(lambda: prefill(engine))
        pid = _started_child(engine, other_than=first)
        os.kill(pid, signal.SIGSTOP)
        Background(engine.close).result(timeout=30)
        with pytest.raises(api.NotReady, match="closed"):
            restarting.result(timeout=30)
        wait_until(lambda: process_gone(pid))
    finally:
        engine.close()


def test_a_terminal_interrupt_does_not_reach_the_child(remote: RemoteFactory) -> None:
    """A terminal's Ctrl-C sends SIGINT to every process of the foreground process group: the
    child is not in the worker's, so it serves on until the worker itself decides."""
    engine = remote(config(spawn="fake"))
    prefill(engine)
    pid = engine.child_pid
    assert pid is not None
    assert os.getpgid(pid) != os.getpgid(0)
    assert decode(engine, 3).first_pos == 3


def test_a_burst_of_sigterms_ends_the_child_at_once(transport: str) -> None:
    """SIGTERM upon SIGTERM (a supervisor asks, then stops; an operator repeats a kill) runs
    the child's handler inside itself: it must take no lock, or the child hangs until the
    supervisor's grace runs out and kills it."""
    for _ in range(5):
        engine = RemoteEngine()
        engine.load(config(spawn="fake", transport=transport))
        prefill(engine)
        child = engine._child
        assert child is not None
        assert child._process is not None
        process = child._process
        for _ in range(300):
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        try:
            # Drained, then ended by the signal it was sent (so a crash report names it).
            assert process.wait(4.0) == -signal.SIGTERM, "the child did not drain and exit"
        finally:
            engine.close()
