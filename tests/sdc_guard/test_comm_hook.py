"""The comm hook's fused scaling pass: DDP's scaling bit for bit, an exact non-finite flag, and
the digests its listeners ask for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdc_guard.scaling as sc
from sdc_guard.checks.nonfinite import NonFiniteCheck
from sdc_guard.checks.sketch import GradientSketch
from sdc_guard.fingerprints.digest import host_spans_digest
from sdc_guard.fingerprints.native import active_kernel, native_enabled
from sdc_guard.parallel import BucketListener, GuardCommHook
from sdc_guard.parallel.ddp import SentinelAnswer, sentinel_values
from sdc_guard.scaling import Flag, SketchRequest

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
    native = native and dtype == torch.float32 and native_enabled()
    with pytest.MonkeyPatch.context() as m:
        if not native:  # torch's paths: the fused AMP kernel, or two passes
            m.setattr(sc, "active_kernel", lambda: None)
        if not fused:
            m.setitem(sc._fused_ok, ("cpu", dtype), False)  # the two-pass fallback
        bad = sc.scale_and_check(x, 1.0 / world)
        checked = sc.check_nonfinite(expected)
    assert isinstance(bad, bool) is native  # the C kernel's flag is a host value
    assert torch.equal(x.view(torch.uint8), expected.view(torch.uint8))
    nonfinite = not bool(torch.isfinite(expected).all())
    if native:
        assert bad == nonfinite and checked == nonfinite  # exact, element by element
    elif fused and dtype != torch.float64:
        assert bool(bad) == nonfinite  # exact, element by element
    else:  # isfinite(sum): never misses; may also flag a finite sum that overflows
        assert bool(bad) or not nonfinite


def test_a_dtype_without_the_fused_kernel_leaves_the_others_on_it() -> None:
    """CUDA's fused unscale kernel has no bfloat16 (seen on an H200): a bfloat16 bucket
    takes two passes, and float32 buckets after it keep the kernel. A scale of 1 (one rank)
    never takes the kernel, which skips the product then (on a GPU, ``mul_`` by 1 gives a
    NaN the canonical payload)."""
    real = torch._amp_foreach_non_finite_check_and_unscale_
    calls: list[torch.dtype] = []

    def no_bfloat16(bufs: list[torch.Tensor], found: torch.Tensor, inv: torch.Tensor) -> None:
        calls.append(bufs[0].dtype)
        if bufs[0].dtype == torch.bfloat16:
            raise RuntimeError('"_amp_foreach_non_finite_check_and_unscale_cuda" not '
                               "implemented for 'BFloat16'")
        real(bufs, found, inv)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bfloat16)
        m.setattr(sc, "_fused_ok", {})
        for dtype in (torch.bfloat16, torch.float32, torch.bfloat16, torch.float32):
            x = torch.tensor([1.5, float("nan"), 3.0], dtype=dtype)
            want = x.clone().mul_(0.25)
            assert bool(sc.scale_and_check_tensor(x, 0.25))
            assert torch.equal(x.view(torch.uint8), want.view(torch.uint8))
        assert calls == [torch.bfloat16, torch.float32, torch.float32]  # bfloat16 tried once
        assert sc.fused_unscale_ok("cpu", torch.bfloat16) is False
        assert sc.fused_unscale_ok("cpu", torch.float32) is True
        x = torch.tensor([1.5, 2.0])
        assert not bool(sc.scale_and_check_tensor(x, 1.0))
        assert calls == [torch.bfloat16, torch.float32, torch.float32]


class _Bucket:
    """A stand-in for DDP's GradBucket: the pass reads only its flat buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return 0


@dataclass
class _Spans:
    spans: list[tuple[int, int, int]]
    torch_calls: int = 0

    def digest(self, buf: torch.Tensor) -> torch.Tensor:
        self.torch_calls += 1
        value = host_spans_digest(buf, self.spans)
        assert value is not None
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value)


class _Listener(BucketListener):
    def __init__(self, spans: _Spans | None, *, flag: bool) -> None:
        self.spans = spans
        self.wants_flag = flag
        self.got: list[tuple[Flag | None, int | torch.Tensor | None]] = []

    def local(self, bucket: Any) -> _Spans | None:
        return self.spans

    def after_scaling(self, bucket: Any, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        self.got.append((flag, digest))


@pytest.mark.parametrize("nan", [False, True])
def test_the_scaling_pass_computes_a_listeners_digest(one_rank: None, nan: bool) -> None:
    if not native_enabled():
        pytest.skip("no C kernel here: the spans are digested by torch ops, not fused")
    hook = GuardCommHook()
    hook.world_size = 3  # the scale 1/world is all the pass takes from the group
    buf = torch.randn(2 * 1000, generator=torch.Generator().manual_seed(0))
    if nan:
        buf[777] = float("nan")
    spans = _Spans([(600, 1000, 0), (0, 100, 400), (100, 600, 500)])  # not the buffer's order
    want = host_spans_digest(buf, spans.spans)
    want_buf = buf.clone().mul_(1.0 / 3)
    flagger = _Listener(None, flag=True)
    digester = _Listener(spans, flag=False)
    hook.subscribe(flagger)
    hook.subscribe(digester)
    hook._local(_Bucket(buf))  # type: ignore[arg-type]
    assert digester.got == [(nan, want)] and hook.fused_digests == 1
    assert flagger.got == [(nan, None)] and spans.torch_calls == 0
    assert torch.equal(buf.view(torch.int32), want_buf.view(torch.int32))
    hook.listeners.remove(flagger)  # nobody wants the flag: the pass still scales and digests
    hook._local(_Bucket(buf))  # type: ignore[arg-type]
    assert digester.got[-1][0] is None and hook.fused_digests == 2


def test_spans_the_pass_cannot_fuse_are_digested_before_the_scaling(one_rank: None) -> None:
    if not native_enabled():
        pytest.skip("no C kernel here")
    buf = torch.randn(200, generator=torch.Generator().manual_seed(1))
    cases = [[(0, 50, 0), (60, 100, 50)],  # a gap
             [(0, 99, 0)]]  # not the whole buffer
    for spans in cases:
        hook = GuardCommHook()
        hook.world_size = 2
        b = buf.clone()
        want = host_spans_digest(b, spans)  # of the words as they were
        listener = _Listener(_Spans(spans), flag=False)
        hook.subscribe(listener)
        hook._local(_Bucket(b))  # type: ignore[arg-type]
        assert hook.fused_digests == 0 and listener.spans is not None
        assert listener.spans.torch_calls == 1
        digest = listener.got[0][1]
        assert isinstance(digest, torch.Tensor) and int(digest) & ((1 << 64) - 1) == want
        assert torch.equal(b, buf * 0.5)
    # one listener's spans ride the pass; a second listener's are digested first
    hook = GuardCommHook()
    whole = [(0, 100, 0)]
    first, second = _Listener(_Spans(whole), flag=False), _Listener(_Spans(whole), flag=False)
    hook.subscribe(first)
    hook.subscribe(second)
    b = buf.clone()
    want = host_spans_digest(b, whole)
    hook._local(_Bucket(b))  # type: ignore[arg-type]
    assert first.got == [(None, want)] and hook.fused_digests == 1
    second_digest = second.got[0][1]
    assert isinstance(second_digest, torch.Tensor) and int(second_digest) & ((1 << 64) - 1) == want
    # a user's comm hook owns the scaling: nothing is fused, the buffer is left alone
    user = GuardCommHook(inner_hook=lambda state, bucket: None)  # type: ignore[arg-type, return-value]
    listener = _Listener(_Spans(whole), flag=True)
    user.subscribe(listener)
    b = buf.clone()
    user._local(_Bucket(b))  # type: ignore[arg-type]
    assert user.fused_digests == 0 and torch.equal(b, buf) and listener.got[0][0] is False


class _Sketching(BucketListener):
    """Asks for the sketch rows of some views into the bucket (``sketches``)."""

    def __init__(self, sketch: GradientSketch, items: list[tuple[int, torch.Tensor]]) -> None:
        self.sketch, self.items = sketch, items
        self.wants_flag = True
        self.got: list[tuple[Flag | None, dict[int, torch.Tensor]]] = []
        self._request: SketchRequest | None = None

    def sketches(self, bucket: Any) -> SketchRequest | None:
        self._request = SketchRequest(self.sketch, self.items)
        return self._request

    def after_scaling(self, bucket: Any, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        assert self._request is not None
        self.got.append((flag, self._request.rows))


@pytest.mark.parametrize("bad", [None, "nan", "inf between"])
def test_the_scaling_pass_takes_a_listeners_sketch_rows(one_rank: None, bad: str | None) -> None:
    """The tolerant replay's own sketch rides the pass (``sdc_scale_sketch``): the rows of the
    gradients as they were, bit for bit those of a read of their own (``GradientSketch.row``),
    whatever the order asked in; the buffer scaled with ``mul_``'s bits, the floats between
    the gradients too; the flag exact, a NaN or Inf inside a gradient or between two."""
    if not native_enabled():
        pytest.skip("no C kernel here: the rows are read apart, not fused")
    sizes = [3000, 7, 33 * 17 + 5, 1]
    sketch = GradientSketch(sizes, seed=5, device=torch.device("cpu"))
    buf = torch.randn(sum(sizes) + 3 * len(sizes) + 2, generator=torch.Generator().manual_seed(2))
    views, at = [], 1
    for n in sizes:
        views.append(buf[at:at + n])
        at += n + 3
    if bad == "nan":
        views[2][40] = float("nan")
    elif bad == "inf between":
        buf[0] = float("inf")
    want = [sketch.row(i, v) for i, v in enumerate(views)]
    want_buf = buf.clone().mul_(0.25)
    hook = GuardCommHook()
    hook.world_size = 4
    listener = _Sketching(sketch, list(enumerate(views))[::-1])
    hook.subscribe(listener)
    for n in (1, 2):  # the plan is made once and found again
        if n == 2:
            buf.copy_(want_buf * 4)
        hook._local(_Bucket(buf))  # type: ignore[arg-type]
        flag, rows = listener.got[-1]
        assert hook.fused_sketches == n and flag is (bad is not None)
        assert sorted(rows) == [0, 1, 2, 3]
        for i, row in rows.items():
            assert torch.equal(row.view(torch.int64), want[i].view(torch.int64))
        assert torch.equal(buf.view(torch.int32), want_buf.view(torch.int32))
    # a user's comm hook owns the scaling: the rows are read apart, the buffer left alone
    user = GuardCommHook(inner_hook=lambda state, bucket: None)  # type: ignore[arg-type, return-value]
    other = _Sketching(sketch, list(enumerate(views)))
    user.subscribe(other)
    before = buf.clone()
    user._local(_Bucket(buf))  # type: ignore[arg-type]
    assert user.fused_sketches == 0 and torch.equal(buf.view(torch.int32), before.view(torch.int32))
    assert all(torch.equal(other.got[0][1][i].view(torch.int64), sketch.row(i, v).view(torch.int64))
               for i, v in enumerate(views))


def test_a_sketch_the_pass_cannot_take_is_read_before_the_scaling(one_rank: None) -> None:
    """Overlapping gradients, or one that is not float32, are not fused: the rows come from
    a read of their own, of the values before the scaling; the kernel itself refuses blocks
    that overlap or leave the buffer, writing nothing."""
    if not native_enabled():
        pytest.skip("no C kernel here")
    sketch = GradientSketch([100, 100], seed=1, device=torch.device("cpu"))
    buf = torch.randn(150, generator=torch.Generator().manual_seed(3))
    items = [(0, buf[:100]), (1, buf[50:150])]  # overlapping
    want = {i: sketch.row(i, v) for i, v in items}
    hook = GuardCommHook()
    hook.world_size = 2
    listener = _Sketching(sketch, items)
    hook.subscribe(listener)
    before = buf.clone()
    hook._local(_Bucket(buf))  # type: ignore[arg-type]
    assert hook.fused_sketches == 0 and listener.got[0][0] is False
    assert all(torch.equal(listener.got[0][1][i], want[i]) for i in want)
    assert torch.equal(buf, before * 0.5)
    assert sc.SketchPlan.of(buf, SketchRequest(sketch, items)) is None
    half = buf.to(torch.bfloat16)
    assert sc.SketchPlan.of(half, SketchRequest(sketch, [(0, half[:100])])) is None
    kernel = active_kernel()
    assert kernel is not None
    out = torch.zeros(2, 1 + sketch.k, dtype=torch.float64)
    block = sketch.c_block(0, buf[:100])
    assert block is not None
    for blocks in ([(0, *block), (50, *block)], [(60, *block)]):
        kept = buf.clone()
        with pytest.raises(ValueError, match="inside the buffer, in increasing offset"):
            kernel.scale_sketch_at(buf.data_ptr(), buf.numel(), 0.5,
                                   kernel.sketch_blocks(blocks), sketch.k, out.data_ptr())
        assert torch.equal(buf, kept) and not bool(out.any())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("local_nan", "reduced_nan"), [(False, False), (True, False),
                                                        (False, True), (True, True)])
def test_host_flags_say_which_side_was_non_finite(one_rank: None, native: bool,
                                                  local_nan: bool, reduced_nan: bool) -> None:
    if native and not native_enabled():
        pytest.skip("no C kernel here")
    with pytest.MonkeyPatch.context() as m:
        if not native:  # tensor flags on the buffer's device, read with one host sync
            m.setattr(sc, "active_kernel", lambda: None)
            m.setattr("sdc_guard.checks.nonfinite.active_kernel", lambda: None)
        hook = GuardCommHook()
        check = NonFiniteCheck(hook, device=torch.device("cpu"))
        check.begin_step(0)
        for i in range(3):  # three buckets; the bad one is the middle one
            local = torch.ones(1000 + i)
            if local_nan and i == 1:
                local[500] = float("nan")
            hook._local(_Bucket(local))  # type: ignore[arg-type]
            reduced = torch.ones(999 - i)
            if reduced_nan and i == 1:
                reduced[-1] = float("inf")
            check.reduced(_Bucket(reduced), reduced)  # type: ignore[arg-type]
        assert check.host_flags() == (local_nan, reduced_nan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_torch_flag_does_not_call_a_finite_buffer_non_finite(dtype: torch.dtype) -> None:
    # The veto sentinel (the dtype's largest finite value) beside large gradients: the
    # buffer's sum overflows the dtype, yet every value is finite.
    big = torch.finfo(dtype).max
    buf = torch.tensor([big, big / 2, big / 4, 1.0], dtype=dtype)
    assert not bool(sc._bad(buf))
    buf[3] = float("inf")
    assert bool(sc._bad(buf))
    buf[3] = float("nan")
    assert bool(sc._bad(buf))


@pytest.mark.parametrize(
    ("slots", "scaler", "vetoed"),
    [
        ([0.5, -2.0, 1.0], False, False),  # gradients only
        ([0.5, 3.4e38, 1.0], False, True),  # rank 1's veto
        ([3.4e38, 3.4e38, 1.0], False, True),  # two vetoes, each in its own slot: finite
        ([float("inf"), 0.5, 1.0], False, True),  # a non-finite slot could hide a veto
        ([float("inf"), 0.5, 1.0], True, False),  # ... unless the scaler skips the step
        ([float("inf"), 3.4e38, 1.0], True, True),  # a veto beside an overflow still counts
    ])
def test_the_sentinel_slots_say_whether_some_rank_vetoed(one_rank: None, slots: list[float],
                                                         scaler: bool, vetoed: bool) -> None:
    answer = GuardCommHook.answer_of(torch.tensor(slots, dtype=torch.float32))
    assert answer.read(expect_overflow=scaler) is vetoed
    assert answer.read(expect_overflow=scaler) is vetoed  # read again: the same answer


def test_checks_unsubscribe_themselves_and_others_stay(one_rank: None) -> None:
    # The guard never edits the backend's listeners: a check that is replaced unsubscribes
    # itself in close(), and a listener of someone else's stays subscribed.
    import sdc_guard
    from tests import workers

    model = torch.nn.parallel.DistributedDataParallel(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sdc_guard.SDCGuard(model, opt, loss_fn=workers.loss_fn,
                               batch_for=workers.batch_for,
                               config=sdc_guard.GuardConfig(checksum=True))
    mine = BucketListener()
    guard.backend.subscribe(mine)

    def subscribed() -> list[Any]:
        return [x for x in guard.backend.listeners if x is not mine]

    first = list(guard.checks)
    assert {type(x).__name__ for x in subscribed()} == {"NonFiniteCheck", "ChecksumCheck"}
    guard.reconfigure(sdc_guard.GuardConfig(nonfinite=False))
    assert subscribed() == [] and mine in guard.backend.listeners
    guard.reconfigure(sdc_guard.GuardConfig())
    assert [type(x).__name__ for x in subscribed()] == ["NonFiniteCheck"]
    assert not any(x in first for x in subscribed())
    guard.step(0)  # the backend still dispatches to what is subscribed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divided_by", [1, 4])
def test_listeners_that_share_the_sentinel_slots_each_read_their_own(
        dtype: torch.dtype, divided_by: int) -> None:
    # Slot r: the values of the listeners that withheld on rank r, plus the other ranks'
    # gradients there, over what an averaging reduction divides by.
    withheld = [(0,), (1,), (0, 2), (0, 1, 2), (), (2,)]
    values = sentinel_values(dtype, 3)
    slots = torch.tensor([(sum(values[k] for k in w) + 0.75) / divided_by for w in withheld],
                         dtype=torch.float64).to(dtype)
    answer = SentinelAnswer(slots, divided_by)
    for k in range(3):
        mine = answer.level(k, 3)
        want = tuple(r for r, w in enumerate(withheld) if k in w)
        assert mine.ranks() == want
        assert mine.read() is True
    nobody = SentinelAnswer(torch.tensor([0.5, -1.0], dtype=dtype), divided_by).level(1, 2)
    assert nobody.ranks() == () and nobody.read() is False
    hidden = SentinelAnswer(torch.tensor([float("nan"), 0.5], dtype=dtype), divided_by)
    assert hidden.level(1, 2).ranks() == ()  # a non-finite slot names no one ...
    assert hidden.level(1, 2).read() is True  # ... and says it hides what it held
    assert hidden.level(1, 2).read(expect_overflow=True) is False
