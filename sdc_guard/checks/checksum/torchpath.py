"""The checksum check by torch operations: where the C passes do not run (CUDA, bfloat16 or
float16 layers, the "norm" bound, no C compiler).

The sums themselves are ``sdc_guard.checks.sides``'s (eager, or fused by ``torch.compile``
where a device type asks for it); here they are taken per hook and the step's entries kept
(``Entries``), to be compared all at once per device when the step's verdict is asked for
(``_compared``): a comparison per product would be six kernels each.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from sdc_guard.checks import sides
from sdc_guard.checks.checksum.bounds import tolerance
from sdc_guard.checks.checksum.state import (
    Call,
    CheckState,
    Entries,
    Failure,
    Layer,
    WeightSides,
    versions,
)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def full_precision(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The checksum sides' products in float32 where CUDA autocast is on (a forward hook runs
    inside the user's autocast region, and CUDA autocast runs ``mv``/``addmv`` in half
    precision: sides rounded to 8 bits, which the tolerance does not allow for); elsewhere
    nothing to do (CPU autocast leaves ``mv``/``addmv`` alone)."""
    if t.is_cuda and torch.is_autocast_enabled():
        return torch.autocast("cuda", enabled=False)
    return contextlib.nullcontext()


class TorchPath(CheckState):
    """The torch operations' side of ``ChecksumCheck`` (a mixin: the state is the check's)."""

    def _record(self, layer: Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                rhs: torch.Tensor, bound: torch.Tensor) -> None:
        self._entries.append(Entries(layer, product, micro_batch, _flat(lhs), _flat(rhs),
                                     _flat(bound)))
        self._batch = None

    def _compared(self) -> list[Failure]:
        """The step's torch-path entries compared, all of them at once per device: one
        ``Failure`` per device whose entries' ``bad`` says whether any failed, or, when one
        did, one per product that failed (with its entries, for the evidence)."""
        if self._batch is not None:
            return self._batch
        by_device: dict[torch.device, list[Entries]] = {}
        for e in self._entries:
            by_device.setdefault(e.lhs.device, []).append(e)
        out = []
        for entries in by_device.values():
            dtypes = {t.dtype for e in entries for t in (e.lhs, e.rhs, e.bound)}
            wide = functools.reduce(torch.promote_types, dtypes)  # an exact widening

            def joined(ts: list[torch.Tensor], wide: torch.dtype = wide) -> torch.Tensor:
                return torch.cat([t if t.dtype == wide else t.to(wide) for t in ts])

            lhs = joined([e.lhs for e in entries])
            rhs = joined([e.rhs for e in entries])
            bound = joined([e.bound for e in entries])
            diff = (lhs - rhs).abs()
            # Only an entry with a finite bound can fail: a non-finite bound means non-finite
            # operands (a NaN in the data), whose product is non-finite without any fault in
            # it. Then NaN and Inf fail, except with a GradScaler: an overflow is the
            # scaler's business.
            bad = (((diff > bound) & torch.isfinite(diff)) if self.expect_overflow
                   else ~(diff <= bound) & torch.isfinite(bound))
            first = entries[0]
            out.append(Failure(first.layer, first.product, first.micro_batch, bad.any(), diff,
                               bound, entries, bad))
        self._batch = out
        return out

    # -- the forward ------------------------------------------------------------------------
    def _forward_torch(self, layer: Layer, x: torch.Tensor, y: torch.Tensor,
                       tapped: bool) -> Call:
        """The forward hook's sums of ``X`` and ``Y`` (and of ``W``, once per step) by torch
        operations, and the forward identity recorded."""
        want = self._want["forward"]
        xd = x.detach().reshape(-1, x.shape[-1])
        y2 = y.detach().reshape(-1, y.shape[-1])
        n = xd.shape[0]
        with full_precision(xd):
            if want and self.exact:  # sum_jk |X_ik||W_jk| + sum |b| bounds the identity
                w_col, w_abs_col, _, _, b_sum, b_abs = self._sides(layer)
                assert w_abs_col is not None
                sums, rhs, bound = sides.forward_sides(
                    xd, y2, w_col, w_abs_col, b_sum, b_abs,
                    self._forward_tol(layer, xd, y.dtype))
            else:  # the sums the backward's identities need (and the "norm" bound's)
                xf = xd if xd.dtype == torch.float32 else xd.float()
                sums = torch.cat([xf.sum(1), torch.linalg.vector_norm(
                    xf, ord=1, dim=1), y2.sum(1, dtype=torch.float32)])
            call = Call(xd, sums, n, micro_batch=self._micro, tapped=tapped, gy_dtype=y.dtype)
            if want and self.exact:
                self._record(layer, "forward", call.micro_batch, call.y_sum, rhs, bound)
            elif want:
                self._forward_norm(layer, call, xf)
            if self.gathered and tapped:  # the backward's sums of the weight, while it is here
                self._sides(layer)
                if not self.exact:
                    self._weight_norm(layer)
        return call

    def _forward_tol(self, layer: Layer, x: torch.Tensor, y_dtype: torch.dtype) -> float:
        m = layer.module
        inner = x.shape[-1]
        return tolerance(self.config.tolerance_scale, k=inner + 1,
                         checked=2 * m.out_features + inner, compute=y_dtype,
                         operands=(x.dtype, self._weight(layer)[0].dtype), device=x.device)

    def _forward_norm(self, layer: Layer, call: Call, xf: torch.Tensor) -> None:
        """The forward identity of ``call`` by torch operations with the "norm" bound, in the
        forward hook (``xf``: its input in float32)."""
        w_col, _, _, _, b_sum, b_abs = self._sides(layer)  # (0-d zeros: no bias)
        tol = self._forward_tol(layer, call.x, call.gy_dtype or torch.promote_types(
            call.x.dtype, self._weight(layer)[0].dtype))
        rhs = torch.addmv(b_sum, xf, w_col)
        # <= ||X_i||_2 sum_j ||W_j||_2 <= ||X_i||_2 sqrt(out) ||W||_F
        bound = (torch.linalg.vector_norm(xf, dim=1) * (
            math.sqrt(layer.module.out_features) * self._weight_norm(layer)) + b_abs) * tol
        self._record(layer, "forward", call.micro_batch, call.y_sum, rhs, bound)

    # -- the weight's sums ------------------------------------------------------------------
    def _weight(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the layer's products use: the module's; under FSDP2 those
        gathered for its last call (``Hooks._gathered``), which the module holds only
        between FSDP2's hooks (a hook on the output's gradient may run before FSDP2
        gathers the weight again for the backward). Their values are read in the forward
        only (``_forward_torch``)."""
        if self.gathered and layer.w is not None:
            return layer.w, layer.b
        m = layer.module
        return m.weight, m.bias

    def _w_key(self, layer: Layer) -> tuple[int, ...]:
        """When the weight's sums are to be taken (again): once per step, and when the
        weight or bias changed since (its version); under FSDP2 at a call that gathered it
        anew (``Layer.w_at``)."""
        if self.gathered and layer.w_at is not None:
            return layer.w_at
        m = layer.module
        return (self._generation, *versions(m.weight, m.bias))

    def _sides(self, layer: Layer) -> WeightSides:
        """The torch path's sums of the weight (``Layer.sides``), once per step."""
        key = self._w_key(layer)
        if layer.sides_key != key or layer.sides is None:
            layer.sides_key = key
            weight, bias = self._weight(layer)
            w = weight.detach()
            b = bias.detach() if bias is not None else None
            w_col, w_abs_col, w_row, w_abs_row, b_sum, b_abs = sides.weight_sides(
                w, b, self._zero(w.device), self.exact)
            assert w_col is not None and w_row is not None
            assert b_sum is not None and b_abs is not None
            layer.sides = (w_col, w_abs_col, w_row, w_abs_row, b_sum, b_abs)
        return layer.sides

    def _zero(self, device: torch.device) -> torch.Tensor:
        """A float32 0-d zero on ``device``, made once (a bias's sums without a bias; the input
        of ``addmv`` with ``beta=0``, which reads none of it)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), device=device)
        return zero

    def _weight_norm(self, layer: Layer) -> torch.Tensor:
        """``||W||_F`` in float32, once per step (the "norm" bound)."""
        key = self._w_key(layer)
        if layer.norm_key != key or layer.w_norm is None:
            w, _ = self._weight(layer)
            layer.w_norm = torch.linalg.vector_norm(w.detach(), dtype=torch.float32)
            layer.norm_key = key
        return layer.w_norm

    # -- the backward -----------------------------------------------------------------------
    def _gy_sides(self, layer: Layer, call: Call, g: torch.Tensor) -> None:
        """The output gradient's sides by torch operations (``g``: ``GY``, 2-D): the input
        gradient's right-hand side and bound (the tolerance applied), and this call's share
        of the weight gradient's, one ``mv``/``addmv`` each."""
        call.gy_dtype = g.dtype
        gx = call.tapped
        gw = layer.gw_step and not layer.gw_at_node
        if not (gx or gw):
            return
        m = layer.module
        w_row = w_abs_row = None
        tol = 0.0
        if gx:  # the weight's sums (once a step) and the tolerance: the input gradient's only
            _, _, w_row, w_abs_row, _, _ = self._sides(layer)
            tol = tolerance(self.config.tolerance_scale, k=m.out_features,
                            checked=2 * m.in_features + m.out_features, compute=g.dtype,
                            operands=(self._weight(layer)[0].dtype,), device=g.device)
        x_rows = call.x_rows
        exact = w_abs_row is not None
        gx_rhs, gx_bound, gw_rhs, gw_bound = sides.gy_sides(
            g, w_row if gx and exact else None, w_abs_row if gx else None, tol,
            x_rows[0] if gw else None, x_rows[1] if gw else None, self._zero(g.device))
        if gx and not exact and w_row is not None:  # GY (W e), within ||GY_i||_2 sqrt(in) ||W||_F
            gf = g if g.dtype == torch.float32 else g.float()
            gx_rhs = torch.mv(gf, w_row)
            gx_bound = torch.linalg.vector_norm(gf, dim=1) * (
                tol * math.sqrt(m.in_features) * self._weight_norm(layer))
        if gx:
            call.gx_rhs, call.gx_bound = gx_rhs, gx_bound
        if gw and gw_rhs is not None and gw_bound is not None:
            if layer.gw_rhs is None or layer.gw_bound is None:
                layer.gw_rhs, layer.gw_bound = gw_rhs, gw_bound
            else:  # another call of the layer in this micro-batch: its share adds on
                layer.gw_rhs = layer.gw_rhs + gw_rhs
                layer.gw_bound = layer.gw_bound + gw_bound
            layer.gw_rows += g.shape[0]
            layer.gw_dtype = g.dtype

    def _gw_node(self, layer: Layer, call: Call, gy: torch.Tensor, lhs: torch.Tensor) -> None:
        """The weight-gradient identity of one call, on the gradient a node passes on before
        the user's hooks see it (``lhs``: its row sums, this call's share of ``GW e``)
        against ``GY^T (X e)``, within ``|GY|^T (|X| e)`` times the tolerance. Torch
        operations: only for a weight whose gradient is hooked (``Layer.gw_at_node``)."""
        g = gy.detach().reshape(-1, gy.shape[-1])
        n = g.shape[0]
        tol = tolerance(self.config.tolerance_scale, k=n,
                        checked=2 * layer.module.in_features + n, compute=g.dtype,
                        operands=(call.x.dtype,), device=gy.device)
        with full_precision(g):
            gf = g if g.dtype == torch.float32 else g.float()
            x_rows = call.x_rows
            rhs = torch.mv(gf.t(), x_rows[0])
            bound = torch.addmv(self._zero(g.device), gf.abs().t(), x_rows[1], beta=0,
                                alpha=tol)
        self._record(layer, "weight_grad", call.micro_batch, lhs, rhs, bound)
