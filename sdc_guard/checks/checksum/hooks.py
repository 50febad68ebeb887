"""The checksum check's hooks on a layer, and where each hands its tensors: to the C path
(``cpu.CpuPath``) or to torch operations (``torchpath.TorchPath``).

A forward pre-hook decides whether the call is checked and, unless the call will be seen
through its product's node, puts a *tap* on its input (a view only this call consumes, whose
hook sees this call's ``GX``). The forward hook (first among the module's, ``prepend``) sums
``X`` and ``Y`` and compares the forward identity, then hooks the call's backward: a
post-hook on the product's node (``GY`` and ``GX`` at once) where ``graph.product_node``
finds one, else a hook on ``Y`` (and, for a weight whose gradient the user hooks, one on the
node that passes the weight its gradient). A hook on the weight sees ``GW`` where the comm
hook's scaling pass does not sum its rows (``ChecksumCheck.bucket_weight_grad``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from sdc_guard.checks.checksum.bounds import tolerance
from sdc_guard.checks.checksum.cpu import F32_DTYPE, CpuPath, flat_rows, rows_ok
from sdc_guard.checks.checksum.graph import (
    eager,
    full_backward_hooked,
    gradient_hooked,
    in_backward,
    known_node,
    node_shape,
    product_node,
    recomputing,
    weight_edge,
)
from sdc_guard.checks.checksum.state import GXS, Call, Layer, versions
from sdc_guard.checks.checksum.torchpath import TorchPath, full_precision

log = logging.getLogger("sdc_guard.checks.checksum")


class Hooks(CpuPath, TorchPath):
    """The hooks' side of ``ChecksumCheck`` (a mixin: the state is the check's)."""

    def _hook(self, layer: Layer) -> None:
        """Hooks on the layer: a forward hook that sums ``X`` and ``Y`` and hooks the call's
        backward. The backward is seen through the product's own autograd node (its
        gradients in and out: ``GY`` and this call's ``GX``, ``graph.product_node``) when the
        layer's graph has one; otherwise (and on a layer's first call, to find out) through a
        hook on ``Y`` and one on a view of ``X`` that only this call consumes (the *tap*,
        installed by a forward pre-hook)."""
        m = layer.module

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            layer.via_node = False
            layer.posted = False
            layer.checked = False
            if nn.modules.module._global_forward_hooks or self._front.handle is not None:
                self._front.keep_first()
            if (not self._active or not args or not isinstance(args[0], torch.Tensor)
                    or args[0].numel() == 0):
                return None  # an empty input (an expert no token was routed to): no product
            if in_backward():  # (the reentrant checkpoint's recomputation runs in one)
                if recomputing():
                    return None
            else:
                self._forward_phase = True
            self._fresh(layer)
            if self.gathered:
                self._gathered(layer)
            layer.checked = True
            x = args[0]
            # The product's node will be there (as on the last call): no tap needed. Only
            # the stock forward on a 2-D or contiguous input multiplies in one addmm/mm.
            if (layer.node_ok and "forward" not in mod.__dict__
                    and type(mod).forward is nn.Linear.forward
                    and (x.dim() <= 2 or x.is_contiguous())):
                layer.via_node = True
                return None
            if not (self._want["input_grad"] and x.requires_grad and torch.is_grad_enabled()):
                return None
            if full_backward_hooked(mod):  # its GX may not be the product's: no tap
                return None
            tap = x.view_as(x)  # consumed by this layer only: its hook sees this layer's GX
            call_index = len(layer.calls)
            tap.register_hook(  # type: ignore[no-untyped-call]
                lambda gx: self._on_tap(layer, call_index, gx))
            return (tap, *args[1:])

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            checked, layer.checked = layer.checked, False
            if not (checked and isinstance(out, torch.Tensor)):
                return  # (the pre-hook found no product to check, or a recomputation)
            layer.called = True
            x = args[0]
            backward = out.requires_grad and torch.is_grad_enabled()
            via_node, layer.via_node = layer.via_node, False
            found = None
            if backward:
                found = known_node(out, layer.node_shape) if via_node else None
                if found is None:
                    found = product_node(out, m.weight)
                    layer.node_shape = None if found is None else node_shape(out, found)
            layer.node_ok = found is not None
            if via_node and found is None and backward:  # not as predicted: no GX this call
                self.unseen_input_grads += int(bool(x.requires_grad) and self._want["input_grad"])
            if found is not None:  # GY and GX (and, hooked, GW) from the product's node
                node, gx_at = found
                tapped = bool(x.requires_grad) and self._want["input_grad"]
                self._on_forward(layer, x, out, tapped)
                call = layer.calls[-1]
                call.via_node = True  # (a tap installed for this call is ignored)
                call_index = len(layer.calls) - 1
                node.register_hook(lambda grads_in, grads_out: self._on_node(
                    layer, call, call_index, grads_out[0], grads_in[gx_at] if tapped else None,
                    grads_in[gx_at + 1] if layer.gw_at_node else None))
                return
            tapped = (bool(x.requires_grad) and self._want["input_grad"] and not via_node
                      and not full_backward_hooked(m))
            self._on_forward(layer, x, out, tapped)
            call = layer.calls[-1]
            if not backward:
                return
            edge = (weight_edge(out, m.weight, x) if layer.gw_step and layer.gw_at_node
                    else None)
            if edge is not None:  # GW at the node that passes it on, GY kept for it
                out.register_hook(  # type: ignore[no-untyped-call]
                    lambda gy: self._on_gy(layer, call, gy, keep=True))
                edge[0].register_hook(lambda grads_in, grads_out: self._on_weight_edge(
                    layer, call, grads_in[edge[1]]))
            else:
                out.register_hook(  # type: ignore[no-untyped-call]
                    lambda gy: self._on_gy(layer, call, gy))

        # Hidden from torch.compile (``eager``): traced, the hooks' reads of ``self._active``
        # would give the train step and the replay (checks idle) different graphs, whose
        # kernels need not agree bit for bit; run eagerly, they split both the same way.
        # The forward hook runs first (prepend): it sees the product's own output, before a
        # forward hook of the user's replaces it or changes it in place.
        # The user's global forward hooks run before any of the module's: then the check's
        # global one (``graph.FrontHook``), kept before them, reads the call and this one
        # leaves it.
        def own(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if layer.posted:
                layer.posted = False
                return
            post(mod, args, out)

        def front(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            layer.posted = True
            post(mod, args, out)

        layer.handles.append(m.register_forward_pre_hook(eager(pre)))
        layer.handles.append(m.register_forward_hook(eager(own), prepend=True))
        self._front.posts[m] = eager(front)
        if layer.gw_checked and m.weight.requires_grad and not self.bucket_weight_grad:
            handle = m.weight.register_hook(  # type: ignore[no-untyped-call]
                lambda gw: self._on_gw(layer, gw))
            layer.weight_hook = handle.id
            layer.handles.append(handle)

    def _gathered(self, layer: Layer) -> None:
        """FSDP2: the weight and bias this call multiplies by, which FSDP2 gathered into the
        module for this forward (its pre-hook runs before the check's), and what the C passes
        can read of them. The forward's sums of the weight serve its backward (FSDP2 may
        gather it again for that: the same values)."""
        w, b = layer.module.weight, layer.module.bias
        layer.w, layer.b = w, b
        layer.w_at = (self._generation, *versions(w, b))
        layer.native = self._kernel is not None and rows_ok(w) and (
            b is None or (b.dtype is F32_DTYPE and b.is_contiguous()))
        layer.gw_at_node = layer.gw_step and gradient_hooked(w, layer.weight_hook)

    def _fresh(self, layer: Layer) -> None:
        """A forward of a new micro-batch: the previous one's calls are done with."""
        if layer.calls and layer.calls[-1].micro_batch != self._micro:
            layer.calls.clear()

    # -- the forward ------------------------------------------------------------------------
    def _on_forward(self, layer: Layer, x: torch.Tensor, y: torch.Tensor,
                    tapped: bool) -> None:
        """The forward hook's sums of ``X`` and ``Y`` (and of ``W``, once per step), and the
        forward identity checked right away, while ``X`` and ``Y`` are in cache."""
        kernel = self._kernel
        if (layer.native and kernel is not None and x.dtype is F32_DTYPE
                and y.dtype is F32_DTYPE):
            call = self._forward_native(kernel, layer, x, y, tapped)
        else:
            call = self._forward_torch(layer, x, y, tapped)
        layer.calls.append(call)

    # -- the backward -----------------------------------------------------------------------
    def _on_node(self, layer: Layer, call: Call, call_index: int, gy: torch.Tensor | None,
                 gx: torch.Tensor | None, gwt: torch.Tensor | None = None) -> None:
        """The product node's post-hook: its output's gradient ``GY`` and, when checked, this
        call's input gradient ``GX`` (both 2-D: the node multiplies the flattened input);
        ``gwt``, the gradient of ``W^T`` it passes on (``in x out``: its column sums are
        ``GW e``), when the weight's gradient is hooked (``Layer.gw_at_node``)."""
        if gy is None:
            return
        if self._forward_phase and self._active:
            self._inner_backward(layer)
        kernel = self._kernel
        if (self._active and call.native and kernel is not None
                and gy.dtype is F32_DTYPE and (gx is None or gx.dtype is F32_DTYPE)):
            # (on the CPU: the call's input and weight were, and the node's gradients are)
            self._gy_native(kernel, layer, call, *flat_rows(gy),
                            *((None, 0) if gx is None else flat_rows(gx)))
        else:
            self._on_gy(layer, call, gy)
            if gx is not None:
                self._on_gx(layer, call_index, gx)
        if gwt is not None and self._active and layer.gw_step and layer.gw_at_node:
            self._gw_node(layer, call, gy, gwt.detach().sum(0, dtype=torch.float32))

    def _on_weight_edge(self, layer: Layer, call: Call, gw: torch.Tensor | None) -> None:
        """The post-hook of the node that passes a hooked weight its gradient, for a call
        seen without the product's node (``graph.weight_edge``): ``gw`` is this call's
        ``GW``."""
        gy, call.gy = call.gy, None
        if gw is not None and gy is not None and self._active and layer.gw_step:
            self._gw_node(layer, call, gy, gw.detach().sum(1, dtype=torch.float32))

    def _on_tap(self, layer: Layer, call_index: int, gx: torch.Tensor) -> None:
        """The tap's hook: the input gradient of a call not seen through its node."""
        if call_index < len(layer.calls) and not layer.calls[call_index].via_node:
            self._on_gx(layer, call_index, gx)

    def _on_gy(self, layer: Layer, call: Call, gy: torch.Tensor, keep: bool = False) -> None:
        """The output's gradient ``GY`` of a call seen without its product's node; ``keep``:
        kept for the weight-gradient identity at the weight's node (``_on_weight_edge``)."""
        if not self._active:
            return
        if keep:
            call.gy = gy
        if self._forward_phase:
            self._inner_backward(layer)
        if call.native and self._kernel is not None and gy.dtype == torch.float32:
            self._gy_native(self._kernel, layer, call, *flat_rows(gy))  # (no detach: pointers)
            return
        g = gy.detach().reshape(-1, gy.shape[-1])
        with full_precision(g):
            self._gy_sides(layer, call, g)

    def _on_gx(self, layer: Layer, call_index: int, gx: torch.Tensor) -> None:
        if not self._active or call_index >= len(layer.calls):
            return
        call = layer.calls[call_index]
        g = gx if gx.dim() == 2 else gx.reshape(-1, gx.shape[-1])
        if call.gx_ready:  # the C passes left GY (W e) and its bound in the call's workspace
            if self._kernel is not None and g.dtype == torch.float32:
                self._gx_native(self._kernel, layer, call, g)
                return
            n, inner = g.shape
            out = layer.module.out_features
            at = GXS * n
            tol = tolerance(self.config.tolerance_scale, k=out, checked=2 * inner + out,
                            compute=call.gy_dtype or gx.dtype,
                            operands=(self._weight(layer)[0].dtype,), device=gx.device)
            call.gx_rhs, call.gx_bound = call.sums[at:at + n], call.sums[at + n:at + 2 * n] * tol
        if call.gx_rhs is None or call.gx_bound is None:
            return
        lhs = g.detach().sum(1, dtype=torch.float32)  # against sides with the tolerance applied
        self._record(layer, "input_grad", call.micro_batch, lhs, call.gx_rhs, call.gx_bound)

    def _on_gw(self, layer: Layer, gw: torch.Tensor) -> None:
        """The weight's hook (without the comm hook's row sums): ``GW`` summed by rows and
        compared with the right-hand sides its calls' output gradients gave."""
        if not self._active:
            return
        if layer.gw_rhs is not None and layer.gw_bound is not None:
            n = layer.gw_rows
            g = gw.detach()
            if (self._kernel is not None and layer.calls and layer.calls[0].native
                    and rows_ok(g) and layer.gw_dtype == torch.float32):
                self._gw_native(self._kernel, layer, g)
                layer.gw_rhs = layer.gw_bound = None
                layer.gw_rows = 0
                return
            lhs = g.sum(1, dtype=torch.float32)
            x_dtype = layer.calls[0].x.dtype if layer.calls else gw.dtype
            tol = tolerance(self.config.tolerance_scale, k=n, checked=2 * gw.shape[1] + n,
                            compute=layer.gw_dtype or gw.dtype, operands=(x_dtype,),
                            device=gw.device)
            micro = layer.calls[0].micro_batch if layer.calls else self._micro
            self._record(layer, "weight_grad", micro, lhs, layer.gw_rhs, layer.gw_bound * tol)
        layer.gw_rhs = layer.gw_bound = None
        layer.gw_rows = 0

    def _inner_backward(self, layer: Layer) -> None:
        """A layer's backward ran before ``loss_fn`` returned: a gradient taken inside the loss
        (an input gradient, as a gradient penalty or a physics-informed loss takes, with
        ``create_graph=True``). The layers' weight gradients then hold terms of that
        gradient's own graph, which no identity of the layer's product covers, and the
        products' backward runs more than once: the weight-gradient identity is not checked
        from now on (the forward and input-gradient ones still are), and said so once."""
        if self.inner_backward:
            return
        self.inner_backward = True
        for each in self.layers:
            each.gw_checked = each.gw_step = False
            each.gw_rhs = each.gw_bound = None
            each.gw_rows = 0
        log.warning("checksum: layer %r ran a backward inside loss_fn (a gradient taken in the "
                    "loss, as a gradient penalty or a physics-informed loss takes): the weight "
                    "gradients then hold terms no product identity covers, so the weight-"
                    "gradient identity is no longer checked; the forward and input-gradient "
                    "products still are", layer.name)
