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
// than the caches, so each key's lines are asked for 16 keys ahead and its values' lines
// while its score is made (in a decode step: 0.42 -> 0.32 ms a layer on an EPYC).
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

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

inline __m512 bf16_to_fp32(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

void attend_row(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, const int64_t* at,
                const bool* live, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                int64_t dim_v, float scale, uint16_t* out, float* scores, float* part,
                float* total) {
  const int64_t groups = heads / kv_heads, padded = (width + 15) / 16 * 16, words = dim / 32;
  // scores, 16 keys at a time: each (head, key) a vector of partial sums (bf16 pairs
  // multiplied and summed in fp32 by vdpbf16ps), the 16 keys' vectors then summed at once
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int64_t j = j0 + jj;
      if (j >= width || !live[j]) {
        for (int64_t hq = 0; hq < heads; ++hq)
          _mm512_storeu_ps(part + (hq * 16 + jj) * 16, _mm512_setzero_ps());
        continue;
      }
      const uint16_t* k = kp + at[j] * kv_heads * dim;
      // the pool is far larger than the caches: ask for the key 16 places on and this
      // key's values (read after the softmax) while the arithmetic runs
      if (j + 16 < width && live[j + 16])
        prefetch<_MM_HINT_T0>(kp + at[j + 16] * kv_heads * dim, kv_heads * dim);
      prefetch<_MM_HINT_T1>(vp + at[j] * kv_heads * dim_v, kv_heads * dim_v);
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
    for (int64_t hq = 0; hq < heads; ++hq) {
      const __m512 s = _mm512_mul_ps(sum16(part + hq * 256), _mm512_set1_ps(scale));
      _mm512_storeu_ps(scores + hq * padded + j0,
                       _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask, s));
    }
  }
  // softmax per head, in fp32
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
  // values: per key head, 32 of its dims and up to 12 of its query heads at a time in registers
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < groups; g0 += 12) {
      const int64_t gn = groups - g0 < 12 ? groups - g0 : 12;
      for (int64_t d0 = 0; d0 < dim_v; d0 += 32) {
        __m512 a[12][2];
        for (int64_t g = 0; g < gn; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; ++j) {
          if (!live[j]) continue;
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

}  // namespace

// q [rows, heads, dim], pools [slots, kv_heads, dim | dim_v], slots and mask [rows, width]
// (every row attends to at least one slot), out [rows, heads, dim_v]; all contiguous.
// 0, or 1 for shapes the kernel does not take (head sizes not multiples of 32).
extern "C" int decode_attention_bf16(const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                                     const int64_t* slots, const bool* mask, int64_t rows,
                                     int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                                     int64_t dim_v, float scale, uint16_t* out, int threads) {
  if (kv_heads <= 0 || heads % kv_heads || dim % 32 || dim_v % 32 || width <= 0) return 1;
  const int64_t padded = (width + 15) / 16 * 16;
  #pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(heads * padded);
    std::vector<float> part(heads * 256), total(heads);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      attend_row(q + r * heads * dim, kp, vp, slots + r * width, mask + r * width, width, heads,
                 kv_heads, dim, dim_v, scale, out + r * heads * dim_v, scores.data(),
                 part.data(), total.data());
  }
  return 0;
}
