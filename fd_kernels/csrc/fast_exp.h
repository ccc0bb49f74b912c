// exp(x) in float32 for the kernels' vectorised loops (softmax, SiLU).
//
// x = n ln2 + r with |r| <= ln2/2; exp(r) by a degree-6 polynomial (relative error < 2e-7, the
// size of expf's rounding); 2^n by building the float's exponent bits. x is clamped to
// [-87, 88]: below, the result is ~1e-38 instead of a denormal or 0, above it stays finite.
// Plain arithmetic only, so `#pragma omp simd` loops that call it vectorise.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>

#include <initializer_list>
#endif

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to nearest in plain arithmetic
  // (std::nearbyint would keep the loop from vectorising).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// fast_exp of 16 lanes, the same steps in AVX-512 intrinsics (for loops GCC would not vectorise
// with the accumulators kept in registers).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif
