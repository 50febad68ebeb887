"""``bench.bursts``: it counts what it says it counts."""

from __future__ import annotations

import math

import torch

from bench import bursts
from sdc_guard import fingerprint


def test_a_word_that_ignores_the_data_lets_every_burst_escape_and_one_element_never() -> None:
    assert bursts.escapes(lambda t: 0, "float32", "same", 4, 50, seed=1) == 50
    # one flipped bit always changes the fingerprint (its proof), in either dtype
    for dtype in bursts.DTYPES:
        assert bursts.escapes(fingerprint, dtype, "random", 1, 300, seed=2) == 0


def test_the_tensor_is_left_as_it_was_after_every_draw() -> None:
    seen = []

    def word(t: torch.Tensor) -> int:
        seen.append(t.clone())
        return 0

    bursts.escapes(word, "bfloat16", "random", 3, 20, seed=3)
    assert len(seen) == 21
    changed = [int((s.view(torch.int16) != seen[0].view(torch.int16)).sum()) for s in seen[1:]]
    assert changed == [3] * 20  # every draw's burst, on the clean tensor


def test_the_wilson_interval() -> None:
    low, high = bursts.wilson(0, 1000)
    assert low == 0.0 and math.isclose(high, 0.00383, rel_tol=0.01)
    low, high = bursts.wilson(50, 100)
    assert math.isclose(low, 0.404, abs_tol=0.001) and math.isclose(high, 0.596, abs_tol=0.001)
