"""The llama engine's OpenMP spin-count default reaches libgomp: it is in the environment
before llama_cpp loads libgomp, and a user's own setting wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = (
    "import json, os\n"
    "from shard_engine_llama import LlamaEngine, _threading\n"
    "print(json.dumps({'env': os.environ.get('GOMP_SPINCOUNT'),\n"
    "                  'report': _threading.threading_report()}))\n"
)


def _probe(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    completed = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, object] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def test_default_spin_count_is_set_before_libgomp_loads() -> None:
    """Importing the llama engine (LlamaEngine; the package itself loads llama.cpp lazily)
    sets GOMP_SPINCOUNT=10000 when unset, before libgomp was
    mapped (so libgomp read it), and libgomp is mapped afterwards. Fix: keep the
    apply_threading_defaults() call in _llama_library.py before `import llama_cpp`."""
    pytest.importorskip("shard_engine_llama")
    probe = _probe()
    report = probe["report"]
    assert isinstance(report, dict)
    assert probe["env"] == "10000"
    assert report["source"] == "shard-engine default"
    assert report["libgomp_loaded_before"] is False
    assert report["libgomp_loaded"] is True


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"GOMP_SPINCOUNT": "300000"}, "300000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None)],
)
def test_the_users_openmp_setting_wins(env: dict[str, str], expected: str | None) -> None:
    """A GOMP_SPINCOUNT or OMP_WAIT_POLICY already in the environment is left as it is."""
    pytest.importorskip("shard_engine_llama")
    probe = _probe(**env)
    report = probe["report"]
    assert isinstance(report, dict)
    assert probe["env"] == expected
    assert report["source"] == "environment"
