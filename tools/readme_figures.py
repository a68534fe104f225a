"""Render the README's "What has been measured" figures from the benchmarks' results.

    python tools/readme_figures.py [--results .nox/bench/results.json] [--write | --check]

``nox -s bench`` merges every benchmark's figures into ``.nox/bench/results.json`` (see
``benchmarks/_results.py``). This tool renders them as the block of README.md between the
two marker lines below. ``--write`` replaces that block and keeps the results it was rendered
from in ``benchmarks/readme-figures.json`` (so a test can re-render and compare); ``--check``
exits 1 when the README's block differs from the rendering of the kept results; without
either it prints the rendering. Figures a run did not produce (no gemma3-270m in the model
store, a ``--smoke`` llama run) are rendered as not measured, never carried over.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
README: Final = ROOT / "README.md"
KEPT_RESULTS: Final = ROOT / "benchmarks" / "readme-figures.json"
DEFAULT_RESULTS: Final = ROOT / ".nox" / "bench" / "results.json"
BEGIN: Final = "<!-- figures: begin (tools/readme_figures.py renders this from nox -s bench) -->"
END: Final = "<!-- figures: end -->"
NOT_MEASURED: Final = "not measured"

Results = Mapping[str, object]


class Figures:
    """Typed access to one results document."""

    def __init__(self, document: Results) -> None:
        benches = document.get("benches", {})
        self.benches: Mapping[str, Mapping[str, object]] = (
            benches if isinstance(benches, Mapping) else {}
        )

    def run(self, bench: str) -> Mapping[str, object]:
        run = self.benches.get(bench, {}).get("run", {})
        return run if isinstance(run, Mapping) else {}

    def measured(self, bench: str) -> bool:
        """Whether ``bench`` ran for real (a smoke run measures nothing)."""
        return bench in self.benches and self.run(bench).get("mode") != "smoke"

    def value(self, bench: str, key: str) -> float | None:
        if not self.measured(bench):
            return None
        figures = self.benches[bench].get("figures", {})
        figure = figures.get(key) if isinstance(figures, Mapping) else None
        value = figure.get("value") if isinstance(figure, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value)

    def values(self, bench: str, *keys: str) -> tuple[float, ...] | None:
        """The values of every one of ``keys``, or None when any is missing (a figure is
        rendered whole or not at all)."""
        values = [self.value(bench, key) for key in keys]
        if any(value is None for value in values):
            return None
        return tuple(value for value in values if value is not None)

    def flag(self, bench: str, key: str) -> bool | None:
        if not self.measured(bench):
            return None
        figures = self.benches[bench].get("figures", {})
        figure = figures.get(key) if isinstance(figures, Mapping) else None
        value = figure.get("value") if isinstance(figure, Mapping) else None
        return value if isinstance(value, bool) else None


_KEEP: Final = "\x00"


def _wrap(text: str, indent: str = "") -> str:
    """Wrap at 100 columns like the rest of the README, never inside a `code span`."""
    pieces = text.split("`")
    joined = "`".join(
        piece.replace(" ", _KEEP) if index % 2 else piece for index, piece in enumerate(pieces)
    )
    wrapped = textwrap.fill(joined, width=100, subsequent_indent=indent, break_on_hyphens=False)
    return wrapped.replace(_KEEP, " ")


def _bullet(title: str, text: str | None) -> str:
    """One README bullet."""
    return _wrap(
        f"- **{title}**: {text if text is not None else NOT_MEASURED + ' in this run.'}", "  "
    )


def _provenance(figures: Figures) -> str:
    runs = [figures.run(bench) for bench in ("codec", "fake", "llama") if bench in figures.benches]
    if not runs:
        return "No benchmark results yet: run `python3 -m nox -s bench -- --readme`."
    started = sorted(str(run.get("started", "?")) for run in runs)
    modes = sorted({str(run.get("mode", "full")) for run in runs})
    loads = [
        float(load)
        for run in runs
        for key in ("load_average_before", "load_average_after")
        if isinstance(load := run.get(key), int | float)
    ]
    load_text = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "unknown"
    spin = figures.run("llama").get("gomp_spincount", "10000")
    text = (
        f"Generated from one `nox -s bench` ({' and '.join(modes)} run started "
        f"{started[0][:16].replace('T', ' ')} UTC, {runs[0].get('cpus', '?')} CPUs, 1-minute "
        f"load average {load_text} during the run; medians). Worker defaults throughout: the "
        'codec and `ValidatingEngine` with `nonfinite="reject"`, the llama engine with 2 '
        f"threads and `GOMP_SPINCOUNT={spin}`."
    )
    return _wrap(text)


def _split(f: Figures) -> str | None:
    names = ("2_way_prefill", "3_way_prefill", "2_way_decode", "3_way_decode")
    generated = f.values(
        "llama",
        *(f"generated_{name}_ratio" for name in names),
        "generated_3_way_decode_overhead_per_hop_ms",
    )
    if generated is None:
        return None
    *ratios, hop = generated
    p2, p3, d2, d3 = (f"{value:.2f}" for value in ratios)
    text = ""
    gemma = f.values("llama", *(f"gemma3_{name}_ratio" for name in names))
    if f.flag("llama", "gemma3_measured") and gemma is not None:
        g2, g3, e2, e3 = (f"{value:.2f}" for value in gemma)
        text = (
            f"gemma3-270m split/unsplit throughput {g2} / {g3} (prefill) and {e2} / {e3} "
            "(decode) for 2- / 3-way splits in one process. "
        )
    else:
        text = (
            "gemma3-270m was not in the model store for this run (`nox -s certify` puts it there). "
        )
    return (
        f"{text}On the generated n_embd-512 model: {p2} / {p3} (prefill) and {d2} / {d3} "
        f"(decode); the API costs {hop:.3f} ms per hop."
    )


def _process(f: Figures) -> str | None:
    found = f.values(
        "llama",
        "generated_3_way_proc_decode_over_in_process",
        "generated_unsplit_proc_decode_ratio",
        "generated_spin_10000_idle_cpu_ms",
        "generated_spin_300000_idle_cpu_ms",
    )
    if found is None:
        return None
    process, alone, spin_default, spin_gomp = found
    return (
        f"pipes and the wire codec, generated model: 3-way decode at {process:.2f} of the "
        f"same split in one process; the unsplit model alone behind the same pipes at "
        f"{alone:.2f} of in-process. In the 50 ms after a decode returns, a process burns "
        f"{spin_default:.1f} ms of CPU with the default spin count and {spin_gomp:.1f} ms "
        "with libgomp's own (`GOMP_SPINCOUNT=300000`): cores taken from the next shard."
    )


def _batched(f: Figures) -> str | None:
    speedup = f.value("llama", "generated_unsplit_batched_speedup")
    sessions = f.run("llama").get("batch_sessions")
    if speedup is None or not isinstance(sessions, int):
        return None
    gemma = f.value("llama", "gemma3_unsplit_batched_speedup")
    extra = f"; gemma3-270m {gemma:.1f}x" if gemma is not None else ""
    return (
        f"{sessions} sessions, one `decode_batch` per step: {speedup:.1f}x sequential "
        f"(generated model{extra})."
    )


def _codec(f: Figures) -> str | None:
    """Default policy (``nonfinite="reject"``) throughout; the one non-default figure names its
    setting. Each dtype's ratios come from the same run."""
    parts: list[str] = []
    for dtype in ("f16", "bf16", "f32"):
        pair = f.values(
            "codec", f"512x4096_{dtype}_codec_over_memcpy", f"512x4096_{dtype}_codec_over_pickle"
        )
        if pair is not None:
            memcpy, pickle = pair
            parts.append(f"{dtype} {memcpy:.2f}x one memcpy and {pickle:.2f}x checksummed pickle")
    if not parts:
        return None
    # Runs from before the checksum was recorded used contract version 1's.
    checksum = f.run("codec").get("checksum", "gsum64-crc32")
    text = (
        f"encode + decode + verify ({checksum} checksum and finiteness, the default "
        f'`nonfinite="reject"`) of a 512x4096 bundle: {"; ".join(parts)}'
    )
    allow = f.value("codec", "512x4096_f16_codec_allow_over_memcpy")
    if allow is not None:
        text += f' (f16 with the non-default `nonfinite="allow"`: {allow:.2f}x memcpy)'
    rows = []
    for size in ("1x4096", "128x4096"):
        ratios = f.values(
            "codec", *(f"{size}_{dtype}_codec_over_pickle" for dtype in ("f16", "bf16", "f32"))
        )
        if ratios is not None:
            rows.append(f"{size}: " + " / ".join(f"{ratio:.2f}" for ratio in ratios))
    if rows:
        text += f". Codec over checksummed pickle (f16 / bf16 / f32) at {'; '.join(rows)}"
    return text + "."


def _fake(f: Figures) -> str | None:
    found = f.values(
        "fake",
        "decode_steps_per_s_hidden_64",
        "decode_unwrapped_steps_per_s_hidden_64",
        "tail_bundle_decode_steps_per_s_hidden_64",
        "conformance_seconds",
    )
    if found is None:
        return None
    decode, unwrapped, tail, conformance = found
    return (
        f"{decode:,.0f} decode steps/s through the API with validation at hidden size 64 "
        f"({unwrapped:,.0f} without the wrapper; {tail:,.0f} for a tail shard decoding "
        f"received bundles); the conformance suite on the fake takes {conformance:.1f} s."
    )


def _cancel(f: Figures) -> str | None:
    latency = f.values(
        "llama", "generated_cancel_latency_median_ms", "generated_cancel_latency_max_ms"
    )
    rolled = f.flag("llama", "generated_cancel_rolled_back")
    if latency is None or rolled is None:
        return None
    median, worst = latency
    return (
        f"cancel -> `Cancelled` in {median:.1f} ms (median; max {worst:.1f}) during a "
        f"llama.cpp prefill of the generated model; session "
        f"{'rolled back' if rolled else 'NOT rolled back'}."
    )


def _migration(f: Figures) -> str | None:
    model = f.run("migration").get("model")
    if model not in ("gemma3", "generated"):
        return None
    key = f"{model}_2048"
    found = f.values(
        "migration",
        *(f"{key}_{name}" for name in ("replay_ms", "tail_move_ms", "tail_ratio", "all_ratio")),
        f"{key}_tail_bytes_per_position",
    )
    if found is None:
        return None
    replay, tail, tail_ratio, all_ratio, per_position = found
    name = "gemma3-270m" if model == "gemma3" else "the generated model (no gemma3-270m)"
    return (
        f"moving a 2,048-position session of {name} to a fresh engine (export, wire "
        f"encode + decode, import) takes {tail:.1f} ms for the tail shard: {tail_ratio:.3f}x "
        f"replaying its prefill through the 3-shard pipeline ({replay:,.0f} ms); all three "
        f"shards {all_ratio:.3f}x; {per_position:,.0f} bytes per position for the tail shard."
    )


def _spread(f: Figures, key: str) -> str:
    """``; repetitions LOW-HIGH``: the range of one repetition's ratio, when recorded."""
    pair = f.values("llama", f"{key}_rep_min", f"{key}_rep_max")
    return "" if pair is None else f"; repetitions {pair[0]:.3f}-{pair[1]:.3f}"


def _raw(f: Figures) -> str | None:
    """The llama engine against llama-cpp-python's raw batch API in the same run."""
    parts: list[str] = []
    for model, name in (("gemma3", "gemma3-270m"), ("generated", "the generated model")):
        if model == "gemma3" and not f.flag("llama", "gemma3_measured"):
            continue
        pair = f.values(
            "llama", f"{model}_raw_cmp_engine_of_raw", f"{model}_raw_cmp_batched_of_raw"
        )
        if pair is not None:
            single, batched = pair
            one = _spread(f, f"{model}_raw_cmp_engine_of_raw")
            many = _spread(f, f"{model}_raw_cmp_batched_of_raw")
            parts.append(
                f"{name} {single:.3f} (one session{one}) and {batched:.3f} (batched{many})"
            )
    if not parts:
        return None
    sessions = f.run("llama").get("batch_sessions", "?")
    same = [
        f.flag("llama", f"{model}_raw_cmp_greedy_tokens_identical")
        for model in ("gemma3", "generated")
    ]
    tokens = (
        "same greedy tokens" if all(flag is not False for flag in same) else "greedy tokens DIFFER"
    )
    return (
        "decode throughput of the engine over llama.cpp itself (llama-cpp-python's batch API, "
        f"same threads, KV type and context shape, {sessions} sessions when batched): "
        f"{'; '.join(parts)}; {tokens}."
    )


def _moe(f: Figures) -> str | None:
    """The generated mixture-of-experts (qwen3moe) model, measured like the dense one."""
    if not f.flag("llama", "moe_measured"):
        return None
    names = ("2_way_prefill", "3_way_prefill", "2_way_decode", "3_way_decode")
    found = f.values(
        "llama", *(f"moe_{name}_ratio" for name in names), "moe_unsplit_batched_speedup"
    )
    raw = f.value("llama", "moe_raw_cmp_engine_of_raw")
    if found is None:
        return None
    *ratios, speedup = found
    p2, p3, d2, d3 = (f"{value:.2f}" for value in ratios)
    text = (
        f"generated qwen3moe model, split/unsplit throughput {p2} / {p3} (prefill) and "
        f"{d2} / {d3} (decode) for 2- / 3-way splits in one process; batched decode "
        f"{speedup:.1f}x sequential"
    )
    if raw is not None:
        text += f"; the engine at {raw:.3f} of raw llama.cpp"
    return text + "."


def _remote(f: Figures) -> str | None:
    """A remote decode hop over each transport, and the 3-process pipeline."""
    hops = f.values("remote", "child_framed_decode_added_us", "child_grpc_decode_added_us")
    server = f.value("remote", "server_grpc_decode_added_us")
    if hops is None:
        return None
    framed, grpc = hops
    text = (
        f"a decode hop to a spawned child adds {framed:.0f} us over the framed unix socket "
        f"(the spawn default) and {grpc:.0f} us over gRPC"
    )
    if server is not None:
        text += f" ({server:.0f} us to a gRPC server in the same process)"
    pipeline = f.values(
        "remote",
        "pipeline_3_shards_3_processes_decode_x",
        "pipeline_3_shards_3_processes_prefill_x",
    )
    if pipeline is not None:
        decode, prefill = pipeline
        gemma = f.flag("remote", "pipeline_gemma3")
        model = (
            "gemma3-270m"
            if gemma
            else "the generated model"
            if gemma is False
            else "gemma3-270m or the generated model"
        )
        text += (
            f". {model} in 3 shards, each in its own spawned process: {decode:.2f} of unsplit "
            f"decode throughput and {prefill:.2f} of unsplit prefill"
        )
    return text + "."


def render(document: Results) -> str:
    """The README block (marker lines included) for a results document."""
    f = Figures(document)
    return "\n".join(
        [
            BEGIN,
            _provenance(f),
            "",
            _bullet("Split overhead (llama engine)", _split(f)),
            _bullet("Against raw llama.cpp", _raw(f)),
            _bullet("Mixture of experts", _moe(f)),
            _bullet("One process per shard", _process(f)),
            _bullet("Remote shards", _remote(f)),
            _bullet("Batched decode", _batched(f)),
            _bullet("Wire codec", _codec(f)),
            _bullet("Fake engine", _fake(f)),
            _bullet("Cancellation", _cancel(f)),
            _bullet("Session migration", _migration(f)),
            END,
        ]
    )


def readme_block(text: str) -> str:
    """The README's current block, marker lines included. Raises ValueError without markers."""
    begin = text.index(BEGIN)
    end = text.index(END, begin) + len(END)
    return text[begin:end]


def replace_block(text: str, block: str) -> str:
    current = readme_block(text)
    return text.replace(current, block, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite README.md's block")
    mode.add_argument("--check", action="store_true", help="README matches the kept results")
    args = parser.parse_args(argv)
    if args.check:
        document = json.loads(KEPT_RESULTS.read_text(encoding="utf-8"))
        if readme_block(README.read_text(encoding="utf-8")) != render(document):
            print(f"README.md's figures differ from {KEPT_RESULTS}: run --write", file=sys.stderr)
            return 1
        return 0
    document = json.loads(args.results.read_text(encoding="utf-8"))
    block = render(document)
    if not args.write:
        print(block)
        return 0
    README.write_text(replace_block(README.read_text(encoding="utf-8"), block), encoding="utf-8")
    KEPT_RESULTS.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", "utf-8")
    print(f"README.md figures rewritten from {args.results} (kept as {KEPT_RESULTS})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
