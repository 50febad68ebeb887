"""Optional fused CPU kernel for the fingerprint's weighted sums (built on first use).

torch has no fused position-weighted integer reduction, so the pure-torch path
reads each chunk three times (widen, row sums, column sums). This kernel reads
it once: per block it keeps running sums ``P += v; Q += P`` in 8 independent
streams (additions only, so the compiler vectorises them), from which
``sum v`` and ``sum i * v`` follow exactly modulo 2**64, and blocks run on
torch's intra-op threads. It computes the same value as the torch path, bit
for bit (tested), so fingerprints never depend on which path ran.

It is opt-in (``sdc_guard.fingerprints.enable_native()`` or the environment
variable ``SDC_GUARD_NATIVE=1``) because it is compiled with
``torch.utils.cpp_extension`` on first use: that needs a C++ compiler and
ninja, and takes about 20 s once per machine (then it is cached). Without a
toolchain ``load`` returns ``None`` and the torch path is used.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>

// Value of element i under each mode: 0 = uint32 lane zero-extended, 1 = 64-bit word
// X mapped to X ^ (X >>> 32), 2 = raw 64-bit word.
template <typename T, int MODE>
static inline uint64_t value(T x) {
  if (MODE == 0) return (uint64_t)(uint32_t)x;
  uint64_t w = (uint64_t)x;
  if (MODE == 1) return w ^ (w >> 32);
  return w;
}

// s1 = sum v_i and s2 = sum i * v_i (mod 2^64) over one block, i from 0.
template <typename T, int MODE>
static void block(const T* x, int64_t n, uint64_t& s1, uint64_t& s2) {
  constexpr int W = 8;
  uint64_t P[W] = {0}, Q[W] = {0};
  const int64_t m = n / W;
  for (int64_t b = 0; b < m; ++b) {
    const T* p = x + b * W;
    for (int s = 0; s < W; ++s) {
      Q[s] += P[s];
      P[s] += value<T, MODE>(p[s]);
    }
  }
  uint64_t a1 = 0, a2 = 0;
  for (int s = 0; s < W; ++s) {
    // P_s = sum_b v_{b,s}; Q_s = sum_b (m - 1 - b) v_{b,s}; element index i = W b + s.
    const uint64_t sum_bv = (uint64_t)(m - 1) * P[s] - Q[s];
    a1 += P[s];
    a2 += (uint64_t)W * sum_bv + (uint64_t)s * P[s];
  }
  for (int64_t i = m * W; i < n; ++i) {
    const uint64_t v = value<T, MODE>(x[i]);
    a1 += v;
    a2 += (uint64_t)i * v;
  }
  s1 = a1;
  s2 = a2;
}

// {sum_k (2k + 1) * value(src_k), sum_k value(src_k)} mod 2^64, as int64s with the same bits.
std::vector<int64_t> weighted_sum(torch::Tensor src, int64_t mode) {
  TORCH_CHECK(src.device().is_cpu() && src.is_contiguous() && src.dim() == 1,
              "weighted: a contiguous 1-D CPU tensor is required");
  TORCH_CHECK((mode == 0 && src.scalar_type() == torch::kInt32) ||
              (mode != 0 && src.scalar_type() == torch::kInt64),
              "weighted: int32 lanes for mode 0, int64 words for modes 1 and 2");
  const int64_t n = src.numel();
  const int64_t grain = 1 << 16;
  const int64_t nb = (n + grain - 1) / grain;
  std::vector<uint64_t> S1(nb), S2(nb);
  const void* base = src.data_ptr();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * grain, len = std::min(grain, n - lo);
      uint64_t s1 = 0, s2 = 0;
      if (mode == 0) block<int32_t, 0>((const int32_t*)base + lo, len, s1, s2);
      else if (mode == 1) block<int64_t, 1>((const int64_t*)base + lo, len, s1, s2);
      else block<int64_t, 2>((const int64_t*)base + lo, len, s1, s2);
      S1[b] = s1;
      S2[b] = s2;
    }
  });
  uint64_t total = 0, plain = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint64_t start = (uint64_t)(b * grain);
    total += (2 * start + 1) * S1[b] + 2 * S2[b];
    plain += S1[b];
  }
  return {(int64_t)total, (int64_t)plain};
}
"""

_module: Any = None
_tried = False


def load() -> Any:
    """The compiled module, or ``None`` (with one warning) when it cannot be built."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    name = "sdc_guard_native_" + hashlib.sha1(_SOURCE.encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(  # type: ignore[no-untyped-call]
            name=name, cpp_sources=[_SOURCE], functions=["weighted_sum"], extra_cflags=["-O3"],
            verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path remains
        warnings.warn(f"sdc_guard: the native fingerprint kernel could not be built ({e!r:.300}); "
                      "using the torch implementation.", RuntimeWarning, stacklevel=2)
        _module = None
    return _module
