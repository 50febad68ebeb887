"""``python -m sdc_guard events summarize LOG [--json]``: what an event log says, counted.

Per check, per suspect rank and per node: the detections, how many were repaired in place
and how many contained (withheld before they reached the weights); the withheld steps, the
restores, the quarantine outcomes (cordon, evidence, breaker, error) and, in a campaign's log,
the injections; the first and last step. A detection logged by several ranks (older logs
wrote one record per rank) counts once: a detection is its (check, step, suspect ranks).
Bad lines are skipped and counted (``sdc_guard.events.read_events``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sdc_guard.events import read_events

QUARANTINE_ACTIONS = ("cordon", "evidence", "breaker", "error")
"""The outcomes the quarantine records (``QuarantineAction.action``)."""


def _counts() -> dict[str, Any]:
    return {"detections": 0, "repaired": 0, "contained": 0, "withheld": 0,
            "first_step": None, "last_step": None}


def _step(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _add(row: dict[str, Any], *, repaired: bool, contained: bool, withheld: bool,
         step: int | None) -> None:
    row["detections"] += 1
    row["repaired"] += repaired
    row["contained"] += contained
    row["withheld"] += withheld
    if step is not None:
        row["first_step"] = step if row["first_step"] is None else min(row["first_step"], step)
        row["last_step"] = step if row["last_step"] is None else max(row["last_step"], step)


def summarize(records: Iterable[Mapping[str, Any]], *, bad_lines: int = 0) -> dict[str, Any]:
    """The summary of an event log's records, as JSON-ready data (``--json`` prints it)."""
    records = list(records)
    steps = [s for s in map(_step, records) if s is not None]
    events: Counter[str] = Counter(str(r.get("event", "?")) for r in records)
    logged_by = sorted({r["rank"] for r in records if isinstance(r.get("rank"), int)})

    by_check: dict[str, dict[str, Any]] = defaultdict(_counts)
    by_rank: dict[str, dict[str, Any]] = defaultdict(_counts)
    by_node: dict[str, dict[str, Any]] = defaultdict(
        lambda: {**_counts(), **{a: 0 for a in QUARANTINE_ACTIONS}})
    withheld_steps: set[int] = set()
    seen: set[tuple[str, int | None, tuple[int, ...]]] = set()
    for r in records:
        if r.get("event") != "detection":
            continue
        check, step = str(r.get("check", "?")), _step(r)
        ranks = tuple(int(x) for x in r.get("suspect_ranks") or () if isinstance(x, int))
        if (check, step, ranks) in seen:
            continue
        seen.add((check, step, ranks))
        repaired, contained = bool(r.get("repaired")), bool(r.get("contained"))
        withheld = bool(r.get("optimizer_step_skipped") or r.get("withheld_by") or contained)
        if withheld and step is not None:
            withheld_steps.add(step)
        rows = [by_check[check], *(by_rank[str(x)] for x in ranks),
                *(by_node[str(n)] for n in r.get("suspect_nodes") or ())]
        for row in rows:
            _add(row, repaired=repaired, contained=contained, withheld=withheld, step=step)

    quarantine: Counter[str] = Counter()
    dry_run = Counter[bool]()
    for r in records:
        if r.get("event") != "quarantine":
            continue
        action = str(r.get("action", "?"))
        quarantine[action] += 1
        dry_run[bool(r.get("dry_run"))] += 1
        nodes = [r["node"]] if r.get("node") else list(r.get("nodes") or ())
        for node in nodes:
            row = by_node[str(node)]
            row[action] = row.get(action, 0) + 1

    restores_by_rank: Counter[Any] = Counter(
        r.get("rank") for r in records if r.get("event") == "restore")
    restore_steps = sorted({s for r in records if r.get("event") == "restore"
                            if (s := _step(r)) is not None})
    injections: Counter[str] = Counter(
        str(r.get("site", "?")) for r in records if r.get("event") == "injection")
    known = {"detection", "quarantine", "restore", "injection"}
    return {
        "records": len(records),
        "bad_lines": bad_lines,
        "logged_by_ranks": logged_by,
        "first_step": min(steps, default=None),
        "last_step": max(steps, default=None),
        "detections": len(seen),
        "by_check": dict(sorted(by_check.items())),
        "by_rank": dict(sorted(by_rank.items(), key=lambda kv: int(kv[0]))),
        "by_node": dict(sorted(by_node.items())),
        "withheld_steps": sorted(withheld_steps),
        # rank 0 logs a restore; an older log may hold one record per rank: count one rank's
        "restores": max(restores_by_rank.values(), default=0),
        "restore_steps": restore_steps,
        "quarantine": {"actions": dict(sorted(quarantine.items())),
                       "dry_run": dry_run[True], "real": dry_run[False]},
        "injections": {"total": sum(injections.values()), "by_site": dict(sorted(injections.items()))},
        "other_events": {k: v for k, v in sorted(events.items()) if k not in known},
    }


def _steps(steps: list[int], most: int = 10) -> str:
    shown = ", ".join(map(str, steps[:most]))
    return shown + (f", ... ({len(steps) - most} more)" if len(steps) > most else "")


def _table(title: str, rows: Mapping[str, Mapping[str, Any]], columns: tuple[str, ...]) -> list[str]:
    if not rows:
        return [f"{title}: none"]
    width = max(len(title), *(len(k) + 2 for k in rows))
    out = [title.ljust(width) + "".join(f"{c:>11}" for c in columns)]
    for key, row in rows.items():
        cells = ("-" if row.get(c) is None else str(row.get(c, 0)) for c in columns)
        out.append(f"  {key}".ljust(width) + "".join(f"{c:>11}" for c in cells))
    return out


def format_text(summary: Mapping[str, Any], path: str | Path | None = None) -> str:
    """The summary as the lines ``events summarize`` prints."""
    s = summary
    ranks = s["logged_by_ranks"]
    span = ("no steps" if s["first_step"] is None
            else f"steps {s['first_step']}..{s['last_step']}")
    lines = [f"event log {path}" if path is not None else "event log",
             f"  {s['records']} records" + (f" ({s['bad_lines']} bad line(s) skipped)"
                                            if s["bad_lines"] else "")
             + f", logged by ranks {ranks or 'unknown'}, {span}", ""]
    cols = ("detections", "repaired", "contained", "withheld", "first_step", "last_step")
    node_cols = ("detections", "repaired", "contained", *QUARANTINE_ACTIONS)
    lines += [*_table("by check", s["by_check"], cols), ""]
    lines += [*_table("by suspect rank", s["by_rank"], cols), ""]
    lines += [*_table("by node", s["by_node"], node_cols), ""]
    w = s["withheld_steps"]
    lines.append(f"withheld steps: {len(w)}" + (f" ({_steps(w)})" if w else ""))
    r = s["restore_steps"]
    lines.append(f"restores: {s['restores']}" + (f" (to steps {_steps(r)})" if r else ""))
    q = s["quarantine"]
    acts = ", ".join(f"{n} {a}" for a, n in q["actions"].items()) or "none"
    lines.append(f"quarantine: {acts}" + (f" ({q['dry_run']} dry run, {q['real']} real)"
                                          if q["actions"] else ""))
    inj = s["injections"]
    if inj["total"]:
        lines.append(f"injections: {inj['total']} ("
                     + ", ".join(f"{k} {v}" for k, v in inj["by_site"].items()) + ")")
    if s["other_events"]:
        lines.append("other records: " + ", ".join(f"{k} {v}" for k, v in s["other_events"].items()))
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    e = sub.add_parser("events", help="read a guard's event log",
                       description=(__doc__ or "").replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = e.add_subparsers(dest="verb", required=True)
    summ = verbs.add_parser("summarize", help="counts per check, per rank and per node")
    summ.add_argument("log", help="the event log (GuardConfig.event_log: JSON lines)")
    summ.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    path = Path(args.log)
    if not path.is_file():
        print(f"error: {path}: no such event log (give the file GuardConfig.event_log "
              "names)", file=sys.stderr)
        return 2
    problems: list[tuple[int, str]] = []
    try:
        records = read_events(path, problems=problems)
    except OSError as e:
        print(f"error: {path}: cannot be read ({e.strerror or e})", file=sys.stderr)
        return 2
    summary = summarize(records, bad_lines=len(problems))
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_text(summary, path))
    return 0
