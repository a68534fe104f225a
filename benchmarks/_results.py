"""Machine-readable results of the benchmarks, for tools/readme_figures.py.

Every ``*_bench.py`` prints its tables for people and, when given ``--results PATH`` (or
``$SHARD_ENGINE_BENCH_RESULTS``), also merges its figures into one JSON file::

    {"benches": {"fake": {"run": {...how it was run...},
                          "figures": {"decode_steps_per_s_hidden_64": {"value": 21000.0,
                                      "unit": "steps/s", "setting": "..."}}}}}

``run`` says how the figures were taken (quick or full, repetitions, load average before and
after, CPUs, versions), so a README rendered from them can say so too. A benchmark that did not
run leaves no section; a section is replaced whole when its benchmark runs again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Final, Literal

RESULTS_ENV: Final = "SHARD_ENGINE_BENCH_RESULTS"

Value = float | int | str | bool


Mode = Literal["full", "quick", "smoke"]


def add_size_options(parser: argparse.ArgumentParser, quick: str) -> None:
    """``--quick`` (described by ``quick``) or ``--smoke`` (tiny sizes that prove the benchmark
    runs and measure nothing: tools/readme_figures.py never renders a smoke run's figures)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick)
    size.add_argument(
        "--smoke", action="store_true", help="tiny sizes: proves it runs, measures nothing"
    )


def run_mode(args: argparse.Namespace) -> Mode:
    """The mode ``add_size_options`` chose, as ``Results`` records it (``mode``)."""
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """``--results PATH``: where to merge this benchmark's figures (default: the env var)."""
    parser.add_argument(
        "--results",
        default=os.environ.get(RESULTS_ENV) or None,
        help=f"merge machine-readable figures into this JSON file (default: ${RESULTS_ENV})",
    )


def _load_average() -> float:
    return round(os.getloadavg()[0], 2)


class Results:
    """The figures of one benchmark run; ``save`` merges them into the results file."""

    def __init__(self, path: str | None, bench: str, **run: Value) -> None:
        self.path = Path(path) if path else None
        self.bench = bench
        self.run: dict[str, Value] = {
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count() or 0,
            "machine": platform.machine(),
            "python": platform.python_version(),
            "load_average_before": _load_average(),
            **run,
        }
        self.figures: dict[str, dict[str, Value]] = {}

    def record(self, key: str, value: Value, unit: str = "", setting: str = "") -> None:
        """One figure. ``setting`` names any non-default setting it was measured with."""
        figure: dict[str, Value] = {"value": value, "unit": unit}
        if setting:
            figure["setting"] = setting
        self.figures[key] = figure

    def save(self) -> None:
        """Merge this benchmark's section into the results file (no-op without a path)."""
        if self.path is None:
            return
        self.run["load_average_after"] = _load_average()
        document: dict[str, dict[str, object]] = {"benches": {}}
        if self.path.is_file():
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict) and isinstance(loaded.get("benches"), dict):
                document = loaded
        document["benches"][self.bench] = {"run": self.run, "figures": self.figures}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", "utf-8")
        temporary.replace(self.path)
        print(f"figures merged into {self.path}", file=sys.stderr)
