"""An append-only JSON-lines event log shared by the guard and the injectors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of an event log (a torn last line is ignored)."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _default(o: object) -> Any:
    if isinstance(o, (tuple, set)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)
