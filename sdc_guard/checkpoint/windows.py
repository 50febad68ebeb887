"""The suspect windows of one checkpoint directory: the rule that opens one, and ``windows.json``.

A detection that was not repaired in place (nor contained before it reached the weights)
makes the state after it suspect. Its window starts at ``start_of(d, verified_through)``:
the detection's step, or the step after the newest one every enabled check had verified
clean, whichever is earlier; for a fault repaired in place before
(``evidence["repair"]["since"]``), no later than that first repair. Checkpoints of the same
timeline (generation) saved at a step inside a window are never restored; a restore starts a
new generation, which the old windows do not cover.

Repairs in place are recorded too (``record_repair``): while one is inside its repair window
the newest checkpoint before it is kept, since a second repair of the same rank opens a
window at the first.

The windows live in ``windows.json`` beside the checkpoints (schema ``SCHEMA``, a revision
counted up by every change, and the SHA-256 of its content), so a restarted job sees them;
every checkpoint's manifest carries the windows known when it was saved. A file that is
missing while manifests carry windows, older than a manifest's windows, edited or unreadable
is detected (``reconcile``) and fails safe: the windows of the newest manifest are used, and
in each timeline no checkpoint newer than the newest one the manifests vouch for (verified
clean by every check, and before any repair on record) is restored, never "no window".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sdc_guard.checkpoint.files import write_atomic
from sdc_guard.report import Detection

WINDOWS = "windows.json"
SCHEMA = 2
"""The schema of ``windows.json`` (1: the first, without schema, revision, repairs or
checksum; still read)."""


def _digest(state: Mapping[str, Any]) -> str:
    body = {k: v for k, v in state.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _parse(raw: Any) -> dict[str, Any]:
    """The state in ``raw`` (a file's JSON), checked; ValueError says what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    schema = raw.get("schema", 1)
    if schema == 1:
        return {"schema": SCHEMA, "revision": 0, "generation": int(raw["generation"]),
                "windows": list(raw["windows"]), "repairs": []}
    if schema != SCHEMA:
        raise ValueError(f"schema {schema!r}, and this sdc-guard reads up to {SCHEMA}: "
                         "upgrade sdc-guard")
    if raw.get("sha256") != _digest(raw):
        raise ValueError("its content does not match its SHA-256: edited or damaged")
    return {k: raw[k] for k in ("schema", "revision", "generation", "windows", "repairs")}


class SuspectWindows:
    """The windows recorded in ``directory / windows.json``, the repairs on record and the
    current generation.

    Every rank keeps the same state; only the writer (``writer=True`` on one rank) writes
    the file. A write that fails (no space, read-only storage) keeps the change in memory
    (``dirty``) for the next write."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / WINDOWS
        self._state: dict[str, Any] | None = None
        self._present = False
        self.unknown: str | None = None
        """Why the recorded windows were found lost or damaged (``reconcile``), or None."""
        self.dirty = False
        """The state in memory is newer than the file (a write failed, or it was recovered)."""

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
            state: dict[str, Any] = {"schema": SCHEMA, "revision": 0, "generation": 0,
                                     "windows": [], "repairs": []}
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                text = None
            except OSError as e:
                self.unknown = f"{self.path} cannot be read ({e})"
                text = None
            if text is not None:
                self._present = True
                try:
                    state = _parse(json.loads(text))
                except (ValueError, KeyError, TypeError) as e:
                    self.unknown = f"{self.path} is damaged ({e})"
            self._state = state
        return self._state

    def snapshot(self) -> dict[str, Any]:
        """What a manifest carries: the windows and repairs known now, and their revision."""
        state = self._load()
        copy: dict[str, Any] = json.loads(json.dumps(
            {k: state[k] for k in ("revision", "generation", "windows", "repairs")}))
        return copy

    def reconcile(self, manifests: Sequence[tuple[int, int, int | None, Mapping[str, Any]]]
                  ) -> str | None:
        """Compare the file with the windows the manifests carry (``(generation, step,
        clean_through, windows)`` per checkpoint); a file lost, damaged or older than a
        manifest's windows is replaced in memory by a safe state: the newest manifest's
        windows, and per timeline a window from the step after the newest checkpoint the
        manifests vouch for. Returns why, or None when the file is sound."""
        state = self._load()
        if not manifests:  # no checkpoint for a window to refuse: the next write replaces it
            self.dirty = self.dirty or self.unknown is not None
            return self.unknown
        newest = max((m[3] for m in manifests), key=lambda w: int(w.get("revision", 0)))
        if self.unknown is None and not self._present:
            self.unknown = (f"{self.path} is missing, while checkpoints were saved with suspect "
                            f"windows of revision {newest.get('revision', 0)}")
        elif self.unknown is None and state["revision"] < int(newest.get("revision", 0)):
            self.unknown = (f"{self.path} holds revision {state['revision']}, older than the "
                            f"revision {newest.get('revision')} a checkpoint was saved with")
        if self.unknown is None:
            return None
        repairs = list(newest.get("repairs", []))
        windows = [dict(w, open=False) for w in newest.get("windows", [])]
        for g in sorted({m[0] for m in manifests}):
            vouched = max((m[2] for m in manifests if m[0] == g and m[2] is not None),
                          default=-1)
            start = min([vouched + 1] + [int(r["step"]) for r in repairs
                                         if r["generation"] == g and r["step"] <= vouched])
            windows.append({"start": start, "generation": g, "exact": True,
                            "check": "unknown windows", "step": None, "suspect_ranks": [],
                            "suspect_nodes": [], "time": time.time(), "open": False,
                            "reason": self.unknown})
        generation = max([int(newest.get("generation", 0))] + [m[0] for m in manifests]) + 1
        self._state = {"schema": SCHEMA, "revision": int(newest.get("revision", 0)) + 1,
                       "generation": generation, "windows": windows, "repairs": repairs}
        self.dirty = True
        return self.unknown

    @property
    def generation(self) -> int:
        """The current timeline: checkpoints saved now carry it."""
        return int(self._load()["generation"])

    def opened(self) -> list[dict[str, Any]]:
        """The windows still open (no restore since they were recorded)."""
        return [dict(w) for w in self._load()["windows"] if w["open"]]

    def record(self, d: Detection, start: int, *, writer: bool) -> dict[str, Any]:
        """Open the window of detection ``d`` from step ``start``; the writer writes it
        (``CheckpointWriteError`` if it cannot: the window stays open in memory)."""
        state = self._load()
        entry = {"start": start, "generation": state["generation"], "check": d.check,
                 "step": d.step, "suspect_ranks": list(d.suspect_ranks),
                 "suspect_nodes": list(d.suspect_nodes), "time": time.time(), "open": True}
        state["windows"].append(entry)
        self._changed(writer)
        return dict(entry)

    def record_repair(self, d: Detection, until: int, *, writer: bool) -> dict[str, Any]:
        """A repair in place of ``d.suspect_ranks`` at ``d.step``, inside its repair window
        while the newest save is at or before step ``until``; the writer writes it."""
        state = self._load()
        entry = {"step": d.step, "until": until, "generation": state["generation"],
                 "check": d.check, "suspect_ranks": list(d.suspect_ranks),
                 "time": time.time()}
        state["repairs"].append(entry)
        self._changed(writer)
        return dict(entry)

    def repairs_before(self, newest_step: int) -> list[int]:
        """The steps of the repairs still inside their repair window when the newest save
        is at ``newest_step``: the newest checkpoint before each is kept."""
        return sorted({int(r["step"]) for r in self._load()["repairs"]
                       if newest_step <= int(r["until"])})

    def refusing(self, generation: int, step: int) -> dict[str, Any] | None:
        """The window that forbids a checkpoint of ``generation`` saved at ``step``, or None."""
        for w in self._load()["windows"]:
            covers = (generation == w["generation"] if w.get("exact")
                      else generation <= w["generation"])
            if covers and step >= w["start"]:
                return dict(w)
        return None

    def new_timeline(self, *, writer: bool) -> None:
        """A restore: every window closes and a new generation starts (``CheckpointWriteError``
        if the writer cannot write it: the change holds in memory)."""
        state = self._load()
        state["generation"] += 1
        for w in state["windows"]:
            w["open"] = False
        self._changed(writer)

    def flush(self, *, writer: bool) -> None:
        """Write the file if the state in memory is newer or the file is gone (the writer,
        before a checkpoint that carries these windows is committed)."""
        self._load()
        if writer and (self.dirty or not self.path.exists()):
            self._write()

    def _changed(self, writer: bool) -> None:
        state = self._load()
        state["revision"] = int(state["revision"]) + 1
        self.dirty = True
        if writer:
            self._write()

    def _write(self) -> None:
        state = dict(self._load(), schema=SCHEMA)
        state["sha256"] = _digest(state)
        write_atomic(self.path, json.dumps(state, indent=1).encode())
        self._present = True
        self.dirty = False
