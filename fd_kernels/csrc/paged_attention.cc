// Paged attention of a whole step, reading K/V blocks in place (no gather copy).
//
// q            float32 [T, H, D]            the step's queries, row after row (contiguous)
// k/v cache    float32 or bfloat16 [N, Hkv, bs, D], or int8 [N, Hkv, bs, D + 4]   (the layout of
//                                            fd_kernels/paged_attention.py; int8: kv_types.h)
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
// declared. A bfloat16 or int8 cache is widened to float32 as it is read (kv_types.h): math stays
// fp32; an int8 block's scores are scaled by its keys' scales, and its softmax weights by its
// values' scales before the weighted sum.
// round_queries: the (scaled) queries are rounded to bfloat16 first; with a bfloat16 cache on a CPU
// with AMX (built with -mamx-bf16, tiles granted; an int8 cache: its prefill tasks, their codes
// widened to bfloat16 block by block) the scores are then AMX tile products (see
// attend_tile_amx), and a prefill task's weighted sum of the values too (its softmax weights rounded
// to bfloat16: amx_values); elsewhere the rounded queries take the float32 path: the same products,
// summed in another order, softmax and the weighted sum of the values in float32.
// Tasks are spread over OpenMP threads when the step is large enough to pay for them; a decode row
// of a step of very few rows is split along its keys (kSplitRows), so that it has tasks for them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "aligned.h"
#include "amx.h"
#include "fast_exp.h"
#include "flush_denormals.h"
#include "kv_types.h"
#include "paddle/extension.h"

namespace {

constexpr int64_t kQueryTile = 16;   // queries of one prefill row per task
// query-key pairs x heads that pay for a thread: ~10 us of a thread's work (a decode step of 8 rows
// at ~280 keys: 20k; at 1 << 15 it ran on one thread, and its attention took 14.6 ms of a 53.9 ms
// step on a 2-core AMD EPYC Zen 4; at 1 << 12, 7.8 of 40.1)
constexpr int64_t kMinWorkPerThread = 1 << 12;

struct Shapes {
  int64_t heads, kv_heads, head_dim, block_size, width;
};

struct Task {
  int64_t row, kv_head, first_token, first_pos, count;   // queries [first_token, +count) at first_pos..
  int64_t key_begin, key_end;   // the keys it reads: [0, first_pos + count), or a part of a split row's
  int64_t part;                 // a split row's part: its slot in the partial results; -1: not split
};

// A decode row of a step with fewer than kSplitRows rows is split into parts of about kSplitKeys
// keys (whole blocks), so that its few KV heads still give every thread work: each part's softmax
// numerators and sums are combined afterwards (combine_parts). One row of SmolLM2 (3 KV heads) at
// 1,000 keys took 3.9 ms a step in attention on one of two cores. The split depends on the shapes
// only, never on the thread count, so results do not change with it.
constexpr int64_t kSplitRows = 4;
constexpr int64_t kSplitKeys = 128;

// A part's unnormalised results: per query vector its scores' max, its softmax numerators' sum, and
// the numerator-weighted sum of the values (d floats).
struct Partial {
  float* top;
  float* total;
  float* out;
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
// out[g * d + c] += sum over j < n of w(g, j) * v_j[c] for G query vectors that see the same keys
// (d % 16 == 0): each value row is read (and widened) once for all G. The weights w(g, j) are
// p[g * p_stride + j], or p[j * p_stride + g] when KeyMajor (the AMX path's transposed scores).
template <int G, bool KeyMajor, typename T>
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
        const __m512 weight = _mm512_set1_ps(KeyMajor ? p[j * p_stride + g] : p[g * p_stride + j]);
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
    case 1: accumulate_values_grouped<1, false>(p, p_stride, v, n, d, out); return true;
    case 2: accumulate_values_grouped<2, false>(p, p_stride, v, n, d, out); return true;
    case 3: accumulate_values_grouped<3, false>(p, p_stride, v, n, d, out); return true;
    case 4: accumulate_values_grouped<4, false>(p, p_stride, v, n, d, out); return true;
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

// scores[m * stride + j] *= scales[j] for m < mq, j < n: an int8 block's row scales applied.
inline void scale_keys(float* scores, int64_t mq, int64_t stride, const float* scales, int64_t n) {
  for (int64_t m = 0; m < mq; ++m) {
    float* row = scores + m * stride;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= scales[j];
  }
}

// Per-thread buffers of a task, reused across tasks.
struct Scratch {
  AlignedVector<float> queries, scores, out, total;
  std::vector<int32_t> last_key;
  AlignedVector<uint32_t> rounded, pairs, weight_tiles, value_tiles;
  std::vector<const Bf16*> value_rows;   // the AMX values pass: where each key's value row lies
  AlignedVector<Bf16> widened;            // an int8 cache's codes as bfloat16, for the AMX path
};

// Query vector m of a task (query m / group, head m % group): its offset in q and out.
inline int64_t vector_offset(const Task& task, const Shapes& s, int64_t m) {
  const int64_t group = s.heads / s.kv_heads;
  return ((task.first_token + m / group) * s.heads + task.kv_head * group + m % group) * s.head_dim;
}

#if defined(__AMX_BF16__) && defined(__AVX512F__)
// The AMX path (a bfloat16 cache, queries rounded): scores transposed, S^T = K Q^T, so a block's
// keys go into the tiles as they lie in the cache (16 keys x 32 dims a tile) and only the task's
// few query vectors are rearranged (into pairs of dims: the B operand's layout). S^T is key-major
// ([keys, query vectors]): the softmax runs down its columns and the values are summed key by key.
constexpr int64_t kKeyTile = 16;

// Tiles 0-2: sums [16 keys x 16 query vectors], 3: keys [16 x 32 dims], 4-6: query pairs.
void configure_attention_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  load_tile_config(config);
}

// S^T rows of 16 keys (d apart in the cache) for query-vector tiles g0..g0+G-1 of `pairs`
// (per 32 dims, per tile: 16 rows of 16 vectors' pairs of dims 2j, 2j + 1), stored ld floats apart.
template <int G>
void amx_key_scores(const Bf16* keys, int64_t d, const uint32_t* pairs, int64_t tiles, int64_t g0, float* s,
                    int64_t ld) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  for (int64_t c = 0; c < d / 32; ++c) {
    const uint32_t* b = pairs + (c * tiles + g0) * 256;
    _tile_loadd(3, keys + c * 32, d * 2);
    _tile_loadd(4, b, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (G > 1) {
      _tile_loadd(5, b + 256, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (G > 2) {
      _tile_loadd(6, b + 512, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, s + g0 * 16, ld * 4);
  if constexpr (G > 1) _tile_stored(1, s + g0 * 16 + 16, ld * 4);
  if constexpr (G > 2) _tile_stored(2, s + g0 * 16 + 32, ld * 4);
}

constexpr int kVectorsPerPass = 6;   // 24 accumulators, 4 value vectors and a weight: 29 registers

// accumulate_values_grouped over `count` (<= kVectorsPerPass) columns of key-major weights (ld apart).
template <typename T>
void accumulate_vectors(const float* p, int64_t ld, const T* v, int64_t n, int64_t d, int64_t count, float* out) {
  switch (count) {
    case 1: return accumulate_values_grouped<1, true>(p, ld, v, n, d, out);
    case 2: return accumulate_values_grouped<2, true>(p, ld, v, n, d, out);
    case 3: return accumulate_values_grouped<3, true>(p, ld, v, n, d, out);
    case 4: return accumulate_values_grouped<4, true>(p, ld, v, n, d, out);
    case 5: return accumulate_values_grouped<5, true>(p, ld, v, n, d, out);
    default: return accumulate_values_grouped<kVectorsPerPass, true>(p, ld, v, n, d, out);
  }
}

// Rounded to bfloat16 (nearest even) in the low (Low) or high half of each 32-bit lane, the other
// half zero; for finite values (the weights are in [0, 1]).
template <bool Low>
inline __m512i round_to_bf16_half(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return Low ? _mm512_srli_epi32(rounded, 16) : _mm512_and_si512(rounded, high_half);
}

// rows[i] lane j <- rows[j] lane i (16 x 16 32-bit values): unpacks within 128-bit lanes, then
// lanes exchanged (a scatter per row took ~5% of a prefill task).
inline void transpose16x16(__m512i rows[16]) {
  __m512i pairs[16], quads[16];
  for (int i = 0; i < 16; i += 2) {   // pairs[i], [i + 1]: rows i, i + 1 interleaved (low, high halves of lanes)
    pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  // quads[4 q + m], 128-bit lane L: column 4 L + m of rows 4 q .. 4 q + 3
  for (int q = 0; q < 4; ++q) {
    const __m512i* t = pairs + 4 * q;
    quads[4 * q] = _mm512_unpacklo_epi64(t[0], t[2]);
    quads[4 * q + 1] = _mm512_unpackhi_epi64(t[0], t[2]);
    quads[4 * q + 2] = _mm512_unpacklo_epi64(t[1], t[3]);
    quads[4 * q + 3] = _mm512_unpackhi_epi64(t[1], t[3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i even01 = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0x88);   // lanes 0, 2 of row groups 0, 1
    const __m512i odd01 = _mm512_shuffle_i32x4(quads[m], quads[4 + m], 0xDD);    // lanes 1, 3
    const __m512i even23 = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(quads[8 + m], quads[12 + m], 0xDD);
    rows[m] = _mm512_shuffle_i32x4(even01, even23, 0x88);        // column m (lane 0)
    rows[8 + m] = _mm512_shuffle_i32x4(even01, even23, 0xDD);    // column 8 + m (lane 2)
    rows[4 + m] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);      // column 4 + m (lane 1)
    rows[12 + m] = _mm512_shuffle_i32x4(odd01, odd23, 0xDD);     // column 12 + m (lane 3)
  }
}

// The values pass on AMX tiles, for tasks of more than one tile of query vectors (a prefill chunk;
// a decode task's few vectors keep the FMA pass, which reads the values once from memory anyway):
// O [vectors x d] = P [vectors x keys] V [keys x d], 32 keys per step, P rounded to bfloat16 (the
// sums stay float32, and the softmax's total is the float32 sum of the unrounded weights). Tiles
// 0-3: sums [16 vectors x 16 dims], 4: weights [16 vectors x 32 keys], 5: values [16 key pairs x 16
// dims]. `weights` are the key-major softmax numerators (ld apart); keys >= `keys` count as zero.
void amx_values(const float* weights, int64_t ld, int64_t tiles, int64_t keys, const Bf16* const* value_rows,
                int64_t d, Scratch& scratch, float* out) {
  const int64_t chunks = (keys + 31) / 32, dim_tiles = d / 16;
  // the values as B tiles: tile (c, t) row j = dims t*16.. of keys c*32 + 2j and + 2j + 1, paired
  scratch.value_tiles.resize(static_cast<size_t>(chunks * dim_tiles * 256));
  uint32_t* vt = scratch.value_tiles.data();
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t key = c * 32 + 2 * j;
      for (int64_t t = 0; t < dim_tiles; ++t) {
        const auto pair_of = [&](int64_t k) {   // dims t*16.. of key k, widened to 32-bit lanes
          if (k >= keys) return _mm512_setzero_si512();
          return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value_rows[k] + t * 16)));
        };
        const __m512i paired = _mm512_or_si512(pair_of(key), _mm512_slli_epi32(pair_of(key + 1), 16));
        _mm512_store_si512(vt + ((c * dim_tiles + t) * 16 + j) * 16, paired);
      }
    }
  // the weights as A tiles: tile (g, c) row n = keys c*32.. of vector g*16 + n, in pairs: the key
  // pairs' rows (16 vectors each) transposed in registers
  scratch.weight_tiles.resize(static_cast<size_t>(tiles * chunks * 256));
  uint32_t* wt = scratch.weight_tiles.data();
  for (int64_t g = 0; g < tiles; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i pairs[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = c * 32 + 2 * j;
        const auto row = [&](int64_t k) {
          return k < keys ? _mm512_loadu_ps(weights + k * ld + g * 16) : _mm512_setzero_ps();
        };
        pairs[j] = _mm512_or_si512(round_to_bf16_half<true>(row(key)), round_to_bf16_half<false>(row(key + 1)));
      }
      transpose16x16(pairs);
      for (int64_t n = 0; n < 16; ++n) _mm512_store_si512(wt + (g * chunks + c) * 256 + n * 16, pairs[n]);
    }
  for (int64_t g = 0; g < tiles; ++g)
    for (int64_t t0 = 0; t0 < dim_tiles; t0 += 4) {
      const int64_t group = std::min<int64_t>(4, dim_tiles - t0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, wt + (g * chunks + c) * 256, 64);
        const uint32_t* b = vt + (c * dim_tiles + t0) * 256;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (group > 1) {
          _tile_loadd(5, b + 256, 64);
          _tile_dpbf16ps(1, 4, 5);
        }
        if (group > 2) {
          _tile_loadd(5, b + 512, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (group > 3) {
          _tile_loadd(5, b + 768, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      float* at = out + g * 16 * d + t0 * 16;
      _tile_stored(0, at, d * 4);
      if (group > 1) _tile_stored(1, at + 16, d * 4);
      if (group > 2) _tile_stored(2, at + 32, d * 4);
      if (group > 3) _tile_stored(3, at + 48, d * 4);
    }
}

// Whether a task of this shape takes the AMX path (the tiles hold 32 dims and 16 keys at a time).
inline bool amx_attention(const Shapes& s) {
  return s.head_dim % 32 == 0 && s.head_dim <= 128 && s.block_size % kKeyTile == 0 && amx_granted();
}

// Rows of a block as bfloat16 for the tiles: a bfloat16 cache's in place; an int8 cache's codes
// widened into `to` (exactly: codes have at most 8 significant bits), their scales applied by the caller.
inline const Bf16* bf16_rows(const Bf16* rows, int64_t, int64_t, Bf16*) { return rows; }
inline const Bf16* bf16_rows(const Int8Code* rows, int64_t n, int64_t d, Bf16* to) {
  for (int64_t i = 0; i < n * d; i += 16) {   // d % 32 == 0 (amx_attention)
    const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(wide), 16)));
  }
  return to;
}

// The first n rows of key-major S^T (ld apart) times their keys' scales: an int8 block's.
inline void scale_key_rows(float* s, int64_t ld, int64_t n, const float* scales) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t m = 0; m < ld; m += 16)
      _mm512_storeu_ps(s + j * ld + m, _mm512_mul_ps(_mm512_loadu_ps(s + j * ld + m), _mm512_set1_ps(scales[j])));
}

template <typename T>
[[gnu::noinline]] void attend_tile_amx(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                                       const Task& task, const Shapes& s, float scale, float* out, Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t mq = task.count * group, tiles = (mq + 15) / 16, ld = tiles * 16;
  const int64_t keys = task.first_pos + task.count, padded_keys = (keys + kKeyTile - 1) / kKeyTile * kKeyTile;
  // the query vectors scaled and rounded (rows of d / 2 pairs of dims, zero past mq), then in the B
  // operand's layout: tile (c, g) is the transpose of the pairs of dims c * 32.. of vectors g * 16..,
  // pairs[((c * tiles + g) * 16 + j) * 16 + n] = pair c * 16 + j of vector g * 16 + n
  const int64_t row_pairs = d / 2;
  scratch.rounded.assign(static_cast<size_t>(ld * row_pairs), 0);
  scratch.pairs.resize(static_cast<size_t>(ld * row_pairs));
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < mq; ++m) {   // d % 32 == 0 (amx_attention)
    const float* src = q + vector_offset(task, s, m);
    auto* dst = reinterpret_cast<uint16_t*>(scratch.rounded.data() + m * row_pairs);
    for (int64_t dim = 0; dim < d; dim += 16) {
      alignas(64) float scaled[16];
      _mm512_store_ps(scaled, _mm512_mul_ps(_mm512_loadu_ps(src + dim), scales));
      round_to_bf16_bits16(scaled, dst + dim);   // (GCC split the scalar loop into 2-float pieces)
    }
  }
  for (int64_t c = 0; c < d / 32; ++c)
    for (int64_t g = 0; g < tiles; ++g) {
      const uint32_t* from = scratch.rounded.data() + g * 16 * row_pairs + c * 16;
      uint32_t* to = scratch.pairs.data() + (c * tiles + g) * 256;
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t n = 0; n < 16; ++n) to[j * 16 + n] = from[n * row_pairs + j];
    }
  scratch.scores.resize(static_cast<size_t>(padded_keys * ld));
  float* scores = scratch.scores.data();
  auto block_of = [&](const T* cache, int64_t b) {
    return cache + (table[b] * s.kv_heads + task.kv_head) * bs * (d + kRowExtra<T>);
  };
  const int64_t blocks = (keys + bs - 1) / bs;
  if constexpr (kScaledRows<T>) scratch.widened.resize(static_cast<size_t>(blocks * bs * d));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = std::min(bs, keys - b * bs);
    const Bf16* block = bf16_rows(block_of(k_cache, b), (n + kKeyTile - 1) / kKeyTile * kKeyTile, d,
                                  scratch.widened.data());
    for (int64_t key = b * bs; key < b * bs + n; key += kKeyTile) {
      const Bf16* rows = block + (key - b * bs) * d;
      float* at = scores + key * ld;
      int64_t g = 0;
      for (; g + 3 <= tiles; g += 3) amx_key_scores<3>(rows, d, scratch.pairs.data(), tiles, g, at, ld);
      if (tiles - g == 2) amx_key_scores<2>(rows, d, scratch.pairs.data(), tiles, g, at, ld);
      if (tiles - g == 1) amx_key_scores<1>(rows, d, scratch.pairs.data(), tiles, g, at, ld);
    }
    if constexpr (kScaledRows<T>) scale_key_rows(scores + b * bs * ld, ld, n, row_scales(block_of(k_cache, b), bs, d));
  }
  // softmax down each column over the keys its query sees: all of the first first_pos + 1, then up
  // to its own position (columns past mq see every key: unused); 16 columns at a time, their
  // running max and sum in registers (through memory they chained every key to the last one)
  scratch.last_key.resize(static_cast<size_t>(ld));
  scratch.total.resize(static_cast<size_t>(ld));
  int32_t* last = scratch.last_key.data();
  float* total = scratch.total.data();
  for (int64_t m = 0; m < ld; ++m) last[m] = static_cast<int32_t>(m < mq ? task.first_pos + m / group : keys - 1);
  const int64_t seen_by_all = task.first_pos + 1;
  for (int64_t g = 0; g < tiles; ++g) {
    float* column = scores + g * 16;
    const __m512i last_seen = _mm512_loadu_si512(last + g * 16);
    auto sees = [&](int64_t key) { return _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(key)), last_seen); };
    __m512 top = _mm512_set1_ps(-3.0e38f);
    for (int64_t key = 0; key < seen_by_all; ++key) top = _mm512_max_ps(top, _mm512_loadu_ps(column + key * ld));
    for (int64_t key = seen_by_all; key < keys; ++key)
      top = _mm512_mask_max_ps(top, sees(key), top, _mm512_loadu_ps(column + key * ld));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t key = 0; key < keys; ++key) {
      __m512 p = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(column + key * ld), top));
      if (key >= seen_by_all) p = _mm512_maskz_mov_ps(sees(key), p);
      _mm512_storeu_ps(column + key * ld, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(total + g * 16, sum);
  }
  if constexpr (kScaledRows<T>)   // the softmax numerators times their values' scales (total: unscaled)
    for (int64_t b = 0; b < blocks; ++b)
      scale_key_rows(scores + b * bs * ld, ld, std::min(bs, keys - b * bs), row_scales(block_of(v_cache, b), bs, d));
  if (tiles > 1) {
    scratch.value_rows.resize(static_cast<size_t>(keys));
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = std::min(bs, keys - b * bs);
      const Bf16* rows = bf16_rows(block_of(v_cache, b), n, d, scratch.widened.data() + b * bs * d);
      for (int64_t j = 0; j < n; ++j) scratch.value_rows[b * bs + j] = rows + j * d;
    }
    scratch.out.resize(static_cast<size_t>(ld * d));
    amx_values(scores, ld, tiles, keys, scratch.value_rows.data(), d, scratch, scratch.out.data());
  } else {
    scratch.out.assign(static_cast<size_t>(mq * d), 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const T* values = block_of(v_cache, b);
      const int64_t n = std::min(bs, keys - b * bs);
      for (int64_t m = 0; m < mq; m += kVectorsPerPass)
        accumulate_vectors(scores + b * bs * ld + m, ld, values, n, d, std::min<int64_t>(kVectorsPerPass, mq - m),
                           scratch.out.data() + m * d);
    }
  }
  for (int64_t m = 0; m < mq; ++m) {
    const float inv = 1.f / total[m];
    float* dst = out + vector_offset(task, s, m);
    const float* src = scratch.out.data() + m * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * inv;
  }
}
#endif  // __AMX_BF16__ && __AVX512F__

// Attention of `task.count` consecutive queries of one row for the query heads of one kv head, over
// keys [key_begin, key_end): normalised into `out`, or for a part of a split row unnormalised into
// `partial`. Kept out of line: inlined into the OpenMP region, GCC's code for it ran a third slower
// (measured).
template <typename T>
[[gnu::noinline]] void attend_tile(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                                   const Task& task, const Shapes& s, float scale, bool round_queries, int64_t window,
                                   float* out, Scratch& scratch, const Partial* partial) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t d = s.head_dim;
  const int64_t bs = s.block_size;
  const int64_t mq = task.count * group;               // query vector m is query m / group, head m % group
  const int64_t begin = task.key_begin, end = task.key_end;
  const int64_t keys = end - begin;                    // a score row's length
  scratch.queries.resize(static_cast<size_t>(mq * d));
  scratch.scores.resize(static_cast<size_t>(mq * keys));
  scratch.out.assign(static_cast<size_t>(mq * d), 0.f);
  float* queries = scratch.queries.data();
  float* scores = scratch.scores.data();
  for (int64_t m = 0; m < mq; ++m) {
    const float* src = q + vector_offset(task, s, m);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) queries[m * d + c] = src[c] * scale;
    if (round_queries) {
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) queries[m * d + c] = to_float(Bf16{round_to_bf16_bits(queries[m * d + c])});
    }
  }
  const int64_t region = bs * (d + kRowExtra<T>);   // a block and head's elements
  auto block_of = [&](const T* cache, int64_t b) { return cache + (table[b] * s.kv_heads + task.kv_head) * region; };
  const int64_t first_block = begin / bs, blocks = (end + bs - 1) / bs;   // begin is a block's first key
  for (int64_t b = first_block; b < blocks; ++b) {
    if (b + 1 < blocks) prefetch_block(block_of(k_cache, b + 1), region);
    else prefetch_block(block_of(v_cache, first_block), region);
    const int64_t n = std::min(bs, end - b * bs);
    block_scores(queries, mq, block_of(k_cache, b), n, d, scores + b * bs - begin, keys);
    if constexpr (kScaledRows<T>) scale_keys(scores + b * bs - begin, mq, keys, row_scales(block_of(k_cache, b), bs, d), n);
  }
  for (int64_t m = 0; m < mq; ++m) {
    const int64_t pos = task.first_pos + m / group;
    const int64_t seen = std::min(pos + 1, end) - begin;
    // with a sliding window the query sees keys pos - window + 1 .. pos (the task starts at or
    // before the first of them, see the task list)
    const int64_t low = window > 0 ? std::max<int64_t>(pos - window + 1 - begin, 0) : 0;
    float* row = scores + m * keys;
    std::fill(row, row + low, 0.f);
    float top = row[low];
#pragma omp simd reduction(max : top)
    for (int64_t j = low + 1; j < seen; ++j) top = std::max(top, row[j]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = low; j < seen; ++j) {
      row[j] = fast_exp(row[j] - top);
      total += row[j];
    }
    if (partial != nullptr) {
      partial->top[m] = top;
      partial->total[m] = total;
    } else {
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t j = low; j < seen; ++j) row[j] *= inv;
    }
    std::fill(row + seen, row + keys, 0.f);   // keys after this query's position
  }
  for (int64_t b = first_block; b < blocks; ++b) {
    const T* values = block_of(v_cache, b);
    if (b + 1 < blocks) prefetch_block(block_of(v_cache, b + 1), region);
    const int64_t n = std::min(bs, end - b * bs);
    if constexpr (kScaledRows<T>) scale_keys(scores + b * bs - begin, mq, keys, row_scales(values, bs, d), n);
    for (int64_t query = 0; query < task.count; ++query) {   // its `group` heads see the same keys
      const int64_t seen = std::min(n, task.first_pos + query + 1 - b * bs);
      if (seen <= 0) continue;
      const int64_t m0 = query * group;
      const float* weights = scores + m0 * keys + b * bs - begin;
      if (accumulate_group(weights, keys, values, seen, d, group, scratch.out.data() + m0 * d)) continue;
      for (int64_t m = m0; m < m0 + group; ++m)
        accumulate_values(weights + (m - m0) * keys, values, seen, d, scratch.out.data() + m * d);
    }
  }
  for (int64_t m = 0; m < mq; ++m)
    std::copy_n(scratch.out.data() + m * d, d, partial != nullptr ? partial->out + m * d : out + vector_offset(task, s, m));
}

// The partial results of split rows' parts: part p's slot holds its `group` query vectors' tops,
// then their totals, then their d values each.
struct Partials {
  int64_t group, d;
  std::vector<float> data;
  Partial of(int64_t part) {
    float* at = data.data() + part * group * (d + 2);
    return {at, at + group, at + 2 * group};
  }
};

// The attention of each split row and kv head from its parts (tasks first .. first + parts - 1,
// whose first is task `first`): softmax numerators rescaled to the largest max, then normalised.
void combine_parts(const std::vector<Task>& tasks, int64_t first, int64_t parts, Partials& partials,
                   const Shapes& s, float* out) {
  const int64_t group = partials.group, d = partials.d;
  for (int64_t m = 0; m < group; ++m) {
    float top = -3.0e38f;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, partials.of(tasks[first + p].part).top[m]);
    float total = 0.f;
    float* dst = out + vector_offset(tasks[first], s, m);
    std::fill(dst, dst + d, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const Partial part = partials.of(tasks[first + p].part);
      const float weight = std::exp(part.top[m] - top);
      total += weight * part.total[m];
      for (int64_t c = 0; c < d; ++c) dst[c] += weight * part.out[m * d + c];
    }
    const float inv = 1.f / total;
    for (int64_t c = 0; c < d; ++c) dst[c] *= inv;
  }
}

// Whether tasks on this cache may take the AMX path (see attend_tile_amx): with a bfloat16 cache
// all of them; with an int8 cache those of more than one tile of query vectors (prefill chunks),
// for which the widening of its codes pays (decode rows read the codes in place).
template <typename T>
bool amx_tasks(const Shapes& s, bool round_queries) {
#if defined(__AMX_BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, Bf16> || kScaledRows<T>) return round_queries && amx_attention(s);
#endif
  (void)s, (void)round_queries;
  return false;
}

#if defined(__AMX_BF16__) && defined(__AVX512F__)
template <typename T>
bool amx_task(bool amx, const Task& task, const Shapes& s) {
  return amx && (!kScaledRows<T> || task.count * (s.heads / s.kv_heads) > kKeyTile);
}
#endif

template <typename T>
void run_tasks(const std::vector<Task>& tasks, const float* q, const T* k_cache, const T* v_cache,
               const int64_t* tables, const Shapes& s, float scale, bool round_queries, int64_t window, float* out,
               int threads, int64_t chunk, Partials& partials) {
  const auto num_tasks = static_cast<int64_t>(tasks.size());
  const bool amx = window == 0 && amx_tasks<T>(s, round_queries);   // the AMX tiles read every key from 0
#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals flush;
    Scratch scratch;
#if defined(__AMX_BF16__) && defined(__AVX512F__)
    if (amx) configure_attention_tiles();
#endif
#pragma omp for schedule(monotonic : dynamic, chunk)   // monotonic: an entry point libiomp5 has (see native.py)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const Task& task = tasks[t];
      const int64_t* table = tables + task.row * s.width;
#if defined(__AMX_BF16__) && defined(__AVX512F__)
      if constexpr (std::is_same_v<T, Bf16> || kScaledRows<T>) {
        if (amx_task<T>(amx, task, s)) {
          attend_tile_amx(q, k_cache, v_cache, table, task, s, scale, out, scratch);
          continue;
        }
      }
#endif
      if (task.part < 0) {
        attend_tile(q, k_cache, v_cache, table, task, s, scale, round_queries, window, out, scratch, nullptr);
      } else {
        const Partial partial = partials.of(task.part);
        attend_tile(q, k_cache, v_cache, table, task, s, scale, round_queries, window, out, scratch, &partial);
      }
    }
#if defined(__AMX_BF16__) && defined(__AVX512F__)
    if (amx) _tile_release();
#endif
  }
}

}  // namespace

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k_cache,
                                           const paddle::Tensor& v_cache, const paddle::Tensor& block_tables,
                                           const paddle::Tensor& starts, const paddle::Tensor& query_lens, float scale,
                                           bool round_queries, int num_threads, int window) {
  const auto cache_dtype = k_cache.dtype();
  PD_CHECK(window >= 0, "fd_paged_attention: window must be >= 0 (0: none)");
  PD_CHECK(q.dtype() == paddle::DataType::FLOAT32 && v_cache.dtype() == cache_dtype && is_cache_dtype(cache_dtype),
           "fd_paged_attention: float32 q, float32, bfloat16 or int8 caches of one dtype");
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT64 && starts.dtype() == paddle::DataType::INT64 &&
               query_lens.dtype() == paddle::DataType::INT64,
           "fd_paged_attention: int64 block tables, starts and query lengths");
  const auto qs = q.shape();
  const auto cs = k_cache.shape();
  const int64_t rows = block_tables.shape()[0];
  const Shapes s{qs[1], cs[1], qs[2], cs[2], block_tables.shape()[1]};
  PD_CHECK(cs[3] == s.head_dim + row_extra(cache_dtype) && s.heads % s.kv_heads == 0,
           "fd_paged_attention: shape mismatch");
  const int64_t* tables = block_tables.data<int64_t>();
  const int64_t* start = starts.data<int64_t>();
  const int64_t* lens = query_lens.data<int64_t>();

  bool amx = false;
  with_cache_type(cache_dtype, [&](auto element) { amx = window == 0 && amx_tasks<decltype(element)>(s, round_queries); });
  bool decode = true;
  for (int64_t r = 0; r < rows; ++r) decode = decode && lens[r] == 1;
  const bool split = decode && rows < kSplitRows && !(amx && cache_dtype == paddle::DataType::BFLOAT16);
  const int64_t part_keys = std::max<int64_t>(1, kSplitKeys / s.block_size) * s.block_size;
  const int64_t group = s.heads / s.kv_heads;

  std::vector<Task> tasks;
  int64_t token = 0, work = 0, parts = 0;
  for (int64_t r = 0; r < rows; ++r) {
    PD_CHECK(lens[r] >= 1 && start[r] + lens[r] <= s.width * s.block_size,
             "fd_paged_attention: row ", r, " does not fit its block table");
    for (int64_t first = 0; first < lens[r]; first += kQueryTile) {
      const int64_t count = std::min(kQueryTile, lens[r] - first);
      const int64_t keys = start[r] + first + count;
      // the first block holding a key the tile's first query sees (a sliding window skips the rest)
      const int64_t from = window > 0 ? std::max<int64_t>(start[r] + first - window + 1, 0) / s.block_size * s.block_size
                                      : 0;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        if (split && keys - from > part_keys) {
          for (int64_t begin = from; begin < keys; begin += part_keys)
            tasks.push_back({r, h, token + first, start[r] + first, count, begin, std::min(keys, begin + part_keys),
                             parts++});
        } else {
          tasks.push_back({r, h, token + first, start[r] + first, count, from, keys, -1});
        }
      }
      work += count * (keys - from) * s.heads;
    }
    token += lens[r];
  }
  PD_CHECK(token == qs[0], "fd_paged_attention: query_lens sum to ", token, ", q has ", qs[0], " tokens");

  auto out = paddle::empty(qs, q.dtype(), q.place());
  const float* qp = q.data<float>();
  float* op = out.data<float>();
  const auto num_tasks = static_cast<int64_t>(tasks.size());
  // split rows use every thread (that is what they are split for); otherwise a step takes threads
  // as its work pays for them
  const int64_t paid = parts > 0 ? num_threads : work / kMinWorkPerThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({num_threads, num_tasks, paid})));
  // a decode step hands out a row's kv heads together, so one thread reads its blocks (the heads
  // side by side in the cache; 64 rows x 270 keys: 0.78 -> 0.67-0.71 ms on the AMX Xeon); a
  // prefill step's tasks grow along the row, and go out one by one (evener ends), as split parts do
  const int64_t chunk = decode && parts == 0 ? s.kv_heads : 1;
  Partials partials{group, s.head_dim, std::vector<float>(static_cast<size_t>(parts * group * (s.head_dim + 2)))};
  with_cache_type(cache_dtype, [&](auto element) {
    using T = decltype(element);
    run_tasks(tasks, qp, cache_data<T>(k_cache), cache_data<T>(v_cache), tables, s, scale, round_queries, window, op,
              threads, chunk, partials);
  });
  for (int64_t t = 0; t < num_tasks;) {   // a split row's parts are consecutive tasks
    int64_t n = 1;
    if (tasks[t].part >= 0)
      while (t + n < num_tasks && tasks[t + n].part >= 0 && tasks[t + n].row == tasks[t].row &&
             tasks[t + n].kv_head == tasks[t].kv_head)
        ++n;
    if (tasks[t].part >= 0) combine_parts(tasks, t, n, partials, s, op);
    t += n;
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
    .Attrs({"scale: float", "round_queries: bool", "num_threads: int", "window: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionDtype));
