"""Distribution hygiene: the API depends on msgspec, pluggy, numpy and xxhash only; every package
re-exports a sorted, pinned ``__all__`` and ships ``py.typed``."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Worker names at the top, engine-author names in .engine, the codec in .wire. A change here is
# a change of the public surface: say so in the commit.
PINNED_EXPORTS: dict[str, list[str]] = {
    "shard_engine_api": [
        "CONTRACT_VERSION",
        "GREEDY",
        "AsyncShardEngine",
        "AuxState",
        "BoundaryBundle",
        "BoundaryDtype",
        "BoundaryResult",
        "CacheMiss",
        "CancelRequest",
        "CancelResult",
        "Cancelled",
        "Capabilities",
        "ChatMessage",
        "ChatTokenizer",
        "ChecksumMismatch",
        "ContractVersionMismatch",
        "DecodeBatchRequest",
        "DecodeBatchResult",
        "DecodeRequest",
        "Determinism",
        "EngineCrashed",
        "ErrorDetail",
        "ErrorInfo",
        "EvictionPolicy",
        "EvidenceClass",
        "ExportSessionRequest",
        "Features",
        "FinishReason",
        "GeneratedToken",
        "GenerationRequest",
        "GenerationResult",
        "Health",
        "HookStatus",
        "ImportSessionRequest",
        "ImportSessionResult",
        "InstalledEngine",
        "InvalidRequest",
        "LifecycleState",
        "Limits",
        "LoadConfig",
        "LogitsMode",
        "LogitsResult",
        "MalformedOutput",
        "ManyGenerationResult",
        "Metrics",
        "MtpState",
        "NotReady",
        "OptionValue",
        "OutcomeUnknown",
        "OutputKind",
        "Pipeline",
        "PipelineStep",
        "PrefillRequest",
        "ReleaseRequest",
        "ReleaseResult",
        "ReservedHooks",
        "ResourceExhausted",
        "Role",
        "Sampler",
        "Sampling",
        "SessionGeneration",
        "SessionRef",
        "SessionSnapshot",
        "ShardEngine",
        "ShardEngineError",
        "ShardInput",
        "ShardMismatch",
        "ShardResult",
        "ShardSpec",
        "ShardTimings",
        "StageTimings",
        "StaleEpoch",
        "Timings",
        "TokenInput",
        "TokenStream",
        "Tokenizer",
        "Tolerance",
        "Unauthenticated",
        "UnknownEngine",
        "UnsupportedFeature",
        "ValidatingEngine",
        "WrongRole",
        "__version__",
        "installed_engines",
        "load_engine",
        "load_pipeline",
        "load_tokenizer",
        "split_layers",
    ],
    "shard_engine_api.engine": [
        "DEFAULT_MODEL_STORE",
        "ENTRY_POINT_GROUP",
        "MODEL_STORE_ENV",
        "TEST_OPTIONS_ENV",
        "BrokenPlugin",
        "CancelToken",
        "CliSubparsers",
        "EngineCore",
        "EngineDescription",
        "ForwardItem",
        "ModelFixture",
        "ModelInfo",
        "ModelStoreRefused",
        "OutputMode",
        "PluginProblem",
        "Tokenizer",
        "build_result",
        "check_pending",
        "checksum_and_finite",
        "copy_checksum_and_finite",
        "describe_model",
        "engine_description",
        "file_sha256",
        "get_plugin_manager",
        "health_problem",
        "hookimpl",
        "hookspec",
        "metrics_problem",
        "model_fixture",
        "model_store",
        "plugin_problems",
        "portable_path",
        "portable_text",
        "test_options_enabled",
        "unchecked_model_store",
    ],
    "shard_engine_api.wire": [
        "BOUNDARY_DTYPES",
        "CHECKSUM_ALGORITHM",
        "DEFAULT_MAX_PAYLOAD_BYTES",
        "MAX_DETAIL_CHARS",
        "MAX_ID_CHARS",
        "MAX_SNAPSHOT_CHUNKS",
        "NATIVE_ENV",
        "NATIVE_VECTOR",
        "SNAPSHOT_CHUNK_BYTES",
        "Codec",
        "Count",
        "ErrorInfo",
        "Milliseconds",
        "NonFinitePolicy",
        "WireMessage",
        "WireReply",
        "WireRequest",
        "check_snapshot_integrity",
        "chunks_checksum",
        "clamp_text",
        "decode_bundle",
        "decode_error",
        "decode_message",
        "decode_reply",
        "decode_request",
        "encode",
        "encode_bundle",
        "encode_error",
        "encode_into",
        "error_from_info",
        "numpy_dtype",
        "payload_checksum",
        "split_chunks",
    ],
}


def test_api_declares_only_its_four_dependencies() -> None:
    project = tomllib.loads((ROOT / "packages/shard-engine-api/pyproject.toml").read_text())
    names = {
        requirement.split(">")[0].split("=")[0].split("<")[0].strip()
        for requirement in project["project"]["dependencies"]
    }
    assert names == {"msgspec", "pluggy", "numpy", "xxhash"}


def _third_party_modules(code: str) -> set[str]:
    probe = (
        f"{code}\nimport sys\n"
        "top = {name.split('.')[0] for name in sys.modules}\n"
        "print('\\n'.join(sorted(top - set(sys.stdlib_module_names))))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return {name for name in output.split() if not name.startswith("_")}


def test_importing_the_api_loads_no_other_third_party_module() -> None:
    """``import shard_engine_api`` (and its CLI) pulls in nothing beyond the standard library,
    the four declared dependencies and what they import themselves (msgspec uses
    typing_extensions when it is installed). Modules the interpreter preloads through .pth
    files are the baseline."""
    baseline = _third_party_modules("pass")
    loaded = _third_party_modules("import shard_engine_api, shard_engine_api.cli") - baseline
    allowed = {"shard_engine_api", "msgspec", "pluggy", "numpy", "xxhash", "typing_extensions"}
    assert loaded <= allowed, loaded - allowed


@pytest.mark.parametrize("package", ["shard_engine_api", "shard_engine_fake", "shard_engine_llama"])
def test_packages_are_typed_with_sorted_exports(package: str) -> None:
    module = __import__(package)
    assert module.__file__ is not None
    assert (Path(module.__file__).parent / "py.typed").is_file()
    exported = list(module.__all__)
    assert len(exported) == len(set(exported))
    for name in exported:
        assert hasattr(module, name), name


@pytest.mark.parametrize("module_name", sorted(PINNED_EXPORTS))
def test_api_namespaces_export_exactly_the_pinned_names(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert list(module.__all__) == PINNED_EXPORTS[module_name]

    # isort-style order (what ruff's RUF022 keeps): constants, then classes, then the rest.
    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)

    assert list(module.__all__) == sorted(module.__all__, key=kind)


def test_engine_author_names_are_not_at_the_top() -> None:
    import shard_engine_api

    top = set(shard_engine_api.__all__)
    assert not top & {"EngineCore", "hookimpl", "EngineDescription", "Codec", "encode"}
