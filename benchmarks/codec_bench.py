"""Boundary-bundle wire cost against its floors and alternatives; prints a table.

For bundles of 1, 128 and 512 rows x 4096 in f16 and f32 it times, in one run:

- memcpy: ``np.copyto`` of the payload into a preallocated buffer (the floor: one copy).
- codec: ``encode_bundle`` + ``decode_bundle(nonfinite="allow")``: encode (one copy into the
  message), zero-copy decode, header checks and checksum verification.
- codec+finite: the same with the default ``nonfinite="reject"`` policy (adds a finiteness pass).
- pickle+sum: ``pickle.dumps((header, payload_bytes, checksum))`` + ``loads`` + the same
  ``payload_checksum`` verification (payload bytes made outside the timing, favouring pickle).
- gzip-1: ``tobytes()`` + ``gzip.compress(level=1)`` + ``gzip.decompress``.

The bundle's checksum is computed when an engine creates it, so no encode path recomputes it.
Each figure is the median of many repetitions, in microseconds.

Usage: ``python benchmarks/codec_bench.py [--quick]``
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np

from shard_engine_api import BoundaryBundle, BoundaryDtype, SessionRef
from shard_engine_api.wire import decode_bundle, encode_bundle, payload_checksum

SHAPES = [(1, 4096), (128, 4096), (512, 4096)]
DTYPES: list[BoundaryDtype] = ["f16", "f32"]


def median_us(action: Callable[[], object], budget_s: float, max_reps: int) -> float:
    """Median wall time of ``action`` in microseconds, repeated within a time budget."""
    for _ in range(3):
        action()
    samples: list[int] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_reps and (len(samples) < 5 or time.perf_counter() < deadline):
        started = time.perf_counter_ns()
        action()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000.0


def measure(n_tokens: int, hidden: int, dtype: BoundaryDtype, budget_s: float) -> dict[str, float]:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    bundle = BoundaryBundle.from_array(
        values,
        session=SessionRef(session_id="bench", epoch=1),
        first_pos=0,
        layer=4,
        model_fingerprint="bench-model",
        dtype=dtype,
    )
    source = bundle.array()
    target = np.empty_like(source)
    payload_bytes = bytes(bundle.payload)
    header = {
        "session_id": "bench",
        "epoch": 1,
        "first_pos": 0,
        "n_tokens": n_tokens,
        "hidden_size": hidden,
        "dtype": dtype,
        "layer": 4,
        "model_fingerprint": "bench-model",
        "contract_version": 1,
    }

    def codec() -> None:
        decode_bundle(encode_bundle(bundle), nonfinite="allow")

    def codec_finite() -> None:
        decode_bundle(encode_bundle(bundle))

    def pickled() -> None:
        loaded_header, loaded, checksum = pickle.loads(
            pickle.dumps((header, payload_bytes, bundle.checksum), protocol=5)
        )
        if payload_checksum(loaded) != checksum:
            raise AssertionError("checksum")
        np.frombuffer(loaded, dtype=source.dtype).reshape(
            loaded_header["n_tokens"], loaded_header["hidden_size"]
        )

    def gzipped() -> None:
        restored = gzip.decompress(gzip.compress(source.tobytes(), compresslevel=1))
        np.frombuffer(restored, dtype=source.dtype)

    results = {
        "memcpy": median_us(lambda: np.copyto(target, source), budget_s, 20000),
        "codec": median_us(codec, budget_s, 20000),
        "codec+finite": median_us(codec_finite, budget_s, 20000),
        "pickle+sum": median_us(pickled, budget_s, 20000),
        "gzip-1": median_us(gzipped, budget_s, 200),
    }
    # Zero-copy sanity: the decoded array is a view into the message bytes.
    message = encode_bundle(bundle)
    decoded = decode_bundle(message)
    if not np.shares_memory(decoded.array(), np.frombuffer(message, dtype=np.uint8)):
        raise AssertionError("decode copied the payload")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter time budget per figure")
    args = parser.parse_args()
    budget_s = 0.1 if args.quick else 0.5
    columns = ["memcpy", "codec", "codec+finite", "pickle+sum", "gzip-1"]
    ratios = f"{'codec/memcpy':>14}{'+fin/memcpy':>13}{'codec/pickle':>14}{'+fin/pickle':>13}"
    print(f"{'bundle':<14}{'MiB':>7}" + "".join(f"{c:>14}" for c in columns) + ratios)
    for n_tokens, hidden in SHAPES:
        for dtype in DTYPES:
            r = measure(n_tokens, hidden, dtype, budget_s)
            size_mib = n_tokens * hidden * (2 if dtype == "f16" else 4) / 2**20
            print(
                f"{f'{n_tokens}x{hidden} {dtype}':<14}{size_mib:>7.3f}"
                + "".join(f"{r[c]:>14.1f}" for c in columns)
                + f"{r['codec'] / r['memcpy']:>14.2f}"
                + f"{r['codec+finite'] / r['memcpy']:>13.2f}"
                + f"{r['codec'] / r['pickle+sum']:>14.2f}"
                + f"{r['codec+finite'] / r['pickle+sum']:>13.2f}"
            )
    print("times: median microseconds; targets: codec <= 2.5x memcpy at 512x4096 f16, "
          "codec < pickle+sum at every size")  # fmt: skip


if __name__ == "__main__":
    main()
