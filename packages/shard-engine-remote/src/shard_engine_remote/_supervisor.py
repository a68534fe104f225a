"""``ChildProcess``: one engine in a supervised child process on a private unix socket.

The socket lives in a fresh ``0700`` directory, and calls need a random bearer token handed to
the child in its environment, so no other user (nor another process without the token) can
drive the engine. The child's stderr is kept in that directory so a crash report can quote its
last lines (a GGML_ASSERT message, a Python traceback). A waiter thread notices the child's exit
at once; :meth:`exit_error` then describes it as EngineCrashed naming the signal or exit code.

Environment: the child inherits this process's environment by default; ``env`` overrides
(a None value removes a variable) and ``inherit_env=False`` starts from PATH alone. Threading
settings belong there: llama.cpp's OpenMP workers spin-wait between graphs (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY``), which steals cores from the other shard processes of one machine.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote._security import TOKEN_ENV_VAR

__all__ = ["ChildProcess", "describe_exit"]

_STDERR_TAIL_BYTES: Final = 4096
_MAX_FIRST_LINE_BYTES: Final = 64 * 1024
"""The longest first line (``ready ADDRESS`` or ``error CODE MESSAGE``) read from a child."""
_SIGNAL_NOTES: Final = {
    signal.SIGABRT: "aborted: an assertion in native code (e.g. GGML_ASSERT) or abort()",
    signal.SIGKILL: "killed: kill -9 or the out-of-memory killer",
    signal.SIGSEGV: "segmentation fault in native code",
    signal.SIGTERM: "terminated",
}


_TELLING_MARKERS: Final = ("GGML_ASSERT", "Assertion", "assert", "Fatal", "Error", "error")


_TOO_LONG: Final = "\0first line too long"


def _last_words(tail: str) -> str:
    """The most telling line of a dead child's stderr: the last one naming an assertion or an
    error (native aborts often print a backtrace after it), else the last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for marker in _TELLING_MARKERS:
        for line in reversed(lines):
            if marker in line:
                return line
    return lines[-1] if lines else ""


def describe_exit(returncode: int) -> tuple[str, dict[str, api.ErrorDetail]]:
    """A sentence and details for a child's exit status (negative: killed by that signal)."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"was killed by signal {-returncode}", {"signal": -returncode}
        note = _SIGNAL_NOTES.get(sig, "")
        sentence = f"was killed by {sig.name} ({sig.value})" + (f": {note}" if note else "")
        return sentence, {"signal": sig.name, "signal_number": sig.value}
    return f"exited with code {returncode}", {"exit_code": returncode}


class ChildProcess:
    """A child process serving ``engine_name`` (unloaded) on a private unix socket."""

    def __init__(
        self,
        engine_name: str,
        *,
        env: Mapping[str, str | None] | None = None,
        inherit_env: bool = True,
        python: str | None = None,
        startup_timeout_s: float = 120.0,
        max_message_bytes: int | None = None,
        transport: Literal["grpc", "framed"] = "grpc",
    ) -> None:
        self.engine_name = engine_name
        self.token = secrets.token_urlsafe(32)
        self._env = dict(env or {})
        self._inherit_env = inherit_env
        self._python = python or sys.executable
        self._startup_timeout_s = startup_timeout_s
        self._max_message_bytes = max_message_bytes
        self.transport = transport
        self._directory = Path(tempfile.mkdtemp(prefix="shard-engine-"))  # mode 0700
        self.socket_path = self._directory / "engine.sock"
        self.address = f"unix:{self.socket_path}"
        self._stderr_path = self._directory / "stderr.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._exited = threading.Event()
        self._stopping = False
        self._terminated = False
        self._start_lock = threading.Lock()

    @property
    def directory(self) -> Path:
        """The private directory holding the socket and the child's stderr."""
        return self._directory

    @property
    def pid(self) -> int:
        assert self._process is not None, "the child was not started"
        return self._process.pid

    def environment(self) -> dict[str, str]:
        """The child's environment: inherited (or PATH only), then ``env`` applied, then the
        token."""
        base = dict(os.environ) if self._inherit_env else {"PATH": os.environ.get("PATH", "")}
        for key, value in self._env.items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = value
        base[TOKEN_ENV_VAR] = self.token
        return base

    def start(self) -> str:
        """Start the child and wait until it serves; returns its address. Raises EngineCrashed
        when it dies or says it cannot serve, NotReady when it is not serving in time."""
        command = [self._python, "-m", "shard_engine_remote._child"]
        command += ["--engine", self.engine_name, "--listen", self.address]
        command += ["--transport", self.transport]
        command += ["--private-directory", str(self._directory)]
        if self._max_message_bytes is not None:
            command += ["--max-message-bytes", str(self._max_message_bytes)]
        with self._start_lock, self._stderr_path.open("wb") as stderr:
            if self._terminated:
                raise api.NotReady(
                    f"the {self.engine_name} engine process was stopped before it started",
                    retryable=False,
                )
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=self.environment(),
                close_fds=True,
                # Out of this process's group: a terminal's Ctrl-C (SIGINT to the foreground
                # group) would otherwise end every child at once, before the worker could
                # drain or move its sessions. The child still ends with this process (its
                # stdin closes).
                start_new_session=True,
            )
        threading.Thread(target=self._wait, daemon=True, name=f"child-{self.pid}").start()
        line = self._first_line()
        if line.startswith("ready "):
            return self.address
        self.stop(grace=1.0)
        if line is _TOO_LONG:
            raise api.NotReady(
                f"the {self.engine_name} engine process wrote more than "
                f"{_MAX_FIRST_LINE_BYTES} bytes without ending its first line (ready or "
                "error); it was stopped",
                retryable=False,
            )
        if line.startswith("error "):
            _, code, message = [*line.split(" ", 2), "", ""][:3]
            if code == api.UnknownEngine.code:
                raise api.UnknownEngine(message)
            raise wire.error_from_info(api.ErrorInfo(code=code, message=message, retryable=False))
        # stop() reaped it, but the waiter thread may not have said so yet.
        crashed = self.wait_exit(1.0) if self._process.returncode is not None else None
        if crashed is not None:
            raise crashed
        raise api.NotReady(
            f"the {self.engine_name} engine process did not start serving within "
            f"{self._startup_timeout_s} s"
        )

    def _first_line(self) -> str:
        """The child's first stdout line; "" when it did not come within the start-up
        timeout, :data:`_TOO_LONG` when it is longer than any ready or error line."""
        process = self._process
        assert process is not None
        assert process.stdout is not None
        deadline = time.monotonic() + self._startup_timeout_s
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while b"\n" not in buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return ""
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    return buffer.decode(errors="replace")
                buffer += chunk
                if len(buffer) > _MAX_FIRST_LINE_BYTES and b"\n" not in buffer:
                    return _TOO_LONG
        return buffer.split(b"\n", 1)[0].decode(errors="replace")

    def _wait(self) -> None:
        assert self._process is not None
        self._process.wait()
        self._exited.set()

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def wait_exit(self, timeout: float) -> api.EngineCrashed | None:
        """Wait up to ``timeout`` seconds for the child to have exited; its EngineCrashed if so.
        (A connection the kernel reset can reach the client just before the exit is reaped.)"""
        if timeout > 0:
            self._exited.wait(timeout)
        return self.exit_error()

    def exit_error(self) -> api.EngineCrashed | None:
        """EngineCrashed describing how the child ended, or None while it runs."""
        process = self._process
        if process is None or not self._exited.is_set() or process.returncode is None:
            return None
        sentence, details = describe_exit(process.returncode)
        details["pid"] = process.pid
        details["engine"] = self.engine_name
        tail = self.stderr_tail()
        if tail:
            details["stderr_tail"] = tail
        message = f"the {self.engine_name} engine process (pid {process.pid}) {sentence}"
        last_words = _last_words(tail)
        if last_words:
            message += f"; its last words: {last_words[:300]}"
        return api.EngineCrashed(message, details=details)

    def stderr_tail(self) -> str:
        """The last few KiB of the child's stderr."""
        try:
            with self._stderr_path.open("rb") as file:
                file.seek(0, os.SEEK_END)
                size = file.tell()
                file.seek(max(0, size - _STDERR_TAIL_BYTES))
                return file.read().decode(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM, and SIGCONT should it be stopped), or, when it has
        not started yet, keep it from starting; never waits. Safe from any thread, while
        :meth:`start` waits for the child: that wait then ends as the child exits. The caller
        still calls :meth:`stop`."""
        with self._start_lock:
            self._terminated = True
            process = self._process
        if process is not None and process.returncode is None:
            try:
                process.send_signal(signal.SIGTERM)
                process.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (the child drains; SIGCONT too, should it be stopped), SIGKILL after
        ``grace`` seconds; removes the private directory. Idempotent."""
        process = self._process
        if process is not None and process.returncode is None and not self._stopping:
            self._stopping = True
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.send_signal(signal.SIGTERM)
                # A stopped child (SIGSTOP, a debugger let go) would hold SIGTERM until
                # resumed and be killed at the end of the grace; resumed, it drains and exits.
                process.send_signal(signal.SIGCONT)
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            except ProcessLookupError:
                pass
        if process is not None and process.stdout is not None:
            process.stdout.close()
        if process is not None and process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        shutil.rmtree(self._directory, ignore_errors=True)
