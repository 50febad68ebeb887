/* The comm hook's fused 1/world scaling pass (sdc_guard.scaling): each gradient bucket
   scaled in place with the bits of torch's mul_, NaN/Inf flagged, and in the same read the
   replay digest's words (sdc_scale_digest) or the checksum check's row sums of the weight
   gradients in the bucket (sdc_scale_rows); and the same rows pass without the store, for
   FSDP2's reduce-scatter input (sdc_check_rows). */

#include "common.h"

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

/* Mode 3: the replay digest's sums of the 2n uint32 lanes of n 64-bit words as they were
   (block6's: s1, s2 by lane, g), then the same float32 lanes scaled in place, chunk by chunk
   while the chunk is in L1: one pass over memory. A job starts at a multiple of 64 words,
   a chunk at a multiple of CHUNK: every block6 phase is a multiple of 64 lanes. */
#define CHUNK 2048
static void scale_words(job_t* j) {
  char* p = (char*)j->x + 8 * j->lo;
  uint64_t a1 = 0, a2 = 0, a3 = 0;
  uint32_t bad = 0;
  for (int64_t c = 0; c < j->n; c += CHUNK) {
    const int64_t m = j->n - c < CHUNK ? j->n - c : CHUNK;
    uint64_t c1, c2, c3;
    block6(p + 8 * c, 2 * m, 0, &c1, &c2, &c3);
    a1 += c1;
    a2 += c2 + 2 * (uint64_t)c * c1;
    a3 += c3;
    bad |= scale_f32((float*)(p + 8 * c), 2 * m, j->scale);
  }
  j->s1 = a1;
  j->s2 = a2;
  j->g = a3;
  j->bad = bad;
}

/* The scaling pass's modes of weighted (common.h). Mode 4 scales n float32 in place and
   flags NaN/Inf (scale_f32), mode 5 only flags (check_f32). */
void scaling_job(job_t* j) {
  const void* p = j->x + (j->mode >= 4 ? 4 : 8) * j->lo;
  if (j->mode == 4) j->bad = scale_f32((float*)p, j->n, j->scale);
  else if (j->mode == 5) j->bad = check_f32((const float*)p, j->n);
  else scale_words(j);
}

/* The replay digest's part of the 2n uint32 lanes of n 64-bit words at x (as mode 6) and
   their plain sum, then those lanes multiplied by scale in place as float32; out[2] = 1 if
   any of them was NaN or Inf. */
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

/* Rows [r0, r1) of a rows x cols float32 block at x: out[r] = the row's float32 sum (as it
   was), then, if store, the row multiplied by scale in place (scale_f32); 1 if any was NaN
   or Inf. Without store the block is only read. */
CLONES static uint32_t cs_sum_scale_rows(float* x, int64_t r0, int64_t r1, int64_t cols,
                                         float scale, float* out, int store) {
  const int64_t body = cols / CS_LANES * CS_LANES;
  cs_i8 flags = {0};
  uint32_t bad = 0;
  for (int64_t r = r0; r < r1; ++r) {
    float* row = x + r * cols;
    cs_v8 acc[2] = {{0}, {0}};
    if (store) {
      for (int64_t c = 0; c < body; c += CS_LANES)  /* one read: sum, flag, scale, store */
        for (int h = 0; h < 2; ++h) {
          cs_v8 v = cs_load(row + c + 8 * h);
          acc[h] += v;
          flags |= ((cs_i8)v & 0x7f800000) == 0x7f800000;
          v *= scale;
          memcpy(row + c + 8 * h, &v, sizeof v);
        }
    } else {
      for (int64_t c = 0; c < body; c += CS_LANES)  /* one read: sum, flag */
        for (int h = 0; h < 2; ++h) {
          const cs_v8 v = cs_load(row + c + 8 * h);
          acc[h] += v;
          flags |= ((cs_i8)v & 0x7f800000) == 0x7f800000;
        }
    }
    float t = 0.0f;
    for (int64_t d = body; d < cols; ++d) {
      t += row[d];
      if (!store) {
        uint32_t w;
        memcpy(&w, row + d, 4);
        bad |= (w & 0x7f800000u) == 0x7f800000u;
      }
    }
    const cs_v8 v2 = acc[0] + acc[1];
    out[r] = t + CS_HSUM(v2);
    if (store) bad |= scale_f32(row + body, cols - body, scale);
  }
  for (int l = 0; l < 8; ++l) bad |= flags[l] != 0;
  return bad;
}

typedef struct {
  float* x; int64_t r0, r1, cols; float scale; float* out; int store; uint32_t bad;
} rows_job_t;

static void* rows_thread(void* arg) {
  rows_job_t* j = (rows_job_t*)arg;
  j->bad = cs_sum_scale_rows(j->x, j->r0, j->r1, j->cols, j->scale, j->out, j->store);
  return 0;
}

static uint32_t sum_scale_block(float* x, int64_t rows, int64_t cols, float scale, float* out,
                                int store, int threads) {
  rows_job_t jobs[MAX_THREADS];
  int64_t per;
  const int used = split(rows, threads, 1, &per);
  for (int t = 0; t < used; ++t) {
    jobs[t] = (rows_job_t){x, (int64_t)t * per, 0, cols, scale, out, store, 0};
    jobs[t].r1 = rows - jobs[t].r0 < per ? rows : jobs[t].r0 + per;
  }
  run_jobs(rows_thread, jobs, sizeof jobs[0], used);
  uint32_t bad = 0;
  for (int t = 0; t < used; ++t) bad |= jobs[t].bad;
  return bad;
}

/* The rows pass over n float32 at x: with store, the comm hook's 1/world scaling pass (in
   place, the bits of torch's mul_, mode 4); without, a read only (mode 5). Either gives
   the row sums of some matrices in it, as they were, in the same read: seg holds m blocks
   of four int64 (offset in floats, rows, cols, address of rows float32 outputs), in
   increasing offset, not overlapping, inside x. 1 if any float was NaN or Inf, 0 if none,
   -1 on bad arguments. Threads split the rows of each block and the floats between
   blocks. */
static int rows_pass(float* x, int64_t n, float scale, const int64_t* seg, int m, int store,
                     int threads) {
  int64_t at = 0;
  uint64_t out[3];
  int bad = 0;
  const int mode = store ? 4 : 5;
  for (int i = 0; i < m; ++i) {
    const int64_t off = seg[4 * i], rows = seg[4 * i + 1], cols = seg[4 * i + 2];
    if (off < at || rows < 0 || cols < 0 || off + rows * cols > n) return -1;
    if (off > at) {
      if (weighted(x + at, off - at, mode, threads, scale, out)) return -1;
      bad |= (int)out[2];
    }
    float* dest = (float*)(intptr_t)seg[4 * i + 3];
    const int use = rows * cols < ((int64_t)1 << 18) ? 1 : threads;
    bad |= (int)sum_scale_block(x + off, rows, cols, scale, dest, store, use);
    at = off + rows * cols;
  }
  if (n > at) {
    if (weighted(x + at, n - at, mode, threads, scale, out)) return -1;
    bad |= (int)out[2];
  }
  return bad;
}

/* The comm hook's scaling pass that also takes the row sums (rows_pass with store). */
int sdc_scale_rows(float* x, int64_t n, float scale, const int64_t* seg, int m, int threads) {
  return rows_pass(x, n, scale, seg, m, 1, threads);
}

/* The non-finite flag of n float32 at x and the row sums of some matrices in it, one read
   that writes nothing (FSDP2's reduce-scatter input, which no scaling pass touches). */
int sdc_check_rows(const float* x, int64_t n, const int64_t* seg, int m, int threads) {
  return rows_pass((float*)(intptr_t)x, n, 1.0f, seg, m, 0, threads);
}
