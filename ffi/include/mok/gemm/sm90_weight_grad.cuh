// mok gemm: the grouped weight-gradient GEMM for Hopper (sm_90a), TMA + wgmma through CuTe.
//
//   out[g][m, n] = bf16( sum_{r in rows of group g} A[r, m] * B[r, n] )      fp32 accumulation
//
// A [M, m_dim] and B [M, n_dim] are expert-major rows (group g owns rows [start_g, start_g + size_g),
// start = exclusive prefix sum of the sizes, read on the device); the reduction runs over a group's rows,
// so K varies from group to group and may be 0 (an empty expert gets exact zeros). Both operands are read
// MN-major (rows are the k index): the down projection's gradient is (w h)^T dy, the gate/up projection's
// x^T dgu.
//
// Every group size must be a multiple of 128 (the backward pads groups to 128 rows with zero rows, its M
// tile; twice the k-tile), so a k-tile never holds another group's rows. Bad sizes (a negative one, a sum
// past the rows, or one that is not a multiple of 128: kStatusUnpaddedGroup) set their status bits, nothing is read, and
// every output element is NaN, so a gradient computed from them cannot pass for a real one.
//
// Work: every group has the same (m_blocks x n_blocks) output tiles; the flat list is group-major and a
// CTA takes tiles c, c + num_ctas, ... A hot expert's tiles are consecutive in the list, so they spread
// over every CTA instead of serialising on one, and each output tile is reduced by exactly one CTA in
// ascending row order: no atomics, no split that depends on the SM count, bitwise the same on any grid.
// Roles as in sm90_grouped_gemm.cuh (one producer thread, two consumer warpgroups).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok::gemm {

constexpr int32_t kStatusUnpaddedGroup = 4;  // a group size that is not a multiple of kGroupAlign
constexpr int kGroupAlign = 128;

// Whether some group size is not a multiple of kGroupAlign (the weight-gradient tiles are then NaN). One full warp.
__device__ __forceinline__ bool any_unpadded_group(const int32_t* __restrict__ sizes, int num_groups, int lane) {
  bool unpadded = false;
  for (int g = lane; g < num_groups; g += 32) unpadded |= sizes[g] % kGroupAlign != 0;
  return __any_sync(0xffffffffu, unpadded);
}

struct Sm90WeightGrad {
  using Tile = Sm90TileT<cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
  using Element = Tile::Element;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kThreads = 128 + Tile::kConsumerThreads;
  static constexpr int kGroupM = 16;
  static constexpr int kMaxGroups = 1024;
  static_assert(kGroupAlign % Tile::kBlockK == 0, "a k-tile never straddles two groups");
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;

  using TmaA = Tile::TmaA;
  using TmaB = Tile::TmaB;
  // A: the [rows, m_dim] expert-major rows read as m_dim x rows; B: [rows, n_dim] rows as rows x n_dim.
  static auto make_tma_a(const Element* ptr, int rows, int m_dim) { return Tile::make_tma_a(ptr, m_dim, rows); }
  static auto make_tma_b(const Element* ptr, int rows, int n_dim) { return Tile::make_tma_b(ptr, n_dim, rows, 1); }

  struct Params {
    TmaA tma_a;
    TmaB tma_b;
    const int32_t* group_sizes;  // [num_groups], device; multiples of kGroupAlign
    int32_t num_groups;
    int32_t num_rows;            // M: rows of A and B
    int32_t m_dim, n_dim;        // out[g] is m_dim x n_dim
    Element* out;                // [num_groups, m_dim, n_dim]
    int32_t* status;             // bounded-wait failures and kStatusUnpaddedGroup are or-ed in
  };

  struct SharedStorage {
    Tile::Stages stages;
    alignas(16) uint32_t epi[Tile::kConsumerWarpgroups][Tile::kEpiWords];
    GroupTable<kMaxGroups> table;
    int32_t unpadded;
    int32_t bad;  // table.status or unpadded: every tile is NaN
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  struct Work {
    int m_blocks, n_blocks, per_group, num_tiles;
  };
  __device__ static Work work(const Params& p) {
    const int mb = (p.m_dim + kBlockM - 1) / kBlockM, nb = (p.n_dim + kBlockN - 1) / kBlockN;
    return Work{mb, nb, mb * nb, mb * nb * p.num_groups};
  }

  struct TileRef {
    int group, m_block, n_block, k0, k_len;
  };
  __device__ static TileRef decode(const Params& p, const SharedStorage& s, const Work& w, int tile) {
    TileRef r;
    r.group = tile / w.per_group;
    band_tile<kBlockM, kGroupM>(tile - r.group * w.per_group, p.m_dim, w.n_blocks, &r.m_block, &r.n_block);
    r.k0 = s.table.row_start[r.group];
    r.k_len = s.unpadded ? 0 : s.table.row_start[r.group + 1] - r.k0;
    return r;
  }

  __device__ static void producer(const Params& p, SharedStorage& s) {
    const Work w = work(p);
    Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < w.num_tiles; tile += gridDim.x) {
      const TileRef r = decode(p, s, w, tile);
      const int col0 = r.n_block * kBlockN;
      const Tile::TileLoad t{p.m_dim, p.num_rows, r.m_block * kBlockM, p.n_dim, 1, 0, col0, col0 + Tile::kHalfN,
                             r.k0, r.k_len};
      if (!Tile::load_tile(p.tma_a, p.tma_b, s.stages, pos, t, p.status)) return;
    }
  }

  // A tile without k: zeros (an empty expert), or NaN (bf16 0x7fc0) when the sizes were bad.
  __device__ static void fill_tile(const Tile::TileStore& st, int ct, bool nan) {
    auto* out = static_cast<Element*>(st.out);
    const uint32_t v = nan ? 0x7fc07fc0u : 0u;
    constexpr int kChunks = kBlockM * kBlockN / 8;
    for (int idx = ct; idx < kChunks; idx += Tile::kConsumerThreads) {
      const int row = st.row0 + idx / (kBlockN / 8), col = st.col0 + (idx % (kBlockN / 8)) * 8;
      if (row < st.row_end && col < st.n_out)
        *reinterpret_cast<uint4*>(out + int64_t(row) * st.ld + col) = make_uint4(v, v, v, v);
    }
  }

  __device__ static void consumer(const Params& p, SharedStorage& s, int ct) {
    const Work w = work(p);
    Tile::Accumulator acc;
    const int wg = ct / 128, t = ct % 128;
    Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < w.num_tiles; tile += gridDim.x) {
      const TileRef r = decode(p, s, w, tile);
      Element* out = p.out + int64_t(r.group) * p.m_dim * p.n_dim;
      const Tile::TileStore st{out, p.n_dim, r.m_block * kBlockM, p.m_dim, r.n_block * kBlockN, p.n_dim};
      if (r.k_len == 0) {  // an empty expert: exact zeros (the accumulator is not involved, see mma_tile)
        fill_tile(st, ct, s.bad);
        continue;
      }
      if (!Tile::mma_tile(s.stages, pos, acc, r.k_len, ct, p.status)) return;
      Tile::store_bf16<false>(acc, s.epi[wg], st, wg, t);
    }
  }

  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& s = aligned_shared_storage<SharedStorage>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      Tile::init_stages(s.stages);
      cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
    }
    if (warp == 1) {
      build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, 1, lane);
      const bool unpadded = any_unpadded_group(p.group_sizes, p.num_groups, lane);
      if (lane == 0) s.unpadded = unpadded, s.bad = unpadded || s.table.status != 0;
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0 && (s.table.status | (s.unpadded ? kStatusUnpaddedGroup : 0)))
      atomicOr(p.status, s.table.status | (s.unpadded ? kStatusUnpaddedGroup : 0));
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp == 0 && cute::elect_one_sync()) producer(p, s);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      consumer(p, s, threadIdx.x - 128);
    }
  }
};

}  // namespace mok::gemm
