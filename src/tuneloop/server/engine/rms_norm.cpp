// transformers' LlamaRMSNorm at bf16, step for step as compiled.py's `rms_norm`: each row's
// mean square in fp32, the row times 1/sqrt(mean + eps) rounded to bf16, times the weight
// rounded to bf16 again. A sampling step's norm is [rows, width] of a few hundred KB: torch
// spends far longer dispatching a compiled call than this loop runs (compiled.py).
#include <cmath>
#include <bit>
#include <cstdint>

namespace {

// (branch-free, so that the compiler vectorizes the loops they are in)
inline float from_bf16(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }

inline uint16_t to_bf16(float v) {  // round to nearest even, as torch's conversion; NaN kept
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40u;
  return uint16_t((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

}  // namespace

// x and out [rows, width], weight [width], all bf16 and contiguous.
extern "C" void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, int64_t rows,
                              int64_t width, float eps, uint16_t* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * width;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) sum += from_bf16(row[i]) * from_bf16(row[i]);
    const float inv = 1.0f / std::sqrt(sum / float(width) + eps);
    uint16_t* o = out + r * width;
    #pragma omp simd
    for (int64_t i = 0; i < width; ++i)
      o[i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(from_bf16(row[i]) * inv)));
  }
}
