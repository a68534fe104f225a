"""Every ```python block of the READMEs type-checks under ``mypy --strict`` and runs, as
written, against the fake engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = [
    ROOT / "README.md",
    ROOT / "packages/shard-engine-api/README.md",
    ROOT / "packages/shard-engine-fake/README.md",
]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for readme in READMES:
        relative = readme.relative_to(ROOT).as_posix()
        for index, match in enumerate(_BLOCK.finditer(readme.read_text())):
            found.append((f"{relative}#{index + 1}", textwrap.dedent(match.group(2))))
    return found


BLOCKS = _blocks()


def _module_name(label: str) -> str:
    return "readme_" + re.sub(r"\W", "_", label).strip("_").lower()


def test_the_worker_example_shows_the_stream_api() -> None:
    worker = "\n".join(code for label, code in BLOCKS if label.startswith("README.md"))
    assert "pipeline.stream(" in worker
    assert "Sampling(" in worker


def test_readme_blocks_pass_mypy_strict(tmp_path: Path) -> None:
    files = []
    for label, code in BLOCKS:
        path = tmp_path / f"{_module_name(label)}.py"
        path.write_text(code)
        files.append(str(path))
    completed = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", "pyproject.toml", *files],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.parametrize(("label", "code"), BLOCKS, ids=[label for label, _ in BLOCKS])
def test_readme_block_runs(label: str, code: str, tmp_path: Path) -> None:
    environment = {**os.environ, "SHARD_ENGINE_MODEL_STORE": str(tmp_path / "store")}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env=environment,
        timeout=120,
    )
    assert completed.returncode == 0, f"{label}:\n{completed.stderr}"
