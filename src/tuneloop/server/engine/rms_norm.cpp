// transformers' LlamaRMSNorm at bf16, step for step as compiled.py's `rms_norm`: each row's
// mean square in fp32, the row times 1/sqrt(mean + eps) rounded to bf16, times the weight
// rounded to bf16 again. A sampling step's norm is [rows, width] of a few hundred KB: torch
// spends far longer dispatching a compiled call than this loop runs (compiled.py).
#include <cmath>
#include <cstdint>

#include "bf16.h"

// x and out [rows, width], weight [width], all bf16 and contiguous.
extern "C" void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, int64_t rows,
                              int64_t width, float eps, uint16_t* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * width;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) {
      const float v = bf16::to_float(row[i]);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / float(width) + eps);
    uint16_t* o = out + r * width;
    #pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float scaled = bf16::rounded(bf16::to_float(row[i]) * inv);  // x's dtype, then
      o[i] = bf16::from_float(bf16::to_float(weight[i]) * scaled);  // times the weight
    }
  }
}

// The same at fp32 (an fp32 model's sampling steps): each row's mean square, the row times
// 1/sqrt(mean + eps), times the weight, each product rounded to fp32 as eager's operations
// round them. The sum of squares is summed in its own order (the compiler's lanes, its
// squares possibly fused into FMAs), so the factor may be a step apart from eager's.
extern "C" void rms_norm_fp32(const float* x, const float* weight, int64_t rows, int64_t width,
                              float eps, float* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / float(width) + eps);
    float* o = out + r * width;
    #pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float scaled = row[i] * inv;
      o[i] = weight[i] * scaled;
    }
  }
}
