"""``trainwire_ops.logs``: text and JSON log lines, extras, exceptions, reconfiguration; ready
lines in one write."""

from __future__ import annotations

import datetime
import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from trainwire_ops.logs import JsonFormatter, announce, configure_logging, parse_level


@pytest.fixture
def root_state() -> Iterator[None]:
    """Puts the root logger's handlers and level back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_time_level_logger_message_and_extras(root_state: None) -> None:
    out = io.StringIO()
    configure_logging("INFO", "json", stream=out)
    log = logging.getLogger("trainwire.test.json")
    log.info("run %s: job started", "r1", extra={"run_id": "r1", "slots": 2})
    log.debug("per-episode payload")  # below INFO: dropped
    log.warning("odd value", extra={"path": object(), "items": ("a", 1), "level": "clash"})
    first, second = json_lines(out)
    assert first["level"] == "INFO" and first["logger"] == "trainwire.test.json"
    assert first["message"] == "run r1: job started"
    assert (first["run_id"], first["slots"]) == ("r1", 2)
    moment = datetime.datetime.fromisoformat(str(first["time"]).replace("Z", "+00:00"))
    assert moment.utcoffset() == datetime.timedelta(0)
    assert str(first["time"]).endswith("Z") and len(str(first["time"])) == 24
    assert abs((datetime.datetime.now(datetime.UTC) - moment).total_seconds()) < 60
    assert second["level"] == "WARNING"  # an extra "level" does not overwrite it
    assert str(second["path"]).startswith("<object object")  # not JSON: its str
    assert second["items"] == ["a", 1]
    assert second["message"] == "odd value" and second["extra_level"] == "clash"


def test_exception_is_one_string_field_on_one_line(root_state: None) -> None:
    out = io.StringIO()
    configure_logging("ERROR", "json", stream=out)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("trainwire.test.exc").exception("run r2: failed", extra={"run_id": "r2"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["run_id"] == "r2" and record["message"] == "run r2: failed"
    assert isinstance(record["exception"], str)
    assert record["exception"].startswith("Traceback (most recent call last):")
    assert "ValueError: bad\nthing" in record["exception"]


def test_text_format_and_reconfiguring_replaces_only_our_handler(root_state: None) -> None:
    root = logging.getLogger()
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "text", stream=first)
    configure_logging("WARNING", "text", stream=second)
    assert foreign in root.handlers
    log = logging.getLogger("trainwire.test.text")
    log.info("quiet now")
    log.warning("run r3: slow")
    assert first.getvalue() == ""
    (line,) = second.getvalue().splitlines()
    assert line.endswith(" WARNING trainwire.test.text: run r3: slow")
    root.removeHandler(foreign)


def test_bad_level_or_format_is_refused(root_state: None) -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        configure_logging("INFO", "xml")
    with pytest.raises(ValueError, match="log level 'loud'"):
        configure_logging("loud", "json")
    assert parse_level("debug") == logging.DEBUG and parse_level("15") == 15


def test_formatter_is_usable_alone() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    record.run_id = "r4"
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["message"], entry["run_id"], entry["logger"]) == ("hello you", "r4", "x")


class _RecordingFile(io.RawIOBase):
    """A file that records each write it is given (as ``write(2)`` calls would be)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_a_ready_line_is_one_write_even_with_stdout_unbuffered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = _RecordingFile()
    # What PYTHONUNBUFFERED makes of stdout: the text layer writes through to the file itself.
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    print("gateway listening on 127.0.0.1:1", flush=True)
    assert raw.writes == [b"gateway listening on 127.0.0.1:1", b"\n"]  # room for a log line
    raw.writes.clear()
    announce("trainer listening on 127.0.0.1:32969")
    assert raw.writes == [b"trainer listening on 127.0.0.1:32969\n"]
