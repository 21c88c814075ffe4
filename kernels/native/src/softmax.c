/* kvtier: softmax over the last axis of float32 rows, with an 8-lane exp.
 *
 * MLX's CPU backend on x86 computes softmax one element at a time with the C
 * library's expf (~13 ns an element here): in a prefill chunk's attention
 * (9 heads x 256 queries x 3,000 keys a layer) the softmax was 99 of 121 ms.
 *
 * Each row: its maximum; then exp(x - max) eight lanes at a time, summed in
 * eight lane accumulators; then every value times 1 / sum. The lanes start at
 * the row's first element whose exp is not zero, so a row with leading
 * hidden keys (the batch lane's left padding: exact zeros after the exp)
 * sums its values in the same lanes, in the same order, as the same row
 * without them: the batch lane and the serial lane get the same bits.
 * Elements past the last full vector go through the same lanes, the rest of
 * the vector filled with zeros.
 *
 * exp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes expf's degree-6
 * polynomial, 2^n through the exponent bits; arguments below -87.33 give 0
 * (softmax arguments are <= 0). AVX2 + FMA; the caller checks the CPU.
 */
#include <immintrin.h>

#include "kvtier_pool.h"
#include "kvtier_simd.h"
#include <stddef.h>
#include <string.h>

#define EXP_LO (-87.33654475f)

static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(EXP_LO);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  /* NOTE: lanes under EXP_LO give 0 below whatever is computed for them; they
     compute e^0 here, since e^EXP_LO's last product is subnormal and x86 takes
     a microcode assist for it (a hidden key cost ~3 ns an element that way). */
  x = _mm256_blendv_ps(x, _mm256_setzero_ps(), under);
  /* NOTE: operands in this order pass a NaN through (min/max return their
     second operand when either is NaN): a NaN score gives NaN weights, as MLX's. */
  x = _mm256_max_ps(lo, _mm256_min_ps(_mm256_set1_ps(88.37626266f), x));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

/* The row's maximum as the scalar `m = x[j] > m ? x[j] : m` from m = x[0]
   finds it: a NaN counts only at x[0] (then the maximum is NaN). Eight lanes
   start from x[0] and max_ps(v, lanes) keeps the lane where v is NaN, so a
   lane is NaN only when x[0] is; the max of numbers is the same in any order. */
static inline float row_max(const float* x, int n) {
  float m = x[0];
  int j = 0;
  if (n >= 8) {
    __m256 lanes = _mm256_set1_ps(x[0]);
    for (; j + 8 <= n; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(x + j), lanes);
    float l[8];
    _mm256_storeu_ps(l, lanes);
    m = l[0];
    for (int k = 1; k < 8; k++) m = l[k] > m ? l[k] : m;
  }
  for (; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

/* NOTE: x may be y (the masked rows run in place); no restrict. */
static void row(const float* x, float* y, int n) {
  if (n <= 0) return;
  const float m = row_max(x, n);
  /* NOTE: leading elements whose exp is zero are written as zero and skipped,
     so the lanes below line up with the first element that counts. */
  int j0 = 0;
  while (j0 < n && x[j0] - m < EXP_LO) y[j0++] = 0.0f;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int j = j0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    _mm256_storeu_ps(y + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {
    float buf[8];
    for (int k = 0; k < 8; k++) buf[k] = j + k < n ? x[j + k] - m : EXP_LO - 1.0f;
    __m256 e = exp8(_mm256_loadu_ps(buf));
    _mm256_storeu_ps(buf, e);
    memcpy(y + j, buf, (size_t)(n - j) * sizeof(float));
    acc = _mm256_add_ps(acc, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(acc));
  for (j = j0; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(y + j), inv));
  const float s = _mm256_cvtss_f32(inv);
  for (; j < n; j++) y[j] *= s;
}

typedef struct {
  const float* x;
  float* y;
  int n, period, offset;
} rows_t;

typedef struct {
  const float* x;
  float* y;
  const unsigned char* mask;
  int n;
  long per_batch, mask_batches, period;
} masked_t;

static void plain_rows(void* ctx, long a, long b) {
  const rows_t* j = (const rows_t*)ctx;
  for (long r = a; r < b; r++) row(j->x + (size_t)r * j->n, j->y + (size_t)r * j->n, j->n);
}

/* Bottom-right causal rows: row r is query r % period, which sees its first
   offset + r % period + 1 elements; the rest weigh exactly 0 (not read). The
   same bits as plain rows over a row whose hidden elements hold the dtype's
   lowest value: those add exact zeros to the lanes. */
static void causal_rows(void* ctx, long a, long b) {
  const rows_t* j = (const rows_t*)ctx;
  const int n = j->n;
  for (long r = a; r < b; r++) {
    long seen = (long)j->offset + r % j->period + 1;
    int vis = seen < 1 ? 1 : seen > n ? n : (int)seen;
    float* yr = j->y + (size_t)r * n;
    row(j->x + (size_t)r * n, yr, vis);
    if (vis < n) memset(yr + vis, 0, (size_t)(n - vis) * sizeof(float));
  }
}

/* Masked rows: row g reads mask row ((g / per_batch) % mask_batches) * period
   + (g % per_batch) % period, and an element the mask hides (0) counts as the
   dtype's lowest value: the same bits as `where(mask, x, lowest)` then the
   plain rows, without that pass (written into y, then the row in place). */
static void masked_rows(void* ctx, long a, long b) {
  const masked_t* j = (const masked_t*)ctx;
  const int n = j->n;
  const float lowest = -3.40282346638528859812e+38f;
  for (long r = a; r < b; r++) {
    long mr = ((r / j->per_batch) % j->mask_batches) * j->period + (r % j->per_batch) % j->period;
    const unsigned char* m = j->mask + (size_t)mr * n;
    const float* xr = j->x + (size_t)r * n;
    float* yr = j->y + (size_t)r * n;
    const __m256 low = _mm256_set1_ps(lowest);
    int k = 0;
    for (; k + 8 <= n; k += 8) {
      /* eight mask bytes widened to lanes: all ones where the byte is not 0 */
      __m256i keep = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(m + k)));
      keep = _mm256_xor_si256(_mm256_cmpeq_epi32(keep, _mm256_setzero_si256()),
                              _mm256_set1_epi32(-1));
      _mm256_storeu_ps(yr + k, _mm256_blendv_ps(low, _mm256_loadu_ps(xr + k),
                                                _mm256_castsi256_ps(keep)));
    }
    for (; k < n; k++) yr[k] = m[k] ? xr[k] : lowest;
    row(yr, yr, n);
  }
}

/* Rows go to the pool's threads in contiguous parts (a row's bits do not
   depend on the split) once a call has MIN_SPLIT elements per thread: below
   that, waking a worker costs more than it saves. */
#define MIN_SPLIT (1L << 15)
static int threads_for(long rows, int n, int threads) {
  long per = (long)MIN_SPLIT;
  long most = rows * (long)n / per;
  if (most < 1) most = 1;
  return threads < most ? threads : (int)most;
}

void kvtier_softmax_rows(const float* x, float* y, long rows, int n, int threads) {
  rows_t job = {x, y, n, 0, 0};
  kvtier_parallel(threads_for(rows, n, threads), rows, plain_rows, &job);
}

void kvtier_softmax_causal_rows(const float* x, float* y, long rows, int n, int period, int offset,
                                int threads) {
  rows_t job = {x, y, n, period, offset};
  kvtier_parallel(threads_for(rows, n, threads), rows, causal_rows, &job);
}

void kvtier_softmax_masked_rows(const float* x, const unsigned char* mask, float* y, long rows, int n,
                                long per_batch, long mask_batches, long period, int threads) {
  masked_t job = {x, y, mask, n, per_batch, mask_batches, period};
  kvtier_parallel(threads_for(rows, n, threads), rows, masked_rows, &job);
}
