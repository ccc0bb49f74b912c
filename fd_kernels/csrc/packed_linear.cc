// Linear layers on weights packed once into MKL's internal GEMM layout.
//
//   fd_pack_weight(weight [k, n] float32, transposed=false) -> packed (uint8, MKL's layout)
//       packs B = weight, or B = weight^T for a [n, k] weight (a tied lm_head) when transposed;
//   fd_packed_linear(x [..., k] float32, packed, n) -> [..., n] = x @ B
//
// Packing moves the per-call repacking of B out of every step: at a decode step's few rows it
// is a large share of the matmul. MKL's entry points come from Paddle's libmklml_intel.so
// (mkl_api.h; its path given at the first packing; the same library instance Paddle's matmuls
// use, so the same thread count). The packed buffer is a Paddle tensor
// that never moves (MKL's layout must not be copied to another address).

#include <cstdint>
#include <string>
#include <vector>

#include "fresh_pages.h"
#include "mkl_api.h"
#include "paddle/extension.h"

namespace {

using namespace mkl_api;

// The row count the packing is sized for; MKL's packed B serves any row count.
constexpr int kPackRows = 64;

}  // namespace

std::vector<paddle::Tensor> PackWeight(const paddle::Tensor& weight, bool transposed, const std::string& mkl_path) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32 && weight.shape().size() == 2,
           "fd_pack_weight: a 2-D float32 weight");
  const int rows = static_cast<int>(weight.shape()[0]), cols = static_cast<int>(weight.shape()[1]);
  const int k = transposed ? cols : rows, n = transposed ? rows : cols;
  const Functions& m = functions(mkl_path);
  const auto bytes = static_cast<int64_t>(m.get_size(kBMatrix, kPackRows, n, k));
  auto packed = paddle::empty({bytes}, paddle::DataType::UINT8, weight.place());
  discard_pages(packed.data<uint8_t>(), bytes);   // MKL writes part of it (fresh_pages.h)
  m.pack(kRowMajor, kBMatrix, transposed ? kTrans : kNoTrans, kPackRows, n, k, 1.0f, weight.data<float>(), cols,
         reinterpret_cast<float*>(packed.data<uint8_t>()));
  return {packed};
}

std::vector<paddle::Tensor> PackedLinear(const paddle::Tensor& x, const paddle::Tensor& packed, int n) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "fd_packed_linear: float32 input");
  auto shape = x.shape();
  const int k = static_cast<int>(shape.back());
  const int rows = static_cast<int>(x.numel() / k);
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (rows > 0)
    functions().compute(kRowMajor, kNoTrans, kPacked, rows, n, k, x.data<float>(), k,
                  reinterpret_cast<const float*>(packed.data<uint8_t>()), n, 0.0f, out.data<float>(), n);
  return {out};
}

std::vector<std::vector<int64_t>> PackWeightShape(const std::vector<int64_t>&) { return {{-1}}; }
std::vector<paddle::DataType> PackWeightDtype(const paddle::DataType&) { return {paddle::DataType::UINT8}; }

std::vector<std::vector<int64_t>> PackedLinearShape(const std::vector<int64_t>& x, const std::vector<int64_t>&, int n) {
  auto shape = x;
  shape.back() = n;
  return {shape};
}
std::vector<paddle::DataType> PackedLinearDtype(const paddle::DataType& x, const paddle::DataType&) { return {x}; }

PD_BUILD_OP(fd_pack_weight)
    .Inputs({"Weight"})
    .Outputs({"Packed"})
    .Attrs({"transposed: bool", "mkl_path: std::string"})
    .SetKernelFn(PD_KERNEL(PackWeight))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightDtype));

PD_BUILD_OP(fd_packed_linear)
    .Inputs({"X", "Packed"})
    .Outputs({"Out"})
    .Attrs({"n: int"})
    .SetKernelFn(PD_KERNEL(PackedLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(PackedLinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackedLinearDtype));
