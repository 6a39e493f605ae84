// mok gemm: the grouped tile scheduler (expert-major rows, group sizes read on the device).
//
// Rows of group g are [row_start[g], row_start[g] + size[g]) with row_start the exclusive prefix sum of
// the sizes, read from a device buffer (no host sync). Work is the flat list of output tiles
//     for g in groups: for each (m_block, n_block) of group g (ceil(size/kBlockM) x n_blocks tiles)
// in which tile t belongs to the last group with tile_start[g] <= t. Every tile costs the same (same K),
// so a static stride over the list (CTA c takes tiles c, c + num_ctas, ...) balances any skew of the
// group sizes to within one tile per CTA, needs no atomics, and is the same on every run.
//
// Inside a group, tiles are rasterised in bands of kGroupM m-blocks, m fastest within a band, so the
// CTAs of one wave share a few A row-blocks and a few B column-blocks in L2.
//
// Bad sizes (a negative size, or a sum above num_rows) set status bits and turn every group empty:
// no tile reads out of bounds, and every output row is then padding (zero).
#pragma once

#include <cstdint>

namespace mok::gemm {

constexpr int32_t kStatusNegativeGroup = 1;   // some group size < 0
constexpr int32_t kStatusRowOverflow = 2;     // sum of group sizes > number of rows

template <int kMaxGroups>
struct GroupTable {
  int32_t row_start[kMaxGroups + 1];   // [num_groups + 1]; row_start[num_groups] = rows in use
  int32_t tile_start[kMaxGroups + 1];  // [num_groups + 1]; tile_start[num_groups] = tiles in all
  int32_t status;                      // kStatus* bits, 0 when the sizes are valid
};

struct TileCoord {
  int32_t group;      // expert index
  int32_t row_begin;  // first row of this tile (global row index)
  int32_t row_end;    // one past the last row of the group (rows >= row_end are not this group's)
  int32_t n_block;    // output column block
};

// Build the table with one full warp (lane = lane index). Sizes are scanned in 32 contiguous chunks
// (one per lane) and the chunk sums combined with a warp scan; 64-bit sums so no overflow goes unseen.
template <int kMaxGroups>
__device__ void build_group_table(GroupTable<kMaxGroups>& table, const int32_t* __restrict__ sizes,
                                  int num_groups, int64_t num_rows, int block_m, int n_blocks, int lane) {
  const int chunk = (num_groups + 31) / 32;
  const int g_begin = min(num_groups, lane * chunk), g_end = min(num_groups, g_begin + chunk);
  bool negative = false;
  int64_t rows = 0, tiles = 0;
  for (int g = g_begin; g < g_end; ++g) {
    const int64_t s = sizes[g];
    negative |= s < 0;
    const int64_t sz = s < 0 ? 0 : s;
    rows += sz;
    tiles += ((sz + block_m - 1) / block_m) * n_blocks;
  }
  int64_t rows_incl = rows, tiles_incl = tiles;
  for (int d = 1; d < 32; d *= 2) {
    const int64_t r = __shfl_up_sync(0xffffffffu, rows_incl, d);
    const int64_t t = __shfl_up_sync(0xffffffffu, tiles_incl, d);
    if (lane >= d) rows_incl += r, tiles_incl += t;
  }
  const bool any_negative = __any_sync(0xffffffffu, negative);
  const int64_t total_rows = __shfl_sync(0xffffffffu, rows_incl, 31);
  const int64_t total_tiles = __shfl_sync(0xffffffffu, tiles_incl, 31);
  const int32_t status = (any_negative ? kStatusNegativeGroup : 0) | (total_rows > num_rows ? kStatusRowOverflow : 0);
  const bool valid = status == 0;
  int64_t row = rows_incl - rows, tile = tiles_incl - tiles;  // exclusive prefix at g_begin
  for (int g = g_begin; g < g_end; ++g) {
    table.row_start[g] = valid ? int32_t(row) : 0;
    table.tile_start[g] = valid ? int32_t(tile) : 0;
    const int64_t sz = valid ? int64_t(sizes[g]) : 0;
    row += sz;
    tile += ((sz + block_m - 1) / block_m) * n_blocks;
  }
  if (lane == 0) {
    table.row_start[num_groups] = valid ? int32_t(total_rows) : 0;
    table.tile_start[num_groups] = valid ? int32_t(total_tiles) : 0;
    table.status = status;
  }
}

// The last g in [0, n) with start(g) <= t, for a non-decreasing start() with start(0) <= t: the group a
// flat tile index belongs to (the grouped FFN's tile_start, the megakernel's m-block prefix).
template <class Start>
__host__ __device__ __forceinline__ int last_group_at(Start start, int n, int t) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (start(mid) <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// Tile `local` of a group of `rows` rows with n_blocks column blocks: bands of kGroupM m-blocks, m fastest
// within a band (the raster of every grouped GEMM of the library).
template <int kBlockM, int kGroupM>
__host__ __device__ __forceinline__ void band_tile(int local, int rows, int n_blocks, int* m_block, int* n_block) {
  const int m_blocks = (rows + kBlockM - 1) / kBlockM;
  const int band = local / (kGroupM * n_blocks);
  const int band_m0 = band * kGroupM;
  const int band_rows = min(kGroupM, m_blocks - band_m0);
  const int in_band = local - band * kGroupM * n_blocks;
  *m_block = band_m0 + in_band % band_rows;
  *n_block = in_band / band_rows;
}

// Map flat tile index t (< tile_start[num_groups]) to its group, rows and column block.
template <int kMaxGroups, int kBlockM, int kGroupM>
__device__ __forceinline__ TileCoord decode_tile(const GroupTable<kMaxGroups>& table, int num_groups, int tile,
                                                 int n_blocks) {
  const int g = last_group_at([&](int i) { return table.tile_start[i]; }, num_groups, tile);
  const int row0 = table.row_start[g], row_end = table.row_start[g + 1];
  int m_block, n_block;
  band_tile<kBlockM, kGroupM>(tile - table.tile_start[g], row_end - row0, n_blocks, &m_block, &n_block);
  return TileCoord{g, row0 + m_block * kBlockM, row_end, n_block};
}

}  // namespace mok::gemm
