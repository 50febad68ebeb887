/* The weighted sums of the fingerprint (sdc_guard.fingerprints.public: uint32 lanes, mode 0,
   and 64-bit words mapped to X ^ (X >>> 32), mode 1) and of the replay digest
   (sdc_guard.fingerprints.digest: raw 64-bit words, mode 2), one copy of the word loops per
   x86 instruction set; and the threaded runner of every word and float pass (weighted),
   which hands the scaling pass's modes to scaling.c. */

#include "common.h"

/* Element values by mode: 0 = uint32 lane zero-extended, 1 = 64-bit word X mapped to
   X ^ (X >>> 32), 2 = raw 64-bit word; 6 = uint32 lanes under the fingerprint's second
   version (block6: the weights 2^8 (2i + 1) + 2^rho(i)). */

/* Software prefetch distance in bytes. These loops do a few integer operations per
   word; a core that waits for each cache line in turn and only then does them stays
   well short of the memory bandwidth (most on AVX2, where each vector holds half as
   many words). Asking for the line 4 KiB ahead overlaps the wait with the arithmetic
   (`python -m bench` measures each instruction set side by side). */
#ifndef SDC_PREFETCH
#define SDC_PREFETCH 4096
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

/* Keeps a loaded vector in a register: without it GCC folds the load into each addition
   that reads the vector and reads the same memory twice (on x86, where an addition may
   take a memory operand), which costs the word loop in cache a sixth of its speed. */
#ifdef SDC_X86
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* sigma(k) = 5 - min(v2(k + 1), 5): the shift of the upper lane of word k under the
   fingerprint's second version, with the words counted from an even lane (block6). It
   depends on k mod 32 alone. */
static inline int sigma(uint64_t k) { return 5 - __builtin_ctzll((k + 1) | 32); }

/* The second version's sums over m 64-bit words at x, in out[0..3]: sum u, sum k u over
   u_k = lo_k + hi_k (the word's two uint32 lanes added), sum hi, and sum hi_k 2^sigma(k +
   half). Since u = X - (2^32 - 1) hi, the loop sums the words X as they are (P, and Q for
   sum k X, as mode 0's loop) and the upper lanes hi apart. Blocks of S words go in rounds
   of R = 32 / S, a round being 32 words: stream s of the round's block c holds the words
   k = s + c S (mod 32), whose upper lanes share one shift, so each (c, stream) sums its
   upper lanes apart (H, running totals) and takes its shift at the end. After each round
   every H of a stream has been added to QH once: the running totals of the upper lanes
   through each round, summed over the rounds, give sum_r r hi_r (hi_r: the sum of round
   r's upper lanes in the stream). Per vector one shift and four additions, as mode 0's
   loop. */
#define WORDS6(NAME, TARGET, VB, NVEC)                                                 \
  TARGET static void NAME(const char* x, int64_t m, uint64_t half, uint64_t* out) {    \
    typedef uint64_t vec __attribute__((vector_size(VB)));                             \
    enum { L = VB / 8, NV = NVEC, S = L * NV, R = 32 / S };                            \
    vec P[NV], Q[NV], QH[NV], H[R][NV];                                                \
    memset(P, 0, sizeof P); memset(Q, 0, sizeof Q); memset(QH, 0, sizeof QH);          \
    memset(H, 0, sizeof H);                                                            \
    const int64_t nr = m / (S * R), nb = nr * R;                                       \
    for (int64_t r = 0; r < nr; ++r) {                                                 \
      _Pragma("GCC unroll 16") for (int c = 0; c < R; ++c)                             \
        _Pragma("GCC unroll 2") for (int j = 0; j < NV; ++j) {                         \
          const char* at = x + 8 * ((r * R + c) * S + j * L);                         \
          if (((c * NV + j) * VB) % 64 == 0) __builtin_prefetch(at + SDC_PREFETCH);    \
          vec v;                                                                       \
          memcpy(&v, at, VB);                                                          \
          IN_REGISTER(v);                                                              \
          Q[j] += P[j];                                                                \
          P[j] += v;                                                                   \
          H[c][j] += v >> 32;                                                          \
          QH[j] += H[c][j];                                                            \
        }                                                                              \
    }                                                                                  \
    uint64_t a = 0, k = 0, h = 0, kh = 0, g = 0;                                       \
    for (int j = 0; j < NV; ++j)                                                       \
      for (int l = 0; l < L; ++l) {                                                    \
        const uint64_t s = (uint64_t)(j * L + l);                                      \
        uint64_t t = 0;                                                                \
        a += P[j][l];                                                                  \
        k += (uint64_t)S * ((uint64_t)(nb - 1) * P[j][l] - Q[j][l]) + s * P[j][l];     \
        for (int c = 0; c < R; ++c) {                                                  \
          t += H[c][j][l];                                                             \
          kh += ((uint64_t)c * S + s) * H[c][j][l];                                    \
          g += H[c][j][l] << sigma((uint64_t)c * S + s + half);                        \
        }                                                                              \
        h += t;                                                                        \
        kh += (uint64_t)S * R * ((uint64_t)nr * t - QH[j][l]);                         \
      }                                                                                \
    a -= 0xffffffffULL * h;                                                            \
    k -= 0xffffffffULL * kh;                                                           \
    for (int64_t i = nb * S; i < m; ++i) {                                             \
      uint64_t w;                                                                      \
      memcpy(&w, x + 8 * i, 8);                                                        \
      const uint64_t hi = w >> 32, u = (w & 0xffffffffULL) + hi;                       \
      a += u;                                                                          \
      k += (uint64_t)i * u;                                                            \
      h += hi;                                                                         \
      g += hi << sigma((uint64_t)i + half);                                            \
    }                                                                                  \
    out[0] = a; out[1] = k; out[2] = h; out[3] = g;                                    \
  }

WORDS(words_base, , 16)
WORDS6(words6_base, , 16, 1)
#ifdef SDC_X86
WORDS(words_avx2, __attribute__((target("avx2"))), 32)
WORDS(words_avx512, __attribute__((target("avx512f"))), 64)
WORDS6(words6_avx2, __attribute__((target("avx2"))), 32, 2)
WORDS6(words6_avx512, __attribute__((target("avx512f"))), 64, 2)
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

static void words6(const char* x, int64_t m, uint64_t half, uint64_t* out) {
  switch (sdc_isa(-1)) {
#ifdef SDC_X86
    case 2: words6_avx512(x, m, half, out); return;
    case 1: words6_avx2(x, m, half, out); return;
#endif
    default: words6_base(x, m, half, out);
  }
}

/* s1 = sum v_i and s2 = sum i * v_i (mod 2^64) over n elements, i from 0.
   block0: n uint32 lanes v, zero-extended. Lane 2k is the low half lo_k of word X_k,
   lane 2k + 1 its high half hi_k, so with X_k = lo_k + 2^32 hi_k (exactly):
   sum lo = sum X - 2^32 sum hi, sum k lo = sum k X - 2^32 sum k hi, and
   s1 = sum lo + sum hi, s2 = 2 (sum k lo + sum k hi) + sum hi. */
void block0(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
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

/* rho(i) = 6 - min(v2(i + 1), 6): lane i (counted from where the weights start) is
   weighted 2^8 (2i + 1) + 2^rho(i) under the fingerprint's second version
   (sdc_guard.fingerprints.public); rho depends on i mod 64 alone. */
static inline int rho(uint64_t i) { return 6 - __builtin_ctzll((i + 1) | 64); }

/* block0's sums, and g = sum_i 2^rho(phase + i) v_i. From an even lane (even phase) the
   low lane of each word has rho = 6 and the high lane of word k rho = sigma(k + phase / 2),
   which the word loop sums (mode 6); an odd phase, which no caller uses, is summed lane by
   lane. */
void block6(const void* x, int64_t n, uint64_t phase, uint64_t* s1, uint64_t* s2,
            uint64_t* g) {
  if (phase % 2) {
    block0(x, n, s1, s2);
    uint64_t e = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t v;
      memcpy(&v, (const char*)x + 4 * i, 4);
      e += (uint64_t)v << rho(phase + (uint64_t)i);
    }
    *g = e;
    return;
  }
  uint64_t o[4];
  words6((const char*)x, n / 2, phase / 2, o);
  *s1 = o[0];                /* lane 2k is lo_k, lane 2k + 1 hi_k: */
  *s2 = 2 * o[1] + o[2];     /* sum (2k lo_k + (2k + 1) hi_k) = 2 sum k u_k + sum hi_k */
  *g = ((o[0] - o[2]) << 6) + o[3];  /* the low lanes' rho is 6 */
  if (n % 2) {
    uint32_t v;
    memcpy(&v, (const char*)x + 4 * (n - 1), 4);
    *s1 += v;
    *s2 += (uint64_t)(n - 1) * v;
    *g += (uint64_t)v << 6;  /* an even lane: phase + n - 1 is even */
  }
}

/* block1: n words mapped to X ^ (X >>> 32); block2: n words as they are. */
void block1(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
  uint64_t o[4];
  words((const char*)x, n, 1, o);
  *s1 = o[0];
  *s2 = o[1];
}

void block2(const void* x, int64_t n, uint64_t* s1, uint64_t* s2) {
  uint64_t o[4];
  words((const char*)x, n, 2, o);
  *s1 = o[0];
  *s2 = o[1];
}

/* Modes 0, 4 and 5 count float32 lanes, the others 64-bit words; modes 3 to 5 are the
   scaling pass's (scaling_job). */
static void run(job_t* j) {
  const void* p = j->x + (j->mode == 0 || j->mode >= 4 ? 4 : 8) * j->lo;
  j->s1 = j->s2 = j->g = 0;
  if (j->mode == 6) block6(p, j->n, (uint64_t)j->lo, &j->s1, &j->s2, &j->g);
  else if (j->mode >= 3) scaling_job(j);
  else if (j->mode == 0) block0(p, j->n, &j->s1, &j->s2);
  else if (j->mode == 1) block1(p, j->n, &j->s1, &j->s2);
  else block2(p, j->n, &j->s1, &j->s2);
}

static void* thread_main(void* arg) {
  run((job_t*)arg);
  return 0;
}

int weighted(const void* x, int64_t n, int mode, int threads, float scale, uint64_t* out) {
  if (n < 0 || mode < 0 || mode > 6) return 1;
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
  uint64_t total = 0, plain = 0, bad = 0, extra = 0;
  for (int t = 0; t < used; ++t) {  /* mode 3 sums lanes, two a word */
    const uint64_t lane0 = (mode == 3 ? 2 : 1) * (uint64_t)jobs[t].lo;
    total += (2 * lane0 + 1) * jobs[t].s1 + 2 * jobs[t].s2;
    plain += jobs[t].s1;
    bad |= jobs[t].bad;
    extra += jobs[t].g;
  }
  out[0] = mode == 6 || mode == 3 ? (total << 8) + extra : total;
  out[1] = plain;
  if (mode >= 3) out[2] = bad;
  return 0;
}

int sdc_weighted_sum(const void* x, int64_t n, int mode, int threads, uint64_t* out) {
  if (mode >= 3 && mode != 6) return 1;
  return weighted(x, n, mode, threads, 1.0f, out);
}

static uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

/* The terms of a list's fingerprint, summed (mod 2**64): span i (address at[i], nbytes[i]
   bytes) as 64-bit words (mode 1) or 32-bit lanes (mode 0, the last partial lane zero-
   padded, weight 2k+1; mode 6, the second version's weights), its value plus key[i] mixed
   by splitmix64's finaliser. One call for
   every tensor of a list; a span takes a thread per per_thread elements, up to threads
   (the value is the same either way). */
int sdc_fingerprint_terms(const uint64_t* at, const int64_t* nbytes, const int32_t* mode,
                          const uint64_t* key, int64_t count, int threads,
                          int64_t per_thread, uint64_t* out) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    const unsigned char* p = (const unsigned char*)(uintptr_t)at[i];
    const int64_t unit = mode[i] == 1 ? 8 : 4, n = nbytes[i] / unit, rem = nbytes[i] % unit;
    if ((mode[i] != 0 && mode[i] != 1 && mode[i] != 6) || nbytes[i] < 0 || (mode[i] == 1 && rem))
      return 1;
    int64_t t = per_thread > 0 ? n / per_thread : 1;
    if (t > threads) t = threads;
    if (t < 1) t = 1;
    uint64_t v[3];
    if (weighted(p, n, mode[i], (int)t, 1.0f, v)) return 1;
    if (rem) {
      uint64_t tail = 0;
      for (int64_t b = 0; b < rem; ++b) tail |= (uint64_t)p[4 * n + b] << (8 * b);
      v[0] += mode[i] == 6 ? ((2 * (uint64_t)n + 1) * tail << 8) + (tail << rho((uint64_t)n))
                           : (2 * (uint64_t)n + 1) * tail;
    }
    sum += mix64(v[0] + key[i]);
  }
  out[0] = sum;
  return 0;
}
