"""Rank functions of the replay audit's FSDP2 tests (``test_replay_fsdp.py``).

A small MLP with dropout (the replay must recompute the owner's random stream) under
``fully_shard`` on a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP), trained
through ``SDCGuard`` with the replay audit; faults are armed through ``injectors``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.checks.replay import ReplayAudit
from tests.sdc_guard.fsdp_workers import batch_for, collectives_issued, local_state, mesh_for


def build(shape: tuple[int, ...], act: type[nn.Module] = nn.ReLU) -> nn.Module:
    """An MLP 8-16-16-4 with ``act`` and dropout after each hidden layer; each hidden Linear
    ``fully_shard``-ed, then the root (which owns the last Linear)."""
    mesh = mesh_for(shape)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), act(), nn.Dropout(0.25), nn.Linear(16, 16),
                          act(), nn.Dropout(0.25), nn.Linear(16, 4))
    for i in (0, 3):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def micro_batches(count: int) -> Any:
    """``batch_for`` of the guard: one batch, or ``count`` micro-batches by index."""
    if count == 1:
        return batch_for

    def per_step(rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [batch_for(rank, step * count + i) for i in range(count)]

    return per_step


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def train(rank: int, world: int, shape: tuple[int, ...], steps: int, *, interval: int = 1,
          micro: int = 1, fault: dict[str, Any] | None = None, contain: bool = True,
          nonfinite: bool = True, checksum: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps with the replay audit every ``interval`` steps (0: off) and, if
    given, one fault armed through ``injectors``. Returns the steps withheld, the detections
    (check, step, suspects), the fault's records on this rank, whether the ranks holding
    each shard hold it alike at the end, and this rank's shards of the weights and the
    optimizer state (as lists, for bit-for-bit comparison across runs), and the steps whose
    ring exchange was posted with the step's first reduce-scatter (``"sent_with_first_chunk"``)."""
    from injectors import Fault, arm

    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = GuardConfig(replay_interval=interval, deterministic=True, micro_batches=micro,
                      nonfinite=nonfinite, skip_step_on_detection=contain, checksum=checksum)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=micro_batches(micro), config=cfg)
    withheld, seen, records = [], [], 0
    withheld_by: list[tuple[str, ...]] = []
    armed = arm(Fault(**fault), guard=guard) if fault else None
    in_hook: list[int] = []
    current = [-1]
    for audit in (c for c in guard.checks if isinstance(c, ReplayAudit)):
        def send(audit: ReplayAudit = audit, real: Any = audit._send_replayed) -> None:
            if audit._buckets:  # a chunk of the step was seen: posted from its reduce-scatter
                in_hook.append(current[0])
            real()
        audit._send_replayed = send  # type: ignore[method-assign]
    try:
        for step in range(steps):
            current[0] = step
            report = guard.step(step)
            if report.skipped:
                withheld.append(step)
                withheld_by.append(report.withheld_by)
            seen += report.detections
        seen += guard.flush()
    finally:
        if armed is not None:
            records = len(armed.records)
            armed.remove()
    state = local_state(model, opt)
    mine = [t.reshape(-1).tolist() for t in state]
    rows: list[Any] = [None] * world  # (shards of 3 ranks differ in size)
    dist.all_gather_object(rows, mine)
    layout = guard.backend.layout
    return {"withheld": withheld, "withheld_by": withheld_by, "records": records,
            "detections": [(d.check, d.step, tuple(d.suspect_ranks)) for d in seen],
            "evidence": [d.evidence for d in seen],
            "alike": all(rows[r] == rows[s[0]] for s in layout.sets for r in s),
            "state": mine, "sent_with_first_chunk": in_hook}


def replicate_collectives_in_replay(rank: int, world: int, micro: int) -> list[int]:
    """HSDP 2x2, one audit step with ``micro`` micro-batches: how many collectives the
    replicate dimension's group issued during each of the audit's recomputations (none:
    the recomputation reduces nothing, HSDP's all-reduce included)."""
    from sdc_guard.checks.replay_fsdp import FSDPReplayAudit

    model = build((2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = GuardConfig(replay_interval=1, deterministic=True, micro_batches=micro)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=micro_batches(micro), config=cfg)
    audit = next(c for c in guard.checks if isinstance(c, FSDPReplayAudit))
    replicate = guard.backend.mesh.get_group("replicate")
    counts: list[int] = []
    real = audit._replay

    def counted(owner: int, step: int, phase: str) -> Any:
        before = replicate._get_sequence_number_for_group()
        try:
            return real(owner, step, phase)
        finally:
            counts.append(replicate._get_sequence_number_for_group() - before)

    audit._replay = counted  # type: ignore[method-assign,assignment]
    report = guard.step(0)
    assert not report.skipped and not report.detections, report
    return counts


def veto_collectives(rank: int, world: int, steps: int) -> dict[str, list[int]]:
    """FSDP, an audit every step, the other checks off: the collectives each step issues
    (every process group of this process) with the audit's veto carried by the step's last
    reduce-scatter (``veto_early``, as built) and with it sent in a word of its own; and
    whether the two runs trained alike."""
    from sdc_guard.checks.replay_fsdp import FSDPReplayAudit

    out: dict[str, list[int]] = {}
    states = []
    for name in ("carried", "word"):
        model = build((world,))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        cfg = GuardConfig(nonfinite=False, weights_interval=0, replay_interval=1,
                          deterministic=True)
        guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, config=cfg)
        if name == "word":
            audit = next(c for c in guard.checks if isinstance(c, FSDPReplayAudit))
            audit.veto_early = False
        counts = []
        for step in range(steps):
            before = collectives_issued()
            report = guard.step(step)
            assert not report.skipped and not report.detections, report
            counts.append(collectives_issued() - before)
        out[name] = counts
        states.append(local_state(model, opt))
    out["identical"] = [int(all(torch.equal(a, b) for a, b in zip(*states, strict=True)))]
    return out


def soak(audits: int) -> None:
    """Clean runs with an audit at every step, FSDP 3 and HSDP 2x2 (2 micro-batches): prints
    the audits and the bad edges seen (the target: 0 over >= 100 audits). Run it with
    ``python -m tests.sdc_guard.replay_fsdp_workers [audits]`` from the repository root."""
    from tests.launch import run_ranks

    for shape, micro in (((3,), 1), ((2, 2), 2)):
        world = 1
        for n in shape:
            world *= n
        res = run_ranks(train, world, shape, audits, micro=micro, timeout=60.0 + audits)
        bad = sum(len(e.get("bad_edges", ())) for e in res[0]["evidence"])
        print(f"{'fsdp' if len(shape) == 1 else 'hsdp'} {shape} micro_batches={micro}: "
              f"{audits} audits, {len(res[0]['detections'])} detections, {bad} bad edges, "
              f"withheld {res[0]['withheld']}")


if __name__ == "__main__":
    import sys

    soak(int(sys.argv[1]) if len(sys.argv) > 1 else 100)


def llama(rank: int, world: int, shape: tuple[int, ...], steps: int, *, interval: int = 1,
          fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """The harness's Llama-style model as users run FSDP2 (bf16 parameters in the forward,
    float32 reductions, activation checkpointing), ``steps`` steps with the replay audit
    every ``interval`` steps and, if given, one fault armed through ``injectors``."""
    from injectors import Fault, arm
    from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
    from scenarios.spec.sharding import shard_model

    model = shard_model(build_model("llama", width=64, depth=2, seed=0),
                        parallel="fsdp" if len(shape) == 1 else "hsdp", mesh_shape=shape,
                        mixed_precision=True, activation_checkpointing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_of(r: int, step: int) -> Any:
        return synthetic_batch("llama", 0, r, step, 0, batch=4)

    cfg = GuardConfig(replay_interval=interval, deterministic=True)
    guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_of, config=cfg)
    withheld, seen = [], []
    with arm(Fault(**fault), guard=guard) if fault else contextlib.nullcontext() as armed:
        for step in range(steps):
            report = guard.step(step)
            if report.skipped:
                withheld.append(step)
            seen += report.detections
        seen += guard.flush()
        records = list(armed.records) if armed is not None else []
    return {"withheld": withheld, "records": records,
            "detections": [(d.check, d.step, tuple(d.suspect_ranks)) for d in seen],
            "state": [t.reshape(-1).tolist() for t in local_state(model, opt)]}


class _Running(nn.Module):
    """A running mean of its inputs kept in a buffer (outside any norm layer), updated by
    every training forward: each rank's drifts with its own batches under FSDP2."""

    mean: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def running_buffer_refusal(rank: int, world: int) -> str:
    """The error of the first audit step of a model whose forward updates a buffer."""
    mesh = mesh_for((world,))
    torch.manual_seed(0)
    model = nn.Sequential(_Running(8), nn.Linear(8, 4))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, config=cfg)
    try:
        guard.step(0)
    except ValueError as e:
        return str(e)
    return "accepted"
