"""The llama.cpp runtime of one shard: :class:`ShardRuntime`, the only caller of llama.cpp's
model, context and decode functions (through llama-cpp-python's ctypes bindings) and of ggml.

Everything here is pinned to one llama-cpp-python release: struct layouts, callback signatures and
graph tensor names (``l_out-<layer>``) are not a stable API, so the version is checked at import
(``_llama_library``, which loads the bindings, ggml and the native callbacks, and holds the error
tree) and ``_self_test`` proves on a generated model that a split pipeline reproduces the
unsplit logits bit for bit before anything relies on it. A model's vocabulary alone is
:class:`Vocabulary` (``_vocabulary``); a runtime's inputs are ``_runtime_inputs``.

How a shard runs (see ``_gguf.writer`` for how its file is built):

* head/full shards take token ids, other shards take hidden states through ``batch.embd``;
* tail/full shards return logits; other shards request no outputs and capture the residual stream
  after their last real layer from the eval callback, then stop the graph (the identity block and
  lm-head are never computed);
* one ``llama_context`` per shard, one sequence id per session, rollback with
  ``llama_memory_seq_rm``; an abort callback polls a flag that :meth:`ShardRuntime.request_abort`
  sets from any thread;
* both callbacks run once per graph node (hundreds per decode), so they are native C functions
  (``_native.c``) when that optional extension is built, and Python ones otherwise (same results;
  ``SHARD_ENGINE_LLAMA_NATIVE=0`` forces the Python ones). Batch arrays are preallocated once per
  runtime and filled through numpy views.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn, TypedDict, cast

import numpy as np
import numpy.typing as npt

from shard_engine_api.engine import checksum_and_finite, copy_checksum_and_finite
from shard_engine_llama import _state
from shard_engine_llama._llama_library import (
    CAPTURE_ERRORS,
    CAPTURE_NAME_BYTES,
    LOG_ENV,
    AbortedError,
    CaptureState,
    InvalidInputError,
    KVFullError,
    LlamaRuntimeError,
    ModelLoadError,
    NativeCallbacks,
    RuntimeFailure,
    address,
    decode_on_compute_thread,
    ensure_backend,
    ggml,
    llama_cpp,
    native,
)
from shard_engine_llama._runtime_inputs import BatchItem, ContextSettings, checked_tokens
from shard_engine_llama._vocabulary import Vocabulary, token_piece, tokenize

__all__ = [
    "AbortedError",
    "BatchItem",
    "ContextSettings",
    "InvalidInputError",
    "KVFullError",
    "LlamaRuntimeError",
    "ModelLoadError",
    "RuntimeFailure",
    "ShardRuntime",
    "Vocabulary",
]


_GGML_TYPE_F32 = 0
_GGML_TYPE_F16 = 1
_KV_TYPES = {"f32": _GGML_TYPE_F32, "f16": _GGML_TYPE_F16}
_MAX_ABORT_POLL_DELAY_S = 0.1
"""The longest sleep ``abort_poll_delay_s`` may ask for before every graph node."""
# struct ggml_tensor { enum ggml_type type; struct ggml_backend_buffer * buffer; int64_t ne[4]; ...}
# (ggml.h of the pinned release): ne starts after a 4-byte enum padded to 8 and one pointer.
_GGML_TENSOR_NE_OFFSET = 16


# llama_get_logits_ith(ctx, i) returning the row's address as an int (None for NULL): a
# function object of our own over the same symbol, so llama_cpp's is left as it is.
_LOGITS_ITH_PROTOTYPE: Final = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)

# A read-only memoryview of ``size`` bytes at an address (CPython's own
# PyMemoryView_FromMemory): one view over several logits rows, where a ctypes array type of
# each size would have to be built first.
_memory_at = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_at.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_memory_at.restype = ctypes.py_object
_PYBUF_READ: Final = 0x100


def _set_field(structure: ctypes.Structure, name: str, value: object) -> None:
    """Set a pointer field of a llama-cpp-python struct (its annotations call them arrays)."""
    setattr(structure, name, value)


_FLOAT32: Final = np.dtype(np.float32)


class _StateLimits(TypedDict):
    """What :mod:`._state` checks a sequence state of this context against."""

    n_sections: int
    max_cells: int
    kv_ggml_type: int
    v_trans: int
    geometry: _state.Geometry


class ShardRuntime:
    """One shard file loaded into one llama.cpp context.

    Not re-entrant: one call at a time (an internal lock serialises callers); only
    :meth:`request_abort` / :meth:`clear_abort` may be called concurrently with a running call.
    Each of the ``n_seq_max`` sequences gets its own KV stream of ``n_ctx_seq`` cells:
    ``n_ctx // n_seq_max`` rounded up to a multiple of 256 by llama.cpp.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_ctx: int = 512,
        n_seq_max: int = 4,
        n_threads: int = 2,
        n_batch: int = 512,
        n_ubatch: int = 512,
        flash_attn: bool = False,
        kv_type: str = "f32",
        settings: ContextSettings | None = None,
        is_head: bool | None = None,
        is_tail: bool | None = None,
        last_layer_index: int | None = None,
        native_callbacks: bool = True,
        abort_poll_delay_s: float = 0.0,
        load_from: str | os.PathLike[str] | None = None,
        kv_row_elements: int | None = None,
    ) -> None:
        """Load ``path`` (read from ``load_from`` when given: a ``/proc/self/fd`` link that pins
        the file the caller verified; ``path`` then only names it in messages). Role and capture
        layer default to what the shard's ``shard.*`` keys say.

        ``settings``, when given, replaces the individual context arguments (use one settings object
        for every shard of a pipeline). ``last_layer_index`` is the shard-local index of the last
        real layer whose output a non-tail shard returns. ``native_callbacks=False`` uses the
        Python callbacks even when the native ones are built (for comparisons);
        ``abort_poll_delay_s > 0`` makes the abort check (once per graph node) sleep that long
        first, which implies the Python callbacks (tests of cancellation mid-forward). Raises
        ModelLoadError when llama.cpp cannot load the file and GGUFValidationError when it is
        not a sound GGUF file. ``kv_row_elements``: :func:`kv_row_bound` of the file (read
        from it when not given), which bounds the sequence states :meth:`restore_sequence`
        accepts.
        """
        ensure_backend()
        self.path = Path(path)
        if settings is None:
            settings = ContextSettings(
                n_ctx=n_ctx,
                n_seq_max=n_seq_max,
                n_threads=n_threads,
                n_batch=n_batch,
                n_ubatch=n_ubatch,
                flash_attn=flash_attn,
                kv_type=kv_type,
            )
        if settings.kv_type not in _KV_TYPES:
            raise InvalidInputError(f"kv_type must be one of {sorted(_KV_TYPES)}")
        self.settings = settings
        if None in (is_head, is_tail, last_layer_index, kv_row_elements):
            # Callers that already parsed the file (the engine) pass all four: a tail shard
            # carries the whole vocabulary, which takes seconds to parse on large ones.
            is_head, is_tail, last_layer_index, kv_row_elements = self._role_from_file(
                load_from, is_head, is_tail, last_layer_index, kv_row_elements
            )
        assert is_head is not None
        assert is_tail is not None
        assert last_layer_index is not None
        assert kv_row_elements is not None
        self.is_head = is_head
        self.is_tail = is_tail
        self.last_layer_index = last_layer_index
        callbacks = self._prepare_calls(last_layer_index, native_callbacks, abort_poll_delay_s)
        self._load_model(self.path if load_from is None else Path(load_from), kv_row_elements)
        self._create_context(self._context_params(callbacks))
        self._allocate_batch(settings.n_batch)

    def _role_from_file(
        self,
        load_from: str | os.PathLike[str] | None,
        is_head: bool | None,
        is_tail: bool | None,
        last_layer_index: int | None,
        kv_row_elements: int | None,
    ) -> tuple[bool, bool, int, int]:
        """The role, capture layer and KV row bound the caller left out, from the file's
        header and its ``shard.*`` keys."""
        from shard_engine_llama._gguf.hyperparameters import kv_row_bound
        from shard_engine_llama._gguf.reader import read_gguf_header
        from shard_engine_llama._gguf.writer import shard_layout

        header = read_gguf_header(self.path if load_from is None else load_from)
        layout = shard_layout(header)
        return (
            layout.is_head if is_head is None else is_head,
            layout.is_tail if is_tail is None else is_tail,
            layout.last_layer_index if last_layer_index is None else last_layer_index,
            kv_row_bound(header) if kv_row_elements is None else kv_row_elements,
        )

    def _prepare_calls(
        self, last_layer_index: int, native_callbacks: bool, abort_poll_delay_s: float
    ) -> NativeCallbacks | None:
        """The state every call and callback shares: the capture tensor's name, the call lock,
        the abort event and flag, and what the capture writes to. Returns the native callbacks
        to install, or None for the Python ones."""
        self._capture_name = f"l_out-{last_layer_index}".encode()
        if len(self._capture_name) >= CAPTURE_NAME_BYTES:
            raise InvalidInputError(f"layer index {last_layer_index} gives too long a name")
        self._lock = threading.Lock()
        self._own_abort = threading.Event()
        # Polled by the native abort callback; request_abort sets it together with the event.
        self._abort_flag = ctypes.c_uint8(0)
        if not 0.0 <= abort_poll_delay_s <= _MAX_ABORT_POLL_DELAY_S:
            raise InvalidInputError(
                f"abort poll delay must lie in [0, {_MAX_ABORT_POLL_DELAY_S}] s, "
                f"got {abort_poll_delay_s}"
            )
        self._abort_poll_delay_s = abort_poll_delay_s
        callbacks = native if native_callbacks and not abort_poll_delay_s else None
        self.native_callbacks = callbacks is not None
        self._capture_state = CaptureState()
        self._model: int | None = None
        self._context: int | None = None
        self._closed = False
        self._captured: list[npt.NDArray[np.float32]] = []
        self.row_digests: list[tuple[int, bool]] = []
        """A tail's last logits rows' (checksum, finite), in row order (see _read_logits)."""
        self._capture_error: str | None = None
        return callbacks

    def _load_model(self, source: Path, kv_row_elements: int) -> None:
        """Load the model's weights (CPU only) from ``source``, and what the runtime reads of
        it: widths, vocabulary, the sequence-state geometry and the logits row reader."""
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(os.fsencode(source), model_params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path} (set {LOG_ENV}=1 to see why)"
            )
        self._model = int(model)

        self.n_embd = int(llama_cpp.llama_model_n_embd(model))
        # The most layers and the widest K or V row a sequence state may declare here.
        self._state_geometry = _state.Geometry(
            max_layers=int(llama_cpp.llama_model_n_layer(model)),
            max_row_bytes=kv_row_elements * (4 if self.settings.kv_type == "f32" else 2),
        )
        self.n_embd_input = int(llama_cpp.llama_model_n_embd_inp(model))
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        # One logits row of llama.cpp's output buffer, as _read_logits reads it: placed at
        # the address that a llama_get_logits_ith of our own returns as a plain integer (a
        # ctypes pointer object and a cast cost more than the row's copy after llama_decode
        # has pushed every cache line out).
        self._logits_row = ctypes.c_char * (self.n_vocab * 4)
        self._logits_address = _LOGITS_ITH_PROTOTYPE(address(llama_cpp.llama_get_logits_ith))

    def _context_params(self, callbacks: NativeCallbacks | None) -> llama_cpp.llama_context_params:
        """The context parameters of this runtime's settings and role, with its callbacks."""
        settings = self.settings
        params: llama_cpp.llama_context_params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_ubatch
        params.n_seq_max = settings.n_seq_max
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if settings.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        # F32 KV so results match the float64 reference; the same on every shard for bitwise splits.
        params.type_k = _KV_TYPES[settings.kv_type]
        params.type_v = _KV_TYPES[settings.kv_type]
        params.embeddings = False
        params.no_perf = True
        params.op_offload = False
        # A full-size sliding-window cache keeps old positions, so rollback (seq_rm) to any
        # earlier position always succeeds on sliding-window models.
        params.swa_full = True
        params.kv_unified = False
        if not self.is_tail:
            # No logits are ever read from a non-tail shard; keep its output buffer minimal.
            # llama.cpp reserves at least one output row per sequence and asserts that this fits
            # (GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)), so 1 only works for 1 sequence.
            params.n_outputs_max = settings.n_seq_max
        else:
            # The default bound is n_batch, which aborts the process (same assert) when there
            # are more sequences than batch rows: allow every row and one per sequence.
            params.n_outputs_max = max(settings.n_batch, settings.n_seq_max)
        self._install_callbacks(params, callbacks)
        return params

    def _install_callbacks(
        self, params: llama_cpp.llama_context_params, callbacks: NativeCallbacks | None
    ) -> None:
        """Put the abort callback (and a non-tail's eval callback, which captures the last
        layer's output) into ``params``: the native ones when given, else the Python ones."""
        # The ctypes callback objects (and the memory the native ones read) must outlive the
        # context: keep them on self.
        if callbacks is not None:
            self._abort_callback = llama_cpp.ggml_abort_callback(callbacks.abort_flag)
            params.abort_callback = self._abort_callback
            params.abort_callback_data = ctypes.cast(
                ctypes.pointer(self._abort_flag), ctypes.c_void_p
            )
        else:
            self._abort_callback = llama_cpp.ggml_abort_callback(self._on_abort_poll)
            params.abort_callback = self._abort_callback
            _set_field(params, "abort_callback_data", None)
        if not self.is_tail:
            if callbacks is not None:
                state = self._capture_state
                state.get_name = callbacks.get_name
                state.tensor_get = callbacks.tensor_get
                state.nbytes = callbacks.nbytes
                state.ne_offset = _GGML_TENSOR_NE_OFFSET
                state.name = self._capture_name
                self._eval_callback = llama_cpp.ggml_backend_sched_eval_callback(
                    callbacks.capture_eval
                )
                params.cb_eval = self._eval_callback
                params.cb_eval_user_data = ctypes.cast(ctypes.pointer(state), ctypes.c_void_p)
            else:
                self._eval_callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
                params.cb_eval = self._eval_callback
                _set_field(params, "cb_eval_user_data", None)

    def _create_context(self, params: llama_cpp.llama_context_params) -> None:
        """The model's ``llama_context`` and its memory module, and what the runtime reads of
        them: context sizes, the sliding window and the layout of a sequence's state."""
        model = self._model
        context = llama_cpp.llama_init_from_model(model, params)
        if not context:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path}")
        self._context = int(context)
        memory = llama_cpp.llama_get_memory(context)
        if not memory:
            self.close()
            raise ModelLoadError(f"{self.path}: context has no memory module")
        self._memory = int(memory)
        self.n_ctx = int(llama_cpp.llama_n_ctx(context))
        # llama.cpp pads each sequence's KV stream to a multiple of 256 cells and sets
        # n_ctx = n_ctx_seq * n_seq_max: a sequence can hold more than n_ctx/n_seq_max positions.
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(context))
        # Sliding-window span (0 without windowed layers) and how many KV caches a sequence
        # state has (one, or full-attention + windowed): an empty sequence's state says.
        self.n_swa = int(llama_cpp.llama_model_n_swa(model))
        empty = self._raw_state(self._context, 0)
        per_section = 4 + 4 * self.settings.n_seq_max
        if ctypes.sizeof(empty) < 8 + per_section or (ctypes.sizeof(empty) - 8) % per_section:
            self.close()
            raise ModelLoadError(
                f"{self.path}: llama.cpp writes a sequence state of an unknown layout"
            )
        self.n_state_sections = (ctypes.sizeof(empty) - 8) // per_section

    def _allocate_batch(self, capacity: int) -> None:
        """One ``llama_batch`` for the runtime's life whose arrays numpy owns: a call fills them
        through views instead of ``llama_batch_init``/``free`` and a Python loop per row."""
        self._batch_tokens = np.zeros(capacity, dtype=np.int32)
        self._batch_positions = np.zeros(capacity, dtype=np.int32)
        self._batch_n_seq_id = np.ones(capacity, dtype=np.int32)
        self._batch_seq_ids = np.zeros(capacity, dtype=np.int32)
        # seq_id is an array of per-row pointers, each to that row's one sequence id.
        base = self._batch_seq_ids.ctypes.data
        self._batch_seq_id_rows = np.array(
            [base + 4 * row for row in range(capacity)] + [0], dtype=np.uintp
        )
        self._batch_output_flags = np.zeros(capacity, dtype=np.int8)
        self._batch_token_pointer = self._batch_tokens.ctypes.data_as(
            ctypes.POINTER(llama_cpp.llama_token)
        )
        batch = llama_cpp.llama_batch()
        batch.n_tokens = 0
        # A head shard always takes token ids (``_check_values``): its batch points at the
        # token array for good. Other shards point ``embd`` at one call's staged rows at a
        # time (reset to NULL after the call).
        _set_field(batch, "token", self._batch_token_pointer if self.is_head else None)
        _set_field(batch, "embd", None)
        _set_field(
            batch,
            "pos",
            self._batch_positions.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
        )
        _set_field(
            batch, "n_seq_id", self._batch_n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        )
        _set_field(
            batch,
            "seq_id",
            self._batch_seq_id_rows.ctypes.data_as(
                ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id))
            ),
        )
        _set_field(
            batch,
            "logits",
            self._batch_output_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self._batch = batch

    # -- callbacks (run on llama.cpp's thread while llama_decode holds no GIL) -----------------

    def _on_abort_poll(self, user_data: int | None) -> bool:
        del user_data
        if self._abort_poll_delay_s:
            time.sleep(self._abort_poll_delay_s)
        return self._own_abort.is_set()

    def _on_eval(self, tensor: int | None, ask: bool, user_data: int | None) -> bool:
        del user_data
        try:
            if not tensor:
                return True
            if ggml.ggml_get_name(tensor) != self._capture_name:
                # In the ask phase False means "not interested"; in the data phase True continues.
                return not ask
            if ask:
                return True
            ne = (ctypes.c_int64 * 2).from_address(tensor + _GGML_TENSOR_NE_OFFSET)
            n_embd, n_rows = int(ne[0]), int(ne[1])
            tensor_type = ctypes.c_int32.from_address(tensor).value
            if tensor_type != _GGML_TYPE_F32 or n_embd != self.n_embd:
                self._capture_error = f"captured tensor has type {tensor_type} and {n_embd} columns"
                return False
            rows = np.empty((n_rows, n_embd), dtype=np.float32)
            n_bytes = int(ggml.ggml_nbytes(tensor))
            if n_bytes != rows.nbytes:
                self._capture_error = f"captured tensor is {n_bytes} bytes, expected {rows.nbytes}"
                return False
            ggml.ggml_backend_tensor_get(tensor, rows.ctypes.data, 0, n_bytes)
            self._captured.append(rows)
            # Stop this graph: the identity block, final norm and lm-head are not needed.
            return False
        except Exception as error:  # noqa: BLE001  (an exception cannot cross the C boundary)
            self._capture_error = f"eval callback failed: {error!r}"
            return False

    # -- abort -----------------------------------------------------------------------------

    def request_abort(self) -> None:
        """Make the running (or next) llama_decode stop at its next node; it raises AbortedError."""
        self._own_abort.set()
        self._abort_flag.value = 1

    def clear_abort(self) -> None:
        # Twice per forward, and the native flag is only ever set with the event (by
        # request_abort): nothing to write unless an abort was requested.
        if self._own_abort.is_set():
            self._own_abort.clear()
            self._abort_flag.value = 0

    @property
    def abort_requested(self) -> bool:
        return self._own_abort.is_set()

    # -- running -----------------------------------------------------------------------------

    def _require_open(self) -> int:
        if self._closed or self._context is None:
            raise LlamaRuntimeError(f"runtime for {self.path} is closed")
        return self._context

    def run(
        self,
        seq_id: int,
        start_pos: int,
        tokens: Sequence[int] | npt.NDArray[np.integer] | None = None,
        embeddings: npt.NDArray[np.float32] | None = None,
        all_logits: bool = False,
    ) -> npt.NDArray[np.float32]:
        """Process consecutive positions ``start_pos..`` of one sequence.

        Head/full shards take ``tokens``; others take ``embeddings`` of shape (n, n_embd). Returns
        hidden states (n, n_embd) for non-tail shards, else logits: (n, n_vocab) when
        ``all_logits`` or (1, n_vocab) for the last position. On any failure the positions this
        call added are removed again, so the sequence is as before the call.
        """
        if tokens is not None and embeddings is not None:
            raise InvalidInputError("pass tokens or embeddings, not both")
        token_array: npt.NDArray[np.int32] | None = None
        if tokens is not None:
            token_array = checked_tokens(tokens)
            n = int(token_array.shape[0])
        elif embeddings is not None:
            if embeddings.ndim != 2:
                raise InvalidInputError(f"embeddings have shape {embeddings.shape}, expected 2-D")
            n = int(embeddings.shape[0])
        else:
            raise InvalidInputError("pass tokens or embeddings")
        if n == 0:
            raise InvalidInputError("no inputs")
        # One sequence at consecutive positions: checked and filled from the scalars (a
        # decode step is one row; numpy arrays and reductions would cost more than the row).
        self._check_rows(n, seq_id, seq_id, start_pos, start_pos + n - 1)
        positions: int | npt.NDArray[np.int64] = (
            start_pos if n == 1 else np.arange(start_pos, start_pos + n, dtype=np.int64)
        )
        outputs = range(n) if all_logits else (n - 1,)
        return self._decode(
            n, seq_id, positions, ((seq_id, start_pos),), token_array, embeddings, outputs
        )

    def run_batch(self, items: Sequence[BatchItem]) -> npt.NDArray[np.float32]:
        """One decode step for several sequences in ONE llama_decode call; rows in item order.

        Each item is one position of a distinct sequence. Returns (len(items), n_embd) hidden
        states or (len(items), n_vocab) logits. On failure every item's position is rolled back.
        """
        if not items:
            raise InvalidInputError("no items")
        seq_list = [item.seq_id for item in items]
        if len(set(seq_list)) != len(seq_list):
            raise InvalidInputError(
                "run_batch needs distinct sequence ids (one position per sequence)"
            )
        # llama.cpp's per-sequence KV streams split a multi-sequence batch into ubatches of
        # consecutive, increasing sequence ids, in batch order; submitting the items sorted by
        # sequence id makes the captured rows come back in that same sorted order.
        order = sorted(range(len(items)), key=seq_list.__getitem__)
        sorted_items = [items[i] for i in order]
        n = len(items)
        # Checked on the Python ints (one step of a few rows: numpy arrays and reductions
        # would cost more than the rows).
        seq_ids = [seq_list[i] for i in order]
        positions = [item.pos for item in sorted_items]
        token_array: npt.NDArray[np.int32] | None = None
        embeddings: npt.NDArray[np.float32] | None = None
        if self.is_head:
            token_list = [item.token for item in sorted_items]
            if any(token is None for token in token_list):
                raise InvalidInputError("this shard takes token ids")
            token_array = checked_tokens(token_list)  # type: ignore[arg-type]
        else:
            rows = [item.embedding for item in sorted_items]
            if any(row is None for row in rows):
                raise InvalidInputError("this shard takes hidden states (embeddings)")
            for row in rows:
                assert row is not None
                if row.shape != (self.n_embd_input,):
                    raise InvalidInputError(
                        f"embedding row has shape {row.shape}, expected ({self.n_embd_input},)"
                    )
            embeddings = np.stack([np.asarray(row, dtype=np.float32) for row in rows])
        self._check_rows(n, min(seq_ids), max(seq_ids), min(positions), max(positions))
        firsts = tuple(zip(seq_ids, positions, strict=True))
        result = self._decode(
            n, seq_ids, positions, firsts, token_array, embeddings, range(n), order
        )
        if self.is_tail:
            return result  # logits were read straight into item order
        in_order = np.empty_like(result)
        in_order[order] = result
        return in_order

    def _check_rows(self, n: int, seq_lo: int, seq_hi: int, pos_lo: int, pos_hi: int) -> None:
        """Refuse a call of ``n`` rows whose sequences or positions do not fit the shard."""
        if n > self.settings.n_batch:
            raise InvalidInputError(
                f"{n} inputs exceed n_batch={self.settings.n_batch}; split the call"
            )
        if seq_lo < 0 or seq_hi >= self.settings.n_seq_max:
            raise InvalidInputError(f"seq_id outside [0, {self.settings.n_seq_max})")
        if pos_lo < 0:
            raise InvalidInputError(f"negative position {pos_lo}")
        if pos_hi >= 2**31:
            raise InvalidInputError(f"position {pos_hi} beyond llama.cpp's range")

    def _check_values(
        self,
        n: int,
        tokens: npt.NDArray[np.int32] | None,
        embeddings: npt.NDArray[np.float32] | None,
    ) -> npt.NDArray[np.float32] | None:
        """Refuse inputs that do not fit the shard's role and vocabulary or width; the
        embeddings as contiguous float32."""
        if self.is_head and tokens is None:
            raise InvalidInputError("this shard takes token ids")
        if not self.is_head and embeddings is None:
            raise InvalidInputError("this shard takes hidden states (embeddings)")
        if tokens is not None:
            if not self.is_head:
                raise InvalidInputError("this shard takes hidden states (embeddings)")
            if n == 1:
                low = high = int(tokens[0])
            else:
                low, high = int(np.min(tokens)), int(np.max(tokens))
            if low < 0 or high >= self.n_vocab:
                bad = low if low < 0 else high
                raise InvalidInputError(f"token {bad} outside the vocabulary of {self.n_vocab}")
            return None
        assert embeddings is not None
        if self.is_head:
            raise InvalidInputError("this shard takes token ids")
        if embeddings.shape != (n, self.n_embd_input):
            raise InvalidInputError(
                f"embedding rows have shape {embeddings.shape[1:]}, expected ({self.n_embd_input},)"
            )
        return np.ascontiguousarray(embeddings, dtype=np.float32)

    def _decode(
        self,
        n: int,
        seq_ids: int | Sequence[int] | npt.NDArray[np.int64],
        positions: int | Sequence[int] | npt.NDArray[np.int64],
        firsts: Sequence[tuple[int, int]],
        tokens: npt.NDArray[np.int32] | None,
        embeddings: npt.NDArray[np.float32] | None,
        outputs: Sequence[int],
        destination: Sequence[int] | None = None,
    ) -> npt.NDArray[np.float32]:
        """One llama_decode of ``n`` rows (sequence ids and positions per row, or one value
        for every row; already checked by ``_check_rows``). ``firsts``: each sequence's
        first position in the call, which a failure removes again. A tail returns the logits
        of batch rows ``outputs``, the j-th in result row ``destination[j]`` (default j);
        other shards return every row's hidden state in batch order."""
        with self._lock:
            context = self._require_open()
            staged = self._check_values(n, tokens, embeddings)
            batch = self._batch
            batch.n_tokens = n
            flags = self._batch_output_flags
            if type(seq_ids) is int and type(positions) is int:
                # One row of run(), a decode step: element writes (a slice assignment is
                # several numpy calls).
                self._batch_seq_ids[0] = seq_ids
                self._batch_positions[0] = positions
                flags[0] = 0
            else:
                self._batch_seq_ids[:n] = seq_ids
                self._batch_positions[:n] = positions
                flags[:n] = 0
            if self.is_tail:
                for row in outputs:
                    flags[row] = 1
            if tokens is not None:
                if n == 1:
                    self._batch_tokens[0] = tokens[0]
                else:
                    self._batch_tokens[:n] = tokens
            else:
                assert staged is not None
                # llama.cpp copies the rows into its input tensor; ``staged`` outlives the call.
                _set_field(batch, "embd", staged.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
            hidden: npt.NDArray[np.float32] | None = None
            if not self.is_tail:
                self._captured = []
                self._capture_error = None
                if self.native_callbacks:
                    hidden = np.empty((n, self.n_embd), dtype=np.float32)
                    state = self._capture_state
                    state.row_values = self.n_embd
                    state.capacity_rows = n
                    state.destination = hidden.ctypes.data
                    state.rows = 0
                    state.error = 0
                    state.calls = 0
            status = decode_on_compute_thread(context, batch)
            if staged is not None:
                _set_field(batch, "embd", None)  # no pointer to a freed array stays behind
            if status != 0:
                self._decode_failed(status, n, firsts)
            if self.is_tail:
                return self._read_logits(context, outputs, destination)
            return self._captured_hidden(hidden, n, firsts)

    def _decode_failed(self, status: int, n: int, firsts: Sequence[tuple[int, int]]) -> NoReturn:
        """Roll back what a failed llama_decode of ``n`` rows added and raise what its
        ``status`` means: AbortedError (2), KVFullError (1), else RuntimeFailure."""
        self._rollback(firsts)
        if status == 2:
            raise AbortedError(f"{self.path.name}: decode aborted")
        if status == 1:
            raise KVFullError(
                f"{self.path.name}: no KV slot for {n} tokens (each sequence holds "
                f"{self.n_ctx_seq} positions)",
                status,
            )
        raise RuntimeFailure(f"{self.path.name}: llama_decode returned {status}", status)

    def _captured_hidden(
        self,
        hidden: npt.NDArray[np.float32] | None,
        n: int,
        firsts: Sequence[tuple[int, int]],
    ) -> npt.NDArray[np.float32]:
        """A non-tail's ``n`` captured rows after a llama_decode: written into ``hidden`` by
        the native capture, or collected by the Python one (``hidden`` None). A capture that
        failed or has another row count rolls the call back and is RuntimeFailure."""
        if hidden is not None:
            state = self._capture_state
            state.destination = None
            captured_rows = int(state.rows)
            capture_error = CAPTURE_ERRORS.get(int(state.error)) if state.error else None
        else:
            capture_error = self._take_capture_error()
            hidden = (
                np.concatenate(self._captured)
                if self._captured
                else np.empty((0, self.n_embd), np.float32)
            )
            self._captured = []
            captured_rows = int(hidden.shape[0])
        if capture_error is not None:
            self._rollback(firsts)
            raise RuntimeFailure(f"{self.path.name}: {capture_error}", -100)
        if captured_rows != n:
            self._rollback(firsts)
            raise RuntimeFailure(
                f"{self.path.name}: captured {captured_rows} rows of "
                f"{self._capture_name.decode()} "
                f"for {n} inputs",
                -101,
            )
        return hidden

    def _take_capture_error(self) -> str | None:
        # Set from the eval callback during llama_decode, hence read through a call.
        error, self._capture_error = self._capture_error, None
        return error

    def _read_logits(
        self,
        context: int,
        outputs: Sequence[int],
        destination: Sequence[int] | None = None,
    ) -> npt.NDArray[np.float32]:
        """Copy each wanted row of llama.cpp's logits once, into its result row, hashing and
        testing it on the way, so that the result built from a row need not read it again
        (:attr:`row_digests`: with a ``destination``, each result row's checksum and
        finiteness in row order; without, one entry for all the rows returned, the payload
        of the one result built from them)."""
        count = len(outputs)
        rows = np.empty((count, self.n_vocab), dtype=_FLOAT32)
        if count == 1 and destination is None:  # a decode step: no row views, no lists
            # _row_address inlined: one call less on every decode step.
            address = self._logits_address(context, outputs[0])
            if not address:
                raise RuntimeFailure(
                    f"{self.path.name}: no logits for batch row {outputs[0]}", -102
                )
            self.row_digests = [
                copy_checksum_and_finite(
                    rows, memoryview(self._logits_row.from_address(address)), "f32"
                )
            ]
            return rows
        block = self._logits_block(context, outputs)
        row_bytes = self.n_vocab * 4
        if block is not None and destination is None:
            self.row_digests = [copy_checksum_and_finite(rows, block, "f32")]
            return rows
        targets = range(count) if destination is None else destination
        digests: list[tuple[int, bool]] = [(0, False)] * count
        for j, (target, index) in enumerate(zip(targets, outputs, strict=True)):
            if block is not None:
                source = block[j * row_bytes : (j + 1) * row_bytes]
            else:
                address = self._row_address(context, index)
                source = memoryview(self._logits_row.from_address(address))
            digests[target] = copy_checksum_and_finite(rows[target], source, "f32")
        self.row_digests = (
            digests if destination is not None else [checksum_and_finite(rows, "f32")]
        )
        return rows

    def _row_address(self, context: int, index: int) -> int:
        """The address of batch row ``index``'s logits (RuntimeFailure when it has none)."""
        address = self._logits_address(context, index)
        if not address:
            raise RuntimeFailure(f"{self.path.name}: no logits for batch row {index}", -102)
        return int(address)

    def _logits_block(self, context: int, outputs: Sequence[int]) -> memoryview | None:
        """The logits rows of ``outputs`` (every batch row that asked for logits, ascending)
        as one read-only view: llama.cpp keeps the logits of a batch's flagged rows contiguous,
        in batch order (``llama_get_logits``). The addresses of the first and last rows confirm
        that layout; None when they do not (the rows are then read one by one)."""
        if type(outputs) is not range or outputs.step != 1:
            return None
        first = self._row_address(context, outputs[0])
        row_bytes = self.n_vocab * 4
        last = self._logits_address(context, outputs[-1])
        if last != first + (len(outputs) - 1) * row_bytes:
            return None
        return cast(memoryview, _memory_at(first, len(outputs) * row_bytes, _PYBUF_READ))

    def _rollback(self, firsts: Sequence[tuple[int, int]]) -> None:
        """Remove what a failed call added: each (sequence, first position) from there on."""
        for seq_id, first in firsts:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, first, -1)

    # -- sequences -------------------------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop positions [p0, p1) of ``seq_id`` (p1 < 0: to the end; seq_id < 0: all sequences)."""
        with self._lock:
            self._require_open()
            return bool(llama_cpp.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of ``seq_id``, -1 when it has none."""
        with self._lock:
            self._require_open()
            return int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id))

    def clear(self) -> None:
        """Drop every sequence's cache."""
        with self._lock:
            self._require_open()
            llama_cpp.llama_memory_clear(self._memory, True)

    # -- whole-sequence snapshots (rollback of a truncating prefill, session transfer) ---------

    def max_state_bytes(self, length: int) -> int:
        """An upper bound of :meth:`save_sequence`'s bytes (without its prefix) for a sequence
        of ``length`` positions: what an import of that length may carry here."""
        return _state.max_portable_bytes(self._state_geometry, length, self.n_state_sections)

    def _state_limits(self) -> _StateLimits:
        return {
            "n_sections": self.n_state_sections,
            "max_cells": self.n_ctx_seq,
            "kv_ggml_type": _KV_TYPES[self.settings.kv_type],
            # llama.cpp stores V transposed unless flash attention is on (llama-context.cpp).
            "v_trans": 0 if self.settings.flash_attn else 1,
            "geometry": self._state_geometry,
        }

    def _raw_state(self, context: int, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
        size = int(llama_cpp.llama_state_seq_get_size(context, seq_id))
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = int(llama_cpp.llama_state_seq_get_data(context, buffer, size, seq_id))
        if written != size:
            raise RuntimeFailure(
                f"{self.path.name}: snapshot of sequence {seq_id} wrote {written} of {size} bytes",
                -103,
            )
        return buffer

    def save_sequence(self, seq_id: int, prefix: bytes = b"") -> tuple[bytes, _state.SequenceState]:
        """The cached positions of ``seq_id`` (KV of every layer) in the portable form of
        :mod:`._state` (loadable into any context with the same settings, whatever its
        sequence count) after ``prefix``, and what it holds."""
        with self._lock:
            context = self._require_open()
            if not 0 <= seq_id < self.settings.n_seq_max:
                raise InvalidInputError(f"seq_id {seq_id} outside [0, {self.settings.n_seq_max})")
            buffer = self._raw_state(context, seq_id)
            try:
                return _state.portable(
                    memoryview(buffer)[: ctypes.sizeof(buffer)],
                    n_stream=self.settings.n_seq_max,
                    seq_id=seq_id,
                    prefix=prefix,
                    **self._state_limits(),
                )
            except _state.StateFormatError as error:
                raise RuntimeFailure(
                    f"{self.path.name}: llama.cpp wrote a sequence state this module does not "
                    f"know: {error}",
                    -105,
                ) from error

    def restore_sequence(
        self, seq_id: int, snapshot: bytes | memoryview, *, expect_length: int | None = None
    ) -> _state.SequenceState:
        """Replace ``seq_id``'s cache with a portable snapshot (from :meth:`save_sequence` of
        a context with the same settings). The snapshot is checked field by field first
        (InvalidInputError, the sequence left empty); llama.cpp refusing it (layer count, row
        sizes) is InvalidInputError too, and leaves the sequence empty.

        ``expect_length``: the snapshot comes from elsewhere and must hold this many
        positions; its K and V values are checked too (finite, within float16's range). Both
        before llama.cpp reads any of it: llama.cpp writes the values into the KV cache before
        it can refuse, and a released cell's values are still read (masked) by every later
        sequence of that stream."""
        with self._lock:
            context = self._require_open()
            if not 0 <= seq_id < self.settings.n_seq_max:
                raise InvalidInputError(f"seq_id {seq_id} outside [0, {self.settings.n_seq_max})")
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            try:
                local, state = _state.localize(
                    snapshot,
                    n_stream=self.settings.n_seq_max,
                    seq_id=seq_id,
                    check_values=expect_length is not None,
                    **self._state_limits(),
                )
            except _state.StateFormatError as error:
                raise InvalidInputError(f"not a sequence state of this shard: {error}") from error
            if expect_length is not None and state.length != expect_length:
                raise InvalidInputError(
                    f"the state holds {state.length} positions, the snapshot says {expect_length}"
                )
            if state.length == 0:
                return state
            buffer = (ctypes.c_uint8 * len(local)).from_buffer_copy(local)
            read = int(llama_cpp.llama_state_seq_set_data(context, buffer, len(local), seq_id))
            if read != len(local):
                llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
                raise InvalidInputError(
                    f"{self.path.name}: llama.cpp refused the sequence state (read {read} of "
                    f"{len(local)} bytes): its layers or tensor sizes are not this shard's"
                )
            if int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)) != state.length - 1:
                llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
                raise InvalidInputError(
                    f"{self.path.name}: the restored sequence does not end at {state.length - 1}"
                )
            return state

    # -- vocabulary ----------------------------------------------------------------------------

    def token_to_piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens rendered too)."""
        return token_piece(self._vocab, token, special=True)

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return tokenize(self._vocab, text, add_special)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and model; safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._context is not None:
                llama_cpp.llama_free(self._context)
                self._context = None
            if self._model is not None:
                llama_cpp.llama_model_free(self._model)
                self._model = None

    def __enter__(self) -> ShardRuntime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter shutdown ctypes, llama_cpp and even contextlib may already be torn
        # down, hence a bare try rather than contextlib.suppress.
        try:  # noqa: SIM105 - contextlib may be gone at interpreter shutdown
            self.close()
        except Exception:  # noqa: BLE001
            pass
