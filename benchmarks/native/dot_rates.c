// Multiply-accumulate rates of one core, from registers and L1 only (no memory traffic): what a
// float32 FMA kernel can reach beside int8 dot products with llama.cpp's per-32 block scales, and
// int8 with one scale per row. Build and run (AVX2 + FMA machines):
//
//   gcc -O3 -mavx2 -mfma benchmarks/native/dot_rates.c -o /tmp/dot_rates && /tmp/dot_rates
//
// It prints one JSON line: GMAC/s of each loop. The int8 loops use vpmaddubsw + vpmaddwd (no
// VNNI), as kernels/csrc/int8_inputs.h does on a CPU without it.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

enum { kBlocks = 16, kBlock = 32, kRepeats = 2000000 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static float lane0_sum(const __m256* acc, int n) {   // keeps the results live
  float total = 0.0f;
  for (int i = 0; i < n; ++i) total += _mm256_cvtss_f32(acc[i]);
  return total;
}

// 12 independent FMA chains: the core's float32 peak.
static double fp32_fma(float* sink) {
  __m256 acc[12];
  const __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps((float)i);
  const double begin = now();
  for (long r = 0; r < kRepeats * 16L; ++r)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  const double seconds = now() - begin;
  *sink += lane0_sum(acc, 12);
  return kRepeats * 16.0 * 12 * 8 / seconds / 1e9;
}

static uint8_t weights[4][kBlocks * kBlock] __attribute__((aligned(32)));
static int8_t inputs[2][kBlocks * kBlock] __attribute__((aligned(32)));
static float weight_scales[4][kBlocks], input_scales[2][kBlocks];

// 2 input rows x 4 weight rows, k = 512: per block of 32 the int32 sums are widened to float32 and
// multiplied by the two blocks' scales (llama.cpp's Q8 x Q4/Q8 arithmetic) when PerBlock, else
// kept in int32 to the end of the row (one scale per row).
static double int8_dots(int per_block, float* sink) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[8];
  __m256i iacc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps(), iacc[i] = _mm256_setzero_si256();
  const double begin = now();
  for (long r = 0; r < kRepeats; ++r) {
    for (int b = 0; b < kBlocks; ++b) {
      __m256i w[4];
      __m256 ws[4];
      for (int n = 0; n < 4; ++n) {
        w[n] = _mm256_load_si256((const __m256i*)(weights[n] + b * kBlock));
        ws[n] = _mm256_broadcast_ss(&weight_scales[n][b]);
      }
      for (int m = 0; m < 2; ++m) {
        const __m256i x = _mm256_load_si256((const __m256i*)(inputs[m] + b * kBlock));
        const __m256 xs = _mm256_broadcast_ss(&input_scales[m][b]);
        for (int n = 0; n < 4; ++n) {
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w[n], x), ones);
          if (per_block)
            acc[m * 4 + n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xs, ws[n]), acc[m * 4 + n]);
          else
            iacc[m * 4 + n] = _mm256_add_epi32(iacc[m * 4 + n], dot);
        }
      }
    }
  }
  const double seconds = now() - begin;
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], _mm256_cvtepi32_ps(iacc[i]));
  *sink += lane0_sum(acc, 8);
  return (double)kRepeats * kBlocks * kBlock * 8 / seconds / 1e9;
}

int main(void) {
  for (int n = 0; n < 4; ++n)
    for (int i = 0; i < kBlocks * kBlock; ++i) weights[n][i] = (uint8_t)((i * 7 + n) % 16);   // Q4 codes
  for (int m = 0; m < 2; ++m)
    for (int i = 0; i < kBlocks * kBlock; ++i) inputs[m][i] = (int8_t)((i * 13 + m) % 255 - 127);
  for (int b = 0; b < kBlocks; ++b) {
    for (int n = 0; n < 4; ++n) weight_scales[n][b] = 0.01f * (b + n + 1);
    for (int m = 0; m < 2; ++m) input_scales[m][b] = 0.02f * (b + m + 1);
  }
  float sink = 0.0f;
  const double fp32 = fp32_fma(&sink), block = int8_dots(1, &sink), row = int8_dots(0, &sink);
  printf("{\"fp32_fma_gmac_s\": %.1f, \"int8_block_scaled_gmac_s\": %.1f, \"int8_row_scaled_gmac_s\": %.1f, "
         "\"sink\": %g}\n", fp32, block, row, sink);
  return 0;
}
