"""``read_events``: every good record of an event log, each bad line reported, none raised."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sdc_guard import EventLog, read_events
from sdc_guard.events import MAX_DEPTH


def _log_with(tmp_path: Path, bad: bytes) -> Path:
    """A log of two good records with ``bad`` as the line between them."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0)
    log.write({"event": "detection", "step": 1})
    with open(path, "ab") as f:
        f.write(bad + b"\n")
    log.write({"event": "injection", "step": 2, "before": 2**64 - 1})
    return path


@pytest.mark.parametrize(("bad", "reason"), [
    (b'{"event": "x", "note": "\xff\xfe"}', "invalid UTF-8 at byte 24"),
    (b"{not json", "not JSON"),
    (b"[1, 2, 3]", "not a JSON object (a JSON array)"),
    (b'"a string"', "not a JSON object (a JSON string)"),
    (b"42", "not a JSON object (a JSON number)"),
    (b"null", "not a JSON object (a JSON null)"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", f"nested deeper than {MAX_DEPTH} levels"),
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", f"nested deeper than {MAX_DEPTH} levels"),
    (b'{"step": ' + b"9" * 5000 + b"}", "a number too large (5000 digits"),
    (b'{"step": 18446744073709551616}', "a number too large (18446744073709551616"),
    (b'{"step": -9223372036854775809}', "a number too large (-9223372036854775809"),
])
def test_a_bad_line_is_reported_and_the_other_records_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: bytes, reason: str) -> None:
    path = _log_with(tmp_path, bad)
    problems: list[tuple[int, str]] = []
    with caplog.at_level(logging.WARNING, logger="sdc_guard.events"):
        events = read_events(path, problems=problems)
    assert [e["event"] for e in events] == ["detection", "injection"]
    assert events[1]["before"] == 2**64 - 1  # the largest 64-bit word is a good number
    assert len(problems) == 1
    line, why = problems[0]
    assert line == 2 and why.startswith(reason), why
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 bad line(s) skipped, 2 record(s) read" in warnings[0].getMessage()
    assert f"line 2: {reason}" in warnings[0].getMessage()


def test_without_a_problems_list_the_good_records_come_back_alike(tmp_path: Path) -> None:
    path = _log_with(tmp_path, b"[1]")
    assert [e["step"] for e in read_events(path)] == [1, 2]


def test_many_bad_lines_one_warning_that_counts_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"step": i}).encode() if i % 3 else b"\xc3(" for i in range(30)]
    path.write_bytes(b"\n".join(lines) + b"\n\n   \n")  # blank lines are not bad lines
    problems: list[tuple[int, str]] = []
    with caplog.at_level(logging.WARNING, logger="sdc_guard.events"):
        events = read_events(path, problems=problems)
    assert [e["step"] for e in events] == [i for i in range(30) if i % 3]
    assert [n for n, _ in problems] == [i + 1 for i in range(30) if not i % 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10 bad line(s) skipped, 20 record(s) read" in warnings[0]


def test_a_clean_log_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _log_with(tmp_path, b"")
    problems: list[tuple[int, str]] = []
    with caplog.at_level(logging.DEBUG, logger="sdc_guard.events"):
        assert len(read_events(path, problems=problems)) == 2
    assert problems == [] and caplog.records == []


def test_an_unfinished_last_line_is_reported_a_whole_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}')  # no newline at the end, but whole
    assert read_events(path) == [{"step": 1}, {"step": 2}]
    path.write_bytes(b'{"step": 1}\n{"step": 2')  # torn by a killed writer
    problems: list[tuple[int, str]] = []
    assert read_events(path, problems=problems) == [{"step": 1}]
    assert problems[0][0] == 2 and "unfinished last line" in problems[0][1]


def test_a_missing_log_has_no_records(tmp_path: Path) -> None:
    problems: list[tuple[int, str]] = []
    assert read_events(tmp_path / "absent.jsonl", problems=problems) == []
    assert problems == []
