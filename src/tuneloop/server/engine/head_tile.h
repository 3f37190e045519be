// A training pass's LM head tile by tile (fused_head.py): the element-wise work on one tile of
// logits [rows, columns of vocabulary], for x86-64 CPUs with AVX512F or AVX2, as loops over the
// tile's stored width (`Logits`: head_tile.cpp's bf16, head_tile_fp32.cpp's fp32; native_head.py
// builds and loads them) in vectors of `Logits::Vec` (vec512.h's 16 lanes, vec256.h's 8).
//
// Eager, a tile's forward statistics are five or six passes over it in fp32 (the upcast at
// bf16, the row maxima, the subtraction, the scaling, exp2, the row sums) and its gradient six
// or seven (the upcast, the subtraction, the scaling, exp2, the product with the gradients'
// sums, the scatter of the targets' gradients, the downcast): on SmolLM2's 49,152-word head,
// ~200 ms of a training step of 1,250 tokens on an AMX Xeon where the head's matmuls take ~65.
// Here each is one pass over the tile, a row at a time (a row of 1,024 logits stays in L1).
//
// exp in fp32 by the reduction and polynomial of SLEEF's expf_u10 (which torch's vectorized
// kernels call), to within an ulp of eager's; the sums run in another order than torch's
// (16 or 8 lanes, then across them), so a row's sums differ from eager's by a few fp32 ulps.
// Rows run in parallel under OpenMP; a row's values depend on that row alone.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>

namespace head_tile {

// Logits: `T` the stored element, `Vec` the vector policy (vec512::Lanes or vec256::Lanes);
// load(p, keep) a vector of them as fp32 (zero outside keep); at(p) one; store(p, keep, v) and
// put(p, v) write gradients back at that width.
template <class Logits>
float row_max(const typename Logits::T* z, int64_t n) {
  using Vec = typename Logits::Vec;
  typename Vec::V high = Vec::set1(-INFINITY);
  for (int64_t j = 0; j < n; j += Vec::kWidth) {
    const typename Vec::Mask keep = Vec::first(n - j);
    high = Vec::max_where(high, keep, Logits::load(z + j, keep));
  }
  return Vec::reduce_max(high);
}

template <class Logits>
float row_exp_sum(const typename Logits::T* z, int64_t n, float shift) {
  using Vec = typename Logits::Vec;
  const typename Vec::V minus = Vec::set1(shift);
  typename Vec::V sum = Vec::set1(0.0f);
  for (int64_t j = 0; j < n; j += Vec::kWidth) {
    const typename Vec::Mask keep = Vec::first(n - j);
    const typename Vec::V e = Vec::exp(Vec::sub(Logits::load(z + j, keep), minus));
    sum = Vec::add_where(sum, keep, e);
  }
  return Vec::reduce_add(sum);
}

// One tile's logits into its rows' running statistics, in place: raw [rows, n] (row stride ld)
// holds vocabulary columns [v0, v0 + n); targets [rows, k] (vocabulary ids, row stride k);
// high, total [rows]: the running maximum and sum of exp(logit - maximum); picked [rows, k]:
// the targets' logits, written where the target falls in the tile.
template <class Logits>
int forward(const typename Logits::T* raw, int64_t ld, int64_t rows, int64_t n, int64_t v0,
            const int64_t* targets, int64_t k, float* high, float* total, float* picked,
            int threads) {
  if (rows < 0 || n <= 0 || ld < n || k < 0) return 1;
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
  for (int64_t i = 0; i < rows; ++i) {
    const typename Logits::T* z = raw + i * ld;
    const float old = high[i];
    const float top = std::fmax(old, row_max<Logits>(z, n));
    // the running sum rescaled to the new maximum (zero on a row's first tile: exp(-inf))
    const float kept = old == top ? total[i] : total[i] * std::exp(old - top);
    total[i] = kept + row_exp_sum<Logits>(z, n, top);
    high[i] = top;
    for (int64_t t = 0; t < k; ++t) {
      const int64_t column = targets[i * k + t] - v0;
      if (column >= 0 && column < n) picked[i * k + t] = Logits::at(z + column);
    }
  }
  return 0;
}

// One tile's gradient of the logits into d [rows, n] (contiguous, the logits' width):
// exp(logit - lse) * -g_sum + the targets' gradients where they fall in the tile, summed in
// fp32 in that order (the targets in theirs). raw, targets as `forward`; lse, g_sum [rows];
// g [rows, k].
template <class Logits>
int backward(const typename Logits::T* raw, int64_t ld, int64_t rows, int64_t n, int64_t v0,
             const int64_t* targets, int64_t k, const float* lse, const float* g_sum,
             const float* g, typename Logits::T* d, int threads) {
  using Vec = typename Logits::Vec;
  if (rows < 0 || n <= 0 || ld < n || k < 0) return 1;
  #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
  for (int64_t i = 0; i < rows; ++i) {
    const typename Logits::T* z = raw + i * ld;
    typename Logits::T* out = d + i * n;
    const typename Vec::V shift = Vec::set1(lse[i]);
    const typename Vec::V scale = Vec::set1(-g_sum[i]);
    // targets in this tile: at most a few per row; their columns' values are fixed below
    bool any = false;
    for (int64_t t = 0; t < k; ++t) {
      const int64_t column = targets[i * k + t] - v0;
      any |= column >= 0 && column < n;
    }
    for (int64_t j = 0; j < n; j += Vec::kWidth) {
      const typename Vec::Mask keep = Vec::first(n - j);
      const typename Vec::V e = Vec::exp(Vec::sub(Logits::load(z + j, keep), shift));
      Logits::store(out + j, keep, Vec::mul(e, scale));
    }
    if (!any) continue;
    // a target's column: its value recomputed in fp32 with each of its gradients added in
    // order, then stored (as a scatter-add into the fp32 tile, then any downcast)
    for (int64_t t = 0; t < k; ++t) {
      const int64_t column = targets[i * k + t] - v0;
      if (column < 0 || column >= n) continue;
      bool first = true;
      for (int64_t s = 0; s < t; ++s) first &= targets[i * k + s] != targets[i * k + t];
      if (!first) continue;  // (done with the first of equal targets)
      const typename Vec::V one = Vec::set1(Logits::at(z + column) - lse[i]);
      float value = Vec::lowest(Vec::mul(Vec::exp(one), scale));
      for (int64_t s = t; s < k; ++s)
        if (targets[i * k + s] == targets[i * k + t]) value += g[i * k + s];
      Logits::put(out + column, value);
    }
  }
  return 0;
}

}  // namespace head_tile

// One width's two entry points (native_head.py's signatures), head_tile_forward_<suffix> and
// head_tile_backward_<suffix>, over the logits `Logits` describes.
#define HEAD_TILE_ENTRY_POINTS(suffix, Logits)                                                   \
  extern "C" int head_tile_forward_##suffix(                                                     \
      const Logits::T* raw, int64_t ld, int64_t rows, int64_t n, int64_t v0,                     \
      const int64_t* targets, int64_t k, float* high, float* total, float* picked,               \
      int threads) {                                                                             \
    return head_tile::forward<Logits>(raw, ld, rows, n, v0, targets, k, high, total, picked,     \
                                      threads);                                                  \
  }                                                                                              \
  extern "C" int head_tile_backward_##suffix(                                                    \
      const Logits::T* raw, int64_t ld, int64_t rows, int64_t n, int64_t v0,                     \
      const int64_t* targets, int64_t k, const float* lse, const float* g_sum, const float* g,   \
      Logits::T* d, int threads) {                                                               \
    return head_tile::backward<Logits>(raw, ld, rows, n, v0, targets, k, lse, g_sum, g, d,       \
                                       threads);                                                 \
  }
