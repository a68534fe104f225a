"""Threading defaults of the llama engine: OpenMP's spin-wait, thread count, affinity.

This llama.cpp build runs graphs on OpenMP: ``libggml-base.so`` and ``libggml-cpu.so`` link
``libgomp.so.1``, which the dynamic loader brings in when llama-cpp-python's ``llama_cpp``
module ``ctypes.CDLL``-loads ``libllama.so`` at import. When a parallel region ends, libgomp's
worker threads busy-wait for the next one for ``GOMP_SPINCOUNT`` iterations (300,000 by
default: milliseconds) before they sleep. Shards that share cores — several engines on one
machine, in one process or in one process per shard — then slow each other: a shard whose
decode has returned keeps its threads spinning on the cores the next shard needs. Reported on
this project's 2-core machine: a 3-way split with one process per shard decoded at 0.36-0.55
of the same split in one process; with ``GOMP_SPINCOUNT=10000`` in every worker, 0.87-0.96.
``OMP_WAIT_POLICY=PASSIVE`` (never spin) was slower still: each of the many barriers inside
one graph then sleeps and is woken.

The defaults (``apply_threading_defaults``, called by ``_llama_library`` before it
imports ``llama_cpp``):

* ``GOMP_SPINCOUNT=10000`` (:data:`DEFAULT_SPIN_COUNT`) unless the environment already sets
  ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` (yours wins; ``GOMP_SPINCOUNT=300000`` restores
  libgomp's own default). Ten thousand spins stay hot across a graph's barriers and the
  sub-millisecond gap between two shards of one process, and end well before the next
  process's shard needs the core. libgomp reads the variable once, when it is loaded, so it
  must be in the environment before the process first loads libgomp: the engine's first use
  (``LlamaEngine``, which imports ``llama_cpp`` through ``_llama_library``) applies it just before.
  If something else loaded libgomp earlier (another OpenMP library), the setting cannot take
  effect; :func:`threading_report` says so.
* threads: ``LoadConfig.n_threads``, by default every core this process may run on
  (``os.sched_getaffinity``): the shards of one pipeline run one after another, so each may
  use all of them. Thread pool: in an OpenMP build ggml runs each graph in libgomp's team of
  the calling thread, created at its first decode and reused after (ggml's own threadpool API
  is not used), so engines called from one thread share one team.
* no affinity: ``OMP_PROC_BIND`` and ``GOMP_CPU_AFFINITY`` are left unset, because pinning the
  threads of several processes to the same cores makes them queue there while others idle.
* compute threads: libgomp keeps one team per thread that ever ran a parallel region, and once
  the process holds more team threads than CPUs it cuts every barrier's spin to 100
  iterations, so a graph's threads sleep and are woken at almost every node. A server that
  serves successive calls on different threads (a thread pool, turn-taking readers, an asyncio
  executor) got exactly that. So every ``llama_decode`` of the process runs on a compute
  thread, the lowest-numbered idle one (:class:`ComputeThreads`; in C in ``_native.c`` when
  that extension is built): calls made one after another, from whichever threads, all run on
  compute thread 0 and its one team. Only calls that overlap get more compute threads, which
  end after :data:`COMPUTE_IDLE_EXIT_S` without work. ``SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0``
  runs every call on its caller's thread instead (for comparisons).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Generic, TypeVar

__all__ = [
    "COMPUTE_IDLE_EXIT_S",
    "COMPUTE_THREADS_ENV",
    "DEFAULT_SPIN_COUNT",
    "SPIN_COUNT_ENV",
    "ComputeThreads",
    "apply_threading_defaults",
    "compute_threads_enabled",
    "libgomp_loaded",
    "record_compute_threads",
    "threading_report",
]

SPIN_COUNT_ENV: Final = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV: Final = "OMP_WAIT_POLICY"
DEFAULT_SPIN_COUNT: Final = 10_000
COMPUTE_THREADS_ENV: Final = "SHARD_ENGINE_LLAMA_COMPUTE_THREADS"
MAX_COMPUTE_THREADS: Final = 64
"""At most this many calls run at once (MAX_COMPUTE_THREADS of ``_native.c``); more wait."""
COMPUTE_IDLE_EXIT_S: Final = 2.0
"""How long a compute thread other than the first waits for work before it ends (IDLE_EXIT_S
of ``_native.c``)."""

_applied: dict[str, object] = {}


def libgomp_loaded() -> bool:
    """Whether libgomp is already mapped into this process (Linux; False elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return "libgomp" in maps


def apply_threading_defaults() -> None:
    """Put the default spin count into the environment unless the user chose one. Call it
    before llama_cpp is imported; repeated calls change nothing."""
    if _applied:
        return
    _applied["libgomp_loaded_before"] = libgomp_loaded()
    if SPIN_COUNT_ENV in os.environ or WAIT_POLICY_ENV in os.environ:
        _applied["source"] = "environment"
    else:
        os.environ[SPIN_COUNT_ENV] = str(DEFAULT_SPIN_COUNT)
        _applied["source"] = "shard-engine default"


def compute_threads_enabled() -> bool:
    """False when ``SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0`` asks for calls on the caller's
    thread."""
    return os.environ.get(COMPUTE_THREADS_ENV, "1").strip() != "0"


def record_compute_threads(mode: str) -> None:
    """``_llama_library`` says where llama_decode runs: "native" or "python" compute threads, or the
    "caller"'s thread."""
    _applied["compute_threads"] = mode


def threading_report() -> dict[str, object]:
    """What is in force: the spin count and wait policy the environment holds, who set them,
    and whether libgomp was loaded before the default could be applied (then it had no
    effect)."""
    return {
        "gomp_spincount": os.environ.get(SPIN_COUNT_ENV),
        "omp_wait_policy": os.environ.get(WAIT_POLICY_ENV),
        "source": _applied.get("source", "not applied"),
        "libgomp_loaded_before": _applied.get("libgomp_loaded_before"),
        "libgomp_loaded": libgomp_loaded(),
        "compute_threads": _applied.get("compute_threads", "not loaded"),
    }


_T = TypeVar("_T")


@dataclass
class _Job(Generic[_T]):
    call: Callable[[], _T]
    done: threading.Event = field(default_factory=threading.Event)
    result: _T | None = None
    error: BaseException | None = None


@dataclass
class _Slot:
    index: int
    jobs: queue.SimpleQueue[_Job[object]] = field(default_factory=queue.SimpleQueue)
    alive: bool = False
    busy: bool = False


class ComputeThreads:
    """Runs each call on the lowest-numbered idle compute thread and returns its result (or
    raises its exception) in the caller. The Python form of ``shard_engine_decode`` in
    ``_native.c``, used when that extension is not built; see the module docstring for why."""

    def __init__(self, idle_exit_s: float = COMPUTE_IDLE_EXIT_S) -> None:
        self._idle_exit_s = idle_exit_s
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._slots: list[_Slot] = []
        self._pid = os.getpid()
        self.started = 0
        """Threads started (since construction, or since this process forked)."""

    def alive(self) -> int:
        with self._lock:
            return sum(slot.alive for slot in self._slots)

    def run(self, call: Callable[[], _T]) -> _T:
        job: _Job[_T] = _Job(call)
        slot = self._claim()
        try:
            slot.jobs.put(job)  # type: ignore[arg-type]
            job.done.wait()
        finally:
            with self._lock:
                slot.busy = False
                self._slot_free.notify()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _claim(self) -> _Slot:
        with self._lock:
            if os.getpid() != self._pid:  # forked: the threads stayed in the parent
                self._slots, self._pid, self.started = [], os.getpid(), 0
            while True:
                slot = next((slot for slot in self._slots if not slot.busy), None)
                if slot is None and len(self._slots) < MAX_COMPUTE_THREADS:
                    slot = _Slot(len(self._slots))
                    self._slots.append(slot)
                if slot is not None:
                    if not slot.alive:
                        threading.Thread(
                            target=self._serve, args=(slot,), daemon=True, name="llama-compute"
                        ).start()
                        slot.alive = True
                        self.started += 1
                    slot.busy = True
                    return slot
                self._slot_free.wait()

    def _serve(self, slot: _Slot) -> None:
        timeout = None if slot.index == 0 else self._idle_exit_s
        while True:
            try:
                job = slot.jobs.get(timeout=timeout)
            except queue.Empty:
                with self._lock:
                    if not slot.busy and slot.jobs.empty():
                        slot.alive = False
                        return
                continue
            try:
                job.result = job.call()
            except BaseException as error:  # noqa: BLE001  (the caller re-raises it)
                job.error = error
            finally:
                job.done.set()
