// bfloat16 products in vdpbf16ps tiles (a build with -mavx512bf16: see bf16_linear.cc), shared by
// the linear layer and the fused MLP (bf16_mlp.cc).
//
// Operands: A, rows rounded to bfloat16, row-major, each padded with zeros to an even length kp;
// B, a weight in fd_pack_bf16's panels of 16 output features, each panel's rows of k in pairs (the
// 32 bits of a lane hold k = 2j and 2j + 1 of one feature). One vdpbf16ps adds, to each of 16
// float32 sums, the exact products of one pair of k: a row's pair is broadcast against a panel's
// 16 pairs. Every sum runs over k in order, in one register, whatever the tile or thread split, so
// the linear and the MLP give the same bits for the same products.

#pragma once

#if defined(__AVX512BF16__)

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "bf16.h"

namespace dot_bf16 {

constexpr int kLanes = 16;   // features per panel

// A row of k float32 values rounded into `a` (kp values, the padding zero).
inline void round_row(const float* x, int64_t k, int64_t kp, uint16_t* a) {
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) round_to_bf16_bits16(x + i, a + i);
  for (; i < k; ++i) a[i] = round_to_bf16_bits(x[i]);
  for (; i < kp; ++i) a[i] = 0;
}

// acc[r][p] = sums of R rows of A (lda apart) with panels w[p] over kp (even) values of k.
template <int R, int P>
inline void accumulate(const uint16_t* a, int64_t lda, const uint16_t* const (&w)[P], int64_t kp,
                       __m512 (&acc)[R][P]) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kp; i += 2) {
    __m512bh pairs[P];
    for (int p = 0; p < P; ++p) pairs[p] = (__m512bh)_mm512_loadu_si512(w[p] + i * kLanes);
    for (int r = 0; r < R; ++r) {
      int32_t both;
      std::memcpy(&both, a + r * lda + i, sizeof both);
      const __m512bh row = (__m512bh)_mm512_set1_epi32(both);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], row, pairs[p]);
    }
  }
}

// y [rows, n] = A [rows, kp] (lda apart) @ the panels of `packed` (kp values of k each), in tiles
// over `threads` OpenMP threads (defined in bf16_linear.cc).
void multiply(const uint16_t* a, int64_t lda, int64_t rows, int64_t kp, const uint16_t* packed, int64_t n, float* y,
              int threads);

}  // namespace dot_bf16

#endif  // __AVX512BF16__
