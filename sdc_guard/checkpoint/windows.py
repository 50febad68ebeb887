"""The suspect windows of one checkpoint directory: the rule that opens one, and ``windows.json``.

A detection that was not repaired in place makes the state after it suspect. Its window
starts at ``start_of(d, verified_through)``: the detection's step, or the step after the
newest one every enabled check had verified clean, whichever is earlier; for a fault
repaired in place before (``evidence["repair"]["since"]``), no later than that first
repair. Checkpoints of the same timeline (generation) saved at a step inside a window are
never restored; a restore starts a new generation, which the old windows do not cover.
The windows live in ``windows.json`` beside the checkpoints, so a restarted job sees them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sdc_guard.checkpoint.files import CheckpointError, write_atomic
from sdc_guard.report import Detection

WINDOWS = "windows.json"


class SuspectWindows:
    """The windows recorded in ``directory / windows.json`` and the current generation.

    Every rank keeps the same state; only the writer (``writer=True`` on one rank) writes
    the file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / WINDOWS
        self._state: dict[str, Any] | None = None

    @staticmethod
    def start_of(d: Detection, verified_through: int | None) -> int:
        """The first suspect step of detection ``d``, given the newest step every enabled
        check had verified clean when it came (None: no check keeps such a step)."""
        start = d.step if verified_through is None else min(d.step, verified_through + 1)
        since = (d.evidence.get("repair") or {}).get("since")
        if since is not None:  # a permanent fault, repaired before: its first sign
            start = min(start, int(since))
        return start

    def _load(self) -> dict[str, Any]:
        if self._state is None:
            state: dict[str, Any] = {"generation": 0, "windows": []}
            if self.path.exists():
                try:
                    state = json.loads(self.path.read_text())
                except (OSError, ValueError) as e:
                    raise CheckpointError(f"{self.path} is unreadable ({e}); it records the "
                                          "suspect windows: repair or remove it") from e
            self._state = state
        return self._state

    @property
    def generation(self) -> int:
        """The current timeline: checkpoints saved now carry it."""
        return int(self._load()["generation"])

    def opened(self) -> list[dict[str, Any]]:
        """The windows still open (no restore since they were recorded)."""
        return [dict(w) for w in self._load()["windows"] if w["open"]]

    def record(self, d: Detection, start: int, *, writer: bool) -> dict[str, Any]:
        """Open the window of detection ``d`` from step ``start``; the writer writes it."""
        state = self._load()
        entry = {"start": start, "generation": state["generation"], "check": d.check,
                 "step": d.step, "suspect_ranks": list(d.suspect_ranks),
                 "suspect_nodes": list(d.suspect_nodes), "time": time.time(), "open": True}
        state["windows"].append(entry)
        if writer:
            self._write(state)
        return dict(entry)

    def refusing(self, generation: int, step: int) -> dict[str, Any] | None:
        """The window that forbids a checkpoint of ``generation`` saved at ``step``, or None."""
        for w in self._load()["windows"]:
            if generation <= w["generation"] and step >= w["start"]:
                return dict(w)
        return None

    def new_timeline(self, *, writer: bool) -> None:
        """A restore: every window closes and a new generation starts."""
        state = self._load()
        state["generation"] += 1
        for w in state["windows"]:
            w["open"] = False
        if writer:
            self._write(state)

    def _write(self, state: dict[str, Any]) -> None:
        write_atomic(self.path, json.dumps(state, indent=1).encode())
