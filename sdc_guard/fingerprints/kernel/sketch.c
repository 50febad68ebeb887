#include "common.h"

/* ---- The tolerant replay audit's gradient sketch (sdc_guard.checks.sketch) -------------

   One read of a float32 gradient viewed as G (q x c, row-major) followed by `tail` more
   elements: per row its sum of squares and its products with the k projection vectors
   b_p (float32, sixteen partial sums each, in any order: the audit compares sketches
   within a tolerance calibrated from the run), then in float64 the norm
   sqrt(sum of the rows' sums of squares + sum of the tail's squares) and the projections
   sum_rows a[row][p] (G b_p)[row] + sum_e t[e][p] tail[e]. torch takes the same numbers in
   about twenty operations per gradient and two reads of it. */

#define SK_MAXK 8

typedef struct {
  const float* g; const float* b; const double* a;
  int64_t c, lo, hi; int k;
  double acc[1 + SK_MAXK];
} sk_job_t;

/* Rows [lo, hi) into acc (norm^2, then the k projections' parts); k a constant in each
   inlined copy, so the 2 (k + 1) accumulators stay in registers. */
static inline __attribute__((always_inline)) void sk_rows_k(sk_job_t* j, const int k) {
  double acc[1 + SK_MAXK] = {0};
  const int64_t c = j->c, body = c / CS_LANES * CS_LANES;
  const float* restrict b = j->b;
  for (int64_t r = j->lo; r < j->hi; ++r) {
    const float* restrict x = j->g + r * c;
    cs_v8 sq[2], d[SK_MAXK][2];
    memset(sq, 0, sizeof sq);
    memset(d, 0, sizeof d);
    for (int64_t i = 0; i < body; i += CS_LANES) {
      for (int h = 0; h < 2; ++h) {
        const cs_v8 xv = cs_load(x + i + 8 * h);
        sq[h] += xv * xv;
        for (int p = 0; p < k; ++p) d[p][h] += cs_load(b + p * c + i + 8 * h) * xv;
      }
    }
    float ts = 0.0f, td[SK_MAXK] = {0};
    for (int64_t i = body; i < c; ++i) {
      ts += x[i] * x[i];
      for (int p = 0; p < k; ++p) td[p] += b[p * c + i] * x[i];
    }
    const cs_v8 s2 = sq[0] + sq[1];
    acc[0] += (double)(ts + CS_HSUM(s2));
    const double* ar = j->a + r * k;
    for (int p = 0; p < k; ++p) {
      const cs_v8 v2 = d[p][0] + d[p][1];
      acc[1 + p] += ar[p] * (double)(td[p] + CS_HSUM(v2));
    }
  }
  memcpy(j->acc, acc, sizeof acc);
}

CLONES static void sk_rows(sk_job_t* j) {
  if (j->k == 4) sk_rows_k(j, 4);
  else sk_rows_k(j, j->k);
}

static void* sk_thread(void* arg) {
  sk_rows((sk_job_t*)arg);
  return 0;
}

/* out[0] = the norm, out[1 + p] = projection p of the n = q c + tail float32 at g (G: the
   first q c as q x c, row-major), with b (k x c float32, row-major), a (q x k float64) and
   t (tail x k float64); the rows split over up to `threads` threads, their parts added in
   order. 0, or -1 on bad arguments. */
int sdc_sketch(const float* g, int64_t q, int64_t c, int64_t tail, const float* b,
               const double* a, const double* t, int k, int threads, double* out) {
  if (k < 1 || k > SK_MAXK || q < 0 || c < 1 || tail < 0 || (q && (!g || !b || !a))
      || (tail && (!g || !t)) || !out)
    return -1;
  sk_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = q ? split(q, threads, 1, &per) : 0;
  for (int i = 0; i < used; ++i) {
    jobs[i] = (sk_job_t){.g = g, .b = b, .a = a, .c = c, .k = k};
    jobs[i].lo = (int64_t)i * per;
    jobs[i].hi = q - jobs[i].lo < per ? q : jobs[i].lo + per;
  }
  if (used) run_jobs(sk_thread, jobs, sizeof jobs[0], used);
  double acc[1 + SK_MAXK] = {0};
  for (int i = 0; i < used; ++i)
    for (int p = 0; p <= k; ++p) acc[p] += jobs[i].acc[p];
  const float* x = g + q * c;
  for (int64_t e = 0; e < tail; ++e) {
    const double v = (double)x[e];
    acc[0] += v * v;
    for (int p = 0; p < k; ++p) acc[1 + p] += t[e * k + p] * v;
  }
  out[0] = __builtin_sqrt(acc[0]);
  for (int p = 0; p < k; ++p) out[1 + p] = acc[1 + p];
  return 0;
}
