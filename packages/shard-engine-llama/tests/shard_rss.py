"""Resident memory of each shard against the full model, each loaded in a fresh process.

``python tests/shard_rss.py [MODEL.gguf] --splits 0:3,3:6,6:8`` (without a model: a generated
qwen3moe). Reports VmRSS after loading and after a 32-token prefill, and the floor: the same
process with llama.cpp initialised and no model. Memory, not time: safe on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys
import numpy as np

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1

from shard_engine_llama._abi import ContextSettings, ShardRuntime
from shard_engine_llama._llama_library import ensure_backend
ensure_backend()
floor = rss_kib()
path = sys.argv[1]
if path == "-":
    print(json.dumps({"floor_kib": floor}))
    raise SystemExit
settings = ContextSettings(n_ctx=256, n_seq_max=1, n_threads=1, n_batch=32, n_ubatch=32)
runtime = ShardRuntime(path, settings=settings)
loaded = rss_kib()
if runtime.is_head:
    runtime.run(0, 0, tokens=[t % runtime.n_vocab for t in range(3, 35)])
else:
    runtime.run(0, 0, embeddings=np.full((32, runtime.n_embd_input), 0.1, dtype=np.float32))
print(json.dumps({"floor_kib": floor, "loaded_kib": loaded, "after_prefill_kib": rss_kib()}))
"""


def _measure(path: str) -> dict[str, int]:
    output = subprocess.run(
        [sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=True
    ).stdout
    result: dict[str, int] = json.loads(output.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    from shard_engine_llama._gguf import split_model
    from shard_engine_llama._tiny_model import write_tiny_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--splits", default="0:3,3:6,6:8")
    args = parser.parse_args(argv)
    ranges = [(int(a), int(b)) for a, b in (part.split(":") for part in args.splits.split(","))]
    with tempfile.TemporaryDirectory(prefix="shard-rss-") as scratch:
        if args.model:
            model = Path(args.model)
        else:
            model = Path(scratch) / "qwen3moe.gguf"
            write_tiny_model(
                model,
                arch="qwen3moe",
                n_layers=8,
                n_embd=256,
                n_head=4,
                n_head_kv=2,
                n_ff=1024,
                vocab=32000,
                n_expert=8,
                n_expert_used=2,
                n_ff_exp=512,
            )
        manifest = split_model(model, ranges, Path(scratch) / "shards")
        report: dict[str, object] = {
            "floor": _measure("-")["floor_kib"],
            "full": _measure(str(model)),
        }
        for index, shard in enumerate(manifest.shards):
            report[f"[{shard.start},{shard.end}) {shard.role}"] = {
                **_measure(str(manifest.shard_path(index))),
                "file_bytes": shard.size,
            }
        report["model_file_bytes"] = model.stat().st_size
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
