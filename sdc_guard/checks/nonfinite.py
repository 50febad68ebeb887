"""Check "nonfinite": NaN/Inf in the gradients, before and after the all-reduce.

The check subscribes to the comm hook for two flags per bucket: whether its local
gradients were non-finite (computed in the fused 1/world scaling pass,
``sdc_guard.scaling``) and whether its reduced result is (read here, in the
all-reduce's callback, on the communication thread). On the CPU both are host
values by the end of the backward pass (the C kernel); a device buffer's reduced
flag is computed on the caller's thread at the verdict, one host sync for all.

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
bits of int64 words (``collectives.flag_words``: rank r owns its own bits, so the SUM
all-reduce of the words is their OR and names every rank that flagged anything,
with no second collective). The words of ``GuardConfig.nonfinite_exchange_interval``
steps travel together in one small all-reduce that is started at the end of the
window and collected at the next step, when it has long arrived: the check has no
meeting point and never waits. The detections are reported then, with the step
they happened at, in the same call on every rank (so a loop that stops at the
first detection stops everywhere together). ``SDCGuard.flush()`` sends and collects
the last, partial window after the last step (``flagword.DeferredFlags``, shared with
the checksum check).

Suspects:

* ranks whose *local* gradients were non-finite, unless another rank reproduced them:
  on a step whose reduced result is non-finite every rank recomputes its ring
  neighbour's batch from the same weights (``NeighbourRecompute``; only then, and on
  its own, no collective) and adds a third flag, "my recomputation of the next rank's
  batch was non-finite too". A NaN that the batch or the model's numerics produce (a bad
  sample, an overflow) comes back on other hardware: reported without a suspect, so no
  healthy node is quarantined for it; one that does not come back names its rank. Under
  FSDP2 and HSDP no rank can recompute alone: on a step whose containment answer says
  some rank's gradients were non-finite (alike on every rank), every rank recomputes
  another's batch at once through the sharded model (``ShardedRecompute``): its ring
  neighbour's, or under HSDP that of the rank holding its shards in the next replica, whose
  parameters come from another copy of every shard (``_partner``);
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

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket

from sdc_guard.checks.base import Check, Verdict
from sdc_guard.checks.flagword import DeferredFlags
from sdc_guard.collectives import COMMUNICATING_LOSS, collectives_issued
from sdc_guard.determinism import buffers_saved, buffers_set, module_state_kept, rng_stream
from sdc_guard.fingerprints.native import active_kernel
from sdc_guard.hostread import StepRead
from sdc_guard.parallel.base import Backend, Containment, GradientListener
from sdc_guard.report import Detection
from sdc_guard.scaling import Flag, check_nonfinite, host_words
from sdc_guard.types import BatchFor, LossFn, fetch_micro_batches, recomputed_loss

if TYPE_CHECKING:
    from sdc_guard.parallel.fsdp import FSDPBackend

log = logging.getLogger(__name__)


class NeighbourRecompute:
    """Recomputes a rank's micro-batches of a step through the module (not DDP: no
    communication) and says whether its loss or gradients come out non-finite. ``seed`` is
    the deterministic mode's (None: off), so the recomputation draws the owner's random
    stream; the module's buffers and plain Python attributes come back afterwards
    (``module_state_kept``); ``.grad`` is not touched."""

    def __init__(self, module: nn.Module, *, loss_fn: LossFn, batch_for: BatchFor,
                 micro_batches: int, seed: int | None, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> None:
        self.module, self.loss_fn, self.batch_for = module, loss_fn, batch_for
        self.micro, self.seed, self.device, self.group = micro_batches, seed, device, group
        self.params = [p for p in module.parameters() if p.requires_grad]

    def nonfinite(self, rank: int, step: int) -> bool:
        buffers = buffers_saved(self.module)
        issued = collectives_issued(self.group)
        try:
            with module_state_kept(self.module):
                found = self._nonfinite(rank, step)
            if issued is not None and collectives_issued(self.group) != issued:
                raise ValueError(f"{COMMUNICATING_LOSS} The rank whose gradients were "
                                 "non-finite stays the suspect.")
            return found
        finally:
            buffers_set(self.module, buffers)

    def _nonfinite(self, rank: int, step: int) -> bool:
        for i, mb in enumerate(fetch_micro_batches(self.batch_for, rank, step, self.micro)):
            with (rng_stream(self.seed, rank, step, i, self.device) if self.seed is not None
                  else contextlib.nullcontext()):
                loss = recomputed_loss(self.loss_fn, self.module, mb)
            if not bool(torch.isfinite(loss.detach()).all()):
                return True
            live = [p for p in self.params if p.requires_grad]  # (frozen since: none)
            grads = torch.autograd.grad(loss, live, allow_unused=True)
            if any(g is not None and not bool(torch.isfinite(
                    g.coalesce().values() if g.is_sparse else g).all()) for g in grads):
                return True
        return False


class ShardedRecompute:
    """``NeighbourRecompute`` under FSDP2 and HSDP, where no rank holds the whole model: every
    rank recomputes its ring neighbour's micro-batches at once, through the sharded model
    (``FSDPBackend.recompute``: the forward all-gathers, nothing is reduced, the sharded
    gradients are put back), and says whether the loss or any module's local gradients came
    out non-finite. Collective: asked only where every rank asks it (the step's containment
    answer, alike on every rank, says some rank's gradients were non-finite)."""

    def __init__(self, backend: FSDPBackend, *, loss_fn: LossFn, batch_for: BatchFor,
                 micro_batches: int, seed: int | None) -> None:
        self.backend, self.loss_fn, self.batch_for = backend, loss_fn, batch_for
        self.micro, self.seed = micro_batches, seed

    def nonfinite(self, rank: int, step: int) -> bool:
        model = self.backend.model
        seen = _NonFiniteSeen()
        buffers = buffers_saved(model)
        self.backend.subscribe(seen)
        try:
            batches = fetch_micro_batches(self.batch_for, rank, step, self.micro)
            losses = self.backend.recompute(batches, self.loss_fn, owner=rank, step=step,
                                            seed=self.seed)
        finally:
            self.backend.unsubscribe(seen)
            buffers_set(model, buffers)
        return seen.bad or not all(bool(torch.isfinite(loss).all()) for loss in losses)


class _NonFiniteSeen(GradientListener):
    """Did a recomputation's local gradients (each module's buffer) hold a NaN/Inf?"""

    def __init__(self) -> None:
        self.bad = False

    def local(self, bucket: Any) -> None:
        self.bad = self.bad or bool(check_nonfinite(bucket.buffer()))


class NonFiniteCheck(Check, GradientListener):
    """NaN/Inf in the local and the reduced gradients, every step; see the module doc."""

    name = "nonfinite"
    withholds = True
    wants_flag = True
    veto_early = True

    def __init__(
        self,
        backend: Backend,
        *,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        expect_overflow: bool = False,
        exchange_interval: int = 1,
        recompute: NeighbourRecompute | ShardedRecompute | None = None,
    ) -> None:
        self.device = device
        self.group = group
        self.expect_overflow = expect_overflow
        self.exchange_interval = exchange_interval
        self.recompute = recompute
        """Recomputes the next rank's batch on a step with a non-finite reduced result."""
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._deferred = DeferredFlags(3, exchange_interval, device=device, group=group)
        """Every rank's ``(local, reduced, reproduced)`` flags per step, judged a step after
        they travel; ``reproduced``: this rank's recomputation of the next rank's batch was
        non-finite."""
        self._local: Flag | None = None
        self._reduced_host: list[bool] = []
        """Host flags of this step's reduced buckets, appended by the all-reduce callbacks
        (a list: ``append`` is atomic, and two buckets' callbacks may run on two threads)."""
        self._reduced_device: list[torch.Tensor] = []
        """Reduced buckets whose flag ``host_flags`` computes (not host float32 words)."""
        self._asked: tuple[Flag, Flag, tuple[StepRead, int] | None] | None = None
        """This step's flags as ``ask`` found them, and their handle in the step's read."""
        self.layout = backend.layout
        """Which ranks hold the same shard (under HSDP a shard's replicas reduce alike)."""
        self.sharded = backend.layout.sharded
        """Each rank reduces a shard of its own (FSDP2): a rank's verdict must travel to
        every rank in its step (the backend's veto word) before any withholds."""
        self.wants_veto = self.sharded and not expect_overflow
        self._found: tuple[Flag, Flag] | None = None
        """This step's flags, once ``veto`` computed them."""
        self._answer: Containment | None = None
        """This step's containment answer (sharded backends)."""
        self._backend = backend
        backend.subscribe(self)

    def close(self) -> None:
        self._backend.unsubscribe(self)

    # -- per bucket, from the comm hook ----------------------------------------------------
    def after_scaling(self, bucket: GradBucket, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        if flag is None:
            return
        if self._local is None:
            self._local = flag
        elif isinstance(flag, bool) and isinstance(self._local, bool):
            self._local = self._local or flag
        else:
            self._local = torch.as_tensor(self._local) | flag

    def reduced(self, bucket: GradBucket, out: torch.Tensor) -> None:
        """Host float32 words are read here, by the C kernel, on the communication thread;
        device buffers are flagged later by ``host_flags`` (no device kernels on this thread)."""
        self._found = None  # (a backend may ask the veto before its last reduction)
        kernel = active_kernel() if host_words(out) else None
        if kernel is not None:
            self._reduced_host.append(kernel.nonfinite_at(out.data_ptr(), out.numel()))
        else:
            self._reduced_device.append(out)

    # -- per step ---------------------------------------------------------------------------
    def veto(self) -> Flag | None:
        """Sharded backends: withhold on every rank when this rank's local gradients or its
        reduced shard hold a NaN/Inf."""
        self._found = self._flags()
        local, reduced = self._found
        if isinstance(local, bool) and isinstance(reduced, bool):
            return local or reduced
        return torch.as_tensor(local).to(self.device) | torch.as_tensor(reduced).to(self.device)

    def vetoed(self, answer: Containment) -> None:
        self._answer = answer

    def begin_step(self, step: int) -> None:
        self._local = None
        self._found = None
        self._answer = None
        self._asked = None
        self._reduced_host = []
        self._reduced_device = []

    def _flags(self) -> tuple[Flag, Flag]:
        """``(local_bad, reduced_bad)`` for this step: Python bools where every flag is on the
        host (the CPU, with the C kernel), else 0-d device bools, never copied back.

        Call after the backward pass (DDP waits for every bucket's future, so every
        ``reduced`` has run)."""
        local: Flag = False if self._local is None else self._local
        reduced: Flag = any(self._reduced_host)
        for t in self._reduced_device:  # no host value is copied to the device (a sync)
            bad = check_nonfinite(t)
            if isinstance(bad, bool):
                reduced = bad or reduced
            elif isinstance(reduced, bool):
                reduced = bad | reduced if reduced else bad
            else:
                reduced = reduced | bad.to(reduced.device)
        return local, reduced

    def ask(self, step: int, read: StepRead) -> None:
        """The device flags of this step and the flags word in flight, for the step's one read."""
        local, reduced = self._flags() if self._found is None else self._found
        if self._answer is not None:
            self._answer.ask(read)
        device = [f.reshape(1).to(self.device) for f in (local, reduced)
                  if isinstance(f, torch.Tensor)]
        self._asked = (local, reduced, None if not device else
                       (read, read.ask(device[0] if len(device) == 1 else torch.cat(device))))
        self._deferred.ask(read)

    def host_flags(self) -> tuple[bool, bool]:
        """``(local_bad, reduced_bad)`` for this step, as Python bools: from the step's read
        where ``ask`` put them, else one read of their own (none where they are host bools)."""
        asked, self._asked = self._asked, None
        local, reduced = asked[:2] if asked is not None else self._flags()
        if asked is not None and asked[2] is not None:
            read, handle = asked[2]
            got = iter(read.get(handle))
        else:
            device = [f.reshape(1) for f in (local, reduced) if isinstance(f, torch.Tensor)]
            got = iter(torch.cat([d.to(device[0].device) for d in device]).tolist()
                       if device else [])
        local_bad = bool(next(got)) if isinstance(local, torch.Tensor) else bool(local)
        reduced_bad = bool(next(got)) if isinstance(reduced, torch.Tensor) else bool(reduced)
        return local_bad, reduced_bad

    def pre_step(self, step: int) -> Verdict:
        """Flag ``step`` and judge the word that is due (its detections are of earlier steps,
        each with its own). Withholds this rank's step when its reduced gradients are
        non-finite (not with a ``GradScaler``, which must see the overflow and skips itself)."""
        local, reduced = self.host_flags()
        everywhere = False
        if self.sharded:  # some rank's local or reduced gradients: every rank withholds
            answer, self._answer = self._answer, None
            everywhere = answer is not None and answer.read()
        # Recompute where every rank does: under DDP the all-reduce gave every rank the NaN,
        # under FSDP2 the containment answer told every rank (the recomputation is collective).
        asked = everywhere if self.sharded else reduced
        reproduced = False
        if asked and not self.expect_overflow and self.recompute is not None and self.world > 1:
            reproduced = self._recompute(self._recomputed_here(), step)
        found = self._deferred.collect(self)  # the word sent at the end of the previous window
        self._deferred.add(step, (local, reduced, reproduced))
        here = reduced and not self.expect_overflow
        if self.sharded:
            # A reduced shard's flag that came after the veto travelled (the step's last
            # reduction carried it: ``veto_early``) holds this rank's step alone, as under DDP.
            return Verdict(found, withhold=everywhere or here, alone=not everywhere)
        return Verdict(found, withhold=here, alone=True)

    def _recompute(self, rank: int, step: int) -> bool:
        """Does ``rank``'s batch of ``step`` come out non-finite here too? The optimizer step
        is withheld, so the weights are the step's own. A recomputation that fails says no
        (the owner stays the suspect), never stops the training."""
        assert self.recompute is not None
        self.phase = "recompute"
        try:
            return self.recompute.nonfinite(rank, step)
        except Exception as e:  # a diagnostic, not the training's own work
            if self.sharded:  # collective: the other ranks may be inside it; stop here
                raise
            log.warning("sdc-guard: recomputing rank %d's batch of step %d failed (%s: %s); "
                        "its non-finite gradients, if any, stay unexplained", rank, step,
                        type(e).__name__, e)
            return False
        finally:
            self.phase = "train"

    def flush(self) -> list[Detection]:
        """Send the partial window and judge everything outstanding. Collective when a
        window is open: every rank has the same window, so all of them send."""
        return self._deferred.flush(self)

    def rewind(self, step: int) -> None:
        """A restore: the flags in flight and unsent belong to the abandoned timeline. The word
        in flight is waited for (every rank started it) and dropped, unjudged."""
        self._deferred.rewind()
        super().rewind(step)

    def _partner(self, owner: int) -> int:
        """The rank that recomputes ``owner``'s batch: the previous rank of the ring, or under
        HSDP the rank that holds the owner's shards in the previous replica. A recomputation
        gathers weight shards as the step did; a rank of the owner's shard group gathers the
        same ones, and a changed shard would make its recomputation non-finite too, while
        the other replica's rank gathers another copy of every shard. (Pure FSDP has one
        copy: there the weights vote names a changed shard at once and the guard narrows
        the detection to its rank, ``SDCGuard._narrowed``.)"""
        if self.sharded and self.layout.replicas >= 2:
            held = self.layout.sets[self.layout.part_of(owner)]
            return held[(held.index(owner) - 1) % len(held)]
        return (owner - 1) % self.world

    def _recomputed_here(self) -> int:
        """The owner whose batch this rank recomputes (``_partner`` of it is this rank)."""
        if self.sharded and self.layout.replicas >= 2:
            held = self.layout.sets[self.layout.part_of(self.rank)]
            return held[(held.index(self.rank) + 1) % len(held)]
        return (self.rank + 1) % self.world

    def judge(self, step: int, rows: list[list[int]]) -> list[Detection]:
        """The detection, if any, from every rank's ``[local, reduced, reproduced]`` flags (row
        r: rank r; ``reproduced``: rank r's recomputation of another rank's batch, that of
        the rank it is ``_partner`` of, was non-finite)."""
        n = len(rows)
        local = tuple(r for r, row in enumerate(rows) if row[0])
        reduced = tuple(r for r, row in enumerate(rows) if row[1])
        withheld = (list(range(n)) if self.sharded and (local or reduced) else list(reduced))
        evidence: dict[str, Any] = {"local_nonfinite": list(local),
                                    "reduced_nonfinite": list(reduced),
                                    "withheld_ranks": [] if self.expect_overflow
                                    else withheld}
        if local and not self.expect_overflow:
            # rank r's batch, recomputed by rank r - 1 (a third flag of that rank's row)
            again = {r: self._partner(r) for r in local if n > 1 and rows[self._partner(r)][2]}
            suspects = tuple(r for r in local if r not in again)
            detail = f"non-finite local gradients on rank(s) {list(local)} before the all-reduce"
            if again:
                evidence["reproduced_by"] = {str(r): t for r, t in again.items()}
                detail += (f"; rank(s) {sorted(again.values())} recomputing the batch of "
                           f"rank(s) {sorted(again)} from the same weights got them too: the "
                           "batch or the model's numerics (a bad sample, an overflow), not "
                           "that hardware")
            return [Detection("nonfinite", step, suspects, detail=detail, evidence=evidence)]
        if reduced and not local:
            world = len(rows)
            suspects = reduced if len(reduced) < world and not self.sharded else ()
            if self.sharded:  # HSDP: a shard's replicas reduce alike; the odd ones out
                suspects = tuple(sorted(
                    r for held in self.layout.sets if len(held) > 1
                    and not all(x in reduced for x in held) for r in held if r in reduced))
            where = (
                f"only on rank(s) {list(suspects)} of the ranks that hold their shard: a "
                "fault in their reduction or link" if suspects and self.sharded
                else f"only on rank(s) {list(reduced)}: a fault in their reduction or link"
                if suspects
                else f"in the shards of rank(s) {list(reduced)}, which each rank reduces from "
                "every rank's part: the reduction, no rank to blame" if self.sharded
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
