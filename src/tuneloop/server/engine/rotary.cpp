// transformers' apply_rotary_pos_emb at bf16 and fp32 (rotary.py), queries and keys in one call:
// out = q * cos + rotate_half(q) * sin, where rotate_half(q) = [-q2, q1] for q's halves q1,
// q2. Each product is rounded to bf16 and so is their sum, as eager torch rounds each of its
// operations, so the result is the eager one bit for bit. A sampling step's rotary is eight
// small operations a layer on [heads, tokens, head size] views (~140 us on an EPYC at 128
// rows, 30 layers a step), where this loop takes a few microseconds.
#include <cstdint>

#include "bf16.h"

namespace {


// One head of one token: x [dim] (contiguous), c and s [dim], out [dim].
inline void rotate(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t dim,
                   uint16_t* out) {
  const int64_t half = dim / 2;
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16::rounded(bf16::to_float(x[i]) * bf16::to_float(c[i]));
    const float b = bf16::rounded(-bf16::to_float(x[i + half]) * bf16::to_float(s[i]));
    out[i] = bf16::from_float(a + b);
  }
  #pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = bf16::rounded(bf16::to_float(x[i]) * bf16::to_float(c[i]));
    const float b = bf16::rounded(bf16::to_float(x[i - half]) * bf16::to_float(s[i]));
    out[i] = bf16::from_float(a + b);
  }
}

// The gradient of one head of one token's rotation: g [dim] (contiguous), out [dim]. Eager
// autograd's arithmetic for q * cos + rotate_half(q) * sin: the products g * cos and g * sin
// each rounded to bf16, the rotated half's moved back (and negated where rotate_half negated
// it), the input's gradient their sum rounded to bf16, plus the zero each slice's backward
// adds (which turns a -0 sum into +0, as eager's accumulation does).
inline void unrotate(const uint16_t* g, const uint16_t* c, const uint16_t* s, int64_t dim,
                     uint16_t* out) {
  const int64_t half = dim / 2;
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16::rounded(bf16::to_float(g[i]) * bf16::to_float(c[i]));
    const float b = bf16::rounded(bf16::to_float(g[i + half]) * bf16::to_float(s[i + half]));
    out[i] = bf16::from_float(bf16::rounded(a + b) + 0.0f);
  }
  #pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = bf16::rounded(bf16::to_float(g[i]) * bf16::to_float(c[i]));
    const float b = bf16::rounded(bf16::to_float(g[i - half]) * bf16::to_float(s[i - half]));
    out[i] = bf16::from_float(bf16::rounded(a - b) + 0.0f);
  }
}

// rotate at fp32 (an fp32 model's sampling steps): each product and the sum rounded to fp32
// by the arithmetic itself, as eager's operations round them. GCC contracts a product and a
// sum into one FMA across statements by default (one rounding where eager makes two), so
// contraction is off here (clang contracts within one expression only); rotary.py takes the
// loop only after it agrees with the family's function bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_fp32(const float* x, const float* c, const float* s, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i];
    const float b = -x[i + half] * s[i];
    out[i] = a + b;
  }
  #pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = x[i] * c[i];
    const float b = x[i - half] * s[i];
    out[i] = a + b;
  }
}

// unrotate at fp32 (an fp32 model's training pass): eager autograd's arithmetic as `unrotate`
// describes it, each product and the sum rounded to fp32, plus the zero of the slices'
// backward.
void unrotate_fp32(const float* g, const float* c, const float* s, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  #pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = g[i] * c[i];
    const float b = g[i + half] * s[i + half];
    out[i] = (a + b) + 0.0f;
  }
  #pragma omp simd
  for (int64_t i = half; i < dim; ++i) {
    const float a = g[i] * c[i];
    const float b = g[i - half] * s[i - half];
    out[i] = (a - b) + 0.0f;
  }
}
#pragma GCC pop_options

template <typename T>
using Head = void (*)(const T*, const T*, const T*, int64_t, T*);

// `head` on every head of every token of q and k, tokens in parallel: the loops' walk over
// their [tokens, heads, dim] inputs and outputs (the entry points' arguments).
template <typename T, Head<T> head>
void each_head(const T* q, int64_t q_token, int64_t q_head, int64_t q_heads, const T* k,
               int64_t k_token, int64_t k_head, int64_t k_heads, const T* cos, const T* sin,
               int64_t cs_token, int64_t tokens, int64_t dim, T* q_out, T* k_out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) \
      if (tokens * (q_heads + k_heads) * dim >= 32768)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * cs_token;
    const T* s = sin + t * cs_token;
    for (int64_t h = 0; h < q_heads; ++h)
      head(q + t * q_token + h * q_head, c, s, dim, q_out + (t * q_heads + h) * dim);
    for (int64_t h = 0; h < k_heads; ++h)
      head(k + t * k_token + h * k_head, c, s, dim, k_out + (t * k_heads + h) * dim);
  }
}

}  // namespace

// An entry point: `head` on every head of q and k (rotary.py's signature). q [tokens, q_heads,
// dim] and k [tokens, k_heads, dim] read with the given token and head strides (elements; the
// head size contiguous), cos and sin [tokens, dim] with a token stride; q_out and k_out
// [tokens, heads, dim] contiguous. A backward's q and k are the gradients of the forward's
// outputs, its outputs the gradients of q and k, as eager autograd makes them bit for bit.
#define ROTARY_ENTRY_POINT(name, T, head)                                                        \
  extern "C" void name(const T* q, int64_t q_token, int64_t q_head, int64_t q_heads, const T* k, \
                       int64_t k_token, int64_t k_head, int64_t k_heads, const T* cos,           \
                       const T* sin, int64_t cs_token, int64_t tokens, int64_t dim, T* q_out,     \
                       T* k_out, int threads) {                                                  \
    each_head<T, head>(q, q_token, q_head, q_heads, k, k_token, k_head, k_heads, cos, sin,       \
                       cs_token, tokens, dim, q_out, k_out, threads);                            \
  }

ROTARY_ENTRY_POINT(rotary_bf16, uint16_t, rotate)
ROTARY_ENTRY_POINT(rotary_backward_bf16, uint16_t, unrotate)
ROTARY_ENTRY_POINT(rotary_fp32, float, rotate_fp32)
ROTARY_ENTRY_POINT(rotary_backward_fp32, float, unrotate_fp32)
