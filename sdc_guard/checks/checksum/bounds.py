"""The checksum check's tolerance: the rounding-error bound of a product and its two sides.

Both sides of an identity are computed in float32 (upcast). With ``u(t)`` the unit roundoff
of dtype ``t`` (float32 2^-24, bfloat16 2^-8, float16 2^-11) and
``g(n, u) = n u / (1 - n u)``, a checksum entry whose product has inner length ``K`` passes
when::

    |lhs - rhs| <= s * ( g(K, u_acc) + u_out + 2 u_in + g(L + R + 2, u32) ) * M * (1 + 1e-3)

``u_acc``: the accumulation (float32 for float32, bfloat16 and float16 products; on CUDA,
with reduced-precision reductions allowed, the product's own dtype over ``ceil(log2 K)``
levels of split sums); ``u_out``: the rounding of the product to its dtype; ``u_in``: the
rounding of each operand to the product's dtype when it arrives in another one (autocast;
TF32 counts as 2^-11); ``L`` and ``R``: the lengths of the two checksum sides' float32 sums;
``M``: the sum of the absolute values of every term of the entry
(``sum_jk |X_ik| |W_jk| + sum_j |b_j|`` for a forward row, ``sum_jk |GY_ij| |W_jk|`` for an
input-gradient row, ``sum_ik |GY_ij| |X_ik|`` for a weight-gradient row), computed exactly,
with the same matrix products as the checksums applied to absolute values;
``s``: ``ChecksumConfig.tolerance_scale`` (1 by default: the bound itself, no per-model
constant). This is the worst-case bound (Higham, *Accuracy and Stability of Numerical
Algorithms*, ch. 3), so a clean product never fails it; the price is that a corruption
smaller than it is invisible. For a float32 entry the bound is about ``K 2^-24 M``: a flip
of an exponent bit or of the top mantissa bits of a term of typical size is seen, a flip of
the lower mantissa bits is not. In bfloat16 (7 mantissa bits) the bound is a few ulps of
``M``: only exponent and sign flips of large terms stand out (the campaign report's
``checksum_bits.svg`` shows, bit by bit, where the line falls; docs/checks/checksum.md).

Pure functions of sizes, dtypes and torch's matmul settings: nothing here reads a tensor.
"""

from __future__ import annotations

import functools
import math

import torch

_U32 = 2.0 ** -24
_UNIT = {torch.float32: _U32, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
         torch.float16: 2.0 ** -11}
_TF32 = 2.0 ** -11


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of a floating dtype (half its machine epsilon)."""
    u = _UNIT.get(dtype)
    if u is None:
        raise ValueError(f"the checksum check handles float32, float64, bfloat16 and float16 "
                         f"products, not {dtype}.")
    return u


def _gamma(n: int, u: float) -> float:
    nu = n * u
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def accumulation(dtype: torch.dtype, device: torch.device, k: int) -> float:
    """``g(K, u_acc)``: the accumulation error of a product of inner length ``k`` in ``dtype``."""
    if dtype == torch.float64:
        return _gamma(k, _UNIT[torch.float64])
    acc = _gamma(k, _U32)
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        reduced = (dtype == torch.float16 and matmul.allow_fp16_reduced_precision_reduction) or (
            dtype == torch.bfloat16 and matmul.allow_bf16_reduced_precision_reduction)
        if reduced:  # split-K partial sums rounded to the product's dtype, level by level
            acc += math.ceil(math.log2(max(k, 2))) * unit_roundoff(dtype)
    return acc


def input_rounding(compute: torch.dtype, operands: tuple[torch.dtype, ...],
                   device: torch.device) -> float:
    """``2 u_in``: the rounding of the operands that arrive in another dtype than ``compute``
    (autocast), or to TF32 when CUDA float32 products may use it."""
    if compute == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return 2 * _TF32
    return sum(unit_roundoff(compute) for d in operands if d != compute)


def tolerance(scale: float, *, k: int, checked: int, compute: torch.dtype,
              operands: tuple[torch.dtype, ...], device: torch.device) -> float:
    """The factor that multiplies ``M`` (module doc): ``k`` the product's inner length,
    ``checked`` the lengths of the two checksum sides' float32 sums together (``L + R``)."""
    if device.type != "cuda":
        return _tolerance(scale, k, checked, compute, tuple(operands), "cpu", None)
    matmul = torch.backends.cuda.matmul
    flags = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    return _tolerance(scale, k, checked, compute, tuple(operands), "cuda", flags)


@functools.lru_cache(maxsize=4096)
def _tolerance(scale: float, k: int, checked: int, compute: torch.dtype,
               operands: tuple[torch.dtype, ...], device: str,
               flags: tuple[bool, bool, bool] | None) -> float:
    """``tolerance``, cached: a hook asks for it every step with the same sizes; ``flags``
    (CUDA's TF32 and reduced-precision settings, read at each call) are part of the key."""
    at = torch.device(device)
    factor = (accumulation(compute, at, k) + unit_roundoff(compute)
              + input_rounding(compute, operands, at) + _gamma(checked + 2, _U32))
    return scale * factor * (1.0 + 1e-3)


@functools.lru_cache(maxsize=4096)
def cpu_tolerance(scale: float, k: int, checked: int) -> float:
    """``tolerance`` of a float32 product of float32 operands on the CPU (cached: the native
    path asks for it every step with the same sizes)."""
    cpu = torch.device("cpu")
    return tolerance(scale, k=k, checked=checked, compute=torch.float32,
                     operands=(torch.float32, torch.float32), device=cpu)
