// Paged attention of a whole step, reading K/V blocks in place (no gather copy).
//
// q            float32 [T, H, D]            the step's queries, row after row (contiguous)
// k/v cache    float32 [N, Hkv, bs, D]      (the layout of fd_kernels/paged_attention.py)
// block_tables int64   [R, W]               row r's blocks, in order
// starts       int64   [R]                  position of row r's first new token
// query_lens   int64   [R]                  row r's new tokens (1 for a decode row)
// out          float32 [T, H, D]
//
// Query i of row r sits at position starts[r] + i and attends causally to keys 0..that position
// (its own new K/V must already be in the cache). One task is (row, kv head, a tile of up to
// kQueryTile queries): the scores of the tile's GQA query heads against every key they see, an
// exact two-pass softmax (max, then exp and sum) per query, then the weighted sum of the values;
// each K vector is read once per tile. With AVX2 + FMA declared, dot products and the value sum
// (its accumulator in registers) use intrinsics; otherwise loops written for the compiler's
// vectoriser (-fopenmp-simd). The ISA flags come from the capabilities the platform declared.
// Tasks are spread over OpenMP threads (libgomp, the pool oneDNN's linear layers use too) when
// the step is large enough to pay for them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "paddle/extension.h"

namespace {

constexpr int64_t kQueryTile = 16;   // queries of one prefill row per task
constexpr int64_t kMinWorkPerThread = 1 << 15;   // query-key pairs x heads that pay for a thread

// exp(x) for x <= 0 (softmax after subtracting the max), vectorisable: x = n ln2 + r with
// |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error < 2e-7), 2^n by building the
// float's exponent bits. Below -87 the result flushes to 0 like expf's.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Shapes {
  int64_t heads, kv_heads, head_dim, block_size, width;
};

struct Task {
  int64_t row, kv_head, first_token, first_pos, count;   // queries [first_token, +count) at first_pos..
};

// Dot product of two head_dim vectors.
inline float dot(const float* a, const float* b, int64_t d) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 16 == 0) {   // two accumulators: two independent FMA chains
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), acc1);
    }
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

// out = sum over j < n of p[j] * value(j), the accumulator kept in registers for head_dim D.
template <int64_t D, typename ValueAt>
inline void weighted_sum_fixed(const float* p, int64_t n, ValueAt value, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[D / 8];
  for (int64_t v = 0; v < D / 8; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 weight = _mm256_set1_ps(p[j]);
    const float* row = value(j);
    for (int64_t v = 0; v < D / 8; ++v) acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * v), acc[v]);
  }
  for (int64_t v = 0; v < D / 8; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
#else
  float acc[D] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* row = value(j);
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) acc[c] += p[j] * row[c];
  }
  std::copy(acc, acc + D, out);
#endif
}

template <typename ValueAt>
inline void weighted_sum(const float* p, int64_t n, ValueAt value, int64_t d, float* out) {
  switch (d) {
    case 64: return weighted_sum_fixed<64>(p, n, value, out);
    case 128: return weighted_sum_fixed<128>(p, n, value, out);
    case 32: return weighted_sum_fixed<32>(p, n, value, out);
    case 16: return weighted_sum_fixed<16>(p, n, value, out);
    default: break;
  }
  std::fill(out, out + d, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* row = value(j);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] += p[j] * row[c];
  }
}

// Attention of `task.count` consecutive queries of one row for the query heads of one kv head.
void attend_tile(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, const Task& task,
                 const Shapes& s, float scale, float* out, std::vector<float>& scores) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t d = s.head_dim;
  const int64_t keys = task.first_pos + task.count;   // the last query sees every key of the tile
  scores.resize(static_cast<size_t>(task.count * group * keys));
  auto at = [&](const float* cache, int64_t j) {
    const int64_t block = table[j / s.block_size];
    return cache + ((block * s.kv_heads + task.kv_head) * s.block_size + j % s.block_size) * d;
  };
  auto offset = [&](int64_t i, int64_t g) {   // of query i of the tile, head g of the group, in q and out
    return ((task.first_token + i) * s.heads + task.kv_head * group + g) * d;
  };
  for (int64_t j = 0; j < keys; ++j) {
    const float* key = at(k_cache, j);
    for (int64_t i = std::max<int64_t>(0, j - task.first_pos); i < task.count; ++i) {
      for (int64_t g = 0; g < group; ++g) scores[(i * group + g) * keys + j] = dot(q + offset(i, g), key, d) * scale;
    }
  }
  for (int64_t i = 0; i < task.count; ++i) {
    const int64_t seen = task.first_pos + i + 1;
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + (i * group + g) * keys;
      const float top = *std::max_element(sg, sg + seen);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < seen; ++j) {
        sg[j] = exp_nonpositive(sg[j] - top);
        total += sg[j];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t j = 0; j < seen; ++j) sg[j] *= inv;
      weighted_sum(sg, seen, [&](int64_t j) { return at(v_cache, j); }, d, out + offset(i, g));
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& starts, const paddle::Tensor& query_lens, float scale,
                                           int num_threads) {
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && k_cache.dtype() == paddle::DataType::FLOAT32 &&
               v_cache.dtype() == paddle::DataType::FLOAT32,
           "fd_paged_attention: float32 q and caches only");
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT64 && starts.dtype() == paddle::DataType::INT64 &&
               query_lens.dtype() == paddle::DataType::INT64,
           "fd_paged_attention: int64 block tables, starts and query lengths");
  const auto qs = q.shape();
  const auto cs = k_cache.shape();
  const int64_t rows = block_tables.shape()[0];
  const Shapes s{qs[1], cs[1], qs[2], cs[2], block_tables.shape()[1]};
  PD_CHECK(cs[3] == s.head_dim && s.heads % s.kv_heads == 0, "fd_paged_attention: shape mismatch");
  const int64_t* tables = block_tables.data<int64_t>();
  const int64_t* start = starts.data<int64_t>();
  const int64_t* lens = query_lens.data<int64_t>();

  std::vector<Task> tasks;
  int64_t token = 0, work = 0;
  for (int64_t r = 0; r < rows; ++r) {
    PD_CHECK(lens[r] >= 1 && start[r] + lens[r] <= s.width * s.block_size,
             "fd_paged_attention: row ", r, " does not fit its block table");
    for (int64_t first = 0; first < lens[r]; first += kQueryTile) {
      const int64_t count = std::min(kQueryTile, lens[r] - first);
      for (int64_t h = 0; h < s.kv_heads; ++h) tasks.push_back({r, h, token + first, start[r] + first, count});
      work += count * (start[r] + first + count) * s.heads;
    }
    token += lens[r];
  }
  PD_CHECK(token == qs[0], "fd_paged_attention: query_lens sum to ", token, ", q has ", qs[0], " tokens");

  auto out = paddle::empty(qs, q.dtype(), q.place());
  const float* qp = q.data<float>();
  const float* kp = k_cache.data<float>();
  const float* vp = v_cache.data<float>();
  float* op = out.data<float>();
  const auto num_tasks = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({num_threads, num_tasks, work / kMinWorkPerThread})));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const Task& task = tasks[t];
      attend_tile(qp, kp, vp, tables + task.row * s.width, task, s, scale, op, scores);
    }
  }
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionShape(const std::vector<int64_t>& q, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {q};
}

std::vector<paddle::DataType> PagedAttentionDtype(const paddle::DataType& q, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&,
                                                  const paddle::DataType&, const paddle::DataType&) {
  return {q};
}

PD_BUILD_OP(fd_paged_attention)
    .Inputs({"Q", "KCache", "VCache", "BlockTables", "Starts", "QueryLens"})
    .Outputs({"Out"})
    .Attrs({"scale: float", "num_threads: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));
