"""llama.cpp itself: a model decoded through llama-cpp-python's raw batch API with the context
settings the engine uses, the baseline the llama benchmark and profile compare the engine with.
Its ``llama_decode`` calls run on the engine's compute thread (``shard_engine_llama._threading``),
as a second engine's would: two libgomp teams in one process throttle each other's barriers."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import numpy as np

from shard_engine_llama._llama_library import decode_on_compute_thread

N_UBATCH: Final = 512
"""The micro-batch (and batch) size of the raw context, and the engine's in the benchmarks."""


class RawLlama:
    """The model decoded through llama-cpp-python's raw batch API, with the context settings
    the engine uses for ``max_sessions`` sessions of ``max_context`` positions (one spare
    sequence included): what llama.cpp itself costs, with nothing of the engine around it."""

    def __init__(self, path: Path, *, max_sessions: int, max_context: int, n_threads: int) -> None:
        import llama_cpp

        self._llama = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(os.fsencode(path), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_context * (max_sessions + 1)
        params.n_seq_max = max_sessions + 1
        params.n_batch = N_UBATCH
        params.n_ubatch = N_UBATCH
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = 0  # F32, the engine's default kv_type
        params.type_v = 0
        params.swa_full = True
        params.kv_unified = False
        params.no_perf = True
        params.n_outputs_max = max(N_UBATCH, max_sessions + 1)
        self._context = llama_cpp.llama_init_from_model(self._model, params)
        if not self._context:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._batch = llama_cpp.llama_batch_init(N_UBATCH, 0, 1)

    def decode(self, rows: Sequence[tuple[int, int, int]]) -> list[int]:
        """One llama_decode of (sequence, position, token) rows, logits for every row; the
        greedy next token of each row (argmax over a view of llama.cpp's logits)."""
        return self.prefill_rows(rows, outputs=range(len(rows)))

    def prefill_rows(
        self, rows: Sequence[tuple[int, int, int]], outputs: Sequence[int] | range
    ) -> list[int]:
        llama_cpp = self._llama
        batch = self._batch
        wanted = set(outputs)
        batch.n_tokens = len(rows)
        for i, (seq, pos, token) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if i in wanted else 0
        # Where the engine runs its own llama_decode calls (its compute thread): one libgomp
        # team for both, as for two engines in one process.
        status = decode_on_compute_thread(self._context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        tokens = []
        for i in outputs:
            pointer = llama_cpp.llama_get_logits_ith(self._context, i)
            view = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
            tokens.append(int(np.argmax(view)))
        return tokens

    def clear(self) -> None:
        self._llama.llama_memory_clear(self._llama.llama_get_memory(self._context), True)

    def close(self) -> None:
        self._llama.llama_batch_free(self._batch)
        self._llama.llama_free(self._context)
        self._llama.llama_model_free(self._model)
