"""Evidence hygiene: generated evidence, logs and reports name paths relative to the repository
or the model store, never this machine's absolute paths."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import evidence as evidence_tool

ROOT = Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / ".scratch" / "distributed-gguf-runtime" / "evidence"
# An absolute path under a directory that differs between machines.
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:work|root|home|tmp|Users|mnt|srv|var/folders)/")


def test_committed_evidence_names_no_absolute_machine_paths() -> None:
    offenders: list[str] = []
    for path in sorted(EVIDENCE.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for machine_path in (str(ROOT), str(Path.home()), tempfile.gettempdir()):
            if machine_path in text:
                offenders.append(f"{path.relative_to(ROOT)}: {machine_path}")
        for match in MACHINE_PATH.finditer(text):
            line = text[text.rfind("\n", 0, match.start()) + 1 : text.find("\n", match.end())]
            offenders.append(f"{path.relative_to(ROOT)}: {line.strip()[:160]}")
    assert not offenders, "\n".join(offenders[:20])


def test_command_logs_and_summaries_are_rewritten(tmp_path: Path) -> None:
    home = Path.home()
    store = tmp_path / "store"
    script = (
        f"print('rootdir: {ROOT}'); print('model {home}/models/m.gguf'); "
        f"print('report {ROOT}/.nox/reports/r.json')"
    )
    log = tmp_path / "command-1.log"
    record = evidence_tool.run_command(f'{sys.executable} -c "{script}"', log)
    assert record.exit_code == 0
    text = log.read_text() + "\n".join(record.summary)
    assert str(ROOT) not in text
    assert str(home) not in text
    assert "rootdir: ." in text
    assert "model ~/models/m.gguf" in text
    assert "report ./.nox/reports/r.json" in text
    assert not store.exists()
