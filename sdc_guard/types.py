"""The callables a user hands the guard, and the micro-batches of one step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss tensor``."""
BatchFor = Callable[[int, int], Any]
"""``batch_for(rank, step) -> that rank's batch for that step`` (deterministic)."""
StepHook = Callable[[int], None]
"""Called with the step number at the start of ``SDCGuard.step``."""


def micro_batches(batch: Any, count: int) -> Sequence[Any]:
    """The micro-batches of one step: ``batch`` itself, or the ``count`` items it holds."""
    if count == 1:
        return [batch]
    if not isinstance(batch, Sequence) or len(batch) != count:
        raise ValueError(
            f"GuardConfig.micro_batches={count}: batch_for(rank, step) must return a sequence "
            f"of {count} micro-batches, got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, Sequence) else "")
            + "."
        )
    shapes = [_structure(mb) for mb in batch]
    if len(set(shapes)) > 1:
        raise ValueError(
            f"GuardConfig.micro_batches={count}: batch_for(rank, step) returned {count} items "
            f"of different forms ({'; '.join(shapes)}), but the micro-batches of one step "
            "share one form: this is most likely one batch, such as (inputs, targets). "
            f"Return a list of {count} micro-batches, e.g. [(x0, y0), (x1, y1)], or set "
            "micro_batches=1.")
    return batch


def _structure(item: Any, depth: int = 0) -> str:
    """A micro-batch's form: its containers, and each tensor's dimensions and dtype (not its
    sizes: micro-batches of one step may differ in length)."""
    if isinstance(item, torch.Tensor):
        return f"{item.dim()}-d {str(item.dtype).removeprefix('torch.')} tensor"
    if depth < 4 and isinstance(item, Mapping):
        return "{" + ", ".join(f"{k!r}: {_structure(v, depth + 1)}"
                               for k, v in sorted(item.items(), key=lambda kv: repr(kv[0]))) + "}"
    if depth < 4 and isinstance(item, tuple):
        return "(" + ", ".join(_structure(v, depth + 1) for v in item) + ")"
    if depth < 4 and isinstance(item, list):  # any number of items (ragged): their forms
        return "[" + " | ".join(sorted({_structure(v, depth + 1) for v in item})) + "]"
    return type(item).__name__


def fetch_micro_batches(batch_for: BatchFor, rank: int, step: int, count: int) -> Sequence[Any]:
    """``micro_batches(batch_for(rank, step), count)``, refusing a batch of None."""
    batch = batch_for(rank, step)
    if batch is None:
        what = f"a sequence of {count} micro-batches" if count > 1 else "the batch"
        raise ValueError(f"batch_for({rank}, {step}) returned None; it must return {what} of "
                         f"rank {rank} for step {step}.")
    return micro_batches(batch, count)


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a one-element tensor (what ``loss_fn`` must return), else a clear error."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn(model, batch) must return the loss as a torch.Tensor, got "
                        f"{type(loss).__name__}.")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn(model, batch) must return a scalar loss, got a tensor of shape "
                         f"{list(loss.shape)}: reduce it (e.g. loss.mean()).")
    return loss


BYPASS = ("Call the model it is given, model(...), and nothing inside it: model.module(...) or "
          "a method of it (model.module.compute_loss(batch)) bypasses DDP's forward, and DDP "
          "then does not all-reduce the gradients (every replica trains on its own batch "
          "alone, and the replicas drift apart). Put the loss in the module's forward, or call "
          "model(batch) and compute the loss from its output.")
"""The fix for a ``loss_fn`` that reaches into ``model.module``."""


def recomputed_loss(loss_fn: LossFn, module: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``loss_fn(module, batch)`` in a recomputation (the replay audit's, the non-finite
    check's), which gives it the module inside DDP: a ``loss_fn`` that reaches for
    ``model.module`` fails there with an AttributeError about this module, told apart and
    named (``BYPASS``)."""
    try:
        return scalar_loss(loss_fn(module, batch))
    except AttributeError as e:
        if e.name == "module" and e.obj is module:
            raise ValueError(
                "loss_fn(model, batch) reached for model.module, which a recomputation of a "
                "neighbour's batch (the replay audit, the non-finite check) cannot give: it "
                f"passes the module inside DDP itself. {BYPASS}") from e
        raise
