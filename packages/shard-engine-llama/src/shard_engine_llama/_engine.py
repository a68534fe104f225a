"""The llama.cpp-backed ShardEngine: one llama_context per shard, one sequence id per session.

The session semantics come from :class:`shard_engine_api.EngineCore`; this module only maps its
backend steps onto :class:`ShardRuntime` and maps runtime failures onto the contract's errors.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    Cancelled,
    Determinism,
    EngineCrashed,
    Features,
    InvalidRequest,
    LoadConfig,
    ResourceExhausted,
    ShardMismatch,
    UnsupportedFeature,
)
from shard_engine_api.engine import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_llama import _abi
from shard_engine_llama._gguf_split import (
    GGUFHeader,
    GGUFValidationError,
    ModelStoreError,
    ShardingRefusedError,
    model_info,
    resolve_model_store,
    split_model,
    validate_gguf,
)

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]

ENGINE_VERSION: Final = "0.1.0"
_MAX_SEQUENCES: Final = 256  # llama.cpp's LLAMA_MAX_SEQ

_self_test_lock = threading.Lock()
_self_test_result: _abi.SelfTestReport | None = None


class LlamaOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``LoadConfig.options`` of the llama engine.

    - ``n_ubatch``: llama.cpp micro-batch size; every shard of a pipeline must use the same value
      (and the same ``kv_type``, ``flash_attn`` and context settings) for bitwise-equal results.
    - ``kv_type``: "f32" (default; matches a float64 reference) or "f16".
    - ``model_store``: where shard files are written (default: SHARD_ENGINE_MODEL_STORE or
      ~/.cache/shard-engine; /home is refused).
    - ``tolerance``: the max |delta logits| declared for results that are not bitwise equal
      (decode vs. prefill of the same tokens, batched vs. single decode). Default: derived from
      the weights, since llama.cpp picks other kernels for other batch shapes — 1e-3 for F32
      (measured ~1e-6), 1e-2 for F16/BF16, 2.0 for quantized weights (measured up to 1.27 on
      gemma3-270m Q4_K_M, whose logits reach ~22).
    - ``self_test``: run the start-up self-test (a generated model split 2-way, bitwise) before
      the first engine of the process reports ready.
    """

    n_ubatch: int = 512
    kv_type: str = "f32"
    flash_attn: bool = False
    model_store: str | None = None
    tolerance: float | None = None
    self_test: bool = True


def _run_self_test() -> _abi.SelfTestReport:
    global _self_test_result  # noqa: PLW0603 - once per process, shared by every engine
    with _self_test_lock:
        if _self_test_result is None:
            _self_test_result = _abi.self_test()
        return _self_test_result


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(16 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


class LlamaEngine(EngineCore):
    """Runs layers ``[start, end)`` of a GGUF model with llama.cpp.

    ``LoadConfig.shard.model`` is a path to the full GGUF model (the engine writes its own shard
    file into the model store, reusing a verified one) or to a shard file written by
    ``shard-engine split`` whose range matches the spec.
    """

    engine_name = "llama"

    def __init__(self) -> None:
        super().__init__()
        self._runtime: _abi.ShardRuntime | None = None
        self._snapshots: dict[int, bytes] = {}
        self.shard_path: Path | None = None
        self.self_test_report: _abi.SelfTestReport | None = None

    # ------------------------------------------------------------------ backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
        try:
            options = msgspec.convert(config.options, LlamaOptions)
        except msgspec.ValidationError as error:
            raise InvalidRequest(f"invalid llama engine options: {error}") from error
        if options.kv_type not in ("f32", "f16"):
            raise InvalidRequest(f"kv_type must be f32 or f16, got {options.kv_type!r}")
        if not 1 <= options.n_ubatch <= config.max_batch_tokens:
            raise InvalidRequest(
                f"n_ubatch must lie in [1, max_batch_tokens={config.max_batch_tokens}]"
            )
        if config.max_sessions > _MAX_SEQUENCES:
            raise InvalidRequest(f"max_sessions may not exceed {_MAX_SEQUENCES} (llama.cpp)")
        if options.self_test:
            try:
                self.self_test_report = _run_self_test()
            except _abi.LlamaRuntimeError as error:
                raise EngineCrashed(f"llama.cpp start-up self-test failed: {error}") from error
        try:
            path, fingerprint, vocab_size, header = self._shard_file(config, options)
            tolerance = (
                options.tolerance if options.tolerance is not None else _default_tolerance(header)
            )
            runtime = _abi.ShardRuntime(
                path,
                n_ctx=config.max_context * config.max_sessions,
                n_seq_max=config.max_sessions,
                n_threads=config.n_threads or _available_cores(),
                n_batch=config.max_batch_tokens,
                n_ubatch=options.n_ubatch,
                flash_attn=options.flash_attn,
                kv_type=options.kv_type,
            )
        except (GGUFValidationError, ModelStoreError) as error:
            raise InvalidRequest(str(error)) from error
        except ShardingRefusedError as error:
            rule = error.rule.split(":", 1)[0]
            raise UnsupportedFeature(str(error), details={"rule": rule}) from error
        except _abi.ModelLoadError as error:
            raise InvalidRequest(str(error)) from error
        except OSError as error:
            raise InvalidRequest(f"cannot read model {config.shard.model!r}: {error}") from error
        self._runtime = runtime
        self.shard_path = path
        return ModelInfo(
            engine_version=ENGINE_VERSION,
            evidence="real",
            model_fingerprint=fingerprint,
            hidden_size=runtime.n_embd,
            vocab_size=vocab_size,
            determinism=Determinism(
                deterministic=True,
                split_exact=True,
                tolerance=tolerance,
                batch_invariant=False,
            ),
            features=Features(
                cancel=True,
                cancel_latency_ms=50.0,
                batched_decode=True,
                truncate=True,
            ),
            boundary_dtypes=("f32", "f16"),
            max_context=runtime.n_ctx_seq,
            max_sessions=config.max_sessions,
        )

    def _shard_file(
        self, config: LoadConfig, options: LlamaOptions
    ) -> tuple[Path, str, int, GGUFHeader]:
        """The file to load for this shard, the model fingerprint, the vocabulary size and the
        validated header of the given model (parsed once: a 262k vocabulary takes seconds)."""
        spec = config.shard
        source = Path(spec.model)
        if not source.is_file():
            raise InvalidRequest(f"model file {source} does not exist")
        header = validate_gguf(source)
        info = model_info(header)
        if info.is_shard:
            start = int(header.get_int("shard.start"))
            end = int(header.get_int("shard.end"))
            total = int(header.get_int("shard.n_layers_total"))
            if (start, end, total) != (spec.start, spec.end, spec.n_layers):
                raise ShardMismatch(
                    f"{source.name} holds layers [{start}, {end}) of {total}; the spec asks for "
                    f"[{spec.start}, {spec.end}) of {spec.n_layers}"
                )
            fingerprint = header.get_str("shard.source_sha256")
            vocab_entry = header.metadata.get("shard.source_vocab_size")
            vocab = int(vocab_entry.value) if vocab_entry is not None else info.vocab_size  # type: ignore[arg-type]
            return source, fingerprint, vocab, header
        if info.n_layers != spec.n_layers:
            raise ShardMismatch(
                f"{source.name} has {info.n_layers} layers; the spec says {spec.n_layers}"
            )
        if spec.role == "full":
            return source, _sha256(source), info.vocab_size, header
        if not info.shardable:
            raise ShardingRefusedError(info.refusal or "not shardable")
        store = resolve_model_store(options.model_store)
        directory = store / "shards" / source.stem / f"{spec.start:03d}-{spec.end:03d}"
        manifest = split_model(source, [(spec.start, spec.end)], directory, partial=True)
        return manifest.shard_path(0), manifest.source_sha256, info.vocab_size, header

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        runtime = self._require_runtime()
        if item.start_pos < item.committed_length:
            # Truncate-and-append: keep the whole sequence so a failure restores it exactly.
            self._snapshots[item.slot] = runtime.save_sequence(item.slot)
            runtime.seq_rm(item.slot, item.start_pos, -1)
        token.check()
        runtime.bind_abort_event(token.event)
        try:
            return runtime.run(
                item.slot,
                item.start_pos,
                tokens=None if item.tokens is None else item.tokens.tolist(),
                embeddings=item.hidden,
                all_logits=output == "all",
            )
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        finally:
            runtime.bind_abort_event(None)

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[npt.NDArray[np.float32]]:
        runtime = self._require_runtime()
        batch = [
            _abi.BatchItem(
                seq_id=item.slot,
                pos=item.start_pos,
                token=None if item.tokens is None else int(item.tokens[0]),
                embedding=None if item.hidden is None else item.hidden[0],
            )
            for item in items
        ]
        token.check()
        runtime.bind_abort_event(token.event)
        try:
            rows = runtime.run_batch(batch)
        except _abi.LlamaRuntimeError as error:
            raise _map_runtime_error(error) from error
        finally:
            runtime.bind_abort_event(None)
        return [rows[index : index + 1] for index in range(len(items))]

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        runtime = self._require_runtime()
        runtime.seq_rm(slot, start_pos, -1)
        snapshot = self._snapshots.pop(slot, None)
        if snapshot is not None:
            runtime.restore_sequence(slot, snapshot)
        elif runtime.seq_pos_max(slot) + 1 > committed_length:
            runtime.seq_rm(slot, committed_length, -1)

    def _commit(self, slot: int) -> None:
        self._snapshots.pop(slot, None)

    def _drop(self, slot: int) -> None:
        self._snapshots.pop(slot, None)
        self._require_runtime().seq_rm(slot, -1, -1)

    def _close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

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


def _default_tolerance(header: GGUFHeader) -> float:
    """The declared tolerance for batch-shape differences, by the widest-error weight type
    of the model (a shard carries its source's weight types)."""
    types = {record.ggml_type.name for record in header.tensors.values()}
    if types <= _FLOAT_TYPES:
        return 1e-3
    if types <= _FLOAT_TYPES | _HALF_TYPES:
        return 1e-2
    return 2.0


def _map_runtime_error(error: _abi.LlamaRuntimeError) -> Exception:
    """The contract error a runtime failure stands for."""
    if isinstance(error, _abi.AbortedError):
        return Cancelled(f"llama.cpp stopped at the next node: {error}")
    if isinstance(error, _abi.KVFullError):
        return ResourceExhausted(str(error), details={"resource": "kv_cells"})
    if isinstance(error, _abi.InvalidInputError):
        return InvalidRequest(str(error))
    return EngineCrashed(str(error))
