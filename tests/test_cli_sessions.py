"""``shard-engine run --sessions N``: N sessions through the shards at once, each printed with
its text, the aggregate tokens/s, and each verified against its own run alone."""

from __future__ import annotations

import json

import pytest

from shard_engine_api.cli import main


def test_run_sessions_prints_each_session_and_the_aggregate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--sessions", "3", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    for number in (1, 2, 3):
        assert f"session {number}: 'The quick brown fox #{number}' -> " in out
    assert "aggregate: 3 sessions in " in out
    assert " group(s), 12 tokens in " in out
    assert "tokens/s" in out
    assert "verify each session against its run alone: PASS (3/3 equal, 3 bitwise" in out


def test_run_sessions_json_equals_each_prompt_run_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = ["--max-new-tokens", "5", "--shards", "2", "--json"]
    assert main(["run", "--sessions", "3", "--temperature", "0.8", "--seed", "4", *arguments]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["verify"]["passed"] is True
    assert document["generated_tokens"] == 15
    assert document["tokens_per_s"] > 0
    assert document["wire_bytes"] > 0
    assert [stage["shard"] for stage in document["stages"]] == [
        "fake[0:3] (head)",
        "fake[3:6] (tail)",
    ]
    sessions = document["sessions"]
    assert [session["prompt"] for session in sessions] == [
        f"The quick brown fox #{number}" for number in (1, 2, 3)
    ]
    for number, session in enumerate(sessions, start=1):
        assert session["error"] is None
        # The same prompt and seed (--seed + i - 1) run alone by the one-session command.
        alone = ["run", "--prompt", session["prompt"], "--seed", str(3 + number), "--no-verify"]
        assert main([*alone, "--temperature", "0.8", *arguments]) == 0
        single = json.loads(capsys.readouterr().out)
        assert session["token_ids"] == single["token_ids"]
        assert session["text"] == single["text"]


def test_run_sessions_with_token_ids_runs_the_same_prompt_in_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = ["run", "--sessions", "2", "--tokens", "5,6,7", "--max-new-tokens", "3", "--json"]
    assert main(arguments) == 0
    sessions = json.loads(capsys.readouterr().out)["sessions"]
    assert [session["prompt_ids"] for session in sessions] == [[5, 6, 7], [5, 6, 7]]
    assert sessions[0]["token_ids"] == sessions[1]["token_ids"]  # greedy: the same tokens


def test_run_sessions_must_be_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--sessions", "0"])
    assert exit_info.value.code == 2
    assert "--sessions" in capsys.readouterr().err


def test_run_sessions_takes_the_groups_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["run", "--sessions", "4", "--max-new-tokens", "3", "--shards", "2", "--json"]
    assert main([*arguments, "--groups", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["groups"] == 2
    assert main(arguments) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["groups"] >= 1
    # Groups change which sessions share a batch, never a session's tokens.
    assert [s["token_ids"] for s in two["sessions"]] == [
        s["token_ids"] for s in default["sessions"]
    ]
    assert two["verify"]["passed"] is True


def test_run_groups_must_be_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--sessions", "2", "--groups", "0"])
    assert exit_info.value.code == 2
    assert "--groups" in capsys.readouterr().err
