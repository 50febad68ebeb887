"""The C kernel (the sources in ``kernel/`` beside this file): built on first use into one
shared library, loaded with ctypes.

torch has no fused position-weighted integer reduction, so the pure-torch path
reads each chunk three times (widen, row sums, column sums), where ``torch.sum``
reads it once. This kernel reads the data once, as 64-bit words: per
vector lane it keeps running sums ``P += v; Q += P`` (two additions per vector,
no multiply), from which ``sum v`` and ``sum i * v`` follow exactly modulo
2**64. Float32 and other 4-byte lanes are not widened: a word ``X`` is
``lo + 2**32 hi``, so the lanes' sums follow from those of ``X`` and of
``hi = X >> 32`` (one shift and two more additions per vector). Blocks run on up to
``torch.get_num_threads()`` threads: those of torch's own OpenMP pool where the kernel can
be built with ``-fopenmp`` against the libgomp torch loaded, else threads of its own
(``NativeKernel.threading`` says which; ``SDC_GUARD_THREADS=pthreads`` forces the latter).
Right after a parallel torch op, torch's OpenMP workers spin for a while waiting for the next
parallel region: a pass on that pool is one, where threads of its own would share the cores
with them. It computes the same values as the torch
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

The sources are split by owner (``kernel/common.h`` lists them): ``fingerprint.c`` (the
fingerprint's and the replay digest's word sums), ``scaling.c`` (the comm hook's scaling
pass), ``checksum.c`` (the checksum check's passes), ``sketch.c`` (the tolerant replay
audit's gradient sketch, ``sdc_sketch``: a float32 gradient's norm and projections in one
read; ``sdc_sketch_distance``: two sketches' distance), ``threads.c``. An entry point with a
long list of arguments takes a pointer to an argument struct declared in ``common.h`` and
mirrored here field for field (``CsColsArgs``, ``CsRowsArgs``, ``CsFwdArgs``,
``CsBwdArgs``): built with keyword arguments, and for the checksum's hooks built once per
plan and kept by the caller, which sets only the fields a call changes. The checksum's
entry points are methods of ``NativeKernel`` with keyword-only arguments, or taking their
struct (``cs_fwd``, ``cs_bwd``: the hooks' calls).

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

_KERNEL = Path(__file__).with_name("kernel")
"""The kernel's C sources (``common.h`` and a ``.c`` file per owner), shipped as package
data and compiled together into one shared library."""


def sources(directory: Path | None = None) -> list[Path]:
    """The kernel's source files (``.c`` and ``.h``) in ``directory`` (default: the shipped
    ones), in a fixed order: what the build compiles and what its cache key covers."""
    return sorted(p for p in (directory or _KERNEL).iterdir() if p.suffix in (".c", ".h"))

ISAS = ("baseline", "avx2", "avx512f")
"""The word loops' instruction sets, narrowest first (baseline: SSE2 on x86-64)."""
DEFAULT_ISA = "avx2"
"""What runs unless ``SDC_GUARD_ISA`` asks otherwise (or the CPU's widest, if narrower).
The loops are bound by memory, not by adding: 512-bit vectors read no faster, and on
some CPUs they lower the core clock (``bench/RESULTS.md`` times every path, each forced
in turn)."""

# Below this many elements per thread, one more thread costs more than it saves.
_PER_THREAD = 1 << 18


_P, _N, _C, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double


def _refused(name: str, sizes: tuple[int, ...], k: int, ka: int) -> ValueError:
    """The error of a checksum pass that refused its arguments (its outputs are unwritten)."""
    return ValueError(f"{name}: refused its arguments (a negative size, a row stride below the "
                      f"columns, more than 2 vectors, or ones mixed with vectors); got "
                      f"{sizes} and k, ka = {k}, {ka}")


def _count_refused(name: str, sizes: tuple[int, ...]) -> ValueError:
    """The error of a checksum hook's call that refused its arguments."""
    return ValueError(f"{name}: refused its arguments (a negative size or a row stride below "
                      f"the columns); got sizes {sizes}")


class CsColsArgs(ctypes.Structure):
    """``sdc_cs_cols_args`` (``kernel/common.h``): over ``A`` (``rows x cols``, row stride
    ``ld``), ``s_p (+)= u_p^T A`` for ``p < k`` and ``b_p (+)= a_p^T |A|`` for ``p < ka``
    (an address of None: a vector of ones); bit ``p`` of ``acc_mask`` adds to ``s_p`` what
    it holds, bit ``2 + p`` to ``b_p`` (else overwritten)."""

    _fields_ = [("A", _P), ("rows", _N), ("cols", _N), ("ld", _N), ("u0", _P), ("u1", _P),
                ("k", _C), ("a0", _P), ("a1", _P), ("ka", _C), ("s0", _P), ("s1", _P),
                ("b0", _P), ("b1", _P), ("acc_mask", _C), ("threads", _C)]
    A: int | None
    rows: int
    cols: int
    ld: int
    k: int
    ka: int


class CsRowsArgs(ctypes.Structure):
    """``sdc_cs_rows_args``: over the ``n`` rows of ``A`` (``n x cols``, row stride ``ld``),
    ``r_p[i] = v_p . A[i]`` for ``p < k`` and ``ra_p[i] = va_p . |A[i]|`` for ``p < ka``
    (every ``v_p`` None, meaning ones, or none; likewise ``va_p``; or, with ``k = ka = 2``,
    the first of each None and the second not)."""

    _fields_ = [("A", _P), ("n", _N), ("cols", _N), ("ld", _N), ("v0", _P), ("v1", _P),
                ("k", _C), ("va0", _P), ("va1", _P), ("ka", _C), ("r0", _P), ("r1", _P),
                ("ra0", _P), ("ra1", _P), ("threads", _C)]
    A: int | None
    n: int
    cols: int
    ld: int
    k: int
    ka: int


class CsFwdArgs(ctypes.Structure):
    """``sdc_cs_fwd_args``: the checksum check's forward hook of ``Y = X W^T + b`` in one
    call (``X``: ``n x inner``, row stride ``ldx``; ``Y``: ``n x out``, ``ldy``). With
    ``w_fresh``, first the weight's pass over ``W`` (``out x inner``, ``ldw``; ``bias``:
    ``out`` floats or None) on ``threads_w`` threads: ``wsum = [e^T W, e^T |W|, W e,
    |W| e]``, ``bsum`` = the bias's sum and absolute sum. ``res`` (``5 n`` floats) gets
    ``[X e, |X| e, Y e, X (e^T W)^T, |X| (e^T |W|)^T]``; with ``check``, the forward
    identity compared within ``tol`` (``finite_only``: only a finite difference fails).

    Built once per plan of a layer's call (``sdc_guard.checks.checksum.state.Plan``); a
    call sets ``X``, ``Y`` and the weight's fields."""

    _fields_ = [("X", _P), ("n", _N), ("inner", _N), ("ldx", _N), ("Y", _P), ("out", _N),
                ("ldy", _N), ("W", _P), ("ldw", _N), ("bias", _P), ("w_fresh", _C),
                ("threads_w", _C), ("wsum", _P), ("bsum", _P), ("res", _P), ("check", _C),
                ("finite_only", _C), ("tol", _D), ("threads_x", _C), ("threads_y", _C)]
    X: int | None
    n: int
    inner: int
    ldx: int
    Y: int | None
    out: int
    ldy: int
    W: int | None
    ldw: int
    bias: int | None
    w_fresh: int
    threads_w: int
    wsum: int | None
    bsum: int | None
    res: int | None
    check: int
    finite_only: int
    tol: float
    threads_x: int
    threads_y: int

    def __init__(self, *, n: int, inner: int, ldx: int, out: int, ldy: int, wsum: int,
                 bsum: int, res: int, check: int, finite_only: int, tol: float,
                 threads_x: int = 1, threads_y: int = 1, X: int | None = None,
                 Y: int | None = None, W: int | None = None, ldw: int | None = None,
                 bias: int | None = None, w_fresh: int = 0, threads_w: int = 1) -> None:
        super().__init__(X, n, inner, ldx, Y, out, ldy, W, inner if ldw is None else ldw, bias,
                         w_fresh, threads_w, wsum, bsum, res, check, finite_only, tol,
                         threads_x, threads_y)


class CsBwdArgs(ctypes.Structure):
    """``sdc_cs_bwd_args``: the backward hook of that call, given ``GY`` (``n x out``,
    ``ldg``), ``wr = W e`` and ``war = |W| e`` (the forward's ``wsum``) and
    ``x_rows = [X e, |X| e]`` (its ``res``). ``gx_side``: ``gxs[0, n) = GY wr`` and
    ``gxs[n, 2n) = |GY| war``; ``gw``: ``gw_rhs (+)= GY^T (X e)``,
    ``gw_bound (+)= |GY|^T (|X| e)`` (``gw_add``: added to what they hold). Then, with
    ``GX`` (``n x inner``, ``ldx``; None: it comes later, ``NativeKernel.cs_gx``),
    ``gxs[2n, 3n) = GX e`` compared within the bound times ``tol``.

    Built once per plan of a layer's call (``state.BackwardPlan``); a call sets ``GY``,
    ``ldg``, ``GX``, ``ldx`` and the products' fields."""

    _fields_ = [("GY", _P), ("n", _N), ("out", _N), ("ldg", _N), ("wr", _P), ("war", _P),
                ("x_rows", _P), ("gw_rhs", _P), ("gw_bound", _P), ("gw", _C), ("gw_add", _C),
                ("gx_side", _C), ("gxs", _P), ("GX", _P), ("inner", _N), ("ldx", _N),
                ("tol", _D), ("finite_only", _C), ("threads_g", _C), ("threads_x", _C)]
    GY: int | None
    n: int
    out: int
    ldg: int
    wr: int | None
    war: int | None
    x_rows: int | None
    gw_rhs: int | None
    gw_bound: int | None
    gw: int
    gw_add: int
    gx_side: int
    gxs: int | None
    GX: int | None
    inner: int
    ldx: int
    tol: float
    finite_only: int
    threads_g: int
    threads_x: int

    def __init__(self, *, n: int, out: int, inner: int, wr: int, war: int, x_rows: int,
                 gxs: int, tol: float, finite_only: int, threads_g: int = 1,
                 threads_x: int = 1, GY: int | None = None, ldg: int | None = None,
                 GX: int | None = None, ldx: int | None = None, gw_rhs: int | None = None,
                 gw_bound: int | None = None, gw: int = 0, gw_add: int = 0,
                 gx_side: int = 0) -> None:
        super().__init__(GY, n, out, out if ldg is None else ldg, wr, war, x_rows, gw_rhs,
                         gw_bound, gw, gw_add, gx_side, gxs, GX, inner,
                         inner if ldx is None else ldx, tol, finite_only, threads_g, threads_x)


class NativeKernel:
    """The loaded library: ``weighted_sum`` on a contiguous 1-D CPU tensor."""

    def __init__(self, path: Path, why_pthreads: str = "") -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # CDLL: calls release the GIL
        threading = self._lib.sdc_threading
        threading.argtypes = []
        threading.restype = ctypes.c_char_p
        self._threading = threading
        self._openmp = threading() == b"openmp"
        self._why_pthreads = why_pthreads
        fn = self._lib.sdc_weighted_sum
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(ctypes.c_uint64)]
        fn.restype = ctypes.c_int
        self._fn = fn
        terms = self._lib.sdc_fingerprint_terms
        terms.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int64),
                          ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint64),
                          ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                          ctypes.POINTER(ctypes.c_uint64)]
        terms.restype = ctypes.c_int
        self._terms = terms
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
        P, N, C, D = _P, _N, _C, _D
        cols = self._lib.sdc_cs_cols
        cols.argtypes = [ctypes.POINTER(CsColsArgs)]
        cols.restype = C
        self._cs_cols = cols
        rows = self._lib.sdc_cs_rows
        rows.argtypes = [ctypes.POINTER(CsRowsArgs)]
        rows.restype = C
        self._cs_rows = rows
        fwd = self._lib.sdc_cs_fwd
        fwd.argtypes = [ctypes.POINTER(CsFwdArgs)]
        fwd.restype = N
        self._cs_fwd = fwd
        bwd = self._lib.sdc_cs_bwd
        bwd.argtypes = [ctypes.POINTER(CsBwdArgs)]
        bwd.restype = N
        self._cs_bwd = bwd
        gx = self._lib.sdc_cs_gx
        gx.argtypes = [P, N, N, N, P, D, C, C]
        gx.restype = N
        self._cs_gx = gx
        fp_wsum = self._lib.sdc_fp_wsum
        fp_wsum.argtypes = [P, N, N, P, P, P, C, C, ctypes.POINTER(ctypes.c_uint64)]
        fp_wsum.restype = C
        self._fp_wsum = fp_wsum
        compare = self._lib.sdc_cs_compare
        compare.argtypes = [P, P, P, N, D, D, D, C]
        compare.restype = N
        self._cs_compare = compare
        scale_rows = self._lib.sdc_scale_rows
        scale_rows.argtypes = [P, N, ctypes.c_float, P, C, C]
        scale_rows.restype = C
        self._scale_rows = scale_rows
        check_rows = self._lib.sdc_check_rows
        check_rows.argtypes = [P, N, P, C, C]
        check_rows.restype = C
        self._check_rows = check_rows
        sketch = self._lib.sdc_sketch
        sketch.argtypes = [P, N, N, N, P, P, P, C, C, P]
        sketch.restype = C
        self._sketch = sketch
        scale_sketch = self._lib.sdc_scale_sketch
        scale_sketch.argtypes = [P, N, ctypes.c_float, P, C, C, P, C]
        scale_sketch.restype = C
        self._scale_sketch = scale_sketch
        sketch_distance = self._lib.sdc_sketch_distance
        sketch_distance.argtypes = [P, P, N, C]
        sketch_distance.restype = ctypes.c_double
        self._sketch_distance = sketch_distance
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
    def threading(self) -> str:
        """What the passes run their threads on: ``"openmp (torch's libgomp at PATH)"`` (the
        pool torch's parallel ops run on) or ``"pthreads"`` (threads of its own, started per
        pass), with the reason when OpenMP was not to be had."""
        if self._threading() == b"openmp":
            return f"openmp (torch's libgomp at {torch_libgomp()[0]})"
        if self._openmp:
            return ("pthreads (a process forked after the kernel loaded: libgomp's pool does "
                    "not survive a fork)")
        return f"pthreads ({self._why_pthreads})" if self._why_pthreads else "pthreads"

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
        ``X ^ (X >>> 32)`` or taken as they are; 6 (``words.LANES_V2``): int32 lanes, the
        first value weighted ``2**8 (2k+1) + 2**rho(k)`` (the fingerprint's version 2).
        """
        want = torch.int32 if mode in (0, 6) else torch.int64
        if (src.device.type != "cpu" or src.dim() != 1 or not src.is_contiguous()
                or src.dtype != want or mode not in (0, 1, 2, 6)):
            raise ValueError(f"weighted_sum: needs a contiguous 1-D CPU {want} tensor for mode "
                             f"{mode}; got {src.dtype} {list(src.shape)} on {src.device}.")
        return [v - (1 << 64) if v >= 1 << 63 else v
                for v in self.words_at(src.data_ptr(), src.numel(), mode)]

    def words_at(self, address: int, n: int, mode: int) -> tuple[int, int]:
        """Unsigned ``(sum_k (2k+1) v_k, sum_k v_k)`` of ``n`` elements at ``address``.

        The caller guarantees the memory: ``n`` int32 lanes (modes 0, 6) or int64 words
        (modes 1, 2) of a live CPU tensor, 8-byte aligned for the words. Mode 6 weights
        ``2**8 (2k+1) + 2**rho(k)`` (``weighted_sum``).
        """
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        out = (ctypes.c_uint64 * 2)()
        if self._fn(address, n, mode, threads, out) != 0:  # pragma: no cover
            raise RuntimeError("sdc_weighted_sum rejected its arguments")
        return out[0], out[1]

    def fingerprint_terms(self, addresses: list[int], nbytes: list[int], modes: list[int],
                          keys: list[int]) -> int:
        """``sum_i mix64(value_i + keys[i])`` (mod 2**64), ``value_i`` the weighted sum of
        ``nbytes[i]`` bytes at ``addresses[i]`` as 64-bit words (mode 1) or 32-bit lanes
        (mode 0, or 6 under version 2's weights; a last partial lane zero-padded): the
        terms of a list's fingerprint by one call, not a call per tensor. The caller
        guarantees the memory (live CPU tensors, 8-byte aligned)."""
        k = len(addresses)
        if not k:
            return 0
        out = (ctypes.c_uint64 * 1)()
        if self._terms((ctypes.c_uint64 * k)(*addresses), (ctypes.c_int64 * k)(*nbytes),
                       (ctypes.c_int32 * k)(*modes), (ctypes.c_uint64 * k)(*keys), k,
                       torch.get_num_threads(), _PER_THREAD, out) != 0:  # pragma: no cover
            raise RuntimeError("sdc_fingerprint_terms rejected its arguments")
        return int(out[0])

    def scale_digest_at(self, address: int, n: int, scale: float) -> tuple[int, int, bool]:
        """``words_at(address, 2n, 6)`` of the ``2n`` float32 lanes of ``n`` 64-bit words as
        they were (the replay digest's part and the lanes' plain sum), then those lanes
        multiplied by ``scale`` in place (the bits of torch's ``mul_``): ``(digest part, sum,
        any lane was NaN or Inf)``, in one pass over memory.

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

    def check_rows_blocks(self, address: int, n: int, blocks: Any) -> bool:
        """``scale_rows_blocks`` that writes nothing: the row sums and whether any float was
        NaN or Inf, in one read of the ``n`` float32 at ``address``."""
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        bad = self._check_rows(address, n, blocks[0], blocks[1], threads)
        if bad < 0:
            raise ValueError("sdc_check_rows: blocks must lie inside the buffer, in increasing "
                             "offset, without overlapping")
        return bool(bad)

    def sketch_at(self, address: int, q: int, c: int, tail: int, b: int, a: int, t: int,
                  k: int, out: int) -> None:
        """``sdc_sketch``: the tolerant replay's sketch of ``q * c + tail`` float32 at
        ``address`` (``sdc_guard.checks.sketch``): ``out`` (``1 + k`` float64) gets the norm
        and the ``k`` projections with ``b`` (``k x c`` float32), ``a`` (``q x k`` float64) and
        ``t`` (``tail x k`` float64), in one read. The caller guarantees the memory (live,
        contiguous CPU tensors of those sizes)."""
        threads = max(1, min(torch.get_num_threads(), (q * c) // _PER_THREAD))
        if self._sketch(address, q, c, tail, b, a, t, k, threads, out) != 0:
            raise ValueError(f"sdc_sketch refused q={q}, c={c}, tail={tail}, k={k}")

    def sketch_distance_at(self, a: int, b: int, n: int, width: int) -> float:
        """``sdc_sketch_distance``: ``sdc_guard.checks.sketch.distance`` of the two sketch
        vectors of ``n`` float64 at ``a`` and ``b`` (the loss, then ``width`` numbers per
        gradient), the same number. The caller guarantees the memory (live, contiguous
        float64 CPU tensors of ``n``)."""
        far = float(self._sketch_distance(a, b, n, width))
        if far < 0:
            raise ValueError(f"sdc_sketch_distance refused n={n}, width={width}")
        return far

    @staticmethod
    def sketch_blocks(blocks: list[tuple[int, int, int, int, int, int, int]]) -> Any:
        """``scale_sketch_at``'s blocks in the C call's form (kept by a caller that repeats
        it): (offset in floats, q, c, tail, address of b, of a, of t) each."""
        return ((ctypes.c_int64 * (7 * len(blocks)))(*(v for b in blocks for v in b)),
                len(blocks))

    def scale_sketch_at(self, address: int, n: int, scale: float, blocks: Any, k: int,
                        out: int) -> bool:
        """``sdc_scale_sketch``: the ``n`` float32 at ``address`` multiplied by ``scale`` in
        place (the bits of torch's ``mul_``), and in the same read the sketch
        (``sketch_at``'s numbers) of each block of ``blocks`` (``sketch_blocks``: in
        increasing offset, not overlapping, inside), block ``i``'s ``1 + k`` float64 at
        ``out + 8 (1 + k) i``. Whether any float was NaN or Inf.

        The caller guarantees the memory: ``n`` writable float32 of a live CPU tensor, the
        factors and the output live CPU tensors of the sizes given."""
        threads = max(1, min(torch.get_num_threads(), n // _PER_THREAD))
        bad = self._scale_sketch(address, n, scale, blocks[0], blocks[1], k, out, threads)
        if bad < 0:
            raise ValueError("sdc_scale_sketch: blocks must lie inside the buffer, in increasing "
                             "offset, without overlapping, with their factors")
        return bool(bad)

    # -- the checksum check's passes (checksum.c) ----------------------------------------
    # The caller guarantees the memory: every address is a live float32 CPU tensor's, of
    # the sizes given.
    def cs_cols(self, *, A: int | None, rows: int, cols: int, ld: int, k: int, ka: int,
                u0: int | None = None, u1: int | None = None, a0: int | None = None,
                a1: int | None = None, s0: int | None = None, s1: int | None = None,
                b0: int | None = None, b1: int | None = None, acc_mask: int = 0,
                threads: int = 1) -> None:
        """``sdc_cs_cols`` (``CsColsArgs``): ``s_p (+)= u_p^T A``, ``b_p (+)= a_p^T |A|`` in one
        pass over a float32 matrix (the checksum check's products with ``W`` and ``GY``).
        ``ValueError`` when it refuses its arguments (its outputs unwritten)."""
        args = CsColsArgs(A, rows, cols, ld, u0, u1, k, a0, a1, ka, s0, s1, b0, b1, acc_mask,
                          threads)
        if self._cs_cols(args) != 0:
            raise _refused("sdc_cs_cols", (rows, cols, ld), k, ka)

    def cs_rows(self, *, A: int | None, n: int, cols: int, ld: int, k: int, ka: int,
                v0: int | None = None, v1: int | None = None, va0: int | None = None,
                va1: int | None = None, r0: int | None = None, r1: int | None = None,
                ra0: int | None = None, ra1: int | None = None, threads: int = 1) -> None:
        """``sdc_cs_rows`` (``CsRowsArgs``): ``r_p[i] = v_p . A[i]``, ``ra_p[i] = va_p . |A[i]|``
        per row. ``ValueError`` when it refuses its arguments (its outputs unwritten)."""
        args = CsRowsArgs(A, n, cols, ld, v0, v1, k, va0, va1, ka, r0, r1, ra0, ra1, threads)
        if self._cs_rows(args) != 0:
            raise _refused("sdc_cs_rows", (n, cols, ld), k, ka)

    def cs_fwd(self, args: CsFwdArgs) -> int:
        """``sdc_cs_fwd``: the checksum check's forward hook in one call (the weight's sums
        once per version; the row sums of ``X``, ``|X|`` and ``Y`` and the forward's two
        sides, compared): how many forward entries fail. ``ValueError`` on arguments it
        refuses."""
        bad: int = self._cs_fwd(args)
        if bad < 0:
            raise _count_refused("sdc_cs_fwd", (args.n, args.inner, args.ldx))
        return bad

    def cs_bwd(self, args: CsBwdArgs) -> int:
        """``sdc_cs_bwd``: its backward hook in one call (one pass over ``GY`` for both
        gradients' right-hand sides, then ``GX``'s row sums compared): how many
        input-gradient entries fail. ``ValueError`` on arguments it refuses."""
        bad: int = self._cs_bwd(args)
        if bad < 0:
            raise _count_refused("sdc_cs_bwd", (args.n, args.out, args.ldg))
        return bad

    def cs_gx(self, *, GX: int, n: int, inner: int, ld: int, gxs: int, tol: float,
              finite_only: bool, threads: int = 1) -> int:
        """``sdc_cs_gx``: the input-gradient check alone, for a ``GX`` (``n x inner``, row
        stride ``ld``) that arrives after ``GY`` (a hook on the input): ``gxs[2n, 3n)`` gets
        ``GX e``, compared with ``gxs[0, n)`` within ``gxs[n, 2n)`` times ``tol``. How many
        entries fail; ``ValueError`` on arguments it refuses."""
        bad: int = self._cs_gx(GX, n, inner, ld, gxs, tol, int(finite_only), threads)
        if bad < 0:
            raise _count_refused("sdc_cs_gx", (n, inner, ld))
        return bad

    def cs_compare(self, *, lhs: int, rhs: int, bound: int, n: int, tol: float,
                   finite_only: bool, rhs0: float = 0.0, bound0: float = 0.0) -> int:
        """``sdc_cs_compare``: how many of the ``n`` entries fail
        ``|lhs - (rhs + rhs0)| <= (bound + bound0) * tol`` (in double; only an entry with a
        finite bound can fail, and with ``finite_only`` only a finite difference)."""
        bad: int = self._cs_compare(lhs, rhs, bound, n, rhs0, bound0, tol, int(finite_only))
        return bad

    def fp_wsum_at(self, *, W: int, rows: int, cols: int, bias: int | None, wsum: int,
                   bsum: int, threads: int, version: int = 1) -> int:
        """``words_at(W, rows * cols, 0)[0]`` of a contiguous float32 matrix (mode 6 for
        ``version`` 2), and the
        checksum check's sums of it in the same read (``sdc_fp_wsum``): ``wsum`` gets
        ``[e^T W, e^T |W|, W e, |W| e]`` (``2 cols + 2 rows`` float32), ``bsum`` the sum and
        absolute sum of the ``rows`` float32 at ``bias`` (None: no bias, zeros). The sums'
        bits are the same from one call to the next with the same ``threads``.
        """
        out = (ctypes.c_uint64 * 2)()
        if self._fp_wsum(W, rows, cols, bias, wsum, bsum, threads, version, out) != 0:
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


_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno")
"""``-fno-math-errno``: a square root is one instruction, no call into libm (which the
library does not link)."""

THREADS_ENV = "SDC_GUARD_THREADS"
"""``pthreads`` builds the kernel with threads of its own even where torch's OpenMP pool is
to be had; ``openmp`` warns when it is not (by default a log record of level INFO says why)."""


def torch_libgomp() -> tuple[Path | None, str]:
    """The libgomp file this process loaded for torch's parallel ops, or None and why not.

    The kernel joins torch's pool only through that very file: a second OpenMP runtime in
    the process would be a second pool, competing with torch's for the cores.
    """
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "torch's parallel backend is not OpenMP"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None, "no /proc/self/maps here to find the OpenMP runtime torch loaded"
    found = {fields[5] for fields in (line.split(None, 5) for line in maps.splitlines())
             if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp")}
    if len(found) != 1:
        return None, (f"torch's OpenMP runtime is not one libgomp (loaded: "
                      f"{sorted(found) or 'none'}; Intel's libiomp5 or LLVM's libomp are not "
                      "linked against)")
    return Path(found.pop()), ""


def _openmp_plan(own_threads: bool = False) -> tuple[Path | None, str]:
    """The libgomp to build the kernel against, or None and why it runs threads of its own."""
    wanted = os.environ.get(THREADS_ENV, "")
    if own_threads:
        return None, "threads of its own asked for"
    if wanted == "pthreads":
        return None, f"{THREADS_ENV}=pthreads"
    if wanted not in ("", "openmp"):
        warnings.warn(f"{THREADS_ENV}={wanted!r}: set it to openmp or pthreads (or unset it); "
                      "taking the default (openmp where torch's libgomp is to be had)",
                      RuntimeWarning, stacklevel=3)
    return torch_libgomp()


def build(directory: Path | None = None) -> Path:
    """Compile the kernel (or find it already built); the path of the shared library.

    Raises ``RuntimeError`` naming the reason when there is no compiler or the build fails.
    """
    return _build(directory)[0]


def _build(directory: Path | None = None, *, own_threads: bool = False) -> tuple[Path, str]:
    """``build``, and why the library runs threads of its own ("" when it runs on torch's
    OpenMP pool; ``own_threads``: the build with threads of its own in any case). A
    compiler that fails with ``-fopenmp`` where the plain build succeeds is remembered
    beside the library (``.no-openmp``, the reason), not tried on every load."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc, gcc or clang)")
    files = {p.name: p.read_text() for p in sources()}
    directory = directory or _cache_dir()
    libgomp, why = _openmp_plan(own_threads)
    failed: Path | None = None
    if libgomp is not None:
        key = _key(files, cc, f"openmp:{libgomp}")
        failed = directory / f"weighted_sum-{key}.no-openmp"
        if failed.exists():
            why, failed = failed.read_text(), None
        else:
            try:
                return _compile_cached(directory, key, files, cc, libgomp), ""
            except RuntimeError as e:
                why = f"{cc} could not build it with -fopenmp against {libgomp}: {e}"[:600]
    target = _compile_cached(directory, _key(files, cc, "pthreads"), files, cc, None)
    if failed is not None:  # -fopenmp is what failed: remember it
        failed.write_text(why)
    return target, why


def _compile_cached(directory: Path, key: str, files: dict[str, str], cc: str,
                    libgomp: Path | None) -> Path:
    """The library of ``key`` in ``directory``, compiled from ``files`` if not there yet."""
    target = directory / f"weighted_sum-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    src = Path(tmp[: -len(".so")] + ".src")
    try:
        src.mkdir()
        for name, text in files.items():  # the sources the key was taken of, compiled
            (src / name).write_text(text)
        # A compiler without the x86-64 levels in target_clones: a copy per instruction
        # set; without target_clones: one plain copy.
        for extra in ((), ("-DSDC_ISA_CLONES",), ("-DSDC_NO_CLONES",)):
            proc = compile_kernel(cc, Path(tmp), extra, src, libgomp=libgomp)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: ranks building at once never see a partial file
    finally:
        shutil.rmtree(src, ignore_errors=True)
        Path(tmp).unlink(missing_ok=True)
    return target


def _key(files: dict[str, str], cc: str, threads: str) -> str:
    """The built library's cache key: every source file's name and text, the compiler, its
    flags, the threads (``pthreads``, or ``openmp:`` and the libgomp linked against) and
    the platform."""
    parts = [*(f"{name}\0{text}" for name, text in sorted(files.items())), cc, *_FLAGS,
             threads, platform.machine(), platform.system()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def cache_key(cc: str, threads: str = "pthreads") -> str:
    """The cache key ``build`` gives the library of the kernel's sources as they are now
    (``threads``: ``pthreads``, or ``openmp:`` and the path of the libgomp)."""
    return _key({p.name: p.read_text() for p in sources()}, cc, threads)


def compile_kernel(cc: str, library: Path, extra: tuple[str, ...] = (),
                   directory: Path | None = None, *,
                   libgomp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Compile the kernel's sources in ``directory`` (default: the shipped ones) into the
    shared ``library`` with ``cc``, ``extra`` flags after the usual ones (``-DSDC_NO_CLONES``,
    ``-DSDC_ISA_CLONES``: the fallbacks ``build`` tries); the compiler's result.

    With ``libgomp``: compiled with ``-fopenmp`` and linked against that file, not the
    compiler's own OpenMP runtime (``-fopenmp`` at the link would add it), every symbol
    resolved at the link (a compiler whose OpenMP calls another runtime, like clang's
    libomp, fails here, not when the library loads).
    """
    units = [str(p.resolve()) for p in sources(directory) if p.suffix == ".c"]
    if libgomp is None:
        return subprocess.run([cc, *_FLAGS, *extra, "-o", str(library), *units],
                              capture_output=True, text=True, timeout=120, check=False)
    with tempfile.TemporaryDirectory() as objects:
        proc = subprocess.run([cc, *_FLAGS, "-fopenmp", *extra, "-c", *units], cwd=objects,
                              capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            return proc
        linked = sorted(str(p) for p in Path(objects).glob("*.o"))
        return subprocess.run([cc, *_FLAGS, "-o", str(library), *linked, str(libgomp),
                               "-Xlinker", "-rpath", "-Xlinker", str(libgomp.parent),
                               "-Wl,-z,defs"],
                              capture_output=True, text=True, timeout=120, check=False)


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
                path, why = _build()
            except OSError as unwritable:  # a read-only home, say: a private temp dir
                try:
                    path, why = _build(_private_tmp_dir())
                except Exception as e:
                    raise RuntimeError(f"the cache {_cache_dir()} is not writable "
                                       f"({unwritable}), nor is a temp dir ({e})") from e
            _kernel = NativeKernel(path, why)
            if why:
                _threads_note(why)
        except Exception as e:  # no compiler, a failed build, nowhere to write, ...
            _error = f"{type(e).__name__}: {e}"[:600]
    if _kernel is None and _error is not None:
        message = (f"sdc_guard: the native fingerprint kernel could not be built ({_error}); "
                   "using the torch implementation (the same values, slower: bench/RESULTS.md).")
        if warn and not _warned:
            _warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        elif not warn:
            _log.info(message)
    return _kernel


def pthreads_kernel() -> NativeKernel:
    """The kernel built with threads of its own, loaded beside the one in use: what runs
    where torch's OpenMP pool is not to be had, for measuring one against the other
    (``kernel_in_use``). ``RuntimeError`` if it cannot be built."""
    return NativeKernel(*_build(own_threads=True))


@contextlib.contextmanager
def kernel_in_use(kernel: NativeKernel) -> Iterator[NativeKernel]:
    """Within the block, the C paths run on ``kernel`` (another build, ``pthreads_kernel``);
    the previous choice is restored on exit. Not thread-safe, like ``native_kernel``."""
    global _native, _native_resolved
    saved = _native, _native_resolved
    _native, _native_resolved = kernel, True
    try:
        yield kernel
    finally:
        _native, _native_resolved = saved


def _threads_note(why: str) -> None:
    """Say why the kernel runs threads of its own: a warning if OpenMP was asked for, else
    a log record of level INFO (the values are the same; only the speed right after a
    parallel torch op differs)."""
    message = (f"sdc_guard: the C kernel runs threads of its own, not torch's OpenMP pool "
               f"({why}); right after a parallel torch op they share the cores with its "
               "spinning workers (docs/fingerprint.md).")
    if os.environ.get(THREADS_ENV) == "openmp":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        _log.info(message)


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
