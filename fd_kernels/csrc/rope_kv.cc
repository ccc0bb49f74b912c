// Rotary position embedding of q and k, and the new K/V written into the paged cache, in one op.
//
// qkv          float32 [T, H + 2 * Hkv, D]  the projection: q heads, then k heads, then v heads
// positions    int64   [T]
// cos, sin     float32 [P, D]               sin with its first half negated (fd_core/model/llama.py)
// k/v cache    float32 or bfloat16 [N, Hkv, bs, D], or int8 [N, Hkv, bs, D + 4]   written in place
//                                            at each token's slot (bfloat16: rounded to nearest even;
//                                            int8: codes and a scale per row, see kv_types.h)
// slots        int64   [T]                  block * bs + offset of each token
// returns q    float32 [T, H, D]            rotated (contiguous, the attention kernel's input)
//
// rotate(x)[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i]: Hugging Face's non-interleaved
// rotate_half convention.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_types.h"
#include "paddle/extension.h"

namespace {

inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
#pragma omp simd
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// A row of d floats into the cache's element type (bfloat16: rounded to nearest even).
inline void store_row(const float* x, int64_t d, float* out) { std::copy_n(x, d, out); }
inline void store_row(const float* x, int64_t d, Bf16* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 at a time (GCC split the scalar loop below into 2-value pieces: a third of this op's time)
  for (; i + 16 <= d; i += 16) round_to_bf16_bits16(x + i, reinterpret_cast<uint16_t*>(out + i));
#endif
  for (; i < d; ++i) out[i].bits = round_to_bf16_bits(x[i]);
}

// Row `offset` of the block and head starting at `region`, written from d floats.
template <typename T>
inline void write_row(const float* x, int64_t d, int64_t block_size, int64_t offset, T* region) {
  store_row(x, d, region + offset * d);
}
// int8: codes rint(x / s) with s = max |x| / 127 (an all-zero row: s = 0, codes 0), s after the codes.
template <>
inline void write_row<Int8Code>(const float* x, int64_t d, int64_t block_size, int64_t offset, Int8Code* region) {
  float top = 0.f;
  for (int64_t i = 0; i < d; ++i) top = std::max(top, std::fabs(x[i]));
  const float scale = top / 127.f;
  Int8Code* codes = region + offset * d;
  for (int64_t i = 0; i < d; ++i)
    codes[i].bits = static_cast<int8_t>(scale > 0.f ? std::nearbyint(x[i] / scale) : 0.f);
  const_cast<float*>(row_scales(region, block_size, d))[offset] = scale;
}

constexpr int64_t kMinValuesPerThread = 1 << 16;   // floats of qkv that pay for a thread

// Rotate every token's q heads into q, and its k heads (rotated) and v heads into the cache;
// positions and slots are checked first, tokens are spread over threads when there are enough.
template <typename T>
void rope_write(const float* in, const int64_t* pos, const int64_t* slot, const float* cp, const float* sp,
                float* qp, T* kp, T* vp, int64_t tokens, int64_t width, int64_t num_heads, int64_t kv_heads,
                int64_t d, int64_t block_size, int64_t max_pos, int64_t cache_rows, int num_threads) {
  for (int64_t t = 0; t < tokens; ++t) {
    PD_CHECK(pos[t] >= 0 && pos[t] < max_pos, "fd_rope_write_kv: position ", pos[t], " outside the table");
    const int64_t first = (slot[t] / block_size * kv_heads) * block_size + slot[t] % block_size;
    PD_CHECK(slot[t] >= 0 && first + (kv_heads - 1) * block_size < cache_rows, "fd_rope_write_kv: slot ", slot[t],
             " outside the cache");
  }
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(num_threads, tokens * width * d / kMinValuesPerThread)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> rotated(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const float* c = cp + pos[t] * d;
      const float* s = sp + pos[t] * d;
      const float* row = in + t * width * d;
      for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * d, c, s, d, qp + (t * num_heads + h) * d);
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t region = (block * kv_heads + h) * block_size * (d + kRowExtra<T>);
        rotate(row + (num_heads + h) * d, c, s, d, rotated.data());
        write_row(rotated.data(), d, block_size, offset, kp + region);
        write_row(row + (num_heads + kv_heads + h) * d, d, block_size, offset, vp + region);
      }
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> RopeWriteKv(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                                        paddle::Tensor& k_cache, paddle::Tensor& v_cache,
                                        const paddle::Tensor& slots, int num_heads, int num_threads) {
  const auto cache_dtype = k_cache.dtype();
  PD_CHECK(qkv.dtype() == paddle::DataType::FLOAT32 && cos.dtype() == paddle::DataType::FLOAT32 &&
               v_cache.dtype() == cache_dtype && is_cache_dtype(cache_dtype),
           "fd_rope_write_kv: float32 qkv and tables, float32, bfloat16 or int8 caches of one dtype");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && slots.dtype() == paddle::DataType::INT64,
           "fd_rope_write_kv: int64 positions and slots");
  const auto shape = qkv.shape();
  const auto cs = k_cache.shape();
  const int64_t tokens = shape[0], d = shape[2], kv_heads = cs[1], block_size = cs[2];
  const int64_t max_pos = cos.shape()[0];
  PD_CHECK(shape[1] == num_heads + 2 * kv_heads && cs[3] == d + row_extra(cache_dtype) && cos.shape()[1] == d,
           "fd_rope_write_kv: shape mismatch");
  auto q = paddle::empty({tokens, num_heads, d}, qkv.dtype(), qkv.place());
  const float* in = qkv.data<float>();
  const int64_t* pos = positions.data<int64_t>();
  const int64_t* slot = slots.data<int64_t>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  float* qp = q.data<float>();
  const int64_t cache_rows = cs[0] * kv_heads * block_size;
  with_cache_type(cache_dtype, [&](auto element) {
    using T = decltype(element);
    rope_write(in, pos, slot, cp, sp, qp, mutable_cache_data<T>(k_cache), mutable_cache_data<T>(v_cache), tokens,
               shape[1], num_heads, kv_heads, d, block_size, max_pos, cache_rows, num_threads);
  });
  return {q};
}

std::vector<std::vector<int64_t>> RopeWriteKvShape(const std::vector<int64_t>& qkv, const std::vector<int64_t>&,
                                                   const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                   const std::vector<int64_t>& k_cache,
                                                   const std::vector<int64_t>& v_cache,
                                                   const std::vector<int64_t>&, int num_heads, int) {
  return {{qkv[0], num_heads, qkv[2]}, k_cache, v_cache};
}

std::vector<paddle::DataType> RopeWriteKvDtype(const paddle::DataType& qkv, const paddle::DataType&,
                                               const paddle::DataType&, const paddle::DataType&,
                                               const paddle::DataType& k_cache, const paddle::DataType& v_cache,
                                               const paddle::DataType&) {
  return {qkv, k_cache, v_cache};
}

PD_BUILD_OP(fd_rope_write_kv)
    .Inputs({"QKV", "Positions", "Cos", "Sin", "KCache", "VCache", "Slots"})
    .Outputs({"Q", "KCacheOut", "VCacheOut"})
    .Attrs({"num_heads: int", "num_threads: int"})
    .SetInplaceMap({{"KCache", "KCacheOut"}, {"VCache", "VCacheOut"}})
    .SetKernelFn(PD_KERNEL(RopeWriteKv))
    .SetInferShapeFn(PD_INFER_SHAPE(RopeWriteKvShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RopeWriteKvDtype));
