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

#if defined(__AVX512F__)
#include <immintrin.h>

// round_to_bf16_bits of 16 floats at once, the same bits (GCC does not vectorise the scalar
// function's 16-bit stores without AVX-512BW).
inline void round_to_bf16_bits16(const float* x, uint16_t* out) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                               _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}
#endif
