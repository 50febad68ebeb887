"""The fused 1/world scaling pass: the one read of each local gradient bucket the checks share.

DDP's built-in reducer multiplies each gradient bucket by ``1/world`` before a SUM
all-reduce. The guard's comm hook does that multiplication itself and, in the same
read of the bucket, computes what the checks subscribed to (``comm_hook``):

* a NaN/Inf flag of the local words (``scale_and_check``): on the CPU the C kernel
  scales and flags in one pass and gives a Python bool; on a device torch's fused
  AMP unscale kernel does (a device flag, no host sync);
* the replay digest of given word spans, before the scaling
  (``scale_digest_spans``: the C kernel, on contiguous float32 CPU buckets);
* the row sums of given matrices in the bucket, before the scaling, for the checksum
  check's weight-gradient identity (``scale_row_sums``: the C kernel, likewise; elsewhere
  ``row_sums`` reads them first).

Every path gives the bits of ``buf.mul_(1/world)``, so guarded training stays
bit-identical to plain DDP. ``check_nonfinite`` is the read-only flag the
non-finite check applies to a bucket's reduced result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from sdc_guard.fingerprints.digest import OFFSET_FACTOR
from sdc_guard.fingerprints.native import active_kernel
from sdc_guard.fingerprints.words import MASK64

Flag = bool | torch.Tensor
"""A non-finite flag: a Python bool when the C kernel computed it on the host, else a
0-d bool tensor on the buffer's device (no host sync until someone reads it)."""

Spans = Sequence[tuple[int, int, int]]
"""(first word, end word, word offset in parameter order) per gradient of a bucket."""

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_fused_ok: dict[tuple[str, torch.dtype], bool] = {}
_scales: dict[tuple[torch.device, float], torch.Tensor] = {}


def host_words(buf: torch.Tensor) -> bool:
    """Can the C kernel read ``buf`` in place: contiguous float32 in CPU memory?"""
    return buf.dtype == torch.float32 and buf.device.type == "cpu" and buf.is_contiguous()


def _bad(buf: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: does ``buf`` hold a NaN or Inf? One read pass, no host sync.

    ``isfinite(sum)`` reads the buffer once and writes one value, where
    ``isfinite(buf).all()`` writes a flag per element and reads them again. NaN and Inf
    always propagate through a sum; a finite buffer must not overflow it, so the sum is
    accumulated in a wider type: float32 for float16 (an fp16 sum overflows at 65504),
    float64 for float32 and bfloat16 (their sums overflow at 3.4e38, which the veto
    sentinel, the dtype's largest value, reaches with any large gradient beside it; MPS,
    which has no float64, keeps float32 there).
    """
    wide = torch.float64 if buf.device.type != "mps" else torch.float32
    if buf.dtype == torch.float16:
        s = buf.sum(dtype=torch.float32)
    elif buf.dtype in (torch.float32, torch.bfloat16):
        s = buf.sum(dtype=wide)
    elif buf.is_floating_point():
        s = buf.sum()
    else:  # integer buffers cannot hold non-finite values
        return torch.zeros((), dtype=torch.bool, device=buf.device)
    # s * 0 is 0 for a finite s and NaN for a NaN or an Inf: two kernels on a device,
    # fewer than ~isfinite(s) launches (isfinite is (s == s) * (|s| != inf)).
    return s.mul(0) != 0


def check_nonfinite(buf: torch.Tensor) -> Flag:
    """Does ``buf`` hold a NaN or Inf? On the host (a bool) where the C kernel can read it."""
    kernel = active_kernel() if host_words(buf) else None
    if kernel is not None:
        return kernel.nonfinite_at(buf.data_ptr(), buf.numel())
    return _bad(buf)


def scale_and_check(buf: torch.Tensor, scale: float) -> Flag:
    """``buf.mul_(scale)`` and "was ``buf`` non-finite", in one read pass where possible.

    Contiguous float32 on the CPU: the C kernel scales and flags in one pass and gives a
    Python bool (no tensor op at all). Elsewhere, ``scale_and_check_tensor``.
    """
    kernel = active_kernel() if host_words(buf) else None
    if kernel is not None:
        return kernel.scale_check_at(buf.data_ptr(), buf.numel(), scale)
    return scale_and_check_tensor(buf, scale)


def scale_and_check_tensor(buf: torch.Tensor, scale: float) -> torch.Tensor:
    """``buf.mul_(scale)`` and a 0-d bool "was ``buf`` non-finite", in one read pass if possible.

    torch's fused AMP unscale kernel multiplies by a float32 scale and flags any NaN or
    Inf as it goes: for float32, float16 and bfloat16 that is the same product as
    ``mul_`` with a Python float (computed in float32, then rounded), bit for bit, and
    an exact per-element check. Other dtypes, a dtype the kernel lacks on this device
    (CUDA's has no bfloat16: remembered per device type and dtype, so that one bfloat16
    bucket leaves float32 buckets on the kernel) and a scale of 1 (one rank: the kernel
    then skips the product, and on a GPU ``mul_`` by 1 canonicalises a NaN's payload)
    take ``_bad`` and ``mul_`` (two passes).
    """
    key = (buf.device.type, buf.dtype)
    if buf.dtype in _FUSED_DTYPES and scale != 1.0 and _fused_ok.get(key, True):
        found = torch.zeros(1, dtype=torch.float32, device=buf.device)
        inv = _scales.get((buf.device, scale))
        if inv is None:  # one per device and world size: built once, only ever read
            inv = _scales[(buf.device, scale)] = torch.full(
                (1,), scale, dtype=torch.float32, device=buf.device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([buf], found, inv)
        except (RuntimeError, NotImplementedError):  # no kernel for this device here
            _fused_ok[key] = False
        else:
            _fused_ok[key] = True
            return found[0] != 0
    bad = _bad(buf)
    buf.mul_(scale)
    return bad


def fused_unscale_ok(device_type: str, dtype: torch.dtype = torch.float32) -> bool | None:
    """Did torch's fused unscale kernel run on this device type for ``dtype`` (None: not
    tried yet)?"""
    return _fused_ok.get((device_type, dtype))


def can_fuse_digest(buf: torch.Tensor, spans: Spans) -> bool:
    """Can ``scale_digest_spans`` digest ``spans`` of ``buf`` in the scaling pass?

    Needs the C kernel, contiguous 8-byte aligned float32 CPU words, and spans that
    tile the whole buffer (the pass scales what it digests: all of it).
    """
    if (buf.dtype != torch.float32 or buf.device.type != "cpu" or not buf.is_contiguous()
            or buf.data_ptr() % 8 or buf.numel() % 2 or active_kernel() is None):
        return False
    covered = 0
    for a, b, _ in sorted(spans):
        if a != covered or b < a:
            return False
        covered = b
    return covered == buf.numel() // 2


def scale_digest_spans(buf: torch.Tensor, spans: Spans, scale: float) -> tuple[int, bool]:
    """The replay digest of ``spans`` of the words as they were, then ``buf.mul_(scale)``
    (the bits of ``mul_``), with "was any of it NaN or Inf", in one pass over memory.

    Only where ``can_fuse_digest(buf, spans)`` holds.
    """
    kernel = active_kernel()
    if kernel is None or not can_fuse_digest(buf, spans):
        raise ValueError("scale_digest_spans: needs can_fuse_digest(buf, spans); check it first.")
    base = buf.data_ptr()
    total, bad = 0, False
    for a, b, offset in spans:
        d, s, flag = kernel.scale_digest_at(base + 8 * a, b - a, scale)
        bad |= flag
        total += d + OFFSET_FACTOR * offset * s
    return total & MASK64, bad


RowSums = tuple[torch.Tensor, torch.Tensor]
"""(a 2-D view into a bucket's buffer, a float32 tensor for its row sums)."""


def row_sums(requests: Sequence[RowSums]) -> None:
    """Write each view's float32 row sums into its output (a pass of its own; the C kernel
    where it can read the view, else torch). A 3-D view is a matrix split in blocks of rows
    (FSDP2's layout), its rows in order, the first ``out.numel()`` of them written."""
    kernel = active_kernel()
    for view, out in requests:
        if (kernel is not None and host_words(out) and view.dtype == torch.float32
                and view.device.type == "cpu" and view.is_contiguous() and view.dim() == 2):
            kernel.cs_rows(A=view.data_ptr(), n=view.shape[0], cols=view.shape[1],
                           ld=view.shape[1], k=1, ka=0, r0=out.data_ptr())
        elif view.dim() == 3:  # FSDP2: [shard ranks, rows each, columns], rows padded
            out.copy_(view.sum(2, dtype=torch.float32).reshape(-1)[:out.numel()])
        else:
            out.copy_(view.sum(1, dtype=torch.float32))


def can_fuse_rows(buf: torch.Tensor, requests: Sequence[RowSums]) -> bool:
    """Can ``scale_row_sums`` sum the rows of ``requests`` in ``buf``'s scaling pass?"""
    if not host_words(buf) or active_kernel() is None:
        return False
    end = buf.data_ptr() + buf.numel() * 4
    for view, out in requests:
        if (view.dtype != torch.float32 or view.dim() != 2 or not view.is_contiguous()
                or not host_words(out) or out.numel() != view.shape[0]
                or not buf.data_ptr() <= view.data_ptr() <= end - view.numel() * 4):
            return False
    return True


def scale_row_sums(buf: torch.Tensor, requests: Sequence[RowSums], scale: float) -> bool:
    """``row_sums(requests)`` of the values as they were, then ``buf.mul_(scale)`` (its bits),
    with "was any of it NaN or Inf", in one pass over memory. Only where ``can_fuse_rows``
    holds; views that overlap one another are refused (``ValueError``)."""
    plan = RowPlan.of(buf, requests)
    if plan is None:
        raise ValueError("scale_row_sums: needs can_fuse_rows(buf, requests); check it first.")
    return plan.scale(scale)


class RowPlan:
    """``scale_row_sums`` of one bucket's buffer and requests, checked once
    (``can_fuse_rows``) and kept with its blocks in the C call's form: the comm hook meets the
    same buffer and the same requests every step (``RowPlans``)."""

    def __init__(self, buf: torch.Tensor, requests: Sequence[RowSums]) -> None:
        kernel = active_kernel()
        assert kernel is not None
        self.kernel = kernel
        self.tensors = (buf, *(t for r in requests for t in r))
        """Kept alive: the key of ``RowPlans`` holds their ids."""
        base = buf.data_ptr()
        self.base, self.n = base, buf.numel()
        self.blocks = kernel.row_blocks(sorted(
            ((v.data_ptr() - base) // 4, v.shape[0], v.shape[1], out.data_ptr())
            for v, out in requests))

    @classmethod
    def of(cls, buf: torch.Tensor, requests: Sequence[RowSums]) -> RowPlan | None:
        """The plan, or None where ``can_fuse_rows`` does not hold."""
        if not can_fuse_rows(buf, requests):
            return None
        return cls(buf, requests)

    def scale(self, scale: float) -> bool:
        """The pass: the row sums written, the buffer scaled; whether any was NaN or Inf."""
        return self.kernel.scale_rows_blocks(self.base, self.n, scale, self.blocks)

    def check(self) -> bool:
        """The pass without scaling: the row sums written, the buffer only read; whether
        any was NaN or Inf."""
        return self.kernel.check_rows_blocks(self.base, self.n, self.blocks)


def check_row_sums(buf: torch.Tensor, requests: Sequence[RowSums]) -> Flag:
    """``row_sums(requests)`` and ``check_nonfinite(buf)``: in one read of ``buf`` where
    ``can_fuse_rows`` holds (the C kernel), else the two passes."""
    plan = RowPlan.of(buf, requests)
    if plan is not None:
        return plan.check()
    row_sums(requests)
    return check_nonfinite(buf)


class RowPlans:
    """The ``RowPlan`` of each bucket (by its index): the same tensor objects, at the same
    addresses, as the last time find it without checking again (a plan keeps its tensors
    alive, so their ids cannot be reused while it is kept); anything else makes a new plan,
    which lets go of the old one's tensors (DDP rebuilds its buckets once)."""

    def __init__(self) -> None:
        self._plans: dict[int, tuple[tuple[int, ...], RowPlan | None]] = {}

    def get(self, index: int, buf: torch.Tensor, requests: Sequence[RowSums]) -> RowPlan | None:
        key = (id(buf), buf.data_ptr(), *(id(t) for r in requests for t in r),
               *(t.data_ptr() for r in requests for t in r))
        known = self._plans.get(index)
        if known is None or known[0] != key:
            known = self._plans[index] = (key, RowPlan.of(buf, requests))
        return known[1]


class Sketcher(Protocol):
    """What the scaling pass needs of a gradient sketch (``sdc_guard.checks.sketch``)."""

    k: int

    def row(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient ``i``'s sketch row, ``1 + k`` float64, in a read of its own."""
        ...

    def c_block(self, i: int, g: torch.Tensor) -> tuple[int, int, int, int, int, int] | None:
        """``(q, c, tail, b, a, t)`` of gradient ``i`` for the C kernel (``sdc_sketch``), or
        None where it cannot read ``g``."""
        ...


class SketchRequest:
    """Gradients of one local bucket whose sketch rows a listener wants, of the values as
    they were before the scaling pass (``GradientListener.sketches``): ``items`` holds
    (the gradient's index in ``sketch``, its view into the bucket's buffer). The pass fills
    ``rows`` (index -> row) in its own read where it can (``SketchPlan``); elsewhere
    ``compute`` reads them first."""

    def __init__(self, sketch: Sketcher, items: list[tuple[int, torch.Tensor]]) -> None:
        self.sketch = sketch
        self.items = items
        self.rows: dict[int, torch.Tensor] = {}

    def compute(self) -> None:
        """The rows, in a read of their own (before anything scales the bucket)."""
        self.rows = {i: self.sketch.row(i, g) for i, g in self.items}


class SketchPlan:
    """The scaling pass that sketches a request's gradients in its read (``sdc_scale_sketch``),
    for one bucket's buffer and one request's layout: checked once and kept with its blocks
    in the C call's form (``SketchPlans``)."""

    def __init__(self, buf: torch.Tensor, request: SketchRequest,
                 blocks: list[tuple[int, int, int, int, int, int, int]],
                 order: list[int]) -> None:
        kernel = active_kernel()
        assert kernel is not None
        self.kernel = kernel
        self.buf = buf
        """Kept alive: the key of ``SketchPlans`` holds its id."""
        self.sketch = request.sketch
        """Kept alive too: its id and its factors' addresses are in the key and the blocks."""
        self.base, self.n, self.k = buf.data_ptr(), buf.numel(), request.sketch.k
        self.blocks = kernel.sketch_blocks(blocks)
        self.order = order
        """The index in the sketch of each block, in the blocks' order."""

    @classmethod
    def of(cls, buf: torch.Tensor, request: SketchRequest) -> SketchPlan | None:
        """The plan, or None where the kernel cannot take the pass: it needs contiguous
        float32 CPU memory for the buffer and every gradient, each inside the buffer, none
        overlapping another."""
        if not host_words(buf) or active_kernel() is None:
            return None
        base, end = buf.data_ptr(), buf.data_ptr() + 4 * buf.numel()
        found = []
        for i, g in request.items:
            block = request.sketch.c_block(i, g)
            if (block is None or not host_words(g) or (g.data_ptr() - base) % 4
                    or not base <= g.data_ptr() <= end - 4 * g.numel()):
                return None
            found.append(((g.data_ptr() - base) // 4, g.numel(), block, i))
        found.sort()
        at = 0
        for off, numel, _, _ in found:
            if off < at:
                return None
            at = off + numel
        return cls(buf, request, [(off, *block) for off, _, block, _ in found],
                   [i for *_, i in found])

    def scale(self, scale: float, request: SketchRequest) -> bool:
        """The pass: the buffer scaled, ``request.rows`` written; whether any was NaN or Inf."""
        out = torch.empty(len(self.order), 1 + self.k, dtype=torch.float64)
        bad = self.kernel.scale_sketch_at(self.base, self.n, scale, self.blocks, self.k,
                                          out.data_ptr())
        request.rows = dict(zip(self.order, out.unbind(0), strict=True))
        return bad


class SketchPlans:
    """The ``SketchPlan`` of each bucket and sketch (by the bucket's index and the sketch's
    id: a listener that asks for two sketches on alternate steps keeps both plans), found
    again while the buffer, the sketch and the gradients' places in the buffer are those it
    was made for."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], tuple[tuple[int, ...], SketchPlan | None]] = {}

    def get(self, index: int, buf: torch.Tensor, request: SketchRequest) -> SketchPlan | None:
        key = (id(buf), buf.data_ptr(), buf.numel(), id(request.sketch),
               *(v for i, g in request.items for v in (i, g.data_ptr(), g.numel())))
        known = self._plans.get((index, id(request.sketch)))
        if known is None or known[0] != key:
            if len(self._plans) >= 64:  # (sketches of listeners gone: a plan keeps them alive)
                self._plans.clear()
            known = self._plans[index, id(request.sketch)] = (key, SketchPlan.of(buf, request))
        return known[1]
