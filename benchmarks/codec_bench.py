"""Boundary-bundle wire cost against its floors and alternatives; prints a table.

For bundles of 1, 128 and 512 rows x 4096 in f16 and f32 it times, in one run:

- memcpy: ``np.copyto`` of the payload into a preallocated buffer (the floor: one copy).
- codec: ``encode_bundle`` + ``decode_bundle()`` with its defaults (``nonfinite="reject"``, what
  every worker gets): encode (one copy into the message), zero-copy decode, header checks,
  checksum verification and a finiteness pass.
- codec-allow: the same with the non-default ``nonfinite="allow"`` (no finiteness pass).
- pickle+sum: ``pickle.dumps((header, payload_bytes, checksum))`` + ``loads`` + the same
  ``payload_checksum`` verification (payload bytes made outside the timing, favouring pickle).
- gzip-1: ``tobytes()`` + ``gzip.compress(level=1)`` + ``gzip.decompress``.

The bundle's checksum is computed when an engine creates it, so no encode path recomputes it.
Each figure is the median of many repetitions, in microseconds.

Usage: ``python benchmarks/codec_bench.py [--quick | --smoke] [--results PATH]``
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np
from _results import Results, add_results_option

from shard_engine_api import CONTRACT_VERSION, BoundaryBundle, BoundaryDtype, SessionRef
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
        "contract_version": CONTRACT_VERSION,
    }

    def codec() -> None:
        decode_bundle(encode_bundle(bundle))

    def codec_allow() -> None:
        decode_bundle(encode_bundle(bundle), nonfinite="allow")

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
        "codec-allow": median_us(codec_allow, budget_s, 20000),
        "pickle+sum": median_us(pickled, budget_s, 20000),
        "gzip-1": median_us(gzipped, budget_s, 200),
    }
    # Zero-copy sanity: the decoded array is a view into the message bytes.
    message = encode_bundle(bundle)
    decoded = decode_bundle(message)
    if not np.shares_memory(decoded.array(), np.frombuffer(message, dtype=np.uint8)):
        raise AssertionError("decode copied the payload")
    return results


TARGET_CODEC_OVER_MEMCPY = 2.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter time budget per figure")
    size.add_argument("--smoke", action="store_true", help="proves it runs, measures nothing")
    add_results_option(parser)
    args = parser.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    budget_s = {"smoke": 0.0, "quick": 0.1, "full": 0.5}[mode]
    results = Results(args.results, "codec", mode=mode, budget_s=budget_s)
    columns = ["memcpy", "codec", "codec-allow", "pickle+sum", "gzip-1"]
    ratios = f"{'codec/memcpy':>14}{'allow/memcpy':>14}{'codec/pickle':>14}"
    print("codec = encode_bundle + decode_bundle() with its defaults (nonfinite='reject');")
    print("codec-allow = the same with the non-default nonfinite='allow'")
    print(f"{'bundle':<14}{'MiB':>7}" + "".join(f"{c:>14}" for c in columns) + ratios)
    for n_tokens, hidden in SHAPES:
        for dtype in DTYPES:
            r = measure(n_tokens, hidden, dtype, budget_s)
            size_mib = n_tokens * hidden * (2 if dtype == "f16" else 4) / 2**20
            name = f"{n_tokens}x{hidden}_{dtype}"
            for column in columns:
                results.record(f"{name}_{column}_us", round(r[column], 2), "us")
            over_memcpy = r["codec"] / r["memcpy"]
            results.record(f"{name}_codec_over_memcpy", round(over_memcpy, 2), "x")
            results.record(
                f"{name}_codec_allow_over_memcpy",
                round(r["codec-allow"] / r["memcpy"], 2),
                "x",
                "nonfinite='allow'",
            )
            results.record(f"{name}_codec_over_pickle", round(r["codec"] / r["pickle+sum"], 2), "x")
            print(
                f"{f'{n_tokens}x{hidden} {dtype}':<14}{size_mib:>7.3f}"
                + "".join(f"{r[c]:>14.1f}" for c in columns)
                + f"{over_memcpy:>14.2f}"
                + f"{r['codec-allow'] / r['memcpy']:>14.2f}"
                + f"{r['codec'] / r['pickle+sum']:>14.2f}"
            )
    print(
        f"times: median microseconds; targets: codec <= {TARGET_CODEC_OVER_MEMCPY}x memcpy at "
        "512x4096 f16, codec < pickle+sum at every size"
    )
    results.save()


if __name__ == "__main__":
    main()
