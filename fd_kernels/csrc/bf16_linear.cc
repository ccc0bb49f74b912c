// Linear layers on float32 weights stored as bfloat16 (half the bytes a decode step reads):
//
//   fd_pack_bf16(weight [k, n] float32, transposed=false) -> packed (uint8: the bytes of
//       uint16 [panels, kp / 2, kLanes, 2]): B = weight (or weight^T for a [n, k] weight: a tied
//       head) rounded to bfloat16 (nearest even), in panels of kLanes output features (the vector
//       width this library was built for), each panel's rows in pairs (k = 2j and 2j + 1 side by
//       side per feature: AMX's layout); k is padded with zeros to kp (a multiple of kKStep: 32
//       where AMX is built in, else 2), the last panel's features with zeros to kLanes;
//   fd_bf16_linear(x [..., k] float32, packed, n, num_threads, mkl_path, round_inputs)
//       -> [..., n] = x @ B, or round(x) @ B with round_inputs (x rounded to bfloat16 as well).
//
// A bfloat16 value is the high half of a float32's bits, so widening is a shift (or a mask, for
// the odd row of a pair), and the widened weights are exactly the rounded values: sums stay
// float32, and the result equals a float32 GEMM of the rounded weight up to the order of the
// sums. The product is computed in tiles of kTileRows rows by kTilePanels panels (every tile's
// sums over k in the same order whatever the thread count), work split over OpenMP threads by
// groups of panels and chunks of rows. From kGemmRows rows on (a prefill chunk: compute-bound) the
// weight is widened once into a float32 buffer this thread keeps, and multiplied by MKL's sgemm
// (mkl_path: Paddle's libmklml_intel.so; empty: never).
//
// round_inputs on a CPU with AMX (built with -mamx-bf16, and the kernel granted this process the
// tile registers): the rounded rows and the panels go straight into AMX tiles (tdpbf16ps:
// bfloat16 pairs, float32 sums), ~7x the float32 FMA's rate on one core. In a build with
// -mavx512bf16 (the platform declares it where vdpbf16ps outruns float32 FMA: AMD Zen 4 and later)
// they meet in vdpbf16ps tiles instead, at every row count (each float32 lane adds the exact
// products of one pair of k; denormal operands count as zero, as the instruction reads them).
// Elsewhere the rounded rows go through the float32 path above: the same products, summed in
// another order.
//
// Measured on an Intel Xeon (Emerald Rapids, no AMX): vdpbf16ps ran at half the float32 FMA's
// rate there, so that build widens to float32. On an AMD EPYC (Zen 4) it runs at ~1.7x.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "aligned.h"
#include "amx_gemm.h"
#include "bf16.h"
#include "dot_bf16.h"
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
// The two rows of a pair: the low halves (row 2j) shifted up, the high halves (row 2j + 1) masked.
inline void widen_pair(const uint16_t* p, Vec& even, Vec& odd) {
  const __m512i both = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store(float* y, Vec v) { _mm512_storeu_ps(y, v); }

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8, kTileRows = 4, kTilePanels = 3;    // 12 accumulators of 16 registers
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void widen_pair(const uint16_t* p, Vec& even, Vec& odd) {
  const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
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
inline void widen_pair(const uint16_t* p, Vec& even, Vec& odd) {
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t low = static_cast<uint32_t>(p[2 * i]) << 16, high = static_cast<uint32_t>(p[2 * i + 1]) << 16;
    std::memcpy(&even.lane[i], &low, 4);
    std::memcpy(&odd.lane[i], &high, 4);
  }
}
inline void store(float* y, Vec v) { std::memcpy(y, v.lane, sizeof v.lane); }

#endif

#if defined(__AMX_BF16__)
constexpr int64_t kKStep = amx_gemm::kKStep;
static_assert(kLanes == amx_gemm::kLanes, "AMX builds are AVX-512 builds: 16 features a panel");
#else
constexpr int64_t kKStep = 2;
#endif

int64_t panels_of(int64_t n) { return (n + kLanes - 1) / kLanes; }
int64_t padded_k(int64_t k) { return (k + kKStep - 1) / kKStep * kKStep; }

// y[r, f] for R rows and P panels: x rows `ldx` apart, panels `panel_stride` values apart; the
// last panel writes `last` features (fewer at the end of n).
template <int R, int P>
void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t k, float* y, int64_t ldy,
          int last) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = zero();
  for (int64_t i = 0; i < k; i += 2) {   // a pair of rows of k per step (the second may be padding)
    Vec even[P], odd[P];
    for (int p = 0; p < P; ++p) widen_pair(w + p * panel_stride + i * kLanes, even[p], odd[p]);
    const bool pair = i + 1 < k;
    for (int r = 0; r < R; ++r) {
      const Vec a = splat(x[r * ldx + i]);
      for (int p = 0; p < P; ++p) acc[r][p] = fma(a, even[p], acc[r][p]);
      if (pair) {
        const Vec b = splat(x[r * ldx + i + 1]);
        for (int p = 0; p < P; ++p) acc[r][p] = fma(b, odd[p], acc[r][p]);
      }
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

// The same tile with bfloat16 input rows (`x`: rounded, k padded to pairs with zeros; see dot_bf16.h).
#if defined(__AVX512BF16__)
static_assert(kLanes == dot_bf16::kLanes, "vdpbf16ps builds are AVX-512 builds: 16 features a panel");

template <int R, int P>
void dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t k, float* y,
              int64_t ldy, int last) {
  const uint16_t* panels[P];
  for (int p = 0; p < P; ++p) panels[p] = w + p * panel_stride;
  __m512 acc[R][P];
  dot_bf16::accumulate<R, P>(x, ldx, panels, k, acc);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      float* out = y + r * ldy + p * kLanes;
      if (p < P - 1 || last == kLanes) _mm512_storeu_ps(out, acc[r][p]);
      else _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << last) - 1), acc[r][p]);
    }
}
#endif

// The tile of R x P for float32 inputs (widened panels, FMA) or bfloat16 ones (vdpbf16ps).
template <class Input, int R, int P>
constexpr auto tile_of() {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Input, uint16_t>) return dot_tile<R, P>;
  else return tile<R, P>;
#else
  return tile<R, P>;
#endif
}

template <class Input>
using TileFn = void (*)(const Input*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, int);

template <class Input, int R, int P>
TileFn<Input> tile_with_panels(int panels) {
  if constexpr (P == 1) return tile_of<Input, R, 1>();
  else return panels == P ? tile_of<Input, R, P>() : tile_with_panels<Input, R, P - 1>(panels);
}

template <class Input, int R>
TileFn<Input> tile_fn(int rows, int panels) {
  if constexpr (R == 1) return tile_with_panels<Input, 1, kTilePanels>(panels);
  else return rows == R ? tile_with_panels<Input, R, kTilePanels>(panels) : tile_fn<Input, R - 1>(rows, panels);
}

// y [rows, n] = x @ B in tiles over OpenMP threads; x rows `ldx` values apart, its first k used
// (float32 rows: ldx = k; bfloat16 pairs: ldx = k = padded_k).
template <class Input>
void tiled(const Input* x, int64_t ldx, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y,
           int threads) {
  const int64_t panels = panels_of(n), panel_stride = padded_k(k) * kLanes;
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
        tile_fn<Input, kTileRows>(tile_rows, group_panels)(x + r * ldx, ldx, packed + p0 * panel_stride,
                                                           panel_stride, k, y + r * n + p0 * kLanes, n, last);
      }
    }
}

// y = x @ B by MKL's sgemm on B widened into a [k, n] buffer this thread keeps for the next call.
void widened_gemm(const float* x, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y, int threads,
                  const std::string& mkl_path) {
  thread_local AlignedVector<float> widened;
  widened.resize(static_cast<size_t>(k * n));
  float* w = widened.data();
  const int64_t panels = panels_of(n), panel_stride = padded_k(k) * kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < k; i += 2) {
    for (int64_t p = 0; p < panels; ++p) {
      float pair[2][kLanes];
      Vec even, odd;
      widen_pair(packed + p * panel_stride + i * kLanes, even, odd);
      store(pair[0], even);
      store(pair[1], odd);
      const int64_t features = std::min<int64_t>(kLanes, n - p * kLanes);
      for (int64_t row = i; row < std::min(i + 2, k); ++row)
        std::memcpy(w + row * n + p * kLanes, pair[row - i], sizeof(float) * features);
    }
  }
  using namespace mkl_api;
  functions(mkl_path).gemm(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(rows), static_cast<int>(n),
                           static_cast<int>(k), 1.0f, x, static_cast<int>(k), w, static_cast<int>(n), 0.0f, y,
                           static_cast<int>(n));
}

#if defined(__AMX_BF16__)

// y = round(x) @ B on AMX tiles (see amx_gemm.h): x rounded into tiles of up to 16 rows in a
// buffer this thread keeps.
void amx_linear(const float* x, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y, int threads) {
  const int64_t kp = padded_k(k);
  const int tile_rows = static_cast<int>(std::min<int64_t>(rows, 16));
  thread_local AlignedVector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>((rows + tile_rows - 1) / tile_rows * tile_rows * kp));
  uint16_t* a = rounded.data();
#pragma omp parallel num_threads(threads)
  {
    amx_gemm::round_into_tiles(x, rows, k, kp, tile_rows, a);
    amx_gemm::configure_tiles(tile_rows);
    amx_gemm::multiply(a, rows, kp, tile_rows, amx_gemm::Panels::plain(packed, kp, panels_of(n)), n,
                       amx_gemm::StoreSums{y, n, tile_rows});
    _tile_release();
  }
}

#endif  // __AMX_BF16__

#if defined(__AVX512BF16__)

// y = round(x) @ B in vdpbf16ps tiles: x rounded into bfloat16 rows of padded_k(k) values (the
// padding zero) in a buffer this thread keeps.
void dot_linear(const float* x, int64_t rows, int64_t k, const uint16_t* packed, int64_t n, float* y, int threads) {
  const int64_t kp = padded_k(k);
  thread_local AlignedVector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>(rows * kp));
  uint16_t* a = rounded.data();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) dot_bf16::round_row(x + r * k, k, kp, a + r * kp);
  tiled(a, kp, rows, kp, packed, n, y, threads);
}

#endif  // __AVX512BF16__

// x rounded to bfloat16 values (kept as float32) in a buffer this thread keeps.
const float* rounded_copy(const float* x, int64_t count, int threads) {
  thread_local AlignedVector<float> rounded;
  rounded.resize(static_cast<size_t>(count));
  float* out = rounded.data();
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = widen_bf16_bits(round_to_bf16_bits(x[i]));
  return out;
}

}  // namespace

#if defined(__AVX512BF16__)
void dot_bf16::multiply(const uint16_t* a, int64_t lda, int64_t rows, int64_t kp, const uint16_t* packed, int64_t n,
                        float* y, int threads) {
  tiled(a, lda, rows, kp, packed, n, y, threads);
}
#endif

std::vector<paddle::Tensor> PackBf16(const paddle::Tensor& weight, bool transposed) {
  PD_CHECK(weight.dtype() == paddle::DataType::FLOAT32 && weight.shape().size() == 2,
           "fd_pack_bf16: a 2-D float32 weight");
  const int64_t rows = weight.shape()[0], cols = weight.shape()[1];
  const int64_t k = transposed ? cols : rows, n = transposed ? rows : cols, panels = panels_of(n), kp = padded_k(k);
  auto packed = paddle::empty({panels * kp * kLanes * 2}, paddle::DataType::UINT8, weight.place());
  const float* src = weight.data<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data<uint8_t>());
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t i = 0; i < kp; ++i)
      for (int64_t f = 0; f < kLanes; ++f) {
        const int64_t j = p * kLanes + f;
        const bool inside = j < n && i < k;
        dst[((p * kp + i - i % 2) * kLanes) + 2 * f + i % 2] =
            inside ? round_to_bf16_bits(src[transposed ? j * cols + i : i * cols + j]) : 0;
      }
  return {packed};
}

std::vector<paddle::Tensor> Bf16Linear(const paddle::Tensor& x, const paddle::Tensor& packed, int n, int num_threads,
                                       const std::string& mkl_path, bool round_inputs) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && packed.dtype() == paddle::DataType::UINT8,
           "fd_bf16_linear: float32 input and a weight from fd_pack_bf16");
  auto shape = x.shape();
  const int64_t k = shape.back();
  PD_CHECK(packed.numel() == panels_of(n) * padded_k(k) * kLanes * 2, "fd_bf16_linear: the packed weight holds ",
           packed.numel(), " bytes, not a [", k, ", ", n, "] weight's");
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (rows == 0 || n == 0) return {out};
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data<uint8_t>());
  const int threads = std::max(1, num_threads);
  const float* in = x.data<float>();
  if (round_inputs) {
#if defined(__AMX_BF16__)
    if (amx_granted()) {
      amx_linear(in, rows, k, w, n, out.data<float>(), threads);
      return {out};
    }
#endif
#if defined(__AVX512BF16__)
    dot_linear(in, rows, k, w, n, out.data<float>(), threads);
    return {out};
#else
    in = rounded_copy(in, rows * k, threads);
#endif
  }
  if (rows >= kGemmRows && !mkl_path.empty())
    widened_gemm(in, rows, k, w, n, out.data<float>(), threads, mkl_path);
  else
    tiled(in, k, rows, k, w, n, out.data<float>(), threads);
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
    .Attrs({"n: int", "num_threads: int", "mkl_path: std::string", "round_inputs: bool"})
    .SetKernelFn(PD_KERNEL(Bf16Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16LinearDtype));
