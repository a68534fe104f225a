"""Children that write where no one reads: an engine printing to stdout once the child is
serving, and a child whose first line never ends. Neither hangs a call nor grows the
supervising process's memory."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest
from conftest import RemoteFactory, config, decode, prefill

import shard_engine_api as api
from shard_engine_remote._supervisor import ChildProcess

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
