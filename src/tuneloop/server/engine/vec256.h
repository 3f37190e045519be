// 8-lane AVX2 helpers of the engine's fp32 C++ loops on CPUs without AVX-512 (head_tile_fp32.cpp
// built for AVX2): the first lanes of a vector, exp for arguments <= 0, and the vector policy
// head_tile.h's loops take (`Lanes`, as vec512.h's for 16 lanes).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "sleef_expf.h"

namespace vec256 {

// The first min(left, 8) lanes, as a mask of whole lanes.
inline __m256i lanes(int64_t left) {
  if (left >= 8) return _mm256_set1_epi32(-1);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(d) for d <= 0, 8 lanes: vec512::exp_le0's reduction and polynomial (sleef_expf.h).
// AVX2 has no scalef: 2^q (q in [-150, 0] after the clamp to -104) is applied as two powers
// of two of at most 75 in size, each a normal number, so the first product is exact and the
// second rounds once, into the subnormals where it must, as scalef's single rounding does.
inline __m256 exp_le0(__m256 d) {
  d = _mm256_max_ps(d, _mm256_set1_ps(-104.0f));
  using namespace sleef_expf;
  const __m256 q = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 s = _mm256_fmadd_ps(q, _mm256_set1_ps(-kLn2High), d);
  s = _mm256_fmadd_ps(q, _mm256_set1_ps(-kLn2Low), s);
  __m256 u = _mm256_set1_ps(kPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kDegree; ++i) u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kPoly[i]));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i whole = _mm256_cvtps_epi32(q);
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256i rest = _mm256_sub_epi32(whole, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(u, first), second);
}

// head_tile.h's vector policy: 8 fp32 lanes, masks of whole lanes.
struct Lanes {
  using V = __m256;
  using Mask = __m256i;
  static constexpr int64_t kWidth = 8;
  static Mask first(int64_t left) { return lanes(left); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V exp(V d) { return exp_le0(d); }
  static V max_where(V acc, Mask keep, V x) {
    return _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), _mm256_castsi256_ps(keep));
  }
  static V add_where(V acc, Mask keep, V x) {
    return _mm256_blendv_ps(acc, _mm256_add_ps(acc, x), _mm256_castsi256_ps(keep));
  }
  static float reduce_max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  static float lowest(V v) { return _mm256_cvtss_f32(v); }
};

}  // namespace vec256
