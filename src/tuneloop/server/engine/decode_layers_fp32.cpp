// A CPU sampling step's decoder layers in one call over fp32 (decode_layers.h's loop, for x86-64
// CPUs with AVX2 and FMA; native_layers.py builds, loads and calls it): an fp32 model's steps,
// on the fp32 forms of the same kernels (no LoRA columns: an fp32 lone copy merges its
// adapter) and silu_mul_fp32.cpp's SiLU product, which gives eager's bits. The residual sums
// are fp32 additions, as torch's add makes them.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "this loop needs AVX2 and FMA"
#endif
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "decode_layers.h"

namespace {

// hidden += y, both [n] fp32, in spans of 16 x 1024 elements across the threads.
void add(float* hidden, const float* y, int64_t n, int threads) {
  constexpr int64_t kSpan = 16 * 1024;
  const int64_t spans = (n + kSpan - 1) / kSpan;
  #pragma omp parallel for num_threads(threads) schedule(static) if (spans > 1)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t end = std::min(n, (s + 1) * kSpan);
    for (int64_t j = s * kSpan; j < end; ++j) hidden[j] += y[j];
  }
}

using T = float;

}  // namespace

extern "C" {

// The scratch block's size in fp32 elements for a step of `shape` over `layers`.
int64_t decode_layers_fp32_scratch(const decode_layers::Layer<T>* layers, int64_t n_layers,
                                   const decode_layers::Shape* shape) {
  return decode_layers::scratch<T>(layers, n_layers, shape);
}

// decode_layers::run over fp32 (its arguments there).
int decode_layers_fp32(const decode_layers::Kernels<T>* kernels,
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
