"""Header and tensor-table fuzz of every family: no file the validator accepts may abort
llama.cpp, be refused by it, return NaN, decode a row other than a prefill computes, or split
into shards whose pipeline differs from it.
Bounded by default (40 mutants and 20 files of consistent, adversarial hyper-parameters per
family, about 15 s); ``SHARD_ENGINE_LLAMA_FUZZ_PER_FAMILY=300`` and
``SHARD_ENGINE_LLAMA_FUZZ_CONSISTENT=300`` (or ``python tests/gguf_fuzz.py --per-family 300
--consistent 300``) run deeper, ``SHARD_ENGINE_LLAMA_FUZZ_SEED`` picks other mutants."""

from __future__ import annotations

import os
from pathlib import Path

from gguf_fuzz import run

from shard_engine_llama._tiny_model import SUPPORTED_TINY_ARCHITECTURES

PER_FAMILY = int(os.environ.get("SHARD_ENGINE_LLAMA_FUZZ_PER_FAMILY", "40"))
SEED = int(os.environ.get("SHARD_ENGINE_LLAMA_FUZZ_SEED", "0"))
CONSISTENT = int(os.environ.get("SHARD_ENGINE_LLAMA_FUZZ_CONSISTENT", "20"))


def test_no_accepted_file_aborts_is_refused_by_llama_cpp_or_computes_nan(tmp_path: Path) -> None:
    report = run(tmp_path, PER_FAMILY, SEED, CONSISTENT)
    print(report.summary())
    assert report.generated >= PER_FAMILY * 10 + CONSISTENT * len(SUPPORTED_TINY_ARCHITECTURES)
    assert len(report.generated_by_family) == len(SUPPORTED_TINY_ARCHITECTURES) + 1  # + llama-moe
    assert report.accepted > 0, "the mutations should leave some files loadable"
    assert not report.aborts, report.aborts
    assert not report.missed, report.missed
    assert not report.nonfinite, report.nonfinite
    assert not report.drift, report.drift
    assert not report.split_differs, report.split_differs
    assert report.pipelines > 0, "some accepted files should be shardable"
    assert report.loaded == report.accepted
