"""Rank functions for the tolerant replay audit's tests: the CPU testbed for nondeterminism
(ranks at 1 and 2 threads, ``injectors.noise.LinearNoise`` on every linear output) and
faults by site and bit (``injectors.Fault``).

The model is ``DropMLP`` with GELU in place of its ReLUs: a ReLU whose input lies within a
rounding of zero passes its gradient in one computation and not in another (a knife edge
the rerun diagnosis cannot tell from a transient fault, ``bench/TOLERANT.md``), and where
one falls depends on the CPU's roundings: the tests would then depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from injectors import Fault, arm
from injectors.noise import LinearNoise
from sdc_guard import GuardConfig, SDCGuard
from tests.workers import DropMLP, batch_for, loss_fn


def compared_in_hook(guard: SDCGuard, audit: Any) -> list[int]:
    """The audit steps whose edge the owner compares in the hook (its veto asked, not None),
    filled in as ``guard`` steps."""
    compared: list[int] = []
    real_veto = audit.veto

    def veto() -> Any:
        answer = real_veto()
        if answer is not None and audit.due(guard.backend.step):
            compared.append(guard.backend.step)
        return answer

    audit.veto = veto
    return compared


def tolerant_run(rank: int, world: int, steps: int, *, threads: tuple[int, ...] = (1, 2),
                 ulps: int = 4, fault: dict[str, Any] | None = None, interval: int = 1,
                 contain: bool = True, event_log: str | None = None,
                 mode: str = "tolerant", window: int = 1000,
                 odd_batch: tuple[int, int, float] | None = None, bf16: bool = False,
                 where: str = "output") -> dict[str, Any]:
    """Guarded training of ``DropMLP`` (dropout: the RNG streams must replay) with the
    tolerant replay audit every ``interval`` steps on the testbed: rank r at
    ``threads[r % len(threads)]`` threads, ``ulps`` of noise on every linear output (0: none),
    and optionally ``fault`` (``injectors.Fault`` fields; armed on its rank). ``odd_batch =
    (rank, step, value)``: that rank's batch of that step has its first input set to
    ``value`` (a spike or a NaN the data makes, on whichever rank computes it). ``bf16``:
    bfloat16 mixed precision (``torch.autocast``), the noise moved ``where`` it says
    (``LinearNoise``)."""
    torch.set_num_threads(threads[rank % len(threads)])
    model = DDP(smooth_mlp())
    noise = (LinearNoise(model.module, ulps=ulps, seed=7, rank=rank, where=where) if ulps
             else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GuardConfig(replay_interval=interval, replay_mode=mode, weights_interval=1,
                      skip_step_on_detection=contain, event_log=event_log,
                      repair_window_steps=window, deterministic=mode == "exact")
    guard = SDCGuard(model, optimizer, loss_fn=autocast_loss if bf16 else loss_fn, config=cfg,
                     batch_for=batch_for if odd_batch is None else OddBatch(*odd_batch))
    handle = arm(Fault(**fault), guard=guard) if fault and fault["rank"] == rank else None
    audit: Any = next(c for c in guard.checks if c.name == "replay")
    compared = compared_in_hook(guard, audit)
    reports = [guard.step(s) for s in range(steps)]
    found = [d for r in reports for d in r.detections] + guard.flush()
    out = {
        "detections": [(d.check, d.step, d.suspect_ranks, d.transient) for d in found],
        "details": [d.detail for d in found],
        "evidence": [d.evidence.get("diagnosis") for d in found],
        "skipped": [r.step for r in reports if r.skipped],
        "tolerance": getattr(audit, "tolerance", None),
        "triggered": list(getattr(audit, "triggered", [])),
        "scores": list(getattr(audit, "scores", [])),
        "noise_calls": noise.calls if noise else 0,
        "fused_sketches": guard.backend.fused_sketches, "native": sdc_guard.native_enabled(),
        "final": sdc_guard.fingerprint(list(model.module.parameters())),
        "injections": len(handle.records) if handle is not None else 0,
        "compared_in_hook": compared,
    }
    if handle is not None:
        handle.remove()
    guard.close()
    return out


def autocast_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``loss_fn`` under bfloat16 mixed precision (``torch.autocast``; the loss in float32)."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return nn.functional.cross_entropy(out.float(), y)


def smooth_mlp() -> DropMLP:
    """``DropMLP`` (seed 0) with GELU activations (the same module names)."""
    torch.manual_seed(0)
    model = DropMLP()
    for name in ("act1", "act2"):
        setattr(model, name, nn.GELU())
    return model


class OddBatch:
    """``batch_for`` with one odd batch: (rank, step)'s first input is ``value`` (with
    ``micro`` above 1: the first micro-batch's, of the FSDP tests' batches)."""

    def __init__(self, rank: int, step: int, value: float, micro: int = 0) -> None:
        self.at, self.value, self.micro = (rank, step), value, micro

    def __call__(self, rank: int, step: int) -> Any:
        if self.micro:
            from tests.sdc_guard import replay_fsdp_workers as rfw

            batches = rfw.micro_batches(self.micro)(rank, step)
            first = batches[0] if isinstance(batches, list) else batches
        else:
            batches = first = batch_for(rank, step)
        if (rank, step) == self.at:
            first[0][0, 0] = self.value
        return batches


def records(path: str, event: str) -> list[dict[str, Any]]:
    """The event log's records of one kind."""
    lines = Path(path).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def calibration_records(path: str) -> list[dict[str, Any]]:
    """The event log's calibration records."""
    lines = Path(path).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "replay_calibration"]


def checkpoint_run(rank: int, world: int, ckpt_dir: str, log: str) -> dict[str, Any]:
    """A tolerant run saved after step 3, then a new guard (a restarted job) restored from
    it: the restored audit compares at the saved tolerance without calibrating again."""
    from sdc_guard import CheckpointManager

    torch.set_num_threads((1, 2)[rank % 2])
    out: dict[str, Any] = {}
    for life in ("first", "restarted"):
        model = DDP(smooth_mlp())
        LinearNoise(model.module, seed=7, rank=rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = CheckpointManager(ckpt_dir, keep=2)
        cfg = GuardConfig(replay_interval=2, replay_mode="tolerant", event_log=log)
        guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg,
                         checkpoints=ckpt)
        audit: Any = next(c for c in guard.checks if c.name == "replay")
        start = 0 if life == "first" else ckpt.restore(model, optimizer)
        out[f"{life}_start_tolerance"] = getattr(audit, "tolerance", None)
        found = [d for s in range(start, start + 4) for d in guard.step(s).detections]
        if life == "first":
            ckpt.save(3, model, optimizer)
        out[f"{life}_tolerance"] = getattr(audit, "tolerance", None)
        out[f"{life}_detections"] = [(d.check, d.step) for d in found + guard.flush()]
        guard.close()
    return out


def fsdp_run(rank: int, world: int, shape: tuple[int, ...], steps: int, *,
             threads: tuple[int, ...] = (1, 2), ulps: int = 4,
             fault: dict[str, Any] | None = None, interval: int = 1, micro: int = 1,
             contain: bool = True, event_log: str | None = None,
             odd_batch: tuple[int, int, float] | None = None) -> dict[str, Any]:
    """``tolerant_run`` under FSDP2 (``shape``: a 1-D mesh) or HSDP (a 2-D one): the FSDP
    tests' MLP with GELU and dropout (``replay_fsdp_workers.build``), ``micro``
    micro-batches, on the testbed. Returns what ``tolerant_run`` does, and whether the ranks
    holding each shard hold it alike at the end."""
    import torch.distributed as dist

    from tests.sdc_guard import replay_fsdp_workers as rfw
    from tests.sdc_guard.fsdp_workers import local_state

    torch.set_num_threads(threads[rank % len(threads)])
    model = rfw.build(shape, act=nn.GELU)
    noise = LinearNoise(model, ulps=ulps, seed=7, rank=rank) if ulps else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GuardConfig(replay_interval=interval, replay_mode="tolerant", micro_batches=micro,
                      skip_step_on_detection=contain, event_log=event_log)
    feed = rfw.micro_batches(micro) if odd_batch is None else OddBatch(*odd_batch, micro)
    guard = SDCGuard(model, optimizer, loss_fn=rfw.loss_fn, config=cfg, batch_for=feed)
    handle = arm(Fault(**fault), guard=guard) if fault and fault["rank"] == rank else None
    audit: Any = next(c for c in guard.checks if c.name == "replay")
    compared = compared_in_hook(guard, audit)
    reports = [guard.step(s) for s in range(steps)]
    found = [d for r in reports for d in r.detections] + guard.flush()
    mine = [t.reshape(-1).tolist() for t in local_state(model, optimizer)]
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, mine)
    out = {
        "detections": [(d.check, d.step, d.suspect_ranks, d.transient) for d in found],
        "details": [d.detail for d in found],
        "evidence": [d.evidence for d in found],
        "skipped": [r.step for r in reports if r.skipped],
        "tolerance": getattr(audit, "tolerance", None),
        "triggered": list(getattr(audit, "triggered", [])),
        "noise_calls": noise.calls if noise else 0,
        "alike": all(rows[r] == rows[s[0]] for s in guard.backend.layout.sets for r in s),
        "injections": len(handle.records) if handle is not None else 0,
        "compared_in_hook": compared,
    }
    if handle is not None:
        handle.remove()
    guard.close()
    return out
