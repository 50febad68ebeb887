"""The checksum check by the C passes: float32 layers on the CPU with the exact bound.

Each hook makes one foreign call (``sdc_cs_fwd`` in the forward hook, ``sdc_cs_bwd`` in the
backward's, ``sdc_cs_gx`` for a ``GX`` seen on its own) that reads each matrix once and
compares in C, into a workspace the layer keeps (``Layer.pool``); a failure is recorded only
when an entry fails, so a clean step dispatches no tensor operation. What a call's sizes fix
(row strides, addresses, tolerance, threads) is kept in a plan per layer and call
(``Plan``). ``W``'s sums come once per step from the forward's call, or from the weights
check's pass over the weights (``weight_sums``); ``GW e`` from the comm hook's scaling pass
(``ChecksumCheck.row_sums``) or, without it, from a hook on the weight (``_gw_native``).
"""

from __future__ import annotations

import torch

from sdc_guard.checks.checksum.bounds import cpu_tolerance
from sdc_guard.checks.checksum.state import (
    F32,
    GXS,
    NATIVE_WS,
    BackwardPlan,
    Call,
    CheckState,
    Failure,
    Layer,
    NativeBuffers,
    Plan,
    versions,
)
from sdc_guard.fingerprints.native import CsBwdArgs, CsFwdArgs, NativeKernel
from sdc_guard.fingerprints.public import WeightSums

F32_DTYPE = torch.float32
_PER_THREAD = 1 << 20
"""Elements per thread of a native pass (below that, starting a thread costs more)."""


def threads(elements: int) -> int:
    if elements < 2 * _PER_THREAD:  # one thread, without asking torch for its count
        return 1
    return max(1, min(torch.get_num_threads(), elements // _PER_THREAD))


def flat_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (float32 on the CPU, at least 1-D) as rows the C passes can read in place, and
    their stride: a contiguous tensor as its rows (no view made; the usual case, asked
    first), a 2-D matrix with unit column stride as it is, anything else copied first."""
    if t.is_contiguous():
        return t, t.shape[-1]
    ld = _row_stride(t)
    if ld >= 0:
        return t, ld
    t = t.reshape(-1, t.shape[-1]).contiguous()
    return t, t.shape[-1]


def rows_ok(t: torch.Tensor) -> bool:
    """A 2-D float32 CPU matrix the C passes can read in place (unit column stride)."""
    return t.dtype is F32_DTYPE and t.device.type == "cpu" and _row_stride(t) >= 0


def _row_stride(t: torch.Tensor) -> int:
    """The row stride of ``t`` if it is a 2-D matrix with unit column stride whose rows do
    not overlap, else -1 (its dtype and device not looked at: the caller knows them)."""
    st = t.stride()
    return st[0] if len(st) == 2 and st[1] == 1 and st[0] >= t.shape[1] else -1


class CpuPath(CheckState):
    """The C passes' side of ``ChecksumCheck`` (a mixin: the state is the check's)."""

    # -- the weight's sums from the weights check's pass -------------------------------------
    def weight_sums(self, step: int) -> list[WeightSums]:
        """The weight sums the shared pass over the weights after ``step``'s optimizer step
        (``WeightPass``, which this check subscribes to) is asked to take in the same read:
        those the next step's first forward would otherwise read each weight again for. The
        C path's layers (the exact bound, float32, a contiguous weight no other checked
        layer shares), when the check is due at the next step.

        The sums serve the next step's first call if the weight's version is still the
        one they were taken at; a write through ``.data`` in between changes no version, so
        an entry that fails against them is checked again (``_stale``)."""
        kernel = self._kernel
        if kernel is None or not self.exact or not self.due(step + 1):
            for layer in self.layers:
                layer.ask = None
            return []
        seen: set[int] = set()
        shared: set[int] = set()
        for layer in self.layers:
            w_id = id(layer.w)
            (shared if w_id in seen else seen).add(w_id)
        asks = []
        for layer in self.layers:
            # (the tensors the step found: if the module got others since, the weights
            # check's pass, which matches them by address, reads none of these)
            w, b, bufs = layer.w, layer.b, layer.buffers
            if not (w is not None and layer.fuse and layer.native and bufs is not None
                    and id(w) not in shared and w.is_contiguous()):
                layer.ask = None
                continue
            # The same ask as last step's while it names the same tensors (only its version
            # moves on): no objects made per step.
            ask = layer.ask
            if not (ask is not None and ask.weight.data_ptr() == w.data_ptr()
                    and ask.weight.shape == w.shape and ask.out is bufs.wsum
                    and (ask.bias is None if b is None else
                         ask.bias is not None and ask.bias.data_ptr() == b.data_ptr()
                         and ask.bias.shape == b.shape)):
                ask = layer.ask = WeightSums(w.detach(), None if b is None else b.detach(),
                                             bufs.wsum, kernel.threads_for(w.numel()))
            ask.taken = False
            layer.ask_key = versions(w, b)
            asks.append(ask)
        return asks

    def _stale(self, layer: Layer) -> bool:
        """An entry failed against the sums from the weights check's pass: take them again
        by the same pass (the same threads: the same bits if the weight is what it was).
        True if they changed: the weight was written since where its version counter does
        not see it (through ``.data``), and the layer takes its own sums from then on."""
        layer.pre_sums = False
        ask, kernel, bufs = layer.ask, self._kernel, layer.buffers
        if ask is None or kernel is None or bufs is None:
            return False
        before = bufs.wsum.view(torch.int32).clone()
        ask.take(kernel)
        if torch.equal(before, bufs.wsum.view(torch.int32)):
            return False
        layer.fuse = False
        self.stale_sums += 1
        return True

    # -- the forward ------------------------------------------------------------------------
    def _forward_native(self, kernel: NativeKernel, layer: Layer, x: torch.Tensor,
                        y: torch.Tensor, tapped: bool) -> Call:
        """The forward hook's sums of ``X`` and ``Y`` (and of ``W``, once per step) and the
        forward identity compared, in one C call (``sdc_cs_fwd``), while ``X`` and ``Y`` are
        in cache."""
        i = len(layer.calls)
        plan = layer.plans[i] if i < len(layer.plans) else None
        if not (plan is not None and plan.x_shape == x.shape and plan.y_shape == y.shape
                and x.is_contiguous() and y.is_contiguous()):
            plan = self._plan(layer, x, y)
        x2, n, ws, args = plan.x2 if plan.x2 is not None else x, plan.n, plan.ws, plan.fwd
        args.X = x2.data_ptr()
        args.Y = plan.y2.data_ptr() if plan.y2 is not None else y.data_ptr()
        w, bias = layer.w, layer.b  # (as the step found them: native says so)
        assert w is not None
        version = (w.data_ptr(), w._version, -1 if bias is None else bias._version)
        key = (self._generation, *version)  # (versions, inline: a hook runs it every call)
        fresh = layer.w_key != key
        layer.w_key = key
        if fresh:  # the weights check's pass may have taken the sums already
            ask = layer.ask
            layer.pre_sums = ask is not None and ask.taken and layer.ask_key == version
            fresh = not layer.pre_sums
            self.pre_sums_used += layer.pre_sums
        if fresh:  # (the weight's fields are read by the C call only when it takes its sums)
            args.W = version[0]
            args.ldw = w.stride(0)
            args.bias = None if bias is None else bias.data_ptr()
            args.threads_w = threads(w.numel())
        args.w_fresh = fresh
        bad = kernel.cs_fwd(args)
        if bad and layer.pre_sums and self._stale(layer):  # against the sums of the weight
            args.w_fresh = 0                               # as it is
            bad = kernel.cs_fwd(args)
        call = Call(x2, ws, n, self._micro, tapped, gy_dtype=y.dtype, native=True, plan=plan)
        self.native_calls += 1
        if bad:
            bufs = layer.buffers
            assert bufs is not None
            b0, b1 = bufs.wsum[-2:].tolist()
            self._failed(layer, "forward", call.micro_batch, ws[2 * n:3 * n],
                         ws[3 * n:4 * n], ws[4 * n:5 * n], args.tol, b0, b1)
        return call

    def _plan(self, layer: Layer, x: torch.Tensor, y: torch.Tensor) -> Plan:
        """The C forward call's arguments that the sizes of ``X`` and ``Y`` fix, for the
        layer's next call in this micro-batch: kept (``Layer.plans``) where both are
        contiguous, the usual case, else made for this call (with copies if need be)."""
        x2, ldx = flat_rows(x)  # the C passes read rows at a stride: no view for 3-D
        y2, ldy = flat_rows(y)
        inner, out = x2.shape[-1], y2.shape[-1]
        n = x2.numel() // inner if inner else 0
        ws = self._workspace(layer, NATIVE_WS * n)
        bufs = layer.buffers
        if bufs is None:
            bufs = layer.buffers = NativeBuffers.make(inner, out)
        kept = x2 is x and y2 is y and x.is_contiguous() and y.is_contiguous()
        at = bufs.at
        fwd = CsFwdArgs(
            n=n, inner=inner, ldx=ldx, out=out, ldy=ldy, ldw=inner, wsum=at.wsum, bsum=at.bsum,
            res=ws.data_ptr(), check=int(self._want["forward"]),
            finite_only=int(self.expect_overflow),
            tol=cpu_tolerance(self.config.tolerance_scale, inner + 1, 2 * out + inner),
            threads_x=threads(n * inner), threads_y=threads(n * out))
        plan = Plan(x.shape, y.shape, n, ws, fwd, x2=None if kept else x2,
                    y2=None if kept else y2)
        if kept:
            i = len(layer.calls)
            if i < len(layer.plans):
                layer.plans[i] = plan
            else:
                layer.plans.append(plan)
        return plan

    @staticmethod
    def _workspace(layer: Layer, size: int) -> torch.Tensor:
        """The workspace of the layer's next call in this micro-batch (``Layer.pool``)."""
        i = len(layer.calls)
        pool = layer.pool
        if i < len(pool) and pool[i].numel() >= size:
            return pool[i]
        ws = torch.empty(size)
        if i < len(pool):
            pool[i] = ws
        else:
            pool.append(ws)
        return ws

    # -- the backward -----------------------------------------------------------------------
    def _gy_native(self, kernel: NativeKernel, layer: Layer, call: Call, g: torch.Tensor,
                   ldg: int, gx: torch.Tensor | None = None, ldx: int = 0) -> None:
        """The output gradient's hook (and the input gradient's, given ``gx``) by the C
        passes, in one call (``sdc_cs_bwd``): one read of ``GY`` for the input gradient's
        right-hand side and bound, ``GY (W e)`` and ``|GY| (|W| e)`` (``W``'s sums from the
        forward), and the weight gradient's, ``GY^T (X e)`` and ``|GY|^T (|X| e)``; then
        ``GX``'s row sums compared. Without ``gx`` the input gradient's sides stay in the
        workspace (``_gx_native``). ``g`` and ``gx`` as ``flat_rows`` gives them, with their
        row strides."""
        bufs = layer.buffers
        if bufs is None:  # (a call on the C path made them in its forward)
            return
        n = call.rows
        call.gy_dtype = g.dtype
        gw = add = 0
        gw_at = gwb_at = 0
        if layer.gw_step and not layer.gw_at_node:
            if layer.gw_rhs is None or layer.gw_bound is None:
                layer.gw_rhs, layer.gw_bound = bufs.gw[0], bufs.gw[1]
                gw_at, gwb_at = bufs.at.gw_rhs, bufs.at.gw_bound
            else:  # another call of the layer in this micro-batch: its share adds on
                add = 1
                gw_at, gwb_at = layer.gw_rhs.data_ptr(), layer.gw_bound.data_ptr()
            gw = 1
            layer.gw_rows += n
            layer.gw_dtype = g.dtype
        side = call.tapped
        if not (gw or side):
            return
        plan = call.plan
        fixed = plan.bwd if plan is not None else None
        if fixed is None:  # what the call's sizes fix (kept with its forward's plan)
            fixed = self._backward_plan(layer, call, g.shape[-1])
            if plan is not None:
                plan.bwd = fixed
        args, inner = fixed.args, fixed.inner
        gx_at = gx.data_ptr() if gx is not None and side else None  # (an input gradient not
        args.GY = g.data_ptr()                                       # asked for: not compared)
        args.ldg = ldg
        args.GX = gx_at
        args.ldx = ldx if gx_at is not None else inner
        args.gw_rhs = gw_at
        args.gw_bound = gwb_at
        args.gw = gw
        args.gw_add = add
        args.gx_side = side
        bad = kernel.cs_bwd(args)
        call.gx_ready = side and gx_at is None
        if bad and layer.pre_sums and self._stale(layer):  # again, against the sums as they are
            args.gw_rhs = args.gw_bound = None
            args.gw = args.gw_add = 0
            args.gx_side = 1
            bad = kernel.cs_bwd(args)
        if bad:
            self._gx_failed(layer, call, n, fixed.tol)

    def _backward_plan(self, layer: Layer, call: Call, out: int) -> BackwardPlan:
        """What the C backward call of ``call`` needs that its sizes fix (``out``: ``GY``'s
        columns)."""
        bufs = layer.buffers
        assert bufs is not None
        n, inner = call.rows, layer.module.in_features
        work = call.sums.data_ptr()
        tol = cpu_tolerance(self.config.tolerance_scale, out, 2 * inner + out)
        return BackwardPlan(CsBwdArgs(
            n=n, out=out, wr=bufs.at.w_row, war=bufs.at.w_abs_row, x_rows=work,
            gxs=work + GXS * n * F32, inner=inner, tol=tol,
            finite_only=int(self.expect_overflow), threads_g=threads(n * out),
            threads_x=threads(n * inner)), inner, tol)

    def _gx_native(self, kernel: NativeKernel, layer: Layer, call: Call,
                   g: torch.Tensor) -> None:
        """The input gradient ``GX`` (2-D float32) of a call whose ``GY`` the C passes saw
        first (``Call.gx_ready``: its sides are in the call's workspace): compared in C."""
        n, inner = g.shape
        out = layer.module.out_features
        at = GXS * n
        g = g if rows_ok(g) else g.contiguous()
        tol = cpu_tolerance(self.config.tolerance_scale, out, 2 * inner + out)
        # A failure against sums found stale is not counted: the right-hand side was taken
        # from GY, gone now, so the entries cannot be checked again.
        if kernel.cs_gx(GX=g.data_ptr(), n=n, inner=inner, ld=g.stride(0),
                        gxs=call.sums.data_ptr() + at * F32, tol=tol,
                        finite_only=self.expect_overflow, threads=threads(g.numel())) and not (
                            layer.pre_sums and self._stale(layer)):
            self._gx_failed(layer, call, n, tol)

    def _gx_failed(self, layer: Layer, call: Call, n: int, tol: float) -> None:
        """The C passes found input-gradient entries that fail: record them."""
        ws = call.sums
        at = GXS * n
        self._failed(layer, "input_grad", call.micro_batch, ws[at + 2 * n:at + 3 * n],
                     ws[at:at + n], ws[at + n:at + 2 * n], tol)

    def _gw_native(self, kernel: NativeKernel, layer: Layer, g: torch.Tensor) -> None:
        """The weight-gradient identity on ``GW`` read in a hook on the weight (without the
        comm hook's row sums): ``GW e`` by a C pass, compared in C."""
        n = layer.gw_rows
        lhs = torch.empty(g.shape[0])
        kernel.cs_rows(A=g.data_ptr(), n=g.shape[0], cols=g.shape[1], ld=g.stride(0), k=1,
                       ka=0, r0=lhs.data_ptr(), threads=threads(g.numel()))
        self._compare(layer, "weight_grad", layer.calls[0].micro_batch, lhs, layer.gw_rhs,
                      layer.gw_bound, cpu_tolerance(self.config.tolerance_scale, n,
                                                    2 * g.shape[1] + n))

    # -- failures ---------------------------------------------------------------------------
    def _compare(self, layer: Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                 rhs: torch.Tensor | None, bound: torch.Tensor | None, tol: float,
                 rhs0: float = 0.0, bound0: float = 0.0) -> None:
        """The C path's ``_record``: entries compared in C; a failure recorded only when one
        fails (no tensor op otherwise)."""
        if self._kernel is None or rhs is None or bound is None:
            return
        bad = self._kernel.cs_compare(lhs=lhs.data_ptr(), rhs=rhs.data_ptr(),
                                      bound=bound.data_ptr(), n=lhs.numel(), tol=tol,
                                      finite_only=self.expect_overflow, rhs0=rhs0,
                                      bound0=bound0)
        if bad:
            self._failed(layer, product, micro_batch, lhs, rhs, bound, tol, rhs0, bound0)

    def _failed(self, layer: Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                rhs: torch.Tensor, bound: torch.Tensor, tol: float, rhs0: float = 0.0,
                bound0: float = 0.0) -> None:
        """A failure the C comparison found, with its entries (read for the evidence)."""
        diff = (lhs.double() - (rhs.double() + rhs0)).abs().float()
        limit = ((bound.double() + bound0) * tol).float()
        self._failures.append(Failure(layer, product, micro_batch, torch.tensor(True), diff,
                                      limit))
