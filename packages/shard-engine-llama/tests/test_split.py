"""GGUF validation, inspection, architecture rules, shard planning and shard writing."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_engine_llama._gguf import (
    GGUFModelInfo,
    GGUFValidationError,
    ShardingRefusedError,
    SplitProgress,
    inspect_gguf,
    parts_by_bytes,
    read_gguf_header,
    split_model,
    validate_gguf,
)
from shard_engine_llama._gguf import writer as writer_module
from shard_engine_llama._tiny_model import write_tiny_model


def _rewrite(
    source: Path,
    destination: Path,
    *,
    drop_tensors: frozenset[str] = frozenset(),
    metadata: Mapping[str, int | str] | None = None,
) -> Path:
    """Copy a GGUF with some tensors dropped and some scalar metadata replaced."""
    header = read_gguf_header(source)
    overrides = metadata or {}
    arch = str(overrides.get("general.architecture", header.architecture))
    writer = gguf.GGUFWriter(destination, arch)
    for key, entry in header.metadata.items():
        if key == "general.architecture":
            continue
        if key in overrides:
            value = overrides[key]
            kind = (
                gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32
            )
            writer.add_key_value(key, value, kind)
        else:
            writer.add_key_value(key, entry.value, entry.value_type, entry.element_type)
    for key, value in overrides.items():
        if key not in header.metadata and key != "general.architecture":
            kind = (
                gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32
            )
            writer.add_key_value(key, value, kind)
    raw = source.read_bytes()
    for record in header.tensors.values():
        if record.name in drop_tensors:
            continue
        block_size, type_size = gguf.GGML_QUANT_SIZES[record.ggml_type]
        byte_shape = (*reversed(record.shape[1:]), record.shape[0] // block_size * type_size)
        data = np.frombuffer(
            raw, dtype=np.uint8, count=record.n_bytes, offset=record.offset
        ).reshape(byte_shape)
        writer.add_tensor(record.name, data, raw_dtype=record.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_model(path, n_layers=4)
    return path


# -- tiny model ---------------------------------------------------------------------------------


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    for dtype in ("f32", "f16", "q8_0"):
        first, second = tmp_path / f"a-{dtype}.gguf", tmp_path / f"b-{dtype}.gguf"
        write_tiny_model(first, dtype=dtype, seed=7)
        write_tiny_model(second, dtype=dtype, seed=7)
        assert first.read_bytes() == second.read_bytes()
    write_tiny_model(tmp_path / "c.gguf", seed=8)
    assert (tmp_path / "c.gguf").read_bytes() != (tmp_path / "a-f32.gguf").read_bytes()


def test_tiny_model_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab"):
        write_tiny_model(tmp_path / "x.gguf", vocab=100)
    with pytest.raises(ValueError, match="architecture"):
        write_tiny_model(tmp_path / "x.gguf", arch="gpt2")


# -- validation ---------------------------------------------------------------------------------


def test_valid_model_passes(tiny: Path) -> None:
    header = validate_gguf(tiny)
    assert header.architecture == "llama"
    assert "blk.3.ffn_down.weight" in header.tensors


@pytest.mark.parametrize("keep_fraction", [0.0, 0.001, 0.05, 0.5, 0.999])
def test_truncated_file_is_refused(tiny: Path, tmp_path: Path, keep_fraction: float) -> None:
    data = tiny.read_bytes()
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(GGUFValidationError):
        validate_gguf(broken)


def test_garbage_file_is_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(
        np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    )
    with pytest.raises(GGUFValidationError, match="magic"):
        validate_gguf(garbage)


def test_garbage_after_valid_magic_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for attempt in range(20):
        garbage = tmp_path / f"garbage-{attempt}.gguf"
        garbage.write_bytes(
            b"GGUF\x03\x00\x00\x00" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        )
        with pytest.raises(GGUFValidationError):
            validate_gguf(garbage)


def test_zeroed_header_is_refused(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[:64] = bytes(64)
    broken = tmp_path / "zeroed.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(GGUFValidationError, match="magic"):
        validate_gguf(broken)


def test_unsupported_version_is_refused(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    broken = tmp_path / "version.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(GGUFValidationError, match="version"):
        validate_gguf(broken)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GGUFValidationError, match="cannot read"):
        validate_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize(
    ("dropped", "message"),
    [
        ("output_norm.weight", "output_norm.weight"),
        ("token_embd.weight", "token_embd.weight"),
        ("blk.2.attn_norm.weight", "blk.2.attn_norm.weight"),
    ],
)
def test_missing_tensor_is_refused(tiny: Path, tmp_path: Path, dropped: str, message: str) -> None:
    broken = _rewrite(tiny, tmp_path / "missing.gguf", drop_tensors=frozenset({dropped}))
    with pytest.raises(GGUFValidationError, match=message.replace(".", r"\.")):
        validate_gguf(broken)


def test_missing_whole_block_is_refused(tiny: Path, tmp_path: Path) -> None:
    header = read_gguf_header(tiny)
    block = frozenset(name for name in header.tensors if name.startswith("blk.1."))
    broken = _rewrite(tiny, tmp_path / "hole.gguf", drop_tensors=block)
    with pytest.raises(GGUFValidationError, match=r"blocks \[1\]"):
        validate_gguf(broken)


@pytest.mark.parametrize(
    ("block_count", "message"), [(5, "have no tensors"), (3, "tensors exist for blocks")]
)
def test_inconsistent_block_count_is_refused(
    tiny: Path, tmp_path: Path, block_count: int, message: str
) -> None:
    broken = _rewrite(tiny, tmp_path / "count.gguf", metadata={"llama.block_count": block_count})
    with pytest.raises(GGUFValidationError, match=message):
        validate_gguf(broken)


def test_inconsistent_embedding_length_is_refused(tiny: Path, tmp_path: Path) -> None:
    broken = _rewrite(tiny, tmp_path / "embd.gguf", metadata={"llama.embedding_length": 32})
    with pytest.raises(GGUFValidationError, match="token_embd"):
        validate_gguf(broken)


def test_tensor_data_past_end_is_refused(tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    broken = tmp_path / "short.gguf"
    broken.write_bytes(data[:-100])
    with pytest.raises(GGUFValidationError, match="beyond the end"):
        validate_gguf(broken)


# -- inspection and architecture rules ------------------------------------------------------------


def test_inspect_reports_sizes(tiny: Path) -> None:
    info = inspect_gguf(tiny)
    assert (info.architecture, info.n_layers, info.n_embd, info.vocab_size) == ("llama", 4, 64, 260)
    assert len(set(info.layer_bytes)) == 1
    assert info.total_layer_bytes + info.non_layer_bytes < info.total_bytes
    assert info.shardable
    assert info.refusal is None
    assert not info.is_shard


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_allowed_architectures_are_shardable(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, n_layers=3)
    assert inspect_gguf(path).shardable


def test_embedding_scaling_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma2.gguf"
    write_tiny_model(path, arch="gemma2", n_layers=2)
    info = inspect_gguf(path)
    assert not info.shardable
    assert info.refusal is not None
    assert info.refusal.startswith("embedding-input-scaled")
    with pytest.raises(ShardingRefusedError, match="embedding-input-scaled"):
        split_model(path, [(0, 1), (1, 2)], tmp_path / "out")


def test_unknown_architecture_is_refused(tiny: Path, tmp_path: Path) -> None:
    renamed: dict[str, int | str] = {"general.architecture": "starcoder2"}
    header = read_gguf_header(tiny)
    for key in header.metadata:
        if key.startswith("llama."):
            renamed_key = "starcoder2." + key[len("llama.") :]
            entry = header.metadata[key]
            if isinstance(entry.value, int | str) and not isinstance(entry.value, bool):
                renamed[renamed_key] = entry.value
    path = _rewrite(tiny, tmp_path / "starcoder2.gguf", metadata=renamed)
    info = inspect_gguf(path)
    assert info.refusal is not None
    assert info.refusal.startswith("architecture-not-allowed")


def test_gemma3_with_62_layers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma3-62.gguf"
    write_tiny_model(path, arch="gemma3", n_layers=62, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    info = inspect_gguf(path)
    assert info.refusal is not None
    assert info.refusal.startswith("gemma3-layer-count-attention-scale")


def test_shard_files_are_not_resplit(tiny: Path, tmp_path: Path) -> None:
    manifest = split_model(tiny, [(0, 2), (2, 4)], tmp_path)
    info = inspect_gguf(manifest.shard_path(0))
    assert info.is_shard
    assert info.refusal is not None
    assert info.refusal.startswith("already-a-shard")


# -- planning -------------------------------------------------------------------------------------


def _info(layer_bytes: list[int]) -> GGUFModelInfo:
    return GGUFModelInfo(
        path=Path("x.gguf"),
        architecture="llama",
        n_layers=len(layer_bytes),
        n_embd=8,
        vocab_size=8,
        layer_bytes=tuple(layer_bytes),
        non_layer_bytes=0,
        file_size=sum(layer_bytes),
        shardable=True,
        refusal=None,
        is_shard=False,
    )


def test_parts_by_bytes_uniform_and_uneven() -> None:
    assert parts_by_bytes(_info([10] * 8), 2) == [(0, 4), (4, 8)]
    assert parts_by_bytes(_info([10] * 8), 8) == [(i, i + 1) for i in range(8)]
    assert parts_by_bytes(_info([100, 1, 1, 1, 1, 100]), 3) == [(0, 1), (1, 5), (5, 6)]
    with pytest.raises(ValueError, match="cannot split"):
        parts_by_bytes(_info([1, 2]), 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_parts_by_bytes_is_optimal(weights: list[int], n_parts: int) -> None:
    if n_parts > len(weights):
        return
    ranges = parts_by_bytes(_info(weights), n_parts)
    assert ranges[0][0] == 0
    assert ranges[-1][1] == len(weights)
    assert len(ranges) == n_parts
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(start < end for start, end in ranges)
    achieved = max(sum(weights[s:e]) for s, e in ranges)

    def best(start: int, parts: int) -> int:
        if parts == 1:
            return sum(weights[start:])
        return min(
            max(sum(weights[start:cut]), best(cut, parts - 1))
            for cut in range(start + 1, len(weights) - parts + 2)
        )

    assert achieved == best(0, n_parts)


# -- writing shards -------------------------------------------------------------------------------


def test_split_writes_expected_shards(tiny: Path, tmp_path: Path) -> None:
    events: list[SplitProgress] = []
    manifest = split_model(tiny, [(0, 1), (1, 3), (3, 4)], tmp_path, progress=events.append)
    assert [s.role for s in manifest.shards] == ["head", "middle", "tail"]
    assert [s.has_identity_block for s in manifest.shards] == [True, True, False]
    assert any(e.stage == "write" and e.bytes_done == e.bytes_total for e in events)
    head, middle, tail = (read_gguf_header(manifest.shard_path(i)) for i in range(3))
    assert head.get_int("llama.block_count") == 2
    assert middle.get_int("llama.block_count") == 3
    assert tail.get_int("llama.block_count") == 1
    assert middle.get_str("tokenizer.ggml.model") == "none"
    assert middle.get_int("llama.vocab_size") == 1
    assert middle.tensors["token_embd.weight"].shape == (64, 1)
    # The tail holds one vocabulary matrix: the lm-head, in the token embedding's place.
    assert "output.weight" not in tail.tensors
    assert "output.weight" not in head.tensors
    assert "tokenizer.ggml.tokens" not in head.metadata
    assert "tokenizer.ggml.tokens" not in tail.metadata
    assert head.get_int("llama.vocab_size") == tail.get_int("llama.vocab_size") == 260
    assert (middle.get_int("shard.start"), middle.get_int("shard.end")) == (1, 3)
    assert middle.get_int("shard.n_layers_total") == 4
    assert middle.get_str("shard.source_sha256") == manifest.source_sha256
    source = read_gguf_header(tiny)
    raw = tiny.read_bytes()
    lm_head, moved = source.tensors["output.weight"], tail.tensors["token_embd.weight"]
    tail_raw = manifest.shard_path(2).read_bytes()
    assert (
        tail_raw[moved.offset : moved.offset + moved.n_bytes]
        == raw[lm_head.offset : lm_head.offset + lm_head.n_bytes]
    )
    shard_raw = manifest.shard_path(1).read_bytes()
    renamed = middle.tensors["blk.1.ffn_down.weight"]
    original = source.tensors["blk.2.ffn_down.weight"]
    assert (
        shard_raw[renamed.offset : renamed.offset + renamed.n_bytes]
        == raw[original.offset : original.offset + original.n_bytes]
    )
    identity_norm = middle.tensors["blk.2.attn_norm.weight"]
    values = np.frombuffer(shard_raw, "<f4", count=64, offset=identity_norm.offset)
    assert np.all(values == 1.0)
    identity_weight = middle.tensors["blk.2.attn_q.weight"]
    assert not any(
        shard_raw[identity_weight.offset : identity_weight.offset + identity_weight.n_bytes]
    )
    for index in range(3):
        validate_gguf(manifest.shard_path(index))


def test_split_reuses_verified_shards(tiny: Path, tmp_path: Path) -> None:
    first = split_model(tiny, [(0, 2), (2, 4)], tmp_path)
    assert first.reused == (False, False)
    again = split_model(tiny, [(0, 2), (2, 4)], tmp_path)
    assert again.reused == (True, True)
    assert again == first
    path = again.shard_path(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    repaired = split_model(tiny, [(0, 2), (2, 4)], tmp_path)
    assert repaired.reused == (True, False)
    assert repaired.shards[1].sha256 == first.shards[1].sha256
    other = split_model(tiny, [(0, 1), (1, 4)], tmp_path)
    assert other.reused == (False, False)
    assert (tmp_path / "manifest.json").read_text() == other.to_json()


def test_split_rejects_bad_ranges(tiny: Path, tmp_path: Path) -> None:
    for ranges in ([(0, 2)], [(0, 2), (3, 4)], [(1, 4)], [(0, 2), (2, 2), (2, 4)], []):
        with pytest.raises(ValueError, match="range"):
            split_model(tiny, ranges, tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-c",
        "import sys; from shard_engine_api.cli import main; sys.exit(main())",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)


def test_a_refused_split_leaves_nothing_behind(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for ranges in ([(3, 1)], [(0, 2), (1, 4)], [(0, 99)]):
        with pytest.raises(ValueError, match="range"):
            split_model(tiny, ranges, out)
        assert not out.exists(), ranges


def test_a_failing_split_removes_the_shards_it_wrote(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module._write_sealed
    calls: list[Path] = []

    def fail_on_the_second(*args: Any, **kwargs: Any) -> str:
        calls.append(args[3])
        if len(calls) == 2:
            args[4].write_bytes(b"half a shard")  # the partial file exists when the disk fills
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "_write_sealed", fail_on_the_second)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space"):
        split_model(tiny, [(0, 2), (2, 4)], out)
    assert len(calls) == 2
    assert not out.exists(), sorted(out.iterdir())


def test_split_never_writes_over_its_source(tiny: Path, tmp_path: Path) -> None:
    source = tmp_path / "manifest.json"  # a model file named like the manifest it would write
    source.write_bytes(tiny.read_bytes())
    with pytest.raises(ValueError, match="source model itself"):
        split_model(source, [(0, 2), (2, 4)], tmp_path)
    assert source.read_bytes() == tiny.read_bytes()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["manifest.json"]


def test_split_cli_reports_an_unwritable_output_without_a_traceback(
    tiny: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (str(blocker), str(blocker / "below"), str(tiny)):
        result = _cli("split", str(tiny), "--parts", "2", "--out", out, "--quiet")
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("shard-engine split: error: cannot write the shards"), (
            result.stderr
        )
        assert "Traceback" not in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


def test_inspect_does_not_wait_on_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    result = _cli("inspect", str(fifo))  # opening it for reading used to block for a writer
    assert result.returncode == 2, result.stderr
    assert "shardable:     no — refused by rule: file-not-regular" in result.stdout


def test_tied_embeddings_keep_embedding_on_tail(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_tiny_model(path, tie_embeddings=True)
    manifest = split_model(path, [(0, 2), (2, 4)], tmp_path / "out")
    tail = read_gguf_header(manifest.shard_path(1))
    record = tail.tensors["token_embd.weight"]
    data = manifest.shard_path(1).read_bytes()[record.offset : record.offset + record.n_bytes]
    assert any(data)


def test_gemma3_pattern_is_sliced(tmp_path: Path) -> None:
    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, arch="gemma3", n_layers=6)
    manifest = split_model(path, [(0, 2), (2, 5), (5, 6)], tmp_path / "out")
    patterns = []
    for index in range(3):
        header = read_gguf_header(manifest.shard_path(index))
        patterns.append(header.metadata["gemma3.attention.sliding_window_pattern"].value)
        windows = header.get_int("gemma3.attention.sliding_window")
        assert windows == (0 if index == 2 else 8)
    # Full model: local where il % 6 < 5; identity blocks are local.
    assert patterns == [[True, True, True], [True, True, True, True], [False]]


def test_duplicate_token_strings_are_refused(tiny: Path, tmp_path: Path) -> None:
    """llama.cpp aborts the whole process (GGML_ASSERT in llama-vocab.cpp) on a vocabulary
    with duplicate token strings; the reader refuses such a file first."""
    broken = tmp_path / "duplicate.gguf"
    broken.write_bytes(tiny.read_bytes().replace(b"<0x01>", b"<0x00>", 1))
    with pytest.raises(GGUFValidationError, match="duplicate"):
        validate_gguf(broken)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_header_byte_mutations_give_a_typed_error_or_a_sound_header(
    tiny: Path, mutations: list[tuple[float, int]]
) -> None:
    """Any byte changes in the metadata and tensor-info region: validation either refuses the
    file with GGUFValidationError or returns a header (never another exception). Loading every
    file that validated, with llama.cpp, was also checked by hand over 1,200 mutations."""
    raw = bytearray(tiny.read_bytes())
    header_end = min(record.offset for record in read_gguf_header(tiny).tensors.values())
    for where, value in mutations:
        raw[int(where * header_end)] = value
    with tempfile.TemporaryDirectory() as scratch:
        mutated = Path(scratch) / "mutated.gguf"
        mutated.write_bytes(bytes(raw))
        message = ""
        try:
            header = validate_gguf(mutated)
        except GGUFValidationError as error:
            message = str(error)
        if message:
            assert str(mutated) in message, "the error names the file"
        else:
            assert header.tensors, "an accepted header describes its tensors"


def test_a_huge_metadata_array_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Five million one-byte elements: read into a list they took ~40 MiB for a 5 MB file (8x;
    float elements several times more), so a long array in a multi-gigabyte file could take the
    machine's memory before the header failed."""
    count = 5_000_000
    key = b"general.huge"
    raw = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IIQ", int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT8), count)
        + bytes(count)
    )
    path = tmp_path / "huge-array.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFValidationError) as raised:
        read_gguf_header(path)
    assert (raised.value.rule, raised.value.field) == ("metadata-array-length", "general.huge")


def test_many_long_metadata_arrays_are_refused_before_they_are_read(tmp_path: Path) -> None:
    """Each array under the per-array bound, together three times a vocabulary's: 48 MB of
    FLOAT32 arrays used to take 480 MB of Python objects, so a large file of them took the
    process's memory; the arrays' total is bounded too."""
    count = 3_000_000
    keys = [f"general.long.{index}".encode() for index in range(3)]
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys))
    for key in keys:
        raw += (
            struct.pack("<Q", len(key))
            + key
            + struct.pack(
                "<IIQ", int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT8), count
            )
            + bytes(count)
        )
    path = tmp_path / "long-arrays.gguf"
    path.write_bytes(raw)
    with pytest.raises(GGUFValidationError) as raised:
        read_gguf_header(path)
    assert (raised.value.rule, raised.value.field) == ("metadata-array-length", "general.long.2")


@pytest.mark.parametrize("field", ["metadata count", "tensor count"])
def test_more_keys_or_tensors_than_any_model_has_are_refused_before_they_are_read(
    tmp_path: Path, field: str
) -> None:
    """A million one-byte metadata keys (a 20 MB file) took 217 MB of Python objects to parse:
    the counts are bounded before anything is read."""
    count = (1 << 16) + 1
    n_tensors, n_kv = (0, count) if field == "metadata count" else (count, 0)
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + bytes(32 * count))
    with pytest.raises(GGUFValidationError) as raised:
        read_gguf_header(path)
    assert (raised.value.rule, raised.value.field) == ("gguf-header-counts", field)


def test_splits_into_one_directory_at_once_take_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four ``shard-engine split`` runs into one directory at once all failed: they wrote the
    same ``.partial`` files over each other ("carries no shard.content_sha256", "No such file
    or directory") and removed the directory under each other. Now they take turns: one
    writes, the others reuse its verified shards. (Slowed writes make the overlap certain.)"""
    import threading
    import time

    source = tmp_path / "model.gguf"
    write_tiny_model(source, n_layers=4)
    write_shard = writer_module._write_shard

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(writer_module, "_write_shard", slow_write)
    out = tmp_path / "shards"
    errors: list[BaseException] = []
    manifests: list[Any] = []

    def split() -> None:
        try:
            manifests.append(split_model(source, [(0, 2), (2, 4)], out))
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=split) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(manifests) == 4
    assert sum(not any(manifest.reused) for manifest in manifests) == 1
    for index in range(2):
        assert validate_gguf(manifests[0].shard_path(index)).is_shard


@pytest.mark.parametrize("name", ["manifest.json", "verified-sha256.json"])
def test_a_damaged_manifest_or_hash_cache_costs_a_rewrite_not_the_split(
    tmp_path: Path, name: str
) -> None:
    """Both only save work, in directories a configuration or a command line names: deeply
    nested JSON in either raised RecursionError out of json.loads and failed the split (and
    every engine load writing a shard into that store)."""
    source = tmp_path / "model.gguf"
    write_tiny_model(source, n_layers=4)
    out = tmp_path / "shards"
    out.mkdir()
    (out / name).write_text("[" * 100_000 + "]" * 100_000)
    manifest = split_model(source, [(0, 2), (2, 4)], out, hash_store=out)
    assert not any(manifest.reused)
    assert validate_gguf(manifest.shard_path(1)).is_shard
