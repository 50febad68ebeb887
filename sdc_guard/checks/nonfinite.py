"""Check "nonfinite": NaN/Inf in the gradients, before and after the all-reduce.

The comm hook keeps a device-side flag per step (any bucket non-finite before
the all-reduce) and the reduced results, which are checked after the backward
pass. Every rank then contributes ``[local, reduced]`` to one all-reduce of the
two counts packed into the halves of one int64 (``pack_flags``; the cheapest
collective there is, see ``sdc_guard.vote.sum_word``). On a replay audit step
the replay audit adds its own term to the same word: one collective for both
checks (``SDCGuard.step``). The sum is the same on every rank, so the decision
is too. Only when it is non-zero (a detection, or a GradScaler overflow step)
does a second collective gather each rank's flags to name it:

* ranks whose *local* gradients were non-finite are the suspects;
* if the reduced result is non-finite on some rank while every local gradient
  was finite, the fault is in the reduction or the link: a detection that names
  the ranks that saw it (a single rank's bad result is its own; all ranks alike
  means the reduction itself, with no suspect).

With a ``GradScaler`` (fp16 mixed precision) Inf gradients are expected: the
scaler skips the step and lowers the scale. Then local non-finite gradients are
not reported; a non-finite *reduced* result while every local gradient was
finite still is (averaging finite values cannot overflow).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdc_guard.comm_hook import GuardCommHook
from sdc_guard.report import Detection
from sdc_guard.vote import all_gather_rows, pack_flags, sum_word


def any_flag(flags: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Is either count of int32 ``flags = [local, reduced]`` non-zero on any rank?

    One all-reduce of one int64 (``pack_flags``) and one host sync.
    """
    return sum_word(pack_flags(flags), group) != 0


class NonFiniteCheck:
    def __init__(
        self,
        hook: GuardCommHook,
        *,
        group: dist.ProcessGroup | None = None,
        expect_overflow: bool = False,
    ) -> None:
        self.hook = hook
        self.group = group
        self.expect_overflow = expect_overflow

    def row(self, device: torch.device) -> torch.Tensor:
        """This rank's int64 ``[local, reduced]`` flags, for a gather shared with other checks."""
        return self.hook.flags(device).to(torch.int64)

    def verdict(self, step: int, device: torch.device) -> list[Detection]:
        """Judge the flags of ``step`` on every rank: one collective, two when something is flagged."""
        flags = self.hook.flags(device)
        if not any_flag(flags, self.group):  # the check's one collective and host sync
            return []
        return self.judge(step, all_gather_rows(flags, self.group).tolist())

    def judge(self, step: int, rows: list[list[int]]) -> list[Detection]:
        """The detection, if any, from every rank's ``[local, reduced]`` flags (row r: rank r)."""
        local = tuple(r for r, row in enumerate(rows) if row[0])
        reduced = tuple(r for r, row in enumerate(rows) if row[1])
        evidence = {"local_nonfinite": list(local), "reduced_nonfinite": list(reduced)}
        if local and not self.expect_overflow:
            return [
                Detection(
                    "nonfinite",
                    step,
                    local,
                    detail=f"non-finite local gradients on rank(s) {list(local)} "
                    "before the all-reduce",
                    evidence=evidence,
                )
            ]
        if reduced and not local:
            world = len(rows)
            suspects = reduced if len(reduced) < world else ()
            where = (
                f"only on rank(s) {list(reduced)}: a fault in their reduction or link"
                if suspects
                else "on every rank: the reduction itself, no rank to blame"
            )
            return [
                Detection(
                    "nonfinite",
                    step,
                    suspects,
                    detail="all local gradients finite but the all-reduced result is "
                    f"non-finite {where}",
                    evidence=evidence,
                )
            ]
        return []
