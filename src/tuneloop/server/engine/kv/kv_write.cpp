// A step's new keys or values written into a layer's pool at their slots (kv_write.py): each
// token's row of bytes copied to its slot's row. The pool is far larger than the caches, so
// every destination row is a cache miss; torch's index_copy_ takes them one after another
// on one thread (a decode step's 60 writes of 128 rows: ~2.6 ms on an EPYC), where here each
// destination is asked for a few rows ahead and the rows are split between the threads.
// Every slot is checked against the pool before any row is written.
#include <cstdint>
#include <cstring>

// pool: pool_rows rows of row_bytes; src: n rows of row_bytes, src_stride bytes apart;
// slots: n row indices. 0, or 1 (nothing written) where a slot lies outside the pool.
extern "C" int write_slots(char* pool, int64_t pool_rows, int64_t row_bytes, const char* src,
                           int64_t src_stride, const int64_t* slots, int64_t n, int threads) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= pool_rows) return 1;
  constexpr int64_t ahead = 4;
  #pragma omp parallel for num_threads(threads) schedule(static) if (n * row_bytes >= 32768)
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n) {
      const char* next = pool + slots[i + ahead] * row_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 1);
    }
    std::memcpy(pool + slots[i] * row_bytes, src + i * src_stride, row_bytes);
  }
  return 0;
}
