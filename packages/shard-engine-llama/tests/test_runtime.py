"""The llama.cpp shard runtime: split pipelines must reproduce unsplit logits bit for bit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api.wire import payload_checksum
from shard_engine_llama._abi import (
    AbortedError,
    BatchItem,
    ContextSettings,
    InvalidInputError,
    KVFullError,
    LlamaRuntimeError,
    ShardRuntime,
)
from shard_engine_llama._gguf import Manifest, split_model
from shard_engine_llama._llama_library import native_callbacks_available
from shard_engine_llama._self_test import self_test
from shard_engine_llama._tiny_model import write_tiny_model

Logits = npt.NDArray[np.float32]
_Digests = list[tuple[int, bool]]
OPTIONS = ContextSettings(n_ctx=256, n_seq_max=4, n_threads=2, n_batch=64, n_ubatch=16)
PREFILL_SIZES = (1, 7, 33, 45)
N_DECODE = 4


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 260, n)]


class Pipeline:
    """A chain of shard runtimes used like one model (or a single full runtime)."""

    def __init__(self, paths: Sequence[Path], settings: ContextSettings) -> None:
        self.runtimes = [ShardRuntime(path, settings=settings) for path in paths]

    def run(self, seq_id: int, pos: int, tokens: Sequence[int], all_logits: bool = False) -> Logits:
        head = self.runtimes[0]
        if len(self.runtimes) == 1:
            return head.run(seq_id, pos, tokens=tokens, all_logits=all_logits)
        hidden = head.run(seq_id, pos, tokens=tokens)
        for runtime in self.runtimes[1:-1]:
            hidden = runtime.run(seq_id, pos, embeddings=hidden)
        return self.runtimes[-1].run(seq_id, pos, embeddings=hidden, all_logits=all_logits)

    def run_batch(self, items: Sequence[tuple[int, int, int]]) -> Logits:
        rows = self.runtimes[0].run_batch([BatchItem(s, p, token=t) for s, p, t in items])
        for runtime in self.runtimes[1:]:
            rows = runtime.run_batch(
                [BatchItem(s, p, embedding=rows[i]) for i, (s, p, _) in enumerate(items)]
            )
        return rows

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        for runtime in self.runtimes:
            runtime.seq_rm(seq_id, p0, p1)

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()


def _generate(
    pipeline: Pipeline, seq_id: int, prompt: Sequence[int], n_decode: int = N_DECODE
) -> list[Logits]:
    """Prefill with all logits, then greedy decode; returns every logits array produced."""
    outputs = [pipeline.run(seq_id, 0, prompt, all_logits=True)]
    for step in range(n_decode):
        token = int(np.argmax(outputs[-1][-1]))
        outputs.append(pipeline.run(seq_id, len(prompt) + step, [token]))
    return outputs


def _shard_paths(manifest: Manifest) -> list[Path]:
    return [manifest.shard_path(i) for i in range(len(manifest.shards))]


@pytest.fixture(scope="module", params=["f32", "f16", "q8_0"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"model-{request.param}") / "tiny.gguf"
    write_tiny_model(path, n_layers=6, dtype=str(request.param), seed=3)
    return path


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model-f32-shared") / "tiny.gguf"
    write_tiny_model(path, n_layers=6, seed=5)
    return path


@pytest.fixture(scope="module")
def f32_split(f32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return split_model(f32_model, [(0, 2), (2, 3), (3, 6)], tmp_path_factory.mktemp("split"))


@pytest.fixture
def full_and_split(f32_model: Path, f32_split: Manifest) -> Iterator[tuple[Pipeline, Pipeline]]:
    full = Pipeline([f32_model], OPTIONS)
    split = Pipeline(_shard_paths(f32_split), OPTIONS)
    yield full, split
    full.close()
    split.close()


@pytest.mark.parametrize(
    "ranges", [[(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]]
)
def test_split_equals_unsplit_bitwise(
    model: Path, tmp_path: Path, ranges: list[tuple[int, int]]
) -> None:
    """Prefill 1/7/33/45 tokens (several ubatches of 16) + 4 decode steps, every logit identical."""
    manifest = split_model(model, ranges, tmp_path)
    full = Pipeline([model], OPTIONS)
    split = Pipeline(_shard_paths(manifest), OPTIONS)
    try:
        for seq_id, n in enumerate(PREFILL_SIZES):
            expected = _generate(full, seq_id, _prompt(n, seed=n))
            actual = _generate(split, seq_id, _prompt(n, seed=n))
            assert all(np.isfinite(e).all() for e in expected)
            assert np.std(expected[0][-1]) > 0.1, (
                "degenerate logits would make equality meaningless"
            )
            for e, a in zip(expected, actual, strict=True):
                assert e.shape == a.shape
                np.testing.assert_array_equal(a, e)
    finally:
        full.close()
        split.close()


def test_interleaved_sessions_are_bitwise_equal(full_and_split: tuple[Pipeline, Pipeline]) -> None:
    """Three sessions advanced in turn: split equals unsplit, and each equals running it alone."""
    full, split = full_and_split
    prompts = {0: _prompt(7, 1), 1: _prompt(33, 2), 3: _prompt(12, 3)}
    results: dict[str, dict[int, list[Logits]]] = {}
    for name, pipeline in (("full", full), ("split", split)):
        outputs: dict[int, list[Logits]] = {s: [pipeline.run(s, 0, p)] for s, p in prompts.items()}
        for step in range(N_DECODE):
            for seq_id, prompt in prompts.items():
                token = int(np.argmax(outputs[seq_id][-1][-1]))
                outputs[seq_id].append(pipeline.run(seq_id, len(prompt) + step, [token]))
        results[name] = outputs
    for seq_id in prompts:
        for e, a in zip(results["full"][seq_id], results["split"][seq_id], strict=True):
            np.testing.assert_array_equal(a, e)
    full.seq_rm(-1)
    alone = _generate(full, 2, prompts[1])
    for e, a in zip(alone[1:], results["full"][1][1:], strict=True):
        np.testing.assert_array_equal(a, e)


def test_batched_decode_row_order(full_and_split: tuple[Pipeline, Pipeline]) -> None:
    """One llama_decode for several sequences returns rows in item order, split == unsplit."""
    full, split = full_and_split
    prompts = {3: _prompt(5, 11), 0: _prompt(9, 12), 2: _prompt(3, 13)}
    next_tokens = {3: 40, 0: 41, 2: 42}
    singles: dict[int, Logits] = {}
    for seq_id, prompt in prompts.items():
        full.run(seq_id, 0, prompt)
        singles[seq_id] = full.run(seq_id, len(prompt), [next_tokens[seq_id]])[0]
        full.seq_rm(seq_id, len(prompt))
        split.run(seq_id, 0, prompt)
    # Deliberately unsorted and non-consecutive sequence ids.
    items = [(s, len(prompts[s]), next_tokens[s]) for s in (2, 3, 0)]
    batched_full = full.run_batch(items)
    batched_split = split.run_batch(items)
    np.testing.assert_array_equal(batched_split, batched_full)
    for row, (seq_id, _, _) in enumerate(items):
        np.testing.assert_allclose(batched_full[row], singles[seq_id], rtol=0, atol=1e-4)
        distances = [float(np.abs(batched_full[row] - singles[s]).max()) for s in prompts]
        assert int(np.argmin(distances)) == list(prompts).index(seq_id)


def test_batched_hidden_rows_follow_item_order(f32_split: Manifest) -> None:
    head = ShardRuntime(f32_split.shard_path(0), settings=OPTIONS)
    try:
        singles = {}
        for seq_id in (1, 2, 3):
            singles[seq_id] = head.run(seq_id, 0, tokens=[10 * seq_id])[0]
            head.seq_rm(seq_id)
        rows = head.run_batch([BatchItem(s, 0, token=10 * s) for s in (3, 1, 2)])
        for row, seq_id in enumerate((3, 1, 2)):
            np.testing.assert_allclose(rows[row], singles[seq_id], rtol=0, atol=1e-5)
    finally:
        head.close()


def test_a_batch_of_one_is_the_single_row(f32_model: Path, f32_split: Manifest) -> None:
    """A one-item batch is the same llama_decode as run() of that row: the same logits (tail)
    and hidden state (head), bit for bit."""
    for path in (f32_model, f32_split.shard_path(0)):
        with ShardRuntime(path, settings=OPTIONS) as runtime:
            runtime.run(1, 0, tokens=[5, 6, 7])
            single = runtime.run(1, 3, tokens=[8])
            runtime.seq_rm(1, 3)
            batched = runtime.run_batch([BatchItem(1, 3, token=8)])
            np.testing.assert_array_equal(batched, single)
            assert runtime.seq_pos_max(1) == 3


def test_logits_rows_are_read_as_one_block(
    f32_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several logits rows (a batch, or every row of a prefill) are read through one view of
    llama.cpp's contiguous logits, with two address lookups instead of one per row, into the
    same bits and digests as rows read one by one: a batch's digest per row in item order, a
    prefill's one digest of all its rows."""

    def read(runtime: ShardRuntime, block: bool) -> tuple[Logits, Logits, _Digests, _Digests, int]:
        lookups = 0
        lookup = runtime._logits_address

        def counted(context: int, index: int) -> int:
            nonlocal lookups
            lookups += 1
            return int(lookup(context, index))

        runtime._logits_address = counted  # type: ignore[assignment]
        if not block:
            monkeypatch.setattr(runtime, "_logits_block", lambda context, outputs: None)
        for seq_id in (0, 1, 2, 3):
            runtime.seq_rm(seq_id)
        prefill = runtime.run(0, 0, tokens=_prompt(6, 21), all_logits=True)
        prefill_digests = runtime.row_digests
        for seq_id in (3, 1, 2):
            runtime.run(seq_id, 0, tokens=_prompt(seq_id + 2, seq_id))
        lookups = 0
        batch = runtime.run_batch([BatchItem(s, s + 2, token=7 * s) for s in (2, 3, 1)])
        return prefill, batch, prefill_digests, runtime.row_digests, lookups

    with ShardRuntime(f32_model, settings=OPTIONS) as runtime:
        prefill, batch, prefill_digests, batch_digests, lookups = read(runtime, block=True)
    with ShardRuntime(f32_model, settings=OPTIONS) as runtime:
        one_by_one = read(runtime, block=False)
    assert lookups == 2
    assert one_by_one[4] == 3
    np.testing.assert_array_equal(prefill, one_by_one[0])
    np.testing.assert_array_equal(batch, one_by_one[1])
    assert prefill_digests == one_by_one[2] == [(payload_checksum(prefill.tobytes()), True)]
    expected = [(payload_checksum(row.tobytes()), True) for row in batch]
    assert batch_digests == one_by_one[3] == expected
    assert len(set(expected)) == 3


def test_native_callbacks_are_built() -> None:
    """The project's install builds the optional C callbacks (a compiler is part of its
    toolchain: llama-cpp-python itself builds from source); without them every non-tail shard
    pays a Python call per graph node."""
    assert native_callbacks_available(), (
        "shard_engine_llama._native was not built: reinstall the llama package with a C compiler"
    )


@pytest.mark.parametrize("shard", [0, 1])
def test_native_and_python_callbacks_capture_the_same_bits(f32_split: Manifest, shard: int) -> None:
    """Head and middle shards capture their rows through the native eval callback or the
    Python one: identical bits for prefills longer than a ubatch (several captures appended),
    single decodes and batched decodes of several sequences."""
    runtimes = [
        ShardRuntime(f32_split.shard_path(shard), settings=OPTIONS, native_callbacks=native)
        for native in (True, False)
    ]
    try:
        assert [runtime.native_callbacks for runtime in runtimes] == [True, False]
        width = runtimes[0].n_embd_input
        rng = np.random.default_rng(shard)
        prompt = _prompt(45, 7)
        hidden = rng.standard_normal((45, width)).astype(np.float32)
        outputs: list[list[npt.NDArray[np.float32]]] = []
        for runtime in runtimes:
            rows: list[npt.NDArray[np.float32]] = []
            for seq_id in (0, 1, 2):
                if runtime.is_head:
                    rows.append(runtime.run(seq_id, 0, tokens=prompt[: 20 + seq_id * 10]))
                else:
                    rows.append(runtime.run(seq_id, 0, embeddings=hidden[: 20 + seq_id * 10]))
            items = [
                BatchItem(seq_id, 20 + seq_id * 10, token=prompt[seq_id])
                if runtime.is_head
                else BatchItem(seq_id, 20 + seq_id * 10, embedding=hidden[seq_id])
                for seq_id in (2, 0, 1)
            ]
            rows.append(runtime.run_batch(items))
            outputs.append(rows)
        for native_rows, python_rows in zip(*outputs, strict=True):
            np.testing.assert_array_equal(native_rows, python_rows)
    finally:
        for runtime in runtimes:
            runtime.close()


def test_abort_mid_prefill_rolls_back(tmp_path: Path) -> None:
    """An abort from another thread stops a long prefill; after rollback a rerun is clean."""
    path = tmp_path / "wide.gguf"
    write_tiny_model(path, n_layers=8, n_embd=256, n_head=8, n_head_kv=4, n_ff=512, seed=9)
    options = ContextSettings(n_ctx=1024, n_seq_max=1, n_threads=2, n_batch=512, n_ubatch=16)
    prompt = _prompt(512, 4)
    with ShardRuntime(path, settings=options) as runtime:
        # The first decode pays one-off allocation costs; time a warm run.
        runtime.run(0, 0, tokens=prompt[:16])
        runtime.seq_rm(0)
        started = time.perf_counter()
        clean = runtime.run(0, 0, tokens=prompt)
        clean_seconds = time.perf_counter() - started
        runtime.seq_rm(0)
        aborted = False
        for fraction in (0.5, 0.25, 0.1, 0.02):
            timer = threading.Timer(clean_seconds * fraction, runtime.request_abort)
            timer.start()
            try:
                runtime.run(0, 0, tokens=prompt)
            except AbortedError:
                aborted = True
            finally:
                timer.join()
                runtime.clear_abort()
            if aborted:
                break
            runtime.seq_rm(0)
        assert aborted, f"prefill of {clean_seconds:.3f}s never got aborted"
        # run() already removed the completed ubatches; the caller's own rollback is harmless.
        assert runtime.seq_pos_max(0) == -1
        runtime.seq_rm(0)
        np.testing.assert_array_equal(runtime.run(0, 0, tokens=prompt), clean)


def test_abort_requested_before_run(f32_model: Path) -> None:
    with ShardRuntime(f32_model, settings=OPTIONS) as runtime:
        runtime.run(0, 0, tokens=_prompt(5))
        runtime.request_abort()
        with pytest.raises(AbortedError):
            runtime.run(0, 5, tokens=_prompt(20))
        assert runtime.seq_pos_max(0) == 4
        runtime.clear_abort()
        assert runtime.run(0, 5, tokens=_prompt(20)).shape == (1, 260)


def test_kv_full_raises_and_keeps_state(f32_model: Path) -> None:
    options = ContextSettings(n_ctx=256, n_seq_max=2, n_threads=2, n_batch=64, n_ubatch=16)
    with ShardRuntime(f32_model, settings=options) as runtime:
        assert runtime.n_ctx_seq == 256
        filled = 0
        while filled < runtime.n_ctx_seq - 10:
            runtime.run(0, filled, tokens=_prompt(50, filled)[: runtime.n_ctx_seq - 10 - filled])
            filled = runtime.seq_pos_max(0) + 1
        with pytest.raises(KVFullError):
            runtime.run(0, filled, tokens=_prompt(20))
        assert runtime.seq_pos_max(0) == filled - 1
        assert runtime.run(0, filled, tokens=_prompt(10)).shape == (1, 260)


def test_rollback_then_rerun_matches(full_and_split: tuple[Pipeline, Pipeline]) -> None:
    full, _ = full_and_split
    prompt = _prompt(20, 8)
    expected = full.run(0, 0, prompt, all_logits=True)
    full.seq_rm(0, 12)
    np.testing.assert_array_equal(full.run(0, 12, prompt[12:], all_logits=True), expected[12:])


def test_wrong_inputs_are_rejected(f32_model: Path, f32_split: Manifest) -> None:
    with ShardRuntime(f32_split.shard_path(1), settings=OPTIONS) as middle:
        assert not middle.is_head
        assert not middle.is_tail
        with pytest.raises(InvalidInputError, match="hidden states"):
            middle.run(0, 0, tokens=[1, 2])
        with pytest.raises(InvalidInputError, match="shape"):
            middle.run(0, 0, embeddings=np.zeros((2, 3), np.float32))
    with ShardRuntime(f32_model, settings=OPTIONS) as full:
        with pytest.raises(InvalidInputError, match="vocabulary"):
            full.run(0, 0, tokens=[100000])
        with pytest.raises(InvalidInputError, match="seq_id"):
            full.run(9, 0, tokens=[1])
        with pytest.raises(InvalidInputError, match="distinct"):
            full.run_batch([BatchItem(0, 0, token=1), BatchItem(0, 1, token=2)])
        full.run(0, 0, tokens=[1, 2, 3])
        bad_calls: list[Callable[[], object]] = [
            lambda: full.run(0, 3, tokens=[-1]),
            lambda: full.run(0, 3, tokens=[2**31]),
            lambda: full.run(0, 3, tokens=np.array([1.5])),
            lambda: full.run(0, 3, tokens=np.array([[1, 2]])),
            lambda: full.run(0, 3, tokens=[]),
            lambda: full.run(0, -1, tokens=[1]),
            lambda: full.run(0, 2**31, tokens=[1]),
            lambda: full.run(-1, 3, tokens=[1]),
            lambda: full.run(0, 3, tokens=list(range(65))),
            lambda: full.run(0, 3, embeddings=np.zeros((1, full.n_embd), np.float32)),
            lambda: full.run_batch([BatchItem(0, 3, embedding=np.zeros(full.n_embd, np.float32))]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, 0, token=-5)]),
            # Batch rows are checked on Python ints: every bound as for a single run.
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, 0, token=2**31)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, 0, token=-(2**31) - 1)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, 0, token=100000)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(9, 0, token=2)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, -1, token=2)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1), BatchItem(1, 2**31, token=2)]),
            lambda: full.run_batch([BatchItem(0, 3, token=True), BatchItem(1, 0, token=2)]),
            lambda: full.run_batch([BatchItem(0, 3, token=1.0), BatchItem(1, 0, token=2)]),  # type: ignore[arg-type]
            lambda: full.run(0, 3, tokens=[True]),
        ]
        for call in bad_calls:
            with pytest.raises(InvalidInputError):
                call()
            # A refused call changes nothing.
            assert full.seq_pos_max(0) == 2
            assert full.seq_pos_max(1) == -1
    with ShardRuntime(f32_split.shard_path(1), settings=OPTIONS) as middle:
        width = middle.n_embd_input
        for embeddings in (
            np.zeros((0, width), np.float32),
            np.zeros((2, width, 1), np.float32),
            np.zeros(width, np.float32),
            np.zeros((2, width + 1), np.float32),
        ):
            with pytest.raises(InvalidInputError):
                middle.run(0, 0, embeddings=embeddings)
        with pytest.raises(InvalidInputError, match="shape"):
            middle.run_batch([BatchItem(0, 0, embedding=np.zeros(width - 1, np.float32))])
        with pytest.raises(InvalidInputError, match="hidden states"):
            middle.run_batch([BatchItem(0, 0, token=1)])
        assert middle.seq_pos_max(0) == -1
        # float64 rows are converted, as before.
        rows = middle.run(0, 0, embeddings=np.zeros((2, width), np.float64))
        assert rows.shape == (2, middle.n_embd)


def test_close_is_idempotent(f32_model: Path) -> None:
    runtime = ShardRuntime(f32_model, settings=OPTIONS)
    runtime.close()
    runtime.close()
    with pytest.raises(LlamaRuntimeError, match="closed"):
        runtime.run(0, 0, tokens=[1])


def test_token_text(f32_model: Path) -> None:
    with ShardRuntime(f32_model, settings=OPTIONS) as runtime:
        assert runtime.token_to_piece(3 + ord("a")) == b"a"
        assert runtime.n_vocab == 260
        assert runtime.tokenize("ab")[-2:] == [3 + ord("a"), 3 + ord("b")]


@pytest.mark.parametrize("ranges", [[(0, 5), (5, 6)], [(0, 2), (2, 4), (4, 6)]])
def test_gemma3_split_equals_unsplit(tmp_path: Path, ranges: list[tuple[int, int]]) -> None:
    """Sliding-window rules per shard; [(0, 5), (5, 6)] has an all-global tail (window 0)."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, arch="gemma3", n_layers=6, sliding_window=8, seed=4)
    manifest = split_model(path, ranges, tmp_path / "out")
    full = Pipeline([path], OPTIONS)
    split = Pipeline(_shard_paths(manifest), OPTIONS)
    try:
        prompt = _prompt(45, 6)
        for e, a in zip(_generate(full, 0, prompt), _generate(split, 0, prompt), strict=True):
            np.testing.assert_array_equal(a, e)
    finally:
        full.close()
        split.close()


def test_self_test_passes(tmp_path: Path) -> None:
    report = self_test(tmp_path)
    assert report.max_abs_diff == 0.0
    assert report.llama_cpp_python.startswith("0.3.36")
