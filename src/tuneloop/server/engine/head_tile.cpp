// The LM head tile's loops (head_tile.h) over bf16 logits, for x86-64 CPUs with AVX512F and
// AVX512-BF16 (native_head.py builds and loads it); a gradient rounds to bf16 as it is stored
// (nearest even, as torch's downcast).
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include "bf16.h"
#include "head_tile.h"
#include "vec512.h"

namespace {

struct Bf16 {
  using T = uint16_t;
  using Vec = vec512::Lanes;
  static __m512 load(const T* p, __mmask16 keep) { return vec512::widen(p, keep); }
  static float at(const T* p) { return bf16::to_float(*p); }
  static void store(T* p, __mmask16 keep, __m512 v) {
    _mm256_mask_storeu_epi16(p, keep, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static void put(T* p, float v) { *p = bf16::from_float(v); }
};

}  // namespace

HEAD_TILE_ENTRY_POINTS(bf16, Bf16)
