"""``python -m scenarios``: run scenarios and campaigns, write and rebuild reports.

    python -m scenarios run FILE [--out DIR]              one scenario: golden + its faults
    python -m scenarios campaign FILE [--quick] [--out DIR]
    python -m scenarios report DIR                        rebuild summary.json, report.md/html
    python -m scenarios throughput [--out DIR]            persistent pool vs spawn per trial
    python -m scenarios check FILE                        validate a scenario or campaign file

Ranks start on this machine (a persistent pool, gloo on 127.0.0.1 or nccl with
one GPU each), or, when the environment names this process's rank (RANK and
WORLD_SIZE, as ``torchrun`` sets them), this process is one of the ranks.

A bad scenario or campaign file prints one line naming the file, the field, the
bad value and what is allowed, and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from scenarios.campaign import CampaignSpec, campaign_for_scenario, load_campaign
from scenarios.pool import PoolError
from scenarios.spec import ScenarioError, load_scenario, read_toml


def _executor(campaign: CampaignSpec) -> object:
    from scenarios.distributed import launched_by_torchrun

    if launched_by_torchrun():
        from scenarios.distributed import DistributedExecutor

        wanted = {s.backend for s in campaign.scenarios}
        return DistributedExecutor(wanted.pop() if len(wanted) == 1 else "auto")
    from scenarios.runner import PoolExecutor

    return PoolExecutor()


def _run_campaign(campaign: CampaignSpec, out: Path, cache: str | None, progress: bool) -> int:
    from scenarios.report import write_report
    from scenarios.runner import CampaignRunner

    executor = _executor(campaign)
    try:
        CampaignRunner(campaign, out, executor, cache=cache,  # type: ignore[arg-type]
                       progress=progress).run()
    finally:
        executor.close()  # type: ignore[attr-defined]
    if getattr(executor, "coordinator", True):
        s = write_report(out)
        _print_summary(s, out)
    return 0


def _print_summary(s: dict[str, object], out: Path) -> None:
    print(f"{s['trials']} fault trials, {s['clean_trials']} clean, "
          f"{s['false_positives']} false positives; outcomes {s['outcomes']}")
    sites = s.get("sites")
    if isinstance(sites, dict):
        for site, g in sites.items():
            cov = g["coverage"]
            print(f"  {site:<26} coverage {'-' if cov is None else f'{cov:.1%}'} "
                  f"(detected {g['detected']}, masked {g['masked']}, escaped {g['escaped']}, "
                  f"crashed {g['crashed']}, hung {g['hung']})")
    print(f"recommended replay interval: {s.get('recommended_replay_interval')}")
    print(f"report: {out / 'report.html'}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scenarios", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one scenario file: golden run and its faults")
    run.add_argument("file")
    run.add_argument("--out", help="output directory (default: runs/<scenario name>)")
    run.add_argument("--clean", type=int, default=1, help="clean trials (false positives)")
    camp = sub.add_parser("campaign", help="run a campaign file (resumes where it stopped)")
    camp.add_argument("file")
    camp.add_argument("--quick", action="store_true", help="apply the file's [quick] overrides")
    camp.add_argument("--out", help="output directory (default: reports/<name>[-quick])")
    for p in (run, camp):
        p.add_argument("--cache", help="golden-run cache directory (default: OUT/golden)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    rep = sub.add_parser("report", help="rebuild the report of an output directory")
    rep.add_argument("dir")
    thr = sub.add_parser("throughput", help="trials/min: persistent pool vs spawn per trial")
    thr.add_argument("--out", default="reports/throughput")
    thr.add_argument("--trials", type=int, default=60, help="trials through the pool")
    thr.add_argument("--baseline-trials", type=int, default=3, help="spawn-per-trial trials")
    chk = sub.add_parser("check", help="validate a scenario or campaign file")
    chk.add_argument("file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("sdc_guard").setLevel(logging.ERROR)  # detections are in trials.csv
    try:
        if args.command == "run":
            sc = load_scenario(args.file)
            out = Path(args.out or Path("runs") / sc.name)
            return _run_campaign(campaign_for_scenario(sc, clean_trials=args.clean), out,
                                 args.cache, not args.no_progress)
        if args.command == "campaign":
            camp = load_campaign(args.file, quick=args.quick)
            out = Path(args.out or Path("reports") / (camp.name + ("-quick" if args.quick
                                                                    else "")))
            return _run_campaign(camp, out, args.cache, not args.no_progress)
        if args.command == "report":
            from scenarios.report import write_report

            out = Path(args.dir)
            if not (out / "trials.csv").exists():
                raise ScenarioError("dir", str(out), "a campaign output directory with "
                                    "trials.csv")
            _print_summary(write_report(out), out)
            return 0
        if args.command == "throughput":
            from scenarios.throughput import main as throughput

            return throughput(Path(args.out), args.trials, args.baseline_trials)
        if args.command == "check":
            data = read_toml(args.file)
            if "scenarios" in data:
                camp = load_campaign(args.file)
                from scenarios.campaign import plan_trials

                print(f"campaign {camp.name!r}: {len(plan_trials(camp))} trials "
                      f"({len(plan_trials(load_campaign(args.file, quick=True)))} with --quick)")
            else:
                sc = load_scenario(args.file)
                print(f"scenario {sc.name!r}: ok")
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
