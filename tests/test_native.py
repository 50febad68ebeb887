"""The C kernel computes exactly what the torch path computes, and builds or falls back cleanly."""

from __future__ import annotations

import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdc_guard._native as native_mod
import sdc_guard.fingerprints as fpmod
from sdc_guard import fingerprint

from .test_fingerprint import DTYPES, _random_tensor


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The module's choice of path is restored afterwards, whatever the test switched.
    monkeypatch.setattr(fpmod, "_native", fpmod._native)
    monkeypatch.setattr(fpmod, "_native_resolved", fpmod._native_resolved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = fpmod.enable_native()
    if not available:
        pytest.skip("sdc_guard._native could not be built here (the torch path is used): "
                    + "; ".join(str(w.message) for w in caught))
    yield


@pytest.mark.parametrize("n", [1, 7, 4096, fpmod._SMALL + 1, 65_537 * 3, 300_001,
                               (1 << 20) + 7, (1 << 19) * 3 + 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_native_values_equal_the_torch_path(native: None, n: int, dtype: torch.dtype) -> None:
    t = _random_tensor(dtype, n, seed=n)
    with_native = (int(fpmod._tensor_value(t)), fpmod.digest_parts(t).tolist(), fingerprint(t))
    fpmod.disable_native()
    assert with_native == (int(fpmod._tensor_value(t)), fpmod.digest_parts(t).tolist(),
                           fingerprint(t))


def test_native_fingerprints_of_every_dtype_and_views(native: None) -> None:
    cases = [_random_tensor(d, 70_001, seed=3) for d in DTYPES[:-1]]
    base = torch.randn(600, 700)
    cases += [base.t(), base[::3, 5:], torch.zeros(1 << 17)]
    got = [fingerprint(t) for t in cases]
    fpmod.disable_native()
    assert got == [fingerprint(t) for t in cases]


def test_native_value_does_not_depend_on_the_threads(native: None) -> None:
    t = torch.randn((1 << 21) + 5)
    threads = torch.get_num_threads()
    try:
        values = set()
        for k in (1, 2, 3, 7):
            torch.set_num_threads(k)
            values.add((fingerprint(t), fpmod.digest_parts(t).tolist()[0]))
    finally:
        torch.set_num_threads(threads)
    assert len(values) == 1


def test_native_rejects_a_tensor_it_cannot_read(native: None) -> None:
    kernel = fpmod._native
    assert kernel is not None
    with pytest.raises(ValueError, match=r"contiguous 1-D CPU torch\.int64"):
        kernel.weighted_sum(torch.zeros(4, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"torch\.int32 tensor for mode 0"):
        kernel.weighted_sum(torch.zeros(8, dtype=torch.int64), 0)


def test_the_build_is_cached_and_written_atomically(tmp_path: Path) -> None:
    if native_mod._compiler() is None:
        pytest.skip("no C compiler here")
    first = native_mod.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native_mod.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    kernel = native_mod.NativeKernel(first)
    words = torch.arange(1000, dtype=torch.int64)
    assert kernel.weighted_sum(words, 2) == [sum((2 * k + 1) * k for k in range(1000)),
                                             sum(range(1000))]


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SDC_GUARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang either
    monkeypatch.setattr(native_mod, "_tried", False)
    monkeypatch.setattr(native_mod, "_warned", False)
    monkeypatch.setattr(native_mod, "_kernel", None)
    monkeypatch.setattr(fpmod, "_native", None)
    monkeypatch.setattr(fpmod, "_native_resolved", False)
    monkeypatch.delenv("SDC_GUARD_NATIVE", raising=False)
    t = torch.randn(100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default path only logs
        assert fpmod.native_enabled() is False
        value = fingerprint(t)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert fpmod.enable_native() is False
    assert value == fingerprint(t.clone())


def test_sdc_guard_native_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fpmod, "_native", None)
    monkeypatch.setattr(fpmod, "_native_resolved", False)
    monkeypatch.setenv("SDC_GUARD_NATIVE", "0")
    assert fpmod.native_enabled() is False


def test_a_failed_build_falls_back_to_torch_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if native_mod._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SDC_GUARD_CACHE", str(tmp_path))
    monkeypatch.setattr(native_mod, "_SOURCE", native_mod._SOURCE + "\n#error broken on purpose\n")
    monkeypatch.setattr(native_mod, "_tried", False)
    monkeypatch.setattr(native_mod, "_warned", False)
    monkeypatch.setattr(native_mod, "_kernel", None)
    monkeypatch.setattr(fpmod, "_native", fpmod._native)
    monkeypatch.setattr(fpmod, "_native_resolved", fpmod._native_resolved)
    with pytest.warns(RuntimeWarning, match="broken on purpose"):
        assert fpmod.enable_native() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_mod.load() is None  # tried once: no second build, no second warning
    assert list(tmp_path.iterdir()) == []  # the failed build left nothing behind
    t = torch.randn(100_000)
    assert fingerprint(t) == fingerprint(t.clone())


def test_the_plain_build_without_target_clones_gives_the_same_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = native_mod._compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    src = tmp_path / "k.c"
    src.write_text(native_mod._SOURCE)
    lib = tmp_path / "k.so"
    subprocess.run([cc, *native_mod._FLAGS, "-DSDC_NO_CLONES", "-o", str(lib), str(src)],
                   check=True)
    plain = native_mod.NativeKernel(lib)
    monkeypatch.setattr(fpmod, "_native", None)
    monkeypatch.setattr(fpmod, "_native_resolved", True)  # the torch path below
    preps = {0: fpmod._prep_lanes, 1: fpmod._prep_words, 2: None}
    for mode, dtype in ((0, torch.int32), (1, torch.int64), (2, torch.int64)):
        t = _random_tensor(dtype, 300_001, seed=mode)
        src_view = t.view(torch.uint32) if mode == 0 else t
        expected = fpmod._weighted(src_view, preps[mode], with_sum=True).tolist()
        assert plain.weighted_sum(t, mode) == expected


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int8]),
       seed=st.integers(0, 2**31 - 1))
def test_host_digests_equal_concat_digest_on_the_torch_path(sizes: list[int], dtype: torch.dtype,
                                                             seed: int) -> None:
    if not fpmod.native_enabled():
        pytest.skip("the C kernel is not in use here")
    tensors = [_random_tensor(dtype, n, seed=seed + i) for i, n in enumerate(sizes)]
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += fpmod.word_count(t)
    host = fpmod.host_concat_digest(zip(tensors, offsets, strict=True))
    # The same tensors laid out in one flat buffer (each padded to whole words), in
    # reverse order, read back as spans moved to their offsets.
    buf = torch.zeros(at, dtype=torch.int64)
    spans, pos = [], 0
    for t, o in reversed(list(zip(tensors, offsets, strict=True))):
        w = fpmod.word_count(t)
        raw = t.reshape(-1).view(torch.uint8)
        buf.view(torch.uint8)[8 * pos: 8 * pos + raw.numel()] = raw
        spans.append((pos, pos + w, o))
        pos += w
    spans_host = fpmod.host_spans_digest(buf, spans)
    saved = fpmod._native, fpmod._native_resolved
    fpmod.disable_native()
    try:
        parts = torch.stack([fpmod.digest_parts(t) for t in tensors])
        expected = int(fpmod.concat_digest(parts, torch.tensor(offsets))) & ((1 << 64) - 1)
        assert fpmod.host_concat_digest(zip(tensors, offsets, strict=True)) is None
    finally:
        fpmod._native, fpmod._native_resolved = saved
    assert host == expected
    assert spans_host == expected


def test_host_spans_digest_refuses_a_span_outside_the_buffer() -> None:
    if not fpmod.native_enabled():
        pytest.skip("the C kernel is not in use here")
    with pytest.raises(ValueError, match="outside the buffer"):
        fpmod.host_spans_digest(torch.zeros(4, dtype=torch.int64), [(2, 5, 0)])


def test_an_unwritable_cache_falls_back_to_a_private_temp_dir(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if native_mod._compiler() is None:
        pytest.skip("no C compiler here")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SDC_GUARD_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(native_mod.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native_mod, "_tried", False)
    monkeypatch.setattr(native_mod, "_kernel", None)
    kernel = native_mod.load(warn=True)
    assert kernel is not None
    assert kernel.path.parent.parent == tmp_path / "tmp"
    assert kernel.path.parent.stat().st_mode & 0o077 == 0


def test_a_temp_dir_open_to_others_is_refused(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(native_mod.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = native_mod._private_tmp_dir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="not private"):
        native_mod._private_tmp_dir()


def test_host_concat_digest_names_bad_pieces() -> None:
    if not fpmod.native_enabled():
        pytest.skip("the C kernel is not in use here")
    with pytest.raises(TypeError, match="pairs"):
        fpmod.host_concat_digest([([1.0, 2.0], 0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pairs"):
        fpmod.host_concat_digest([(torch.zeros(2), 1.5)])  # type: ignore[list-item]


FUSED_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38, 3.4e38,
                  1e-8, 7.0]


def _check_scale_digest(kernel: native_mod.NativeKernel, x: torch.Tensor, world: int) -> None:
    words = x.numel() // 2
    want_d, want_s = (v & ((1 << 64) - 1)
                      for v in fpmod.digest_parts(x.view(torch.int64)).tolist())
    want_x = x.clone().mul_(1.0 / world)
    want_bad = not bool(torch.isfinite(x).all())
    d, s, bad = kernel.scale_digest_at(x.data_ptr(), words, 1.0 / world)
    assert (d, s) == (want_d, want_s)  # the words as they were, before the scaling
    assert torch.equal(x.view(torch.int32), want_x.view(torch.int32))  # mul_'s bits
    assert bad == want_bad  # exact, element by element


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture is idempotent
@given(words=st.integers(0, 9000), world=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 17_999), st.sampled_from(FUSED_SPECIALS)),
                         max_size=3))
def test_scale_digest_is_the_digest_then_mul_with_an_exact_flag(
        native: None, words: int, world: int, seed: int,
        specials: list[tuple[int, float]]) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2 * words, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-40, 38, (2 * words,), generator=g)).float()
    for i, v in specials:
        if i < x.numel():
            x[i] = v
    kernel = fpmod._native_kernel()
    assert kernel is not None
    _check_scale_digest(kernel, x, world)


def test_scale_digest_does_not_depend_on_the_threads(native: None) -> None:
    kernel = fpmod._native_kernel()
    assert kernel is not None
    x = torch.randn(2 * (3 * native_mod._PER_THREAD + 77), generator=torch.Generator().manual_seed(1))
    x[123_457] = float("nan")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            _check_scale_digest(kernel, x.clone(), 3)
    finally:
        torch.set_num_threads(before)


def test_the_plain_build_scales_and_digests_the_same(tmp_path: Path, native: None) -> None:
    cc = native_mod._compiler()
    assert cc is not None  # the fixture built the kernel
    src = tmp_path / "k.c"
    src.write_text(native_mod._SOURCE)
    lib = tmp_path / "k.so"
    subprocess.run([cc, *native_mod._FLAGS, "-DSDC_NO_CLONES", "-o", str(lib), str(src)],
                   check=True)
    x = torch.randn(2 * 70_001, generator=torch.Generator().manual_seed(2))
    x[5] = float("-inf")
    plain = native_mod.NativeKernel(lib)
    _check_scale_digest(plain, x, 7)
    for bad in (None, 2 * 70_001 - 1):
        y = torch.randn(2 * 70_001, generator=torch.Generator().manual_seed(3))
        if bad is not None:
            y[bad] = float("nan")
        want = y.clone().mul_(1.0 / 3)
        assert plain.nonfinite_at(y.data_ptr(), y.numel()) is (bad is not None)
        assert plain.scale_check_at(y.data_ptr(), y.numel(), 1.0 / 3) is (bad is not None)
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("count", [1, 3, 9, 40])  # few spans: a sum each; many: one cumsum
def test_bucket_digest_is_the_same_on_the_host_and_the_tensor_path(native: None,
                                                                   count: int) -> None:
    from sdc_guard.checks.replay import _FEW_SPANS, _BucketPlan, grads_digest

    g = torch.Generator().manual_seed(count)
    sizes = [2 * int(n) for n in torch.randint(1, 300, (count,), generator=g)]
    grads = [torch.randn(n, generator=g) for n in sizes]
    offsets = [sum(sizes[:i]) // 2 for i in range(count)]
    order = list(reversed(range(count)))  # DDP lays the last parameters out first
    buf = torch.cat([grads[i] for i in order])
    views, at = [], 0
    for i in order:
        views.append(buf[at:at + sizes[i]])
        at += sizes[i]
    plan = _BucketPlan.of(buf, views, order, offsets)
    assert plan is not None
    want = int(grads_digest(grads, offsets, torch.device("cpu")))
    assert int(plan.digest(buf)) == want  # the C kernel, per span
    fpmod.disable_native()
    assert int(plan.digest(buf)) == want  # tensor ops: the device path
    assert (count > _FEW_SPANS) == (count in (9, 40))


def test_host_spans_scale_digest_names_a_bad_span_and_refuses_other_dtypes(native: None) -> None:
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match=r"host_spans_scale_digest: span \[2, 9\) lies outside"):
        fpmod.host_spans_scale_digest(buf, [(2, 9, 0)], 0.5)
    assert fpmod.host_spans_scale_digest(torch.zeros(8, dtype=torch.float16), [(0, 2, 0)],
                                         0.5) is None


@pytest.mark.parametrize("threads", [1, 3])
def test_scale_check_and_nonfinite_are_exact_on_every_thread(native: None, threads: int) -> None:
    kernel = fpmod._native_kernel()
    assert kernel is not None
    n = 3 * (1 << 18) + 77  # enough elements for three threads, and a ragged tail
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for where in (None, 0, n // 3 + 5, n - 1):  # no bad value, or one in each thread's share
            x = torch.randn(n, generator=torch.Generator().manual_seed(1))
            if where is not None:
                x[where] = float("-inf") if where % 2 else float("nan")
            want = x.clone().mul_(1.0 / 7)
            assert kernel.nonfinite_at(x.data_ptr(), n) is (where is not None)
            assert kernel.scale_check_at(x.data_ptr(), n, 1.0 / 7) is (where is not None)
            assert torch.equal(x.view(torch.int32), want.view(torch.int32))
    finally:
        torch.set_num_threads(old)
