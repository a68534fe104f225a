"""The shard-engine CLI and plugin discovery across the installed distributions."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import shard_engine_api as api
from shard_engine_api import (
    BoundaryResult,
    Capabilities,
    InvalidRequest,
    LoadConfig,
    PrefillRequest,
    SessionRef,
    ShardEngine,
    ShardMismatch,
    ShardSpec,
    TokenInput,
    UnknownEngine,
    cli,
    installed_engines,
    load_engine,
)
from shard_engine_api.cli import main
from shard_engine_api.engine import EngineDescription, Tokenizer, get_plugin_manager, hookimpl

ROOT = Path(__file__).resolve().parent.parent


def test_engines_lists_every_plugin_with_distribution_and_evidence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard-engine engines --json` lists fake (fixture) and llama (real)."""
    assert main(["engines", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)["engines"]}
    assert listed["fake"]["distribution"] == "shard-engine-fake"
    assert listed["fake"]["evidence"] == "fixture"
    assert listed["llama"]["distribution"] == "shard-engine-llama"
    assert listed["llama"]["evidence"] == "real"
    assert main(["engines"]) == 0
    assert "shard-engine-fake" in capsys.readouterr().out


def test_unknown_engine_error_lists_installed_ones() -> None:
    with pytest.raises(UnknownEngine) as missing:
        load_engine("nope")
    assert "fake" in str(missing.value)
    assert "llama" in str(missing.value)
    assert isinstance(missing.value, InvalidRequest)


@pytest.mark.parametrize("engine", ["fake", "llama"])
def test_run_is_a_verified_three_shard_pipeline(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's main job: 3 shards, tokens, text, per-shard timings, and a PASS against one
    full shard."""
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "store"))
    code = main(["run", "--engine", engine, "--workdir", str(tmp_path), "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "generated ids (6)" in out
    assert "generated text:" in out
    assert "(head)" in out
    assert "(middle)" in out
    assert "(tail)" in out
    assert "verify against one full shard: PASS" in out
    assert "boundaries: 2" in out
    assert "bitwise identical" in out


def test_run_reports_errors_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--engine", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown_engine" in err
    assert "'nope' is not installed (installed: fake, llama" in err


# Every bad input: (arguments, a piece of the one line on stderr). Exit status 2, one line,
# no traceback, and (for conformance) before the suite runs.
BAD_INPUTS: list[tuple[list[str], str]] = [
    (["run", "--max-new-tokens", "-3"], "--max-new-tokens: must be an integer in [1, 1048576]"),
    (["run", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer in [1, 1048576]"),
    (["run", "--max-new-tokens", "100000000"], "must be an integer in [1, 1048576], got 1000"),
    (["run", "--max-new-tokens", "many"], "--max-new-tokens: 'many' is not an integer"),
    (["run", "--tokens", "1,,x"], "--tokens: '1,,x': item 2 is empty"),
    (["run", "--tokens", "1,x"], "--tokens: 'x' is not an integer"),
    (["run", "--tokens", "-1"], "item 1 is -1"),
    (["run", "--tokens", ""], "item 1 is empty"),
    (["run", "--tokens", "100000"], "token ids must lie in [0, 512)"),
    (["run", "--tokens", "1,2", "--prompt", "hi"], "give --prompt or --tokens, not both"),
    (["run", "--prompt", ""], "the prompt has no tokens"),
    # Bytes of argv that are not UTF-8 arrive as lone surrogates (surrogateescape).
    (["run", "--prompt", "ab\udcffcd"], "--prompt: is not valid UTF-8"),
    (["run", "--engine", "llama", "--prompt", "\udc80"], "--prompt: is not valid UTF-8"),
    (["run", "--threads", "-2"], "--threads: must be an integer >= 0, got -2"),
    (["run", "--shards", "7"], "--shards: 7 shards of a 6-layer model; choose 1 to 6"),
    (["run", "--shards", "0"], "--shards: must be an integer >= 1"),
    (["run", "--tolerance", "-1"], "--tolerance: must be a finite number >= 0"),
    (["run", "--tolerance", "nan"], "--tolerance: must be a finite number >= 0"),
    (["run", "--tolerance", "inf"], "--tolerance: must be a finite number >= 0"),
    (["run", "--temperature", "-0.5"], "--temperature: must be a finite number >= 0"),
    (["run", "--top-p", "0"], "--top-p: must lie in (0, 1]"),
    (["run", "--top-p", "1.5"], "--top-p: must lie in (0, 1]"),
    (["run", "--top-k", "-1"], "--top-k: must be an integer >= 0"),
    (["run", "--seed", "-1"], "--seed: must be an integer >= 0"),
    (["run", "--stop-tokens", "1,,2"], "--stop-tokens: '1,,2': item 2 is empty"),
    (["run", "--boundary-dtype", "f8"], "--boundary-dtype: invalid choice: 'f8'"),
    (["run", "--engine", "nosuch"], "'nosuch' is not installed (installed: fake"),
    (["run", "--model", "fake:layers=x"], "layers must be an integer"),
    (["run", "--model", "fake:depth=3"], "'depth=3' is not one of"),
    (["run", "--model", "fake:layers=0"], "layer count must lie in [1, 4096]"),
    (["run", "--model", "fake:vocab=100"], "has no tokenizer for this model; pass --tokens"),
    (["run", "--model", "fake:layers=2", "--shards", "3"], "3 shards of a 2-layer model"),
    (["run", "--workdir", "/home/someone/models"], "is under /home"),
    (["run", "--engine", "llama", "--model", "/no/such/model.gguf"], "does not exist"),
    (["run", "--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["bench", "--splits", "abc"], "--splits: 'abc' is not an integer"),
    (["bench", "--splits", "1,,2"], "--splits: '1,,2': item 2 is empty"),
    (["bench", "--splits", "0"], "item 1 is 0; every item must be >= 1"),
    (["bench", "--splits", "1,9"], "--splits: 9 shards of a 6-layer model"),
    (["bench", "--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer in [1, 1048576]"),
    (["bench", "--prompt-tokens", "0"], "--prompt-tokens: must be an integer >= 1"),
    (["bench", "--engine", "nosuch"], "'nosuch' is not installed"),
    (["conformance"], "the following arguments are required: --engine"),
    (["conformance", "--engine", "nosuch"], "'nosuch' is not installed"),
    (["conformance", "--engine", "fake", "--report", "{tmp}"], "is a directory; name a JSON file"),
    (["conformance", "--engine", "fake", "--report", "{tmp}/no/dir/r.json"], "does not exist"),
    (["engines", "--yaml"], "unrecognized arguments: --yaml"),
    ([], "the following arguments are required: command"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
]


@pytest.mark.parametrize(
    ("arguments", "message"), BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _ in BAD_INPUTS]
)
def test_bad_input_is_one_line_and_exit_2(
    arguments: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    arguments = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    suites: list[tuple[object, ...]] = []

    def run_suite(*given: object, **named: object) -> int:
        suites.append(given)
        return 0

    monkeypatch.setattr(pytest, "main", run_suite)
    try:
        code: int | str | None = main(arguments)
    except SystemExit as exit_:  # argparse exits by itself
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert message in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "store").exists(), "a refused command created the model store"
    assert not suites, "the suite ran before the input was checked"


@pytest.mark.parametrize("where", ["load", "tokenizer"])
def test_an_engines_own_exception_is_one_line(
    where: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend failure that escaped the engine's error mapping (e.g. llama.cpp refusing a
    vocabulary: at load, or when the tokenizer opens the model) is one line and exit 2."""
    from shard_engine_fake import FakeEngine, plugin

    problem = "llama_model_load: vocabulary cannot be loaded"

    class Refusing(FakeEngine):
        def load(self, config: LoadConfig) -> Capabilities:
            raise RuntimeError(problem)

    def refusing_tokenizer(model: str) -> Tokenizer | None:
        raise RuntimeError(problem)

    described = plugin.shard_engine_register()
    changes: dict[str, object] = (
        {"factory": Refusing} if where == "load" else {"tokenizer": refusing_tokenizer}
    )

    class RefusingPlugin:
        @hookimpl
        def shard_engine_register(self) -> EngineDescription:
            return msgspec.structs.replace(described, name="refusing", **changes)

    manager = get_plugin_manager(entry_points=False, plugins=[("refusing", RefusingPlugin())])
    monkeypatch.setattr(cli, "get_plugin_manager", lambda: manager)
    assert main(["run", "--engine", "refusing"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert problem in lines[0]
    assert "Traceback" not in captured.err


def test_version_and_defaults_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"shard-engine {api.__version__}"
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "(default: 16)" in out
    assert "(default: fake)" in out
    assert "(default: 3)" in out


def test_run_echoes_the_prompt_and_says_fixture_text_is_meaningless(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "store"))
    workdir = tmp_path / "never-used"
    assert main(["run", "--prompt", "hello", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'hello'" in out
    assert "meaningless by design" in out
    assert not workdir.exists(), "the fake never writes a model, so no directory is made"
    assert not (tmp_path / "store").exists()


def test_run_accepts_the_fake_model_references_its_readme_documents(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--engine", "fake", "--model", "fake:hidden=32,layers=4"]) == 0
    out = capsys.readouterr().out
    assert "of 4 layers" in out
    assert "hidden 32" in out
    assert "verify against one full shard: PASS" in out


def test_run_and_bench_print_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", "--max-new-tokens", "3", "--shards", "2"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"] == "fake"
    assert document["prompt"] == "The quick brown fox"
    assert len(document["token_ids"]) == 3
    assert document["verify"]["passed"] is True
    assert document["shards"] == [[0, 3], [3, 6]]
    assert document["wire_bytes"] > 0
    arguments = ["bench", "--json", "--repeat", "1", "--max-new-tokens", "2", "--splits", "1,2"]
    assert main(arguments) == 0
    bench = json.loads(capsys.readouterr().out)
    assert [row["shards"] for row in bench["rows"]] == [1, 2]
    assert bench["rows"][0]["decode_ratio"] == 1.0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_run_with_every_boundary_dtype(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    """`run --boundary-dtype` end to end: 16-bit payloads cross the wire, and a split that
    declares itself not split-exact (the fake with bf16) is verified against its declared
    tolerance instead of failing for the drift it declares."""
    arguments = ["run", "--json", "--max-new-tokens", "4", "--boundary-dtype", dtype]
    assert main(arguments) == 0
    document = json.loads(capsys.readouterr().out)
    verify = document["verify"]
    assert verify["passed"] is True
    assert verify["declared_split_exact"] is (dtype != "bf16")
    assert verify["bitwise"] is (dtype != "bf16")  # the fake's integers are exact in f16
    assert main(["run", "--max-new-tokens", "4", "--boundary-dtype", "f32", "--json"]) == 0
    f32_bytes = json.loads(capsys.readouterr().out)["wire_bytes"]
    assert (document["wire_bytes"] < f32_bytes) is (dtype != "f32")


def test_sampled_run_is_reproducible_and_split_exact(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["run", "--json", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9"]
    assert main([*arguments, "--seed", "3"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*arguments, "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    assert first["verify"]["passed"] is True


def test_wire_bytes_are_counted_per_generation() -> None:
    from shard_engine_api import Pipeline, split_layers

    engines = [
        load_engine("fake", LoadConfig(shard=ShardSpec(model="fake", n_layers=6, start=s, end=e)))
        for s, e in split_layers(6, 2)
    ]
    with Pipeline(engines, wire=True) as pipeline:
        first = pipeline.generate((5, 6, 7), 3)
        second = pipeline.generate((5, 6, 7), 3)
        assert first.wire_bytes > 0
        assert first.wire_bytes == second.wire_bytes
        assert pipeline.wire_bytes == first.wire_bytes + second.wire_bytes


def test_verbose_logs_to_stderr_and_quiet_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--max-new-tokens", "1", "--no-verify"]) == 0
    assert capsys.readouterr().err == ""
    try:
        assert main(["-v", "run", "--max-new-tokens", "1", "--no-verify"]) == 0
    finally:
        logger = logging.getLogger("shard_engine")
        for handler in logger.handlers[:]:
            if not isinstance(handler, logging.NullHandler):
                logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    assert "shard-engine: shard_engine.pipeline: loaded fake" in err


def test_a_broken_third_party_plugin_does_not_break_engines(tmp_path: Path) -> None:
    """An installed plugin whose module fails to import is listed by name; the rest work."""
    info = tmp_path / "broken_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[shard_engine]\nbroken = broken_engine_plugin\n")
    (tmp_path / "broken_engine_plugin.py").write_text("raise ImportError('needs libfoo')\n")
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    listing = subprocess.run(
        [sys.executable, "-m", "shard_engine_api.cli", "engines"],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
    )
    assert listing.returncode == 0, listing.stderr
    assert "shard-engine-fake" in listing.stdout
    assert "broken plugin 'broken' (broken-engine 1.0)" in listing.stdout
    assert "needs libfoo" in listing.stdout
    run = subprocess.run(
        [sys.executable, "-m", "shard_engine_api.cli", "run", "--engine", "broken"],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "shard-engine run: BrokenPlugin [broken_plugin]: engine 'broken' (broken-engine 1.0) is "
        "installed but its plugin failed: failed to import broken_engine_plugin: ImportError: "
        "needs libfoo"
    ]


def test_llama_inspect_and_split_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shard_engine_llama._fixtures import tiny_model_path

    model = tiny_model_path(tmp_path)
    assert main(["inspect", str(model)]) == 0
    assert "shardable:     yes" in capsys.readouterr().out
    out_dir = tmp_path / "shards"
    arguments = ["split", str(model), "--shards", "0:2,2:4,4:6", "--out", str(out_dir), "--quiet"]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    assert first.count("written") == 3
    assert main(arguments) == 0
    assert capsys.readouterr().out.count("reused") == 3
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert [shard["start"] for shard in manifest["shards"]] == [0, 2, 4]
    assert main(["inspect", str(tmp_path / "missing.gguf")]) == 2


def test_bundles_do_not_cross_models(tmp_path: Path) -> None:
    """A fake head's bundle fed to a llama tail is refused with ShardMismatch."""
    from shard_engine_llama._fixtures import tiny_model_path

    model = tiny_model_path(tmp_path)
    head = load_engine(
        "fake", LoadConfig(shard=ShardSpec(model="fake", n_layers=6, start=0, end=3))
    )
    tail = load_engine(
        "llama",
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=6, start=3, end=6),
            max_sessions=2,
            max_context=256,
            options={"model_store": str(tmp_path / "store")},
        ),
    )
    session = SessionRef(session_id="x", epoch=1)
    try:
        out = head.prefill(
            PrefillRequest(
                request_id="h", session=session, start_pos=0, inputs=TokenInput(token_ids=(1, 2))
            )
        )
        assert isinstance(out, BoundaryResult)
        with pytest.raises(ShardMismatch):
            tail.prefill(
                PrefillRequest(request_id="t", session=session, start_pos=0, inputs=out.bundle)
            )
    finally:
        head.close()
        tail.close()


def test_installed_engines_through_a_fresh_plugin_manager() -> None:
    names = [engine.name for engine in installed_engines(get_plugin_manager())]
    assert {"fake", "llama"} <= set(names)  # and any other installed engine (remote)
    assert names == sorted(names)


def test_console_script_runs() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "shard_engine_api.cli", "engines"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "llama" in completed.stdout


def test_pipeline_over_the_wire_equals_in_process() -> None:
    """Bundles encoded, decoded and verified at every hop give bitwise the in-process logits."""
    from shard_engine_api import Pipeline, split_layers

    def engines() -> list[ShardEngine]:
        return [
            load_engine(
                "fake", LoadConfig(shard=ShardSpec(model="fake", n_layers=6, start=s, end=e))
            )
            for s, e in split_layers(6, 3)
        ]

    local, remote = engines(), engines()
    try:
        wired = Pipeline(remote, wire=True)
        over_wire = wired.generate((5, 6, 7), 4)
        in_process = Pipeline(local).generate((5, 6, 7), 4)
        assert over_wire.step_logits == in_process.step_logits
        assert wired.wire_bytes > 0
    finally:
        for engine in local + remote:
            engine.close()


def test_discovering_engines_does_not_import_llama_cpp() -> None:
    """Plugin discovery stays cheap: llama.cpp loads only when a llama engine or tokenizer is
    made (importing it leaves files open that pytest then reports at exit)."""
    probe = (
        "import sys\n"
        "from shard_engine_api import installed_engines\n"
        "from shard_engine_api.engine import get_plugin_manager\n"
        "names = [engine.name for engine in installed_engines(get_plugin_manager())]\n"
        "assert 'llama' in names, names\n"
        "assert 'llama_cpp' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_conformance_on_the_fake_exits_cleanly(tmp_path: Path) -> None:
    """No 'Exception ignored ... ResourceWarning' at exit (one standard test is enough to
    show it; the whole suite runs in the conformance sessions)."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "shard_engine_api.cli", "conformance", "--engine", "fake"]
    completed = subprocess.run(
        [*command, "--report", str(report), "--", "-k", "test_evidence_class"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "SHARD_ENGINE_MODEL_STORE": str(tmp_path / "store")},
    )
    assert completed.returncode == 0, completed.stdout[-2000:]
    assert "ResourceWarning" not in completed.stderr, completed.stderr
    assert "Exception ignored" not in completed.stderr, completed.stderr
    assert json.loads(report.read_text())["engine"] == "fake"


def test_run_on_a_gguf_whose_vocabulary_llama_cpp_cannot_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF that passes the header checks but whose tokenizer llama.cpp refuses: one line
    naming the file, exit 2 (the backend's ModelLoadError does not escape as a traceback)."""
    from shard_engine_llama._fixtures import tiny_model_path

    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "store"))
    data = tiny_model_path(tmp_path).read_bytes()
    at = data.index(b"llama", data.index(b"tokenizer.ggml.model"))
    broken = tmp_path / "bad-vocabulary.gguf"
    broken.write_bytes(data[:at] + b"bogus" + data[at + len(b"llama") :])
    assert main(["run", "--engine", "llama", "--model", str(broken)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "bad-vocabulary.gguf" in lines[0]
    assert "Traceback" not in captured.err


def test_the_driver_logs_crashes(caplog: pytest.LogCaptureFixture) -> None:
    from shard_engine_api import EngineCrashed, Pipeline
    from shard_engine_fake import Crash, FaultPlan, FaultRule

    plan = FaultPlan(rules=(FaultRule(action=Crash(detail="boom"), operations=("decode",)),))
    engines = [
        load_engine(
            "fake",
            LoadConfig(
                shard=ShardSpec(model="fake", n_layers=6, start=s, end=e),
                options={"faults": plan} if s else {},
            ),
        )
        for s, e in ((0, 3), (3, 6))
    ]
    caplog.set_level(logging.INFO, logger="shard_engine")
    with Pipeline(engines) as pipeline, pytest.raises(EngineCrashed):
        pipeline.generate((1, 2), 3)
    assert any("shard 1 crashed" in record.getMessage() for record in caplog.records)


def test_conformance_without_its_test_tools_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def without_hypothesis(name: str) -> object:
        return None if name == "hypothesis" else real_find_spec(name)

    monkeypatch.setattr(importlib.util, "find_spec", without_hypothesis)
    assert main(["conformance", "--engine", "fake"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "shard-engine conformance: error: the conformance suite needs hypothesis: "
        "pip install 'shard-engine-api[conformance]'"
    ]
