"""The llama.cpp-backed ShardEngine: one llama_context per shard, one sequence id per session.

The session semantics come from :class:`shard_engine_api.EngineCore`; this module only maps its
backend steps onto :class:`ShardRuntime` and maps runtime failures onto the contract's errors.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import resource
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    CacheMiss,
    Cancelled,
    CancelRequest,
    CancelResult,
    Determinism,
    EngineCrashed,
    Features,
    InvalidRequest,
    LoadConfig,
    ResourceExhausted,
    ShardMismatch,
    Tolerance,
    UnsupportedFeature,
)
from shard_engine_api.engine import (
    MODEL_STORE_ENV,
    TEST_OPTIONS_ENV,
    CancelToken,
    EngineCore,
    ForwardItem,
    ModelInfo,
    ModelStoreRefused,
    OutputMode,
    file_sha256,
    model_store,
    test_options_enabled,
)
from shard_engine_llama import _abi, _self_test, _state
from shard_engine_llama._gguf import (
    GGUFHeader,
    GGUFValidationError,
    ShardingRefusedError,
    model_info,
    split_model,
    validate_gguf,
)
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._gguf.hyperparameters import (
    hyperparameters,
    kv_row_bound,
    largest_count,
)
from shard_engine_llama._gguf.integrity import ShardIntegrityError, verify_shard
from shard_engine_llama._gguf.store import FileIdentity, file_identity, hash_cache
from shard_engine_llama._gguf.writer import (
    ShardLayout,
    planned_layout,
    shard_file_name,
    shard_layout,
)
from shard_engine_llama._sealed import SealedCopy, sealed_copies_supported

_log = logging.getLogger("shard_engine.llama")

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]

ENGINE_VERSION: Final = "0.1.0"
_MAX_SEQUENCES: Final = 256  # llama.cpp's LLAMA_MAX_SEQ
_MAX_SLOW_FORWARD_US: Final = 100_000
_MAX_THREADS: Final = 512  # ggml's GGML_MAX_N_THREADS
_MAX_CONTEXT_CELLS: Final = 2**32 - 1  # llama_context_params.n_ctx is a uint32_t
_KV_CELL_PAD: Final = 256  # llama.cpp pads each sequence's KV stream to this many cells

_self_test_lock = threading.Lock()
_self_test_result: _self_test.SelfTestReport | None = None


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
      row's magnitude, measured per weight type (see ``_declared_determinism``), since
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


def _run_self_test() -> _self_test.SelfTestReport:
    global _self_test_result  # noqa: PLW0603 - once per process, shared by every engine
    with _self_test_lock:
        if _self_test_result is None:
            _self_test_result = _self_test.self_test()
        return _self_test_result


class _PinnedFiles:
    """Files opened once, then read only through their ``/proc/self/fd`` links.

    Validation, hashing and llama.cpp's own open all go through the link, so they see the one
    file that was opened first: a name renamed over or a symlink swapped (and swapped back)
    between the checks and the load cannot slip another file in. Without procfs the names are
    used as they are (the identity checks still catch a change that persists).
    """

    def __init__(self) -> None:
        self._descriptors: list[int] = []
        self._names: dict[str, str] = {}
        # Each pinned file's identity when it was pinned, before any check read it.
        self._identities: dict[str, FileIdentity] = {}
        # The private copy of the file llama.cpp will load (LlamaOptions.private_copy).
        self.copy: SealedCopy | None = None

    def pin(self, path: Path) -> Path:
        # O_NONBLOCK: a name swapped to a FIFO must not block the open (the reader then refuses
        # anything but a regular file).
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._descriptors.append(descriptor)
        link = Path(f"/proc/self/fd/{descriptor}")
        pinned = link if link.exists() else path
        if pinned == link:
            self._names[str(link)] = str(path)
        with contextlib.suppress(OSError):
            self._identities[str(pinned)] = file_identity(pinned)
        return pinned

    def unchanged_since_pinned(self, pinned: Path, identity: FileIdentity) -> bool:
        """Whether ``identity`` (taken after the checks) is the one ``pinned`` had when it was
        pinned: a file written between the two was checked in no single version."""
        return self._identities.get(str(pinned)) == identity

    def private_copy(self, pinned: Path) -> SealedCopy:
        """A new, empty private copy for ``pinned`` (the file llama.cpp will load), refused
        with ResourceExhausted when the memory it needs is not available."""
        size = os.stat(pinned).st_size
        available = _available_memory()
        if available is not None and size > available:
            raise ResourceExhausted(
                f"a private copy of {self.name(pinned)} needs {size / 2**30:.2f} GiB and "
                f"{available / 2**30:.2f} GiB are available; the option private_copy=false "
                "maps the file instead (shared page cache, but exposed to changes of the file)",
                retryable=False,
                details={"resource": "memory", "bytes": size, "available": available},
            )
        if self.copy is not None:
            self.copy.close()
        self.copy = SealedCopy(f"shard-engine:{self.name(pinned).name}")
        return self.copy

    def name(self, path: Path) -> Path:
        return Path(self._names.get(str(path), str(path)))

    def named(self, text: str) -> str:
        """``text`` with every pinned link replaced by the name it was opened as."""
        for link in sorted(self._names, key=len, reverse=True):
            text = text.replace(link, self._names[link])
        return text

    def close(self) -> None:
        while self._descriptors:
            os.close(self._descriptors.pop())
        if self.copy is not None:
            # A mapping llama.cpp made of the copy keeps it alive.
            self.copy.close()
            self.copy = None

    def open_validated(self, named: Path) -> tuple[Path, GGUFHeader]:
        """Pin the GGUF file ``named`` and validate it through the pin, with its family's
        layout known: what stands between any file and llama.cpp opening it. Raises
        InvalidRequest (not a regular file), GGUFValidationError (see :meth:`refusal`) and
        UnsupportedFeature (a family whose layout is not checked)."""
        if not named.is_file():
            problem = "is not a regular file" if named.exists() else "does not exist"
            raise InvalidRequest(f"model file {named} {problem}")
        source = self.pin(named)
        header = validate_gguf(source)
        if header.architecture not in FAMILIES:
            # Without a known layout the validator cannot keep files llama.cpp aborts on away.
            raise UnsupportedFeature(
                f"architecture-unknown-layout: {header.architecture!r} is not one of the families "
                f"whose layout is checked before llama.cpp opens a file ({sorted(FAMILIES)})",
                details={"rule": "architecture-unknown-layout"},
            )
        return source, header

    def refusal(self, error: GGUFValidationError) -> InvalidRequest:
        """What a validation failure is to the caller: InvalidRequest naming the file as it was
        opened, with the rule and the field in ``details``."""
        details: dict[str, str | int | float | bool | None] = {"rule": error.rule}
        if error.field:
            details["field"] = error.field
        return InvalidRequest(self.named(str(error)), details=details)


@dataclass(frozen=True)
class _ShardChoice:
    """What ``_open`` loads: the file (a pinned link, see :class:`_PinnedFiles`), the model
    fingerprint and vocabulary size it reports, the given model's parsed header, and how the
    runtime drives the file."""

    path: Path
    fingerprint: str
    vocab_size: int
    header: GGUFHeader
    layout: ShardLayout
    # The file's identity once verified: it must be unchanged after llama.cpp has mapped it.
    identity: FileIdentity = field(default_factory=lambda: FileIdentity("", 0, 0, 0, 0, 0))

    def verified(self, pins: _PinnedFiles) -> _ShardChoice:
        """This choice with the file's identity now, which must be the one it had when it was
        pinned (before it was validated and hashed)."""
        identity = file_identity(self.path)
        if not pins.unchanged_since_pinned(self.path, identity):
            raise ShardIntegrityError(f"{pins.name(self.path)} changed while it was being checked")
        return replace(self, identity=identity)


def _store_write_error(store: Path, directory: Path, error: OSError) -> InvalidRequest:
    """What a failure to write a shard into the model store is: the store named, with the
    system's reason and the path it failed on."""
    return InvalidRequest(
        f"cannot write the shard into the model store {store}: "
        f"{error.strerror or error} ({error.filename or directory})",
        details={"path": str(store)},
    )


def _store_writable(directory: Path) -> bool:
    """Whether this process may create ``directory``'s lock file and shard files: the nearest
    existing one of ``directory``'s parents is writable (``os.access``, which says no on a
    read-only mount even to root)."""
    for candidate in (directory.parent, *directory.parent.parents):
        if candidate.exists():
            return os.access(candidate, os.W_OK | os.X_OK)
    return False


@contextlib.contextmanager
def _store_lock(store: Path, directory: Path) -> Iterator[bool]:
    """An exclusive ``flock`` on ``<directory>.lock`` (per open file, so threads of one
    process exclude each other too) for as long as the block runs; yields whether the store
    can be written.

    A store this process cannot write (a read-only mount, another user's directory) can
    still serve shards already in it: the lock file is then opened read-only when it exists
    (``flock`` needs no write permission, so writers elsewhere are still excluded) and no
    lock is taken when it does not, and the block must only read.
    """
    lock_path = directory.with_name(directory.name + ".lock")
    writable = _store_writable(directory)
    try:
        if writable:
            directory.parent.mkdir(parents=True, exist_ok=True)
            descriptor: int | None = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        else:
            try:
                descriptor = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                descriptor = None
    except OSError as error:
        raise _store_write_error(store, directory, error) from error
    try:
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield writable
    finally:
        if descriptor is not None:
            os.close(descriptor)


def _usable_store(explicit: str | None) -> Path | None:
    """The model store for the persistent hash cache, or None when none is usable: a full model
    runs from where it is and needs no store."""
    try:
        return model_store(explicit)
    except ModelStoreRefused:
        return None


class LlamaEngine(EngineCore):
    """Runs layers ``[start, end)`` of a GGUF model with llama.cpp.

    ``LoadConfig.shard.model`` is a path to the full GGUF model (the engine writes its own shard
    file into the model store, reusing a verified one) or to a shard file written by
    ``shard-engine split`` whose range matches the spec.
    """

    engine_name = "llama"
    # Every array _forward / _forward_batch return is allocated for that call (_abi's
    # _read_logits, the capture destination, run_batch's reordering) and never written again:
    # the core uses it as the result's payload without copying (1 MiB per token at a 262k
    # vocabulary).
    rows_private = True

    def __init__(self) -> None:
        super().__init__()
        self._runtime: _abi.ShardRuntime | None = None
        self._snapshots: dict[int, bytes] = {}
        # Per slot: the lowest position a truncating prefill may go back to (see
        # _state.SequenceState.window_floor); only slots restored from a state have one.
        self._window_floors: dict[int, int] = {}
        self._untouched: set[int] = set()
        self.result_settings: tuple[tuple[str, str], ...] = ()
        self._state_identity = b""
        self._inject_crash = False
        self._inject_abort = False
        # The request whose forward is inside llama.cpp now, and whether close() has begun:
        # cancel() and close() turn them into the runtime's abort flag (see _start_forward).
        self._abort_lock = threading.Lock()
        self._running_token: CancelToken | None = None
        self._closing = False
        self.shard_path: Path | None = None
        self.self_test_report: _self_test.SelfTestReport | None = None

    # ------------------------------------------------------------------ backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
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
            raise InvalidRequest(
                f"tolerance must be a finite number >= 0, got {options.tolerance!r}"
            )
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
        if options.self_test:
            try:
                self.self_test_report = _run_self_test()
            except _abi.LlamaRuntimeError as error:
                raise EngineCrashed(f"llama.cpp start-up self-test failed: {error}") from error
        pins = _PinnedFiles()
        try:
            choice = self._shard_file(config, options, pins)
            determinism = _declared_determinism(
                choice.header, options.tolerance, config.boundary_dtype
            )
            load_from = choice.path
            if pins.copy is not None:
                if not pins.copy.complete:
                    # The digest was cached for the file's identity: the copy needs a read of
                    # its own, and the identity check below proves it copied that version.
                    pins.copy.fill(choice.path)
                load_from = pins.copy.seal(choice.identity.size)
            _check_memory(choice.header, choice.layout, config, options)
            runtime = _abi.ShardRuntime(
                pins.name(choice.path),
                load_from=load_from,
                # One spare sequence (slot max_sessions): a new session evicting the LRU one
                # runs in it, so a failed or cancelled forward evicts nothing.
                n_ctx=config.max_context * (config.max_sessions + 1),
                n_seq_max=config.max_sessions + 1,
                n_threads=config.n_threads or _available_cores(),
                n_batch=config.max_batch_tokens,
                # llama.cpp needs n_ubatch <= n_batch; a smaller batch bound caps it (the same
                # way on every shard of a pipeline loaded with the same config).
                n_ubatch=min(options.n_ubatch, config.max_batch_tokens),
                flash_attn=options.flash_attn,
                kv_type=options.kv_type,
                is_head=choice.layout.is_head,
                is_tail=choice.layout.is_tail,
                last_layer_index=choice.layout.last_layer_index,
                native_callbacks=options.native_callbacks,
                abort_poll_delay_s=options.slow_forward_us / 1e6,
                kv_row_elements=kv_row_bound(choice.header),
            )
            if file_identity(choice.path) != choice.identity:
                # Rewritten in place between verification and llama.cpp mapping it (or
                # copying it).
                runtime.close()
                raise ShardIntegrityError(
                    f"{pins.name(choice.path)} changed while it was being loaded"
                )
        except GGUFValidationError as error:
            raise pins.refusal(error) from error
        except ShardingRefusedError as error:
            rule = error.rule.split(":", 1)[0]
            raise UnsupportedFeature(pins.named(str(error)), details={"rule": rule}) from error
        except _abi.ModelLoadError as error:
            raise InvalidRequest(pins.named(str(error))) from error
        except OSError as error:
            raise InvalidRequest(
                f"cannot read model {config.shard.model!r}: {pins.named(str(error))}"
            ) from error
        finally:
            # llama.cpp holds its own descriptor and mapping by now.
            pins.close()
        self._runtime = runtime
        # A long prefill runs in llama.cpp's own micro-batches, so other sessions' decodes can
        # run between them; each sequence has its own KV stream (kv_unified off), so the
        # chunks give exactly what one llama_decode of the whole prefill gives.
        self.prefill_chunk_tokens = runtime.settings.n_ubatch
        self.result_settings = _result_settings(runtime.settings, runtime.n_ctx_seq)
        self._state_identity = _state_identity(
            choice.fingerprint,
            config.shard.start,
            config.shard.end,
            config.shard.n_layers,
            self.result_settings,
        )
        self.shard_path = pins.name(choice.path)
        self._inject_crash = options.inject_crash
        self._inject_abort = options.inject_abort
        _log.info(
            "loaded %s layers [%d, %d) of %d (%d threads)",
            pins.name(choice.path).name,
            config.shard.start,
            config.shard.end,
            config.shard.n_layers,
            config.n_threads or _available_cores(),
        )
        return ModelInfo(
            engine_version=ENGINE_VERSION,
            evidence="real",
            model_fingerprint=choice.fingerprint,
            hidden_size=runtime.n_embd,
            vocab_size=choice.vocab_size,
            determinism=determinism,
            features=Features(
                cancel=True,
                cancel_latency_ms=50.0,
                batched_decode=True,
                truncate=True,
                session_migration=True,
            ),
            # Converted by the core on the way out (round to nearest even) and in (exact):
            # llama.cpp sees f32 rows either way.
            boundary_dtypes=("f32", "f16", "bf16"),
            max_context=runtime.n_ctx_seq,
            max_sessions=config.max_sessions,
            spare_slot=True,
            settings=self.result_settings,
        )

    @staticmethod
    def _file_digest(source: Path, store: Path | None, copy: SealedCopy | None = None) -> str:
        """``source``'s sha256 from the hash cache, checked to be 64 hex digits before it is
        reported as a fingerprint or names a directory of the store (a digest with a "/" or
        ".." in it would put the shard outside the store). ``copy``: when the file is hashed,
        the same read fills it."""
        from shard_engine_llama._gguf.store import is_sha256_hex

        digest = hash_cache().digest(
            source,
            "file",
            file_sha256 if copy is None else (lambda target: copy.hash_copying(target, None)),
            store=store,
        )
        if not is_sha256_hex(digest):
            raise ShardIntegrityError(f"{source}: its digest {digest[:80]!r} is not sha256 hex")
        return digest

    def _shard_file(
        self, config: LoadConfig, options: LlamaOptions, pins: _PinnedFiles
    ) -> _ShardChoice:
        """The file to load for this shard, what it reports, and how the runtime drives it.

        The given model's header is parsed once here and handed on (a 262k vocabulary takes
        seconds to parse); whole-file digests come from the per-identity hash cache. Every
        file is pinned before it is checked, and the pinned file is what llama.cpp loads (or
        its private copy, ``pins.copy``, filled by the read that hashes it, if one does).
        """
        spec = config.shard
        named = Path(spec.model)
        source, header = pins.open_validated(named)
        info = model_info(header)
        if info.is_shard:
            start = int(header.get_int("shard.start"))
            end = int(header.get_int("shard.end"))
            total = int(header.get_int("shard.n_layers_total"))
            if (start, end, total) != (spec.start, spec.end, spec.n_layers):
                raise ShardMismatch(
                    f"{named.name} holds layers [{start}, {end}) of {total}; the spec asks for "
                    f"[{spec.start}, {spec.end}) of {spec.n_layers}"
                )
            # The source fingerprint is only reported for bytes proven to be what split wrote.
            verify_shard(
                header,
                store=_usable_store(options.model_store),
                copy=pins.private_copy(source) if options.private_copy else None,
            )
            fingerprint = header.get_str("shard.source_sha256")
            vocab_entry = header.metadata.get("shard.source_vocab_size")
            vocab = int(vocab_entry.value) if vocab_entry is not None else info.vocab_size  # type: ignore[arg-type]
            choice = _ShardChoice(source, fingerprint, vocab, header, shard_layout(header))
            return choice.verified(pins)
        if info.n_layers != spec.n_layers:
            raise ShardMismatch(
                f"{named.name} has {info.n_layers} layers; the spec says {spec.n_layers}"
            )
        if spec.role == "full":
            fingerprint = self._file_digest(
                source,
                _usable_store(options.model_store),
                pins.private_copy(source) if options.private_copy else None,
            )
            return _ShardChoice(
                source, fingerprint, info.vocab_size, header, shard_layout(header)
            ).verified(pins)
        if not info.shardable:
            raise ShardingRefusedError(info.refusal or "not shardable")
        store = model_store(options.model_store)
        digest = self._file_digest(source, store)
        # Named by the model and its digest (two models of one name do not share a directory)
        # and written under a lock: engines of several processes or threads that load the same
        # range at once take turns, and all but the first reuse the verified file instead of
        # writing the same ".partial" file over each other. The lock is held until the shard
        # is pinned, so no one rewrites it between the write and the pin.
        directory = (
            store / "shards" / f"{named.stem}-{digest[:16]}" / f"{spec.start:03d}-{spec.end:03d}"
        )
        with _store_lock(store, directory) as writable:
            if writable:
                try:
                    manifest = split_model(
                        named,
                        [(spec.start, spec.end)],
                        directory,
                        partial=True,
                        header=header,
                        hash_store=store,
                    )
                except OSError as error:
                    raise _store_write_error(store, directory, error) from error
                if manifest.source_sha256 != digest:
                    # The name was pointed at another file while the shard was being written.
                    raise ShardIntegrityError(f"{named} changed while its shard was being written")
                shard_name = manifest.shard_path(0)
                action = "reused" if manifest.reused and manifest.reused[0] else "wrote"
            else:
                # A read-only store: only a shard already in it can serve, and it is checked
                # below exactly as a reused one (its own digest, source and range).
                shard_name = directory / shard_file_name(
                    named.resolve(), spec.start, spec.end, spec.n_layers
                )
                if not shard_name.is_file():
                    raise InvalidRequest(
                        f"the model store {store} is not writable and holds no shard "
                        f"[{spec.start}, {spec.end}) of {named.name} to reuse "
                        f"({shard_name.relative_to(store)}): make the store writable, or "
                        "choose a writable one (the model_store option or "
                        f"{MODEL_STORE_ENV}), or give the engine a shard written by "
                        "shard-engine split",
                        details={"path": str(store), "rule": "model-store-read-only"},
                    )
                action = "reused (read-only store)"
            shard = pins.pin(shard_name)
        layout = planned_layout(header, spec.start, spec.end)
        _log.info(
            "shard [%d, %d) of %s: %s %s",
            spec.start,
            spec.end,
            named.name,
            action,
            shard_name.name,
        )
        # The store's shard file (pinned above) is checked again: what llama.cpp opens must be
        # the shard of this source and range, with the bytes its digest records.
        shard_header = validate_gguf(shard)
        verify_shard(
            shard_header,
            store=store,
            copy=pins.private_copy(shard) if options.private_copy else None,
        )
        if (
            shard_header.get_str("shard.source_sha256") != digest
            or shard_header.get_int("shard.start") != spec.start
            or shard_header.get_int("shard.end") != spec.end
        ):
            raise ShardIntegrityError(
                f"{shard_name} is not the shard [{spec.start}, {spec.end}) of {named}"
            )
        return _ShardChoice(shard, digest, info.vocab_size, header, layout).verified(pins)

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        runtime = self._require_runtime()
        self._injected_crash()
        if item.start_pos < item.committed_length:
            self._check_window_floor(item.slot, item.start_pos, item.committed_length)
            # Truncate-and-append: keep the whole sequence so a failure restores it exactly.
            try:
                self._snapshots[item.slot], _ = runtime.save_sequence(item.slot)
            except _abi.LlamaRuntimeError as error:
                raise _map_runtime_error(error) from error
            runtime.seq_rm(item.slot, item.start_pos, -1)
        self._start_forward(runtime, token)
        try:
            rows = runtime.run(
                item.slot,
                item.start_pos,
                tokens=item.tokens,
                embeddings=item.hidden,
                all_logits=output == "all",
            )
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        finally:
            self._end_forward(runtime)
        if output != "hidden":
            # The logits were hashed as they were copied out of llama.cpp's buffer.
            self._record_digest(rows, *runtime.row_digests[0])
        return rows

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[npt.NDArray[np.float32]]:
        runtime = self._require_runtime()
        self._injected_crash()
        batch = [
            _abi.BatchItem(
                seq_id=item.slot,
                pos=item.start_pos,
                token=None if item.tokens is None else int(item.tokens[0]),
                embedding=None if item.hidden is None else item.hidden[0],
            )
            for item in items
        ]
        self._start_forward(runtime, token)
        try:
            rows = runtime.run_batch(batch)
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        finally:
            self._end_forward(runtime)
        results = [rows[index : index + 1] for index in range(len(items))]
        if output == "last":
            for result, digest in zip(results, runtime.row_digests, strict=True):
                self._record_digest(result, *digest)
        return results

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        runtime = self._require_runtime()
        if slot in self._untouched:
            # The forward refused before it changed the sequence.
            self._untouched.discard(slot)
            return
        runtime.seq_rm(slot, start_pos, -1)
        snapshot = self._snapshots.pop(slot, None)
        if snapshot is not None:
            restored = runtime.restore_sequence(slot, snapshot)
            self._set_window_floor(slot, restored)
        elif runtime.seq_pos_max(slot) + 1 > committed_length:
            runtime.seq_rm(slot, committed_length, -1)

    def _commit(self, slot: int) -> None:
        self._snapshots.pop(slot, None)
        self._untouched.discard(slot)

    def _drop(self, slot: int) -> None:
        self._snapshots.pop(slot, None)
        self._window_floors.pop(slot, None)
        self._require_runtime().seq_rm(slot, -1, -1)

    # ------------------------------------------------------------------ session transfer

    def _export_state(self, slot: int, length: int) -> bytes:
        """The portable llama.cpp state of the session in ``slot`` (see ``_state``): the KV of
        positions ``[0, length)`` of every layer of this shard (a sliding-window cache: only
        its window). The slot is unchanged."""
        try:
            blob, state = self._require_runtime().save_sequence(slot, self._state_identity)
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        if state.length != length:
            raise EngineCrashed(
                f"slot {slot} holds {state.length} positions, the session {length}",
                details={"slot": slot},
            )
        return blob

    def max_state_bytes(self, length: int) -> int:
        """An upper bound of an exported state of ``length`` positions (identity prefix and
        the portable KV form at this shard's widest rows), which a server checks an import
        stream's header against before it reads the body."""
        return len(self._state_identity) + self._require_runtime().max_state_bytes(length)

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        """Install a state from :meth:`_export_state` of an engine with the same shard and
        settings into the empty ``slot``. Every field llama.cpp would trust, the row widths
        against this shard's and every K and V value are checked first (``_state.parse``): a
        malformed, truncated, foreign or poisoned state is InvalidRequest, and llama.cpp has
        not seen it."""
        runtime = self._require_runtime()
        self._window_floors.pop(slot, None)
        identity = self._state_identity
        if state[: len(identity)] != identity:
            # Geometry alone cannot tell two models (or settings) apart: llama.cpp would load
            # a same-shaped model's KV and continue with it.
            raise InvalidRequest(
                "session state is not of this model, shard range and settings "
                "(its identity prefix differs)"
            )
        try:
            restored = runtime.restore_sequence(
                slot, memoryview(state)[len(identity) :], expect_length=length
            )
        except _abi.InvalidInputError as error:
            raise InvalidRequest(f"session state refused: {error}") from error
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        self._set_window_floor(slot, restored)

    def _set_window_floor(self, slot: int, state: _state.SequenceState) -> None:
        floor = state.window_floor(self._require_runtime().n_swa)
        if floor:
            self._window_floors[slot] = floor
        else:
            self._window_floors.pop(slot, None)

    def _check_window_floor(self, slot: int, start_pos: int, committed_length: int) -> None:
        """A restored sliding-window cache holds only the window of its last position, so a
        truncation further back than that would attend cells it does not have."""
        floor = self._window_floors.get(slot, 0)
        if 0 < start_pos < floor:
            self._untouched.add(slot)
            raise CacheMiss(
                f"this session was restored from a state whose sliding-window layers hold "
                f"positions from {floor - self._require_runtime().n_swa + 1} on; truncating to "
                f"{start_pos} needs earlier ones: prefill from position 0 (or from {floor} on)",
                committed_length=committed_length,
                reason="window",
                details={"window_floor": floor},
            )
        if start_pos == 0:
            self._window_floors.pop(slot, None)

    def _close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    # ------------------------------------------------------------------ cancellation

    def _start_forward(self, runtime: _abi.ShardRuntime, token: CancelToken) -> None:
        """Make ``token`` the running request. The runtime polls a native flag, not the token:
        a cancel that lands before this point is seen by ``token.check()`` below, one after it
        finds the token running and sets the flag (both sides hold ``_abort_lock``)."""
        with self._abort_lock:
            runtime.clear_abort()
            self._running_token = token
            if self._closing:
                runtime.request_abort()
        token.check()

    def _end_forward(self, runtime: _abi.ShardRuntime) -> None:
        with self._abort_lock:
            self._running_token = None
            runtime.clear_abort()

    def _abort_if_cancelled(self) -> None:
        with self._abort_lock:
            token = self._running_token
            runtime = self._runtime
            if token is not None and runtime is not None and (token.cancelled or self._closing):
                runtime.request_abort()

    def cancel(self, request: CancelRequest) -> CancelResult:
        result = super().cancel(request)
        if result.cancelled:
            self._abort_if_cancelled()
        return result

    def close(self) -> None:
        with self._abort_lock:
            self._closing = True
        # A forward in llama.cpp stops at its next node; the core then cancels every token.
        self._abort_if_cancelled()
        super().close()

    def _injected_crash(self) -> None:
        if self._inject_abort:
            _abi.ggml_abort("inject_abort option")
        if self._inject_crash:
            raise EngineCrashed("injected crash (inject_crash option)")

    def _require_runtime(self) -> _abi.ShardRuntime:
        if self._runtime is None:
            raise EngineCrashed("llama runtime is not open")
        return self._runtime


_FLOAT_TYPES: Final = frozenset({"F32", "F64"})
_HALF_TYPES: Final = frozenset({"F16", "BF16"})


def _available_cores() -> int:
    """The cores this process may run on: llama.cpp's threads spin at barriers, so more
    threads than free cores collapses throughput (measured: 12 ms -> 3.5 s per token)."""
    return max(1, len(os.sched_getaffinity(0)))


def _available_memory() -> int | None:
    """Bytes this process can still allocate without swapping, its cgroup's OOM killer or its
    address-space limit: ``MemAvailable``, bounded by the cgroup v2 limit left and by
    ``RLIMIT_AS`` less the address space in use; None when none is known."""
    bounds: list[int] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                in_use = next(
                    int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:")
                )
            bounds.append(max(0, soft - in_use))
        except (OSError, ValueError, IndexError, StopIteration):
            bounds.append(soft)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    bounds.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text(encoding="ascii").strip()
        if limit != "max":
            used = Path("/sys/fs/cgroup/memory.current").read_text(encoding="ascii").strip()
            bounds.append(max(0, int(limit) - int(used)))
    except (OSError, ValueError):
        pass
    return min(bounds) if bounds else None


def _check_memory(
    header: GGUFHeader, layout: ShardLayout, config: LoadConfig, options: LlamaOptions
) -> None:
    """Refuse a context llama.cpp cannot address or this machine cannot hold, before llama.cpp
    allocates (and clears) it.

    llama.cpp allocates every sequence's KV stream up front (``max_context`` positions, padded
    to 256 cells, for each session and the spare one: 3.4 GB for a 1 MB model at a 131,072
    context and 16 sessions), the attention scores of one micro-batch over a whole stream and a
    tail's logits for a full batch; a context that does not fit gets the process killed by the
    kernel instead of an error. ``n_ctx`` is 32-bit in llama.cpp: a larger product wrapped
    around silently (``max_context`` 2**24 with 255 sessions loaded with 256 positions).
    """
    n_seq = config.max_sessions + 1
    cells = config.max_context * n_seq
    if cells > _MAX_CONTEXT_CELLS:
        raise InvalidRequest(
            f"max_context {config.max_context} x {n_seq} sequences ({config.max_sessions} "
            f"sessions and a spare) = {cells} KV cells exceeds llama.cpp's limit of "
            f"{_MAX_CONTEXT_CELLS} (n_ctx is 32-bit)",
            details={"cells": cells, "limit": _MAX_CONTEXT_CELLS},
        )
    family = FAMILIES[header.architecture]
    h = hyperparameters(header, family)
    prefix = header.architecture + ".attention."
    heads = largest_count(header, prefix + "head_count", h.n_head)
    heads_kv = largest_count(header, prefix + "head_count_kv", h.n_head_kv)
    n_ctx_seq = -(-config.max_context // _KV_CELL_PAD) * _KV_CELL_PAD
    # The file's blocks: the shard's own (smollm3 shards may lead with identity blocks) and
    # the identity block a non-tail shard ends in.
    n_blocks = layout.last_layer_index + 1 + (0 if layout.is_tail else 1)
    element = 4 if options.kv_type == "f32" else 2
    kv = n_ctx_seq * n_seq * n_blocks * heads_kv * (h.n_embd_head_k + h.n_embd_head_v) * element
    n_ubatch = min(options.n_ubatch, config.max_batch_tokens)
    scores = 0 if options.flash_attn else n_ubatch * n_ctx_seq * heads * 4
    logits = max(config.max_batch_tokens, n_seq) * h.n_vocab * 4 if layout.is_tail else 0
    needed = kv + scores + logits
    available = _available_memory()
    if available is not None and needed > available:
        gib = 2**30
        raise ResourceExhausted(
            f"this context needs about {needed / gib:.2f} GiB (KV cache {kv / gib:.2f} GiB for "
            f"{n_seq} sequences of {n_ctx_seq} positions, attention scores "
            f"{scores / gib:.2f} GiB, logits {logits / gib:.2f} GiB for {config.max_batch_tokens}"
            f" rows) and {available / gib:.2f} GiB are available: lower max_context, "
            "max_sessions or max_batch_tokens",
            retryable=False,
            details={"resource": "memory", "bytes": needed, "available": available},
        )


_STATE_MAGIC: Final = b"SELS\x01"  # shard-engine llama state, layout 1


def _state_identity(
    fingerprint: str, start: int, end: int, n_layers: int, settings: tuple[tuple[str, str], ...]
) -> bytes:
    """The prefix of every exported state: the layout tag and a digest of the model, the shard
    range and the result settings, so a state is refused by any other engine before llama.cpp
    reads it, whatever checked it upstream."""
    digest = hashlib.sha256()
    digest.update(msgspec.msgpack.encode([fingerprint, start, end, n_layers, list(settings)]))
    return _STATE_MAGIC + digest.digest()


def _result_settings(settings: _abi.ContextSettings, n_ctx_seq: int) -> tuple[tuple[str, str], ...]:
    """The context settings a session's state and its continuation depend on (``ModelInfo
    .settings``: a snapshot moves only between engines whose settings are equal).

    In: the KV tensor type (the state's bytes and every later attention); flash attention
    (another kernel, and V stored untransposed); the effective micro-batch (a later prefill is
    split into micro-batches of this size, and llama.cpp picks kernels by batch shape); the
    per-sequence context (what fits; llama.cpp pads the attention span to 256 cells, so
    results are not known to depend on it, kept equal to be safe); the full-size sliding
    window cache and per-sequence KV streams (the state's layout); the llama.cpp build (the
    state has no version of its own). Out: threads (ggml's CPU kernels give every output
    element to one thread, so results do not depend on the count: checked bitwise), the batch
    bound (a batch is cut into the same micro-batches whatever it is) and the session count
    (the portable state has one stream whatever the exporter's count).
    """
    return (
        ("flash_attn", "true" if settings.flash_attn else "false"),
        ("kv_type", settings.kv_type),
        ("kv_unified", "false"),
        ("llama_cpp_python", _abi.LLAMA_CPP_PYTHON_VERSION),
        ("n_ctx_seq", str(n_ctx_seq)),
        ("n_ubatch", str(settings.n_ubatch)),
        ("swa_full", "true"),
    )


_BOUNDARY_TOLERANCE: Final[dict[str, Tolerance]] = {
    "f32": Tolerance(),
    "f16": Tolerance(absolute=1e-3, relative=1e-2),
    "bf16": Tolerance(absolute=1e-2, relative=0.1),
}
"""The logits drift of a pipeline whose boundaries carry 16-bit hidden states, against the
same split with f32 boundaries (which equals the unsplit model bit for bit), relative to each
row's magnitude.

Measured (teacher-forced over prompt + 32 greedy tokens, all rows; 2- and 3-way splits):
generated llama and gemma3 models (n_embd 64 and 512, F32 and F16, logits up to ~5): bf16 up to
0.012 (~2.4e-3 of the row), f16 up to 0.0022 (~4.4e-4); gemma3-270m Q4_K_M (logits up to ~31):
bf16 up to 1.19 (~0.04), f16 refused (hidden states reach ~8.3e4, beyond its range). bf16 keeps
8 significant bits, so its drift grows with the logit scale: 0.1 covers the real model with
margin; f16 is declared at ~20x its measurement because it is only usable where states stay
below 65504."""

_BOUNDARY_ROUNDING: Final[dict[str, float]] = {"f32": 0.0, "f16": 0.0, "bf16": 2.0**-7}
"""Hidden states leave a shard rounded to the boundary dtype: when a batch-shape difference
moves a value across a rounding step, the emitted rows differ by one step (relative 2**-8 of
the value for bf16, bounded by the row's magnitude; declared with a factor 2). The conformance
suite already allows one f16 step itself."""


def _declared_determinism(
    header: GGUFHeader, explicit: float | None, boundary_dtype: str
) -> Determinism:
    """What the engine declares: splits are bit-exact with f32 boundaries (the split recipe
    reproduces unsplit llama.cpp; a 16-bit boundary rounds the hidden states), batch shapes are
    not (llama.cpp picks other kernels and groupings for other batch and ubatch sizes), within
    a tolerance per output kind chosen by the widest-error weight type of the model (a shard
    carries its source's weight types), widened by the boundary dtype's drift.

    The weight-type tolerances are the largest per-row differences measured by
    ``tools/measure_tolerance.py`` (one prefill of 40 positions vs. chunks of 1, 3, 7, 16 and
    17 rows and a 3-session decode_batch, on a full, a head and a middle shard, n_ubatch 16,
    relative to each row's largest magnitude), with a margin of about 2x or more:

    - F32/F64 weights: generated llama 7.4e-7 (logits) / 5.1e-7 (hidden), generated gemma3
      3.6e-5 / 2.2e-5 -> relative 2e-4 for both;
    - F16/BF16: generated llama 7.6e-4 / 4.9e-4, generated gemma3 4.9e-4 / 1.2e-4 -> 5e-3;
    - quantized: gemma3-270m Q4_K_M 0.205 / 0.095 on one x86-64 host (6 sequences, 3,654 rows)
      and 0.506 / 0.207 on an AMD EPYC host (12 sequences, 7,308 rows) — llama.cpp's own
      ``Llama.eval`` shows the same differences between batch sizes (the same 6.85 at the same
      row), so they are the backend's and its kernels', not the engine's; generated Q8_0 0 / 0.
      The logits maximum is one row of small magnitude (6.85 of 13.5): no relative bound a
      wrong output can still fail (the conformance suite accepts at most 0.5) covers it, while
      at a relative 0.4 an absolute 1.44 covers every row -> logits absolute 4.0 + relative
      0.4 (9.4 at that row). Hidden relative 0.25: gemma3's hidden rows are dominated by a few
      huge channels (~4,000 at layer 9), so the first 6 positions of another prompt differ by
      only 0.29-0.33 of a row at most; a bound must lie between that and the 0.207 measured.

    ``explicit`` (the ``tolerance`` option) declares one absolute bound for both kinds instead,
    as before per-kind tolerances existed."""
    split_exact = boundary_dtype == "f32"
    if explicit is not None:
        return Determinism(
            deterministic=True, split_exact=split_exact, tolerance=explicit, batch_invariant=False
        )
    types = {record.ggml_type.name for record in header.tensors.values()}
    if types <= _FLOAT_TYPES:
        logits = hidden = Tolerance(absolute=1e-5, relative=2e-4)
    elif types <= _FLOAT_TYPES | _HALF_TYPES:
        logits = hidden = Tolerance(absolute=1e-3, relative=5e-3)
    else:
        logits = Tolerance(absolute=4.0, relative=0.4)
        hidden = Tolerance(absolute=1e-2, relative=0.25)
    boundary = _BOUNDARY_TOLERANCE[boundary_dtype]
    rounding = _BOUNDARY_ROUNDING[boundary_dtype]
    return Determinism(
        deterministic=True,
        split_exact=split_exact,
        batch_invariant=False,
        logits_tolerance=Tolerance(
            absolute=max(logits.absolute, boundary.absolute),
            relative=max(logits.relative, boundary.relative),
        ),
        hidden_tolerance=Tolerance(
            absolute=hidden.absolute, relative=max(hidden.relative, rounding)
        ),
    )


def _map_runtime_error(error: _abi.LlamaRuntimeError) -> Exception:
    """The contract error a runtime failure stands for."""
    if isinstance(error, _abi.AbortedError):
        return Cancelled(f"llama.cpp stopped at the next node: {error}")
    if isinstance(error, _abi.KVFullError):
        return ResourceExhausted(str(error), details={"resource": "kv_cells"})
    if isinstance(error, _abi.InvalidInputError):
        return InvalidRequest(str(error))
    return EngineCrashed(str(error))
