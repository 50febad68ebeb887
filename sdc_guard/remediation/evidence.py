"""What a quarantine writes on a node: our taint, our marker, the evidence, bounded in size.

Names (stable; ``python -m sdc_guard quarantine`` and operators' tooling read them):

- taint ``sdc-guard.io/quarantine=sdc:NoSchedule``: ours, by key; other tools' taints stay.
- annotation ``sdc-guard.io/quarantine``: JSON marking the quarantine as ours: the job, the
  time, the first detection, and whether the node was already unschedulable (someone else
  cordoned it first: ``release`` then refuses unless forced, and leaves it cordoned).
- annotation ``sdc-guard.io/evidence``: a JSON list of entries (detections and the suspect
  rank's GPU telemetry), newest last. Kubernetes limits all annotations of an object together
  to 256 KiB; we keep this one under ``EVIDENCE_LIMIT`` bytes, whatever the entries hold, by
  dropping the oldest entries (counted in ``{"dropped": N}``, the list's first element) and
  shortening an entry that alone is too large.
- annotation ``sdc-guard.io/history``: on release, the quarantine marker and evidence move
  here (bounded the same way), so a node's past survives its return to service.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sdc_guard.report import Detection

PREFIX = "sdc-guard.io"
TAINT_KEY = f"{PREFIX}/quarantine"
TAINT_VALUE = "sdc"
TAINT_EFFECT = "NoSchedule"
MARKER = f"{PREFIX}/quarantine"
EVIDENCE = f"{PREFIX}/evidence"
HISTORY = f"{PREFIX}/history"
EVIDENCE_LIMIT = 64 * 1024
"""Bytes per evidence annotation: two of them (evidence, history) stay far below the 256 KiB
that Kubernetes allows for all annotations of a node together, leaving room for other tools."""


def our_taint() -> dict[str, str]:
    return {"key": TAINT_KEY, "value": TAINT_VALUE, "effect": TAINT_EFFECT}


def has_our_taint(taints: list[dict[str, Any]] | None) -> bool:
    return any(t.get("key") == TAINT_KEY and t.get("effect") == TAINT_EFFECT for t in taints or [])


def detection_entry(d: Detection, *, job: str, now: float | None = None) -> dict[str, Any]:
    """The evidence of one detection, as written on a node: check, step, ranks, nodes, the
    check's own evidence (fingerprints per rank, flags per rank), the job and the time."""
    return {
        "kind": "detection",
        "job": job,
        "time": time.time() if now is None else now,
        "check": d.check,
        "step": d.step,
        "suspect_ranks": list(d.suspect_ranks),
        "suspect_nodes": list(d.suspect_nodes),
        "detail": d.detail,
        "evidence": d.evidence,
    }


def telemetry_entry(d: Detection, *, rank: int, job: str, snapshot: dict[str, Any],
                    now: float | None = None) -> dict[str, Any]:
    """The suspect rank's own GPU snapshot at detection time."""
    return {"kind": "telemetry", "job": job, "time": time.time() if now is None else now,
            "check": d.check, "step": d.step, "rank": rank, "telemetry": snapshot}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def parse_entries(text: str | None) -> tuple[int, list[dict[str, Any]]]:
    """(entries dropped so far, entries) of an evidence annotation; tolerant of foreign text."""
    if not text:
        return 0, []
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return 0, [{"kind": "unparsed", "text": text[:1000]}]
    if not isinstance(value, list):
        return 0, [{"kind": "unparsed", "text": text[:1000]}]
    dropped = 0
    if value and isinstance(value[0], dict) and set(value[0]) == {"dropped"}:
        dropped, value = int(value[0]["dropped"]), value[1:]
    return dropped, [e for e in value if isinstance(e, dict)]


def append_entries(text: str | None, new: list[dict[str, Any]], *,
                   limit: int = EVIDENCE_LIMIT) -> str:
    """The annotation ``text`` with ``new`` appended, the oldest dropped to fit ``limit`` bytes.

    The result is never longer than ``limit`` bytes, whatever the entries hold. The newest entry
    is kept; if it alone exceeds the limit, its bulkiest parts (the check's evidence, the
    telemetry) are replaced by a note saying they were cut, and any other field still too long
    (a detail of megabytes) is shortened, saying how much was cut.
    """
    dropped, entries = parse_entries(text)
    entries = entries + [_fit(e, limit) for e in new]
    sizes = [len(_dumps(e)) + 1 for e in entries]
    total = sum(sizes) + 32
    first = 0
    while total > limit and first < len(entries) - 1:
        total -= sizes[first]
        first += 1
    dropped += first
    kept = entries[first:]
    out = _dumps(([{"dropped": dropped}] if dropped else []) + kept)
    if len(out) > limit:  # only a limit too small for one shortened entry gets here
        out = _dumps([{"dropped": dropped + len(kept)}])
    return out


_CORE = ("kind", "job", "time", "check", "step", "rank", "suspect_ranks", "suspect_nodes")


def _fit(entry: dict[str, Any], limit: int) -> dict[str, Any]:
    if len(_dumps(entry)) + 64 <= limit:
        return entry
    cut = {k: v for k, v in entry.items() if k not in ("evidence", "telemetry")}
    cut["cut"] = "evidence larger than the annotation limit; see the job's event log"
    room = max(64, limit // 8)
    for key, value in list(cut.items()):
        if key != "cut" and len(_dumps(value)) > room:
            cut[key] = _shorten(value if isinstance(value, str) else _dumps(value), room)
    if len(_dumps(cut)) + 64 > limit:
        cut = {k: v for k, v in cut.items() if k in _CORE or k == "cut"}
    return cut


def _shorten(text: str, room: int) -> str:
    """``text`` cut to about ``room`` bytes of JSON, saying how many characters were cut."""
    keep = text[:room]
    while keep and len(_dumps(keep)) > room:  # escapes (non-ASCII, controls) take more bytes
        keep = keep[:len(keep) // 2]
    return f"{keep}... [{len(text) - len(keep)} characters cut]"


def marker(d: Detection, *, job: str, already_unschedulable: bool,
           now: float | None = None) -> str:
    """The ``sdc-guard.io/quarantine`` annotation: this quarantine is ours."""
    return _dumps({"job": job, "time": time.time() if now is None else now, "check": d.check,
                   "step": d.step, "already_unschedulable": already_unschedulable})


def parse_marker(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
