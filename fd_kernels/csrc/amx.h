// What the AMX kernels share: the process's permission to use the tile registers, and the tile
// configuration's layout (palette 1: eight tiles of at most 16 rows of 64 bytes).

#pragma once

#if defined(__AMX_BF16__)

#include <cstdint>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands a process the AMX tile registers only when asked (arch_prctl), once.
inline bool amx_granted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of the whole configuration. GCC 12's _tile_loadconfig tells the compiler it reads only
// the first 8 bytes, so once inlined the stores of the rows and widths can be dropped as dead
// (seen: ldtilecfg faulting on a half-written configuration).
inline void load_tile_config(const TileConfig& config) { __asm__ volatile("ldtilecfg %0" ::"m"(config)); }

#endif  // __AMX_BF16__
