"""Shared fixtures: generated tiny models (deterministic, so generated once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shard_engine_api.engine import TEST_OPTIONS_ENV
from shard_engine_llama._fixtures import tiny_model_path

# These tests load engines with test-only options (injected crashes, aborts and delays), as the
# conformance suite does; spawned engine processes inherit the setting (test_engine.py checks
# the refusal without it).
os.environ[TEST_OPTIONS_ENV] = "1"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default 6-layer tiny llama model the plugin's fixture hook also provides."""
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))
