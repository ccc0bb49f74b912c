// bfloat16 as bits: the upper 16 bits of a float32. Widening is a shift; narrowing rounds to
// nearest even (a NaN stays a quiet NaN), written without a branch so that loops calling it vectorise.

#pragma once

#include <cstdint>
#include <cstring>

inline uint16_t round_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

inline float widen_bf16_bits(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}
