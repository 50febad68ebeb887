"""The checksum's sides by torch operations (``sdc_guard.checks.sides``): the fused expressions
a GPU may take, compiled here by the CPU's inductor, against the eager form and against
float64; and a compiled form that fails or disagrees given up with a warning."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from sdc_guard.checks import sides as S

U32 = 2.0 ** -24


def _operands(n: int, inner: int, out: int, dtype: torch.dtype, seed: int,
              bias: bool) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, inner, generator=g) * torch.exp(torch.randn(n, inner, generator=g)))
    w = torch.randn(out, inner, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    y = torch.nn.functional.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    gy = torch.randn(n, out, generator=g).to(dtype)
    return {"x": x.to(dtype), "w": w.to(dtype), "b": None if b is None else b.to(dtype),
            "y": y, "gy": gy}


def _within(got: torch.Tensor | None, want: torch.Tensor, mag: torch.Tensor, k: int) -> None:
    """``got`` is ``want`` (float64) up to float32 summation over ``k`` terms of magnitude
    ``mag``: the tolerance's own allowance for the sides (docs/checks/checksum.md)."""
    assert got is not None and got.dtype == torch.float32
    limit = 2 * (k + 2) * U32 * mag + 1e-30
    assert bool(((got.double() - want).abs() <= limit).all()), float(
        ((got.double() - want).abs() / limit).max())


def _check_all(ops: dict[str, torch.Tensor | None], tol: float) -> set[str]:
    """Every side of ``sides`` for ``ops`` against float64 references; the expressions run."""
    x, w, b, y, gy = (ops[k] for k in ("x", "w", "b", "y", "gy"))
    assert x is not None and w is not None and y is not None and gy is not None
    xd, wd, yd, gd = x.double(), w.double(), y.double(), gy.double()
    bd = b.double() if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    zero = torch.zeros(())
    n, inner = x.shape
    out = w.shape[0]
    c, a, r, ra, bs, ba = S.weight_sides(w, b, zero, True)
    _within(c, wd.sum(0), wd.abs().sum(0), out)
    _within(a, wd.abs().sum(0), wd.abs().sum(0), out)
    _within(r, wd.sum(1), wd.abs().sum(1), inner)
    _within(ra, wd.abs().sum(1), wd.abs().sum(1), inner)
    _within(bs, bd.sum(), bd.abs().sum(), out)
    _within(ba, bd.abs().sum(), bd.abs().sum(), out)
    assert c is not None and a is not None and r is not None and ra is not None
    assert bs is not None and ba is not None
    sums, rhs, bound = S.forward_sides(x, y, c, a, bs, ba, tol)
    ca, aa = c.double(), a.double()
    mag = xd.abs() @ aa + ba.double()
    _within(sums[:n], xd.sum(1), xd.abs().sum(1), inner)
    _within(sums[n:2 * n], xd.abs().sum(1), xd.abs().sum(1), inner)
    _within(sums[2 * n:], yd.sum(1), yd.abs().sum(1), out)
    _within(rhs, xd @ ca + bs.double(), xd.abs() @ ca.abs() + bd.abs().sum(), inner + 1)
    _within(bound, mag * tol, mag * tol, inner + 2)
    for gx, gw in ((True, True), (True, False), (False, True)):
        got = S.gy_sides(gy, r if gx else None, ra if gx else None, tol,
                         sums[:n] if gw else None, sums[n:2 * n] if gw else None, zero)
        if gx:
            _within(got[0], gd @ r.double(), gd.abs() @ r.double().abs(), out)
            _within(got[1], gd.abs() @ ra.double() * tol, gd.abs() @ ra.double() * tol, out + 1)
        else:
            assert got[:2] == (None, None)
        if gw:
            xe, xae = sums[:n].double(), sums[n:2 * n].double()
            _within(got[2], gd.t() @ xe, gd.abs().t() @ xe.abs(), n)
            _within(got[3], gd.abs().t() @ xae, gd.abs().t() @ xae, n)
        else:
            assert got[2:] == (None, None)
    assert all(S._FUSED.checked.values()), S._FUSED.checked  # every form that ran agreed
    return {name for _, name, _ in S._FUSED.checked}


CASES = [(37, 50, 23, torch.float32, True), (5, 130, 1, torch.bfloat16, True),
         (64, 16, 40, torch.float32, False), (1, 7, 9, torch.float16, True)]


@pytest.mark.parametrize("n,inner,out,dtype,bias", CASES)
def test_the_eager_sides_are_float32_sums(monkeypatch: pytest.MonkeyPatch, n: int, inner: int,
                                          out: int, dtype: torch.dtype, bias: bool) -> None:
    monkeypatch.setattr(S, "FUSED_DEVICES", set())
    monkeypatch.setattr(S._FUSED, "checked", {})
    assert _check_all(_operands(n, inner, out, dtype, n + inner, bias), 3e-6) == set()


def test_the_fused_expressions_run_as_written_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(S._FUSED, "checked", {})
    monkeypatch.setattr(S._FUSED, "fns", {"forward": S._forward_math,
                                         "weight": S._weight_math, **S.GY_FORMS})
    for n, inner, out, dtype, bias in CASES:
        assert _check_all(_operands(n, inner, out, dtype, n * out, bias), 3e-6) == {
            "forward", "gx", "gw", "gx+gw", "weight"}


@pytest.mark.timeout(280)
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_kernels_give_float32_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA device takes (``torch.compile`` of the expressions, dynamic shapes),
    compiled by the CPU's inductor: every case, each dtype, within float32's bound; one
    compilation of each serves every size."""
    monkeypatch.setattr(S, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(S._FUSED, "checked", {})
    monkeypatch.setattr(S._FUSED, "fns", {})
    for n, inner, out, dtype, bias in CASES:
        assert _check_all(_operands(n, inner, out, dtype, n + out, bias), 3e-6) == {
            "forward", "gx", "gw", "gx+gw", "weight"}
    assert set(S._FUSED.fns) == {"forward", "gx", "gw", "gx+gw", "weight"}


def test_a_form_that_fails_or_disagrees_is_given_up_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(S._FUSED, "checked", {})
    ops = _operands(9, 12, 5, torch.float32, 1, True)
    x, w, b, y = ops["x"], ops["w"], ops["b"], ops["y"]
    assert x is not None and w is not None and y is not None
    zero = torch.zeros(())

    def broken(*args: object) -> object:
        raise RuntimeError("Cannot find a working triton installation")

    def off(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:  # a kernel that lost a term
        got: tuple[torch.Tensor, ...] = S._forward_math(*args)
        return got[0], got[1] * 1.01, got[2]

    monkeypatch.setattr(S._FUSED, "fns", {"weight": broken, "forward": off})
    with pytest.warns(RuntimeWarning, match="did not compile"):
        c, a, _, _, bs, ba = S.weight_sides(w, b, zero, True)
    assert S._FUSED.checked == {("cpu", "weight", "float32"): False}
    assert c is not None and a is not None and bs is not None and ba is not None
    want = S._forward_eager(x, y, c, a, bs, ba, 1e-5)
    with pytest.warns(RuntimeWarning, match="another value"):
        got = S.forward_sides(x, y, c, a, bs, ba, 1e-5)
    assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))  # the eager form
    assert S._FUSED.checked[("cpu", "forward", "float32")] is False
    S.weight_sides(w, b, zero, True)  # given up: not tried again, no warning
    assert all(torch.equal(g, v) for g, v in zip(
        S.forward_sides(x, y, c, a, bs, ba, 1e-5), want, strict=True))


def test_data_with_nan_decides_nothing_and_the_next_call_compares(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A first checked step whose data overflowed gave the fused form up for the dtype (NaN
    # sums never agree), leaving the slower eager form for the rest of the run. Now such a
    # call takes the eager result and the next call with finite data decides.
    monkeypatch.setattr(S, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(S._FUSED, "checked", {})
    monkeypatch.setattr(S._FUSED, "fns", {"forward": S._forward_math})
    ops = _operands(9, 12, 5, torch.float32, 2, True)
    x, w, b, y = ops["x"], ops["w"], ops["b"], ops["y"]
    assert x is not None and w is not None and b is not None and y is not None
    c, a, bs, ba = w.sum(0), w.abs().sum(0), b.sum(), b.abs().sum()
    bad = x.clone()
    bad[3, 4] = float("nan")
    got = S.forward_sides(bad, y, c, a, bs, ba, 1e-5)
    want = S._forward_eager(bad, y, c, a, bs, ba, 1e-5)
    for g, v in zip(got, want, strict=True):  # the eager form's, NaN where it is
        torch.testing.assert_close(g, v, rtol=0, atol=0, equal_nan=True)
    assert bool(got[1].isnan().any())
    assert S._FUSED.checked == {}  # undecided
    S.forward_sides(x, y, c, a, bs, ba, 1e-5)
    assert S._FUSED.checked == {("cpu", "forward", "float32"): True}
    # A kernel that turns finite data into NaN still disagrees, and is given up.
    monkeypatch.setattr(S._FUSED, "checked", {})
    monkeypatch.setattr(S._FUSED, "fns", {"forward": lambda *t: tuple(
        r * float("nan") for r in S._forward_math(*t))})
    with pytest.warns(RuntimeWarning, match="another value"):
        S.forward_sides(x, y, c, a, bs, ba, 1e-5)
    assert S._FUSED.checked == {("cpu", "forward", "float32"): False}


@pytest.mark.timeout(280)
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_a_form_compiled_first_in_another_thread_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU the output gradient's hook runs in autograd's device thread, not the main one.
    monkeypatch.setattr(S, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(S._FUSED, "checked", {})
    monkeypatch.setattr(S._FUSED, "fns", {})
    ops = _operands(33, 20, 12, torch.float32, 5, True)
    gy, w = ops["gy"], ops["w"]
    assert gy is not None and w is not None
    g = torch.Generator().manual_seed(6)
    xe, xae = torch.randn(33, generator=g), torch.rand(33, generator=g)
    got: list[tuple[torch.Tensor | None, ...]] = []
    worker = threading.Thread(target=lambda: got.append(S.gy_sides(
        gy, w.sum(1), w.abs().sum(1), 1e-5, xe, xae, torch.zeros(()))))
    worker.start()
    worker.join()
    assert S._FUSED.checked == {("cpu", "gx+gw", "float32"): True}
    want = S._gy_eager(gy, w.sum(1), w.abs().sum(1), 1e-5, xe, xae, torch.zeros(()))
    for a, b in zip(got[0], want, strict=True):
        assert a is not None and b is not None
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
