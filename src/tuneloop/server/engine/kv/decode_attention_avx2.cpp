// The decode rows' attention over a paged KV pool, fp32, for x86-64 CPUs with AVX2 and FMA (every
// x86-64 server CPU of the last decade; native_decode.py builds and loads it): the fp32 engine's
// counterpart of decode_attention_avx512.cpp. One query per row and head; each row's keys and
// values are read from the pool through its slots, all of a slot's heads at once (they are
// contiguous there). Scores: for 8 keys at a time, each (head, key) pair's products summed by
// FMAs into a vector of partial sums, the 8 vectors then summed across their lanes together
// (horizontal adds and one lane swap: no sum per score). Softmax in fp32, exp by a polynomial to
// about an ulp; values summed in fp32 registers, up to 6 of a key head's query heads at a time.
// Rows run in parallel under OpenMP. A row's result does not depend on the other rows or on its
// padding: masked keys are never read and add exact zeros. The pool is far larger than the
// caches, so each key's and value's lines are asked into L2 24 keys ahead and the keys' into L1 8
// keys ahead, as the bf16 kernel does. For head sizes 64 and 128, attend_row_fixed keeps a query
// head's dims in registers, scores two keys at a time in two FMA chains each, and sums the values
// in spans of 64 keys that stay in cache (their lines asked into L2 a span ahead, into L1 16
// keys ahead of each pass over a span).
#if !defined(__AVX2__) || !defined(__FMA__)
#error "this kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <cmath>
#include <cstdint>

#include "decode_rows.h"

namespace {

// exp(x) for x <= 0, 8 lanes, to about an ulp of fp32 (this is the fp32 engine's path, whose
// sampler and training logprobs agree to fp32's rounding): x = n ln2 + r, |r| <= ln2 / 2 (ln2
// in two parts, Cody-Waite), e^r by Cephes' degree-5 polynomial, times 2^n; below -87
// (exp underflows fp32's normal range) 0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, out);
}

// 8 vectors -> one vector of their 8 horizontal sums, in order: out[i] = sum(v[i]).
inline __m256 sum8(const float* p) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  // b0: (v0..v3 over lanes 0-3 | the same over lanes 4-7); b1 likewise for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Every cache line of `elements` fp32 values from p, into the cache level of Hint.
template <int Hint>
inline void prefetch(const float* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elements * 4; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(Hint));
}

// A chunk of 8 keys' scores from their partial sums (part [heads, 8 keys, 8 lanes]): scaled,
// the keys whose `keep` is 0 -inf, into scores [heads, padded] at the chunk's place.
inline void chunk_scores(const float* part, const float* keep, int64_t heads, float scale,
                         float* scores, int64_t padded) {
  const __m256 kept = _mm256_cmp_ps(_mm256_loadu_ps(keep), _mm256_setzero_ps(), _CMP_NEQ_OQ);
  for (int64_t hq = 0; hq < heads; ++hq) {
    const __m256 s = _mm256_mul_ps(sum8(part + hq * 64), _mm256_set1_ps(scale));
    _mm256_storeu_ps(scores + hq * padded, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, kept));
  }
}

// Each head's scores (padded to 8, masked ones -inf) -> exp(score - max), their sum in total.
void softmax(float* scores, int64_t padded, int64_t heads, float* total) {
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* s = scores + hq * padded;
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < padded; j0 += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(s + j0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    float top = lanes[0];
    for (int i = 1; i < 8; ++i) top = lanes[i] > top ? lanes[i] : top;
    const __m256 m = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j0), m));
      _mm256_storeu_ps(s + j0, p);
      sum = _mm256_add_ps(sum, p);
    }
    _mm256_store_ps(lanes, sum);
    float t = 0.0f;
    for (int i = 0; i < 8; ++i) t += lanes[i];
    total[hq] = t;
  }
}

void attend_row(const float* q, const float* kp, const float* vp, const int64_t* at,
                const bool* live, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                int64_t dim_v, float scale, float* out, float* scores, float* part,
                float* total) {
  const int64_t groups = heads / kv_heads, padded = (width + 7) / 8 * 8, words = dim / 8;
  const int64_t row_k = kv_heads * dim, row_v = kv_heads * dim_v;
  for (int64_t j0 = 0; j0 < padded; j0 += 8) {
    for (int64_t jj = 0; jj < 8; ++jj) {
      const int64_t j = j0 + jj;
      if (j >= width || !live[j]) {
        for (int64_t hq = 0; hq < heads; ++hq)
          _mm256_storeu_ps(part + (hq * 8 + jj) * 8, _mm256_setzero_ps());
        continue;
      }
      if (j + 24 < width && live[j + 24]) {
        prefetch<_MM_HINT_T1>(kp + at[j + 24] * row_k, row_k);
        prefetch<_MM_HINT_T1>(vp + at[j + 24] * row_v, row_v);
      }
      if (j + 8 < width && live[j + 8]) prefetch<_MM_HINT_T0>(kp + at[j + 8] * row_k, row_k);
      const float* k = kp + at[j] * row_k;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t hq = h * groups + g;
          __m256 s = _mm256_setzero_ps();
          for (int64_t w = 0; w < words; ++w)
            s = _mm256_fmadd_ps(_mm256_loadu_ps(q + hq * dim + w * 8),
                                _mm256_loadu_ps(k + h * dim + w * 8), s);
          _mm256_storeu_ps(part + (hq * 8 + jj) * 8, s);
        }
      }
    }
    alignas(32) float keep[8];
    for (int64_t jj = 0; jj < 8; ++jj)
      keep[jj] = j0 + jj < width && live[j0 + jj] ? 1.0f : 0.0f;
    chunk_scores(part, keep, heads, scale, scores + j0, padded);
  }
  softmax(scores, padded, heads, total);
  // values: per key head, 16 of its dims and up to 6 of its query heads at a time in registers
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < groups; g0 += 6) {
      const int64_t gn = groups - g0 < 6 ? groups - g0 : 6;
      for (int64_t d0 = 0; d0 < dim_v; d0 += 16) {
        __m256 a[6][2];
        for (int64_t g = 0; g < gn; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < width; ++j) {
          if (!live[j]) continue;
          if (j + 16 < width && live[j + 16])  // as the common shapes' loop, which measured it
            prefetch<_MM_HINT_T0>(vp + at[j + 16] * row_v + h * dim_v + d0, 16);
          const float* v = vp + at[j] * row_v + h * dim_v + d0;
          const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
          for (int64_t g = 0; g < gn; ++g) {
            const __m256 p = _mm256_broadcast_ss(scores + (h * groups + g0 + g) * padded + j);
            a[g][0] = _mm256_fmadd_ps(p, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(p, v1, a[g][1]);
          }
        }
        for (int64_t g = 0; g < gn; ++g) {
          const int64_t hq = h * groups + g0 + g;
          const __m256 inv = _mm256_set1_ps(1.0f / total[hq]);
          _mm256_storeu_ps(out + hq * dim_v + d0, _mm256_mul_ps(a[g][0], inv));
          _mm256_storeu_ps(out + hq * dim_v + d0 + 8, _mm256_mul_ps(a[g][1], inv));
        }
      }
    }
  }
}

// attend_row for head sizes of 64 and 128 (DW x 8 dims) and G query heads per key head known
// at compile time: a query head's 64 dims at a time stay in 8 registers while the chunk's keys
// are scored two at a time, each score summed in two chains (the even and odd 8 dims) so that
// the FMAs' latency overlaps; the values summed for two keys at a time into two sets of
// accumulators. Other sums' order than attend_row's: another rounding, as exact.
template <int DW, int G>
void attend_row_fixed(const float* q, const float* kp, const float* vp, const int64_t* at,
                      const bool* live, int64_t width, int64_t kv_heads, float scale,
                      float* out, float* scores, float* part, float* total) {
  constexpr int64_t dim = DW * 8;
  constexpr int GB = G <= 3 ? G : (G % 3 == 0 ? 3 : 2);  // query heads per values pass
  const int64_t heads = kv_heads * G, padded = (width + 7) / 8 * 8, row = kv_heads * dim;
  for (int64_t j0 = 0; j0 < padded; j0 += 8) {
    alignas(32) float keep[8];
    for (int64_t jj = 0; jj < 8; ++jj) {
      const int64_t j = j0 + jj;
      const bool on = j < width && live[j];
      keep[jj] = on ? 1.0f : 0.0f;
      if (!on) continue;
      if (j + 24 < width && live[j + 24]) prefetch<_MM_HINT_T1>(kp + at[j + 24] * row, row);
      if (j + 8 < width && live[j + 8]) prefetch<_MM_HINT_T0>(kp + at[j + 8] * row, row);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        for (int wb = 0; wb < DW; wb += 8) {
          __m256 qr[8];
          for (int w = 0; w < 8; ++w) qr[w] = _mm256_loadu_ps(q + hq * dim + (wb + w) * 8);
          for (int64_t jj = 0; jj < 8; jj += 2) {
            __m256 s[2][2];
            for (int e = 0; e < 2; ++e) {
              s[e][0] = s[e][1] = _mm256_setzero_ps();
              const int64_t j = j0 + jj + e;
              if (!keep[jj + e]) continue;
              const float* k = kp + at[j] * row + h * dim + wb * 8;
              for (int w = 0; w < 8; w += 2) {
                s[e][0] = _mm256_fmadd_ps(qr[w], _mm256_loadu_ps(k + w * 8), s[e][0]);
                s[e][1] = _mm256_fmadd_ps(qr[w + 1], _mm256_loadu_ps(k + w * 8 + 8), s[e][1]);
              }
            }
            for (int e = 0; e < 2; ++e) {
              float* dst = part + (hq * 8 + jj + e) * 8;
              const __m256 sum = _mm256_add_ps(s[e][0], s[e][1]);
              _mm256_storeu_ps(dst, wb ? _mm256_add_ps(_mm256_loadu_ps(dst), sum) : sum);
            }
          }
        }
      }
    }
    chunk_scores(part, keep, heads, scale, scores + j0, padded);
  }
  softmax(scores, padded, heads, total);
  // values in spans of 64 keys (48 KB of a head's 64 dims at fp32 at most: they stay in L1
  // and L2 across the span's passes), the next span's lines asked for while one is summed,
  // and within a pass each key's line into L1 16 keys ahead (128 rows x 471-568 slots on an
  // EPYC: 1.16x the passes without; 8 keys ahead 1.08x, 24 and 32 no better than 16);
  // the accumulators of every (key head, 16 dims, query head) kept in `acc` between spans
  constexpr int64_t SPAN = 64, PF = 16;
  float* acc = part;  // [heads, dim] (part holds heads x 64 floats: dim <= 128 needs 2x)
  for (int64_t i = 0; i < heads * dim; ++i) acc[i] = 0.0f;
  for (int64_t s0 = 0; s0 < width; s0 += SPAN) {
    const int64_t s1 = s0 + SPAN < width ? s0 + SPAN : width;
    for (int64_t j = s1; j < s1 + SPAN && j < width; ++j)
      if (live[j]) prefetch<_MM_HINT_T1>(vp + at[j] * row, row);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int g0 = 0; g0 < G; g0 += GB) {
        for (int64_t d0 = 0; d0 < dim; d0 += 16) {
          __m256 a[2][GB][2];
          for (int g = 0; g < GB; ++g) {
            const float* from = acc + (h * G + g0 + g) * dim + d0;
            a[0][g][0] = _mm256_loadu_ps(from);
            a[0][g][1] = _mm256_loadu_ps(from + 8);
            a[1][g][0] = a[1][g][1] = _mm256_setzero_ps();
          }
          const float* p0 = scores + (h * G + g0) * padded;
          int64_t j = s0;
          for (; j + 1 < s1; j += 2) {
            for (int e = 0; e < 2; ++e) {
              if (!live[j + e]) continue;
              if (j + e + PF < s1 && live[j + e + PF])
                prefetch<_MM_HINT_T0>(vp + at[j + e + PF] * row + h * dim + d0, 16);
              const float* v = vp + at[j + e] * row + h * dim + d0;
              const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
              for (int g = 0; g < GB; ++g) {
                const __m256 p = _mm256_broadcast_ss(p0 + g * padded + j + e);
                a[e][g][0] = _mm256_fmadd_ps(p, v0, a[e][g][0]);
                a[e][g][1] = _mm256_fmadd_ps(p, v1, a[e][g][1]);
              }
            }
          }
          if (j < s1 && live[j]) {
            const float* v = vp + at[j] * row + h * dim + d0;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            for (int g = 0; g < GB; ++g) {
              const __m256 p = _mm256_broadcast_ss(p0 + g * padded + j);
              a[0][g][0] = _mm256_fmadd_ps(p, v0, a[0][g][0]);
              a[0][g][1] = _mm256_fmadd_ps(p, v1, a[0][g][1]);
            }
          }
          for (int g = 0; g < GB; ++g) {
            float* to = acc + (h * G + g0 + g) * dim + d0;
            _mm256_storeu_ps(to, _mm256_add_ps(a[0][g][0], a[1][g][0]));
            _mm256_storeu_ps(to + 8, _mm256_add_ps(a[0][g][1], a[1][g][1]));
          }
        }
      }
    }
  }
  for (int64_t hq = 0; hq < heads; ++hq) {
    const __m256 inv = _mm256_set1_ps(1.0f / total[hq]);
    for (int64_t d0 = 0; d0 < dim; d0 += 8)
      _mm256_storeu_ps(out + hq * dim + d0,
                       _mm256_mul_ps(_mm256_loadu_ps(acc + hq * dim + d0), inv));
  }
}

using FixedRow = decode_rows::FixedRow<float>;

template <int DW>
FixedRow fixed_for_groups(int64_t groups) {
  switch (groups) {
    case 1: return attend_row_fixed<DW, 1>;
    case 2: return attend_row_fixed<DW, 2>;
    case 3: return attend_row_fixed<DW, 3>;
    case 4: return attend_row_fixed<DW, 4>;
    case 6: return attend_row_fixed<DW, 6>;
    case 8: return attend_row_fixed<DW, 8>;
    default: return nullptr;
  }
}

// attend_row_fixed's instance for a model's heads, or nullptr (attend_row takes them).
FixedRow fixed_row(int64_t heads, int64_t kv_heads, int64_t dim, int64_t dim_v) {
  if (dim != dim_v) return nullptr;
  if (dim == 64) return fixed_for_groups<8>(heads / kv_heads);
  if (dim == 128) return fixed_for_groups<16>(heads / kv_heads);
  return nullptr;
}

}  // namespace

// q [rows, heads, dim], pools [slots, kv_heads, dim | dim_v], slots and mask [rows, width]
// (every row attends to at least one slot), out [rows, heads, dim_v]; all fp32, contiguous.
// 0, or 1 for shapes the kernel does not take (head sizes not multiples of 16).
extern "C" int decode_attention_fp32(const float* q, const float* kp, const float* vp,
                                     const int64_t* slots, const bool* mask, int64_t rows,
                                     int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                                     int64_t dim_v, float scale, float* out, int threads) {
  if (kv_heads <= 0 || heads % kv_heads || dim % 16 || dim_v % 16 || width <= 0) return 1;
  // scores in chunks of 8 keys; part: each head's 8 keys' partial sums of 8 lanes, or the
  // common shapes' loop's value sums of a head (dim_v floats)
  decode_rows::attend_rows(q, kp, vp, slots, mask, rows, width, heads, kv_heads, dim, dim_v,
                           scale, out, threads, 8, heads * (dim_v > 64 ? dim_v : 64),
                           fixed_row(heads, kv_heads, dim, dim_v), attend_row);
  return 0;
}
