"""The llama engine's options (``LoadConfig.options``) and the checks of a load's options and
limits before anything is opened."""

from __future__ import annotations

import math
from typing import Final

import msgspec

from shard_engine_api import InvalidRequest, LoadConfig, UnsupportedFeature
from shard_engine_api.engine import TEST_OPTIONS_ENV, test_options_enabled
from shard_engine_llama._sealed import sealed_copies_supported

__all__ = ["LlamaOptions", "checked_options"]

_MAX_SEQUENCES: Final = 256  # llama.cpp's LLAMA_MAX_SEQ
_MAX_SLOW_FORWARD_US: Final = 100_000
_MAX_THREADS: Final = 512  # ggml's GGML_MAX_N_THREADS


class LlamaOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``LoadConfig.options`` of the llama engine.

    - ``n_ubatch``: llama.cpp micro-batch size, capped at ``max_batch_tokens``; every shard of a
      pipeline must use the same value (and the same ``kv_type``, ``flash_attn`` and context
      settings) for bitwise-equal results.
    - ``kv_type``: "f32" (default; matches a float64 reference) or "f16".
    - ``model_store``: where shard files are written (default: SHARD_ENGINE_MODEL_STORE, else
      a private per-user directory in $TMPDIR or /var/tmp; /home is refused).
    - ``tolerance``: one absolute max |delta| declared for logits and hidden states alike, for
      results that are not bitwise equal (decode vs. prefill of the same tokens, batched vs.
      single decode). Default: none; the engine declares per-kind tolerances relative to each
      row's magnitude, measured per weight type (see ``_determinism.declared_determinism``), since
      llama.cpp picks other kernels for other batch shapes and gemma3's hidden states reach
      ~1e5, where no absolute bound fits.
    - ``self_test``: run the start-up self-test (a generated model split 2-way, bitwise) before
      the first engine of the process reports ready.
    - ``private_copy``: llama.cpp maps a private copy of the shard file, sealed against any
      change (a ``memfd``), filled by the read that verifies the file (default). A file
      rewritten in place or truncated under the engine then changes nothing. It costs the
      file's size in memory that is not shared with other processes and not reclaimable, and
      one read of the file per load (see the README's "Shard integrity"). False maps the file
      itself (shared page cache): a file rewritten in place under a running engine then
      changes its outputs without an error, and a truncated one kills the process (SIGBUS).
    The three test-only options below are refused (InvalidRequest) unless the process runs with
    ``SHARD_ENGINE_TEST_OPTIONS=1`` (``shard_engine_api.engine.TEST_OPTIONS_ENV``; the
    conformance suite sets it): a configuration sent to a worker cannot make it crash.

    - ``inject_crash``: test only: the next forward fails as a backend crash would (the
      conformance suite checks EngineCrashed and health "failed" with it).
    - ``inject_abort``: test only: the next forward calls llama.cpp's own ``ggml_abort`` (what a
      failed ``GGML_ASSERT`` calls: message, backtrace, ``abort()``), so the process dies of
      SIGABRT exactly as on an assertion inside llama.cpp. For tests of process isolation
      (``shard-engine-remote``'s ``spawn``): the validator keeps the files known to trip such
      assertions away, so no GGUF is left that does it on purpose.
    - ``slow_forward_us``: test only: llama.cpp's abort check, once per graph node, first
      sleeps this many microseconds (0 to 100,000; it implies the Python callbacks), so that
      a forward on a tiny model lasts long enough to be cancelled mid-way: the conformance
      suite's cancellation tests then always see a cancel land inside llama.cpp.
    - ``native_callbacks``: use llama.cpp callbacks written in C when the optional extension
      is built (default); False runs them in Python (same results, slower per token: for
      comparisons).
    """

    n_ubatch: int = 512
    kv_type: str = "f32"
    flash_attn: bool = False
    model_store: str | None = None
    tolerance: float | None = None
    self_test: bool = True
    private_copy: bool = True
    inject_crash: bool = False
    inject_abort: bool = False
    slow_forward_us: int = 0
    native_callbacks: bool = True


_DEFAULT_OPTIONS: Final = LlamaOptions()
_TEST_ONLY_OPTIONS: Final = ("inject_crash", "inject_abort", "slow_forward_us")
"""Accepted at other than their defaults only where ``test_options_enabled()``."""


def checked_options(config: LoadConfig) -> LlamaOptions:
    """``config.options`` as :class:`LlamaOptions`, and the load's limits, checked before
    anything is opened: InvalidRequest for an unknown, malformed or out-of-range option or
    limit (a test-only option outside a test process too), UnsupportedFeature for a private
    copy this system cannot make."""
    unknown = sorted(set(config.options) - set(LlamaOptions.__struct_fields__))
    if unknown:
        known = sorted(set(LlamaOptions.__struct_fields__) - set(_TEST_ONLY_OPTIONS))
        raise InvalidRequest(
            f"unknown llama engine options {unknown}; the options are {', '.join(known)}",
            details={"unknown": ", ".join(unknown)},
        )
    try:
        options = msgspec.convert(config.options, LlamaOptions)
    except msgspec.ValidationError as error:
        raise InvalidRequest(f"invalid llama engine options: {error}") from error
    if options.kv_type not in ("f32", "f16"):
        raise InvalidRequest(f"kv_type must be f32 or f16, got {options.kv_type!r}")
    if options.n_ubatch < 1:
        raise InvalidRequest(f"n_ubatch must be positive, got {options.n_ubatch}")
    if options.tolerance is not None and not (
        math.isfinite(options.tolerance) and options.tolerance >= 0
    ):
        # Declared as the engine's determinism: NaN would make every comparison fail (and
        # a negative bound none succeed).
        raise InvalidRequest(f"tolerance must be a finite number >= 0, got {options.tolerance!r}")
    if options.model_store is not None and "\x00" in options.model_store:
        # Refused here, not as the OS's ValueError deep in the store lookup.
        raise InvalidRequest(f"model_store may not contain NUL: {options.model_store!r}")
    for name in _TEST_ONLY_OPTIONS:
        if getattr(options, name) != getattr(_DEFAULT_OPTIONS, name) and not (
            test_options_enabled()
        ):
            # A LoadConfig may come from whoever asks a worker to load a shard; only the
            # process's owner may let it crash, abort or crawl.
            raise InvalidRequest(
                f"{name} is a test-only option: refused unless the engine's process runs "
                f"with {TEST_OPTIONS_ENV}=1",
                details={"field": f"options.{name}"},
            )
    if not 0 <= options.slow_forward_us <= _MAX_SLOW_FORWARD_US:
        raise InvalidRequest(
            f"slow_forward_us must lie in [0, {_MAX_SLOW_FORWARD_US}], "
            f"got {options.slow_forward_us}"
        )
    _check_limits(config, options)
    return options


def _check_limits(config: LoadConfig, options: LlamaOptions) -> None:
    """The load's thread and session counts within what ggml and llama.cpp allow, and a
    private copy only where this system can seal one."""
    if config.n_threads > _MAX_THREADS:
        # ggml sizes its thread pools for at most this many; OpenMP starts as many as
        # asked (4,096 threads: 6.8 s per token of a 1 MB model on 2 cores).
        raise InvalidRequest(
            f"n_threads may not exceed {_MAX_THREADS} (ggml's GGML_MAX_N_THREADS), got "
            f"{config.n_threads}; more threads than cores only slows llama.cpp down",
            details={"field": "n_threads", "limit": _MAX_THREADS},
        )
    if config.max_sessions >= _MAX_SEQUENCES:
        raise InvalidRequest(
            f"max_sessions may not exceed {_MAX_SEQUENCES - 1} (llama.cpp's sequence limit, "
            "one sequence kept spare so that an LRU eviction happens only at commit)"
        )
    if options.private_copy and not sealed_copies_supported():
        raise UnsupportedFeature(
            "private_copy needs sealable memfds and /proc (Linux); set private_copy=false "
            "to map the shard file itself, which must then not change while it is loaded",
            details={"field": "options.private_copy"},
        )
