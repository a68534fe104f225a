"""A GGUF that makes llama.cpp abort (GGML_ASSERT(eps >= 0) on a negative RMS-norm epsilon),
loaded through ``spawn``: the child dies of SIGABRT, this process lives on and sees
EngineCrashed naming the signal and quoting the assertion.

The llama engine's GGUF validator refuses this model at load (InvalidRequest, typed across the
process boundary) since it learned the family rules; the test then skips, saying where the abort
path is covered instead."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest
from conftest import RemoteFactory

import shard_engine_api as api

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("shard_engine_llama") is None
    or importlib.util.find_spec("llama_cpp") is None,
    reason="shard-engine-llama (llama-cpp-python) is not installed",
)

_EPSILON_KEY = b"llama.attention.layer_norm_rms_epsilon"
_GGUF_FLOAT32 = 6


def _aborting_model(directory: Path) -> tuple[Path, int]:
    from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path

    data = bytearray(tiny_model_path(directory).read_bytes())
    # A GGUF key-value entry: key, then its uint32 value type, then the value.
    at = data.index(_EPSILON_KEY) + len(_EPSILON_KEY)
    assert struct.unpack_from("<I", data, at)[0] == _GGUF_FLOAT32
    struct.pack_into("<f", data, at + 4, -1.0)
    path = directory / "negative-rms-epsilon.gguf"
    path.write_bytes(bytes(data))
    return path, TINY_MODEL_LAYERS


def test_llama_abort_is_engine_crashed(
    remote: RemoteFactory, tmp_path: Path, transport: str
) -> None:
    model, n_layers = _aborting_model(tmp_path)
    shard = api.ShardSpec(model=str(model), n_layers=n_layers, start=0, end=n_layers)
    try:
        engine = remote(
            api.LoadConfig(shard=shard, options={"spawn": "llama", "transport": transport})
        )
    except (api.InvalidRequest, api.UnsupportedFeature) as refused:
        pytest.skip(
            f"the llama engine now refuses this model at load ({refused.code}); the SIGABRT "
            "path from inside an engine is covered by "
            "test_faults.py::test_engine_abort_is_engine_crashed (the fake's abort() rule)"
        )
    with pytest.raises(api.EngineCrashed, match="SIGABRT") as caught:
        engine.prefill(
            api.PrefillRequest(
                request_id="abort",
                session=api.SessionRef(session_id="s", epoch=1),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1, 2, 3)),
            )
        )
    assert caught.value.details["signal"] == "SIGABRT"
    assert "GGML_ASSERT" in caught.value.message
    assert engine.health().state == "failed"
    with pytest.raises(api.EngineCrashed):
        engine.release(api.ReleaseRequest(session=api.SessionRef(session_id="s", epoch=1)))
