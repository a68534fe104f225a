"""llama.cpp aborting inside a spawned child: the child dies of SIGABRT, this process lives on
and sees EngineCrashed naming the signal and quoting the assertion.

The abort comes from llama.cpp's own ``ggml_abort`` (what every failed ``GGML_ASSERT`` calls),
reached through the llama engine's ``inject_abort`` test option on the first forward. A GGUF
file can no longer do it: the one that did (a negative RMS-norm epsilon, ``GGML_ASSERT(eps >=
0.0f)`` in ggml-cpu on the first prefill) is refused by the engine's validator before llama.cpp
opens it, and the second test here pins that, through the same process boundary."""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path

import pytest
from conftest import RemoteFactory

import shard_engine_api as api
from shard_engine_api.engine import TEST_OPTIONS_ENV

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("shard_engine_llama") is None
    or importlib.util.find_spec("llama_cpp") is None,
    reason="shard-engine-llama (llama-cpp-python) is not installed",
)

_EPSILON_KEY = b"llama.attention.layer_norm_rms_epsilon"
_GGUF_FLOAT32 = 6
_SESSION = api.SessionRef(session_id="s", epoch=1)


def _tiny_model(directory: Path) -> tuple[Path, int]:
    from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path

    return tiny_model_path(directory), TINY_MODEL_LAYERS


def _negative_epsilon_model(directory: Path) -> tuple[Path, int]:
    source, n_layers = _tiny_model(directory)
    data = bytearray(source.read_bytes())
    # A GGUF key-value entry: key, then its uint32 value type, then the value.
    at = data.index(_EPSILON_KEY) + len(_EPSILON_KEY)
    assert struct.unpack_from("<I", data, at)[0] == _GGUF_FLOAT32
    struct.pack_into("<f", data, at + 4, -1.0)
    path = directory / "negative-rms-epsilon.gguf"
    path.write_bytes(bytes(data))
    return path, n_layers


def _prefill(engine: api.ShardEngine, request_id: str) -> api.ShardResult:
    return engine.prefill(
        api.PrefillRequest(
            request_id=request_id,
            session=_SESSION,
            start_pos=0,
            inputs=api.TokenInput(token_ids=(1, 2, 3)),
        )
    )


def _spawned(directory: Path, transport: str, **options: api.OptionValue) -> api.LoadConfig:
    """The whole tiny model in a spawned llama child, with ``options`` added."""
    model, n_layers = _tiny_model(directory)
    return api.LoadConfig(
        shard=api.ShardSpec(model=str(model), n_layers=n_layers, start=0, end=n_layers),
        options={"spawn": "llama", "transport": transport, "self_test": False, **options},
    )


def test_llama_abort_is_engine_crashed(
    remote: RemoteFactory, tmp_path: Path, transport: str
) -> None:
    engine = remote(_spawned(tmp_path, transport, inject_abort=True))
    assert engine.health().state == "ready"
    with pytest.raises(api.EngineCrashed, match="SIGABRT") as caught:
        _prefill(engine, "abort")
    assert caught.value.details["signal"] == "SIGABRT"
    assert "GGML_ASSERT(inject_abort option) failed" in caught.value.message
    assert engine.health().state == "failed"
    with pytest.raises(api.EngineCrashed):
        engine.release(api.ReleaseRequest(session=_SESSION))
    # This process is alive and can load another child that works.
    healthy = remote(_spawned(tmp_path, transport))
    assert isinstance(_prefill(healthy, "after"), api.LogitsResult)
    assert os.getpid() > 0


def test_a_child_without_test_options_refuses_to_abort(
    remote: RemoteFactory, tmp_path: Path, transport: str
) -> None:
    """The test option comes through the LoadConfig, but whether it is honoured is the serving
    process's own setting: a child started without the variable refuses it at load, as a
    typed InvalidRequest naming the option, and nothing aborts."""
    config = _spawned(tmp_path, transport, inject_abort=True, env={TEST_OPTIONS_ENV: None})
    with pytest.raises(api.InvalidRequest, match="inject_abort is a test-only option") as caught:
        remote(config)
    assert caught.value.details["field"] == "options.inject_abort"
    assert os.environ[TEST_OPTIONS_ENV] == "1"  # this process's own setting is untouched


def test_aborting_gguf_is_refused_before_llama_cpp_opens_it(
    remote: RemoteFactory, tmp_path: Path, transport: str
) -> None:
    """The file that used to abort the first prefill is a typed InvalidRequest at load,
    naming the field, and the child stays alive to say so (no signal)."""
    model, n_layers = _negative_epsilon_model(tmp_path)
    shard = api.ShardSpec(model=str(model), n_layers=n_layers, start=0, end=n_layers)
    with pytest.raises(api.InvalidRequest) as refused:
        remote(
            api.LoadConfig(
                shard=shard, options={"spawn": "llama", "transport": transport, "self_test": False}
            )
        )
    assert "layer_norm_rms_epsilon" in refused.value.message
    assert not isinstance(refused.value, api.EngineCrashed)
