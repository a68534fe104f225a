"""The model store resolver and the file-hash helper."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

import pytest

from shard_engine_api import InvalidRequest
from shard_engine_api._store import default_model_store
from shard_engine_api.engine import (
    ModelStoreRefused,
    file_sha256,
    model_store,
    portable_path,
    portable_text,
)


def test_explicit_then_environment_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(tmp_path / "env"))
    assert model_store() == (tmp_path / "env").resolve()
    assert model_store(tmp_path / "explicit") == (tmp_path / "explicit").resolve()
    assert not (tmp_path / "env").exists(), "resolving a chosen store must create nothing"
    monkeypatch.delenv("SHARD_ENGINE_MODEL_STORE")
    (tmp_path / "t").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    assert model_store() == (tmp_path / "t" / f"shard-engine-{os.getuid()}").resolve()


def test_the_default_store_is_private_and_outside_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A user whose home is under /home gets a working default: shard-engine-<uid> in the
    temporary area, created 0700, its path logged (what -v shows)."""
    monkeypatch.delenv("SHARD_ENGINE_MODEL_STORE", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    expected = tmp_path.resolve() / f"shard-engine-{os.getuid()}"
    assert default_model_store() == expected
    assert not expected.exists(), "naming the default creates nothing"
    with caplog.at_level(logging.INFO, logger="shard_engine.store"):
        assert model_store() == expected
    assert stat.S_IMODE(expected.stat().st_mode) == 0o700
    assert f"model store {expected} (from the default" in caplog.text
    assert model_store() == expected, "an existing private store is used again"
    # A command passing on the store it was given keeps the default's checks and source.
    assert model_store(str(expected)) == expected


def test_the_default_store_is_refused_when_another_could_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a shared temporary area, a default store that is open to others, a link or a file
    is refused (someone else may have made it first), naming the path and the default."""
    monkeypatch.delenv("SHARD_ENGINE_MODEL_STORE", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    store = tmp_path / f"shard-engine-{os.getuid()}"
    store.mkdir(mode=0o700)
    store.chmod(0o755)
    with pytest.raises(ModelStoreRefused, match="is open to other users") as raised:
        model_store()
    assert str(store) in raised.value.message
    assert "(from the default: shard-engine-" in raised.value.message
    assert "in $TMPDIR" in raised.value.message
    assert "SHARD_ENGINE_MODEL_STORE" in raised.value.message
    store.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    store.symlink_to(tmp_path / "elsewhere")
    for explicit in (None, str(store)):  # also when passed on as the store it was given
        with pytest.raises(ModelStoreRefused, match="is not a directory"):
            model_store(explicit)
    store.unlink()
    store.write_bytes(b"")
    with pytest.raises(ModelStoreRefused, match="is not a directory"):
        model_store()


@pytest.mark.parametrize("where", ["argument", "environment", "default"])
def test_home_is_refused_wherever_the_path_comes_from(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARD_ENGINE_MODEL_STORE", raising=False)
    if where == "environment":
        monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", "/home/someone/models")
    if where == "default":
        monkeypatch.setenv("TMPDIR", "/home/someone/tmp")
    explicit = "/home/someone/models" if where == "argument" else None
    with pytest.raises(ModelStoreRefused, match="under /home") as raised:
        model_store(explicit)
    assert raised.value.code == "model_store_refused"
    assert not raised.value.retryable
    source = {
        "argument": "(from an explicit path)",
        "environment": "(from SHARD_ENGINE_MODEL_STORE)",
        "default": "(from the default: shard-engine-",
    }[where]
    assert source in raised.value.message
    assert source.removeprefix("(from ").removesuffix(")") in str(raised.value.details["source"])


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("argument", "a\x00b"),
        ("argument", "~no-such-user-of-this-machine/models"),
        # (an environment variable cannot hold a NUL byte)
        ("environment", "~no-such-user-of-this-machine/models"),
    ],
)
def test_a_store_path_that_cannot_be_resolved_is_invalid(
    where: str, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "environment":
        monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", text)
    explicit = text if where == "argument" else None
    with pytest.raises(InvalidRequest, match="is not a usable directory path") as raised:
        model_store(explicit)
    assert raised.value.details["source"] == (
        "an explicit path" if where == "argument" else "SHARD_ENGINE_MODEL_STORE"
    )


@pytest.mark.parametrize("explicit", [5, b"/tmp/models", ["/tmp"], 1.5])
def test_a_store_that_is_not_a_path_is_invalid(explicit: object) -> None:
    with pytest.raises(InvalidRequest, match="must be a directory path"):
        model_store(explicit)  # type: ignore[arg-type]


def test_file_sha256_streams_the_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    assert file_sha256(str(path)) == hashlib.sha256(data).hexdigest()


def test_portable_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(store))
    repository = tmp_path / "repo"
    assert portable_path(repository / "a" / "b.json", root=repository) == "./a/b.json"
    assert portable_path(store / "models" / "m.gguf") == "$SHARD_ENGINE_MODEL_STORE/models/m.gguf"
    assert portable_path(Path.home() / "x.gguf") == "~/x.gguf"
    assert portable_path("/opt/models/deep/m.gguf") == ".../deep/m.gguf"
    assert portable_path("fake:layers=4") == "fake:layers=4"
    assert portable_path("relative/m.gguf") == "relative/m.gguf"
    text = f"rootdir: {repository}\nreport {repository}/r.json model {store}/m.gguf"
    assert portable_text(text, root=repository) == (
        "rootdir: .\nreport ./r.json model $SHARD_ENGINE_MODEL_STORE/m.gguf"
    )
    # Whole path components only: the repository's prefix does not rewrite a sibling.
    assert not portable_text(f"{repository}2/x", root=repository).startswith(".")
