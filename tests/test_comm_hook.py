"""The comm hook's fused local check: DDP's scaling bit for bit, and an exact non-finite flag."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdc_guard.comm_hook as ch

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38, 65504.0,
            1e-8, 7.0]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       world=st.integers(1, 9), n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from(SPECIALS)),
                         max_size=3),
       fused=st.booleans())
def test_scale_and_check_is_mul_bit_for_bit_with_an_exact_flag(
        dtype: torch.dtype, world: int, n: int, seed: int,
        specials: list[tuple[int, float]], fused: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-6, 6, (n,), generator=g)).to(dtype)
    for i, v in specials:
        if i < n:
            x[i] = v
    expected = x.clone().mul_(1.0 / world)
    with pytest.MonkeyPatch.context() as m:
        if not fused:
            m.setitem(ch._fused_ok, "cpu", False)  # the two-pass fallback
        bad = ch._scale_and_check(x, 1.0 / world)
    assert torch.equal(x.view(torch.uint8), expected.view(torch.uint8))
    nonfinite = not bool(torch.isfinite(expected).all())
    if fused and dtype != torch.float64:
        assert bool(bad) == nonfinite  # exact, element by element
    else:  # isfinite(sum): never misses; may also flag a finite sum that overflows
        assert bool(bad) or not nonfinite
