"""Which file a llama engine loads for a shard, and the proof that it is the right one.

:class:`PinnedFiles` opens each file once and reads it only through its descriptor;
:func:`choose_shard_file` picks the file for a ``LoadConfig`` (a shard file written by
``shard-engine split``, the full model itself, or a shard the engine writes into the model
store, under a lock, reusing a verified one) and checks its range, digest and identity.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shard_engine_api import (
    InvalidRequest,
    LoadConfig,
    ResourceExhausted,
    ShardMismatch,
    ShardSpec,
    UnsupportedFeature,
)
from shard_engine_api.engine import (
    MODEL_STORE_ENV,
    ModelStoreRefused,
    file_sha256,
    model_store,
)
from shard_engine_llama import _memory
from shard_engine_llama._gguf import (
    GGUFHeader,
    GGUFModelInfo,
    GGUFValidationError,
    ShardingRefusedError,
    model_info,
    split_model,
    validate_gguf,
)
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._gguf.integrity import ShardIntegrityError, verify_shard
from shard_engine_llama._gguf.store import FileIdentity, file_identity, hash_cache
from shard_engine_llama._gguf.writer import (
    ShardLayout,
    planned_layout,
    shard_file_name,
    shard_layout,
)
from shard_engine_llama._sealed import SealedCopy

if TYPE_CHECKING:
    from shard_engine_llama._options import LlamaOptions

__all__ = ["PinnedFiles", "ShardChoice", "choose_shard_file"]

_log = logging.getLogger("shard_engine.llama")


class PinnedFiles:
    """Files opened once, then read only through their ``/proc/self/fd`` links.

    Validation, hashing and llama.cpp's own open all go through the link, so they see the one
    file that was opened first: a name renamed over or a symlink swapped (and swapped back)
    between the checks and the load cannot slip another file in. Without procfs the names are
    used as they are (the identity checks still catch a change that persists).
    """

    def __init__(self) -> None:
        self._descriptors: list[int] = []
        self._names: dict[str, str] = {}
        # Each pinned file's identity when it was pinned, before any check read it.
        self._identities: dict[str, FileIdentity] = {}
        # The private copy of the file llama.cpp will load (LlamaOptions.private_copy).
        self.copy: SealedCopy | None = None

    def pin(self, path: Path) -> Path:
        # O_NONBLOCK: a name swapped to a FIFO must not block the open (the reader then refuses
        # anything but a regular file).
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._descriptors.append(descriptor)
        link = Path(f"/proc/self/fd/{descriptor}")
        pinned = link if link.exists() else path
        if pinned == link:
            self._names[str(link)] = str(path)
        with contextlib.suppress(OSError):
            self._identities[str(pinned)] = file_identity(pinned)
        return pinned

    def unchanged_since_pinned(self, pinned: Path, identity: FileIdentity) -> bool:
        """Whether ``identity`` (taken after the checks) is the one ``pinned`` had when it was
        pinned: a file written between the two was checked in no single version."""
        return self._identities.get(str(pinned)) == identity

    def private_copy(self, pinned: Path) -> SealedCopy:
        """A new, empty private copy for ``pinned`` (the file llama.cpp will load), refused
        with ResourceExhausted when the memory it needs is not available."""
        size = os.stat(pinned).st_size
        available = _memory.available_memory()
        if available is not None and size > available:
            raise ResourceExhausted(
                f"a private copy of {self.name(pinned)} needs {size / 2**30:.2f} GiB and "
                f"{available / 2**30:.2f} GiB are available; the option private_copy=false "
                "maps the file instead (shared page cache, but exposed to changes of the file)",
                retryable=False,
                details={"resource": "memory", "bytes": size, "available": available},
            )
        if self.copy is not None:
            self.copy.close()
        self.copy = SealedCopy(f"shard-engine:{self.name(pinned).name}")
        return self.copy

    def name(self, path: Path) -> Path:
        return Path(self._names.get(str(path), str(path)))

    def named(self, text: str) -> str:
        """``text`` with every pinned link replaced by the name it was opened as."""
        for link in sorted(self._names, key=len, reverse=True):
            text = text.replace(link, self._names[link])
        return text

    def close(self) -> None:
        while self._descriptors:
            os.close(self._descriptors.pop())
        if self.copy is not None:
            # A mapping llama.cpp made of the copy keeps it alive.
            self.copy.close()
            self.copy = None

    def open_validated(self, named: Path) -> tuple[Path, GGUFHeader]:
        """Pin the GGUF file ``named`` and validate it through the pin, with its family's
        layout known: what stands between any file and llama.cpp opening it. Raises
        InvalidRequest (not a regular file), GGUFValidationError (see :meth:`refusal`) and
        UnsupportedFeature (a family whose layout is not checked)."""
        if not named.is_file():
            problem = "is not a regular file" if named.exists() else "does not exist"
            raise InvalidRequest(f"model file {named} {problem}")
        source = self.pin(named)
        header = validate_gguf(source)
        if header.architecture not in FAMILIES:
            # Without a known layout the validator cannot keep files llama.cpp aborts on away.
            raise UnsupportedFeature(
                f"architecture-unknown-layout: {header.architecture!r} is not one of the families "
                f"whose layout is checked before llama.cpp opens a file ({sorted(FAMILIES)})",
                details={"rule": "architecture-unknown-layout"},
            )
        return source, header

    def refusal(self, error: GGUFValidationError) -> InvalidRequest:
        """What a validation failure is to the caller: InvalidRequest naming the file as it was
        opened, with the rule and the field in ``details``."""
        details: dict[str, str | int | float | bool | None] = {"rule": error.rule}
        if error.field:
            details["field"] = error.field
        return InvalidRequest(self.named(str(error)), details=details)


@dataclass(frozen=True)
class ShardChoice:
    """What the engine loads: the file (a pinned link, see :class:`PinnedFiles`), the model
    fingerprint and vocabulary size it reports, the given model's parsed header, and how the
    runtime drives the file."""

    path: Path
    fingerprint: str
    vocab_size: int
    header: GGUFHeader
    layout: ShardLayout
    # The file's identity once verified: it must be unchanged after llama.cpp has mapped it.
    identity: FileIdentity = field(default_factory=lambda: FileIdentity("", 0, 0, 0, 0, 0))

    def verified(self, pins: PinnedFiles) -> ShardChoice:
        """This choice with the file's identity now, which must be the one it had when it was
        pinned (before it was validated and hashed)."""
        identity = file_identity(self.path)
        if not pins.unchanged_since_pinned(self.path, identity):
            raise ShardIntegrityError(f"{pins.name(self.path)} changed while it was being checked")
        return replace(self, identity=identity)


def _store_write_error(store: Path, directory: Path, error: OSError) -> InvalidRequest:
    """What a failure to write a shard into the model store is: the store named, with the
    system's reason and the path it failed on."""
    return InvalidRequest(
        f"cannot write the shard into the model store {store}: "
        f"{error.strerror or error} ({error.filename or directory})",
        details={"path": str(store)},
    )


def _store_writable(directory: Path) -> bool:
    """Whether this process may create ``directory``'s lock file and shard files: the nearest
    existing one of ``directory``'s parents is writable (``os.access``, which says no on a
    read-only mount even to root)."""
    for candidate in (directory.parent, *directory.parent.parents):
        if candidate.exists():
            return os.access(candidate, os.W_OK | os.X_OK)
    return False


@contextlib.contextmanager
def _store_lock(store: Path, directory: Path) -> Iterator[bool]:
    """An exclusive ``flock`` on ``<directory>.lock`` (per open file, so threads of one
    process exclude each other too) for as long as the block runs; yields whether the store
    can be written.

    A store this process cannot write (a read-only mount, another user's directory) can
    still serve shards already in it: the lock file is then opened read-only when it exists
    (``flock`` needs no write permission, so writers elsewhere are still excluded) and no
    lock is taken when it does not, and the block must only read.
    """
    lock_path = directory.with_name(directory.name + ".lock")
    writable = _store_writable(directory)
    try:
        if writable:
            directory.parent.mkdir(parents=True, exist_ok=True)
            descriptor: int | None = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        else:
            try:
                descriptor = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                descriptor = None
    except OSError as error:
        raise _store_write_error(store, directory, error) from error
    try:
        if descriptor is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield writable
    finally:
        if descriptor is not None:
            os.close(descriptor)


def _usable_store(explicit: str | None) -> Path | None:
    """The model store for the persistent hash cache, or None when none is usable: a full model
    runs from where it is and needs no store."""
    try:
        return model_store(explicit)
    except ModelStoreRefused:
        return None


def choose_shard_file(config: LoadConfig, options: LlamaOptions, pins: PinnedFiles) -> ShardChoice:
    """The file to load for this shard, what it reports, and how the runtime drives it.

    The given model's header is parsed once here and handed on (a 262k vocabulary takes
    seconds to parse); whole-file digests come from the per-identity hash cache. Every
    file is pinned before it is checked, and the pinned file is what llama.cpp loads (or
    its private copy, ``pins.copy``, filled by the read that hashes it, if one does).
    """
    spec = config.shard
    named = Path(spec.model)
    source, header = pins.open_validated(named)
    info = model_info(header)
    if info.is_shard:
        return _given_shard(config, options, pins, source, header, info)
    if info.n_layers != spec.n_layers:
        raise ShardMismatch(
            f"{named.name} has {info.n_layers} layers; the spec says {spec.n_layers}"
        )
    if spec.role == "full":
        fingerprint = _file_digest(
            source,
            _usable_store(options.model_store),
            pins.private_copy(source) if options.private_copy else None,
        )
        return ShardChoice(
            source, fingerprint, info.vocab_size, header, shard_layout(header)
        ).verified(pins)
    if not info.shardable:
        raise ShardingRefusedError(info.refusal or "not shardable")
    return _store_shard(config, options, pins, source, header, info)


def _given_shard(
    config: LoadConfig,
    options: LlamaOptions,
    pins: PinnedFiles,
    source: Path,
    header: GGUFHeader,
    info: GGUFModelInfo,
) -> ShardChoice:
    """A shard file written by ``shard-engine split``: its range must be the spec's, and its
    bytes what split wrote (then it reports its source's fingerprint and vocabulary)."""
    spec = config.shard
    named = Path(spec.model)
    start = int(header.get_int("shard.start"))
    end = int(header.get_int("shard.end"))
    total = int(header.get_int("shard.n_layers_total"))
    if (start, end, total) != (spec.start, spec.end, spec.n_layers):
        raise ShardMismatch(
            f"{named.name} holds layers [{start}, {end}) of {total}; the spec asks for "
            f"[{spec.start}, {spec.end}) of {spec.n_layers}"
        )
    # The source fingerprint is only reported for bytes proven to be what split wrote.
    verify_shard(
        header,
        store=_usable_store(options.model_store),
        copy=pins.private_copy(source) if options.private_copy else None,
    )
    fingerprint = header.get_str("shard.source_sha256")
    vocab_entry = header.metadata.get("shard.source_vocab_size")
    vocab = int(vocab_entry.value) if vocab_entry is not None else info.vocab_size  # type: ignore[arg-type]
    choice = ShardChoice(source, fingerprint, vocab, header, shard_layout(header))
    return choice.verified(pins)


def _store_shard(
    config: LoadConfig,
    options: LlamaOptions,
    pins: PinnedFiles,
    source: Path,
    header: GGUFHeader,
    info: GGUFModelInfo,
) -> ShardChoice:
    """The shard of a full model in the model store: written there (or reused) under the
    range's lock, pinned, then checked to be this source's range with the bytes its digest
    records."""
    spec = config.shard
    named = Path(spec.model)
    store = model_store(options.model_store)
    digest = _file_digest(source, store)
    # Named by the model and its digest (two models of one name do not share a directory)
    # and written under a lock: engines of several processes or threads that load the same
    # range at once take turns, and all but the first reuse the verified file instead of
    # writing the same ".partial" file over each other. The lock is held until the shard
    # is pinned, so no one rewrites it between the write and the pin.
    directory = (
        store / "shards" / f"{named.stem}-{digest[:16]}" / f"{spec.start:03d}-{spec.end:03d}"
    )
    with _store_lock(store, directory) as writable:
        shard_name, action = _write_or_find_shard(
            named, header, spec, store, digest, directory, writable=writable
        )
        shard = pins.pin(shard_name)
    layout = planned_layout(header, spec.start, spec.end)
    _log.info(
        "shard [%d, %d) of %s: %s %s",
        spec.start,
        spec.end,
        named.name,
        action,
        shard_name.name,
    )
    # The store's shard file (pinned above) is checked again: what llama.cpp opens must be
    # the shard of this source and range, with the bytes its digest records.
    shard_header = validate_gguf(shard)
    verify_shard(
        shard_header,
        store=store,
        copy=pins.private_copy(shard) if options.private_copy else None,
    )
    if (
        shard_header.get_str("shard.source_sha256") != digest
        or shard_header.get_int("shard.start") != spec.start
        or shard_header.get_int("shard.end") != spec.end
    ):
        raise ShardIntegrityError(
            f"{shard_name} is not the shard [{spec.start}, {spec.end}) of {named}"
        )
    return ShardChoice(shard, digest, info.vocab_size, header, layout).verified(pins)


def _write_or_find_shard(
    named: Path,
    header: GGUFHeader,
    spec: ShardSpec,
    store: Path,
    digest: str,
    directory: Path,
    *,
    writable: bool,
) -> tuple[Path, str]:
    """The shard's file in ``directory`` of the store (under its lock) and what was done:
    written or reused by ``split_model`` where the store is writable, else an existing one
    (InvalidRequest when there is none)."""
    if writable:
        try:
            manifest = split_model(
                named,
                [(spec.start, spec.end)],
                directory,
                partial=True,
                header=header,
                hash_store=store,
            )
        except OSError as error:
            raise _store_write_error(store, directory, error) from error
        if manifest.source_sha256 != digest:
            # The name was pointed at another file while the shard was being written.
            raise ShardIntegrityError(f"{named} changed while its shard was being written")
        shard_name = manifest.shard_path(0)
        action = "reused" if manifest.reused and manifest.reused[0] else "wrote"
    else:
        # A read-only store: only a shard already in it can serve, and _store_shard checks
        # it exactly as a reused one (its own digest, source and range).
        shard_name = directory / shard_file_name(
            named.resolve(), spec.start, spec.end, spec.n_layers
        )
        if not shard_name.is_file():
            raise InvalidRequest(
                f"the model store {store} is not writable and holds no shard "
                f"[{spec.start}, {spec.end}) of {named.name} to reuse "
                f"({shard_name.relative_to(store)}): make the store writable, or "
                "choose a writable one (the model_store option or "
                f"{MODEL_STORE_ENV}), or give the engine a shard written by "
                "shard-engine split",
                details={"path": str(store), "rule": "model-store-read-only"},
            )
        action = "reused (read-only store)"
    return shard_name, action


def _file_digest(source: Path, store: Path | None, copy: SealedCopy | None = None) -> str:
    """``source``'s sha256 from the hash cache, checked to be 64 hex digits before it is
    reported as a fingerprint or names a directory of the store (a digest with a "/" or
    ".." in it would put the shard outside the store). ``copy``: when the file is hashed,
    the same read fills it."""
    from shard_engine_llama._gguf.store import is_sha256_hex

    digest = hash_cache().digest(
        source,
        "file",
        file_sha256 if copy is None else (lambda target: copy.hash_copying(target, None)),
        store=store,
    )
    if not is_sha256_hex(digest):
        raise ShardIntegrityError(f"{source}: its digest {digest[:80]!r} is not sha256 hex")
    return digest
