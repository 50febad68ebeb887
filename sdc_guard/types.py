"""The callables a user hands the guard, and the micro-batches of one step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    return batch


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
