"""The one protocol every check follows, and what a pre-step verdict returns.

``SDCGuard.step`` only sequences its checks (``sdc_guard.guard``)::

    c.check_start(step)                  # once, at the first step, if c.checks_start
    due = [c for c in checks if c.due(step)]
    c.begin_step(step)                   # before the forward (the replay replays here)
    c.on_loss(loss)                      # each micro-batch's loss, before its backward
    pre = due + [c for c in checks if c.awaiting(step)]   # something of an earlier step to read
    c.ask(step, read)                    # after the backward: what pre_step needs from the device
    verdict = c.pre_step(step)           # detections, withhold? (the values: one read in all)
    ... optimizer.step() unless a verdict withholds it ...
    c.post_step(step)                    # after it: detections
    c.flush()                            # after the last step: detections still due
    c.close()                            # replaced by a reconfigure: unhook

A check declares what it needs as attributes of this protocol (``compares_replicas``,
``checks_start``), never by a name the guard looks for. A check that needs the
gradients subscribes to the backend when it is built and unsubscribes in ``close``
(``sdc_guard.parallel.base.GradientListener``: gradient events, and the step's
containment answer as the ``vetoed`` event); it never calls back into the backend or
the guard, and the guard shares no mutable state with it. Two checks that share work
share an object both subscribe to (``sdc_guard.checks.weightpass.WeightPass``), built
by ``build_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sdc_guard.hostread import StepRead
from sdc_guard.report import Detection


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a check says before the optimizer step."""

    detections: list[Detection] = field(default_factory=list)
    """Detections reached now; each carries its own step (it may be an earlier one)."""
    withhold: bool = False
    """This rank must not apply this step's gradients (containment)."""
    alone: bool = False
    """The withhold may hold on this rank alone (a fault in its own copy of a reduced
    result): other ranks may apply the step, so nothing collective may follow from it."""


class Check:
    """Base class of the guard's checks: every method has a harmless default."""

    name: str = ""
    """The ``Detection.check`` value this check reports."""

    phase: str = "train"
    """What the model is computing for this check right now: "train", or e.g. "replay"
    while the replay audit recomputes a neighbour's batch (fault injectors read it)."""

    compares_replicas: bool = False
    """Does this check compare the replicas' state or computation? A forward that writes
    its parameters in place makes them differ without a fault, so the guard refuses one
    (once, at the first step) when any enabled check does."""

    withholds: bool = False
    """Can this check's verdict withhold a step? Its detections are then faults in a step's
    computation, which a withheld step keeps from the weights: the guard marks such a
    detection ``contained`` when its step was withheld on every rank (the evidence's
    ``"withheld_ranks"``, where a check's withholding can differ between ranks, lists the
    ranks that withheld)."""

    checks_start: bool = False
    """Does this check ask, at the first step, whether the replicas start alike
    (``check_start``)?"""

    clean_through: int = -1
    """The newest step through which this check has verified the run clean (-1: none yet).
    It stops at the check's first detection and moves again only after ``rewind`` (a
    restore from a checkpoint): a suspect window starts after the newest step every check
    has verified (``SDCGuard.clean_through``, ``sdc_guard.checkpoint``)."""

    _tainted: bool = False

    def verified(self, step: int) -> None:
        """Record that this check found ``step`` clean."""
        if not self._tainted and step > self.clean_through:
            self.clean_through = step

    def tainted(self) -> None:
        """Record a detection: ``clean_through`` stays where it is until ``rewind``."""
        self._tainted = True

    def rewind(self, step: int) -> None:
        """The run was restored to the state after ``step`` (a checkpoint verified clean)."""
        self.clean_through = step
        self._tainted = False

    def check_start(self, step: int) -> None:
        """Once per guard, at the first step with a check that ``checks_start``, before
        anything of the step runs: raise ``ValueError`` if the run cannot be checked from
        here (collective: every rank raises alike)."""

    def due(self, step: int) -> bool:
        """Does this check look at ``step``? The guard calls the methods below only then."""
        return True

    def begin_step(self, step: int) -> None:
        """Before the step's forward pass, on the pre-step weights."""

    def on_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's (detached) loss, before its backward pass."""

    def awaiting(self, step: int) -> bool:
        """Is something of an earlier step still to be read in this step's ``pre_step`` (a vote
        in flight)? The guard then calls ``ask`` and ``pre_step`` even where ``due`` says no."""
        return False

    def ask(self, step: int, read: StepRead) -> None:
        """After the backward pass, before any check's ``pre_step``: put on ``read`` every tensor
        ``pre_step`` will need on the host (``StepRead.ask``), so that the step reads from the
        device once for every check (``sdc_guard.hostread``)."""

    def pre_step(self, step: int) -> Verdict:
        """After the backward pass, before ``optimizer.step()``."""
        return Verdict()

    def records(self) -> list[dict[str, Any]]:
        """Event records of this check's own that are not detections (the tolerant replay's
        calibration), taken by the guard after ``pre_step`` and written to the event log."""
        return []

    def saved(self) -> dict[str, Any]:
        """What this check keeps in a checkpoint (a calibration), JSON-like; {} for nothing."""
        return {}

    def load_saved(self, state: dict[str, Any]) -> None:
        """Take back what ``saved`` gave, from a restored checkpoint."""

    def post_step(self, step: int) -> list[Detection]:
        """After ``optimizer.step()`` (or after it was withheld)."""
        return []

    def flush(self) -> list[Detection]:
        """After the last step, on every rank: detections still due (may be collective)."""
        return []

    def close(self) -> None:
        """The check is replaced (``SDCGuard.reconfigure``): remove what it hooked into."""
