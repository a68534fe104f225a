"""``shard-engine split`` and ``shard-engine inspect``: the llama plugin's CLI commands."""

from __future__ import annotations

import argparse
import sys

from shard_engine_api.engine import ModelStoreRefused, model_store
from shard_engine_llama._gguf import (
    GGUFValidationError,
    ShardingRefusedError,
    SplitProgress,
    inspect_gguf,
    parts_by_bytes,
    split_model,
)
from shard_engine_llama._gguf.validation import describe_bytes

__all__ = ["add_commands"]


def _parse_ranges(text: str) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        start, _, end = part.partition(":")
        try:
            ranges.append((int(start), int(end)))
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"bad range {part!r}; use START:END,...") from error
    return ranges


def _progress(event: SplitProgress) -> None:
    """A progress bar redrawn in place: only on a terminal (in a redirected log each redraw
    would be one more carriage-return line)."""
    if event.bytes_total <= 0 or not sys.stderr.isatty():
        return
    width = 30
    filled = int(width * event.bytes_done / event.bytes_total)
    label = event.stage if event.shard_index < 0 else f"{event.stage} shard {event.shard_index + 1}"
    sys.stderr.write(
        f"\r{label:<16} [{'#' * filled}{'.' * (width - filled)}] "
        f"{event.bytes_done / 2**20:8.1f}/{event.bytes_total / 2**20:.1f} MiB"
    )
    if event.bytes_done >= event.bytes_total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _command_inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_gguf(args.model)
    except GGUFValidationError as error:
        # A file llama.cpp would refuse or abort on: say which rule, and that it is not shardable.
        print(f"shard-engine inspect: error: invalid GGUF: {error}", file=sys.stderr)
        field = f" (field {error.field})" if error.field else ""
        print(f"shardable:     no — refused by rule: {error.rule}{field}")
        return 2
    print(f"file:          {info.path}")
    print(f"architecture:  {info.architecture}")
    print(f"layers:        {info.n_layers}   n_embd: {info.n_embd}   vocab: {info.vocab_size}")
    print(f"size:          {info.file_size:,} bytes ({info.non_layer_bytes:,} outside layers)")
    print(f"is a shard:    {'yes' if info.is_shard else 'no'}")
    if info.shardable:
        print("shardable:     yes")
        print(f"shard rules:   {', '.join(info.rules)}")
    else:
        print(f"shardable:     no — refused by rule: {info.refusal}")
    if info.unspellable:
        print(
            f"tokenizer:     no token for {len(info.unspellable)} byte(s) "
            f"({describe_bytes(info.unspellable)}): text containing one is refused"
        )
    print("bytes per layer:")
    for index, size in enumerate(info.layer_bytes):
        print(f"  blk.{index:<4} {size:>14,}")
    return 0


def _command_split(args: argparse.Namespace) -> int:
    try:
        info = inspect_gguf(args.model)
        ranges = args.shards if args.shards else parts_by_bytes(info, args.parts)
        # An explicit --out is a model-store directory too: refused under /home like the default.
        out = model_store(args.out) if args.out else model_store() / "shards" / info.path.stem
        manifest = split_model(args.model, ranges, out, None if args.quiet else _progress)
    except (GGUFValidationError, ModelStoreRefused, ValueError) as error:
        kind = "refused" if isinstance(error, ShardingRefusedError) else "error"
        print(f"shard-engine split: {kind}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # An output directory that cannot be made or written (the split removed what it wrote).
        where = error.filename if error.filename is not None else args.out
        print(
            f"shard-engine split: error: cannot write the shards ({where}): "
            f"{error.strerror or error}",
            file=sys.stderr,
        )
        return 2
    print(f"source  {manifest.source_path}  sha256 {manifest.source_sha256}")
    for index, shard in enumerate(manifest.shards):
        state = "reused" if manifest.reused and manifest.reused[index] else "written"
        print(
            f"[{shard.start:>3}, {shard.end:>3})  {shard.role:<6}  {shard.size:>14,} bytes  "
            f"{state:<7}  {manifest.shard_path(index)}  sha256 {shard.sha256}"
        )
    print(f"manifest {manifest.directory / 'manifest.json'}")
    return 0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``split`` and ``inspect``."""
    inspect = subparsers.add_parser("inspect", help="describe a GGUF model and its shardability")
    inspect.add_argument("model", help="path of a GGUF file (a full model or a shard)")
    inspect.set_defaults(func=_command_inspect)

    split = subparsers.add_parser("split", help="write shard GGUF files and a manifest")
    split.add_argument("model", help="path of the full GGUF model to split")
    group = split.add_mutually_exclusive_group(required=True)
    group.add_argument("--shards", type=_parse_ranges, help="layer ranges, e.g. 0:6,6:12,12:18")
    group.add_argument("--parts", type=int, help="N shards balanced by layer bytes")
    split.add_argument("--out", help="output directory (default: the model store)")
    split.add_argument(
        "--quiet", action="store_true", help="no progress bar (drawn only on a terminal anyway)"
    )
    split.set_defaults(func=_command_split)
