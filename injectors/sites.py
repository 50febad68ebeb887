"""The seven fault sites: how an armed fault reaches its tensor, and the record it leaves.

``Injector`` turns a fault and a tensor into a corruption and a ground-truth
record; one ``install_*`` function per site wires an injector into the model,
the comm hook or the step hooks of an ``InjectionContext`` and returns the
undo actions that remove exactly what it added.

=========================  =====================================================
site                       how
=========================  =====================================================
activation                 forward hook on the module: the output is cloned, the
                           clone corrupted and returned (the producer may have
                           saved its output for backward, so it is never
                           modified in place). Gradients flow through the clone
                           as through the identity.
activation_grad            the same forward hook registers a tensor hook on the
                           output; it returns a corrupted clone of the incoming
                           gradient.
gradient_before_allreduce  ``comm.before`` callback: the parameter's view in the
                           bucket (``bucket.gradients()[j]``, a view into
                           ``bucket.buffer()``), before the non-finite check and
                           the all-reduce. FSDP2: its local, unsharded gradient
                           in the reduce-scatter's buffer (``gradient_of``).
gradient_after_allreduce   ``comm.after`` callback: the parameter's slice of the
                           reduced tensor (same offset as in the bucket buffer).
                           FSDP2: its slice of this rank's reduced shard (after
                           HSDP's replicate all-reduce).
optimizer_state            start-of-step hook: ``optimizer.state[param][key]``
                           (FSDP2: this rank's shard of it).
weight_storage             start-of-step hook: the parameter itself (FSDP2: this
                           rank's shard).
linear_product             the ``nn.Linear``'s ``forward`` is wrapped (an instance
                           attribute, removed on undo); on a firing call it runs
                           ``F.linear`` as an autograd function of its own that
                           corrupts the matmul's output before the bias (forward),
                           or the input or weight gradient its backward computes,
                           before any hook sees them: a fault inside the product.
=========================  =====================================================

Every firing writes one record (see ``Injector.corrupt``) to the context's
sink and to the handle's ``records``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from injectors import bits as B
from injectors.context import InjectionContext, Record
from injectors.fault import Fault, FaultError

if TYPE_CHECKING:  # the class behind torch.distributed.GradBucket (annotations only)
    from torch._C._distributed_c10d import GradBucket

__all__ = ["INSTALLERS", "Injector", "Undo"]

Undo = Callable[[], None]


class Injector:
    """One armed fault on its rank: decides when it fires and corrupts the tensor it is given."""

    def __init__(
        self, fault: Fault, ctx: InjectionContext, records: list[Record], target: Any
    ) -> None:
        self.fault = fault
        self.ctx = ctx
        self.records = records
        self.target = target
        """The resolved target: an ``nn.Module`` (activation sites) or an ``nn.Parameter``."""

    def fires(self, step: int) -> bool:
        return step >= 0 and self.fault.active_at(step)

    def fires_in_forward(self, mod: torch.nn.Module) -> int | None:
        """Activation sites: the step if the fault fires in this forward call, else None."""
        if mod is not self.target:  # a deepcopy of the model carries the hook along
            return None
        if self.fault.phase not in ("any", self.ctx.phase):
            return None
        step = self.ctx.step
        return step if self.fires(step) else None

    def corrupt(self, t: torch.Tensor, step: int, phase: str | None = None) -> Record:
        """Corrupt ``t`` in place as the fault says; record and return what changed.

        The record: ``event="injection"``, ``rank``, ``step``, ``site``, ``target``
        (and ``state_key``), ``kind``, ``model``, ``dtype`` (e.g. ``"float32"``),
        ``index`` (first element, logical row-major), ``burst``, ``bits`` (the bit
        indices flipped, or held by a stuck fault: the first element's; ``[]`` for value
        faults), ``before`` / ``after`` (one unsigned raw word per element, as ints), for
        activation sites ``phase``; and where the fault says so ``stride`` (a column),
        ``bits_each`` (each element's bits) and ``stuck``.
        """
        f = self.fault
        f.check_dtype(t.dtype)
        n = t.numel()
        stride, span = f.stride(t.shape), f.span(t.shape)
        if span > n:
            raise FaultError("burst", f"{f.burst} elements ({f.along}) do not fit the {f.site} "
                             f"tensor of {f.target!r} ({n} element(s), shape {tuple(t.shape)}).")
        rng = f.where_rng()
        index = rng.randrange(n - span + 1) if f.index is None else f.index
        if index + span > n:
            raise FaultError("index", f"element {index} (burst {f.burst}, {f.along}) is out of "
                             f"range for the {f.site} tensor of {f.target!r}: shape "
                             f"{tuple(t.shape)}, {n} element(s); use index <= {n - span}.")
        flipped: tuple[int, ...] = ()
        each: list[tuple[int, ...]] | None = None
        if f.kind in ("bitflip", "stuck"):
            flipped = f.bits
            if f.field is not None:
                flipped = B.choose_bits(t.dtype, f.field, f.count, rng)
            if f.burst_bits == "each":  # (the first element's draw is the one "same" makes)
                each = [flipped] + [B.choose_bits(t.dtype, f.field or "any", f.count, rng)
                                    for _ in range(f.burst - 1)]
            if f.kind == "stuck":
                assert f.stuck is not None
                change = (B.stick_bits(t, index, flipped, f.stuck, burst=f.burst, stride=stride)
                          if each is None else self._stick_each(t, index, each, f.stuck, stride))
            elif each is not None:
                change = B.flip_each(t, index, each, stride=stride)
            else:
                change = B.flip_bits(t, index, flipped, burst=f.burst, stride=stride)
        elif f.kind == "set":
            # Exactly one of value / value_bits is set (checked on construction).
            word = f.value_bits
            if word is None:
                word = B.bits_of(f.value if f.value is not None else 0.0, t.dtype)
            change = B.set_bits(t, index, word, burst=f.burst, stride=stride)
        elif f.kind == "random":
            change = B.random_bits(t, index, f.value_rng(step), burst=f.burst, stride=stride)
        else:
            change = B.zero(t, index, burst=f.burst, stride=stride)
        record: Record = {
            "event": "injection",
            "rank": self.ctx.rank,
            "step": step,
            "site": f.site,
            "target": f.target,
            "kind": f.kind,
            "model": f.model,
            "dtype": B.dtype_name(t.dtype),
            "index": index,
            "burst": f.burst,
            "bits": list(flipped),
            "before": list(change.before),
            "after": list(change.after),
        }
        if stride != 1:
            record["stride"] = stride
        if each is not None:
            record["bits_each"] = [list(b) for b in each]
        if f.stuck is not None:
            record["stuck"] = f.stuck
        if f.state_key is not None:
            record["state_key"] = f.state_key
        if f.product is not None:
            record["product"] = f.product
        if f.site in ("activation", "activation_grad", "linear_product"):
            record["phase"] = phase if phase is not None else self.ctx.phase
        self.records.append(record)
        self.ctx.record(record)
        return record


    @staticmethod
    def _stick_each(t: torch.Tensor, index: int, each: list[tuple[int, ...]], value: int,
                    stride: int) -> B.BitChange:
        """``stick_bits`` with each element's own bits: one element at a time (a burst of
        at most a few dozen), one change for the whole burst."""
        changes = [B.stick_bits(t, index + j * stride, bits, value)
                   for j, bits in enumerate(each)]
        return B.BitChange(dtype=t.dtype, index=index,
                           before=tuple(c.before[0] for c in changes),
                           after=tuple(c.after[0] for c in changes), stride=stride)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard (FSDP2), else ``t``; detached."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach()


def _remove_item(items: list[Any], item: Any) -> Undo:
    def undo() -> None:
        for i, x in enumerate(items):
            if x is item:
                del items[i]
                return

    return undo


def _module_output(inj: Injector, output: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise FaultError(
            "target", f"site {inj.fault.site!r} corrupts a module's Tensor output, but module "
            f"{inj.fault.target!r} returned a {type(output).__name__}; target a submodule that "
            "returns a single Tensor."
        )
    return output


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, hidden from torch.compile. Traced, a hook that reads the step would be
    recompiled at every step, and past dynamo's cache limit its module would fall back to
    eager kernels on this rank alone, whose results the replay audit would tell apart from
    its neighbours' compiled ones."""
    return torch.compiler.disable(hook)  # type: ignore[no-untyped-call,no-any-return]


def install_activation(inj: Injector) -> list[Undo]:
    module: torch.nn.Module = inj.target

    def hook(mod: torch.nn.Module, args: Any, output: Any) -> Any:
        step = inj.fires_in_forward(mod)
        if step is None or _module_output(inj, output).numel() == 0:
            return None  # an empty output (an expert no token was routed to): nothing to hit
        out = _module_output(inj, output).clone()
        inj.corrupt(out, step)
        return out

    return [module.register_forward_hook(_eager(hook)).remove]


def install_activation_grad(inj: Injector) -> list[Undo]:
    module: torch.nn.Module = inj.target
    pending: list[torch.utils.hooks.RemovableHandle] = []

    def hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
        step = inj.fires_in_forward(mod)
        if step is None:
            return
        out = _module_output(inj, output)
        if not out.requires_grad or out.numel() == 0:  # no backward through it, or empty
            return
        phase = inj.ctx.phase

        def on_grad(grad: torch.Tensor) -> torch.Tensor:
            g = grad.clone()
            inj.corrupt(g, step, phase)
            return g

        pending[:] = [h for h in pending if h.hooks_dict_ref() is not None]
        pending.append(out.register_hook(on_grad))  # type: ignore[no-untyped-call]

    def remove_pending() -> None:
        for h in pending:
            h.remove()
        pending.clear()

    return [module.register_forward_hook(_eager(hook)).remove, remove_pending]


def _bucket_slot(bucket: GradBucket, param: torch.Tensor) -> int | None:
    for j, p in enumerate(bucket.parameters()):
        if p is param:
            return j
    return None


def _need_comm(inj: Injector) -> Any:
    if inj.ctx.comm is None:  # checked when arming; kept for a clear message
        raise FaultError("site", f"{inj.fault.site!r} needs a GuardCommHook in the context.")
    return inj.ctx.comm


def install_gradient_before_allreduce(inj: Injector) -> list[Undo]:
    param: torch.Tensor = inj.target
    comm = _need_comm(inj)

    def before(bucket: GradBucket) -> None:
        step = inj.ctx.step
        if not inj.fires(step):
            return
        if hasattr(bucket, "gradient_of"):  # FSDP2: the local gradient, split across rows
            view = bucket.gradient_of(param)
            if view is not None:
                inj.corrupt(view, step)
            return
        j = _bucket_slot(bucket, param)
        if j is not None:
            inj.corrupt(bucket.gradients()[j], step)  # a view into bucket.buffer()

    comm.before.append(before)
    return [_remove_item(comm.before, before)]


def install_gradient_after_allreduce(inj: Injector) -> list[Undo]:
    param: torch.Tensor = inj.target
    comm = _need_comm(inj)

    def after(bucket: GradBucket, reduced: torch.Tensor) -> None:
        step = inj.ctx.step
        if not inj.fires(step):
            return
        if hasattr(bucket, "reduced_of"):  # FSDP2: this rank's shard of the reduced gradient
            shard = bucket.reduced_of(param, reduced)
            if shard is not None:
                inj.corrupt(shard, step)
            return
        j = _bucket_slot(bucket, param)
        if j is None:
            return
        buf = bucket.buffer()
        grad = bucket.gradients()[j]
        offset = (grad.data_ptr() - buf.data_ptr()) // buf.element_size()
        if not reduced.is_contiguous() or reduced.numel() != buf.numel():
            raise FaultError(
                "site", f"gradient_after_allreduce: the comm hook's result (shape "
                f"{tuple(reduced.shape)}) does not have the bucket buffer's layout "
                f"({buf.numel()} contiguous elements)."
            )
        view = reduced.view(-1)[offset : offset + grad.numel()].view(grad.shape)
        inj.corrupt(view, step)

    comm.after.append(after)
    return [_remove_item(comm.after, after)]


def install_optimizer_state(inj: Injector) -> list[Undo]:
    param: torch.Tensor = inj.target
    key = inj.fault.state_key
    optimizer = inj.ctx.optimizer_of(param)
    if optimizer is None:  # checked when arming
        raise FaultError("site", "optimizer_state needs an optimizer in the context.")

    def on_step(step: int) -> None:
        if not inj.fires(step):
            return
        state = optimizer.state.get(param, {})
        value = state.get(key)
        if not isinstance(value, torch.Tensor):
            have = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
            raise FaultError(
                "state_key", f"at step {step} the optimizer state of {inj.fault.target!r} has "
                f"no tensor {key!r} (tensor entries: {have}). Optimizers create their state "
                "at the first optimizer.step(), so inject at a later step, and check the key "
                "(Adam: exp_avg, exp_avg_sq; SGD with momentum: momentum_buffer)."
            )
        inj.corrupt(local(value), step)

    inj.ctx.step_hooks.append(on_step)
    return [_remove_item(inj.ctx.step_hooks, on_step)]


def install_weight_storage(inj: Injector) -> list[Undo]:
    param: torch.Tensor = inj.target

    def on_step(step: int) -> None:
        if inj.fires(step):
            inj.corrupt(local(param), step)

    inj.ctx.step_hooks.append(on_step)
    return [_remove_item(inj.ctx.step_hooks, on_step)]


class _FaultyLinear(torch.autograd.Function):
    """``F.linear`` with one product corrupted: the forward matmul before the bias, or the
    input or weight gradient of the backward (as autocast would, operands are cast to the
    incoming gradient's dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                inj: Injector, step: int, phase: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.inj, ctx.step, ctx.phase, ctx.has_bias = inj, step, phase, bias is not None
        y = torch.nn.functional.linear(x, weight)
        if inj.fault.product == "forward":
            inj.corrupt(y, step, phase)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        inj: Injector = ctx.inj
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (gy @ weight.to(gy.dtype)).to(x.dtype)
            if inj.fault.product == "input_grad":
                inj.corrupt(gx, ctx.step, ctx.phase)
        if ctx.needs_input_grad[1]:
            g2 = gy.reshape(-1, gy.shape[-1])
            gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(gy.dtype)).to(weight.dtype)
            if inj.fault.product == "weight_grad":
                inj.corrupt(gw, ctx.step, ctx.phase)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gx, gw, gb, None, None, None


def _linear(fault: Fault, module: torch.nn.Module) -> torch.nn.Linear:
    if not isinstance(module, torch.nn.Linear):
        raise FaultError("target", f"site 'linear_product' needs an nn.Linear module; "
                         f"{fault.target!r} is a {type(module).__name__}.")
    return module


def install_linear_product(inj: Injector) -> list[Undo]:
    module = _linear(inj.fault, inj.target)
    original = module.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        step = inj.fires_in_forward(module)
        if step is None or args or kwargs or x.numel() == 0:
            return original(x, *args, **kwargs)
        bias = module.bias
        return _FaultyLinear.apply(  # type: ignore[no-untyped-call]
            x, module.weight, bias, inj, step, inj.ctx.phase)

    return _replace_forward(module, _eager(forward))


def _replace_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> list[Undo]:
    had = "forward" in module.__dict__
    original = module.forward
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = original
        else:
            del module.forward

    return [undo]


def _nothing(*args: Any) -> None:
    return None


def install_inert(fault: Fault, module: torch.nn.Module) -> list[Undo]:
    """On the other ranks, for a site that hooks a module: a hook that does nothing, hidden
    from torch.compile as the armed rank's is, so that a compiled model breaks its graph at
    the same place on every rank (the armed rank's kernels stay those of its neighbours, and
    the replay audit sees only the fault). Eager models: a no-op."""
    if fault.site == "linear_product":
        original = _linear(fault, module).forward
        return _replace_forward(module, _eager(lambda *a, **k: original(*a, **k)))
    return [module.register_forward_hook(_eager(_nothing)).remove]


INERT_SITES = ("activation", "activation_grad", "linear_product")
"""Sites whose hooks sit in the model: installed, inert, on the ranks a fault does not touch."""

INSTALLERS: dict[str, Callable[[Injector], list[Undo]]] = {
    "activation": install_activation,
    "activation_grad": install_activation_grad,
    "gradient_before_allreduce": install_gradient_before_allreduce,
    "gradient_after_allreduce": install_gradient_after_allreduce,
    "optimizer_state": install_optimizer_state,
    "weight_storage": install_weight_storage,
    "linear_product": install_linear_product,
}
"""site -> installer; every name in ``injectors.fault.SITES`` has one."""
