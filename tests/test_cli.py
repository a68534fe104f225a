"""The shard-engine CLI and plugin discovery across the installed distributions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shard_engine_api import (
    BoundaryResult,
    InvalidRequest,
    LoadConfig,
    PrefillRequest,
    SessionRef,
    ShardEngine,
    ShardMismatch,
    ShardSpec,
    TokenInput,
    UnknownEngine,
    installed_engines,
    load_engine,
)
from shard_engine_api.cli import main
from shard_engine_api.engine import get_plugin_manager


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
    assert "unknown_engine" in capsys.readouterr().err


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
    assert names == ["fake", "llama"]


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
