// bfloat16 GEMMs on AMX tiles (tdpbf16ps: bfloat16 pairs, float32 sums), shared by the linear
// layer (bf16_linear.cc) and the fused MLP (bf16_mlp.cc).
//
// Operands: A, rows rounded to bfloat16 in [tile_rows, 32] tiles, each contiguous (each 32 columns
// of a row tile one tile, kp / 32 of them, then the next row tile's; rows padded to whole tiles
// with zeros); B, a weight in fd_pack_bf16's panels of 16 output features (see bf16_linear.cc).
// The product runs in blocks of up to two row tiles by two panels over the whole of k (so every
// sum runs over k in the same order, whatever the blocking or thread count), in OpenMP tasks of
// kRowBlocks x kPanelBlocks blocks. What happens to a block's sums is the caller's epilogue: stored
// as they are (StoreSums), or e.g. SwiGLU of a gate and an up panel (bf16_mlp.cc).
//
// The functions with `#pragma omp for` inside are called from within a parallel region, by every
// thread of it, with the tiles configured (configure_tiles) on each.

#pragma once

#if defined(__AMX_BF16__)

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>
#include <omp.h>

#include "aligned.h"
#include "amx.h"
#include "bf16.h"

namespace amx_gemm {

constexpr int64_t kKStep = 32;   // one tile row: 32 bfloat16 values of k
constexpr int64_t kLanes = 16;   // features per panel (the AVX-512 build's)

// Tiles 0-3: float32 sums [rows x 16], 4-5: input rows [rows x 32 bfloat16], 6-7: panels
// [16 pairs x 16 features].
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 6 ? rows : 16;
    config.bytes_per_row[t] = 64;
  }
  load_tile_config(config);
}

// x [rows, k] float32 rounded into A's tiles at `a` (kp columns, k padded with zeros; see above).
inline void round_into_tiles(const float* x, int64_t rows, int64_t k, int64_t kp, int tile_rows, uint16_t* a) {
  const int64_t padded_rows = (rows + tile_rows - 1) / tile_rows * tile_rows;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < padded_rows; ++r) {
    uint16_t* row = a + (r / tile_rows) * tile_rows * kp + (r % tile_rows) * kKStep;
    for (int64_t c = 0; c < kp; c += kKStep) {
      uint16_t* part = row + c * tile_rows;
      const int64_t valid = r < rows ? std::clamp<int64_t>(k - c, 0, kKStep) : 0;
      int64_t i = 0;
      for (; i + 16 <= valid; i += 16) round_to_bf16_bits16(x + r * k + c + i, part + i);
      for (; i < valid; ++i) part[i] = round_to_bf16_bits(x[r * k + c + i]);
      std::fill(part + valid, part + kKStep, 0);
    }
  }
}

// Where A's element (r, c) lies (the layout above).
inline int64_t tile_offset(int64_t r, int64_t c, int64_t kp, int tile_rows) {
  return (r / tile_rows) * tile_rows * kp + (c / kKStep) * kKStep * tile_rows + (r % tile_rows) * kKStep + c % kKStep;
}

// _tile_stored of sums tile `Tile` (the intrinsic's tile is a literal in its assembly).
template <int Tile>
inline void store_tile(void* to, int64_t stride_bytes) {
  static_assert(Tile >= 0 && Tile < 4, "the sums are tiles 0-3");
  if constexpr (Tile == 0) _tile_stored(0, to, stride_bytes);
  if constexpr (Tile == 1) _tile_stored(1, to, stride_bytes);
  if constexpr (Tile == 2) _tile_stored(2, to, stride_bytes);
  if constexpr (Tile == 3) _tile_stored(3, to, stride_bytes);
}

// A block's place: its first row (of the operation's) and panel block, and how many of its rows
// and of its two panels' features exist.
struct BlockAt {
  int64_t row, panel_block;
  int rows[2], cols[2];
};

// The epilogue of a plain product: a block's sums into y [rows, n] (whole tiles straight from the
// tile registers, partial ones through a scratch tile).
struct StoreSums {
  float* y;
  int64_t ldy;
  int tile_rows;

  template <int Tile>
  void tile(const BlockAt& at, int row_tile, int panel) const {
    float* out = y + (at.row + row_tile * tile_rows) * ldy + (at.panel_block * 2 + panel) * kLanes;
    const int valid_rows = at.rows[row_tile], valid_cols = at.cols[panel];
    if (valid_rows == tile_rows && valid_cols == kLanes) {
      store_tile<Tile>(out, ldy * 4);
    } else {
      alignas(64) float scratch[16 * kLanes];
      store_tile<Tile>(scratch, kLanes * 4);
      for (int r = 0; r < valid_rows; ++r) std::memcpy(out + r * ldy, scratch + r * kLanes, 4 * valid_cols);
    }
  }
  void done(const BlockAt&) const {}
};

// B as the blocks see it: block pb's first panel at `first + pb * block_stride`, its second
// `second` values after the first (a plain weight: panels 2 pb and 2 pb + 1; a gate/up weight:
// gate panel pb and up panel pb); `blocks` of them; `two(pb)`: whether block pb has a second panel.
struct Panels {
  const uint16_t* first;
  int64_t panel_stride;   // values from one panel to the next (kp * kLanes)
  int64_t block_stride, second, blocks, panels;
  bool gated;

  static Panels plain(const uint16_t* packed, int64_t kp, int64_t panels) {
    const int64_t stride = kp * kLanes;
    return {packed, stride, 2 * stride, stride, (panels + 1) / 2, panels, false};
  }
  // gate panels [0, half), then up panels [half, 2 half): block pb is (gate pb, up pb)
  static Panels gate_up(const uint16_t* packed, int64_t kp, int64_t half) {
    const int64_t stride = kp * kLanes;
    return {packed, stride, stride, half * stride, half, 2 * half, true};
  }
  bool two(int64_t pb) const { return gated || pb * 2 + 1 < panels; }
  int cols(int64_t pb, int panel, int64_t n) const {   // features of the block's panel that exist
    if (gated) return kLanes;
    return static_cast<int>(std::clamp<int64_t>(n - (pb * 2 + panel) * kLanes, 0, kLanes));
  }
};

// _tile_loadd into sums tile `Tile`.
template <int Tile>
inline void load_tile(const void* from, int64_t stride_bytes) {
  static_assert(Tile >= 0 && Tile < 4, "the sums are tiles 0-3");
  if constexpr (Tile == 0) _tile_loadd(0, from, stride_bytes);
  if constexpr (Tile == 1) _tile_loadd(1, from, stride_bytes);
  if constexpr (Tile == 2) _tile_loadd(2, from, stride_bytes);
  if constexpr (Tile == 3) _tile_loadd(3, from, stride_bytes);
}

// A block's sums part way over k, kept between its passes: four 16 x 16 float32 tiles.
constexpr int64_t kPartialFloats = 4 * 16 * kLanes;

// Sums tile `Tile` to (Store) or from its place in `partial`.
template <int Tile, bool Store>
inline void move_partial_tile(float* partial) {
  if constexpr (Store) store_tile<Tile>(partial + Tile * 16 * kLanes, kLanes * 4);
  else load_tile<Tile>(partial + Tile * 16 * kLanes, kLanes * 4);
}

// The sums tiles of a RowTiles x PanelTiles block to (Store) or from `partial`.
template <int RowTiles, int PanelTiles, bool Store>
inline void move_partial(float* partial) {
  move_partial_tile<0, Store>(partial);
  if constexpr (PanelTiles > 1) move_partial_tile<1, Store>(partial);
  if constexpr (RowTiles > 1) move_partial_tile<2, Store>(partial);
  if constexpr (RowTiles > 1 && PanelTiles > 1) move_partial_tile<3, Store>(partial);
}

// One block of RowTiles x PanelTiles tiles over k in [k0, k1): `a` its first row tile, `w` its
// first panel, the second `second` values on. From k0 > 0 on it resumes the sums it left in
// `partial`; before k1 = kp it leaves them there, at kp it hands them to the epilogue (stored and
// loaded float32 sums are the same values: the sums run over k in one order either way). Each step
// over k also asks for `ahead_step` bytes from `ahead` on (and as many from `ahead + ahead_gap`,
// when that is not 0: the next task's panels) into L2.
template <int RowTiles, int PanelTiles, class Epilogue>
void block(const uint16_t* a, int64_t kp, int tile_rows, const uint16_t* w, int64_t second, int64_t k0, int64_t k1,
           float* partial, const char* ahead, int64_t ahead_step, int64_t ahead_gap, const BlockAt& at,
           const Epilogue& epilogue) {
  if (k0 == 0) {
    _tile_zero(0);
    if constexpr (PanelTiles > 1) _tile_zero(1);
    if constexpr (RowTiles > 1) _tile_zero(2);
    if constexpr (RowTiles > 1 && PanelTiles > 1) _tile_zero(3);
  } else {
    move_partial<RowTiles, PanelTiles, false>(partial);
  }
  const uint16_t* a1 = a + tile_rows * kp;
  for (int64_t i = k0; i < k1; i += kKStep) {
    const char* fetch = ahead + (i - k0) / kKStep * ahead_step;
    for (int64_t b = 0; b < ahead_step; b += 64) _mm_prefetch(fetch + b, _MM_HINT_T1);
    if (ahead_gap != 0)
      for (int64_t b = 0; b < ahead_step; b += 64) _mm_prefetch(fetch + ahead_gap + b, _MM_HINT_T1);
    _tile_loadd(4, a + i * tile_rows, kKStep * 2);
    _tile_loadd(6, w + i * kLanes, 64);
    if constexpr (PanelTiles > 1) _tile_loadd(7, w + second + i * kLanes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PanelTiles > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles > 1) {
      _tile_loadd(5, a1 + i * tile_rows, kKStep * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PanelTiles > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (k1 < kp) {
    move_partial<RowTiles, PanelTiles, true>(partial);
    return;
  }
  epilogue.template tile<0>(at, 0, 0);
  if constexpr (PanelTiles > 1) epilogue.template tile<1>(at, 0, 1);
  if constexpr (RowTiles > 1) epilogue.template tile<2>(at, 1, 0);
  if constexpr (RowTiles > 1 && PanelTiles > 1) epilogue.template tile<3>(at, 1, 1);
  epilogue.done(at);
}

// Tasks of up to kRowBlocks x kPanelBlocks blocks (256 rows by 8 panels), panel by panel over their
// rows, so that both their rows and their panels stay in L2 (one block at a time over the whole
// weight read it again from L3 for every 32 rows: measured 894 -> 984 GFLOP/s on a 2048-row
// gate/up on the AMX Xeon, 1006 -> 1274 at 64 rows).
constexpr int64_t kRowBlocks = 8, kPanelBlocks = 4, kMinRowBlocksToPrefetch = 4;
// Threads share out the tasks in order: where A fits in L2 the panels are the outer loop (each
// thread reads its share of the weight, and all of A, once), else the rows (A read once).
constexpr int64_t kPanelMajorBytes = 1 << 20;
// Steps over k in one pass of a task's blocks: two panels and two row tiles of 9 steps are 36 KiB,
// within a 48 KiB L1 data cache (Sapphire Rapids'); a block over k = 576 whole was 72 KiB.
constexpr int64_t kPassSteps = 9;

// Part g of `parts` even parts of `count` items: [part_begin(g), part_begin(g + 1)).
inline int64_t part_begin(int64_t g, int64_t count, int64_t parts) { return g * count / parts; }

// How many even parts of at most `most` items to cut `count` into, for a team of `threads` that
// shares them out in order (schedule(static)): a multiple of the team, so that every thread gets as
// many items (blocks of rows or of panels) to within one a part. Parts of up to `most` each, cut
// in order, gave one of two threads twice the other's work on a 576-wide output (18 panel blocks:
// 4 + 4 + 4 | 4 + 2) in every step of up to 256 rows.
inline int64_t even_parts(int64_t count, int64_t most, int threads) {
  const int64_t parts = (count + most - 1) / most;
  return std::min(count, (parts + threads - 1) / threads * threads);
}

// A [rows, kp] (tiles of tile_rows rows) times the panels, each block's sums to the epilogue;
// n: the product's features (a plain weight's columns). Called by every thread of the team.
template <class Epilogue>
void multiply(const uint16_t* a, int64_t rows, int64_t kp, int tile_rows, const Panels& w, int64_t n,
              const Epilogue& epilogue) {
  const int64_t row_tiles = (rows + tile_rows - 1) / tile_rows, row_blocks = (row_tiles + 1) / 2;
  const int64_t steps = kp / kKStep;
  const bool panels_outer = rows * kp * 2 <= kPanelMajorBytes;
  const int threads = omp_get_num_threads();
  // the outer of the two is shared out between the threads: its parts come evenly
  const int64_t row_groups = panels_outer ? (row_blocks + kRowBlocks - 1) / kRowBlocks
                                          : even_parts(row_blocks, kRowBlocks, threads);
  const int64_t panel_groups = panels_outer ? even_parts(w.blocks, kPanelBlocks, threads)
                                            : (w.blocks + kPanelBlocks - 1) / kPanelBlocks;
  thread_local AlignedVector<float> partials(kRowBlocks * kPanelBlocks * kPartialFloats);
  const int64_t outer = panels_outer ? panel_groups : row_groups, inner = panels_outer ? row_groups : panel_groups;
#pragma omp for schedule(static) collapse(2)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t q = 0; q < inner; ++q) {
      const int64_t rg = panels_outer ? q : o, pg = panels_outer ? o : q;
      const int64_t pb_begin = part_begin(pg, w.blocks, panel_groups), pb_end = part_begin(pg + 1, w.blocks, panel_groups);
      const int64_t rb_begin = part_begin(rg, row_blocks, row_groups), rb_end = part_begin(rg + 1, row_blocks, row_groups);
      // the panels of this thread's next task (pg + 1), fetched into L2 while this one computes:
      // otherwise a task's first pass over its panels waits on memory. Not in tasks of few rows
      // (a decode step): there the panels stream from memory anyway, and the prefetches only
      // compete with them (measured slower at 1 and 64 rows on the AMX Xeon)
      const bool prefetch = rb_end - rb_begin >= kMinRowBlocksToPrefetch;
      const int64_t next_blocks = prefetch && pg + 1 < panel_groups ? part_begin(pg + 2, w.blocks, panel_groups) - pb_end : 0;
      // a plain weight's next panels are one run; a gate/up weight's two (gate and up)
      const int64_t run_bytes = w.gated ? next_blocks * w.panel_stride * 2
                                        : std::min(next_blocks * 2, w.panels - pb_end * 2) * w.panel_stride * 2;
      const int64_t blocks = (pb_end - pb_begin) * (rb_end - rb_begin);
      const int64_t ahead_block = (run_bytes / blocks + 63) / 64 * 64;   // per block, spread over its steps
      const int64_t ahead_step = run_bytes > 0 ? (ahead_block / steps + 63) / 64 * 64 : 0;
      const char* ahead = reinterpret_cast<const char*>(w.first + pb_end * w.block_stride);
      const int64_t ahead_gap = w.gated ? w.second * 2 : 0;
      // k in passes of at most kPassSteps steps where a task's blocks share panels (all its blocks'
      // passes over one part of k, then the next part): a pass's panels then stay in L1 while its
      // row tiles stream from L2, where over the whole of k both came from L2 (see kPassSteps)
      const int64_t passes = rb_end - rb_begin > 1 ? (steps + kPassSteps - 1) / kPassSteps : 1;
      const int64_t pass_steps = (steps + passes - 1) / passes;
      const char* fetch = ahead;
      for (int64_t k0 = 0; k0 < kp; k0 += pass_steps * kKStep) {
        const int64_t k1 = std::min(kp, k0 + pass_steps * kKStep);
        float* partial = partials.data();
        for (int64_t pb = pb_begin; pb < pb_end; ++pb)
          for (int64_t rb = rb_begin; rb < rb_end; ++rb, partial += kPartialFloats) {
            const int64_t r0 = rb * 2 * tile_rows;
            const BlockAt at{r0, pb,
                             {static_cast<int>(std::clamp<int64_t>(rows - r0, 0, tile_rows)),
                              static_cast<int>(std::clamp<int64_t>(rows - r0 - tile_rows, 0, tile_rows))},
                             {w.cols(pb, 0, n), w.cols(pb, 1, n)}};
            const bool two_rows = rb * 2 + 1 < row_tiles, two_panels = w.two(pb);
            const auto run = two_rows ? (two_panels ? block<2, 2, Epilogue> : block<2, 1, Epilogue>)
                                      : (two_panels ? block<1, 2, Epilogue> : block<1, 1, Epilogue>);
            run(a + r0 * kp, kp, tile_rows, w.first + pb * w.block_stride, w.second, k0, k1, partial, fetch,
                ahead_step, ahead_gap, at, epilogue);
            fetch += (k1 - k0) / kKStep * ahead_step;
          }
      }
    }
}

}  // namespace amx_gemm

#endif  // __AMX_BF16__
