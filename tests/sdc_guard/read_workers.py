"""Rank functions of ``test_host_reads.py`` (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.fingerprints.native import native_kernel
from sdc_guard.internal import cpu_as_device
from tests.hostsync import DispatchedOps, HostReads
from tests.workers import batch_for, loss_fn


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(16, 32), nn.ReLU()]
    for _ in range(layers):
        mods += [nn.Linear(32, 32), nn.ReLU()]
    mods.append(nn.Linear(32, 4))
    return nn.Sequential(*mods)


def _wrapped(layers: int, parallel: str, world: int) -> nn.Module:
    """The MLP under DDP, or under FSDP2 (each Linear, then the root, on a 1-D mesh)."""
    if parallel == "ddp":
        return DDP(_mlp(layers))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(layers)
    for m in model.children():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def reads_per_step(rank: int, world: int, config: dict[str, Any] | None, optimizer: str,
                   steps: int, layers: int = 1, ops: bool = False,
                   parallel: str = "ddp") -> list[dict[str, int]]:
    """The reads to the host of each step (by kind), on the path GPUs take: the C kernel off,
    the CPU treated as a device. ``config`` None: a plain loop (forward, backward, optimizer
    step) with the same model, data and optimizer. ``ops``: the aten ops dispatched instead
    (by name), and ``layers`` hidden layers. ``parallel``: "ddp", or "fsdp" (FSDP2)."""
    torch.set_num_threads(1)
    with native_kernel(False), cpu_as_device():
        model = _wrapped(layers, parallel, world)
        opt: torch.optim.Optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3)
                                      if optimizer == "adamw" else
                                      torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
        if config is None:
            def step(s: int) -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn(model, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
                opt.step()
        else:
            guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                             config=GuardConfig(**config))

            def step(s: int) -> None:
                report = guard.step(s)
                assert not report.detections and not report.skipped, report
        per_step = []
        for s in range(steps):
            with DispatchedOps() if ops else HostReads() as reads:
                step(s)
            per_step.append(dict(reads.counts))
        if config is not None:
            assert guard.flush() == []
        return per_step
