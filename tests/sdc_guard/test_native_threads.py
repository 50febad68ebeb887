"""The C kernel's passes on torch's OpenMP pool or on threads of their own: the same values
to the bit, the very libgomp torch loaded, and a clean fallback where OpenMP is not to be had."""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sdc_guard.fingerprints import native as nat


def _kernels() -> Iterator[nat.NativeKernel]:
    """The two builds of the shipped sources: on torch's OpenMP pool, and on threads of
    their own (``SDC_GUARD_THREADS=pthreads``)."""
    if nat._compiler() is None:
        pytest.skip("no C compiler here")
    libgomp, why = nat.torch_libgomp()
    if libgomp is None:
        pytest.skip(f"no OpenMP build here: {why}")
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv(nat.THREADS_ENV, raising=False)
        path, why = nat._build()
        assert why == "", why
        yield nat.NativeKernel(path)
        mp.setenv(nat.THREADS_ENV, "pthreads")
        path, why = nat._build()
        assert why == f"{nat.THREADS_ENV}=pthreads"
        yield nat.NativeKernel(path, why)
    finally:
        mp.undo()


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).tolist()


def _every_entry_point(kernel: nat.NativeKernel) -> list[object]:
    """What each entry point gives on inputs split over 3 jobs (more than the 2 cores, and
    the word loops' 3 * 2**18 elements), as ints and float bits."""
    g = torch.Generator().manual_seed(61)
    n = 3 * (1 << 18) + 4099
    x = torch.randn(n, generator=g) * 1e3
    x[n - 5] = float("nan")
    out: list[object] = []
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for mode in (0, 1, 2):
            count = n if mode == 0 else n // 2
            out.append(kernel.words_at(x.data_ptr(), count, mode))
        y = x.clone()
        out += [kernel.scale_digest_at(y.data_ptr(), n // 2, 1 / 3), _bits(y)]
        y = x.clone()
        out += [kernel.scale_check_at(y.data_ptr(), n, 1 / 7), _bits(y),
                kernel.nonfinite_at(x.data_ptr(), n)]
        rows = [torch.full((600,), float("nan")), torch.full((40,), float("nan"))]
        blocks = [(100, 600, 300, rows[0].data_ptr()), (200_000, 40, 7, rows[1].data_ptr())]
        y = x.clone()
        out += [kernel.scale_rows_at(y.data_ptr(), n, 0.5, blocks), _bits(y),
                *map(_bits, rows)]
    finally:
        torch.set_num_threads(saved)
    w = torch.randn(700, 1500, generator=g)
    b = torch.randn(700, generator=g)
    wsum = torch.full((2 * 1500 + 2 * 700,), float("nan"))
    bsum = torch.full((2,), float("nan"))
    out += [kernel.fp_wsum_at(W=w.data_ptr(), rows=700, cols=1500, bias=b.data_ptr(),
                              wsum=wsum.data_ptr(), bsum=bsum.data_ptr(), threads=3),
            _bits(wsum), _bits(bsum)]
    u = [torch.randn(700, generator=g) for _ in range(4)]
    s = [torch.full((1500,), float("nan")) for _ in range(4)]
    kernel.cs_cols(A=w.data_ptr(), rows=700, cols=1500, ld=1500, k=2, ka=2,
                   u0=u[0].data_ptr(), u1=u[1].data_ptr(), a0=u[2].data_ptr(),
                   a1=u[3].data_ptr(), s0=s[0].data_ptr(), s1=s[1].data_ptr(),
                   b0=s[2].data_ptr(), b1=s[3].data_ptr(), threads=3)
    r = [torch.full((700,), float("nan")) for _ in range(2)]
    kernel.cs_rows(A=w.data_ptr(), n=700, cols=1500, ld=1500, k=1, ka=1, r0=r[0].data_ptr(),
                   ra0=r[1].data_ptr(), threads=3)
    out += [*map(_bits, s), *map(_bits, r)]
    xs = torch.randn(500, 1500, generator=g)
    ys = torch.addmm(b, xs, w.t())
    fw_wsum = torch.full((2 * 1500 + 2 * 700 + 2,), float("nan"))
    res = torch.full((5 * 500,), float("nan"))
    bad = kernel.cs_fwd(nat.CsFwdArgs(
        X=xs.data_ptr(), n=500, inner=1500, ldx=1500, Y=ys.data_ptr(), out=700, ldy=700,
        W=w.data_ptr(), bias=b.data_ptr(), wsum=fw_wsum.data_ptr(),
        bsum=fw_wsum.data_ptr() + 4 * (2 * 1500 + 2 * 700), w_fresh=1, res=res.data_ptr(),
        check=1, tol=1e-3, finite_only=0, threads_x=3, threads_y=3, threads_w=3))
    out += [bad, _bits(fw_wsum), _bits(res)]
    return out


def test_the_openmp_and_the_pthreads_builds_give_the_same_bits() -> None:
    # Each job computes the same sums whichever thread runs it, and the jobs are combined in
    # job order: torch's pool or threads of their own, the values are the same to the bit.
    openmp, own = _kernels()
    assert openmp.threading.startswith("openmp (torch's libgomp at ")
    assert own.threading == f"pthreads ({nat.THREADS_ENV}=pthreads)"
    torch.ones(1 << 20).sum()  # torch's pool started, its workers spinning
    assert _every_entry_point(openmp) == _every_entry_point(own)


def _mapped(predicate: str) -> set[str]:
    return {fields[5] for fields in (line.split(None, 5)
                                     for line in Path("/proc/self/maps").read_text().splitlines())
            if len(fields) == 6 and predicate in Path(fields[5]).name}


def test_the_openmp_build_runs_on_the_libgomp_torch_loaded() -> None:
    openmp, _ = _kernels()
    t = torch.randn(1 << 20)
    t.sum()
    openmp.words_at(t.data_ptr(), t.numel(), 0)
    # One OpenMP runtime in the process, the file next to torch's own libraries (what
    # libtorch_cpu resolves through its $ORIGIN run path), named in the kernel's threading.
    mapped = _mapped("gomp") | _mapped("libomp") | _mapped("iomp")
    assert len(mapped) == 1, mapped
    torch_dir = Path(torch.__file__).parent / "lib"
    shipped = list(torch_dir.glob("libgomp*.so*"))
    loaded = Path(mapped.pop())
    if shipped:
        assert any(os.path.samefile(loaded, p) for p in shipped), (loaded, shipped)
    assert openmp.threading == f"openmp (torch's libgomp at {loaded})"


def test_a_forked_process_runs_the_passes_on_threads_of_its_own() -> None:
    # libgomp's pool does not survive a fork (a parallel region in the child would wait
    # for workers that were not copied): there the kernel starts threads of its own.
    openmp, _ = _kernels()
    t = torch.randn(1 << 21)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = openmp.words_at(t.data_ptr(), t.numel(), 0)  # the pool in use before the fork
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                got = openmp.words_at(t.data_ptr(), t.numel(), 0)
                os.write(write, f"{got[0]} {got[1]} {openmp.threading}".encode())
            finally:
                os._exit(0)
    finally:
        torch.set_num_threads(saved)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        reply = os.read(read, 4096).decode() if ready else ""
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert reply, "the forked child's pass did not return within 60 s"
    s1, s2, threading = reply.split(" ", 2)
    assert (int(s1), int(s2)) == want
    assert threading.startswith("pthreads (a process forked")


def _compiler_without_openmp(tmp_path: Path) -> Path:
    """A C compiler that fails on ``-fopenmp`` (and logs each call that asks for it)."""
    cc = nat._compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    real = shutil.which(cc)
    script = tmp_path / "cc-without-openmp"
    script.write_text("#!/bin/sh\n"
                      "for a in \"$@\"; do\n"
                      f"  if [ \"$a\" = -fopenmp ]; then echo x >> {tmp_path}/asked;"
                      " echo 'cc: error: no OpenMP here' >&2; exit 1; fi\n"
                      "done\n"
                      f"exec {real} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_compiler_that_fails_with_fopenmp_gives_the_pthreads_build_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    libgomp, why = nat.torch_libgomp()
    if libgomp is None:
        pytest.skip(f"no OpenMP build here: {why}")
    monkeypatch.setenv("CC", str(_compiler_without_openmp(tmp_path)))
    monkeypatch.setenv("SDC_GUARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(nat.THREADS_ENV, raising=False)
    monkeypatch.setattr(nat, "_tried", False)
    monkeypatch.setattr(nat, "_kernel", None)
    caplog.set_level(logging.INFO, logger="sdc_guard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # by default a log record, no warning
        kernel = nat.load(warn=False)
    assert kernel is not None
    assert kernel.threading.startswith("pthreads (") and "no OpenMP here" in kernel.threading
    assert any("threads of its own" in r.getMessage() and "no OpenMP here" in r.getMessage()
               for r in caplog.records)
    tries = (tmp_path / "asked").read_text().count("x")
    assert tries >= 1
    t = torch.randn(1 << 20)
    assert kernel.words_at(t.data_ptr(), t.numel(), 0)[1] == \
        int(t.view(torch.int32).to(torch.int64).bitwise_and(0xFFFFFFFF).sum()) % (1 << 64)
    # Remembered: the next load takes the pthreads build without trying -fopenmp again,
    # and with SDC_GUARD_THREADS=openmp it warns.
    monkeypatch.setenv(nat.THREADS_ENV, "openmp")
    monkeypatch.setattr(nat, "_tried", False)
    monkeypatch.setattr(nat, "_kernel", None)
    with pytest.warns(RuntimeWarning, match="no OpenMP here"):
        again = nat.load(warn=False)
    assert again is not None and again.path == kernel.path
    assert (tmp_path / "asked").read_text().count("x") == tries


def test_a_typo_in_sdc_guard_threads_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nat.THREADS_ENV, "omp")
    with pytest.warns(RuntimeWarning, match=r"SDC_GUARD_THREADS='omp': set it to openmp or "
                                            r"pthreads"):
        nat._openmp_plan()


def test_the_cache_key_covers_the_threads_and_the_libgomp() -> None:
    keys = {nat.cache_key("cc"), nat.cache_key("cc", "openmp:/a/libgomp.so.1"),
            nat.cache_key("cc", "openmp:/b/libgomp.so.1")}
    assert len(keys) == 3
    assert nat.cache_key("cc") == nat.cache_key("cc", "pthreads")


def test_the_pool_serves_a_pass_while_torch_runs_one_on_another_thread() -> None:
    # A pass called from a thread that is not torch's (a comm hook's, a watchdog's) gets a
    # team of its own from libgomp, while torch's parallel ops run on the main thread.
    import threading

    openmp, _ = _kernels()
    t = torch.randn(1 << 21)
    want = openmp.words_at(t.data_ptr(), t.numel(), 0)
    got: list[tuple[int, int]] = []
    stop = time.monotonic() + 2

    def passes() -> None:
        while time.monotonic() < stop and len(got) < 20:
            got.append(openmp.words_at(t.data_ptr(), t.numel(), 0))

    worker = threading.Thread(target=passes)
    worker.start()
    while worker.is_alive():
        t.sum()
    worker.join()
    assert got and set(got) == {want}
