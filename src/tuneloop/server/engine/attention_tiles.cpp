// Causal attention of a packed row's sequences, forward and backward, on the AMX tile unit at
// bf16: in place of causal_cpu.py's matmul kernel for sequences up to its bound (packing.py
// calls it through native_attention.py, every sequence of the row in one call each way).
//
// torch makes the matmul kernel of a sequence of ~150 tokens (SmolLM2's 9 query heads over 3
// key heads) as a dozen operations of which each costs more than its arithmetic: the fp32
// copies of q and k, batched matmuls run at a tenth of the bf16 peak on such shapes, the
// bias, the softmax, the downcast, and in the backward four more matmuls and the softmax's
// gradient; about 1 ms a sequence and layer, 16 % of a training step for 3 % of its FLOPs.
// Here a key head's stacked query rows go 16 at a time through the tile unit and the vector
// unit while they are in cache, and only the key blocks at or before the diagonal are
// computed. Each sequence is padded to whole 16-token blocks inside (zero keys and queries
// past its end, whose outputs are not stored) and its blocks depend on its own tokens only:
// a sequence gets the values it gets alone. The blocks of all sequences are one list of work.
//
// Layouts: the tile unit multiplies A [16 rows, 32 k] (row-major bf16) by B stored as pairs
// [k / 2][n][2]. q, k, v and the output's gradient are read where they lie (any head and
// token strides); the kernels first rearrange what a product needs in another layout (keys
// and values as pairs of features or of rows, q and dO transposed: each the size of a
// sequence's q, k or v, small next to its scores), in registers (16 x 16 transposes). The
// probabilities are kept for the backward pass with rows in pairs ([rows / 2][keys][2]), the
// layout in which they are the B side of dV^T = dO^T P; dS is written the same way for
// dK^T = Q^T dS.
//
// Numerics: scores are fp32 sums of exact bf16 products (as the matmul kernel's fp32
// matmuls on the bf16 units), scaled, masked and put through an fp32 softmax whose
// probabilities are rounded to bf16, as there; the output sums those in fp32 and is rounded
// once. The backward keeps dP and the softmax's gradient in fp32 (torch's kernel rounds both
// to bf16) and rounds dS to bf16 for its two products. Units of 16 query rows (forward, dQ)
// or 64 keys (dK, dV) run in parallel under OpenMP; each output's sum runs in one order
// whatever the number of threads.
//
// Without a tile unit (AVX-512-BF16 CPUs: AMD's Zen 4 and 5, Intel's Cooper Lake) the same
// products run on the vector unit's bf16 dot products (`vdpbf16ps`): each product is exact
// in fp32 there too and is summed in fp32, pairs of k in order, so the numerics above hold;
// the order within a pair may differ from the tile unit's, so the two forms' bits may differ
// in the last place. Everything else (layouts, softmax, units of work) is shared. On a CPU
// with AMX the tile form is the default where Linux grants the tiles, and
// `attention_tiles_allow(0)` selects the vector form (for the tests and the benches).
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define ATTENTION_AMX 1
#endif
#include "vec512.h"

namespace {

constexpr int kBlock = 16;  // rows of a tile; columns of a C tile
constexpr int kDepth = 32;  // bf16 values of k in one tile row
constexpr int kWide = 4;    // C tiles 0-3; A in tile 4, B in tile 5
// Scratch rows are padded by 64 bytes: rows 4 KB apart (a 1,024-key block of fp32 scores)
// would all fall in one set of the L1 cache as a tile loads or stores them.
constexpr int kPad = 32;

inline int64_t up32(int64_t n) { return (n + kDepth - 1) / kDepth * kDepth; }

#ifdef ATTENTION_AMX
bool g_tiles_allowed = true;  // attention_tiles_allow

// Whether the products take the tile unit: built with AMX, allowed, granted by Linux (a kernel
// that does not grant it leaves them on the vector unit).
bool use_tiles() { return g_tiles_allowed && amx::permitted(); }

void configure() {
  if (!use_tiles()) return;
  amx::TileConfig config;
  for (int t = 0; t < 6; ++t) config.rows[t] = kBlock, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

void release() {
  if (use_tiles()) _tile_release();
}
#else
constexpr bool use_tiles() { return false; }
void configure() {}
void release() {}
#endif

// The right side of a product: pair row p (inputs 2p and 2p + 1, interleaved per column) of
// column block n at b + p * pair + n * block. A tile of it is 16 pair rows `pair` apart.
struct Right {
  const uint16_t* b;
  int64_t pair, block;
};

#ifdef ATTENTION_AMX
// C [16, 16 J] fp32 (row stride ldc) = A [16, k] times B over the k of `ranges` (pairs of
// [begin, end), multiples of 32). A: bf16 rows of stride lda.
template <int J>
void tile_product(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count,
                  float* c, int64_t ldc) {
  _tile_zero(0);
  if constexpr (J >= 2) _tile_zero(1);
  if constexpr (J >= 3) _tile_zero(2);
  if constexpr (J >= 4) _tile_zero(3);
  const int64_t b_stride = r.pair * int64_t(sizeof(uint16_t));
  for (int i = 0; i < count; ++i) {
    for (int64_t k = ranges[2 * i]; k < ranges[2 * i + 1]; k += kDepth) {
      _tile_loadd(4, a + k, lda * int64_t(sizeof(uint16_t)));
      const uint16_t* bk = r.b + (k / 2) * r.pair;
      _tile_loadd(5, bk, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (J >= 2) {
        _tile_loadd(5, bk + r.block, b_stride);
        _tile_dpbf16ps(1, 4, 5);
      }
      if constexpr (J >= 3) {
        _tile_loadd(5, bk + 2 * r.block, b_stride);
        _tile_dpbf16ps(2, 4, 5);
      }
      if constexpr (J >= 4) {
        _tile_loadd(5, bk + 3 * r.block, b_stride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
  }
  const int64_t c_stride = ldc * int64_t(sizeof(float));
  _tile_stored(0, c, c_stride);
  if constexpr (J >= 2) _tile_stored(1, c + 16, c_stride);
  if constexpr (J >= 3) _tile_stored(2, c + 32, c_stride);
  if constexpr (J >= 4) _tile_stored(3, c + 48, c_stride);
}
#endif

// The vector unit's form of `product`: C [16, 16 J] fp32 = A [16, k] times B, in passes of
// R rows (R x J accumulators in registers, J pair rows of B loaded once a pass and each A pair
// broadcast to the J of them). Each pair of k is one `vdpbf16ps`: both products exact in fp32
// and added to the sum in order of k.
template <int R, int J>
void vector_rows(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count,
                 float* c, int64_t ldc) {
  __m512 sum[R][J];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) sum[i][j] = _mm512_setzero_ps();
  for (int n = 0; n < count; ++n) {
    for (int64_t k = ranges[2 * n]; k < ranges[2 * n + 1]; k += 2) {
      const uint16_t* bk = r.b + (k / 2) * r.pair;
      __m512bh b[J];
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j)
        b[j] = (__m512bh)_mm512_loadu_si512((const void*)(bk + j * r.block));
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + i * lda + k, sizeof(pair));
        const __m512bh ai = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], ai, b[j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(c + i * ldc + 16 * j, sum[i][j]);
}

// 16 rows in passes of R: R x J accumulators stay within the 32 vector registers.
template <int R, int J>
void vector_product(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count,
                    float* c, int64_t ldc) {
  for (int i = 0; i < kBlock; i += R)
    vector_rows<R, J>(a + i * lda, lda, r, ranges, count, c + i * ldc, ldc);
}

template <int J>
void product(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count, float* c,
             int64_t ldc) {
#ifdef ATTENTION_AMX
  if (use_tiles()) return tile_product<J>(a, lda, r, ranges, count, c, ldc);
#endif
  if constexpr (J == 1) {
    vector_product<16, 1>(a, lda, r, ranges, count, c, ldc);
  } else if constexpr (J == 4) {
    vector_product<4, 4>(a, lda, r, ranges, count, c, ldc);
  } else {
    vector_product<8, J>(a, lda, r, ranges, count, c, ldc);
  }
}

// C [16, 16 n] over n column blocks, four at a time.
void products(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count,
              float* c, int64_t ldc, int64_t n) {
  for (int64_t j = 0; j < n; j += kWide) {
    const Right rj{r.b + j * r.block, r.pair, r.block};
    float* cj = c + j * kBlock;
    switch (std::min<int64_t>(kWide, n - j)) {
      case 1: product<1>(a, lda, rj, ranges, count, cj, ldc); break;
      case 2: product<2>(a, lda, rj, ranges, count, cj, ldc); break;
      case 3: product<3>(a, lda, rj, ranges, count, cj, ldc); break;
      default: product<4>(a, lda, rj, ranges, count, cj, ldc); break;
    }
  }
}

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The first `count` rows of a C block [16, d] fp32 rounded into bf16 rows `token` apart.
void store_rows(const float* c, int64_t d, uint16_t* out, int64_t token, int64_t count) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t j = 0; j < d; j += 16)
      _mm256_storeu_si256((__m256i*)(out + t * token + j), to_bf16(_mm512_loadu_ps(c + t * d + j)));
}

// A 16 x 16 block of 32-bit values transposed in registers: r[i] holds column i after.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Rows of bf16 features: row i of head h at base + h * head + i * token (features contiguous).
struct Rows {
  const uint16_t* base;
  int64_t head, token;
  const uint16_t* at(int64_t h, int64_t i) const { return base + h * head + i * token; }
};

// Features [0, dim) of 16 rows `token` values apart as 32-bit pairs, transposed: `store`
// takes pair p (features 2p, 2p + 1) of the 16 rows, 16 pairs at a time.
template <typename Store>
void pair_columns(const uint16_t* rows, int64_t token, int64_t dim, Store store) {
  for (int64_t p0 = 0; p0 < dim / 2; p0 += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = _mm512_loadu_si512((const void*)(rows + i * token + 2 * p0));
    transpose16(r);
    for (int p = 0; p < 16; ++p) store(p0 + p, r[p]);
  }
}

// A key head's keys (or values) as pairs of features, by 16-key blocks: [keys32 / 16][dim /
// 2][16][2], each tile of a block 1 KB in one piece. `features` of a block: a Right.
Right features_of(const uint16_t* head, int64_t dim) { return {head, 32, dim / 2 * 32}; }

void feature_pairs(const uint16_t* rows, int64_t token, int64_t dim, int64_t j0, uint16_t* out) {
  uint16_t* block = out + (j0 / kBlock) * (dim / 2) * 32;
  pair_columns(rows, token, dim,
               [&](int64_t p, __m512i v) { _mm512_storeu_si512((void*)(block + p * 32), v); });
}

// 16 rows [r0, r0 + 16) as pairs of rows: out [rows32 / 2][dim][2].
void row_pairs(const uint16_t* rows, int64_t token, int64_t dim, int64_t r0, uint16_t* out) {
  for (int t = 0; t < 16; t += 2) {
    const uint16_t* even = rows + t * token;
    uint16_t* pair = out + ((r0 + t) / 2) * dim * 2;
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + c)));
      const __m512i hi =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + token + c)));
      _mm512_storeu_si512((void*)(pair + 2 * c), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// 16 rows [r0, r0 + 16) transposed: out [dim][ld], features as rows.
void transposed(const uint16_t* rows, int64_t token, int64_t dim, int64_t ld, int64_t r0,
                uint16_t* out) {
  pair_columns(rows, token, dim, [&](int64_t p, __m512i v) {
    _mm256_storeu_si256((__m256i*)(out + 2 * p * ld + r0), _mm512_cvtepi32_epi16(v));
    _mm256_storeu_si256((__m256i*)(out + (2 * p + 1) * ld + r0),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  });
}

// One sequence of a packed call: its tokens [offset, offset + length) of the packed rows,
// padded to whole 16-token blocks inside the kernels (zero keys and queries past the end,
// whose outputs are not stored), and where its buffers start.
struct Shape {
  int64_t heads, groups, length, dim;  // key heads, query heads per key head, tokens, head size
  int64_t offset;                      // its first token in the packed rows
  int64_t padded() const { return (length + kBlock - 1) / kBlock * kBlock; }
  int64_t rows() const { return groups * padded(); }  // a key head's stacked query rows
  int64_t rows32() const { return up32(rows()); }
  int64_t keys32() const { return up32(padded()); }
  int64_t blocks() const { return padded() / kBlock; }
  int64_t wide() const { return keys32() + kPad; }  // a scratch row's values
  // A key head's probabilities (or dS) as pairs of rows: [rows32 / 2][keys32][2], written a
  // pair row at a time.
  int64_t pairs() const { return keys32() * rows32(); }
  Right pairs_of(const uint16_t* head) const { return {head, 2 * keys32(), 32}; }
};

// A packed call's sequences, with the start of each one's buffers (in values) of a size per
// key head: probabilities or dS, layouts of the keys, transposed rows.
struct Packed {
  std::vector<Shape> shapes;
  std::vector<int64_t> pairs, keys, rows;  // one more than the sequences: the totals last
  int64_t longest = 0;                     // keys32 of the longest
  int64_t groups;
  Packed(const int64_t* lengths, int64_t count, int64_t heads, int64_t groups, int64_t dim)
      : groups(groups) {
    int64_t offset = 0;
    pairs = keys = rows = {0};
    for (int64_t i = 0; i < count; ++i) {
      const Shape s{heads, groups, lengths[i], dim, offset};
      offset += lengths[i];
      shapes.push_back(s);
      pairs.push_back(pairs.back() + heads * s.pairs());
      keys.push_back(keys.back() + heads * dim * s.keys32());
      rows.push_back(rows.back() + heads * dim * (s.rows32() + kPad));
      longest = std::max(longest, s.keys32());
    }
  }
};

// Per thread: a block's scores [16, wide] fp32 (or a key unit's C block [16, 64]), its
// probabilities (or dS) [16, wide] bf16, its output [16, dim] fp32, a copy of 16 input
// rows [16, dim] (zeros past a sequence's end), for the longest sequence, and a key unit's
// ranges of rows. Made by the calling thread before the parallel region (`for_threads`): the
// OpenMP workers allocate nothing, so none of them takes an allocator arena of its own, whose
// pages another thread's allocations could not reuse. (A cache line each: a key unit writes
// its ranges' size.)
struct alignas(64) Scratch {
  std::vector<float> scores;
  std::vector<uint16_t> block;
  std::vector<float> out;
  std::vector<uint16_t> rows;
  std::vector<int64_t> ranges;
  Scratch(const Packed& p, int64_t dim)
      : scores(kBlock * std::max<int64_t>(p.longest + kPad, kWide * kBlock)),
        block(kBlock * (p.longest + kPad)),
        out(kBlock * dim),
        rows(kBlock * dim) {
    ranges.reserve(2 * (p.groups * p.longest / kDepth + 2));  // at most one per 32 rows
  }
};

std::vector<Scratch> for_threads(const Packed& p, int64_t dim, int threads) {
  std::vector<Scratch> scratch;
  scratch.reserve(std::max(threads, 1));
  for (int t = 0; t < std::max(threads, 1); ++t) scratch.emplace_back(p, dim);
  return scratch;
}

// Rows [i0, i0 + 16) of head h of a sequence's rows: where they lie (their token stride in
// *token), or copied into `copy` (stride dim) with zeros past the sequence's end.
const uint16_t* block_rows(const Shape& s, const Rows& r, int64_t h, int64_t i0, uint16_t* copy,
                           int64_t* token) {
  const uint16_t* first = r.at(h, s.offset + i0);
  if (i0 + kBlock <= s.length) {
    *token = r.token;
    return first;
  }
  const int64_t valid = s.length - i0;
  std::memset(copy, 0, sizeof(uint16_t) * kBlock * s.dim);
  for (int64_t t = 0; t < valid; ++t)
    std::memcpy(copy + t * s.dim, first + t * r.token, sizeof(uint16_t) * s.dim);
  *token = s.dim;
  return copy;
}

// The 16 rows' block of bf16 values [16, ld] (keys [0, width) set) written into a key head's
// pairs layout (Shape::pairs) at rows [r0, r0 + 16), zeros past width: every value of the
// rows is written.
void store_pairs(const Shape& s, const uint16_t* block, int64_t ld, int64_t width, uint16_t* out,
                 int64_t r0) {
  const int64_t k32 = s.keys32();
  for (int t = 0; t < kBlock; t += 2) {
    uint16_t* pair = out + (r0 + t) / 2 * 2 * k32;
    for (int64_t j = 0; j < width; j += 16) {
      const __m512i even =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(block + t * ld + j)));
      const __m512i odd =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(block + (t + 1) * ld + j)));
      _mm512_storeu_si512((void*)(pair + 2 * j), _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
    std::memset(pair + 2 * width, 0, sizeof(uint16_t) * 2 * (k32 - width));
  }
}

// Zeros in a key head's pairs layout for the padding rows [rows, rows32).
void zero_padding(const Shape& s, uint16_t* out) {
  std::memset(out + s.rows() * s.keys32(), 0,
              sizeof(uint16_t) * (s.rows32() - s.rows()) * s.keys32());
}

// The (head, 16-row block) units of a call's sequences: sequence, key head, first row.
struct Unit {
  int64_t sequence, head, first;
};

std::vector<Unit> row_units(const Packed& p) {
  std::vector<Unit> units;
  for (int64_t i = 0; i < int64_t(p.shapes.size()); ++i)
    for (int64_t h = 0; h < p.shapes[i].heads; ++h)
      for (int64_t r0 = 0; r0 < p.shapes[i].rows(); r0 += kBlock) units.push_back({i, h, r0});
  return units;
}

// (head, 16-key block) units: the keys' layouts; (head, 64-key group) units: dK and dV.
std::vector<Unit> key_units(const Packed& p, int64_t keys) {
  std::vector<Unit> units;
  for (int64_t i = 0; i < int64_t(p.shapes.size()); ++i)
    for (int64_t h = 0; h < p.shapes[i].heads; ++h)
      for (int64_t j0 = 0; j0 < p.shapes[i].padded(); j0 += keys) units.push_back({i, h, j0});
  return units;
}

// A 16-row block of a unit: its key head, first stacked row, first position in its query
// head, the keys it sees (a multiple of 16) and their tile width, its query head.
struct Block {
  int64_t head, r0, i0, keys, width, query;
  Block(const Shape& s, const Unit& u)
      : head(u.head),
        r0(u.first),
        i0(u.first % s.padded()),
        keys(i0 + kBlock),
        width(up32(keys)),
        query(u.head * s.groups + u.first / s.padded()) {}
};

// The block's rows of `rows` (q, or dO) times the keys it sees of the key head's `features`
// (keys, or values, as pairs of features): S = Q K^T, or dP = dO V^T, into the scratch.
void block_scores(const Shape& s, const Block& b, const Rows& rows, const uint16_t* features,
                  Scratch& w) {
  int64_t token = 0;
  const uint16_t* first = block_rows(s, rows, b.query, b.i0, w.rows.data(), &token);
  const Right keys_of = features_of(features + b.head * s.dim * s.keys32(), s.dim);
  const int64_t depth[2] = {0, s.dim};
  products(first, token, keys_of, depth, 1, w.scores.data(), s.wide(), b.keys / kBlock);
}

// The block's bf16 values in the scratch (P, or dS) written into the key head's pairs layout
// `pairs`, then their product with the key head's `rows` as pairs of rows (values, or keys)
// rounded into the sequence's rows of `out` (O, or dQ) at head and token strides.
void block_product(const Shape& s, const Block& b, uint16_t* pairs, const uint16_t* rows,
                   uint16_t* out, int64_t head_stride, int64_t token_stride, Scratch& w) {
  store_pairs(s, w.block.data(), s.wide(), b.width, pairs + b.head * s.pairs(), b.r0);
  const int64_t keys_range[2] = {0, b.width};
  const Right right{rows + b.head * s.keys32() * s.dim, 2 * s.dim, 32};
  products(w.block.data(), s.wide(), right, keys_range, 1, w.out.data(), s.dim,
           s.dim / kBlock);
  const int64_t count = std::min<int64_t>(kBlock, s.length - b.i0);
  if (count > 0)
    store_rows(w.out.data(), s.dim,
               out + b.query * head_stride + (s.offset + b.i0) * token_stride, token_stride,
               count);
}

void forward_unit(const Shape& s, const Unit& u, const Rows& q, const uint16_t* kp,
                  const uint16_t* vr, uint16_t* out, int64_t o_head, int64_t o_token,
                  uint16_t* probs, float scale, Scratch& w) {
  const Block b(s, u);
  const int64_t ld = s.wide();
  block_scores(s, b, q, kp, w);
  const __m512 factor = _mm512_set1_ps(scale);
  for (int t = 0; t < kBlock; ++t) {
    float* row = w.scores.data() + t * ld;
    const int64_t valid = b.i0 + t + 1;  // keys at or before the query's position
    __m512 high = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < valid; j += 16) {
      const __mmask16 keep = vec512::lanes(valid - j);
      high = _mm512_mask_max_ps(high, keep, high, _mm512_maskz_loadu_ps(keep, row + j));
    }
    // the largest scaled score: scaling by a positive factor keeps the order
    const __m512 top = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(high)), factor);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < valid; j += 16) {
      const __mmask16 keep = vec512::lanes(valid - j);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, row + j), factor);
      const __m512 e = _mm512_maskz_mov_ps(keep, vec512::exp_le0(_mm512_sub_ps(x, top)));
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    uint16_t* p = w.block.data() + t * ld;
    for (int64_t j = 0; j < b.width; j += 16) {
      const __mmask16 keep = j < valid ? vec512::lanes(valid - j) : 0;  // zero past the diagonal
      const __m512 e = _mm512_maskz_loadu_ps(keep, row + j);
      _mm256_storeu_si256((__m256i*)(p + j), to_bf16(_mm512_mul_ps(e, inverse)));
    }
  }
  block_product(s, b, probs, vr, out, o_head, o_token, w);
}

// One 16-row block of the backward pass: dP = dO V^T, dS = P (dP - rowsum(P dP)) scale,
// written into the pairs layout ds, and dQ = dS K.
void backward_unit(const Shape& s, const Unit& u, const Rows& dout, const uint16_t* vp,
                   const uint16_t* kr, const uint16_t* probs, uint16_t* ds, uint16_t* dq,
                   int64_t g_head, int64_t g_token, float scale, Scratch& w) {
  const Block b(s, u);
  const int64_t k32 = s.keys32(), ld = s.wide();
  block_scores(s, b, dout, vp, w);
  // pairs of rows (t, t + 1) as 32-bit values, a pair row of keys32
  const uint32_t* pairs = (const uint32_t*)(probs + b.head * s.pairs()) + b.r0 / 2 * k32;
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int t = 0; t < kBlock; t += 2) {
    const uint32_t* pt = pairs + t / 2 * k32;
    const float* even = w.scores.data() + t * ld;
    const float* odd = even + ld;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t j = 0; j < b.keys; j += 16) {
      const __m512i both = _mm512_loadu_si512((const void*)(pt + j));
      const __m512 p0 = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      const __m512 p1 = _mm512_castsi512_ps(_mm512_and_si512(both, high_half));
      sum0 = _mm512_fmadd_ps(p0, _mm512_loadu_ps(even + j), sum0);
      sum1 = _mm512_fmadd_ps(p1, _mm512_loadu_ps(odd + j), sum1);
    }
    const __m512 d0 = _mm512_set1_ps(_mm512_reduce_add_ps(sum0));
    const __m512 d1 = _mm512_set1_ps(_mm512_reduce_add_ps(sum1));
    uint16_t* g0 = w.block.data() + t * ld;
    uint16_t* g1 = g0 + ld;
    for (int64_t j = 0; j < b.width; j += 16) {
      if (j >= b.keys) {  // zero past the block's keys, up to whole tile rows
        _mm256_storeu_si256((__m256i*)(g0 + j), _mm256_setzero_si256());
        _mm256_storeu_si256((__m256i*)(g1 + j), _mm256_setzero_si256());
        continue;
      }
      const __m512i both = _mm512_loadu_si512((const void*)(pt + j));
      const __m512 p0 = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      const __m512 p1 = _mm512_castsi512_ps(_mm512_and_si512(both, high_half));
      const __m512 s0 = _mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(even + j), d0));
      const __m512 s1 = _mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(odd + j), d1));
      _mm256_storeu_si256((__m256i*)(g0 + j), to_bf16(_mm512_mul_ps(s0, factor)));
      _mm256_storeu_si256((__m256i*)(g1 + j), to_bf16(_mm512_mul_ps(s1, factor)));
    }
  }
  block_product(s, b, ds, kr, dq, g_head, g_token, w);
}

// dK and dV of keys [j0, j0 + 16 n) of a key head: dK^T = Q^T dS and dV^T = dO^T P, summed
// over the stacked rows that can see those keys (in 32-row steps; rows that cannot hold
// zeros), written transposed for the sequence's keys. qt, dot: [heads][dim][rows32 + kPad].
void key_unit(const Shape& s, int64_t head, int64_t j0, int64_t n, const uint16_t* qt,
              const uint16_t* dot, const uint16_t* probs, const uint16_t* ds, uint16_t* dk,
              uint16_t* dv, int64_t k_head, int64_t k_token, float* c,
              std::vector<int64_t>& ranges) {
  const int64_t ldt = s.rows32() + kPad;
  ranges.clear();  // (within the capacity the calling thread reserved: no allocation)
  for (int64_t r = 0; r < s.rows32(); r += kDepth) {
    bool sees = false;  // a row of the step at or after j0 in its query head
    for (int64_t g = 0; g < s.groups && !sees; ++g)
      sees = std::max(r, g * s.padded() + j0) < std::min(r + kDepth, (g + 1) * s.padded());
    if (!sees) continue;
    if (!ranges.empty() && ranges.back() == r)
      ranges.back() = r + kDepth;
    else
      ranges.insert(ranges.end(), {r, r + kDepth});
  }
  const int count = int(ranges.size() / 2);
  const uint16_t* lefts[2] = {qt, dot};
  const uint16_t* rights[2] = {ds, probs};
  uint16_t* outs[2] = {dk, dv};
  const int64_t keys = std::min<int64_t>(n * kBlock, s.length - j0);  // stored
  for (int which = 0; which < 2; ++which) {
    const uint16_t* left = lefts[which] + head * s.dim * ldt;
    Right right = s.pairs_of(rights[which] + head * s.pairs());
    right.b += j0 / kBlock * right.block;  // past the pairs of the keys before j0
    uint16_t* out = outs[which] + head * k_head + (s.offset + j0) * k_token;
    for (int64_t c0 = 0; c0 < s.dim; c0 += kBlock) {
      if (count) {
        products(left + c0 * ldt, ldt, right, ranges.data(), count, c, kWide * kBlock, n);
      } else {
        std::memset(c, 0, sizeof(float) * kBlock * kWide * kBlock);
      }
      // C [16 features, 16 n keys] transposed a 16 x 16 block at a time: a key's 16
      // features rounded and stored as one row
      for (int64_t k0 = 0; k0 < keys; k0 += kBlock) {
        __m512i r[16];
        for (int f = 0; f < kBlock; ++f)
          r[f] = _mm512_loadu_si512((const void*)(c + f * kWide * kBlock + k0));
        transpose16(r);
        for (int64_t j = k0; j < std::min<int64_t>(keys, k0 + kBlock); ++j)
          _mm256_storeu_si256((__m256i*)(out + j * k_token + c0),
                              to_bf16(_mm512_castsi512_ps(r[j - k0])));
      }
    }
  }
}

// The keys' (or values') layouts of a key head's 16-key block j0: pairs of features
// (features_of; or null) and pairs of rows ([keys32 / 2][dim][2], or null).
void key_layouts(const Shape& s, const Rows& keys, int64_t head, int64_t j0, uint16_t* features,
                 uint16_t* pairs, Scratch& w) {
  const int64_t k32 = s.keys32();
  int64_t token = 0;
  const uint16_t* rows = block_rows(s, keys, head, j0, w.rows.data(), &token);
  if (features) feature_pairs(rows, token, s.dim, j0, features + head * s.dim * k32);
  if (pairs) row_pairs(rows, token, s.dim, j0, pairs + head * k32 * s.dim);
}

// Within a parallel region, each 16-key block of every sequence: `as_features`' keys (keys,
// or values) as pairs of features into `features` and `as_rows`' (values, or keys) as pairs
// of rows into `rows`; and zeros in the padding rows of each key head's pairs layout `pairs`
// (the probabilities, or dS).
void lay_out_keys(const Packed& p, const std::vector<Unit>& blocks, const Rows& as_features,
                  uint16_t* features, const Rows& as_rows, uint16_t* rows, uint16_t* pairs,
                  Scratch& w) {
#pragma omp for schedule(static)
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Unit& u = blocks[i];
    const Shape& s = p.shapes[u.sequence];
    key_layouts(s, as_features, u.head, u.first, features + p.keys[u.sequence], nullptr, w);
    key_layouts(s, as_rows, u.head, u.first, nullptr, rows + p.keys[u.sequence], w);
    if (u.first == 0) zero_padding(s, pairs + p.pairs[u.sequence] + u.head * s.pairs());
  }
}

// Rows [i0, i0 + 16) of a query head transposed into a key head's [dim][rows32 + kPad] at
// stacked row r0 (zeros past the sequence's end).
void transposed_block(const Shape& s, const Rows& r, int64_t query, int64_t i0, int64_t r0,
                      uint16_t* out, Scratch& w) {
  int64_t token = 0;
  const uint16_t* rows = block_rows(s, r, query, i0, w.rows.data(), &token);
  transposed(rows, token, s.dim, s.rows32() + kPad, r0, out);
}

}  // namespace

// Let the products take the tile unit where the CPU has one and Linux grants it (1, the
// default) or keep them on the vector unit (0). Returns whether they take the tile unit now.
extern "C" int attention_tiles_allow(int allowed) {
#ifdef ATTENTION_AMX
  g_tiles_allowed = allowed != 0;
#else
  (void)allowed;
#endif
  return use_tiles() ? 1 : 0;
}

// The size in values of a packed call's probabilities ([heads, rows32 / 2, keys32, 2] a
// sequence, one after the other).
extern "C" int64_t attention_probs_size(const int64_t* lengths, int64_t count, int64_t heads,
                                        int64_t groups) {
  return Packed(lengths, count, heads, groups, kDepth).pairs.back();
}

// Packed sequences of `lengths` tokens end to end. q: [query heads, tokens, dim] rows of
// features at (head stride, token stride) q_head, q_token (a key head's query heads
// adjacent); k, v: [heads, tokens, dim] likewise; out like q at o_head, o_token; probs
// (attention_probs_size, written whole; kept for the backward pass). dim a multiple of 32.
extern "C" void attention_forward_bf16(const uint16_t* q, int64_t q_head, int64_t q_token,
                                       const uint16_t* k, int64_t k_head, int64_t k_token,
                                       const uint16_t* v, int64_t v_head, int64_t v_token,
                                       uint16_t* out, int64_t o_head, int64_t o_token,
                                       uint16_t* probs, const int64_t* lengths, int64_t count,
                                       int64_t heads, int64_t groups, int64_t dim, float scale,
                                       int threads) {
  const Packed p(lengths, count, heads, groups, dim);
  const Rows queries{q, q_head, q_token}, keys{k, k_head, k_token}, values{v, v_head, v_token};
  std::vector<uint16_t> kp(p.keys.back()), vr(p.keys.back());  // zeroed: keys past the end
  const std::vector<Unit> blocks = key_units(p, kBlock), units = row_units(p);
  std::vector<Scratch> scratch = for_threads(p, dim, threads);
#pragma omp parallel num_threads(threads)
  {
    Scratch& w = scratch[omp_get_thread_num()];
    lay_out_keys(p, blocks, keys, kp.data(), values, vr.data(), probs, w);
    configure();
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < units.size(); ++i) {
      const Unit& u = units[i];
      forward_unit(p.shapes[u.sequence], u, queries, kp.data() + p.keys[u.sequence],
                   vr.data() + p.keys[u.sequence], out, o_head, o_token,
                   probs + p.pairs[u.sequence], scale, w);
    }
    release();
  }
}

// dout, q, k, v: rows at (head stride, token stride) as the forward's inputs (dout as its
// output); probs from the forward pass; dq like q at g_head, g_token; dk and dv like k at
// k_head, k_token.
extern "C" void attention_backward_bf16(const uint16_t* dout, int64_t d_head, int64_t d_token,
                                        const uint16_t* q, int64_t q_head, int64_t q_token,
                                        const uint16_t* k, int64_t k_head, int64_t k_token,
                                        const uint16_t* v, int64_t v_head, int64_t v_token,
                                        const uint16_t* probs, uint16_t* dq, int64_t g_head,
                                        int64_t g_token, uint16_t* dk, uint16_t* dv,
                                        int64_t dk_head, int64_t dk_token,
                                        const int64_t* lengths, int64_t count, int64_t heads,
                                        int64_t groups, int64_t dim, float scale, int threads) {
  const Packed p(lengths, count, heads, groups, dim);
  const Rows grads{dout, d_head, d_token}, queries{q, q_head, q_token};
  const Rows keys{k, k_head, k_token}, values{v, v_head, v_token};
  // zeroed: keys and rows past the ends
  std::vector<uint16_t> vp(p.keys.back()), kr(p.keys.back());
  std::vector<uint16_t> qt(p.rows.back()), dot(p.rows.back());
  std::unique_ptr<uint16_t[]> ds(new uint16_t[p.pairs.back()]);  // written whole
  const std::vector<Unit> blocks = key_units(p, kBlock), units = row_units(p);
  const std::vector<Unit> groups_of_keys = key_units(p, kWide * kBlock);
  std::vector<Scratch> scratch = for_threads(p, dim, threads);
#pragma omp parallel num_threads(threads)
  {
    Scratch& w = scratch[omp_get_thread_num()];
    lay_out_keys(p, blocks, values, vp.data(), keys, kr.data(), ds.get(), w);
#pragma omp for schedule(static)
    for (size_t i = 0; i < units.size(); ++i) {
      const Unit& u = units[i];
      const Shape& s = p.shapes[u.sequence];
      const int64_t query = u.head * groups + u.first / s.padded(), i0 = u.first % s.padded();
      const int64_t at = p.rows[u.sequence] + u.head * dim * (s.rows32() + kPad);
      transposed_block(s, queries, query, i0, u.first, qt.data() + at, w);
      transposed_block(s, grads, query, i0, u.first, dot.data() + at, w);
    }
    configure();
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < units.size(); ++i) {
      const Unit& u = units[i];
      const int64_t at = p.keys[u.sequence];
      backward_unit(p.shapes[u.sequence], u, grads, vp.data() + at, kr.data() + at,
                    probs + p.pairs[u.sequence], ds.get() + p.pairs[u.sequence], dq, g_head,
                    g_token, scale, w);
    }
    // (the loop's implicit barrier: every block's dS is written before the keys' sums)
#pragma omp for schedule(dynamic)
    for (size_t i = 0; i < groups_of_keys.size(); ++i) {
      const Unit& u = groups_of_keys[i];
      const Shape& s = p.shapes[u.sequence];
      const int64_t n = std::min<int64_t>(kWide, (s.padded() - u.first) / kBlock);
      const int64_t at = p.rows[u.sequence];
      key_unit(s, u.head, u.first, n, qt.data() + at, dot.data() + at,
               probs + p.pairs[u.sequence], ds.get() + p.pairs[u.sequence], dk, dv, dk_head,
               dk_token, w.scores.data(), w.ranges);
    }
    release();
  }
}
