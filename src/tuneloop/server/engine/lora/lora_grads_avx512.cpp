// The LoRA factors' gradients of a training step's backward pass, bf16, for x86-64 CPUs with
// AVX512-BF16 (native_grads.py builds and loads it): C = S^T @ G, a sum over the step's rows,
// where S [K, M] is narrow (a layer's low-rank activations x @ A.T or their gradient, M = the
// rank or a sibling group's ranks) and G [K, N] wide (the layer's input or its output's
// gradient): dA = dlow^T @ x and dB^T = low^T @ dy. oneDNN makes these products of a long sum
// and a narrow side at a fifth to two thirds of the bf16 peak (SmolLM2-135M's 736-row training
// parts on a Zen 5 EPYC: 0.18-0.31 TFLOP/s a thread against 0.47 for the layers' own
// matmuls; about a twentieth of a training step).
//
// Here S is rearranged once into pairs of rows, one 32-bit word per (row pair, column): the
// B side of `vdpbf16ps`, broadcast. G is read where it lies, two rows at a time over a strip of
// 32 columns; unpacking the two rows interleaves them into the pairs the instruction takes, so
// G is never copied. Each C entry's products are exact in fp32 and summed in fp32, pair after
// pair in row order, then rounded to bf16 once (to nearest even, as torch's conversion): the
// numerics of oneDNN's kernel, in another order of the sums. A register block holds up to 12
// rows of C by the strip's 32 columns; the rows run in chunks of 256 so that a strip's rows of
// G stay in L1 while every block of C passes over them, the partial sums kept in a small fp32
// buffer between chunks. A strip's rows of G lie a row stride apart, which the hardware
// prefetcher followed poorly: the first block's pass asks for them 16 pairs ahead (operands
// out of cache at 736 rows on a Zen 5 EPYC: 1.26-2.07x torch's product, 1.07-1.71x without;
// reading G in memory order instead, row chunks outermost, 0.67-1.36x). Strips run in
// parallel under OpenMP; each entry's sum runs in one order whatever the number of threads.
//
// Unpacking pairs the columns within 128-bit lanes, so a block's two vectors hold the strip's
// columns in the order (0-3, 8-11, 16-19, 24-27) and (4-7, 12-15, 20-23, 28-31); the stores put
// them back in order.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "this kernel needs AVX512F, AVX512BW and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../vec512.h"

namespace {

constexpr int kStrip = 32;        // columns of G (and C) per strip
constexpr int kBlock = 12;        // rows of C per register block: 24 accumulators
constexpr int64_t kAhead = 16;    // row pairs a block's first pass asks for ahead
constexpr int64_t kChunk = 128;   // row pairs of G per pass of the blocks over a strip

// The first min(width, 32) columns of a strip.
inline __mmask32 strip_lanes(int64_t width) {
  return width >= kStrip ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
}

// words [pairs, m]: S[2p][j] in the low half, S[2p + 1][j] (zero past the last row) in the high.
void pair_rows(const uint16_t* s, int64_t lds, int64_t k, int64_t m, uint32_t* words) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* a = s + 2 * p * lds;
    uint32_t* w = words + p * m;
    if (2 * p + 1 < k) {
      const uint16_t* b = a + lds;
      for (int64_t j = 0; j < m; ++j) w[j] = uint32_t(a[j]) | (uint32_t(b[j]) << 16);
    } else {
      for (int64_t j = 0; j < m; ++j) w[j] = uint32_t(a[j]);
    }
  }
}

// Rows [m0, m0 + B) of a strip's partial sums (acc [m, 32], lanes in the unpacked order) plus
// row pairs [p0, p1) of G's strip at g (columns past the strip's width masked to zero).
template <int B>
void block(const uint32_t* words, int64_t m, int64_t m0, const uint16_t* g, int64_t ldg,
           int64_t k, int64_t p0, int64_t p1, __mmask32 mask, float* acc) {
  __m512 c[B][2];
#pragma GCC unroll 12
  for (int b = 0; b < B; ++b) {
    c[b][0] = _mm512_loadu_ps(acc + (m0 + b) * kStrip);
    c[b][1] = _mm512_loadu_ps(acc + (m0 + b) * kStrip + 16);
  }
  const int64_t full = std::min(p1, k / 2);  // pairs with both rows inside G
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* r0 = g + 2 * p * ldg;
    if (m0 == 0 && 2 * (p + kAhead) + 1 < k) {  // (the pass that reads the strip from memory)
      _mm_prefetch(reinterpret_cast<const char*>(r0 + 2 * kAhead * ldg), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r0 + (2 * kAhead + 1) * ldg), _MM_HINT_T0);
    }
    const __m512i x0 = _mm512_maskz_loadu_epi16(mask, r0);
    const __m512i x1 =
        p < full ? _mm512_maskz_loadu_epi16(mask, r0 + ldg) : _mm512_setzero_si512();
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    const uint32_t* w = words + p * m + m0;
#pragma GCC unroll 12
    for (int b = 0; b < B; ++b) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(int(w[b]));
      c[b][0] = _mm512_dpbf16_ps(c[b][0], lo, s);
      c[b][1] = _mm512_dpbf16_ps(c[b][1], hi, s);
    }
  }
#pragma GCC unroll 12
  for (int b = 0; b < B; ++b) {
    _mm512_storeu_ps(acc + (m0 + b) * kStrip, c[b][0]);
    _mm512_storeu_ps(acc + (m0 + b) * kStrip + 16, c[b][1]);
  }
}

using Block = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                       int64_t, int64_t, __mmask32, float*);

constexpr Block kBlocks[kBlock + 1] = {nullptr,   block<1>, block<2>,  block<3>, block<4>,
                                       block<5>,  block<6>, block<7>,  block<8>, block<9>,
                                       block<10>, block<11>, block<12>};

// A strip's C from its partial sums: row-major C [m, ldc] at column n0, or C^T [N, ldc] (row
// n0 + n holds column n0 + n of C).
void store(const float* acc, int64_t m, int64_t n0, int64_t width, uint16_t* c, int64_t ldc,
           bool transposed) {
  if (!transposed) {
    const __m512i first =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __mmask32 mask = strip_lanes(width);
    for (int64_t j = 0; j < m; ++j) {
      const __m512 lo = _mm512_loadu_ps(acc + j * kStrip);
      const __m512 hi = _mm512_loadu_ps(acc + j * kStrip + 16);
      const __m512 a = _mm512_permutex2var_ps(lo, first, hi);   // columns 0-15
      const __m512 b = _mm512_permutex2var_ps(lo, second, hi);  // columns 16-31
      const __m512i out = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      _mm512_mask_storeu_epi16(c + j * ldc + n0, mask, out);
    }
    return;
  }
  // C^T's rows: each a column of the strip, its m entries gathered 16 at a time
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t n = 0; n < width; ++n) {
    const int64_t q = n / 8, r = n % 8;
    const int lane = int(r < 4 ? 4 * q + r : 16 + 4 * q + (r - 4));
    uint16_t* row = c + (n0 + n) * ldc;
    for (int64_t j0 = 0; j0 < m; j0 += 16) {
      const __mmask16 live = vec512::lanes(m - j0);
      const __m512i rows_at = _mm512_add_epi32(iota, _mm512_set1_epi32(int(j0)));
      const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(rows_at, _mm512_set1_epi32(kStrip)),
                                          _mm512_set1_epi32(lane));
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, acc, 4);
      _mm256_mask_storeu_epi16(row + j0, live, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

void strips(const uint32_t* words, int64_t m, const uint16_t* g, int64_t ldg, int64_t k,
            int64_t n, int64_t first, int64_t last, uint16_t* c, int64_t ldc, bool transposed) {
  std::vector<float> acc(m * kStrip);
  const int64_t pairs = (k + 1) / 2;
  for (int64_t s = first; s < last; ++s) {
    const int64_t n0 = s * kStrip, width = std::min<int64_t>(kStrip, n - n0);
    const __mmask32 mask = strip_lanes(width);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p0 = 0; p0 < pairs; p0 += kChunk) {
      const int64_t p1 = std::min(pairs, p0 + kChunk);
      for (int64_t m0 = 0; m0 < m; m0 += kBlock)
        kBlocks[std::min<int64_t>(kBlock, m - m0)](words, m, m0, g + n0, ldg, k, p0, p1, mask,
                                                   acc.data());
    }
    store(acc.data(), m, n0, width, c, ldc, transposed);
  }
}

}  // namespace

// C [m, n] (row stride ldc) = S^T @ G for S [k, m] (row stride lds) and G [k, n] (row stride
// ldg), bf16, every entry summed in fp32 and rounded once; with `transposed`, C^T [n, m] (row
// stride ldc) instead. Features contiguous in every operand. 0, or 1 for shapes it does not
// take (m or n not positive, k negative, a row stride shorter than its row).
extern "C" int lora_tn_bf16(const uint16_t* s, int64_t lds, const uint16_t* g, int64_t ldg,
                            int64_t k, int64_t m, int64_t n, uint16_t* c, int64_t ldc,
                            int transposed, int threads) {
  if (m <= 0 || n <= 0 || k < 0 || (k > 1 && (lds < m || ldg < n))) return 1;
  if (ldc < (transposed ? m : n)) return 1;
  std::vector<uint32_t> words(((k + 1) / 2) * m);
  pair_rows(s, lds, k, m, words.data());
  const int64_t count = (n + kStrip - 1) / kStrip;
  const int team = int(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  if (team == 1) {
    strips(words.data(), m, g, ldg, k, n, 0, count, c, ldc, transposed != 0);
    return 0;
  }
#pragma omp parallel num_threads(team)
  {
    const int64_t t = omp_get_thread_num(), size = omp_get_num_threads();
    strips(words.data(), m, g, ldg, k, n, count * t / size, count * (t + 1) / size, c, ldc,
           transposed != 0);
  }
  return 0;
}
