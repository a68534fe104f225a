"""`shard-engine serve` takes -v and --log-format on either side of the command, as every
other command does."""

from __future__ import annotations

from shard_engine_api.cli import build_parser

_SERVE = ["serve", "--engine", "fake", "--layers", "0:2"]


def test_serve_takes_verbose_before_and_after_the_command() -> None:
    parser = build_parser()
    before = parser.parse_args(["-v", "--log-format", "json", *_SERVE])
    after = parser.parse_args([*_SERVE, "-vv", "--log-format", "json"])
    assert before.verbose == 1
    assert before.log_format == "json"
    assert after.verbose_after_command == 2
    assert after.log_format_after_command == "json"
