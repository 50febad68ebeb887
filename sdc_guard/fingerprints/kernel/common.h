/* The C kernel of sdc_guard, shared by its sources (built into one shared library by
   sdc_guard/fingerprints/native.py, which loads it with ctypes):

     threads.c      the threads every pass splits its work over (OpenMP's, or its own)
     fingerprint.c  the 64-bit word sums of the fingerprint and of the replay digest, one
                    copy per instruction set (sdc_weighted_sum, sdc_isa)
     scaling.c      the comm hook's fused 1/world scaling pass: scale, flag NaN/Inf, digest
                    and row sums in one read (sdc_scale_check, sdc_nonfinite,
                    sdc_scale_digest, sdc_scale_rows; read only: sdc_check_rows)
     checksum.c     the checksum check's float32 passes and its hooks' calls (sdc_cs_*),
                    and the weights check's pass that takes the checksum's weight sums
                    (sdc_fp_wsum)
     sketch.c       the tolerant replay audit's gradient sketch in one read (sdc_sketch,
                    sdc_scale_sketch) and two sketches' distance (sdc_sketch_distance)

   An entry point with a long list of arguments takes a pointer to one of the argument
   structs below; sdc_guard/fingerprints/native.py mirrors each as a ctypes.Structure, field
   for field. Change both together (the library's cache key covers every source file). */

#ifndef SDC_KERNEL_COMMON_H
#define SDC_KERNEL_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

/* What only the library's own sources call. */
#define SDC_HIDDEN __attribute__((visibility("hidden")))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(SDC_NO_CLONES)
#define SDC_X86 1
#endif

#ifdef SDC_X86
/* One copy per x86-64 level, chosen when the library loads: v4 (AVX-512 F, BW, CD, DQ,
   VL) and v3 (AVX2 with FMA), so that the checksum's float loops multiply and add in one
   instruction, on other pipes than their plain additions; a compiler without the levels
   (GCC < 11) builds one copy per instruction set instead (SDC_ISA_CLONES, native.build).
   Only on functions local to their file: the copy is chosen there, not through a symbol
   another file resolves. */
#ifdef SDC_ISA_CLONES
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#else
#define CLONES
#endif

/* ---- threads.c ------------------------------------------------------------------------ */

#define MAX_THREADS 64

/* How many jobs of `*per` elements (a multiple of align) cover extent elements on up to
   `threads` threads; the last job may be shorter. */
SDC_HIDDEN int split(int64_t extent, int threads, int64_t align, int64_t* per);

/* Runs fn on each of used jobs (size bytes apart, from jobs), job 0 on the caller's thread.
   Built with OpenMP (-fopenmp), the others on the threads of OpenMP's pool (torch's, when the
   library is linked against the libgomp torch loaded), except in a forked process; else on
   threads of their own (a job whose thread failed to start on the caller's). */
SDC_HIDDEN void run_jobs(void* (*fn)(void*), void* jobs, size_t size, int used);

/* ---- fingerprint.c: weighted sums of words -------------------------------------------- */

/* s1 = sum v_i and s2 = sum i * v_i (mod 2^64) over n elements at x, i from 0:
   block0 over uint32 lanes, block1 over 64-bit words X mapped to X ^ (X >>> 32), block2
   over 64-bit words as they are. */
SDC_HIDDEN void block0(const void* x, int64_t n, uint64_t* s1, uint64_t* s2);
SDC_HIDDEN void block1(const void* x, int64_t n, uint64_t* s1, uint64_t* s2);
SDC_HIDDEN void block2(const void* x, int64_t n, uint64_t* s1, uint64_t* s2);
/* block0's sums of n uint32 lanes, and g = sum_i 2^rho(phase + i) v_i: the extra term of
   the fingerprint's second version (rho: fingerprint.c). */
SDC_HIDDEN void block6(const void* x, int64_t n, uint64_t phase, uint64_t* s1, uint64_t* s2,
                       uint64_t* g);

/* One thread's share of a pass over words or floats (weighted). */
typedef struct {
  const char* x; int64_t lo, n; int mode; uint64_t s1, s2; float scale; uint32_t bad;
  uint64_t g;
} job_t;

/* out = {sum_k (2k + 1) v_k, sum_k v_k} (mod 2^64) over n elements of x, on up to threads
   threads. Modes 0 (uint32 lanes), 1 and 2 (64-bit words, block1 and block2) sum; mode 6
   (uint32 lanes) gives sum_k (2^8 (2k + 1) + 2^rho(k)) v_k in out[0] instead, as does mode
   3 over the 2n lanes of n words (the replay digest, out[1] their plain sum); modes
   3, 4 and 5 are the scaling pass's (scaling_job), which set out[2] to 1 if a float was NaN
   or Inf. 0, or 1 on bad arguments. */
SDC_HIDDEN int weighted(const void* x, int64_t n, int mode, int threads, float scale,
                        uint64_t* out);

/* ---- scaling.c ------------------------------------------------------------------------ */

/* A job of modes 3 (scale_words: the digest's sums of the words' lanes, then those float32
   lanes scaled),
   4 (n float32 scaled in place, NaN/Inf flagged) and 5 (flagged only). */
SDC_HIDDEN void scaling_job(job_t* j);

/* ---- float32 vectors (checksum.c, scaling.c) ------------------------------------------ */

#pragma GCC diagnostic ignored "-Wpsabi" /* vector-returning helpers, always inlined */

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

/* ---- the entry points ------------------------------------------------------------------ */

int sdc_isa(int want);
/* "openmp" or "pthreads": what run_jobs runs the jobs on now (threads.c). */
const char* sdc_threading(void);
int sdc_weighted_sum(const void* x, int64_t n, int mode, int threads, uint64_t* out);
int sdc_scale_digest(void* x, int64_t n, float scale, int threads, uint64_t* out);
int sdc_scale_check(void* x, int64_t n, float scale, int threads);
int sdc_nonfinite(const void* x, int64_t n, int threads);
int sdc_scale_rows(float* x, int64_t n, float scale, const int64_t* seg, int m, int threads);
int sdc_check_rows(const float* x, int64_t n, const int64_t* seg, int m, int threads);
int sdc_sketch(const float* g, int64_t q, int64_t c, int64_t tail, const float* b,
               const double* a, const double* t, int k, int threads, double* out);
int sdc_scale_sketch(float* x, int64_t n, float scale, const int64_t* seg, int m, int k,
                     double* out, int threads);
double sdc_sketch_distance(const double* a, const double* b, int64_t n, int width);

/* sdc_cs_cols: over A (rows x cols, row stride ld), s_p (+)= u_p^T A for p < k and
   b_p (+)= a_p^T |A| for p < ka (a NULL u_p or a_p is a vector of ones); bit p of acc_mask
   adds to s_p what it holds, bit 2 + p to b_p (else overwritten). */
typedef struct {
  const float* A; int64_t rows, cols, ld;
  const float* u0; const float* u1; int k;
  const float* a0; const float* a1; int ka;
  float* s0; float* s1; float* b0; float* b1;
  int acc_mask; int threads;
} sdc_cs_cols_args;
int sdc_cs_cols(const sdc_cs_cols_args* a);

/* sdc_cs_rows: over the n rows of A (n x cols, row stride ld), r_p[i] = v_p . A[i] for
   p < k and ra_p[i] = va_p . |A[i]| for p < ka (every v_p NULL, meaning ones, or none;
   likewise va_p; or, with k = ka = 2, the first of each NULL and the second not). */
typedef struct {
  const float* A; int64_t n, cols, ld;
  const float* v0; const float* v1; int k;
  const float* va0; const float* va1; int ka;
  float* r0; float* r1; float* ra0; float* ra1;
  int threads;
} sdc_cs_rows_args;
int sdc_cs_rows(const sdc_cs_rows_args* a);

int64_t sdc_cs_compare(const float* lhs, const float* rhs, const float* bound, int64_t n,
                       double rhs0, double bound0, double tol, int finite_only);

/* sdc_cs_fwd: the checksum check's forward hook of a call Y = X W^T + b, in one call.
   X: n x inner, row stride ldx; Y: n x out, ldy. With w_fresh, first the weight's pass over
   W (out x inner, ldw; bias: out floats or NULL) on threads_w threads: wsum = [e^T W, e^T |W|
   (inner each), W e, |W| e (out each)], bsum = the bias's sum and absolute sum. res (5 n
   floats) gets [X e, |X| e, Y e, X (e^T W)^T, |X| (e^T |W|)^T]; with check, the forward
   identity is compared within tol (finite_only: only a finite difference fails). */
typedef struct {
  const float* X; int64_t n, inner, ldx;
  const float* Y; int64_t out, ldy;
  const float* W; int64_t ldw; const float* bias; int w_fresh; int threads_w;
  float* wsum; float* bsum; float* res;
  int check; int finite_only; double tol;
  int threads_x, threads_y;
} sdc_cs_fwd_args;
int64_t sdc_cs_fwd(const sdc_cs_fwd_args* a);

/* sdc_cs_bwd: the backward hook of that call, given GY (n x out, ldg), wr = W e and
   war = |W| e (the forward's wsum) and x_rows = [X e, |X| e] (its res). gx_side:
   gxs[0, n) = GY wr and gxs[n, 2n) = |GY| war, the input gradient's right-hand side and
   bound; gw: gw_rhs (+)= GY^T (X e), gw_bound (+)= |GY|^T (|X| e), the weight gradient's
   (gw_add: added to what they hold). Then, with GX (n x inner, ldx; NULL: it comes later,
   sdc_cs_gx), gxs[2n, 3n) = GX e compared within the bound times tol. gxs: 3 n floats. */
typedef struct {
  const float* GY; int64_t n, out, ldg;
  const float* wr; const float* war; const float* x_rows;
  float* gw_rhs; float* gw_bound; int gw; int gw_add;
  int gx_side; float* gxs;
  const float* GX; int64_t inner, ldx;
  double tol; int finite_only; int threads_g, threads_x;
} sdc_cs_bwd_args;
int64_t sdc_cs_bwd(const sdc_cs_bwd_args* a);

int64_t sdc_cs_gx(const float* GX, int64_t n, int64_t in, int64_t ld, float* gxs, double tol,
                  int finite_only, int threads);
int sdc_fp_wsum(const float* W, int64_t rows, int64_t cols, const float* bias, float* wsum,
                float* bsum, int threads, int version, uint64_t* out);

#endif
