// A CPU sampling step's decoder layers in one call over bf16 (decode_layers.h's loop, for x86-64
// CPUs with AVX512F and AVX512-BF16; native_layers.py builds, loads and calls it). The residual
// sums are bf16 + bf16 in fp32 rounded to bf16 (nearest even), as torch's add on bf16 tensors
// rounds them.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this loop needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "decode_layers.h"
#include "vec512.h"

namespace {

// hidden += y, both [n] bf16: the sum in fp32 rounded to bf16 (nearest even), in spans of
// 16 x 1024 elements across the threads.
void add(uint16_t* hidden, const uint16_t* y, int64_t n, int threads) {
  constexpr int64_t kSpan = 16 * 1024;
  const int64_t spans = (n + kSpan - 1) / kSpan;
  #pragma omp parallel for num_threads(threads) schedule(static) if (spans > 1)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t end = std::min(n, (s + 1) * kSpan);
    for (int64_t j = s * kSpan; j < end; j += 16) {
      const __mmask16 keep = vec512::lanes(end - j);
      const __m512 sum =
          _mm512_add_ps(vec512::widen(hidden + j, keep), vec512::widen(y + j, keep));
      _mm256_mask_storeu_epi16(hidden + j, keep, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

using T = uint16_t;

}  // namespace

extern "C" {

// The scratch block's size in bf16 elements for a step of `shape` over `layers`.
int64_t decode_layers_scratch(const decode_layers::Layer<T>* layers, int64_t n_layers,
                              const decode_layers::Shape* shape) {
  return decode_layers::scratch<T>(layers, n_layers, shape);
}

// decode_layers::run over bf16 (its arguments there).
int decode_layers_bf16(const decode_layers::Kernels<T>* kernels,
                       const decode_layers::Layer<T>* layers, int64_t n_layers,
                       const decode_layers::Shape* shape, T* hidden, const T* cos, const T* sin,
                       int64_t cs_stride, const int64_t* slot_mapping, const int64_t* slots,
                       const bool* mask, char* const* k_pools, char* const* v_pools, T* scratch,
                       int64_t scratch_elements) {
  return decode_layers::run<T, add>(kernels, layers, n_layers, shape, hidden, cos, sin,
                                    cs_stride, slot_mapping, slots, mask, k_pools, v_pools,
                                    scratch, scratch_elements);
}

}  // extern "C"
