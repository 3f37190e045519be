// A decode step's draw on the CPU, one row at a time (native_draw.py builds and loads it):
// what draw.py's torch ops compute for rows without top-k or top-p, in two passes over the
// row's logits instead of a softmax that writes [rows, V] probabilities and the passes that
// read them again. Logits are fp32 or bf16 (the head's own output: no fp32 copy of it).
//
// Per row: pass 1, each block's maximum and whether any logit is NaN or infinite; the row's
// max and its first index (torch.argmax's tie-break). Pass 2, each block's sum of
// exp(logit - max), and at a temperature other than 1 of exp((logit - max) / temperature);
// the row's totals in fp64. The logsumexp at temperature 1 is max + log(total). The draw is the
// inverse CDF at the row's uniform u, in two levels as draw.py's: the block sums locate the
// block, and that block alone is summed again token by token; a token whose probability is 0
// is never drawn (where rounding puts u * total past the last sum, the last token with mass).
// A row reads its own logits, uniform and parameters only, so its token and logsumexp do not
// depend on the rows beside it. Rows with top-k or top-p are drawn again by a second entry
// point (`draw_filtered_rows`, below).
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <functional>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16.h"

namespace {

// 16 lanes in GCC's vector extensions: AVX-512 registers where the host has them, pairs of
// AVX2 ones elsewhere (-march=native), lane by lane the same operations.
typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
typedef uint32_t Words __attribute__((vector_size(64)));
typedef uint16_t Halves __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

inline float value(const float* x, int64_t i) { return x[i]; }
inline float value(const uint16_t* x, int64_t i) { return bf16::to_float(x[i]); }

inline Floats load(const float* x, int64_t i) {
  Floats v;
  std::memcpy(&v, x + i, sizeof v);
  return v;
}
inline Floats load(const uint16_t* x, int64_t i) {  // bf16: the high half of an fp32
  Halves h;
  std::memcpy(&h, x + i, sizeof h);
  return reinterpret_cast<Floats>(__builtin_convertvector(h, Words) << 16);
}

// NaN or an infinity: every exponent bit set.
inline bool not_finite(float v) {
  return (std::bit_cast<uint32_t>(v) & 0x7f800000u) == 0x7f800000u;
}

// Without AVX-512, GCC expands the 16-lane vectors' comparisons, selections and conversions
// lane by lane into scalar code (the draw of 128 x 49,152 fp32 logits built for x86-64-v3 took
// 10.5 ms, 1.3 ms built for AVX-512 on the same Zen 5 host): there the hot loops take each 16
// lanes as two native 8-lane halves, the same operations lane by lane and their sums in the
// same lane order, so the same bits.
typedef float Floats8 __attribute__((vector_size(32)));
typedef int32_t Ints8 __attribute__((vector_size(32)));
typedef uint32_t Words8 __attribute__((vector_size(32)));
typedef uint16_t Halves8 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
constexpr bool kHalves = false;
#else
constexpr bool kHalves = true;
#endif

inline Floats8 load8(const float* x, int64_t i) {
  Floats8 v;
  std::memcpy(&v, x + i, sizeof v);
  return v;
}
inline Floats8 load8(const uint16_t* x, int64_t i) {
  Halves8 h;
  std::memcpy(&h, x + i, sizeof h);
  return reinterpret_cast<Floats8>(__builtin_convertvector(h, Words8) << 16);
}

// exp(x) for x <= 0, Cephes' expf: x = n ln 2 + r with n the nearest integer to x log2 e and
// |r| <= ln 2 / 2 (ln 2 in two parts, so r is exact), exp(r) by a degree-7 polynomial, times
// 2^n (relative error < 8e-8 over [-87, 0], measured against fp64); 0 below -87, where fp32's
// exp leaves its normal range. Every lane width and the scalar form give the same bits.
template <typename F, typename I>
inline F exp_lanes(F x) {
  const F t = x * 1.44269504088896341f + 0.5f;
  I whole = __builtin_convertvector(t, I);  // toward zero, then down: floor(t)
  whole += __builtin_convertvector(whole, F) > t;  // (-1 where so)
  const F n = __builtin_convertvector(whole, F);
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F y = p * (r * r) + r + 1.0f;
  const I low = whole < -126;  // (only where x < -87: those lanes give 0 below)
  const F scale = reinterpret_cast<F>(((low ? -126 : whole) + 127) << 23);
  return x < -87.0f ? F{} : y * scale;
}
inline Floats exp_nonpositive(Floats x) { return exp_lanes<Floats, Ints>(x); }
inline Floats8 exp_nonpositive(Floats8 x) { return exp_lanes<Floats8, Ints8>(x); }
inline float exp_nonpositive(float x) {
  Floats8 lanes = Floats8{} + x;
  return exp_nonpositive(lanes)[0];
}

inline float lane_sum(Floats v) {  // in lane order
  float s = 0.0f;
  for (int64_t k = 0; k < kLanes; ++k) s += v[k];
  return s;
}
inline float lane_max(Floats v) {
  float m = v[0];
  for (int64_t k = 1; k < kLanes; ++k) m = v[k] > m ? v[k] : m;
  return m;
}

inline Ints8 not_finite(Floats8 v) {
  return (reinterpret_cast<Words8>(v) & 0x7f800000u) == 0x7f800000u;
}

// Block [lo, hi)'s largest logit, and whether any is NaN or infinite.
template <typename T>
inline float block_max(const T* x, int64_t lo, int64_t hi, bool* bad) {
  float m = -std::numeric_limits<float>::infinity();
  bool any = false;
  int64_t i = lo;
  if constexpr (kHalves) {
    Floats8 first = Floats8{} + m, second = first;
    Ints8 wrong = Ints8{};
    for (; i + kLanes <= hi; i += kLanes) {
      const Floats8 a = load8(x, i), b = load8(x, i + kLanes / 2);
      first = a > first ? a : first;
      second = b > second ? b : second;
      wrong |= not_finite(a) | not_finite(b);
    }
    for (int64_t k = 0; k < kLanes / 2; ++k) m = first[k] > m ? first[k] : m;  // lane order
    for (int64_t k = 0; k < kLanes / 2; ++k) m = second[k] > m ? second[k] : m;
    for (int64_t k = 0; k < kLanes / 2; ++k) any |= wrong[k] != 0;
  } else {
    Floats best = Floats{} + m;
    Ints wrong = Ints{};
    for (; i + kLanes <= hi; i += kLanes) {
      const Floats v = load(x, i);
      best = v > best ? v : best;
      wrong |= (reinterpret_cast<Words>(v) & 0x7f800000u) == 0x7f800000u;
    }
    m = lane_max(best);
    for (int64_t k = 0; k < kLanes; ++k) any |= wrong[k] != 0;
  }
  for (; i < hi; ++i) {
    const float v = value(x, i);
    m = v > m ? v : m;
    any |= not_finite(v);
  }
  *bad = any;
  return m;
}

// The lane-order sum of exp((logit - top) * scale) over the whole vectors from i up to hi, i
// advanced past them; with kStore each exponential also goes to store[j].
template <bool kStore, typename T>
inline float exp_sum_lanes(const T* x, int64_t& i, int64_t hi, float top, float scale,
                           float* store) {
  float s = 0.0f;
  if constexpr (kHalves) {
    Floats8 first = Floats8{}, second = Floats8{};
    for (; i + kLanes <= hi; i += kLanes) {
      const Floats8 a = exp_nonpositive((load8(x, i) - top) * scale);
      const Floats8 b = exp_nonpositive((load8(x, i + kLanes / 2) - top) * scale);
      if constexpr (kStore) {
        std::memcpy(store + i, &a, sizeof a);
        std::memcpy(store + i + kLanes / 2, &b, sizeof b);
      }
      first += a;
      second += b;
    }
    for (int64_t k = 0; k < kLanes / 2; ++k) s += first[k];  // lane order, as lane_sum
    for (int64_t k = 0; k < kLanes / 2; ++k) s += second[k];
  } else {
    Floats acc = Floats{};
    for (; i + kLanes <= hi; i += kLanes) {
      const Floats v = exp_nonpositive((load(x, i) - top) * scale);
      if constexpr (kStore) std::memcpy(store + i, &v, sizeof v);
      acc += v;
    }
    s = lane_sum(acc);
  }
  return s;
}

// Block [lo, hi)'s sum of exp((logit - top) * scale).
template <typename T>
inline float block_sum(const T* x, int64_t lo, int64_t hi, float top, float scale) {
  int64_t i = lo;
  float s = exp_sum_lanes<false>(x, i, hi, top, scale, nullptr);
  for (; i < hi; ++i) s += exp_nonpositive((value(x, i) - top) * scale);
  return s;
}

struct Row {
  int64_t token;
  double logsumexp;
  bool finite;
};

template <typename T>
Row draw_row(const T* x, int64_t vocab, int64_t block, float u, float temperature, bool greedy,
             float* maxima, float* sums, float* tempered) {
  const int64_t blocks = (vocab + block - 1) / block;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * block, hi = lo + block < vocab ? lo + block : vocab;
    bool bad = false;
    const float best = block_max(x, lo, hi, &bad);
    if (bad) {  // (its maxima NaN, so that nothing reads stale values as this row's)
      for (int64_t c = 0; c < blocks; ++c) maxima[c] = std::numeric_limits<float>::quiet_NaN();
      return {0, std::numeric_limits<double>::quiet_NaN(), false};
    }
    maxima[b] = best;
    top = best > top ? best : top;
  }
  int64_t at = 0;  // the first index holding the max: in the first block whose max it is
  for (int64_t b = 0; b < blocks; ++b)
    if (maxima[b] == top) {
      at = b * block;
      while (value(x, at) != top) ++at;
      break;
    }
  double total = 0.0, tempered_total = 0.0;
  const bool tempering = !greedy && temperature != 1.0f;
  const float inverse = 1.0f / temperature;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * block, hi = lo + block < vocab ? lo + block : vocab;
    const float sum = block_sum(x, lo, hi, top, 1.0f);
    sums[b] = sum;
    total += sum;
    if (tempering) {
      tempered[b] = block_sum(x, lo, hi, top, inverse);
      tempered_total += tempered[b];
    }
  }
  const double logsumexp = static_cast<double>(top) + std::log(total);
  if (greedy) return {at, logsumexp, true};
  const float* mass = tempering ? tempered : sums;
  const double target = static_cast<double>(u) * (tempering ? tempered_total : total);
  // the block: the first whose cumulative sum reaches the target, among those with mass
  double before = 0.0, before_last = 0.0;
  int64_t chosen = -1, last = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (mass[b] <= 0.0f) continue;
    if (before + mass[b] >= target) {
      chosen = b;
      break;
    }
    last = b;
    before_last = before;
    before += mass[b];
  }
  if (chosen < 0) {  // rounding: u * total past the last sum
    chosen = last;
    before = before_last;
  }
  // the token: the first in the block whose cumulative sum reaches it, among those with mass
  const int64_t lo = chosen * block, hi = lo + block < vocab ? lo + block : vocab;
  double running = before;
  int64_t token = -1;
  for (int64_t i = lo; i < hi; ++i) {
    const float d = value(x, i) - top;
    const float p = exp_nonpositive(d * (tempering ? inverse : 1.0f));
    if (p <= 0.0f) continue;
    token = i;
    running += p;
    if (running >= target) break;
  }
  return {token < 0 ? at : token, logsumexp, true};
}

template <typename T>
void draw_rows(const T* logits, int64_t rows, int64_t vocab, int64_t stride, int64_t block,
               const float* u, const float* temperature, const bool* greedy, int64_t* tokens,
               double* logsumexp, bool* finite, float* maxima, int threads) {
  const int64_t blocks = (vocab + block - 1) / block;
  #pragma omp parallel num_threads(threads)
  {
    std::vector<float> sums(blocks), tempered(blocks);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const Row out = draw_row(logits + r * stride, vocab, block, u[r], temperature[r], greedy[r],
                               maxima + r * blocks, sums.data(), tempered.data());
      tokens[r] = out.token;
      logsumexp[r] = out.logsumexp;
      finite[r] = out.finite;
    }
  }
}

// A row's draw under its top-k, then top-p on what top-k kept (draw.py's `_filtered_draw`),
// without sorting the vocabulary: torch's sort of 128 rows x 49,152 probabilities took ~330 ms
// a step on an AMX Xeon, against ~3.5 ms for the whole draw of unfiltered rows. Only the
// candidates that the filters can keep are sorted (by value, ties by ascending index: a stable
// sort's order, where torch's sort leaves the order of ties unspecified):
// - top-k (k at most the row's spans of 64 tokens): the logits at least as large as the k-th
//   largest span maximum, which is at most the row's k-th logit;
// - otherwise a histogram of the row's exp(logit - max) by their top bits (an exponent and 3
//   mantissa bits: 8 bins an octave, in the values' order) gives the least bin from which up
//   the tokens hold the k best, or with top-p alone more than p of the row's mass (with
//   top-p alone only the values that can matter are binned).
// Then as the torch form: the k-th value, every token at least as large kept (ties with it
// too), their total; a token dropped where the mass above it is p of that total or more; the
// inverse CDF of the rest at u, a token without mass never drawn. Sums in fp64; the exp is the
// unfiltered draw's, so a token differs from the torch form's only where u falls within
// rounding of a boundary.
constexpr int kBinShift = 20;  // fp32 bits >> 20: the sign (0), 8 exponent bits, 3 mantissa
constexpr int kBins = 1024;  // values in [0, 1]: bits <= 0x3f800000, keys <= 1016

struct Candidate {
  float mass;
  int64_t index;
};

constexpr int64_t kSpan = 64;  // tokens a span, whose maximum bounds top-k's candidates

struct FilterScratch {
  std::vector<float> mass;  // the row's exp((logit - max) / temperature)
  std::vector<float> span_max, order;
  std::vector<Candidate> candidates;
  double bin_mass[kBins];
  int64_t bin_count[kBins];
};

inline int key(float v) { return int(std::bit_cast<uint32_t>(v) >> kBinShift); }

// f(j) for each j in [i, i + 16) with e[j] >= least, a whole vector's lanes compared at once
// where the CPU has AVX-512 (in a peaked row most vectors hold none).
template <typename F>
inline void each_at_least(const float* e, int64_t i, float least, F f) {
#ifdef __AVX512F__
  uint32_t m = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), _mm512_set1_ps(least), _CMP_GE_OQ);
  for (; m; m &= m - 1) f(i + __builtin_ctz(m));
#else
  for (int64_t j = i; j < i + kLanes; ++j)
    if (e[j] >= least) f(j);
#endif
}

template <typename T>
int64_t filtered_row(const T* x, int64_t vocab, float u, float temperature, int64_t k, float p,
                     FilterScratch& s) {
  bool bad = false;
  const float top = block_max(x, 0, vocab, &bad);
  if (bad) return -1;  // (not finite: the unfiltered call's report stands)
  const float inverse = 1.0f / temperature;
  std::vector<Candidate>& c = s.candidates;
  c.clear();
  const int64_t spans = (vocab + kSpan - 1) / kSpan;
  double all = 0.0;  // the row's total (top-p alone filters by it)
  if (k < vocab && k <= spans) {
    // Top-k: the k-th largest span maximum is at most the row's k-th logit (k spans hold one
    // at least as large), so the candidates are the logits at least that large, in the spans
    // whose maximum is; only theirs are exponentiated.
    s.span_max.resize(spans);
    for (int64_t b = 0; b < spans; ++b) {
      bool unused = false;
      s.span_max[b] = block_max(x, b * kSpan, std::min(vocab, (b + 1) * kSpan), &unused);
    }
    s.order.assign(s.span_max.begin(), s.span_max.end());
    std::nth_element(s.order.begin(), s.order.begin() + (k - 1), s.order.end(),
                     std::greater<float>());
    const float least = s.order[k - 1];
    for (int64_t b = 0; b < spans; ++b)
      if (s.span_max[b] >= least)
        for (int64_t i = b * kSpan; i < std::min(vocab, (b + 1) * kSpan); ++i)
          if (value(x, i) >= least)
            c.push_back({exp_nonpositive((value(x, i) - top) * inverse), i});
  } else {
    s.mass.assign((vocab + kLanes - 1) / kLanes * kLanes, 0.0f);  // (whole vectors)
    float* e = s.mass.data();
    int64_t i = 0;
    all = exp_sum_lanes<true>(x, i, vocab, top, inverse, e);  // (the tail's sum in fp64)
    for (; i < vocab; ++i) all += (e[i] = exp_nonpositive((value(x, i) - top) * inverse));
    // the least bin from which up the candidates hold what the filters can keep
    std::memset(s.bin_mass, 0, sizeof s.bin_mass);
    std::memset(s.bin_count, 0, sizeof s.bin_count);
    // With top-p alone, only values of at least (1 - p) / 2 of the mean are binned. All below
    // hold less than (1 - p) / 2 of the total, so those above hold more than p of it (for p
    // below 1 - 2e-6; above, the search below finds no bin and takes every token). A peaked
    // row has few: SmolLM2's rows at top-p 0.9 took 2.6x as long binned whole. Otherwise
    // every value is binned (the k-th may be any).
    const bool top_p_alone = !(k < vocab) && p < 1.0f;
    const float floor = top_p_alone ? float(0.5 * (1.0 - double(p)) * all / double(vocab)) : 0.0f;
    for (i = 0; i < vocab; i += kLanes)  // (e's lanes past vocab are zeros: not tokens)
      each_at_least(e, i, floor, [&](int64_t j) {
        if (j < vocab) {
          s.bin_mass[key(e[j])] += e[j];
          ++s.bin_count[key(e[j])];
        }
      });
    int first = 0;
    if (k < vocab) {
      int64_t seen = 0;
      for (int b = kBins - 1; b >= 0; --b)
        if ((seen += s.bin_count[b]) >= k) {
          first = b;
          break;
        }
    } else if (p < 1.0f) {  // more than p of the mass (a margin over the sums' rounding)
      const double wanted = double(p) * all * (1.0 + 1e-6);
      double held = 0.0;
      for (int b = kBins - 1; b >= 0; --b)
        if ((held += s.bin_mass[b]) > wanted) {
          first = b;
          break;
        }
    }
    const float least = std::bit_cast<float>(uint32_t(first) << kBinShift);
    for (i = 0; i < vocab; i += kLanes)
      each_at_least(e, i, least, [&](int64_t j) {
        if (j < vocab) c.push_back({e[j], j});
      });
  }
  std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) {
    return a.mass > b.mass || (a.mass == b.mass && a.index < b.index);
  });
  int64_t kept = int64_t(c.size());
  double total = all;  // top-k keeps every token: the nucleus of the whole row's mass
  if (k < vocab) {
    const float kth = c[k - 1].mass;
    kept = k;
    while (kept < int64_t(c.size()) && c[kept].mass >= kth) ++kept;
    total = 0.0;
    for (int64_t j = 0; j < kept; ++j) total += c[j].mass;
  }
  int64_t n = kept;
  if (p < 1.0f) {  // dropped: a token with p of the kept mass or more above it
    double above = 0.0;
    for (int64_t j = 0; j < kept; ++j) {
      if (above / total >= double(p)) {
        n = j;
        break;
      }
      above += c[j].mass;
    }
  }
  double nucleus = 0.0;
  for (int64_t j = 0; j < n; ++j) nucleus += c[j].mass;
  const double target = double(u) * nucleus;
  double running = 0.0;
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (c[j].mass <= 0.0f) continue;
    last = j;
    running += c[j].mass;
    if (running >= target) break;
  }
  return c[last < 0 ? 0 : last].index;
}

template <typename T>
void draw_filtered(const T* logits, int64_t count, const int64_t* rows, int64_t vocab,
                   int64_t stride, const float* u, const float* temperature, const int64_t* top_k,
                   const float* top_p, int64_t* tokens, int threads) {
  #pragma omp parallel num_threads(threads) if (count > 1)
  {
    FilterScratch scratch;
    #pragma omp for schedule(dynamic)
    for (int64_t f = 0; f < count; ++f)
      tokens[f] = filtered_row(logits + rows[f] * stride, vocab, u[f], temperature[f],
                               top_k[f], top_p[f], scratch);
  }
}

}  // namespace

// logits [rows, vocab] (row `stride` elements apart), fp32 or bf16 (`bf16`); u, temperature
// and greedy [rows]. Out: tokens [rows], logsumexp [rows] at temperature 1 (NaN where a logit
// is not finite), finite [rows], the block maxima [rows, ceil(vocab / block)] (NaN in a row
// that is not finite).
extern "C" void draw_rows(const void* logits, int bf16, int64_t rows, int64_t vocab,
                          int64_t stride, int64_t block, const float* u, const float* temperature,
                          const bool* greedy, int64_t* tokens, double* logsumexp, bool* finite,
                          float* maxima, int threads) {
  if (bf16)
    draw_rows(static_cast<const uint16_t*>(logits), rows, vocab, stride, block, u, temperature,
              greedy, tokens, logsumexp, finite, maxima, threads);
  else
    draw_rows(static_cast<const float*>(logits), rows, vocab, stride, block, u, temperature,
              greedy, tokens, logsumexp, finite, maxima, threads);
}

// The rows `rows` [count] of logits [*, vocab] (row `stride` elements apart), fp32 or bf16,
// drawn under their top-k ([count], 1 <= k <= vocab; vocab: none) and top-p ([count], in
// (0, 1]; 1: none) at their uniform and temperature ([count] each). Out: tokens [count], -1
// for a row with a logit that is not finite. Returns 1 where an argument is out of range.
extern "C" int draw_filtered_rows(const void* logits, int bf16, int64_t count, const int64_t* rows,
                                  int64_t vocab, int64_t stride, const float* u,
                                  const float* temperature, const int64_t* top_k,
                                  const float* top_p, int64_t* tokens, int threads) {
  if (count < 0 || vocab <= 0 || stride < 0) return 1;  // (rows may be one row, repeated)
  for (int64_t f = 0; f < count; ++f)
    if (rows[f] < 0 || top_k[f] < 1 || top_k[f] > vocab || !(temperature[f] > 0.0f)) return 1;
  if (bf16)
    draw_filtered(static_cast<const uint16_t*>(logits), count, rows, vocab, stride, u,
                  temperature, top_k, top_p, tokens, threads);
  else
    draw_filtered(static_cast<const float*>(logits), count, rows, vocab, stride, u, temperature,
                  top_k, top_p, tokens, threads);
  return 0;
}
