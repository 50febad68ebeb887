"""The fingerprint's weighted sums in one read pass: a small C kernel, built on first use.

torch has no fused position-weighted integer reduction, so the pure-torch path
reads each chunk three times (widen, row sums, column sums) and reaches about a
third of ``torch.sum``'s speed. This kernel reads the data once: per block it
keeps running sums ``P += v; Q += P`` in 32 independent streams (additions
only, which any compiler vectorises at plain ``-O3``), from which ``sum v`` and
``sum i * v`` follow exactly modulo 2**64; blocks run on up to
``torch.get_num_threads()`` threads. It computes the same values as the torch
path, bit for bit (``tests/test_native.py``), so a fingerprint never depends on
which path ran.

Two more entry points serve the non-finite check on float32 CPU buffers:
``sdc_scale_check`` (DDP's 1/world scaling, the bits of ``mul_``, with a NaN/Inf
flag, in one pass) and ``sdc_nonfinite`` (the flag alone, read only). Their
flags come back as Python bools: no tensor op, no host sync.

It is plain C with no dependency (not even torch's headers): the system C
compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) builds it in well under a
second, once per machine and source version, into a per-user cache
(``$SDC_GUARD_CACHE``, else ``$XDG_CACHE_HOME/sdc_guard``, else
``~/.cache/sdc_guard``; if that is not writable, a private ``sdc_guard-<uid>``
directory under the system temp dir). Ranks that build at the same time each write their own
file and rename it into place. The ctypes call releases the GIL. Without a
compiler (or with ``SDC_GUARD_NATIVE=0``) the torch path is used: the same
values, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_log = logging.getLogger("sdc_guard")

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <pthread.h>

/* Value of element i under each mode: 0 = uint32 lane zero-extended, 1 = 64-bit word
   X mapped to X ^ (X >>> 32), 2 = raw 64-bit word. */
static inline uint64_t val0(const void* x, int64_t i) { return (uint64_t)((const uint32_t*)x)[i]; }
static inline uint64_t val1(const void* x, int64_t i) {
  uint64_t w = ((const uint64_t*)x)[i];
  return w ^ (w >> 32);
}
static inline uint64_t val2(const void* x, int64_t i) { return ((const uint64_t*)x)[i]; }

/* s1 = sum v_i and s2 = sum i * v_i (mod 2^64) over n elements, i from 0. Stream s
   holds P_s = sum_b v_{b,s} and Q_s = sum_b (m - 1 - b) v_{b,s}, element i = W b + s. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(SDC_NO_CLONES)
/* One copy per instruction set, chosen when the library loads (about 1.3x faster
   with AVX2 or AVX-512 than with the x86-64 baseline's SSE2). */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define W 32
#define BLOCK(NAME, VAL)                                                          \
  CLONES static void NAME(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {        \
    uint64_t P[W] = {0}, Q[W] = {0};                                              \
    const int64_t m = n / W;                                                      \
    for (int64_t b = 0; b < m; ++b)                                               \
      for (int s = 0; s < W; ++s) {                                               \
        Q[s] += P[s];                                                             \
        P[s] += VAL(x, b * W + s);                                                \
      }                                                                           \
    uint64_t a1 = 0, a2 = 0;                                                      \
    for (int s = 0; s < W; ++s) {                                                 \
      const uint64_t sum_bv = (uint64_t)(m - 1) * P[s] - Q[s];                    \
      a1 += P[s];                                                                 \
      a2 += (uint64_t)W * sum_bv + (uint64_t)s * P[s];                            \
    }                                                                             \
    for (int64_t i = m * W; i < n; ++i) {                                         \
      const uint64_t v = VAL(x, i);                                               \
      a1 += v;                                                                    \
      a2 += (uint64_t)i * v;                                                      \
    }                                                                             \
    *s1 = a1;                                                                     \
    *s2 = a2;                                                                     \
  }
BLOCK(block0, val0)
BLOCK(block1, val1)
BLOCK(block2, val2)

/* f[i] *= scale over n float32, in place (IEEE single precision, rounded to nearest:
   the product torch's mul_ computes); returns 1 if any f[i] was NaN or Inf before. */
CLONES static uint32_t scale_f32(float* f, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, &f[i], 4);
    bad |= (u & 0x7f800000u) == 0x7f800000u;
    f[i] = f[i] * scale;
  }
  return bad;
}

/* 1 if any of n float32 at f is NaN or Inf (read only). */
CLONES static uint32_t check_f32(const float* f, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, &f[i], 4);
    bad |= (u & 0x7f800000u) == 0x7f800000u;
  }
  return bad;
}

typedef struct {
  const char* x; int64_t lo, n; int mode; uint64_t s1, s2; float scale; uint32_t bad;
} job_t;

/* Mode 3: the raw 64-bit words' sums as mode 2, then the float32 halves of the same
   words scaled in place, chunk by chunk while the chunk is in L1: one pass over memory. */
#define CHUNK 2048
static void scale_words(job_t* j) {
  char* p = (char*)j->x + 8 * j->lo;
  uint64_t a1 = 0, a2 = 0;
  uint32_t bad = 0;
  for (int64_t c = 0; c < j->n; c += CHUNK) {
    const int64_t m = j->n - c < CHUNK ? j->n - c : CHUNK;
    uint64_t c1, c2;
    block2(p + 8 * c, m, &c1, &c2);
    a1 += c1;
    a2 += c2 + (uint64_t)c * c1;
    bad |= scale_f32((float*)(p + 8 * c), 2 * m, j->scale);
  }
  j->s1 = a1;
  j->s2 = a2;
  j->bad = bad;
}

/* Modes 0, 4 and 5 count float32 lanes, the others 64-bit words. Mode 4 scales n
   float32 in place and flags NaN/Inf (scale_f32), mode 5 only flags (check_f32). */
static void run(job_t* j) {
  const void* p = j->x + (j->mode == 0 || j->mode >= 4 ? 4 : 8) * j->lo;
  j->s1 = j->s2 = 0;
  if (j->mode == 4) j->bad = scale_f32((float*)p, j->n, j->scale);
  else if (j->mode == 5) j->bad = check_f32((const float*)p, j->n);
  else if (j->mode == 0) block0(p, j->n, &j->s1, &j->s2);
  else if (j->mode == 1) block1(p, j->n, &j->s1, &j->s2);
  else if (j->mode == 2) block2(p, j->n, &j->s1, &j->s2);
  else scale_words(j);
}

static void* thread_main(void* arg) {
  run((job_t*)arg);
  return 0;
}

#define MAX_THREADS 64

/* out = {sum_k (2k + 1) v_k, sum_k v_k} (mod 2^64) over n elements of x. Mode 3 (see
   scale_words) also scales x in place and sets out[2] to 1 if a float was NaN or Inf. */
static int weighted(const void* x, int64_t n, int mode, int threads, float scale,
                    uint64_t* out) {
  if (n < 0 || mode < 0 || mode > 5) return 1;
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  job_t jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  int64_t per = (n + threads - 1) / threads;
  per = (per + 63) / 64 * 64;
  int used = 0;
  for (int t = 0; t < threads && (int64_t)t * per < n; ++t, ++used) {
    jobs[t].x = (const char*)x;
    jobs[t].lo = (int64_t)t * per;
    jobs[t].n = n - jobs[t].lo < per ? n - jobs[t].lo : per;
    jobs[t].mode = mode;
    jobs[t].scale = scale;
    jobs[t].bad = 0;
  }
  for (int t = 1; t < used; ++t) started[t] = pthread_create(&ids[t], 0, thread_main, &jobs[t]) == 0;
  for (int t = 0; t < used; ++t)
    if (!started[t]) run(&jobs[t]);  /* the caller's share, and any thread that failed to start */
  for (int t = 1; t < used; ++t)
    if (started[t]) pthread_join(ids[t], 0);
  uint64_t total = 0, plain = 0, bad = 0;
  for (int t = 0; t < used; ++t) {
    total += (2 * (uint64_t)jobs[t].lo + 1) * jobs[t].s1 + 2 * jobs[t].s2;
    plain += jobs[t].s1;
    bad |= jobs[t].bad;
  }
  out[0] = total;
  out[1] = plain;
  if (mode >= 3) out[2] = bad;
  return 0;
}

int sdc_weighted_sum(const void* x, int64_t n, int mode, int threads, uint64_t* out) {
  if (mode >= 3) return 1;
  return weighted(x, n, mode, threads, 1.0f, out);
}

/* The sums of n raw 64-bit words at x (as mode 2), then their 2n float32 halves
   multiplied by scale in place; out[2] = 1 if any of them was NaN or Inf. */
int sdc_scale_digest(void* x, int64_t n, float scale, int threads, uint64_t* out) {
  return weighted(x, n, 3, threads, scale, out);
}

/* n float32 at x multiplied by scale in place (torch's mul_); 1 if any was NaN or Inf
   before, 0 if none, -1 on bad arguments. */
int sdc_scale_check(void* x, int64_t n, float scale, int threads) {
  uint64_t out[3];
  return weighted(x, n, 4, threads, scale, out) ? -1 : (int)out[2];
}

/* 1 if any of n float32 at x is NaN or Inf, 0 if none, -1 on bad arguments. */
int sdc_nonfinite(const void* x, int64_t n, int threads) {
  uint64_t out[3];
  return weighted(x, n, 5, threads, 1.0f, out) ? -1 : (int)out[2];
}
"""

# Below this many elements per thread, one more thread costs more than it saves.
_PER_THREAD = 1 << 18


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
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(),
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
        src.write_text(_SOURCE)
        for extra in ((), ("-DSDC_NO_CLONES",)):  # a compiler without target_clones: plain
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
