"""``python -m bench.compare``: the bench's headline ratios for two source trees, measured
before and after interleaved in one run (``nox -s compare -- --before DIR``)::

    python -m bench.compare --before /path/to/base --after . [--quick] [--out bench]
                            [--rounds N] [--max-minutes 20] [--sections fingerprint,...]

Each round runs one measurement process per tree, the tree that goes first alternating
from round to round. A measurement process is this file's ``child``, started as
``python -c BOOT`` with ``cwd`` and ``PYTHONPATH`` set to its tree, so that the tree's own
``sdc_guard``, ``bench`` and ``scenarios`` are imported (an editable install of another
tree comes after both on the import path); every process reports where they came from,
its rank processes too, and a process whose modules lie outside its tree fails the run.
The process calls the tree's own section functions (``bench.fingerprint``,
``bench.overhead``, ``bench.replay``, ``bench.checksum``) with fewer rounds than ``python
-m bench`` and returns the headline ratios of ``ROWS``.

Per ratio the table gives each tree's median, after/before, and the difference
after - before with a 90% bootstrap interval (``bench.timing.bootstrap_interval``). The
unit resampled is one launch of rank processes: one measurement process of a round, or,
where a section runs several launches, each of them; the units of the two trees are paired
by their place in the run (round, then launch), as the bench pairs configurations within a
round, so a drift of the machine over the run moves both sides of a pair. A section that
reports its rounds (the block-timed sections: per rotation of their configurations) puts
each rotation's ratio in its launch's unit; the others give one value per launch. Writes
``OUT/compare.json`` (after every measurement process, so an interrupted run keeps what it
measured) and ``OUT/COMPARE.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.timing import bootstrap_interval, cpu_name

MARKER = "BENCH-COMPARE-REPORT "
"""The child's stdout line that carries its report (JSON), whatever else is printed."""

BOOT = ("import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('_bench_compare_child', sys.argv[1]); "
        "assert spec is not None and spec.loader is not None; "
        "mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; "
        "spec.loader.exec_module(mod); sys.exit(mod.child(sys.argv[2:]))")
"""What a measurement process runs (``python -c BOOT THIS_FILE PLAN``): this file loaded by
its path, so that the tree measured needs no copy of it, while every import it makes comes
from the tree (the working directory is first on the path of ``python -c``)."""

MODULES = ("sdc_guard", "bench", "scenarios")
"""What a measurement process must import from its own tree."""


@dataclass(frozen=True)
class Row:
    """One headline ratio of the table."""

    key: str
    section: str
    label: str
    better: str  # "higher" or "lower"
    meaning: str


ROWS: tuple[Row, ...] = (
    Row("fingerprint_c", "fingerprint", "fingerprint, C kernel / torch.sum", "higher",
        "Throughput of `sdc_guard.fingerprint` on the C kernel (its default instruction set) "
        "over `torch.sum` of the same float32 tensor, same threads (`bench.fingerprint`)."),
    Row("fingerprint_torch", "fingerprint", "fingerprint, torch path / torch.sum", "higher",
        "The same with the C kernel off (the torch-ops path a machine without a C compiler "
        "runs)."),
    Row("overhead_nonfinite", "overhead", "step: nonfinite / plain DDP", "lower",
        "Median step time with the non-finite check alone over plain DDP, reference MLP, "
        "3 ranks, a barrier around each step (`bench.overhead.check_overhead`)."),
    Row("overhead_weights", "overhead", "step: weights / plain DDP", "lower",
        "The same for the weights check alone (every step)."),
    Row("overhead_defaults", "overhead", "step: defaults (nonfinite + weights) / plain DDP",
        "lower", "The same for the guard's default checks together."),
    Row("replay", "replay", "replay: per audit step, measured / ideal", "lower",
        "What an audit step adds over the other steps, over what one plain forward+backward "
        "of the neighbour's batch adds (`bench.replay.replay_overhead`, the non-finite check "
        "on, 3 ranks): each interval's median over rounds, pooled over k = 1, 2, 5, 10, 50."),
    Row("guard_off", "guard_off", "guard, checks off / plain DDP (bucket views)", "lower",
        "Block-timed step time of the guard with its checks off over plain DDP built the same "
        "way (`gradient_as_bucket_view`), per rotation of the 4 configurations "
        "(`bench.overhead.check_guard_off`)."),
    Row("guard_off_copied", "guard_off", "guard, checks off / plain DDP (gradients copied)",
        "lower", "The same on DDP's default construction."),
    Row("checksum", "checksum", "defaults + checksum / defaults", "lower",
        "Block-timed step time of `GuardConfig(checksum=True)` over `GuardConfig()`, "
        "reference MLP, 3 ranks, per rotation (`bench.checksum.checksum_launches`)."),
)
SECTIONS = tuple(dict.fromkeys(r.section for r in ROWS))

Plan = dict[str, dict[str, Any]]
"""Section -> the keyword arguments of its function."""

QUICK: Plan = {
    "fingerprint": {"mib": 64, "rounds": 3},
    "overhead": {"world": 3, "rounds": 3, "block": 3, "batch": 128},
    "replay": {"world": 3, "rounds": 1, "batch": 128},
    "guard_off": {"world": 3, "rounds": 4, "block": 4, "batch": 128, "launches": 1},
    "checksum": {"world": 3, "rounds": 2, "block": 4, "batch": 128, "launches": 1},
}
FULL: Plan = {
    "fingerprint": {"mib": 256, "rounds": 5},
    "overhead": {"world": 3, "rounds": 6, "block": 8, "batch": 128},
    "replay": {"world": 3, "rounds": 1, "batch": 128},
    "guard_off": {"world": 3, "rounds": 8, "block": 16, "batch": 128, "launches": 1},
    "checksum": {"world": 3, "rounds": 16, "block": 16, "batch": 128, "launches": 1},
}
"""One measurement process of the full run: about 2.5 minutes on the bench's 2-core machine,
so 3 rounds of both trees stay under 20 minutes."""
ROUNDS = {"quick": 1, "full": 3}


# --- the measurement process (runs inside a tree) ------------------------------------------

def call_with(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Any, list[str]]:
    """``fn(**kwargs)`` with the arguments its signature does not name left out (a tree whose
    function lost or renamed an optional argument); returns the result and what was left out.
    A required argument the plan does not give is a clear error."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs), []
    named = {n for n, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    given = {k: v for k, v in kwargs.items() if k in named}
    missing = [n for n in named if n not in given and params[n].default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"{fn.__module__}.{fn.__qualname__}{inspect.signature(fn)} needs "
                        f"{missing}, which the compare's plan does not give")
    return fn(**given), sorted(set(kwargs) - named)


def signature(fn: Callable[..., Any]) -> str:
    """``fn``'s name and parameters, those with a default marked ``=...`` (their values, a
    configuration's repr among them, may differ between the trees without the call doing so)."""
    params = inspect.signature(fn).parameters.values()
    return f"{fn.__module__}.{fn.__qualname__}(" + ", ".join(
        p.name + ("=..." if p.default is not inspect.Parameter.empty else "") for p in params) + ")"


Units = list[list[float]]
"""A row's samples, one list per unit (a launch of rank processes)."""


def _per_rotation_ratio(res: dict[str, Any], on: str, base: str) -> Units:
    """Each rotation's ratio of means of ``on`` over ``base`` from a block-timed section's
    ``round_step_s``, one list per launch (as ``bench.overhead.block_stats`` takes them)."""
    from bench.timing import per_rotation, split_rounds

    rot = per_rotation({k: res["round_step_s"][k] for k in (on, base)}, res["rotation_rounds"])
    ratios = [a / b for a, b in zip(rot[on], rot[base], strict=True)]
    return split_rounds(ratios, res["launches"])


def _fingerprint_rows(res: dict[str, Any]) -> dict[str, Units]:
    rows = {}
    for key, prefix in (("fingerprint_c", "sdc_guard.fingerprint (C kernel, the default"),
                        ("fingerprint_torch", "sdc_guard.fingerprint (torch ops")):
        found = [m for name, m in res["methods"].items() if name.startswith(prefix)]
        if found:  # (no C kernel on a machine without a compiler)
            rows[key] = [[found[0]["ratio_to_sum"]]]
    return rows


def _overhead_rows(res: dict[str, Any]) -> dict[str, Units]:
    from scenarios.spec.overhead import ALWAYS_ON, NONFINITE, WEIGHTS

    over = res["overhead_vs_plain_ddp"]
    return {key: [[1.0 + over[oc.name]]] for key, oc in
            (("overhead_nonfinite", NONFINITE), ("overhead_weights", WEIGHTS),
             ("overhead_defaults", ALWAYS_ON))}


def _replay_rows(res: dict[str, Any]) -> dict[str, Units]:
    return {"replay": [[r["per_audit_step_ratio"] for r in res["intervals"].values()]]}


def _guard_off_rows(res: dict[str, Any]) -> dict[str, Units]:
    from bench.reference import CHECKS_OFF_COPIED, PLAIN_DDP_VIEWS
    from scenarios.spec.overhead import CHECKS_OFF, PLAIN_DDP

    return {"guard_off": _per_rotation_ratio(res, CHECKS_OFF.name, PLAIN_DDP_VIEWS.name),
            "guard_off_copied": _per_rotation_ratio(res, CHECKS_OFF_COPIED.name, PLAIN_DDP.name)}


def _checksum_rows(res: dict[str, Any]) -> dict[str, Units]:
    from bench.checksum import DEFAULTS, DEFAULTS_CHECKSUM

    return {"checksum": _per_rotation_ratio(res, DEFAULTS_CHECKSUM, DEFAULTS)}


def _section(name: str) -> tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]],
                                                                        dict[str, Units]]]:
    """The tree's function of section ``name`` and what takes its rows from its result."""
    if name == "fingerprint":
        from bench.fingerprint import fingerprint_throughput
        return fingerprint_throughput, _fingerprint_rows
    if name == "overhead":
        from bench.overhead import check_overhead
        return check_overhead, _overhead_rows
    if name == "replay":
        from bench.replay import replay_overhead
        return replay_overhead, _replay_rows
    if name == "guard_off":
        from bench.overhead import check_guard_off
        return check_guard_off, _guard_off_rows
    if name == "checksum":
        from bench.checksum import checksum_launches
        return checksum_launches, _checksum_rows
    raise ValueError(f"unknown section {name!r}; the sections are {', '.join(SECTIONS)}")


def module_paths(names: Iterable[str] = MODULES) -> dict[str, str]:
    """Where each of ``names`` is imported from in this process (or why it is not)."""
    import importlib

    out = {}
    for name in names:
        try:
            out[name] = str(Path(importlib.import_module(name).__file__ or "?").resolve())
        except Exception as e:  # reported, then refused by the parent
            out[name] = f"not importable: {type(e).__name__}: {e}"
    return out


def _rank_sdc_guard() -> str:
    """Where a process started as the ranks are (``run_ranks``'s fork server) imports
    ``sdc_guard`` from."""
    from scenarios.run.launch import mp_context

    with mp_context().Pool(1) as pool:
        path: str = pool.apply(eval, ("__import__('sdc_guard').__file__",))
    return str(Path(path).resolve())


def child(argv: list[str]) -> int:
    """The measurement process: ``argv`` is ``[PLAN]``, the JSON of ``{"sections": Plan,
    "probe_ranks": bool}``; prints ``MARKER`` and its report (JSON) as the last line."""
    plan = json.loads(argv[0])
    report: dict[str, Any] = {"paths": module_paths(), "cwd": os.getcwd(), "sections": {}}
    if plan.get("probe_ranks"):
        report["rank_sdc_guard"] = _rank_sdc_guard()
    for name, kwargs in plan["sections"].items():
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        try:
            fn, rows = _section(name)
            out["signature"] = signature(fn)
            res, out["dropped"] = call_with(fn, kwargs)
            out["rows"] = rows(res)
        except Exception:
            out["error"] = traceback.format_exc(limit=-4)
        out["seconds"] = time.perf_counter() - t0
        report["sections"][name] = out
        print(f"[compare] {name}: {out['seconds']:.1f} s"
              + (" (error)" if "error" in out else ""), file=sys.stderr, flush=True)
    if "torch" in sys.modules:
        import torch
        report["torch"] = torch.__version__
        report["threads"] = torch.get_num_threads()
    print(MARKER + json.dumps(report), flush=True)
    return 0


# --- the parent: runs the children, pairs them, writes the table ------------------------

def parse_report(stdout: str) -> dict[str, Any]:
    """The report in a measurement process's ``stdout`` (its last ``MARKER`` line)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            found: dict[str, Any] = json.loads(line[len(MARKER):])
            return found
    raise ValueError("the measurement process printed no report; its output ends:\n"
                     + "\n".join(stdout.splitlines()[-20:]))


def check_paths(report: dict[str, Any], tree: Path) -> None:
    """Refuse a report whose modules (and ranks' ``sdc_guard``) are not its tree's own."""
    root = tree.resolve()
    found = dict(report["paths"])
    if "rank_sdc_guard" in report:
        found["sdc_guard (in a rank)"] = report["rank_sdc_guard"]
    wrong = {k: v for k, v in found.items() if not Path(v).is_absolute()
             or not Path(v).resolve().is_relative_to(root)}
    if wrong:
        raise RuntimeError(f"the measurement process of {root} imported modules from outside "
                           f"it: {wrong}; its cwd and PYTHONPATH should have put the tree "
                           "first on the import path")


def run_child(tree: Path, plan: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    """One measurement process in ``tree`` (its own modules checked); returns its report."""
    root = tree.resolve()
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", BOOT, str(Path(__file__).resolve()),
                           json.dumps(plan)], cwd=root, env=env, stdout=subprocess.PIPE,
                          text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"the measurement process of {root} exited with {proc.returncode}; "
                           "its output ends:\n" + "\n".join(proc.stdout.splitlines()[-20:]))
    report = parse_report(proc.stdout)
    check_paths(report, root)
    return report


def units(reports: list[dict[str, Any]], key: str, section: str) -> Units:
    """Row ``key``'s units over a tree's measurement processes, in the order they ran."""
    out: Units = []
    for rep in reports:
        out += rep["sections"].get(section, {}).get("rows", {}).get(key, [])
    return out


def difference_interval(before: Units, after: Units) -> tuple[float, float] | None:
    """A 90% bootstrap interval of median(after) - median(before), resampling the paired
    units (``bench.timing.bootstrap_interval``); None with fewer than 3 pairs or unpaired
    units (a measurement process that failed on one side)."""
    if len(before) != len(after) or len(before) < 3:
        return None

    def diff(m: dict[str, list[float]]) -> float:
        return statistics.median(m["after"]) - statistics.median(m["before"])

    lo, hi = bootstrap_interval({"before": before, "after": after}, diff)
    return lo, hi


def verdict(row: Row, interval: tuple[float, float] | None) -> str:
    """Whether the interval of the difference shows ``after`` worse, better, or neither."""
    if interval is None:
        return "-"
    lo, hi = interval
    worse, better = (lo > 0, hi < 0) if row.better == "lower" else (hi < 0, lo > 0)
    return "worse" if worse else "better" if better else "no difference shown"


def summarize(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row of ``ROWS``: each tree's median over its pooled samples, after/before, the
    difference and its interval (see ``difference_interval``), and the verdict."""
    rows = []
    for row in ROWS:
        b, a = units(before, row.key, row.section), units(after, row.key, row.section)
        bs, as_ = [x for u in b for x in u], [x for u in a for x in u]
        bm = statistics.median(bs) if bs else None
        am = statistics.median(as_) if as_ else None
        interval = difference_interval(b, a)
        rows.append({"key": row.key, "section": row.section, "label": row.label,
                     "better": row.better,
                     "before": bm, "after": am,
                     "after_over_before": am / bm if am is not None and bm else None,
                     "difference": am - bm if am is not None and bm is not None else None,
                     "difference_interval_90": interval, "units": [len(b), len(a)],
                     "samples": [len(bs), len(as_)], "verdict": verdict(row, interval)})
    return rows


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(res: dict[str, Any]) -> str:
    """COMPARE.md: the machine, both trees, the table, what each ratio means, the notes."""
    trees = res["trees"]
    lines = [f"# Before/after: the bench's headline ratios ({res['cpu']})", "",
             f"`python -m bench.compare{' --quick' if res['quick'] else ''}`, {res['rounds']} "
             f"round(s), each one measurement process per tree, the first alternating; "
             f"torch {res.get('torch', '?')}, {res.get('threads', '?')} threads; "
             f"{res['seconds'] / 60:.1f} minutes in all.", ""]
    for side in ("before", "after"):
        t = trees[side]
        lines.append(f"- **{side}**: `{t['path']}` at commit {t['commit']}"
                     + (f" with {t['changes']} changed or new paths" if t["changes"] else "")
                     + f" (sources sha256 {t['digest'][:12]})")
    lines += ["", "| ratio | better | before | after | after/before | after - before "
              "(90% interval) | units | verdict |", "|---|---|---|---|---|---|---|---|"]
    measured = res.get("plan", SECTIONS)  # (--sections: the others are not shown)
    for r in res["rows"]:
        if r["section"] not in measured:
            continue
        iv = r["difference_interval_90"]
        diff = _num(r["difference"], "+.4f") + (
            f" ({iv[0]:+.4f} .. {iv[1]:+.4f})" if iv else "")
        lines.append(f"| {r['label']} | {r['better']} | {_num(r['before'])} | "
                     f"{_num(r['after'])} | {_num(r['after_over_before'])} | {diff} | "
                     f"{r['units'][0]} / {r['units'][1]} | {r['verdict']} |")
    lines += ["", "Each value is a ratio (1.0 = equal; the overheads are step-time ratios, so "
              "1.12 is +12%): the median over the tree's pooled samples. The interval is a 90% "
              "bootstrap interval of the difference of medians over the paired units (a launch "
              "of rank processes: one measurement process, or each launch of a section that "
              "runs several; the block-timed rows sample each rotation within it); none with "
              "fewer than 3 pairs. \"units\": before / after. The verdict says whether the "
              "interval excludes no change.", ""]
    lines += [f"- **{row.label}**: {row.meaning}" for row in ROWS if row.section in measured]
    notes = res.get("notes", [])
    if notes:
        lines += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    lines += ["", "Seconds per section (median over the measurement processes): "
              + "; ".join(f"{s} {side} {v:.0f}" for s, per in res["section_seconds"].items()
                          for side, v in per.items()) + "."]
    return "\n".join(lines) + "\n"


def tree_info(tree: Path) -> dict[str, Any]:
    """The tree's commit, how many paths differ from it, and a digest of the sources
    measured (``sdc_guard``, ``bench``, ``scenarios``), committed or not."""
    root = tree.resolve()

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    status = git("status", "--porcelain")
    return {"path": str(root), "commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "changes": len(status.splitlines()) if status else 0,
            "digest": source_digest(root)}


def source_digest(root: Path, dirs: Iterable[str] = MODULES) -> str:
    """sha256 over the relative paths and contents of the ``.py``, ``.c`` and ``.h`` files
    under ``dirs`` of ``root``."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted((root / d).rglob("*")):
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts and p.is_file():
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _notes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """What differed between the trees' section functions, and any section that failed."""
    notes = []
    for section in SECTIONS:
        sig = {side: {r["sections"][section].get("signature") for r in reps
                      if section in r["sections"]} - {None}
               for side, reps in (("before", before), ("after", after))}
        if sig["before"] != sig["after"]:
            notes.append(f"{section}: the function differs between the trees: before "
                         f"{sorted(sig['before'])}, after {sorted(sig['after'])}")
        for side, reps in (("before", before), ("after", after)):
            dropped = {d for r in reps for d in r["sections"].get(section, {}).get("dropped", [])}
            if dropped:
                notes.append(f"{section}, {side}: the function takes no {sorted(dropped)}; "
                             "left out")
            errors = [r["sections"][section]["error"] for r in reps
                      if "error" in r["sections"].get(section, {})]
            if errors:
                notes.append(f"{section}, {side}: failed in {len(errors)} of {len(reps)} "
                             f"processes: {errors[-1].strip().splitlines()[-1]}")
    return notes


def _section_seconds(reports: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per section and tree, the median seconds of its measurement processes."""
    out: dict[str, dict[str, float]] = {}
    for side, reps in reports.items():
        for s in dict.fromkeys(s for r in reps for s in r["sections"]):
            out.setdefault(s, {})[side] = statistics.median(
                r["sections"][s]["seconds"] for r in reps if s in r["sections"])
    return out


def result(trees: dict[str, dict[str, Any]], reports: dict[str, list[dict[str, Any]]],
           *, quick: bool, rounds: int, plan: Plan, order: list[list[str]],
           seconds: float) -> dict[str, Any]:
    """``compare.json``: everything ``markdown`` shows, and every process's report."""
    first = next((r for reps in reports.values() for r in reps), {})
    return {"cpu": cpu_name(), "python": platform.python_version(),
            "torch": first.get("torch"), "threads": first.get("threads"),
            "quick": quick, "rounds": len(order), "rounds_asked": rounds, "plan": plan,
            "order": order,
            "trees": trees, "seconds": seconds,
            "rows": summarize(reports["before"], reports["after"]),
            "notes": _notes(reports["before"], reports["after"]),
            "section_seconds": _section_seconds(reports), "reports": reports}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the tree before the change (a checkout)")
    ap.add_argument("--after", default=".", help="the tree after it (default: .)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes")
    ap.add_argument("--out", default="bench", help="directory for compare.json and COMPARE.md")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"rounds (default {ROUNDS['full']}, --quick {ROUNDS['quick']})")
    ap.add_argument("--max-minutes", type=float, default=20.0,
                    help="start no round that would, at the pace of those before, end later "
                         "than this (default 20)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated sections to measure (default all: "
                         + ", ".join(SECTIONS) + ")")
    args = ap.parse_args(argv)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for side, path in trees.items():
        if not (path / "sdc_guard").is_dir() or not (path / "bench").is_dir():
            ap.error(f"--{side} {path}: not a source tree (no sdc_guard/ and bench/ in it)")
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        ap.error(f"--sections: unknown {unknown}; the sections are {', '.join(SECTIONS)}")
    rounds = args.rounds if args.rounds is not None else ROUNDS["quick" if args.quick else "full"]
    if rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {rounds})")
    base = QUICK if args.quick else FULL
    plan: Plan = {s: base[s] for s in sections}
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = {side: tree_info(path) for side, path in trees.items()}
    reports: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    order: list[list[str]] = []
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    stopped: list[str] = []
    for r in range(rounds):
        spent = time.perf_counter() - t0
        if r and spent / r * (r + 1) > args.max_minutes * 60:
            stopped.append(f"stopped after {r} of {rounds} rounds: at {spent / r:.0f} s a round, "
                           f"the next would end after --max-minutes {args.max_minutes:g}")
            print(stopped[-1], file=sys.stderr, flush=True)
            break
        sides = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        order.append(sides)
        for side in sides:
            print(f"round {r + 1}/{rounds}: {side} ({trees[side]})", file=sys.stderr, flush=True)
            t1 = time.perf_counter()
            reports[side].append(run_child(trees[side], {"sections": plan, "probe_ranks": True}))
            print(f"round {r + 1}/{rounds}: {side} took {time.perf_counter() - t1:.0f} s",
                  file=sys.stderr, flush=True)
            res = result(info, reports, quick=args.quick, rounds=rounds, plan=plan,
                         order=order, seconds=time.perf_counter() - t0)
            (out / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
        if r == 0 and rounds > 1:
            print(f"one round took {time.perf_counter() - t0:.0f} s: about "
                  f"{(time.perf_counter() - t0) * rounds / 60:.1f} minutes in all",
                  file=sys.stderr, flush=True)
    if stopped:
        res["notes"] = stopped + res["notes"]
        (out / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "COMPARE.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
