// The gated MLP's `act_fn(gate) * up` at bf16 with act_fn SiLU (Llama, Qwen2/3, Mistral,
// SmolLM2), as eager torch's two operations give it: silu in fp32 as x / (1 + exp(-x)) rounded
// to bf16, then the product of the two bf16 values in fp32 rounded to bf16 again. Eager, each
// operation is a pass over [rows, width] with its own dispatch and thread hand-off (a sampling
// step's [128, 1536]: ~60 us for silu, ~23 us for the product); one loop reads each input once
// and writes once (gated_mlp.py). gate and up are often the two halves of one matmul's output
// (the engine's sibling layers), so rows are read through their strides, without a copy.
//
// silu of a bf16 value is a function of its 16 bits: it is looked up in a table of all 65,536,
// filled once per process. Computed in the loop, exp and the division cost as much as eager's
// silu alone (~2.3 cycles an element on an AVX-512 EPYC, 77 us for the [128, 1536] on two
// threads); looked up, 36 us. A layer's activations take a few thousand of the entries, which
// stay in the L1/L2 caches. The compiler looks the tables up one element at a time; where the
// CPU has AVX-512 the loops can read them by gathers, 16 lanes at a time, with the same bits:
// faster on some CPUs, slower on others, so each loop measures both forms once (below).
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "sleef_expf.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "vec512.h"
#define SILU_MUL_AVX512 1
#endif

namespace {


inline float pow2(int32_t e) { return std::bit_cast<float>(uint32_t(e + 127) << 23); }

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// exp in fp32 within 1 ulp by the reduction and polynomial of SLEEF's expf_u10, which torch's
// vectorized CPU kernels call, so that silu's rounding to bf16 lands where eager's does: the
// table equals eager's silu for every bf16 input (checked in the tests). The input is clamped
// to [-104, 100] first so that the integer part stays small; silu needs no more, as 1 + exp(d)
// is 1 in fp32 below d = -17, and exp overflows to infinity past ~88.7 (x / inf is -0 for a
// large negative x, as in eager). NaN becomes -104 here; silu keeps it, as x / anything is
// NaN. (Clamped as integers, without float comparisons, so that the table's fill vectorizes:
// a comparison reached on some paths only may trap, and the compiler then keeps branches.)
inline float exp_f32(float d) {
  const auto ordered = [](int32_t bits) {  // a float's bits as an integer ordered as floats
    return bits ^ ((bits >> 31) & 0x7fffffff);  // (its own inverse)
  };
  const int32_t key = ordered(std::bit_cast<int32_t>(d));
  const int32_t low = ordered(std::bit_cast<int32_t>(-104.0f));
  const int32_t high = ordered(std::bit_cast<int32_t>(100.0f));
  const float c = std::bit_cast<float>(ordered(key < low ? low : key > high ? high : key));
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
  using namespace sleef_expf;
  const float q = (c * kLog2e + shifter) - shifter;
  float s = fma(q, -kLn2High, c);
  s = fma(q, -kLn2Low, s);
  float u = kPoly[0];
#pragma GCC unroll 8
  for (int i = 1; i < kDegree; ++i) u = fma(u, s, kPoly[i]);
  u = 1.0f + fma(s * s, u, s);
  const int32_t e = int32_t(q);
  return u * pow2(e >> 1) * pow2(e - (e >> 1));  // 2^e in two steps: e may pass 127
}

// silu(x) of every bf16 x, rounded to bf16 and held as fp32 bits (a bf16 value's fp32 form).
// Filled at the first call (thread-safe, as a function's static); 256 KB.
const std::array<uint32_t, 65536>& silu_table() {
  static const std::array<uint32_t, 65536> table = [] {
    std::array<uint32_t, 65536> filled{};
    for (uint32_t v = 0; v < filled.size(); ++v) {
      const float x = bf16::to_float(uint16_t(v));
      filled[v] = uint32_t(bf16::from_float(x / (1.0f + exp_f32(-x)))) << 16;
    }
    return filled;
  }();
  return table;
}

// silu's derivative of every bf16 x in the two fp32 factors eager's silu_backward makes
// of it, sigmoid = 1 / (1 + exp(-x)) and 1 + x * (1 - sigmoid), each with its own roundings
// (no fused multiply-add, which would round once where eager rounds twice). 512 KB.
struct SiluSlope {
  float sigmoid, rest;
};

__attribute__((optimize("fp-contract=off"))) SiluSlope slope_of(float x) {
  const float sigmoid = 1.0f / (1.0f + exp_f32(-x));
  const float complement = 1.0f - sigmoid;
  const float product = x * complement;
  return {sigmoid, 1.0f + product};
}

const std::array<SiluSlope, 65536>& slope_table() {
  static const std::array<SiluSlope, 65536> table = [] {
    std::array<SiluSlope, 65536> filled{};
    for (uint32_t v = 0; v < filled.size(); ++v) filled[v] = slope_of(bf16::to_float(uint16_t(v)));
    return filled;
  }();
  return table;
}

// A row of the forward and of the backward, the tables read one element at a time.
void scalar_row(const uint16_t* g, const uint16_t* u, int64_t width, uint16_t* o,
                const uint32_t* silu) {
  #pragma omp simd
  for (int64_t i = 0; i < width; ++i)
    o[i] = bf16::from_float(std::bit_cast<float>(silu[g[i]]) * bf16::to_float(u[i]));
}

void scalar_backward_row(const uint16_t* d, const uint16_t* g, const uint16_t* u,
                         int64_t width, uint16_t* dg, uint16_t* du, const uint32_t* silu,
                         const SiluSlope* slope) {
  #pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float dy = bf16::to_float(d[i]);
    du[i] = bf16::from_float(dy * std::bit_cast<float>(silu[g[i]]));
    const float d_silu = bf16::rounded(dy * bf16::to_float(u[i]));
    const SiluSlope s = slope[g[i]];
    dg[i] = bf16::from_float((d_silu * s.sigmoid) * s.rest);
  }
}

// Whether each loop reads the tables by AVX-512 gathers or one element at a time. Neither is
// faster everywhere: at a training step's [1408, 1536], gathers took an AMX Xeon's forward
// from 793 to 543 us and its backward from 2,099 to 1,253, but a Zen 5 EPYC's from 288 to
// 505 and from 927 to 1,405 (bench/cpu_kernels.py --only silu-loops). So each loop's form is
// measured once per process, at its first call (kMeasure): both forms on the same few rows
// of made-up values, alternated, the faster kept. Both give the same bits (tested), so the
// choice moves only the time. The tests and the benchmark set a form (silu_mul_gathers).
constexpr int kMeasure = -1, kOneAtATime = 0, kGathers = 1;
std::atomic<int> g_forward{kMeasure}, g_backward{kMeasure};

#ifdef SILU_MUL_AVX512
// 16 lanes at a time where the CPU has AVX-512: the tables read by gathers (the compiler
// looks them up one element at a time), the arithmetic and the rounding as the scalar loop's.
// A row's last lanes are masked.

// 16 bf16 values' bits (the lanes in `keep`; zero elsewhere) as 32-bit table indices.
inline __m512i indices(const uint16_t* p, __mmask16 keep) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p));
}

inline __m512 floats(__m512i bf16_bits) {  // bf16 values' bits in 32-bit lanes, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits, 16));
}

// bf16::from_float of each lane (round to nearest even, NaN kept quiet), in 32-bit lanes.
inline __m512i rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i nearest = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(nearest, nan, quiet);
}

inline void store(uint16_t* p, __mmask16 keep, __m512i bf16_bits) {
  _mm256_mask_storeu_epi16(p, keep, _mm512_cvtepi32_epi16(bf16_bits));
}

void silu_mul_row(const uint16_t* g, const uint16_t* u, int64_t width, uint16_t* o,
                  const uint32_t* silu) {
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 keep = vec512::lanes(width - i);
    const __m512i index = indices(g + i, keep);
    const __m512 s = _mm512_castsi512_ps(_mm512_i32gather_epi32(index, silu, 4));
    store(o + i, keep, rounded(_mm512_mul_ps(s, vec512::widen(u + i, keep))));
  }
}

void silu_mul_backward_row(const uint16_t* d, const uint16_t* g, const uint16_t* u,
                           int64_t width, uint16_t* dg, uint16_t* du, const uint32_t* silu,
                           const SiluSlope* slope) {
  const float* pairs = reinterpret_cast<const float*>(slope);  // sigmoid, rest per entry
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 keep = vec512::lanes(width - i);
    const __m512i index = indices(g + i, keep);
    const __m512 dy = vec512::widen(d + i, keep);
    const __m512 s = _mm512_castsi512_ps(_mm512_i32gather_epi32(index, silu, 4));
    store(du + i, keep, rounded(_mm512_mul_ps(dy, s)));
    const __m512 d_silu = floats(rounded(_mm512_mul_ps(dy, vec512::widen(u + i, keep))));
    const __m512i twice = _mm512_slli_epi32(index, 1);
    const __m512 sigmoid = _mm512_i32gather_ps(twice, pairs, 4);
    const __m512 rest = _mm512_i32gather_ps(_mm512_add_epi32(twice, _mm512_set1_epi32(1)), pairs, 4);
    store(dg + i, keep, rounded(_mm512_mul_ps(_mm512_mul_ps(d_silu, sigmoid), rest)));
  }
}
#endif

// The best of five alternated timings of each form of a loop, on kRows rows of kWidth made-up
// bf16 values spread over silu's range: whether the gathers were faster.
constexpr int64_t kRows = 8, kWidth = 1536;

template <class Run>
bool gathers_faster(Run run) {
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < 5; ++round)
    for (int gathers = 0; gathers < 2; ++gathers) {
      const auto start = std::chrono::steady_clock::now();
      run(gathers == 1);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      best[gathers] = std::min(best[gathers], took.count());
    }
  return best[1] < best[0];
}

std::vector<uint16_t> made_up(uint32_t seed) {
  std::vector<uint16_t> values(kRows * kWidth);
  for (auto& v : values) {  // (a linear congruential generator: uniform in [-8, 8))
    seed = seed * 1664525u + 1013904223u;
    v = bf16::from_float(float(seed >> 8) * (16.0f / 16777216.0f) - 8.0f);
  }
  return values;
}

bool measure_forward() {
#ifdef SILU_MUL_AVX512
  const uint32_t* silu = silu_table().data();
  const auto g = made_up(1), u = made_up(2);
  std::vector<uint16_t> o(kRows * kWidth);
  return gathers_faster([&](bool gathers) {
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t at = r * kWidth;
      if (gathers) silu_mul_row(&g[at], &u[at], kWidth, &o[at], silu);
      else scalar_row(&g[at], &u[at], kWidth, &o[at], silu);
    }
  });
#else
  return false;
#endif
}

bool measure_backward() {
#ifdef SILU_MUL_AVX512
  const uint32_t* silu = silu_table().data();
  const SiluSlope* slope = slope_table().data();
  const auto d = made_up(3), g = made_up(4), u = made_up(5);
  std::vector<uint16_t> dg(kRows * kWidth), du(kRows * kWidth);
  return gathers_faster([&](bool gathers) {
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t at = r * kWidth;
      if (gathers)
        silu_mul_backward_row(&d[at], &g[at], &u[at], kWidth, &dg[at], &du[at], silu, slope);
      else
        scalar_backward_row(&d[at], &g[at], &u[at], kWidth, &dg[at], &du[at], silu, slope);
    }
  });
#else
  return false;
#endif
}

// A loop's form, measured at its first call (two first calls at once may both measure).
bool form(std::atomic<int>& chosen, bool (*measure)()) {
  int now = chosen.load(std::memory_order_relaxed);
  if (now == kMeasure) {
    now = measure() ? kGathers : kOneAtATime;
    chosen.store(now, std::memory_order_relaxed);
  }
  return now == kGathers;
}

}  // namespace

// gate and up [rows, width] bf16, row r at gate + r * gate_stride (in elements), each row
// contiguous; out [rows, width] bf16 and contiguous. Returns 0 (it refuses no shape; the
// return is silu_mul_fp32's, so that decode_layers.h calls either alike).
extern "C" int silu_mul_bf16(const uint16_t* gate, int64_t gate_stride, const uint16_t* up,
                             int64_t up_stride, int64_t rows, int64_t width, uint16_t* out,
                             int threads) {
  const uint32_t* silu = silu_table().data();
  [[maybe_unused]] const bool gathers = form(g_forward, measure_forward);
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate + r * gate_stride;
    const uint16_t* u = up + r * up_stride;
    uint16_t* o = out + r * width;
#ifdef SILU_MUL_AVX512
    if (gathers) {
      silu_mul_row(g, u, width, o, silu);
      continue;
    }
#endif
    scalar_row(g, u, width, o, silu);
  }
  return 0;
}

// The backward of silu_mul_bf16 as eager autograd makes it from the saved silu(gate) (a
// bf16 tensor) and up: grad_up = grad * silu(gate) and grad_silu = grad * up, each in fp32
// rounded to bf16, then silu_backward's grad_silu * sigmoid * (1 + gate * (1 - sigmoid)) in
// fp32 rounded to bf16 as grad_gate. Eager makes these in four passes over [rows, width] and
// keeps silu(gate) from the forward pass; here one pass reads grad, gate and up once, looks
// silu and its slope up by gate's bits, and writes both gradients. grad, gate, up: rows
// through their strides, each row contiguous; grad_gate and grad_up [rows, width] contiguous.
extern "C" void silu_mul_backward_bf16(const uint16_t* grad, int64_t grad_stride,
                                       const uint16_t* gate, int64_t gate_stride,
                                       const uint16_t* up, int64_t up_stride, int64_t rows,
                                       int64_t width, uint16_t* grad_gate, uint16_t* grad_up,
                                       int threads) {
  const uint32_t* silu = silu_table().data();
  const SiluSlope* slope = slope_table().data();
  [[maybe_unused]] const bool gathers = form(g_backward, measure_backward);
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* d = grad + r * grad_stride;
    const uint16_t* g = gate + r * gate_stride;
    const uint16_t* u = up + r * up_stride;
    uint16_t* dg = grad_gate + r * width;
    uint16_t* du = grad_up + r * width;
#ifdef SILU_MUL_AVX512
    if (gathers) {
      silu_mul_backward_row(d, g, u, width, dg, du, silu, slope);
      continue;
    }
#endif
    scalar_backward_row(d, g, u, width, dg, du, silu, slope);
  }
}

// Sets both loops' form: 1 gathers, 0 one element at a time, -1 measured at their next calls
// (the default). Returns whether the forward now takes the gathers (measured first for -1;
// 0 on a CPU without AVX-512).
extern "C" int silu_mul_gathers(int allowed) {
#ifdef SILU_MUL_AVX512
  const int set = allowed < 0 ? kMeasure : allowed != 0 ? kGathers : kOneAtATime;
#else
  (void)allowed;
  const int set = kOneAtATime;  // (no gathers to take)
#endif
  g_forward = set;
  g_backward = set;
  return form(g_forward, measure_forward) ? 1 : 0;
}
