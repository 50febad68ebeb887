"""One optimizer or several, stepped as one: what ``SDCGuard`` and ``CheckpointManager`` take.

A model is often trained by more than one optimizer: ``torch.optim.Muon`` updates only
2-D weights, so the biases, norms and embeddings go to an AdamW beside it. Every place that
takes an optimizer takes a list (or tuple) of them instead: the guard zeroes and steps each
(through the ``GradScaler``, when there is one, each in turn and one ``update`` after), the
weights check fingerprints their state one optimizer after the other, in the order given,
and a checkpoint holds each one's ``state_dict`` in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
"""A ``torch.optim.Optimizer``, or a list or tuple of them holding disjoint parameters."""


def as_optimizers(optimizer: Any, where: str) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer`` as a tuple of optimizers, checked: each one an optimizer, at least one,
    no parameter in two of them (it would be updated twice a step). ``where`` names the
    argument in the errors."""
    opts = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else (
        tuple(optimizer) if isinstance(optimizer, (list, tuple)) else None)
    if opts is None or not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        got = (type(optimizer).__name__ if opts is None or not opts else
               ", ".join(type(o).__name__ for o in opts))
        raise TypeError(
            f"{where} must be a torch.optim.Optimizer or a non-empty list of them (one per "
            f"set of parameters: Muon for the matrices, AdamW for the rest), got {got}.")
    seen: dict[int, int] = {}
    for i, opt in enumerate(opts):
        for group in opt.param_groups:
            for p in group["params"]:
                j = seen.setdefault(id(p), i)
                if j != i:
                    raise ValueError(
                        f"{where}: optimizers {j} and {i} both hold a parameter of shape "
                        f"{tuple(p.shape)}; each parameter must belong to one optimizer (it "
                        "would be updated twice a step).")
    return opts


def each(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer`` as a tuple, its types checked but not its parameters (``as_optimizers``
    checked those where it came in): what runs every step (the weights check's fingerprint)
    skips the overlap check's walk over every parameter."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if isinstance(optimizer, (list, tuple)) and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return tuple(optimizer)
    return as_optimizers(optimizer, "optimizer")  # raises, naming what it got


def param_groups(optimizer: Optimizers) -> list[dict[str, Any]]:
    """Every param group of every optimizer, in order."""
    return [g for opt in each(optimizer) for g in opt.param_groups]


def state_dict(optimizer: Optimizers) -> Any:
    """The ``state_dict`` of one optimizer; of several, the list of theirs."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    return [opt.state_dict() for opt in each(optimizer)]


def load_state_dict(optimizer: Optimizers, saved: Any, where: str) -> None:
    """Load what ``state_dict`` returned: one optimizer's, or each of several in order. A
    checkpoint of another number of optimizers, or one whose param groups hold other
    numbers of parameters than the optimizers given, is refused before any optimizer loads
    (one loaded and the next refused would leave the first holding another run's state)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(saved, list):
            raise ValueError(
                f"{where}: the checkpoint holds the state of {len(saved)} optimizers; pass "
                f"the same {len(saved)}, as a list in the order they were saved.")
        pairs = [(optimizer, saved)]
    else:
        opts = as_optimizers(optimizer, where)
        if not isinstance(saved, list) or len(saved) != len(opts):
            count = len(saved) if isinstance(saved, list) else 1
            raise ValueError(
                f"{where}: the checkpoint holds the state of {count} optimizer(s), and "
                f"{len(opts)} were given; pass the ones it was saved with, in the same order.")
        pairs = list(zip(opts, saved, strict=True))
    for i, (opt, sd) in enumerate(pairs):
        given = [len(g["params"]) for g in opt.param_groups]
        held = [len(g["params"]) for g in sd.get("param_groups", [])]
        if given != held:
            which = f"optimizer {i} ({type(opt).__name__})" if len(pairs) > 1 else (
                type(opt).__name__)
            raise ValueError(
                f"{where}: the checkpoint's {which} has param groups of {held} parameters, "
                f"the one given {given}: pass the optimizer it was saved with (the same "
                "parameters in the same groups, in the same order).")
    for opt, sd in pairs:
        opt.load_state_dict(sd)
