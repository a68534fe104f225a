"""``ChildProcess``: one engine in a supervised child process on a private unix socket.

The socket lives in a fresh ``0700`` directory, and calls need a random bearer token handed to
the child in its environment, so no other user (nor another process without the token) can
drive the engine. The child's stderr is kept in that directory so a crash report can quote its
last lines (a GGML_ASSERT message, a Python traceback). It reaches the file through a pipe this
process drains, so the file never holds more than :data:`STDERR_LOG_MAX_BYTES`: past that, the
oldest half is dropped (a child, or a native library inside it, logging forever cannot fill the
disk, and the end of the log, where a crash says why, is always kept). A waiter thread notices
the child's exit at once; :meth:`exit_error` then describes it as EngineCrashed naming the
signal or exit code.

Environment: the child inherits this process's environment by default; ``env`` overrides
(a None value removes a variable) and ``inherit_env=False`` starts from PATH alone. Threading
settings belong there: llama.cpp's OpenMP workers spin-wait between graphs (``GOMP_SPINCOUNT``,
``OMP_WAIT_POLICY``), which steals cores from the other shard processes of one machine.
"""

from __future__ import annotations

import io
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

__all__ = ["STDERR_LOG_MAX_BYTES", "ChildProcess", "describe_exit"]

_STDERR_TAIL_BYTES: Final = 4096
STDERR_LOG_MAX_BYTES: Final = 1 << 20
"""The most of a child's stderr kept on disk (1 MiB); past it the oldest half is dropped."""
_STDERR_READ_BYTES: Final = 64 * 1024
_STDERR_DRAIN_S: Final = 2.0
"""How long the exit waiter waits for the rest of a dead child's stderr (the pipe ends at once
unless a process the child started holds it open) before reporting the exit anyway."""
_MAX_FIRST_LINE_BYTES: Final = 64 * 1024
"""The longest first line (``ready ADDRESS`` or ``error CODE MESSAGE``) read from a child."""
_SIGNAL_NOTES: Final = {
    signal.SIGABRT: "aborted: an assertion in native code (e.g. GGML_ASSERT) or abort()",
    signal.SIGKILL: "killed: kill -9 or the out-of-memory killer",
    signal.SIGSEGV: "segmentation fault in native code",
    signal.SIGTERM: "terminated: someone other than its worker asked it to stop (it drained "
    "its calls first)",
    signal.SIGHUP: "hung up: someone other than its worker asked it to stop (it drained its "
    "calls first)",
    signal.SIGINT: "interrupted (it drained its calls first)",
    signal.SIGBUS: "bus error: a file mapped by native code shrank or vanished",
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
    if returncode == 0:
        # The child exits 0 only when its stdin closed, which its worker never does while it
        # still needs it; a signal ends it with that signal (see _child).
        return "exited with code 0 without being asked to", {"exit_code": 0}
    return f"exited with code {returncode}", {"exit_code": returncode}


class _StderrLog:
    """A child's stderr: a thread drains the pipe into ``path``, keeping at most ``limit`` bytes
    (when a write would pass it, the file is rewritten with the newest ``limit // 2`` bytes).

    Draining never stops before the pipe ends, even when the file cannot be written (the
    directory removed, the disk full): a child blocked writing to a full pipe would hang."""

    def __init__(self, path: Path, limit: int = STDERR_LOG_MAX_BYTES) -> None:
        self.path = path
        self._limit = limit
        self._lock = threading.Lock()
        self._file: io.FileIO | None = io.FileIO(path, "w+")
        self._size = 0
        self._thread: threading.Thread | None = None

    def start(self, read_fd: int, name: str) -> None:
        """Drain ``read_fd`` (which the log now owns and closes) in a daemon thread."""
        self._thread = threading.Thread(target=self._drain, args=(read_fd,), daemon=True, name=name)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the pipe to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop writing the file (draining goes on until the pipe ends)."""
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            file.close()

    def _drain(self, read_fd: int) -> None:
        try:
            while True:
                try:
                    chunk = os.read(read_fd, _STDERR_READ_BYTES)
                except OSError:
                    return
                if not chunk:
                    return
                self._append(chunk)
        finally:
            os.close(read_fd)
            self.close()

    def _append(self, chunk: bytes) -> None:
        with self._lock:
            file = self._file
            if file is None:
                return
            try:
                if self._size + len(chunk) <= self._limit:
                    file.seek(self._size)
                    _write_all(file, chunk)
                    self._size += len(chunk)
                    return
                keep = self._limit // 2
                if len(chunk) >= keep:
                    newest = chunk[-keep:]
                else:
                    older = keep - len(chunk)
                    file.seek(self._size - older)
                    newest = file.read(older) + chunk
                file.seek(0)
                file.truncate()
                _write_all(file, newest)
                self._size = len(newest)
            except OSError:
                # No room or no file any more: drop what cannot be kept, keep draining.
                self._file = None
                file.close()

    def tail(self, n_bytes: int) -> bytes:
        """The last ``n_bytes`` bytes written so far (b"" once the file is gone)."""
        with self._lock:
            try:
                with self.path.open("rb") as file:
                    file.seek(0, os.SEEK_END)
                    file.seek(max(0, file.tell() - n_bytes))
                    return file.read()
            except OSError:
                return b""


def _write_all(file: io.FileIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:
            raise OSError("short write")
        view = view[written:]


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
        self._stderr: _StderrLog | None = None
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

    @property
    def running_pid(self) -> int | None:
        """The child's pid while it runs; None before it started and once it exited. Never
        raises, from any thread, whatever a start, a stop or a restart is doing."""
        process = self._process
        if process is None or self._exited.is_set():
            return None
        return process.pid

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
        command += ["--parent-pid", str(os.getpid())]
        if self._max_message_bytes is not None:
            command += ["--max-message-bytes", str(self._max_message_bytes)]
        with self._start_lock:
            if self._terminated:
                raise api.NotReady(
                    f"the {self.engine_name} engine process was stopped before it started",
                    retryable=False,
                )
            log = self._stderr = _StderrLog(self._stderr_path)
            read_fd, write_fd = os.pipe()
            try:
                self._process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=write_fd,
                    env=self.environment(),
                    close_fds=True,
                    # Out of this process's group: a terminal's Ctrl-C (SIGINT to the
                    # foreground group) would otherwise end every child at once, before the
                    # worker could drain or move its sessions. The child still ends with this
                    # process (its stdin closes).
                    start_new_session=True,
                )
            except BaseException:
                os.close(read_fd)
                log.close()
                raise
            finally:
                os.close(write_fd)
            log.start(read_fd, f"child-{self._process.pid}-stderr")
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
        # The crash report quotes the child's last words: let them reach the log first.
        if self._stderr is not None:
            self._stderr.join(_STDERR_DRAIN_S)
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
        if self._stderr is None:
            return ""
        return self._stderr.tail(_STDERR_TAIL_BYTES).decode(errors="replace")

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
        if self._stderr is not None:
            # The pipe ends with the child (unless a process it started holds it; draining
            # then goes on, into no file, until that one ends too).
            self._stderr.join(_STDERR_DRAIN_S if process is not None else 0.0)
            self._stderr.close()
        shutil.rmtree(self._directory, ignore_errors=True)
