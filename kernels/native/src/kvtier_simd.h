/* kvtier: AVX2 helpers shared by the native kernels (few_row.c, softmax.c). */
#ifndef KVTIER_SIMD_H
#define KVTIER_SIMD_H
#include <immintrin.h>

/* The 8 lanes' sum in a fixed order (the same bits for the same lanes). */
static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

#endif
