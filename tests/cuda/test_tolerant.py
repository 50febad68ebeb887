"""The tolerant replay audit on the device without deterministic kernels: how far apart the
device's recomputations of one batch come out (the calibration), no detection on clean steps,
and an exponent flip in an activation named."""

from __future__ import annotations

from typing import Any

import torch

from tests.cuda.support import fill, on

FLIP_STEP = 8


def tolerant_rank(rank: int, world: int, device: str, bf16: bool = False) -> dict[str, Any]:
    """Twelve steps of the reference MLP with the tolerant audit every step (the default
    kernels: cuBLAS and cuDNN as they come); at ``FLIP_STEP`` bit 30 of one element of the
    last rank's first ReLU output flips in its own step. ``bf16``: under ``torch.autocast``
    in bfloat16 (the flip: bit 14, the top exponent bit of a bfloat16)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
    from injectors import Fault, arm
    from sdc_guard import GuardConfig, SDCGuard

    dev = on(device)
    model = DDP(reference_mlp().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        x, y = classification_batch(r, step, batch=128)
        return x.to(dev), y.to(dev)

    cfg = GuardConfig(replay_interval=1, replay_mode="tolerant", nonfinite=False,
                      weights_interval=0)
    def autocast_loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss: torch.Tensor = cross_entropy_loss(m, batch)
        return loss

    guard = SDCGuard(model, opt, loss_fn=autocast_loss if bf16 else cross_entropy_loss,
                     batch_for=batch_for, config=cfg)
    audit = guard.checks[0]
    arm(Fault(site="activation", rank=world - 1, step=FLIP_STEP, target="1",
              bits=(14,) if bf16 else (30,), index=0), guard=guard)
    found = []
    for s in range(12):
        found += guard.step(s).detections
    dist.barrier()
    return {"detections": [(d.check, d.step, list(d.suspect_ranks), d.transient) for d in found],
            "tolerance": getattr(audit, "tolerance", None),
            "half": getattr(audit, "half", None),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "device": str(dev)}


def test_tolerant_replay_calibrates_on_the_device_and_names_a_flip(
        device: str = "cuda", world: int | None = None,
        record: dict[str, Any] | None = None) -> None:
    """On ``world`` ranks (every GPU by default): a tolerance between the floor and the
    ceiling, no deterministic algorithms, and only the flip's step detected: named transient
    on its rank (with two or more ranks; with one, its own rerun tells the same)."""
    from scenarios.run.launch import run_ranks
    from sdc_guard.checks.sketch import CEILING, FLOOR

    out = fill(record)
    cuda = torch.device(device).type == "cuda"
    world = world or (torch.cuda.device_count() if cuda else 1)
    results = run_ranks(tolerant_rank, world, "cuda" if cuda else "cpu", timeout=600,
                        backend="nccl" if cuda else "gloo")
    last = world - 1
    expected = [("replay", FLIP_STEP, [last], True)]
    out.update(world=world, expected=expected, ranks=results)
    for r, res in enumerate(results):
        assert not res["deterministic_algorithms"], (r, res)
        assert res["tolerance"] is not None and FLOOR <= res["tolerance"] <= CEILING, (r, res)
        assert [tuple(d) for d in res["detections"]] == expected, (r, res)


def test_tolerant_replay_in_bfloat16_finds_half_precision_and_names_a_flip(
        device: str = "cuda", world: int | None = None,
        record: dict[str, Any] | None = None) -> None:
    """The same under ``torch.autocast`` in bfloat16: the audit finds its products in half
    precision (its ceiling ``CEILING_HALF``), and on the device's own roundings only the
    flip's step is detected, named transient on its rank."""
    from scenarios.run.launch import run_ranks
    from sdc_guard.checks.sketch import CEILING_HALF, FLOOR

    out = fill(record)
    cuda = torch.device(device).type == "cuda"
    world = world or (torch.cuda.device_count() if cuda else 1)
    results = run_ranks(tolerant_rank, world, "cuda" if cuda else "cpu", True, timeout=600,
                        backend="nccl" if cuda else "gloo")
    expected = [("replay", FLIP_STEP, [world - 1], True)]
    out.update(world=world, expected=expected, ranks=results)
    for r, res in enumerate(results):
        assert res["half"] is True, (r, res)
        assert res["tolerance"] is not None and FLOOR <= res["tolerance"] <= CEILING_HALF, (r, res)
        assert [tuple(d) for d in res["detections"]] == expected, (r, res)
