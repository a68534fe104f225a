"""The llama.cpp-backed ShardEngine: one llama_context per shard, one sequence id per session.

The session semantics come from :class:`shard_engine_api.EngineCore`; this module only maps its
backend steps onto :class:`ShardRuntime` and maps runtime failures onto the contract's errors.
Loading draws on its own modules: ``_options`` (the options and limits), ``_shard_files`` (which
file, and the proof it is the right one), ``_memory`` (whether the context fits) and
``_determinism`` (what the engine declares about its results).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
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
    UnsupportedFeature,
)
from shard_engine_api.engine import (
    CancelToken,
    EngineCore,
    ForwardItem,
    ModelInfo,
    OutputMode,
)
from shard_engine_llama import _abi, _self_test, _state
from shard_engine_llama._determinism import declared_determinism
from shard_engine_llama._gguf import GGUFValidationError, ShardingRefusedError
from shard_engine_llama._gguf.hyperparameters import kv_row_bound
from shard_engine_llama._gguf.integrity import ShardIntegrityError
from shard_engine_llama._gguf.store import file_identity
from shard_engine_llama._llama_library import LLAMA_CPP_PYTHON_VERSION, ggml_abort
from shard_engine_llama._memory import available_cores, check_memory
from shard_engine_llama._options import LlamaOptions, checked_options
from shard_engine_llama._shard_files import PinnedFiles, ShardChoice, choose_shard_file

_log = logging.getLogger("shard_engine.llama")

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]

ENGINE_VERSION: Final = "0.1.0"

_self_test_lock = threading.Lock()
_self_test_result: _self_test.SelfTestReport | None = None


def _run_self_test() -> _self_test.SelfTestReport:
    global _self_test_result  # noqa: PLW0603 - once per process, shared by every engine
    with _self_test_lock:
        if _self_test_result is None:
            _self_test_result = _self_test.self_test()
        return _self_test_result


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
        """Load the shard ``config`` names, in phases: check the options and limits, run the
        start-up self-test, choose and verify the file and load its runtime, then take the
        runtime on and say what the engine offers."""
        options = checked_options(config)
        self._run_start_up_self_test(options)
        choice, shard_path, runtime, determinism = self._load_runtime(config, options)
        self._adopt_runtime(config, options, choice, runtime)
        self.shard_path = shard_path
        _log.info(
            "loaded %s layers [%d, %d) of %d (%d threads)",
            shard_path.name,
            config.shard.start,
            config.shard.end,
            config.shard.n_layers,
            config.n_threads or available_cores(),
        )
        return self._model_info(config, choice, runtime, determinism)

    def _run_start_up_self_test(self, options: LlamaOptions) -> None:
        """The start-up self-test (once per process, shared by every engine) when the options
        ask for it; its failure is EngineCrashed."""
        if options.self_test:
            try:
                self.self_test_report = _run_self_test()
            except _abi.LlamaRuntimeError as error:
                raise EngineCrashed(f"llama.cpp start-up self-test failed: {error}") from error

    def _load_runtime(
        self, config: LoadConfig, options: LlamaOptions
    ) -> tuple[ShardChoice, Path, _abi.ShardRuntime, Determinism]:
        """Choose and verify the shard file, check that its context fits, and load it into a
        runtime: the choice, the file's name, the runtime and the declared determinism. Every
        failure is a contract error naming the file as it was opened; the pinned descriptors
        are closed either way."""
        pins = PinnedFiles()
        try:
            choice = choose_shard_file(config, options, pins)
            determinism = declared_determinism(
                choice.header, options.tolerance, config.boundary_dtype
            )
            load_from = choice.path
            if pins.copy is not None:
                if not pins.copy.complete:
                    # The digest was cached for the file's identity: the copy needs a read of
                    # its own, and the identity check below proves it copied that version.
                    pins.copy.fill(choice.path)
                load_from = pins.copy.seal(choice.identity.size)
            check_memory(choice.header, choice.layout, config, options)
            runtime = _new_runtime(config, options, choice, pins.name(choice.path), load_from)
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
        return choice, pins.name(choice.path), runtime, determinism

    def _adopt_runtime(
        self,
        config: LoadConfig,
        options: LlamaOptions,
        choice: ShardChoice,
        runtime: _abi.ShardRuntime,
    ) -> None:
        """Make ``runtime`` this engine's: its prefill chunks, the settings its results and
        exported states depend on, and the test-only injections."""
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
        self._inject_crash = options.inject_crash
        self._inject_abort = options.inject_abort

    def _model_info(
        self,
        config: LoadConfig,
        choice: ShardChoice,
        runtime: _abi.ShardRuntime,
        determinism: Determinism,
    ) -> ModelInfo:
        """What the loaded shard offers, as the core advertises it in ``Capabilities``."""
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
            ggml_abort("inject_abort option")
        if self._inject_crash:
            raise EngineCrashed("injected crash (inject_crash option)")

    def _require_runtime(self) -> _abi.ShardRuntime:
        if self._runtime is None:
            raise EngineCrashed("llama runtime is not open")
        return self._runtime


def _new_runtime(
    config: LoadConfig,
    options: LlamaOptions,
    choice: ShardChoice,
    name: Path,
    load_from: Path,
) -> _abi.ShardRuntime:
    """The runtime of the chosen file (``name`` in messages, read from ``load_from``) with the
    context the load config asks for."""
    return _abi.ShardRuntime(
        name,
        load_from=load_from,
        # One spare sequence (slot max_sessions): a new session evicting the LRU one
        # runs in it, so a failed or cancelled forward evicts nothing.
        n_ctx=config.max_context * (config.max_sessions + 1),
        n_seq_max=config.max_sessions + 1,
        n_threads=config.n_threads or available_cores(),
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
        ("llama_cpp_python", LLAMA_CPP_PYTHON_VERSION),
        ("n_ctx_seq", str(n_ctx_seq)),
        ("n_ubatch", str(settings.n_ubatch)),
        ("swa_full", "true"),
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
