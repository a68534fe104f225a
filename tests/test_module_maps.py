"""Module maps: the docstring of each package's ``__init__.py`` lists every module of that
package, one line each, so a newcomer finds where a concern lives (and a module added
without a line fails here). Read from the source files, so no package needs importing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = (
    "packages/shard-engine-api/src/shard_engine_api",
    "packages/shard-engine-fake/src/shard_engine_fake",
    "packages/shard-engine-llama/src/shard_engine_llama",
    "packages/shard-engine-llama/src/shard_engine_llama/_gguf",
    "packages/shard-engine-remote/src/shard_engine_remote",
    "packages/shard-engine-remote/src/shard_engine_remote/_framed",
)


def modules(package: Path) -> list[str]:
    """The modules of ``package``: its Python files and C extension sources by module name,
    and its subpackages as ``name/``."""
    names = {path.stem for path in package.glob("*.py") if path.name != "__init__.py"}
    names |= {path.stem for path in package.glob("*.c")}
    names |= {f"{path.parent.name}/" for path in package.glob("*/__init__.py")}
    return sorted(names)


def listed(docstring: str, module: str) -> bool:
    """Whether a line of ``docstring`` starts with ``module``, as ``- ``name``: ...`` or as a
    literal block's ``name    ...``."""
    name = re.escape(module.rstrip("/")) + ("/" if module.endswith("/") else "")
    return re.search(rf"^\s*(- ``)?{name}(``)?[:;,\s]", docstring, re.MULTILINE) is not None


@pytest.mark.parametrize("folder", MAPPED)
def test_the_package_docstring_lists_every_module(folder: str) -> None:
    package = ROOT / folder
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text("utf-8")))
    assert docstring is not None
    missing = [module for module in modules(package) if not listed(docstring, module)]
    assert missing == [], f"{folder}/__init__.py: add one line for each of {missing}"


def test_the_map_check_needs_a_line_that_starts_with_the_name() -> None:
    docstring = (
        "Intro naming _codec in prose.\n\n- ``_types``: the types;\n    frames   the protocol\n"
    )
    assert listed(docstring, "_types")
    assert listed(docstring, "frames")
    assert not listed(docstring, "_codec")
    assert not listed(docstring, "_type")
    assert modules(ROOT / "packages/shard-engine-remote/src/shard_engine_remote")[0] == "_admission"
