"""Whether a shard's context fits: llama.cpp's 32-bit context, and this machine's cores and
memory (what llama.cpp allocates at load, estimated before it does)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Final

from shard_engine_api import InvalidRequest, LoadConfig, ResourceExhausted
from shard_engine_llama._gguf import GGUFHeader
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._gguf.hyperparameters import hyperparameters, largest_count
from shard_engine_llama._gguf.writer import ShardLayout

if TYPE_CHECKING:
    from shard_engine_llama._options import LlamaOptions

__all__ = ["available_cores", "available_memory", "check_memory"]

_MAX_CONTEXT_CELLS: Final = 2**32 - 1  # llama_context_params.n_ctx is a uint32_t
_KV_CELL_PAD: Final = 256  # llama.cpp pads each sequence's KV stream to this many cells


def available_cores() -> int:
    """The cores this process may run on: llama.cpp's threads spin at barriers, so more
    threads than free cores collapses throughput (measured: 12 ms -> 3.5 s per token)."""
    return max(1, len(os.sched_getaffinity(0)))


def available_memory() -> int | None:
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


def check_memory(
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
    available = available_memory()
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
