"""A spawned llama engine gets the same threading defaults as one in the worker's process:
the child sets ``GOMP_SPINCOUNT`` itself before it loads llama.cpp (the environment's own value
wins), and the serving process reports what is in force (``ServerStats.threading``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import RemoteFactory

import shard_engine_api as api
from shard_engine_remote import RemoteEngine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("shard_engine_llama") is None
    or importlib.util.find_spec("llama_cpp") is None,
    reason="shard-engine-llama (llama-cpp-python) is not installed",
)


def _spawn(remote: RemoteFactory, directory: Path, env: dict[str, str | None]) -> RemoteEngine:
    from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path

    shard = api.ShardSpec(
        model=str(tiny_model_path(directory)), n_layers=TINY_MODEL_LAYERS, start=0, end=2
    )
    return remote(api.LoadConfig(shard=shard, n_threads=1, options={"spawn": "llama", "env": env}))


def _libgomp_mapped(pid: int) -> bool:
    return "libgomp" in Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")


def test_spawned_llama_child_applies_the_engine_default(
    remote: RemoteFactory, tmp_path: Path
) -> None:
    from shard_engine_llama import DEFAULT_SPIN_COUNT

    engine = _spawn(remote, tmp_path, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None})
    threading = engine.server_stats().threading
    assert threading.get("GOMP_SPINCOUNT") == str(DEFAULT_SPIN_COUNT)
    assert "OMP_WAIT_POLICY" not in threading
    pid = engine.child_pid
    assert pid is not None
    assert _libgomp_mapped(pid), "llama.cpp's OpenMP runtime is what the setting is for"


def test_the_environment_wins_in_the_child(remote: RemoteFactory, tmp_path: Path) -> None:
    engine = _spawn(remote, tmp_path, {"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": None})
    assert engine.server_stats().threading.get("GOMP_SPINCOUNT") == "300000"
