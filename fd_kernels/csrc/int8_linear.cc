// Linear layers in integers: int8 weights (one scale per output channel) times uint8 inputs (one
// scale and zero point per row), by MKL's integer GEMM (linear_weights = "int8"):
//
//   fd_pack_int8(codes [n, k] int8, mkl_path) -> packed (uint8, MKL's layout of B = codes^T)
//   fd_int8_linear(x [..., k] float32, packed, scales [n] float32, code_sums [n] int32, n, num_threads)
//       -> [..., n] ~ x @ W^T
//
// A row of x is quantized as fd_kernels.quantized.quantize_uint8_rows defines (the same bits):
// x ~ s * (q - z). Output (m, j) is (s_m * scales[j]) * float(sum_i q_mi c_ji - z_m * code_sums[j]),
// the integer sums exact: the weight codes stay within [-64, 64] (quantize_int8_channels), so that
// MKL's vpmaddubsw pairs on CPUs without VNNI never saturate (2 * 255 * 64 < 2^15). On an AVX2
// CPU that GEMM runs at about twice float32 MKL's rate (~370 against ~190 GOP/s at 2,048 rows on
// two Zen 3 cores), and the weights are a quarter of the bytes.
//
// Rows go in chunks of kChunkRows: a chunk's int32 sums stay in the cache between the GEMM and
// the pass that scales them into the output.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "aligned.h"
#include "fresh_pages.h"
#include "mkl_api.h"
#include "paddle/extension.h"

namespace {

using namespace mkl_api;

constexpr int kPackRows = 64;            // the row count MKL's packing is sized for; any count runs
constexpr int64_t kChunkRows = 512;
constexpr int64_t kMinValuesPerThread = 1 << 14;

// Row r of x (k values) into codes, *scale and *zero (see the header).
void quantize_row(const float* x, int64_t k, uint8_t* codes, float* scale, int32_t* zero) {
  float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t i = 0; i < k; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const float s = (hi - lo) / 255.0f;
  const float inverse = s != 0.0f ? 1.0f / s : 0.0f;
  const float z = std::clamp(std::nearbyint(-lo * inverse), 0.0f, 255.0f);
#pragma omp simd
  for (int64_t i = 0; i < k; ++i)
    codes[i] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[i] * inverse) + z, 0.0f, 255.0f));
  *scale = s;
  *zero = static_cast<int32_t>(z);
}

// y = x @ W^T for `rows` rows, a chunk at a time.
void int8_linear(const float* x, int64_t rows, int64_t k, const uint8_t* packed, const float* scales,
                 const int32_t* code_sums, int64_t n, float* y, int threads) {
  thread_local AlignedVector<uint8_t> codes;
  thread_local AlignedVector<int32_t> sums;
  thread_local std::vector<float> row_scales;
  thread_local std::vector<int32_t> zeros;
  const int64_t chunk = std::min(rows, kChunkRows);
  codes.resize(static_cast<size_t>(chunk * k));
  sums.resize(static_cast<size_t>(chunk * n));
  row_scales.resize(static_cast<size_t>(chunk));
  zeros.resize(static_cast<size_t>(chunk));
  // the calling thread's buffers, by pointer: inside the parallel regions `codes` would name each
  // worker's own (empty) thread_local
  uint8_t* const codes_at = codes.data();
  int32_t* const sums_at = sums.data();
  float* const scales_at = row_scales.data();
  int32_t* const zeros_at = zeros.data();
  const int32_t no_offset = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t count = std::min(chunk, rows - r0);
    const int team = static_cast<int>(std::clamp<int64_t>(count * std::max(k, n) / kMinValuesPerThread, 1, threads));
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < count; ++r)
      quantize_row(x + (r0 + r) * k, k, codes_at + r * k, scales_at + r, zeros_at + r);
    int8_functions().compute(kRowMajor, kNoTrans, kPacked, kFixOffset, static_cast<int>(count), static_cast<int>(n),
                             static_cast<int>(k), 1.0f, codes_at, static_cast<int>(k), 0, packed,
                             static_cast<int>(k), 0, 0.0f, sums_at, static_cast<int>(n), &no_offset);
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < count; ++r) {
      const int32_t* in = sums_at + r * n;
      float* out = y + (r0 + r) * n;
      const float s = scales_at[r];
      const int32_t z = zeros_at[r];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = (s * scales[j]) * static_cast<float>(in[j] - z * code_sums[j]);
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> PackInt8(const paddle::Tensor& codes, const std::string& mkl_path) {
  PD_CHECK(codes.dtype() == paddle::DataType::INT8 && codes.shape().size() == 2, "fd_pack_int8: 2-D int8 codes");
  const int n = static_cast<int>(codes.shape()[0]), k = static_cast<int>(codes.shape()[1]);
  const Int8Functions& m = int8_functions(mkl_path);
  const auto bytes = static_cast<int64_t>(m.get_size(kBMatrix, kPackRows, n, k));
  auto packed = paddle::empty({bytes}, paddle::DataType::UINT8, codes.place());
  discard_pages(packed.data<uint8_t>(), bytes);   // MKL writes part of it (fresh_pages.h)
  m.pack(kRowMajor, kBMatrix, kTrans, kPackRows, n, k, codes.data<int8_t>(), k, packed.data<uint8_t>());
  return {packed};
}

std::vector<paddle::Tensor> Int8Linear(const paddle::Tensor& x, const paddle::Tensor& packed,
                                       const paddle::Tensor& scales, const paddle::Tensor& code_sums, int n,
                                       int num_threads) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "fd_int8_linear: float32 input");
  PD_CHECK(scales.dtype() == paddle::DataType::FLOAT32 && code_sums.dtype() == paddle::DataType::INT32 &&
               scales.numel() == n && code_sums.numel() == n,
           "fd_int8_linear: ", n, " float32 scales and int32 code sums");
  auto shape = x.shape();
  const int64_t k = shape.back();
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (rows > 0 && n > 0)
    int8_linear(x.data<float>(), rows, k, packed.data<uint8_t>(), scales.data<float>(), code_sums.data<int32_t>(), n,
                out.data<float>(), std::max(1, num_threads));
  return {out};
}

std::vector<std::vector<int64_t>> PackInt8Shape(const std::vector<int64_t>&) { return {{-1}}; }
std::vector<paddle::DataType> PackInt8Dtype(const paddle::DataType&) { return {paddle::DataType::UINT8}; }

std::vector<std::vector<int64_t>> Int8LinearShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                  const std::vector<int64_t>&, const std::vector<int64_t>&, int n) {
  auto shape = x;
  shape.back() = n;
  return {shape};
}
std::vector<paddle::DataType> Int8LinearDtype(const paddle::DataType& x, const paddle::DataType&,
                                              const paddle::DataType&, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(fd_pack_int8)
    .Inputs({"Codes"})
    .Outputs({"Packed"})
    .Attrs({"mkl_path: std::string"})
    .SetKernelFn(PD_KERNEL(PackInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(PackInt8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackInt8Dtype));

PD_BUILD_OP(fd_int8_linear)
    .Inputs({"X", "Packed", "Scales", "CodeSums"})
    .Outputs({"Out"})
    .Attrs({"n: int", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(Int8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Int8LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Int8LinearDtype));
