"""``-v`` and ``--log-format``: the library's logs on stderr, as text or one JSON object a line."""

from __future__ import annotations

import datetime
import logging
import sys

import msgspec

__all__ = ["LOG_FORMATS", "LOG_FORMAT_HELP", "VERBOSE_HELP", "configure_logging"]

LOG_FORMATS = ("text", "json")
LOG_FORMAT_HELP = (
    "json: each log line one JSON object (time, level, logger, message), warnings logged "
    "even without -v"
)
VERBOSE_HELP = "log what happens to stderr (-v: loads, files, evictions; -vv: debug)"
_LOG_HANDLER = "shard-engine-cli"


class _JsonLines(logging.Formatter):
    """One JSON object a line, for log collectors: UTC time, level, logger, message (and the
    exception's traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(entry).decode()


def configure_logging(verbosity: int, log_format: str = "text") -> None:
    if verbosity <= 0 and log_format == "text":
        return
    root = logging.getLogger("shard_engine")
    root.setLevel(
        logging.DEBUG if verbosity > 1 else logging.INFO if verbosity == 1 else logging.WARNING
    )
    for handler in root.handlers[:]:
        if handler.get_name() == _LOG_HANDLER:
            root.removeHandler(handler)  # main() called again in the same process
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_LOG_HANDLER)
    handler.setFormatter(
        _JsonLines()
        if log_format == "json"
        else logging.Formatter("shard-engine: %(name)s: %(message)s")
    )
    root.addHandler(handler)
