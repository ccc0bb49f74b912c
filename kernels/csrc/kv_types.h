// Element types of the paged KV cache: float32, or bfloat16 (fp32 math, half the memory traffic).
//
// bfloat16 conversions: bf16.h. load8 / load16 widen consecutive elements into an AVX register.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "paddle/extension.h"

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == sizeof(paddle::bfloat16), "bfloat16 is 16 bits");

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) { return widen_bf16_bits(x.bits); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline Bf16 from_float<Bf16>(float x) { return Bf16{round_to_bf16_bits(x)}; }

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
