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
