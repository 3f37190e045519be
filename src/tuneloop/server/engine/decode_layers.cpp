// A CPU sampling step's decoder layers in one call over bf16 (decode_layers.h's loop, for x86-64
// CPUs with AVX512F and AVX512-BF16; native_layers.py builds, loads and calls it). The residual
// sums are bf16 + bf16 in fp32 rounded to bf16 (nearest even), as torch's add on bf16 tensors
// rounds them.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this loop needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>

#include <cstdint>

#include "decode_layers.h"
#include "vec512.h"

namespace {

// hidden += y, both [n] bf16.
void add(uint16_t* hidden, const uint16_t* y, int64_t n, int threads) {
  decode_layers::add_spans(hidden, y, n, threads, [](uint16_t* h, const uint16_t* v, int64_t
                                                     begin, int64_t end) {
    for (int64_t j = begin; j < end; j += 16) {
      const __mmask16 keep = vec512::lanes(end - j);
      const __m512 sum = _mm512_add_ps(vec512::widen(h + j, keep), vec512::widen(v + j, keep));
      _mm256_mask_storeu_epi16(h + j, keep, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  });
}

}  // namespace

DECODE_LAYERS_ENTRY_POINTS(bf16, uint16_t, add)
