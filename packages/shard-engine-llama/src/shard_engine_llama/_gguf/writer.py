"""Writing shards: the metadata and tensors of one layer range, streamed into its own GGUF.

llama.cpp has no API to run a window of layers, so a shard is a rewritten GGUF file that contains
only its layers (renumbered from 0) and is loaded as an ordinary model. The rules that make a shard
compute exactly what the same layers compute inside the full model:

* ``token_embd.weight`` and ``output_norm.weight`` are required by the loader in every shard;
  ``output.weight`` only matters on the tail. Middle shards carry no vocabulary (tokenizer "none",
  one token, a 1 x n_embd zero embedding).
* llama.cpp keeps only the output rows inside the *last* layer of a graph. A non-tail shard asks
  for no outputs and appends one exact-identity block (zero weights, unit norms), so the residual
  stream after its last real layer (``l_out-<last real>``) still holds every row.
* Per-layer metadata arrays are sliced to the shard; layer-index rules (gemma3 sliding-window
  pattern) are written out explicitly for the full model and then sliced.

Tensors are written with ``gguf.GGUFWriter``, their bytes streamed from the source in chunks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from shard_engine_llama._gguf.families import (
    EMBEDDING_SCALE_HEAD_ONLY,
    FAMILIES,
    GEMMA3_27B_LAYER_COUNT,
)
from shard_engine_llama._gguf.hyperparameters import (
    hyperparameters,
    swa_pattern,
    uses_sliding_window,
)
from shard_engine_llama._gguf.integrity import (
    CONTENT_KEY,
    PLACEHOLDER,
    ShardIntegrityError,
    seal_shard,
    verify_shard_file,
)
from shard_engine_llama._gguf.planning import (
    GGUFModelInfo,
    ShardingRefusedError,
    check_partial_ranges,
    check_ranges,
    model_info,
    role_of,
)
from shard_engine_llama._gguf.reader import (
    GGUFHeader,
    GGUFValidationError,
    MetadataValue,
    TensorRecord,
    layer_index,
)
from shard_engine_llama._gguf.store import file_sha256, hash_cache, read_json_document
from shard_engine_llama._gguf.validation import validate_gguf

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ShardFile",
    "ShardLayout",
    "SplitProgress",
    "planned_layout",
    "shard_file_name",
    "shard_layout",
    "split_model",
]

MANIFEST_NAME = "manifest.json"
# 2: a shard's "sha256" is its content digest (integrity.py), which the file also carries.
MANIFEST_FORMAT = 2
_COPY_CHUNK_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class SplitProgress:
    """Reported while splitting: bytes of the current stage done out of its total."""

    stage: str
    shard_index: int
    n_shards: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class ShardFile:
    """One shard in a manifest; ``sha256`` is its content digest: the sha256 of the file with
    its ``shard.content_sha256`` value read as 64 ASCII zeros (the file carries it too)."""

    start: int
    end: int
    file: str
    sha256: str
    size: int
    role: str
    has_identity_block: bool


@dataclass(frozen=True)
class Manifest:
    """The result of a split: source fingerprint and one entry per shard, in layer order."""

    source_path: str
    source_sha256: str
    source_size: int
    architecture: str
    n_layers: int
    n_embd: int
    vocab_size: int
    shards: tuple[ShardFile, ...]
    directory: Path = field(compare=False)
    reused: tuple[bool, ...] = field(compare=False, default=())

    def shard_path(self, index: int) -> Path:
        return self.directory / self.shards[index].file

    def to_json(self) -> str:
        document = {
            "format": MANIFEST_FORMAT,
            "source": {
                "path": self.source_path,
                "sha256": self.source_sha256,
                "size": self.source_size,
            },
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "n_embd": self.n_embd,
            "vocab_size": self.vocab_size,
            "shards": [
                {
                    "start": s.start,
                    "end": s.end,
                    "file": s.file,
                    "sha256": s.sha256,
                    "size": s.size,
                    "role": s.role,
                    "has_identity_block": s.has_identity_block,
                }
                for s in self.shards
            ],
        }
        return json.dumps(document, indent=2, sort_keys=True) + "\n"


ProgressCallback = Callable[[SplitProgress], None]


@dataclass(frozen=True)
class ShardLayout:
    """How a runtime drives a file: token or hidden-state input, logits or hidden-state output,
    and the file-local block whose output (``l_out-<i>``) a non-tail shard returns."""

    is_head: bool
    is_tail: bool
    last_layer_index: int


def has_identity_block(role: str) -> bool:
    """Non-tail shards end in an identity block (see the module docstring)."""
    return role in ("head", "middle")


def planned_layout(source: GGUFHeader, start: int, end: int) -> ShardLayout:
    """The layout of the shard :func:`split_model` writes for ``[start, end)`` of ``source``."""
    role = role_of(start, end, source.get_int(f"{source.architecture}.block_count"))
    return ShardLayout(
        is_head=role in ("head", "full"),
        is_tail=role in ("tail", "full"),
        last_layer_index=leading_identity_blocks(source, start) + end - start - 1,
    )


def shard_layout(header: GGUFHeader) -> ShardLayout:
    """The layout a file's ``shard.*`` keys describe (a file without them is a full model)."""
    n_blocks = header.get_int(f"{header.architecture}.block_count")
    role_entry = header.metadata.get("shard.role")
    role = role_entry.value if role_entry is not None else "full"
    identity_entry = header.metadata.get("shard.has_identity_block")
    identity = bool(identity_entry.value) if identity_entry is not None else False
    return ShardLayout(
        is_head=role in ("head", "full"),
        is_tail=role in ("tail", "full"),
        last_layer_index=n_blocks - (2 if identity else 1),
    )


@dataclass(frozen=True)
class _TensorPlan:
    """A tensor of a shard: copied from the source, or synthesised (zeros / ones)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    n_bytes: int
    source: TensorRecord | None = None
    fill: str = "zeros"


def leading_identity_blocks(header: GGUFHeader, start: int) -> int:
    """Identity blocks a shard starting at ``start`` needs in front of its layers so that each
    real layer keeps its index modulo the family's no-RoPE step (rule no-rope-step-padding)."""
    family = FAMILIES.get(header.architecture)
    step = family.no_rope_step if family is not None else 0
    return start % step if step else 0


def _shard_metadata(
    header: GGUFHeader,
    start: int,
    end: int,
    source_sha256: str,
    with_identity_block: bool,
) -> dict[str, MetadataValue]:
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    role = role_of(start, end, n_layers)
    padding = leading_identity_blocks(header, start)
    n_blocks = padding + end - start + (1 if with_identity_block else 0)
    u32 = gguf.GGUFValueType.UINT32
    # The shard keys come first: the content digest is then found within the first KiB
    # without parsing the (possibly large) vocabulary behind it.
    result: dict[str, MetadataValue] = {
        CONTENT_KEY: MetadataValue(PLACEHOLDER, gguf.GGUFValueType.STRING),
        "shard.start": MetadataValue(start, u32),
        "shard.end": MetadataValue(end, u32),
        "shard.n_layers_total": MetadataValue(n_layers, u32),
        "shard.role": MetadataValue(role, gguf.GGUFValueType.STRING),
        "shard.has_identity_block": MetadataValue(with_identity_block, gguf.GGUFValueType.BOOL),
        "shard.source_sha256": MetadataValue(source_sha256, gguf.GGUFValueType.STRING),
        "shard.leading_identity_blocks": MetadataValue(padding, u32),
    }
    for key, entry in header.metadata.items():
        if key == "general.architecture":
            continue
        if key.startswith("tokenizer.") and role != "full":
            # No partial shard tokenizes (token ids arrive encoded, the tail returns logits), so
            # none carries the vocabulary: llama.cpp would build its token tables from it.
            continue
        value = entry
        if (
            key.startswith(f"{arch}.")
            and isinstance(entry.value, list)
            and len(entry.value) == n_layers
        ):
            # Per-layer hyper-parameters (head counts, ff sizes, window patterns): slice, and give
            # the identity block the last real layer's value so its tensor shapes match.
            sliced = [entry.value[start]] * padding + list(entry.value[start:end])
            if with_identity_block:
                sliced.append(entry.value[end - 1])
            value = MetadataValue(sliced, entry.value_type, entry.element_type)
        result[key] = value
    result[f"{arch}.block_count"] = MetadataValue(n_blocks, u32)
    # Rule middle-no-vocabulary, and for head and tail shards a vocabulary of vocab_size
    # nameless tokens: the token embedding and lm-head keep their shapes.
    if role != "full":
        n_vocab = header.tensors["token_embd.weight"].shape[1]
        result["tokenizer.ggml.model"] = MetadataValue("none", gguf.GGUFValueType.STRING)
        result[f"{arch}.vocab_size"] = MetadataValue(1 if role == "middle" else n_vocab, u32)
    family = FAMILIES[arch]
    if uses_sliding_window(header):
        # Rule swa-pattern-explicit: without the explicit array a shard would apply the default
        # pattern to its own renumbered layers.
        full_pattern = swa_pattern(header, n_layers, family.swa_period)
        # llama.cpp asserts a sliding-window model has a local layer; identity blocks never run
        # attention that matters, so they can always be local.
        pattern = [True] * padding + full_pattern[start:end]
        if with_identity_block:
            pattern.append(True)
        result[f"{arch}.attention.sliding_window_pattern"] = MetadataValue(
            [bool(item) for item in pattern], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL
        )
        if not any(pattern):
            result[f"{arch}.attention.sliding_window"] = MetadataValue(0, u32)
    if EMBEDDING_SCALE_HEAD_ONLY in family.rules and role in ("middle", "tail"):
        # 0 disables the multiplier llama.cpp would also apply to hidden-state input.
        result[f"{arch}.embedding_scale"] = MetadataValue(0.0, gguf.GGUFValueType.FLOAT32)
    if arch == "gemma3" and (
        (n_layers == GEMMA3_27B_LAYER_COUNT) != (n_blocks == GEMMA3_27B_LAYER_COUNT)
    ):
        raise ShardingRefusedError(
            f"gemma3-layer-count-attention-scale: a gemma3 shard with {n_blocks} blocks of a "
            f"{n_layers}-layer model would switch llama.cpp's layer-count-based attention scale"
        )
    result["general.name"] = MetadataValue(
        f"{_metadata_name(header)} layers [{start}, {end}) of {n_layers}", gguf.GGUFValueType.STRING
    )
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and isinstance(tokens.value, list):
        # Middle shards drop the vocabulary; the model's vocabulary size is still its contract.
        result["shard.source_vocab_size"] = MetadataValue(len(tokens.value), u32)
    return result


def _metadata_name(header: GGUFHeader) -> str:
    entry = header.metadata.get("general.name")
    return entry.value if entry is not None and isinstance(entry.value, str) else header.path.stem


def _shard_tensors(
    header: GGUFHeader, start: int, end: int, with_identity_block: bool
) -> list[_TensorPlan]:
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    n_embd = header.get_int(f"{arch}.embedding_length")
    role = role_of(start, end, n_layers)
    has_output = "output.weight" in header.tensors
    plans: list[_TensorPlan] = []
    for record in header.tensors.values():
        index = layer_index(record.name)
        if index is not None:
            continue
        if record.name == "output.weight" and role == "tail" and not _output_required(header):
            continue  # moved into token_embd.weight above
        if record.name == "output.weight" and role not in ("tail", "full"):
            if _output_required(header):
                # This family's loader insists on an lm-head; a non-tail shard never runs it,
                # so zeros of the shard's vocabulary width (a sparse hole) stand in.
                n_vocab = 1 if role == "middle" else record.shape[1]
                shape = (record.shape[0], n_vocab)
                n_bytes = record.n_bytes // record.shape[1] * n_vocab
                plans.append(_TensorPlan(record.name, shape, record.ggml_type, n_bytes))
            continue
        if record.name == "token_embd.weight":
            if role == "middle":
                # The loader insists on a token embedding; one zero row of the vocabulary-less
                # middle shard costs nothing.
                plans.append(
                    _TensorPlan(record.name, (n_embd, 1), gguf.GGMLQuantizationType.F32, n_embd * 4)
                )
                continue
            if role == "tail" and has_output:
                output = header.tensors["output.weight"]
                if not _output_required(header):
                    # Rule tail-lm-head-as-embedding: the tail never looks tokens up (its
                    # input is hidden states), so the lm-head's bytes take the embedding's
                    # place and output.weight is left out; the loader then uses token_embd as
                    # the lm-head (TENSOR_DUPLICATED): one vocabulary-sized matrix, not two.
                    plans.append(
                        _TensorPlan(
                            record.name,
                            output.shape,
                            output.ggml_type,
                            output.n_bytes,
                            source=output,
                        )
                    )
                    continue
                # This family needs both: the unused embedding becomes a sparse zero hole.
                plans.append(
                    _TensorPlan(record.name, record.shape, record.ggml_type, record.n_bytes)
                )
                continue
        plans.append(
            _TensorPlan(record.name, record.shape, record.ggml_type, record.n_bytes, source=record)
        )
    padding = leading_identity_blocks(header, start)
    for block in range(padding):
        plans += _identity_block(header, start, block)
    for il in range(start, end):
        prefix = f"blk.{il}."
        for record in header.tensors.values():
            if record.name.startswith(prefix):
                new_name = f"blk.{padding + il - start}.{record.name[len(prefix) :]}"
                plans.append(
                    _TensorPlan(
                        new_name, record.shape, record.ggml_type, record.n_bytes, source=record
                    )
                )
    if with_identity_block:
        plans += _identity_block(header, end - 1, padding + end - start)
    return plans


def _output_required(header: GGUFHeader) -> bool:
    family = FAMILIES[header.architecture]
    needs = family.model_tensors(hyperparameters(header, family), lambda name: True)
    return any(need.name == "output.weight" and need.required for need in needs)


def _identity_block(header: GGUFHeader, like: int, index: int) -> list[_TensorPlan]:
    """Block ``index`` shaped like source block ``like``, computing x + 0 exactly: unit norms
    and all-zero weights (experts and router included), so attention and feed-forward add 0."""
    prefix = f"blk.{like}."
    plans: list[_TensorPlan] = []
    for record in header.tensors.values():
        if not record.name.startswith(prefix):
            continue
        suffix = record.name[len(prefix) :]
        new_name = f"blk.{index}.{suffix}"
        if "norm" in suffix:
            plans.append(
                _TensorPlan(
                    new_name,
                    record.shape,
                    gguf.GGMLQuantizationType.F32,
                    math.prod(record.shape) * 4,
                    fill="ones",
                )
            )
        else:
            # All-zero bytes decode to 0 in every ggml type (zero scales, zero quants).
            plans.append(_TensorPlan(new_name, record.shape, record.ggml_type, record.n_bytes))
    return plans


def _write_shard(
    header: GGUFHeader,
    metadata: dict[str, MetadataValue],
    tensors: list[_TensorPlan],
    destination: Path,
    report: Callable[[int], None],
) -> str:
    """Write the shard, seal it with its content digest (integrity.py), return the digest."""
    partial = destination.with_name(destination.name + ".partial")
    try:
        return _write_sealed(header, metadata, tensors, destination, partial, report)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _write_sealed(
    header: GGUFHeader,
    metadata: dict[str, MetadataValue],
    tensors: list[_TensorPlan],
    destination: Path,
    partial: Path,
    report: Callable[[int], None],
) -> str:
    writer = gguf.GGUFWriter(partial, header.architecture, use_temp_file=False)
    try:
        writer.data_alignment = header.alignment
        for key, entry in metadata.items():
            writer.add_key_value(key, entry.value, entry.value_type, entry.element_type)
        for plan in tensors:
            # ggml order -> numpy order; raw_dtype with a non-uint8 numpy dtype keeps the
            # shape as is.
            writer.add_tensor_info(
                plan.name,
                tuple(reversed(plan.shape)),
                np.dtype(np.float32),
                plan.n_bytes,
                raw_dtype=plan.ggml_type,
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        output = writer.fout[0]
        writer.write_padding(output, output.tell())
        done = 0
        with open(header.path, "rb") as source:
            for plan in tensors:
                if plan.source is not None:
                    source.seek(plan.source.offset)
                    remaining = plan.n_bytes
                    while remaining:
                        chunk = source.read(min(remaining, _COPY_CHUNK_BYTES))
                        if not chunk:
                            raise GGUFValidationError(
                                f"{header.path}: file shrank while being split"
                            )
                        output.write(chunk)
                        remaining -= len(chunk)
                elif plan.fill == "ones":
                    output.write(np.ones(math.prod(plan.shape), dtype="<f4").tobytes())
                else:
                    output.seek(plan.n_bytes, os.SEEK_CUR)
                writer.write_padding(output, plan.n_bytes)
                done += plan.n_bytes
                report(done)
        # A trailing hole from seek() only becomes part of the file once the size is set.
        output.truncate()
        output.flush()
        os.fsync(output.fileno())
    finally:
        # Closed on failure too (the caller removes the partial file).
        writer.close()
    digest = seal_shard(partial)
    os.replace(partial, destination)
    return digest


def shard_file_name(source: Path, start: int, end: int, n_layers: int) -> str:
    return f"{source.stem}.layers-{start:03d}-{end:03d}-of-{n_layers:03d}.gguf"


def _load_manifest(path: Path) -> dict[str, object] | None:
    document = read_json_document(path)
    return document if isinstance(document, dict) else None


def _reusable_shards(
    document: dict[str, object] | None, source_sha256: str
) -> dict[tuple[int, int], dict[str, object]]:
    if document is None or document.get("format") != MANIFEST_FORMAT:
        return {}
    source = document.get("source")
    if not isinstance(source, dict) or source.get("sha256") != source_sha256:
        return {}
    shards = document.get("shards")
    if not isinstance(shards, list):
        return {}
    result: dict[tuple[int, int], dict[str, object]] = {}
    for entry in shards:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("start"), int)
            and isinstance(entry.get("end"), int)
        ):
            result[(int(entry["start"]), int(entry["end"]))] = entry
    return result


def split_model(
    source: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]],
    out_dir: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    *,
    partial: bool = False,
    header: GGUFHeader | None = None,
    hash_store: Path | None = None,
) -> Manifest:
    """Write one GGUF per layer range into ``out_dir`` plus ``manifest.json``; return the manifest.

    The ranges must cover every layer contiguously unless ``partial`` (an engine building only
    its own shard): then they need only be ordered, non-empty and within the model. Shards
    already present whose sha256 matches the previous manifest for the same source are reused,
    not rewritten. Raises GGUFValidationError for a bad source, ShardingRefusedError when the
    architecture or a range is not shard-safe, ValueError for malformed ranges.

    ``header`` is the source's already validated header (a caller that parsed it passes it on:
    on a 262k-token vocabulary parsing is the expensive part). Whole-file digests go through the
    process's hash cache (persisted in ``hash_store`` when given), so an unchanged source is
    hashed once, not on every load.
    """
    source_path = Path(source).resolve()
    directory = Path(out_dir)
    if header is None:
        header = validate_gguf(source_path)
    info = model_info(header)
    if info.refusal is not None:
        raise ShardingRefusedError(info.refusal)
    if partial:
        check_partial_ranges(ranges, info.n_layers)
    else:
        check_ranges(ranges, info.n_layers)
    outputs = [
        directory / shard_file_name(source_path, start, end, info.n_layers) for start, end in ranges
    ]
    for output in [*outputs, directory / MANIFEST_NAME]:
        if output.exists() and os.path.samefile(output, source_path):
            raise ValueError(f"{output} is the source model itself; choose another directory")
    # Only once the arguments are known to be good: a refused split leaves nothing behind.
    with _locked_directory(directory) as created:
        written: list[Path] = []
        try:
            return _split_into(
                header, info, source_path, ranges, directory, hash_store, progress, written
            )
        except BaseException:
            # No partial output: the shards this call wrote go again, and a directory it made.
            for path in written:
                path.unlink(missing_ok=True)
            (directory / (MANIFEST_NAME + ".partial")).unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise


@contextlib.contextmanager
def _locked_directory(directory: Path) -> Iterator[bool]:
    """``directory``, made if missing (yields whether this call made it), under an exclusive
    ``flock`` of the directory itself while a split writes into it.

    Splits into one directory at once (two ``shard-engine split`` runs, or threads) used to
    write the same ``.partial`` files over each other, seal each other's half-written files
    and remove the directory under each other: every one of them failed. Now they take
    turns, and all but the first reuse the verified shards. A split that fails removes a
    directory it made; one that was waiting for it then finds the name gone or pointing
    elsewhere, and starts over.
    """
    while True:
        try:
            directory.mkdir(parents=True)
            created = True
        except FileExistsError:
            created = False
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            try:
                current = os.stat(directory)
            except FileNotFoundError:
                continue
            if os.path.samestat(os.fstat(descriptor), current):
                yield created
                return
        finally:
            os.close(descriptor)


def _split_into(
    header: GGUFHeader,
    info: GGUFModelInfo,
    source_path: Path,
    ranges: Sequence[tuple[int, int]],
    directory: Path,
    hash_store: Path | None,
    progress: Callable[[SplitProgress], None] | None,
    written: list[Path],
) -> Manifest:
    """split_model's work once its arguments are checked; every file it writes is appended to
    ``written`` before it is written."""
    n_shards = len(ranges)

    def notify(stage: str, index: int, done: int, total: int) -> None:
        if progress is not None:
            progress(SplitProgress(stage, index, n_shards, done, total))

    notify("fingerprint", -1, 0, header.file_size)
    source_sha256 = hash_cache().digest(source_path, "file", file_sha256, store=hash_store)
    notify("fingerprint", -1, header.file_size, header.file_size)
    previous = _reusable_shards(_load_manifest(directory / MANIFEST_NAME), source_sha256)

    shard_files: list[ShardFile] = []
    reused: list[bool] = []
    for index, (start, end) in enumerate(ranges):
        role = role_of(start, end, info.n_layers)
        with_identity_block = has_identity_block(role)
        name = shard_file_name(source_path, start, end, info.n_layers)
        destination = directory / name
        metadata = _shard_metadata(header, start, end, source_sha256, with_identity_block)
        earlier = previous.get((start, end))
        if earlier is not None and earlier.get("file") == name and destination.is_file():
            try:
                existing_sha256: str | None = verify_shard_file(destination, store=hash_store)
            except ShardIntegrityError:
                existing_sha256 = None
            if existing_sha256 is not None and existing_sha256 == earlier.get("sha256"):
                size = destination.stat().st_size
                shard_files.append(
                    ShardFile(start, end, name, existing_sha256, size, role, with_identity_block)
                )
                reused.append(True)
                notify("reused", index, size, size)
                continue
        tensors = _shard_tensors(header, start, end, with_identity_block)
        total = sum(plan.n_bytes for plan in tensors)

        def report(done: int, index: int = index, total: int = total) -> None:
            notify("write", index, done, total)

        written.append(destination)
        digest = _write_shard(header, metadata, tensors, destination, report)
        shard_files.append(
            ShardFile(
                start,
                end,
                name,
                digest,
                destination.stat().st_size,
                role,
                with_identity_block,
            )
        )
        reused.append(False)

    manifest = Manifest(
        source_path=str(source_path),
        source_sha256=source_sha256,
        source_size=header.file_size,
        architecture=info.architecture,
        n_layers=info.n_layers,
        n_embd=info.n_embd,
        vocab_size=info.vocab_size,
        shards=tuple(shard_files),
        directory=directory,
        reused=tuple(reused),
    )
    staging = directory / (MANIFEST_NAME + ".partial")
    staging.write_text(manifest.to_json())
    os.replace(staging, directory / MANIFEST_NAME)
    return manifest
