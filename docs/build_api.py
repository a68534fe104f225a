"""Build the API reference of the four packages with pdoc (``nox -s docs`` runs it).

    python docs/build_api.py OUTPUT_FOLDER

Documents each package and every public submodule (no part of its dotted name starting with an
underscore: ``shard_engine_api.wire``, ``shard_engine_api.engine``, ``.conformance``, ...), the
docstrings read as reStructuredText, as the code writes them. Names a package exports lazily
(a module ``__getattr__``, which keeps ``import shard_engine_llama`` from loading llama.cpp) are
resolved first: pdoc documents only what a module holds.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import pdoc
import pdoc.render

__all__ = ["PACKAGES", "build", "public_modules"]

PACKAGES = ("shard_engine_api", "shard_engine_fake", "shard_engine_llama", "shard_engine_remote")


def _resolve_lazy_exports(module: ModuleType) -> None:
    for name in getattr(module, "__all__", ()):
        if name not in vars(module):
            setattr(module, name, getattr(module, name))


def public_modules(package: str) -> list[str]:
    """``package`` and its public submodules, each imported (lazy exports resolved)."""
    root = importlib.import_module(package)
    names = [package]
    for found in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if any(part.startswith("_") for part in found.name.split(".")):
            continue
        names.append(found.name)
    for name in names:
        _resolve_lazy_exports(importlib.import_module(name))
    return names


def build(output: Path) -> list[str]:
    """Write the reference into ``output``; returns the modules documented."""
    modules = [name for package in PACKAGES for name in public_modules(package)]
    pdoc.render.configure(docformat="restructuredtext")
    pdoc.pdoc(*modules, output_directory=output)
    return modules


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: build_api.py OUTPUT_FOLDER", file=sys.stderr)
        return 2
    modules = build(Path(argv[0]))
    print(f"documented {len(modules)} modules in {argv[0]}: {', '.join(modules)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
