// Element types of the paged KV cache: float32, or bfloat16 (fp32 math, half the memory traffic).
//
// A bfloat16 is the upper 16 bits of a float32: widening is a shift, narrowing rounds to nearest
// even (NaN stays NaN). load8 widens eight consecutive elements into an AVX register.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "paddle/extension.h"

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == sizeof(paddle::bfloat16), "bfloat16 is 16 bits");

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) {
  const uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline Bf16 from_float<Bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40)};   // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

// from_float<Bf16>'s bits without a branch, for loops the compiler vectorises.
inline uint16_t round_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// The cache tensor's elements as T (checked against its dtype).
template <typename T>
const T* cache_data(const paddle::Tensor& cache);
template <>
inline const float* cache_data<float>(const paddle::Tensor& cache) { return cache.data<float>(); }
template <>
inline const Bf16* cache_data<Bf16>(const paddle::Tensor& cache) {
  return reinterpret_cast<const Bf16*>(cache.data<paddle::bfloat16>());
}
template <typename T>
T* mutable_cache_data(paddle::Tensor& cache) {
  return const_cast<T*>(cache_data<T>(cache));
}
