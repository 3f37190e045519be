// The AMX tile unit's setup for the engine's C++ loops (lora/lora_columns_avx512.cpp,
// attention_tiles.cpp): the tile configuration record and Linux's permission to use the
// tile registers. Include only where __AMX_TILE__ is defined.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use the tile registers: Linux grants them on request, once.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

}  // namespace amx
