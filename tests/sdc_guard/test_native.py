"""The C kernel computes exactly what the torch path computes, and builds or falls back cleanly."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdc_guard import fingerprint
from sdc_guard.fingerprints import digest as D
from sdc_guard.fingerprints import native as nat
from sdc_guard.fingerprints import public as P
from sdc_guard.fingerprints import weighted as W

from .test_fingerprint import DTYPES, _random_tensor


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The module's choice of path is restored afterwards, whatever the test switched.
    monkeypatch.setattr(nat, "_native", nat._native)
    monkeypatch.setattr(nat, "_native_resolved", nat._native_resolved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = nat.enable_native()
    if not available:
        pytest.skip("the C kernel could not be built here (the torch path is used): "
                    + "; ".join(str(w.message) for w in caught))
    yield


@pytest.mark.parametrize("n", [1, 7, 4096, W.SMALL + 1, 65_537 * 3, 300_001,
                               (1 << 20) + 7, (1 << 19) * 3 + 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_native_values_equal_the_torch_path(native: None, n: int, dtype: torch.dtype) -> None:
    t = _random_tensor(dtype, n, seed=n)
    with_native = (int(P.tensor_value(t)), D.digest_parts(t).tolist(), fingerprint(t))
    nat.disable_native()
    assert with_native == (int(P.tensor_value(t)), D.digest_parts(t).tolist(),
                           fingerprint(t))


def test_native_fingerprints_of_every_dtype_and_views(native: None) -> None:
    cases = [_random_tensor(d, 70_001, seed=3) for d in DTYPES[:-1]]
    base = torch.randn(600, 700)
    cases += [base.t(), base[::3, 5:], torch.zeros(1 << 17)]
    got = [fingerprint(t) for t in cases]
    nat.disable_native()
    assert got == [fingerprint(t) for t in cases]


_LIST_DTYPES = [*DTYPES, torch.complex64, torch.complex128]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.tuples(st.sampled_from(_LIST_DTYPES),
                                st.sampled_from([0, 1, 3, 5, 17, 4099, W.SMALL + 3, 70_001]),
                                st.sampled_from(["plain", "strided", "offset", "conj"])),
                      min_size=0, max_size=6),
       as_list=st.booleans())
def test_host_combined_fingerprints_equal_the_torch_path(
        native: None, items: list[tuple[torch.dtype, int, str]], as_list: bool) -> None:
    # On the CPU one C call gives the terms of the whole list: the same fingerprint as the
    # torch operations, for lists and single tensors of every dtype (odd byte counts: a
    # zero-padded last lane), strided views, views off an 8-byte boundary, lazy conjugates
    # (all copied first) and complex tensors.
    tensors = []
    for i, (dtype, n, layout) in enumerate(items):
        if dtype.is_complex:
            t = torch.randn(2 * n + 2, dtype=dtype, generator=torch.Generator().manual_seed(i))
        else:
            t = _random_tensor(dtype, 2 * n + 2, seed=i)
        conj = t[:n].conj() if dtype.is_complex else t[:n]
        tensors.append({"plain": t[:n], "strided": t[1::2][:n], "offset": t[1:n + 1],
                        "conj": conj}[layout])
    x: torch.Tensor | list[torch.Tensor] = tensors if as_list or not tensors else tensors[0]
    with nat.native_kernel(True):
        assert P._native_fingerprint(*P._tensors(x)) is not None
        host = (fingerprint(x), int(P.fingerprint_tensor(x)))
    with nat.native_kernel(False):
        assert P._native_fingerprint(*P._tensors(x)) is None
        assert host == (fingerprint(x), int(P.fingerprint_tensor(x)))


def test_native_value_does_not_depend_on_the_threads(native: None) -> None:
    t = torch.randn((1 << 21) + 5)
    threads = torch.get_num_threads()
    try:
        values = set()
        for k in (1, 2, 3, 7):
            torch.set_num_threads(k)
            values.add((fingerprint(t), D.digest_parts(t).tolist()[0]))
    finally:
        torch.set_num_threads(threads)
    assert len(values) == 1


def test_native_rejects_a_tensor_it_cannot_read(native: None) -> None:
    kernel = nat._native
    assert kernel is not None
    with pytest.raises(ValueError, match=r"contiguous 1-D CPU torch\.int64"):
        kernel.weighted_sum(torch.zeros(4, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"torch\.int32 tensor for mode 0"):
        kernel.weighted_sum(torch.zeros(8, dtype=torch.int64), 0)


def test_the_build_is_cached_and_written_atomically(tmp_path: Path) -> None:
    if nat._compiler() is None:
        pytest.skip("no C compiler here")
    first = nat.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert nat.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    kernel = nat.NativeKernel(first)
    words = torch.arange(1000, dtype=torch.int64)
    assert kernel.weighted_sum(words, 2) == [sum((2 * k + 1) * k for k in range(1000)),
                                             sum(range(1000))]


def test_the_cache_key_covers_every_kernel_source(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The library is built from every file in kernel/ (a header and a .c file per owner):
    # a change to any of them is a new library, never the old one found in the cache.
    src = tmp_path / "kernel"
    shutil.copytree(nat._KERNEL, src)
    monkeypatch.setattr(nat, "_KERNEL", src)
    names = {p.name for p in nat.sources()}
    assert {"common.h", "threads.c", "fingerprint.c", "scaling.c", "checksum.c"} <= names
    base = nat.cache_key("cc")
    for p in nat.sources():
        text = p.read_text()
        p.write_text(text + "\n/* changed */\n")
        assert nat.cache_key("cc") != base, p.name
        p.write_text(text)
    assert nat.cache_key("cc") == base
    (src / "extra.c").write_text("int sdc_extra;\n")  # a new file counts too
    assert nat.cache_key("cc") != base


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SDC_GUARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang either
    monkeypatch.setattr(nat, "_tried", False)
    monkeypatch.setattr(nat, "_warned", False)
    monkeypatch.setattr(nat, "_kernel", None)
    monkeypatch.setattr(nat, "_native", None)
    monkeypatch.setattr(nat, "_native_resolved", False)
    monkeypatch.delenv("SDC_GUARD_NATIVE", raising=False)
    t = torch.randn(100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default path only logs
        assert nat.native_enabled() is False
        value = fingerprint(t)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert nat.enable_native() is False
    assert value == fingerprint(t.clone())


def test_sdc_guard_native_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nat, "_native", None)
    monkeypatch.setattr(nat, "_native_resolved", False)
    monkeypatch.setenv("SDC_GUARD_NATIVE", "0")
    assert nat.native_enabled() is False


def test_a_failed_build_falls_back_to_torch_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if nat._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SDC_GUARD_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "src"
    shutil.copytree(nat._KERNEL, broken)
    (broken / "checksum.c").write_text((nat._KERNEL / "checksum.c").read_text()
                                       + "\n#error broken on purpose\n")
    monkeypatch.setattr(nat, "_KERNEL", broken)
    monkeypatch.setattr(nat, "_tried", False)
    monkeypatch.setattr(nat, "_warned", False)
    monkeypatch.setattr(nat, "_kernel", None)
    monkeypatch.setattr(nat, "_native", nat._native)
    monkeypatch.setattr(nat, "_native_resolved", nat._native_resolved)
    with pytest.warns(RuntimeWarning, match="broken on purpose"):
        assert nat.enable_native() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nat.load() is None  # tried once: no second build, no second warning
    assert list((tmp_path / "cache").iterdir()) == []  # the failed build left nothing behind
    t = torch.randn(100_000)
    assert fingerprint(t) == fingerprint(t.clone())


def test_the_plain_build_without_target_clones_gives_the_same_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = nat._compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    lib = tmp_path / "k.so"
    built = nat.compile_kernel(cc, lib, ("-DSDC_NO_CLONES",))
    assert built.returncode == 0, built.stderr
    plain = nat.NativeKernel(lib)
    monkeypatch.setattr(nat, "_native", None)
    monkeypatch.setattr(nat, "_native_resolved", True)  # the torch path below
    preps = {0: W.prep_lanes, 1: W.prep_words, 2: None}
    for mode, dtype in ((0, torch.int32), (1, torch.int64), (2, torch.int64)):
        t = _random_tensor(dtype, 300_001, seed=mode)
        src_view = t.view(torch.uint32) if mode == 0 else t
        expected = W.weighted_sum(src_view, preps[mode], with_sum=True).tolist()
        assert plain.weighted_sum(t, mode) == expected


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int8]),
       seed=st.integers(0, 2**31 - 1))
def test_host_digests_equal_concat_digest_on_the_torch_path(sizes: list[int], dtype: torch.dtype,
                                                             seed: int) -> None:
    if not nat.native_enabled():
        pytest.skip("the C kernel is not in use here")
    tensors = [_random_tensor(dtype, n, seed=seed + i) for i, n in enumerate(sizes)]
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += D.word_count(t)
    host = D.host_concat_digest(zip(tensors, offsets, strict=True))
    # The same tensors laid out in one flat buffer (each padded to whole words), in
    # reverse order, read back as spans moved to their offsets.
    buf = torch.zeros(at, dtype=torch.int64)
    spans, pos = [], 0
    for t, o in reversed(list(zip(tensors, offsets, strict=True))):
        w = D.word_count(t)
        raw = t.reshape(-1).view(torch.uint8)
        buf.view(torch.uint8)[8 * pos: 8 * pos + raw.numel()] = raw
        spans.append((pos, pos + w, o))
        pos += w
    spans_host = D.host_spans_digest(buf, spans)
    saved = nat._native, nat._native_resolved
    nat.disable_native()
    try:
        parts = torch.stack([D.digest_parts(t) for t in tensors])
        expected = int(D.concat_digest(parts, torch.tensor(offsets))) & ((1 << 64) - 1)
        assert D.host_concat_digest(zip(tensors, offsets, strict=True)) is None
    finally:
        nat._native, nat._native_resolved = saved
    assert host == expected
    assert spans_host == expected


def test_host_spans_digest_refuses_a_span_outside_the_buffer() -> None:
    if not nat.native_enabled():
        pytest.skip("the C kernel is not in use here")
    with pytest.raises(ValueError, match="outside the buffer"):
        D.host_spans_digest(torch.zeros(4, dtype=torch.int64), [(2, 5, 0)])


def test_an_unwritable_cache_falls_back_to_a_private_temp_dir(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if nat._compiler() is None:
        pytest.skip("no C compiler here")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SDC_GUARD_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(nat, "_tried", False)
    monkeypatch.setattr(nat, "_kernel", None)
    kernel = nat.load(warn=True)
    assert kernel is not None
    assert kernel.path.parent.parent == tmp_path / "tmp"
    assert kernel.path.parent.stat().st_mode & 0o077 == 0


def test_a_temp_dir_open_to_others_is_refused(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    shared = nat._private_tmp_dir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="not private"):
        nat._private_tmp_dir()


def test_host_concat_digest_names_bad_pieces() -> None:
    if not nat.native_enabled():
        pytest.skip("the C kernel is not in use here")
    with pytest.raises(TypeError, match="pairs"):
        D.host_concat_digest([([1.0, 2.0], 0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pairs"):
        D.host_concat_digest([(torch.zeros(2), 1.5)])  # type: ignore[list-item]


FUSED_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38, 3.4e38,
                  1e-8, 7.0]


def _check_scale_digest(kernel: nat.NativeKernel, x: torch.Tensor, world: int) -> None:
    words = x.numel() // 2
    want_d, want_s = (v & ((1 << 64) - 1)
                      for v in D.digest_parts(x.view(torch.int64)).tolist())
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
    kernel = nat.active_kernel()
    assert kernel is not None
    _check_scale_digest(kernel, x, world)


def test_scale_digest_does_not_depend_on_the_threads(native: None) -> None:
    kernel = nat.active_kernel()
    assert kernel is not None
    x = torch.randn(2 * (3 * nat._PER_THREAD + 77), generator=torch.Generator().manual_seed(1))
    x[123_457] = float("nan")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            _check_scale_digest(kernel, x.clone(), 3)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fallback", ["-DSDC_NO_CLONES", "-DSDC_ISA_CLONES"])
def test_the_fallback_builds_scale_and_digest_the_same(tmp_path: Path, native: None,
                                                       fallback: str) -> None:
    """The builds ``native.build`` falls back to on older compilers: one plain copy, or a
    copy per instruction set (no x86-64 levels in ``target_clones``)."""
    cc = nat._compiler()
    assert cc is not None  # the fixture built the kernel
    lib = tmp_path / "k.so"
    built = nat.compile_kernel(cc, lib, (fallback,))
    assert built.returncode == 0, built.stderr
    x = torch.randn(2 * 70_001, generator=torch.Generator().manual_seed(2))
    x[5] = float("-inf")
    plain = nat.NativeKernel(lib)
    _check_scale_digest(plain, x, 7)
    for bad in (None, 2 * 70_001 - 1):
        y = torch.randn(2 * 70_001, generator=torch.Generator().manual_seed(3))
        if bad is not None:
            y[bad] = float("nan")
        want = y.clone().mul_(1.0 / 3)
        assert plain.nonfinite_at(y.data_ptr(), y.numel()) is (bad is not None)
        assert plain.scale_check_at(y.data_ptr(), y.numel(), 1.0 / 3) is (bad is not None)
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("count", [1, 3, 9, 40])
def test_bucket_digest_is_the_same_on_the_host_and_the_tensor_path(native: None,
                                                                   count: int) -> None:
    from sdc_guard.checks.replay import BucketPlan, grads_digest

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
    plan = BucketPlan.of(buf, views, order, offsets)
    assert plan is not None
    want = int(grads_digest(grads, offsets, torch.device("cpu")))
    assert int(plan.digest(buf)) == want  # the C kernel, per span
    nat.disable_native()
    assert int(plan.digest(buf)) == want  # tensor ops: the device path


def test_scale_digest_spans_refuses_what_the_pass_cannot_fuse(native: None) -> None:
    from sdc_guard.scaling import can_fuse_digest, scale_digest_spans

    buf = torch.zeros(8)
    assert not can_fuse_digest(buf, [(2, 9, 0)])  # past the end
    with pytest.raises(ValueError, match="scale_digest_spans: needs can_fuse_digest"):
        scale_digest_spans(buf, [(2, 9, 0)], 0.5)
    assert not can_fuse_digest(torch.zeros(8, dtype=torch.float16), [(0, 2, 0)])
    assert can_fuse_digest(buf, [(0, 4, 0)])


@pytest.mark.parametrize("threads", [1, 3])
def test_scale_check_and_nonfinite_are_exact_on_every_thread(native: None, threads: int) -> None:
    kernel = nat.active_kernel()
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


def test_every_instruction_set_gives_the_same_values(native: None) -> None:
    kernel = nat.active_kernel()
    assert kernel is not None
    usable = nat.ISAS[: nat.ISAS.index(kernel.cpu_isa) + 1]
    cases = [_random_tensor(d, n, seed=n) for d in (torch.float32, torch.float64, torch.uint8)
             for n in (1, 31, 4099, (1 << 19) + 13)]
    before = kernel.isa
    seen = {}
    try:
        for name in usable:
            assert kernel.use_isa(name) == name
            seen[name] = [(int(P.tensor_value(t)), int(P.tensor_value(t, 1)),
                           D.digest_parts(t).tolist()) for t in cases]
    finally:
        kernel.use_isa(before)
    nat.disable_native()
    want = [(int(P.tensor_value(t)), int(P.tensor_value(t, 1)), D.digest_parts(t).tolist())
            for t in cases]
    assert all(v == want for v in seen.values()), [k for k, v in seen.items() if v != want]
    with pytest.raises(ValueError, match="avx2"):
        kernel.use_isa("avx1024")


def test_sdc_guard_isa_narrows_the_loops_and_a_typo_is_named(
        native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = nat.active_kernel()
    assert kernel is not None
    before = kernel.isa
    try:
        monkeypatch.setenv("SDC_GUARD_ISA", "baseline")
        assert nat.NativeKernel(kernel.path).isa == "baseline"
        monkeypatch.setenv("SDC_GUARD_ISA", "avx-2")
        with pytest.warns(RuntimeWarning, match="SDC_GUARD_ISA='avx-2'.*baseline, avx2, avx512f"):
            other = nat.NativeKernel(kernel.path)
        default = nat.ISAS[min(nat.ISAS.index(nat.DEFAULT_ISA), nat.ISAS.index(kernel.cpu_isa))]
        assert other.isa == default  # the default, AVX2 or the CPU's widest if narrower
        monkeypatch.delenv("SDC_GUARD_ISA")
        assert nat.NativeKernel(kernel.path).isa == default
        monkeypatch.setenv("SDC_GUARD_ISA", "avx512f")  # wider on request, where the CPU has it
        assert nat.NativeKernel(kernel.path).isa == kernel.cpu_isa
    finally:
        kernel.use_isa(before)


@settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # the fixture is set-up only
@given(rows=st.integers(0, 300), cols=st.integers(0, 2100), threads=st.integers(1, 4),
       bias=st.booleans(), seed=st.integers(0, 1000))
def test_the_fingerprint_pass_takes_a_weights_sums_and_its_value_is_unchanged(
        native: None, rows: int, cols: int, threads: int, bias: bool, seed: int) -> None:
    # The weights check's pass with the checksum's sums of a weight taken in the same read
    # (sdc_fp_wsum): the fingerprint is fingerprint_tensor's to the bit, on every
    # instruction set; the sums are the float64 ones within float32 rounding, and the same
    # bits from one pass to the next (what the checksum's staleness test compares).
    kernel = nat.active_kernel()
    assert kernel is not None
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g))
    b = torch.randn(rows, generator=g) if bias else None
    other = torch.randn(5, generator=g)
    tensors = [other, w, torch.randn(3, 4, generator=g, dtype=torch.float64)]
    out = torch.full((2 * cols + 2 * rows + 2,), float("nan"))
    ask = P.WeightSums(w, b, out, threads)
    before = kernel.isa
    try:
        for isa in nat.ISAS[: nat.ISAS.index(kernel.cpu_isa) + 1]:
            kernel.use_isa(isa)
            for version in (1, 2):
                ask.taken = False
                assert P.fingerprint_with_sums(tensors, [ask], version).item() == \
                    P.fingerprint_tensor(tensors, version=version).item()
                assert ask.taken
    finally:
        kernel.use_isa(before)
    wd = w.double()
    want = torch.cat([wd.sum(0), wd.abs().sum(0), wd.sum(1), wd.abs().sum(1)])
    mag = torch.cat([wd.abs().sum(0)] * 2 + [wd.abs().sum(1)] * 2)
    length = max(rows, cols) + 2
    assert bool(((out[:-2].double() - want).abs()
                 <= length * 2.0 ** -24 * 1.01 * mag + 1e-30).all())
    bd = torch.zeros(0, dtype=torch.float64) if b is None else b.double()
    assert torch.allclose(out[-2:].double(), torch.stack([bd.sum(), bd.abs().sum()]),
                          rtol=1e-5, atol=1e-5)
    again = out.clone()
    ask.take(kernel)
    assert torch.equal(again.view(torch.int32), out.view(torch.int32))


def test_the_fingerprint_pass_leaves_what_it_cannot_take(native: None) -> None:
    # A weight not among the tensors, or not a contiguous float32 matrix, is fingerprinted
    # as ever and its sums are not taken.
    w = torch.randn(6, 8)
    tensors = [w.t(), torch.randn(6, 8, dtype=torch.float64)]
    asks = [P.WeightSums(w.t(), None, torch.empty(30), 1),
            P.WeightSums(torch.randn(6, 8), None, torch.empty(30), 1),
            P.WeightSums(tensors[1], None, torch.empty(30), 1)]
    assert P.fingerprint_with_sums(tensors, asks).item() == P.fingerprint_tensor(tensors).item()
    assert not any(a.taken for a in asks)
    nat.disable_native()  # the torch path takes none either
    ok = P.WeightSums(torch.randn(6, 8), None, torch.empty(30), 1)
    assert P.fingerprint_with_sums([ok.weight], [ok]).item() == \
        P.fingerprint_tensor([ok.weight]).item()
    assert not ok.taken
