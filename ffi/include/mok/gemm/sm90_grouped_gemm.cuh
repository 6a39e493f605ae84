// mok gemm: persistent, warp-specialised grouped GEMM for Hopper (sm_90a), TMA + wgmma through CuTe.
//
//   out[r, n] = epilogue( sum_k A[r, k] * B[g][k, n] )        for rows r of group g (expert-major rows)
//   kSwiGLU:  the CTA tile's 256 MMA columns are 128 gate columns [n0, n0+128) and the 128 matching up
//             columns [n0 + I, n0 + I + 128) of gate_up[g] (H x 2I); out = silu(gate) * up  (h, M x I)
//   else:     the 256 MMA columns are [n0, n0 + 256) of down[g] (I x H); out = acc         (y, M x H)
// fp32 accumulation in registers, bf16 out with round-to-nearest-even.
//
// Roles (384 threads = 3 warpgroups, one CTA per SM, persistent over the tiles of the group scheduler):
//   warpgroup 0, warp 0, one lane : producer: TMA loads of A (128 x 64) and B (2 halves of 128 x 64) per
//                                   k-tile into a kStages ring; registers trimmed to kProducerRegs.
//   warpgroup 0, warps 1..3       : write zeros into the padding rows [sum(group sizes), M) of `out`.
//   warpgroups 1, 2 (consumers)   : each owns 64 rows of the 128 x 256 tile: wgmma 64x256x16 (A K-major,
//                                   B MN-major, both from 128B-swizzled shared memory), one batch of 4
//                                   in flight; then the epilogue through a per-warpgroup staging buffer
//                                   (64 x 64 bf16, padded rows) into 16-byte, row-masked global stores.
//
// Shared memory: 4 stages x (16 KB A + 32 KB B) = 192 KB, 2 x 9 KB epilogue staging, 8 KB group table,
// mbarriers; < 227 KB, so one CTA per SM. Barriers: full[s] (1 producer arrive + TMA bytes) and empty[s]
// (one arrive per consumer warp = 8). All waits are bounded (sm90_sync.cuh).
//
// Invariants: every output row of a group is written by exactly one CTA with a fixed k order, so results
// are bitwise reproducible and independent of the number of CTAs; tile rows past the group's end (read
// from the next group's rows or TMA zero fill) are computed but never stored; rows past M are zero-filled
// by TMA; K and N tails are zero-filled by TMA (H and I need only be multiples of 8 for 16-byte strides).
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok::gemm {

template <bool kSwiGLU_>
struct Sm90GroupedGemm {
  using Element = cutlass::bfloat16_t;
  static constexpr bool kSwiGLU = kSwiGLU_;

  // 128 x 256 x 64 is the tile cuBLAS/CUTLASS pick for large bf16 GEMMs on H100: 64x256 wgmma per
  // consumer warpgroup has the lowest shared-memory traffic per FLOP, and 4 stages of 48 KB cover the
  // TMA latency. The SwiGLU variant keeps the 256-wide MMA (gate and up halves) and writes 128 columns.
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;
  static constexpr int kStages = 4;
  static constexpr int kHalfN = kBlockN / 2;
  static constexpr int kOutCols = kSwiGLU ? kHalfN : kBlockN;  // output columns per tile
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;
  // Raster band height (m-blocks): a 132-tile wave spans ~16 m-blocks x ~8 n-blocks of one group,
  // about the L2 footprint that minimises A + B re-reads for the ep64-slice shapes.
  static constexpr int kGroupM = 16;
  static constexpr int kMaxGroups = 1024;
  static constexpr int kEpiCols = 64;
  static constexpr int kEpiPitch = kEpiCols + 8;  // bf16; +16 B per row makes the bf16x2 writes conflict-free
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <= 64 * 1024, "register file");
  static_assert(kOutCols % kEpiCols == 0, "epilogue passes");

  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  // MN-major B: swizzle atoms (64 n x 8 k) tiled along k first, so each 64-column strip of a stage is one
  // contiguous 8 KB box for TMA and the strips sit at a uniform stride for the wgmma descriptor.
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // One 128-column half of one B stage: the same strides as the matching part of SmemLayoutB.
  using SmemLayoutBHalf = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{}, cute::Shape<cute::Int<kHalfN>, cute::Int<kBlockK>>{},
      cute::Step<cute::_2, cute::_1>{}));
  static constexpr int kStageElemsA = kBlockM * kBlockK;
  static constexpr int kStageElemsB = kBlockN * kBlockK;
  static constexpr int kHalfElemsB = kHalfN * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + kStageElemsB) * sizeof(Element);

  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  // A: rows x k, k contiguous (x, or h for the down projection).
  static auto make_tma_a(const Element* ptr, int rows, int k) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(rows, k), make_stride(int64_t(k), Int<1>{}));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutA{}(_, _, 0), Shape<Int<kBlockM>, Int<kBlockK>>{}, Int<1>{});
  }
  // B: one k x n_b row-major matrix per group (n contiguous), viewed as (n_b, k, groups).
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_b, k, groups),
                           make_stride(Int<1>{}, int64_t(n_b), int64_t(n_b) * k));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutBHalf{}, Shape<Int<kHalfN>, Int<kBlockK>>{}, Int<1>{});
  }
  using TmaA = decltype(make_tma_a(nullptr, 0, 0));
  using TmaB = decltype(make_tma_b(nullptr, 0, 0, 0));

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
    alignas(1024) Element a[cute::cosize_v<SmemLayoutA>];
    alignas(1024) Element b[cute::cosize_v<SmemLayoutB>];
    alignas(16) uint32_t epi[kConsumerWarpgroups][kRowsPerConsumer * kEpiPitch / 2];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
    GroupTable<kMaxGroups> table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  __device__ static float silu(float g) { return g / (1.0f + __expf(-g)); }

  __device__ static uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }

  // ---- producer: one thread ------------------------------------------------------------------------
  __device__ static void producer(const Params& p, SharedStorage& s, int n_blocks) {
    using namespace cute;
    const int k_tiles = (p.k + kBlockK - 1) / kBlockK;
    const int num_tiles = s.table.tile_start[p.num_groups];
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.num_rows, p.k));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_b, p.k, p.num_groups));
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      Tensor gA = local_tile(domain_offset(make_coord(tc.row_begin, 0), mA), Shape<Int<kBlockM>, Int<kBlockK>>{},
                             make_coord(0, _));  // (BM, BK, k)
      auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      Tensor mBg = mB(_, _, tc.group);
      const int col0 = tc.n_block * kOutCols;
      Tensor gB0 = local_tile(domain_offset(make_coord(col0, 0), mBg), Shape<Int<kHalfN>, Int<kBlockK>>{},
                              make_coord(0, _));  // (BN/2, BK, k)
      Tensor gB1 = local_tile(domain_offset(make_coord(col0 + p.b_second_offset, 0), mBg),
                              Shape<Int<kHalfN>, Int<kBlockK>>{}, make_coord(0, _));
      // A second half that starts past the last column of B (the N tail of the down projection) feeds
      // only masked output columns: skip its load rather than ask TMA for a box wholly out of bounds.
      const bool load_second = col0 + p.b_second_offset < p.n_b;
      const uint32_t stage_bytes = load_second ? kStageBytes : kStageBytes - kHalfElemsB * sizeof(Element);
      for (int k = 0; k < k_tiles; ++k) {
        mbarrier_wait(&s.empty[stage], phase ^ 1, p.status);
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[stage], stage_bytes);
        copy(p.tma_a.with(s.full[stage]), tAgA(_, k), tAsA(_, stage));
        Tensor sB0 = make_tensor(make_smem_ptr(s.b + stage * kStageElemsB), SmemLayoutBHalf{});
        Tensor sB1 = make_tensor(make_smem_ptr(s.b + stage * kStageElemsB + kHalfElemsB), SmemLayoutBHalf{});
        auto [tB0g, tB0s] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB0),
                                          group_modes<0, 2>(gB0(_, _, k)));
        copy(p.tma_b.with(s.full[stage]), tB0g, tB0s);
        if (load_second) {
          auto [tB1g, tB1s] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB1),
                                            group_modes<0, 2>(gB1(_, _, k)));
          copy(p.tma_b.with(s.full[stage]), tB1g, tB1s);
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
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

  // ---- consumer epilogue: acc (this thread's part of 64 x 256) -> out rows, masked ------------------
  // wgmma accumulator fragment (PTX ISA, m64nNk16 f32 D): value i of thread (warp w, lane l) of the
  // warpgroup sits at row 16w + l/4 + 8*((i/2)%2), column 8*(i/4) + 2*(l%4) + i%2. For SwiGLU the up
  // partner of gate column c (< 128) is column c + 128, i.e. value i + 64 of the same thread.
  template <class Acc>
  __device__ static void epilogue(const Params& p, SharedStorage& s, const Acc& acc, const TileCoord& tc, int wg,
                                  int t) {
    uint32_t* buf = s.epi[wg];
    constexpr int kPitchWords = kEpiPitch / 2;
    const int lane = t % 32, warp = t / 32;
    const int r_base = 16 * warp + lane / 4;
    const int c_base = 2 * (lane % 4);
    const int row0 = tc.row_begin + kRowsPerConsumer * wg;
    CUTE_UNROLL
    for (int pass = 0; pass < kOutCols / kEpiCols; ++pass) {
      CUTE_UNROLL
      for (int j = 0; j < 32; j += 2) {
        const int i = 32 * pass + j;
        const int r = r_base + 8 * ((i >> 1) & 1);
        const int c = 8 * ((i >> 2) - 8 * pass) + c_base;
        float v0, v1;
        if constexpr (kSwiGLU) {
          v0 = silu(acc(i)) * acc(i + 64);
          v1 = silu(acc(i + 1)) * acc(i + 65);
        } else {
          v0 = acc(i);
          v1 = acc(i + 1);
        }
        buf[r * kPitchWords + c / 2] = pack_bf16x2(v0, v1);
      }
      named_barrier_sync(1 + wg, 128);
      CUTE_UNROLL
      for (int j = 0; j < kRowsPerConsumer * kEpiCols / 8 / 128; ++j) {
        const int idx = t + 128 * j;
        const int r = idx / (kEpiCols / 8), chunk = idx % (kEpiCols / 8);
        const int row = row0 + r;
        const int col = tc.n_block * kOutCols + pass * kEpiCols + chunk * 8;
        if (row < tc.row_end && col < p.n_out) {
          const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kPitchWords + chunk * 4);
          *reinterpret_cast<uint4*>(p.out + int64_t(row) * p.out_ld + col) = v;
        }
      }
      named_barrier_sync(1 + wg, 128);
    }
  }

  // ---- consumers: two warpgroups, 64 rows each --------------------------------------------------------
  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int n_blocks) {
    using namespace cute;
    TiledMma mma;
    auto thr = mma.get_thread_slice(ct);
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stages) descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, stages) descriptors
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    static_assert(decltype(size(acc))::value == kRowsPerConsumer * kBlockN / 128, "64x256 per warpgroup");
    const int k_tiles = (p.k + kBlockK - 1) / kBlockK;
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int wg = ct / 128, t = ct % 128, lane = t % 32;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      int prev_stage = -1;
      for (int k = 0; k < k_tiles; ++k) {
        mbarrier_wait(&s.full[stage], phase, p.status);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          cute::gemm(mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the previous k-tile's wgmmas are done: free its stage
        warpgroup_fence_operand(acc);
        if (prev_stage >= 0) release_stage(s, prev_stage, lane);
        prev_stage = stage;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0) release_stage(s, prev_stage, lane);
      epilogue(p, s, acc, tc, wg, t);
    }
  }

  __device__ static void release_stage(SharedStorage& s, int stage, int lane) {
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[stage]);
  }

  // ---- the kernel body: set up, then route by role ---------------------------------------------------
  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    // Align to 1024 B (128B-swizzle atoms) by offsetting from the __shared__ array itself, so the
    // compiler keeps seeing shared-memory addresses (STS/LDS rather than generic ST/LD).
    const uint32_t misalign = uint32_t(__cvta_generic_to_shared(smem_raw)) & 1023u;
    SharedStorage& s = *reinterpret_cast<SharedStorage*>(smem_raw + ((1024u - misalign) & 1023u));
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    const int n_blocks = (p.n_out + kOutCols - 1) / kOutCols;
    if (warp == 0 && lane == 0) {
      for (int i = 0; i < kStages; ++i) {
        cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], 1);
        cutlass::arch::ClusterBarrier::init(&s.empty[i], kConsumerWarpgroups * 4);
      }
      cutlass::arch::fence_barrier_init();
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
      } else {
        zero_padding_rows(p, s, threadIdx.x - 32, 96);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      consumer(p, s, threadIdx.x - 128, n_blocks);
    }
  }
};

template <class Gemm>
__global__ void __launch_bounds__(Gemm::kThreads, 1) sm90_grouped_gemm_kernel(const __grid_constant__ typename Gemm::Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  Gemm::run(params);
#elif defined(__CUDA_ARCH__)
  // Built without the sm_90a target (wgmma, setmaxnreg): refuse loudly rather than write nothing.
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("mok grouped gemm: this build lacks sm_90a code\n");
  __trap();
#endif
}

}  // namespace mok::gemm
