"""``shard-engine run --chat`` where it cannot apply: refused in one typed line before any
shard loads (the llama package's test_chat.py runs it on a GGUF with a chat template)."""

from __future__ import annotations

import pytest

from shard_engine_api.cli import main


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a shard fails the test: every refusal here comes before any work."""
    from shard_engine_fake import FakeEngine

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a shard was loaded")

    monkeypatch.setattr(FakeEngine, "load", refuse)


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (
            ["run", "--chat"],
            "shard-engine run: UnsupportedFeature [unsupported_feature]: argument --chat: the "
            "tokenizer of engine 'fake' applies no chat template; run without --chat",
        ),
        (
            ["run", "--chat", "--model", "fake:vocab=100"],
            "shard-engine run: UnsupportedFeature [unsupported_feature]: argument --chat: "
            "engine 'fake' has no tokenizer for this model; run without --chat",
        ),
        (
            ["run", "--chat", "--tokens", "1,2"],
            "shard-engine run: error: argument --chat: the chat template applies to --prompt "
            "text, not --tokens",
        ),
        (
            ["run", "--chat", "--sessions", "2"],
            "shard-engine run: UnsupportedFeature [unsupported_feature]: argument --chat: the "
            "tokenizer of engine 'fake' applies no chat template; run without --chat",
        ),
    ],
)
def test_chat_without_a_chat_template_is_refused_before_loading(
    arguments: list[str], line: str, capsys: pytest.CaptureFixture[str], no_loading: None
) -> None:
    assert main(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [said] = captured.err.strip().splitlines()
    assert said.startswith(line), said


def test_run_help_describes_chat(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--chat send the prompt as one user message in the model's own chat template" in (
        help_text
    )
