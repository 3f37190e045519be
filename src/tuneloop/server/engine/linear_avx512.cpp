// A frozen linear layer's matmul, y = x @ W.T + b in bf16, for x86-64 CPUs with AVX512-BF16
// and no AMX (native_linear.py builds, loads and picks it). A decode step's weights are read
// whole every step: at a few rows the step is the weights' read, and oneDNN's bf16 kernel on
// its packed layout read them at 21-24 GB/s on an AVX-512-BF16 EPYC whose cores read 37 GB/s;
// this kernel read them at 28-31 GB/s there, and kept up with oneDNN at 32 and 128 rows,
// where the step is the arithmetic (1.21x and 1.04x; docs/benchmarks.md).
//
// W comes in "blocks", [ceil(N / 64), ceil(K / 2), 64, 2] (zeros past N and K): a block's 64
// outputs' weights for input pair p are one 256-byte run, and a block's weights one stream.
// vdpbf16ps multiplies 16 outputs' weights for two inputs by the two inputs broadcast to every
// lane and sums in fp32; rows x 4 vectors of accumulators stay in registers for the whole K.
// The sums start from the bias in fp32 and each output is rounded to bf16 once (nearest even). Work is split
// between the threads in (block, rows) units; a row's values depend on that row alone.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "vec512.h"

namespace {

constexpr int kRows = 6;  // rows a tile: 6 x 4 vectors = 24 fp32 accumulators of 32 registers
constexpr int64_t kChunk = 8 * kRows;  // rows a unit of work: units enough for two threads

// Rows [0, MB) of x times a block's 64 outputs, `valid` of them written (the last block's).
template <int MB>
void tile(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* w, const float* bias,
          uint16_t* y, int64_t ldy, int64_t valid) {
  __m512 acc[MB][4];
  for (int j = 0; j < 4; ++j) {  // (the sums start from the bias)
    const __m512 start = bias != nullptr ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) acc[i][j] = start;
  }
  const int64_t full = k / 2;
  for (int64_t p = 0; p < full; ++p) {
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + p * 128 + 32 * j);
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      int32_t two;
      std::memcpy(&two, x + i * ldx + 2 * p, sizeof(two));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
  if (k % 2) {  // the last input alone, paired with a zero (the weights' pad is zero too)
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + full * 128 + 32 * j);
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int32_t(x[i * ldx + k - 1]));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t left = valid - 16 * j;
    if (left <= 0) break;
    const __mmask16 keep = vec512::lanes(left);
    for (int i = 0; i < MB; ++i)
      _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
  }
}

using Tile = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*,
                      uint16_t*, int64_t, int64_t);

template <int... M>
constexpr std::array<Tile, sizeof...(M)> tiles_of(std::integer_sequence<int, M...>) {
  return {tile<M + 1>...};
}
constexpr auto kTiles = tiles_of(std::make_integer_sequence<int, kRows>{});

}  // namespace

// x [rows, k] (row stride ldx), w [ceil(n / 64), ceil(k / 2), 64, 2], bias: ceil(n / 64) * 64
// fp32 values or null; y [rows, n] (row stride ldy) = x @ W.T + bias, rounded to bf16.
extern "C" int linear_bf16(const uint16_t* x, int64_t ldx, int64_t rows, int64_t k,
                           const uint16_t* w, const float* bias, int64_t n, uint16_t* y,
                           int64_t ldy, int threads) {
  if (rows < 0 || k <= 0 || n <= 0 || ldx < k || ldy < n) return 1;
  if (rows == 0) return 0;
  const int64_t blocks = (n + 63) / 64, pairs = (k + 1) / 2;
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  const int64_t units = blocks * chunks;
  // (a unit's rows and a block's weights: consecutive units share a block, so a thread's
  // share of the units reads each block it touches once from memory)
  #pragma omp parallel for num_threads(threads) schedule(static) if (units > 1)
  for (int64_t unit = 0; unit < units; ++unit) {
    const int64_t block = unit / chunks, first = (unit % chunks) * kChunk;
    const int64_t last = first + kChunk < rows ? first + kChunk : rows;
    const uint16_t* wb = w + block * pairs * 128;
    const float* bb = bias != nullptr ? bias + block * 64 : nullptr;
    const int64_t valid = n - block * 64 < 64 ? n - block * 64 : 64;
    for (int64_t i0 = first; i0 < last; i0 += kRows) {
      const int64_t m = last - i0 < kRows ? last - i0 : kRows;
      kTiles[m - 1](x + i0 * ldx, ldx, k, wb, bb, y + i0 * ldy + block * 64, ldy, valid);
    }
  }
  return 0;
}
