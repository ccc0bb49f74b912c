// Linear layers on float32 weights stored as bfloat16 (half the bytes a decode step reads):
//
//   fd_pack_bf16(weight [k, n] float32, transposed=false) -> packed (uint8: the bytes of
//       uint16 [panels, k, kLanes]): B = weight (or weight^T for a [n, k] weight: a tied head)
//       rounded to bfloat16 (nearest even), in panels of kLanes output features (the vector
//       width this library was built for); the last panel is padded with zeros;
//   fd_bf16_linear(x [..., k] float32, packed, n, num_threads, mkl_path) -> [..., n] = x @ B
//
// A bfloat16 value is the high half of a float32's bits, so widening is one shift per vector,
// and the widened weights are exactly the rounded values: inputs and sums stay float32, and the
// result equals a float32 GEMM of the rounded weight up to the order of the sums. The product is
// computed in tiles of kTileRows rows by kTilePanels panels (every tile's sums over k in the same
// order whatever the thread count), work split over OpenMP threads by groups of panels and
// chunks of rows. From kGemmRows rows on (a prefill chunk: compute-bound) the weight is widened
// once into a float32 buffer this thread keeps, and multiplied by MKL's sgemm (mkl_path:
// Paddle's libmklml_intel.so; empty: never).
//
// Measured on an Intel Xeon (Emerald Rapids, no AMX): vdpbf16ps (bfloat16 products) ran at half
// the float32 FMA's rate there, so this kernel widens to float32 instead of multiplying in bfloat16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mkl_api.h"
#include "ops.h"
#include "paddle/extension.h"

namespace {

constexpr int64_t kGemmRows = 128;
constexpr int64_t kRowsPerTask = 64;

#if defined(__AVX512F__)

constexpr int kLanes = 16, kTileRows = 8, kTilePanels = 3;   // 24 accumulators of 32 registers
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec widen(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void store(float* y, Vec v) { _mm512_storeu_ps(y, v); }

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8, kTileRows = 4, kTilePanels = 3;    // 12 accumulators of 16 registers
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec widen(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void store(float* y, Vec v) { _mm256_storeu_ps(y, v); }

#else  // portable build: the same arithmetic, one lane at a time

constexpr int kLanes = 8, kTileRows = 4, kTilePanels = 2;
struct Vec {
  float lane[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec splat(float v) {
  Vec out;
  std::fill(out.lane, out.lane + kLanes, v);
  return out;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.lane[i] = std::fma(a.lane[i], b.lane[i], c.lane[i]);
  return c;
}
inline Vec widen(const uint16_t* p) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&out.lane[i], &bits, 4);
  }
  return out;
}
inline void store(float* y, Vec v) { std::memcpy(y, v.lane, sizeof v.lane); }

#endif

// Round to bfloat16, nearest even (NaN: the quiet NaN).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

int64_t panels_of(int64_t n) { return (n + kLanes - 1) / kLanes; }

// y[r, f] for R rows and P panels: x rows `ldx` apart, panels `panel_stride` values apart; the
// last panel writes `last` features (fewer at the end of n).
template <int R, int P>
void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t k, float* y, int64_t ldy,
          int last) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = zero();
  for (int64_t i = 0; i < k; ++i) {
    Vec b[P];
    for (int p = 0; p < P; ++p) b[p] = widen(w + p * panel_stride + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec a = splat(x[r * ldx + i]);
      for (int p = 0; p < P; ++p) acc[r][p] = fma(a, b[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      float* out = y + r * ldy + p * kLanes;
      if (p < P - 1 || last == kLanes) {
        store(out, acc[r][p]);
      } else {
        float full[kLanes];
        store(full, acc[r][p]);
        std::memcpy(out, full, sizeof(float) * last);
      }
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, int);

template <int R, int P>
TileFn tile_with_panels(int panels) {
  if constexpr (P == 1) return tile<R, 1>;
  else return panels == P ? tile<R, P> : tile_with_panels<R, P - 1>(panels);
}

template <int R>
TileFn tile_fn(int rows, int panels) {
  if constexpr (R == 1) return tile_with_panels<1, kTilePanels>(panels);
  else return rows == R ? tile_with_panels<R, kTilePanels>(panels) : tile_fn<R - 1>(rows, panels);
}

void tiled(const float* x, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y, int threads) {
  const int64_t panels = panels_of(n), panel_stride = k * kLanes;
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const int tail = static_cast<int>(n - (panels - 1) * kLanes);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t rt = 0; rt < row_tasks; ++rt)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p0 = g * kTilePanels;
      const int group_panels = static_cast<int>(std::min<int64_t>(kTilePanels, panels - p0));
      const int last = p0 + group_panels == panels ? tail : kLanes;
      const int64_t r_end = std::min(rows, (rt + 1) * kRowsPerTask);
      for (int64_t r = rt * kRowsPerTask; r < r_end; r += kTileRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kTileRows, r_end - r));
        tile_fn<kTileRows>(tile_rows, group_panels)(x + r * k, k, packed + p0 * panel_stride, panel_stride, k,
                                                    y + r * n + p0 * kLanes, n, last);
      }
    }
}

// y = x @ B by MKL's sgemm on B widened into a [k, n] buffer this thread keeps for the next call.
void widened_gemm(const float* x, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y, int threads,
                  const std::string& mkl_path) {
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(k * n));
  float* w = widened.data();
  const int64_t panels = panels_of(n);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t p = 0; p + 1 < panels; ++p) store(w + i * n + p * kLanes, widen(packed + (p * k + i) * kLanes));
    float last[kLanes];   // the last panel's features that exist
    store(last, widen(packed + ((panels - 1) * k + i) * kLanes));
    std::memcpy(w + i * n + (panels - 1) * kLanes, last, sizeof(float) * (n - (panels - 1) * kLanes));
  }
  using namespace mkl_api;
  functions(mkl_path).gemm(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(rows), static_cast<int>(n),
                           static_cast<int>(k), 1.0f, x, static_cast<int>(k), w, static_cast<int>(n), 0.0f, y,
                           static_cast<int>(n));
}

}  // namespace

std::vector<paddle::Tensor> PackBf16(const paddle::Tensor& weight, bool transposed) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32 && weight.shape().size() == 2,
           "fd_pack_bf16: a 2-D float32 weight");
  const int64_t rows = weight.shape()[0], cols = weight.shape()[1];
  const int64_t k = transposed ? cols : rows, n = transposed ? rows : cols, panels = panels_of(n);
  auto packed = paddle::empty({panels * k * kLanes * 2}, paddle::DataType::UINT8, weight.place());
  const float* src = weight.data<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data<uint8_t>());
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t f = 0; f < kLanes; ++f) {
        const int64_t j = p * kLanes + f;
        dst[(p * k + i) * kLanes + f] = j < n ? to_bf16(src[transposed ? j * cols + i : i * cols + j]) : 0;
      }
  return {packed};
}

std::vector<paddle::Tensor> Bf16Linear(const paddle::Tensor& x, const paddle::Tensor& packed, int n, int num_threads,
                                       const std::string& mkl_path) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && packed.dtype() == paddle::DataType::UINT8,
           "fd_bf16_linear: float32 input and a weight from fd_pack_bf16");
  auto shape = x.shape();
  const int64_t k = shape.back();
  PD_CHECK(packed.numel() == panels_of(n) * k * kLanes * 2, "fd_bf16_linear: the packed weight holds ",
           packed.numel(), " bytes, not a [", k, ", ", n, "] weight's");
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (rows == 0 || n == 0) return {out};
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data<uint8_t>());
  const int threads = std::max(1, num_threads);
  if (rows >= kGemmRows && !mkl_path.empty())
    widened_gemm(x.data<float>(), rows, k, w, n, out.data<float>(), threads, mkl_path);
  else
    tiled(x.data<float>(), rows, k, w, n, out.data<float>(), threads);
  return {out};
}

std::vector<std::vector<int64_t>> PackBf16Shape(const std::vector<int64_t>&) { return {{-1}}; }
std::vector<paddle::DataType> PackBf16Dtype(const paddle::DataType&) { return {paddle::DataType::UINT8}; }

std::vector<std::vector<int64_t>> Bf16LinearShape(const std::vector<int64_t>& x, const std::vector<int64_t>&, int n) {
  auto shape = x;
  shape.back() = n;
  return {shape};
}
std::vector<paddle::DataType> Bf16LinearDtype(const paddle::DataType& x, const paddle::DataType&) { return {x}; }

PD_BUILD_OP(fd_pack_bf16)
    .Inputs({"Weight"})
    .Outputs({"Packed"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackBf16))
    .SetInferShapeFn(PD_INFER_SHAPE(PackBf16Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackBf16Dtype));

PD_BUILD_OP(fd_bf16_linear)
    .Inputs({"X", "Packed"})
    .Outputs({"Out"})
    .Attrs({"n: int", "num_threads: int", "mkl_path: std::string"})
    .SetKernelFn(PD_KERNEL(Bf16Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16LinearDtype));
