"""Children that write where no one reads: an engine printing to stdout once the child is
serving, a child whose first line never ends, and a child flooding its stderr. None hangs a
call nor grows the supervising process's memory or its disk use."""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import RemoteFactory, config, decode, prefill, wait_until

import shard_engine_api as api
from shard_engine_remote._supervisor import STDERR_LOG_MAX_BYTES, ChildProcess, _StderrLog

_CHATTY = """
import runpy, sys
from shard_engine_fake._engine import FakeEngine

served = FakeEngine.decode

def decode(self, request):
    # Far more than a pipe holds, every call.
    sys.stdout.write("x" * 300_000 + "\\n")
    sys.stdout.flush()
    return served(self, request)

FakeEngine.decode = decode
sys.argv[0] = "shard_engine_remote._child"
runpy.run_module("shard_engine_remote._child", run_name="__main__")
"""

_ENDLESS = """
import os, sys, time
while True:
    os.write(1, b"y" * (1 << 20))
"""


_FLOODING = """
import os, sys
print("ready unix:/nowhere", flush=True)
chunk = b"ggml_debug: a line of noise nobody reads\\n" * (1 << 15)
written = 0
while written < (100 << 20):
    written += os.write(2, chunk)
os.write(2, b"llama.cpp:123: GGML_ASSERT(n_tokens <= n_batch) failed\\n")
os.abort()
"""


def _interpreter(tmp_path: Path, code: str) -> str:
    """An executable standing in for Python (``python`` option): it runs ``code`` with the
    child's arguments, whatever module it is asked to run."""
    script = tmp_path / "code.py"
    script.write_text(code)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def test_an_engine_writing_to_stdout_does_not_hang_its_calls(
    remote: RemoteFactory, tmp_path: Path, transport: str
) -> None:
    """The child's stdout is a pipe its supervisor reads only for the ``ready`` line: an
    engine printing more than a pipe holds once serving would block there for good (its
    calls past their deadline). What it prints is discarded instead."""
    engine = remote(
        config(
            spawn="fake",
            transport=transport,
            python=_interpreter(tmp_path, _CHATTY),
            timeout_s=20,
        )
    )
    prefill(engine)
    for position in range(3, 6):
        started = time.monotonic()
        assert decode(engine, position).first_pos == position
        assert time.monotonic() - started < 10


def test_a_first_line_that_never_ends_is_bounded(tmp_path: Path) -> None:
    """A child writing megabytes to stdout without a newline: the supervisor reads at most a
    bounded greeting, then stops it and says it did not start (NotReady), instead of
    buffering until the start-up timeout."""
    child = ChildProcess("fake", python=_interpreter(tmp_path, _ENDLESS), startup_timeout_s=20.0)
    started = time.monotonic()
    with pytest.raises(api.NotReady) as refused:
        child.start()
    assert time.monotonic() - started < 10
    assert "first line" in refused.value.message
    child.stop()
    assert not os.path.exists(child.directory)


def test_a_child_flooding_its_stderr_leaves_a_bounded_log(tmp_path: Path) -> None:
    """A child writing 100 MiB to stderr, then failing an assertion: the stderr log in its
    private directory stays within a fixed size (the oldest part dropped) instead of filling
    the disk, and the crash report still quotes the assertion and names the signal."""
    child = ChildProcess("fake", python=_interpreter(tmp_path, _FLOODING), startup_timeout_s=20.0)
    try:
        child.start()
        crashed = child.wait_exit(60.0)
        assert crashed is not None
        log = child.directory / "stderr.log"
        assert log.stat().st_size <= STDERR_LOG_MAX_BYTES <= 2 << 20
        assert "SIGABRT" in crashed.message
        assert "GGML_ASSERT(n_tokens <= n_batch) failed" in crashed.message
        tail = crashed.details["stderr_tail"]
        assert isinstance(tail, str)
        assert tail.endswith("GGML_ASSERT(n_tokens <= n_batch) failed\n")
    finally:
        child.stop()
    assert not os.path.exists(child.directory)


def test_the_stderr_log_keeps_the_newest_bytes(tmp_path: Path) -> None:
    """Past its limit the log drops its oldest half, never the newest bytes, and keeps
    draining the pipe once its file is gone (a writer must never block on it)."""
    log = _StderrLog(tmp_path / "stderr.log", limit=100)
    read_fd, write_fd = os.pipe()
    log.start(read_fd, "test-stderr")
    sent = b"".join(b"%04d," % i for i in range(1000))
    for start in range(0, len(sent), 37):
        os.write(write_fd, sent[start : start + 37])
    wait_until(lambda: log.tail(10) == sent[-10:])
    kept = (tmp_path / "stderr.log").read_bytes()
    assert 0 < len(kept) <= 100
    assert sent.endswith(kept)
    (tmp_path / "stderr.log").unlink()
    # More than a pipe holds: only a pipe still drained takes it all.
    writer = threading.Thread(target=os.write, args=(write_fd, b"x" * (1 << 20)), daemon=True)
    writer.start()
    writer.join(10.0)
    assert not writer.is_alive()
    os.close(write_fd)
    log.join(10.0)
    assert log.tail(10) == b""
