"""Header and tensor-table fuzzing: mutate generated models of every family, validate, and load
every file the validator accepts with llama.cpp in a child process.

A child that dies (SIGABRT from a GGML_ASSERT, SIGSEGV) is an abort; a file llama.cpp refuses
to load although the validator accepted it is a miss, and one whose prefill or decode returns
NaN or infinity, or whose decoded row is not the row one prefill of the same positions computes,
is a silent miscomputation. All must stay at zero.

Run directly for a deeper run: ``python tests/gguf_fuzz.py --per-family 200 --seed 1``.
The child mode (``--load``) reads one file path per line from stdin and answers per file.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from gguf_edit import TensorEdit, tensor_offset_position, tensors_of, write_gguf

from shard_engine_llama._gguf import (
    GGUFValidationError,
    MetadataValue,
    model_info,
    read_gguf_header,
    validate_header,
)
from shard_engine_llama._gguf.families import FAMILIES, ROPE_FACTOR_TENSORS, Hyperparameters
from shard_engine_llama._gguf.family_checks import _ARCH_KEYS
from shard_engine_llama._tiny_model import SUPPORTED_TINY_ARCHITECTURES, write_tiny_model

U32 = gguf.GGUFValueType.UINT32
F32 = gguf.GGUFValueType.FLOAT32
_RETYPES = {
    U32: (gguf.GGUFValueType.INT32, gguf.GGUFValueType.UINT64, F32),
    F32: (gguf.GGUFValueType.FLOAT64, U32),
    gguf.GGUFValueType.BOOL: (U32,),
    gguf.GGUFValueType.STRING: (U32,),
}
# Every tensor type the gguf package knows a size for (Q8_1 / Q8_K are activation-only types a
# weight must not have; the integer types and F64 have no matrix kernels).
_TYPES = tuple(t for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES)
# Keys llama.cpp reads that no supported family needs (several abort or fail the load), and
# keys it never reads for the family.
_FOREIGN_ARCH_KEYS: tuple[tuple[str, MetadataValue], ...] = (
    ("nextn_predict_layers", MetadataValue(9, U32)),
    ("nextn_predict_layers", MetadataValue(1, U32)),
    ("attention.key_length_swa", MetadataValue(8, U32)),
    ("rope.dimension_count_swa", MetadataValue(6, U32)),
    ("pooling_type", MetadataValue("mean", gguf.GGUFValueType.STRING)),
    ("embedding_length_out", MetadataValue(7, U32)),
    ("rope.scaling.alpha", MetadataValue(math.nan, F32)),
    # Keys llama.cpp never reads for a supported family: accepted, and they must load.
    ("tensor_data_layout", MetadataValue("Meta AI original pth", gguf.GGUFValueType.STRING)),
    ("expert_gating_func", MetadataValue(7, U32)),
    ("attention.q_lora_rank", MetadataValue(math.nan, F32)),
    ("converter.note", MetadataValue([1, 2], gguf.GGUFValueType.ARRAY, U32)),
)
_GENERAL_EDITS: tuple[tuple[str, MetadataValue], ...] = (
    ("general.alignment", MetadataValue(8, U32)),
    ("general.alignment", MetadataValue(1, U32)),
    ("general.alignment", MetadataValue(64, U32)),
    ("general.alignment", MetadataValue(True, gguf.GGUFValueType.BOOL)),
    ("general.name", MetadataValue(3, U32)),
    ("general.file_type", MetadataValue("f32", gguf.GGUFValueType.STRING)),
    ("tokenizer.ggml.add_space_prefix", MetadataValue(1, U32)),
    ("tokenizer.ggml.token_type_count", MetadataValue("x", gguf.GGUFValueType.STRING)),
    ("tokenizer.ggml.mask_token_id", MetadataValue(2**32 - 1, U32)),
    ("tokenizer.ggml.pre", MetadataValue("bogus", gguf.GGUFValueType.STRING)),
)
_ELEMENT_TYPES = (
    gguf.GGUFValueType.UINT8,
    gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.UINT32,
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.FLOAT64,
    gguf.GGUFValueType.BOOL,
)


def _interesting_ints(value: int) -> list[int]:
    return [0, 1, 2, 3, 7, value - 1, value + 1, 2 * value, value // 2, 2**31, 2**32 - 1]


def _interesting_floats(value: float) -> list[float]:
    return [0.0, -value, -1e-5, math.nan, math.inf, -math.inf, 1e-45, 1e30, 3e38, 1.0, value * 1e6]


@dataclass
class Mutant:
    """One mutated file and what was done to it."""

    family: str
    path: Path
    mutations: list[str] = field(default_factory=list)
    is_shard: bool = False
    # A full model and its shards, head first: the child runs them as a pipeline.
    pipeline: tuple[Path, ...] = ()

    @property
    def job(self) -> str:
        return "\t".join(str(path) for path in self.pipeline) if self.pipeline else str(self.path)


def _mutate_metadata(
    rng: random.Random, arch: str, metadata: dict[str, MetadataValue], log: list[str]
) -> None:
    keys = [
        k
        for k in metadata
        if k.startswith((f"{arch}.", "tokenizer.ggml.")) and k != "tokenizer.ggml.tokens"
    ]
    kind = rng.choice(
        ("value", "value", "value", "retype", "drop", "add", "array", "foreign", "element")
    )
    if kind == "foreign":
        if rng.random() < 0.5:
            suffix, foreign = rng.choice(_FOREIGN_ARCH_KEYS)
            metadata[f"{arch}.{suffix}"] = foreign
            log.append(f"foreign {arch}.{suffix}={foreign.value!r}")
        else:
            key, foreign = rng.choice(_GENERAL_EDITS)
            metadata[key] = foreign
            log.append(f"edit {key}={foreign.value!r} ({foreign.value_type.name})")
        return
    if kind == "element":
        # The same array with another element type (llama.cpp takes only some per key).
        arrays = [k for k, v in metadata.items() if isinstance(v.value, list)]
        key = rng.choice(arrays)
        entry = metadata[key]
        assert isinstance(entry.value, list)
        if entry.element_type == gguf.GGUFValueType.STRING:
            items = list(entry.value)
            if items:
                index = rng.randrange(len(items))
                # An empty token, the name llama.cpp gives an empty one, or a short byte token.
                items[index] = rng.choice(("", f"[EMPTY_{max(index - 1, 0)}]", "<x"))
            metadata[key] = MetadataValue(items, entry.value_type, entry.element_type)
            log.append(f"string element of {key}")
            return
        element = rng.choice(_ELEMENT_TYPES)
        converted_items: list[object] = [
            (
                bool(v)
                if element == gguf.GGUFValueType.BOOL
                else float(v)
                if element in (F32, gguf.GGUFValueType.FLOAT64)
                else int(v) % 256
                if element == gguf.GGUFValueType.UINT8
                else int(v) % 2**31
            )
            for v in entry.value
        ]
        metadata[key] = MetadataValue(converted_items, entry.value_type, element)  # type: ignore[arg-type]
        log.append(f"element {key} {entry.element_type} -> {element.name}")
        return
    if kind == "add":
        suffix = rng.choice(sorted(_ARCH_KEYS))
        key = f"{arch}.{suffix}"
        value_type, _ = _ARCH_KEYS[suffix]
        value: object
        if value_type == U32:
            value = rng.choice(_interesting_ints(4))
        elif value_type == F32:
            value = rng.choice(_interesting_floats(1.0))
        elif value_type == gguf.GGUFValueType.BOOL:
            value = rng.choice((True, False))
        else:
            value = rng.choice(("none", "linear", "yarn", "longrope", "bogus"))
        metadata[key] = MetadataValue(value, value_type)
        log.append(f"add {key}={value!r}")
        return
    if kind == "array":
        arrays = [k for k, v in metadata.items() if isinstance(v.value, list)]
        key = rng.choice(arrays)
        entry = metadata[key]
        assert isinstance(entry.value, list)
        items = list(entry.value)
        action = rng.choice(("truncate", "extend", "duplicate", "poke"))
        if action == "truncate" and items:
            items = items[: rng.randrange(len(items))]
        elif action == "extend" and items:
            items = items + items[-1:]
        elif action == "duplicate" and len(items) > 1:
            items[rng.randrange(1, len(items))] = items[0]
        elif items:
            index = rng.randrange(len(items))
            old = items[index]
            if isinstance(old, bool):
                items[index] = not old
            elif isinstance(old, int):
                items[index] = rng.choice(_interesting_ints(old))
            elif isinstance(old, float):
                items[index] = rng.choice(_interesting_floats(old))
            else:
                items[index] = ""
        metadata[key] = MetadataValue(items, entry.value_type, entry.element_type)
        log.append(f"array {action} {key}")
        return
    key = rng.choice(keys)
    entry = metadata[key]
    if kind == "drop":
        del metadata[key]
        log.append(f"drop {key}")
        return
    if isinstance(entry.value, list):
        return
    if kind == "retype" and entry.value_type in _RETYPES:
        new_type = rng.choice(_RETYPES[entry.value_type])
        raw = entry.value
        if new_type in (gguf.GGUFValueType.FLOAT64, F32):
            converted: object = float(raw) if not isinstance(raw, str) else 1.0
        else:
            converted = (
                int(raw) if isinstance(raw, int | float) and math.isfinite(float(raw)) else 1
            )
            if new_type == gguf.GGUFValueType.INT32:
                converted = max(min(int(converted), 2**31 - 1), -(2**31))
        metadata[key] = MetadataValue(converted, new_type)  # type: ignore[arg-type]
        log.append(f"retype {key} {entry.value_type.name}->{new_type.name}")
        return
    raw = entry.value
    if isinstance(raw, bool):
        new: object = not raw
    elif isinstance(raw, int):
        new = rng.choice(_interesting_ints(raw))
        if entry.value_type == U32:
            new = int(new) % 2**32
    elif isinstance(raw, float):
        new = rng.choice(_interesting_floats(raw))
    else:
        new = rng.choice(("", "none", "gpt2", "llama", "bogus"))
    metadata[key] = MetadataValue(new, entry.value_type)  # type: ignore[arg-type]
    log.append(f"value {key}={new!r}")


def _mutate_tensors(rng: random.Random, tensors: list[TensorEdit], log: list[str]) -> None:
    kind = rng.choice(("drop", "rename", "shape", "shape", "type", "type", "add", "values"))
    index = rng.randrange(len(tensors))
    tensor = tensors[index]
    vectors = [i for i, t in enumerate(tensors) if len(t.shape) == 1]
    if kind == "values" and vectors:
        # A norm, bias, gate or rope factor holding values the arithmetic cannot take (huge
        # finite weights are data, as in any matrix: not checked).
        index = rng.choice(vectors)
        tensor = tensors[index]
        value = rng.choice((0.0, math.nan, math.inf, -1.0, 1e-45))
        data = struct.pack(f"<{tensor.shape[0]}f", *([value] * tensor.shape[0]))
        tensors[index] = TensorEdit(tensor.name, tensor.shape, tensor.ggml_type, data)
        log.append(f"values {tensor.name} = {value}")
    elif kind == "values":
        return
    elif kind == "drop":
        del tensors[index]
        log.append(f"drop tensor {tensor.name}")
    elif kind == "rename":
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            parts[1] = str(int(parts[1]) + rng.choice((1, 7, 100)))
        else:
            parts[0] = parts[0] + "_x"
        tensors[index] = TensorEdit(".".join(parts), tensor.shape, tensor.ggml_type, tensor.data)
        log.append(f"rename {tensor.name} -> {'.'.join(parts)}")
    elif kind == "shape":
        shape = list(tensor.shape)
        action = rng.choice(("plus", "minus", "swap", "double", "dim"))
        axis = rng.randrange(len(shape))
        if action == "plus":
            shape[axis] += 1
        elif action == "minus" and shape[axis] > 1:
            shape[axis] -= 1
        elif action == "swap" and len(shape) > 1:
            shape[0], shape[-1] = shape[-1], shape[0]
        elif action == "double":
            shape[axis] *= 2
        else:
            shape.append(1)
        block = gguf.GGML_QUANT_SIZES[tensor.ggml_type][0]
        if shape[0] % block:
            return
        tensors[index] = TensorEdit(tensor.name, tuple(shape), tensor.ggml_type)
        log.append(f"shape {tensor.name} {list(tensor.shape)} -> {shape}")
    elif kind == "type":
        new_type = rng.choice(_TYPES)
        if tensor.shape[0] % gguf.GGML_QUANT_SIZES[new_type][0]:
            return
        tensors[index] = TensorEdit(tensor.name, tensor.shape, new_type)
        log.append(f"type {tensor.name} {tensor.ggml_type.name} -> {new_type.name}")
    else:
        name = rng.choice(("blk.0.extra.weight", "extra.weight", f"{tensor.name}.copy"))
        tensors.append(TensorEdit(name, tensor.shape, tensor.ggml_type, tensor.data))
        log.append(f"add tensor {name}")


def generate(directory: Path, per_family: int, seed: int) -> Iterator[Mutant]:
    """``per_family`` mutants of a generated model of every family (and llama with experts)."""
    rng = random.Random(seed)
    bases: list[tuple[str, Path]] = []
    for arch in (*SUPPORTED_TINY_ARCHITECTURES, "llama-moe"):
        path = directory / f"base-{arch}.gguf"
        if arch == "llama-moe":
            write_tiny_model(path, arch="llama", n_layers=3, n_expert=4, n_expert_used=2, seed=seed)
        else:
            write_tiny_model(path, arch=arch, n_layers=3, seed=seed)
        bases.append((arch, path))
    for arch, base in bases:
        header = read_gguf_header(base)
        originals = tensors_of(header)
        for index in range(per_family):
            metadata = dict(header.metadata)
            tensors = list(originals)
            log: list[str] = []
            for _ in range(rng.choice((1, 1, 2, 3))):
                if rng.random() < 0.6:
                    _mutate_metadata(rng, header.architecture, metadata, log)
                else:
                    _mutate_tensors(rng, tensors, log)
            target = directory / f"{arch}-{index:04d}.gguf"
            architecture = metadata.get("general.architecture")
            name = architecture.value if architecture is not None else header.architecture
            try:
                write_gguf(target, str(name), metadata, tensors)
            except (ValueError, OverflowError, TypeError, struct.error) as error:
                # The gguf writer itself refuses some values (e.g. negative uint32).
                log.append(f"unwritable: {error}")
                continue
            if rng.random() < 0.25:
                _mutate_bytes(rng, target, log)
            yield Mutant(arch, target, log)


def _consistent_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> TensorEdit:
    """Small finite values (norms 1) so that a NaN out of the forward is the metadata's."""
    if len(shape) == 1:
        values = np.ones(shape) if "norm" in name else rng.uniform(-0.1, 0.1, shape)
    else:
        bound = 1.0 / math.sqrt(shape[0])
        values = rng.uniform(-bound, bound, tuple(reversed(shape)))
    data = values.astype("<f4").tobytes()
    return TensorEdit(name, shape, gguf.GGMLQuantizationType.F32, data)


def generate_consistent(directory: Path, per_family: int, seed: int) -> Iterator[Mutant]:
    """``per_family`` files per family whose hyper-parameters are drawn adversarially (head
    counts, grouped heads, key/value/rope sizes, experts and experts per token, windows and
    their patterns, rope scaling and its factor tensors) and whose tensors have exactly the
    shapes families.py derives from them, so the file gets past the shape checks and the
    hyper-parameters themselves meet llama.cpp."""
    rng = random.Random(seed)
    u32 = gguf.GGUFValueType.UINT32
    for arch in SUPPORTED_TINY_ARCHITECTURES:
        base = directory / f"consistent-base-{arch}.gguf"
        write_tiny_model(base, arch=arch, n_layers=3, seed=seed)
        header = read_gguf_header(base)
        family = FAMILIES[arch]
        for index in range(per_family):
            n_layer = rng.choice((1, 2, 3, 4, 7, 12))
            n_embd = rng.choice((32, 48, 64))
            n_head = rng.choice((1, 2, 3, 4, 8, 16))
            n_head_kv = rng.choice(
                [d for d in range(1, n_head + 1) if n_head % d == 0] + [rng.randint(1, 5)]
            )
            head_k = rng.choice((n_embd // n_head or 1, 8, 16, 6, 2))
            head_v = rng.choice((head_k, head_k, 8))
            n_rot = rng.choice((head_k, head_k, 2, max(2, head_k // 4 * 2)))
            n_ff = rng.choice((32, 8, 2))
            values: dict[str, int] = {
                "block_count": n_layer,
                "embedding_length": n_embd,
                "attention.head_count": n_head,
                "attention.head_count_kv": n_head_kv,
                "attention.key_length": head_k,
                "attention.value_length": head_v,
                "rope.dimension_count": n_rot,
                "feed_forward_length": n_ff,
            }
            n_expert = used = ff_exp = ff_shared = 0
            if family.moe or (arch == "llama" and rng.random() < 0.3):
                n_expert = rng.choice((1, 2, 4, 8, 16))
                used = rng.choice((1, 2, n_expert, min(8, n_expert), rng.randint(1, n_expert)))
                values |= {"expert_count": n_expert, "expert_used_count": used}
                if arch in ("qwen2moe", "qwen3moe"):
                    ff_exp = rng.choice((8, 16))
                    values["expert_feed_forward_length"] = ff_exp
                if arch == "qwen2moe":
                    ff_shared = rng.choice((8, 32))
                    values["expert_shared_feed_forward_length"] = ff_shared
            if family.swa_period:
                values["attention.sliding_window"] = rng.choice((1, 2, 3, 8, 512))
                if rng.random() < 0.5:
                    values["attention.sliding_window_pattern"] = rng.choice((2, 3, 4, 6))
            metadata = dict(header.metadata)
            for suffix, value in values.items():
                metadata[f"{arch}.{suffix}"] = MetadataValue(value, u32)
            log = [f"consistent {values}"]
            scaling = "linear"  # load_hparams' default without the key
            if rng.random() < 0.3:
                scaling = rng.choice(("linear", "yarn", "longrope", "none"))
                factor = rng.choice((0.0, 0.25, 1.0, 4.0, 32.0))
                metadata[f"{arch}.rope.scaling.type"] = MetadataValue(
                    scaling, gguf.GGUFValueType.STRING
                )
                metadata[f"{arch}.rope.scaling.factor"] = MetadataValue(factor, F32)
                log.append(f"rope {scaling} x{factor}")
            hyper = Hyperparameters(
                n_layer=n_layer,
                n_embd=n_embd,
                n_vocab=header.tensors["token_embd.weight"].shape[1],
                n_head=n_head,
                n_head_kv=n_head_kv,
                n_embd_head_k=head_k,
                n_embd_head_v=head_v,
                n_rot=n_rot,
                n_ff=n_ff,
                n_expert=n_expert,
                n_expert_used=used,
                n_ff_exp=ff_exp or (n_ff if n_expert else 0),
                n_ff_shexp=ff_shared,
                rope_scaling_type=scaling,
            )
            needs = list(family.model_tensors(hyper, lambda name: False))
            for il in range(n_layer):
                needs += family.layer_tensors(hyper, il, lambda name: False)
            values_rng = np.random.default_rng(rng.randrange(2**32))
            tensors = [
                _consistent_tensor(values_rng, need.name, need.shape)
                for need in needs
                if need.required and all(size > 0 for size in need.shape)
            ]
            # Rope factors (drawn from values_rng, which leaves the other draws as they were):
            # the set the family's loader asks for with this scaling type, which must load, or
            # the other set, which llama.cpp refuses ("wrong number of tensors") and the
            # validator must refuse first.
            offered = [need for need in needs if need.name in ROPE_FACTOR_TENSORS]
            draw = float(values_rng.random())
            if offered and draw < 0.5:
                names = [need.name for need in offered]
                if draw < 0.15:
                    names = [name for name in ROPE_FACTOR_TENSORS if name not in names]
                size = n_rot // 2
                for name in names:
                    factors = values_rng.uniform(0.5, 2.0, size).astype("<f4").tobytes()
                    tensors.append(
                        TensorEdit(name, (size,), gguf.GGMLQuantizationType.F32, factors)
                    )
                log.append(f"rope factors {names}")
            target = directory / f"consistent-{arch}-{index:04d}.gguf"
            write_gguf(target, arch, metadata, tensors)
            yield Mutant(arch, target, log)


def _mutate_bytes(rng: random.Random, path: Path, log: list[str]) -> None:
    """Damage the written header itself: flipped bits, a poked byte or 8-byte word anywhere
    before the tensor data (lengths, counts, types, offsets), or two tensors' offsets swapped."""
    raw = bytearray(path.read_bytes())
    try:
        header = read_gguf_header(path)
    except GGUFValidationError:
        return
    end = header.data_start
    kind = rng.choice(("flip", "byte", "word", "offsets"))
    if kind == "flip":
        position = rng.randrange(end)
        raw[position] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        position = rng.randrange(end)
        raw[position] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
    elif kind == "word":
        position = rng.randrange(end - 8)
        raw[position : position + 8] = struct.pack("<Q", rng.choice((0, 1, 32, 2**32, 2**63)))
    else:
        if len(header.tensors) < 2:
            return
        first, second = rng.sample(sorted(header.tensors), 2)
        a, b = tensor_offset_position(raw, first), tensor_offset_position(raw, second)
        raw[a : a + 8], raw[b : b + 8] = raw[b : b + 8], raw[a : a + 8]
        position = a
    path.write_bytes(bytes(raw))
    log.append(f"bytes {kind} at {position}")


@dataclass
class FuzzReport:
    generated: int = 0
    accepted: int = 0
    generated_by_family: Counter[str] = field(default_factory=Counter)
    accepted_by_family: Counter[str] = field(default_factory=Counter)
    loaded: int = 0
    shards_loaded: int = 0
    aborts: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    split_differs: list[str] = field(default_factory=list)
    pipelines: int = 0
    refused_by_rule: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, object]:
        return {
            "generated": self.generated,
            "accepted": self.accepted,
            "generated_by_family": dict(sorted(self.generated_by_family.items())),
            "accepted_by_family": dict(sorted(self.accepted_by_family.items())),
            "loaded": self.loaded,
            "shards_loaded": self.shards_loaded,
            "aborts": len(self.aborts),
            "accepted_but_llama_cpp_refused": len(self.missed),
            "accepted_but_not_finite": len(self.nonfinite),
            "decode_not_prefill": len(self.drift),
            "pipelines_equal_to_full": self.pipelines,
            "pipelines_not_equal_to_full": len(self.split_differs),
            "refused_by_rule": dict(self.refused_by_rule.most_common()),
        }


_PROTOCOL = "@@fuzz "


def _load_in_children(paths: Sequence[str]) -> dict[str, str]:
    """Load each file in a child process; a child that dies is restarted after the file.

    Paths are fed one at a time, each after the previous answer: a child that dies leaves no
    unread backlog to break the pipe on, and neither side can block on a full pipe.
    """
    results: dict[str, str] = {}
    pending = list(paths)
    while pending:
        child = subprocess.Popen(
            [sys.executable, __file__, "--load"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            # ggml's abort handler would attach gdb and print a backtrace to stdout.
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        assert child.stdin is not None
        assert child.stdout is not None
        while pending:
            current = pending[0]
            try:
                child.stdin.write(f"{current}\n")
                child.stdin.flush()
            except BrokenPipeError:
                break
            answer = None
            for line in child.stdout:
                if line.startswith(_PROTOCOL):
                    kind, _, rest = line[len(_PROTOCOL) :].rstrip("\n").partition(" ")
                    if kind != "START":
                        answer = f"{kind} {rest}".strip()
                        break
            if answer is None:
                break
            results[current] = answer
            pending.pop(0)
        with contextlib.suppress(BrokenPipeError):
            child.stdin.close()
        child.stdout.close()
        code = child.wait()
        if pending and pending[0] not in results:
            results[pending.pop(0)] = f"ABORT signal/exit {code}"
    return results


def run(directory: Path, per_family: int, seed: int, consistent: int = 0) -> FuzzReport:
    """Fuzz ``per_family`` mutants of every family and ``consistent`` files per family from
    :func:`generate_consistent`."""
    report = FuzzReport()
    accepted: list[Mutant] = []
    mutants = itertools.chain(
        generate(directory, per_family, seed), generate_consistent(directory, consistent, seed)
    )
    for mutant in mutants:
        report.generated += 1
        report.generated_by_family[mutant.family] += 1
        try:
            header = validate_header(read_gguf_header(mutant.path))
        except GGUFValidationError as error:
            report.refused_by_rule[error.rule] += 1
            mutant.path.unlink()  # deep runs write thousands of files
            continue
        report.accepted += 1
        report.accepted_by_family[mutant.family] += 1
        accepted.append(mutant)
        info = model_info(header)
        if info.shardable:
            from shard_engine_llama._gguf import split_model

            n = info.n_layers
            ranges = [(0, 1), (1, 2), (2, n)] if n >= 3 else [(0, 1), (1, n)]
            manifest = split_model(mutant.path, ranges, directory / f"{mutant.path.stem}-shards")
            shards = [manifest.shard_path(index) for index in range(len(manifest.shards))]
            for index, shard in enumerate(shards):
                accepted.append(
                    Mutant(
                        mutant.family, shard, [*mutant.mutations, f"shard {index}"], is_shard=True
                    )
                )
            accepted.append(
                Mutant(
                    mutant.family,
                    mutant.path,
                    [*mutant.mutations, "pipeline"],
                    is_shard=True,
                    pipeline=(mutant.path, *shards),
                )
            )
    results = _load_in_children([mutant.job for mutant in accepted])
    for mutant in accepted:
        outcome = results[mutant.job]
        description = f"{mutant.path.name}: {'; '.join(mutant.mutations)} -> {outcome}"
        if outcome.startswith("ABORT"):
            report.aborts.append(description)
        elif outcome.startswith("NONFINITE"):
            report.nonfinite.append(description)
        elif outcome.startswith("DRIFT"):
            report.drift.append(description)
        elif outcome.startswith("SPLIT"):
            report.split_differs.append(description)
        elif outcome.startswith("OK"):
            if mutant.pipeline:
                report.pipelines += 1
            elif mutant.is_shard:
                report.shards_loaded += 1
            else:
                report.loaded += 1
        else:
            report.missed.append(description)
    return report


def _run_pipeline(paths: Sequence[str], settings: object) -> str:
    """The full model's prefill and decode logits, and the same through its shards (head,
    middle, tail): a split computes exactly what the model does (same settings)."""
    import numpy as np

    from shard_engine_llama._abi import ContextSettings, LlamaRuntimeError, ShardRuntime

    assert isinstance(settings, ContextSettings)
    tokens = [1, 40, 77, 120, 3]
    try:
        with ShardRuntime(paths[0], settings=settings) as full:
            tokens = [t % max(full.n_vocab, 1) for t in tokens]
            expected = [full.run(0, 0, tokens=tokens), full.run(0, 5, tokens=tokens[:1])]
        prefill: np.ndarray | None = None
        decode: np.ndarray | None = None
        for shard in paths[1:]:
            with ShardRuntime(shard, settings=settings) as runtime:
                if prefill is None or decode is None:
                    prefill = runtime.run(0, 0, tokens=tokens)
                    decode = runtime.run(0, 5, tokens=tokens[:1])
                else:
                    prefill = runtime.run(0, 0, embeddings=prefill)
                    decode = runtime.run(0, 5, embeddings=decode)
    except LlamaRuntimeError as error:
        return f"REFUSED {type(error).__name__}: {str(error)[:200]}"
    assert prefill is not None
    assert decode is not None
    delta = max(
        float(np.abs(expected[0] - prefill).max()), float(np.abs(expected[1] - decode).max())
    )
    return "OK" if delta == 0 else f"SPLIT logits differ from the full model's by {delta:.3g}"


def _load_worker() -> int:
    import numpy as np

    from shard_engine_llama._abi import ContextSettings, LlamaRuntimeError, ShardRuntime

    settings = ContextSettings(n_ctx=64, n_seq_max=1, n_threads=1, n_batch=16, n_ubatch=16)
    for line in sys.stdin:
        path = line.strip()
        print(f"{_PROTOCOL}START {path}", flush=True)
        if "\t" in path:
            print(f"{_PROTOCOL}{_run_pipeline(path.split(chr(9)), settings)}", flush=True)
            continue
        try:
            with ShardRuntime(path, settings=settings) as runtime:
                tokens = [t % max(runtime.n_vocab, 1) for t in (1, 40, 77, 120, 3)]
                if runtime.is_head:
                    out = runtime.run(0, 0, tokens=tokens)
                    last = runtime.run(0, len(tokens), tokens=tokens[:1])
                    runtime.seq_rm(0)
                    whole = runtime.run(0, 0, tokens=[*tokens, tokens[0]])
                else:
                    hidden = np.full((5, runtime.n_embd_input), 0.5, dtype=np.float32)
                    hidden[:, ::2] = -0.25  # rows differ from the row mean
                    hidden *= np.arange(1, 6, dtype=np.float32)[:, None]
                    out = runtime.run(0, 0, embeddings=hidden)
                    last = runtime.run(0, 5, embeddings=hidden[:1])
                    runtime.seq_rm(0)
                    whole = runtime.run(0, 0, embeddings=np.concatenate([hidden, hidden[:1]]))
                # Generated weights are small and finite: a NaN or infinity out of them is a
                # hyper-parameter the validator let through that breaks the arithmetic.
                finite = bool(np.isfinite(out).all() and np.isfinite(last).all())
                # A session extends its cached prefix one row at a time: the decoded row must
                # be the one a single prefill of all six computes (up to batch-shape rounding).
                scale = max(1.0, float(np.abs(whole[-1]).max())) if finite else 1.0
                consistent = bool(np.abs(whole[-1] - last[-1]).max() <= 1e-2 * scale)
            outcome = "OK" if finite and consistent else "NONFINITE" if not finite else "DRIFT"
            print(f"{_PROTOCOL}{outcome} {out.shape}", flush=True)
        except LlamaRuntimeError as error:
            print(f"{_PROTOCOL}REFUSED {type(error).__name__}: {str(error)[:200]}", flush=True)
        except Exception as error:  # noqa: BLE001 - reported, the parent decides
            print(f"{_PROTOCOL}ERROR {type(error).__name__}: {str(error)[:200]}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--load", action="store_true", help="child mode: load files from stdin")
    parser.add_argument("--per-family", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--consistent", type=int, default=0, help="files per family with consistent tensors"
    )
    parser.add_argument("--keep", type=Path, help="write the files here and keep them")
    args = parser.parse_args(argv)
    if args.load:
        return _load_worker()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        report = run(args.keep, args.per_family, args.seed, args.consistent)
    else:
        with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as scratch:
            report = run(Path(scratch), args.per_family, args.seed, args.consistent)
    print(json.dumps(report.summary(), indent=2))
    failures = report.aborts + report.missed + report.nonfinite + report.drift
    failures += report.split_differs
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
