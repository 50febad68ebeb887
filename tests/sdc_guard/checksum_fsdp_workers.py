"""Rank functions of the checksum check's FSDP2 tests (``test_checksum_fsdp.py``): the
campaign's models sharded by the harness (``scenarios.spec.sharding.shard_model``), trained
through ``SDCGuard`` with the checksum check on, faults armed through ``injectors``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from injectors import Fault, arm
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.sharding import shard_model
from sdc_guard import ChecksumConfig, GuardConfig, SDCGuard
from sdc_guard.checks.checksum import ChecksumCheck
from sdc_guard.fingerprints.native import disable_native

WIDTHS = {"mlp": 15, "llama": 64}
"""The MLP 16-15-15-4: 15 rows do not split evenly over 2 shards (FSDP2 pads them)."""


def sharded(kind: str, shape: tuple[int, ...], *, mixed_precision: bool = False,
            checkpointing: bool = False) -> nn.Module:
    """``kind`` (``"mlp"`` or ``"llama"``) under FSDP2 on a 1-D mesh (FSDP) or a 2-D one
    (HSDP), as the campaigns shard it."""
    return shard_model(build_model(kind, width=WIDTHS[kind], depth=2, seed=0),
                       parallel="fsdp" if len(shape) == 1 else "hsdp", mesh_shape=shape,
                       mixed_precision=mixed_precision, activation_checkpointing=checkpointing)


def llama_linears() -> list[str]:
    """The names of the Llama-style model's ``nn.Linear`` layers."""
    model = build_model("llama", width=WIDTHS["llama"], depth=2, seed=0)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _batches(kind: str, micro: int) -> Any:
    def batch_for(rank: int, step: int) -> Any:
        mbs = [synthetic_batch(kind, 0, rank, step, i, batch=4) for i in range(micro)]
        return mbs[0] if micro == 1 else mbs
    return batch_for


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters and the optimizer state, copied."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = [local(p) for p in model.parameters()]
    for p in model.parameters():
        for k in sorted(opt.state.get(p, {})):
            out.append(local(opt.state[p][k]))
    return out


def _plain(kind: str, shape: tuple[int, ...], steps: int, rank: int, micro: int,
           **how: bool) -> list[torch.Tensor]:
    """FSDP2 without the guard, from the same start on the same batches: its final state."""
    model = sharded(kind, shape, **how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch_for = _batches(kind, micro)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        batch = batch_for(rank, step)
        for i, mb in enumerate(batch if micro > 1 else [batch]):
            model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            scenario_loss(model, mb).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return local_state(model, opt)


def guarded(rank: int, world: int, shape: tuple[int, ...], kind: str, steps: int, *,
            faults: tuple[dict[str, Any], ...] = (), micro: int = 1, native: bool = True,
            mixed_precision: bool = False, checkpointing: bool = False,
            nonfinite: bool = True, bound: str = "exact",
            compare_plain: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps of ``kind`` under FSDP2 through the guard (the defaults and the
    checksum check), ``faults`` armed through ``injectors`` (each with its own step).
    ``native=False``: the torch operations only (no C kernel in this rank);
    ``nonfinite=False``: the checksum check contains its faults alone; ``bound``: the
    checksum's (``ChecksumConfig.bound``).

    Returns the detections as this rank saw them (check, step, suspects), their evidence
    per rank, the steps withheld, the steps at which this rank's shards changed, where the
    faults fired on this rank, what the check found in the model (checked and skipped
    layers, layers never called, calls on the C path), and, ``compare_plain``, whether the
    final shards equal unguarded FSDP2's bit for bit."""
    if not native:
        disable_native()
    how = {"mixed_precision": mixed_precision, "checkpointing": checkpointing}
    model = sharded(kind, shape, **how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=_batches(kind, micro),
                     config=GuardConfig(checksum=ChecksumConfig(bound=bound), micro_batches=micro,
                                       nonfinite=nonfinite))
    check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    handles = [arm(Fault(**f), guard=guard) for f in faults]
    seen, withheld, moved = [], [], []
    before = local_state(model, opt)
    for step in range(steps):
        report = guard.step(step)
        seen += report.detections
        if report.skipped:
            withheld.append(step)
        after = local_state(model, opt)
        if len(after) != len(before) or not all(
                torch.equal(a, b) for a, b in zip(after, before, strict=True)):
            moved.append(step)
        before = after
    seen += guard.flush()
    fired = sorted({rec["step"] for h in handles for rec in h.records})
    for h in handles:
        h.remove()
    same = None
    if compare_plain:
        plain = _plain(kind, shape, steps, rank, micro, **how)
        mine = local_state(model, opt)
        same = len(plain) == len(mine) and all(
            torch.equal(a, b) for a, b in zip(mine, plain, strict=True))
    # Do the replicas of each shard hold it alike (HSDP)? Every rank's words, per shard
    # (shards of padded rows differ in size).
    words = torch.cat([t.reshape(-1).double() for t in local_state(model, opt)])
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, words)
    sets = guard.backend.layout.sets
    return {
        "detections": [(d.check, d.step, tuple(d.suspect_ranks)) for d in seen],
        "ranks": [d.evidence.get("ranks") for d in seen],
        "entries": [d.evidence.get("entries") for d in seen],
        "steps": steps,
        "withheld": withheld,
        "moved": moved,
        "fired": fired,
        "layers": [layer.name for layer in check.layers],
        "linears": [n for n, m in model.named_modules() if isinstance(m, nn.Linear)],
        "skipped": check.skipped,
        "uncalled": check.uncalled,
        "gathered": check.gathered,
        "native_calls": check.native_calls,
        "same_as_plain": same,
        "replicas_alike": all(torch.equal(rows[r], rows[s[0]]) for s in sets for r in s),
    }
