"""Check "nonfinite": NaN/Inf in the gradients, before and after the all-reduce.

The comm hook flags, per step, whether any bucket was non-finite before the
all-reduce (the local gradients) and after it (the reduced result); on the CPU
both flags are host values by the end of the backward pass (the C kernel
computes them in the scaling pass, and in one read of each bucket's result in
the all-reduce's callback, on the communication thread).

**Containment needs no communication.** The reduced result is the same on every
rank (each element's sum is computed once by the all-reduce and copied to every
rank: DDP's replicas stay identical only because of it), and a NaN or Inf in any
rank's local gradients always reaches it (NaN and Inf propagate through a sum).
So a rank whose reduced gradients are non-finite withholds its own optimizer
step at once, and in the usual cases (one rank's NaN; a fault in the reduction)
every rank does, at the same step, without a word exchanged. Only a fault in one
rank's *copy* of the result after the all-reduce makes the ranks differ: that
rank withholds, the others apply their (correct) step.

**Naming the suspects needs one word.** Every rank puts its two flags per step as
bits of int64 words (``vote.flag_words``: rank r owns its own bits, so the SUM
all-reduce of the words is their OR and names every rank that flagged anything,
with no second collective). The words of ``GuardConfig.nonfinite_exchange_interval``
steps travel together in one small all-reduce that is started at the end of the
window and collected at the next step, when it has long arrived: the check has no
meeting point and never waits. The detections are reported then, with the step
they happened at, in the same call on every rank (so a loop that stops at the
first detection stops everywhere together). ``SDCGuard.flush()`` sends and collects
the last, partial window after the last step.

Suspects:

* ranks whose *local* gradients were non-finite;
* if the reduced result is non-finite on some rank while every local gradient
  was finite, the fault is in the reduction or the link: a detection that names
  the ranks that saw it (a single rank's bad result is its own; all ranks alike
  means the reduction itself, with no suspect).

With a ``GradScaler`` (fp16 mixed precision) Inf gradients are expected: the
scaler skips the step and lowers the scale (the check does not withhold it: the
scaler must see the overflow). Local non-finite gradients are then not reported;
a non-finite *reduced* result while every local gradient was finite still is
(averaging finite values cannot overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sdc_guard.comm_hook import GuardCommHook
from sdc_guard.report import Detection
from sdc_guard.vote import PendingSum, flag_rows, flag_words


@dataclass
class _Sent:
    steps: list[int]
    word: PendingSum


class NonFiniteCheck:
    def __init__(
        self,
        hook: GuardCommHook,
        *,
        group: dist.ProcessGroup | None = None,
        expect_overflow: bool = False,
        exchange_interval: int = 1,
    ) -> None:
        self.hook = hook
        self.group = group
        self.expect_overflow = expect_overflow
        self.exchange_interval = exchange_interval
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._window: list[tuple[int, bool, bool]] = []
        self._sent: _Sent | None = None
        self.withheld_here = False
        """Set by ``verdict``: this rank's reduced gradients of the step are non-finite, so
        it must not apply them (left False with a ``GradScaler``, which skips by itself)."""

    def verdict(self, step: int, device: torch.device) -> list[Detection]:
        """Flag ``step`` (see the module doc): returns the detections of the word that is due.

        Those are of earlier steps (each carries its own). ``withheld_here`` says whether
        this rank must withhold ``step``'s optimizer step.
        """
        local, reduced = self.hook.host_flags()
        found = self.collect()  # the word sent at the end of the previous window
        self.withheld_here = reduced and not self.expect_overflow
        self._window.append((step, local, reduced))
        if len(self._window) >= self.exchange_interval:
            self._send(device)
        return found

    def _send(self, device: torch.device) -> None:
        flags = [f for _, local, reduced in self._window for f in (local, reduced)]
        words = flag_words(flags, self.rank, self.world_size)
        word = PendingSum(torch.tensor(words, dtype=torch.int64, device=device), self.group,
                          in_place=True)
        self._sent = _Sent([s for s, _, _ in self._window], word)
        self._window = []

    def collect(self) -> list[Detection]:
        """Judge the word in flight, if any: it was sent a step ago, so this rarely waits.
        Starts no collective."""
        sent, self._sent = self._sent, None
        self.withheld_here = False
        if sent is None:
            return []
        rows = flag_rows(sent.word.wait_all(), 2 * len(sent.steps), self.world_size)
        found: list[Detection] = []
        for i, step in enumerate(sent.steps):
            found += self.judge(step, [row[2 * i:2 * i + 2] for row in rows])
        return found

    def flush(self, device: torch.device) -> list[Detection]:
        """Send the partial window and judge everything outstanding. Collective when a
        window is open: every rank has the same window, so all of them send."""
        found = self.collect()
        if self._window:
            self._send(device)
            found += self.collect()
        return found

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
