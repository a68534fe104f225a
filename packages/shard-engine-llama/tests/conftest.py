"""Shared fixtures: generated tiny models (deterministic, so generated once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard_engine_llama._fixtures import tiny_model_path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default 6-layer tiny llama model the plugin's fixture hook also provides."""
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))
