#include "common.h"

/* ---- Float32 passes of the checksum check (sdc_guard.checks.checksum) ------------------

   The check's sums are float32 sums in any order: its tolerance bounds the rounding of a
   float32 sum of any order (the gamma term of its formula), so these loops reassociate
   freely (several rows at once, partial sums per vector lane). They exist because each
   identity needs a few vector products with a matrix and with its absolute values;
   torch computes |W| into a new tensor first and spends a dispatch per small product. */

#define CS_MAXK 2

/* Columns [c0, c1) of: s_p[c] += sum_j u_p[j] A[j][c] for p < k and b_p[c] += sum_j
   a_p[j] |A[j][c]| for p < ka (A: rows x cols, row stride ld; a NULL u_p or a_p is a vector
   of ones). Rows go four at a time: one load and store of each accumulator serves four
   rows of A, while the columns (a block of them) stay in L1. */
#define CS_UNROLL 4
static inline __attribute__((always_inline)) void cs_cols_k(
    const float* restrict A, int64_t rows, int64_t ld, int64_t c0, int64_t c1,
    const float* const* u, const float* const* a, float* const* s, float* const* b,
    const int k, const int ka) {
  int64_t j = 0;
  for (; j + CS_UNROLL <= rows; j += CS_UNROLL) {
    const float* restrict w0 = A + j * ld;
    const float* restrict w1 = w0 + ld;
    const float* restrict w2 = w1 + ld;
    const float* restrict w3 = w2 + ld;
    for (int p = 0; p < k; ++p) {
      const float* up = u[p] ? u[p] + j : 0;
      const float x0 = up ? up[0] : 1.0f, x1 = up ? up[1] : 1.0f;
      const float x2 = up ? up[2] : 1.0f, x3 = up ? up[3] : 1.0f;
      float* restrict sp = s[p];
      for (int64_t c = c0; c < c1; ++c)
        sp[c] += x0 * w0[c] + x1 * w1[c] + x2 * w2[c] + x3 * w3[c];
    }
    for (int p = 0; p < ka; ++p) {
      const float* ap = a[p] ? a[p] + j : 0;
      const float x0 = ap ? ap[0] : 1.0f, x1 = ap ? ap[1] : 1.0f;
      const float x2 = ap ? ap[2] : 1.0f, x3 = ap ? ap[3] : 1.0f;
      float* restrict bp = b[p];
      for (int64_t c = c0; c < c1; ++c)
        bp[c] += x0 * __builtin_fabsf(w0[c]) + x1 * __builtin_fabsf(w1[c])
               + x2 * __builtin_fabsf(w2[c]) + x3 * __builtin_fabsf(w3[c]);
    }
  }
  for (; j < rows; ++j) {
    const float* restrict w = A + j * ld;
    for (int p = 0; p < k; ++p) {
      const float x = u[p] ? u[p][j] : 1.0f;
      float* restrict sp = s[p];
      for (int64_t c = c0; c < c1; ++c) sp[c] += x * w[c];
    }
    for (int p = 0; p < ka; ++p) {
      const float x = a[p] ? a[p][j] : 1.0f;
      float* restrict bp = b[p];
      for (int64_t c = c0; c < c1; ++c) bp[c] += x * __builtin_fabsf(w[c]);
    }
  }
}

/* cs_cols_k for k = ka = 2 (the check's usual passes over W and GY): each element of A is
   read once for its four sums, rather than once per sum. */
static inline __attribute__((always_inline)) void cs_cols_22(
    const float* restrict A, int64_t rows, int64_t ld, int64_t c0, int64_t c1,
    const float* const* u, const float* const* a, float* const* s, float* const* b) {
  float* restrict s0 = s[0];
  float* restrict s1 = s[1];
  float* restrict b0 = b[0];
  float* restrict b1 = b[1];
  int64_t j = 0;
#define CS_COEF(v, i) ((v) ? (v)[j + (i)] : 1.0f)
  for (; j + CS_UNROLL <= rows; j += CS_UNROLL) {
    const float* restrict w0 = A + j * ld;
    const float* restrict w1 = w0 + ld;
    const float* restrict w2 = w1 + ld;
    const float* restrict w3 = w2 + ld;
    const float p0 = CS_COEF(u[0], 0), p1 = CS_COEF(u[0], 1), p2 = CS_COEF(u[0], 2),
                p3 = CS_COEF(u[0], 3), q0 = CS_COEF(u[1], 0), q1 = CS_COEF(u[1], 1),
                q2 = CS_COEF(u[1], 2), q3 = CS_COEF(u[1], 3), r0 = CS_COEF(a[0], 0),
                r1 = CS_COEF(a[0], 1), r2 = CS_COEF(a[0], 2), r3 = CS_COEF(a[0], 3),
                t0 = CS_COEF(a[1], 0), t1 = CS_COEF(a[1], 1), t2 = CS_COEF(a[1], 2),
                t3 = CS_COEF(a[1], 3);
    for (int64_t c = c0; c < c1; ++c) {
      const float v0 = w0[c], v1 = w1[c], v2 = w2[c], v3 = w3[c];
      const float m0 = __builtin_fabsf(v0), m1 = __builtin_fabsf(v1);
      const float m2 = __builtin_fabsf(v2), m3 = __builtin_fabsf(v3);
      s0[c] += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3;
      s1[c] += q0 * v0 + q1 * v1 + q2 * v2 + q3 * v3;
      b0[c] += r0 * m0 + r1 * m1 + r2 * m2 + r3 * m3;
      b1[c] += t0 * m0 + t1 * m1 + t2 * m2 + t3 * m3;
    }
  }
#undef CS_COEF
  if (j < rows) cs_cols_k(A + j * ld, rows - j, ld, c0, c1,
                          (const float* const[]){u[0] ? u[0] + j : 0, u[1] ? u[1] + j : 0},
                          (const float* const[]){a[0] ? a[0] + j : 0, a[1] ? a[1] + j : 0},
                          s, b, 2, 2);
}

#define CS_COLBLOCK 1024
CLONES static void cs_cols_range(const float* A, int64_t rows, int64_t ld, int64_t c0,
                                 int64_t c1, const float* const* u, int k,
                                 const float* const* a, int ka, float* const* s,
                                 float* const* b) {
  for (int64_t lo = c0; lo < c1; lo += CS_COLBLOCK) {
    const int64_t hi = c1 - lo < CS_COLBLOCK ? c1 : lo + CS_COLBLOCK;
    if (k == 2 && ka == 2) cs_cols_22(A, rows, ld, lo, hi, u, a, s, b);
    else if (k == 1 && ka == 1) cs_cols_k(A, rows, ld, lo, hi, u, a, s, b, 1, 1);
    else if (k == 1 && ka == 0) cs_cols_k(A, rows, ld, lo, hi, u, a, s, b, 1, 0);
    else cs_cols_k(A, rows, ld, lo, hi, u, a, s, b, k, ka);
  }
}

/* Row i of A (n x cols, row stride ld): r_p[i] = sum_c v_p[c] A[i][c] for p < k and
   ra_p[i] = sum_c va_p[c] |A[i][c]| for p < ka (a NULL v_p or va_p: ones). Sixteen
   partial sums per product (two vectors of eight); the flags are constants in each
   inlined copy. */
static inline __attribute__((always_inline)) void cs_row(
    const float* restrict x, int64_t cols, const float* const* v, const float* const* va,
    float* out, const int k, const int ka, const int ones, const int abs_ones,
    const int first_ones) {
  cs_v8 acc[2 * CS_MAXK][2];
  memset(acc, 0, sizeof acc);
  const int64_t body = cols / CS_LANES * CS_LANES;
  for (int64_t c = 0; c < body; c += CS_LANES) {
    for (int h = 0; h < 2; ++h) {
      const cs_v8 xv = cs_load(x + c + 8 * h);
      const cs_v8 xa = CS_ABS(xv);
      for (int p = 0; p < k; ++p)
        acc[p][h] += ones || (first_ones && p == 0) ? xv : cs_load(v[p] + c + 8 * h) * xv;
      for (int p = 0; p < ka; ++p)
        acc[CS_MAXK + p][h] += abs_ones || (first_ones && p == 0)
                                   ? xa : cs_load(va[p] + c + 8 * h) * xa;
    }
  }
  for (int p = 0; p < k; ++p) {
    float t = 0.0f;
    for (int64_t d = body; d < cols; ++d)
      t += (ones || (first_ones && p == 0) ? 1.0f : v[p][d]) * x[d];
    const cs_v8 v2 = acc[p][0] + acc[p][1];
    out[p] = t + CS_HSUM(v2);
  }
  for (int p = 0; p < ka; ++p) {
    float t = 0.0f;
    for (int64_t d = body; d < cols; ++d)
      t += (abs_ones || (first_ones && p == 0) ? 1.0f : va[p][d]) * __builtin_fabsf(x[d]);
    const cs_v8 v2 = acc[CS_MAXK + p][0] + acc[CS_MAXK + p][1];
    out[CS_MAXK + p] = t + CS_HSUM(v2);
  }
}

CLONES static void cs_rows_range(const float* A, int64_t i0, int64_t i1, int64_t ld,
                                 int64_t cols, const float* const* v, int k,
                                 const float* const* va, int ka, float* const* r,
                                 float* const* ra) {
  /* every v_p NULL (ones), or none, or (k = ka = 2) v_0 and va_0 NULL, v_1 and va_1 not */
  const int mixed = k == 2 && ka == 2 && !v[0] && v[1] && !va[0] && va[1];
  const int ones = !mixed && (k == 0 || !v[0]), abs_ones = !mixed && (ka == 0 || !va[0]);
  for (int64_t i = i0; i < i1; ++i) {
    const float* x = A + i * ld;
    float out[2 * CS_MAXK];
    if (ones && abs_ones && k == 1 && ka == 1) cs_row(x, cols, v, va, out, 1, 1, 1, 1, 0);
    else if (ones && k == 1 && ka == 0) cs_row(x, cols, v, va, out, 1, 0, 1, 1, 0);
    else if (!ones && !abs_ones && k == 1 && ka == 1) cs_row(x, cols, v, va, out, 1, 1, 0, 0, 0);
    else if (mixed) cs_row(x, cols, v, va, out, 2, 2, 0, 0, 1);
    else cs_row(x, cols, v, va, out, k, ka, ones, abs_ones, 0);
    for (int p = 0; p < k; ++p) r[p][i] = out[p];
    for (int p = 0; p < ka; ++p) ra[p][i] = out[CS_MAXK + p];
  }
}

typedef struct {
  const float* A; int64_t rows, ld, cols, lo, hi;
  const float* u[CS_MAXK]; int k; const float* a[CS_MAXK]; int ka;
  float* s[CS_MAXK]; float* b[CS_MAXK]; int by_rows;
} cs_job_t;

static void* cs_thread(void* arg) {
  cs_job_t* j = (cs_job_t*)arg;
  if (j->by_rows)
    cs_rows_range(j->A, j->lo, j->hi, j->ld, j->cols, j->u, j->k, j->a, j->ka, j->s, j->b);
  else
    cs_cols_range(j->A, j->rows, j->ld, j->lo, j->hi, j->u, j->k, j->a, j->ka, j->s, j->b);
  return 0;
}

/* Splits [0, extent) into up to `threads` ranges (multiples of 16) and runs them. */
static void cs_parallel(cs_job_t base, int64_t extent, int threads) {
  cs_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(extent, threads, 16, &per);
  for (int t = 0; t < used; ++t) {
    jobs[t] = base;
    jobs[t].lo = (int64_t)t * per;
    jobs[t].hi = extent - jobs[t].lo < per ? extent : jobs[t].lo + per;
  }
  run_jobs(cs_thread, jobs, sizeof jobs[0], used);
}

/* The columns' pass (common.h, sdc_cs_cols_args; see cs_cols_k). 0, or 1 on bad
   arguments. */
int sdc_cs_cols(const sdc_cs_cols_args* a) {
  const int64_t rows = a->rows, cols = a->cols;
  const int k = a->k, ka = a->ka;
  if (rows < 0 || cols < 0 || a->ld < cols || k < 0 || k > CS_MAXK || ka < 0 || ka > CS_MAXK)
    return 1;
  cs_job_t job = {a->A, rows, a->ld, cols, 0, 0, {a->u0, a->u1}, k, {a->a0, a->a1}, ka,
                  {a->s0, a->s1}, {a->b0, a->b1}, 0};
  for (int p = 0; p < k; ++p)
    if (!(a->acc_mask >> p & 1)) memset(job.s[p], 0, sizeof(float) * (size_t)cols);
  for (int p = 0; p < ka; ++p)
    if (!(a->acc_mask >> (2 + p) & 1)) memset(job.b[p], 0, sizeof(float) * (size_t)cols);
  cs_parallel(job, cols, a->threads);
  return 0;
}

/* The rows' pass (common.h, sdc_cs_rows_args; see cs_rows_range). 0, or 1 on bad
   arguments. */
int sdc_cs_rows(const sdc_cs_rows_args* a) {
  const int64_t n = a->n, cols = a->cols;
  const int k = a->k, ka = a->ka;
  const float *v0 = a->v0, *v1 = a->v1, *va0 = a->va0, *va1 = a->va1;
  if (n < 0 || cols < 0 || a->ld < cols || k < 0 || k > CS_MAXK || ka < 0 || ka > CS_MAXK)
    return 1;
  const int mixed = k == 2 && ka == 2 && !v0 && v1 && !va0 && va1;
  if (!mixed && ((k == 2 && !v0 != !v1) || (ka == 2 && !va0 != !va1))) return 1;
  cs_job_t job = {a->A, n, a->ld, cols, 0, 0, {v0, v1}, k, {va0, va1}, ka, {a->r0, a->r1},
                  {a->ra0, a->ra1}, 1};
  cs_parallel(job, n, a->threads);
  return 0;
}

/* Row sums of A (n x cols, row stride ld): r = A e, and ra = |A| e unless ra is NULL. */
static int rows_of(const float* A, int64_t n, int64_t cols, int64_t ld, float* r, float* ra,
                   int threads) {
  return sdc_cs_rows(&(sdc_cs_rows_args){.A = A, .n = n, .cols = cols, .ld = ld, .k = 1,
                                         .ka = ra ? 1 : 0, .r0 = r, .ra0 = ra,
                                         .threads = threads});
}

/* The entries i < n that fail |lhs[i] - (rhs[i] + rhs0)| <= (bound[i] + bound0) * tol,
   in double: their count. Only an entry with a finite bound can fail: a non-finite bound
   means non-finite operands (a NaN in the data), which make a non-finite product without
   any fault in it. Then a NaN in the difference fails; with finite_only, only a finite
   difference can fail (a GradScaler's overflow is the scaler's business). */
int64_t sdc_cs_compare(const float* lhs, const float* rhs, const float* bound, int64_t n,
                       double rhs0, double bound0, double tol, int finite_only) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = __builtin_fabs((double)lhs[i] - ((double)rhs[i] + rhs0));
    const double t = ((double)bound[i] + bound0) * tol;
    if (finite_only) bad += d > t && d - d == 0.0;
    else bad += !(d <= t) && t - t == 0.0;
  }
  return bad;
}

/* A 1 the compiler cannot fold (cs_rc). */
static volatile float cs_one = 1.0f;

/* Rows [i0, i1), columns [c0, c1) of A (row stride ld), each element read once: per row,
   r[i] = v . A[i][c0:c1] and ra[i] = va . |A[i][c0:c1]| (rows_on; v, va NULL: ones), and
   per column, s[c] += sum_i u[i] A[i][c] and b[c] += sum_i a[i] |A[i][c]| (cols_on; u, a
   NULL: ones). Four rows at a time: one load and store of each column accumulator serves
   four rows, eight lanes of partial sums per row dot. pf (elements; 0: none): a line
   pf elements past each one read is prefetched into the outer caches (sdc_fp_wsum's next
   tiles, fetched while this one is summed). */
static inline __attribute__((always_inline)) void cs_rc(
    const float* restrict A, int64_t ld, int64_t i0, int64_t i1, int64_t c0, int64_t c1,
    const float* restrict v, const float* restrict va, float* restrict r,
    float* restrict ra, const float* restrict u, const float* restrict a,
    float* restrict s, float* restrict b, const int rows_on, const int cols_on,
    const int v_ones, const int u_ones, const int acc_rows, const int64_t pf) {
  /* The column sums of ones multiply by a 1 the compiler cannot see (cs_one): a fused
     multiply-add by 1 is the addition to the bit, and it runs on the multiply pipes, which
     the row sums' additions leave idle (half the additions of a pass of sums alone). */
  const float one = cs_one;
  const int64_t body = c0 + (c1 - c0) / 8 * 8;
  int64_t i = i0;
  for (; i + CS_UNROLL <= i1; i += CS_UNROLL) {
    const float* restrict x[CS_UNROLL];
    float uc[CS_UNROLL], ac[CS_UNROLL];
    cs_v8 rv[CS_UNROLL], qv[CS_UNROLL];
    for (int q = 0; q < CS_UNROLL; ++q) {
      x[q] = A + (i + q) * ld;
      uc[q] = u_ones ? one : (cols_on ? u[i + q] : 0.0f);
      ac[q] = u_ones ? one : (cols_on ? a[i + q] : 0.0f);
      rv[q] = (cs_v8){0};
      qv[q] = (cs_v8){0};
    }
    for (int64_t c = c0; c < body; c += 8) {
      cs_v8 w[CS_UNROLL], m[CS_UNROLL];
      for (int q = 0; q < CS_UNROLL; ++q) {
        w[q] = cs_load(x[q] + c);
        m[q] = CS_ABS(w[q]);
      }
      if (pf && ((c - c0) & 15) == 0)  /* a 64-byte line every other vector */
        for (int q = 0; q < CS_UNROLL; ++q) __builtin_prefetch(x[q] + c + pf, 0, 1);
      if (rows_on) {
        if (v_ones) {
          for (int q = 0; q < CS_UNROLL; ++q) { rv[q] += w[q]; qv[q] += m[q]; }
        } else {
          const cs_v8 vv = cs_load(v + c), vva = cs_load(va + c);
          for (int q = 0; q < CS_UNROLL; ++q) { rv[q] += vv * w[q]; qv[q] += vva * m[q]; }
        }
      }
      if (cols_on) {
        cs_v8 sv = cs_load(s + c), bv = cs_load(b + c);
        for (int q = 0; q < CS_UNROLL; ++q) { sv += uc[q] * w[q]; bv += ac[q] * m[q]; }
        memcpy(s + c, &sv, sizeof sv);
        memcpy(b + c, &bv, sizeof bv);
      }
    }
    for (int q = 0; q < CS_UNROLL; ++q) {
      float t = 0.0f, ta = 0.0f;
      for (int64_t c = body; c < c1; ++c) {
        const float e = x[q][c], ea = __builtin_fabsf(e);
        if (rows_on) {
          t += (v_ones ? 1.0f : v[c]) * e;
          ta += (v_ones ? 1.0f : va[c]) * ea;
        }
        if (cols_on) {
          s[c] += uc[q] * e;
          b[c] += ac[q] * ea;
        }
      }
      if (rows_on) {
        t += CS_HSUM(rv[q]);
        ta += CS_HSUM(qv[q]);
        r[i + q] = acc_rows ? r[i + q] + t : t;
        ra[i + q] = acc_rows ? ra[i + q] + ta : ta;
      }
    }
  }
  for (; i < i1; ++i) {
    const float* restrict xi = A + i * ld;
    const float ui = u_ones ? one : (cols_on ? u[i] : 0.0f);
    const float ai = u_ones ? one : (cols_on ? a[i] : 0.0f);
    cs_v8 rv = {0}, qv = {0};
    for (int64_t c = c0; c < body; c += 8) {
      const cs_v8 w = cs_load(xi + c), m = CS_ABS(w);
      if (pf && ((c - c0) & 15) == 0) __builtin_prefetch(xi + c + pf, 0, 1);
      if (rows_on) {
        rv += v_ones ? w : cs_load(v + c) * w;
        qv += v_ones ? m : cs_load(va + c) * m;
      }
      if (cols_on) {
        cs_v8 sv = cs_load(s + c), bv = cs_load(b + c);
        sv += ui * w;
        bv += ai * m;
        memcpy(s + c, &sv, sizeof sv);
        memcpy(b + c, &bv, sizeof bv);
      }
    }
    float t = 0.0f, ta = 0.0f;
    for (int64_t c = body; c < c1; ++c) {
      const float e = xi[c], ea = __builtin_fabsf(e);
      if (rows_on) {
        t += (v_ones ? 1.0f : v[c]) * e;
        ta += (v_ones ? 1.0f : va[c]) * ea;
      }
      if (cols_on) {
        s[c] += ui * e;
        b[c] += ai * ea;
      }
    }
    if (rows_on) {
      t += CS_HSUM(rv);
      ta += CS_HSUM(qv);
      r[i] = acc_rows ? r[i] + t : t;
      ra[i] = acc_rows ? ra[i] + ta : ta;
    }
  }
}

typedef struct {
  const float* A; int64_t ld, rows, c0, c1;
  const float *v, *va; float *r, *ra; const float *u, *a; float *s, *b;
} rc_job_t;

/* cs_rc over all rows and columns [c0, c1), the columns a block at a time (the column
   accumulators stay in L1), the row dots summed over the blocks. */
CLONES static void cs_rc_range(const rc_job_t* j) {
  const int rows_on = j->r != 0, cols_on = j->s != 0;
  const int v_ones = !j->v, u_ones = !j->u;
  if (rows_on && j->c0 >= j->c1)
    for (int64_t i = 0; i < j->rows; ++i) j->r[i] = j->ra[i] = 0.0f;
  for (int64_t lo = j->c0; lo < j->c1; lo += CS_COLBLOCK) {
    const int64_t hi = j->c1 - lo < CS_COLBLOCK ? j->c1 : lo + CS_COLBLOCK;
    const int acc = lo > j->c0;
#define CS_RC(R, C, V, U) cs_rc(j->A, j->ld, 0, j->rows, lo, hi, j->v, j->va, j->r, j->ra, \
                                j->u, j->a, j->s, j->b, R, C, V, U, acc, 0)
    if (rows_on && cols_on && v_ones && u_ones) CS_RC(1, 1, 1, 1);
    else if (rows_on && cols_on && !v_ones && !u_ones) CS_RC(1, 1, 0, 0);
    else if (rows_on && !cols_on && v_ones) CS_RC(1, 0, 1, 1);
    else if (rows_on && !cols_on) CS_RC(1, 0, 0, 1);
    else if (cols_on && u_ones) CS_RC(0, 1, 1, 1);
    else if (cols_on) CS_RC(0, 1, 1, 0);
    else CS_RC(rows_on, cols_on, v_ones, u_ones);
#undef CS_RC
  }
}

static void* rc_thread(void* arg) {
  cs_rc_range((const rc_job_t*)arg);
  return 0;
}

/* One pass over A (rows x cols, row stride ld): r = A v and ra = |A| va (r NULL: none; v,
   va NULL: ones), s (+)= A^T u and b (+)= |A|^T a (s NULL: none; u, a NULL: ones; add: the
   column sums add to what s and b hold). Threads split the columns; their row dots are
   summed at the end. */
typedef struct {
  const float* A; int64_t rows, cols, ld;
  const float* v; const float* va; float* r; float* ra;
  const float* u; const float* a; float* s; float* b; int add;
  int threads;
} rowcol_t;

/* 0, or 1 on bad arguments (or no memory for the threads' row dots). */
static int cs_rowcol(const rowcol_t* p) {
  const float *A = p->A, *v = p->v, *va = p->va, *u = p->u, *a = p->a;
  const int64_t rows = p->rows, cols = p->cols, ld = p->ld;
  float *r = p->r, *ra = p->ra, *s = p->s, *b = p->b;
  const int add = p->add, threads = p->threads;
  if (rows < 0 || cols < 0 || ld < cols || (r && !ra) || (s && !b) || (!v != !va)
      || (!u != !a))
    return 1;
  if (s && !add) {
    memset(s, 0, sizeof(float) * (size_t)cols);
    memset(b, 0, sizeof(float) * (size_t)cols);
  }
  rc_job_t jobs[MAX_THREADS];
  int64_t per;
  int used = split(cols, threads, 16, &per);
  float* scratch = 0;  /* the row dots of threads 1.. */
  if (r && used > 1 && !(scratch = malloc(sizeof(float) * 2 * (size_t)rows * (size_t)used)))
    used = 1, per = cols;
  for (int t = 0; t < used; ++t) {
    jobs[t] = (rc_job_t){A, ld, rows, (int64_t)t * per, 0, v, va, r, ra, u, a, s, b};
    jobs[t].c1 = cols - jobs[t].c0 < per ? cols : jobs[t].c0 + per;
    if (r && t > 0) {
      jobs[t].r = scratch + 2 * rows * t;
      jobs[t].ra = jobs[t].r + rows;
    }
  }
  if (used == 0 && r)
    for (int64_t i = 0; i < rows; ++i) r[i] = ra[i] = 0.0f;
  run_jobs(rc_thread, jobs, sizeof jobs[0], used);
  for (int t = 1; t < used && r; ++t)
    for (int64_t i = 0; i < rows; ++i) {
      r[i] += jobs[t].r[i];
      ra[i] += jobs[t].ra[i];
    }
  free(scratch);
  return 0;
}

/* The checksum check's hooks, one call each (sdc_guard.checks.checksum): the passes above
   strung together in C, so that a hook makes one foreign call instead of four or five.
   Each reads a matrix once, while it is in cache where it can: X and Y right after the
   forward product, GY and GX right after the backward one. */

/* The forward hook of a call Y = X W^T + b (common.h, sdc_cs_fwd_args): the forward
   identity compares Y e against X wc + bsum[0] within (|X| wac + bsum[1]) tol, with
   wc = e^T W and wac = e^T |W| the first 2 in floats of wsum. The number of entries that
   fail, or -1 on bad arguments. */
int64_t sdc_cs_fwd(const sdc_cs_fwd_args* a) {
  const int64_t n = a->n, in = a->inner, out = a->out;
  if (n < 0 || in < 0 || out < 0 || a->ldw < in) return -1;
  float *wsum = a->wsum, *bsum = a->bsum;
  float *wc = wsum, *wac = wc + in, *wr = wac + in, *war = wr + out;
  if (a->w_fresh) {
    if (cs_rowcol(&(rowcol_t){.A = a->W, .rows = out, .cols = in, .ld = a->ldw, .r = wr,
                              .ra = war, .s = wc, .b = wac, .threads = a->threads_w}))
      return -1;
    bsum[0] = bsum[1] = 0.0f;
    if (a->bias && rows_of(a->bias, 1, out, out, bsum, bsum + 1, 1)) return -1;
  }
  float *xs = a->res, *xa = xs + n, *ys = xa + n, *fr = ys + n, *fb = fr + n;
  if (a->check) {
    if (sdc_cs_rows(&(sdc_cs_rows_args){.A = a->X, .n = n, .cols = in, .ld = a->ldx,
                                        .v1 = wc, .k = 2, .va1 = wac, .ka = 2, .r0 = xs,
                                        .r1 = fr, .ra0 = xa, .ra1 = fb,
                                        .threads = a->threads_x}))
      return -1;
  } else if (rows_of(a->X, n, in, a->ldx, xs, xa, a->threads_x)) {
    return -1;
  }
  if (rows_of(a->Y, n, out, a->ldy, ys, 0, a->threads_y)) return -1;
  return a->check ? sdc_cs_compare(ys, fr, fb, n, bsum[0], bsum[1], a->tol, a->finite_only)
                  : 0;
}

/* The backward hook of that call (common.h, sdc_cs_bwd_args): row i of GX sums to row i
   of GY times W e. The number of input-gradient entries that fail, or -1 on bad
   arguments. */
int64_t sdc_cs_bwd(const sdc_cs_bwd_args* a) {
  const int64_t n = a->n;
  if (n < 0 || a->out < 0 || a->inner < 0) return -1;
  const int side = a->gx_side, gw = a->gw;
  if ((side || gw)
      && cs_rowcol(&(rowcol_t){.A = a->GY, .rows = n, .cols = a->out, .ld = a->ldg,
                               .v = a->wr, .va = a->war, .r = side ? a->gxs : 0,
                               .ra = side ? a->gxs + n : 0, .u = a->x_rows,
                               .a = a->x_rows + n, .s = gw ? a->gw_rhs : 0,
                               .b = gw ? a->gw_bound : 0, .add = a->gw_add,
                               .threads = a->threads_g}))
    return -1;
  if (!a->GX) return 0;
  return sdc_cs_gx(a->GX, n, a->inner, a->ldx, a->gxs, a->tol, a->finite_only, a->threads_x);
}

/* The weights check's fingerprint pass over a layer's weight W (rows x cols float32,
   contiguous) with the checksum check's sums of it taken in the same read: tiles of a few
   rows (FW_TILE bytes, in L1) are read for the fingerprint's words and then again, from
   cache, for the sums. The sums wait on the floating-point pipes, not on memory, so while a
   tile is summed the tile FW_AHEAD tiles on is prefetched: the next tiles' reads then find
   it in cache instead of waiting on L3 or memory. */
#define FW_TILE 16384
#define FW_AHEAD 2
typedef struct {
  const float* W; int64_t cols, r0, r1; float *wr, *war, *s, *b; uint64_t s1, s2;
  int v2; uint64_t g;
} fw_job_t;

/* Rows [r0, r1): s1 = sum v, s2 = sum i v over their uint32 lanes (i from the job's
   first lane), with v2 also g = sum 2^rho(i) v (i from W's first lane: block6), r = W e and
   ra = |W| e of each row, s = e^T W and b = e^T |W| over them. */
CLONES static void fw_range(fw_job_t* j) {
  const int64_t cols = j->cols;
  int64_t tile = cols ? FW_TILE / (4 * cols) : 1;
  if (tile < 1) tile = 1;
  if (cols % 2 && tile % 2) ++tile;  /* tiles from even lanes (block6's fast path) */
  memset(j->s, 0, sizeof(float) * (size_t)cols);
  memset(j->b, 0, sizeof(float) * (size_t)cols);
  uint64_t a1 = 0, a2 = 0, a3 = 0;
  for (int64_t i = j->r0; i < j->r1; i += tile) {
    const int64_t i1 = j->r1 - i < tile ? j->r1 : i + tile;
    const uint64_t lane0 = (uint64_t)((i - j->r0) * cols);
    uint64_t c1, c2, c3 = 0;
    if (j->v2) block6(j->W + i * cols, (i1 - i) * cols, (uint64_t)(i * cols), &c1, &c2, &c3);
    else block0(j->W + i * cols, (i1 - i) * cols, &c1, &c2);
    a1 += c1;
    a2 += c2 + lane0 * c1;
    a3 += c3;
    if (!cols)
      for (int64_t r = i; r < i1; ++r) j->wr[r] = j->war[r] = 0.0f;
    for (int64_t lo = 0; lo < cols; lo += CS_COLBLOCK) {
      const int64_t hi = cols - lo < CS_COLBLOCK ? cols : lo + CS_COLBLOCK;
      cs_rc(j->W, cols, i, i1, lo, hi, 0, 0, j->wr, j->war, 0, 0, j->s, j->b, 1, 1, 1, 1,
            lo > 0, FW_AHEAD * (i1 - i) * cols);
    }
  }
  j->s1 = a1;
  j->s2 = a2;
  j->g = a3;
}

static void* fw_thread(void* arg) {
  fw_range((fw_job_t*)arg);
  return 0;
}

/* out = {sum_k (2k + 1) v_k, sum_k v_k} over W's rows * cols uint32 lanes, as
   sdc_weighted_sum(W, rows * cols, 0, ...) gives them (version 2: out[0] as mode 6 gives it), and wsum = [e^T W, e^T |W| (cols
   each), W e, |W| e (rows each)], bsum = the bias's sum and absolute sum (bias: rows
   floats, or NULL), as sdc_cs_fwd's weight pass gives them (the float sums in another
   order; the same bits from one call to the next with the same threads). Threads split
   the rows. 0, or 1 on bad arguments (or no memory for the threads' column sums). */
int sdc_fp_wsum(const float* W, int64_t rows, int64_t cols, const float* bias, float* wsum,
                float* bsum, int threads, int version, uint64_t* out) {
  if (rows < 0 || cols < 0 || version < 1 || version > 2) return 1;
  float *wc = wsum, *wac = wc + cols, *wr = wac + cols, *war = wr + rows;
  fw_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(rows, threads, cols % 2 ? 2 : 1, &per);  /* even lanes, as the tiles */
  float* scratch = 0;  /* the column sums of threads 1.. */
  if (used > 1 && !(scratch = malloc(sizeof(float) * 2 * (size_t)cols * (size_t)used))) return 1;
  for (int t = 0; t < used; ++t) {
    jobs[t] = (fw_job_t){W, cols, (int64_t)t * per, 0, wr, war, wc, wac, 0, 0, version == 2, 0};
    jobs[t].r1 = rows - jobs[t].r0 < per ? rows : jobs[t].r0 + per;
    if (t > 0) {
      jobs[t].s = scratch + 2 * cols * t;
      jobs[t].b = jobs[t].s + cols;
    }
  }
  if (used == 0) {
    memset(wc, 0, sizeof(float) * 2 * (size_t)cols);
  }
  run_jobs(fw_thread, jobs, sizeof jobs[0], used);
  uint64_t total = 0, plain = 0, extra = 0;
  for (int t = 0; t < used; ++t) {
    const uint64_t lo = (uint64_t)(jobs[t].r0 * cols);
    total += (2 * lo + 1) * jobs[t].s1 + 2 * jobs[t].s2;
    plain += jobs[t].s1;
    extra += jobs[t].g;
    for (int64_t c = 0; c < cols && t > 0; ++c) {
      wc[c] += jobs[t].s[c];
      wac[c] += jobs[t].b[c];
    }
  }
  free(scratch);
  out[0] = version == 2 ? (total << 8) + extra : total;
  out[1] = plain;
  bsum[0] = bsum[1] = 0.0f;
  if (bias && rows_of(bias, 1, rows, rows, bsum, bsum + 1, 1)) return 1;
  return 0;
}

/* Input-gradient hook: gxs[2n, 3n) = GX e (GX: n x in, ld), compared with gxs[0, n)
   within gxs[n, 2n) * tol (as sdc_cs_compare). The number of entries that fail, or -1
   on bad arguments. */
int64_t sdc_cs_gx(const float* GX, int64_t n, int64_t in, int64_t ld, float* gxs, double tol,
                  int finite_only, int threads) {
  if (rows_of(GX, n, in, ld, gxs + 2 * n, 0, threads)) return -1;
  return sdc_cs_compare(gxs + 2 * n, gxs, gxs + n, n, 0.0, 0.0, tol, finite_only);
}
