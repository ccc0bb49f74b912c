// Linear layers on weights kept in 4- or 8-bit blocks (GGUF's Q4_0, Q4_1, Q8_0 and K-quant tensors,
// see fd_kernels/quantized.py):
//
//   fd_quant_linear(x [..., k] float32, codes [n, k * bits / 8] uint8, scales [n, k / 32 or k / 16]
//                   float32, mins [n, k / 32] float32, bits, num_threads, mkl_path, int8_inputs)
//       -> [..., n] = x @ W^T
//
// W's row j (output feature j) is stored in blocks of 32 values along k; block b of row j is
// W[j, 32b + i] = scale * q_i + mins[j, b], with q_i its codes: for bits = 4, 16 bytes whose low
// nibbles are q_0..q_15 and high nibbles q_16..q_31 (GGUF's Q4_0 byte layout), for bits = 8, 32
// int8 codes. A block has one scale, scales[j, b], or two (scales [n, k / 16], Q6_K's scale per
// 16): scales[j, 2b] for q_0..q_15 and scales[j, 2b + 1] for q_16..q_31. The kernel widens each block in registers with one fused multiply-add per
// eight values; since scale * q is exact in float32 (a half-precision scale times a small
// integer), the widened values equal the loader's float32 dequantization bit for bit. Only the
// order of the dot products' sums differs from a float32 GEMM's.
//
// The weights are read once per tile of up to eight input rows, so a decode step reads 4-8x fewer
// bytes than with float32 weights; output features are spread over the OpenMP threads. From
// kGemmRows input rows on (a prefill chunk), where a GEMM's blocking beats re-widening the blocks
// per tile, the weight is widened once into a reused float32 buffer and multiplied by MKL's
// sgemm instead (mkl_path: Paddle's libmklml_intel.so; empty: never).
//
// int8_inputs: x is first quantized to int8 in blocks of 32 (int8_inputs.h), and the result is
// x' @ W^T for its quantized values x'. Below kGemmRows the blocks then meet in integers, as
// llama.cpp's do: per block, sum(q_i * q'_i) exactly (vpdpbusd / vpmaddubsw), times both scales,
// plus the weight block's min times the input block's sum. That is a third of the instructions of
// widening to float32, so a decode step of few rows reads its weights at close to memory speed.
// From kGemmRows rows x' itself goes into the GEMM.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "aligned.h"
#include "int8_inputs.h"
#include "mkl_api.h"
#include "paddle/extension.h"

namespace {

constexpr int kBlock = 32;          // values per quantized block
constexpr int kMaxRows = 8;         // input rows that share one read of a weight block
constexpr int64_t kFeaturesPerTask = 16;
constexpr int64_t kGemmRows = 128;  // measured: below this the tiled kernel is as fast or faster
// Weight rows ahead of the one being multiplied whose cache lines are prefetched. Without it a
// decode step of one row spent ~45% of the kernel's time waiting on the codes' loads (the rows of
// one task are contiguous, but too short a stream for the hardware prefetcher); 4-8 rows ahead
// made SmolLM2's Q4_1 decode 1.5-1.7x faster on the AMX Xeon.
constexpr int64_t kPrefetchRows = 6;

// `k`-value float32 input rows.
struct FloatRows {
  const float* x;
  int64_t k;
};

#if defined(__AVX2__) && defined(__FMA__)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum(a[i] * b[i]) over n floats (a weight row's mins against an input row's block sums).
inline float dot_floats(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// The 32 values of one block, in order, as four registers of eight (`scale`: its Scales scales).
template <int Bits, int Scales>
inline void widen_block(const uint8_t* codes, const float* scale, float min, __m256 w[4]) {
  const __m256 first = _mm256_set1_ps(scale[0]), second = _mm256_set1_ps(scale[Scales - 1]);
  const __m256 m = _mm256_set1_ps(min);
  __m256i q[4];
  if constexpr (Bits == 4) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    uint64_t first, second;
    std::memcpy(&first, codes, 8);
    std::memcpy(&second, codes + 8, 8);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(first)));   // bytes 0-7
    const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(second)));  // bytes 8-15
    q[0] = _mm256_and_si256(a, low);            // values 0-7
    q[1] = _mm256_and_si256(b, low);            // values 8-15
    q[2] = _mm256_srli_epi32(a, 4);             // values 16-23
    q[3] = _mm256_srli_epi32(b, 4);             // values 24-31
  } else {
    for (int j = 0; j < 4; ++j) {
      uint64_t bytes;
      std::memcpy(&bytes, codes + 8 * j, 8);
      q[j] = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
    }
  }
  for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[j]), j < 2 ? first : second, m);
}

// y[r * ldy] = dot(x row r, W row) for R input rows; enough accumulators per row to hide the
// FMA latency when R is small.
template <int Bits, int Scales, int R>
void dot_rows(const FloatRows& in, int64_t row, const uint8_t* codes, const float* scales, const float* mins,
              int64_t blocks, float* y, int64_t ldy) {
  const float* x = in.x + row * in.k;
  const int64_t ldx = in.k;
  constexpr int kAcc = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int64_t kBlockBytes = kBlock * Bits / 8;
  __m256 acc[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    widen_block<Bits, Scales>(codes + b * kBlockBytes, scales + b * Scales, mins[b], w);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      for (int j = 0; j < 4; ++j) acc[r][j % kAcc] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % kAcc]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[r][0];
    for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[r][a]);
    y[r * ldy] = hsum(total);
  }
}


// The 32 codes of one block as bytes: 4-bit codes 0..15 (unsigned), 8-bit ones as stored (signed).
template <int Bits>
inline __m256i block_codes(const uint8_t* codes) {
  if constexpr (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));   // values 0-15, then 16-31
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  }
}

// A block's weight scales times an input block's scale, per lane of dot_u8s8's sums (lanes 0-3
// hold values 0-15, lanes 4-7 values 16-31).
template <int Scales>
inline __m256 block_scales(const float* scale, float input_scale) {
  if constexpr (Scales == 1) return _mm256_set1_ps(scale[0] * input_scale);
  return _mm256_setr_m128(_mm_set1_ps(scale[0] * input_scale), _mm_set1_ps(scale[1] * input_scale));
}

// Integer block products for R int8 input rows: y[r * ldy] = sum_b scale_b * d_rb * sum(q * q')
// + min_b * sums_rb. Signed 8-bit codes go in as |q| against q' with q's sign.
template <int Bits, int Scales, int R>
void dot_rows(const q8::Rows& in, int64_t row, const uint8_t* codes, const float* scales,
              const float* mins, int64_t blocks, float* y, int64_t ldy) {
  constexpr int64_t kBlockBytes = kBlock * Bits / 8;
  __m256 even[R], odd[R];   // sums of the even and the odd blocks: two chains hide the FMA latency
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  const auto add_block = [&](int64_t b, __m256* acc) {
    const __m256i w = block_codes<Bits>(codes + b * kBlockBytes);
    const __m256i unsigned_w = Bits == 4 ? w : _mm256_abs_epi8(w);
    for (int r = 0; r < R; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes_of(row + r) + b * kBlock));
      if constexpr (Bits == 8) x = _mm256_sign_epi8(x, w);
      const __m256 products = _mm256_cvtepi32_ps(q8::dot_u8s8(unsigned_w, x));
      acc[r] = _mm256_fmadd_ps(products, block_scales<Scales>(scales + b * Scales, in.scales_of(row + r)[b]), acc[r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    add_block(b, even);
    add_block(b + 1, odd);
  }
  if (b < blocks) add_block(b, even);
  for (int r = 0; r < R; ++r)
    y[r * ldy] = hsum(_mm256_add_ps(even[r], odd[r])) + dot_floats(mins, in.sums_of(row + r), blocks);
}

#else  // portable build: the same arithmetic, one value at a time

inline float dot_floats(const float* a, const float* b, int64_t n) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

template <int Bits>
inline float code(const uint8_t* codes, int i) {
  if constexpr (Bits == 4) return static_cast<float>(i < 16 ? codes[i] & 0x0F : codes[i - 16] >> 4);
  return static_cast<float>(static_cast<int8_t>(codes[i]));
}

// The scale of value i of a block whose scales start at `scale`.
template <int Scales>
inline float scale_of(const float* scale, int i) {
  return scale[i * Scales / kBlock];
}

template <int Bits, int Scales, int R>
void dot_rows(const FloatRows& in, int64_t row, const uint8_t* codes, const float* scales, const float* mins,
              int64_t blocks, float* y, int64_t ldy) {
  const float* x = in.x + row * in.k;
  const int64_t ldx = in.k;
  constexpr int64_t kBlockBytes = kBlock * Bits / 8;
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = codes + b * kBlockBytes;
    for (int i = 0; i < kBlock; ++i) {
      const float w = std::fma(code<Bits>(block, i), scale_of<Scales>(scales + b * Scales, i), mins[b]);
      for (int r = 0; r < R; ++r) acc[r] += w * x[r * ldx + b * kBlock + i];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = acc[r];
}

template <int Bits, int Scales, int R>
void dot_rows(const q8::Rows& in, int64_t row, const uint8_t* codes, const float* scales,
              const float* mins, int64_t blocks, float* y, int64_t ldy) {
  constexpr int64_t kBlockBytes = kBlock * Bits / 8;
  constexpr int kGroup = kBlock / Scales;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = in.codes_of(row + r);
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b)
      for (int g = 0; g < Scales; ++g) {
        int32_t products = 0;
        for (int i = g * kGroup; i < (g + 1) * kGroup; ++i)
          products += static_cast<int32_t>(code<Bits>(codes + b * kBlockBytes, i)) * x[b * kBlock + i];
        acc += static_cast<float>(products) * (scales[b * Scales + g] * in.scales_of(row + r)[b]);
      }
    y[r * ldy] = acc + dot_floats(mins, in.sums_of(row + r), blocks);
  }
}

#endif

// The float32 values of row j (all its blocks) into out[0, k).
template <int Bits, int Scales>
void widen_row(const uint8_t* codes, const float* scales, const float* mins, int64_t blocks, float* out) {
  constexpr int64_t kBlockBytes = kBlock * Bits / 8;
  for (int64_t b = 0; b < blocks; ++b) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 w[4];
    widen_block<Bits, Scales>(codes + b * kBlockBytes, scales + b * Scales, mins[b], w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * kBlock + 8 * j, w[j]);
#else
    for (int i = 0; i < kBlock; ++i)
      out[b * kBlock + i] = std::fma(code<Bits>(codes + b * kBlockBytes, i), scale_of<Scales>(scales + b * Scales, i),
                                     mins[b]);
#endif
  }
}

// y = x @ W^T by MKL's sgemm on W widened into a buffer this thread keeps for the next call.
template <int Bits, int Scales>
void widened_gemm(const float* x, int64_t rows, int64_t k, const uint8_t* codes, const float* scales,
                  const float* mins, int64_t n, float* y, int threads, const std::string& mkl_path) {
  thread_local AlignedVector<float> widened;
  widened.resize(static_cast<size_t>(n * k));
  const int64_t blocks = k / kBlock, row_bytes = k * Bits / 8;
  float* w = widened.data();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < n; ++j)
    widen_row<Bits, Scales>(codes + j * row_bytes, scales + j * blocks * Scales, mins + j * blocks, blocks, w + j * k);
  using namespace mkl_api;
  functions(mkl_path).gemm(kRowMajor, kNoTrans, kTrans, static_cast<int>(rows), static_cast<int>(n),
                           static_cast<int>(k), 1.0f, x, static_cast<int>(k), w, static_cast<int>(k), 0.0f, y,
                           static_cast<int>(n));
}

// Features [first, last) of input rows [row, row + rows): tiles of up to kMaxRows rows.
template <int Bits, int Scales, class Inputs>
void features(const Inputs& in, int64_t row, int64_t rows, const uint8_t* codes, const float* scales,
              const float* mins, int64_t first, int64_t last, float* y, int64_t n) {
  const int64_t blocks = in.k / kBlock, row_bytes = in.k * Bits / 8;
  for (int64_t r = row; r < row + rows; r += kMaxRows) {
    const int64_t tile = std::min<int64_t>(kMaxRows, row + rows - r);
    for (int64_t j = first; j < last; ++j) {
      const uint8_t* c = codes + j * row_bytes;
      const float *s = scales + j * blocks * Scales, *m = mins + j * blocks;
      float* yr = y + r * n + j;
      if (j + kPrefetchRows < n) {
        for (int64_t at = 0; at < row_bytes; at += kCacheLine) __builtin_prefetch(c + kPrefetchRows * row_bytes + at);
        for (int64_t at = 0; at < blocks * Scales; at += kCacheLine / sizeof(float))
          __builtin_prefetch(s + kPrefetchRows * blocks * Scales + at);
        for (int64_t at = 0; at < blocks; at += kCacheLine / sizeof(float))
          __builtin_prefetch(m + kPrefetchRows * blocks + at);
      }
      switch (tile) {
        case 8: dot_rows<Bits, Scales, 8>(in, r, c, s, m, blocks, yr, n); break;
        case 7: dot_rows<Bits, Scales, 7>(in, r, c, s, m, blocks, yr, n); break;
        case 6: dot_rows<Bits, Scales, 6>(in, r, c, s, m, blocks, yr, n); break;
        case 5: dot_rows<Bits, Scales, 5>(in, r, c, s, m, blocks, yr, n); break;
        case 4: dot_rows<Bits, Scales, 4>(in, r, c, s, m, blocks, yr, n); break;
        case 3: dot_rows<Bits, Scales, 3>(in, r, c, s, m, blocks, yr, n); break;
        case 2: dot_rows<Bits, Scales, 2>(in, r, c, s, m, blocks, yr, n); break;
        default: dot_rows<Bits, Scales, 1>(in, r, c, s, m, blocks, yr, n); break;
      }
    }
  }
}

// Rows are split into groups so that a large prefill chunk still has tasks for every thread
// while each task keeps its tile of input rows in cache across its features.
constexpr int64_t kRowsPerTask = 64;

// y = in @ W^T by the tiled kernel, features spread over the threads.
template <int Bits, int Scales, class Inputs>
void tiled(const Inputs& in, int64_t rows, const uint8_t* codes, const float* scales, const float* mins,
           int64_t n, float* y, int threads) {
  const int64_t feature_tasks = (n + kFeaturesPerTask - 1) / kFeaturesPerTask;
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t rt = 0; rt < row_tasks; ++rt)
    for (int64_t ft = 0; ft < feature_tasks; ++ft) {
      const int64_t r0 = rt * kRowsPerTask;
      const int64_t first = ft * kFeaturesPerTask;
      features<Bits, Scales>(in, r0, std::min(kRowsPerTask, rows - r0), codes, scales, mins, first,
                     std::min(n, first + kFeaturesPerTask), y, n);
    }
}

template <int Bits, int Scales>
void quant_linear(const float* x, int64_t rows, int64_t k, const uint8_t* codes, const float* scales,
                  const float* mins, int64_t n, float* y, int threads, const std::string& mkl_path,
                  bool int8_inputs) {
  const bool gemm = rows >= kGemmRows && !mkl_path.empty();
  if (!int8_inputs) {
    if (gemm) return widened_gemm<Bits, Scales>(x, rows, k, codes, scales, mins, n, y, threads, mkl_path);
    return tiled<Bits, Scales>(FloatRows{x, k}, rows, codes, scales, mins, n, y, threads);
  }
  thread_local q8::Rows quantized;
  q8::quantize(x, rows, k, threads, quantized);
  if (!gemm) return tiled<Bits, Scales>(quantized, rows, codes, scales, mins, n, y, threads);
  thread_local AlignedVector<float> values;   // the quantized inputs' values, for the GEMM
  values.resize(static_cast<size_t>(rows * k));
  q8::dequantize(quantized, rows, threads, values.data());
  widened_gemm<Bits, Scales>(values.data(), rows, k, codes, scales, mins, n, y, threads, mkl_path);
}

}  // namespace

std::vector<paddle::Tensor> QuantLinear(const paddle::Tensor& x, const paddle::Tensor& codes,
                                        const paddle::Tensor& scales, const paddle::Tensor& mins, int bits,
                                        int num_threads, const std::string& mkl_path, bool int8_inputs) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "fd_quant_linear: float32 input");
  PD_CHECK(bits == 4 || bits == 8, "fd_quant_linear: bits must be 4 or 8, not ", bits);
  PD_CHECK(codes.dtype() == paddle::DataType::UINT8 && scales.dtype() == paddle::DataType::FLOAT32 &&
               mins.dtype() == paddle::DataType::FLOAT32,
           "fd_quant_linear: uint8 codes, float32 scales and mins");
  auto shape = x.shape();
  const int64_t k = shape.back();
  const int64_t n = codes.shape()[0];
  PD_CHECK(k % kBlock == 0 && codes.shape()[1] * 8 == k * bits && scales.shape()[0] == n &&
               (scales.shape()[1] == k / kBlock || scales.shape()[1] == 2 * k / kBlock) && mins.shape()[0] == n &&
               mins.shape()[1] == k / kBlock,
           "fd_quant_linear: codes [", n, ", ", codes.shape()[1], "], scales and mins must hold ", k,
           "-value rows of ", bits, "-bit blocks of 32 (one or two scales and one min a block)");
  const bool two_scales = scales.shape()[1] != k / kBlock;
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (rows == 0 || n == 0) return {out};
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  const auto run = [&](auto kernel) {
    kernel(x.data<float>(), rows, k, codes.data<uint8_t>(), scales.data<float>(), mins.data<float>(), n,
           out.data<float>(), threads, mkl_path, int8_inputs);
  };
  if (bits == 4)
    two_scales ? run(quant_linear<4, 2>) : run(quant_linear<4, 1>);
  else
    two_scales ? run(quant_linear<8, 2>) : run(quant_linear<8, 1>);
  return {out};
}

std::vector<std::vector<int64_t>> QuantLinearShape(const std::vector<int64_t>& x, const std::vector<int64_t>& codes,
                                                   const std::vector<int64_t>&, const std::vector<int64_t>&) {
  auto shape = x;
  shape.back() = codes[0];
  return {shape};
}

std::vector<paddle::DataType> QuantLinearDtype(const paddle::DataType& x, const paddle::DataType&,
                                               const paddle::DataType&, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(fd_quant_linear)
    .Inputs({"X", "Codes", "Scales", "Mins"})
    .Outputs({"Out"})
    .Attrs({"bits: int", "num_threads: int", "mkl_path: std::string", "int8_inputs: bool"})
    .SetKernelFn(PD_KERNEL(QuantLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantLinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantLinearDtype));
