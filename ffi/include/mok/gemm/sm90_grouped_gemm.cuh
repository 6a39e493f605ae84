// mok gemm: persistent, warp-specialised grouped GEMM for Hopper (sm_90a), TMA + wgmma through CuTe.
//
//   out[r, n] = epilogue( sum_k A[r, k] * B[g][k, n] )        for rows r of group g (expert-major rows)
//   kSwiGLU:  the CTA tile's 256 MMA columns are 128 gate columns [n0, n0+128) and the 128 matching up
//             columns [n0 + I, n0 + I + 128) of gate_up[g] (H x 2I); out = silu(gate) * up  (h, M x I)
//   kBf16:    the 256 MMA columns are [n0, n0 + 256) of B[g]; out = acc  (y = h @ down, M x H; and in the
//             backward gu = x @ gate_up, M x 2I, and, with K-major B, dx = dgu @ gate_up^T, M x H)
//   kF32:     as kBf16 with fp32 out (`out` points at floats): the backward's g, u at the forward's precision
// fp32 accumulation in registers, bf16 out with round-to-nearest-even.
//
// Built from the tile pieces of sm90_tile.cuh and the static group scheduler of group_scheduler.cuh.
// Roles (384 threads = 3 warpgroups, one CTA per SM, persistent over the tiles of the group scheduler):
//   warpgroup 0, warp 0, one lane : producer: Sm90Tile::load_tile for each of its tiles; registers trimmed.
//   warpgroup 0, warps 1..3       : write zeros into the padding rows [sum(group sizes), M) of `out`.
//   warpgroups 1, 2 (consumers)   : Sm90Tile::mma_tile, then the epilogue policy (SwiGLU or plain bf16).
//
// Shared memory: the stage ring (192 KB), 2 x 9 KB epilogue buffers, 8 KB group table; < 227 KB.
//
// Invariants: every output row of a group is written by exactly one CTA with a fixed k order, so results
// are bitwise reproducible and independent of the number of CTAs; tile rows past the group's end (read
// from the next group's rows or TMA zero fill) are computed but never stored; rows past M are zero-filled
// by TMA; K and N tails are zero-filled by TMA (H and I need only be multiples of 8 for 16-byte strides).
// A bounded wait that times out sets kStatusWaitTimeout in the status word and ends the CTA early.
#pragma once

#include <cuda_bf16.h>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/common.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok::gemm {

enum class Epilogue { kSwiGLU, kBf16, kF32 };

template <Epilogue kEpi, cute::GMMA::Major kMajorB = cute::GMMA::Major::MN>
struct Sm90GroupedGemm {
  using Tile = Sm90TileT<cute::GMMA::Major::K, kMajorB>;
  using Element = typename Tile::Element;
  static constexpr bool kSwiGLU = kEpi == Epilogue::kSwiGLU;
  static constexpr bool kF32Out = kEpi == Epilogue::kF32;  // out is float (the backward's g, u)
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kHalfN = Tile::kHalfN;
  static constexpr int kOutCols = kSwiGLU ? Tile::kHalfN : Tile::kBlockN;  // output columns per tile
  static constexpr int kThreads = 128 + Tile::kConsumerThreads;
  // Raster band height (m-blocks): a 132-tile wave spans ~16 m-blocks x ~8 n-blocks of one group,
  // about the L2 footprint that minimises A + B re-reads for the ep64-slice shapes.
  static constexpr int kGroupM = 16;
  static constexpr int kMaxGroups = 1024;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // setmaxnreg only moves the registers the launch gave the CTA (65536 / 384, rounded down to 8, each).
  static_assert(kProducerRegs * 128 + kConsumerRegs * Tile::kConsumerThreads <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg budget of the CTA");

  using TmaA = typename Tile::TmaA;
  using TmaB = typename Tile::TmaB;
  static auto make_tma_a(const Element* ptr, int rows, int k) { return Tile::make_tma_a(ptr, rows, k); }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    return Tile::make_tma_b(ptr, n_b, k, groups);
  }

  struct Params {
    TmaA tma_a;
    TmaB tma_b;
    const int32_t* group_sizes;  // [num_groups], device
    int32_t num_groups;
    int32_t num_rows;            // M: rows of A and of out
    int32_t k;                   // reduction length
    int32_t n_out;               // columns of out (I for gate/up, H for down)
    int32_t n_b;                 // columns of one B matrix (2I, or H)
    int32_t b_second_offset;     // column of the second B half relative to the first (I, or 128)
    Element* out;                // [num_rows, out_ld]
    int64_t out_ld;
    int32_t* status;             // status word (bounded-wait failures are or-ed in)
    int32_t write_status;        // CTA 0 stores the group-size status (the first GEMM of the pair)
  };

  struct SharedStorage {
    typename Tile::Stages stages;
    alignas(16) uint32_t epi[Tile::kConsumerWarpgroups][Tile::kEpiWords];
    GroupTable<kMaxGroups> table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  __device__ static typename Tile::TileLoad tile_load(const Params& p, const TileCoord& tc) {
    const int col0 = tc.n_block * kOutCols;
    return typename Tile::TileLoad{p.num_rows, p.k, tc.row_begin, p.n_b, p.num_groups, tc.group, col0,
                          col0 + p.b_second_offset};
  }

  // ---- producer: one thread ------------------------------------------------------------------------
  __device__ static void producer(const Params& p, SharedStorage& s, int n_blocks) {
    const int num_tiles = s.table.tile_start[p.num_groups];
    typename Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      if (!Tile::load_tile(p.tma_a, p.tma_b, s.stages, pos, tile_load(p, tc), p.status)) return;
    }
  }

  // ---- padding rows: warps 1..3 of the producer warpgroup -------------------------------------------
  __device__ static void zero_padding_rows(const Params& p, const SharedStorage& s, int t, int num_threads) {
    const int64_t first = s.table.row_start[p.num_groups];
    const int64_t chunks_per_row = p.n_out / 8;
    const int64_t total = (int64_t(p.num_rows) - first) * chunks_per_row;
    for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < total; idx += int64_t(gridDim.x) * num_threads) {
      const int64_t row = first + idx / chunks_per_row, col = (idx % chunks_per_row) * 8;
      *reinterpret_cast<uint4*>(p.out + row * p.out_ld + col) = make_uint4(0, 0, 0, 0);
    }
  }

  // ---- consumers: two warpgroups, 64 rows each --------------------------------------------------------
  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int n_blocks) {
    typename Tile::Accumulator acc;
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int wg = ct / 128, t = ct % 128;
    typename Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      if (!Tile::mma_tile(s.stages, pos, acc, p.k, ct, p.status)) return;
      if constexpr (kF32Out) {
        const typename Tile::TileStore st{p.out, p.out_ld, tc.row_begin, tc.row_end, tc.n_block * kOutCols, p.n_out};
        Tile::store_f32(acc, st, wg, t);
      } else {
        const typename Tile::TileStore st{p.out, p.out_ld, tc.row_begin, tc.row_end, tc.n_block * kOutCols, p.n_out};
        Tile::template store_bf16<kSwiGLU>(acc, s.epi[wg], st, wg, t);
      }
    }
  }

  // ---- the kernel body: set up, then route by role ---------------------------------------------------
  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& s = aligned_shared_storage<SharedStorage>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    const int n_blocks = (p.n_out + kOutCols - 1) / kOutCols;
    if (warp == 0 && lane == 0) {
      Tile::init_stages(s.stages);
      cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
    }
    if (warp == 1) build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, n_blocks, lane);
    __syncthreads();
    if (p.write_status && blockIdx.x == 0 && threadIdx.x == 0) *p.status = s.table.status;
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp == 0) {
        if (cute::elect_one_sync()) producer(p, s, n_blocks);
      } else if constexpr (!kF32Out) {  // the backward's outputs past the groups are scratch
        zero_padding_rows(p, s, threadIdx.x - 32, 96);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      consumer(p, s, threadIdx.x - 128, n_blocks);
    }
  }
};

// Status bit of a build without sm_90a machine code (the kernel then does nothing but say so).
constexpr int32_t kStatusNoSm90a = 1 << 29;

template <class Gemm>
__global__ void __launch_bounds__(Gemm::kThreads, 1) sm90_grouped_gemm_kernel(const __grid_constant__ typename Gemm::Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  Gemm::run(params);
#elif defined(__CUDA_ARCH__)
  // Built without the sm_90a target (wgmma, setmaxnreg): say so in the status word rather than write
  // nothing silently (the host refuses to launch such a build in the first place).
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(params.status, kStatusNoSm90a);
#endif
}

// ---- host side ---------------------------------------------------------------------------------------
// The CTA count of a persistent GEMM: num_sms when it is in (0, SMs of the current device), else every SM.
inline cudaError_t persistent_grid(int32_t num_sms, int* grid) {
  int device = 0, sm_count = 0;
  MOK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  *grid = num_sms > 0 && num_sms < sm_count ? num_sms : sm_count;
  return cudaSuccess;
}

// Enqueue sm90_grouped_gemm_kernel<Gemm> (a grouped GEMM of this header, or Sm90WeightGrad) on `grid` CTAs.
// Refuses a build without sm_90a machine code (the kernel would only set kStatusNoSm90a).
template <class Gemm>
cudaError_t launch_persistent_gemm(const typename Gemm::Params& params, int grid, cudaStream_t stream) {
  return launch_sm90a(&sm90_grouped_gemm_kernel<Gemm>, grid, Gemm::kThreads, Gemm::kSmemBytes, stream, params);
}

}  // namespace mok::gemm
