"""Generate each story's evidence by running the commands it names, and derive ``passes``.

    python tools/evidence.py [STORY ...]

For every story in prd.json (or those named), runs its ``commands`` from the repository root,
records exit codes, durations and summarized output (absolute paths rewritten relative to the
repository, the model store, the temporary directory or the home), the environment and the
story's changed files, and writes ``<evidence_root>/<STORY>/README.md`` (plus the full logs
beside it). The hand-written "Limitations" and "Dependency handoff" sections of an existing
README are kept. A story passes only when every command it names exited 0; prd.json's
``passes`` is rewritten from that and never set by hand.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

import msgspec

from shard_engine_api.engine import portable_text

ROOT: Final = Path(__file__).resolve().parent.parent
PRESERVED: Final = ("Limitations", "Dependency handoff")
JSON_MARKER: Final = "evidence-json"
PYTEST_TOTALS: Final = re.compile(r"^=+ .*(passed|failed|error|skipped|no tests ran).* =+$")
SUMMARY_PATTERNS: Final = (
    PYTEST_TOTALS,
    re.compile(r"^nox > (Session .*|Ran multiple sessions:|\* .*)"),
    re.compile(r"^shard-engine conformance: .*"),
)
NOISE: Final = re.compile(
    r"^nox > (python -m pip|Creating virtual|Re-using|Running session|uv binary|Session .* "
    r"was successful)"
)
SUMMARY_LINES: Final = 90
LOG_TAIL_LINES: Final = 400


class CommandRecord(msgspec.Struct, frozen=True, kw_only=True):
    command: str
    exit_code: int
    seconds: float
    summary: list[str]
    log: str


class StoryEvidence(msgspec.Struct, frozen=True, kw_only=True):
    story: str
    generated_at: str
    commit: str
    passes: bool
    commands: list[CommandRecord]
    environment: dict[str, str]


class Story(msgspec.Struct, kw_only=True):
    id: str
    title: str
    paths: list[str]
    criteria: list[str]
    commands: list[str]
    passes: bool = False


class Prd(msgspec.Struct, kw_only=True):
    project: str
    evidence_root: str
    stories: list[Story]


def committed_text(text: str) -> str:
    """Text as evidence is committed: paths relative to the repository or the model store
    (never this machine's absolute paths) and no trailing whitespace on any line, so the
    tree stays clean under ``git diff --check``."""
    return "\n".join(line.rstrip() for line in portable_text(text, root=ROOT).split("\n"))


def _git(*args: str) -> str:
    completed = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return completed.stdout.strip()


def environment() -> dict[str, str]:
    """Python, platform, CPU and the versions of the packages the stories touch."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": str(os.cpu_count()),
    }
    for name in (
        "shard-engine-api",
        "shard-engine-fake",
        "shard-engine-llama",
        "msgspec",
        "pluggy",
        "numpy",
        "llama-cpp-python",
        "gguf",
        "pytest",
        "hypothesis",
        "nox",
    ):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    return info


def summarize(output: str) -> list[str]:
    """The lines worth reading: pytest totals and nox results for test runs; for anything else
    (benchmarks, demos, certification) the whole output less installer noise."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    if any(PYTEST_TOTALS.match(line) for line in lines):
        picked = [line for line in lines if any(p.match(line) for p in SUMMARY_PATTERNS)]
        return picked[-60:]
    return [line for line in lines if not NOISE.match(line)][-SUMMARY_LINES:]


def run_command(command: str, log_path: Path) -> CommandRecord:
    started = time.perf_counter()
    completed = subprocess.run(
        command,
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    seconds = time.perf_counter() - started
    output = committed_text(completed.stdout + completed.stderr)
    tail = output.splitlines()[-LOG_TAIL_LINES:]
    log_path.write_text("\n".join(tail) + "\n", encoding="utf-8")
    return CommandRecord(
        command=command,
        exit_code=completed.returncode,
        seconds=round(seconds, 1),
        summary=summarize(output),
        log=log_path.name,
    )


def preserved_sections(readme: Path) -> dict[str, str]:
    """The hand-written sections of an existing evidence README, by heading."""
    if not readme.exists():
        return {}
    text = readme.read_text(encoding="utf-8")
    sections: dict[str, str] = {}
    for heading in PRESERVED:
        match = re.search(
            rf"^## {re.escape(heading)}\n(.*?)(?=^## |^<!-- {JSON_MARKER}|\Z)", text, re.S | re.M
        )
        if match:
            sections[heading] = match.group(1).strip()
    return sections


def changed_files(story: Story) -> list[str]:
    """Tracked files under the story's paths, with the last commit that touched each."""
    files = _git("ls-files", "--", *story.paths).splitlines()
    return sorted(files)


def render(
    story: Story, evidence: StoryEvidence, sections: dict[str, str], files: list[str]
) -> str:
    status = "PASSES" if evidence.passes else "DOES NOT PASS"
    out = [
        f"# {story.id}: {story.title}",
        "",
        "<!-- Generated by `nox -s evidence` (tools/evidence.py). Only the Limitations and",
        "     Dependency handoff sections are hand-written; regeneration keeps them. -->",
        "",
        f"**Status: {status}** ({sum(c.exit_code == 0 for c in evidence.commands)} of "
        f"{len(evidence.commands)} commands exited 0) at {evidence.generated_at}, "
        f"commit `{evidence.commit}`.",
        "",
        "## Acceptance criteria",
        "",
        *[f"- {criterion}" for criterion in story.criteria],
        "",
        "## Commands",
        "",
        "| # | command | exit | seconds | log |",
        "|---|---------|------|---------|-----|",
    ]
    for index, record in enumerate(evidence.commands, 1):
        out.append(
            f"| {index} | `{record.command}` | {record.exit_code} | {record.seconds} | "
            f"[{record.log}]({record.log}) |"
        )
    out += ["", "## Results", ""]
    for index, record in enumerate(evidence.commands, 1):
        out += [f"### {index}. `{record.command}`", "", "```", *record.summary, "```", ""]
    out += ["## Environment", "", "| what | value |", "|---|---|"]
    out += [f"| {key} | {value} |" for key, value in evidence.environment.items()]
    out += ["", "## Changed files", ""]
    out += [f"- `{path}`" for path in files]
    for heading in PRESERVED:
        out += ["", f"## {heading}", "", sections.get(heading, "_To be written._")]
    out += [
        "",
        f"<!-- {JSON_MARKER}",
        msgspec.json.format(msgspec.json.encode(evidence), indent=1).decode(),
        "-->",
        "",
    ]
    return "\n".join(out)


def read_evidence(readme: Path) -> StoryEvidence | None:
    """The machine-readable record embedded in an evidence README (None when absent)."""
    if not readme.exists():
        return None
    match = re.search(rf"<!-- {JSON_MARKER}\n(.*?)\n-->", readme.read_text(encoding="utf-8"), re.S)
    if not match:
        return None
    return msgspec.json.decode(match.group(1), type=StoryEvidence)


def main(argv: list[str]) -> int:
    prd_path = ROOT / "prd.json"
    prd = msgspec.json.decode(prd_path.read_bytes(), type=Prd)
    chosen = set(argv) or {story.id for story in prd.stories}
    commit = _git("rev-parse", "--short", "HEAD") or "uncommitted"
    env = environment()
    for story in prd.stories:
        if story.id not in chosen:
            continue
        folder = ROOT / prd.evidence_root / story.id
        folder.mkdir(parents=True, exist_ok=True)
        readme = folder / "README.md"
        sections = preserved_sections(readme)
        records = []
        for index, command in enumerate(story.commands, 1):
            print(f"[{story.id}] {command}", flush=True)
            record = run_command(command, folder / f"command-{index}.log")
            print(f"[{story.id}]   exit {record.exit_code} in {record.seconds}s", flush=True)
            records.append(record)
        evidence = StoryEvidence(
            story=story.id,
            generated_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            commit=commit,
            passes=bool(records) and all(record.exit_code == 0 for record in records),
            commands=records,
            environment=env,
        )
        readme.write_text(render(story, evidence, sections, changed_files(story)), encoding="utf-8")
        story.passes = evidence.passes
    text = json.dumps(msgspec.to_builtins(prd), indent=2, ensure_ascii=False) + "\n"
    prd_path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
