"""Logging setup of the Trainwire services: ``--log-format text|json``.

``text`` is the classic one-line format for people; ``json`` writes one JSON object per line for
log shippers (Loki, Elasticsearch, Cloud Logging)::

    {"time": "2026-11-30T07:01:02.345Z", "level": "INFO", "logger": "trainer_service.core.jobs",
     "message": "run r1: imitation job finished after 3 episode(s)", "run_id": "r1", ...}

Fields passed through ``extra=`` (``run_id``, ``outcome``, ...) become top-level fields; an
exception becomes the ``exception`` field (its formatted traceback, one string). The services'
``__main__`` s call ``configure_logging``; their configs check ``--log-format`` and
``--log-level`` against ``LOG_FORMATS`` and ``parse_level``. Standard library only.

Ready lines (``trainer listening on HOST:PORT``...) go to stdout through :func:`announce`, one
write each, so a ready line is never split: scripts read them from a file that stdout and stderr
share, and ``print`` writes its text and its newline separately, which with stdout unbuffered
(``PYTHONUNBUFFERED``) leaves room for another thread's log line between the two.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# JSON keys the formatter owns; an ``extra`` field with one of these names is prefixed.
_OWN_KEYS = frozenset({"time", "level", "logger", "message", "exception", "stack"})
# Marks the handler configure_logging installed, so a second call replaces only that one.
_HANDLER_MARK = "_trainwire_handler"


def _rfc3339(created: float) -> str:
    """``created`` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can carry it as is, else its ``str``."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON: time, level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        """Returns the record as a single-line JSON object."""
        entry: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key in _RECORD_ATTRIBUTES or key.startswith("_"):
                continue
            entry[f"extra_{key}" if key in _OWN_KEYS else key] = _jsonable(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # json.dumps escapes newlines, so a traceback stays on the record's one line.
        return json.dumps(entry, ensure_ascii=False)


def announce(line: str) -> None:
    """Writes ``line`` and its newline to stdout in one write, then flushes (the module docstring
    says why)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_formatter(fmt: str = "text") -> logging.Formatter:
    """The formatter for ``fmt`` (``text`` or ``json``).

    Raises:
        ValueError: ``fmt`` is neither.
    """
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format {fmt!r} must be one of {', '.join(LOG_FORMATS)}")


def parse_level(level: str) -> int:
    """A level name (``debug``, ``INFO``, ...) or number as a logging level.

    Raises:
        ValueError: Not a known level.
    """
    name = level.strip().upper()
    if name.isdigit():
        return int(name)
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise ValueError(f"log level {level!r} must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


def configure_logging(
    level: str = "INFO", fmt: str = "text", *, stream: TextIO | None = None
) -> None:
    """Sends the root logger's records at ``level`` and above to ``stream`` in format ``fmt``.

    Call it once from a ``__main__``. Calling it again replaces the handler it installed before;
    handlers others installed (pytest's, for instance) are left alone. Python warnings
    (``warnings.warn``) become records of the ``py.warnings`` logger, so they are formatted like
    every other line (one JSON object with ``json``).

    Args:
        level: Level name (``DEBUG``, ``INFO``, ...), any case.
        fmt: ``text`` (one line for people) or ``json`` (one JSON object per line).
        stream: Where to write; standard error by default.

    Raises:
        ValueError: Unknown level or format.
    """
    formatter = make_formatter(fmt)
    numeric_level = parse_level(level)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
            handler.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    logging.captureWarnings(True)
