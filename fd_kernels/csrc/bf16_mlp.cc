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
// by SwiGLU, written again and read again to be rounded. With vdpbf16ps (a build with
// -mavx512bf16, m a multiple of 16) the same: each tile's gate and up sums go through SwiGLU in
// registers into the down projection's bfloat16 input rows (see dot_bf16.h). Elsewhere it runs
// those three ops.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "aligned.h"
#include "amx_gemm.h"
#include "bf16.h"
#include "dot_bf16.h"
#include "fast_exp.h"
#include "flush_denormals.h"
#include "ops.h"
#include "paddle/extension.h"

namespace {

#if defined(__AVX512F__)
// 16 features' SwiGLU (gate, up: their float32 sums), rounded into bfloat16 at `out`: the values
// fd_swiglu computes, in the bits fd_bf16_linear rounds them to.
inline void swiglu_rounded16(const float* gate, const float* up, uint16_t* out) {
  alignas(64) float gated[16];
#pragma omp simd
  for (int i = 0; i < 16; ++i) gated[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];   // as fd_swiglu
  round_to_bf16_bits16(gated, out);
}
#endif

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
        swiglu_rounded16(gate, up, a + amx_gemm::tile_offset(at.row + t * tile_rows + r, at.panel_block * kLanes, m,
                                                             tile_rows));
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

#if defined(__AVX512BF16__)

constexpr int kGateRows = 6, kGatePanels = 2;   // 6 rows x (2 gate + 2 up panels): 24 accumulators
constexpr int64_t kGateRowsPerTask = 64;

// Rows [0, R) of A (lda apart) times gate panels `gate` .. + G - 1 and their up panels (`up_gap`
// values on), through SwiGLU into `act` (m values a row, the gate panels' features).
template <int R, int G>
void gated_tile(const uint16_t* a, int64_t lda, const uint16_t* gate, int64_t panel_stride, int64_t up_gap,
                int64_t kp, uint16_t* act, int64_t m) {
  const uint16_t* panels[2 * G];
  for (int g = 0; g < G; ++g) panels[g] = gate + g * panel_stride, panels[G + g] = gate + up_gap + g * panel_stride;
  __m512 acc[R][2 * G];
  dot_bf16::accumulate<R, 2 * G>(a, lda, panels, kp, acc);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      alignas(64) float sums[2][16];
      _mm512_store_ps(sums[0], acc[r][g]);
      _mm512_store_ps(sums[1], acc[r][G + g]);
      swiglu_rounded16(sums[0], sums[1], act + r * m + g * dot_bf16::kLanes);
    }
}

using GatedFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t);

template <int R>
GatedFn gated_fn(int rows, int panels) {
  if constexpr (R == 1) return panels == 2 ? gated_tile<1, 2> : gated_tile<1, 1>;
  else if (rows < R) return gated_fn<R - 1>(rows, panels);
  else return panels == 2 ? gated_tile<R, 2> : gated_tile<R, 1>;
}

void dot_mlp(const float* h, int64_t rows, int64_t hidden, const uint16_t* gate_up, const uint16_t* down, int64_t m,
             int64_t n, float* y, int threads) {
  const int64_t kp = (hidden + 1) / 2 * 2, half = m / dot_bf16::kLanes, panel_stride = kp * dot_bf16::kLanes;
  thread_local AlignedVector<uint16_t> inputs, activations;
  inputs.resize(static_cast<size_t>(rows * kp));
  activations.resize(static_cast<size_t>(rows * m));
  uint16_t* a = inputs.data();
  uint16_t* act = activations.data();
  const int64_t row_tasks = (rows + kGateRowsPerTask - 1) / kGateRowsPerTask;
  const int64_t groups = (half + kGatePanels - 1) / kGatePanels;
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;   // as fd_swiglu runs
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) dot_bf16::round_row(h + r * hidden, hidden, kp, a + r * kp);
#pragma omp for schedule(static) collapse(2)
    for (int64_t rt = 0; rt < row_tasks; ++rt)
      for (int64_t g = 0; g < groups; ++g) {
        const int panels = static_cast<int>(std::min<int64_t>(kGatePanels, half - g * kGatePanels));
        const int64_t r_end = std::min(rows, (rt + 1) * kGateRowsPerTask);
        for (int64_t r = rt * kGateRowsPerTask; r < r_end; r += kGateRows)
          gated_fn<kGateRows>(static_cast<int>(std::min<int64_t>(kGateRows, r_end - r)), panels)(
              a + r * kp, kp, gate_up + g * kGatePanels * panel_stride, panel_stride, half * panel_stride, kp,
              act + r * m + g * kGatePanels * dot_bf16::kLanes, m);
      }
  }
  dot_bf16::multiply(act, m, rows, m, down, n, y, threads);
}

#endif  // __AVX512BF16__

// The fused pass this build and CPU run for intermediate size m, and the multiple of k its panels
// are padded to; none: the three ops.
struct FusedPass {
  void (*run)(const float*, int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, float*, int) = nullptr;
  int64_t k_step = 1;
};

FusedPass fused_pass([[maybe_unused]] int64_t m) {
#if defined(__AMX_BF16__)
  if (m % kKStep == 0 && amx_granted()) return {amx_mlp, kKStep};
#endif
#if defined(__AVX512BF16__)
  if (m % dot_bf16::kLanes == 0) return {dot_mlp, 2};
#endif
  return {};
}

}  // namespace

std::vector<paddle::Tensor> Bf16Mlp(const paddle::Tensor& h, const paddle::Tensor& gate_up, const paddle::Tensor& down,
                                    int m, int n, int num_threads, const std::string& mkl_path) {
  PD_CHECK(h.dtype() == paddle::DataType::FLOAT32, "fd_bf16_mlp: float32 input");
  const int64_t hidden = h.shape().back(), rows = h.numel() / std::max<int64_t>(hidden, 1);
  const FusedPass fused = fused_pass(m);
  if (fused.run != nullptr && rows > 0 && n > 0) {
    constexpr int64_t kPanel = 16;   // features a panel in the AVX-512 builds that fuse
    const int64_t kp = (hidden + fused.k_step - 1) / fused.k_step * fused.k_step;
    PD_CHECK(gate_up.numel() == 2 * m * kp * 2 && down.numel() == (n + kPanel - 1) / kPanel * kPanel * m * 2,
             "fd_bf16_mlp: the packed weights are not [", hidden, ", 2 x ", m, "] and [", m, ", ", n, "] weights'");
    auto shape = h.shape();
    shape.back() = n;
    auto out = paddle::empty(shape, h.dtype(), h.place());
    fused.run(h.data<float>(), rows, hidden, reinterpret_cast<const uint16_t*>(gate_up.data<uint8_t>()),
              reinterpret_cast<const uint16_t*>(down.data<uint8_t>()), m, n, out.data<float>(), std::max(1, num_threads));
    return {out};
  }
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
