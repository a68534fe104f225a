"""The start-up self-test: the pinned llama.cpp must reproduce unsplit logits through a split.

The layer-capture recipe in ``_abi`` relies on internal graph tensor names and struct layouts of
one llama-cpp-python release; this proves on a generated model, before the first engine of a
process reports ready, that a 2-way split still matches the unsplit model bit for bit.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shard_engine_llama._abi import ContextSettings, LlamaRuntimeError, ShardRuntime
from shard_engine_llama._gguf.writer import split_model
from shard_engine_llama._llama_library import (
    LLAMA_CPP_PYTHON_VERSION,
    SUPPORTED_LLAMA_CPP_PYTHON,
)
from shard_engine_llama._tiny_model import write_tiny_model

__all__ = ["SelfTestReport", "self_test"]


@dataclass(frozen=True)
class SelfTestReport:
    """What :func:`self_test` measured."""

    llama_cpp_python: str
    n_prefill: int
    n_decode: int
    max_abs_diff: float
    seconds: float


def self_test(
    directory: str | os.PathLike[str] | None = None, *, n_threads: int = 2
) -> SelfTestReport:
    """Prove the pinned runtime on a generated model: split logits must equal unsplit bit for bit.

    Generates a tiny llama model, splits it 2-way, runs a prefill and two decode steps through
    head -> tail and through the full model. Raises LlamaRuntimeError if anything differs.
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shard-engine-selftest-", dir=directory) as scratch:
        source = Path(scratch) / "tiny.gguf"
        write_tiny_model(source, n_layers=4, seed=1234)
        manifest = split_model(source, [(0, 2), (2, 4)], Path(scratch) / "shards")
        options = ContextSettings(
            n_ctx=64, n_seq_max=1, n_threads=n_threads, n_batch=32, n_ubatch=32
        )
        prompt = [1, 72, 101, 108, 108, 111]
        with (
            ShardRuntime(source, settings=options) as full,
            ShardRuntime(manifest.shard_path(0), settings=options) as head,
            ShardRuntime(manifest.shard_path(1), settings=options) as tail,
        ):
            expected = [full.run(0, 0, tokens=prompt)]
            actual = [tail.run(0, 0, embeddings=head.run(0, 0, tokens=prompt))]
            for step in range(2):
                token = int(np.argmax(expected[-1][-1]))
                position = len(prompt) + step
                expected.append(full.run(0, position, tokens=[token]))
                actual.append(
                    tail.run(0, position, embeddings=head.run(0, position, tokens=[token]))
                )
        max_abs_diff = max(
            float(np.max(np.abs(e - a))) for e, a in zip(expected, actual, strict=True)
        )
        identical = all(np.array_equal(e, a) for e, a in zip(expected, actual, strict=True))
        if not identical or not all(np.all(np.isfinite(e)) for e in expected):
            raise LlamaRuntimeError(
                f"self-test failed: split logits differ from unsplit (max |diff| {max_abs_diff}); "
                "the installed llama.cpp does not behave like "
                f"llama-cpp-python{SUPPORTED_LLAMA_CPP_PYTHON}"
            )
    return SelfTestReport(
        llama_cpp_python=LLAMA_CPP_PYTHON_VERSION,
        n_prefill=len(prompt),
        n_decode=2,
        max_abs_diff=max_abs_diff,
        seconds=time.perf_counter() - started,
    )
