// What the two decode attention kernels (decode_attention_avx512.cpp over bf16 pools,
// decode_attention_avx2.cpp over fp32 ones) share: the loop over a step's rows. Each kernel
// makes one row by its loop for the common head shapes (`FixedRow`, an instance chosen once per
// call) or by its generic loop (`GenericRow`); the rows run in parallel under OpenMP, each
// thread with its own scratch, four rows at a time as threads free up: the rows' contexts
// differ in length, and an even split of them left one thread waiting (sampling 32 prompts x
// 4 samples on an AMX Xeon: 1.046x); four adjacent rows are often one prompt's samples,
// which read its blocks once from memory.
#pragma once
#include <cstdint>
#include <vector>

namespace decode_rows {

// q, k pool, v pool, the row's slots and mask, width, key heads, scale, out; scratch: scores,
// part, total.
template <typename T>
using FixedRow = void (*)(const T*, const T*, const T*, const int64_t*, const bool*, int64_t,
                          int64_t, float, T*, float*, float*, float*);
// q, k pool, v pool, the row's slots and mask, width, heads, key heads, dim, dim_v, scale, out;
// scratch: scores, part, total.
template <typename T>
using GenericRow = void (*)(const T*, const T*, const T*, const int64_t*, const bool*, int64_t,
                            int64_t, int64_t, int64_t, int64_t, float, T*, float*, float*,
                            float*);

// q [rows, heads, dim], pools [slots, kv_heads, dim | dim_v], slots and mask [rows, width],
// out [rows, heads, dim_v]: every row by `fixed` where it is not null, else by `generic`. Each
// thread's scratch: the heads' scores padded to a multiple of `granule` keys, `part` floats and
// the heads' totals.
template <typename T>
void attend_rows(const T* q, const T* kp, const T* vp, const int64_t* slots, const bool* mask,
                 int64_t rows, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                 int64_t dim_v, float scale, T* out, int threads, int64_t granule, int64_t part,
                 FixedRow<T> fixed, GenericRow<T> generic) {
  const int64_t padded = (width + granule - 1) / granule * granule;
  #pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(heads * padded), scratch(part), total(heads);
    #pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r) {
      if (fixed)
        fixed(q + r * heads * dim, kp, vp, slots + r * width, mask + r * width, width, kv_heads,
              scale, out + r * heads * dim_v, scores.data(), scratch.data(), total.data());
      else
        generic(q + r * heads * dim, kp, vp, slots + r * width, mask + r * width, width, heads,
                kv_heads, dim, dim_v, scale, out + r * heads * dim_v, scores.data(),
                scratch.data(), total.data());
    }
  }
}

}  // namespace decode_rows
