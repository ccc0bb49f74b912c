// RMSNorm with the residual add fused in, on every ISA the compiler targets:
//
//   s = x + residual   (s = x without a residual)
//   out = s / sqrt(mean(s * s) + eps) * weight
//
// x, residual [T, hidden] float32 (contiguous), weight [hidden]; returns (out, s). One pass
// writes s and sums its squares, a second scales; loops are written for the vectoriser, rows are
// spread over OpenMP threads when there are enough of them to pay for it (a prefill chunk).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int64_t kMinValuesPerThread = 1 << 16;

}  // namespace

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                    const paddle::Tensor& weight, float eps, bool has_residual, int num_threads) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && weight.dtype() == paddle::DataType::FLOAT32,
           "fd_rms_norm: float32 only");
  const auto shape = x.shape();
  const int64_t hidden = shape.back();
  const int64_t rows = x.numel() / hidden;
  PD_CHECK(weight.numel() == hidden, "fd_rms_norm: weight has ", weight.numel(), " values, rows have ", hidden);
  PD_CHECK(!has_residual || residual.numel() == x.numel(), "fd_rms_norm: residual shape differs from x");
  auto out = paddle::empty(shape, x.dtype(), x.place());
  auto sum = paddle::empty(shape, x.dtype(), x.place());   // without a residual: a copy of x
  const float* xp = x.data<float>();
  const float* rp = has_residual ? residual.data<float>() : nullptr;
  const float* w = weight.data<float>();
  float* op = out.data<float>();
  float* sp = sum.data<float>();
  const int threads =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, rows * hidden / kMinValuesPerThread)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * hidden;
    float* s = sp + r * hidden;
    if (has_residual) {
      const float* rr = rp + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) s[i] = xr[i] + rr[i];
    } else {
      std::copy(xr, xr + hidden, s);
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += s[i] * s[i];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    float* o = op + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = s[i] * inv * w[i];
  }
  return {out, sum};
}

std::vector<std::vector<int64_t>> RmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                               const std::vector<int64_t>&) {
  return {x, x};
}

std::vector<paddle::DataType> RmsNormDtype(const paddle::DataType& x, const paddle::DataType&,
                                           const paddle::DataType&) {
  return {x, x};
}

PD_BUILD_OP(fd_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Out", "Sum"})
    .Attrs({"eps: float", "has_residual: bool", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormDtype));
