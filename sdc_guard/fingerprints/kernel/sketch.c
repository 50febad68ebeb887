#include "common.h"

/* ---- The tolerant replay audit's gradient sketch (sdc_guard.checks.sketch) -------------

   One read of a float32 gradient viewed as G (q x c, row-major) followed by `tail` more
   elements: per row its sum of squares and its products with the k projection vectors
   b_p (float32, sixteen partial sums each, in any order: the audit compares sketches
   within a tolerance calibrated from the run), then in float64 the norm
   sqrt(sum of the rows' sums of squares + sum of the tail's squares) and the projections
   sum_rows a[row][p] (G b_p)[row] + sum_e t[e][p] tail[e]. torch takes the same numbers in
   about twenty operations per gradient and two reads of it.

   sdc_scale_sketch is the comm hook's 1/world scaling pass over a gradient bucket that
   takes the sketches of the gradients in it in the same read (of the values as they were,
   the same numbers as sdc_sketch gives them), scales in place with the bits of torch's
   mul_ and flags NaN/Inf, as sdc_scale_check does. */

#define SK_MAXK 8

/* Floats ahead of the one read whose cache line is asked for (4 KiB, as the word loops). */
#ifndef SK_PREFETCH
#define SK_PREFETCH 1024
#endif

typedef struct {
  float* g; const float* b; const double* a;
  int64_t c, lo, hi; int k; float scale;
  double acc[1 + SK_MAXK];
  uint32_t bad;
} sk_job_t;

/* Rows [lo, hi) into acc (norm^2, then the k projections' parts); k and store constants in
   each inlined copy, so the 2 (k + 1) accumulators stay in registers. With store each value
   is flagged if NaN or Inf and multiplied by scale in place once it is read; the sums are
   those of the values as they were, added in the same order as without it. */
static inline __attribute__((always_inline)) void sk_rows_k(sk_job_t* j, const int k,
                                                            const int store) {
  double acc[1 + SK_MAXK] = {0};
  const int64_t c = j->c, body = c / CS_LANES * CS_LANES;
  const float* restrict b = j->b;
  const float scale = j->scale;
  cs_i8 flags = {0};
  uint32_t bad = 0;
  for (int64_t r = j->lo; r < j->hi; ++r) {
    float* restrict x = j->g + r * c;
    cs_v8 sq[2], d[SK_MAXK][2];
    memset(sq, 0, sizeof sq);
    memset(d, 0, sizeof d);
    for (int64_t i = 0; i < body; i += CS_LANES) {
      if (SK_PREFETCH) __builtin_prefetch(x + i + SK_PREFETCH, store, 1);
      for (int h = 0; h < 2; ++h) {
        cs_v8 xv = cs_load(x + i + 8 * h);
        sq[h] += xv * xv;
        for (int p = 0; p < k; ++p) d[p][h] += cs_load(b + p * c + i + 8 * h) * xv;
        if (store) {
          flags |= ((cs_i8)xv & 0x7f800000) == 0x7f800000;
          xv *= scale;
          memcpy(x + i + 8 * h, &xv, sizeof xv);
        }
      }
    }
    float ts = 0.0f, td[SK_MAXK] = {0};
    for (int64_t i = body; i < c; ++i) {
      const float v = x[i];
      ts += v * v;
      for (int p = 0; p < k; ++p) td[p] += b[p * c + i] * v;
      if (store) {
        uint32_t u;
        memcpy(&u, &v, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
        x[i] = v * scale;
      }
    }
    const cs_v8 s2 = sq[0] + sq[1];
    acc[0] += (double)(ts + CS_HSUM(s2));
    const double* ar = j->a + r * k;
    for (int p = 0; p < k; ++p) {
      const cs_v8 v2 = d[p][0] + d[p][1];
      acc[1 + p] += ar[p] * (double)(td[p] + CS_HSUM(v2));
    }
  }
  for (int l = 0; l < 8; ++l) bad |= flags[l] != 0;
  memcpy(j->acc, acc, sizeof acc);
  j->bad = bad;
}

CLONES static void sk_rows(sk_job_t* j) {
  if (j->k == 4) sk_rows_k(j, 4, 0);
  else sk_rows_k(j, j->k, 0);
}

CLONES static void sk_rows_store(sk_job_t* j) {
  if (j->k == 4) sk_rows_k(j, 4, 1);
  else sk_rows_k(j, j->k, 1);
}

static void* sk_thread(void* arg) {
  sk_rows((sk_job_t*)arg);
  return 0;
}

static void* sk_thread_store(void* arg) {
  sk_rows_store((sk_job_t*)arg);
  return 0;
}

/* One gradient (q rows of c, then tail) at g: out[0] its norm, out[1 + p] projection p;
   with store also scaled in place and flagged (the return value: 1 if any was NaN or Inf).
   The rows split over up to `threads` threads, their parts added in order; the tail after
   them, in float64. */
static uint32_t sketch_one(float* g, int64_t q, int64_t c, int64_t tail, const float* b,
                           const double* a, const double* t, int k, int threads, float scale,
                           int store, double* out) {
  sk_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = q ? split(q, threads, 1, &per) : 0;
  for (int i = 0; i < used; ++i) {
    jobs[i] = (sk_job_t){.g = g, .b = b, .a = a, .c = c, .k = k, .scale = scale};
    jobs[i].lo = (int64_t)i * per;
    jobs[i].hi = q - jobs[i].lo < per ? q : jobs[i].lo + per;
  }
  if (used) run_jobs(store ? sk_thread_store : sk_thread, jobs, sizeof jobs[0], used);
  double acc[1 + SK_MAXK] = {0};
  uint32_t bad = 0;
  for (int i = 0; i < used; ++i) {
    for (int p = 0; p <= k; ++p) acc[p] += jobs[i].acc[p];
    bad |= jobs[i].bad;
  }
  float* x = g + q * c;
  for (int64_t e = 0; e < tail; ++e) {
    const double v = (double)x[e];
    acc[0] += v * v;
    for (int p = 0; p < k; ++p) acc[1 + p] += t[e * k + p] * v;
    if (store) {
      uint32_t u;
      memcpy(&u, &x[e], 4);
      bad |= (u & 0x7f800000u) == 0x7f800000u;
      x[e] = x[e] * scale;
    }
  }
  out[0] = __builtin_sqrt(acc[0]);
  for (int p = 0; p < k; ++p) out[1 + p] = acc[1 + p];
  return bad;
}

/* out[0] = the norm, out[1 + p] = projection p of the n = q c + tail float32 at g (G: the
   first q c as q x c, row-major), with b (k x c float32, row-major), a (q x k float64) and
   t (tail x k float64). 0, or -1 on bad arguments. */
int sdc_sketch(const float* g, int64_t q, int64_t c, int64_t tail, const float* b,
               const double* a, const double* t, int k, int threads, double* out) {
  if (k < 1 || k > SK_MAXK || q < 0 || c < 1 || tail < 0 || (q && (!g || !b || !a))
      || (tail && (!g || !t)) || !out)
    return -1;
  sketch_one((float*)(intptr_t)g, q, c, tail, b, a, t, k, threads, 1.0f, 0, out);
  return 0;
}

/* The comm hook's scaling pass over n float32 at x (in place, the bits of torch's mul_ by
   scale) that also sketches some gradients in it, as they were: seg holds m blocks of seven
   int64 (offset in floats, q, c, tail, and the addresses of that gradient's b, a and t as
   sdc_sketch takes them), in increasing offset, not overlapping, inside x; block i's norm
   and k projections go to out[i (1 + k) ...]. 1 if any float was NaN or Inf, 0 if none, -1
   on bad arguments (nothing written then). The floats between blocks are scaled as
   sdc_scale_check does. */
int sdc_scale_sketch(float* x, int64_t n, float scale, const int64_t* seg, int m, int k,
                     double* out, int threads) {
  if (!x || n < 0 || m < 0 || (m && (!seg || !out)) || k < 1 || k > SK_MAXK) return -1;
  int64_t at = 0;
  for (int i = 0; i < m; ++i) {  /* every block checked before anything is written */
    const int64_t* s = seg + 7 * i;
    const int64_t off = s[0], q = s[1], c = s[2], tail = s[3];
    if (off < at || q < 0 || c < 1 || tail < 0 || off + q * c + tail > n
        || (q && (!s[4] || !s[5])) || (tail && !s[6]))
      return -1;
    at = off + q * c + tail;
  }
  uint64_t w[3];
  int bad = 0;
  at = 0;
  for (int i = 0; i < m; ++i) {
    const int64_t* s = seg + 7 * i;
    const int64_t off = s[0], q = s[1], c = s[2], tail = s[3];
    if (off > at) {
      if (weighted(x + at, off - at, 4, threads, scale, w)) return -1;
      bad |= (int)w[2];
    }
    const int use = q * c < ((int64_t)1 << 18) ? 1 : threads;
    bad |= (int)sketch_one(x + off, q, c, tail, (const float*)(intptr_t)s[4],
                           (const double*)(intptr_t)s[5], (const double*)(intptr_t)s[6], k,
                           use, scale, 1, out + (int64_t)i * (1 + k));
    at = off + q * c + tail;
  }
  if (n > at) {
    if (weighted(x + at, n - at, 4, threads, scale, w)) return -1;
    bad |= (int)w[2];
  }
  return bad;
}

/* The largest difference between two sketch vectors a and b (n float64: the loss, then per
   gradient its norm and width - 1 projections), each component in its own scale: the
   loss's relative to the larger of the two losses, a gradient's components relative to the
   larger of its two norms (sdc_guard.checks.sketch.distance, the same IEEE operations in
   the same order, so the same number). Equal components, and NaN against NaN, differ by 0;
   a NaN quotient (0/0, Inf/Inf, a NaN scale) by Inf. -1 on bad arguments. */
static double sk_max(double x, double y) {  /* torch.maximum: NaN if either is */
  return (x != x || y != y) ? x + y : (x > y ? x : y);
}

double sdc_sketch_distance(const double* a, const double* b, int64_t n, int width) {
  if (!a || !b || n < 1 || width < 1 || (n - 1) % width) return -1.0;
  double far = 0.0;
  double scale = sk_max(__builtin_fabs(a[0]), __builtin_fabs(b[0]));
  for (int64_t i = 0; i < n; ++i) {
    if (i && (i - 1) % width == 0) scale = sk_max(__builtin_fabs(a[i]), __builtin_fabs(b[i]));
    if (a[i] == b[i] || (a[i] != a[i] && b[i] != b[i])) continue;
    double rel = __builtin_fabs(a[i] - b[i]) / scale;
    if (rel != rel) rel = __builtin_inf();
    if (rel > far) far = rel;
  }
  return far;
}
