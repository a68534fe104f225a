"""The ``pytest.main`` arguments of a conformance run (kept out of the plugin module, where a
``pytest_`` name would be taken for a hook)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["PLUGIN_MODULE", "pytest_arguments"]

PLUGIN_MODULE: Final = "shard_engine_api.conformance.plugin"


def pytest_arguments(
    engine: str, report: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """The arguments that run the standard suite against ``engine`` (what ``shard-engine
    conformance`` passes to ``pytest.main``). The plugin is named explicitly so the suite runs
    even with plugin autoloading disabled; ``extra`` go last (paths in it are run as well)."""
    arguments = [
        "-p",
        PLUGIN_MODULE,
        "--shard-engine",
        engine,
        # The CLI imported shard_engine_api before pytest could install its assertion
        # rewriter; a project's filterwarnings=error must not turn that notice into a failure.
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-p",
        "no:cacheprovider",
    ]
    if report:
        arguments += ["--shard-engine-report", report]
    return [*arguments, *extra]
