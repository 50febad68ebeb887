"""Rank functions for the multi-rank injector tests (module level so spawned ranks import them).

Each function runs several independent *trials* in one process group (a fresh DDP
model, optimizer and, where used, guard per trial), so one spawn of 3 ranks covers
several sites. Every trial returns picklable data: detections, losses, fingerprints,
the injection records and whether disarming left the hooks exactly as it found them.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from injectors import Fault, InjectionContext, InjectionHandle, arm
from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.comm_hook import GuardCommHook

PADDING_FEATURE = 15
"""Input feature that is always 0: column 15 of ``0.weight`` has an exactly-zero gradient."""


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(8, 16, generator=g)
    x[:, PADDING_FEATURE] = 0.0
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _optimizer(model: nn.Module, opt: str) -> torch.optim.Optimizer:
    if opt == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _no_module_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def _same_items(now: list[Any], before: list[Any]) -> bool:
    return len(now) == len(before) and all(a is b for a, b in zip(now, before, strict=True))


def _grad_observer(comm: GuardCommHook, step_of: Any, out: dict[int, list[int]]) -> None:
    """Record a fingerprint of each local bucket as the all-reduce would see it."""
    def observe(bucket: Any) -> None:
        out.setdefault(step_of(), []).append(sdc_guard.fingerprint(bucket.buffer()))
    comm.before.append(observe)


def guard_trials(rank: int, world: int, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trial: ``faults`` (list of Fault), ``steps``, ``opt``, ``cfg`` (GuardConfig kwargs)."""
    results = []
    for trial in trials:
        model = DDP(make_model())
        optimizer = _optimizer(model, trial.get("opt", "adamw"))
        guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                         config=GuardConfig(**trial.get("cfg", {})))
        lists_before = (list(guard.before_step), list(guard.comm.before), list(guard.comm.after))
        handles = [arm(f, guard=guard) for f in trial.get("faults", [])]
        grads: dict[int, list[int]] = {}
        _grad_observer(guard.comm, lambda g=guard: g.comm.step, grads)
        reports = [guard.step(s) for s in range(trial["steps"])]
        flushed = guard.flush()
        guard.comm.before.pop()  # the observer
        for h in handles:
            h.remove()
        clean = (_same_items(guard.before_step, lists_before[0])
                 and _same_items(guard.comm.before, lists_before[1])
                 and _same_items(guard.comm.after, lists_before[2])
                 and _no_module_hooks(model.module))
        results.append({
            "detections": [(d.check, d.step, d.suspect_ranks)
                           for d in [*(d for r in reports for d in r.detections), *flushed]],
            "skipped": [r.step for r in reports if r.skipped],
            "losses": [r.loss for r in reports],
            "grads": [grads.get(s, []) for s in range(trial["steps"])],
            "final": sdc_guard.fingerprint(list(model.module.parameters())),
            "records": [rec for h in handles for rec in h.records],
            "armed": [h.armed for h in handles],
            "clean": clean,
        })
        del guard, model, optimizer, handles
    gc.collect()  # once: with torch._dynamo imported (by DDP) a full collection costs ~1 s
    dist.barrier()
    return results


def plain_trials(rank: int, world: int, trials: list[dict[str, Any]],
                 bad_faults: list[Fault]) -> tuple[list[dict[str, Any]], list[str]]:
    """A user's own DDP loop with ``GuardCommHook(check_nonfinite=False)`` and no SDCGuard.

    Each trial: ``faults``, ``steps``, optional ``events`` (a path for an EventLog sink).
    Also arms each of ``bad_faults`` (see ``arm_errors``), in the same process group.
    """
    errors = arm_errors(rank, world, bad_faults)
    results = []
    for trial in trials:
        model = DDP(make_model())
        optimizer = _optimizer(model, trial.get("opt", "adamw"))
        comm = GuardCommHook(check_nonfinite=False)
        model.register_comm_hook(comm, GuardCommHook.hook)
        sink: list[dict[str, Any]] = []
        events = trial.get("events")
        ctx = InjectionContext.plain(model, optimizer=optimizer, comm=comm,
                                     events=events if events is not None else sink)
        handles: list[InjectionHandle] = [arm(f, context=ctx) for f in trial.get("faults", [])]
        losses = []
        for s in range(trial["steps"]):
            for h in handles:  # several handles on one context: the step starts once
                h.begin_step(s)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch_for(rank, s))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        for h in handles:
            h.remove()
        results.append({
            "losses": losses,
            "final": sdc_guard.fingerprint(list(model.module.parameters())),
            "records": [rec for h in handles for rec in h.records],
            "sink": sink,
            "armed": [h.armed for h in handles],
            "clean": (comm.before == [] and comm.after == [] and ctx.step_hooks == []
                      and _no_module_hooks(model.module)),
        })
        del model, optimizer, comm, ctx, handles
    gc.collect()
    dist.barrier()
    return results, errors


def arm_errors(rank: int, world: int, faults: list[Fault]) -> list[str]:
    """Arm each fault on every rank against a plain context; return each error (or "")."""
    model = DDP(make_model())
    comm = GuardCommHook(check_nonfinite=False)
    model.register_comm_hook(comm, GuardCommHook.hook)
    ctx = InjectionContext.plain(model, comm=comm)
    out = []
    for f in faults:
        try:
            h = arm(f, context=ctx)
            out.append(f"armed={h.armed}")
            h.remove()
        except ValueError as e:
            out.append(f"{type(e).__name__}: {e}")
    del model, comm, ctx
    gc.collect()
    return out
