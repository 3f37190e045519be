// The LM head tile's loops (head_tile.h) over fp32 logits, for x86-64 CPUs with AVX512F
// (native_head.py builds and loads it): an fp32 model's training pass, where the CPU has no
// bf16 units.
#if !defined(__AVX512F__)
#error "this kernel needs AVX512F"
#endif
#include "head_tile.h"

namespace {

struct Fp32 {
  using T = float;
  static __m512 load(const T* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
  static float at(const T* p) { return *p; }
  static void store(T* p, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(p, keep, v); }
  static void put(T* p, float v) { *p = v; }
};

}  // namespace

HEAD_TILE_ENTRY_POINTS(fp32, Fp32)
