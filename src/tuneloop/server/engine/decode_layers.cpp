// A CPU sampling step's decoder layers in one call (native_layers.py builds, loads and calls
// it): decode_layers.py's lean loop for a step of decode rows alone on one key's fused
// weights in the native linear kernel's layout, the same kernels called in the same order on
// the same inputs, so the same bits. In Python each layer's ~15 kernel calls cost their
// ctypes conversions, tensor allocations and views, and the residual sums' dispatch between
// them, ~300 us a layer while the second thread spun waiting: about a sixth of a 128-row step
// of SmolLM2-135M on an AMX Xeon. Here the calls follow each other directly.
//
// The kernels are the other libraries' entry points, passed in as addresses (`Kernels`), so
// one kernel's code serves both loops. The residual sums are bf16 + bf16 in fp32 rounded to
// bf16 (nearest even), as torch's add on bf16 tensors rounds them. Every buffer of a step
// lies in one scratch block the caller allocates (`decode_layers_scratch` says its size).
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
#error "this loop needs AVX512F and AVX512-BF16"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec512.h"

namespace {

using Norm = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float, uint16_t*, int);
using Columns = int (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                        int64_t, uint16_t*, int);
using Linear = int (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, const float*,
                       int64_t, uint16_t*, int64_t, int, const int32_t*);
using Rotate = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t,
                        int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t,
                        int64_t, uint16_t*, uint16_t*, int);
using Write = int (*)(char*, int64_t, int64_t, const char*, int64_t, const int64_t*, int64_t,
                      int);
using Attend = int (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                       const bool*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                       uint16_t*, int);
using Silu = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                      uint16_t*, int);

}  // namespace

extern "C" {

// The kernels' entry points (rms_norm.cpp, lora_columns_avx512.cpp, linear_avx512.cpp,
// rotary.cpp, kv_write.cpp, decode_attention_avx512.cpp, silu_mul.cpp).
struct Kernels {
  Norm norm;
  Columns columns;
  Linear linear;
  Rotate rotate;
  Write write;
  Attend attend;
  Silu silu;
};

// A fused group (lora/fused.py): the native linear's blocks for `out` outputs of the
// group's input plus its `rank` LoRA columns, the fp32 bias or null, the blocks' input pair
// spans or null (every pair), the down-projections in the columns kernel's pairs layout (`rp`
// wide) or null (no LoRA columns: rank 0).
struct Group {
  const uint16_t* blocks;
  const float* bias;
  const int32_t* spans;
  const uint16_t* pairs;
  int64_t out;
  int64_t rank;
  int64_t rp;
};

// A decoder layer: its norms' weights (Qwen3's per-head q/k norms, or null) and groups.
struct Layer {
  const uint16_t* norm_in;
  const uint16_t* norm_post;
  const uint16_t* q_norm;
  const uint16_t* k_norm;
  Group qkv, o, gate_up, down;
  float eps_in, eps_post, q_eps, k_eps;
};

// A step's shape: rows, the model's widths, each row's slots (`width`), the pools' rows.
struct Shape {
  int64_t rows, hidden, heads, kv_heads, dim, inter, width, pool_rows;
  float scale;
  int threads;
};

}  // extern "C"

namespace {

constexpr int64_t kAlign = 32;  // elements: each buffer starts on a cache line

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The step's buffers, carved from one block in this order.
struct Buffers {
  uint16_t *normed, *extended, *qkv, *q_rows, *k_rows, *q_normed, *k_normed, *q, *k, *attended,
      *y, *gate_up, *product;
};

int64_t widest_input(const Shape& s) { return std::max({s.hidden, s.heads * s.dim, s.inter}); }

int64_t widest_rank(const Layer* layers, int64_t n) {
  int64_t r = 0;
  for (int64_t i = 0; i < n; ++i)
    for (const Group* g : {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down})
      r = std::max(r, g->rank);
  return r;
}

// Buffers of `s.rows` rows from `base` (null: only the size); returns the elements used.
int64_t carve(const Shape& s, int64_t rank, uint16_t* base, Buffers* b) {
  const int64_t rows = s.rows, q_width = s.heads * s.dim, kv_width = s.kv_heads * s.dim;
  const int64_t sizes[] = {
      rows * s.hidden,                         // normed
      rows * (widest_input(s) + rank),         // extended: [x | x @ A.T]
      rows * (q_width + 2 * kv_width),         // qkv
      rows * q_width, rows * kv_width,         // q_rows, k_rows (per-head norms' inputs)
      rows * q_width, rows * kv_width,         // q_normed, k_normed
      rows * q_width, rows * kv_width,         // q, k (rotated)
      rows * q_width,                          // attended
      rows * s.hidden,                         // y
      rows * 2 * s.inter, rows * s.inter,      // gate_up, product
  };
  uint16_t** slots[] = {&b->normed,   &b->extended, &b->qkv,      &b->q_rows,   &b->k_rows,
                        &b->q_normed, &b->k_normed, &b->q,        &b->k,        &b->attended,
                        &b->y,        &b->gate_up,  &b->product};
  int64_t used = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
    if (base != nullptr) *slots[i] = base + used;
    used += aligned(sizes[i]);
  }
  return used;
}

// hidden += y, both [n] bf16: the sum in fp32 rounded to bf16 (nearest even), in spans of
// 16 x 1024 elements across the threads.
void add(uint16_t* hidden, const uint16_t* y, int64_t n, int threads) {
  constexpr int64_t kSpan = 16 * 1024;
  const int64_t spans = (n + kSpan - 1) / kSpan;
  #pragma omp parallel for num_threads(threads) schedule(static) if (spans > 1)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t end = std::min(n, (s + 1) * kSpan);
    for (int64_t j = s * kSpan; j < end; j += 16) {
      const __mmask16 keep = vec512::lanes(end - j);
      const __m512 sum =
          _mm512_add_ps(vec512::widen(hidden + j, keep), vec512::widen(y + j, keep));
      _mm256_mask_storeu_epi16(hidden + j, keep, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// Error codes: which kernel refused its inputs (native_layers.py names it).
enum Refused { kNone = 0, kColumns = 1, kLinear = 2, kWrite = 3, kAttend = 4, kShape = 5 };

// x [rows, in] (row stride ldx) through group g into y [rows, g.out]: [x | x @ A.T] by the
// columns kernel where g has LoRA columns, then the linear kernel.
int project(const Kernels& k, const Shape& s, const uint16_t* x, int64_t ldx, int64_t in,
            const Group& g, uint16_t* extended, uint16_t* y) {
  const uint16_t* input = x;
  int64_t ld = ldx, width = in;
  if (g.pairs != nullptr) {
    if (k.columns(x, ldx, g.pairs, s.rows, in, g.rank, g.rp, extended, s.threads))
      return kColumns;
    input = extended, ld = width = in + g.rank;
  }
  if (k.linear(input, ld, s.rows, width, g.blocks, g.bias, g.out, y, g.out, s.threads,
               g.spans))
    return kLinear;
  return kNone;
}

}  // namespace

extern "C" {

// The scratch block's size in bf16 elements for a step of `shape` over `layers`.
int64_t decode_layers_scratch(const Layer* layers, int64_t n_layers, const Shape* shape) {
  Buffers unused{};
  return carve(*shape, widest_rank(layers, n_layers), nullptr, &unused);
}

// hidden [rows, hidden] (contiguous) through every layer, in place. cos, sin: the rotary
// embedding's [rows, dim] (row stride cs_stride); slot_mapping [rows]: each row's new slot;
// slots [rows, width], mask [rows, width]: the slots each row attends (decode_attention);
// k_pools, v_pools: each layer's pools [pool_rows, kv_heads, dim]. Returns 0, or the
// `Refused` code of the kernel that refused its inputs (nothing past it is computed).
int decode_layers(const Kernels* kernels, const Layer* layers, int64_t n_layers,
                  const Shape* shape, uint16_t* hidden, const uint16_t* cos, const uint16_t* sin,
                  int64_t cs_stride, const int64_t* slot_mapping, const int64_t* slots,
                  const bool* mask, char* const* k_pools, char* const* v_pools,
                  uint16_t* scratch, int64_t scratch_elements) {
  const Kernels& k = *kernels;
  const Shape& s = *shape;
  Buffers b{};
  if (carve(s, widest_rank(layers, n_layers), scratch, &b) > scratch_elements) return kShape;
  const int64_t rows = s.rows, h = s.hidden, dim = s.dim, inter = s.inter;
  const int64_t q_width = s.heads * dim, kv_width = s.kv_heads * dim;
  const int64_t qkv_width = q_width + 2 * kv_width, kv_bytes = kv_width * sizeof(uint16_t);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Layer& l = layers[i];
    if (l.qkv.out != qkv_width || l.o.out != h || l.gate_up.out != 2 * inter || l.down.out != h)
      return kShape;
    int code;
    k.norm(hidden, l.norm_in, rows, h, l.eps_in, b.normed, s.threads);
    if ((code = project(k, s, b.normed, h, h, l.qkv, b.extended, b.qkv))) return code;
    const uint16_t *q_at = b.qkv, *k_at = b.qkv + q_width;
    int64_t q_stride = qkv_width, k_stride = qkv_width;
    if (l.q_norm != nullptr) {  // each head's queries and keys normed first, rows of `dim`
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(b.q_rows + r * q_width, b.qkv + r * qkv_width, q_width * sizeof(uint16_t));
        std::memcpy(b.k_rows + r * kv_width, b.qkv + r * qkv_width + q_width, kv_bytes);
      }
      k.norm(b.q_rows, l.q_norm, rows * s.heads, dim, l.q_eps, b.q_normed, s.threads);
      k.norm(b.k_rows, l.k_norm, rows * s.kv_heads, dim, l.k_eps, b.k_normed, s.threads);
      q_at = b.q_normed, k_at = b.k_normed, q_stride = q_width, k_stride = kv_width;
    }
    k.rotate(q_at, q_stride, dim, s.heads, k_at, k_stride, dim, s.kv_heads, cos, sin, cs_stride,
             rows, dim, b.q, b.k, s.threads);
    const uint16_t* v_new = b.qkv + q_width + kv_width;
    if (k.write(k_pools[i], s.pool_rows, kv_bytes, reinterpret_cast<const char*>(b.k), kv_bytes,
                slot_mapping, rows, s.threads))
      return kWrite;
    if (k.write(v_pools[i], s.pool_rows, kv_bytes, reinterpret_cast<const char*>(v_new),
                qkv_width * int64_t(sizeof(uint16_t)), slot_mapping, rows, s.threads))
      return kWrite;
    if (k.attend(b.q, reinterpret_cast<const uint16_t*>(k_pools[i]),
                 reinterpret_cast<const uint16_t*>(v_pools[i]), slots, mask, rows, s.width,
                 s.heads, s.kv_heads, dim, dim, s.scale, b.attended, s.threads))
      return kAttend;
    if ((code = project(k, s, b.attended, q_width, q_width, l.o, b.extended, b.y))) return code;
    add(hidden, b.y, rows * h, s.threads);
    k.norm(hidden, l.norm_post, rows, h, l.eps_post, b.normed, s.threads);
    if ((code = project(k, s, b.normed, h, h, l.gate_up, b.extended, b.gate_up))) return code;
    k.silu(b.gate_up, 2 * inter, b.gate_up + inter, 2 * inter, rows, inter, b.product,
           s.threads);
    if ((code = project(k, s, b.product, inter, inter, l.down, b.extended, b.y))) return code;
    add(hidden, b.y, rows * h, s.threads);
  }
  return kNone;
}

}  // extern "C"
