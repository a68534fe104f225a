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

The defaults (``apply_threading_defaults``, called by ``_abi`` before it imports
``llama_cpp``):

* ``GOMP_SPINCOUNT=10000`` (:data:`DEFAULT_SPIN_COUNT`) unless the environment already sets
  ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` (yours wins; ``GOMP_SPINCOUNT=300000`` restores
  libgomp's own default). Ten thousand spins stay hot across a graph's barriers and the
  sub-millisecond gap between two shards of one process, and end well before the next
  process's shard needs the core. libgomp reads the variable once, when it is loaded, so it
  must be in the environment before the process first loads libgomp: the engine's first use
  (``LlamaEngine``, which imports ``llama_cpp`` through ``_abi``) applies it just before.
  If something else loaded libgomp earlier (another OpenMP library), the setting cannot take
  effect; :func:`threading_report` says so.
* threads: ``LoadConfig.n_threads``, by default every core this process may run on
  (``os.sched_getaffinity``): the shards of one pipeline run one after another, so each may
  use all of them. Thread pool: in an OpenMP build ggml runs each graph in libgomp's team of
  the calling thread, created at its first decode and reused after (ggml's own threadpool API
  is not used), so engines called from one thread share one team.
* no affinity: ``OMP_PROC_BIND`` and ``GOMP_CPU_AFFINITY`` are left unset, because pinning the
  threads of several processes to the same cores makes them queue there while others idle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_SPIN_COUNT",
    "SPIN_COUNT_ENV",
    "apply_threading_defaults",
    "libgomp_loaded",
    "threading_report",
]

SPIN_COUNT_ENV: Final = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV: Final = "OMP_WAIT_POLICY"
DEFAULT_SPIN_COUNT: Final = 10_000

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
    }
