// Paged attention of a whole step, reading K/V blocks in place (no gather copy).
//
// q            float32 [T, H, D]            the step's queries, row after row (contiguous)
// k/v cache    float32 or bfloat16 [N, Hkv, bs, D]   (the layout of fd_kernels/paged_attention.py)
// block_tables int64   [R, W]               row r's blocks, in order
// starts       int64   [R]                  position of row r's first new token
// query_lens   int64   [R]                  row r's new tokens (1 for a decode row)
// out          float32 [T, H, D]
//
// Query i of row r sits at position starts[r] + i and attends causally to keys 0..that position
// (its own new K/V must already be in the cache). One task is (row, kv head, a tile of up to
// kQueryTile queries): its M = queries x GQA group query vectors are copied into a contiguous
// tile, then, block by block, their scores against the block's keys (micro-kernels of 3 queries x
// 4 keys, each key vector read once per 3 queries), an exact two-pass softmax per query (max, then
// exp and sum), and the weighted sum of the values (each value vector read once per block and
// query from L1). With AVX2 + FMA declared the micro-kernels use intrinsics; otherwise loops
// written for the compiler's vectoriser. The ISA flags come from the capabilities the platform
// declared. A bfloat16 cache is widened to float32 as it is read (kv_types.h): math stays fp32.
// Tasks are spread over OpenMP threads when the step is large enough to pay for them.

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "fast_exp.h"
#include "flush_denormals.h"
#include "kv_types.h"
#include "paddle/extension.h"

namespace {

constexpr int64_t kQueryTile = 16;   // queries of one prefill row per task
constexpr int64_t kMinWorkPerThread = 1 << 15;   // query-key pairs x heads that pay for a thread

struct Shapes {
  int64_t heads, kv_heads, head_dim, block_size, width;
};

struct Task {
  int64_t row, kv_head, first_token, first_pos, count;   // queries [first_token, +count) at first_pos..
};

#if defined(__AVX2__) && defined(__FMA__)
// The four sums of a0..a3's lanes, in order.
inline __m128 sum_lanes4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// scores[m * stride + j] = q_m . k_j for MQ query vectors (rows of q) and 4 keys (rows of k), d % 8 == 0.
template <int MQ, typename T>
inline void scores_4keys(const float* q, const T* k, int64_t d, float* scores, int64_t stride) {
  __m256 acc[MQ][4];
  for (int m = 0; m < MQ; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 key[4];
    for (int j = 0; j < 4; ++j) key[j] = load8(k + j * d + c);
    for (int m = 0; m < MQ; ++m) {
      const __m256 query = _mm256_loadu_ps(q + m * d + c);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(query, key[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MQ; ++m) _mm_storeu_ps(scores + m * stride, sum_lanes4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}
#endif

#if defined(__AVX512F__)
// out[g * d + c] += sum over j < n of p[g * p_stride + j] * v_j[c] for the G query heads sharing one
// kv head (d % 16 == 0, d <= 128): each value row is read (and widened) once for all G of them.
template <int G, typename T>
void accumulate_values_grouped(const float* p, int64_t p_stride, const T* v, int64_t n, int64_t d, float* out) {
  for (int64_t c = 0; c < d; c += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(4, (d - c) / 16));
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < chunks; ++u) acc[g][u] = _mm512_loadu_ps(out + g * d + c + 16 * u);
    for (int64_t j = 0; j < n; ++j) {
      __m512 row[4];
      for (int u = 0; u < chunks; ++u) row[u] = load16(v + j * d + c + 16 * u);
      for (int g = 0; g < G; ++g) {
        const __m512 weight = _mm512_set1_ps(p[g * p_stride + j]);
        for (int u = 0; u < chunks; ++u) acc[g][u] = _mm512_fmadd_ps(weight, row[u], acc[g][u]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < chunks; ++u) _mm512_storeu_ps(out + g * d + c + 16 * u, acc[g][u]);
  }
}
#endif

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < d; ++c) acc += a[c] * to_float(b[c]);
  return acc;
}

// scores[m * stride + j] = q_m . k_j for m < mq (rows of q) and j < n (rows of k).
template <typename T>
void block_scores(const float* q, int64_t mq, const T* k, int64_t n, int64_t d, float* scores, int64_t stride) {
  int64_t m = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    const int64_t n4 = n - n % 4;
    for (; m + 3 <= mq; m += 3)
      for (int64_t j = 0; j < n4; j += 4) scores_4keys<3>(q + m * d, k + j * d, d, scores + m * stride + j, stride);
    for (; m < mq; ++m)
      for (int64_t j = 0; j < n4; j += 4) scores_4keys<1>(q + m * d, k + j * d, d, scores + m * stride + j, stride);
    for (int64_t r = 0; r < mq; ++r)
      for (int64_t j = n4; j < n; ++j) scores[r * stride + j] = dot(q + r * d, k + j * d, d);
    return;
  }
#endif
  for (; m < mq; ++m)
    for (int64_t j = 0; j < n; ++j) scores[m * stride + j] = dot(q + m * d, k + j * d, d);
}

// out[0, d) += sum over j < n of p[j] * v_j (rows of v), the accumulator held in registers.
template <typename T>
void accumulate_values(const float* p, const T* v, int64_t n, int64_t d, float* out) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 64 <= d; c += 64) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(out + c + 8 * u);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 weight = _mm256_set1_ps(p[j]);
      const T* row = v + j * d + c;
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(weight, load8(row + 8 * u), acc[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + c + 8 * u, acc[u]);
  }
  for (; c + 8 <= d; c += 8) {
    __m256 acc = _mm256_loadu_ps(out + c);
    for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(v + j * d + c), acc);
    _mm256_storeu_ps(out + c, acc);
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* row = v + j * d;
#pragma omp simd
    for (int64_t i = c; i < d; ++i) out[i] += p[j] * to_float(row[i]);
  }
}

// accumulate_values for the `group` query heads of one kv head at once, where this build has a
// kernel for it (AVX-512, d % 16 == 0, d <= 128, group <= 4); false: do them one by one.
template <typename T>
bool accumulate_group(const float* p, int64_t p_stride, const T* v, int64_t n, int64_t d, int64_t group,
                      float* out) {
#if defined(__AVX512F__)
  if (d % 16 != 0 || d > 128) return false;
  switch (group) {
    case 1: accumulate_values_grouped<1>(p, p_stride, v, n, d, out); return true;
    case 2: accumulate_values_grouped<2>(p, p_stride, v, n, d, out); return true;
    case 3: accumulate_values_grouped<3>(p, p_stride, v, n, d, out); return true;
    case 4: accumulate_values_grouped<4>(p, p_stride, v, n, d, out); return true;
    default: return false;
  }
#else
  (void)p, (void)p_stride, (void)v, (void)n, (void)d, (void)group, (void)out;
  return false;
#endif
}

// Asks for the cache lines of the next block to be read (blocks sit anywhere in the pool, which
// the hardware prefetcher cannot guess).
template <typename T>
inline void prefetch_block(const T* block, int64_t elements) {
#if defined(__SSE__)
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t at = 0; at < elements * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
#else
  (void)block, (void)elements;
#endif
}

// Per-thread buffers of a task, reused across tasks.
struct Scratch {
  std::vector<float> queries, scores, out;
};

// Attention of `task.count` consecutive queries of one row for the query heads of one kv head. Kept
// out of line: inlined into the OpenMP region, GCC's code for it ran a third slower (measured).
template <typename T>
[[gnu::noinline]] void attend_tile(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                                   const Task& task, const Shapes& s, float scale, float* out, Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t d = s.head_dim;
  const int64_t bs = s.block_size;
  const int64_t mq = task.count * group;               // query vector m is query m / group, head m % group
  const int64_t keys = task.first_pos + task.count;   // the last query sees every key of the tile
  scratch.queries.resize(static_cast<size_t>(mq * d));
  scratch.scores.resize(static_cast<size_t>(mq * keys));
  scratch.out.assign(static_cast<size_t>(mq * d), 0.f);
  float* queries = scratch.queries.data();
  float* scores = scratch.scores.data();
  auto offset = [&](int64_t m) {   // of query vector m in q and out
    return ((task.first_token + m / group) * s.heads + task.kv_head * group + m % group) * d;
  };
  for (int64_t m = 0; m < mq; ++m) {
    const float* src = q + offset(m);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) queries[m * d + c] = src[c] * scale;
  }
  auto block_of = [&](const T* cache, int64_t b) {
    return cache + (table[b] * s.kv_heads + task.kv_head) * bs * d;
  };
  const int64_t blocks = (keys + bs - 1) / bs;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) prefetch_block(block_of(k_cache, b + 1), bs * d);
    else prefetch_block(block_of(v_cache, 0), bs * d);
    block_scores(queries, mq, block_of(k_cache, b), std::min(bs, keys - b * bs), d, scores + b * bs, keys);
  }
  for (int64_t m = 0; m < mq; ++m) {
    const int64_t seen = task.first_pos + m / group + 1;
    float* row = scores + m * keys;
    float top = row[0];
#pragma omp simd reduction(max : top)
    for (int64_t j = 1; j < seen; ++j) top = std::max(top, row[j]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < seen; ++j) {
      row[j] = fast_exp(row[j] - top);
      total += row[j];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < seen; ++j) row[j] *= inv;
    std::fill(row + seen, row + keys, 0.f);   // keys after this query's position
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const T* values = block_of(v_cache, b);
    if (b + 1 < blocks) prefetch_block(block_of(v_cache, b + 1), bs * d);
    const int64_t n = std::min(bs, keys - b * bs);
    for (int64_t query = 0; query < task.count; ++query) {   // its `group` heads see the same keys
      const int64_t seen = std::min(n, task.first_pos + query + 1 - b * bs);
      if (seen <= 0) continue;
      const int64_t m0 = query * group;
      if (accumulate_group(scores + m0 * keys + b * bs, keys, values, seen, d, group, scratch.out.data() + m0 * d))
        continue;
      for (int64_t m = m0; m < m0 + group; ++m)
        accumulate_values(scores + m * keys + b * bs, values, seen, d, scratch.out.data() + m * d);
    }
  }
  for (int64_t m = 0; m < mq; ++m) std::copy_n(scratch.out.data() + m * d, d, out + offset(m));
}

template <typename T>
void run_tasks(const std::vector<Task>& tasks, const float* q, const T* k_cache, const T* v_cache,
               const int64_t* tables, const Shapes& s, float scale, float* out, int threads) {
  const auto num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    Scratch scratch;
#pragma omp for schedule(monotonic : dynamic)   // monotonic: an entry point libiomp5 has (see native.py)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const Task& task = tasks[t];
      attend_tile(q, k_cache, v_cache, tables + task.row * s.width, task, s, scale, out, scratch);
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& starts, const paddle::Tensor& query_lens, float scale,
                                           int num_threads) {
  const auto cache_dtype = k_cache.dtype();
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && v_cache.dtype() == cache_dtype &&
               (cache_dtype == paddle::DataType::FLOAT32 || cache_dtype == paddle::DataType::BFLOAT16),
           "fd_paged_attention: float32 q, float32 or bfloat16 caches of one dtype");
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
  float* op = out.data<float>();
  const auto num_tasks = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({num_threads, num_tasks, work / kMinWorkPerThread})));
  if (cache_dtype == paddle::DataType::BFLOAT16)
    run_tasks(tasks, qp, cache_data<Bf16>(k_cache), cache_data<Bf16>(v_cache), tables, s, scale, op, threads);
  else
    run_tasks(tasks, qp, cache_data<float>(k_cache), cache_data<float>(v_cache), tables, s, scale, op, threads);
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
