// The LM head tile's loops (head_tile.h) over bf16 logits, for x86-64 CPUs with AVX512F and
// AVX512-BF16 (native_head.py builds and loads it); a gradient rounds to bf16 as it is stored
// (nearest even, as torch's downcast).
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include "bf16.h"
#include "head_tile.h"

namespace {

struct Bf16 {
  using T = uint16_t;
  static __m512 load(const T* p, __mmask16 keep) { return vec512::widen(p, keep); }
  static float at(const T* p) { return bf16::to_float(*p); }
  static void store(T* p, __mmask16 keep, __m512 v) {
    _mm256_mask_storeu_epi16(p, keep, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static void put(T* p, float v) { *p = bf16::from_float(v); }
};

}  // namespace

extern "C" int head_tile_forward_bf16(const uint16_t* raw, int64_t ld, int64_t rows, int64_t n,
                                      int64_t v0, const int64_t* targets, int64_t k,
                                      float* high, float* total, float* picked, int threads) {
  return head_tile::forward<Bf16>(raw, ld, rows, n, v0, targets, k, high, total, picked,
                                  threads);
}

extern "C" int head_tile_backward_bf16(const uint16_t* raw, int64_t ld, int64_t rows, int64_t n,
                                       int64_t v0, const int64_t* targets, int64_t k,
                                       const float* lse, const float* g_sum, const float* g,
                                       uint16_t* d, int threads) {
  return head_tile::backward<Bf16>(raw, ld, rows, n, v0, targets, k, lse, g_sum, g, d,
                                   threads);
}
