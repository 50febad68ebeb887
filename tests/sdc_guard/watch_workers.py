"""Rank functions for tests/sdc_guard/test_watch_dist.py: detections a person can follow, the
step agreement and the watchdog, on real gloo groups."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard import GuardConfig, SDCGuard
from tests.workers import batch_for, loss_fn, make_mlp


def _guard(cfg: dict[str, Any], found: list[sdc_guard.Detection] | None = None) -> SDCGuard:
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                    config=GuardConfig(**cfg),
                    on_detection=None if found is None else found.append)


def followed_run(rank: int, world: int, fault: str, log: str) -> dict[str, Any]:
    """Eight steps with a fault on rank 1 at step 3: ``"grad_nan"`` (a NaN in its local
    gradients: withheld everywhere, reported when the word of steps 0-3 arrives at step 4)
    or ``"weight_flip"`` (its weights after the step: not containable). What each step's
    report and each detection say."""
    found: list[sdc_guard.Detection] = []
    guard = _guard({"event_log": log, "nonfinite_exchange_interval": 4,
                    "repair_by_majority": False}, found)
    model = guard.model
    if fault == "grad_nan" and rank == 1:
        def nan(bucket: Any) -> None:
            if guard.backend.step == 3:
                bucket.buffer()[0] = float("nan")
        guard.backend.before.append(nan)
    reports = []
    for s in range(8):
        reports.append(guard.step(s))
        if fault == "weight_flip" and rank == 1 and s == 2:  # after step 2: seen at step 3
            with torch.no_grad():
                w = next(model.module.parameters())
                w.view(-1).view(torch.int32)[3] ^= 1 << 20
    guard.flush()
    return {
        "withheld": [(r.step, r.skipped, r.withheld_by) for r in reports if r.skipped],
        "arrived": [(r.step, d.check, d.step, d.suspect_ranks, d.contained)
                    for r in reports for d in r.detections],
        "found": [(d.check, d.step, d.contained, d.repaired) for d in found],
    }


def out_of_step_run(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 skips step 3 (it calls 0, 1, 2, 4, 5, ...): the error each rank gets, and the loop
    index it came at."""
    guard = _guard(cfg)
    steps = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] if rank != 1 else [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    at = 0
    try:
        for at, s in enumerate(steps):  # noqa: B007  (``at`` says where it raised)
            guard.step(s)
        guard.flush()
    except ValueError as e:
        return {"error": str(e), "type": type(e).__name__, "at": at}
    return {"error": None, "type": None, "at": None}


def fallen_out_run(rank: int, world: int, log: str, timeout_s: float) -> dict[str, Any]:
    """Rank 1 stops calling ``guard.step`` after step 2 (it sleeps between steps): the others
    wait in step 3 until their watchdog names it and ends their process."""
    guard = _guard({"event_log": log, "collective_timeout_s": timeout_s})
    for s in range(6):
        if rank == 1 and s == 3:
            time.sleep(600)
        guard.step(s)
    return {"finished": True}
