// A CPU sampling step's decoder layers in one call over fp32 (decode_layers.h's loop, for x86-64
// CPUs with AVX2 and FMA; native_layers.py builds, loads and calls it): an fp32 model's steps,
// on the fp32 forms of the same kernels (no LoRA columns: an fp32 lone copy merges its
// adapter) and silu_mul_fp32.cpp's SiLU product, which gives eager's bits. The residual sums
// are fp32 additions, as torch's add makes them.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "this loop needs AVX2 and FMA"
#endif
#include <cstdint>

#include "decode_layers.h"

namespace {

// hidden += y, both [n] fp32.
void add(float* hidden, const float* y, int64_t n, int threads) {
  decode_layers::add_spans(hidden, y, n, threads,
                           [](float* h, const float* v, int64_t begin, int64_t end) {
                             for (int64_t j = begin; j < end; ++j) h[j] += v[j];
                           });
}

}  // namespace

DECODE_LAYERS_ENTRY_POINTS(fp32, float, add)
