"""A rank that repeats a step or goes back one, on a 3-rank guarded run with the replay audit
on every step: the step agreement names it on every rank, at the same call, never a hang to
the process group's timeout and never a conviction (the skipped step is attacked in
``tests/sdc_guard/test_watch_dist.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_guard import Detection, GuardConfig, SDCGuard
from tests.launch import run_ranks
from tests.workers import batch_for, loss_fn, make_mlp

pytestmark = pytest.mark.timeout(240)

STEPS = {
    "repeated": [0, 1, 2, 2, 3, 4, 5],  # rank 1 runs step 2 twice
    "back": [0, 1, 2, 1, 2, 3, 4],  # rank 1 goes back to step 1
}


def wrong_order_run(rank: int, world: int, case: str) -> dict[str, Any]:
    """Every rank trains guarded steps 0, 1, 2, ...; rank 1 calls them in ``STEPS[case]``."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    detections: list[Detection] = []
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(replay_interval=1, deterministic=True),
                     on_detection=detections.append)
    steps = STEPS[case] if rank == 1 else list(range(len(STEPS[case])))
    at = 0
    try:
        for at, s in enumerate(steps):  # noqa: B007  (``at`` says where it raised)
            guard.step(s)
        guard.flush()
    except ValueError as e:
        return {"error": str(e), "type": type(e).__name__, "at": at,
                "detections": len(detections)}
    return {"error": None, "type": None, "at": None, "detections": len(detections)}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_a_rank_that_repeats_or_goes_back_a_step_is_named_on_every_rank(case: str) -> None:
    res = run_ranks(wrong_order_run, 3, case, timeout=120)
    for r in res:
        # StepsDisagree from the step agreement, or the replay audit's ValueError: both name it
        assert r["error"] is not None, r
        assert "the ranks are not at one step" in r["error"] and "on rank 1" in r["error"], r
        assert r["detections"] == 0, r
    assert len({r["at"] for r in res}) == 1  # every rank, at the same call
