"""``rng_stream``: each (seed, rank, step, micro-batch) its own random stream, and the caller's
generator state back afterwards, whatever the block did."""

from __future__ import annotations

import pytest
import torch

from sdc_guard.determinism import rng_stream, stream_seed

CPU = torch.device("cpu")


def test_stream_is_the_generator_seeded_with_stream_seed() -> None:
    with rng_stream(7, 1, 3, 0, CPU):
        got = torch.rand(64)
    want = torch.rand(64, generator=torch.Generator().manual_seed(stream_seed(7, 1, 3, 0)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("other", [(8, 1, 3, 0), (7, 2, 3, 0), (7, 1, 4, 0), (7, 1, 3, 1)])
def test_each_key_draws_its_own_stream(other: tuple[int, int, int, int]) -> None:
    with rng_stream(7, 1, 3, 0, CPU):
        a = torch.rand(64)
    with rng_stream(*other, CPU):
        b = torch.rand(64)
    assert not torch.equal(a, b)


def test_the_callers_state_comes_back_even_when_the_block_raises() -> None:
    torch.manual_seed(123)
    torch.rand(5)
    before = torch.get_rng_state()
    expected = torch.rand(16)
    torch.set_rng_state(before)
    with pytest.raises(RuntimeError, match="inside"), rng_stream(7, 1, 3, 0, CPU):
        torch.rand(1000)
        raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), before)
    with rng_stream(7, 1, 3, 0, CPU):
        with rng_stream(7, 1, 3, 1, CPU):  # nested: each restores its caller's state
            torch.rand(3)
        torch.rand(3)
    assert torch.equal(torch.rand(16), expected)
