"""The DDP backend: the guard's comm hook, the one place gradients are seen before and after the all-reduce.

``GuardCommHook`` implements ``sdc_guard.parallel.base.Backend`` for
``DistributedDataParallel``. It does not judge anything: it runs the fused scaling
pass (``sdc_guard.scaling``) and dispatches per-bucket events to the listeners that
subscribed when they were built (the checks, ``GradientListener``) and to the fault
injectors' callbacks. Per bucket, in this order::

    before-callbacks (fault injectors: site "gradient_before_allreduce")
    -> listener.local(bucket): read the local words; may return digest spans
    -> listener.row_sums(bucket): matrices whose row sums (as they were) it wants
    -> the 1/world scaling pass: on the CPU the C kernel scales, flags NaN/Inf
       (if a listener wants the flag) and digests the spans returned, or sums the
       rows asked for, in one read of the bucket; what it cannot fuse is read first
    -> listener.after_scaling(bucket, flag, digest)
    -> on the step's last bucket: listener.before_last_allreduce(), then
       listener.veto() (the containment channel: ``GuardCommHook._veto``)
    -> the all-reduce (ours, or the user's own comm hook)
    -> after-callbacks (fault injectors: site "gradient_after_allreduce")
    -> on the last bucket: listener.vetoed(answer), the step's containment answer
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
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from sdc_guard.collectives import PendingSum, words_on
from sdc_guard.hostread import StepRead
from sdc_guard.parallel.base import Containment, GradientListener, Layout
from sdc_guard.scaling import (
    Flag,
    RowPlans,
    SketchPlans,
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


def sentinel_values(dtype: torch.dtype, levels: int) -> list[float]:
    """What each of ``levels`` listeners that share one rank's sentinel slot adds to it when
    it withholds: one listener the dtype's largest finite value; several ``max / 2``,
    ``max / 8``, ``max / 32``...: their sum stays finite, and the values below any one sum
    to under a third of it, so each is read back on its own (``SentinelAnswer.level``)."""
    big = torch.finfo(dtype).max
    return [big] if levels == 1 else [big / 2 / 4 ** k for k in range(levels)]


class SentinelAnswer:
    """The containment answer carried by the last bucket's reduced sentinel slots (slot
    ``r``: rank ``r``'s). ``divided_by``: what the reduction divides each sum by (an
    averaging one), so a sentinel arrives as its value over it. Where several listeners
    share the slots (``sentinel_values``), each reads its own ``level``."""

    __slots__ = ("_asked", "_values", "divided_by", "slots")

    def __init__(self, slots: torch.Tensor, divided_by: int = 1) -> None:
        self.slots = slots
        self.divided_by = divided_by
        self._values: list[float] | None = None
        self._asked: tuple[StepRead, int] | None = None

    def ask(self, read: StepRead) -> None:
        if self._asked is None:
            self._asked = (read, read.ask(self.slots))

    def values(self) -> list[float]:
        """The slots as host floats: from the step's read where ``ask`` put them (else one
        read of their own), times ``divided_by``."""
        if self._values is None:
            if self._asked is not None:
                read, handle = self._asked
                got = read.get(handle)
            else:
                got = self.slots.tolist()
            self._values = [float(v) * self.divided_by for v in got]
        return self._values

    def read(self, *, expect_overflow: bool = False) -> bool:
        """One of the slots at least half the dtype's largest finite value (no gradient is
        that large, a corrupt one that is deserves the same), else a non-finite slot (a
        non-finite gradient, which could hide a veto): True, unless a ``GradScaler`` is there
        to skip the step itself."""
        values = self.values()
        half = _half_max(self.slots.dtype)
        return any(math.isfinite(v) and abs(v) >= half for v in values) or not (
            expect_overflow or all(math.isfinite(v) for v in values))

    def level(self, index: int, levels: int) -> Containment:
        """The answer of the ``index``-th of ``levels`` listeners that share the slots."""
        return self if levels == 1 else _Level(self, index, levels)

    def ranks_at(self, index: int, levels: int) -> tuple[int, ...]:
        """The ranks whose slot holds listener ``index``'s value (of ``levels``): read from
        the highest value down, each taken where the slot holds at least half of it. A
        non-finite slot (a non-finite gradient summed into it) names no one."""
        values = sentinel_values(self.slots.dtype, levels)
        out = []
        for r, v in enumerate(self.values()):
            if not math.isfinite(v):
                continue
            for k, w in enumerate(values[:index + 1]):
                if v >= w / 2:
                    v -= w
                    if k == index:
                        out.append(r)
        return tuple(out)

    def ranks(self) -> tuple[int, ...]:
        return self.ranks_at(0, 1)


class _Level:
    """One listener's answer among several that share a ``SentinelAnswer``'s slots."""

    __slots__ = ("_got", "index", "levels", "parent")

    def __init__(self, parent: SentinelAnswer, index: int, levels: int) -> None:
        self.parent, self.index, self.levels = parent, index, levels
        self._got: dict[bool, bool] = {}

    def ask(self, read: StepRead) -> None:
        self.parent.ask(read)

    def ranks(self) -> tuple[int, ...]:
        return self.parent.ranks_at(self.index, self.levels)

    def read(self, *, expect_overflow: bool = False) -> bool:
        """A slot with this listener's value in it, else (as ``SentinelAnswer.read``) a
        non-finite slot unless a ``GradScaler`` skips the step itself."""
        got = self._got.get(expect_overflow)
        if got is None:
            got = bool(self.ranks()) or not (
                expect_overflow or all(math.isfinite(v) for v in self.parent.values()))
            self._got[expect_overflow] = got
        return got


class WordAnswer:
    """The containment answer carried by a word of its own (an int64 SUM all-reduce): its
    ``slot``-th word, the number of ranks that withheld."""

    __slots__ = ("pending", "slot")

    def __init__(self, pending: PendingSum, slot: int = 0) -> None:
        self.pending = pending
        self.slot = slot

    def ask(self, read: StepRead) -> None:
        self.pending.ask(read)

    def read(self, *, expect_overflow: bool = False) -> bool:
        return self.pending.wait_all()[self.slot] > 0

    def ranks(self) -> None:
        """A count, not names: ask the ranks (a gather) where they are wanted."""
        return None


class GuardCommHook:
    """The DDP backend (``sdc_guard.parallel.base.Backend``): the state and function of
    ``DistributedDataParallel.register_comm_hook``, the veto sentinel, and the word that
    carries the veto where no sentinel can travel."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        model: Any = None,
        inner_hook: CommHook | None = None,
        inner_state: Any = None,
        sparse_gradients: bool = False,
    ) -> None:
        self.group = process_group
        """The group the hook all-reduces within and the checks compare within: under DDP
        every member holds a replica of the same state."""
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.layout = Layout.replicated(self.world_size)
        """Every rank a replica of the same state."""
        self.model = model
        """The DDP model ``attach`` registers this hook with (None: the caller registers it)."""
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.carries_veto = inner_hook is None and not sparse_gradients
        """Can the veto sentinel ride the step's last bucket (``_veto``)? Not under a user's
        hook (it may compress or keep state), and not where a gradient is sparse
        (``nn.Embedding(sparse=True)``: DDP gives it a bucket of its own, the last when the
        embedding is the model's first layer, with no dense slot to write). The veto then
        travels as a word of its own."""
        self.before: list[BucketCallback] = []
        """Fault injectors' callbacks on the local bucket (may modify it)."""
        self.after: list[ReducedCallback] = []
        """Fault injectors' callbacks on the reduced result (may modify it)."""
        self.listeners: list[GradientListener] = []
        self.fused_digests = 0
        """How many listener digests the scaling pass has computed."""
        self.fused_row_sums = 0
        """How many buckets' row sums the scaling pass has taken (``row_sums``)."""
        self._row_plans = RowPlans()
        self.fused_sketches = 0
        """How many buckets' sketch rows the scaling pass has taken (``sketches``)."""
        self._sketch_plans = SketchPlans()
        self.step = -1
        """The step being computed (set by ``begin_step``; fault injectors read it)."""
        self._answer_due = False
        """A listener was asked for its veto this step and the sentinel carries the answer
        (pushed with the last bucket's reduced result)."""
        self.attached = False
        """Is the hook registered with DDP (``attach``)?"""

    def subscribe(self, listener: GradientListener) -> None:
        """Dispatch per-bucket events to ``listener`` from now on (checks, when built)."""
        self.listeners.append(listener)

    def unsubscribe(self, listener: GradientListener) -> None:
        """Stop dispatching events to ``listener`` (a check that is closed)."""
        self.listeners[:] = [x for x in self.listeners if x is not listener]

    def attach(self) -> None:
        """Register the hook with DDP the first time something needs the gradient buckets: a
        listener, a fault injector's callback, or the user's own hook. Until then DDP runs
        its built-in all-reduce, which scales each gradient while it copies it into its
        bucket: any comm hook costs one more pass (docs/architecture.md), and checks that
        never read a bucket do not pay it. DDP cannot remove a hook: once registered it
        stays, bit-identical either way."""
        if self.attached or self.model is None:
            return
        if self.listeners or self.before or self.after or self.inner_hook is not None:
            self.model.register_comm_hook(self, GuardCommHook.hook)
            self.attached = True

    def begin_step(self, step: int) -> None:
        """Call before the forward pass of ``step``."""
        self.step = step
        self._answer_due = False

    def no_sync(self) -> AbstractContextManager[Any]:
        """DDP's own ``no_sync``: the buckets are reduced in the last micro-batch's backward."""
        ctx: AbstractContextManager[Any] = self.model.no_sync()
        return ctx

    def after_backward(self) -> None:
        """Nothing: the veto rode the last bucket (``_veto``)."""

    def _veto(self, bucket: GradBucket) -> None:
        """Ask the listeners that want to whether this rank withholds the step, and carry the
        answer to every rank (``GradientListener.vetoed``).

        With our own all-reduce the answer rides the last bucket as a sentinel: a rank that
        withholds writes the dtype's largest finite value into the bucket, after the scaling
        pass (so the local non-finite scan never sees it) and before the all-reduce, which
        carries it to every rank. Each rank writes its own slot, element ``rank`` of the
        bucket: two ranks vetoing in one step then leave two finite sentinels, not one sum
        that overflows to Inf (which the non-finite check would report as a fault in the
        reduction, and a ``GradScaler`` as an overflow). Under a user's hook (it may
        compress or keep state) or a sparse last bucket, the answer travels as one int64
        word of its own instead, when some listener takes part this step."""
        asked = [lst for lst in self.listeners if lst.wants_veto]
        if not asked:
            return
        flags = [f for lst in asked if (f := lst.veto()) is not None]
        raised = [f for f in flags if f is not False]
        if not self.carries_veto:
            if not flags:  # every listener sits this step out (alike on every rank)
                return
            device = bucket.buffer().device
            if all(isinstance(f, bool) for f in raised):
                word = words_on([int(bool(raised))], device)  # no tensor op, no sync
            else:
                word = torch.stack([torch.as_tensor(f, device=device)
                                    for f in raised]).any().to(torch.int64).reshape(1)
            answer = WordAnswer(PendingSum(word, self.group, in_place=True))
            for lst in asked:
                lst.vetoed(answer)
            return
        self._answer_due = True
        if not raised:
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
        if all(isinstance(f, bool) for f in raised):
            mine.fill_(big)
            return
        flag = torch.stack([torch.as_tensor(f, device=mine.device) for f in raised]).any()
        mine.copy_(torch.where(flag, torch.full_like(mine, big), mine))  # no host sync

    @staticmethod
    def answer_of(slots: torch.Tensor) -> Containment:
        """The containment answer that reduced sentinel ``slots`` carry."""
        return SentinelAnswer(slots)

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
        requests = [r for r in (lst.sketches(bucket) for lst in self.listeners) if r is not None]
        sketching = (self._sketch_plans.get(bucket.index(), buf, requests[0])
                     if len(requests) == 1 and ours and fused is None and plan is None
                     else None)
        if sketching is None:
            for request in requests:
                request.compute()  # a read of their own, before anything scales them
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
        elif sketching is not None:
            found = sketching.scale(scale, requests[0])
            self.fused_sketches += 1
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
        work = dist.all_reduce(bucket.buffer(), group=self.group, async_op=True)
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
            if last and state._answer_due:
                answer = SentinelAnswer(out.view(-1)[:state.world_size])
                for lst in state.listeners:
                    if lst.wants_veto:
                        lst.vetoed(answer)
            for lst in state.listeners:
                lst.reduced(bucket, out)
            return out

        return fut.then(_after)
