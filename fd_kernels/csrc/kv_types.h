// Element types of the paged KV cache: float32, bfloat16 (fp32 math, half the memory traffic), or
// int8 codes with a float32 scale per row (fp32 math, a little over a quarter of float32's traffic).
//
// bfloat16 conversions: bf16.h. load8 / load16 widen consecutive elements into an AVX register.
//
// An int8 cache holds, per block and KV head, block_size rows of head_dim codes and then block_size
// float32 scales: row r's values are its codes times scale r (the row's largest magnitude / 127,
// written by rope_kv.cc). Its tensor is int8 [N, Hkv, bs, D + 4]: the shape sizes a block's bytes,
// the layout inside a block and head is all codes first, so that rows stay d apart as in the others.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "paddle/extension.h"

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == sizeof(paddle::bfloat16), "bfloat16 is 16 bits");
struct Int8Code {
  int8_t bits;
};

// Whether rows of T carry a scale (the int8 cache), and the elements it adds to a row in the shape.
template <typename T>
constexpr bool kScaledRows = std::is_same_v<T, Int8Code>;
template <typename T>
constexpr int64_t kRowExtra = kScaledRows<T> ? 4 : 0;

// The scales of a block and head of an int8 cache, from the start of its codes.
inline const float* row_scales(const Int8Code* codes, int64_t block_size, int64_t d) {
  return reinterpret_cast<const float*>(codes + block_size * d);
}

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) { return widen_bf16_bits(x.bits); }
inline float to_float(Int8Code x) { return static_cast<float>(x.bits); }

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
inline __m256 load8(const Int8Code* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const Int8Code* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
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
template <>
inline const Int8Code* cache_data<Int8Code>(const paddle::Tensor& cache) {
  return reinterpret_cast<const Int8Code*>(cache.data<int8_t>());
}
template <typename T>
T* mutable_cache_data(paddle::Tensor& cache) {
  return const_cast<T*>(cache_data<T>(cache));
}

// Whether a cache tensor's dtype is one of the element types above.
inline bool is_cache_dtype(paddle::DataType dtype) {
  return dtype == paddle::DataType::FLOAT32 || dtype == paddle::DataType::BFLOAT16 || dtype == paddle::DataType::INT8;
}

// f(T{}) with T the element type of a cache of `dtype` (checked with is_cache_dtype first).
template <typename F>
void with_cache_type(paddle::DataType dtype, F&& f) {
  if (dtype == paddle::DataType::BFLOAT16) f(Bf16{});
  else if (dtype == paddle::DataType::INT8) f(Int8Code{});
  else f(float{});
}

// The elements a cache of `dtype` adds to each row of head_dim values (the int8 cache's scale).
inline int64_t row_extra(paddle::DataType dtype) {
  int64_t extra = 0;
  with_cache_type(dtype, [&](auto element) { extra = kRowExtra<decltype(element)>; });
  return extra;
}
