"""prd.json's ``passes`` may only say true when the story's generated evidence shows every
command it names exiting 0."""

from __future__ import annotations

from pathlib import Path

import evidence as evidence_tool
import msgspec
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _prd() -> evidence_tool.Prd:
    return msgspec.json.decode((ROOT / "prd.json").read_bytes(), type=evidence_tool.Prd)


@pytest.mark.parametrize("story", _prd().stories, ids=lambda story: story.id)
def test_story_passes_only_with_evidence(story: evidence_tool.Story) -> None:
    """A story claiming to pass needs a generated evidence README whose embedded record names
    exactly the story's commands, each with exit code 0. Fix: run `nox -s evidence`."""
    readme = ROOT / _prd().evidence_root / story.id / "README.md"
    evidence = evidence_tool.read_evidence(readme)
    if not story.passes:
        return
    assert evidence is not None, f"{story.id} claims to pass but {readme} has no evidence"
    assert [record.command for record in evidence.commands] == story.commands
    failing = [record.command for record in evidence.commands if record.exit_code != 0]
    assert not failing, f"{story.id} claims to pass but these commands failed: {failing}"
    assert evidence.passes


def test_passes_is_derived_from_evidence() -> None:
    """Where evidence exists, prd.json's passes equals what the evidence shows (it is written
    by tools/evidence.py, never by hand)."""
    prd = _prd()
    for story in prd.stories:
        evidence = evidence_tool.read_evidence(ROOT / prd.evidence_root / story.id / "README.md")
        if evidence is None:
            assert story.passes is False, f"{story.id} passes without evidence"
            continue
        same_commands = [record.command for record in evidence.commands] == story.commands
        assert story.passes == (evidence.passes and same_commands), story.id


def test_evidence_tool_records_failure_and_keeps_hand_written_sections(tmp_path: Path) -> None:
    """The generator records a failing command as failing and keeps hand-written sections."""
    record = evidence_tool.run_command("python3 -c 'raise SystemExit(3)'", tmp_path / "x.log")
    assert record.exit_code == 3
    readme = tmp_path / "README.md"
    readme.write_text(
        "# X\n\n## Limitations\n\nhand text\n\n## Dependency handoff\n\nmore text\n",
        encoding="utf-8",
    )
    sections = evidence_tool.preserved_sections(readme)
    assert sections == {"Limitations": "hand text", "Dependency handoff": "more text"}
