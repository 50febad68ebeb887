"""``python -m scenarios``: run scenarios and campaigns, write and rebuild reports.

    python -m scenarios run FILE [--out DIR]              one scenario: golden + its faults
    python -m scenarios campaign FILE [--quick] [--out DIR] [--no-report]
    python -m scenarios campaign FILE --shard I/N --out DIR   a 1/N of it (docs/cluster.md)
    python -m scenarios merge OUT DIR...                  the shards into one campaign + report
    python -m scenarios report DIR [--overhead-file FILE] rebuild summary.json, report.md/html
    python -m scenarios check FILE                        validate a scenario or campaign file

Ranks start on this machine (a persistent pool, gloo on 127.0.0.1 or nccl with
one GPU each), or, when the environment names this process's rank (RANK and
WORLD_SIZE, as ``torchrun`` sets them), this process is one of the ranks.

A bad scenario or campaign file prints one line naming the file, the field, the
bad value and what is allowed, and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from scenarios.run.outlock import hold_output
from scenarios.run.pool import PoolError
from scenarios.run.shards import merge, parse_shard
from scenarios.spec.campaign import CampaignSpec, campaign_for_scenario, load_campaign
from scenarios.spec.cluster import add_cluster_arguments, cluster_overrides
from scenarios.spec.errors import ScenarioError
from scenarios.spec.scenario import load_scenario
from scenarios.spec.tables import read_toml
from scenarios.spec.trials import check_trial_count, plan_trials


def _run_campaign(campaign: CampaignSpec, out: Path, cache: str | None, progress: bool,
                  shard: tuple[int, int] | None = None, report: bool = True) -> int:
    """Run it; the report unless ``report`` is False or this is a shard (``merge`` writes the
    report of the whole campaign; a shard's own would describe a part of the sample). The
    report is written while the run still holds ``OUT/.lock``."""
    from scenarios.report.render import summary_text, write_report
    from scenarios.run.runner import run_campaign

    def then() -> None:
        if shard is not None:
            print(f"shard {shard[0]}/{shard[1]} done: {out}; merge every shard's directory "
                  "into the campaign and its report with: python -m scenarios merge OUT DIR...")
        elif report:
            print(summary_text(write_report(out, None, _overhead_file(out, None)), out))
        else:
            print(f"campaign done: {out} (no report; python -m scenarios report {out} writes "
                  "it)")

    run_campaign(campaign, out, cache=cache, progress=progress, shard=shard, then=then)
    return 0


def _count(campaign: CampaignSpec, file: str) -> int:
    """The campaign's planned trials, counted before any is built; beyond
    ``scenarios.spec.limits.MAX_TRIALS`` a ``ScenarioError`` located in ``file``."""
    try:
        return check_trial_count(campaign)
    except ScenarioError as e:
        raise e.in_file(file) from None


def _load_campaign(file: str, quick: bool = False, full: bool = False) -> CampaignSpec:
    """``load_campaign`` with ``[cluster] overhead_file`` made absolute, relative to ``file``
    (``ClusterSpec.resolved``): a missing file is refused before anything runs."""
    camp = load_campaign(file, quick=quick, full=full)
    if camp.cluster is None or camp.cluster.overhead_file is None:
        return camp
    try:
        return replace(camp, cluster=camp.cluster.resolved(Path(file).parent))
    except ScenarioError as e:
        raise e.in_file(file) from None


def _overhead_file(out: Path, given: str | None) -> str | None:
    """The overhead file the report of ``out`` reads: ``--overhead-file`` when given, else
    the campaign's ``[cluster] overhead_file`` (absolute in ``campaign.json``)."""
    if given is not None:
        return given
    try:
        meta: Any = json.loads((out / "campaign.json").read_text())
    except (OSError, ValueError):
        return None
    cluster = meta.get("cluster") if isinstance(meta, dict) else None
    path = cluster.get("overhead_file") if isinstance(cluster, dict) else None
    return path if isinstance(path, str) else None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scenarios",
                                 description=__doc__.splitlines()[0].replace("``", ""))
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one scenario file: golden run and its faults")
    run.add_argument("file")
    run.add_argument("--out", help="output directory (default: runs/<scenario name>)")
    run.add_argument("--clean", type=int, default=1, help="clean trials (false positives)")
    camp = sub.add_parser("campaign", help="run a campaign file (resumes where it stopped)")
    camp.add_argument("file")
    camp.add_argument("--quick", action="store_true", help="apply the file's [quick] overrides")
    camp.add_argument("--full", action="store_true",
                      help="apply the file's [full] overrides (its full cross product)")
    camp.add_argument("--out", help="output directory (default: reports/<name>[-quick|-full])")
    camp.add_argument("--shard", metavar="I/N",
                      help="run shard I (0-based) of N: a deterministic 1/N of the trials "
                           "(shard 0 fewer: it also measures the overhead), no report (merge "
                           "writes it); N alone takes I from $JOB_COMPLETION_INDEX")
    camp.add_argument("--no-report", action="store_true",
                      help="trials.csv, overhead.json and campaign.json only (report DIR "
                           "writes the report later)")
    for p in (run, camp):
        p.add_argument("--cache", help="golden-run cache directory (default: OUT/golden)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    mrg = sub.add_parser("merge", help="merge the output directories of a campaign's shards")
    mrg.add_argument("out", help="the merged campaign's directory (new)")
    mrg.add_argument("dirs", nargs="+", help="the shards' output directories")
    rep = sub.add_parser("report", help="rebuild the report of an output directory")
    rep.add_argument("dir")
    add_cluster_arguments(rep)
    rep.add_argument("--overhead-file", metavar="FILE",
                     help="your hardware's per-check overheads: bench/results.json from "
                          "python -m bench on it, or a JSON mapping such as "
                          '{"weights": 0.05} (docs/cost-model.md); replaces the campaign\'s '
                          "[cluster] overhead_file; --check-overhead wins over it")
    chk = sub.add_parser("check", help="validate a scenario or campaign file")
    chk.add_argument("file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("sdc_guard").setLevel(logging.ERROR)  # detections are in trials.csv
    try:
        if args.command == "run":
            sc = load_scenario(args.file)
            one = campaign_for_scenario(sc, clean_trials=args.clean)
            _count(one, args.file)
            out = Path(args.out or Path("runs") / sc.name)
            return _run_campaign(one, out, args.cache, not args.no_progress)
        if args.command == "campaign":
            camp = _load_campaign(args.file, quick=args.quick, full=args.full)
            _count(camp, args.file)
            shard = parse_shard(args.shard) if args.shard is not None else None
            name = camp.name + ("-quick" if args.quick else "-full" if args.full else "") + (
                f"-shard{shard[0]}of{shard[1]}" if shard else "")
            out = Path(args.out or Path("reports") / name)
            return _run_campaign(camp, out, args.cache, not args.no_progress, shard,
                                 not args.no_report)
        if args.command == "merge":
            from scenarios.report.render import summary_text, write_report

            out = Path(args.out)
            dirs = [Path(d) for d in args.dirs]
            with contextlib.ExitStack() as held:  # no shard may still be running
                for d in dirs:
                    if d.is_dir():
                        held.enter_context(hold_output(d, command="merge (reading)",
                                                       create=False))
                held.enter_context(hold_output(out, command="merge"))
                merge(out, dirs)
                print(summary_text(write_report(out, None, _overhead_file(out, None)), out))
            return 0
        if args.command == "report":
            from scenarios.report.render import summary_text, write_report

            out = Path(args.dir)
            if not (out / "trials.csv").exists():
                raise ScenarioError("dir", str(out), "a campaign output directory with "
                                    "trials.csv")
            with hold_output(out, command="report", create=False):
                print(summary_text(write_report(out, cluster_overrides(args),
                                                _overhead_file(out, args.overhead_file)), out))
            return 0
        if args.command == "check":
            data = read_toml(args.file)
            if "scenarios" in data:
                camp = _load_campaign(args.file)
                quick = _load_campaign(args.file, quick=True)
                _count(camp, args.file)
                _count(quick, args.file)
                print(f"campaign {camp.name!r}: {len(plan_trials(camp))} trials "
                      f"({len(plan_trials(quick))} with --quick)")
            else:
                sc = load_scenario(args.file)
                n = _count(campaign_for_scenario(sc), args.file)
                print(f"scenario {sc.name!r}: ok ({n} trial(s) with python -m scenarios run)")
            return 0
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PoolError as e:  # a golden run or the overhead measurement could not run at all
        detail = e.detail.strip().splitlines()[-12:] if e.detail else []
        print("\n".join([*detail, f"error: the ranks failed outside any trial: {e}"]),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    return 2
