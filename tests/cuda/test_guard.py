"""Guarded DDP steps on the device with nccl, one rank per GPU (a ring of one on a single
GPU): nonfinite, weights and replay every step, and a NaN in a local gradient named and its
step withheld on every rank."""

from __future__ import annotations

from typing import Any

import torch

from tests.cuda.support import fill, on

NAN_STEP = 6


def guarded_rank(rank: int, world: int, device: str) -> dict[str, Any]:
    """Eight guarded steps of the reference MLP; at ``NAN_STEP`` the last rank's gradient of
    the first layer's weight gets a NaN in its bucket, before the hook checks and digests it.
    ``device`` is a device type."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
    from injectors import Fault, arm
    from sdc_guard import GuardConfig, SDCGuard

    dev = on(device)  # "cuda": the GPU run_ranks set for this rank
    model = DDP(reference_mlp().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        x, y = classification_batch(r, step, batch=128)
        return x.to(dev), y.to(dev)

    guard = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=GuardConfig(deterministic=True, replay_interval=1))
    arm(Fault(site="gradient_before_allreduce", rank=world - 1, step=NAN_STEP,
              target="0.weight", index=0, kind="set", value=float("nan")), guard=guard)
    reports = [guard.step(s) for s in range(8)]
    flushed = guard.flush()  # the non-finite flags of steps 0-7 travel in one word
    dist.barrier()
    return {"detections": [(d.check, d.step, list(d.suspect_ranks))
                           for d in [*(d for r in reports for d in r.detections), *flushed]],
            "skipped": [r.step for r in reports if r.skipped],
            "device": str(dev), "backend": dist.get_backend()}


def test_guarded_ddp_names_a_nan_and_withholds_its_step(
        device: str = "cuda", world: int | None = None,
        record: dict[str, Any] | None = None) -> None:
    """On ``world`` ranks (every GPU by default; 3 on the CPU): the NaN named by the non-finite
    check and by the replay, that step withheld on every rank, no other detection."""
    from scenarios.run.launch import run_ranks

    out = fill(record)
    cuda = torch.device(device).type == "cuda"
    world = world or (torch.cuda.device_count() if cuda else 3)
    backend = "nccl" if cuda else "gloo"
    results = run_ranks(guarded_rank, world, "cuda" if cuda else "cpu", timeout=600,
                        backend=backend)
    # The NaN is written into the local gradient before the hook digests it, so the
    # replay audit sees rank world-1's own gradient disagree with its replay as well:
    # blamed by the arbitration (a ring of one: by its own replay), nobody with 2 ranks.
    last = world - 1
    expected = [("nonfinite", NAN_STEP, [last]),
                ("replay", NAN_STEP, [] if world == 2 else [last])]
    out.update(world=world, backend=backend, expected=expected,
               expected_skipped=[NAN_STEP], ranks=results)
    for r, res in enumerate(results):
        assert sorted(tuple(d) for d in res["detections"]) == expected, (r, res)
        assert res["skipped"] == [NAN_STEP], (r, res)
