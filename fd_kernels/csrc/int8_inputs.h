// Linear inputs quantized to int8 in blocks of 32 (llama.cpp's Q8 activations), for the integer
// dot products of quant_linear.cc:
//
//   block b of row r: scale d = max|x| / 127, codes q_i = rint(x_i / d) (nearest even; 0 when d is
//   0), so x_i ~ d * q_i; `sums[r, b]` = d * sum(q_i), what a block's mins multiply.
//
// The quantized value of x_i is defined as d * q_i with q_i = rint(x_i * (1 / d)), every step in
// float32, so fd_kernels.quantized.quantize_int8_blocks (NumPy) finds the same codes and scales
// bit for bit. dot_u8s8 sums products of unsigned and signed bytes exactly, in 32-bit lanes:
// vpdpbusd where the build has VNNI (avx512_vnni with avx512vl, or avx_vnni), else vpmaddubsw
// (the pairs' sums stay within 16 bits for the codes it gets here) and vpmaddwd.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "aligned.h"

namespace q8 {

constexpr int kBlock = 32;

// `rows` x `k` inputs as int8 blocks (k a multiple of kBlock).
struct Rows {
  AlignedVector<int8_t> codes;   // [rows, k]
  AlignedVector<float> scales;   // [rows, k / 32]
  AlignedVector<float> sums;     // [rows, k / 32]
  int64_t k = 0, blocks = 0;

  const int8_t* codes_of(int64_t row) const { return codes.data() + row * k; }
  const float* scales_of(int64_t row) const { return scales.data() + row * blocks; }
  const float* sums_of(int64_t row) const { return sums.data() + row * blocks; }
};

// One block: its 32 codes into q, its scale and d * sum(q) into *scale and *sum.
inline void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));   // nearest even
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  // packs interleave 128-bit lanes; the permute puts the 32 bytes back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *scale = d;
  *sum = d * static_cast<float>(_mm_cvtsi128_si32(t));
#else
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int total = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    total += q[i];
  }
  *scale = d;
  *sum = d * static_cast<float>(total);
#endif
}

// `rows` x `k` float32 inputs into `out`, whose buffers it sizes.
inline void quantize(const float* x, int64_t rows, int64_t k, int threads, Rows& out) {
  out.k = k;
  out.blocks = k / kBlock;
  out.codes.resize(static_cast<size_t>(rows * k));
  out.scales.resize(static_cast<size_t>(rows * out.blocks));
  out.sums.resize(out.scales.size());
  const int64_t total = rows * out.blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (total >= 4096)
  for (int64_t b = 0; b < total; ++b)
    quantize_block(x + b * kBlock, out.codes.data() + b * kBlock, out.scales.data() + b, out.sums.data() + b);
}

// The quantized values d * q of `rows` rows into out [rows, k] (the GEMM path's input).
inline void dequantize(const Rows& in, int64_t rows, int threads, float* out) {
  const int64_t total = rows * in.blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (total >= 4096)
  for (int64_t b = 0; b < total; ++b)
    for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = in.scales[b] * static_cast<float>(in.codes[b * kBlock + i]);
}

#if defined(__AVX2__)

// Eight 32-bit sums of four products each of unsigned bytes u and signed bytes s.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#endif

}  // namespace q8
