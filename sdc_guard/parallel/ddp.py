"""The guard's DDP communication hook: the one place gradients are seen before and after the all-reduce.

The hook does not judge anything: it runs the fused scaling pass
(``sdc_guard.scaling``) and dispatches per-bucket events to the listeners that
subscribed when they were built (the checks, ``BucketListener``) and to the fault
injectors' callbacks. Per bucket, in this order::

    before-callbacks (fault injectors: site "gradient_before_allreduce")
    -> listener.local(bucket): read the local words; may return digest spans
    -> listener.row_sums(bucket): matrices whose row sums (as they were) it wants
    -> the 1/world scaling pass: on the CPU the C kernel scales, flags NaN/Inf
       (if a listener wants the flag) and digests the spans returned, or sums the
       rows asked for, in one read of the bucket; what it cannot fuse is read first
    -> listener.after_scaling(bucket, flag, digest)
    -> on the step's last bucket: listener.before_last_allreduce()
    -> the all-reduce (ours, or the user's own comm hook)
    -> after-callbacks (fault injectors: site "gradient_after_allreduce")
    -> listener.reduced(bucket, result), on the communication thread

Our default all-reduce reproduces DDP's built-in reducer bit for bit: the
built-in path multiplies each gradient by ``1/world`` (``mul``, not ``div``)
before a SUM all-reduce, and so do we. Whatever an injector writes is exactly
what the listeners see.

Composing with a hook of your own (fp16 compression, PowerSGD, ...): DDP
accepts one comm hook per model, so give yours to the guard instead of to DDP:
``SDCGuard(..., comm_hook=my_hook, comm_hook_state=my_state)``. The listeners
see the local bucket before ``my_hook(my_state, bucket)`` and the result of its
future afterwards; your hook owns the scaling by ``1/world``, exactly as it would
without the guard (the flag is then a separate read, and nothing is fused).
"""

# No "from __future__ import annotations": DDP inspects the hook's annotations at runtime.
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from sdc_guard.scaling import (
    Flag,
    RowPlans,
    RowSums,
    Spans,
    can_fuse_digest,
    check_nonfinite,
    row_sums,
    scale_and_check,
    scale_digest_spans,
)

CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
BucketCallback = Callable[[GradBucket], None]
"""Called with the bucket; may modify ``bucket.buffer()`` in place."""
ReducedCallback = Callable[[GradBucket, torch.Tensor], None]
"""Called with the bucket and the reduced tensor; may modify the tensor in place."""


@functools.cache
def _half_max(dtype: torch.dtype) -> float:
    """Half the largest finite value of ``dtype`` (a veto's sentinel is at least that)."""
    return torch.finfo(dtype).max / 2


def _dense(t: torch.Tensor) -> bool:
    """Does ``t`` fill its memory without gaps or overlaps, in some order of its dims?"""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def bucket_gradients(bucket: GradBucket) -> list[torch.Tensor]:
    """The bucket's gradients as views of its buffer with their parameters' strides.

    ``GradBucket.gradients()`` views every gradient as contiguous, but DDP lays a gradient
    out in its bucket with its parameter's strides when those are dense (a transposed
    weight, a ``channels_last`` convolution): read through that view, the gradient's
    elements come in another order than its parameter's (the replay audit's gradient word
    then differed from every recomputation's, every edge of the ring disagreeing)."""
    grads, params = bucket.gradients(), bucket.parameters()
    if len(grads) != len(params):  # a sparse gradient's bucket lists no dense view
        return grads
    out = []
    for p, g in zip(params, grads, strict=True):
        if (g.layout == torch.strided and p.layout == torch.strided and p.dim() > 1
                and p.stride() != g.stride() and _dense(p)):
            g = g.as_strided(p.shape, p.stride())
        out.append(g)
    return out


class DigestSpans(Protocol):
    """Which words of a bucket a listener wants digested, and how to digest them without
    the C kernel (the same value, by torch ops)."""

    @property
    def spans(self) -> Spans: ...

    def digest(self, buf: torch.Tensor) -> torch.Tensor: ...


class BucketListener:
    """What a check can subscribe to in the comm hook. Every method is optional (no-op).

    The hook calls these and nothing else; a listener never calls back into the hook.
    """

    wants_flag: bool = False
    """Set to have the scaling pass flag NaN/Inf in each local bucket (``after_scaling``)."""

    def local(self, bucket: GradBucket) -> DigestSpans | None:
        """The local words, before the scaling pass (read only). Return spans to have the
        pass digest them (their digest comes to ``after_scaling``)."""
        return None

    def row_sums(self, bucket: GradBucket) -> list[RowSums] | None:
        """Matrices in the local bucket (2-D views into its buffer) whose float32 row sums,
        before the scaling, the pass should write into the tensors given with them (ready
        in ``after_scaling``)."""
        return None

    def after_scaling(self, bucket: GradBucket, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        """After the scaling pass: the local NaN/Inf flag (if ``wants_flag``), the digest of
        the spans ``local`` returned (an unsigned int from the C kernel, else a 0-d int64
        tensor), or None."""

    def before_last_allreduce(self) -> None:
        """Once per step, before the last bucket's all-reduce: every local bucket has been
        seen, and a small collective started here rides the meeting point the gradient
        all-reduce needs anyway."""

    def reduced(self, bucket: GradBucket, out: torch.Tensor) -> None:
        """The bucket's reduced result, on the communication thread (read only)."""

    wants_veto: bool = False
    """Set to be asked, once per step, whether this rank withholds the step (``veto``)."""

    def veto(self) -> Flag | None:
        """Before the last bucket's all-reduce, after ``before_last_allreduce``: True (or a
        0-d device bool) to withhold the step on every rank through the veto sentinel
        (``GuardCommHook.vetoed``); None or False otherwise."""
        return None


class GuardCommHook:
    """State and hook function for ``DistributedDataParallel.register_comm_hook``."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        inner_hook: CommHook | None = None,
        inner_state: Any = None,
        sparse_gradients: bool = False,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.carries_veto = inner_hook is None and not sparse_gradients
        """Can the veto sentinel ride the step's last bucket (``_veto``)? Not under a user's
        hook (it may compress or keep state), and not where a gradient is sparse
        (``nn.Embedding(sparse=True)``: DDP gives it a bucket of its own, the last when the
        embedding is the model's first layer, with no dense slot to write). Listeners then
        withhold the step by a word of their own."""
        self.before: list[BucketCallback] = []
        """Fault injectors' callbacks on the local bucket (may modify it)."""
        self.after: list[ReducedCallback] = []
        """Fault injectors' callbacks on the reduced result (may modify it)."""
        self.listeners: list[BucketListener] = []
        self.fused_digests = 0
        """How many listener digests the scaling pass has computed."""
        self.fused_row_sums = 0
        """How many buckets' row sums the scaling pass has taken (``row_sums``)."""
        self._row_plans = RowPlans()
        self.step = -1
        """The step being computed (set by ``begin_step``; fault injectors read it)."""
        self.sentinel: torch.Tensor | None = None
        """The sentinel's slots in this step's reduced last bucket (its first ``world``
        elements), when a listener wants vetoes."""

    def subscribe(self, listener: BucketListener) -> None:
        """Dispatch per-bucket events to ``listener`` from now on (checks, when built)."""
        self.listeners.append(listener)

    def begin_step(self, step: int) -> None:
        """Call before the forward pass of ``step``."""
        self.step = step
        self.sentinel = None

    def _veto(self, bucket: GradBucket) -> None:
        """The veto sentinel: a listener that withholds the step writes the dtype's largest
        finite value into the last bucket, after the scaling pass (so the local non-finite
        scan never sees it) and before the all-reduce, which carries it to every rank
        (``vetoed``). Each rank writes its own slot, element ``rank`` of the bucket: two
        ranks vetoing in one step then leave two finite sentinels, not one sum that
        overflows to Inf (which the non-finite check would report as a fault in the
        reduction, and a ``GradScaler`` as an overflow). Only with our own all-reduce: a
        user's hook may compress or keep state, and its listeners veto by a word of their
        own instead."""
        if not self.carries_veto:
            for lst in self.listeners:
                if lst.wants_veto:
                    lst.veto()
            return
        flags = [f for lst in self.listeners if lst.wants_veto
                 if (f := lst.veto()) is not None and f is not False]
        if not flags:
            return
        if bucket.buffer().layout != torch.strided:
            raise RuntimeError(
                "sdc-guard: the step's last gradient bucket holds a sparse gradient that the "
                "guard did not foresee (it looks for nn.Embedding and nn.EmbeddingBag with "
                "sparse=True), so it cannot carry the checks' veto. Make that gradient "
                "dense, or build the guard with the replay audit and the checksum check off")
        flat = bucket.buffer().view(-1)
        slot = self.rank % flat.numel()  # a bucket smaller than the world shares its slots
        mine = flat[slot:slot + 1]
        big = torch.finfo(mine.dtype).max
        if all(isinstance(f, bool) for f in flags):
            mine.fill_(big)
            return
        flag = torch.stack([torch.as_tensor(f, device=mine.device) for f in flags]).any()
        mine.copy_(torch.where(flag, torch.full_like(mine, big), mine))  # no host sync

    def vetoed(self, *, expect_overflow: bool = False) -> bool:
        """Did some rank veto this step (``veto``)? Read from this rank's copy of the reduced
        sentinel's slots: one of them at least half the dtype's largest finite value (no
        gradient is that large; a corrupt one that is deserves the same). Else a non-finite
        slot (a non-finite gradient, which could hide a veto): True, unless a
        ``GradScaler`` is there to skip the step itself. One host read (a sync on a
        device)."""
        if self.sentinel is None:
            return False
        values = self.sentinel.tolist()
        half = _half_max(self.sentinel.dtype)
        if any(math.isfinite(v) and abs(v) >= half for v in values):
            return True
        return not (expect_overflow or all(math.isfinite(v) for v in values))

    def _local(self, bucket: GradBucket) -> None:
        """Listeners' local reads, then the scaling pass with what they asked fused in."""
        buf = bucket.buffer()
        ours = self.inner_hook is None
        flag_wanted = any(lst.wants_flag for lst in self.listeners)
        wants = [lst.local(bucket) for lst in self.listeners]
        # One listener's spans can ride the scaling pass; any others are digested first.
        fused = next((i for i, w in enumerate(wants)
                      if w is not None and ours and can_fuse_digest(buf, w.spans)), None)
        digests: list[int | torch.Tensor | None] = [
            None if w is None or i == fused else w.digest(buf) for i, w in enumerate(wants)]
        rows = [r for lst in self.listeners for r in (lst.row_sums(bucket) or ())]
        plan = (self._row_plans.get(bucket.index(), buf, rows)
                if rows and ours and fused is None else None)
        if rows and plan is None:
            row_sums(rows)  # a read of their own, before anything scales them
        scale = 1.0 / self.world_size
        flag: Flag | None = None
        fused_spans = None if fused is None else wants[fused]
        if plan is not None:
            found = plan.scale(scale)
            self.fused_row_sums += 1
            flag = found if flag_wanted else None
        elif fused is not None and fused_spans is not None:
            digests[fused], found = scale_digest_spans(buf, fused_spans.spans, scale)
            self.fused_digests += 1
            flag = found if flag_wanted else None
        elif not ours:  # the user's hook owns the scaling
            flag = check_nonfinite(buf) if flag_wanted else None
        elif flag_wanted:
            flag = scale_and_check(buf, scale)
        else:
            buf.mul_(scale)
        for lst, digest in zip(self.listeners, digests, strict=True):
            lst.after_scaling(bucket, flag, digest)

    def _allreduce(self, bucket: GradBucket) -> torch.futures.Future[Any]:
        """The in-place SUM all-reduce of the bucket; its future's value is ``[buffer]``."""
        work = dist.all_reduce(bucket.buffer(), group=self.process_group, async_op=True)
        if work is None:  # pragma: no cover - async_op=True always returns a Work handle
            raise RuntimeError("torch.distributed.all_reduce(async_op=True) returned no Work")
        fut: torch.futures.Future[Any] = work.get_future()
        return fut

    @staticmethod
    def hook(state: "GuardCommHook", bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The function registered with DDP (``state`` is the ``GuardCommHook``)."""
        for cb in state.before:
            cb(bucket)
        state._local(bucket)
        last = bucket.is_last()
        if last:
            for lst in state.listeners:
                lst.before_last_allreduce()
            state._veto(bucket)
        if state.inner_hook is None:
            fut = state._allreduce(bucket)
        else:
            fut = state.inner_hook(state.inner_state, bucket)

        # DDP needs a Python callback on a Python hook's future anyway (its value must be
        # a Python object); the listeners' reduced reads ride it, on the communication thread.
        def _after(f: torch.futures.Future[Any]) -> torch.Tensor:
            value = f.value()
            out: torch.Tensor = value[0] if isinstance(value, list) else value
            for cb in state.after:
                cb(bucket, out)
            if last and state.carries_veto and any(
                    lst.wants_veto for lst in state.listeners):
                state.sentinel = out.view(-1)[:state.world_size]
            for lst in state.listeners:
                lst.reduced(bucket, out)
            return out

        return fut.then(_after)
