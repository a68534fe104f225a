"""Header and tensor-table fuzz of every family: no file the validator accepts may abort
llama.cpp or be refused by it. Bounded by default; ``SHARD_ENGINE_LLAMA_FUZZ_PER_FAMILY=200``
(or ``python tests/gguf_fuzz.py --per-family 200``) runs deeper."""

from __future__ import annotations

import os
from pathlib import Path

from gguf_fuzz import run

PER_FAMILY = int(os.environ.get("SHARD_ENGINE_LLAMA_FUZZ_PER_FAMILY", "12"))
SEED = int(os.environ.get("SHARD_ENGINE_LLAMA_FUZZ_SEED", "0"))


def test_no_accepted_file_aborts_or_is_refused_by_llama_cpp(tmp_path: Path) -> None:
    report = run(tmp_path, PER_FAMILY, SEED)
    print(report.summary())
    assert report.generated >= PER_FAMILY * 10
    assert report.accepted > 0, "the mutations should leave some files loadable"
    assert not report.aborts, report.aborts
    assert not report.missed, report.missed
    assert report.loaded == report.accepted
