// A Llama MLP whose two linears are bfloat16 panels (fd_pack_bf16) with their inputs rounded:
//
//   fd_bf16_mlp(h [T, hidden] float32, gate_up packed ([hidden, 2 m]: gate, then up columns),
//               down packed ([m, n]), m, n, num_threads, mkl_path) -> [T, n]
//       = round(swiglu(round(h) @ Wgate_up)) @ Wdown
//
// bit for bit what fd_bf16_linear (round_inputs) -> fd_swiglu -> fd_bf16_linear (round_inputs)
// give. With AMX (built in, tiles granted, m a multiple of 32) it runs in chunks of kChunkRows rows,
// and a chunk's gate/up sums go from the tiles through SwiGLU straight into the down projection's
// input tiles, in bfloat16: the float32 gate/up sums ([T, 2 m]) are never written out, read back
// by SwiGLU, written again and read again to be rounded. Elsewhere it runs those three ops.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "aligned.h"
#include "amx_gemm.h"
#include "bf16.h"
#include "fast_exp.h"
#include "flush_denormals.h"
#include "ops.h"
#include "paddle/extension.h"

namespace {

#if defined(__AMX_BF16__)

using amx_gemm::kKStep;
using amx_gemm::kLanes;

// Rows of one chunk: its gate/up input and SwiGLU output tiles (hidden + m bfloat16 values a row)
// stay in the CPU's caches between the two products.
constexpr int64_t kChunkRows = 512;

// The gate/up product's epilogue: a block (row tiles x (gate panel, up panel)) through SwiGLU,
// rounded, into the down projection's input tiles `a` (m columns). `scratch`: this thread's, for
// four tiles of sums.
struct SwigluIntoTiles {
  uint16_t* a;
  int64_t m;
  int tile_rows;
  float* scratch;

  template <int Tile>
  void tile(const amx_gemm::BlockAt&, int, int) const {
    amx_gemm::store_tile<Tile>(scratch + Tile * 16 * kLanes, kLanes * 4);   // tile (row tile t, panel p) is 2 t + p
  }

  void done(const amx_gemm::BlockAt& at) const {
    const int row_tiles = at.rows[1] > 0 ? 2 : 1;
    for (int t = 0; t < row_tiles; ++t)
      for (int r = 0; r < tile_rows; ++r) {   // padding rows too: their sums are 0, and so is SwiGLU's
        const float* gate = scratch + (2 * t) * 16 * kLanes + r * kLanes;
        const float* up = gate + 16 * kLanes;
        uint16_t* out = a + amx_gemm::tile_offset(at.row + t * tile_rows + r, at.panel_block * kLanes, m, tile_rows);
        alignas(64) float gated[kLanes];
#pragma omp simd
        for (int i = 0; i < kLanes; ++i) gated[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];   // as fd_swiglu
        round_to_bf16_bits16(gated, out);
      }
  }
};

void amx_mlp(const float* h, int64_t rows, int64_t hidden, const uint16_t* gate_up, const uint16_t* down, int64_t m,
             int64_t n, float* y, int threads) {
  const int64_t kp = (hidden + kKStep - 1) / kKStep * kKStep;
  const int64_t chunk = std::min(rows, kChunkRows);
  const int64_t padded_chunk = (chunk + 15) / 16 * 16;
  thread_local AlignedVector<uint16_t> inputs, activations;
  inputs.resize(static_cast<size_t>(padded_chunk * kp));
  activations.resize(static_cast<size_t>(padded_chunk * m));
  uint16_t* a = inputs.data();   // (the calling thread's buffers, shared by the team)
  uint16_t* gated = activations.data();
  const auto gates = amx_gemm::Panels::gate_up(gate_up, kp, m / kLanes);
  const auto downs = amx_gemm::Panels::plain(down, m, (n + kLanes - 1) / kLanes);
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;   // as fd_swiglu runs
    alignas(64) float scratch[4 * 16 * kLanes];
    for (int64_t at = 0; at < rows; at += chunk) {
      const int64_t count = std::min(chunk, rows - at);
      const int tile_rows = static_cast<int>(std::min<int64_t>(count, 16));
      amx_gemm::round_into_tiles(h + at * hidden, count, hidden, kp, tile_rows, a);
      amx_gemm::configure_tiles(tile_rows);
      amx_gemm::multiply(a, count, kp, tile_rows, gates, m, SwigluIntoTiles{gated, m, tile_rows, scratch});
      amx_gemm::multiply(gated, count, m, tile_rows, downs, n, amx_gemm::StoreSums{y + at * n, n, tile_rows});
    }
    _tile_release();
  }
}

#endif  // __AMX_BF16__

}  // namespace

std::vector<paddle::Tensor> Bf16Mlp(const paddle::Tensor& h, const paddle::Tensor& gate_up, const paddle::Tensor& down,
                                    int m, int n, int num_threads, const std::string& mkl_path) {
  PD_CHECK(h.dtype() == paddle::DataType::FLOAT32, "fd_bf16_mlp: float32 input");
#if defined(__AMX_BF16__)
  const int64_t hidden = h.shape().back(), rows = h.numel() / std::max<int64_t>(hidden, 1);
  if (m % kKStep == 0 && rows > 0 && n > 0 && amx_granted()) {
    const int64_t kp = (hidden + kKStep - 1) / kKStep * kKStep;
    PD_CHECK(gate_up.numel() == 2 * m * kp * 2 && down.numel() == (n + kLanes - 1) / kLanes * kLanes * m * 2,
             "fd_bf16_mlp: the packed weights are not [", hidden, ", 2 x ", m, "] and [", m, ", ", n, "] weights'");
    auto shape = h.shape();
    shape.back() = n;
    auto out = paddle::empty(shape, h.dtype(), h.place());
    amx_mlp(h.data<float>(), rows, hidden, reinterpret_cast<const uint16_t*>(gate_up.data<uint8_t>()),
            reinterpret_cast<const uint16_t*>(down.data<uint8_t>()), m, n, out.data<float>(), std::max(1, num_threads));
    return {out};
  }
#endif
  auto gated = Swiglu(Bf16Linear(h, gate_up, 2 * m, num_threads, mkl_path, true)[0], num_threads)[0];
  return Bf16Linear(gated, down, n, num_threads, mkl_path, true);
}

std::vector<std::vector<int64_t>> Bf16MlpShape(const std::vector<int64_t>& h, const std::vector<int64_t>&,
                                               const std::vector<int64_t>&, int, int n) {
  auto shape = h;
  shape.back() = n;
  return {shape};
}
std::vector<paddle::DataType> Bf16MlpDtype(const paddle::DataType& h, const paddle::DataType&,
                                           const paddle::DataType&) {
  return {h};
}

PD_BUILD_OP(fd_bf16_mlp)
    .Inputs({"H", "GateUp", "Down"})
    .Outputs({"Out"})
    .Attrs({"m: int", "n: int", "num_threads: int", "mkl_path: std::string"})
    .SetKernelFn(PD_KERNEL(Bf16Mlp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16MlpShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16MlpDtype));
