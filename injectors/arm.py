"""Arming: check a fault against the model, wire it into its site, hand back a handle.

``arm(fault, guard=guard)`` (under ``SDCGuard.step``) or
``arm(fault, context=InjectionContext.plain(...))`` (a user's loop):

1. validates the fault against the context on *every* rank: the rank exists,
   the module / parameter name exists (the error lists close matches), the
   element index and burst fit, the bits fit the tensor's dtype, the site's
   prerequisites (comm hook, optimizer, a gradient) are there;
2. on the fault's rank only, installs the site's hooks / callbacks;
3. returns an ``InjectionHandle``: ``handle.records`` holds the ground truth
   of every firing, ``handle.remove()`` (or leaving the ``with`` block)
   removes everything that was added. On other ranks the handle is inert
   (``handle.armed`` is False) but the fault was validated all the same.
"""

from __future__ import annotations

import difflib
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from injectors.context import InjectionContext, Record
from injectors.fault import GRADIENT_SITES, MODULE_SITES, Fault, FaultError
from injectors.sites import INERT_SITES, INSTALLERS, Injector, Undo, install_inert

if TYPE_CHECKING:
    from sdc_guard.guard import SDCGuard

__all__ = ["InjectionHandle", "arm", "resolve_target"]


class InjectionHandle:
    """What ``arm`` returns: the records of one armed fault, and the way to disarm it."""

    def __init__(self, fault: Fault, context: InjectionContext, *, armed: bool) -> None:
        self.fault = fault
        self.context = context
        self.armed = armed
        """True on the fault's rank (hooks installed), False elsewhere (inert: at most a hook
        that does nothing, see ``injectors.sites.install_inert``)."""
        self.records: list[Record] = []
        """One record per firing (see ``injectors.sites.Injector.corrupt``)."""
        self._undo: list[Undo] = []

    @property
    def active(self) -> bool:
        """Installed and not yet removed."""
        return self.armed and bool(self._undo)

    def begin_step(self, step: int) -> None:
        """Plain loops: start ``step`` before its forward (``InjectionContext.begin_step``)."""
        self.context.begin_step(step)

    def remove(self) -> None:
        """Remove every hook and callback this handle added. Safe to call twice."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> InjectionHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else ("removed" if self.armed else "inert")
        f = self.fault
        return (f"InjectionHandle({f.site} on rank {f.rank}, target {f.target!r}, "
                f"{state}, {len(self.records)} record(s))")


def _lookup(names: dict[str, Any], fault: Fault, what: str) -> Any:
    name = fault.target
    if name not in names and name.startswith("module.") and name[7:] in names:
        name = name[7:]  # a DDP-qualified name
    if name in names:
        return names[name]
    close = difflib.get_close_matches(name, [n for n in names if n], n=5, cutoff=0.5)
    sample = [n for n in names if n][:8]
    hint = f"close matches: {close}" if close else f"the model's {what}s include {sample}"
    raise FaultError(
        "target", f"site {fault.site!r} needs a {what} name from named_{what}s() of the model "
        f"(inside DDP), and there is no {what} {fault.target!r}; {hint}."
    )


def _check_fits(fault: Fault, t: torch.Tensor, what: str) -> None:
    fault.check_dtype(t.dtype)
    n = t.numel()
    span = fault.span(t.shape)
    if span > n:
        raise FaultError("burst", f"{fault.burst} elements ({fault.along}) do not fit {what} "
                         f"({n} element(s), shape {tuple(t.shape)}).")
    if fault.index is not None and fault.index + span > n:
        raise FaultError(
            "index", f"element {fault.index} (burst {fault.burst}, {fault.along}) is out of "
            f"range for {what}: shape {tuple(t.shape)}, {n} element(s); use index <= "
            f"{n - span}."
        )


def resolve_target(fault: Fault, ctx: InjectionContext) -> Any:
    """Validate ``fault`` against the context; return its module or parameter."""
    if fault.rank >= ctx.world_size:
        raise FaultError("rank", f"rank {fault.rank} does not exist: the world has "
                         f"{ctx.world_size} rank(s), 0..{ctx.world_size - 1}.")
    if fault.site in MODULE_SITES:
        return _lookup(dict(ctx.model.named_modules()), fault, "module")
    param: torch.nn.Parameter = _lookup(dict(ctx.model.named_parameters()), fault, "parameter")
    what = f"parameter {fault.target!r}"
    if fault.site in GRADIENT_SITES:
        if ctx.comm is None:
            raise FaultError(
                "site", f"{fault.site!r} injects through sdc_guard's comm hook: arm under an "
                "SDCGuard, or register GuardCommHook() on the DDP model "
                "and pass it as InjectionContext.plain(..., comm=hook)."
            )
        if not param.requires_grad:
            raise FaultError("target", f"{what} has requires_grad=False: it has no gradient.")
    if fault.site != "optimizer_state":
        _check_fits(fault, param, what)
        return param
    if not ctx.optimizers:
        raise FaultError("site", "'optimizer_state' needs the optimizer: arm under an SDCGuard "
                         "or pass InjectionContext.plain(..., optimizer=opt).")
    opt = ctx.optimizer_of(param)
    if opt is None:
        raise FaultError("target", f"{what} is not in the optimizer's param_groups.")
    state = opt.state.get(param)
    if state:  # optimizers create state lazily; before their first step it is checked on firing
        value = state.get(fault.state_key)
        if not isinstance(value, torch.Tensor):
            have = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
            raise FaultError("state_key", f"the optimizer state of {what} has no tensor "
                             f"{fault.state_key!r}; its tensor entries are {have}.")
        _check_fits(fault, value, f"optimizer state {fault.state_key!r} of {what}")
    return param


def arm(
    fault: Fault,
    *,
    guard: SDCGuard | None = None,
    context: InjectionContext | None = None,
) -> InjectionHandle:
    """Validate ``fault`` and, on its rank, install it. Give exactly one of ``guard`` / ``context``.

    Collective-free: call it on every rank (each validates; only ``fault.rank`` installs;
    for a site in the model, the other ranks install a hook that does nothing, so that
    torch.compile splits the model alike on every rank).
    """
    if not isinstance(fault, Fault):
        raise TypeError(f"arm(fault): expected an injectors.Fault, got {type(fault).__name__}.")
    if (guard is None) == (context is None):
        raise TypeError("arm(fault, ...): pass exactly one of guard=SDCGuard or "
                        "context=InjectionContext.plain(...).")
    ctx = context
    if ctx is None:
        if guard is None:  # unreachable: exactly one was given
            raise TypeError("arm(fault, ...): pass guard= or context=.")
        ctx = InjectionContext.for_guard(guard)
    target = resolve_target(fault, ctx)
    handle = InjectionHandle(fault, ctx, armed=fault.rank == ctx.rank)
    if handle.armed:
        injector = Injector(fault, ctx, handle.records, target)
        handle._undo = INSTALLERS[fault.site](injector)
    elif fault.site in INERT_SITES:
        handle._undo = install_inert(fault, target)
    return handle
