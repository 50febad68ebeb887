"""``python -m bench.shards``: what sharding a campaign costs.

The campaign (default: the default campaign with ``--quick``) runs whole, then as N shards,
one after the other (this machine's 2 cores cannot run N shards of 3 ranks at once), each in
a fresh process and output directory, order alternated round by round. The target: each
shard alone takes at most ``T / N`` plus one golden run per scenario it needs and one process
start (``T``: the unsharded wall time). Goldens, the overhead measurement (shard 0 only) and
process starts are read from each run's ``campaign.json`` and measured here.

Like for like: the whole campaign runs with ``--no-report`` because a shard writes none
(``merge`` writes the campaign's report); the merge of each round's shards is timed on its
own (``merge_s``) and its ``trials.csv`` compared with the whole run's, trial for trial. The
C fingerprint kernel is built before anything is timed (a first build would slow whichever
run came first). Writes ``OUT/shards.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.timing import cpu_name


def _run(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "scenarios", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _start_s() -> float:
    """A bare process start that imports the harness (what every shard pays once)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import scenarios.run.runner"], check=True)
    return time.perf_counter() - t0


def _warm_up() -> None:
    """Build (or find) the C fingerprint kernel and read the harness's files once, untimed."""
    subprocess.run([sys.executable, "-c", "import scenarios.run.runner, sdc_guard; "
                    "sdc_guard.native_enabled()"], check=True)


_TIMES = {"seconds", "fault_to_cordon_s", "fault_to_resume_s"}


def _rows(path: Path) -> list[dict[str, str]]:
    """A trials.csv in order, without its wall-clock columns."""
    with path.open() as fh:
        return [{k: v for k, v in r.items() if k not in _TIMES} for r in csv.DictReader(fh)]


def _differences(whole: list[dict[str, str]], merged: list[dict[str, str]]) -> list[str]:
    """Where the merged shards' trials differ from the whole run's: ``id column: a != b``."""
    if [r["id"] for r in whole] != [r["id"] for r in merged]:
        return [f"trial ids or their order differ ({len(whole)} against {len(merged)} rows)"]
    return [f"{a['id']} {k}: {a[k]!r} != {b.get(k)!r}"
            for a, b in zip(whole, merged, strict=True) for k in a if a[k] != b.get(k)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shards", description=__doc__.splitlines()[0])
    ap.add_argument("--campaign", default="scenarios/configs/default.toml")
    ap.add_argument("--full", action="store_true", help="the whole campaign, not --quick")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    n = args.shards
    quick = [] if args.full else ["--quick"]
    rows: list[dict[str, Any]] = []
    _warm_up()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            runs = [("whole", None), *((f"shard {i}", i) for i in range(n))]
            if rnd % 2:
                runs.reverse()
            rec: dict[str, Any] = {}
            dirs: dict[str, Path] = {}
            for name, i in runs:
                out = dirs[name] = Path(tmp) / f"r{rnd}-{name.replace(' ', '')}"
                extra = ["--no-report"] if i is None else ["--shard", f"{i}/{n}"]
                secs = _run(["campaign", args.campaign, *quick, "--out", str(out), *extra,
                             "--no-progress"])
                meta = json.loads((out / "campaign.json").read_text())
                goldens = sum(g.get("seconds") or 0.0 for g in (meta.get("goldens") or {}).values())
                overhead = json.loads((out / "overhead.json").read_text())["seconds"] if (
                    out / "overhead.json").exists() else 0.0
                rec[name] = {"seconds": secs, "trials": len(meta["planned_ids"]),
                             "golden_s": goldens, "overhead_s": overhead}
            merged = Path(tmp) / f"r{rnd}-merged"
            rec["merge_s"] = _run(["merge", str(merged),
                                   *(str(dirs[f"shard {i}"]) for i in range(n))])
            rec["merged_differs"] = _differences(_rows(dirs["whole"] / "trials.csv"),
                                                 _rows(merged / "trials.csv"))
            for d in [*dirs.values(), merged]:
                shutil.rmtree(d)
            rec["start_s"] = statistics.median(_start_s() for _ in range(3))
            rows.append(rec)
    whole = statistics.median(r["whole"]["seconds"] for r in rows)
    start = statistics.median(r["start_s"] for r in rows)
    merge_s = statistics.median(r["merge_s"] for r in rows)
    differs = [d for r in rows for d in r["merged_differs"]]
    same = not differs
    result: dict[str, Any] = {
        "machine": cpu_name(), "shards": n,
        "campaign": args.campaign + ("" if args.full else " --quick"), "rounds": args.rounds,
        "report": "none in the timed runs: the whole runs with --no-report, a shard writes "
                  "none; the merge writes the campaign's (merge_s)",
        "whole_s": whole, "whole_samples_s": [r["whole"]["seconds"] for r in rows],
        "start_s": start, "merge_s": merge_s,
        "merged_equals_whole": same, "merged_differs": differs, "per_shard": {},
    }
    print(f"whole campaign: {whole:.1f} s; a process start: {start:.2f} s; the merge and its "
          f"report: {merge_s:.1f} s; merged trials.csv {'equals' if same else 'DIFFERS FROM'} "
          "the whole run's")
    for i in range(n):
        name = f"shard {i}"
        secs = statistics.median(r[name]["seconds"] for r in rows)
        golden = statistics.median(r[name]["golden_s"] for r in rows)
        overhead = statistics.median(r[name]["overhead_s"] for r in rows)
        bound = whole / n + golden + start
        result["per_shard"][name] = {
            "seconds": secs, "samples_s": [r[name]["seconds"] for r in rows],
            "trials": rows[0][name]["trials"], "golden_s": golden,
            "overhead_measurement_s": overhead, "bound_s": bound, "within": secs <= bound,
        }
        print(f"{name}: {secs:.1f} s for {rows[0][name]['trials']} trials; bound T/{n} + "
              f"golden {golden:.1f} s + start {start:.2f} s = {bound:.1f} s; "
              f"{'within' if secs <= bound else 'OVER'} (its overhead measurement: "
              f"{overhead:.1f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shards.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
