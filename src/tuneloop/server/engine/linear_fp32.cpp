// A frozen linear layer's matmul, y = x @ W.T + b in fp32, for x86-64 CPUs with AVX2 and FMA
// (native_linear.py builds, loads and picks it), built with AVX-512 tiles where the CPU has
// AVX-512. There a sampling step's fp32 weights were packed for oneDNN's fp32 kernel, which on
// a Zen 3 EPYC ran a 128-row step's linears at 75 % of the measured fp32 peak and read a
// one-row step's weights at ~25 GB/s of the 34 the cores read, and on an AVX-512 Zen 4 EPYC
// read them at ~27 of 51 GB/s; this kernel's tiles run at the FMA units' rate on one core and
// its blocks stream the weights once per call (docs/benchmarks.md, bench/native_linear.py).
//
// W comes in "blocks", [ceil(N / 16), K, 16] (zeros past N): a block's 16 outputs' weights for
// input p are one 64-byte line, a block's weights one stream. With AVX2 a tile of up to 6 rows
// keeps 6 x 2 vectors of 8 fp32 sums in registers for the whole K; with AVX-512 a tile of up to
// 8 rows by three blocks keeps 8 x 3 vectors of 16. Each row's input is broadcast to the
// lanes, one fused multiply-add a row and vector for each input, in input order from the bias
// (or zero): every output's sum is the same sequence of operations whatever the row count, the
// tile, the thread or the vector width, and depends on its own row alone. The threads split
// the blocks (threes of blocks with AVX-512) evenly; each thread runs every row over its
// blocks, so a block is read from memory once a call.
#if !defined(__AVX2__) || !defined(__FMA__)
#error "this kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 16;  // outputs a block: two vectors of 8 (AVX2) or one of 16

#if defined(__AVX512F__)
// A tile: 8 rows by three blocks, 24 accumulators, three weight vectors and a broadcast. Each
// row's broadcast then serves three FMAs: 12 rows by two blocks (the same registers) ran
// 1.04-1.32x slower on a Zen 4 EPYC, its broadcasts competing with the FMAs, and 6 by four
// split a layer's few blocks unevenly between the threads.
constexpr int kRows = 8;
constexpr int64_t kUnit = 3;  // blocks a tile (the last tile of a weight may have fewer)

// Rows [0, MB) of x times NB blocks (1 to 3, `w` the first, `stride` apart): `valid` of the
// last block's outputs written (it may hold fewer than 16).
template <int MB, int NB>
void tile(const float* x, int64_t ldx, int64_t k, const float* w, int64_t stride,
          const float* bias, float* y, int64_t ldy, int64_t valid) {
  __m512 acc[MB][NB];
#pragma GCC unroll 3
  for (int j = 0; j < NB; ++j) {
    const __m512 start = bias != nullptr ? _mm512_loadu_ps(bias + j * kBlock) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) acc[i][j] = start;
  }
  for (int64_t p = 0; p < k; ++p) {
    __m512 wv[NB];
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * stride + p * kBlock);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + p]);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(a, wv[j], acc[i][j]);
    }
  }
  const __mmask16 last = valid == kBlock ? __mmask16(0xffff) : __mmask16((1u << valid) - 1u);
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    float* row = y + i * ldy;
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) {
      const __mmask16 mask = j == NB - 1 ? last : __mmask16(0xffff);
      _mm512_mask_storeu_ps(row + j * kBlock, mask, acc[i][j]);
    }
  }
}

template <int NB>
void rows_of(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t stride,
             const float* bias, float* y, int64_t ldy, int64_t valid) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    tile<kRows, NB>(x + r * ldx, ldx, k, w, stride, bias, y + r * ldy, ldy, valid);
  }
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: tile<1, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 2: tile<2, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 3: tile<3, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 4: tile<4, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 5: tile<5, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 6: tile<6, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    case 7: tile<7, NB>(xr, ldx, k, w, stride, bias, yr, ldy, valid); break;
    default: break;
  }
}

// Every row of x times the blocks [first, first + count) (count 1 to 3).
void block_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w,
                int64_t count, const float* bias, float* y, int64_t ldy, int64_t valid) {
  const int64_t stride = k * kBlock;
  if (count == 3) {
    rows_of<3>(x, ldx, rows, k, w, stride, bias, y, ldy, valid);
  } else if (count == 2) {
    rows_of<2>(x, ldx, rows, k, w, stride, bias, y, ldy, valid);
  } else {
    rows_of<1>(x, ldx, rows, k, w, stride, bias, y, ldy, valid);
  }
}
#else
constexpr int kRows = 6;        // rows a tile: 12 accumulators, two weight vectors, a broadcast
constexpr int64_t kUnit = 1;    // blocks a tile

// Rows [0, MB) of x times one block: `valid` of its outputs written (the last block's may be
// fewer than 16). (Every loop over the rows is unrolled: with a constant index the sums stay
// in registers, which GCC otherwise spills to the stack at every input.)
template <int MB>
void tile(const float* x, int64_t ldx, int64_t k, const float* w, const float* bias, float* y,
          int64_t ldy, int64_t valid) {
  __m256 low[MB], high[MB];
  const __m256 start_low = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 start_high = bias != nullptr ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) low[i] = start_low, high[i] = start_high;
  for (int64_t p = 0; p < k; ++p) {
    const __m256 w_low = _mm256_loadu_ps(w + p * kBlock);
    const __m256 w_high = _mm256_loadu_ps(w + p * kBlock + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + p);
      low[i] = _mm256_fmadd_ps(a, w_low, low[i]);
      high[i] = _mm256_fmadd_ps(a, w_high, high[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    float* row = y + i * ldy;
    if (valid == kBlock) {
      _mm256_storeu_ps(row, low[i]);
      _mm256_storeu_ps(row + 8, high[i]);
    } else {
      alignas(32) float sums[kBlock];
      _mm256_store_ps(sums, low[i]);
      _mm256_store_ps(sums + 8, high[i]);
      std::copy(sums, sums + valid, row);
    }
  }
}

// Every row of x times one block (count 1), in tiles of kRows and one shorter tile.
void block_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w,
                int64_t /*count*/, const float* bias, float* y, int64_t ldy, int64_t valid) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    tile<kRows>(x + r * ldx, ldx, k, w, bias, y + r * ldy, ldy, valid);
  }
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: tile<1>(xr, ldx, k, w, bias, yr, ldy, valid); break;
    case 2: tile<2>(xr, ldx, k, w, bias, yr, ldy, valid); break;
    case 3: tile<3>(xr, ldx, k, w, bias, yr, ldy, valid); break;
    case 4: tile<4>(xr, ldx, k, w, bias, yr, ldy, valid); break;
    case 5: tile<5>(xr, ldx, k, w, bias, yr, ldy, valid); break;
    default: break;
  }
}

#endif

}  // namespace

// y [rows, n] (row stride ldy) = x [rows, k] (row stride ldx) @ W.T (+ bias [ceil(n / 16) x 16],
// or null), W in blocks [ceil(n / 16), k, 16]. Returns 0, or 1 where the shapes are refused.
// `spans` is linear_bf16's (the same signature, so callers hold either); fp32 weights hold no
// zero blocks to skip (an fp32 lone copy merges its adapter), so it must be null.
extern "C" int linear_fp32(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w,
                           const float* bias, int64_t n, float* y, int64_t ldy, int threads,
                           const int32_t* spans) {
  if (spans != nullptr) return 1;
  if (rows < 0 || k < 1 || n < 1 || (rows > 1 && ldx < k) || (rows > 1 && ldy < n)) return 1;
  if (rows == 0) return 0;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t units = (blocks + kUnit - 1) / kUnit;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u * kUnit;
    const int64_t count = std::min(kUnit, blocks - b);
    const int64_t valid = std::min(kBlock, n - (b + count - 1) * kBlock);  // the last block's
    block_rows(x, ldx, rows, k, w + b * k * kBlock, count,
               bias != nullptr ? bias + b * kBlock : nullptr, y + b * kBlock, ldy, valid);
  }
  return 0;
}
