// A frozen linear layer's matmul, y = x @ W.T + b in bf16, for x86-64 CPUs with AVX512-BF16
// (native_linear.py builds, loads and picks it). A decode step's weights are read whole every
// step: at a few rows the step is the weights' read, and oneDNN's bf16 kernel on its packed
// layout read them at 21-24 GB/s on an AVX-512-BF16 EPYC whose cores read 37 GB/s; this
// kernel read them at 28-31 GB/s there, and kept up with oneDNN at 32 and 128 rows, where the
// step is the arithmetic (1.21x and 1.04x; docs/benchmarks.md).
//
// W comes in "blocks", [ceil(N / 64), ceil(K / 2), 64, 2] (zeros past N and K): a block's 64
// outputs' weights for input pair p are one 256-byte run, and a block's weights one stream.
// vdpbf16ps multiplies 16 outputs' weights for two inputs by the two inputs broadcast to every
// lane and sums in fp32; rows x 4 vectors of accumulators stay in registers for the whole K.
// The sums start from the bias in fp32 and each output is rounded to bf16 once (nearest
// even). The threads split the (block, row) pairs evenly; a row's values depend on
// that row alone.
//
// On CPUs with AMX the same layout feeds the tile unit (below): 16 input pairs of a block's
// weights are four 16-output tiles at a 256-byte stride. A training pass's adapted layers take
// `linear_bf16_operands` (several operands, each with its own blocks: lora/native_summed.py),
// on the tile unit where the CPU has one and every operand is whole tile steps wide.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "vec512.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <atomic>
#include <vector>

#include "amx.h"
#define LINEAR_AMX 1
#endif

namespace {

constexpr int kRows = 6;  // rows a tile: 6 x 4 vectors = 24 fp32 accumulators of 32 registers
constexpr int64_t kAheadRows = 16;  // calls of more rows than this ask for weights ahead

// The next block's weights, asked for into L2 a cache line at a time while a block's tiles
// run (one line every fourth input pair of a tile), up to `stop`: a block's first tile
// otherwise waits on the block's read from memory.
struct Ahead {
  const char* at = nullptr;
  const char* stop = nullptr;
  void next() {
    if (at < stop) {
      _mm_prefetch(at, _MM_HINT_T1);
      at += 64;
    }
  }
};

// One operand of a call: x [rows, k] (row stride ld) and its weights, a block's at w + 128
// `stride` b (block b), [ceil(k / 2), 64, 2] of them; its inputs are the call's input pairs
// from `begin` on (linear_bf16_operands: the operands' inputs joined in order).
// (No default values: a tile's array of them is filled for its `count` operands only.)
struct Operand {
  const uint16_t* x;
  int64_t ld;
  const uint16_t* w;
  int64_t stride;
  int64_t begin;
};
constexpr int kOperands = 8;  // operands a call at most

// acc += rows [0, MB) of x times a block's weights w over input pairs [from, to), x and w
// indexed from pair `base` (x's pair p at x + 2 (p - base), its weights at w + 128 (p - base)).
template <int MB>
__attribute__((always_inline)) inline void products(__m512 (&acc)[MB][4], const uint16_t* x,
                                                    int64_t ldx, const uint16_t* w, int64_t base,
                                                    int64_t from, int64_t to, Ahead& ahead) {
  for (int64_t p = from; p < to; ++p) {
    if ((p & 3) == 0) ahead.next();
    const int64_t q = p - base;
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + q * 128 + 32 * j);
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      int32_t two;
      std::memcpy(&two, x + i * ldx + 2 * q, sizeof(two));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
}

// Rows [0, MB) of the operands (their rows and blocks at this tile's) times a block's 64
// outputs, `valid` of them written (the last block's), over the block's input pairs [span[0],
// span[1]) and [span[2], span[3]) in order (the entry point's `spans`); k counts the inputs
// of every operand, each but the last a whole number of pairs.
// `Many`: the form of several operands; one operand's form keeps a decode step's loop as it
// was (the general form ran a 128-row step's linears 0.99x, 1 row's 0.96x on a Zen 4 EPYC).
template <int MB, bool Many>
void tile(const Operand* ops, int count, int64_t k, const float* bias, uint16_t* y,
          int64_t ldy, int64_t valid, Ahead& ahead, const int32_t* span) {
  // Every loop over the sums is unrolled: with the first and last loops left rolled, GCC kept
  // `acc` in a stack array between the loops, cleared by a call to memset (no bias) and
  // loaded into registers each tile: 2.7 % of a 128-row decode step on a Zen 4 EPYC. In
  // registers throughout, a step's linears ran 1.03-1.05x at 128 rows and 1.02-1.03x at 32
  // (bench/linear_ab.py, docs/benchmarks.md).
  __m512 acc[MB][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // (the sums start from the bias)
    const __m512 start = bias != nullptr ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) acc[i][j] = start;
  }
  const int64_t full = k / 2;
#pragma GCC unroll 2
  for (int s = 0; s < 4; s += 2) {
    const int64_t from = span[s], to = std::min<int64_t>(span[s + 1], full);
    if constexpr (!Many) {
      products<MB>(acc, ops[0].x, ops[0].ld, ops[0].w, 0, from, to, ahead);
      continue;
    }
    for (int o = 0; o < count; ++o) {
      const int64_t begin = std::max(from, ops[o].begin);
      const int64_t end = std::min(to, o + 1 < count ? ops[o + 1].begin : full);
      products<MB>(acc, ops[o].x, ops[o].ld, ops[o].w, ops[o].begin, begin, end, ahead);
    }
  }
  if (k % 2 && span[3] > full) {  // the last input alone, paired with a zero (the pad's too)
    const Operand& last = ops[Many ? count - 1 : 0];
    const uint16_t* wl = last.w + (full - last.begin) * 128;
    const uint16_t* xl = last.x + (k - 1 - 2 * last.begin);
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(wl + 32 * j);
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int32_t(xl[i * last.ld]));
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, b[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int64_t left = valid - 16 * j;
    if (left <= 0) continue;
    const __mmask16 keep = vec512::lanes(left);
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i)
      _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
  }
}

using Tile = void (*)(const Operand*, int, int64_t, const float*, uint16_t*, int64_t, int64_t,
                      Ahead&, const int32_t*);

template <bool Many, int... M>
constexpr std::array<Tile, sizeof...(M)> tiles_of(std::integer_sequence<int, M...>) {
  return {tile<M + 1, Many>...};
}
constexpr auto kTiles = tiles_of<false>(std::make_integer_sequence<int, kRows>{});
constexpr auto kManyTiles = tiles_of<true>(std::make_integer_sequence<int, kRows>{});

}  // namespace

#ifdef LINEAR_AMX
// The tile unit's form. oneDNN's packed matmul ran on the tiles already, but at a decode
// step's shapes (128 rows, SmolLM2's layers) it read cold weights at ~8 GB/s, a third of the
// host's read bandwidth: the weights' read and the arithmetic took turns (each linear took
// about its time on weights held in cache plus the time of the read alone). Here each
// thread streams its blocks in order and, while one block's products run, asks for the next
// block's weights ahead (prefetcht1, spread evenly over the block's tile steps), so the read
// overlaps the arithmetic.
//
// A pass multiplies 32 rows of x (two A tiles) by 32 outputs of a block (two B tiles) into
// four fp32 C tiles that start from the bias (a tile load of stride 0 repeats its 16 values
// down the rows), 32 inputs a step; each output is its fp32 sum rounded to bf16 once. Every
// row's sums take the same steps in the same order, so a row's values depend on that row
// alone. Rows come in even chunks of kChunkRows at most (x's chunk stays in L2 while its blocks
// stream past it); a chunk's last rows, short of a whole 32, are copied into zero rows first
// (a tile always loads 16 rows). A call of 16 rows or fewer takes `narrow_pass` instead.
//
// A call's inputs may be several operands, each with its own weights (linear_bf16_operands),
// every one a whole number of tile steps wide: a block's steps are its "stretches", each a
// run of one operand's steps; with `spans`, only the steps the block's spans hold (their
// bounds whole steps), the pairs left out holding zero weights: a product by zero adds
// nothing to an fp32 sum, so the bits are those of every step.
namespace {

constexpr int64_t kTileK = 32;  // inputs a tile step
constexpr int64_t kStepPairs = kTileK / 2;
constexpr int64_t kTileRows = 16;  // rows an A tile
constexpr int64_t kPassRows = 32;  // rows a pass: two A tiles
constexpr int64_t kChunkRows = 256;  // rows a unit of work at most
constexpr int64_t kLine = 64;  // bytes a cache line
constexpr int kStretches = 2 * kOperands;  // a block's stretches at most: two spans' worth

std::atomic<bool> g_tiles_allowed{true};

bool tiles_permitted() { return g_tiles_allowed && amx::permitted(); }

void configure() {
  amx::TileConfig config;  // C tiles 0-3, A tiles 4-5, B tiles 6-7: 16 rows of 64 bytes
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// A run of one operand's tile steps in a block: x at its first input of the call's row 0
// (row stride ld), its weights at their first pair, `steps` steps; `col`: its first input
// among the call's joined inputs (where a short pass's zero-padded rows hold it).
struct Stretch {
  const uint16_t* x;
  int64_t ld;
  const uint16_t* w;
  int64_t steps;
  int64_t col;
};

// A block's stretches: each of its spans' steps within each operand's, in order.
int stretches_of(const Operand* ops, int count, int64_t pairs, int64_t block,
                 const int32_t* span, Stretch* out) {
  int n = 0;
  for (int s = 0; s < 4; s += 2)
    for (int o = 0; o < count; ++o) {
      const int64_t lo = ops[o].begin, hi = o + 1 < count ? ops[o + 1].begin : pairs;
      const int64_t from = std::max<int64_t>(span[s], lo), to = std::min<int64_t>(span[s + 1], hi);
      if (from >= to) continue;
      out[n++] = {ops[o].x + 2 * (from - lo), ops[o].ld,
                  ops[o].w + (block * ops[o].stride + from - lo) * 128, (to - from) / kStepPairs,
                  2 * from};
    }
  return n;
}

// The next unit's weights, asked for into L2 a cache line at a time: its stretches' bytes in
// turn. The current range is held apart from the rest, so that a step's requests are a compare
// and a prefetch each, as they were with one range.
struct Stream {
  const char* at = nullptr;
  const char* stop = nullptr;
  const char* from[kStretches];
  const char* to[kStretches];
  int i = 0, n = 0;
  int64_t bytes = 0;
  void add(const Stretch& s) {
    from[n] = reinterpret_cast<const char*>(s.w);
    to[n] = from[n] + s.steps * kStepPairs * 256;
    bytes += to[n] - from[n];
    ++n;
  }
  // `lines` more lines asked for (fewer where the ranges end)
  __attribute__((always_inline)) inline void next(int64_t lines) {
    const char* a = at;
    const char* e = stop;
    for (int64_t l = 0; l < lines; ++l) {
      if (a >= e) {
        if (i >= n) break;
        a = from[i], e = to[i], ++i;
      }
      _mm_prefetch(a, _MM_HINT_T1);
      a += kLine;
    }
    at = a, stop = e;
  }
};

// C tiles 0-3 started from the bias (each from the 16 values at its offset, repeated down
// the rows by a tile load of stride 0), or from zero where bias is null.
void start_sums(const float* bias, int64_t o0, int64_t o1, int64_t o2, int64_t o3) {
  if (bias == nullptr) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    return;
  }
  _tile_loadd(0, bias + o0, 0);
  _tile_loadd(1, bias + o1, 0);
  _tile_loadd(2, bias + o2, 0);
  _tile_loadd(3, bias + o3, 0);
}

// Where a stretch's rows of a pass lie: from row i0 of x, or in the padded rows (row stride k).
struct Rows {
  const uint16_t* x;
  int64_t ldx;
};
inline Rows rows_of(const Stretch& s, int64_t i0, const uint16_t* padded, int64_t k) {
  return padded != nullptr ? Rows{padded + s.col, k} : Rows{s.x + i0 * s.ld, s.ld};
}

// One pass: rows [i0, i0 + 32) of the stretches' inputs (or the padded rows) times outputs
// [32 h, 32 h + 32) of their block, into sums [32][32] fp32; `ahead` is advanced by `lines`
// cache lines a step.
void pass(const Stretch* st, int count, int64_t i0, const uint16_t* padded, int64_t k,
          const float* bias, int h, float* sums, Stream& ahead, int64_t lines) {
  start_sums(bias != nullptr ? bias + 32 * h : nullptr, 0, 16, 0, 16);
  for (int s = 0; s < count; ++s) {
    const Rows r = rows_of(st[s], i0, padded, k);
    const int64_t ld = r.ldx * int64_t(sizeof(uint16_t));
    for (int64_t t = 0; t < st[s].steps; ++t) {
      const uint16_t* b = st[s].w + t * kStepPairs * 128 + 64 * h;  // 16 pairs of 32 outputs
      const uint16_t* a = r.x + t * kTileK;
      _tile_loadd(4, a, ld);
      _tile_loadd(5, a + 16 * r.ldx, ld);
      _tile_loadd(6, b, 256);
      _tile_loadd(7, b + 32, 256);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      ahead.next(lines);
    }
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  _tile_stored(2, sums + 16 * 32, 128);
  _tile_stored(3, sums + 16 * 32 + 16, 128);
}

// sums [m][32] rounded into y's rows, outputs [0, valid) of them.
void round_out(const float* sums, int64_t m, int64_t valid, uint16_t* y, int64_t ldy) {
  const __mmask16 low = vec512::lanes(valid);
  const __mmask16 high = valid > 16 ? vec512::lanes(valid - 16) : __mmask16(0);
  for (int64_t i = 0; i < m; ++i) {
    const __m512 a = _mm512_load_ps(sums + 32 * i), b = _mm512_load_ps(sums + 32 * i + 16);
    _mm256_mask_storeu_epi16(y + i * ldy, low, (__m256i)_mm512_cvtneps_pbh(a));
    _mm256_mask_storeu_epi16(y + i * ldy + 16, high, (__m256i)_mm512_cvtneps_pbh(b));
  }
}

// A pass of a call of 16 rows or fewer: rows [0, 16) of the stretches' inputs times all 64
// outputs of their block (four C tiles, one A tile, the B tiles in turn), into sums [16][64].
// At a few rows a call is the weights' read, and here each tile step reads its pair rows' 256
// bytes whole, in order through the block, which the CPU's own prefetcher follows: asked for
// ahead as the 32-row passes ask (they read every other 128 bytes, which it does not follow),
// the reads were slower (1-16 rows of SmolLM2's decode linears on an AMX Xeon: 1.07-1.09x the
// 32-row passes with the requests, 1.17-1.23x without). The same sums in the same order as
// `pass`, so a row's values do not depend on which pass made them.
void narrow_pass(const Stretch* st, int count, const uint16_t* padded, int64_t k,
                 const float* bias, float* sums) {
  start_sums(bias, 0, 16, 32, 48);
  for (int s = 0; s < count; ++s) {
    const Rows r = rows_of(st[s], 0, padded, k);
    const int64_t ld = r.ldx * int64_t(sizeof(uint16_t));
    for (int64_t t = 0; t < st[s].steps; ++t) {
      const uint16_t* b = st[s].w + t * kStepPairs * 128;  // 16 pairs of 64 outputs
      _tile_loadd(4, r.x + t * kTileK, ld);
      _tile_loadd(5, b, 256);
      _tile_loadd(6, b + 32, 256);
      _tile_loadd(7, b + 64, 256);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 96, 256);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, sums, 256);
  _tile_stored(1, sums + 16, 256);
  _tile_stored(2, sums + 32, 256);
  _tile_stored(3, sums + 48, 256);
}

// sums [m][64] rounded into y's rows, outputs [0, valid) of them.
void narrow_round_out(const float* sums, int64_t m, int64_t valid, uint16_t* y, int64_t ldy) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < 4 && 16 * j < valid; ++j) {
      const __m512 a = _mm512_load_ps(sums + 64 * i + 16 * j);
      _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, vec512::lanes(valid - 16 * j),
                               (__m256i)_mm512_cvtneps_pbh(a));
    }
}

// Whether a call takes the tile unit: permitted, every operand whole tile steps wide.
bool on_tiles(const Operand* ops, int count, int64_t k) {
  if (!tiles_permitted() || k % kTileK) return false;
  for (int o = 1; o < count; ++o)
    if (ops[o].begin % kStepPairs) return false;
  return true;
}

// Whether `spans` (null: none) bound every block's steps at whole tile steps.
bool whole_steps(const int32_t* spans, int64_t blocks) {
  if (spans == nullptr) return false;
  for (int64_t i = 0; i < 4 * blocks; ++i)
    if (spans[i] % kStepPairs) return false;
  return true;
}

int tile_linear(const Operand* ops, int count, int64_t rows, int64_t k, const float* bias,
                int64_t n, uint16_t* y, int64_t ldy, int threads, const int32_t* spans) {
  const int64_t blocks = (n + 63) / 64, pairs = k / 2;
  // chunks of even size (whole passes): 300 rows as 256 + 44 left a thread the short chunk's
  // units where the other had the long chunk's (300 rows 1.24x, 520 rows 1.22x as 160 + 140
  // and 192 + 192 + 136; docs/benchmarks.md)
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = ((rows + chunks - 1) / chunks + kPassRows - 1) / kPassRows * kPassRows;
  const int64_t units = blocks * chunks;
  // the rows past the last whole pass, with zero rows after them
  // (a step of 16 rows or fewer takes narrow passes of 16)
  const bool narrow = rows <= kTileRows;
  const int64_t pass_rows = narrow ? kTileRows : kPassRows;
  const int64_t whole = rows / pass_rows * pass_rows, tail = rows - whole;
  std::vector<uint16_t> padded(tail ? pass_rows * k : 0, 0);
  for (int o = 0; o < count; ++o) {
    const int64_t end = o + 1 < count ? ops[o + 1].begin : pairs, width = 2 * (end - ops[o].begin);
    for (int64_t i = 0; i < tail; ++i)
      std::memcpy(padded.data() + i * k + 2 * ops[o].begin, ops[o].x + (whole + i) * ops[o].ld,
                  width * sizeof(uint16_t));
  }
  // the spans' steps only where they are whole steps, past a few rows (as the AVX-512 loops)
  const bool skip = rows > kAheadRows && whole_steps(spans, blocks);
  const int32_t every[4] = {0, int32_t(pairs), int32_t(pairs), int32_t(pairs)};
  #pragma omp parallel num_threads(threads) if (units > 1)
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    const int64_t begin = units * part / parts, end = units * (part + 1) / parts;
    alignas(64) float sums[kPassRows * 32];  // (narrow: 16 x 64)
    Stretch st[kStretches], next[kStretches];
    if (begin < end) configure();
    for (int64_t unit = begin; unit < end; ++unit) {
      // chunk-major: a chunk's rows meet every block in turn (consecutive units share rows)
      const int64_t chunk = unit / blocks, block = unit % blocks;
      const int64_t first = chunk * chunk_rows, last = std::min(rows, first + chunk_rows);
      const int m = stretches_of(ops, count, pairs, block, skip ? spans + 4 * block : every, st);
      const float* bb = bias != nullptr ? bias + block * 64 : nullptr;
      const int64_t valid = std::min<int64_t>(64, n - block * 64);
      if (narrow) {  // one pass: every row, every output of the block
        narrow_pass(st, m, tail ? padded.data() : nullptr, k, bb, sums);
        narrow_round_out(sums, rows, valid, y + block * 64, ldy);
        continue;
      }
      // the next unit's weights, asked for over this unit's tile steps
      Stream ahead;
      if (unit + 1 < end) {
        const int64_t after = (unit + 1) % blocks;
        const int got =
            stretches_of(ops, count, pairs, after, skip ? spans + 4 * after : every, next);
        for (int s = 0; s < got; ++s) ahead.add(next[s]);
      }
      int64_t block_steps = 0;
      for (int s = 0; s < m; ++s) block_steps += st[s].steps;
      const int64_t passes = (last - first + kPassRows - 1) / kPassRows;
      const int64_t steps = std::max<int64_t>(1, passes * 2 * block_steps);
      const int64_t lines = (ahead.bytes / kLine + steps - 1) / steps;
      for (int64_t i0 = first; i0 < last; i0 += kPassRows) {
        const uint16_t* pad = i0 >= whole ? padded.data() : nullptr;
        const int64_t rows_here = std::min(kPassRows, last - i0);
        for (int h = 0; h < 2 && 32 * h < valid; ++h) {
          pass(st, m, i0, pad, k, bb, h, sums, ahead, lines);
          round_out(sums, rows_here, valid - 32 * h, y + i0 * ldy + block * 64 + 32 * h, ldy);
        }
      }
    }
    if (begin < end) _tile_release();
  }
  return 0;
}

}  // namespace
#endif

namespace {

bool spans_valid(const int32_t* spans, int64_t blocks, int64_t pairs) {
  if (spans != nullptr)
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t* s = spans + 4 * b;
      if (s[0] < 0 || s[0] > s[1] || s[1] > s[2] || s[2] > s[3] || s[3] > pairs) return false;
    }
  return true;
}

// The AVX-512 loops of a call over its operands (k: their inputs in all).
void avx512_linear(const Operand* ops, int count, int64_t rows, int64_t k, const float* bias,
                   int64_t n, uint16_t* y, int64_t ldy, int threads, const int32_t* spans) {
  const int64_t blocks = (n + 63) / 64, pairs = (k + 1) / 2;
  const int32_t every[4] = {0, int32_t(pairs), int32_t(pairs), int32_t(pairs)};
  const bool skip = spans != nullptr && rows > kAheadRows;
  const int64_t first_pairs = count > 1 ? ops[1].begin : pairs;
  const int64_t work = blocks * rows, block_bytes = first_pairs * 256;
  // The work is (block, row) pairs in block-major order, split evenly between the threads:
  // a thread takes each of its blocks' rows in one go (the block read from memory once, its
  // later tiles reading it from L2), and the threads' shares differ by a row at most (a split
  // in units of blocks or of a block's row chunks left one thread waiting at the end). Where
  // a block is one tile (6 rows or fewer) the threads take whole blocks.
  #pragma omp parallel num_threads(threads) if (blocks > 1 || rows > 8 * kRows)
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    int64_t begin = work * part / parts, end = work * (part + 1) / parts;
    if (rows <= kRows) {  // a block is one tile: whole blocks
      begin = blocks * part / parts * rows;
      end = blocks * (part + 1) / parts * rows;
    }
    for (int64_t block = begin / rows; block * rows < end; ++block) {
      const int64_t lo = std::max(begin, block * rows) - block * rows;
      const int64_t hi = std::min(end, (block + 1) * rows) - block * rows;
      const uint16_t* wb = ops[0].w + block * ops[0].stride * 128;
      const float* bb = bias != nullptr ? bias + block * 64 : nullptr;
      const int64_t valid = std::min<int64_t>(64, n - block * 64);
      Ahead ahead;  // (not at a few rows: there the call is the weights' read, which the
                    // CPU's own prefetcher follows, and asking too made it slower)
      if (rows > kAheadRows && (block + 1) * rows < end) {
        ahead.at = reinterpret_cast<const char*>(wb + ops[0].stride * 128);
        ahead.stop = ahead.at + block_bytes;
      }
      // the rows in tiles of as even a size as 6 rows at most allow (128 rows: 18 x 6 +
      // 4 x 5, where the chunks of 48 rows made 21 x 6 and a tile of 2)
      const int64_t mine = hi - lo, tiles = (mine + kRows - 1) / kRows;
      for (int64_t t = 0, i0 = lo; t < tiles; ++t) {
        const int64_t m = mine / tiles + (t < mine % tiles ? 1 : 0);
        Operand at[kOperands];  // the operands' rows and block of this tile
        for (int o = 0; o < count; ++o)
          at[o] = {ops[o].x + i0 * ops[o].ld, ops[o].ld, ops[o].w + block * ops[o].stride * 128,
                   ops[o].stride, ops[o].begin};
        (count > 1 ? kManyTiles : kTiles)[m - 1](at, count, k, bb, y + i0 * ldy + block * 64,
                                                 ldy, valid, ahead,
                                                 skip ? spans + 4 * block : every);
        i0 += m;
      }
    }
  }
}

}  // namespace

// Whether the tile unit's form may run (the tests run both forms on one CPU): a switch the
// process keeps; 0 on a CPU without AMX.
extern "C" int linear_bf16_tiles(int allowed) {
#ifdef LINEAR_AMX
  if (allowed >= 0) g_tiles_allowed = allowed != 0;
  return g_tiles_allowed && amx::permitted();
#else
  (void)allowed;
  return 0;
#endif
}

// x [rows, k] (row stride ldx), w [ceil(n / 64), ceil(k / 2), 64, 2], bias: ceil(n / 64) * 64
// fp32 values or null; y [rows, n] (row stride ldy) = x @ W.T + bias, rounded to bf16.
// `spans` (null: every pair) gives each block the input pairs it multiplies, [ceil(n / 64)][4]:
// [s0, s1) then [s2, s3), 0 <= s0 <= s1 <= s2 <= s3 <= ceil(k / 2); the pairs left out must
// hold only zero weights. A group of siblings with a lone key's LoRA columns (lora/fused.py)
// holds each member's up-projection in its own rank's columns, zeros in the others' (q/k/v:
// two thirds of their extra columns; gate/up: half); those products add nothing and were
// 3.3 % of a SmolLM2 decode row's multiply-adds. Skipping exact zeros leaves every sum's bits
// as they were (for finite x). Only calls of more than kAheadRows rows skip: at a few rows a
// call is the weights' read, which the CPU's prefetcher follows as one stream a block, and
// the jumps over the zero pairs made 1-16 rows 3-7 % slower on a Zen 4 EPYC (a 128-row
// step's linears 1.01-1.03x faster; bench/native_linear.py --part spans). The tile unit's
// form leaves out the spans' tile steps where their bounds are whole steps (32 inputs).
extern "C" int linear_bf16(const uint16_t* x, int64_t ldx, int64_t rows, int64_t k,
                           const uint16_t* w, const float* bias, int64_t n, uint16_t* y,
                           int64_t ldy, int threads, const int32_t* spans) {
  if (rows < 0 || k <= 0 || n <= 0 || ldx < k || ldy < n) return 1;
  const int64_t pairs = (k + 1) / 2;
  if (!spans_valid(spans, (n + 63) / 64, pairs)) return 1;
  if (rows == 0) return 0;
  const Operand one{x, ldx, w, pairs, 0};
#ifdef LINEAR_AMX
  if (on_tiles(&one, 1, k)) return tile_linear(&one, 1, rows, k, bias, n, y, ldy, threads, spans);
#endif
  avx512_linear(&one, 1, rows, k, bias, n, y, ldy, threads, spans);
  return 0;
}

// y [rows, n] = [x_1 | ... | x_count] @ W.T + bias, rounded to bf16 once: the same sums as
// linear_bf16 on the joined inputs and the joined weights, without joining them. Operand o:
// xs[o] [rows, ks[o]] (row stride lds[o]; every width but the last even), its weights in
// blocks at ws[o] (block b at ws[o] + 128 b strides[o]: [ceil(ks[o] / 2), 64, 2] of it). A
// training pass's adapted layer (lora/native_summed.py): forward [x | low] by a frozen W
// packed once and a B packed per call, each its own stride (no joined copies a pass); input
// gradient [dy_1 | ... | dy_G | dlow] by the members' W_i^T packed once and A^T packed per
// call, summed in fp32 and rounded once. `spans` as linear_bf16's, over the joined pairs.
// On the tile unit where the CPU has one and every operand is whole tile steps (32 inputs)
// wide, else the AVX-512 loops.
extern "C" int linear_bf16_operands(int count, const uint16_t* const* xs, const int64_t* lds,
                                    const int64_t* ks, const uint16_t* const* ws,
                                    const int64_t* strides, int64_t rows, const float* bias,
                                    int64_t n, uint16_t* y, int64_t ldy, int threads,
                                    const int32_t* spans) {
  if (count < 1 || count > kOperands || rows < 0 || n <= 0 || ldy < n) return 1;
  Operand ops[kOperands];
  int64_t k = 0;
  for (int o = 0; o < count; ++o) {
    if (ks[o] <= 0 || lds[o] < ks[o] || strides[o] < (ks[o] + 1) / 2) return 1;
    if (o + 1 < count && ks[o] % 2) return 1;  // (the next operand starts at a whole pair)
    ops[o] = {xs[o], lds[o], ws[o], strides[o], k / 2};
    k += ks[o];
  }
  if (!spans_valid(spans, (n + 63) / 64, (k + 1) / 2)) return 1;
  if (rows == 0) return 0;
#ifdef LINEAR_AMX
  if (on_tiles(ops, count, k))
    return tile_linear(ops, count, rows, k, bias, n, y, ldy, threads, spans);
#endif
  avx512_linear(ops, count, rows, k, bias, n, y, ldy, threads, spans);
  return 0;
}
