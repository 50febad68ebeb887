"""``python -m bench`` (``nox -s bench``): fingerprint throughput and per-check step-time overhead.

Every number is a median over alternated repetitions measured in one run, and is
written next to the ratio it is judged by. Results go to ``bench/results.json`` and
``bench/RESULTS.md`` (quoted in the README)::

    python -m bench [--quick] [--out bench] [--only SECTION,...]

``--only`` re-measures the named sections of an earlier full run (its ``results.json``, on
the same machine) and keeps the others; RESULTS.md then names the sections measured
later, with the commit and date of that run.

The parts: ``fingerprint`` (throughput), ``overhead`` (per check, per step and in
blocks; the guard with its checks off beside plain DDP), ``replay`` (the replay audit
against its ideal; also with glibc's heap trimming off), ``replay_exchange`` (where the audit
posts its ring exchange),
``results`` (RESULTS.md);
``reference`` (the workload) and ``timing`` (repetitions, bootstrap intervals).
``python -m bench.throughput`` measures the campaign harness, ``python -m
bench.device_check`` checks a machine with an accelerator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.checksum import checksum_launches, checksum_overhead
from bench.fingerprint import fingerprint_throughput
from bench.overhead import NO_TRIM, check_guard_off, check_overhead, check_overhead_blocks
from bench.replay import replay_overhead
from bench.replay_exchange import replay_exchange
from bench.results import markdown
from bench.timing import cpu_name


def machine_name() -> str:
    """What ``results.json`` says it was measured on: the CPU, threads and torch."""
    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller tensor")
    ap.add_argument("--out", default="bench", help="directory for results.json and RESULTS.md")
    ap.add_argument("--only", default="",
                    help="comma-separated sections to measure again in an earlier full run's "
                         "results.json (same machine), keeping the others: "
                         + ", ".join(SECTIONS))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    only = [s for s in args.only.split(",") if s]
    # What is measured: taken now, before any later edit of the tree.
    when = {"commit": _commit(), "date": time.strftime("%Y-%m-%d")} if only else {}
    if only:
        results = _earlier(out / "results.json", only, machine, args.quick, ap)
    else:
        results = {"machine": machine, "quick": args.quick}
    if not only or "fingerprint" in only:
        results["fingerprint"] = fingerprint_throughput(64 if args.quick else 256,
                                                        3 if args.quick else 9)
        print(json.dumps(results["fingerprint"], indent=1))
    runs = _runs(args.quick)
    for key, measure in runs:
        if only and key not in only:
            continue
        results[key] = measure()
        print(json.dumps(results[key], indent=1))
    if only:
        results.setdefault("measured_later", {}).update({key: when for key in only})
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "RESULTS.md").write_text(markdown(results))
    print((out / "RESULTS.md").read_text())
    return 0


def _runs(q: bool) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The sections after the fingerprint's, in the order they run (``q``: ``--quick``)."""
    return [
        ("overhead", lambda: check_overhead(3, rounds=3 if q else 24, block=3 if q else 8,
                                            batch=128)),
        ("overhead_blocks", lambda: check_overhead_blocks(3, rounds=4 if q else 48,
                                                          block=8 if q else 24, batch=128)),
        # The guard with its checks off against a 0.5% target: its 90% intervals were about
        # +-1.2% wide at 120 rounds, so four times the rounds (about half as wide). Single
        # runs of 480 rounds disagreed by more than their intervals (+1.47%, +0.88%, +0.72%):
        # the allocator's draw per process, so launches (block_stats): 10 launches of 48 rounds
        # still left intervals about 0.5% wide, and 24 rounds a launch widened them (the
        # rounds of one launch vary too), so launches of 48. With 20, the intervals were still
        # about 0.6% wide (the blocks' own noise, 4% a block on 2 cores), so 40.
        ("guard_off", lambda: check_guard_off(3, rounds=8 if q else 1920, block=8 if q else 16,
                                              batch=128, launches=2 if q else 40)),
        ("guard_off_no_trim", lambda: check_guard_off(
            3, rounds=8 if q else 480, block=8 if q else 16, batch=128, allocator=NO_TRIM,
            launches=2 if q else 10)),
        ("checksum", lambda: checksum_overhead(3, rounds=7 if q else 49, block=4 if q else 16)),
        # The comparison alone, in launches: one process's allocator draw moved the
        # guard_off ratios by more than their intervals (block_stats).
        ("checksum_launches", lambda: checksum_launches(
            3, rounds=4 if q else 480, block=4 if q else 16, launches=2 if q else 20)),
        # The headline replay section (the target): four times the rounds of the
        # others, as its per-audit-step medians moved by about 0.1 from one 12-round run to
        # the next, and still by up to 0.2 between two 24-round runs of one commit.
        ("replay", lambda: replay_overhead(3, rounds=3 if q else 48, batch=128)),
        ("replay_no_trim", lambda: replay_overhead(3, rounds=3 if q else 12, batch=128,
                                                   allocator=NO_TRIM)),
        ("replay_exchange", lambda: replay_exchange(3, rounds=2 if q else 30,
                                                    block=2 if q else 10)),
        ("replay_alone", lambda: replay_overhead(3, rounds=3 if q else 12, batch=128,
                                                 nonfinite=False)),
        ("overhead_world2", lambda: check_overhead(2, rounds=3 if q else 6, block=3 if q else 8,
                                                   batch=128)),
        ("replay_world2", lambda: replay_overhead(2, rounds=3 if q else 12, batch=128)),
        ("replay_world1", lambda: replay_overhead(1, rounds=3 if q else 12, batch=128)),
        ("replay_world1_torch", lambda: replay_overhead(1, rounds=3 if q else 12, batch=128,
                                                        native=False)),
    ]


SECTIONS = ("fingerprint", *(key for key, _ in _runs(False)))
"""What ``--only`` may name: the keys of ``results.json``, in the order they are measured."""


def _earlier(path: Path, only: list[str], machine: str, quick: bool,
             ap: argparse.ArgumentParser) -> dict[str, Any]:
    """The full run that ``--only`` amends; a clear error if it cannot be amended."""
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; the sections are {', '.join(SECTIONS)}")
    if not path.exists():
        ap.error(f"--only amends an earlier full run, and {path} does not exist: run "
                 "`python -m bench` without --only first")
    results: dict[str, Any] = json.loads(path.read_text())
    if results.get("machine") != machine or bool(results.get("quick")) != quick:
        ap.error(f"--only: {path} was measured on {results.get('machine')!r} "
                 f"(quick={bool(results.get('quick'))}), this run is {machine!r} "
                 f"(quick={quick}); sections from two machines or settings are not comparable: "
                 "run the whole bench here (without --only)")
    return results


def _commit() -> str:
    """The checked-out commit (short), with '+' when the tree has changes; 'unknown' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True,
                               cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


if __name__ == "__main__":
    raise SystemExit(main())
