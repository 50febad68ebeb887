"""``python -m bench.throughput``: campaign trials per minute, persistent pool vs a process per trial.

All runners execute the same trials of ``scenarios/configs/mlp.toml`` (3 ranks,
20 steps; one fault each, sampled over all six sites, plus clean trials) with
the same rank code (``scenarios.run.rank``) and classify them against the same
golden run:

* pool: ``WorkerPool`` ranks stay in their process group; each trial restores
  the step-0 snapshot into the already-built DDP model;
* spawn per trial: a fresh ``WorkerPool(start_method="spawn")`` per trial (3
  spawned processes that import torch, join a new process group, build the model,
  run one trial, exit);
* forkserver per trial: ``scenarios.run.launch.run_ranks`` per trial (processes
  forked from a server that has torch imported already: the cheapest way to get
  fresh processes per trial).

The pool's start-up (spawn, process group, golden run) is reported separately
and not counted in its rate; the baselines' golden run is not counted either.
Writes ``<out>/throughput.json`` and ``<out>/throughput.md``::

    python -m bench.throughput [--out reports/throughput] [--trials 60] [--baseline-trials 3]
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

import scenarios
from scenarios.report.outcome import classify
from scenarios.run.launch import run_ranks
from scenarios.run.pool import WorkerPool
from scenarios.run.rank import Golden, RankRunner, Trial
from scenarios.run.store import GoldenRun, write_json
from scenarios.spec.campaign import CampaignSpec
from scenarios.spec.faults import FaultSpace
from scenarios.spec.scenario import Scenario, load_scenario
from scenarios.spec.trials import plan_trials

CONFIG = Path(scenarios.__file__).parent / "configs" / "mlp.toml"


def _spawned_trial(rank: int, world: int, scenario: Scenario, cmd: Trial) -> dict[str, Any]:
    logging.getLogger("sdc_guard").setLevel(logging.ERROR)
    runner = RankRunner(rank, world, torch.device("cpu"))
    out = runner.trial(cmd)
    runner.close()
    gc.collect()
    return out


def _fresh_pool(scenario: Scenario, cmd: Trial) -> list[Any]:
    with WorkerPool(scenario.world_size, start_method="spawn") as pool:
        return pool.run(cmd, 300)


def _forkserver(scenario: Scenario, cmd: Trial) -> list[Any]:
    return run_ranks(_spawned_trial, scenario.world_size, scenario, cmd, timeout=300)


def _golden(res: list[dict[str, Any]], scenario: Scenario) -> GoldenRun:
    return GoldenRun(key=scenario.training_key(), scenario=scenario.name,
                     initial_fp=res[0]["initial_fp"], state_fps=res[0]["state_fps"],
                     weight_fps=res[0]["weight_fps"], losses=[r["losses"] for r in res],
                     detections=res[0]["detections"], ranks_agree=True,
                     seconds=res[0]["seconds"])


def measure(out: Path, trials: int, baseline_trials: int) -> dict[str, Any]:
    scenario = load_scenario(CONFIG)
    space = FaultSpace(mode="sample", trials_per_site=max(1, trials // 6), seed=11,
                       fields=("sign", "exponent", "mantissa", "nan"),
                       replay_intervals=(scenario.guard.replay_interval,))
    plan = plan_trials(CampaignSpec(name="throughput", scenarios=(scenario,), space=space,
                                    clean_trials=2, overhead=None))[:trials]
    out.mkdir(parents=True, exist_ok=True)
    pt = str(out / "golden.pt")
    t0 = time.monotonic()
    pool = WorkerPool(scenario.world_size)
    try:
        pool.start()
        golden = _golden(pool.run(Golden(scenario, save_to=pt), 120), scenario)
        startup = time.monotonic() - t0
        outcomes: dict[str, int] = {}
        t1 = time.monotonic()
        for t in plan:
            s0 = time.monotonic()
            row = classify(t, golden, pool.run(Trial(scenario, t, pt), 120), time.monotonic() - s0)
            outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
        pool_s = time.monotonic() - t1
    finally:
        pool.close()
    baselines = {}
    for name, run in (("spawn_per_trial", _fresh_pool), ("forkserver_per_trial", _forkserver)):
        t2 = time.monotonic()
        n = 0
        for t in plan[:baseline_trials]:
            s0 = time.monotonic()
            classify(t, golden, run(scenario, Trial(scenario, t, pt)), time.monotonic() - s0)
            n += 1
        secs = time.monotonic() - t2
        baselines[name] = {"trials": n, "seconds": secs,
                           "trials_per_minute": n / secs * 60 if n else None,
                           "seconds_per_trial": secs / n if n else None}
    pool_rate = len(plan) / pool_s * 60
    base_rate = baselines["spawn_per_trial"]["trials_per_minute"]
    fork_rate = baselines["forkserver_per_trial"]["trials_per_minute"]
    return {
        "scenario": scenario.name, "world_size": scenario.world_size, "steps": scenario.steps,
        "replay_interval": scenario.guard.replay_interval,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "pool": {"trials": len(plan), "seconds": pool_s, "trials_per_minute": pool_rate,
                 "startup_seconds": startup, "outcomes": outcomes},
        **baselines,
        "speedup": pool_rate / base_rate if base_rate else None,
        "speedup_vs_forkserver": pool_rate / fork_rate if fork_rate else None,
        "targets": {"pool_at_least_60_per_minute": pool_rate >= 60,
                    "speedup_at_least_10x": bool(base_rate and pool_rate / base_rate >= 10)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.throughput",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/throughput", help="directory for the results")
    ap.add_argument("--trials", type=int, default=60, help="trials through the pool")
    ap.add_argument("--baseline-trials", type=int, default=3, help="trials per baseline runner")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.baseline_trials < 0:
        ap.error(f"--trials takes a count >= 1 and --baseline-trials one >= 0, got "
                 f"{args.trials} and {args.baseline_trials}.")
    out = Path(args.out)
    res = measure(out, args.trials, args.baseline_trials)
    write_json(out / "throughput.json", res)
    p, b, f = res["pool"], res["spawn_per_trial"], res["forkserver_per_trial"]
    md = "\n".join([
        "# Campaign throughput", "",
        f"Scenario `{res['scenario']}`: {res['world_size']} ranks, {res['steps']} steps, replay "
        f"every {res['replay_interval']}; {res['machine']}.", "",
        "| runner | trials | seconds | trials/min |", "|---|---|---|---|",
        f"| persistent pool | {p['trials']} | {p['seconds']:.1f} | {p['trials_per_minute']:.1f} |",
        f"| spawn per trial | {b['trials']} | {b['seconds']:.1f} | "
        f"{b['trials_per_minute'] or 0:.1f} |",
        f"| forkserver per trial (`scenarios.run.launch.run_ranks`) | {f['trials']} | "
        f"{f['seconds']:.1f} | {f['trials_per_minute'] or 0:.1f} |", "",
        f"Speed-up: **{res['speedup'] or 0:.1f}x** over spawn per trial, "
        f"{res['speedup_vs_forkserver'] or 0:.1f}x over forkserver per trial; pool start-up "
        f"(spawn, process group, golden run) {p['startup_seconds']:.1f} s, not counted.", "",
    ])
    (out / "throughput.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
