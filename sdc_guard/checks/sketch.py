"""The tolerant replay's gradient sketch, its distance and its calibrated tolerance.

Without deterministic kernels a recomputation of the same batch differs from the first
in the last bits, so the replay cannot compare bit patterns. It compares a *sketch*
instead, in float64: the loss, and for every parameter its gradient's L2 norm and
``PROJECTIONS`` fixed random projections of it. The projections are drawn once, from a
generator seeded alike on every rank (``GuardConfig.seed``), so two ranks that sketch
the same gradient compute the same numbers up to rounding.

A projection of a gradient ``g`` of ``n`` elements, viewed as a ``q x c`` matrix ``G``
(``c`` about ``sqrt(n)``; the last ``n - qc`` elements apart), is ``a' G b`` plus the
tail's ``t' g_tail``, with ``a``, ``b`` and ``t`` standard normal: a random rank-one
tensor, held in ``O(sqrt(n))`` numbers rather than ``n``, read in one pass (one matrix
product). The factors are drawn in float64; ``G b`` and the norms of the rows of ``G`` are
taken in the gradient's own precision (float32 for half-precision gradients), everything
after them in float64. The
rounding of ``G b`` is deterministic for one input on one machine and far below the
recomputation noise the tolerance is calibrated from; reading the gradient in its own
precision, rather than copying it to float64, is what keeps the sketch cheap. A float32
gradient on the CPU is read once by the C kernel (``sdc_sketch``: each row's sum of squares
and products with ``b`` in one pass); torch's path reads it twice (the rows' norms, ``G b``)
and agrees with it up to the order of the float32 sums.

For any fixed difference ``d`` between two gradients the projection of ``d``
has mean 0 and variance ``||d||^2``, so a difference large against the rounding noise
shows, whatever its direction; a difference exactly orthogonal to all of them has
probability zero.

Each component's difference is measured in its own scale (``distance``): the loss's
relative to the loss, a parameter's norm and projections relative to its gradient's
norm. The audit compares the largest of them with a tolerance calibrated from the run
(``calibrated_tolerance``): a quantile of the differences seen when the same batch is
recomputed, on one rank and across ranks, times ``MARGIN``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from sdc_guard.fingerprints.native import active_kernel

PROJECTIONS = 4
"""Random projections per parameter: a difference escapes all of them together only when
it is small against the tolerance in each of four independent directions."""

MARGIN = 16.0
"""The calibrated tolerance is this multiple of the median of the calibration's
differences: the noise of a recomputation of another batch (other magnitudes, other
roundings) stays within a few times the median (``docs/checks/replay.md``, "Tolerant
mode", gives the measured spread and the false-positive rate)."""

FLOOR = 2.0**-20
"""The least tolerance: eight float32 ulps of a component's scale. A calibration that saw no
difference at all (every recomputation bit for bit alike) gives this, so that one rounding
of another kernel later is not a fault."""

CEILING = 2.0**-10
"""The largest tolerance the audit accepts (about 0.1% of each component's scale: the
threshold Megatron-LM's rerun machine uses for non-deterministic attention backward).
A calibration above it is refused and done again at the next audit: a faulty
computation during the calibration must not blind the audit."""

CEILING_HALF = 2.0**-5
"""The ceiling where the model's products run in bfloat16 or float16: four bfloat16 ulps of a
component's scale (``2**-7`` each at the bottom of a binade). A recomputation rounds each
half-precision product anew, a rounding moves its element by up to ``2**-8`` of it, and the
moves cascade through the layers: the sketch then differs by far more than the float32
ceiling allows (``docs/checks/replay.md``, "In half precision")."""


def _factors(n: int, k: int, gen: torch.Generator) -> tuple[int, int, torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """``a`` (q x k), ``b`` stored transposed (k x c: the matrix product's fast layout) and
    ``t`` (tail x k), standard normal, float64."""
    c = max(1, math.isqrt(n))
    q = n // c
    a = torch.randn(q, k, generator=gen, dtype=torch.float64)
    b = torch.randn(c, k, generator=gen, dtype=torch.float64).t().contiguous()
    t = torch.randn(n - q * c, k, generator=gen, dtype=torch.float64)
    return q, c, a, b, t


_FIRST_STAGE = {torch.float64: torch.float64, torch.float32: torch.float32}
"""The dtype ``G b`` is taken in, by the gradient's (others: float32)."""


def _kernel_reads(g: torch.Tensor) -> bool:
    """Can the C kernel sketch ``g`` (contiguous float32 on the CPU, the kernel built)?"""
    return (g.layout == torch.strided and g.dtype == torch.float32 and g.device.type == "cpu"
            and g.is_contiguous() and active_kernel() is not None)


class GradientSketch:
    """Each gradient as its norm and ``PROJECTIONS`` random projections, in float64.

    ``sizes``: the element count of each gradient sketched (a parameter's, or under FSDP2 a
    ``fully_shard`` module's local gradient buffer). ``row(i, g)`` sketches gradient ``i``;
    ``of(loss, rows)`` lays the loss and every gradient's row end to end: the vector the
    audit compares. A gradient not computed sketches as zeros, as a gradient of zeros does."""

    def __init__(self, sizes: Sequence[int], *, seed: int, device: torch.device,
                 k: int = PROJECTIONS) -> None:
        self.k = k
        self.device = device
        gen = torch.Generator().manual_seed(seed & (2**63 - 1))
        self._factors = []
        self._b: list[dict[torch.dtype, torch.Tensor]] = []
        """Each parameter's ``b`` in the first stage's dtypes (float64 as drawn)."""
        for n in sizes:
            q, c, a, b, t = _factors(int(n), k, gen)
            self._factors.append((q, c, a.to(device), t.to(device)))
            b = b.to(device)
            self._b.append({torch.float64: b, torch.float32: b.to(torch.float32)})

    @property
    def count(self) -> int:
        """Gradients sketched."""
        return len(self._factors)

    @property
    def width(self) -> int:
        """Numbers per parameter: the norm and the projections."""
        return 1 + self.k

    def size(self) -> int:
        """Length of the sketch vector (``of``)."""
        return 1 + len(self._factors) * self.width

    def c_block(self, i: int, g: torch.Tensor) -> tuple[int, int, int, int, int, int] | None:
        """``(q, c, tail, b, a, t)`` (the factors' addresses) for the C kernel to sketch
        gradient ``i``, ``g``, where it can (contiguous float32 on the CPU, the kernel
        built), else None. ``ValueError`` for a gradient of another size."""
        q, c, a, t = self._factors[i]
        if g.numel() != q * c + t.shape[0]:
            raise ValueError(f"GradientSketch.row({i}): a gradient of {g.numel()} elements, "
                             f"where the sketch was built for {q * c + t.shape[0]}")
        if not _kernel_reads(g):
            return None
        return (q, c, g.numel() - q * c, self._b[i][torch.float32].data_ptr(), a.data_ptr(),
                t.data_ptr())

    def row(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient ``i``, ``g``, as ``[norm, projections...]`` (float64).

        A contiguous float32 gradient on the CPU takes the C kernel's one read
        (``sdc_sketch``) where it is built; elsewhere torch computes the same numbers, up to
        the order of its float32 sums."""
        if g.layout != torch.strided:  # a sparse gradient: its dense values, same numbers
            g = g.to_dense()
        block = self.c_block(i, g)
        kernel = active_kernel()
        if block is not None and kernel is not None:
            out = torch.empty(self.width, dtype=torch.float64)
            kernel.sketch_at(g.data_ptr(), *block, self.k, out.data_ptr())
            return out
        q, c, a, t = self._factors[i]
        dtype = _FIRST_STAGE.get(g.dtype, torch.float32)
        flat = g.detach().reshape(-1).to(dtype)
        out = torch.empty(self.width, dtype=torch.float64, device=flat.device)
        body = flat[:q * c].view(q, c)
        # the norm: each row's in the first stage's precision, their squares summed in float64
        square = torch.linalg.vector_norm(body, dim=1).to(torch.float64).square().sum()
        partial = torch.mm(body, self._b[i][dtype].t())  # G b, q x k
        proj = (partial.to(torch.float64) * a).sum(0)
        if t.shape[0]:
            tail = flat[q * c:].to(torch.float64)
            proj = proj + tail @ t
            square = square + tail.square().sum()
        out[0] = square.sqrt()
        out[1:] = proj
        return out

    def of(self, loss: torch.Tensor, rows: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The sketch vector: the loss, then each gradient's row (None, or none given: zeros)."""
        if len(rows) > self.count:
            raise ValueError(f"GradientSketch.of: {len(rows)} rows for {self.count} gradients")
        zeros = None
        parts = [loss.detach().to(device=self.device, dtype=torch.float64).reshape(1)]
        for i in range(self.count):
            r = rows[i] if i < len(rows) else None
            if r is None:
                if zeros is None:
                    zeros = torch.zeros(self.width, dtype=torch.float64, device=self.device)
                r = zeros
            parts.append(r.to(self.device))
        return torch.cat(parts)


class BucketNorms:
    """A gradient bucket's L2 norm as a sketch row ``[norm, 0]`` (one projection, on zeros),
    so that the comm hook's scaling pass takes it in its own read of the bucket
    (``sdc_guard.scaling.Sketcher``, ``sdc_scale_sketch``) rather than a read of its own:
    the tolerant audit's trigger between audits. The norm's float32 partial sums are the
    C kernel's on the CPU and torch's elsewhere: the trigger's threshold is a factor of
    several, not a rounding."""

    k = 1

    def __init__(self) -> None:
        self._zeros: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def c_block(self, i: int, g: torch.Tensor) -> tuple[int, int, int, int, int, int] | None:
        """``(q, c, tail, b, a, t)`` for the C kernel, of zero factors of ``g``'s size (None
        where the kernel cannot read ``g``: not contiguous float32 on the CPU, or not built)."""
        if not _kernel_reads(g):
            return None
        n = g.numel()
        known = self._zeros.get(n)
        if known is None:  # kept while this lives: a scaling plan holds their addresses
            c = max(1, math.isqrt(n))
            q = n // c
            known = self._zeros[n] = (q, c, torch.zeros(c, dtype=torch.float32),
                                      torch.zeros(q, dtype=torch.float64),
                                      torch.zeros(n - q * c, dtype=torch.float64))
        q, c, b, a, t = known
        return (q, c, n - q * c, b.data_ptr(), a.data_ptr(), t.data_ptr())

    def row(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """``[norm, 0]`` of ``g`` (float64, on its device), in a read of its own; a sparse
        bucket's from its values."""
        vals = g.coalesce().values() if g.layout != torch.strided else g
        norm = torch.linalg.vector_norm(vals).to(torch.float64).reshape(1)
        return torch.cat([norm, torch.zeros_like(norm)])


def differences(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """Each component's difference in its own scale (``distance`` is their largest)."""
    diff = (a - b).abs()
    scale = torch.empty_like(diff)
    scale[0] = torch.maximum(a[0].abs(), b[0].abs())
    norms = torch.maximum(a[1::width].abs(), b[1::width].abs())
    scale[1:] = norms.repeat_interleave(width)
    rel = diff / scale
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    rel = torch.where(same, torch.zeros_like(rel), rel)
    return torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)


def component(i: int, width: int, names: Sequence[str]) -> str:
    """What component ``i`` of a sketch vector is, in words."""
    if i == 0:
        return "the loss"
    p, k = divmod(i - 1, width)
    return f"{names[p]}'s gradient " + ("norm" if k == 0 else f"projection {k}")


def distance(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """How far apart two sketch vectors are: the largest of their components' differences,
    each in its own scale (0-d float64, on their device, no host read).

    The loss's difference is relative to the larger of the two losses; a parameter's norm
    and projections differ relative to the larger of its two gradient norms. Components
    equal bit for bit, or non-finite alike (NaN and NaN, Inf and Inf of one sign: a batch
    that makes the same overflow on every rank), differ by 0; a component finite on one
    side only, or a non-zero difference with a zero scale, by Inf.

    Two contiguous float64 CPU vectors take the C kernel's one loop (``sdc_sketch_distance``,
    the same operations: the same number) where it is built; torch's path is about fifteen
    operations."""
    kernel = active_kernel()
    if (kernel is not None and a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype == torch.float64 and b.dtype == torch.float64 and a.dim() == 1
            and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
            and a.numel() >= 1 and (a.numel() - 1) % width == 0):
        far = kernel.sketch_distance_at(a.data_ptr(), b.data_ptr(), a.numel(), width)
        return torch.tensor(far, dtype=torch.float64)
    return differences(a, b, width).max()


def calibrated_tolerance(same_rank: Sequence[float], cross_rank: Sequence[float]) -> float:
    """``MARGIN`` times the larger of the medians of the two kinds of calibration
    differences (the same batch recomputed on one rank; a rank's recomputation against the
    owner's step), at least ``FLOOR``. The medians, not the maxima: one faulty
    recomputation during the calibration moves a median little."""
    def median(xs: Sequence[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return max(FLOOR, MARGIN * max(median(same_rank), median(cross_rank)))
