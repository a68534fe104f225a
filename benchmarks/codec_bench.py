"""Boundary-bundle wire cost against its floors and alternatives; prints a table.

For bundles of 1, 128 and 512 rows x 4096 in f16, bf16 and f32 it times, in one run:

- memcpy: ``np.copyto`` of the payload into a preallocated buffer (the floor: one copy).
- codec: ``encode_bundle`` + ``decode_bundle()`` with its defaults (``nonfinite="reject"``, what
  every worker gets): encode (one copy into the message), zero-copy decode, header checks,
  xxh3-64 checksum verification and the finiteness test: one pass in the optional C extension
  (``shard_engine_api._native``) where it was built, which the table's heading says.
- codec-allow: the same with the non-default ``nonfinite="allow"`` (no finiteness test).
- codec-fallback: the default codec with the pure-Python verification an install without a C
  compiler gets (the xxhash package, then two numpy max reductions over integer views of the
  bits); only measured when the extension is in use, in a child process started with
  ``SHARD_ENGINE_API_NATIVE=0`` (the choice is made when the API is imported).
- pickle+sum: ``pickle.dumps((header, payload_bytes, checksum))`` + ``loads`` + the same
  ``payload_checksum`` verification (payload bytes made outside the timing, favouring pickle;
  it checks no finiteness).
- gzip-1: ``tobytes()`` + ``gzip.compress(level=1)`` + ``gzip.decompress``.

The bundle's checksum is computed when an engine creates it, so no encode path recomputes it.
Each figure is the median of many repetitions, in microseconds.

Usage: ``python benchmarks/codec_bench.py [--quick | --smoke] [--results PATH]``
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
from _results import Results, add_results_option, add_size_options, run_mode

from shard_engine_api import CONTRACT_VERSION, BoundaryBundle, BoundaryDtype, SessionRef
from shard_engine_api.wire import (
    CHECKSUM_ALGORITHM,
    NATIVE_ENV,
    NATIVE_VECTOR,
    decode_bundle,
    encode_bundle,
    numpy_dtype,
    payload_checksum,
)

SHAPES = [(1, 4096), (128, 4096), (512, 4096)]
VERIFICATION = (
    f"native (the API's C extension, {NATIVE_VECTOR})"
    if NATIVE_VECTOR is not None
    else "fallback (xxhash package + numpy; the C extension is not built or is disabled)"
)


DTYPES: list[BoundaryDtype] = ["f16", "bf16", "f32"]


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


def make_bundle(n_tokens: int, hidden: int, dtype: BoundaryDtype) -> BoundaryBundle:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    return BoundaryBundle.from_array(
        values,
        session=SessionRef(session_id="bench", epoch=1),
        first_pos=0,
        layer=4,
        model_fingerprint="bench-model",
        dtype=dtype,
    )


FALLBACK_FLAG = "--fallback-codec-us"


def fallback_codec_us(n_tokens: int, hidden: int, dtype: BoundaryDtype, budget_s: float) -> float:
    """The codec figure with the pure-Python verification, from a child process that imports
    the API with the C extension disabled; NaN where the extension is not in use here."""
    if NATIVE_VECTOR is None:
        return math.nan
    child = subprocess.run(
        [sys.executable, __file__, FALLBACK_FLAG, str(n_tokens), str(hidden), dtype, str(budget_s)],
        env={**os.environ, NATIVE_ENV: "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(child.stdout)


def print_codec_us(n_tokens: int, hidden: int, dtype: BoundaryDtype, budget_s: float) -> None:
    """The child's side of :func:`fallback_codec_us`."""
    bundle = make_bundle(n_tokens, hidden, dtype)
    print(median_us(lambda: decode_bundle(encode_bundle(bundle)), budget_s, 20000))


def measure(n_tokens: int, hidden: int, dtype: BoundaryDtype, budget_s: float) -> dict[str, float]:
    bundle = make_bundle(n_tokens, hidden, dtype)
    # The payload as stored (bf16 as its uint16 bits): memcpy copies exactly the payload bytes.
    source = np.frombuffer(bundle.payload, dtype=numpy_dtype(dtype)).reshape(n_tokens, hidden)
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
        "codec-fallback": fallback_codec_us(n_tokens, hidden, dtype, budget_s),
        "pickle+sum": median_us(pickled, budget_s, 20000),
        "gzip-1": median_us(gzipped, budget_s, 200),
    }
    # Zero-copy sanity: the decoded array is a view into the message bytes.
    message = encode_bundle(bundle)
    decoded = decode_bundle(message)
    if not np.shares_memory(
        np.frombuffer(decoded.payload, dtype=np.uint8), np.frombuffer(message, dtype=np.uint8)
    ):
        raise AssertionError("decode copied the payload")
    return results


TARGET_CODEC_OVER_MEMCPY = 2.2
"""The target at 512x4096 in a 16-bit dtype (f16 and bf16), with the default policy."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser, quick="shorter time budget per figure")
    add_results_option(parser)
    args = parser.parse_args()
    mode = run_mode(args)
    budget_s = {"smoke": 0.0, "quick": 0.1, "full": 0.5}[mode]
    results = Results(
        args.results,
        "codec",
        mode=mode,
        budget_s=budget_s,
        checksum=CHECKSUM_ALGORITHM,
        verification=VERIFICATION,
    )
    slower_than_pickle: list[str] = []
    columns = ["memcpy", "codec", "codec-allow", "codec-fallback", "pickle+sum", "gzip-1"]
    ratios = f"{'codec/memcpy':>14}{'allow/memcpy':>14}{'codec/pickle':>14}{'fallbk/pickle':>14}"
    print(f"payload verification: {VERIFICATION}")
    print("codec = encode_bundle + decode_bundle() with its defaults (nonfinite='reject');")
    print("codec-allow = the same with the non-default nonfinite='allow'; checksum xxh3-64;")
    print("codec-fallback = codec with the pure-Python verification (no C extension)")
    print(f"{'bundle':<14}{'MiB':>7}" + "".join(f"{c:>15}" for c in columns) + ratios)
    for n_tokens, hidden in SHAPES:
        for dtype in DTYPES:
            r = measure(n_tokens, hidden, dtype, budget_s)
            size_mib = n_tokens * hidden * (4 if dtype == "f32" else 2) / 2**20
            name = f"{n_tokens}x{hidden}_{dtype}"
            for column in columns:
                if not math.isnan(r[column]):
                    results.record(f"{name}_{column}_us", round(r[column], 2), "us")
            over_memcpy = r["codec"] / r["memcpy"]
            results.record(f"{name}_codec_over_memcpy", round(over_memcpy, 2), "x")
            results.record(
                f"{name}_codec_allow_over_memcpy",
                round(r["codec-allow"] / r["memcpy"], 2),
                "x",
                "nonfinite='allow'",
            )
            over_pickle = r["codec"] / r["pickle+sum"]
            results.record(f"{name}_codec_over_pickle", round(over_pickle, 2), "x")
            fallback_over_pickle = r["codec-fallback"] / r["pickle+sum"]
            if not math.isnan(fallback_over_pickle):
                results.record(
                    f"{name}_codec_fallback_over_pickle",
                    round(fallback_over_pickle, 2),
                    "x",
                    "without the C extension",
                )
            if over_pickle >= 1.0:
                slower_than_pickle.append(f"{n_tokens}x{hidden} {dtype}")
            print(
                f"{f'{n_tokens}x{hidden} {dtype}':<14}{size_mib:>7.3f}"
                + "".join(f"{r[c]:>15.1f}" for c in columns)
                + f"{over_memcpy:>14.2f}"
                + f"{r['codec-allow'] / r['memcpy']:>14.2f}"
                + f"{r['codec'] / r['pickle+sum']:>14.2f}"
                + f"{fallback_over_pickle:>14.2f}"
            )
    print(
        f"times: median microseconds; targets: codec <= {TARGET_CODEC_OVER_MEMCPY}x memcpy at "
        "512x4096 f16 and bf16, codec < pickle+sum at every size"
    )
    print(
        "codec slower than pickle+sum at: " + ", ".join(slower_than_pickle)
        if slower_than_pickle
        else "codec faster than pickle+sum at every size"
    )
    results.record("codec_faster_than_pickle_everywhere", not slower_than_pickle)
    results.save()


if __name__ == "__main__":
    if sys.argv[1:2] == [FALLBACK_FLAG]:
        size, width, kind, budget = sys.argv[2:]
        if kind not in DTYPES:
            raise SystemExit(f"unknown dtype {kind!r}")
        print_codec_us(int(size), int(width), DTYPES[DTYPES.index(kind)], float(budget))
    else:
        main()
