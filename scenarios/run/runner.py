"""The campaign loop: golden runs, overhead, trials, one CSV line per finished trial.

``CampaignRunner`` only coordinates. Where the ranks live is an *executor*:

* ``PoolExecutor``: persistent worker pools on this machine (``scenarios.run.pool``),
  one per (world size, backend), restarted after a crash or hang;
* ``scenarios.run.distributed.DistributedExecutor``: this process *is* a rank,
  started by ``torchrun`` (every rank runs the same loop; rank 0 writes files).

Resuming: trial ids are fixed by the campaign file, the ids already in
``trials.csv`` are skipped, and goldens and the overhead measurement are reused
from disk when present.

One writer: the coordinator holds ``OUT/.lock`` (``scenarios.run.outlock``) for the
whole run; a second run on the same directory is refused at once, naming the holder.

Lost trials: a trial whose rank was killed by a signal the harness did not send (the
pool's ``PoolError("lost")``: SIGKILL from a person, a scheduler, the OOM killer) says
nothing about its fault, so it is run again once; killed again, its row gets the outcome
``lost`` (not ``crashed``, which stays a failure of the trial itself), and the run lists
it at the end and in ``campaign.json`` (``lost_this_run``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, Protocol

from kube_standin import StandInAPIServer
from scenarios.report.outcome import classify, failed_row
from scenarios.report.summary import fit_replay_overhead
from scenarios.run.outlock import OutputBusy, hold_output
from scenarios.run.pool import PoolError, WorkerPool
from scenarios.run.rank import Command, Golden, Overhead, Prepare, Trial
from scenarios.run.shards import overhead_share, plan_key, shard_of
from scenarios.run.store import (
    GoldenRun,
    TrialTable,
    golden_paths,
    load_golden,
    save_golden,
    write_json,
)
from scenarios.spec.campaign import CampaignSpec
from scenarios.spec.errors import ScenarioError
from scenarios.spec.overhead import HEADLINE, PLAIN_DDP, all_checks, replay_only
from scenarios.spec.paths import inside
from scenarios.spec.scenario import Scenario
from scenarios.spec.trials import TrialSpec, describe, plan_trials, scenario_of

LOST: Final = "lost"
"""The outcome of a trial lost twice to a kill from outside the harness."""


def overhead_matches(ov: Any, campaign: CampaignSpec) -> bool:
    """Whether an ``overhead.json`` left in the output directory measured what ``campaign``
    asks for (its scenario, world size and model, the replay intervals, rounds and block), so
    that a resumed campaign keeps it; a campaign whose overhead section changed measures
    again rather than report another configuration's numbers."""
    spec = campaign.overhead
    if spec is None or not isinstance(ov, dict):
        return False
    sc = campaign.overhead_scenario()
    want = {"scenario": sc.name, "world_size": sc.world_size, "model": sc.model.kind,
            "rounds": spec.rounds, "block": spec.block}
    return (all(ov.get(k) == v for k, v in want.items())
            and isinstance(ov.get("replay"), dict)
            and sorted(ov["replay"], key=int)
            == [str(k) for k in sorted(campaign.overhead_intervals())])


def confined(campaign: CampaignSpec, out: Path) -> CampaignSpec:
    """``campaign`` with each scenario's ``[guard] event_log`` resolved under ``out``
    (``scenarios.spec.paths.inside``: a path that leaves it is a ``ScenarioError``)."""
    def under_out(sc: Scenario) -> Scenario:
        log = sc.guard.event_log
        if log is None:
            return sc
        try:
            path = inside(out, log, "guard.event_log")
        except ScenarioError as e:
            raise ScenarioError(e.field, e.value, e.allowed, reason=f"scenario {sc.name!r}: "
                                f"{e.reason}" if e.reason else f"scenario {sc.name!r}") from None
        return replace(sc, guard=replace(sc.guard, event_log=str(path)))

    scenarios = tuple(under_out(s) for s in campaign.scenarios)
    ov = campaign.overhead_file_scenario
    if scenarios == campaign.scenarios and ov is None:
        return campaign
    return replace(campaign, scenarios=scenarios,
                   overhead_file_scenario=None if ov is None else under_out(ov))


class Executor(Protocol):
    coordinator: bool
    """True in the process that classifies trials and writes files."""
    shared_files: bool
    """True when every rank reads the coordinator's files (one machine)."""

    def run(self, scenario: Scenario, cmd: Command, timeout: float) -> list[Any] | None: ...
    def generation(self, scenario: Scenario) -> int: ...
    def agree(self, value: Any) -> Any: ...
    def close(self) -> None: ...


class PoolExecutor:
    """Ranks in persistent local worker pools, one per (world size, backend)."""

    coordinator = True
    shared_files = True

    def __init__(self, *, start_timeout: float = 300.0) -> None:
        self.pools: dict[tuple[int, str], WorkerPool] = {}
        self.start_timeout = start_timeout

    def pool(self, scenario: Scenario) -> WorkerPool:
        key = (scenario.world_size, scenario.backend)
        if key not in self.pools:
            self.pools[key] = WorkerPool(scenario.world_size, backend=scenario.backend,
                                         start_timeout=self.start_timeout)
        return self.pools[key]

    def run(self, scenario: Scenario, cmd: Command, timeout: float) -> list[Any]:
        return self.pool(scenario).run(cmd, timeout)

    def agree(self, value: Any) -> Any:
        return value

    def generation(self, scenario: Scenario) -> int:
        """Changes whenever the scenario's pool is (re)started: its sessions are gone."""
        pool = self.pool(scenario)
        return pool.restarts if pool.alive else pool.restarts + 1

    @property
    def restarts(self) -> int:
        return sum(max(0, p.restarts) for p in self.pools.values())

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(total: int, initial: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the harness extra
        return None
    return tqdm(total=total, initial=initial, disable=not enabled, unit="trial",
                dynamic_ncols=True, file=sys.stderr, smoothing=0.1)


class CampaignRunner:
    """Runs a campaign into ``out``: ``trials.csv``, ``overhead.json``, ``campaign.json``."""

    def __init__(self, campaign: CampaignSpec, out: str | Path, executor: Executor, *,
                 cache: str | Path | None = None, progress: bool = True,
                 shard: tuple[int, int] | None = None) -> None:
        """``shard``: ``(I, N)``: run only shard I of N (``scenarios.run.shards``)."""
        self.shard = shard
        self.out = Path(out)
        self.campaign = confined(campaign, self.out)
        self.cache = Path(cache) if cache is not None else self.out / "golden"
        self.executor = executor
        self.progress = progress and executor.coordinator
        self.goldens: dict[str, GoldenRun] = {}
        self._prepared: set[tuple[int, str]] = set()

    # -- golden ---------------------------------------------------------------------------------
    def golden(self, scenario: Scenario) -> GoldenRun:
        key = scenario.training_key()
        if self.executor.coordinator and self.executor.shared_files:
            cached = load_golden(self.cache, key)
        else:
            cached = None
        if self.executor.agree(cached is not None) and cached is not None:
            return cached
        _, pt = golden_paths(self.cache, key)
        if self.executor.coordinator:
            self.cache.mkdir(parents=True, exist_ok=True)
        res = self.executor.run(scenario, Golden(scenario, save_to=str(pt)),
                                timeout=max(60.0, scenario.trial_timeout_s * 2))
        if res is None:  # a non-coordinating rank: it keeps the weights in memory
            return GoldenRun(key=key, scenario=scenario.name, initial_fp=0, state_fps=[],
                             weight_fps=[], losses=[], detections=[], ranks_agree=True,
                             seconds=0.0)
        g = GoldenRun(
            key=key, scenario=scenario.name, initial_fp=res[0]["initial_fp"],
            state_fps=res[0]["state_fps"], weight_fps=res[0]["weight_fps"],
            losses=[r["losses"] for r in res], detections=res[0]["detections"],
            ranks_agree=all(r["state_fps"] == res[0]["state_fps"] for r in res),
            seconds=res[0]["seconds"],
        )
        if not g.ranks_agree or g.detections:
            _say(f"warning: golden run of {scenario.name!r}: ranks agree={g.ranks_agree}, "
                 f"detections={g.detections}")
        save_golden(self.cache, g)
        return g

    # -- overhead -------------------------------------------------------------------------------
    def overhead(self) -> dict[str, Any] | None:
        """``overhead.json``: each configuration's median step time and its overhead over
        plain DDP, with every configuration's per-round times (``samples_ms``) from which the
        report draws each overhead's interval; None without an ``[overhead]`` section."""
        spec = self.campaign.overhead
        if spec is None:
            return None
        sc = self.campaign.overhead_scenario()
        ks = self.campaign.overhead_intervals()
        t0 = time.monotonic()
        res = self.executor.run(sc, Overhead(sc, ks, spec.rounds, spec.block), timeout=1800.0)
        if res is None:
            return None
        r0 = res[0]
        step = r0["step_s"]
        base = step[PLAIN_DDP.name]
        return {
            "scenario": sc.name, "world_size": sc.world_size, "model": sc.model.kind,
            "rounds": r0["rounds"], "block": r0["block"], "seconds": time.monotonic() - t0,
            "baseline_step_ms": base * 1e3,
            "step_ms": {k: v * 1e3 for k, v in step.items()},
            **{oc.key: step[oc.name] / base - 1 for oc in HEADLINE},
            "replay": {str(k): step[replay_only(k).name] / base - 1 for k in ks},
            "total": {str(k): step[all_checks(k).name] / base - 1 for k in (0, *ks)},
            "replay_fit": fit_replay_overhead(r0["samples"], list(ks)),
            # every configuration's per-round block times, so that the report gives each
            # check's overhead (not only the replay audit's) an interval over the rounds
            "samples_ms": {name: [v * 1e3 for v in times]
                           for name, times in r0["samples"].items()},
        }

    # -- trials ---------------------------------------------------------------------------------
    def trial(self, t: TrialSpec) -> dict[str, Any] | None:
        """Run ``t``: its row (None on a rank that does not coordinate). A trial lost to a kill
        from outside is run once more; lost again, its row's outcome is ``lost``."""
        row = self._attempt(t)
        if row is not None and row["outcome"] == LOST:
            if self.executor.coordinator:
                _say(f"trial {t.id}: {row['error']}: running it again")
            first = row["error"]
            row = self._attempt(t)
            if row is not None and row["outcome"] == LOST:
                row["error"] = f"lost twice: {first}; then {row['error']}"[:500]
        return row

    def _attempt(self, t: TrialSpec) -> dict[str, Any] | None:
        sc = scenario_of(self.campaign, t)
        golden = self.goldens[sc.name]
        _, pt = golden_paths(self.cache, golden.key)
        t0 = time.monotonic()
        try:
            key = (self.executor.generation(sc), sc.name)
            if key not in self._prepared:  # a new session: not part of the trial's timeout
                self.executor.run(sc, Prepare(sc, str(pt)), timeout=600.0)
                self._prepared.add(key)
                t0 = time.monotonic()
            ckpt_dir = self._checkpoint_dir(sc, t)
            try:
                with self._api_server(sc) as kubeconfig:
                    res = self.executor.run(sc, Trial(sc, t, str(pt), kubeconfig, ckpt_dir),
                                            timeout=sc.trial_timeout_s)
            finally:  # a trial's checkpoints serve that trial only
                if ckpt_dir is not None and self.executor.coordinator:
                    shutil.rmtree(ckpt_dir, ignore_errors=True)
        except PoolError as e:
            return failed_row(t, e.kind, e.reason, time.monotonic() - t0)
        if res is None:
            return None
        return classify(t, golden, res, time.monotonic() - t0)

    def _checkpoint_dir(self, sc: Scenario, t: TrialSpec) -> str | None:
        """With ``[recovery]``: an empty checkpoint directory for the trial (a resumed
        campaign reruns the trial from scratch, so what a killed run left is removed)."""
        if sc.recovery is None:
            return None
        if not self.executor.shared_files:
            raise ScenarioError("recovery", "[recovery]", "a campaign on one machine",
                                reason="every rank reads the checkpoints rank 0 writes")
        path = self.out / "checkpoints" / t.id
        if self.executor.coordinator:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        return str(path)

    @contextlib.contextmanager
    def _api_server(self, sc: Scenario) -> Iterator[str | None]:
        """With ``[quarantine]``: a fresh loopback API stand-in for one trial, a node per rank
        (``node-<rank>``, as ``RankRunner`` names them), and its kubeconfig's path."""
        if sc.quarantine is None:
            yield None
            return
        if not self.executor.shared_files:
            raise ScenarioError("quarantine", "[quarantine]", "a campaign on one machine",
                                reason="the API stand-in listens on this machine's loopback")
        with StandInAPIServer() as srv:
            for r in range(sc.world_size):
                srv.add_node(f"node-{r}")
            path = srv.write_kubeconfig(self.out / "kube" / "kubeconfig")
            yield str(path)

    # -- torchrun: a trial that took its ranks down ----------------------------------------
    def _mark_inflight(self, t: TrialSpec) -> None:
        path = self.out / "inflight.json"
        prev = _read_json(path)
        attempts = prev["attempts"] + 1 if isinstance(prev, dict) and prev.get("id") == t.id else 1
        info = {"id": t.id, "attempts": attempts, "started": time.time()}
        write_json(path, info)
        sc = self.campaign.scenario(t.scenario)

        def hung() -> None:
            write_json(path, {**info, "reason": f"hung: no answer within "
                                                f"{sc.trial_timeout_s:.0f}s (watchdog)"})

        self.executor.on_hang = hung  # type: ignore[attr-defined]

    def _resolve_inflight(self, table: TrialTable, trials: dict[str, TrialSpec]) -> None:
        """Record the trial that was running when the ranks went down (see distributed.py)."""
        info = _read_json(self.out / "inflight.json")
        if not isinstance(info, dict) or info.get("id") not in trials:
            return
        if info["id"] in table.done_ids():
            return
        t = trials[info["id"]]
        reason = str(info.get("reason", ""))
        if reason.startswith("hung"):
            table.append(failed_row(t, "hung", reason, 0.0))
        elif info.get("attempts", 0) >= 2:
            table.append(failed_row(t, "crashed", "the ranks went down during this trial "
                                    f"{info['attempts']} times (a rank died or raised)", 0.0))

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold ``OUT/.lock`` for the block (the coordinator takes it; every rank raises
        ``OutputBusy`` when another run holds it). Nested holds share the lock."""
        with contextlib.ExitStack() as stack:
            holder = None
            if self.executor.coordinator:
                try:
                    stack.enter_context(hold_output(
                        self.out, command=f"campaign {self.campaign.name!r}"))
                except OutputBusy as e:
                    holder = e.holder
            holder = self.executor.agree(holder)
            if holder is not None:
                raise OutputBusy(self.out, holder)
            yield

    def run(self) -> dict[str, Any]:
        """Run every trial not yet in ``trials.csv``, holding ``OUT/.lock``."""
        with self.holding():
            return self._run()

    def _run(self) -> dict[str, Any]:
        started = time.time()
        t_start = time.monotonic()
        plan = plan_trials(self.campaign)
        trials = plan if self.shard is None else shard_of(
            plan, *self.shard, head_start=overhead_share(self.campaign))
        coordinator = self.executor.coordinator
        table = TrialTable(self.out / "trials.csv") if coordinator else None
        if table is not None:
            table.check_header()
        inflight = getattr(self.executor, "tracks_inflight", False)
        if table is not None and inflight:
            self._resolve_inflight(table, {t.id: t for t in trials})
        done = self.executor.agree(table.done_ids() if table is not None else None)
        todo = [t for t in trials if t.id not in done]
        planned = {t.id for t in trials}
        meta = {**self.campaign.to_json(), **describe(self.campaign, trials),
                "already_done": len(planned & done), "started": started,
                "planned_ids": [t.id for t in trials]}
        if self.shard is not None:
            meta["shard"] = {"index": self.shard[0], "count": self.shard[1],
                             "plan_key": plan_key(self.campaign.to_json(), plan),
                             "plan_ids": [t.id for t in plan]}
        if coordinator:
            _say(f"campaign {self.campaign.name!r}: {len(trials)} trials planned, "
                 f"{len(todo)} to run, output in {self.out}")
            previous = _read_json(self.out / "campaign.json")
            if not isinstance(previous, dict):
                previous = {}
            meta["runs"] = list(previous.get("runs", []))
            meta["goldens"] = previous.get("goldens", {})
            write_json(self.out / "campaign.json", meta)
        runs_on: dict[str, Scenario] = {}  # in plan order: the same on every rank
        for t in todo:
            sc = scenario_of(self.campaign, t)
            runs_on.setdefault(sc.name, sc)
        for name, sc in runs_on.items():
            self.goldens[name] = self.golden(sc)
        ov_path = self.out / "overhead.json"
        kept = _read_json(ov_path) if coordinator and ov_path.exists() else None
        reuse = kept is not None and overhead_matches(kept, self.campaign)
        if coordinator and kept is not None and not reuse and self.campaign.overhead is not None:
            _say(f"{ov_path} was measured for another overhead configuration (scenario, "
                 "world size, model, replay intervals, rounds or block): measuring again")
        have_ov = self.executor.agree(reuse)
        measures = self.shard is None or self.shard[0] == 0  # shard 0 measures the overhead
        if self.campaign.overhead is not None and not have_ov and measures:
            if coordinator:
                _say("measuring step-time overhead ...")
            ov = self.overhead()
            if ov is not None and coordinator:
                write_json(ov_path, ov)
        counts: Counter[str] = Counter()
        lost: list[str] = []
        bar = _bar(len(trials), len(trials) - len(todo), self.progress)
        t_trials = time.monotonic()
        try:
            for t in todo:
                if inflight and coordinator:
                    self._mark_inflight(t)
                row = self.trial(t)
                if row is None or table is None:
                    continue
                table.append(row)
                counts[row["outcome"]] += 1
                if row["outcome"] == LOST:
                    lost.append(t.id)
                if bar is not None:
                    bar.set_postfix(counts, refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        trial_seconds = time.monotonic() - t_trials
        run = {"started": started, "ran": len(todo), "seconds": time.monotonic() - t_start,
               "trial_seconds": trial_seconds}
        meta.update({
            "runs": [*meta.get("runs", []), run],
            "ran": len(todo), "outcomes_this_run": dict(counts), "lost_this_run": lost,
            "trial_seconds": trial_seconds, "seconds": time.monotonic() - t_start,
            "trials_per_minute": len(todo) / trial_seconds * 60 if todo and trial_seconds else None,
            "goldens": {**meta.get("goldens", {}),
                        **{k: {"key": g.key, "ranks_agree": g.ranks_agree,
                               "detections": g.detections, "seconds": g.seconds}
                           for k, g in self.goldens.items()}},
            "pool_restarts": getattr(self.executor, "restarts", None),
        })
        if coordinator:
            write_json(self.out / "campaign.json", meta)
            if lost:
                _say(f"{len(lost)} trial(s) lost: a rank was killed by a signal the harness did "
                     f"not send, twice (outcome 'lost' in trials.csv, left out of coverage): "
                     + ", ".join(lost))
        return meta


def executor_for(campaign: CampaignSpec) -> Executor:
    """This process as one rank of a ``torchrun`` launch, or a local pool of ranks."""
    from scenarios.run.distributed import DistributedExecutor, launched_by_torchrun

    if launched_by_torchrun():
        wanted = {s.backend for s in campaign.scenarios}
        return DistributedExecutor(wanted.pop() if len(wanted) == 1 else "auto")
    return PoolExecutor()


def run_campaign(campaign: CampaignSpec, out: Path, *, cache: str | Path | None = None,
                 progress: bool = True, shard: tuple[int, int] | None = None,
                 then: Callable[[], None] | None = None) -> bool:
    """Run ``campaign`` into ``out`` on this machine's ranks or as a torchrun rank; whether
    this process coordinates. ``then`` (the report): called in the coordinator after the
    run, still holding ``OUT/.lock``."""
    executor = executor_for(campaign)
    coordinator = executor.coordinator
    with contextlib.ExitStack() as held:
        try:
            runner = CampaignRunner(campaign, out, executor, cache=cache, progress=progress,
                                    shard=shard)
            held.enter_context(runner.holding())
            runner.run()
        finally:
            executor.close()
        if then is not None and coordinator:
            then()
    return coordinator
