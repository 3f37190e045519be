// The gated MLP's `silu(gate) * up` at fp32, as eager torch's two operations give it, for
// x86-64 CPUs with AVX2 and FMA (gated_mlp.py builds it; a sampling step's layers in one C++
// call, decode_layers_fp32.cpp, take it). Eager's vectorized silu on fp32 is x / (1 + exp(-x))
// with SLEEF's expf_u10, the product a second pass; here one pass reads gate and up and writes
// the product. The exp is torch's own function, passed in by its address (`silu_mul_fp32_exp`,
// from libtorch_cpu): an exp of our own, however close, would round apart from eager's in some
// inputs. gated_mlp.py takes the loop only after it gave eager's bits on a probe.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "this kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <omp.h>

#include <cstdint>

namespace {

using Exp = __m256 (*)(__m256);
Exp exp_fn = nullptr;

}  // namespace

// The exp the loop calls: SLEEF's expf8_u10 for AVX2 as torch carries it. Returns 0.
extern "C" int silu_mul_fp32_exp(const void* fn) {
  exp_fn = reinterpret_cast<Exp>(const_cast<void*>(fn));
  return 0;
}

// out [rows, width] (contiguous) = silu(gate) * up, gate and up [rows, width] with row strides
// gate_stride and up_stride. Returns 0, or 1 where refused (no exp set, a width that is not a
// multiple of 16: eager's vectorized loop takes two vectors a step and computes a row's last
// width % 16 elements by the scalar exp, which rounds apart from SLEEF's).
extern "C" int silu_mul_fp32(const float* gate, int64_t gate_stride, const float* up,
                             int64_t up_stride, int64_t rows, int64_t width, float* out,
                             int threads) {
  if (exp_fn == nullptr || width % 16 != 0 || rows < 0) return 1;
  const Exp exp8 = exp_fn;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * gate_stride;
    const float* u = up + r * up_stride;
    float* o = out + r * width;
    for (int64_t i = 0; i < width; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
  }
  return 0;
}
