"""Rank functions of ``test_llama_model.py`` (``tests.launch.run_ranks`` imports them by name):
the campaign's llama model trained under ``scenarios.spec.sharding.shard_model``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.sharding import is_checkpointed, parallel_of, shard_model, shard_units

WIDTH, DEPTH, BATCH, LR = 64, 2, 4, 1e-2


def train(parallel: str, mesh_shape: tuple[int, ...], steps: int, *, mixed_precision: bool = False,
          activation_checkpointing: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps of the llama (seed 0) on this rank's synthetic batches; the losses
    this rank saw, what ``parallel_of`` reads, and the parameters after the last step, flattened
    (the full tensors, gathered on every rank, and this rank's own shards)."""
    model = shard_model(build_model("llama", width=WIDTH, depth=DEPTH, seed=0),
                        parallel=parallel, mesh_shape=mesh_shape, mixed_precision=mixed_precision,
                        activation_checkpointing=activation_checkpointing)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rank = dist.get_rank()
    losses, calls = [], [0]
    # a layer inside the first block: it runs again when its block is recomputed
    probe = inner.get_submodule("blocks.0.attention.wq")
    probe.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for step in range(steps):
        loss = scenario_loss(model, synthetic_batch("llama", 0, rank, step, 0, batch=BATCH))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full, local = {}, {}  # as lists of floats: tensors in a queue outlive no rank
    for name, p in inner.named_parameters():
        if isinstance(p, DTensor):
            full[name] = p.full_tensor().detach().flatten().tolist()
            local[name] = p.to_local().detach().flatten().tolist()
        else:
            full[name] = local[name] = p.detach().flatten().tolist()
    return {"losses": losses, "parallel_of": parallel_of(model), "full": full, "local": local,
            "probe_calls": calls[0],
            "checkpointed": [is_checkpointed(u) for u in shard_units(inner)],
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def two_rank_runs(rank: int, world: int, steps: int) -> dict[str, dict[str, Any]]:
    """The same training under DDP, FSDP2 twice, FSDP2 with activation checkpointing and
    FSDP2 with mixed precision, one after the other in one process group."""
    return {
        "ddp": train("ddp", (world,), steps),
        "fsdp": train("fsdp", (world,), steps),
        "fsdp_again": train("fsdp", (world,), steps),
        "fsdp_ac": train("fsdp", (world,), steps, activation_checkpointing=True),
        "fsdp_mp": train("fsdp", (world,), steps, mixed_precision=True),
    }


def hsdp_runs(rank: int, world: int, steps: int) -> dict[str, dict[str, Any]]:
    """The llama trained under DDP, then under HSDP on a (2, world // 2) mesh."""
    return {"ddp": train("ddp", (world,), steps), "hsdp": train("hsdp", (2, world // 2), steps)}


def refusals(rank: int, world: int) -> list[str]:
    """The messages ``shard_model`` and ``parallel_of`` refuse bad arguments with."""
    model = build_model("llama", width=WIDTH, depth=DEPTH, seed=0)
    messages = []
    for kwargs in ({"parallel": "tp", "mesh_shape": (world,)},
                   {"parallel": "fsdp", "mesh_shape": (world + 1,)},
                   {"parallel": "hsdp", "mesh_shape": (world,)},
                   {"parallel": "hsdp", "mesh_shape": (2, 2)},
                   {"parallel": "fsdp", "mesh_shape": [world]},
                   {"parallel": "ddp", "mesh_shape": (world,), "mixed_precision": True}):
        try:
            shard_model(model, **kwargs)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append(f"accepted {kwargs}")
    try:
        parallel_of(model)
    except ValueError as e:
        messages.append(str(e))
    return messages


def every_kind(rank: int, world: int, kinds: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """Each model kind of ``kinds`` (width 8, depth 2) trained ``steps`` AdamW steps under DDP
    and under FSDP2: the losses and the full parameters after the last step."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        for parallel in ("ddp", "fsdp"):
            model = shard_model(build_model(kind, width=8, depth=2, seed=0), parallel=parallel,
                                mesh_shape=(world,))
            inner = model.module if isinstance(model, DistributedDataParallel) else model
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for step in range(steps):
                loss = scenario_loss(model, synthetic_batch(kind, 0, rank, step, 0, batch=BATCH))
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                    .tolist() for n, p in inner.named_parameters()}
            out[f"{kind}/{parallel}"] = {"losses": losses, "full": full,
                                         "parallel_of": parallel_of(model)}
    return out
