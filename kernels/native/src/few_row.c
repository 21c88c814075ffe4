/* kvtier: y = x @ w.T for a few input rows, reading each fp32 weight row once.
 *
 * x: M rows of K floats; w: N rows of K floats (row-major, as nn.Linear keeps
 * its weight); y: M rows of N floats. Each output element is one 8-lane
 * accumulator over k in order, then a fixed horizontal sum and a scalar tail:
 * the same arithmetic whatever M, the tiling or the thread split, so a row's
 * result does not depend on which other rows share the call (the batch lane
 * and the serial lane compute every row alike). AVX2 + FMA; the caller checks
 * the CPU before loading this code.
 */
#include <immintrin.h>

#include "kvtier_pool.h"
#include "kvtier_simd.h"
#include <stddef.h>

/* MM (a compile-time count, so the accumulators stay in registers) input rows
   against weight rows [n0, n1). */
#define ROWS(MM)                                                                          \
  static void rows##MM(const float* restrict x, const float* restrict w, float* restrict y, \
                       int K, int N, int n0, int n1) {                                    \
    for (int n = n0; n < n1; n++) {                                                       \
      const float* wr = w + (size_t)n * K;                                                \
      __m256 acc[MM];                                                                     \
      _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();   \
      int k = 0;                                                                          \
      for (; k + 8 <= K; k += 8) {                                                        \
        __m256 wv = _mm256_loadu_ps(wr + k);                                              \
        _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) acc[m] =                     \
            _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)m * K + k), wv, acc[m]);          \
      }                                                                                   \
      _Pragma("GCC unroll 8") for (int m = 0; m < MM; m++) {                              \
        float s = hsum(acc[m]);                                                           \
        for (int kk = k; kk < K; kk++) s += x[(size_t)m * K + kk] * wr[kk];               \
        y[(size_t)m * N + n] = s;                                                         \
      }                                                                                   \
    }                                                                                     \
  }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

typedef void (*rows_fn)(const float*, const float*, float*, int, int, int, int);
static const rows_fn ROWS_FN[5] = {0, rows1, rows2, rows3, rows4};

typedef struct {
  const float* x;
  const float* w;
  float* y;
  int M, K, N;
} product_t;

/* Weight rows [n0, n1) in tiles that stay in the L2 cache while every block of
   up to 4 input rows reads them: the weights come from memory once per call. */
#define TILE 32
static void run(void* ctx, long n0, long n1) {
  const product_t* j = (const product_t*)ctx;
  for (int t0 = (int)n0; t0 < (int)n1; t0 += TILE) {
    int t1 = t0 + TILE < (int)n1 ? t0 + TILE : (int)n1;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
      int mm = j->M - m0 < 4 ? j->M - m0 : 4;
      ROWS_FN[mm](j->x + (size_t)m0 * j->K, j->w, j->y + (size_t)m0 * j->N, j->K, j->N, t0, t1);
    }
  }
}

/* The weight rows split across `threads` (kvtier_pool.h); returns the threads used. */
int kvtier_few_row_matmul(const float* x, const float* w, float* y, int M, int K, int N, int threads) {
  product_t job = {x, w, y, M, K, N};
  return kvtier_parallel(threads, N, run, &job);
}
