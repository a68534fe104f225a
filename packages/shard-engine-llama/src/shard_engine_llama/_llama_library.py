"""llama.cpp, loaded once per process and pinned: the bindings' version, ggml's own symbols,
the optional native callbacks (``_native.c``) and where ``llama_decode`` runs.

Importing this module checks that the installed llama-cpp-python is the pinned release (the
layer-capture recipe of ``_abi`` depends on its internal graph tensor names and struct layouts),
applies the threading defaults libgomp reads when it loads, and only then imports ``llama_cpp``
(exported here as ``llama_cpp`` so every user imports it after the check). ``_abi``, the one
module that runs llama.cpp, builds on what is loaded here; the error tree of both starts here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final, NoReturn

__all__ = [
    "CAPTURE_ERRORS",
    "CAPTURE_NAME_BYTES",
    "LLAMA_CPP_PYTHON_VERSION",
    "LOG_ENV",
    "NATIVE_ENV",
    "SUPPORTED_LLAMA_CPP_PYTHON",
    "AbortedError",
    "CaptureState",
    "InvalidInputError",
    "KVFullError",
    "LlamaRuntimeError",
    "ModelLoadError",
    "NativeCallbacks",
    "RuntimeFailure",
    "UnsupportedLlamaVersionError",
    "address",
    "compute_threads",
    "decode_on_compute_thread",
    "ensure_backend",
    "ggml",
    "ggml_abort",
    "llama_cpp",
    "native",
    "native_callbacks_available",
]

SUPPORTED_LLAMA_CPP_PYTHON = ">=0.3.36,<0.3.37"
_SUPPORTED_MINIMUM = (0, 3, 36)
_SUPPORTED_BELOW = (0, 3, 37)
LOG_ENV = "SHARD_ENGINE_LLAMA_LOG"
NATIVE_ENV = "SHARD_ENGINE_LLAMA_NATIVE"


class LlamaRuntimeError(RuntimeError):
    """Root of the errors raised by this module."""


class UnsupportedLlamaVersionError(LlamaRuntimeError, ImportError):
    """The installed llama-cpp-python is outside SUPPORTED_LLAMA_CPP_PYTHON."""


class ModelLoadError(LlamaRuntimeError):
    """llama.cpp refused to load the model file or create a context for it."""


class RuntimeFailure(LlamaRuntimeError):
    """``llama_decode`` failed (any status other than success, abort or a full KV cache)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class KVFullError(RuntimeFailure):
    """``llama_decode`` returned 1: no KV-cache slot for the batch (context or sequence full)."""


class AbortedError(LlamaRuntimeError):
    """``llama_decode`` returned 2 because :meth:`ShardRuntime.request_abort` was called."""


class InvalidInputError(LlamaRuntimeError, ValueError):
    """The inputs do not fit the shard (wrong kind for its role, wrong shape, bad positions)."""


def _parse_version(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _check_version() -> str:
    try:
        installed = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError as error:
        raise UnsupportedLlamaVersionError(
            "llama-cpp-python is not installed; shard_engine_llama needs "
            f"llama-cpp-python{SUPPORTED_LLAMA_CPP_PYTHON}"
        ) from error
    if not _SUPPORTED_MINIMUM <= _parse_version(installed) < _SUPPORTED_BELOW:
        raise UnsupportedLlamaVersionError(
            f"llama-cpp-python {installed} is installed but shard_engine_llama is pinned to "
            f"llama-cpp-python{SUPPORTED_LLAMA_CPP_PYTHON}: the layer-capture recipe depends on "
            "internal graph tensor names and struct layouts of that release"
        )
    return installed


LLAMA_CPP_PYTHON_VERSION = _check_version()

# libgomp reads its spin count when llama_cpp loads it: the default must be in place first.
from shard_engine_llama._threading import (  # noqa: E402
    ComputeThreads,
    apply_threading_defaults,
    compute_threads_enabled,
    record_compute_threads,
)

apply_threading_defaults()

import llama_cpp  # noqa: E402  (imported only once the pinned version is confirmed)


def _load_ggml_base() -> ctypes.CDLL:
    library_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(library_dir.glob("libggml-base.*"))
    if not candidates:
        raise ModelLoadError(f"libggml-base not found next to libllama in {library_dir}")
    # RTLD_GLOBAL is what libllama already loaded it with; asking again returns the same handle.
    library = ctypes.CDLL(str(candidates[0]), mode=ctypes.RTLD_GLOBAL)
    library.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    library.ggml_backend_tensor_get.restype = None
    library.ggml_get_name.argtypes = [ctypes.c_void_p]
    library.ggml_get_name.restype = ctypes.c_char_p
    library.ggml_nbytes.argtypes = [ctypes.c_void_p]
    library.ggml_nbytes.restype = ctypes.c_size_t
    library.ggml_nelements.argtypes = [ctypes.c_void_p]
    library.ggml_nelements.restype = ctypes.c_int64
    return library


ggml = _load_ggml_base()


def ggml_abort(reason: str) -> NoReturn:
    """Abort the process the way a failed ``GGML_ASSERT`` inside llama.cpp does: ggml's own
    ``ggml_abort`` prints ``GGML_ASSERT(<reason>) failed`` and a backtrace, then calls
    ``abort()`` (SIGABRT). Only the llama engine's ``inject_abort`` test option calls it."""
    function = ggml.ggml_abort
    function.restype = None
    function(
        b"shard_engine_llama/_abi.py",
        ctypes.c_int(0),
        b"GGML_ASSERT(%s) failed",
        reason.encode("utf-8", "replace"),
    )
    raise AssertionError("ggml_abort returned")  # unreachable: it never returns


CAPTURE_NAME_BYTES = 64  # GGML_MAX_NAME of the pinned release
CAPTURE_ERRORS = {
    1: "the captured tensor is not F32",
    2: "the captured tensor does not have n_embd columns and 2 dimensions",
    3: "the captured tensor has more rows than the batch",
    4: "the captured tensor is not contiguous",
}


class CaptureState(ctypes.Structure):
    """``struct capture_state`` of ``_native.c`` (same field order and types)."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("ne_offset", ctypes.c_int64),
        ("row_values", ctypes.c_int64),
        ("capacity_rows", ctypes.c_int64),
        ("destination", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("calls", ctypes.c_int32),
        ("name", ctypes.c_char * CAPTURE_NAME_BYTES),
    ]


@dataclass(frozen=True)
class NativeCallbacks:
    """Addresses of the native callbacks and of the ggml functions they call."""

    capture_eval: int
    abort_flag: int
    get_name: int
    tensor_get: int
    nbytes: int


def address(function: object) -> int:
    value = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]
    if not value:
        raise OSError("null function address")
    return int(value)


def _load_native_library() -> ctypes.CDLL | None:
    """The built ``_native`` extension as a library, or None (not built, or disabled)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    spec = importlib.util.find_spec("shard_engine_llama._native")
    if spec is None or spec.origin is None:
        return None
    try:
        return ctypes.CDLL(spec.origin)
    except OSError:
        return None


_native_library = _load_native_library()


def _load_native() -> NativeCallbacks | None:
    """The built ``_native`` extension's callbacks, or None (not built, or disabled)."""
    library = _native_library
    if library is None:
        return None
    try:
        return NativeCallbacks(
            capture_eval=address(library.shard_engine_capture_eval),
            abort_flag=address(library.shard_engine_abort_flag),
            get_name=address(ggml.ggml_get_name),
            tensor_get=address(ggml.ggml_backend_tensor_get),
            nbytes=address(ggml.ggml_nbytes),
        )
    except (OSError, AttributeError):
        return None


native = _load_native()


@dataclass(frozen=True)
class _Compute:
    """How ``llama_decode`` reaches a compute thread (see ``_threading``)."""

    mode: str  # "native", "python" or "caller"
    decode: Callable[[object, llama_cpp.llama_batch], int]
    counts: Callable[[], tuple[int, int]]


def _decode_here(context: object, batch: llama_cpp.llama_batch) -> int:
    return int(llama_cpp.llama_decode(context, batch))


def _load_compute() -> _Compute:
    """The native ``shard_engine_decode`` when the extension is built (and its callbacks
    load), else ``ComputeThreads``; the caller's thread when
    ``SHARD_ENGINE_LLAMA_COMPUTE_THREADS=0``."""
    if not compute_threads_enabled():
        return _Compute("caller", _decode_here, lambda: (0, 0))
    if native is not None and _native_library is not None:
        try:
            function = _native_library.shard_engine_decode
            counter = _native_library.shard_engine_compute_threads
        except AttributeError:
            pass
        else:
            decode_address = address(llama_cpp.llama_cpp._lib.llama_decode)
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            function.restype = ctypes.c_int32
            counter.argtypes = [ctypes.POINTER(ctypes.c_int32)] * 2
            counter.restype = None

            def native_decode(context: object, batch: llama_cpp.llama_batch) -> int:
                return int(function(decode_address, context, ctypes.byref(batch)))

            def native_counts() -> tuple[int, int]:
                alive, started = ctypes.c_int32(0), ctypes.c_int32(0)
                counter(ctypes.byref(alive), ctypes.byref(started))
                return int(alive.value), int(started.value)

            return _Compute("native", native_decode, native_counts)
    threads = ComputeThreads()

    def python(context: object, batch: llama_cpp.llama_batch) -> int:
        return threads.run(lambda: _decode_here(context, batch))

    return _Compute("python", python, lambda: (threads.alive(), threads.started))


_compute = _load_compute()
record_compute_threads(_compute.mode)

decode_on_compute_thread: Final = _compute.decode
"""``llama_decode(context, batch)`` where the engine runs its own (``ShardRuntime`` and a
baseline that calls llama.cpp directly in the same process: a second libgomp team would
throttle both)."""


def compute_threads() -> tuple[str, int, int]:
    """Where ``llama_decode`` runs ("native" or "python" compute threads, or the "caller"'s
    thread), how many compute threads run now and how many this process started."""
    alive, started = _compute.counts()
    return _compute.mode, alive, started


def native_callbacks_available() -> bool:
    """Whether runtimes created from now on use the native callbacks of ``_native.c``."""
    return native is not None


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _silent_log(level: int, text: bytes, user_data: int | None) -> None:
    del level, text, user_data


_backend_lock = threading.Lock()
_backend_state: dict[str, bool] = {"ready": False}


def ensure_backend() -> None:
    with _backend_lock:
        if _backend_state["ready"]:
            return
        if not os.environ.get(LOG_ENV):
            # Loading a model prints hundreds of lines to stderr otherwise.
            llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_state["ready"] = True
