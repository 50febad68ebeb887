"""Rank functions for the multi-rank tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard import GuardConfig, SDCGuard


def make_mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _summary(reports: list[sdc_guard.StepReport]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(d.check, d.step, d.suspect_ranks) for r in reports for d in r.detections]


def guarded_run(rank: int, world: int, steps: int, fault: dict[str, Any] | None = None,
                cfg: dict[str, Any] | None = None, opt: str = "adamw") -> dict[str, Any]:
    """Train ``steps`` guarded steps; optionally corrupt something on one rank at one step."""
    model = DDP(make_mlp())
    optimizer: torch.optim.Optimizer
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(**(cfg or {})))
    fault = fault or {}
    if fault.get("site") == "weight_bitflip" and fault["rank"] == rank:
        def flip(step: int) -> None:
            if step == fault["step"]:
                w = next(model.module.parameters()).detach()
                w.view(-1).view(torch.int32)[3] ^= 1 << fault.get("bit", 0)
        guard.before_step.append(flip)
    if fault.get("site") == "grad_nan" and fault["rank"] == rank:
        def nan(bucket: Any) -> None:
            if guard.comm.step == fault["step"]:
                bucket.buffer()[0] = float("nan")
        guard.comm.before.append(nan)
    reports = [guard.step(s) for s in range(steps)]
    out = {
        "detections": _summary(reports),
        "skipped": [r.step for r in reports if r.skipped],
        "losses": [r.loss for r in reports],
        "final": sdc_guard.fingerprint(list(model.module.parameters())),
    }
    del guard, model, optimizer
    gc.collect()
    return out


def plain_run(rank: int, world: int, steps: int, opt: str = "adamw") -> dict[str, Any]:
    """The same training as ``guarded_run`` with a plain DDP loop and no guard."""
    model = DDP(make_mlp())
    optimizer: torch.optim.Optimizer
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch_for(rank, s))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
    out = {"losses": losses, "final": sdc_guard.fingerprint(list(model.module.parameters()))}
    del model, optimizer
    gc.collect()
    return out
