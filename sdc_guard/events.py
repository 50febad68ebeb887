"""An append-only JSON-lines event log shared by the guard and the injectors."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Final

_log = logging.getLogger(__name__)


class EventLog:
    """Appends one JSON object per line; each line is written with a single ``write``.

    The file is opened with ``O_APPEND`` for each record, so several ranks can
    share one file without interleaving lines, and a killed process never
    leaves half a record behind more than the last line (readers skip it).
    """

    def __init__(self, path: str | Path, *, rank: int | None = None) -> None:
        self.path = Path(path)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))  # writable?

    def write(self, record: dict[str, Any]) -> None:
        if self.rank is not None and "rank" not in record:
            record = {"rank": self.rank, **record}
        line = (json.dumps(record, sort_keys=True, default=_default) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


MAX_DEPTH: Final = 64
"""Deepest nesting of arrays and objects a record may have; deeper lines are bad lines."""
MAX_INT: Final = 2**64 - 1
"""Integers in a record lie in ``[-2**63, 2**64 - 1]`` (the log writes raw words as unsigned
64-bit integers); a larger one makes its line a bad line."""


class _BadLine(ValueError):
    """Why one line of an event log is not a record."""


def read_events(path: str | Path, *,
                problems: list[tuple[int, str]] | None = None) -> list[dict[str, Any]]:
    """Every good record of an event log: each line that holds one JSON object.

    A bad line never hides the others. Lines that are not UTF-8, not JSON, not an object,
    nested deeper than ``MAX_DEPTH``, or hold an integer outside 64 bits are skipped, and so
    is an unfinished last line (a writer stopped mid-record); blank lines are ignored. When
    some lines were skipped, one WARNING on this module's logger counts them and names the
    first; pass a list as ``problems`` to get ``(line_number, reason)`` for each (1-based).
    A missing file has no records.
    """
    out: list[dict[str, Any]] = []
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return out
    bad: list[tuple[int, str]] = []
    lines = data.split(b"\n")
    unfinished = lines[-1] if lines else b""
    for number, raw in enumerate(lines[:-1], start=1):
        if not raw.strip():
            continue
        try:
            out.append(_record(raw))
        except _BadLine as e:
            bad.append((number, str(e)))
    if unfinished.strip():
        try:  # a last line without its newline: whole if it parses, torn otherwise
            out.append(_record(unfinished))
        except _BadLine as e:
            bad.append((len(lines), f"an unfinished last line ({e}): its writer stopped "
                                    "mid-record"))
    if bad:
        first, why = bad[0]
        _log.warning("event log %s: %d bad line(s) skipped, %d record(s) read (first: line "
                     "%d: %s)", p, len(bad), len(out), first, why)
        if problems is not None:
            problems.extend(bad)
    return out


def _record(raw: bytes) -> dict[str, Any]:
    """One line as a record, or ``_BadLine`` saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(f"invalid UTF-8 at byte {e.start}") from None
    try:
        value = json.loads(text, parse_int=_parse_int)
    except _BadLine:
        raise
    except RecursionError:
        raise _BadLine(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing a very long number
        raise _BadLine(f"not JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise _BadLine(f"not a JSON object (a JSON {_json_type(value)})")
    if _depth(value) > MAX_DEPTH:
        raise _BadLine(f"nested deeper than {MAX_DEPTH} levels")
    return value


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > 20:  # longer than any 64-bit integer: do not convert it
        raise _BadLine(f"a number too large ({len(digits)} digits; integers lie in "
                       f"[-2**63, 2**64 - 1])")
    v = int(digits)
    if not -(2**63) <= v <= MAX_INT:
        raise _BadLine(f"a number too large ({digits}; integers lie in [-2**63, 2**64 - 1])")
    return v


def _depth(value: Any) -> int:
    """The nesting depth of a parsed value (an object of scalars: 1), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            return d
        deepest = max(deepest, d)
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def _default(o: object) -> Any:
    if isinstance(o, (tuple, set)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)
