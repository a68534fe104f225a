"""Layering: the engine packages and their tests, the cross-package tests, the benchmarks and
the tools use the API only through its public namespaces (``shard_engine_api``, ``.engine``,
``.wire``, ``.conformance`` and other plainly named modules), never a private module
(``_codec``, ``_core``, ...), so the API can move its implementation without breaking them. The
API's own tests may test its private modules; they are not scanned. Imports are read with
``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = (
    "packages/shard-engine-fake/src",
    "packages/shard-engine-fake/tests",
    "packages/shard-engine-llama/src",
    "packages/shard-engine-llama/tests",
    "packages/shard-engine-remote/src",
    "packages/shard-engine-remote/tests",
    "tests",
    "benchmarks",
    "tools",
)
API = "shard_engine_api"


def _private(module: str) -> bool:
    """Whether the dotted name ``module`` is, or lies inside, a private module of the API
    (a component with a leading underscore; dunder names such as ``__main__`` are public)."""
    parts = module.split(".")
    return parts[0] == API and any(
        part.startswith("_") and not part.endswith("__") for part in parts[1:]
    )


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a private API module in ``source``: ``import`` and
    ``from ... import`` statements (a private module itself, or a private name imported from an
    API package, which is a submodule or an internal), and ``import_module("...")`` calls."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _private(node.module):
                found.append((node.lineno, node.module))
            elif node.module.split(".")[0] == API:
                found += [
                    (node.lineno, f"{node.module}.{alias.name}")
                    for alias in node.names
                    if _private(f"{node.module}.{alias.name}")
                ]
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else None
            if isinstance(function, ast.Name):
                name = function.id
            argument = node.args[0]
            if (
                name == "import_module"
                and isinstance(argument, ast.Constant)
                and isinstance(argument.value, str)
                and _private(argument.value)
            ):
                found.append((node.lineno, argument.value))
    return found


def _scanned_files() -> list[Path]:
    files: list[Path] = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if not any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
                files.append(path)
    return files


def test_scanned_folders_hold_python_files() -> None:
    for folder in SCANNED:
        assert any(path.is_relative_to(ROOT / folder) for path in _scanned_files()), folder


def test_no_private_api_module_is_imported_outside_the_api_package() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _scanned_files()
        for line, module in private_imports(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], (
        "import these through shard_engine_api, .engine or .wire (add the name there, with a "
        "docstring, if it is missing):\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import shard_engine_api._codec", ["shard_engine_api._codec"]),
        ("import shard_engine_api._codec as codec", ["shard_engine_api._codec"]),
        ("from shard_engine_api._types import ShardSpec", ["shard_engine_api._types"]),
        ("from shard_engine_api import _typecheck", ["shard_engine_api._typecheck"]),
        ("from shard_engine_api import ShardSpec, _inputs", ["shard_engine_api._inputs"]),
        (
            "from shard_engine_api.conformance._harness import raises",
            ["shard_engine_api.conformance._harness"],
        ),
        (
            "def f():\n    from shard_engine_api._plugins import model_fixture",
            ["shard_engine_api._plugins"],
        ),
        ("importlib.import_module('shard_engine_api._core')", ["shard_engine_api._core"]),
        ("import_module('shard_engine_api._core')", ["shard_engine_api._core"]),
        ("import shard_engine_api as api", []),
        ("from shard_engine_api import ShardSpec, __version__", []),
        ("from shard_engine_api.engine import EngineCore", []),
        ("from shard_engine_api.wire import encode", []),
        ("from shard_engine_api.conformance import ShardEngineConformance", []),
        ("from shard_engine_api.cli import main", []),
        ("import shard_engine_api.__main__", []),
        ("from shard_engine_fake._model import FakeModel", []),
        ("from ._wire import encode", []),
    ],
)
def test_the_scan_finds_every_form_of_private_import(source: str, expected: list[str]) -> None:
    assert [module for _, module in private_imports(source)] == expected
