"""What each rank does: golden runs, trials and overhead rounds on reused sessions.

``RankRunner.execute(command)`` is the one entry point, used by the persistent
worker pool (``scenarios.run.pool``) and by ranks started with ``torchrun``
(``scenarios.run.distributed``). Commands are small picklable records, the same
on every rank; the sessions they run on (``scenarios.run.session``) stay built
between commands. A scenario's golden run and all its trials share one session,
whatever their replay interval and checksum setting: its guard is reconfigured
for each run (fresh checks, as every trial has always had), and the model,
optimizer and DDP buckets are the same objects, restored to step 0.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from injectors import arm
from scenarios.run.session import Session
from scenarios.spec.overhead import campaign_configs
from scenarios.spec.scenario import Scenario
from scenarios.spec.trials import Chaos, TrialSpec
from sdc_guard import CheckpointManager, GuardConfig, ShardedCheckpointManager
from sdc_guard.checkpoint import CheckpointError, CheckpointWriteError
from sdc_guard.remediation import KubeQuarantine


# -- commands (picklable; the same on every rank) -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ping:
    """Answer once the process group is up (pool start-up)."""


@dataclass(frozen=True, slots=True)
class Golden:
    scenario: Scenario
    save_to: str | None = None
    """Rank 0 saves the final parameters here (``torch.save`` of a list of CPU tensors)."""


@dataclass(frozen=True, slots=True)
class Trial:
    scenario: Scenario
    trial: TrialSpec
    golden_path: str | None = None
    """Where the golden final parameters are, if this process has not computed them itself."""
    kubeconfig: str | None = None
    """With the scenario's ``[quarantine]``: the kubeconfig of this trial's API stand-in."""
    checkpoint_dir: str | None = None
    """With the scenario's ``[recovery]``: this trial's (empty) checkpoint directory."""


@dataclass(frozen=True, slots=True)
class Prepare:
    """Build the scenario's session (DDP, optimizer, guard, warm-up) and load the golden
    weights, so that a trial's timeout measures the trial alone."""

    scenario: Scenario
    golden_path: str | None = None


@dataclass(frozen=True, slots=True)
class Overhead:
    scenario: Scenario
    intervals: tuple[int, ...]
    rounds: int
    block: int


Command = Ping | Golden | Prepare | Trial | Overhead


@dataclass(frozen=True, slots=True)
class Recovery:
    """A recovery trial's checkpoints, their interval, and how to replace the faulty node."""

    checkpoints: CheckpointManager
    every: int
    disarm: Callable[[], None]


def _chaos_hook(chaos: Chaos, rank: int) -> Any:
    def hook(step: int) -> None:
        if rank != chaos.rank or step != chaos.step:
            return
        if chaos.action == "raise":
            raise RuntimeError(f"chaos: rank {rank} raises at step {step}")
        if chaos.action == "exit":
            os._exit(17)
        if chaos.action == "kill":  # as a kill from outside would (the pool tells it apart)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10**6)  # hang

    return hook


def _relative_deviation(params: list[torch.Tensor], golden: list[torch.Tensor]) -> float:
    num = sum(float((p.double() - g.double().to(p.device)).square().sum())
              for p, g in zip(params, golden, strict=True))
    den = sum(float(g.double().square().sum()) for g in golden)
    return math.sqrt(num) / math.sqrt(den) if den > 0 else float("inf")


# -- the executor ---------------------------------------------------------------------------------
class RankRunner:
    """Executes commands on one rank; keeps sessions and golden weights between commands."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.sessions: dict[tuple[str, ...], Session] = {}
        self.golden_final: dict[str, list[torch.Tensor]] = {}
        # Each rank stands for a node of its own (the guard's topology reads NODE_NAME when
        # it is built), unless a real one is set (torchrun in a pod, from the downward API).
        os.environ.setdefault("NODE_NAME", f"node-{rank}")

    def session(self, scenario: Scenario, config: GuardConfig | None) -> Session:
        """A session of its own for ``config`` (the overhead rounds alternate them)."""
        key = (scenario.training_key(), repr(config))
        if key not in self.sessions:
            self.sessions[key] = Session(scenario, config, self.rank, self.world, self.device)
        return self.sessions[key]

    def run_session(self, scenario: Scenario, config: GuardConfig) -> Session:
        """The scenario's session for golden runs and trials, reset to step 0 and its guard
        reconfigured to ``config`` (fresh checks). One per trajectory: a scenario's run
        configurations differ only in the checks (``Scenario.guard_config``); the fields the
        guard reads only when it is built (the variables naming node and pod) are in the key."""
        base = scenario.guard_config()
        key = (scenario.training_key(), "run", base.node_name_env, base.pod_name_env)
        if key not in self.sessions:
            self.sessions[key] = Session(scenario, base, self.rank, self.world, self.device)
        s = self.sessions[key]
        assert s.guard is not None
        s.reset()
        # The last run ended with flush(): no non-finite words of the old checks in flight.
        s.guard.reconfigure(config)
        return s

    def execute(self, cmd: Command) -> Any:
        if isinstance(cmd, Ping):
            return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device)}
        if isinstance(cmd, Golden):
            return self.golden(cmd)
        if isinstance(cmd, Prepare):
            self.run_session(cmd.scenario, cmd.scenario.guard_config())
            self._golden_weights(cmd.scenario, cmd.golden_path)
            return None
        if isinstance(cmd, Trial):
            return self.trial(cmd)
        if isinstance(cmd, Overhead):
            return self.overhead(cmd)
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def _train(self, s: Session, steps: int, *, stop_on_detection: bool,
               params_too: bool = False, recovery: Recovery | None = None) -> dict[str, Any]:
        """Train ``steps`` steps; per-step records (fingerprints, losses, start times) of the
        run as it first went. With ``recovery``: checkpoints, and at the first unrepaired
        detection the faults are disarmed (the node replaced) and the run restored from the
        last clean checkpoint and trained to the end (``out["recovery"]``)."""
        assert s.guard is not None
        fps: list[int] = []
        wfps: list[int] = []
        losses: list[float] = []
        detections: list[tuple[str, int, tuple[int, ...]]] = []
        skipped: list[int] = []
        repaired: list[tuple[str, int]] = []
        transient: list[tuple[str, int]] = []
        started: list[float] = []
        rolled: dict[str, Any] | None = None
        refused: list[int] = []
        """Steps whose checkpoint the manager refused (sharded: HSDP replicas that differ, a
        fault not reported yet); the next older one serves the rollback."""

        def roll_back(at: int) -> int:
            """Replace the faulty node (disarm), restore; the step to train next."""
            nonlocal rolled
            assert recovery is not None and s.guard is not None
            recovery.disarm()
            s.forget_noise()
            resume = recovery.checkpoints.restore(s.model, s.optimizer)
            if resume == 0:  # no usable checkpoint: from scratch, the initial state
                s.reset()
                s.guard.rewind(-1)
            rolled = {"reported_step": at, "rollback_step": resume,
                      "wasted_steps": at + 1 - resume, "resumed_at": time.time()}
            return resume

        step = 0
        while True:
            while step < steps:
                if rolled is None:
                    started.append(time.time())
                rep = s.guard.step(step)
                if rolled is None:  # the run as it first went
                    fps.append(s.state_fingerprint())
                    if params_too:
                        wfps.append(s.weights_fingerprint())
                    losses.append(rep.loss)
                    if rep.skipped:
                        skipped.append(step)
                    detections += [(d.check, d.step, tuple(d.suspect_ranks))
                                   for d in rep.detections]
                    repaired += [(d.check, d.step) for d in rep.detections if d.repaired]
                    transient += [(d.check, d.step) for d in rep.detections if d.transient]
                if recovery is None:
                    if rep.detections and stop_on_detection:
                        break
                    step += 1
                    continue
                # Transient detections too: the golden run never withheld their step, so
                # only a rollback makes the final state comparable with it bit for bit.
                if rolled is None and any(not d.repaired for d in rep.detections):
                    found = s.guard.flush()  # also waits for the quarantine
                    detections += [(d.check, d.step, tuple(d.suspect_ranks)) for d in found]
                    step = roll_back(step)
                    continue
                if (step + 1) % recovery.every == 0:
                    try:
                        recovery.checkpoints.save(step, s.model, s.optimizer)
                    except CheckpointWriteError:
                        raise
                    except CheckpointError:  # refused on every rank: the replicas differ
                        refused.append(step)
                step += 1
            # The non-finite flags still out (sent every few steps, collected a step later).
            found = s.guard.flush()
            if rolled is None:
                detections += [(d.check, d.step, tuple(d.suspect_ranks)) for d in found]
                repaired += [(d.check, d.step) for d in found if d.repaired]
                transient += [(d.check, d.step) for d in found if d.transient]
            if recovery is not None and rolled is None and any(not d.repaired for d in found):
                step = roll_back(steps - 1)  # detected after the last step: train again
                continue
            break
        out = {
            "rank": self.rank,
            "state_fps": fps,
            "losses": losses,
            "detections": detections,
            "skipped": skipped,
            "repaired": repaired,
            "transient": transient,
            "step_started": started,
        }
        if params_too:
            out["weight_fps"] = wfps
        if recovery is not None:
            out["recovery"] = {**(rolled or {}), "final_fp": s.state_fingerprint(),
                               "saves_refused": refused}
        return out

    def golden(self, cmd: Golden) -> dict[str, Any]:
        sc = cmd.scenario
        s = self.run_session(sc, sc.guard_config())
        initial = s.state_fingerprint()
        t0 = time.perf_counter()
        out = self._train(s, sc.steps, stop_on_detection=False, params_too=True)
        out["seconds"] = time.perf_counter() - t0
        out["initial_fp"] = initial
        final = [p.to("cpu", copy=True) for p in s.full_parameters()]
        self.golden_final[sc.training_key()] = final
        if cmd.save_to is not None and self.rank == 0:
            tmp = f"{cmd.save_to}.tmp{os.getpid()}"
            torch.save(final, tmp)
            os.replace(tmp, cmd.save_to)
        return out

    def _golden_weights(self, sc: Scenario, path: str | None) -> list[torch.Tensor] | None:
        key = sc.training_key()
        if key not in self.golden_final and path is not None and os.path.exists(path):
            self.golden_final[key] = torch.load(path, map_location="cpu", weights_only=True)
        return self.golden_final.get(key)

    def trial(self, cmd: Trial) -> dict[str, Any]:
        sc, spec = cmd.scenario, cmd.trial
        # Fresh checks: a trial must not inherit the last one's memory (the weights check's
        # repairs, the checks' verified steps).
        s = self.run_session(sc, sc.guard_config(spec.replay_interval, spec.checksum))
        assert s.guard is not None
        t0 = time.perf_counter()
        handles = [arm(f, guard=s.guard) for f in spec.faults]
        chaos = _chaos_hook(spec.chaos, self.rank) if spec.chaos is not None else None
        if chaos is not None:
            s.guard.before_step.append(chaos)
        quarantine = None
        if sc.quarantine is not None and cmd.kubeconfig is not None:
            quarantine = KubeQuarantine(kubeconfig=cmd.kubeconfig, job=f"trial-{spec.id}",
                                        backoff_s=0.05, request_timeout_s=5.0, deadline_s=10.0,
                                        **sc.quarantine.kwargs())
            s.guard.set_remediation(quarantine)
        recovery = None
        if sc.recovery is not None and cmd.checkpoint_dir is not None:
            manager = ShardedCheckpointManager if sc.sharded else CheckpointManager
            ckpt = manager(cmd.checkpoint_dir, keep=sc.recovery.keep)
            s.guard.set_checkpoints(ckpt)

            def disarm() -> None:
                for h in handles:
                    h.remove()
            recovery = Recovery(ckpt, sc.recovery.checkpoint_every, disarm)
        try:
            out = self._train(s, sc.steps, stop_on_detection=sc.stop_on_detection,
                              recovery=recovery)
        finally:
            s.guard.set_checkpoints(None)
            for h in handles:
                h.remove()
            if chaos is not None:
                s.guard.before_step.remove(chaos)
            if quarantine is not None:
                quarantine.close()  # the evidence held back by the rate limit, too
                s.guard.set_remediation(None)
        out["records"] = [r for h in handles for r in h.records]
        out["quarantine"] = [a.to_json() for a in quarantine.actions] if quarantine else None
        out["rel_weight_dev"] = None
        golden = self._golden_weights(sc, cmd.golden_path)
        # the same on every rank (the gathers under FSDP2 are collective): a trial that ran
        # to its end compares whole parameters
        if golden is not None and len(out["state_fps"]) == sc.steps:
            out["rel_weight_dev"] = _relative_deviation(s.full_parameters(), golden)
        out["seconds"] = time.perf_counter() - t0
        return out

    def overhead(self, cmd: Overhead) -> dict[str, Any] | None:
        """Median step time of each configuration (``scenarios.spec.overhead``), each on a
        session of its own, alternated block by block."""
        sc = cmd.scenario
        sessions = {oc.name: self.session(sc, oc.for_scenario(sc))
                    for oc in campaign_configs(cmd.intervals)}
        lcm = math.lcm(*cmd.intervals) if cmd.intervals else 1
        block = lcm * max(1, math.ceil(cmd.block / lcm))  # every interval audits block/k steps
        names = list(sessions)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(cmd.rounds + 1):  # round 0 warms up
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                s = sessions[name]
                s.reset()
                dist.barrier()
                t0 = time.perf_counter()
                for step in range(block):
                    if s.guard is None:
                        s.plain_step(step)
                    else:
                        s.guard.step(step)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dist.barrier()
                if rnd:
                    times[name].append((time.perf_counter() - t0) / block)
        if self.rank != 0:
            return None
        return {"step_s": {n: statistics.median(v) for n, v in times.items()},
                "samples": times, "block": block, "rounds": cmd.rounds}

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        gc.collect()
