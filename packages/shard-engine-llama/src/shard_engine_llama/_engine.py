"""The llama.cpp-backed ShardEngine: one llama_context per shard, one sequence id per session.

The session semantics come from :class:`shard_engine_api.EngineCore`; this module only maps its
backend steps onto :class:`ShardRuntime` and maps runtime failures onto the contract's errors.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
    Tolerance,
    UnsupportedFeature,
)
from shard_engine_api.engine import (
    CancelToken,
    EngineCore,
    ForwardItem,
    ModelInfo,
    ModelStoreRefused,
    OutputMode,
    file_sha256,
    model_store,
)
from shard_engine_llama import _abi, _self_test
from shard_engine_llama._gguf import (
    GGUFHeader,
    GGUFValidationError,
    ShardingRefusedError,
    model_info,
    split_model,
    validate_gguf,
)
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._gguf.integrity import ShardIntegrityError, verify_shard
from shard_engine_llama._gguf.store import FileIdentity, file_identity, hash_cache
from shard_engine_llama._gguf.writer import ShardLayout, planned_layout, shard_layout

_log = logging.getLogger("shard_engine.llama")

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]

ENGINE_VERSION: Final = "0.1.0"
_MAX_SEQUENCES: Final = 256  # llama.cpp's LLAMA_MAX_SEQ

_self_test_lock = threading.Lock()
_self_test_result: _self_test.SelfTestReport | None = None


class LlamaOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``LoadConfig.options`` of the llama engine.

    - ``n_ubatch``: llama.cpp micro-batch size, capped at ``max_batch_tokens``; every shard of a
      pipeline must use the same value (and the same ``kv_type``, ``flash_attn`` and context
      settings) for bitwise-equal results.
    - ``kv_type``: "f32" (default; matches a float64 reference) or "f16".
    - ``model_store``: where shard files are written (default: SHARD_ENGINE_MODEL_STORE or
      ~/.cache/shard-engine; /home is refused).
    - ``tolerance``: one absolute max |delta| declared for logits and hidden states alike, for
      results that are not bitwise equal (decode vs. prefill of the same tokens, batched vs.
      single decode). Default: none; the engine declares per-kind tolerances relative to each
      row's magnitude, measured per weight type (see ``_declared_determinism``), since
      llama.cpp picks other kernels for other batch shapes and gemma3's hidden states reach
      ~1e5, where no absolute bound fits.
    - ``self_test``: run the start-up self-test (a generated model split 2-way, bitwise) before
      the first engine of the process reports ready.
    - ``inject_crash``: test only: the next forward fails as a backend crash would (the
      conformance suite checks EngineCrashed and health "failed" with it).
    """

    n_ubatch: int = 512
    kv_type: str = "f32"
    flash_attn: bool = False
    model_store: str | None = None
    tolerance: float | None = None
    self_test: bool = True
    inject_crash: bool = False


def _run_self_test() -> _self_test.SelfTestReport:
    global _self_test_result  # noqa: PLW0603 - once per process, shared by every engine
    with _self_test_lock:
        if _self_test_result is None:
            _self_test_result = _self_test.self_test()
        return _self_test_result


@dataclass(frozen=True)
class _ShardChoice:
    """What ``_open`` loads: the file, the model fingerprint and vocabulary size it reports, the
    given model's parsed header, and how the runtime drives the file."""

    path: Path
    fingerprint: str
    vocab_size: int
    header: GGUFHeader
    layout: ShardLayout
    # The file's identity once verified: it must be unchanged after llama.cpp has mapped it.
    identity: FileIdentity = field(default_factory=lambda: FileIdentity("", 0, 0, 0, 0, 0))

    def verified(self) -> _ShardChoice:
        return replace(self, identity=file_identity(self.path))


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

    def __init__(self) -> None:
        super().__init__()
        self._runtime: _abi.ShardRuntime | None = None
        self._snapshots: dict[int, bytes] = {}
        self._inject_crash = False
        self.shard_path: Path | None = None
        self.self_test_report: _self_test.SelfTestReport | None = None

    # ------------------------------------------------------------------ backend steps

    def _open(self, config: LoadConfig) -> ModelInfo:
        try:
            options = msgspec.convert(config.options, LlamaOptions)
        except msgspec.ValidationError as error:
            raise InvalidRequest(f"invalid llama engine options: {error}") from error
        if options.kv_type not in ("f32", "f16"):
            raise InvalidRequest(f"kv_type must be f32 or f16, got {options.kv_type!r}")
        if options.n_ubatch < 1:
            raise InvalidRequest(f"n_ubatch must be positive, got {options.n_ubatch}")
        if config.max_sessions >= _MAX_SEQUENCES:
            raise InvalidRequest(
                f"max_sessions may not exceed {_MAX_SEQUENCES - 1} (llama.cpp's sequence limit, "
                "one sequence kept spare so that an LRU eviction happens only at commit)"
            )
        if options.self_test:
            try:
                self.self_test_report = _run_self_test()
            except _abi.LlamaRuntimeError as error:
                raise EngineCrashed(f"llama.cpp start-up self-test failed: {error}") from error
        try:
            choice = self._shard_file(config, options)
            determinism = _declared_determinism(choice.header, options.tolerance)
            runtime = _abi.ShardRuntime(
                choice.path,
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
            )
            if file_identity(choice.path) != choice.identity:
                # Replaced or rewritten between verification and llama.cpp mapping it.
                runtime.close()
                raise ShardIntegrityError(f"{choice.path} changed while it was being loaded")
        except GGUFValidationError as error:
            details: dict[str, str | int | float | bool | None] = {"rule": error.rule}
            if error.field:
                details["field"] = error.field
            raise InvalidRequest(str(error), details=details) from error
        except ShardingRefusedError as error:
            rule = error.rule.split(":", 1)[0]
            raise UnsupportedFeature(str(error), details={"rule": rule}) from error
        except _abi.ModelLoadError as error:
            raise InvalidRequest(str(error)) from error
        except OSError as error:
            raise InvalidRequest(f"cannot read model {config.shard.model!r}: {error}") from error
        self._runtime = runtime
        self.shard_path = choice.path
        self._inject_crash = options.inject_crash
        _log.info(
            "loaded %s layers [%d, %d) of %d (%d threads)",
            choice.path.name,
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
            ),
            boundary_dtypes=("f32", "f16"),
            max_context=runtime.n_ctx_seq,
            max_sessions=config.max_sessions,
            spare_slot=True,
        )

    def _shard_file(self, config: LoadConfig, options: LlamaOptions) -> _ShardChoice:
        """The file to load for this shard, what it reports, and how the runtime drives it.

        The given model's header is parsed once here and handed on (a 262k vocabulary takes
        seconds to parse); whole-file digests come from the per-identity hash cache.
        """
        spec = config.shard
        source = Path(spec.model)
        if not source.is_file():
            raise InvalidRequest(f"model file {source} does not exist")
        header = validate_gguf(source)
        if header.architecture not in FAMILIES:
            # Without a known layout the validator cannot keep files llama.cpp aborts on away.
            raise UnsupportedFeature(
                f"architecture-unknown-layout: {header.architecture!r} is not one of the families "
                f"whose layout is checked before llama.cpp opens a file ({sorted(FAMILIES)})",
                details={"rule": "architecture-unknown-layout"},
            )
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
            # The source fingerprint is only reported for bytes proven to be what split wrote.
            verify_shard(header, store=_usable_store(options.model_store))
            fingerprint = header.get_str("shard.source_sha256")
            vocab_entry = header.metadata.get("shard.source_vocab_size")
            vocab = int(vocab_entry.value) if vocab_entry is not None else info.vocab_size  # type: ignore[arg-type]
            return _ShardChoice(source, fingerprint, vocab, header, shard_layout(header)).verified()
        if info.n_layers != spec.n_layers:
            raise ShardMismatch(
                f"{source.name} has {info.n_layers} layers; the spec says {spec.n_layers}"
            )
        if spec.role == "full":
            store = _usable_store(options.model_store)
            fingerprint = hash_cache().digest(source, "file", file_sha256, store=store)
            return _ShardChoice(
                source, fingerprint, info.vocab_size, header, shard_layout(header)
            ).verified()
        if not info.shardable:
            raise ShardingRefusedError(info.refusal or "not shardable")
        store = model_store(options.model_store)
        directory = store / "shards" / source.stem / f"{spec.start:03d}-{spec.end:03d}"
        manifest = split_model(
            source,
            [(spec.start, spec.end)],
            directory,
            partial=True,
            header=header,
            hash_store=store,
        )
        layout = planned_layout(header, spec.start, spec.end)
        _log.info(
            "shard [%d, %d) of %s: %s %s",
            spec.start,
            spec.end,
            source.name,
            "reused" if manifest.reused and manifest.reused[0] else "wrote",
            manifest.shard_path(0).name,
        )
        return _ShardChoice(
            manifest.shard_path(0), manifest.source_sha256, info.vocab_size, header, layout
        ).verified()

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        runtime = self._require_runtime()
        self._injected_crash()
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

    def _injected_crash(self) -> None:
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


def _declared_determinism(header: GGUFHeader, explicit: float | None) -> Determinism:
    """What the engine declares: splits are bit-exact (the split recipe reproduces unsplit
    llama.cpp), batch shapes are not (llama.cpp picks other kernels and groupings for other
    batch and ubatch sizes), within a tolerance per output kind chosen by the widest-error
    weight type of the model (a shard carries its source's weight types).

    The tolerances are the largest per-row differences measured by
    ``tools/measure_tolerance.py`` (one prefill of 40 positions vs. chunks of 1, 3, 7, 16 and
    17 rows and a 3-session decode_batch, on a full, a head and a middle shard, n_ubatch 16,
    relative to each row's largest magnitude), with a margin of about 2x or more:

    - F32/F64 weights: generated llama 7.4e-7 (logits) / 5.1e-7 (hidden), generated gemma3
      3.6e-5 / 2.2e-5 -> relative 2e-4 for both;
    - F16/BF16: generated llama 7.6e-4 / 4.9e-4, generated gemma3 4.9e-4 / 1.2e-4 -> 5e-3;
    - quantized: gemma3-270m Q4_K_M (6 sequences, 3,654 rows) 0.205 / 0.095 — llama.cpp's own
      ``Llama.eval`` shows the same differences between batch sizes (10.79 at the same logits
      row), so they are the backend's, not the engine's; generated Q8_0 0 / 0 -> logits 0.4,
      hidden 0.2.

    ``explicit`` (the ``tolerance`` option) declares one absolute bound for both kinds instead,
    as before per-kind tolerances existed."""
    if explicit is not None:
        return Determinism(
            deterministic=True, split_exact=True, tolerance=explicit, batch_invariant=False
        )
    types = {record.ggml_type.name for record in header.tensors.values()}
    if types <= _FLOAT_TYPES:
        logits = hidden = Tolerance(absolute=1e-5, relative=2e-4)
    elif types <= _FLOAT_TYPES | _HALF_TYPES:
        logits = hidden = Tolerance(absolute=1e-3, relative=5e-3)
    else:
        logits = Tolerance(absolute=1e-2, relative=0.4)
        hidden = Tolerance(absolute=1e-2, relative=0.2)
    return Determinism(
        deterministic=True,
        split_exact=True,
        batch_invariant=False,
        logits_tolerance=logits,
        hidden_tolerance=hidden,
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
