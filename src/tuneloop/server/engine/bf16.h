// bf16 <-> fp32 as torch converts them, for the engine's C++ loops (native.py builds each
// source with this folder's headers, and a header's change rebuilds them). Branch-free, so
// that the compiler vectorizes the loops they are in.
#pragma once
#include <bit>
#include <cstdint>

namespace bf16 {

inline float to_float(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }

// Round to nearest even, as torch's conversion; NaN kept (quiet).
inline uint16_t from_float(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40u;
  return uint16_t((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// v rounded to bf16 and back: what an eager bf16 operation's result holds.
inline float rounded(float v) { return to_float(from_float(v)); }

}  // namespace bf16
