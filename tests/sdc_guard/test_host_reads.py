"""At most one read from the device per guarded step, counted on the path GPUs take.

A read to the host (``.item()``, ``.tolist()``, ``bool(t)``, a value-shaped op) makes a GPU's
host wait for every queued kernel: the next ones start late. The guard reads once per step at
most (``sdc_guard.hostread``): the values every due check needs before the optimizer step
(the non-finite flags, the containment answer, the flags words and the weights vote in
flight, the replay's step word) travel in one read, and a step where no check is due or
awaited reads nothing. Counted here on the CPU with the C kernel off and the CPU treated as
a device (``cpu_as_device``), so the code that runs is the code a GPU runs
(``tests/hostsync.py`` says what counts as a read). The baseline is a plain loop with the
same optimizer: SGD reads nothing; AdamW reads its step counters on the host (CPU tensors
on a GPU too, so no sync there), which both sides pay alike.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import run_ranks
from tests.sdc_guard import read_workers

STEPS = 9
STEADY = slice(3, STEPS)
"""Steps 0-2 set up once (the start check, the first vote, the first exchanges, plans)."""


def _totals(per_step: list[dict[str, int]]) -> list[int]:
    return [sum(step.values()) for step in per_step]


@pytest.mark.parametrize(("name", "config"), [
    ("defaults", {}),
    ("checksum", {"checksum": True}),
    ("replay every step", {"replay_interval": 1, "deterministic": True}),
    ("everything", {"checksum": True, "replay_interval": 2, "deterministic": True,
                    "nonfinite_exchange_interval": 1}),
])
def test_a_steady_guarded_step_reads_from_the_device_once(name: str,
                                                           config: dict[str, Any]) -> None:
    plain = run_ranks(read_workers.reads_per_step, 2, None, "sgd", STEPS)
    guarded = run_ranks(read_workers.reads_per_step, 2, config, "sgd", STEPS)
    for rank in range(2):
        assert _totals(plain[rank]) == [0] * STEPS, plain[rank]
        # exactly one: the step's read (a second read anywhere fails this)
        assert _totals(guarded[rank])[STEADY] == [1] * (STEPS - 3), (name, guarded[rank])
        assert all(step == {"tolist": 1} for step in guarded[rank][STEADY]), guarded[rank]


def test_adamw_reads_the_same_beside_the_guard_plus_one() -> None:
    """AdamW's own reads (its step counters) are the same with and without the guard."""
    plain = run_ranks(read_workers.reads_per_step, 2, None, "adamw", STEPS)
    guarded = run_ranks(read_workers.reads_per_step, 2, {"checksum": True}, "adamw", STEPS)
    for rank in range(2):
        base = _totals(plain[rank])[STEADY]
        assert base and all(b > 0 for b in base)
        assert [g - b for g, b in zip(_totals(guarded[rank])[STEADY], base,
                                      strict=True)] == [1] * len(base)


def test_a_step_where_no_check_is_due_reads_nothing() -> None:
    """The weights vote every 3 steps alone: it is taken after steps 0, 3, 6 and read in the
    next step; the other steps read nothing."""
    config = {"nonfinite": False, "weights_interval": 3}
    guarded = run_ranks(read_workers.reads_per_step, 2, config, "sgd", STEPS)
    for rank in range(2):
        totals = _totals(guarded[rank])
        # step 0 also asks whether the replicas start alike (once)
        assert totals[1:] == [1 if s % 3 == 1 else 0 for s in range(1, STEPS)], totals


def test_a_steady_guarded_fsdp2_step_reads_from_the_device_once() -> None:
    """FSDP 2: the defaults (the non-finite check's veto word over every rank, the at-rest
    weights check's vote) add one read to a plain FSDP2 step, the step's read."""
    plain = run_ranks(read_workers.reads_per_step, 2, None, "sgd", STEPS, parallel="fsdp")
    guarded = run_ranks(read_workers.reads_per_step, 2, {}, "sgd", STEPS, parallel="fsdp")
    for rank in range(2):
        base = _totals(plain[rank])[STEADY]
        assert [g - b for g, b in zip(_totals(guarded[rank])[STEADY], base, strict=True)] == [
            1] * len(base), (plain[rank], guarded[rank])
