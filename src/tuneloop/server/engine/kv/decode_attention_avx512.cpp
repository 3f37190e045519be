// The decode rows' attention over a paged KV pool, bf16, for x86-64 CPUs with AVX512-BF16
// (native_decode.py builds and loads it). One query per row and head; each row's keys and
// values are read from the pool through its slots, all of a slot's heads at once (they are
// contiguous there). Scores: for 16 keys at a time, each (head, key) pair's bf16 products
// summed in fp32 by vdpbf16ps into a vector of partial sums, the 16 vectors then summed
// across their lanes together (a transpose-and-add tree: no lane-by-lane sum per score, which
// is what a compiler makes of a dot product). Softmax in fp32, exp by a polynomial; values
// summed in fp32 registers, a key head's query heads together; the result rounded to bf16
// once. Rows run in parallel under OpenMP. A row's result does not depend on the other rows
// or on its padding: masked keys are never read and add exact zeros. The pool is far larger
// than the caches, so each key's and value's lines are asked into L2 24 keys ahead and the
// keys' into L1 8 keys ahead (a layer of 128 rows x 471-568 slots on an EPYC: 3.66 -> 2.43 ms
// against the keys 16 ahead into L1 and the values as their key was scored); the values'
// pass asks for each key's lines into L1 32 keys ahead (1.10-1.13x at 251-568 slots).
// attend_row_fixed makes the same sums with fewer instructions for the common head shapes;
// attend_row takes the others.
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <cmath>
#include <cstdint>

#include "decode_rows.h"

namespace {

// exp(x) for x <= 0, 16 lanes: 2^(x log2 e) as an integer power and a degree-6 polynomial of
// the fraction (relative error up to ~8e-6 over [-87, 0], measured against fp64, far below
// the bf16 output's rounding); below -87 (exp underflows fp32's normal range) 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  const __m512i e = _mm512_slli_epi32(biased, 23);
  const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), out);
}

// 16 vectors -> one vector of their 16 horizontal sums, in order: out[i] = sum(v[i]).
inline __m512 sum16(const float* p) {
  __m512 v[16], a[8], b[4], c[2];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(p + 16 * i);
  for (int i = 0; i < 8; ++i)  // within 128-bit lanes: pairs' elements interleaved, half summed
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: the sums of 4 vectors' lane quarter
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// Every cache line of `elements` bf16 values from p, into the cache level of Hint.
template <int Hint>
inline void prefetch(const uint16_t* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elements * 2; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(Hint));
}

// The scores' loops' requests ahead, both loops: at a row's start its first 24 keys' and
// values' lines into L2 (1.02x at 49-80 slots on a Zen 5 EPYC: the loop's own requests do not
// cover them); at key j, the keys and values 24 places on into L2 and the keys 8 places on
// from there into L1. A row's blocks are scattered through a pool far larger than the caches,
// and the L2's misses in flight are many more than the L1's (a layer of 128 rows x 520 slots
// on an EPYC: 3.2 ms asking only for the keys 16 on into L1, 2.1 ms so; on a Zen 5 EPYC, 40
// or 64 places on were slower, and none for the values 0.97x). k_row, v_row: a slot's keys
// and values, all heads, in elements. Always inlined: left to the compiler, the scores' loop
// called them, and a layer took 1.37x as long.
[[gnu::always_inline]] inline void ask_first(const uint16_t* kp, const uint16_t* vp,
                                             const int64_t* at, const bool* live, int64_t width,
                                             int64_t k_row, int64_t v_row) {
  for (int64_t j = 0; j < 24 && j < width; ++j) {
    if (!live[j]) continue;
    prefetch<_MM_HINT_T1>(kp + at[j] * k_row, k_row);
    prefetch<_MM_HINT_T1>(vp + at[j] * v_row, v_row);
  }
}

[[gnu::always_inline]] inline void ask_ahead(const uint16_t* kp, const uint16_t* vp,
                                             const int64_t* at, const bool* live, int64_t width,
                                             int64_t j, int64_t k_row, int64_t v_row) {
  if (j + 24 < width && live[j + 24]) {
    prefetch<_MM_HINT_T1>(kp + at[j + 24] * k_row, k_row);
    prefetch<_MM_HINT_T1>(vp + at[j + 24] * v_row, v_row);
  }
  if (j + 8 < width && live[j + 8]) prefetch<_MM_HINT_T0>(kp + at[j + 8] * k_row, k_row);
}

inline __m512 bf16_to_fp32(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// A chunk of 16 keys' scores from their partial sums (part [heads, 16 keys, 16 lanes]):
// scaled, masked keys -inf, into scores [heads, padded] at the chunk's place.
inline void chunk_scores(const float* part, __mmask16 mask, int64_t heads, float scale,
                         float* scores, int64_t padded) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    const __m512 s = _mm512_mul_ps(sum16(part + hq * 256), _mm512_set1_ps(scale));
    _mm512_storeu_ps(scores + hq * padded, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, s));
  }
}

// Each head's scores (padded to 16, masked ones -inf) -> exp(score - max) in fp32, their sum
// in total.
void softmax(float* scores, int64_t padded, int64_t heads, float* total) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* s = scores + hq * padded;
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < padded; j0 += 16)
      best = _mm512_max_ps(best, _mm512_loadu_ps(s + j0));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j0), m));
      _mm512_storeu_ps(s + j0, p);
      sum = _mm512_add_ps(sum, p);
    }
    total[hq] = _mm512_reduce_add_ps(sum);
  }
}

void attend_row(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* at,
                const bool* live, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                int64_t dim_v, float scale, uint16_t* out, float* scores, float* part,
                float* total) {
  const int64_t groups = heads / kv_heads, padded = (width + 15) / 16 * 16, words = dim / 32;
  // scores, 16 keys at a time: each (head, key) a vector of partial sums (bf16 pairs
  // multiplied and summed in fp32 by vdpbf16ps), the 16 keys' vectors then summed at once
  ask_first(kp, vp, at, live, width, kv_heads * dim, kv_heads * dim_v);
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = j0 + jj;
      if (j >= width || !live[j]) {
        for (int64_t hq = 0; hq < heads; ++hq)
          _mm512_storeu_ps(part + (hq * 16 + jj) * 16, _mm512_setzero_ps());
        continue;
      }
      const uint16_t* k = kp + at[j] * kv_heads * dim;
      ask_ahead(kp, vp, at, live, width, j, kv_heads * dim, kv_heads * dim_v);
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t hq = h * groups + g;
          __m512 s = _mm512_setzero_ps();
          for (int64_t w = 0; w < words; ++w) {
            const __m512bh kw = (__m512bh)_mm512_loadu_si512(k + h * dim + w * 32);
            const __m512bh qw = (__m512bh)_mm512_loadu_si512(q + hq * dim + w * 32);
            s = _mm512_dpbf16_ps(s, qw, kw);
          }
          _mm512_storeu_ps(part + (hq * 16 + jj) * 16, s);
        }
      }
    }
    __mmask16 mask = 0;
    for (int64_t jj = 0; jj < 16; ++jj)
      if (j0 + jj < width && live[j0 + jj]) mask |= static_cast<__mmask16>(1u << jj);
    chunk_scores(part, mask, heads, scale, scores + j0, padded);
  }
  softmax(scores, padded, heads, total);
  // values: per key head, 32 of its dims and up to 12 of its query heads at a time in registers
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < groups; g0 += 12) {
      const int64_t gn = groups - g0 < 12 ? groups - g0 : 12;
      for (int64_t d0 = 0; d0 < dim_v; d0 += 32) {
        __m512 a[12][2];
        for (int64_t g = 0; g < gn; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; ++j) {
          if (!live[j]) continue;
          if (j + 32 < width && live[j + 32])  // as attend_row_fixed, which measured it
            prefetch<_MM_HINT_T0>(vp + (at[j + 32] * kv_heads + h) * dim_v + d0, 32);
          const uint16_t* v = vp + (at[j] * kv_heads + h) * dim_v + d0;
          const __m512 v0 = bf16_to_fp32(_mm256_loadu_si256((const __m256i*)v));
          const __m512 v1 = bf16_to_fp32(_mm256_loadu_si256((const __m256i*)(v + 16)));
          for (int64_t g = 0; g < gn; ++g) {
            const __m512 p = _mm512_set1_ps(scores[(h * groups + g0 + g) * padded + j]);
            a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
          }
        }
        for (int64_t g = 0; g < gn; ++g) {
          const int64_t hq = h * groups + g0 + g;
          const __m512 inv = _mm512_set1_ps(1.0f / total[hq]);
          uint16_t* o = out + hq * dim_v + d0;
          for (int half = 0; half < 2; ++half) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(a[g][half], inv));
            _mm256_storeu_si256((__m256i*)(o + 16 * half), (__m256i)rounded);
          }
        }
      }
    }
  }
}

// The same sums as attend_row, in the same order (so the same bits), for head sizes of W x 32
// and G query heads per key head known at compile time (head sizes 64 and 128, up to 8 query
// heads per key head: the models served). The scores take a key's heads one after another, so
// a slot's keys are read in order, whole (a row of 49-80 slots on a Zen 5 EPYC, the pool
// cold: 1.04x the heads' passes over the keys one head at a time, which kept each head's
// queries in registers; the queries now come from L1); a key's values are widened to fp32 by
// one unpack per 16 dims, interleaved with zeros (lanes in a fixed permuted order, put back
// once at the end), where attend_row spends two loads and four operations per 32 dims; all 64
// of a value head's dims at a time where G <= 4 (G x 4 accumulators). In a layer of 128 rows x
// 520 slots on an EPYC with the pool in cache: 1.64 -> 1.10 ms.
template <int W, int G>
void attend_row_fixed(const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                      const int64_t* at, const bool* live, int64_t width, int64_t kv_heads,
                      float scale, uint16_t* out, float* scores, float* part, float* total) {
  constexpr int64_t dim = W * 32;
  constexpr int VD = G <= 4 ? 64 : 32;  // value dims per pass: G x VD/16 accumulators
  constexpr int VN = VD / 16;
  const int64_t heads = kv_heads * G, padded = (width + 15) / 16 * 16;
  const int64_t row = kv_heads * dim;  // a slot's keys (and values), all heads
  ask_first(kp, vp, at, live, width, row, row);
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    const int64_t jn = width - j0 < 16 ? width - j0 : 16;
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = j0 + jj;
      if (jj >= jn || !live[j]) {
        for (int64_t hq = 0; hq < heads; ++hq)
          _mm512_storeu_ps(part + (hq * 16 + jj) * 16, _mm512_setzero_ps());
        continue;
      }
      ask_ahead(kp, vp, at, live, width, j, row, row);
      const uint16_t* key = kp + at[j] * row;
      for (int64_t h = 0; h < kv_heads; ++h) {
        __m512bh kr[W];
        for (int w = 0; w < W; ++w) kr[w] = (__m512bh)_mm512_loadu_si512(key + h * dim + w * 32);
        for (int g = 0; g < G; ++g) {
          const uint16_t* qh = q + (h * G + g) * dim;
          __m512 s = _mm512_setzero_ps();
          for (int w = 0; w < W; ++w)
            s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qh + w * 32), kr[w]);
          _mm512_storeu_ps(part + ((h * G + g) * 16 + jj) * 16, s);
        }
      }
    }
    __mmask16 mask = 0;
    for (int64_t jj = 0; jj < jn; ++jj)
      if (live[j0 + jj]) mask |= static_cast<__mmask16>(1u << jj);
    chunk_scores(part, mask, heads, scale, scores + j0, padded);
  }
  softmax(scores, padded, heads, total);
  const __m512i zero = _mm512_setzero_si512();
  alignas(64) float lanes[16];
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t d0 = 0; d0 < dim; d0 += VD) {
      __m512 a[G][VN];
      for (int g = 0; g < G; ++g)
        for (int n = 0; n < VN; ++n) a[g][n] = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; ++j) {
        if (!live[j]) continue;
        // the scores asked for these lines into L2; into L1 32 keys ahead, as the loop reads
        // them (128 rows x 471-568 slots on an EPYC: 1.13x the loop without)
        if (j + 32 < width && live[j + 32])
          prefetch<_MM_HINT_T0>(vp + at[j + 32] * row + h * dim + d0, VD);
        const uint16_t* v = vp + at[j] * row + h * dim + d0;
        __m512 vf[VN];
        for (int n = 0; n < VN / 2; ++n) {  // 32 dims: lanes (0-3, 8-11, ...) and (4-7, ...)
          const __m512i x = _mm512_loadu_si512(v + 32 * n);
          vf[2 * n] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
          vf[2 * n + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
        }
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[(h * G + g) * padded + j]);
          for (int n = 0; n < VN; ++n) a[g][n] = _mm512_fmadd_ps(p, vf[n], a[g][n]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        const __m512 inv = _mm512_set1_ps(1.0f / total[hq]);
        uint16_t* o = out + hq * dim + d0;
        for (int n = 0; n < VN; n += 2) {  // lanes back in order: 32 dims from a pair
          alignas(64) float dims[32];
          for (int half = 0; half < 2; ++half) {
            _mm512_store_ps(lanes, _mm512_mul_ps(a[g][n + half], inv));
            for (int l = 0; l < 4; ++l)
              for (int e = 0; e < 4; ++e) dims[8 * l + 4 * half + e] = lanes[4 * l + e];
          }
          for (int c = 0; c < 2; ++c) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_load_ps(dims + 16 * c));
            _mm256_storeu_si256((__m256i*)(o + 16 * n + 16 * c), (__m256i)rounded);
          }
        }
      }
    }
  }
}

using FixedRow = decode_rows::FixedRow<uint16_t>;

template <int W>
FixedRow fixed_for_groups(int64_t groups) {
  switch (groups) {
    case 1: return attend_row_fixed<W, 1>;
    case 2: return attend_row_fixed<W, 2>;
    case 3: return attend_row_fixed<W, 3>;
    case 4: return attend_row_fixed<W, 4>;
    case 5: return attend_row_fixed<W, 5>;
    case 6: return attend_row_fixed<W, 6>;
    case 7: return attend_row_fixed<W, 7>;
    case 8: return attend_row_fixed<W, 8>;
    default: return nullptr;
  }
}

// attend_row_fixed's instance for a model's heads, or nullptr (attend_row takes them).
FixedRow fixed_row(int64_t heads, int64_t kv_heads, int64_t dim, int64_t dim_v) {
  if (dim != dim_v) return nullptr;
  if (dim == 64) return fixed_for_groups<2>(heads / kv_heads);
  if (dim == 128) return fixed_for_groups<4>(heads / kv_heads);
  return nullptr;
}

int attend(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* slots,
           const bool* mask, int64_t rows, int64_t width, int64_t heads, int64_t kv_heads,
           int64_t dim, int64_t dim_v, float scale, uint16_t* out, int threads, bool fixed_rows) {
  if (kv_heads <= 0 || heads % kv_heads || dim % 32 || dim_v % 32 || width <= 0) return 1;
  // scores in chunks of 16 keys; part: each head's 16 keys' partial sums of 16 lanes
  decode_rows::attend_rows(q, kp, vp, slots, mask, rows, width, heads, kv_heads, dim, dim_v,
                           scale, out, threads, 16, heads * 256,
                           fixed_rows ? fixed_row(heads, kv_heads, dim, dim_v) : nullptr,
                           attend_row);
  return 0;
}

}  // namespace

// q [rows, heads, dim], pools [slots, kv_heads, dim | dim_v], slots and mask [rows, width]
// (every row attends to at least one slot), out [rows, heads, dim_v]; all contiguous.
// 0, or 1 for shapes the kernel does not take (head sizes not multiples of 32).
extern "C" int decode_attention_bf16(const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                                     const int64_t* slots, const bool* mask, int64_t rows,
                                     int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                                     int64_t dim_v, float scale, uint16_t* out, int threads) {
  return attend(q, kp, vp, slots, mask, rows, width, heads, kv_heads, dim, dim_v, scale, out,
                threads, true);
}

// The same, every row by attend_row (tests hold attend_row_fixed to its bits).
extern "C" int decode_attention_bf16_generic(
    const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* slots,
    const bool* mask, int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t dim_v, float scale, uint16_t* out, int threads) {
  return attend(q, kp, vp, slots, mask, rows, width, heads, kv_heads, dim, dim_v, scale, out,
                threads, false);
}
