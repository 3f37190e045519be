// A CPU sampling step's decoder layers in one call, over a step's element type T (bf16 bits:
// decode_layers.cpp; fp32: decode_layers_fp32.cpp; native_layers.py builds, loads and calls
// them): decode_layers.py's lean loop for a step of decode rows alone on one key's fused
// weights in the native linear kernel's layout, the same kernels called in the same order on
// the same inputs, so the same bits. In Python each layer's ~15 kernel calls cost their
// ctypes conversions, tensor allocations and views, and the residual sums' dispatch between
// them, ~300 us a layer while the second thread spun waiting: about a sixth of a 128-row step
// of SmolLM2-135M on an AMX Xeon. Here the calls follow each other directly.
//
// The kernels are the other libraries' entry points, passed in as addresses (`Kernels`), so
// one kernel's code serves both loops. The residual sums are each width's `add` (as torch's
// add on tensors of that dtype rounds them). Every buffer of a step lies in one scratch block
// the caller allocates (`scratch` says its size).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace decode_layers {

template <class T>
struct Types {
  using Norm = void (*)(const T*, const T*, int64_t, int64_t, float, T*, int);
  using Columns = int (*)(const T*, int64_t, const T*, int64_t, int64_t, int64_t, int64_t, T*,
                          int);
  using Linear = int (*)(const T*, int64_t, int64_t, int64_t, const T*, const float*, int64_t, T*,
                         int64_t, int, const int32_t*);
  using Rotate = void (*)(const T*, int64_t, int64_t, int64_t, const T*, int64_t, int64_t, int64_t,
                          const T*, const T*, int64_t, int64_t, int64_t, T*, T*, int);
  using Write = int (*)(char*, int64_t, int64_t, const char*, int64_t, const int64_t*, int64_t,
                        int);
  using Attend = int (*)(const T*, const T*, const T*, const int64_t*, const bool*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, T*, int);
  using Silu = int (*)(const T*, int64_t, const T*, int64_t, int64_t, int64_t, T*, int);
};

// The kernels' entry points (rms_norm.cpp, lora_columns_avx512.cpp or none, linear_avx512.cpp
// or linear_fp32.cpp, rotary.cpp, kv_write.cpp, decode_attention_avx512.cpp or
// decode_attention_avx2.cpp, silu_mul.cpp or silu_mul_fp32.cpp).
template <class T>
struct Kernels {
  typename Types<T>::Norm norm;
  typename Types<T>::Columns columns;
  typename Types<T>::Linear linear;
  typename Types<T>::Rotate rotate;
  typename Types<T>::Write write;
  typename Types<T>::Attend attend;
  typename Types<T>::Silu silu;
};

// A fused group (lora/fused.py): the native linear's blocks for `out` outputs of the
// group's input plus its `rank` LoRA columns, the fp32 bias or null, the blocks' input pair
// spans or null (every pair), the down-projections in the columns kernel's pairs layout (`rp`
// wide) or null (no LoRA columns: rank 0).
template <class T>
struct Group {
  const T* blocks;
  const float* bias;
  const int32_t* spans;
  const T* pairs;
  int64_t out;
  int64_t rank;
  int64_t rp;
};

// A decoder layer: its norms' weights (Qwen3's per-head q/k norms, or null) and groups.
template <class T>
struct Layer {
  const T* norm_in;
  const T* norm_post;
  const T* q_norm;
  const T* k_norm;
  Group<T> qkv, o, gate_up, down;
  float eps_in, eps_post, q_eps, k_eps;
};

// A step's shape: rows, the model's widths, each row's slots (`width`), the pools' rows.
struct Shape {
  int64_t rows, hidden, heads, kv_heads, dim, inter, width, pool_rows;
  float scale;
  int threads;
};

// hidden[j] = sum(hidden[j], y[j]) for j < n, `sum(hidden, y, begin, end)` over spans of
// 16 x 1024 elements split across the threads: each width's residual add.
template <class T, class Sum>
void add_spans(T* hidden, const T* y, int64_t n, int threads, Sum sum) {
  constexpr int64_t kSpan = 16 * 1024;
  const int64_t spans = (n + kSpan - 1) / kSpan;
  #pragma omp parallel for num_threads(threads) schedule(static) if (spans > 1)
  for (int64_t s = 0; s < spans; ++s) sum(hidden, y, s * kSpan, std::min(n, (s + 1) * kSpan));
}

constexpr int64_t kAlign = 32;  // elements: each buffer starts on a cache line (or two)

inline int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The step's buffers, carved from one block in this order.
template <class T>
struct Buffers {
  T *normed, *extended, *qkv, *q_rows, *k_rows, *q_normed, *k_normed, *q, *k, *attended, *y,
      *gate_up, *product;
};

inline int64_t widest_input(const Shape& s) {
  return std::max({s.hidden, s.heads * s.dim, s.inter});
}

template <class T>
int64_t widest_rank(const Layer<T>* layers, int64_t n) {
  int64_t r = 0;
  for (int64_t i = 0; i < n; ++i)
    for (const Group<T>* g : {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down})
      r = std::max(r, g->rank);
  return r;
}

// Buffers of `s.rows` rows from `base` (null: only the size); returns the elements used.
template <class T>
int64_t carve(const Shape& s, int64_t rank, T* base, Buffers<T>* b) {
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
  T** slots[] = {&b->normed,   &b->extended, &b->qkv,      &b->q_rows,   &b->k_rows,
                 &b->q_normed, &b->k_normed, &b->q,        &b->k,        &b->attended,
                 &b->y,        &b->gate_up,  &b->product};
  int64_t used = 0;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
    if (base != nullptr) *slots[i] = base + used;
    used += aligned(sizes[i]);
  }
  return used;
}

// Error codes: which kernel refused its inputs (native_layers.py names it).
enum Refused {
  kNone = 0, kColumns = 1, kLinear = 2, kWrite = 3, kAttend = 4, kShape = 5, kSilu = 6
};

// x [rows, in] (row stride ldx) through group g into y [rows, g.out]: [x | x @ A.T] by the
// columns kernel where g has LoRA columns, then the linear kernel.
template <class T>
int project(const Kernels<T>& k, const Shape& s, const T* x, int64_t ldx, int64_t in,
            const Group<T>& g, T* extended, T* y) {
  const T* input = x;
  int64_t ld = ldx, width = in;
  if (g.pairs != nullptr) {
    if (k.columns == nullptr ||
        k.columns(x, ldx, g.pairs, s.rows, in, g.rank, g.rp, extended, s.threads))
      return kColumns;
    input = extended, ld = width = in + g.rank;
  }
  if (k.linear(input, ld, s.rows, width, g.blocks, g.bias, g.out, y, g.out, s.threads,
               g.spans))
    return kLinear;
  return kNone;
}

// The scratch block's size in elements for a step of `shape` over `layers`.
template <class T>
int64_t scratch(const Layer<T>* layers, int64_t n_layers, const Shape* shape) {
  Buffers<T> unused{};
  return carve<T>(*shape, widest_rank(layers, n_layers), nullptr, &unused);
}

// hidden [rows, hidden] (contiguous) through every layer, in place; `add(hidden, y, n,
// threads)` the residual sum. cos, sin: the rotary embedding's [rows, dim] (row stride
// cs_stride); slot_mapping [rows]: each row's new slot; slots [rows, width], mask [rows,
// width]: the slots each row attends (decode_attention); k_pools, v_pools: each layer's pools
// [pool_rows, kv_heads, dim]. Returns 0, or the `Refused` code of the kernel that refused its
// inputs (nothing past it is computed).
template <class T, void (*add)(T*, const T*, int64_t, int)>
int run(const Kernels<T>* kernels, const Layer<T>* layers, int64_t n_layers, const Shape* shape,
        T* hidden, const T* cos, const T* sin, int64_t cs_stride, const int64_t* slot_mapping,
        const int64_t* slots, const bool* mask, char* const* k_pools, char* const* v_pools,
        T* scratch_block, int64_t scratch_elements) {
  const Kernels<T>& k = *kernels;
  const Shape& s = *shape;
  Buffers<T> b{};
  if (carve<T>(s, widest_rank(layers, n_layers), scratch_block, &b) > scratch_elements)
    return kShape;
  const int64_t rows = s.rows, h = s.hidden, dim = s.dim, inter = s.inter;
  const int64_t q_width = s.heads * dim, kv_width = s.kv_heads * dim;
  const int64_t qkv_width = q_width + 2 * kv_width, kv_bytes = kv_width * sizeof(T);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Layer<T>& l = layers[i];
    if (l.qkv.out != qkv_width || l.o.out != h || l.gate_up.out != 2 * inter || l.down.out != h)
      return kShape;
    int code;
    k.norm(hidden, l.norm_in, rows, h, l.eps_in, b.normed, s.threads);
    if ((code = project(k, s, b.normed, h, h, l.qkv, b.extended, b.qkv))) return code;
    const T *q_at = b.qkv, *k_at = b.qkv + q_width;
    int64_t q_stride = qkv_width, k_stride = qkv_width;
    if (l.q_norm != nullptr) {  // each head's queries and keys normed first, rows of `dim`
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(b.q_rows + r * q_width, b.qkv + r * qkv_width, q_width * sizeof(T));
        std::memcpy(b.k_rows + r * kv_width, b.qkv + r * qkv_width + q_width, kv_bytes);
      }
      k.norm(b.q_rows, l.q_norm, rows * s.heads, dim, l.q_eps, b.q_normed, s.threads);
      k.norm(b.k_rows, l.k_norm, rows * s.kv_heads, dim, l.k_eps, b.k_normed, s.threads);
      q_at = b.q_normed, k_at = b.k_normed, q_stride = q_width, k_stride = kv_width;
    }
    k.rotate(q_at, q_stride, dim, s.heads, k_at, k_stride, dim, s.kv_heads, cos, sin, cs_stride,
             rows, dim, b.q, b.k, s.threads);
    const T* v_new = b.qkv + q_width + kv_width;
    if (k.write(k_pools[i], s.pool_rows, kv_bytes, reinterpret_cast<const char*>(b.k), kv_bytes,
                slot_mapping, rows, s.threads))
      return kWrite;
    if (k.write(v_pools[i], s.pool_rows, kv_bytes, reinterpret_cast<const char*>(v_new),
                qkv_width * int64_t(sizeof(T)), slot_mapping, rows, s.threads))
      return kWrite;
    if (k.attend(b.q, reinterpret_cast<const T*>(k_pools[i]),
                 reinterpret_cast<const T*>(v_pools[i]), slots, mask, rows, s.width, s.heads,
                 s.kv_heads, dim, dim, s.scale, b.attended, s.threads))
      return kAttend;
    if ((code = project(k, s, b.attended, q_width, q_width, l.o, b.extended, b.y))) return code;
    add(hidden, b.y, rows * h, s.threads);
    k.norm(hidden, l.norm_post, rows, h, l.eps_post, b.normed, s.threads);
    if ((code = project(k, s, b.normed, h, h, l.gate_up, b.extended, b.gate_up))) return code;
    if (k.silu(b.gate_up, 2 * inter, b.gate_up + inter, 2 * inter, rows, inter, b.product,
               s.threads))
      return kSilu;
    if ((code = project(k, s, b.product, inter, inter, l.down, b.extended, b.y))) return code;
    add(hidden, b.y, rows * h, s.threads);
  }
  return kNone;
}

}  // namespace decode_layers

// One width's two entry points (native_layers.py's signatures), decode_layers_<suffix> (`run`)
// and decode_layers_<suffix>_scratch (`scratch`), over elements `T` with residual sums `add`.
#define DECODE_LAYERS_ENTRY_POINTS(suffix, T, add)                                              \
  extern "C" int64_t decode_layers_##suffix##_scratch(const decode_layers::Layer<T>* layers,   \
                                                      int64_t n_layers,                        \
                                                      const decode_layers::Shape* shape) {     \
    return decode_layers::scratch<T>(layers, n_layers, shape);                                 \
  }                                                                                            \
  extern "C" int decode_layers_##suffix(                                                       \
      const decode_layers::Kernels<T>* kernels, const decode_layers::Layer<T>* layers,         \
      int64_t n_layers, const decode_layers::Shape* shape, T* hidden, const T* cos,            \
      const T* sin, int64_t cs_stride, const int64_t* slot_mapping, const int64_t* slots,      \
      const bool* mask, char* const* k_pools, char* const* v_pools, T* scratch,                \
      int64_t scratch_elements) {                                                              \
    return decode_layers::run<T, add>(kernels, layers, n_layers, shape, hidden, cos, sin,      \
                                      cs_stride, slot_mapping, slots, mask, k_pools, v_pools,  \
                                      scratch, scratch_elements);                              \
  }
