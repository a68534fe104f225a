"""`nox -s bench` installs what the benchmarks import and run, and the README's measured
figures are the renderer's output of kept benchmark results."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import readme_figures

import noxfile

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# Import names of the distributions the bench session installs by requirement string.
REQUIREMENT_IMPORTS = {"pytest": "pytest", "hypothesis": "hypothesis"}
# What benchmarks run in a subprocess rather than import: fake_bench.py times
# `shard-engine conformance`, which runs the suite under pytest.
RUN_BY_SUBPROCESS = {"fake_bench.py": {"pytest"}}


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _package_imports(folder: str) -> set[str]:
    """The import names a package folder provides, plus its declared dependencies."""
    pyproject = tomllib.loads((ROOT / folder / "pyproject.toml").read_text(encoding="utf-8"))
    provided = {child.name for child in (ROOT / folder / "src").iterdir() if child.is_dir()}
    for requirement in pyproject["project"].get("dependencies", []):
        name = requirement.split(";")[0]
        for separator in "<>=!~[ ":
            name = name.split(separator)[0]
        # Distribution names whose import name differs.
        provided.add({"llama-cpp-python": "llama_cpp"}.get(name, name.replace("-", "_")))
    return provided


def _bench_installs() -> list[str]:
    """The arguments of every session.install call in the bench session, with the noxfile's
    module-level names resolved."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    session = next(
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "bench"
    )
    installs: list[str] = []
    for node in ast.walk(session):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "install"
        ):
            continue
        for argument in node.args:
            target = argument.value if isinstance(argument, ast.Starred) else argument
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                installs.append(target.value)
            elif isinstance(target, ast.Name):
                value = getattr(noxfile, target.id)
                installs.extend(value if isinstance(value, list) else [value])
            else:
                raise AssertionError(f"unresolvable install argument: {ast.dump(target)}")
    return installs


def test_bench_session_installs_what_every_benchmark_imports_and_runs() -> None:
    """Every module a benchmarks/*.py imports is the standard library, another benchmarks
    module, or provided by what the bench session installs (a package folder and its
    dependencies, or a requirement); pytest is installed because fake_bench.py runs the
    conformance suite. Fix: add the missing requirement to BENCH_REQUIREMENTS in noxfile.py."""
    installs = _bench_installs()
    provided: set[str] = set()
    for install in installs:
        if install.startswith("packages/"):
            provided |= _package_imports(install)
        elif install != "-e":
            name = install.split("<")[0].split(">")[0].split("=")[0]
            provided.add(REQUIREMENT_IMPORTS.get(name, name.replace("-", "_")))
    local = {path.stem for path in BENCHMARKS.glob("*.py")}
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert any(path.name.endswith("_bench.py") for path in scripts)
    for script in scripts:
        needed = _top_level_imports(script) | RUN_BY_SUBPROCESS.get(script.name, set())
        missing = {
            name
            for name in needed - local - provided
            if name not in sys.stdlib_module_names and name != "__future__"
        }
        assert not missing, f"{script.name} needs {sorted(missing)}, not installed by bench"


def test_bench_session_resolves_the_three_packages() -> None:
    """The bench session installs the API, the fake and the llama package (editable)."""
    installs = _bench_installs()
    for folder in (noxfile.API, noxfile.FAKE, noxfile.LLAMA):
        assert folder in installs


def test_readme_figures_are_the_rendering_of_the_kept_results() -> None:
    """README.md's "What has been measured" block is exactly what tools/readme_figures.py
    renders from benchmarks/readme-figures.json. Fix: `python3 -m nox -s bench -- --readme`
    (or `python tools/readme_figures.py --results R --write` for results R); never edit the
    block by hand."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    kept = json.loads(readme_figures.KEPT_RESULTS.read_text(encoding="utf-8"))
    assert readme.count(readme_figures.BEGIN) == 1
    assert readme_figures.readme_block(readme) == readme_figures.render(kept)


def _sample_results() -> dict[str, object]:
    def figures(values: dict[str, float | bool]) -> dict[str, object]:
        return {key: {"value": value, "unit": ""} for key, value in values.items()}

    llama = {
        f"generated_{config}_{kind}_ratio": 0.9
        for config in ("2_way", "3_way")
        for kind in ("prefill", "decode")
    }
    llama |= {
        "generated_3_way_decode_overhead_per_hop_ms": 0.05,
        "generated_3_way_proc_decode_over_in_process": 0.93,
        "generated_unsplit_proc_decode_ratio": 0.97,
        "generated_spin_10000_idle_cpu_ms": 0.4,
        "generated_spin_300000_idle_cpu_ms": 9.0,
        "generated_unsplit_batched_speedup": 2.2,
        "generated_cancel_latency_median_ms": 3.5,
        "generated_cancel_latency_max_ms": 4.0,
        "generated_cancel_rolled_back": True,
        "gemma3_measured": False,
    }
    run = {"started": "2026-12-01T11:00:00+00:00", "cpus": 2, "load_average_before": 0.05}
    return {
        "benches": {
            "llama": {
                "run": {**run, "mode": "full", "batch_sessions": 8},
                "figures": figures(llama),
            },
            "fake": {
                "run": run,
                "figures": figures(
                    {
                        "decode_steps_per_s_hidden_64": 51234,
                        "decode_unwrapped_steps_per_s_hidden_64": 60000,
                        "tail_bundle_decode_steps_per_s_hidden_64": 40000,
                        "conformance_seconds": 6.2,
                    }
                ),
            },
        }
    }


def test_renderer_quotes_the_figures_and_names_non_defaults() -> None:
    """Every figure comes from the results; a benchmark that did not run (here the codec)
    and a model that was not in the store say so instead of carrying old numbers."""
    rendered = readme_figures.render(_sample_results())
    block = " ".join(rendered.split())  # unwrapped
    assert "51,234 decode steps/s" in block
    assert "0.93 of the same split in one process" in block
    assert "8 sessions, one `decode_batch` per step: 2.2x sequential" in block
    assert "gemma3-270m was not in the model store" in block
    assert "**Wire codec**: not measured in this run." in block
    assert 'nonfinite="reject"' in block
    assert all(len(line) <= 100 for line in rendered.splitlines()[1:-1])


def test_smoke_llama_runs_measure_nothing() -> None:
    """A `--smoke` llama run proves the benchmark runs; its figures never reach the README."""
    document = _sample_results()
    benches = document["benches"]
    assert isinstance(benches, dict)
    benches["llama"]["run"]["mode"] = "smoke"
    block = " ".join(readme_figures.render(document).split())
    assert "**Split overhead (llama engine)**: not measured in this run." in block
    assert "**Cancellation**: not measured in this run." in block


def test_every_benchmark_takes_the_session_arguments() -> None:
    """`nox -s bench -- ARGS` hands ARGS to every *_bench.py: each takes --quick, --smoke
    (proves it runs) and --results (figures for the README). A benchmark whose imports this
    venv lacks (the cross-package venv has no remote engine) is checked where it is installed,
    the bench session. Fix: add the missing option."""
    local = {path.stem for path in BENCHMARKS.glob("*.py")}
    checked = 0
    for script in sorted(BENCHMARKS.glob("*_bench.py")):
        imports = _top_level_imports(script) - local - set(sys.stdlib_module_names)
        if any(importlib.util.find_spec(name) is None for name in imports - {"__future__"}):
            continue
        checked += 1
        shown = subprocess.run(
            [sys.executable, str(script), "--help"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        for option in ("--quick", "--smoke", "--results"):
            assert option in shown, f"{script.name} does not take {option}"
    assert checked >= 3


def test_renderer_quotes_the_migration_figures_and_the_model() -> None:
    """The session-migration bullet quotes the 2,048-position figures of the model that was
    measured, and says when gemma3-270m was not there."""
    document = _sample_results()
    benches = document["benches"]
    assert isinstance(benches, dict)
    figures = {
        "generated_2048_replay_ms": 1500.0,
        "generated_2048_tail_move_ms": 12.5,
        "generated_2048_tail_ratio": 0.0083,
        "generated_2048_all_ratio": 0.025,
        "generated_2048_tail_bytes_per_position": 16384,
    }
    benches["migration"] = {
        "run": {"mode": "full", "model": "generated"},
        "figures": {key: {"value": value, "unit": ""} for key, value in figures.items()},
    }
    block = " ".join(readme_figures.render(document).split())
    assert "the generated model (no gemma3-270m)" in block
    assert "12.5 ms for the tail shard: 0.008x replaying" in block
    assert "(1,500 ms); all three shards 0.025x; 16,384 bytes per position" in block
    benches["migration"]["run"]["mode"] = "smoke"
    assert "**Session migration**: not measured in this run." in " ".join(
        readme_figures.render(document).split()
    )
