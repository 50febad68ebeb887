"""The comm hook's fused local check: DDP's scaling bit for bit, and an exact non-finite flag."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import sdc_guard.comm_hook as ch
import sdc_guard.fingerprints as fpmod

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38, 65504.0,
            1e-8, 7.0]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       world=st.integers(1, 9), n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 2999), st.sampled_from(SPECIALS)),
                         max_size=3),
       fused=st.booleans(), native=st.booleans())
def test_scale_and_check_is_mul_bit_for_bit_with_an_exact_flag(
        dtype: torch.dtype, world: int, n: int, seed: int,
        specials: list[tuple[int, float]], fused: bool, native: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-6, 6, (n,), generator=g)).to(dtype)
    for i, v in specials:
        if i < n:
            x[i] = v
    expected = x.clone().mul_(1.0 / world)
    native = native and dtype == torch.float32 and fpmod.native_enabled()
    with pytest.MonkeyPatch.context() as m:
        if not native:  # torch's paths: the fused AMP kernel, or two passes
            m.setattr(ch, "_native_kernel", lambda: None)
        if not fused:
            m.setitem(ch._fused_ok, "cpu", False)  # the two-pass fallback
        bad = ch._scale_and_check(x, 1.0 / world)
        checked = ch._check(expected)
    assert isinstance(bad, bool) is native  # the C kernel's flag is a host value
    assert torch.equal(x.view(torch.uint8), expected.view(torch.uint8))
    nonfinite = not bool(torch.isfinite(expected).all())
    if native:
        assert bad == nonfinite and checked == nonfinite  # exact, element by element
    elif fused and dtype != torch.float64:
        assert bool(bad) == nonfinite  # exact, element by element
    else:  # isfinite(sum): never misses; may also flag a finite sum that overflows
        assert bool(bad) or not nonfinite


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group (the hook asks it for the world size)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nan", [False, True])
def test_the_scaling_pass_computes_a_requested_digest(one_rank: None, nan: bool) -> None:
    if not fpmod.native_enabled():
        pytest.skip("no C kernel here: request_digest refuses, the observer digests itself")
    hook = ch.GuardCommHook()
    hook.world_size = 3  # the scale 1/world is all the pass takes from the group
    buf = torch.randn(2 * 1000, generator=torch.Generator().manual_seed(0))
    if nan:
        buf[777] = float("nan")
    spans = [(600, 1000, 0), (0, 100, 400), (100, 600, 500)]  # another order than the buffer's
    want = fpmod.host_spans_digest(buf, spans)
    want_buf = buf.clone().mul_(1.0 / 3)
    got: list[int] = []
    assert hook.request_digest(buf, spans, got.append)
    hook._scale(buf)
    assert got == [want] and hook.fused_digests == 1
    assert torch.equal(buf.view(torch.int32), want_buf.view(torch.int32))
    assert hook.local_bad is not None and bool(hook.local_bad) is nan
    hook.check_nonfinite = False  # the pass still scales and digests; no flag
    hook.begin_step(1)
    assert hook.request_digest(buf, spans, got.append)
    hook._scale(buf)
    assert len(got) == 2 and hook.local_bad is None


def test_request_digest_refuses_what_the_pass_cannot_do(one_rank: None) -> None:
    if not fpmod.native_enabled():
        pytest.skip("no C kernel here: request_digest always refuses")
    hook = ch.GuardCommHook()
    buf = torch.zeros(200)
    whole = [(0, 100, 0)]
    assert not hook.request_digest(buf, [(0, 50, 0), (60, 100, 50)], print)  # a gap
    assert not hook.request_digest(buf, [(0, 99, 0)], print)  # not the whole buffer
    assert not hook.request_digest(buf, [(0, 101, 0)], print)  # past its end
    assert not hook.request_digest(torch.zeros(200, dtype=torch.float16), [(0, 50, 0)], print)
    assert not hook.request_digest(torch.zeros(201), whole, print)  # not whole words
    assert hook.request_digest(buf, whole, print)
    assert not hook.request_digest(buf, whole, print)  # one request per bucket
    with_user_hook = ch.GuardCommHook(inner_hook=lambda state, bucket: None)  # type: ignore[arg-type, return-value]
    assert not with_user_hook.request_digest(buf, whole, print)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("local_nan", "reduced_nan"), [(False, False), (True, False),
                                                        (False, True), (True, True)])
def test_host_flags_say_which_side_was_non_finite(one_rank: None, native: bool,
                                                  local_nan: bool, reduced_nan: bool) -> None:
    if native and not fpmod.native_enabled():
        pytest.skip("no C kernel here")
    with pytest.MonkeyPatch.context() as m:
        if not native:  # tensor flags on the buffer's device, read with one host sync
            m.setattr(ch, "_native_kernel", lambda: None)
        hook = ch.GuardCommHook()
        hook.begin_step(0)
        for i in range(3):  # three buckets; the bad one is the middle one
            local = torch.ones(1000 + i)
            if local_nan and i == 1:
                local[500] = float("nan")
            hook._scale(local)
            reduced = torch.ones(999 - i)
            if reduced_nan and i == 1:
                reduced[-1] = float("inf")
            hook.reduced_result(reduced)
        assert hook.host_flags() == (local_nan, reduced_nan)
