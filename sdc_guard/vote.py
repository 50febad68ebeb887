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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def start_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None = None
                      ) -> tuple[dist.Work, torch.Tensor]:
    """Start gathering a small 1-D tensor from every rank; ``(work, rows)``.

    After ``work.wait()``, ``rows`` is ``(world, len)`` with rank r's tensor in row r.
    Done as a SUM all-reduce of a zero matrix in which each rank fills its own row
    (integer addition of one value and zeros is exact; floating-point tensors travel
    as integers of the same size, so -0.0 and NaN payloads survive). On gloo a small
    all-reduce is several times cheaper than an all_gather: about 0.3 against 1.1 ms
    with 3 ranks here.
    """
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT_OF_SIZE[flat.element_size()])
    elif flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    rows = torch.zeros(dist.get_world_size(group), flat.numel(), dtype=flat.dtype,
                       device=flat.device)
    rows[dist.get_rank(group)] = flat
    work = dist.all_reduce(rows, group=group, async_op=True)
    if work is None:  # pragma: no cover - async_op=True always returns a Work handle
        raise RuntimeError("torch.distributed.all_reduce(async_op=True) returned no Work")
    return work, rows


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank into a ``(world, len)`` tensor (one collective).

    Integer dtypes come back as they were; other dtypes as integers with the same bits.
    """
    work, rows = start_gather_rows(t, group)
    work.wait()
    return rows


def gather_if_different(word: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[int] | None:
    """``None`` when every rank holds the same int64 ``word``; else every rank's word.

    The common case costs one all-reduce (MAX over ``[w, ~w]``, i.e. the maximum and
    the bitwise complement of the minimum), which on gloo is about 4x cheaper than
    an all_gather; the all_gather runs only when the words differ. Every rank gets
    the same answer, so the second collective happens on every rank or on none.
    """
    w = word.reshape(1).to(torch.int64)
    both = torch.cat([w, torch.bitwise_not(w)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, not_smallest = both.tolist()
    if largest == ~not_smallest:  # max == min: every rank holds the same word
        return None
    return [int(v) for v in all_gather_rows(w, group)[:, 0].tolist()]
