"""Load settings at and beyond llama.cpp's limits and the machine's: typed refusals before
llama.cpp allocates anything, and an engine that loads normally afterwards."""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

import pytest

from shard_engine_api import (
    InvalidRequest,
    LoadConfig,
    PrefillRequest,
    ResourceExhausted,
    SessionRef,
    ShardSpec,
    TokenInput,
)
from shard_engine_llama import LlamaEngine, _memory, _shard_files
from shard_engine_llama._fixtures import TINY_MODEL_LAYERS
from shard_engine_llama._gguf import split_model

MiB = 1 << 20


def _config(
    model: Path, start: int = 0, end: int = TINY_MODEL_LAYERS, **fields: object
) -> LoadConfig:
    options = {"n_ubatch": 4, "model_store": str(model.parent / "store")}
    return LoadConfig(
        shard=ShardSpec(model=str(model), n_layers=TINY_MODEL_LAYERS, start=start, end=end),
        options=options,
        **fields,  # type: ignore[arg-type]
    )


def _serves_after_refusal(engine: LlamaEngine, model: Path) -> None:
    """The refused load left nothing behind: the same engine loads and computes."""
    engine.load(_config(model, max_sessions=2, max_context=64))
    session = SessionRef(session_id="after", epoch=1)
    engine.prefill(
        PrefillRequest(
            request_id="after", session=session, start_pos=0, inputs=TokenInput(token_ids=(1, 2))
        )
    )
    engine.close()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_context_cells_beyond_32_bits_are_refused(tiny_model: Path) -> None:
    """llama.cpp's n_ctx is 32-bit: max_context 2**24 for 255 sessions and the spare one is
    2**32 cells, which used to wrap to 0 and load with llama.cpp's default context (256
    positions per session reported for the 16,777,216 asked for)."""
    engine = LlamaEngine()
    with pytest.raises(InvalidRequest, match="32-bit") as raised:
        engine.load(_config(tiny_model, max_context=1 << 24, max_sessions=255))
    assert raised.value.details["cells"] == 1 << 32
    _serves_after_refusal(engine, tiny_model)


@pytest.mark.parametrize("n_threads", [513, 4096])
def test_threads_beyond_ggml_limit_are_refused(tiny_model: Path, n_threads: int) -> None:
    """OpenMP started every thread asked for (4,097 of them, 6.8 s per token on 2 cores)."""
    engine = LlamaEngine()
    with pytest.raises(InvalidRequest, match="GGML_MAX_N_THREADS"):
        engine.load(_config(tiny_model, n_threads=n_threads))
    _serves_after_refusal(engine, tiny_model)


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (None, {"model_store": "a\x00b"}, "NUL"),
        ("/", {}, "not a regular file"),
        ("/dev/null", {}, "not a regular file"),
        ("/nonexistent/model.gguf", {}, "does not exist"),
    ],
)
def test_bad_paths_are_named(
    tiny_model: Path, model: str | None, options: dict[str, str], message: str
) -> None:
    config = _config(tiny_model)
    config = LoadConfig(
        shard=ShardSpec(model=model or str(tiny_model), n_layers=TINY_MODEL_LAYERS, start=0, end=6),
        options={**config.options, **options},
    )
    engine = LlamaEngine()
    with pytest.raises(InvalidRequest, match=message):
        engine.load(config)
    _serves_after_refusal(engine, tiny_model)


def test_context_beyond_memory_is_refused_before_allocation(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp allocates and clears every sequence's KV stream at load: 1.7 GB for this
    1 MB model at a 65,536 context with 16 sessions, and a context larger than the memory got
    the process killed. The estimate is refused before llama.cpp sees the config."""
    monkeypatch.setattr(_memory, "available_memory", lambda: 256 * MiB)
    engine = LlamaEngine()
    before = _peak_rss()
    with pytest.raises(ResourceExhausted, match="KV cache") as raised:
        engine.load(_config(tiny_model, max_context=1 << 16, max_sessions=16))
    assert raised.value.retryable is False
    assert raised.value.details["resource"] == "memory"
    # 17 sequences x 65,536 cells x 6 layers x 2 KV heads x (16 + 16) x 4 bytes.
    assert int(raised.value.details["bytes"]) >= 17 * (1 << 16) * 6 * 2 * 32 * 4  # type: ignore[arg-type]
    assert _peak_rss() - before < 256 * MiB
    _serves_after_refusal(engine, tiny_model)


def test_tail_logits_buffer_counts_against_memory(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tail reserves logits for a whole batch (max_batch_tokens rows of the vocabulary); a
    middle shard with the same settings computes no logits and fits."""
    monkeypatch.setattr(_memory, "available_memory", lambda: 512 * MiB)
    fields = {"max_context": 16, "max_sessions": 1, "max_batch_tokens": 1 << 20}
    engine = LlamaEngine()
    with pytest.raises(ResourceExhausted, match="logits"):
        engine.load(_config(tiny_model, 3, TINY_MODEL_LAYERS, **fields))
    middle = LlamaEngine()
    middle.load(_config(tiny_model, 2, 4, **fields))
    middle.close()
    _serves_after_refusal(engine, tiny_model)


def test_engines_loading_one_range_at_once_take_turns(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines of several processes (or threads) loading the same range into one store used
    to write the same ``.partial`` file over each other: measured with 3 processes on a fresh
    store, 2 of 3 loads failed ("carries no shard.content_sha256", "No such file or
    directory"). The write is now under a per-range lock: one writes, the others reuse the
    verified file. (Slowed writes make the overlap certain without the lock.) The shard
    directory is named after the model and its digest, not the descriptor it was read by."""
    active = 0
    overlap = 0
    guard = threading.Lock()

    def slow_split(*args: Any, **kwargs: Any) -> Any:
        nonlocal active, overlap
        with guard:
            active += 1
            overlap = max(overlap, active)
        try:
            time.sleep(0.2)
            return split_model(*args, **kwargs)
        finally:
            with guard:
                active -= 1

    monkeypatch.setattr(_shard_files, "split_model", slow_split)
    store = tmp_path / "store"
    config = LoadConfig(
        shard=ShardSpec(model=str(tiny_model), n_layers=TINY_MODEL_LAYERS, start=2, end=4),
        max_sessions=1,
        max_context=16,
        options={"n_ubatch": 4, "model_store": str(store)},
    )
    engines = [LlamaEngine() for _ in range(3)]
    errors: list[BaseException] = []

    def load(engine: LlamaEngine) -> None:
        try:
            engine.load(config)
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=load, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert not errors, errors
        assert overlap == 1
        paths = {engine.shard_path for engine in engines}
        assert len(paths) == 1
        (path,) = paths
        assert path is not None
        assert path.parent.parent.name.startswith(tiny_model.stem + "-")
    finally:
        for engine in engines:
            engine.close()


_UNDER_ADDRESS_LIMIT: Final = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
from shard_engine_api import LoadConfig, ResourceExhausted, ShardSpec
from shard_engine_llama import LlamaEngine
config = LoadConfig(
    shard=ShardSpec(model=sys.argv[1], n_layers=6, start=0, end=6),
    max_context=1 << 17,
    options={"n_ubatch": 4, "model_store": sys.argv[2], "self_test": False},
)
try:
    LlamaEngine().load(config)
except ResourceExhausted as error:
    print("refused", error.details["resource"])
else:
    print("loaded")
"""


def test_context_beyond_the_address_space_limit_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Under ``ulimit -v`` (RLIMIT_AS) llama.cpp's allocation failed and the load said only
    "llama.cpp could not create a context"; the limit left now bounds the estimate (here 3 GiB
    against the 4.2 GiB a 131,072 context with 16 sessions needs)."""
    completed = subprocess.run(
        [sys.executable, "-c", _UNDER_ADDRESS_LIMIT, str(tiny_model), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["refused", "memory"], completed.stdout
