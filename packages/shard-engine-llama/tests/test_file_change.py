"""Shard files that change under a running engine, and model stores that cannot be written.

llama.cpp maps the file it loads: a shard rewritten in place (``cp``, ``rsync --inplace``) used
to change a running engine's outputs with no error, and a truncated one killed the process with
SIGBUS at the next forward. The engine now loads a private copy sealed against change
(``LlamaOptions.private_copy``, the default). The engines run in child processes, so a SIGBUS
ends the child and fails the test instead of killing pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shard_engine_api import InvalidRequest, LoadConfig, ShardSpec
from shard_engine_llama import LlamaEngine, _sealed
from shard_engine_llama._fixtures import TINY_MODEL_LAYERS
from shard_engine_llama._gguf import split_model
from shard_engine_llama._gguf.integrity import content_sha256
from shard_engine_llama._tiny_model import write_tiny_model

# Loads the engines, generates, changes the file the named engine loaded, generates again
# (a fresh session: every weight is read again) and prints both results' logits digests.
_CHILD = r"""
import hashlib, json, os, sys
from pathlib import Path
from shard_engine_api import LoadConfig, Pipeline, ShardSpec
from shard_engine_llama import LlamaEngine

model, store, layout, change, private_copy = sys.argv[1:6]
n_layers = int(sys.argv[6])
replacement = Path(sys.argv[7])
ranges = [(0, n_layers)] if layout == "full" else [(0, 2), (2, n_layers)]
engines = []
for start, end in ranges:
    engine = LlamaEngine()
    engine.load(LoadConfig(
        shard=ShardSpec(model=model, n_layers=n_layers, start=start, end=end),
        max_sessions=2, max_context=64,
        options={"n_ubatch": 4, "model_store": store, "private_copy": private_copy == "1"},
    ))
    engines.append(engine)

pipeline = Pipeline(engines)

def run():
    result = pipeline.generate([5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], 4)
    digest = hashlib.sha256()
    for row in result.step_logits:  # each step's logits, as bytes
        digest.update(row)
    digest = digest.hexdigest()
    return digest, list(result.token_ids)

before = run()
# The tail's file: the model itself (full) or the tail's shard in the store.
target = engines[-1].shard_path
size = target.stat().st_size
if change == "rewrite":
    # Another model's file of the same layout written over it in place, as rsync --inplace
    # does: same inode, same size, other weights.
    assert replacement.stat().st_size == size
    with open(target, "r+b") as handle:
        handle.write(replacement.read_bytes())
else:
    os.truncate(target, size // 4)
after = run()
print(json.dumps({"before": before, "after": after}))
for engine in engines:
    engine.close()
"""


def _run_child(model: Path, store: Path, layout: str, change: str, private_copy: bool) -> object:
    """The child's result: the digests and tokens before and after the change, or its exit
    status and stderr when it failed."""
    # The replacement: the same file (model, or tail shard) of a model of another seed.
    other = store.parent / "other" / model.name
    other.parent.mkdir(parents=True, exist_ok=True)
    write_tiny_model(other, n_layers=TINY_MODEL_LAYERS, seed=8, dtype="f32")
    if layout != "full":
        manifest = split_model(
            other, [(2, TINY_MODEL_LAYERS)], other.parent / "shards", partial=True
        )
        other = manifest.shard_path(0)
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(model),
            str(store),
            layout,
            change,
            "1" if private_copy else "0",
            str(TINY_MODEL_LAYERS),
            str(other),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if process.returncode != 0:
        return (process.returncode, process.stderr[-2000:])
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.fixture
def own_model(tiny_model: Path, tmp_path: Path) -> Path:
    """A model of this test's own, free to be damaged."""
    model = tmp_path / "model" / tiny_model.name
    model.parent.mkdir()
    shutil.copyfile(tiny_model, model)
    return model


@pytest.mark.parametrize("change", ["rewrite", "truncate"])
@pytest.mark.parametrize("layout", ["full", "store-shard"])
def test_a_file_changed_under_a_running_engine_changes_nothing(
    own_model: Path, tmp_path: Path, layout: str, change: str
) -> None:
    """The full model file (role full) or the tail's shard in the model store is rewritten in
    place or truncated while the engines are loaded: the next generation's logits are bit for
    bit those before, and the process lives."""
    outcome = _run_child(own_model, tmp_path / "store", layout, change, private_copy=True)
    assert isinstance(outcome, dict), f"the engine's process ended with {outcome}"
    assert outcome["after"] == outcome["before"]


@pytest.mark.parametrize("change", ["rewrite", "truncate"])
def test_a_mapped_file_is_exposed_to_changes(own_model: Path, tmp_path: Path, change: str) -> None:
    """What ``private_copy=False`` (the file mapped, as before) leaves open, so the test above
    proves something: a rewrite changes the outputs without an error, a truncation kills the
    process with SIGBUS."""
    outcome = _run_child(own_model, tmp_path / "store", "full", change, private_copy=False)
    if change == "rewrite":
        assert isinstance(outcome, dict), f"the engine's process ended with {outcome}"
        assert outcome["after"] != outcome["before"]
    else:
        assert isinstance(outcome, tuple)
        assert outcome[0] == -signal.SIGBUS


def test_a_fresh_load_of_the_changed_file_is_refused(own_model: Path, tmp_path: Path) -> None:
    """The engine that loaded before the change keeps its copy; a new load reads the file
    again and refuses it (the digest no longer matches)."""
    manifest = split_model(own_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    tail = manifest.shard_path(1)
    loaded = _load(tail, 2, TINY_MODEL_LAYERS, tmp_path / "store")
    try:
        with open(tail, "r+b") as handle:
            handle.seek(tail.stat().st_size // 2)
            handle.write(b"\x55" * 4096)
        with pytest.raises(InvalidRequest) as refused:
            _load(tail, 2, TINY_MODEL_LAYERS, tmp_path / "store")
        assert refused.value.details["rule"] == "shard-integrity"
    finally:
        loaded.close()


def _load(model: Path, start: int, end: int, store: Path, **options: object) -> LlamaEngine:
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=TINY_MODEL_LAYERS, start=start, end=end),
            max_sessions=2,
            max_context=64,
            options={"n_ubatch": 4, "model_store": str(store), **options},
        )
    )
    return engine


@pytest.mark.parametrize("placeholder_at", [None, 0, 100, 16 * 1024 - 10])
def test_the_copy_hashes_what_it_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placeholder_at: int | None
) -> None:
    """One read fills the copy and gives the digest the integrity check computes (a plain
    sha256, or a shard's content digest with its value read as zeros, also across the
    boundary of two reads), and the sealed copy refuses every change."""
    monkeypatch.setattr(_sealed, "_CHUNK_BYTES", 16 * 1024)
    source = tmp_path / "file"
    data = bytes((i * 7) % 251 for i in range(40 * 1024 + 123))
    source.write_bytes(data)
    copy = _sealed.SealedCopy("test")
    try:
        digest = copy.hash_copying(source, placeholder_at)
        if placeholder_at is None:
            assert digest == hashlib.sha256(data).hexdigest()
        else:
            assert digest == content_sha256(source, placeholder_at)
        path = copy.seal(len(data))
        assert path.read_bytes() == data
        with pytest.raises(PermissionError), open(path, "r+b") as handle:
            handle.write(b"x")
        descriptor = int(path.name)
        with pytest.raises(PermissionError):
            os.ftruncate(descriptor, 10)
        with pytest.raises(PermissionError):
            os.pwrite(descriptor, b"x", 0)
    finally:
        copy.close()


def test_a_copy_of_the_wrong_size_is_not_sealed(tmp_path: Path) -> None:
    source = tmp_path / "file"
    source.write_bytes(b"a" * 1000)
    copy = _sealed.SealedCopy("test")
    try:
        copy.fill(source)
        with pytest.raises(OSError, match="changed while it was being copied"):
            copy.seal(2000)
    finally:
        copy.close()


def test_private_copy_false_maps_the_file(own_model: Path, tmp_path: Path) -> None:
    """The option reaches the load: with it off the engine maps the model file itself."""
    engine = _load(own_model, 0, TINY_MODEL_LAYERS, tmp_path / "store", private_copy=False)
    try:
        maps = Path("/proc/self/maps").read_text()
        assert str(own_model.resolve()) in maps
    finally:
        engine.close()
    engine = _load(own_model, 0, TINY_MODEL_LAYERS, tmp_path / "store")
    try:
        maps = Path("/proc/self/maps").read_text()
        assert str(own_model.resolve()) not in maps
        assert "memfd:shard-engine:" in maps
    finally:
        engine.close()


# ---------------------------------------------------------------------- read-only model stores


def _populate(model: Path, store: Path) -> None:
    """The store with the head shard [0, 2) of ``model`` written and verified by a load."""
    _load(model, 0, 2, store).close()


def test_a_store_that_is_not_writable_serves_its_verified_shards(
    own_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writability decision is ``os.access`` (which a read-only mount answers with no even
    for root, while plain permissions do not stop root): monkeypatched here, so the test runs
    as any user. A shard already in the store loads without the lock file being written or
    created; one that is not there is a typed error naming the store."""
    store = tmp_path / "store"
    _populate(own_model, store)
    (lock,) = store.rglob("*.lock")
    lock.unlink()  # a store copied without its lock files must serve as well
    before = sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*"))
    real_access = os.access

    def no_writes(path: object, mode: int, **kwargs: object) -> bool:
        if mode & os.W_OK and str(path).startswith(str(store)):
            return False
        return real_access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", no_writes)
    engine = _load(own_model, 0, 2, store)
    engine.close()
    assert sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*")) == before
    with pytest.raises(InvalidRequest) as refused:
        _load(own_model, 2, 4, store)
    assert refused.value.details == {"path": str(store), "rule": "model-store-read-only"}
    assert str(store) in str(refused.value)


_READ_ONLY_CHILD = r"""
import json, sys
from shard_engine_api import InvalidRequest, LoadConfig, ShardSpec
from shard_engine_llama import LlamaEngine

model, store, n_layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
outcome = {}
for start, end in ((0, 2), (2, 4)):
    engine = LlamaEngine()
    try:
        engine.load(LoadConfig(
            shard=ShardSpec(model=model, n_layers=n_layers, start=start, end=end),
            max_sessions=2, max_context=64, options={"n_ubatch": 4, "model_store": store},
        ))
        outcome[f"{start}-{end}"] = "loaded"
        engine.close()
    except InvalidRequest as error:
        outcome[f"{start}-{end}"] = error.details.get("rule")
print(json.dumps(outcome))
"""


def test_a_store_on_a_read_only_mount_serves_its_verified_shards(
    own_model: Path, tmp_path: Path
) -> None:
    """The store bind-mounted read-only in a private mount namespace (``unshare -m``; skipped
    where that is not allowed): the shard in it loads, a missing one is refused by name."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    store = tmp_path / "store"
    _populate(own_model, store)
    mounted = tmp_path / "read-only-store"
    mounted.mkdir()
    script = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'
    process = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(store),
            str(mounted),
            sys.executable,
            "-c",
            _READ_ONLY_CHILD,
            str(own_model),
            str(mounted),
            str(TINY_MODEL_LAYERS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if process.returncode != 0 and "mount" in process.stderr.lower():
        pytest.skip(f"no read-only bind mount here: {process.stderr.strip()[-200:]}")
    assert process.returncode == 0, process.stderr[-2000:]
    outcome = json.loads(process.stdout.strip().splitlines()[-1])
    assert outcome == {"0-2": "loaded", "2-4": "model-store-read-only"}
