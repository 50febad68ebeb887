"""Majority votes over per-rank values, and the small collectives that gather them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist


def majority_outliers(values: Sequence[Hashable]) -> tuple[int, ...] | None:
    """Ranks whose value differs from a strict majority; ``None`` when there is none.

    ``()`` means everyone agrees. With two ranks that disagree there is no strict
    majority (1 of 2), so the answer is ``None``: a mismatch without a suspect.
    """
    if not values:
        return ()
    value, count = Counter(values).most_common(1)[0]
    if count * 2 <= len(values):
        return None
    return tuple(r for r, v in enumerate(values) if v != value)


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank into a ``(world, len)`` tensor (one collective)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)
