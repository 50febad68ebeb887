"""``python -m tests.attack [--out reports] [--workers N] [--retry-failed]``: run every
attack's test of ``tests.attack.catalogue`` in one pytest run, classify each outcome and write
``OUT/ATTACK.md`` and ``OUT/attack.json``.

A passed test is "handled well"; a failed or errored one counts as the failure its attack
guards against, except a pytest-timeout timeout or a rank that never answered ("hung") and a
rank that died ("crashed"); a skipped one is listed as skipped with its reason, not handled
well. The total line is printed; the exit status is 1 when any attack is not handled well.
``--retry-failed`` runs again only the attacks OUT/attack.json records as not handled well
(a timeout on a machine others share may be the machine's) and rewrites both files.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tests.attack.catalogue import AREAS, ATTACKS, FAILURES, Attack

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: pytest runs there, and the node ids are relative to it."""

HANDLED = "handled well"
SKIPPED = "skipped"
COLUMNS = ("tried", HANDLED, *FAILURES, SKIPPED)
"""The table's columns, in issue 60's order, with the skipped beside them."""


def node_id(classname: str, name: str) -> str:
    """The pytest node id of a JUnit test case (``tests.a.test_b`` + ``test_c[x]``)."""
    return classname.replace(".", "/") + ".py::" + name


def classify(attack: Attack, kind: str, message: str) -> str:
    """The outcome of one attack from its test's JUnit result: ``kind`` is ``"passed"``,
    ``"failure"``, ``"error"`` or ``"skipped"``, ``message`` what pytest said about it."""
    if kind == "passed":
        return HANDLED
    if kind == "skipped":
        return SKIPPED
    if "Timeout" in message and ("pytest-timeout" in message or "Failed: Timeout" in message
                                 or "+++ Timeout +++" in message):
        return "hung"
    if "RankFailure: no result within" in message or message.startswith("no result within"):
        return "hung"
    if "died with exit code" in message:
        return "crashed"
    return attack.guards_against


def read_junit(path: Path) -> dict[str, tuple[str, str, float]]:
    """Each test case of a JUnit XML file: node id -> (kind, message, seconds)."""
    out: dict[str, tuple[str, str, float]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = child.tag
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        nid = node_id(case.get("classname", ""), case.get("name", ""))
        out[nid] = (kind, message.strip(), float(case.get("time") or 0.0))
    return out


def run_pytest(ids: Sequence[str], workers: int) -> tuple[int, dict[str, tuple[str, str, float]]]:
    """One pytest run of ``ids`` at the repository root: its exit status and its cases."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "attack.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider",
               "-q", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
        if workers > 1 and importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", str(workers)]
        rc = subprocess.run([*cmd, *ids], cwd=ROOT, check=False).returncode
        return rc, read_junit(xml) if xml.exists() else {}


def first_line(message: str) -> str:
    line = next((s for s in message.splitlines() if s.strip()), "")
    return line[:300]


def judge(attacks: Iterable[Attack], cases: dict[str, tuple[str, str, float]],
          rc: int) -> list[dict[str, Any]]:
    """One record per attack: the attack, its outcome and what pytest said."""
    records = []
    for a in attacks:
        kind, message, seconds = cases.get(
            a.test, ("error", f"no result for this test (pytest exit status {rc})", 0.0))
        records.append({"area": a.area, "what": a.what, "guards_against": a.guards_against,
                        "test": a.test, "outcome": classify(a, kind, message),
                        "detail": "" if kind == "passed" else first_line(message),
                        "seconds": round(seconds, 2)})
    return records


def table(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per area and in total: how many were tried and how many had each outcome."""
    rows: dict[str, dict[str, int]] = {}
    for area in (*AREAS, "total"):
        mine = [r for r in records if area in (r["area"], "total")]
        rows[area] = {c: sum(1 for r in mine if r["outcome"] == c) for c in COLUMNS[1:]}
        rows[area] = {"tried": len(mine), **rows[area]}
    return rows


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_line(rows: dict[str, dict[str, int]]) -> str:
    t = rows["total"]
    return "attack: " + ", ".join(f"{t[c]} {c}" for c in COLUMNS)


def markdown(report: dict[str, Any]) -> str:
    rows = report["table"]
    out = ["# The attack table (issue 60)", "",
           f"Generated by `python -m tests.attack` (`nox -s attack`) on {report['date']}: "
           f"torch {report['torch']}, Python {report['python']}, CPU {report['cpu']}, "
           f"pytest with {report['workers']} worker(s).", "",
           "Each attack is an existing test that performs it and asserts the good behaviour "
           "(`tests/attack/catalogue.py`). Passed: handled well; failed: the failure it guards "
           "against (a timeout: hung; a rank that died: crashed); skipped: listed apart.", "",
           f"**{total_line(rows)}**", "",
           "| area | " + " | ".join(COLUMNS) + " |",
           "|---" * (len(COLUMNS) + 1) + "|"]
    for area in (*AREAS, "total"):
        name = f"**{area}**" if area == "total" else area
        out.append(f"| {name} | " + " | ".join(str(rows[area][c]) for c in COLUMNS) + " |")
    bad = [r for r in report["attacks"] if r["outcome"] != HANDLED]
    if bad:
        out += ["", "## Not handled well", ""]
        out += [f"- **{r['outcome']}** ({r['area']}): {r['what']}: `{r['test']}`: "
                f"{r['detail']}" for r in bad]
    for area in AREAS:
        out += ["", f"## {area}", "", "| outcome | attack | guards against | test |",
                "|---|---|---|---|"]
        out += [f"| {r['outcome']} | {r['what']} | {r['guards_against']} | "
                f"`{r['test'].replace('|', '&#124;')}` |"
                for r in report["attacks"] if r["area"] == area]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.attack", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "reports",
                        help="where ATTACK.md and attack.json go (default: reports)")
    parser.add_argument("--workers", type=int, default=2,
                        help="pytest-xdist workers when it is installed (default: 2)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run again only the attacks OUT/attack.json records as not "
                             "handled well")
    args = parser.parse_args(argv)
    import torch

    attacks = list(ATTACKS)
    previous: dict[str, dict[str, Any]] = {}
    if args.retry_failed:
        saved = args.out / "attack.json"
        if not saved.exists():
            parser.error(f"--retry-failed: {saved} does not exist; run without it first.")
        previous = {r["test"]: r for r in json.loads(saved.read_text())["attacks"]}
        attacks = [a for a in attacks if previous.get(a.test, {}).get("outcome") != HANDLED]
    rc, cases = run_pytest([a.test for a in attacks], args.workers) if attacks else (0, {})
    fresh = {r["test"]: r for r in judge(attacks, cases, rc)}
    records = [fresh.get(a.test) or previous[a.test] for a in ATTACKS]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model(),
        "workers": args.workers, "retried": sorted(fresh) if args.retry_failed else [],
        "table": table(records), "attacks": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attack.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "ATTACK.md").write_text(markdown(report))
    print(total_line(report["table"]))
    return 0 if report["table"]["total"][HANDLED] == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
