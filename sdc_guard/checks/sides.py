"""The checksum check's sides by torch operations: the sums of ``X``, ``Y``, ``GY`` and ``W``
its identities compare (``sdc_guard.checks.checksum``), where the C passes do not run (GPUs,
other dtypes, a CPU without a compiler).

Two forms of each:

- **eager**, one kernel a reduction (``torch.addmv`` with the bias's sum and the tolerance
  folded in, sums written in place): about six kernels a hook, each reading its operand
  again, and ``X`` copied twice when it is not float32 (widened, then its absolute values);
- **fused**, the same sums written as one expression per hook (elementwise products and
  row or column sums) that ``torch.compile`` turns into a kernel or two reading each operand
  once, widening in registers. Taken on the device types in ``FUSED_DEVICES``; compiled once
  per expression, checked against the eager form on its first use in each dtype, and given
  up for the eager form, with a warning, if it fails to compile or to agree
  (``sdc_guard.compiled``).

Every sum accumulates in float32 in both forms; the tolerance's bound allows for any order of
summation (docs/checks/checksum.md), so the two may differ in their last bits, never by more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sdc_guard.compiled import CheckedCompile

FUSED_DEVICES: set[str] = set()
"""The device types whose sides take the fused expressions. None by default: on a GPU the
fused form reads each operand once where the eager one reads it four to six times, but a
compiled call has a fixed host cost of its own; ``python -m bench.device_check`` times both
side by side (docs/checks/checksum.md)."""

_FUSED = CheckedCompile()
"""The expressions compiled by name, checked per (device type, name, the first operand's
dtype): each dtype is a graph of its own."""
_tols: dict[tuple[torch.device, float], torch.Tensor] = {}


def _tol(device: torch.device, tol: float) -> torch.Tensor:
    """The tolerance as a 0-d float32 tensor on ``device``, made once per value (a Python
    float would be compiled into the kernel: a new compilation per layer size)."""
    t = _tols.get((device, tol))
    if t is None:
        t = _tols[(device, tol)] = torch.tensor(tol, dtype=torch.float32, device=device)
    return t


def _agree(got: tuple[torch.Tensor | None, ...],
           want: tuple[torch.Tensor | None, ...]) -> bool | None:
    """The compiled result is the eager one up to float32 rounding: within 1e-4 relative, or
    1e-3 of the largest magnitude among the results (sums in another order), never a
    non-finite value or a shape of its own. None when the eager result holds NaN or Inf
    (a first step whose data overflowed): such sums cannot tell a right kernel from a wrong
    one, and the compiled form is compared again on the next call rather than given up."""
    pairs = [(g, w) for g, w in zip(got, want, strict=True) if w is not None]
    if any(g is None or g.shape != w.shape for g, w in pairs):
        return False
    if not all(bool(torch.isfinite(w).all()) for _, w in pairs):
        return None
    scale = max((float(w.abs().max()) for _, w in pairs if w.numel()), default=0.0)
    return all(g is not None and bool(torch.isfinite(g).all()) and torch.allclose(
        g, w, rtol=1e-4, atol=1e-3 * scale) for g, w in pairs)


def _fused(name: str, math: Callable[..., Any], device: torch.device,
           eager: Callable[[], tuple[torch.Tensor | None, ...]],
           *args: Any) -> tuple[torch.Tensor | None, ...] | None:
    """``math(*args)`` compiled, or None where the fused form is off for ``device``, failed to
    compile, or once disagreed with ``eager()`` (``sdc_guard.compiled``)."""
    kind = device.type
    if kind not in FUSED_DEVICES:
        return None
    dtype = str(args[0].dtype).removeprefix("torch.")
    got: tuple[torch.Tensor | None, ...] | None = _FUSED.run(
        name, math, (kind, name, dtype), f"the checksum's {name} sums ({dtype}) on {kind}",
        eager, _agree, *args)
    return got


# -- the forward hook: X e, |X| e, Y e; X (W^T e) + sum b; (|X| (|W|^T e) + sum |b|) tol -----
def _forward_math(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
                  b_sum: torch.Tensor, b_abs: torch.Tensor,
                  tol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = x.float()
    xa = xf.abs()
    sums = torch.cat([xf.sum(1), xa.sum(1), y.float().sum(1)])
    return sums, (xf * c).sum(1) + b_sum, ((xa * a).sum(1) + b_abs) * tol


def _forward_eager(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
                   b_sum: torch.Tensor, b_abs: torch.Tensor,
                   tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    xf = x if x.dtype == torch.float32 else x.float()
    xa = xf.abs()  # formed once: its row sums, and the bound
    sums = torch.empty(3 * n, device=x.device)  # summed in place: no concatenation
    torch.sum(xf, 1, out=sums[:n])
    torch.sum(xa, 1, out=sums[n:2 * n])
    torch.sum(y, 1, dtype=torch.float32, out=sums[2 * n:])
    # One kernel a side: the bias's sum added, the tolerance applied, in the product.
    rhs = torch.addmv(b_sum, xf, c)
    bound = torch.addmv(b_abs, xa, a, beta=tol, alpha=tol)
    return sums, rhs, bound


def forward_sides(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
                  b_sum: torch.Tensor, b_abs: torch.Tensor,
                  tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``Y = X W^T + b`` (``X``: ``N x in``, ``Y``: ``N x out``, 2-D; ``c = W^T e``,
    ``a = |W|^T e``, ``b_sum``/``b_abs`` 0-d): the float32 row sums ``X e``, ``|X| e``,
    ``Y e`` laid end to end, the forward identity's right-hand side and its bound times
    ``tol``."""
    def eager() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _forward_eager(x, y, c, a, b_sum, b_abs, tol)

    if x.device.type not in FUSED_DEVICES:
        return eager()
    got = _fused("forward", _forward_math, x.device, eager, x, y, c, a, b_sum, b_abs,
                 _tol(x.device, tol))
    return eager() if got is None else got  # type: ignore[return-value]


# -- the output's gradient: GY (W e), |GY| (|W| e) tol; GY^T (X e), |GY|^T (|X| e) ------------
def _gx_math(g: torch.Tensor, w_row: torch.Tensor, w_abs_row: torch.Tensor,
             tol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gf = g.float()
    return (gf * w_row).sum(1), (gf.abs() * w_abs_row).sum(1) * tol


def _gw_math(g: torch.Tensor, xe: torch.Tensor,
             xae: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gf = g.float()
    return (gf * xe[:, None]).sum(0), (gf.abs() * xae[:, None]).sum(0)


def _gxw_math(g: torch.Tensor, w_row: torch.Tensor, w_abs_row: torch.Tensor, tol: torch.Tensor,
              xe: torch.Tensor, xae: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gf = g.float()
    ga = gf.abs()
    return ((gf * w_row).sum(1), (ga * w_abs_row).sum(1) * tol, (gf * xe[:, None]).sum(0),
            (ga * xae[:, None]).sum(0))


GY_FORMS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {
    "gx": _gx_math, "gw": _gw_math, "gx+gw": _gxw_math}
"""The output gradient's expressions, one function each (a compiled function holds a few
graphs only: one per dtype and per size of 1, not one per combination)."""


def _gy_eager(g: torch.Tensor, w_row: torch.Tensor | None, w_abs_row: torch.Tensor | None,
              tol: float, xe: torch.Tensor | None, xae: torch.Tensor | None,
              zero: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    gf = g if g.dtype == torch.float32 else g.float()
    ga = gf.abs()
    gx: tuple[torch.Tensor | None, ...] = (None, None)
    if w_row is not None and w_abs_row is not None:
        gx = (torch.mv(gf, w_row),
              torch.addmv(zero, ga, w_abs_row, beta=0, alpha=tol))  # (zero: not read)
    gw: tuple[torch.Tensor | None, ...] = (None, None)
    if xe is not None and xae is not None:
        gw = (torch.mv(gf.t(), xe), torch.mv(ga.t(), xae))
    return (*gx, *gw)


def gy_sides(g: torch.Tensor, w_row: torch.Tensor | None, w_abs_row: torch.Tensor | None,
             tol: float, xe: torch.Tensor | None, xae: torch.Tensor | None,
             zero: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """For the output's gradient ``GY`` (``N x out``, 2-D): the input-gradient identity's
    right-hand side ``GY (W e)`` and its bound ``|GY| (|W| e)`` times ``tol`` (given ``W e``
    and ``|W| e``), and this call's share of the weight gradient's, ``GY^T (X e)`` and
    ``|GY|^T (|X| e)`` (given ``X e`` and ``|X| e``); None for those not asked for. ``zero``: a
    float32 0-d tensor on the device."""
    def eager() -> tuple[torch.Tensor | None, ...]:
        return _gy_eager(g, w_row, w_abs_row, tol, xe, xae, zero)

    def eager_parts() -> tuple[torch.Tensor | None, ...]:  # as the fused form returns them
        return tuple(t for t in eager() if t is not None)

    gx = w_row is not None and w_abs_row is not None
    gw = xe is not None and xae is not None
    if not (gx or gw):
        return None, None, None, None
    if g.device.type not in FUSED_DEVICES:
        return eager()
    name = "gx+gw" if gx and gw else "gx" if gx else "gw"
    args = ((w_row, w_abs_row, _tol(g.device, tol)) if gx else ()) + ((xe, xae) if gw else ())
    got = _fused(name, GY_FORMS[name], g.device, eager_parts, g, *args)
    if got is None:
        return eager()
    return (*(got[:2] if gx else (None, None)), *(got[-2:] if gw else (None, None)))


# -- the weight, once per step: e^T W, e^T |W|, W e, |W| e; sum b, sum |b| --------------------
def _weight_math(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    wf = w.float()
    wa = wf.abs()
    if b is None:
        zero = torch.zeros((), dtype=torch.float32, device=w.device)
        bs, ba = zero, zero
    else:
        bf = b.float()
        bs, ba = bf.sum(), bf.abs().sum()
    return wf.sum(0), wa.sum(0), wf.sum(1), wa.sum(1), bs, ba


def _weight_eager(w: torch.Tensor, b: torch.Tensor | None, zero: torch.Tensor,
                  exact: bool) -> tuple[torch.Tensor | None, ...]:
    f32 = torch.float32
    norm1 = torch.linalg.vector_norm  # ord=1: sum |t| in one pass, no |t| formed
    return (w.sum(0, dtype=f32), norm1(w, 1, dim=0, dtype=f32) if exact else None,
            w.sum(1, dtype=f32), norm1(w, 1, dim=1, dtype=f32) if exact else None,
            zero if b is None else b.sum(dtype=f32),
            zero if b is None else norm1(b, 1, dtype=f32))


def weight_sides(w: torch.Tensor, b: torch.Tensor | None, zero: torch.Tensor,
                 exact: bool) -> tuple[torch.Tensor | None, ...]:
    """``e^T W``, ``e^T |W|``, ``W e``, ``|W| e`` (the absolute ones None unless ``exact``),
    the bias's sum and absolute sum (``zero`` without a bias), in float32."""
    def eager() -> tuple[torch.Tensor | None, ...]:
        return _weight_eager(w, b, zero, exact)

    got = _fused("weight", _weight_math, w.device, eager, w, b) if exact else None
    return eager() if got is None else got
