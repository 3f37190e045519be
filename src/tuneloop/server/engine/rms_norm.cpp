// transformers' LlamaRMSNorm at bf16, step for step as compiled.py's `rms_norm`: each row's
// mean square in fp32, the row times 1/sqrt(mean + eps) rounded to bf16, times the weight
// rounded to bf16 again. A sampling step's norm is [rows, width] of a few hundred KB: torch
// spends far longer dispatching a compiled call than this loop runs (compiled.py). A training
// pass's norms run it too, keeping each row's factor, with the input gradient's loop below.
#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

// An element type's widening to fp32, rounding of an fp32 result to it (as an eager
// operation on tensors of that type rounds), and narrowing.
template <class T>
struct Element;

template <>
struct Element<uint16_t> {
  static float wide(uint16_t v) { return bf16::to_float(v); }
  static float rounded(float v) { return bf16::rounded(v); }
  static uint16_t narrow(float v) { return bf16::from_float(v); }
};

template <>
struct Element<float> {
  static float wide(float v) { return v; }
  static float rounded(float v) { return v; }
  static float narrow(float v) { return v; }
};

// One bf16 row's norm into `o`; returns the row's factor 1/sqrt(mean + eps).
inline float norm_row(const uint16_t* row, const uint16_t* weight, int64_t width, float eps,
                      uint16_t* o) {
  float sum = 0.0f;
  #pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) {
    const float v = bf16::to_float(row[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / float(width) + eps);
  #pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float scaled = bf16::rounded(bf16::to_float(row[i]) * inv);  // x's dtype, then
    o[i] = bf16::from_float(bf16::to_float(weight[i]) * scaled);  // times the weight
  }
  return inv;
}

}  // namespace

// x and out [rows, width], weight [width], all bf16 and contiguous.
extern "C" void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, int64_t rows,
                              int64_t width, float eps, uint16_t* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * width, weight, width, eps, out + r * width);
}

// The same at fp32 (an fp32 model's sampling steps): each row's mean square, the row times
// 1/sqrt(mean + eps), times the weight, each product rounded to fp32 as eager's operations
// round them. The sum of squares is summed in its own order (the compiler's lanes, its
// squares possibly fused into FMAs), so the factor may be a step apart from eager's.
namespace {

inline float norm_row(const float* row, const float* weight, int64_t width, float eps, float* o) {
  float sum = 0.0f;
  #pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
  const float inv = 1.0f / std::sqrt(sum / float(width) + eps);
  #pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float scaled = row[i] * inv;
    o[i] = weight[i] * scaled;
  }
  return inv;
}

}  // namespace

extern "C" void rms_norm_fp32(const float* x, const float* weight, int64_t rows, int64_t width,
                              float eps, float* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * width, weight, width, eps, out + r * width);
}

// A training pass's norm (compiled.py's `_NativeNorm`): the forward above, each row's factor
// kept in `inv` [rows] for the backward pass.
template <class T>
void forward_saved(const T* x, const T* weight, int64_t rows, int64_t width, float eps, T* out,
                   float* inv, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r)
    inv[r] = norm_row(x + r * width, weight, width, eps, out + r * width);
}

// The input's gradient through the norm (the weight is frozen), eager autograd's chain of
// `rms_norm` (compiled.py) step for step: d hb = g * w rounded to x's dtype (MulBackward),
// d h = d hb * inv (the scaling) + d mean / width * 2 h (RsqrtBackward's -0.5 * d inv * inv^3
// through the mean and the square), each in fp32, rounded once to x's dtype. d inv, the row's
// sum of d hb * h, is summed in the compiler's lanes (eager sums in its own order).
template <class T>
void backward_rows(const T* g, const T* x, const T* weight, const float* inv, int64_t rows,
                   int64_t width, T* dx, int threads) {
  using E = Element<T>;
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gr = g + r * width;
    const T* xr = x + r * width;
    float dot = 0.0f;
    #pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < width; ++i)
      dot += E::rounded(E::wide(gr[i]) * E::wide(weight[i])) * E::wide(xr[i]);
    const float factor = inv[r];
    const float d_mean = -0.5f * dot * (factor * factor * factor) / float(width);
    T* o = dx + r * width;
    #pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float h = E::wide(xr[i]);
      const float d_hb = E::rounded(E::wide(gr[i]) * E::wide(weight[i]));
      o[i] = E::narrow(d_hb * factor + d_mean * (2.0f * h));
    }
  }
}

extern "C" void rms_norm_forward_bf16(const uint16_t* x, const uint16_t* weight, int64_t rows,
                                      int64_t width, float eps, uint16_t* out, float* inv,
                                      int threads) {
  forward_saved(x, weight, rows, width, eps, out, inv, threads);
}

extern "C" void rms_norm_forward_fp32(const float* x, const float* weight, int64_t rows,
                                      int64_t width, float eps, float* out, float* inv,
                                      int threads) {
  forward_saved(x, weight, rows, width, eps, out, inv, threads);
}

// g, x and dx [rows, width], weight [width], all contiguous; inv [rows] from the forward.
extern "C" void rms_norm_backward_bf16(const uint16_t* g, const uint16_t* x,
                                       const uint16_t* weight, const float* inv, int64_t rows,
                                       int64_t width, uint16_t* dx, int threads) {
  backward_rows(g, x, weight, inv, rows, width, dx, threads);
}

extern "C" void rms_norm_backward_fp32(const float* g, const float* x, const float* weight,
                                       const float* inv, int64_t rows, int64_t width, float* dx,
                                       int threads) {
  backward_rows(g, x, weight, inv, rows, width, dx, threads);
}
