"""Plugin discovery: one registration hook, broken plugins reported by name and never hiding
the others, misspelt hooks named, one entry-point scan per process."""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance_engines import ReferenceEngine, ReferencePlugin

from shard_engine_api import (
    InvalidRequest,
    UnknownEngine,
    installed_engines,
    load_engine,
    load_tokenizer,
)
from shard_engine_api import _plugins as plugins_module
from shard_engine_api.engine import (
    BrokenPlugin,
    EngineDescription,
    ModelFixture,
    check_pending,
    engine_description,
    get_plugin_manager,
    hookimpl,
    plugin_problems,
)


class _Misspelt:
    @hookimpl
    def shard_engine_register(self) -> EngineDescription:
        return EngineDescription(name="misspelt", factory=ReferenceEngine, evidence="fixture")

    @hookimpl
    def shard_engine_registr(self) -> None:
        """A typo: no hookspec declares it."""


class _Raising:
    @hookimpl
    def shard_engine_register(self) -> EngineDescription:
        raise RuntimeError("backend library missing")


class _WrongType:
    @hookimpl
    def shard_engine_register(self) -> object:
        return {"name": "wrong"}


def test_a_good_plugin_is_described_once() -> None:
    calls: list[int] = []

    class Counting(ReferencePlugin):
        @hookimpl
        def shard_engine_register(self) -> EngineDescription:
            calls.append(1)
            return super().shard_engine_register()

    manager = get_plugin_manager(entry_points=False, plugins=[("reference", Counting())])
    check_pending(manager)
    assert [engine.name for engine in installed_engines(manager)] == ["reference"]
    assert engine_description("reference", manager=manager).summary
    load_engine("reference", manager=manager).close()
    assert calls == [1]


def test_broken_plugins_are_named_and_hide_nothing() -> None:
    manager = get_plugin_manager(
        entry_points=False,
        plugins=[
            ("reference", ReferencePlugin()),
            ("misspelt", _Misspelt()),
            ("raising", _Raising()),
            ("wrong", _WrongType()),
        ],
    )
    assert [engine.name for engine in installed_engines(manager)] == ["reference"]
    problems = {problem.plugin: problem.problem for problem in plugin_problems(manager)}
    assert set(problems) == {"misspelt", "raising", "wrong"}
    assert "shard_engine_registr" in problems["misspelt"]
    assert "backend library missing" in problems["raising"]
    assert "not an EngineDescription" in problems["wrong"]
    with pytest.raises(BrokenPlugin, match="backend library missing"):
        load_engine("raising", manager=manager)
    with pytest.raises(UnknownEngine, match=r"installed: reference; broken: "):
        load_engine("nosuch", manager=manager)


def test_check_pending_names_the_misspelt_hook() -> None:
    manager = get_plugin_manager(entry_points=False, plugins=[("misspelt", _Misspelt())])
    with pytest.raises(InvalidRequest, match="shard_engine_registr"):
        check_pending(manager)


def test_unknown_engine_says_not_installed() -> None:
    manager = get_plugin_manager(entry_points=False, plugins=[("reference", ReferencePlugin())])
    with pytest.raises(UnknownEngine, match=r"'nosuch' is not installed \(installed: reference\)"):
        engine_description("nosuch", manager=manager)


def test_description_fields_are_checked() -> None:
    with pytest.raises(TypeError, match="evidence"):
        EngineDescription(name="x", factory=ReferenceEngine, evidence="gold")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        EngineDescription(name="", factory=ReferenceEngine, evidence="fixture")
    with pytest.raises(TypeError, match="tokenizer"):
        EngineDescription(
            name="x",
            factory=ReferenceEngine,
            evidence="fixture",
            tokenizer="bytes",  # type: ignore[arg-type]
        )


def _distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[shard_engine]\n{lines}")


@contextlib.contextmanager
def _installed(root: Path, modules: dict[str, str]) -> Iterator[Path]:
    """``root`` (holding the distributions) on sys.path with ``modules`` written into it, the
    entry points rescanned; all undone on exit."""
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    plugins_module._entry_points.cache_clear()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for module in modules:
            sys.modules.pop(module, None)
        plugins_module._entry_points.cache_clear()


@pytest.fixture
def broken_distribution(tmp_path: Path) -> Iterator[Path]:
    """An installed distribution whose ``shard_engine`` entry point cannot be imported, and one
    whose entry-point name is not the engine name it registers."""
    _distribution(
        tmp_path,
        "broken-engine",
        {"broken": "no_such_module_for_shard_engine", "renamed": "renamed_plugin"},
    )
    renamed = (
        "from conformance_engines import ReferencePlugin\n"
        "shard_engine_register = ReferencePlugin('other').shard_engine_register\n"
    )
    with _installed(tmp_path, {"renamed_plugin": renamed}) as root:
        yield root


def test_an_entry_point_that_fails_to_import_is_reported(broken_distribution: Path) -> None:
    manager = get_plugin_manager(plugins=[("reference", ReferencePlugin())])
    assert "reference" in [engine.name for engine in installed_engines(manager)]
    problems = {problem.plugin: problem for problem in plugin_problems(manager)}
    assert problems["broken"].distribution == "broken-engine"
    assert "no_such_module_for_shard_engine" in problems["broken"].problem
    assert "entry-point name must be the engine name" in problems["renamed"].problem
    with pytest.raises(BrokenPlugin, match=r"broken-engine 1\.0"):
        load_engine("broken", manager=manager)


def test_entry_points_are_scanned_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[str] = []
    original = importlib.metadata.entry_points

    def counting(**kwargs: str) -> object:
        scans.append(kwargs.get("group", ""))
        return original(**kwargs)

    plugins_module._entry_points.cache_clear()
    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    try:
        for _ in range(3):
            installed_engines(get_plugin_manager())
    finally:
        plugins_module._entry_points.cache_clear()
    assert scans == ["shard_engine"]


_HOSTILE_MODULES: dict[str, str] = {
    "exits_on_import": "raise SystemExit('needs a GPU')\n",
    "exits_in_hook": (
        "from shard_engine_api.engine import hookimpl\n"
        "@hookimpl\n"
        "def shard_engine_register():\n"
        "    raise SystemExit(3)\n"
    ),
    "undecorated": (
        "from conformance_engines import ReferencePlugin\n"
        "def shard_engine_register():\n"
        "    return ReferencePlugin('undecorated').shard_engine_register()\n"
    ),
    "lazy_attributes": (
        "def __getattr__(name):\n    raise RuntimeError('lazy import failed: ' + name)\n"
    ),
    "makes_none": (
        "from shard_engine_api.engine import EngineDescription, hookimpl\n"
        "@hookimpl\n"
        "def shard_engine_register():\n"
        "    return EngineDescription(\n"
        "        name='makes_none', factory=lambda: None, evidence='fixture'\n"
        "    )\n"
    ),
    "factory_raises": (
        "from shard_engine_api.engine import EngineDescription, hookimpl\n"
        "def _factory():\n"
        "    raise ImportError('libcuda.so.1: cannot open shared object file')\n"
        "@hookimpl\n"
        "def shard_engine_register():\n"
        "    return EngineDescription(\n"
        "        name='factory_raises', factory=_factory, evidence='fixture'\n"
        "    )\n"
    ),
    "twin_a": "from conformance_engines import ReferencePlugin\n"
    "shard_engine_register = ReferencePlugin('twin').shard_engine_register\n",
    "twin_b": "from conformance_engines import ReferencePlugin\n"
    "shard_engine_register = ReferencePlugin('twin').shard_engine_register\n",
    "well_behaved": "from conformance_engines import ReferencePlugin\n"
    "shard_engine_register = ReferencePlugin('well_behaved').shard_engine_register\n",
}


@pytest.fixture
def hostile_distributions(tmp_path: Path) -> Iterator[Path]:
    """Installed distributions whose plugins fail in every way a third party's can, one of
    them declaring the same engine name as another distribution, beside one sound plugin."""
    _distribution(
        tmp_path,
        "hostile-engines",
        {
            "exits_on_import": "exits_on_import",
            "exits_in_hook": "exits_in_hook",
            "undecorated": "undecorated",
            "lazy_attributes": "lazy_attributes",
            "makes_none": "makes_none",
            "factory_raises": "factory_raises",
            "twin": "twin_a",
            "well_behaved": "well_behaved",
        },
    )
    _distribution(tmp_path, "other-twin", {"twin": "twin_b"})
    with _installed(tmp_path, _HOSTILE_MODULES) as root:
        yield root


def test_hostile_plugins_are_named_and_leave_the_others_working(
    hostile_distributions: Path,
) -> None:
    """Each failing plugin is a PluginProblem under its entry-point name and BrokenPlugin from
    load_engine (never SystemExit, AttributeError or "not installed"); every other engine
    still loads."""
    manager = get_plugin_manager(plugins=[("reference", ReferencePlugin())])
    assert "reference" in [engine.name for engine in installed_engines(manager)]
    problems = {problem.plugin: problem.problem for problem in plugin_problems(manager)}
    expected = {
        "exits_on_import": "SystemExit: needs a GPU",
        "exits_in_hook": "shard_engine_register raised SystemExit: 3",
        "undecorated": "implements no shard_engine_register hook",
        "lazy_attributes": "implements no shard_engine_register hook",
        "twin": "declared more than once: ",
    }
    for name, text in expected.items():
        assert text in problems[name], (name, problems.get(name))
        with pytest.raises(BrokenPlugin, match=name):
            load_engine(name, manager=manager)
    assert "hostile-engines 1.0 (twin_a)" in problems["twin"]
    assert "other-twin 1.0 (twin_b)" in problems["twin"]
    with pytest.raises(BrokenPlugin, match="returned NoneType, which is not a ShardEngine"):
        load_engine("makes_none", manager=manager)
    with pytest.raises(BrokenPlugin, match="factory raised ImportError: libcuda"):
        load_engine("factory_raises", manager=manager)
    load_engine("reference", manager=manager).close()
    # The sound engine of the same hostile distribution, found through entry points alone.
    assert "well_behaved" in [engine.name for engine in installed_engines(get_plugin_manager())]
    load_engine("well_behaved").close()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"n_threads": 99999}, "n_threads"), ({"max_sessions": "four"}, "max_sessions"),
     ({"eviction": "bogus"}, "eviction")],
)  # fmt: skip
def test_a_fixture_config_with_a_bad_field_is_invalid_request(
    overrides: dict[str, object], field: str
) -> None:
    """ModelFixture.config (what the CLI and the suite build configs with) raises the
    contract's InvalidRequest naming the field, not msgspec's ValidationError."""
    fixture = ModelFixture(model="m", n_layers=2)
    with pytest.raises(InvalidRequest, match=field) as caught:
        fixture.config(0, 2, **overrides)
    assert type(caught.value) is InvalidRequest


class _TokenizerPlugin:
    """A plugin whose tokenizer hook does whatever ``make`` does for a model."""

    def __init__(self, make: object) -> None:
        self._make = make

    @hookimpl
    def shard_engine_register(self) -> EngineDescription:
        return EngineDescription(
            name="toks",
            factory=ReferenceEngine,
            evidence="fixture",
            tokenizer=self._make,  # type: ignore[arg-type]
        )


class _Letters:
    def encode(self, text: str) -> list[int]:
        return [ord(character) for character in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


def _raise_os_error(model: str) -> None:
    raise OSError(f"cannot open {model}")


def _exit(model: str) -> None:
    raise SystemExit(3)


def test_a_tokenizer_hook_is_called_with_a_model_path_only() -> None:
    manager = get_plugin_manager(
        entry_points=False, plugins=[("toks", _TokenizerPlugin(lambda model: _Letters()))]
    )
    found = load_tokenizer("toks", "model.gguf", manager=manager)
    assert found is not None
    assert found.decode(found.encode("ab")) == "ab"
    for model in (None, 5, "", b"model.gguf", ["model.gguf"]):
        with pytest.raises(InvalidRequest, match="model must be a non-empty str"):
            load_tokenizer("toks", model, manager=manager)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_raise_os_error, "its tokenizer raised OSError"),
        (_exit, "its tokenizer raised SystemExit"),
        (lambda model: 42, "returned int, which has no encode and decode"),
        (lambda model: object(), "returned object, which has no encode and decode"),
    ],
)
def test_a_broken_tokenizer_hook_is_a_broken_plugin(make: object, match: str) -> None:
    manager = get_plugin_manager(entry_points=False, plugins=[("toks", _TokenizerPlugin(make))])
    with pytest.raises(BrokenPlugin, match=match):
        load_tokenizer("toks", "model.gguf", manager=manager)


def test_a_tokenizer_hook_may_refuse_a_model_with_a_typed_error() -> None:
    def refuse(model: str) -> None:
        raise InvalidRequest(f"{model} is not a model of mine")

    manager = get_plugin_manager(entry_points=False, plugins=[("toks", _TokenizerPlugin(refuse))])
    with pytest.raises(InvalidRequest, match="not a model of mine"):
        load_tokenizer("toks", "model.gguf", manager=manager)
