// A decode step's input with its LoRA columns, [x | x @ A.T] in bf16, for x86-64 CPUs with
// AVX512-BF16 (native_columns.py builds and loads it). A lone adapter's sibling linears run as
// one matmul over [x | x @ A.T] (fused.py); at 128 rows the small product x @ A.T (A: the
// adapter's stacked down-projections, 32-96 rows) and the concatenation took oneDNN and torch
// 36-99 us a layer each, about twice what their arithmetic needs, 120 of them a step.
//
// A comes in "pairs" layout, [ceil(K / 2), Rp, 2] with Rp = R rounded up to 16 (zeros past
// R, and past K when K is odd): one 64-byte load holds 16 outputs' weights for two inputs,
// which vdpbf16ps multiplies by the two inputs broadcast to every lane and sums in fp32 into
// those 16 outputs; no sum across lanes is ever needed. Blocks of 6 rows x 64 outputs (12 x
// 32, 24 x 16) keep 24 fp32 accumulators in registers; each output is rounded to bf16 once
// (nearest even), as oneDNN's bf16 matmul does. Rows run in parallel under OpenMP; a row's values depend on
// that row alone.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../vec512.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "../amx.h"
#define LORA_COLUMNS_AMX 1
#endif

namespace {

constexpr int kAccumulators = 24;  // fp32 vectors held per block (of 32 registers)
constexpr int kVectors = 4;  // at most, 16 outputs each: 6 rows a block; 2 vectors, 12 rows

// Rows [0, MB) of a block times outputs [n0, n0 + 16 J) of A, written from column `n0`
// of each row's LoRA part (`low`); `valid` of those outputs exist (R - n0).
template <int MB, int J>
void block(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* pairs, int64_t rp,
           int64_t n0, uint16_t* low, int64_t ldo, int64_t valid) {
  __m512 acc[MB][J];  // (loops over MB and J unrolled: the sums stay in registers)
#pragma GCC unroll 24
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = k / 2;
  for (int64_t p = 0; p < full; ++p) {
    __m512bh b[J];
    for (int j = 0; j < J; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(pairs + (p * rp + n0 + 16 * j) * 2);
#pragma GCC unroll 24
    for (int i = 0; i < MB; ++i) {
      int32_t two;
      std::memcpy(&two, x + i * ldx + 2 * p, sizeof(two));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
  if (k % 2) {  // the last input alone, paired with a zero (A's pad is zero too)
    __m512bh b[J];
    for (int j = 0; j < J; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(pairs + (full * rp + n0 + 16 * j) * 2);
#pragma GCC unroll 24
    for (int i = 0; i < MB; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int32_t(x[i * ldx + k - 1]));
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < J; ++j) {
    const int64_t left = valid - 16 * j;
    const __mmask16 keep = vec512::lanes(left);
#pragma GCC unroll 24
    for (int i = 0; i < MB; ++i) {
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(acc[i][j]);
      _mm256_mask_storeu_epi16(low + i * ldo + n0 + 16 * j, keep, rounded);
    }
  }
}

using Block = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                       uint16_t*, int64_t, int64_t);

// block<m, J> for m = 1 .. 24 / J: the rows of a block fill 24 accumulators whatever J.
template <int J, int... M>
constexpr std::array<Block, sizeof...(M)> blocks_of(std::integer_sequence<int, M...>) {
  return {block<M + 1, J>...};
}
template <int J>
constexpr auto kBlocks = blocks_of<J>(std::make_integer_sequence<int, kAccumulators / J>{});

Block pick(int64_t rows, int vectors) {
  switch (vectors) {
    case 1: return kBlocks<1>[rows - 1];
    case 2: return kBlocks<2>[rows - 1];
    case 3: return kBlocks<3>[rows - 1];
    default: return kBlocks<4>[rows - 1];
  }
}

}  // namespace

#ifdef LORA_COLUMNS_AMX
// On CPUs with AMX the product runs on the tile unit: a 16-row block of x times 16 outputs
// of A is one tile operation per 32 inputs, where the AVX-512 blocks above take 16 vdpbf16ps
// per 32 inputs per row (at 128 rows of SmolLM2's four groups a layer, the AVX-512 blocks
// took 264 us on a Sapphire Rapids guest, oneDNN's packed matmul and a concatenation 183). A's
// pairs layout is the tile unit's own layout of a matmul's right side (two inputs of 16
// outputs per 64-byte row). Each output is its fp32 sum rounded once, as above; the order of
// the sum is the same (pair by pair); a row's values depend on that row alone.
namespace {

constexpr int kTileRows = 16, kTileK = 32, kTileC = 4;  // C tiles 0-3, A tile 4, B tile 5

void configure(int m) {
  amx::TileConfig config;
  for (int t = 0; t < kTileC; ++t) config.rows[t] = m, config.colsb[t] = 64;
  config.rows[4] = m, config.colsb[4] = 64;  // x: m rows of 32 inputs
  config.rows[5] = 16, config.colsb[5] = 64;  // A: 16 pairs of 16 outputs
  _tile_loadconfig(&config);
}

// Rows [0, m) of a block (the tiles configured for m) times outputs [n0, n0 + 16 J) of A,
// rounded into low from column n0; `valid` of those outputs exist. k: a multiple of 32.
template <int J>
void tile_block(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* pairs, int64_t rp,
                int64_t n0, uint16_t* low, int64_t ldo, int64_t valid, int m) {
  if constexpr (J >= 1) _tile_zero(0);
  if constexpr (J >= 2) _tile_zero(1);
  if constexpr (J >= 3) _tile_zero(2);
  if constexpr (J >= 4) _tile_zero(3);
  const int64_t b_stride = rp * 2 * sizeof(uint16_t);
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    _tile_loadd(4, x + k0, ldx * sizeof(uint16_t));
    const uint16_t* b = pairs + ((k0 / 2) * rp + n0) * 2;
    _tile_loadd(5, b, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (J >= 2) {
      _tile_loadd(5, b + 32, b_stride);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (J >= 3) {
      _tile_loadd(5, b + 64, b_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (J >= 4) {
      _tile_loadd(5, b + 96, b_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float sums[kTileC][kTileRows][16];
  _tile_stored(0, sums[0], 64);
  if constexpr (J >= 2) _tile_stored(1, sums[1], 64);
  if constexpr (J >= 3) _tile_stored(2, sums[2], 64);
  if constexpr (J >= 4) _tile_stored(3, sums[3], 64);
  for (int j = 0; j < J; ++j) {
    const int64_t left = valid - 16 * j;
    if (left <= 0) break;
    const __mmask16 keep = vec512::lanes(left);
    for (int i = 0; i < m; ++i) {
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums[j][i]));
      _mm256_mask_storeu_epi16(low + i * ldo + n0 + 16 * j, keep, rounded);
    }
  }
}

// The rows [begin, end) of `columns` on the tile unit.
void tile_rows(const uint16_t* x, int64_t ldx, const uint16_t* pairs, int64_t begin,
               int64_t end, int64_t k, int64_t r, int64_t rp, uint16_t* low, int64_t ldo) {
  int configured = 0;
  for (int64_t i0 = begin; i0 < end; i0 += kTileRows) {
    const int m = end - i0 < kTileRows ? int(end - i0) : kTileRows;
    if (m != configured) configure(m), configured = m;
    for (int64_t n0 = 0; n0 < rp; n0 += 16 * kTileC) {
      const int vectors = (rp - n0) / 16 < kTileC ? int((rp - n0) / 16) : kTileC;
      const uint16_t* xs = x + i0 * ldx;
      uint16_t* out = low + i0 * ldo;
      switch (vectors) {
        case 1: tile_block<1>(xs, ldx, k, pairs, rp, n0, out, ldo, r - n0, m); break;
        case 2: tile_block<2>(xs, ldx, k, pairs, rp, n0, out, ldo, r - n0, m); break;
        case 3: tile_block<3>(xs, ldx, k, pairs, rp, n0, out, ldo, r - n0, m); break;
        default: tile_block<4>(xs, ldx, k, pairs, rp, n0, out, ldo, r - n0, m); break;
      }
    }
  }
  if (configured) _tile_release();
}

}  // namespace
#endif

namespace {

// Whether `columns` runs its product on the tile unit: AMX built in, granted, allowed (the
// tests run both forms on one CPU), and an input size of whole tiles (32 inputs).
std::atomic<bool> g_tiles_allowed{true};

bool on_tiles(int64_t k) {
#ifdef LORA_COLUMNS_AMX
  return g_tiles_allowed && k % kTileK == 0 && amx::permitted();
#else
  (void)k;
  return false;
#endif
}

// One thread's share of a call's rows: an even share of the rows (a decode step's 128: 64 and
// 64; tasks of whole AVX-512 blocks left one thread 72 rows to 56), of whole 16-row blocks on
// the tile unit. Returns [begin, end).
std::pair<int64_t, int64_t> share(int64_t rows, bool tiles, int64_t part, int64_t parts) {
  if (!tiles) return {rows * part / parts, rows * (part + 1) / parts};
#ifdef LORA_COLUMNS_AMX
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows;
  return {std::min(rows, blocks * part / parts * kTileRows),
          std::min(rows, blocks * (part + 1) / parts * kTileRows)};
#else
  return {rows, rows};
#endif
}

// Rows [begin, end) of x @ A.T rounded to bf16 into low (row stride ldo).
void product(const uint16_t* x, int64_t ldx, const uint16_t* pairs, int64_t begin, int64_t end,
             int64_t k, int64_t r, int64_t rp, uint16_t* low, int64_t ldo, bool tiles) {
#ifdef LORA_COLUMNS_AMX
  if (tiles) return tile_rows(x, ldx, pairs, begin, end, k, r, rp, low, ldo);
#else
  (void)tiles;
#endif
  for (int64_t n0 = 0; n0 < rp; n0 += 16 * kVectors) {
    const int vectors = (rp - n0) / 16 < kVectors ? int((rp - n0) / 16) : kVectors;
    const int64_t step = kAccumulators / vectors;
    for (int64_t i0 = begin; i0 < end; i0 += step) {
      const int64_t m = end - i0 < step ? end - i0 : step;
      pick(m, vectors)(x + i0 * ldx, ldx, k, pairs, rp, n0, low + i0 * ldo, ldo, r - n0);
    }
  }
}

// x @ A.T rounded to bf16 into low [rows, r] (row stride ldo), with x copied first into
// copy [rows, k] (row stride ldo too) unless copy is null.
int columns(const uint16_t* x, int64_t ldx, const uint16_t* pairs, int64_t rows, int64_t k,
            int64_t r, int64_t rp, uint16_t* copy, uint16_t* low, int64_t ldo, int threads) {
  if (rows < 0 || k <= 0 || r <= 0 || rp % 16 || rp < r || ldx < k || ldo < r) return 1;
  const bool tiles = on_tiles(k);
  #pragma omp parallel num_threads(threads) if (rows * (k + r) >= 16384)
  {
    const auto [begin, end] = share(rows, tiles, omp_get_thread_num(), omp_get_num_threads());
    if (copy != nullptr)
      for (int64_t i = begin; i < end; ++i)
        std::memcpy(copy + i * ldo, x + i * ldx, k * sizeof(uint16_t));
    product(x, ldx, pairs, begin, end, k, r, rp, low, ldo, tiles);
  }
  return 0;
}

// Rows [0, MB) of a block: y[:, 16 J outputs from y] += low[:, col .. col + 2 pairs) @ up,
// where up holds J vectors' weights, `pairs` pairs each ([J][pairs][16][2], vector-major);
// the products summed in fp32, then y's own value, rounded to bf16 once.
template <int MB, int J>
void expand(const uint16_t* low, int64_t ldl, int64_t pairs, const uint16_t* up, uint16_t* y,
            int64_t ldy) {
  __m512 acc[MB][J];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[J];
    for (int j = 0; j < J; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(up + ((j * pairs + p) * 16) * 2);
#pragma GCC unroll 24
    for (int i = 0; i < MB; ++i) {
      int32_t two;
      std::memcpy(&two, low + i * ldl + 2 * p, sizeof(two));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < J; ++j) {
      uint16_t* at = y + i * ldy + 16 * j;
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)at));
      const __m512 sum = _mm512_add_ps(acc[i][j], _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      _mm256_storeu_si256((__m256i*)at, (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

using Expand = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*, int64_t);

template <int J, int... M>
constexpr std::array<Expand, sizeof...(M)> expands_of(std::integer_sequence<int, M...>) {
  return {expand<M + 1, J>...};
}
template <int J>
constexpr auto kExpands = expands_of<J>(std::make_integer_sequence<int, kAccumulators / J>{});

Expand pick_expand(int64_t rows, int vectors) {
  switch (vectors) {
    case 1: return kExpands<1>[rows - 1];
    case 2: return kExpands<2>[rows - 1];
    case 3: return kExpands<3>[rows - 1];
    default: return kExpands<4>[rows - 1];
  }
}

}  // namespace

// x [rows, k] (row stride ldx, elements), pairs [ceil(k / 2), rp, 2], out [rows, k + r]
// contiguous: out[:, :k] = x, out[:, k:] = x @ A.T rounded to bf16. rp: r rounded up to 16.
extern "C" int lora_columns_bf16(const uint16_t* x, int64_t ldx, const uint16_t* pairs,
                                 int64_t rows, int64_t k, int64_t r, int64_t rp, uint16_t* out,
                                 int threads) {
  return columns(x, ldx, pairs, rows, k, r, rp, out, out + k, k + r, threads);
}

// The LoRA part alone: low [rows, r] (row stride ldo) = x @ A.T rounded to bf16, the same
// values as lora_columns_bf16's last r columns (a step of several keys adds each key's
// product to its rows' part of the shared base output, lora/segments.py).
extern "C" int lora_low_bf16(const uint16_t* x, int64_t ldx, const uint16_t* pairs,
                             int64_t rows, int64_t k, int64_t r, int64_t rp, uint16_t* low,
                             int64_t ldo, int threads) {
  return columns(x, ldx, pairs, rows, k, r, rp, nullptr, low, ldo, threads);
}

// One key's LoRA delta of a sibling group added to its rows of the group's base output, in
// one call (lora/segments.py): low = x @ A.T rounded to bf16, as lora_low_bf16 makes it (A:
// the group's stacked down-projections, pairs [ceil(k / 2), rp, 2], r outputs), then
// y[:, 16 v .. 16 v + 16) += low[:, col[v] .. col[v] + rank) @ up[v] for each output vector v
// with col[v] >= 0: each member's outputs read its own rank columns of low, no zero blocks.
// up [vectors, ceil(rank / 2), 16, 2]: vector v's weights (scale * B of its member, zeros
// past rank), pair by pair. Each output summed in fp32, y's value added last, rounded once.
// y [rows, 16 vectors] (row stride ldy). Rows, then output vectors, run in parallel; a row's
// values depend on that row alone.
extern "C" int lora_delta_bf16(const uint16_t* x, int64_t ldx, const uint16_t* pairs,
                               int64_t rows, int64_t k, int64_t r, int64_t rp,
                               const uint16_t* up, const int64_t* col, int64_t rank,
                               int64_t vectors, uint16_t* y, int64_t ldy, int threads) {
  if (rows < 0 || k <= 0 || r <= 0 || rp % 16 || rp < r || ldx < k) return 1;
  if (rank <= 0 || vectors <= 0 || ldy < 16 * vectors) return 1;
  for (int64_t v = 0; v < vectors; ++v)
    if (col[v] >= 0 && col[v] + rank > r) return 1;
  const int64_t half = (rank + 1) / 2;
  // low's rows: rp columns and 16 of zeros, so that an odd rank's last pair reads a zero
  const int64_t ldl = rp + 16;
  std::vector<uint16_t> low(static_cast<size_t>(rows * ldl));  // (zeros: past r never written)
  const bool tiles = on_tiles(k);
  #pragma omp parallel num_threads(threads) if (rows * (k + 16 * vectors) >= 16384)
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    // low, each thread its share of the rows, as lora_low_bf16 makes it
    const auto [begin, end] = share(rows, tiles, part, parts);
    product(x, ldx, pairs, begin, end, k, r, rp, low.data(), ldl, tiles);
    #pragma omp barrier
    // the sums into y, each thread an even share of the output vectors for every row: each
    // vector's weights are read once (a head's 49,152 outputs: 3 MB a key), y's parts once
    const int64_t first = vectors * part / parts, last = vectors * (part + 1) / parts;
    for (int64_t v0 = first; v0 < last;) {  // runs of up to 4 vectors reading the same columns
      if (col[v0] < 0) {
        ++v0;
        continue;
      }
      int vecs = 1;
      while (vecs < kVectors && v0 + vecs < last && col[v0 + vecs] == col[v0]) ++vecs;
      const int64_t step = kAccumulators / vecs;
      for (int64_t i0 = 0; i0 < rows; i0 += step) {
        const int64_t m = rows - i0 < step ? rows - i0 : step;
        pick_expand(m, vecs)(low.data() + i0 * ldl + col[v0], ldl, half, up + v0 * half * 32,
                             y + i0 * ldy + 16 * v0, ldy);
      }
      v0 += vecs;
    }
  }
  return 0;
}

// Whether the product runs on the tile unit where it can (1, the default) or on the AVX-512
// blocks (0): both forms on one CPU for the tests and bench/cpu_kernels.py. Returns whether
// this library's calls would now take the tile unit for an input size of 32 x n.
extern "C" int lora_columns_tiles(int allowed) {
  g_tiles_allowed = allowed != 0;
  return on_tiles(32) ? 1 : 0;
}
