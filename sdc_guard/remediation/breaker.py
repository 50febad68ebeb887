"""The circuit breaker: how many nodes one job may quarantine in a sliding window.

Many suspects at once point to software (a bad kernel, a driver, a misconfigured job), not to
hardware; draino once cordoned every node of a misconfigured cluster. So within ``window_s``
seconds a job quarantines at most ``max_nodes`` nodes (absolute) and at most
``max(1, floor(max_fraction * nodes_in_job))``: the fractional limit never forbids a single
node, the absolute one bounds a large job ("1% of 288 nodes" cannot say "never more than 5").

A detection is admitted whole or not at all: if cordoning its new suspects would cross either
limit, none of them is cordoned. Nodes this job already quarantined within the window count
once, however many detections name them again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BreakerLimits:
    max_nodes: int = 1
    max_fraction: float = 0.1
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or (
                self.max_nodes < 0):
            raise ValueError(f"max_nodes must be an int >= 0 (0 never quarantines), "
                             f"got {self.max_nodes!r}.")
        if not isinstance(self.max_fraction, (int, float)) or not 0 <= self.max_fraction <= 1:
            raise ValueError(f"max_fraction must be a number in [0, 1] (a share of the job's "
                             f"nodes), got {self.max_fraction!r}.")
        if not isinstance(self.window_s, (int, float)) or self.window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {self.window_s!r}.")

    def limit(self, nodes_in_job: int) -> int:
        """The most nodes the job may hold quarantined in one window."""
        fractional = max(1, math.floor(self.max_fraction * max(nodes_in_job, 0)))
        return min(self.max_nodes, fractional)


@dataclass(frozen=True, slots=True)
class Admission:
    cordon: tuple[str, ...]
    """Suspect nodes to quarantine now (not yet quarantined by this job in the window)."""
    known: tuple[str, ...]
    """Suspect nodes this job already quarantined in the window: evidence only."""
    tripped: bool
    reason: str = ""


def admit(suspects: Iterable[str], quarantined_at: Mapping[str, float], *, now: float,
          nodes_in_job: int, limits: BreakerLimits) -> Admission:
    """Which of ``suspects`` to quarantine, given when this job quarantined which node."""
    recent = {n for n, t in quarantined_at.items() if now - t < limits.window_s}
    suspects = tuple(dict.fromkeys(suspects))
    known = tuple(n for n in suspects if n in recent)
    new = tuple(n for n in suspects if n not in recent)
    if not new:
        return Admission((), known, False)
    limit = limits.limit(nodes_in_job)
    total = len(recent) + len(new)
    if total > limit:
        fraction = (f"max_fraction={limits.max_fraction} of {nodes_in_job} nodes")
        return Admission((), known, True, (
            f"circuit breaker: quarantining {', '.join(new)} would make {total} nodes "
            f"quarantined by this job within {limits.window_s:g} s ({len(recent)} already), "
            f"over the limit of {limit} (max_nodes={limits.max_nodes}, {fraction}); nothing "
            f"was cordoned. Many suspects at once point to software, not hardware."))
    return Admission(new, known, False)
