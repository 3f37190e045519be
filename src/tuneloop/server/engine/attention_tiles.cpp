// Causal attention of one packed sequence, forward and backward, on the AMX tile unit at bf16:
// causal_cpu.py's matmul kernel for short sequences (native_attention.py builds and loads it).
//
// torch makes the matmul kernel of a sequence of ~150 tokens (SmolLM2's 9 query heads over 3
// key heads) as a dozen operations of which each costs more than its arithmetic: the fp32
// copies of q and k, batched matmuls run at a tenth of the bf16 peak on such shapes, the
// bias, the softmax, the downcast, and in the backward four more matmuls and the softmax's
// gradient; about 1 ms a sequence and layer, 16 % of a training step for 3 % of its FLOPs.
// Here a key head's stacked query rows go 16 at a time through the tile unit and the vector
// unit while they are in cache, and only the key blocks at or before the diagonal are
// computed.
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
#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AMX_TILE__) || \
    !defined(__AMX_BF16__)
#error "this kernel needs AVX512F, AVX512-BF16, AMX-TILE and AMX-BF16"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "vec512.h"

namespace {

constexpr int kBlock = 16;  // rows of a tile; columns of a C tile
constexpr int kDepth = 32;  // bf16 values of k in one tile row
constexpr int kWide = 4;    // C tiles 0-3; A in tile 4, B in tile 5
// Scratch rows are padded by 64 bytes: rows 4 KB apart (a 1,024-key block of fp32 scores)
// would all fall in one set of the L1 cache as a tile loads or stores them.
constexpr int kPad = 32;

inline int64_t up32(int64_t n) { return (n + kDepth - 1) / kDepth * kDepth; }

void configure() {
  amx::TileConfig config;
  for (int t = 0; t < 6; ++t) config.rows[t] = kBlock, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// The right side of a product: pair row p (inputs 2p and 2p + 1, interleaved per column) of
// column block n at b + p * pair + n * block. A tile of it is 16 pair rows `pair` apart.
struct Right {
  const uint16_t* b;
  int64_t pair, block;
};

// C [16, 16 J] fp32 (row stride ldc) = A [16, k] times B over the k of `ranges` (pairs of
// [begin, end), multiples of 32). A: bf16 rows of stride lda.
template <int J>
void product(const uint16_t* a, int64_t lda, Right r, const int64_t* ranges, int count, float* c,
             int64_t ldc) {
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

// A C block [16, d] fp32 rounded into 16 bf16 rows of stride d.
void store_rows(const float* c, int64_t d, uint16_t* out) {
  for (int t = 0; t < kBlock; ++t)
    for (int64_t j = 0; j < d; j += 16)
      _mm256_storeu_si256((__m256i*)(out + t * d + j), to_bf16(_mm512_loadu_ps(c + t * d + j)));
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

struct Shape {
  int64_t heads, groups, length, dim;  // key heads, query heads per key head, tokens, head size
  int64_t rows() const { return groups * length; }           // a key head's stacked query rows
  int64_t rows32() const { return up32(rows()); }
  int64_t keys32() const { return up32(length); }
  int64_t units() const { return heads * rows() / kBlock; }  // 16-row blocks
  int64_t wide() const { return keys32() + kPad; }           // a scratch row's bf16 values
  // A key head's probabilities (or dS) as pairs of rows: [rows32 / 2][keys32][2], written a
  // pair row at a time.
  int64_t pairs() const { return keys32() * rows32(); }
  Right pairs_of(const uint16_t* head) const { return {head, 2 * keys32(), 32}; }
};

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

// Per thread: the block's scores [16, wide] fp32 (or a key unit's C block [16, 64]), its
// probabilities (or dS) [16, wide] bf16 and its output [16, dim] fp32.
struct Scratch {
  std::vector<float> scores;
  std::vector<uint16_t> block;
  std::vector<float> out;
  explicit Scratch(const Shape& s)
      : scores(kBlock * std::max<int64_t>(s.wide(), kWide * kBlock)),
        block(kBlock * s.wide()),
        out(kBlock * s.dim) {}
};

// One 16-row block's scores against keys [0, keys) (a multiple of 16): S = Q_rows K^T with
// the rows `token` values apart and `keys_of` the key head's keys as pairs of features.
void scores(const Shape& s, const uint16_t* rows, int64_t token, Right keys_of, int64_t keys,
            float* out) {
  const int64_t depth[2] = {0, s.dim};
  products(rows, token, keys_of, depth, 1, out, s.wide(), keys / kBlock);
}

void forward_unit(const Shape& s, int64_t unit, const Rows& q, const uint16_t* kp,
                  const uint16_t* vr, uint16_t* out, uint16_t* probs, float scale,
                  Scratch& w) {
  const int64_t head = unit / (s.rows() / kBlock), r0 = unit % (s.rows() / kBlock) * kBlock;
  const int64_t i0 = r0 % s.length, keys = i0 + kBlock, width = up32(keys);
  const int64_t k32 = s.keys32(), ld = s.wide();
  const uint16_t* rows = q.at(head * s.groups + r0 / s.length, i0);
  scores(s, rows, q.token, features_of(kp + head * s.dim * k32, s.dim), keys, w.scores.data());
  const __m512 factor = _mm512_set1_ps(scale);
  for (int t = 0; t < kBlock; ++t) {
    float* row = w.scores.data() + t * ld;
    const int64_t valid = i0 + t + 1;  // keys at or before the query's position
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
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 keep = j < valid ? vec512::lanes(valid - j) : 0;  // zero past the diagonal
      const __m512 e = _mm512_maskz_loadu_ps(keep, row + j);
      _mm256_storeu_si256((__m256i*)(p + j), to_bf16(_mm512_mul_ps(e, inverse)));
    }
  }
  store_pairs(s, w.block.data(), ld, width, probs + head * s.pairs(), r0);
  const int64_t keys_range[2] = {0, width};
  products(w.block.data(), ld, Right{vr + head * k32 * s.dim, 2 * s.dim, 32}, keys_range, 1,
           w.out.data(), s.dim, s.dim / kBlock);
  store_rows(w.out.data(), s.dim, out + (head * s.rows() + r0) * s.dim);
}

// One 16-row block of the backward pass: dP = dO V^T, dS = P (dP - rowsum(P dP)) scale,
// written into the pairs layout ds, and dQ = dS K.
void backward_unit(const Shape& s, int64_t unit, const Rows& dout, const uint16_t* vp,
                   const uint16_t* kr, const uint16_t* probs, uint16_t* ds, uint16_t* dq,
                   float scale, Scratch& w) {
  const int64_t head = unit / (s.rows() / kBlock), r0 = unit % (s.rows() / kBlock) * kBlock;
  const int64_t i0 = r0 % s.length, keys = i0 + kBlock, width = up32(keys);
  const int64_t k32 = s.keys32(), ld = s.wide();
  const uint16_t* rows = dout.at(head * s.groups + r0 / s.length, i0);
  scores(s, rows, dout.token, features_of(vp + head * s.dim * k32, s.dim), keys,
         w.scores.data());
  // pairs of rows (t, t + 1) as 32-bit values, a pair row of keys32
  const uint32_t* pairs = (const uint32_t*)(probs + head * s.pairs()) + r0 / 2 * k32;
  const __m512 factor = _mm512_set1_ps(scale);
  const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int t = 0; t < kBlock; t += 2) {
    const uint32_t* pt = pairs + t / 2 * k32;
    const float* even = w.scores.data() + t * ld;
    const float* odd = even + ld;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
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
    for (int64_t j = 0; j < width; j += 16) {
      if (j >= keys) {  // zero past the block's keys, up to whole tile rows
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
  store_pairs(s, w.block.data(), ld, width, ds + head * s.pairs(), r0);
  const int64_t keys_range[2] = {0, width};
  products(w.block.data(), ld, Right{kr + head * k32 * s.dim, 2 * s.dim, 32}, keys_range, 1,
           w.out.data(), s.dim, s.dim / kBlock);
  store_rows(w.out.data(), s.dim, dq + (head * s.rows() + r0) * s.dim);
}

// dK and dV of keys [j0, j0 + 16 n) of a key head: dK^T = Q^T dS and dV^T = dO^T P, summed
// over the stacked rows that can see those keys (in 32-row steps; rows that cannot hold
// zeros), written transposed. qt, dot: [heads][dim][ldt].
void key_unit(const Shape& s, int64_t head, int64_t j0, int64_t n, const uint16_t* qt,
              const uint16_t* dot, int64_t ldt, const uint16_t* probs, const uint16_t* ds,
              uint16_t* dk, uint16_t* dv, float* c) {
  std::vector<int64_t> ranges;
  for (int64_t r = 0; r < s.rows32(); r += kDepth) {
    bool sees = false;  // a row of the step at or after j0 in its query head
    for (int64_t g = 0; g < s.groups && !sees; ++g)
      sees = std::max(r, g * s.length + j0) < std::min(r + kDepth, (g + 1) * s.length);
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
  for (int which = 0; which < 2; ++which) {
    const uint16_t* left = lefts[which] + head * s.dim * ldt;
    Right right = s.pairs_of(rights[which] + head * s.pairs());
    right.b += j0 / kBlock * right.block;  // (16 keys' pairs: 32 values on)
    uint16_t* out = outs[which] + (head * s.length + j0) * s.dim;
    for (int64_t c0 = 0; c0 < s.dim; c0 += kBlock) {
      if (count) {
        products(left + c0 * ldt, ldt, right, ranges.data(), count, c, kWide * kBlock, n);
      } else {
        std::memset(c, 0, sizeof(float) * kBlock * kWide * kBlock);
      }
      for (int64_t j = 0; j < n * kBlock; ++j) {  // C [16 features, 16 n keys] transposed
        uint16_t* key = out + j * s.dim + c0;
        for (int f = 0; f < kBlock; ++f) key[f] = bf16::from_float(c[f * kWide * kBlock + j]);
      }
    }
  }
}

// The keys' (or values') layouts of a key head's 16-key block j0: pairs of features
// (Shape: features_of; or null) and pairs of rows ([keys32 / 2][dim][2], or null).
void key_layouts(const Shape& s, const Rows& keys, int64_t head, int64_t j0, uint16_t* features,
                 uint16_t* pairs) {
  const int64_t k32 = s.keys32();
  const uint16_t* rows = keys.at(head, j0);
  if (features) feature_pairs(rows, keys.token, s.dim, j0, features + head * s.dim * k32);
  if (pairs) row_pairs(rows, keys.token, s.dim, j0, pairs + head * k32 * s.dim);
}

}  // namespace

// Whether this process may run the kernels: Linux grants the tile registers.
extern "C" int attention_tiles_ready() { return amx::permitted() ? 1 : 0; }

// q: [query heads, length, dim] rows of features at (head stride, token stride) q_head,
// q_token (a key head's query heads adjacent); k, v: [heads, length, dim] likewise; out
// [heads x groups, length, dim] contiguous; probs [heads, rows32 / 2, keys32, 2] (written
// whole; kept for the backward pass), rows = groups x length. length a multiple of
// 16, dim of 32. Returns 0, or -1 without the tile unit.
extern "C" int attention_forward_bf16(const uint16_t* q, int64_t q_head, int64_t q_token,
                                      const uint16_t* k, int64_t k_head, int64_t k_token,
                                      const uint16_t* v, int64_t v_head, int64_t v_token,
                                      uint16_t* out, uint16_t* probs, int64_t heads,
                                      int64_t groups, int64_t length, int64_t dim, float scale,
                                      int threads) {
  if (!amx::permitted()) return -1;
  const Shape s{heads, groups, length, dim};
  const Rows queries{q, q_head, q_token}, keys{k, k_head, k_token}, values{v, v_head, v_token};
  std::vector<uint16_t> kp(heads * dim * s.keys32()), vr(heads * s.keys32() * dim);  // zeroed
  const int64_t blocks = length / kBlock;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < heads * blocks; ++unit) {
      const int64_t head = unit / blocks, j0 = unit % blocks * kBlock;
      key_layouts(s, keys, head, j0, kp.data(), nullptr);
      key_layouts(s, values, head, j0, nullptr, vr.data());
      if (j0 == 0) zero_padding(s, probs + head * s.pairs());
    }
    configure();
    Scratch w(s);
#pragma omp for schedule(dynamic)
    for (int64_t unit = 0; unit < s.units(); ++unit)
      forward_unit(s, unit, queries, kp.data(), vr.data(), out, probs, scale, w);
    _tile_release();
  }
  return 0;
}

// dout, q, k, v: rows at (head stride, token stride) as the forward's inputs; probs from the
// forward pass; dq [heads x groups, length, dim], dk and dv [heads, length, dim], contiguous.
extern "C" int attention_backward_bf16(const uint16_t* dout, int64_t d_head, int64_t d_token,
                                       const uint16_t* q, int64_t q_head, int64_t q_token,
                                       const uint16_t* k, int64_t k_head, int64_t k_token,
                                       const uint16_t* v, int64_t v_head, int64_t v_token,
                                       const uint16_t* probs, uint16_t* dq, uint16_t* dk,
                                       uint16_t* dv, int64_t heads, int64_t groups,
                                       int64_t length, int64_t dim, float scale, int threads) {
  if (!amx::permitted()) return -1;
  const Shape s{heads, groups, length, dim};
  const Rows grads{dout, d_head, d_token}, queries{q, q_head, q_token};
  const Rows keys{k, k_head, k_token}, values{v, v_head, v_token};
  const int64_t k32 = s.keys32(), ldt = s.rows32() + kPad, blocks = length / kBlock;
  // zeroed: the padding past the keys and rows
  std::vector<uint16_t> vp(heads * dim * k32), kr(heads * k32 * dim);
  std::vector<uint16_t> qt(heads * dim * ldt), dot(heads * dim * ldt);
  std::unique_ptr<uint16_t[]> ds(new uint16_t[heads * s.pairs()]);  // written whole
  const int64_t per_head = (length + kWide * kBlock - 1) / (kWide * kBlock);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < heads * blocks; ++unit) {
      const int64_t head = unit / blocks, j0 = unit % blocks * kBlock;
      key_layouts(s, values, head, j0, vp.data(), nullptr);
      key_layouts(s, keys, head, j0, nullptr, kr.data());
      if (j0 == 0) zero_padding(s, ds.get() + head * s.pairs());
    }
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < s.units(); ++unit) {
      const int64_t head = unit / (s.rows() / kBlock), r0 = unit % (s.rows() / kBlock) * kBlock;
      const int64_t query = head * groups + r0 / length, i0 = r0 % length;
      transposed(queries.at(query, i0), q_token, dim, ldt, r0, qt.data() + head * dim * ldt);
      transposed(grads.at(query, i0), d_token, dim, ldt, r0, dot.data() + head * dim * ldt);
    }
    configure();
    Scratch w(s);
#pragma omp for schedule(dynamic)
    for (int64_t unit = 0; unit < s.units(); ++unit)
      backward_unit(s, unit, grads, vp.data(), kr.data(), probs, ds.get(), dq, scale, w);
    // (the loop's implicit barrier: every block's dS is written before the keys' sums)
#pragma omp for schedule(dynamic)
    for (int64_t unit = 0; unit < heads * per_head; ++unit) {
      const int64_t head = unit / per_head, j0 = unit % per_head * kWide * kBlock;
      const int64_t n = std::min<int64_t>(kWide, (length - j0) / kBlock);
      key_unit(s, head, j0, n, qt.data(), dot.data(), ldt, probs, ds.get(), dk, dv,
               w.scores.data());
    }
    _tile_release();
  }
  return 0;
}
