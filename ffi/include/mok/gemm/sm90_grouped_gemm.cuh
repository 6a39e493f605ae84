// mok gemm: the persistent, warp-specialised grouped GEMM for Hopper (sm_90a), TMA + wgmma through CuTe; one
// kernel for every precision, which is its mainloop (sm90_mainloop.cuh: Bf16Mainloop, Fp8BlockScaledMainloop).
//
//   out[r, n] = epilogue( sum_k A[r, k] * B[g][k, n] )        for rows r of group g (expert-major rows)
//   bf16:  fp32 accumulation in registers;  FP8: sum over 128-long k blocks of the block's E4M3 product times the
//          row's and the weight block's scales (DeepSeek-V3), promoted into fp32 on the CUDA cores
// The epilogues (kSwiGLU, kSwiGLUQuant, kBf16, kF32) are listed in sm90_mainloop.cuh; a SwiGLU tile's 256 MMA
// columns are 128 gate columns and the 128 up columns b_second_offset (= I) further on, a plain tile's are 256
// adjacent columns (b_second_offset = 128).
//
// Roles (384 threads = 3 warpgroups, one CTA per SM, persistent over the tiles of the group scheduler,
// group_scheduler.cuh):
//   warpgroup 0, warp 0           : producer: Mainloop::load_tile for each of its tiles (one elected lane for bf16,
//                                   the whole warp for FP8, whose lanes copy the stage's scales); registers trimmed.
//   warpgroup 0, warps 1..3       : padding rows [sum(group sizes), M) of `out` (zeros; FP8 h's scales 1).
//   warpgroups 1, 2 (consumers)   : Mainloop::mma_tile, then the epilogue Mainloop::store<kEpi>.
//
// Shared memory: the stage ring (192 KB, the same bytes for either precision), the mainloop's extra (bf16: 2 x 9 KB
// epilogue buffers; FP8: the stages' scales, 2 KB), 8 KB group table; < 227 KB.
//
// Invariants: every output row of a group is written by exactly one CTA with a fixed k order, so results
// are bitwise reproducible and independent of the number of CTAs; tile rows past the group's end (read
// from the next group's rows or TMA zero fill) are computed but never stored; rows past M are zero-filled
// by TMA; K and N tails are zero-filled by TMA (bf16: H and I need only be multiples of 8 for 16-byte strides;
// FP8: multiples of 128, whole scale blocks). A bounded wait that times out sets kStatusWaitTimeout in the status
// word and ends the CTA early.
#pragma once

#include <cuda_bf16.h>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/common.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_mainloop.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok::gemm {

template <class Mainloop, Epilogue kEpi>
struct Sm90GroupedGemm {
  using Tile = typename Mainloop::Tile;
  using Element = typename Mainloop::Element;
  static constexpr bool kSwiGLU = kEpi == Epilogue::kSwiGLU || kEpi == Epilogue::kSwiGLUQuant;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kHalfN = Tile::kHalfN;
  static constexpr int kOutCols = kTileOutCols<Tile, kEpi>;  // output columns per tile
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

  using TmaA = typename Mainloop::TmaA;
  using TmaB = typename Mainloop::TmaB;
  static auto make_tma_a(const Element* ptr, int rows, int k) { return Mainloop::make_tma_a(ptr, rows, k); }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    return Mainloop::make_tma_b(ptr, n_b, k, groups);
  }

  // The mainloop's operands (tma_a, tma_b; FP8: `scales`) first, then the grouped problem, then the output. As a
  // base class (not a member) the operands take no tail padding: group_sizes follows the FP8 scales directly.
  struct Params : Mainloop::Operands {
    const int32_t* group_sizes;  // [num_groups], device
    int32_t num_groups;
    int32_t num_rows;            // M: rows of A and of out
    int32_t k;                   // reduction length
    int32_t n_out;               // columns of out (I for gate/up, H for down)
    int32_t n_b;                 // columns of one B matrix (2I, or H)
    int32_t b_second_offset;     // column of the second B half relative to the first (I, or 128)
    typename Mainloop::Out out;  // ptr [num_rows, ld] (FP8: and scale)
    int32_t* status;             // status word (bounded-wait failures are or-ed in)
    int32_t write_status;        // CTA 0 stores the group-size status (the first GEMM of the pair)
  };

  struct SharedStorage {
    StageRing stages;
    typename Mainloop::SharedExtra extra;
    GroupTable<kMaxGroups> table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  // ---- producer: warp 0 (one lane of it for the bf16 mainloop) ---------------------------------------------
  __device__ static void producer(const Params& p, SharedStorage& s, int n_blocks, int lane) {
    const int num_tiles = s.table.tile_start[p.num_groups];
    const auto state = Mainloop::load_init(p);
    RingPos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      if (!Mainloop::template load_tile<kEpi>(state, p, s.stages, s.extra, pos, tc, lane)) return;
    }
  }

  // ---- consumers: two warpgroups, 64 rows each --------------------------------------------------------
  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int n_blocks) {
    Mainloop::with_accumulators([&](auto&... acc) { consume(p, s, ct, n_blocks, acc...); });
  }
  template <class... Accumulator>
  __device__ static void consume(const Params& p, SharedStorage& s, int ct, int n_blocks, Accumulator&... acc) {
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int wg = ct / 128, t = ct % 128;
    const auto state = Mainloop::mma_init(p);
    RingPos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      if (!Mainloop::mma_tile(state, p, s.stages, s.extra, pos, ct, acc...)) return;
      Mainloop::template store<kEpi>(p, s.extra, tc, wg, t, acc...);
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
      Mainloop::init_stages(s.stages);
      cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
    }
    if (warp == 1) build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, n_blocks, lane);
    __syncthreads();
    if (p.write_status && blockIdx.x == 0 && threadIdx.x == 0) *p.status = s.table.status;
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (warp == 0) {
        if constexpr (Mainloop::kProducerLanes == 32) {
          producer(p, s, n_blocks, lane);
        } else if (cute::elect_one_sync()) {
          producer(p, s, n_blocks, lane);
        }
      } else if constexpr (kEpi != Epilogue::kF32) {  // the backward's outputs past the groups are scratch
        Mainloop::template zero_padding_rows<kEpi>(p, s.table, threadIdx.x - 32, 96);
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
