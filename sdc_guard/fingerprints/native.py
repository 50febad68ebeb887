"""The C kernel (``kernel.c`` beside this file): built on first use, loaded with ctypes.

torch has no fused position-weighted integer reduction, so the pure-torch path
reads each chunk three times (widen, row sums, column sums), where ``torch.sum``
reads it once. This kernel reads the data once, as 64-bit words: per
vector lane it keeps running sums ``P += v; Q += P`` (two additions per vector,
no multiply), from which ``sum v`` and ``sum i * v`` follow exactly modulo
2**64. Float32 and other 4-byte lanes are not widened: a word ``X`` is
``lo + 2**32 hi``, so the lanes' sums follow from those of ``X`` and of
``hi = X >> 32`` (one shift and two more additions per vector). Blocks run on up to
``torch.get_num_threads()`` threads. It computes the same values as the torch
path, bit for bit (``tests/sdc_guard/test_native.py``), so a fingerprint never depends on
which path ran.

The word loops are written once with GCC/Clang vector extensions and compiled for
each x86 instruction set (AVX-512F, AVX2, the SSE2 baseline); the widest the CPU
has up to AVX2 runs by default (``DEFAULT_ISA``: the loops wait on memory, and wider
vectors read no faster and lower the core clock on some CPUs), another on request
(``NativeKernel.use_isa``, ``SDC_GUARD_ISA=avx512f``), so that one machine can also
measure another's code. They ask for
each cache line 4 KiB before they read it (software prefetch): without it a core
alternates between waiting for memory and adding, well short of the bandwidth.

Other entry points serve the checksum check (``sdc_guard.checks.checksum``) with float32
passes: its products with ``W`` and ``|W|`` in one read, without materialising ``|W|``
(``sdc_cs_cols``, ``sdc_cs_rows``), its hooks' checks in one call each (``sdc_cs_fwd``,
``sdc_cs_bwd``, ``sdc_cs_gx``, ``sdc_cs_compare``), and the comm hook's scaling pass that
also sums the rows of the weight gradients in the bucket (``sdc_scale_rows``); float sums
in any order, which its tolerance allows. They (and the scaling and
non-finite passes) are compiled for each x86-64 level (v4, v3: with fused multiply-add,
which rounds once where a multiply then an add round twice: within the same bound).

Entry points serve the non-finite check on float32 CPU buffers too:
``sdc_scale_check`` (DDP's 1/world scaling, the bits of ``mul_``, with a NaN/Inf
flag, in one pass) and ``sdc_nonfinite`` (the flag alone, read only). Their
flags come back as Python bools: no tensor op, no host sync.

It is plain C with no dependency (not even torch's headers): the system C
compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) builds it once per machine
and source version, into a per-user cache
(``$SDC_GUARD_CACHE``, else ``$XDG_CACHE_HOME/sdc_guard``, else
``~/.cache/sdc_guard``; if that is not writable, a private ``sdc_guard-<uid>``
directory under the system temp dir). Ranks that build at the same time each write their own
file and rename it into place. The ctypes call releases the GIL. Without a
compiler (or with ``SDC_GUARD_NATIVE=0``) the torch path is used: the same
values, slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_log = logging.getLogger("sdc_guard")

_SOURCE = Path(__file__).with_name("kernel.c")
"""The kernel's C source, shipped as package data."""

ISAS = ("baseline", "avx2", "avx512f")
"""The word loops' instruction sets, narrowest first (baseline: SSE2 on x86-64)."""
DEFAULT_ISA = "avx2"
"""What runs unless ``SDC_GUARD_ISA`` asks otherwise (or the CPU's widest, if narrower).
The loops are bound by memory, not by adding: 512-bit vectors read no faster, and on
some CPUs they lower the core clock (``bench/RESULTS.md`` times every path, each forced
in turn)."""

# Below this many elements per thread, one more thread costs more than it saves.
_PER_THREAD = 1 << 18


def _refused(result: int, fn: Any, args: tuple[Any, ...]) -> int:
    """``errcheck`` of the checksum passes: their outputs are unwritten when they refuse."""
    if result != 0:
        raise ValueError(f"{fn.__name__}: refused its arguments (a negative size, a row "
                         f"stride below the columns, more than 2 vectors, or ones mixed with "
                         f"vectors); got {args[1:4]} and k, ka = {args[6]}, {args[9]}")
    return result


def _count(result: int, fn: Any, args: tuple[Any, ...]) -> int:
    """``errcheck`` of the checksum hooks' calls, which return a count of failing entries."""
    if result < 0:
        raise ValueError(f"{fn.__name__}: refused its arguments (a negative size or a row "
                         f"stride below the columns); got sizes {args[1:4]}")
    return result


class NativeKernel:
    """The loaded library: ``weighted_sum`` on a contiguous 1-D CPU tensor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # CDLL: calls release the GIL
        fn = self._lib.sdc_weighted_sum
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(ctypes.c_uint64)]
        fn.restype = ctypes.c_int
        self._fn = fn
        fused = self._lib.sdc_scale_digest
        fused.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                          ctypes.POINTER(ctypes.c_uint64)]
        fused.restype = ctypes.c_int
        self._fused = fused
        scale_check = self._lib.sdc_scale_check
        scale_check.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        scale_check.restype = ctypes.c_int
        self._scale_check = scale_check
        nonfinite = self._lib.sdc_nonfinite
        nonfinite.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        nonfinite.restype = ctypes.c_int
        self._nonfinite = nonfinite
        P, N, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        cols = self._lib.sdc_cs_cols
        cols.argtypes = [P, N, N, N, P, P, C, P, P, C, P, P, P, P, C, C]
        cols.restype = C
        cols.errcheck = _refused  # type: ignore[assignment]
        self.cs_cols = cols
        """``sdc_cs_cols`` (``kernel.c``): ``s_p (+)= u_p^T A``, ``b_p (+)= a_p^T |A|`` in one pass
        over a float32 matrix (the checksum check's products with ``W`` and ``GY``)."""
        rows = self._lib.sdc_cs_rows
        rows.argtypes = [P, N, N, N, P, P, C, P, P, C, P, P, P, P, C]
        rows.restype = C
        rows.errcheck = _refused  # type: ignore[assignment]
        self.cs_rows = rows
        """``sdc_cs_rows``: ``r_p[i] = v_p . A[i]``, ``ra_p[i] = va_p . |A[i]|`` per row."""
        D = ctypes.c_double
        fwd = self._lib.sdc_cs_fwd
        fwd.argtypes = [P, N, N, N, P, N, N, P, N, P, P, P, C, P, C, D, C, C, C, C]
        fwd.restype = N
        fwd.errcheck = _count  # type: ignore[assignment]
        self.cs_fwd = fwd
        """``sdc_cs_fwd``: the checksum check's forward hook in one call (the weight's sums
        once per version; the row sums of ``X``, ``|X|`` and ``Y`` and the forward's two
        sides, compared): how many forward entries fail."""
        bwd = self._lib.sdc_cs_bwd
        bwd.argtypes = [P, N, N, N, P, P, P, P, P, C, C, C, P, P, N, N, D, C, C, C]
        bwd.restype = N
        bwd.errcheck = _count  # type: ignore[assignment]
        self.cs_bwd = bwd
        """``sdc_cs_bwd``: its backward hook in one call (one pass over ``GY`` for both
        gradients' right-hand sides, then ``GX``'s row sums compared): how many
        input-gradient entries fail."""
        gx = self._lib.sdc_cs_gx
        gx.argtypes = [P, N, N, N, P, D, C, C]
        gx.restype = N
        gx.errcheck = _count  # type: ignore[assignment]
        self.cs_gx = gx
        """``sdc_cs_gx``: the input-gradient check alone, for a ``GX`` that arrives after
        ``GY`` (a hook on the input): how many entries fail."""
        fp_wsum = self._lib.sdc_fp_wsum
        fp_wsum.argtypes = [P, N, N, P, P, P, C, ctypes.POINTER(ctypes.c_uint64)]
        fp_wsum.restype = C
        self._fp_wsum = fp_wsum
        compare = self._lib.sdc_cs_compare
        compare.argtypes = [P, P, P, N, ctypes.c_double, ctypes.c_double, ctypes.c_double, C]
        compare.restype = N
        self.cs_compare = compare
        """``sdc_cs_compare``: how many entries fail ``|lhs - rhs| <= bound * tol``."""
        scale_rows = self._lib.sdc_scale_rows
        scale_rows.argtypes = [P, N, ctypes.c_float, P, C, C]
        scale_rows.restype = C
        self._scale_rows = scale_rows
        isa = self._lib.sdc_isa
        isa.argtypes = [ctypes.c_int]
        isa.restype = ctypes.c_int
        self._isa = isa
        self.cpu_isa = ISAS[isa(-2)]
        """The widest instruction set this CPU gives the word loops."""
        wanted = os.environ.get("SDC_GUARD_ISA")
        self.use_isa(wanted if wanted in ISAS else DEFAULT_ISA)
        if wanted and wanted not in ISAS:  # a typo must not cost the kernel: say so
            warnings.warn(f"SDC_GUARD_ISA={wanted!r} is not an instruction set; set it to one of "
                          f"{', '.join(ISAS)} (or unset it). Using {self.isa}.", RuntimeWarning,
                          stacklevel=2)

    @property
    def isa(self) -> str:
        """The instruction set the fingerprint and digest loops run on: one of ``ISAS``."""
        return ISAS[self._isa(-1)]

    def use_isa(self, name: str) -> str:
        """Run the word loops on ``name`` (``ISAS``), or on this CPU's widest if narrower.

        Values are the same on every one; only the speed differs. For measuring a
        narrower machine's code on this one (``SDC_GUARD_ISA=avx2`` does it at load).
        Returns the instruction set now in use.
        """
        if name not in ISAS:
            raise ValueError(f"instruction set {name!r}: use one of {', '.join(ISAS)}")
        return ISAS[self._isa(ISAS.index(name))]

    def weighted_sum(self, src: torch.Tensor, mode: int) -> list[int]:
        """int64 bits of ``[sum_k (2k+1) v_k, sum_k v_k]`` (mod 2**64).

        ``mode`` 0: ``src`` is int32 (uint32 lanes); 1 and 2: int64 words, mapped to
        ``X ^ (X >>> 32)`` or taken as they are.
        """
        want = torch.int32 if mode == 0 else torch.int64
        if (src.device.type != "cpu" or src.dim() != 1 or not src.is_contiguous()
                or src.dtype != want or mode not in (0, 1, 2)):
            raise ValueError(f"weighted_sum: needs a contiguous 1-D CPU {want} tensor for mode "
                             f"{mode}; got {src.dtype} {list(src.shape)} on {src.device}.")
        return [v - (1 << 64) if v >= 1 << 63 else v
                for v in self.words_at(src.data_ptr(), src.numel(), mode)]

    def words_at(self, address: int, n: int, mode: int) -> tuple[int, int]:
        """Unsigned ``(sum_k (2k+1) v_k, sum_k v_k)`` of ``n`` elements at ``address``.

        The caller guarantees the memory: ``n`` int32 lanes (mode 0) or int64 words
        (modes 1, 2) of a live CPU tensor, 8-byte aligned for the words.
        """
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        out = (ctypes.c_uint64 * 2)()
        if self._fn(address, n, mode, threads, out) != 0:  # pragma: no cover
            raise RuntimeError("sdc_weighted_sum rejected its arguments")
        return out[0], out[1]

    def scale_digest_at(self, address: int, n: int, scale: float) -> tuple[int, int, bool]:
        """``words_at(address, n, 2)`` of ``n`` 64-bit words as they were, then their
        ``2n`` float32 halves multiplied by ``scale`` in place (the bits of torch's
        ``mul_``): ``(digest, sum, any half was NaN or Inf)``, in one pass over memory.

        The caller guarantees the memory: ``n`` writable, 8-byte aligned words of a
        live float32 CPU tensor.
        """
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        out = (ctypes.c_uint64 * 3)()
        if self._fused(address, n, scale, threads, out) != 0:  # pragma: no cover
            raise RuntimeError("sdc_scale_digest rejected its arguments")
        return out[0], out[1], bool(out[2])

    def scale_check_at(self, address: int, n: int, scale: float) -> bool:
        """``n`` float32 at ``address`` multiplied by ``scale`` in place (the bits of torch's
        ``mul_``); whether any of them was NaN or Inf. One pass over memory.

        The caller guarantees the memory: ``n`` writable float32 of a live CPU tensor.
        """
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        bad = self._scale_check(address, n, scale, threads)
        if bad < 0:  # pragma: no cover
            raise RuntimeError("sdc_scale_check rejected its arguments")
        return bool(bad)

    def scale_rows_at(self, address: int, n: int, scale: float,
                      blocks: list[tuple[int, int, int, int]]) -> bool:
        """``scale_check_at`` that also writes the row sums (as they were) of some matrices
        in the ``n`` float32 at ``address``: ``blocks`` holds (offset in floats, rows, cols,
        address of ``rows`` float32 outputs), in increasing offset, not overlapping, inside.
        One pass over memory; whether any float was NaN or Inf.

        The caller guarantees the memory: ``n`` writable float32 of a live CPU tensor, and
        live float32 outputs.
        """
        return self.scale_rows_blocks(address, n, scale, self.row_blocks(blocks))

    @staticmethod
    def row_blocks(blocks: list[tuple[int, int, int, int]]) -> Any:
        """``scale_rows_at``'s blocks in the C call's form (kept by a caller that repeats it)."""
        return ((ctypes.c_int64 * (4 * len(blocks)))(*(v for b in blocks for v in b)),
                len(blocks))

    def scale_rows_blocks(self, address: int, n: int, scale: float, blocks: Any) -> bool:
        """``scale_rows_at`` with its blocks from ``row_blocks``."""
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        bad = self._scale_rows(address, n, scale, blocks[0], blocks[1], threads)
        if bad < 0:
            raise ValueError("sdc_scale_rows: blocks must lie inside the buffer, in increasing "
                             "offset, without overlapping")
        return bool(bad)

    def fp_wsum_at(self, address: int, rows: int, cols: int, bias: int | None, wsum: int,
                   bsum: int, threads: int) -> int:
        """``words_at(address, rows * cols, 0)[0]`` of a contiguous float32 matrix, and the
        checksum check's sums of it in the same read (``sdc_fp_wsum``): ``wsum`` gets
        ``[e^T W, e^T |W|, W e, |W| e]`` (``2 cols + 2 rows`` float32), ``bsum`` the sum and
        absolute sum of the ``rows`` float32 at ``bias`` (None: no bias, zeros). The sums'
        bits are the same from one call to the next with the same ``threads``.

        The caller guarantees the memory: live float32 CPU tensors of those sizes.
        """
        out = (ctypes.c_uint64 * 2)()
        if self._fp_wsum(address, rows, cols, bias, wsum, bsum, threads, out) != 0:
            raise RuntimeError("sdc_fp_wsum rejected its arguments (or found no memory for "
                               "its threads' column sums)")
        return int(out[0])

    @staticmethod
    def threads_for(n: int) -> int:
        """The threads a pass over ``n`` elements takes (the word loops' rule)."""
        return max(1, min(torch.get_num_threads(), n // _PER_THREAD))

    def nonfinite_at(self, address: int, n: int) -> bool:
        """Whether any of ``n`` float32 at ``address`` (a live CPU tensor's) is NaN or Inf."""
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        bad = self._nonfinite(address, n, threads)
        if bad < 0:  # pragma: no cover
            raise RuntimeError("sdc_nonfinite rejected its arguments")
        return bool(bad)


def _cache_dir() -> Path:
    env = os.environ.get("SDC_GUARD_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sdc_guard"


def _private_tmp_dir() -> Path:
    """A per-user directory under the system temp dir, for when the cache is not writable.

    Created with mode 0700; refused if it exists but belongs to someone else or is
    open to others (a shared temp dir must not hand us someone else's library).
    """
    uid = os.getuid() if hasattr(os, "getuid") else None
    d = Path(tempfile.gettempdir()) / f"sdc_guard-{uid if uid is not None else 'user'}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
    if (uid is not None and st.st_uid != uid) or st.st_mode & 0o077:
        raise RuntimeError(f"{d} is not private to this user; set $SDC_GUARD_CACHE")
    return d


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread")


def build(directory: Path | None = None) -> Path:
    """Compile the kernel (or find it already built); the path of the shared library.

    Raises ``RuntimeError`` naming the reason when there is no compiler or the build fails.
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc, gcc or clang)")
    source = _SOURCE.read_text()
    key = hashlib.sha256("\0".join([source, cc, *_FLAGS, platform.machine(),
                                    platform.system()]).encode()).hexdigest()[:16]
    directory = directory or _cache_dir()
    target = directory / f"weighted_sum-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    src = Path(tmp[: -len(".so")] + ".c")
    try:
        src.write_text(source)
        # A compiler without the x86-64 levels in target_clones: a copy per instruction
        # set; without target_clones: one plain copy.
        for extra in ((), ("-DSDC_ISA_CLONES",), ("-DSDC_NO_CLONES",)):
            proc = subprocess.run([cc, *_FLAGS, *extra, "-o", tmp, str(src)],
                                  capture_output=True, text=True, timeout=120, check=False)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: ranks building at once never see a partial file
    finally:
        src.unlink(missing_ok=True)
        Path(tmp).unlink(missing_ok=True)
    return target


_kernel: NativeKernel | None = None
_error: str | None = None
_tried = False
_warned = False


def load(*, warn: bool = True) -> NativeKernel | None:
    """The kernel, built on the first call, or ``None`` when it cannot be (tried once).

    ``warn``: say why with a ``RuntimeWarning``, once (else a log record of level INFO).
    """
    global _kernel, _error, _tried, _warned
    if not _tried:
        _tried = True
        try:
            try:
                path = build()
            except OSError as unwritable:  # a read-only home, say: a private temp dir
                try:
                    path = build(_private_tmp_dir())
                except Exception as e:
                    raise RuntimeError(f"the cache {_cache_dir()} is not writable "
                                       f"({unwritable}), nor is a temp dir ({e})") from e
            _kernel = NativeKernel(path)
        except Exception as e:  # no compiler, a failed build, nowhere to write, ...
            _error = f"{type(e).__name__}: {e}"[:600]
    if _kernel is None and _error is not None:
        message = (f"sdc_guard: the native fingerprint kernel could not be built ({_error}); "
                   "using the torch implementation (the same values, about 3x slower).")
        if warn and not _warned:
            _warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        elif not warn:
            _log.info(message)
    return _kernel


_native: NativeKernel | None = None
"""The kernel in use (None: the torch path), once resolved."""
_native_resolved = False


def active_kernel() -> NativeKernel | None:
    """The C kernel if in use, built on the first call, else None.

    On by default wherever a C compiler can build it; ``SDC_GUARD_NATIVE=0`` turns it
    off and ``SDC_GUARD_NATIVE=1`` warns when it cannot be built (the default only logs).
    """
    global _native, _native_resolved
    if not _native_resolved:
        _native_resolved = True
        setting = os.environ.get("SDC_GUARD_NATIVE", "")
        if setting != "0":
            _native = load(warn=setting == "1")
    return _native


def enable_native() -> bool:
    """Use the C kernel (building it now if needed); True if in use, else a warning says why.

    Fingerprints are identical either way; only the speed differs.
    """
    global _native, _native_resolved
    _native = load(warn=True)
    _native_resolved = True
    return _native is not None


def disable_native() -> None:
    """Use the pure-torch implementation until ``enable_native`` is called."""
    global _native, _native_resolved
    _native = None
    _native_resolved = True


def native_enabled() -> bool:
    """Does a CPU fingerprint run on the C kernel (building it if this is the first ask)?"""
    return active_kernel() is not None



@contextlib.contextmanager
def native_kernel(enabled: bool) -> Iterator[bool]:
    """Within the block, use the C kernel (``True``) or the pure-torch path (``False``).

    Yields whether the C kernel is in use inside the block (``native_kernel(True)``
    yields False where it cannot be built). Results are identical either way; only
    the speed differs. The previous choice is restored on exit. Not thread-safe:
    switch before training starts, not while a step runs.
    """
    global _native, _native_resolved
    saved = _native, _native_resolved
    try:
        if enabled:
            enable_native()
        else:
            disable_native()
        yield _native is not None
    finally:
        _native, _native_resolved = saved


if os.environ.get("SDC_GUARD_NATIVE") == "1":
    enable_native()  # build now, and warn now if it cannot be built
