// The LM head tile's loops (head_tile.h) over fp32 logits, for x86-64 CPUs with AVX512F, or
// AVX2 and FMA (native_head.py builds and loads it): an fp32 model's training pass, where the
// CPU has no bf16 units. Built with AVX-512 where the CPU has it (16 lanes), else with AVX2 (8).
#if defined(__AVX512F__)
#include "vec512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec256.h"
#else
#error "this kernel needs AVX512F, or AVX2 and FMA"
#endif
#include "head_tile.h"

namespace {

#if defined(__AVX512F__)
struct Fp32 {
  using T = float;
  using Vec = vec512::Lanes;
  static __m512 load(const T* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
  static float at(const T* p) { return *p; }
  static void store(T* p, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(p, keep, v); }
  static void put(T* p, float v) { *p = v; }
};
#else
// A row's whole vectors by plain loads and stores, its last by masked ones: on a Zen 3 EPYC a
// masked store of every vector made the backward loop slower than torch's three passes.
struct Fp32 {
  using T = float;
  using Vec = vec256::Lanes;
  static bool whole(__m256i keep) { return _mm256_movemask_ps(_mm256_castsi256_ps(keep)) == 0xFF; }
  static __m256 load(const T* p, __m256i keep) {
    return whole(keep) ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, keep);
  }
  static float at(const T* p) { return *p; }
  static void store(T* p, __m256i keep, __m256 v) {
    if (whole(keep)) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm256_maskstore_ps(p, keep, v);
    }
  }
  static void put(T* p, float v) { *p = v; }
};
#endif

}  // namespace

HEAD_TILE_ENTRY_POINTS(fp32, Fp32)
