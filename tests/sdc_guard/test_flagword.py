"""The deferred flag word on gloo ranks: when a window travels, what every rank reads back,
the clean/tainted bookkeeping, the partial window at ``flush`` and the words dropped at ``rewind``."""

from __future__ import annotations

from typing import Any

import torch

from sdc_guard.checks.flagword import DeferredFlags
from sdc_guard.report import Detection
from tests.launch import run_ranks


class _Recorder:
    """A judge that reports a detection for every step where some rank raised a flag."""

    def __init__(self) -> None:
        self.judged: list[tuple[int, list[list[int]]]] = []
        self.verified_steps: list[int] = []
        self.taints = 0

    def judge(self, step: int, rows: list[list[int]]) -> list[Detection]:
        self.judged.append((step, rows))
        suspects = tuple(r for r, row in enumerate(rows) if any(row))
        return [Detection("test", step, suspects)] if suspects else []

    def verified(self, step: int) -> None:
        self.verified_steps.append(step)

    def tainted(self) -> None:
        self.taints += 1


def _flags(rank: int, step: int) -> tuple[bool, bool, bool]:
    """Rank 1 raises its second flag at step 1, rank 2 its first and third at step 4."""
    return (rank == 2 and step == 4, rank == 1 and step == 1, rank == 2 and step == 4)


def _exchange(rank: int, world: int) -> dict[str, Any]:
    flags = DeferredFlags(3, 2, device=torch.device("cpu"))
    judge = _Recorder()
    seen: list[list[tuple[int, tuple[int, ...]]]] = []
    for step in range(5):  # windows [0, 1] and [2, 3] travel; step 4 stays open
        seen.append([(d.step, d.suspect_ranks) for d in flags.collect(judge)])
        flags.add(step, _flags(rank, step))
    at_flush = [(d.step, d.suspect_ranks) for d in flags.flush(judge)]
    return {"seen": seen, "flush": at_flush, "judged": judge.judged,
            "verified": judge.verified_steps, "taints": judge.taints}


def test_windows_travel_every_interval_and_are_judged_at_the_next_collect() -> None:
    res = run_ranks(_exchange, 3)
    for r in res:  # the same answers on every rank
        assert r["seen"] == [[], [], [(1, (1,))], [], []]
        assert r["flush"] == [(4, (2,))]
        assert [s for s, _ in r["judged"]] == [0, 1, 2, 3, 4]
        assert r["judged"][1][1] == [[0, 0, 0], [0, 1, 0], [0, 0, 0]]
        assert r["judged"][4][1] == [[0, 0, 0], [0, 0, 0], [1, 0, 1]]
        assert r["verified"] == [0, 2, 3]
        assert r["taints"] == 2


def _rewound(rank: int, world: int) -> dict[str, Any]:
    flags = DeferredFlags(1, 2, device=torch.device("cpu"))
    judge = _Recorder()
    for step in range(4):  # [0, 1] judged at step 2, [2, 3] sent at step 3
        flags.collect(judge)
        flags.add(step, (rank == 0,))
    flags.add(4, (True,))  # an open window
    flags.rewind()
    out: dict[str, Any] = {"after_rewind": flags.flush(judge),
                           "judged": [s for s, _ in judge.judged]}
    flags.add(5, (False,))
    flags.add(6, (False,))  # a full window: it travels
    out["later"] = flags.flush(judge)
    out["verified"] = judge.verified_steps
    try:
        flags.add(7, (True, False))
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_rewind_drops_the_words_in_flight_and_the_open_window() -> None:
    for r in run_ranks(_rewound, 2):
        assert r["after_rewind"] == [] and r["judged"] == [0, 1]
        assert r["later"] == [] and r["verified"] == [5, 6]  # the new timeline goes on
        assert "step 7 has 2 flags, but this word carries 1" in r["refused"]
