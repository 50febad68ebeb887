"""The checksum check's C passes (``sdc_cs_cols``, ``sdc_cs_rows``, ``sdc_cs_compare`` and the
hooks' single calls) against float64 references, within the float32 rounding bound the check's
tolerance allows for them; and the check's torch path still catches what the C path catches."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdc_guard.fingerprints import native as nat
from tests.launch import run_ranks
from tests.sdc_guard import checksum_workers as W
from tests.sdc_guard.test_checksum_dist import _assert_caught, _faults

U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def kernel() -> Iterator[nat.NativeKernel]:
    k = nat.load(warn=False)
    if k is None:
        pytest.skip("the C kernel could not be built here (the torch path is used)")
    yield k


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _matrix(rows: int, cols: int, ld: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rows x cols float32 view with row stride ld, with large and tiny entries mixed."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, ld, generator=g) * torch.exp(torch.randn(rows, ld, generator=g) * 3)
    return base, base[:, :cols]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(0, 70), cols=st.integers(0, 300), pad=st.integers(0, 5),
       k=st.integers(0, 2), ka=st.integers(0, 2), ones=st.lists(st.booleans(), min_size=4,
                                                                 max_size=4),
       acc=st.integers(0, 15), threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_cols_pass_is_within_the_float32_bound(kernel: nat.NativeKernel, rows: int, cols: int,
                                               pad: int, k: int, ka: int, ones: list[bool],
                                               acc: int, threads: int, seed: int) -> None:
    base, a = _matrix(rows, cols, cols + pad, seed)
    g = torch.Generator().manual_seed(seed + 1)
    u = [None if ones[p] else torch.randn(rows, generator=g) for p in range(2)]
    va = [None if ones[2 + p] else torch.rand(rows, generator=g) for p in range(2)]
    s = [torch.randn(cols, generator=g) for _ in range(2)]
    b = [torch.rand(cols, generator=g) for _ in range(2)]
    before = [t.clone() for t in s + b]
    kernel.cs_cols(A=a.data_ptr() if rows else base.data_ptr(), rows=rows, cols=cols,
                   ld=cols + pad, u0=_ptr(u[0]), u1=_ptr(u[1]), k=k, a0=_ptr(va[0]),
                   a1=_ptr(va[1]), ka=ka, s0=s[0].data_ptr(), s1=s[1].data_ptr(),
                   b0=b[0].data_ptr(), b1=b[1].data_ptr(), acc_mask=acc, threads=threads)
    ad = a.double()
    for p in range(2):
        for signed, vec, out, bit, prior in ((True, u[p], s[p], p, before[p]),
                                             (False, va[p], b[p], 2 + p, before[2 + p])):
            used = p < (k if signed else ka)
            if not used:  # untouched
                assert torch.equal(out, prior)
                continue
            w = torch.ones(rows, dtype=torch.float64) if vec is None else vec.double()
            m = ad if signed else ad.abs()
            ref = w @ m if rows else torch.zeros(cols, dtype=torch.float64)
            mag = w.abs() @ ad.abs() if rows else torch.zeros(cols, dtype=torch.float64)
            start = prior.double() if acc >> bit & 1 else torch.zeros(cols, dtype=torch.float64)
            err = (out.double() - (start + ref)).abs()
            limit = _gamma(rows + 2) * (mag + start.abs()) + 1e-30
            assert bool((err <= limit).all()), (signed, p, float((err / limit).max()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 70), cols=st.integers(0, 300), pad=st.integers(0, 5),
       k=st.integers(0, 2), ka=st.integers(0, 2), ones=st.booleans(), abs_ones=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_rows_pass_is_within_the_float32_bound(kernel: nat.NativeKernel, n: int, cols: int,
                                               pad: int, k: int, ka: int, ones: bool,
                                               abs_ones: bool, threads: int, seed: int) -> None:
    base, a = _matrix(n, cols, cols + pad, seed)
    g = torch.Generator().manual_seed(seed + 1)
    v = [None if ones else torch.randn(cols, generator=g) for _ in range(2)]
    va = [None if abs_ones else torch.rand(cols, generator=g) for _ in range(2)]
    r = [torch.full((n,), math.nan) for _ in range(2)]
    ra = [torch.full((n,), math.nan) for _ in range(2)]
    kernel.cs_rows(A=a.data_ptr() if n else base.data_ptr(), n=n, cols=cols, ld=cols + pad,
                   v0=_ptr(v[0]), v1=_ptr(v[1]), k=k, va0=_ptr(va[0]), va1=_ptr(va[1]), ka=ka,
                   r0=r[0].data_ptr(), r1=r[1].data_ptr(), ra0=ra[0].data_ptr(),
                   ra1=ra[1].data_ptr(), threads=threads)
    ad = a.double()
    for p in range(2):
        for signed, vec, out in ((True, v[p], r[p]), (False, va[p], ra[p])):
            if p >= (k if signed else ka):
                assert bool(out.isnan().all())  # untouched
                continue
            w = torch.ones(cols, dtype=torch.float64) if vec is None else vec.double()
            ref = (ad if signed else ad.abs()) @ w
            err = (out.double() - ref).abs()
            limit = _gamma(cols + 2) * (ad.abs() @ w.abs()) + 1e-30
            assert bool((err <= limit).all()), (signed, p)


def test_rows_pass_refuses_ones_mixed_with_vectors_and_bad_shapes(
        kernel: nat.NativeKernel) -> None:
    a = torch.randn(4, 8)
    v = torch.randn(8)
    r = torch.empty(2, 4)
    r0, r1 = r[0].data_ptr(), r[1].data_ptr()
    with pytest.raises(ValueError, match="ones mixed with vectors"):
        kernel.cs_rows(A=a.data_ptr(), n=4, cols=8, ld=8, v0=v.data_ptr(), k=2, ka=0, r0=r0,
                       r1=r1)
    with pytest.raises(ValueError, match="row stride below the columns"):
        kernel.cs_rows(A=a.data_ptr(), n=4, cols=8, ld=7, k=1, ka=0, r0=r0, r1=r1)
    with pytest.raises(ValueError, match="more than 2 vectors"):
        kernel.cs_cols(A=a.data_ptr(), rows=4, cols=8, ld=8, k=3, ka=0, s0=r0, s1=r1)


def test_compare_counts_failures_nan_and_the_scalers_overflow(kernel: nat.NativeKernel) -> None:
    lhs = torch.tensor([1.0, 2.0, math.nan, math.inf, 5.0, 10.5])
    rhs = torch.tensor([1.0, 2.5, 0.0, 0.0, 4.0, 10.0])
    bound = torch.tensor([0.0, 0.1, 1.0, 1.0, 2.0, 0.25])

    def count(rhs0: float, bound0: float, tol: float, finite_only: int) -> int:
        return kernel.cs_compare(lhs=lhs.data_ptr(), rhs=rhs.data_ptr(), bound=bound.data_ptr(),
                                 n=6, rhs0=rhs0, bound0=bound0, tol=tol,
                                 finite_only=bool(finite_only))

    # |diff|: 0, 0.5, nan, inf, 1, 0.5 against bound * tol: 0, 0.1, 1, 1, 2, 0.25
    assert count(0.0, 0.0, 1.0, 0) == 4  # 0.5 > 0.1, nan, inf, 0.5 > 0.25
    assert count(0.0, 0.0, 1.0, 1) == 2  # only the finite differences can fail
    assert count(0.5, 0.0, 1.0, 1) == 2  # rhs + 0.5: diffs 0.5, 1, -, -, 0.5, 0
    assert count(0.0, 0.5, 2.0, 1) == 0  # (bound + 0.5) * 2 covers every finite one


def test_the_torch_path_catches_what_the_c_path_catches() -> None:
    faults = _faults(bits=(30,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False,
                                              "weights_interval": 1}, native=False, timeout=300)
    _assert_caught(res, faults, "net.2")
    assert {r["native"] for rank in res for r in rank} == {False}


def test_the_c_path_runs_for_float32_layers_on_the_cpu(kernel: nat.NativeKernel) -> None:
    faults = _faults(bits=(30,))[:1]
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True}, timeout=300)
    assert {r["native"] for rank in res for r in rank} == {True}



def test_the_weight_gradient_is_checked_in_the_bucket_by_the_scaling_pass() -> None:
    # A flip in the local bucket (after the product, before the all-reduce) is in GW e too:
    # the scaling pass's row sums catch it, as a weight-gradient mismatch of that layer.
    faults = [{"site": "gradient_before_allreduce", "rank": 1, "target": "net.2.weight",
               "bits": (30,), "step": 0, "index": 37}]
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False,
                                              "weights_interval": 1}, timeout=300)
    step = res[1][0]["fired"][0][0]  # the faulted rank's record
    for rank in res:
        (r,) = rank
        assert r["detections"] == [("checksum", step, (1,))], r["detections"]
        assert r["layers"][0]["1"] == {"products": ["weight_grad"], "layer": "net.2"}
        assert r["skipped"] == [step]
        assert r["fused_row_sums"] > 0  # in the scaling pass, not a read of its own
    assert res[1][0]["entries"][0][0]["micro_batch"] == 0


F32 = 4


def _within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, length: int) -> bool:
    """``got`` (a float32 sum of ``length`` terms) is ``want`` within the float32 bound."""
    return bool(((got.double() - want).abs() <= _gamma(length + 2) * mag + 1e-30).all())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), out=st.integers(1, 70), inner=st.integers(1, 90),
       pad=st.integers(0, 3), bias=st.booleans(), gw=st.integers(0, 2), side=st.booleans(),
       threads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_the_hooks_single_calls_give_the_sums_and_count_the_entries_that_fail(
        kernel: nat.NativeKernel, n: int, out: int, inner: int, pad: int, bias: bool, gw: int,
        side: bool, threads: int, seed: int) -> None:
    # sdc_cs_fwd, sdc_cs_bwd and sdc_cs_gx string the passes together in one foreign call
    # each: the sums within the float32 bound of float64 references, and the comparisons
    # count the entries that fail (none on a clean product, the one corrupted entry
    # otherwise).
    g = torch.Generator().manual_seed(seed)
    _, gy = _matrix(n, out, out + pad, seed)
    _, w = _matrix(out, inner, inner + pad, seed + 1)
    _, x = _matrix(n, inner, inner + pad, seed + 2)
    b = torch.randn(out, generator=g) if bias else None
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()
    y_base = torch.zeros(n, out + pad)
    y_base[:, :out] = y
    wsum = torch.full((2 * inner + 2 * out + 2,), math.nan)
    res = torch.full((8 * n,), math.nan)
    tol = 1e-3

    def fwd(fresh: int, check: int) -> int:
        bs = wsum.data_ptr() + 4 * (2 * inner + 2 * out)
        return kernel.cs_fwd(nat.CsFwdArgs(
            X=x.data_ptr(), n=n, inner=inner, ldx=inner + pad, Y=y_base.data_ptr(), out=out,
            ldy=out + pad, W=w.data_ptr(), ldw=inner + pad, bias=_ptr(b), wsum=wsum.data_ptr(),
            bsum=bs, w_fresh=fresh, res=res.data_ptr(), check=check, tol=tol, finite_only=0,
            threads_x=threads, threads_y=threads, threads_w=threads))

    assert fwd(1, 1) == 0
    wd, xd, yd = w.double(), x.double(), y_base.double()[:, :out]
    wc, wac, wr, war, bsum = torch.split(wsum, [inner, inner, out, out, 2])
    ones_in, ones_out = torch.ones(inner, dtype=torch.float64), torch.ones(out, dtype=torch.float64)
    assert _within(wc, ones_out @ wd, ones_out @ wd.abs(), out)
    assert _within(wac, ones_out @ wd.abs(), ones_out @ wd.abs(), out)
    assert _within(wr, wd @ ones_in, wd.abs() @ ones_in, inner)
    assert _within(war, wd.abs() @ ones_in, wd.abs() @ ones_in, inner)
    if b is not None:  # float32 sums: within their bound of the float64 ones (a float32
        # reference summed in another order differed by more than a relative 1e-5)
        bd = b.double()
        mag = bd.abs().sum().reshape(1)
        assert _within(bsum[:1], bd.sum().reshape(1), mag, out)
        assert _within(bsum[1:], mag, mag, out)
    else:
        assert bsum.tolist() == [0.0, 0.0]
    xs, xa, ys, fr, fb = torch.split(res[:5 * n], n)
    assert _within(xs, xd @ ones_in, xd.abs() @ ones_in, inner)
    assert _within(xa, xd.abs() @ ones_in, xd.abs() @ ones_in, inner)
    assert _within(ys, yd @ ones_out, yd.abs() @ ones_out, out)
    assert _within(fr, xd @ wc.double(), xd.abs() @ wc.double().abs(), inner)
    assert _within(fb, xd.abs() @ wac.double(), xd.abs() @ wac.double(), inner)
    # the weight's sums are kept when not fresh: the forward's sides use the ones given
    # (zeroed, the right-hand side loses X (W^T e): every row where that term is well past
    # the row's tolerance must fail; a row whose term is within it may pass)
    missing = (xd @ wc.double()).abs()
    limit = tol * (fb.double() + float(bsum[1]))
    must_fail = int((missing > 2 * limit + 1e-6).sum())
    wsum[:inner] = 0.0
    assert must_fail <= fwd(0, 1) <= n
    assert bool((res[3 * n:4 * n] == 0).all())
    assert fwd(1, 1) == 0
    y_base[n // 2, out // 2] += 1e3 * float(fb[n // 2]) + 1e3
    assert fwd(0, 1) == 1
    assert fwd(0, 0) == 0  # the sums without the comparison
    y_base[n // 2, out // 2] = y[n // 2, out // 2]

    gw_buf = torch.randn(2, out, generator=g)
    gw0 = gw_buf.clone()
    gx = y_base.new_zeros(n, inner + pad)
    gx[:, :inner] = gy @ w

    def bwd(with_gx: bool) -> int:
        return kernel.cs_bwd(nat.CsBwdArgs(
            GY=gy.data_ptr(), n=n, out=out, ldg=out + pad, wr=wr.data_ptr(), war=war.data_ptr(),
            x_rows=res.data_ptr(), gw_rhs=gw_buf[0].data_ptr(), gw_bound=gw_buf[1].data_ptr(),
            gw=int(gw > 0), gw_add=int(gw == 2), gx_side=int(side), gxs=res[5 * n:].data_ptr(),
            GX=gx.data_ptr() if with_gx else None, inner=inner, ldx=inner + pad, tol=tol,
            finite_only=0, threads_g=threads, threads_x=threads))

    assert bwd(side) == 0
    gyd = gy.double()
    gxr, gxb, gxl = torch.split(res[5 * n:], n)
    if gw:
        keep = gw0.double() * (gw == 2)
        want = keep + torch.stack([gyd.t() @ xs.double(), gyd.abs().t() @ xa.double()])
        mag = keep.abs() + gyd.abs().t() @ xa.double().abs()
        assert _within(gw_buf, want, mag, n)
    else:
        assert torch.equal(gw_buf, gw0)
    if side:
        assert _within(gxr, gyd @ wr.double(), gyd.abs() @ war.double(), out)
        assert _within(gxb, gyd.abs() @ war.double(), gyd.abs() @ war.double(), out)
        gxd = gx.double()[:, :inner]
        assert _within(gxl, gxd @ ones_in, gxd.abs() @ ones_in, inner)
        gs = res[5 * n:].data_ptr()
        assert kernel.cs_gx(GX=gx.data_ptr(), n=n, inner=inner, ld=inner + pad, gxs=gs, tol=tol,
                            finite_only=False, threads=threads) == 0
        gx[n // 2, inner // 2] += 1e3 * float(gxb[n // 2]) + 1e3
        assert kernel.cs_gx(GX=gx.data_ptr(), n=n, inner=inner, ld=inner + pad, gxs=gs, tol=tol,
                            finite_only=False, threads=threads) == 1
        assert bwd(True) == 1
        gx[n // 2, inner // 2] = math.nan  # a NaN fails, unless only finite differences do
        assert kernel.cs_gx(GX=gx.data_ptr(), n=n, inner=inner, ld=inner + pad, gxs=gs, tol=tol,
                            finite_only=False, threads=threads) == 1
        assert kernel.cs_gx(GX=gx.data_ptr(), n=n, inner=inner, ld=inner + pad, gxs=gs, tol=tol,
                            finite_only=True, threads=threads) == 0
    else:
        assert bool(res[5 * n:].isnan().all())  # nothing of the input gradient's
    with pytest.raises(ValueError, match=r"sdc_cs_fwd: refused .* got sizes"):
        kernel.cs_fwd(nat.CsFwdArgs(
            X=x.data_ptr(), n=n, inner=inner, ldx=inner + pad, Y=y_base.data_ptr(), out=out,
            ldy=out + pad, W=w.data_ptr(), ldw=inner - 1, wsum=wsum.data_ptr(),
            bsum=wsum.data_ptr(), w_fresh=1, res=res.data_ptr(), check=1, tol=tol,
            finite_only=0))
    with pytest.raises(ValueError, match="refused"):  # a row stride below the columns
        kernel.cs_gx(GX=x.data_ptr(), n=n, inner=inner, ld=inner - 1, gxs=res.data_ptr(), tol=tol,
                     finite_only=False)


@pytest.mark.parametrize("threads", [1, 3])
def test_scale_row_sums_is_mul_and_the_row_sums_as_they_were(kernel: nat.NativeKernel,
                                                            threads: int) -> None:
    from sdc_guard.scaling import can_fuse_rows, row_sums, scale_row_sums
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(300_000, generator=g) * 1e3
    buf[7] = math.inf
    a = buf[100:100 + 600 * 300].view(600, 300)  # rows of a weight gradient
    b = buf[200_000:200_000 + 40 * 7].view(40, 7)
    outs = [torch.empty(600), torch.empty(40)]
    want_rows = [a.double().sum(1), b.double().sum(1)]
    want = buf.clone().mul_(1 / 3)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert can_fuse_rows(buf, [(b, outs[1]), (a, outs[0])])
        assert scale_row_sums(buf, [(b, outs[1]), (a, outs[0])], 1 / 3) is True  # the Inf
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(buf, want)  # the bits of mul_, everywhere
    for got, ref, view_rows in zip(outs, want_rows, (300, 7), strict=True):
        assert bool(((got.double() - ref).abs() <= 4 * view_rows * U32 * ref.abs().clamp_min(
            1.0) * 1e3).all())
    with pytest.raises(ValueError, match="without overlapping"):
        scale_row_sums(buf, [(a, outs[0]), (buf[150:450].view(1, 300), torch.empty(1))], 0.5)
    separate = [torch.empty(600)]
    row_sums([(a, separate[0])])  # the read of its own, where the pass cannot fuse
    assert torch.allclose(separate[0].double(), a.double().sum(1), rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize(("threads", "where"), [(1, None), (3, 7), (1, 100 + 5 * 300 + 299),
                                               (3, 200_000 + 39 * 7 + 6), (1, 299_999)])
def test_check_row_sums_reads_once_and_writes_nothing(kernel: nat.NativeKernel, threads: int,
                                                      where: int | None) -> None:
    # FSDP2's local gradients: the row sums of the weight gradients in the buffer and its
    # non-finite flag in one read; the buffer keeps its bits (a signalling NaN's payload too,
    # which a multiplication by 1 would quiet), a NaN or Inf anywhere is flagged (in a
    # block's body, its last column, between blocks, at the end), and the sums are the
    # separate pass's bit for bit.
    from sdc_guard.scaling import check_nonfinite, check_row_sums, row_sums
    g = torch.Generator().manual_seed(6)
    buf = torch.randn(300_000, generator=g) * 1e3
    if where is not None:
        buf.view(torch.int32)[where] = 0x7FA00001  # a signalling NaN
    a = buf[100:100 + 600 * 300].view(600, 300)
    b = buf[200_000:200_000 + 40 * 7].view(40, 7)
    outs = [torch.empty(600), torch.empty(40)]
    want = [torch.empty(600), torch.empty(40)]
    row_sums([(a, want[0]), (b, want[1])])
    before = buf.clone()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flag = check_row_sums(buf, [(b, outs[1]), (a, outs[0])])
    finally:
        torch.set_num_threads(saved)
    assert flag is (where is not None) and check_nonfinite(buf) is flag
    assert torch.equal(buf.view(torch.int32), before.view(torch.int32))
    for got, ref in zip(outs, want, strict=True):  # (a row with the NaN sums to NaN in both)
        keep = ~ref.isnan()
        assert int(keep.sum()) >= ref.numel() - 1 and torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got[keep].view(torch.int32), ref[keep].view(torch.int32))


def test_row_plans_are_kept_per_bucket_and_remade_when_its_tensors_change(
        kernel: nat.NativeKernel) -> None:
    from sdc_guard.scaling import RowPlans
    plans = RowPlans()
    buf = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    a, out = buf[40:40 + 30 * 20].view(30, 20), torch.empty(30)
    first = plans.get(0, buf, [(a, out)])
    assert first is not None and plans.get(0, buf, [(a, out)]) is first  # checked once
    expected = a.double().sum(1)
    scaled = buf.clone().mul_(0.25)
    assert first.scale(0.25) is False
    assert torch.equal(buf, scaled)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-4)
    other = torch.empty(30)  # another output tensor: a new plan, writing there
    second = plans.get(0, buf, [(a, other)])
    assert second is not None and second is not first
    second.scale(1.0)
    assert torch.allclose(other.double(), buf[40:640].view(30, 20).double().sum(1), rtol=1e-5,
                          atol=1e-4)
    assert plans.get(1, buf, [(a, other)]) is not second  # another bucket: its own plan
    half = buf.to(torch.float64)  # a buffer the pass cannot read: no plan
    assert plans.get(0, half, [(half[:600].view(30, 20), other)]) is None


@pytest.mark.parametrize("write_at", [None, 2])
def test_the_weights_check_pass_takes_the_weight_sums_and_a_stale_one_raises_no_alarm(
        kernel: nat.NativeKernel, write_at: int | None) -> None:
    # With the defaults (the weights check every step) the checksum's weight sums for each
    # step after the first come from the weights check's fingerprint pass, not a read of
    # their own. A write through .data after step 2 leaves the sums that pass took stale at
    # step 3's products: each layer's first entry fails against them, the sums are taken
    # again, found changed, and the entries pass against the new ones (no detection); the
    # layer then takes its own sums.
    steps = 6
    for r in run_ranks(W.weight_sums_run, 3, steps, write_at, timeout=300):
        assert r["detections"] == [] and r["native"] > 0
        layers = r["layers"]
        if write_at is None:
            assert (r["pre_sums_used"], r["stale"]) == ((steps - 1) * layers, 0)
            assert all(r["fuse"])
        else:
            assert r["stale"] == layers and not any(r["fuse"])
            assert r["pre_sums_used"] == (write_at + 1) * layers


def test_a_layer_seen_through_its_product_node_catches_an_input_gradient_flip() -> None:
    # From its second call on, a stock nn.Linear is seen through its addmm node (GY and this
    # call's GX in one post-hook, no tap on X): a flip in the GX that node passes on is
    # still an input-gradient mismatch of that layer, on that rank, withheld everywhere.
    res = run_ranks(W.node_gx_fault, 3, 2, timeout=300)
    for r in res:
        assert r["detections"] == [("checksum", 2, (1,))], r["detections"]
        assert r["layers"][0]["1"] == {"products": ["input_grad"], "layer": "net.2"}
        assert r["skipped"] == [2]
        assert all(r["node_ok"]) and r["unseen"] == 0


def test_a_layer_whose_input_layout_switches_keeps_its_plan_and_catches_faults(
        kernel: nat.NativeKernel) -> None:
    # net.2's input alternates between contiguous and strided from step to step: the C
    # forward's arguments come from the kept plan, then from one made for the call, then
    # from the kept one again. Clean steps stay clean; a flip in the forward product on a
    # strided step and one in the input gradient on the contiguous step after are both
    # caught in their step, on rank 1, and withheld everywhere.
    faults = [{"site": "linear_product", "product": "forward", "rank": 1, "target": "net.2",
               "bits": (30,), "step": 5},
              {"site": "linear_product", "product": "input_grad", "rank": 1,
               "target": "net.2", "bits": (30,), "step": 8}]
    res = run_ranks(W.switching_layout, 3, 10, faults, timeout=300)
    assert res[1]["fired"] == [5, 8]
    for r in res:
        assert r["detections"] == [("checksum", 5, (1,)), ("checksum", 8, (1,))], r
        assert [x["1"]["products"] for x in r["layers"]] == [["forward"], ["input_grad"]]
        assert r["skipped"] == [5, 8]
        assert r["native"] > 0 and r["plans"] == 1


def test_a_tied_weight_leaves_its_weight_gradient_unchecked_and_raises_no_alarm() -> None:
    res = run_ranks(W.tied_run, 2, 6, timeout=300)
    for r in res:
        assert r["detections"] == []
        assert r["gw_checked"] == {"mid": True, "head": False}


def test_the_torch_path_vetoes_without_a_false_non_finite_alarm() -> None:
    # The veto sentinel beside the large gradients a flipped exponent leaves: the torch
    # path's reduced non-finite flag once summed the buffer in float32, which overflowed,
    # and reported "the reduction itself" beside the checksum's detection.
    faults = _faults("blocks.0.attn.qkv", (30,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True}, kind="transformer", micro=2,
                    native=False, timeout=300)
    _assert_caught(res, faults, "blocks.0.attn.qkv")


@pytest.mark.parametrize("native", [True, False])
def test_an_output_no_backward_reaches_is_checked_in_its_forward(native: bool) -> None:
    # A probe layer's output requires a gradient but the loss never uses it: its forward
    # identity is checked in the forward hook all the same, and the step is withheld.
    if native and nat.load(warn=False) is None:
        pytest.skip("the C kernel could not be built here (the torch path is used)")
    clean = run_ranks(W.unused_output_run, 3, 3, -1, native, timeout=300)
    for r in clean:
        assert r["detections"] == [] and r["skipped"] == [] and r["native"] == native, r
    res = run_ranks(W.unused_output_run, 3, 3, 1, native, timeout=300)
    for r in res:
        assert r["detections"] == [("checksum", 1, (1,))], r["detections"]
        assert r["layers"][0]["1"] == {"products": ["forward"], "layer": "probe"}
        assert r["skipped"] == [1]


@pytest.mark.parametrize("kernel_on", [True, False])
def test_row_sums_of_a_3d_block_view_are_its_rows_in_order(kernel_on: bool) -> None:
    """FSDP2 lays a matrix out as blocks of rows, one per shard rank (``[shards, rows, cols]``,
    padded): ``row_sums`` writes the first rows' sums, with the kernel on or off (a
    contiguous 3-D view is not a matrix of its first two dims)."""
    from sdc_guard.scaling import row_sums

    blocks = torch.arange(30, dtype=torch.float32).view(3, 2, 5)  # 6 rows of 5, 5 real
    want = blocks.reshape(6, 5).sum(1)[:5]
    with nat.native_kernel(kernel_on):
        out = torch.empty(5)
        row_sums([(blocks, out)])
    assert torch.equal(out, want)
