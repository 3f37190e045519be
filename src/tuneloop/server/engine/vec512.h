// 16-lane AVX-512 helpers of the engine's C++ loops over bf16 (head_tile.cpp,
// attention_tiles.cpp): a masked widening load, exp for arguments <= 0, and the vector policy
// head_tile.h's loops take (`Lanes`; vec256.h's for 8 AVX2 lanes). native.py builds each
// source with the engine folder's headers, and a header's change rebuilds them.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "sleef_expf.h"

namespace vec512 {

// 16 bf16 values at p (the lanes in `keep`; zero elsewhere) as fp32.
inline __m512 widen(const uint16_t* p, __mmask16 keep) {
  const __m256i bits = _mm256_maskz_loadu_epi16(keep, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The first min(left, 16) lanes.
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// exp(d) for d <= 0 (a logit less its row's maximum or logsumexp), 16 lanes: SLEEF's expf_u10
// reduction and polynomial (which torch's vectorized kernels call), 2^q applied by scalef
// (which underflows to zero as exp does). d is clamped to -104 first (exp is zero in fp32
// below about -103.3), so -inf gives zero too.
inline __m512 exp_le0(__m512 d) {
  d = _mm512_max_ps(d, _mm512_set1_ps(-104.0f));
  using namespace sleef_expf;
  const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-kLn2High), d);
  s = _mm512_fmadd_ps(q, _mm512_set1_ps(-kLn2Low), s);
  __m512 u = _mm512_set1_ps(kPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < kDegree; ++i) u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kPoly[i]));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  return _mm512_scalef_ps(u, q);
}

// head_tile.h's vector policy: 16 fp32 lanes, AVX-512 masks.
struct Lanes {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kWidth = 16;
  static Mask first(int64_t left) { return lanes(left); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V exp(V d) { return exp_le0(d); }
  static V max_where(V acc, Mask keep, V x) { return _mm512_mask_max_ps(acc, keep, acc, x); }
  static V add_where(V acc, Mask keep, V x) { return _mm512_mask_add_ps(acc, keep, acc, x); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float lowest(V v) { return _mm512_cvtss_f32(v); }
};

}  // namespace vec512
