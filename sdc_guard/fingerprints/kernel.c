#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

/* Element values by mode: 0 = uint32 lane zero-extended, 1 = 64-bit word X mapped to
   X ^ (X >>> 32), 2 = raw 64-bit word. */

/* Software prefetch distance in bytes. These loops do a few integer operations per
   word; a core that waits for each cache line in turn and only then does them stays
   well short of the memory bandwidth (most on AVX2, where each vector holds half as
   many words). Asking for the line 4 KiB ahead overlaps the wait with the arithmetic
   (`python -m bench` measures each instruction set side by side). */
#ifndef SDC_PREFETCH
#define SDC_PREFETCH 4096
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SDC_NO_CLONES)
#define SDC_X86 1
#endif

/* Sums over m 64-bit words X_k at x, k from 0 (mod 2^64), in out[0..3]:
   mode 0: sum X, sum k X, sum hi, sum k hi (hi = X >> 32: the word's upper uint32 lane);
   mode 1: sum Y, sum k Y over Y = X ^ (X >> 32), out[2..3] = 0;
   mode 2: sum X, sum k X, out[2..3] = 0.
   NV vectors of VB bytes make one block of S words: word k = S b + s sits in stream s,
   which keeps P_s = sum_b v and Q_s = sum_b (nb - 1 - b) v (Q += P, then P += v: two
   additions per vector, no multiply), so that sum_b b v = (nb - 1) P_s - Q_s. One copy
   per vector width; GCC and Clang vector extensions, no intrinsics. */
#define WORDS(NAME, TARGET, VB)                                                        \
  typedef uint64_t NAME##_vec __attribute__((vector_size(VB)));                        \
  TARGET static void NAME(const char* x, int64_t m, int mode, uint64_t* out) {         \
    enum { L = VB / 8, NV = 2, S = L * NV };                                           \
    NAME##_vec P[NV], Q[NV], PH[NV], QH[NV];                                           \
    memset(P, 0, sizeof P); memset(Q, 0, sizeof Q);                                    \
    memset(PH, 0, sizeof PH); memset(QH, 0, sizeof QH);                                \
    const int64_t nb = m / S;                                                          \
    for (int64_t b = 0; b < nb; ++b)                                                   \
      for (int j = 0; j < NV; ++j) {                                                   \
        const char* at = x + 8 * (b * S + j * L);                                      \
        if ((j * VB) % 64 == 0) __builtin_prefetch(at + SDC_PREFETCH);                 \
        NAME##_vec v;                                                                  \
        memcpy(&v, at, VB);                                                            \
        Q[j] += P[j];                                                                  \
        if (mode == 0) {                                                               \
          QH[j] += PH[j];                                                              \
          PH[j] += v >> 32;                                                            \
        } else if (mode == 1) {                                                        \
          v ^= v >> 32;                                                                \
        }                                                                              \
        P[j] += v;                                                                     \
      }                                                                                \
    uint64_t a = 0, k = 0, h = 0, kh = 0;                                              \
    for (int j = 0; j < NV; ++j)                                                       \
      for (int l = 0; l < L; ++l) {                                                    \
        const uint64_t s = (uint64_t)(j * L + l);                                      \
        a += P[j][l];                                                                  \
        k += (uint64_t)S * ((uint64_t)(nb - 1) * P[j][l] - Q[j][l]) + s * P[j][l];     \
        h += PH[j][l];                                                                 \
        kh += (uint64_t)S * ((uint64_t)(nb - 1) * PH[j][l] - QH[j][l]) + s * PH[j][l]; \
      }                                                                                \
    for (int64_t i = nb * S; i < m; ++i) {                                             \
      uint64_t w;                                                                      \
      memcpy(&w, x + 8 * i, 8);                                                        \
      const uint64_t hi = w >> 32;                                                     \
      if (mode == 1) w ^= hi;                                                          \
      a += w;                                                                          \
      k += (uint64_t)i * w;                                                            \
      if (mode == 0) {                                                                 \
        h += hi;                                                                       \
        kh += (uint64_t)i * hi;                                                        \
      }                                                                                \
    }                                                                                  \
    out[0] = a; out[1] = k; out[2] = h; out[3] = kh;                                   \
  }

WORDS(words_base, , 16)
#ifdef SDC_X86
WORDS(words_avx2, __attribute__((target("avx2"))), 32)
WORDS(words_avx512, __attribute__((target("avx512f"))), 64)
#endif

/* The widest copy this CPU runs: 2 = AVX-512F, 1 = AVX2, 0 = the baseline (SSE2 on
   x86-64). sdc_isa may lower it, to measure a narrower machine's code on this one. */
static int isa_top = -1, isa_used = -1;

static int cpu_isa(void) {
#ifdef SDC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
#endif
  return 0;
}

/* The instruction set in use; want >= 0 selects min(want, what the CPU has), want = -2
   asks for what the CPU has. */
int sdc_isa(int want) {
  if (isa_top < 0) isa_top = cpu_isa();
  if (isa_used < 0) isa_used = isa_top;
  if (want == -2) return isa_top;
  if (want >= 0) isa_used = want < isa_top ? want : isa_top;
  return isa_used;
}

static void words(const char* x, int64_t m, int mode, uint64_t* out) {
  switch (sdc_isa(-1)) {
#ifdef SDC_X86
    case 2: words_avx512(x, m, mode, out); return;
    case 1: words_avx2(x, m, mode, out); return;
#endif
    default: words_base(x, m, mode, out);
  }
}

/* s1 = sum v_i and s2 = sum i * v_i (mod 2^64) over n elements, i from 0.
   block0: n uint32 lanes v, zero-extended. Lane 2k is the low half lo_k of word X_k,
   lane 2k + 1 its high half hi_k, so with X_k = lo_k + 2^32 hi_k (exactly):
   sum lo = sum X - 2^32 sum hi, sum k lo = sum k X - 2^32 sum k hi, and
   s1 = sum lo + sum hi, s2 = 2 (sum k lo + sum k hi) + sum hi. */
static void block0(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
  uint64_t o[4];
  words((const char*)x, n / 2, 0, o);
  const uint64_t lo = o[0] - (o[2] << 32), klo = o[1] - (o[3] << 32);
  *s1 = lo + o[2];
  *s2 = 2 * (klo + o[3]) + o[2];
  if (n % 2) {
    uint32_t v;
    memcpy(&v, (const char*)x + 4 * (n - 1), 4);
    *s1 += v;
    *s2 += (uint64_t)(n - 1) * v;
  }
}

/* block1: n words mapped to X ^ (X >>> 32); block2: n words as they are. */
static void block1(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
  uint64_t o[4];
  words((const char*)x, n, 1, o);
  *s1 = o[0];
  *s2 = o[1];
}

static void block2(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
  uint64_t o[4];
  words((const char*)x, n, 2, o);
  *s1 = o[0];
  *s2 = o[1];
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SDC_NO_CLONES)
/* One copy per x86-64 level, chosen when the library loads: v4 (AVX-512 F, BW, CD, DQ,
   VL) and v3 (AVX2 with FMA), so that the checksum's float loops multiply and add in one
   instruction, on other pipes than their plain additions; a compiler without the levels
   (GCC < 11) builds one copy per instruction set instead (SDC_ISA_CLONES, native.build). */
#ifdef SDC_ISA_CLONES
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#else
#define CLONES
#endif

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

/* How many jobs of `*per` elements (a multiple of align) cover extent elements on up to
   `threads` threads; the last job may be shorter. */
static int split(int64_t extent, int threads, int64_t align, int64_t* per) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  *per = ((extent + threads - 1) / threads + align - 1) / align * align;
  if (*per < align) *per = align;
  return (int)((extent + *per - 1) / *per);
}

/* Runs fn on each of used jobs (size bytes apart, from jobs): job 0, and any whose thread
   failed to start, on the caller's thread; the others on threads of their own. */
static void run_jobs(void* (*fn)(void*), void* jobs, size_t size, int used) {
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  char* at = (char*)jobs;
  for (int t = 1; t < used; ++t) started[t] = pthread_create(&ids[t], 0, fn, at + t * size) == 0;
  for (int t = 0; t < used; ++t)
    if (!started[t]) fn(at + t * size);
  for (int t = 1; t < used; ++t)
    if (started[t]) pthread_join(ids[t], 0);
}

/* out = {sum_k (2k + 1) v_k, sum_k v_k} (mod 2^64) over n elements of x. Mode 3 (see
   scale_words) also scales x in place and sets out[2] to 1 if a float was NaN or Inf. */
static int weighted(const void* x, int64_t n, int mode, int threads, float scale,
                    uint64_t* out) {
  if (n < 0 || mode < 0 || mode > 5) return 1;
  job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(n, threads, 64, &per);
  for (int t = 0; t < used; ++t) {
    jobs[t].x = (const char*)x;
    jobs[t].lo = (int64_t)t * per;
    jobs[t].n = n - jobs[t].lo < per ? n - jobs[t].lo : per;
    jobs[t].mode = mode;
    jobs[t].scale = scale;
    jobs[t].bad = 0;
  }
  run_jobs(thread_main, jobs, sizeof jobs[0], used);
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

/* ---- Float32 passes of the checksum check (sdc_guard.checks.checksum) ----------------

   The check's sums are float32 sums in any order: its tolerance bounds the rounding of a
   float32 sum of any order (the gamma term of its formula), so these loops reassociate
   freely (several rows at once, partial sums per vector lane). They exist because each
   identity needs a few vector products with a matrix and with its absolute values;
   torch computes |W| into a new tensor first and spends a dispatch per small product. */

#define CS_MAXK 2

#pragma GCC diagnostic ignored "-Wpsabi" /* vector-returning helpers, always inlined */

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
typedef float cs_v8 __attribute__((vector_size(32)));
typedef int32_t cs_i8 __attribute__((vector_size(32)));
#define CS_LANES 16
static inline __attribute__((always_inline)) cs_v8 cs_load(const float* p) {
  cs_v8 v;
  memcpy(&v, p, sizeof v);
  return v;
}
/* |v|: the sign bits cleared (a vector cast keeps the bits) */
#define CS_ABS(v) ((cs_v8)((cs_i8)(v) & 0x7fffffff))
/* The sum of the eight lanes of the vector lvalue v as a tree (three additions deep, not
   a chain of eight: a row's reductions are much of the work on short rows). */
#define CS_HSUM(v) ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))
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

/* s_p (+)= u_p^T A for p < k, b_p (+)= a_p^T |A| for p < ka (see cs_cols_k); a NULL
   u_p or a_p is a vector of ones; bit p of acc_mask adds to s_p what it holds, bit 2 + p
   to b_p (else overwritten). 0, or 1 on bad arguments. */
int sdc_cs_cols(const float* A, int64_t rows, int64_t cols, int64_t ld, const float* u0,
                const float* u1, int k, const float* a0, const float* a1, int ka, float* s0,
                float* s1, float* b0, float* b1, int acc_mask, int threads) {
  if (rows < 0 || cols < 0 || ld < cols || k < 0 || k > CS_MAXK || ka < 0 || ka > CS_MAXK)
    return 1;
  cs_job_t job = {A, rows, ld, cols, 0, 0, {u0, u1}, k, {a0, a1}, ka, {s0, s1}, {b0, b1}, 0};
  for (int p = 0; p < k; ++p)
    if (!(acc_mask >> p & 1)) memset(job.s[p], 0, sizeof(float) * (size_t)cols);
  for (int p = 0; p < ka; ++p)
    if (!(acc_mask >> (2 + p) & 1)) memset(job.b[p], 0, sizeof(float) * (size_t)cols);
  cs_parallel(job, cols, threads);
  return 0;
}

/* r_p[i] = v_p . A[i] for p < k, ra_p[i] = va_p . |A[i]| for p < ka over the n rows of A
   (see cs_rows_range; every v_p is NULL, meaning ones, or none is; likewise va_p; or, with
   k = ka = 2, the first of each NULL and the second not). 0, or 1 on bad arguments. */
int sdc_cs_rows(const float* A, int64_t n, int64_t cols, int64_t ld, const float* v0,
                const float* v1, int k, const float* va0, const float* va1, int ka, float* r0,
                float* r1, float* ra0, float* ra1, int threads) {
  if (n < 0 || cols < 0 || ld < cols || k < 0 || k > CS_MAXK || ka < 0 || ka > CS_MAXK)
    return 1;
  const int mixed = k == 2 && ka == 2 && !v0 && v1 && !va0 && va1;
  if (!mixed && ((k == 2 && !v0 != !v1) || (ka == 2 && !va0 != !va1))) return 1;
  cs_job_t job = {A, n, ld, cols, 0, 0, {v0, v1}, k, {va0, va1}, ka, {r0, r1}, {ra0, ra1}, 1};
  cs_parallel(job, n, threads);
  return 0;
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
   summed at the end. 0, or 1 on bad arguments (or no memory for the threads' row dots). */
static int cs_rowcol(const float* A, int64_t rows, int64_t cols, int64_t ld, const float* v,
                     const float* va, float* r, float* ra, const float* u, const float* a,
                     float* s, float* b, int add, int threads) {
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

int64_t sdc_cs_gx(const float* GX, int64_t n, int64_t in, int64_t ld, float* gxs, double tol,
                  int finite_only, int threads);

/* The checksum check's hooks, one call each (sdc_guard.checks.checksum): the passes above
   strung together in C, so that a hook makes one foreign call instead of four or five.
   Each reads a matrix once, while it is in cache where it can: X and Y right after the
   forward product, GY and GX right after the backward one. */

/* Forward hook of a call Y = X W^T + b (X: n x in, row stride ldx; Y: n x out, ldy; W:
   out x in, ldw; bias: out floats or NULL). With w_fresh, first the weight's pass:
   wsum = [e^T W, e^T |W| (in each), W e, |W| e (out each)] (and bsum = the bias's sum and
   absolute sum), once per weight version: the forward's right-hand side and the input
   gradient's. Then out = [X e, |X| e, Y e, X (e^T W)^T, |X| (e^T |W|)^T] (n each), and the
   forward identity compared (check): Y e against X wc + bsum[0] within (|X| wac +
   bsum[1]) tol (finite_only: only a finite difference fails). wsum holds 2 in + 2 out
   floats, res 5 n. The number of entries that fail, or -1 on bad arguments. */
int64_t sdc_cs_fwd(const float* X, int64_t n, int64_t in, int64_t ldx, const float* Y,
                   int64_t out, int64_t ldy, const float* W, int64_t ldw, const float* bias,
                   float* wsum, float* bsum, int w_fresh, float* res, int check, double tol,
                   int finite_only, int threads_x, int threads_y, int threads_w) {
  if (n < 0 || in < 0 || out < 0 || ldw < in) return -1;
  float *wc = wsum, *wac = wc + in, *wr = wac + in, *war = wr + out;
  if (w_fresh) {
    if (cs_rowcol(W, out, in, ldw, 0, 0, wr, war, 0, 0, wc, wac, 0, threads_w)) return -1;
    bsum[0] = bsum[1] = 0.0f;
    if (bias && sdc_cs_rows(bias, 1, out, out, 0, 0, 1, 0, 0, 1, bsum, 0, bsum + 1, 0, 1))
      return -1;
  }
  float *xs = res, *xa = xs + n, *ys = xa + n, *fr = ys + n, *fb = fr + n;
  if (check) {
    if (sdc_cs_rows(X, n, in, ldx, 0, wc, 2, 0, wac, 2, xs, fr, xa, fb, threads_x)) return -1;
  } else if (sdc_cs_rows(X, n, in, ldx, 0, 0, 1, 0, 0, 1, xs, 0, xa, 0, threads_x)) {
    return -1;
  }
  if (sdc_cs_rows(Y, n, out, ldy, 0, 0, 1, 0, 0, 0, ys, 0, 0, 0, threads_y)) return -1;
  return check ? sdc_cs_compare(ys, fr, fb, n, bsum[0], bsum[1], tol, finite_only) : 0;
}

/* Backward hook of that call, given GY (n x out, ldg), wr = W e and war = |W| e (the
   forward's wsum) and x_rows = [X e, |X| e] (its out). gx_side: gxs[0, n) = GY wr and
   gxs[n, 2n) = |GY| war, the input gradient's right-hand side and bound (row i of GX sums
   to row i of GY times W e); gw: gw_rhs (+)= GY^T (X e), gw_bound (+)= |GY|^T (|X| e), the
   weight gradient's (gw_add: added to what they hold). Then, with GX (n x in, ldx: this
   call's input gradient; NULL: it comes later, sdc_cs_gx), gxs[2n, 3n) = GX e compared
   with the right-hand side within the bound times tol. gxs holds 3 n floats. The number
   of input-gradient entries that fail, or -1 on bad arguments. */
int64_t sdc_cs_bwd(const float* GY, int64_t n, int64_t out, int64_t ldg, const float* wr,
                   const float* war, const float* x_rows, float* gw_rhs, float* gw_bound,
                   int gw, int gw_add, int gx_side, float* gxs, const float* GX, int64_t in,
                   int64_t ldx, double tol, int finite_only, int threads_g, int threads_x) {
  if (n < 0 || out < 0 || in < 0) return -1;
  if ((gx_side || gw)
      && cs_rowcol(GY, n, out, ldg, wr, war, gx_side ? gxs : 0, gx_side ? gxs + n : 0,
                   x_rows, x_rows + n, gw ? gw_rhs : 0, gw ? gw_bound : 0, gw_add,
                   threads_g))
    return -1;
  if (!GX) return 0;
  return sdc_cs_gx(GX, n, in, ldx, gxs, tol, finite_only, threads_x);
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
} fw_job_t;

/* Rows [r0, r1): s1 = sum v, s2 = sum i v over their uint32 lanes (i from the job's
   first lane), r = W e and ra = |W| e of each row, s = e^T W and b = e^T |W| over them. */
CLONES static void fw_range(fw_job_t* j) {
  const int64_t cols = j->cols;
  int64_t tile = cols ? FW_TILE / (4 * cols) : 1;
  if (tile < 1) tile = 1;
  memset(j->s, 0, sizeof(float) * (size_t)cols);
  memset(j->b, 0, sizeof(float) * (size_t)cols);
  uint64_t a1 = 0, a2 = 0;
  for (int64_t i = j->r0; i < j->r1; i += tile) {
    const int64_t i1 = j->r1 - i < tile ? j->r1 : i + tile;
    const uint64_t lane0 = (uint64_t)((i - j->r0) * cols);
    uint64_t c1, c2;
    block0(j->W + i * cols, (i1 - i) * cols, &c1, &c2);
    a1 += c1;
    a2 += c2 + lane0 * c1;
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
}

static void* fw_thread(void* arg) {
  fw_range((fw_job_t*)arg);
  return 0;
}

/* out = {sum_k (2k + 1) v_k, sum_k v_k} over W's rows * cols uint32 lanes, as
   sdc_weighted_sum(W, rows * cols, 0, ...) gives them, and wsum = [e^T W, e^T |W| (cols
   each), W e, |W| e (rows each)], bsum = the bias's sum and absolute sum (bias: rows
   floats, or NULL), as sdc_cs_fwd's weight pass gives them (the float sums in another
   order; the same bits from one call to the next with the same threads). Threads split
   the rows. 0, or 1 on bad arguments (or no memory for the threads' column sums). */
int sdc_fp_wsum(const float* W, int64_t rows, int64_t cols, const float* bias, float* wsum,
                float* bsum, int threads, uint64_t* out) {
  if (rows < 0 || cols < 0) return 1;
  float *wc = wsum, *wac = wc + cols, *wr = wac + cols, *war = wr + rows;
  fw_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(rows, threads, 1, &per);
  float* scratch = 0;  /* the column sums of threads 1.. */
  if (used > 1 && !(scratch = malloc(sizeof(float) * 2 * (size_t)cols * (size_t)used))) return 1;
  for (int t = 0; t < used; ++t) {
    jobs[t] = (fw_job_t){W, cols, (int64_t)t * per, 0, wr, war, wc, wac, 0, 0};
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
  uint64_t total = 0, plain = 0;
  for (int t = 0; t < used; ++t) {
    const uint64_t lo = (uint64_t)(jobs[t].r0 * cols);
    total += (2 * lo + 1) * jobs[t].s1 + 2 * jobs[t].s2;
    plain += jobs[t].s1;
    for (int64_t c = 0; c < cols && t > 0; ++c) {
      wc[c] += jobs[t].s[c];
      wac[c] += jobs[t].b[c];
    }
  }
  free(scratch);
  out[0] = total;
  out[1] = plain;
  bsum[0] = bsum[1] = 0.0f;
  if (bias && sdc_cs_rows(bias, 1, rows, rows, 0, 0, 1, 0, 0, 1, bsum, 0, bsum + 1, 0, 1))
    return 1;
  return 0;
}

/* Input-gradient hook: gxs[2n, 3n) = GX e (GX: n x in, ld), compared with gxs[0, n)
   within gxs[n, 2n) * tol (as sdc_cs_compare). The number of entries that fail, or -1
   on bad arguments. */
int64_t sdc_cs_gx(const float* GX, int64_t n, int64_t in, int64_t ld, float* gxs, double tol,
                  int finite_only, int threads) {
  if (sdc_cs_rows(GX, n, in, ld, 0, 0, 1, 0, 0, 0, gxs + 2 * n, 0, 0, 0, threads))
    return -1;
  return sdc_cs_compare(gxs + 2 * n, gxs, gxs + n, n, 0.0, 0.0, tol, finite_only);
}

/* Rows [r0, r1) of a rows x cols float32 block at x: out[r] = the row's float32 sum (as it
   was), then the row multiplied by scale in place (scale_f32); 1 if any was NaN or Inf. */
CLONES static uint32_t cs_sum_scale_rows(float* x, int64_t r0, int64_t r1, int64_t cols,
                                         float scale, float* out) {
  const int64_t body = cols / CS_LANES * CS_LANES;
  cs_i8 flags = {0};
  uint32_t bad = 0;
  for (int64_t r = r0; r < r1; ++r) {
    float* row = x + r * cols;
    cs_v8 acc[2] = {{0}, {0}};
    for (int64_t c = 0; c < body; c += CS_LANES)  /* one read: sum, flag, scale, store */
      for (int h = 0; h < 2; ++h) {
        cs_v8 v = cs_load(row + c + 8 * h);
        acc[h] += v;
        flags |= ((cs_i8)v & 0x7f800000) == 0x7f800000;
        v *= scale;
        memcpy(row + c + 8 * h, &v, sizeof v);
      }
    float t = 0.0f;
    for (int64_t d = body; d < cols; ++d) t += row[d];
    const cs_v8 v2 = acc[0] + acc[1];
    out[r] = t + CS_HSUM(v2);
    bad |= scale_f32(row + body, cols - body, scale);
  }
  for (int l = 0; l < 8; ++l) bad |= flags[l] != 0;
  return bad;
}

typedef struct {
  float* x; int64_t r0, r1, cols; float scale; float* out; uint32_t bad;
} rows_job_t;

static void* rows_thread(void* arg) {
  rows_job_t* j = (rows_job_t*)arg;
  j->bad = cs_sum_scale_rows(j->x, j->r0, j->r1, j->cols, j->scale, j->out);
  return 0;
}

static uint32_t sum_scale_block(float* x, int64_t rows, int64_t cols, float scale, float* out,
                                int threads) {
  rows_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(rows, threads, 1, &per);
  for (int t = 0; t < used; ++t) {
    jobs[t] = (rows_job_t){x, (int64_t)t * per, 0, cols, scale, out, 0};
    jobs[t].r1 = rows - jobs[t].r0 < per ? rows : jobs[t].r0 + per;
  }
  run_jobs(rows_thread, jobs, sizeof jobs[0], used);
  uint32_t bad = 0;
  for (int t = 0; t < used; ++t) bad |= jobs[t].bad;
  return bad;
}

/* The comm hook's 1/world scaling pass over n float32 at x (in place, the bits of torch's
   mul_) that also gives the checksum check the row sums of some matrices in it, as they
   were, in the same read: seg holds m blocks of four int64 (offset in floats, rows, cols,
   address of rows float32 outputs), in increasing offset, not overlapping, inside x.
   1 if any float was NaN or Inf, 0 if none, -1 on bad arguments. Threads split the rows
   of each block and the floats between blocks. */
int sdc_scale_rows(float* x, int64_t n, float scale, const int64_t* seg, int m, int threads) {
  int64_t at = 0;
  uint64_t out[3];
  int bad = 0;
  for (int i = 0; i < m; ++i) {
    const int64_t off = seg[4 * i], rows = seg[4 * i + 1], cols = seg[4 * i + 2];
    if (off < at || rows < 0 || cols < 0 || off + rows * cols > n) return -1;
    if (off > at) {
      if (weighted(x + at, off - at, 4, threads, scale, out)) return -1;
      bad |= (int)out[2];
    }
    float* dest = (float*)(intptr_t)seg[4 * i + 3];
    const int use = rows * cols < ((int64_t)1 << 18) ? 1 : threads;
    bad |= (int)sum_scale_block(x + off, rows, cols, scale, dest, use);
    at = off + rows * cols;
  }
  if (n > at) {
    if (weighted(x + at, n - at, 4, threads, scale, out)) return -1;
    bad |= (int)out[2];
  }
  return bad;
}
