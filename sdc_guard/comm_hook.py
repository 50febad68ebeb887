"""The guard's DDP communication hook: the one place gradients are seen before and after the all-reduce.

Per bucket, in this order::

    before-callbacks (fault injectors: site "gradient_before_allreduce")
    -> local gradient observers (the replay audit's gradient digest; they only read)
    -> the 1/world scaling pass, with the local non-finite flag fused in: on the
       CPU the C kernel scales, flags (a Python bool, no tensor op) and computes a
       digest an observer asked for (``request_digest``), in one pass; on a device
       torch's fused AMP unscale kernel (a device flag, no host sync)
    -> on the step's last bucket: before-last-all-reduce callbacks (the replay
       audit starts its small all-reduce here)
    -> the all-reduce (ours, or the user's own comm hook)
    -> after-callbacks (fault injectors: site "gradient_after_allreduce")
    -> the reduced non-finite flag of the bucket's result (``reduced_result``)

The reduced result is read in the all-reduce future's callback (the Python callback
DDP needs from a Python comm hook anyway), on the communication thread, as soon as
the all-reduce completes, while the main thread computes the rest of the backward
pass or waits for it: on the CPU the C kernel reads the buffer and gives a Python
bool (measured: as long a read as after the backward pass, but a smaller increase
in step time, ``bench/RESULTS.md``); a device buffer's flag is left
to ``host_flags``, on the caller's thread (no device kernels on that thread).
Whatever an injector writes is exactly what the checks see.

Our default all-reduce reproduces DDP's built-in reducer bit for bit: the
built-in path multiplies each gradient by ``1/world`` (``mul``, not ``div``)
before a SUM all-reduce, and so do we.

Composing with a hook of your own (fp16 compression, PowerSGD, ...): DDP
accepts one comm hook per model, so give yours to the guard instead of to DDP:
``SDCGuard(..., comm_hook=my_hook, comm_hook_state=my_state)``. The guard
checks the local bucket before calling ``my_hook(my_state, bucket)`` and the
result of its future afterwards. Your hook then owns the scaling by
``1/world``, exactly as it would without the guard.
"""

# No "from __future__ import annotations": DDP inspects the hook's annotations at runtime.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from sdc_guard.fingerprints import _native_kernel, host_spans_scale_digest

CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
BucketCallback = Callable[[GradBucket], None]
"""Called with the bucket; may modify ``bucket.buffer()`` in place."""
ReducedCallback = Callable[[GradBucket, torch.Tensor], None]
"""Called with the bucket and the reduced tensor; may modify the tensor in place."""


def _bad(buf: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: does ``buf`` hold a NaN or Inf? One read pass, no host sync.

    ``isfinite(sum)`` is about 20x cheaper than ``isfinite(buf).all()``; the sum
    is accumulated in float32 for 16-bit buffers (an fp16 sum would overflow at
    65504 and raise false alarms). NaN and Inf always propagate through a sum;
    a false alarm needs finite gradients whose float32 sum exceeds 3.4e38.
    """
    if buf.dtype in (torch.float16, torch.bfloat16):
        s = buf.sum(dtype=torch.float32)
    elif buf.is_floating_point():
        s = buf.sum()
    else:  # integer buffers cannot hold non-finite values
        return torch.zeros((), dtype=torch.bool, device=buf.device)
    return ~torch.isfinite(s)


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_fused_ok: dict[str, bool] = {}
_scales: dict[tuple[torch.device, float], torch.Tensor] = {}


def _host_words(buf: torch.Tensor) -> bool:
    """Can the C kernel read ``buf`` in place: contiguous float32 in CPU memory?"""
    return buf.dtype == torch.float32 and buf.device.type == "cpu" and buf.is_contiguous()


Flag = bool | torch.Tensor
"""A non-finite flag: a Python bool when the C kernel computed it on the host, else a
0-d bool tensor on the buffer's device (no host sync until the step's verdict)."""


def _check(buf: torch.Tensor) -> Flag:
    """Does ``buf`` hold a NaN or Inf? On the host (a bool) where the C kernel can read it."""
    kernel = _native_kernel() if _host_words(buf) else None
    if kernel is not None:
        return kernel.nonfinite_at(buf.data_ptr(), buf.numel())
    return _bad(buf)


def _scale_and_check(buf: torch.Tensor, scale: float) -> Flag:
    """``buf.mul_(scale)`` and "was ``buf`` non-finite", in one read pass where possible.

    Contiguous float32 on the CPU: the C kernel scales and flags in one pass and gives a
    Python bool (no tensor op at all). Elsewhere, ``_scale_and_check_tensor``.
    """
    kernel = _native_kernel() if _host_words(buf) else None
    if kernel is not None:
        return kernel.scale_check_at(buf.data_ptr(), buf.numel(), scale)
    return _scale_and_check_tensor(buf, scale)


def _scale_and_check_tensor(buf: torch.Tensor, scale: float) -> torch.Tensor:
    """``buf.mul_(scale)`` and a 0-d bool "was ``buf`` non-finite", in one read pass if possible.

    torch's fused AMP unscale kernel multiplies by a float32 scale and flags any NaN or
    Inf as it goes: for float32, float16 and bfloat16 that is the same product as
    ``mul_`` with a Python float (computed in float32, then rounded), bit for bit, and
    an exact per-element check. Other dtypes, and a torch without the kernel on this
    device, take ``_bad`` and ``mul_`` (two passes).
    """
    kind = buf.device.type
    if buf.dtype in _FUSED_DTYPES and _fused_ok.get(kind, True):
        found = torch.zeros(1, dtype=torch.float32, device=buf.device)
        inv = _scales.get((buf.device, scale))
        if inv is None:  # one per device and world size: built once, only ever read
            inv = _scales[(buf.device, scale)] = torch.full(
                (1,), scale, dtype=torch.float32, device=buf.device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([buf], found, inv)
        except (RuntimeError, NotImplementedError):  # no kernel for this device here
            _fused_ok[kind] = False
        else:
            _fused_ok[kind] = True
            return found[0] != 0
    bad = _bad(buf)
    buf.mul_(scale)
    return bad


class GuardCommHook:
    """State and hook function for ``DistributedDataParallel.register_comm_hook``."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        check_nonfinite: bool = True,
        inner_hook: CommHook | None = None,
        inner_state: Any = None,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.check_nonfinite = check_nonfinite
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.before: list[BucketCallback] = []
        self.local_observers: list[BucketCallback] = []
        self.before_last_allreduce: list[Callable[[], None]] = []
        """Called once per step, in the hook of the step's last bucket, after the local
        observers and before its all-reduce: every local gradient has been seen, and
        a small collective started here rides the synchronisation point that the
        gradient all-reduce needs anyway (the replay audit sends its words here)."""
        self.after: list[ReducedCallback] = []
        self._digest_request: tuple[list[tuple[int, int, int]], Callable[[int], None]] | None = None
        self.fused_digests = 0
        """How many observer digests the scaling pass has computed (``request_digest``)."""
        self.step = -1
        self.local_bad: Flag | None = None
        self._reduced_host: list[bool] = []
        """Host flags of this step's reduced buckets, appended by the future callbacks (a
        list: ``append`` is atomic, and two buckets' callbacks may run on two threads)."""
        self._results: list[torch.Tensor] = []
        """Reduced buckets whose flag ``host_flags`` computes (not host float32 words)."""

    def begin_step(self, step: int) -> None:
        """Reset the per-step flags; call before the backward pass of ``step``."""
        self.step = step
        self.local_bad = None
        self._reduced_host = []
        self._results = []

    def reduced_result(self, out: torch.Tensor) -> None:
        """Flag a bucket's reduced result: the C kernel reads host float32 words here, on
        the calling thread (the all-reduce's callback); other buffers are flagged by
        ``host_flags``."""
        kernel = _native_kernel() if _host_words(out) else None
        if kernel is not None:
            self._reduced_host.append(kernel.nonfinite_at(out.data_ptr(), out.numel()))
        else:
            self._results.append(out)

    def host_flags(self) -> tuple[bool, bool]:
        """``(local_bad, reduced_bad)`` for this step, as Python bools.

        Call after the backward pass (DDP waits for every bucket's future, so every
        ``reduced_result`` has run). On the CPU (with the C kernel) every flag is already
        a host value; flags that live on a device cost one host sync, for all of them
        together.
        """
        local: Flag = False if self.local_bad is None else self.local_bad
        reduced: Flag = any(self._reduced_host)
        for t in self._results:
            bad = _check(t)
            if isinstance(bad, bool) and isinstance(reduced, bool):
                reduced = reduced or bad
            else:
                reduced = torch.as_tensor(reduced, device=t.device) | bad
        if isinstance(local, torch.Tensor) and isinstance(reduced, torch.Tensor):
            both = torch.stack([local.to(reduced.device), reduced]).tolist()  # one host sync
            return bool(both[0]), bool(both[1])
        return bool(local), bool(reduced)  # a tensor here: one .item(), one host sync

    def _or_local(self, flag: Flag) -> None:
        if self.local_bad is None:
            self.local_bad = flag
        elif isinstance(flag, bool) and isinstance(self.local_bad, bool):
            self.local_bad = self.local_bad or flag
        else:
            self.local_bad = torch.as_tensor(self.local_bad) | flag

    def request_digest(self, buf: torch.Tensor, spans: list[tuple[int, int, int]],
                       deliver: Callable[[int], None]) -> bool:
        """Offer to compute a local observer's digest of ``buf`` in the scaling pass.

        For a local observer, during its call: ``host_spans_digest(buf, spans)`` of the
        local words (before the scaling) is passed to ``deliver`` from the pass that
        scales the bucket by ``1/world`` (one read of the buffer instead of two), before
        any before-last-all-reduce callback. ``False``, and nothing is delivered, when the
        pass cannot do it (no C kernel, a user comm hook, a buffer not of contiguous,
        aligned float32 CPU words, or a request already pending): the observer then
        computes the digest itself.
        """
        if (self._digest_request is not None or self.inner_hook is not None
                or buf.dtype != torch.float32 or buf.device.type != "cpu"
                or not buf.is_contiguous() or buf.data_ptr() % 8 or buf.numel() % 2
                or _native_kernel() is None):
            return False
        covered = 0
        for a, b, _ in sorted(spans):  # the pass scales what it digests: the whole buffer
            if a != covered or b < a:
                return False
            covered = b
        if covered != buf.numel() // 2:
            return False
        self._digest_request = (spans, deliver)
        return True

    def _scale(self, buf: torch.Tensor) -> None:
        """The 1/world scaling pass, with the local check and a requested digest fused in."""
        scale = 1.0 / self.world_size
        request, self._digest_request = self._digest_request, None
        if request is not None:
            spans, deliver = request
            done = host_spans_scale_digest(buf, spans, scale)  # spans tile buf: all is scaled
            assert done is not None  # request_digest checked the kernel and the buffer
            self.fused_digests += 1
            deliver(done[0])
            if self.check_nonfinite:
                self._or_local(done[1])
        elif self.check_nonfinite:  # the local check rides the 1/world scaling pass
            self._or_local(_scale_and_check(buf, scale))
        else:
            buf.mul_(scale)

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
        for cb in state.local_observers:
            cb(bucket)
        if state.inner_hook is None:
            state._scale(bucket.buffer())
        elif state.check_nonfinite:
            state._or_local(_check(bucket.buffer()))  # the user's hook owns the scaling
        if bucket.is_last():
            for last in state.before_last_allreduce:
                last()
        if state.inner_hook is None:
            fut = state._allreduce(bucket)
        else:
            fut = state.inner_hook(state.inner_state, bucket)

        # DDP needs a Python callback on a Python hook's future anyway (its value must be
        # a Python object); the reduced check rides it, on the communication thread.
        def _after(f: torch.futures.Future[Any]) -> torch.Tensor:
            value = f.value()
            out: torch.Tensor = value[0] if isinstance(value, list) else value
            for cb in state.after:
                cb(bucket, out)
            if state.check_nonfinite:
                state.reduced_result(out)
            return out

        return fut.then(_after)
