"""What each rank does: build a scenario's DDP model once, then run golden runs and trials on it.

A ``Session`` is one DDP model, optimizer and ``SDCGuard`` for one (scenario,
guard configuration). DDP accepts one comm hook and the guard registers it in
its constructor, so a session is built once and reused: each trial restores the
step-0 snapshot (``state_dict`` copies taken right after construction) into the
same parameters (``load_state_dict`` copies in place) and a fresh optimizer
state, arms its faults, trains, and disarms them.

Two warm-up iterations (forward and backward, no optimizer step) run before the
snapshot is restored the first time: DDP rebuilds its gradient buckets at the
second iteration, and the bucket layout decides the summation order of the
all-reduce, so without them the golden run's first step would not be
bit-identical to a later trial's.

``RankRunner.execute(command)`` is the one entry point, used by the persistent
worker pool (``scenarios.pool``) and by ranks started with ``torchrun``
(``scenarios.distributed``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from injectors import arm
from scenarios.campaign import Chaos, TrialSpec
from scenarios.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec import Scenario
from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.checks import state_tensors
from sdc_guard.fingerprints import fingerprint_tensor, to_unsigned64

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CONCAT_BYTES = 1 << 18


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


@dataclass(frozen=True, slots=True)
class Prepare:
    """Build the session a trial will use (DDP, optimizer, guard, warm-up) and load the golden
    weights, so that the trial's timeout measures the trial alone."""

    scenario: Scenario
    replay_interval: int
    golden_path: str | None = None


@dataclass(frozen=True, slots=True)
class Overhead:
    scenario: Scenario
    intervals: tuple[int, ...]
    rounds: int
    block: int


Command = Ping | Golden | Prepare | Trial | Overhead


# -- one model + optimizer + guard ----------------------------------------------------------------
def _optimizer(scenario: Scenario, params: Any) -> torch.optim.Optimizer:
    o = scenario.optimizer
    if o.kind == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)


def batch_for(scenario: Scenario, device: torch.device, rank: int, step: int) -> Any:
    """``batch_for(rank, step)`` of a scenario: one batch, or a list of micro-batches."""
    dtype = DTYPES[scenario.dtype]

    def one(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batch(scenario.model.kind, scenario.seed, rank, step, micro,
                               batch=scenario.batch, dtype=dtype)
        return x.to(device), y.to(device)

    if scenario.micro_batches == 1:
        return one(0)
    return [one(i) for i in range(scenario.micro_batches)]


def loss_for(micro_batches: int, model: nn.Module, batch: Any) -> torch.Tensor:
    loss = scenario_loss(model, batch)
    return loss if micro_batches == 1 else loss / micro_batches


class Session:
    """A DDP model, its optimizer and (unless ``config`` is None) an SDCGuard, reused by trials."""

    def __init__(self, scenario: Scenario, config: GuardConfig | None, rank: int, world: int,
                 device: torch.device) -> None:
        self.scenario = scenario
        self.rank = rank
        self.device = device
        module = build_model(scenario.model.kind, width=scenario.model.width,
                             depth=scenario.model.depth, seed=scenario.seed)
        module = module.to(device=device, dtype=DTYPES[scenario.dtype])
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DDP(module, device_ids=ids)
        self.module = module
        self.optimizer = _optimizer(scenario, module.parameters())
        self.batch_for = functools.partial(batch_for, scenario, device)
        self.loss_fn = functools.partial(loss_for, scenario.micro_batches)
        self.guard = None if config is None else SDCGuard(
            self.ddp, self.optimizer, loss_fn=self.loss_fn, batch_for=self.batch_for,
            config=config)
        self._model0 = copy.deepcopy(module.state_dict())
        self._opt0 = copy.deepcopy(self.optimizer.state_dict())
        for step in range(2):  # DDP rebuilds its buckets at the second iteration
            self.ddp.zero_grad(set_to_none=True)
            batch = self.batch_for(rank, step)
            first = batch[0] if scenario.micro_batches > 1 else batch
            self.loss_fn(self.ddp, first).backward()
        self.reset()

    def reset(self) -> None:
        """Back to step 0: the snapshot's weights and buffers, an empty optimizer state."""
        self.module.load_state_dict(self._model0)
        self.optimizer.load_state_dict(copy.deepcopy(self._opt0))
        self.optimizer.zero_grad(set_to_none=True)
        # The CPU generator directly: torch.manual_seed also queues a lazy CUDA seeding
        # that formats a stack trace on CPU-only builds (about 1 ms a call).
        torch.default_generator.manual_seed(self.scenario.seed * 7919 + self.rank)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(self.scenario.seed * 7919 + self.rank)

    def plain_step(self, step: int) -> float:
        """A training step without the guard (the overhead baseline)."""
        self.optimizer.zero_grad(set_to_none=True)
        batch = self.batch_for(self.rank, step)
        batches = batch if self.scenario.micro_batches > 1 else [batch]
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = self.loss_fn(self.ddp, mb)
                loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def state_fingerprint(self) -> torch.Tensor:
        """Parameters + optimizer state (what the weight check compares), in its order.

        Small states (the campaign models) are fingerprinted as one concatenation of
        their bytes, a single pass instead of one per tensor (the set and order of
        tensors is fixed within a scenario, so any change of any bit still changes the
        value); large ones tensor by tensor, to avoid the copy. Stays on the device.
        """
        tensors = [t.detach() for t in state_tensors(self.module, self.optimizer)]
        if sum(t.numel() * t.element_size() for t in tensors) > _CONCAT_BYTES:
            return fingerprint_tensor(tensors)
        return fingerprint_tensor(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]))

    def close(self) -> None:
        self.guard = None
        del self.ddp, self.optimizer


def _chaos_hook(chaos: Chaos, rank: int) -> Any:
    def hook(step: int) -> None:
        if rank != chaos.rank or step != chaos.step:
            return
        if chaos.action == "raise":
            raise RuntimeError(f"chaos: rank {rank} raises at step {step}")
        if chaos.action == "exit":
            os._exit(17)
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
        self.sessions: dict[tuple[str, str], Session] = {}
        self.golden_final: dict[str, list[torch.Tensor]] = {}

    def session(self, scenario: Scenario, config: GuardConfig | None) -> Session:
        key = (scenario.training_key(), repr(config))
        if key not in self.sessions:
            self.sessions[key] = Session(scenario, config, self.rank, self.world, self.device)
        return self.sessions[key]

    def execute(self, cmd: Command) -> Any:
        if isinstance(cmd, Ping):
            return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device)}
        if isinstance(cmd, Golden):
            return self.golden(cmd)
        if isinstance(cmd, Prepare):
            self.session(cmd.scenario, cmd.scenario.guard_config(cmd.replay_interval))
            self._golden_weights(cmd.scenario, cmd.golden_path)
            return None
        if isinstance(cmd, Trial):
            return self.trial(cmd)
        if isinstance(cmd, Overhead):
            return self.overhead(cmd)
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def _train(self, s: Session, steps: int, *, stop_on_detection: bool,
               params_too: bool = False) -> dict[str, Any]:
        assert s.guard is not None
        fps: list[torch.Tensor] = []
        wfps: list[torch.Tensor] = []
        losses: list[float] = []
        detections: list[tuple[str, int, tuple[int, ...]]] = []
        skipped: list[int] = []
        for step in range(steps):
            rep = s.guard.step(step)
            fps.append(s.state_fingerprint())
            if params_too:
                wfps.append(fingerprint_tensor([p.detach() for p in s.module.parameters()]))
            losses.append(rep.loss)
            if rep.skipped:
                skipped.append(step)
            detections += [(d.check, d.step, tuple(d.suspect_ranks)) for d in rep.detections]
            if rep.detections and stop_on_detection:
                break
        # The non-finite flags still out (sent every few steps, collected a step later).
        detections += [(d.check, d.step, tuple(d.suspect_ranks)) for d in s.guard.flush()]
        out = {
            "rank": self.rank,
            "state_fps": [to_unsigned64(v) for v in torch.stack(fps).tolist()],
            "losses": losses,
            "detections": detections,
            "skipped": skipped,
        }
        if params_too:
            out["weight_fps"] = [to_unsigned64(v) for v in torch.stack(wfps).tolist()]
        return out

    def golden(self, cmd: Golden) -> dict[str, Any]:
        sc = cmd.scenario
        s = self.session(sc, sc.guard_config())
        s.reset()
        initial = to_unsigned64(int(s.state_fingerprint()))
        t0 = time.perf_counter()
        out = self._train(s, sc.steps, stop_on_detection=False, params_too=True)
        out["seconds"] = time.perf_counter() - t0
        out["initial_fp"] = initial
        final = [p.detach().to("cpu", copy=True) for p in s.module.parameters()]
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
        s = self.session(sc, sc.guard_config(spec.replay_interval))
        assert s.guard is not None
        s.reset()
        t0 = time.perf_counter()
        handles = [arm(f, guard=s.guard) for f in spec.faults]
        chaos = _chaos_hook(spec.chaos, self.rank) if spec.chaos is not None else None
        if chaos is not None:
            s.guard.before_step.append(chaos)
        try:
            out = self._train(s, sc.steps, stop_on_detection=sc.stop_on_detection)
        finally:
            for h in handles:
                h.remove()
            if chaos is not None:
                s.guard.before_step.remove(chaos)
        out["records"] = [r for h in handles for r in h.records]
        out["rel_weight_dev"] = None
        golden = self._golden_weights(sc, cmd.golden_path)
        if golden is not None and len(out["state_fps"]) == sc.steps:
            out["rel_weight_dev"] = _relative_deviation(
                [p.detach() for p in s.module.parameters()], golden)
        out["seconds"] = time.perf_counter() - t0
        return out

    def overhead(self, cmd: Overhead) -> dict[str, Any] | None:
        """Median step time of each configuration, alternated block by block."""
        sc = cmd.scenario
        configs: dict[str, GuardConfig | None] = {"plain DDP": None}
        base = {"seed": sc.seed, "micro_batches": sc.micro_batches,
                "include_optimizer_state": sc.guard.include_optimizer_state}
        configs["guard, checks off"] = GuardConfig(nonfinite=False, weights_interval=0, **base)
        configs["nonfinite"] = GuardConfig(nonfinite=True, weights_interval=0, **base)
        configs["weights"] = GuardConfig(nonfinite=False, weights_interval=1, **base)
        configs["all@0"] = GuardConfig(nonfinite=True, weights_interval=1, **base)
        for k in cmd.intervals:
            configs[f"replay@{k}"] = GuardConfig(nonfinite=False, weights_interval=0,
                                                 replay_interval=k, deterministic=True, **base)
            configs[f"all@{k}"] = GuardConfig(nonfinite=True, weights_interval=1,
                                              replay_interval=k, deterministic=True, **base)
        sessions = {name: self.session(sc, cfg) for name, cfg in configs.items()}
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
