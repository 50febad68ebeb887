"""``InjectionContext``: everything an armed fault needs to reach its site, in one object.

A fault is armed against a context, never against loose arguments. The
context holds the model (unwrapped from DDP), the optimizer, the comm hook
whose ``before`` / ``after`` callback lists the gradient sites join, this
process's rank and the world size, where injection records go (the event
sink), the current step (the step source) and phase (training, or a guard's
replay audit recomputing on the same module), and where start-of-step
callbacks go (the step hooks). Two constructors cover the two ways to train:

* ``InjectionContext.for_guard(guard)``: under ``SDCGuard.step``. The step is
  ``guard.backend.step`` (set by the guard before each forward), start-of-step
  sites join ``guard.before_step``, records go to ``guard.log_event``.
* ``InjectionContext.plain(model, ...)``: a user's own loop. The loop calls
  ``ctx.begin_step(step)`` (or ``handle.begin_step(step)``, the same thing)
  at the start of each step, before the forward; the gradient sites need a
  ``sdc_guard.parallel.ddp.GuardCommHook`` registered on the DDP model::

      comm = GuardCommHook()
      ddp.register_comm_hook(comm, GuardCommHook.hook)
      ctx = InjectionContext.plain(ddp, optimizer=opt, comm=comm, events=records)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.events import EventLog
from sdc_guard.optimizers import Optimizers, as_optimizers
from sdc_guard.parallel.ddp import GuardCommHook

if TYPE_CHECKING:
    from sdc_guard.guard import SDCGuard

__all__ = ["EventSink", "InjectionContext", "StepHook"]

Record = dict[str, Any]
EventSink = EventLog | list[Record] | Callable[[Record], None] | str | Path | None
"""Where records go: an ``EventLog``, a list (appended to), a callable, a path, or nowhere."""
StepHook = Callable[[int], None]


def _sink_fn(events: EventSink, rank: int) -> Callable[[Record], None]:
    if events is None:
        return lambda record: None
    if isinstance(events, (str, Path)):
        events = EventLog(events, rank=rank)
    if isinstance(events, EventLog):
        return events.write
    if isinstance(events, list):
        return events.append
    if callable(events):
        return events
    raise TypeError(
        f"events must be an EventLog, a list, a callable, a path or None; got "
        f"{type(events).__name__}."
    )


def _fsdp_backend(comm: Any) -> bool:
    """Is ``comm`` the FSDP2 backend of a guard (its module loaded only for FSDP2 users)?"""
    import sys

    fsdp = sys.modules.get("sdc_guard.parallel.fsdp")
    return fsdp is not None and isinstance(comm, fsdp.FSDPBackend)


class InjectionContext:
    """The model, optimizer, comm hook, rank, world size, event sink and step source."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        optimizer: Optimizers | None,
        comm: Any,
        rank: int,
        world_size: int,
        sink: Callable[[Record], None],
        step_source: Callable[[], int] | None,
        step_hooks: list[StepHook] | None,
        phase_source: Callable[[], str] | None = None,
    ) -> None:
        """Prefer ``for_guard`` or ``plain``. ``step_source=None`` / ``step_hooks=None``: the
        context keeps its own step and hook list, driven by ``begin_step``."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        optimizers = () if optimizer is None else as_optimizers(optimizer, "optimizer")
        if comm is not None and not isinstance(comm, GuardCommHook) and not _fsdp_backend(comm):
            raise TypeError(
                "comm must be the sdc_guard.parallel.ddp.GuardCommHook registered on the DDP model, "
                "a guard's FSDP2 backend (guard.backend), or None; got "
                f"{type(comm).__name__}."
            )
        for name, v in (("rank", rank), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}."
            )
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        self.optimizer = optimizer
        self.optimizers = optimizers
        """The optimizer, or each of several (``sdc_guard.optimizers``); () without one."""
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.sink = sink
        self.owns_steps = step_source is None
        """True for a plain loop: ``begin_step`` drives the step and the step hooks."""
        self._step = -1
        self._step_source: Callable[[], int] = step_source or (lambda: self._step)
        self.step_hooks: list[StepHook] = [] if step_hooks is None else step_hooks
        """Start-of-step callbacks (``guard.before_step`` under a guard)."""
        self._phase_source: Callable[[], str] = phase_source or (lambda: "train")

    def optimizer_of(self, param: torch.Tensor) -> torch.optim.Optimizer | None:
        """The optimizer (of several, the one) whose param groups hold ``param``."""
        return next((opt for opt in self.optimizers for g in opt.param_groups
                     if any(p is param for p in g["params"])), None)

    # -- constructors -----------------------------------------------------------------
    @classmethod
    def for_guard(cls, guard: SDCGuard) -> InjectionContext:
        """Inject under ``guard.step``: its comm hook, its ``before_step`` list, its event log."""
        comm = guard.backend
        return cls(
            guard.model,
            optimizer=guard.optimizer,
            comm=comm,
            rank=guard.rank,
            world_size=guard.world_size,
            sink=guard.log_event,
            step_source=lambda: comm.step,
            step_hooks=guard.before_step,
            # Guards with a replay audit say whether the model is training or replaying.
            phase_source=lambda: str(getattr(guard, "phase", "train")),
        )

    @classmethod
    def plain(
        cls,
        model: torch.nn.Module,
        *,
        optimizer: Optimizers | None = None,
        comm: GuardCommHook | None = None,
        events: EventSink = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> InjectionContext:
        """Inject in a user's own loop, which calls ``begin_step(step)`` before each forward.

        ``rank`` / ``world_size`` default to the initialised process group's, or 0 / 1
        without one (single-process use).
        """
        live = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if live else 0
        if world_size is None:
            world_size = dist.get_world_size() if live else 1
        return cls(
            model,
            optimizer=optimizer,
            comm=comm,
            rank=rank,
            world_size=world_size,
            sink=_sink_fn(events, rank),
            step_source=None,
            step_hooks=None,
        )

    # -- the step ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The current step (-1 before the first)."""
        return self._step_source()

    @property
    def phase(self) -> str:
        """What the model computes now: "train", or "replay" / "arbitrate" in a guard's audit."""
        return self._phase_source()

    def begin_step(self, step: int) -> None:
        """Plain loops: start ``step`` (before its forward). Runs the start-of-step sites.

        Calling it again with the same step does nothing, so several handles sharing one
        context can each be told.
        """
        if not self.owns_steps:
            raise RuntimeError(
                "this context follows an SDCGuard: guard.step(step) starts each step and runs "
                "the injectors; do not call begin_step yourself."
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"begin_step(step): step must be an int >= 0, got {step!r}.")
        if step == self._step:
            return
        self._step = step
        for hook in list(self.step_hooks):
            hook(step)

    def record(self, record: Record) -> None:
        """Send one record to the event sink."""
        self.sink(record)
