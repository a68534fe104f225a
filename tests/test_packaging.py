"""Distribution hygiene: the API depends on msgspec, pluggy and numpy only; every package
re-exports a sorted, pinned ``__all__`` and ships ``py.typed``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_api_declares_only_its_three_dependencies() -> None:
    project = tomllib.loads((ROOT / "packages/shard-engine-api/pyproject.toml").read_text())
    names = {
        requirement.split(">")[0].split("=")[0].split("<")[0].strip()
        for requirement in project["project"]["dependencies"]
    }
    assert names == {"msgspec", "pluggy", "numpy"}


def _third_party_modules(code: str) -> set[str]:
    probe = (
        f"{code}\nimport sys\n"
        "top = {name.split('.')[0] for name in sys.modules}\n"
        "print('\\n'.join(sorted(top - set(sys.stdlib_module_names))))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return {name for name in output.split() if not name.startswith("_")}


def test_importing_the_api_loads_no_other_third_party_module() -> None:
    """``import shard_engine_api`` (and its CLI) pulls in nothing beyond the standard library,
    the three declared dependencies and what they import themselves (msgspec uses
    typing_extensions when it is installed). Modules the interpreter preloads through .pth
    files are the baseline."""
    baseline = _third_party_modules("pass")
    loaded = _third_party_modules("import shard_engine_api, shard_engine_api.cli") - baseline
    allowed = {"shard_engine_api", "msgspec", "pluggy", "numpy", "typing_extensions"}
    assert loaded <= allowed, loaded - allowed


@pytest.mark.parametrize("package", ["shard_engine_api", "shard_engine_fake", "shard_engine_llama"])
def test_packages_are_typed_with_sorted_exports(package: str) -> None:
    module = __import__(package)
    assert module.__file__ is not None
    assert (Path(module.__file__).parent / "py.typed").is_file()
    exported = list(module.__all__)
    assert len(exported) == len(set(exported))
    for name in exported:
        assert hasattr(module, name), name
