"""One read of the weights after the optimizer step, shared by the checks that want it.

The weights check fingerprints the replicated state after each step it is due at; the
checksum check needs each linear weight's sums before the next step's first product.
Both read the same weights, so they share one pass: the weights check runs it
(``fingerprint``), and any check that wants sums taken in the same read subscribes an
*asker* (``subscribe``): a function of the step that returns the ``WeightSums`` it wants.
Neither check knows the other; ``build_checks`` hands both the same ``WeightPass``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sdc_guard.fingerprints.public import WeightSums, fingerprint_tensor, fingerprint_with_sums

Asker = Callable[[int], Sequence[WeightSums]]
"""Given the step whose optimizer step just ran, the sums wanted from this pass."""


class WeightPass:
    """The shared pass: a fingerprint of the state, with the subscribers' sums taken alike."""

    def __init__(self) -> None:
        self._askers: list[Asker] = []
        self._asks: list[WeightSums] = []

    def subscribe(self, asker: Asker) -> None:
        """Have the sums ``asker`` returns taken in every pass from now on."""
        self._askers.append(asker)

    def unsubscribe(self, asker: Asker) -> None:
        """Stop asking ``asker`` (a check that is closed)."""
        self._askers[:] = [a for a in self._askers if a != asker]

    def fingerprint(self, tensors: list[torch.Tensor], step: int | None = None) -> torch.Tensor:
        """``fingerprint_tensor(tensors)``; after ``step``'s optimizer step, with the sums
        every subscriber asks for taken in the same read (the value is the same either way)."""
        if step is None or not self._askers:
            return fingerprint_tensor(tensors)
        self._asks = [ask for asker in self._askers for ask in asker(step)]
        return fingerprint_with_sums(tensors, self._asks)

    def invalidate(self) -> None:
        """The weights were overwritten after the pass (a repair): the sums it took are stale."""
        for ask in self._asks:
            ask.taken = False
