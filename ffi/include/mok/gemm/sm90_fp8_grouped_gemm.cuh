// mok gemm: persistent grouped FP8 (E4M3) GEMM for Hopper (sm_90a) with DeepSeek-V3 block scaling.
//
//   out[r, n] = epilogue( sum_{kb} partial_kb[r, n] * a_scale[kb, r] * b_scale[g][n / 128, kb] )
//   partial_kb[r, n] = sum_{k in block kb (128 long)} A[r, k] * B[g][n, k]        E4M3 x E4M3 -> fp32 (tensor core)
//
// Hopper has no hardware block scaling, so each 128-long K block is one wgmma chain of 4 x k32 into a
// `partial` accumulator (started from zero), and the CUDA cores promote it into an fp32 `total` with the
// two block scales (DeepSeek-V3 §3.3: the tensor core keeps only ~14 bits while it accumulates, so its
// chains stay 128 long). Epilogues:
//   kSwiGLUQuant  the CTA's 256 MMA columns are h columns [c, c+128) of gate and of up (gate_up[g] rows
//                 c.. and c+I..); h = silu(gate) * up in fp32, then quantised to E4M3 with one fp32 scale
//                 per row and 128 h columns (amax * (1/448)): out = h_q [M, I] e4m3, out_scale [I/128, M] f32
//   kBf16         the 256 MMA columns are [n0, n0 + 256) of B[g]; out = bf16(total)  (y = h @ down)
//
// Operands (FP8 wgmma reads both from shared memory K-major only):
//   A [num_rows, k] e4m3, k contiguous (x_q or h_q), a_scale [k/128, num_rows] f32 (k-block major, so the
//     rows of one tile read consecutive floats)
//   B [groups, n_b, k] e4m3, k contiguous (the weight transposed), b_scale [groups, n_b/128, k/128] f32
//
// CTA tile: 128 rows x 256 MMA columns x 128 k per stage (one scale block), the bf16 GEMM's tile. The
// 256 columns are two halves of 128 (each two 64-row TMA boxes of B); consumer warpgroup w owns rows
// [64 w, 64 w + 64) and both halves. Per k block and half, one wgmma chain (4 x m64n128k32) into `partial`,
// wait, promote into that half's `total`: 64 + 2 x 64 fp32 registers per thread (ptxas needs 200..216 of
// the 232 setmaxnreg gives; 160 spills). Keeping both halves' partials in flight would need 256 accumulator
// registers; the tensor core instead idles while one warpgroup promotes and runs the other's chain.
//   kSwiGLUQuant: half 0 = gate columns [c, c + 128), half 1 = up columns [c + I, c + I + 128), so gate value
//     i of total0 pairs with up value i of total1 in the same thread, and a row's 128 h columns (one scale
//     block) lie in the 4 lanes of one warpgroup that share the row: its amax is a max over the thread's 32
//     values and a 2-step shuffle, no shared memory.
//   kBf16: the halves are columns [n0, n0 + 128) and [n0 + 128, n0 + 256).
//
// Roles (384 threads, one CTA per SM, persistent over the static tile list of group_scheduler.cuh):
//   warpgroup 0, warp 0            : producer: per k block, lane 0 loads one A box (128 x 128) + up to four B
//                                   boxes (64 x 128) by TMA into the stage (full[s] counts the bytes), and the
//                                   32 lanes copy the block's 128 row scales and 2 column scales by cp.async
//   warpgroup 0, warps 1..3       : padding rows [sum(group sizes), M) of out (zeros; out_scale 1)
//   warpgroups 1, 2 (consumers)   : per k block two wgmma chains, each waited for and promoted; after the
//                                   second chain the stage is freed; then the epilogue
// The stage ring, the chains, the promotions and both epilogues are sm90_fp8_tile.cuh's (shared with the MoE
// megakernel's routed tiles, so both give the same bits per row); the producer warp is this kernel's own.
//
// Shared memory: kStages (4) x (16 KB A + 32 KB B + 528 B scales) = 194 KB, 8 KB group table: < 227 KB.
// Stage ring: full[s] 1 + 32 producer arrives (lane 0's with the TMA bytes, then each lane's when its scale
// copies land); empty[s] one arrive per consumer warp (8).
//
// Invariants: every output element is written by one CTA with a fixed k order and fixed per-thread
// arithmetic, so the result is bitwise reproducible and independent of the CTA count. Rows of a tile past
// its group (the next group's rows, or TMA zero fill past M) are computed but never stored; a B box past
// n_b (the last 128 columns of an H that is an odd multiple of 128) is not loaded and its columns never
// stored (its chain runs on stale shared memory, with scale 0). k and the column counts must be multiples of
// 128 (the host checks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory_sm80.h>
#include <cutlass/arch/reg_reconfig.h>

#include "mok/common.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok::gemm {

enum class Fp8Epilogue { kSwiGLUQuant, kBf16 };

template <Fp8Epilogue kEpi>
struct Sm90Fp8GroupedGemm {
  using Tile = Sm90Fp8Tile;
  using Element = Tile::Element;
  static constexpr bool kSwiGLU = kEpi == Fp8Epilogue::kSwiGLUQuant;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockK = Tile::kBlockK;
  static constexpr int kHalfN = Tile::kHalfN;
  static constexpr int kBox = Tile::kBox;
  static constexpr int kBoxes = Tile::kBoxes;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kConsumerWarpgroups = Tile::kConsumerWarpgroups;
  static constexpr int kConsumerThreads = Tile::kConsumerThreads;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kOutCols = kSwiGLU ? kHalfN : Tile::kBlockN;  // output columns per tile
  static_assert(kBlockM == 4 * 32, "each producer lane copies 4 row scales");
  static constexpr int kGroupM = 16;   // raster band (m-blocks), as the bf16 grouped GEMM
  static constexpr int kMaxGroups = 1024;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg budget of the CTA");

  // A: rows x k, k contiguous. B: (n_b, k, groups), k contiguous (each weight matrix transposed).
  static auto make_tma_a(const Element* ptr, int rows, int k) { return Tile::make_tma_a(ptr, rows, k, k); }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    return Tile::make_tma_b(ptr, n_b, k, groups);
  }
  using TmaA = Tile::TmaA;
  using TmaB = Tile::TmaB;

  struct Params {
    TmaA tma_a;
    TmaB tma_b;
    const float* a_scale;        // [k / 128, num_rows]
    const float* b_scale;        // [num_groups, n_b / 128, k / 128]
    const int32_t* group_sizes;  // [num_groups], device
    int32_t num_groups;
    int32_t num_rows;            // M: rows of A and of out
    int32_t k;                   // reduction length, a multiple of 128
    int32_t n_out;               // columns of out (I for gate/up, H for down), a multiple of 128
    int32_t n_b;                 // rows of one B matrix (2I, or H)
    int32_t second_half;         // column of the tile's second half relative to its first (I, or 128)
    void* out;                   // kSwiGLU: e4m3 [num_rows, out_ld]; else bf16 [num_rows, out_ld]
    int64_t out_ld;
    float* out_scale;            // kSwiGLU: [n_out / 128, num_rows], the scales of out
    int32_t* status;             // status word (bounded-wait failures are or-ed in)
    int32_t write_status;        // CTA 0 stores the group-size status (the first GEMM of the pair)
  };

  struct SharedStorage {
    StageRing stages;
    Fp8StageScales scales;
    GroupTable<kMaxGroups> table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  // First column (row of B) of half hf of tile column block n_block, and of box j (half j / 2).
  __device__ static int half_col(const Params& p, int n_block, int hf) {
    return n_block * kOutCols + hf * p.second_half;
  }
  __device__ static int box_col(const Params& p, int n_block, int j) {
    return half_col(p, n_block, j / 2) + (j % 2) * kBox;
  }

  // ---- producer: one warp -------------------------------------------------------------------------
  // Lane 0 issues the stage's TMA loads (full[s] counts their bytes); every lane copies 4 of the tile's 128 row
  // scales of the k block by cp.async (lanes 0, 1 also a half's column scale; rows past M and a half past n_b
  // read as 0) and arrives on full[s] when its copies land. The consumers then read the scales from shared
  // memory after the stage's wait, so no global load sits in their loop. (The megakernel's one-thread producer,
  // Sm90Fp8Tile::load_tile, brings the row scales by TMA instead.)
  __device__ static void producer(const Params& p, SharedStorage& s, int n_blocks, int lane) {
    using namespace cute;
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int n_k = p.k / kBlockK;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.num_rows, p.k));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_b, p.k, p.num_groups));
    RingPos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      Tensor gA = local_tile(domain_offset(make_coord(tc.row_begin, 0), mA), Shape<Int<kBlockM>, Int<kBlockK>>{},
                             make_coord(0, _));  // (BM, BK, k)
      Tensor mBg = mB(_, _, tc.group);
      const int b_col = half_col(p, tc.n_block, lane % 2);
      const bool b_valid = lane < 2 && b_col < p.n_b;
      const float* b_src =
          p.b_scale + (int64_t(tc.group) * (p.n_b / kFp8ScaleBlock) + (b_valid ? b_col : 0) / kFp8ScaleBlock) * n_k;
      uint32_t bytes = Tile::kStageElemsA * sizeof(Element);
      CUTE_UNROLL
      for (int j = 0; j < kBoxes; ++j)
        if (box_col(p, tc.n_block, j) < p.n_b) bytes += Tile::kBoxElems * sizeof(Element);
      for (int kb = 0; kb < n_k; ++kb) {
        if (!mbarrier_wait(&s.stages.empty[pos.stage], pos.phase ^ 1, p.status)) return;
        if (lane == 0) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.stages.full[pos.stage], bytes);
          Tensor sA = make_tensor(make_smem_ptr(Tile::stage_a(s.stages, pos.stage)), Tile::SmemLayoutAStage{});
          auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                          group_modes<0, 2>(gA(_, _, kb)));
          copy(p.tma_a.with(s.stages.full[pos.stage]), tAg, tAs);
          CUTE_UNROLL
          for (int j = 0; j < kBoxes; ++j) {
            const int col = box_col(p, tc.n_block, j);
            if (col >= p.n_b) continue;  // the N tail of the down GEMM: never stored
            Tensor gB = local_tile(domain_offset(make_coord(col, 0), mBg), Shape<Int<kBox>, Int<kBlockK>>{},
                                   make_coord(0, _));  // (box, BK, k)
            Tensor sB = make_tensor(make_smem_ptr(Tile::stage_b(s.stages, pos.stage) + j * Tile::kBoxElems),
                                    Tile::SmemLayoutBox{});
            auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                            group_modes<0, 2>(gB(_, _, kb)));
            copy(p.tma_b.with(s.stages.full[pos.stage]), tBg, tBs);
          }
        }
        const float* a_src = p.a_scale + int64_t(kb) * p.num_rows;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int r = 4 * lane + i, row = tc.row_begin + r;
          cutlass::arch::cp_async_zfill<4>(&s.scales.a[pos.stage][r], row < p.num_rows ? a_src + row : p.a_scale,
                                           row < p.num_rows);
        }
        if (lane < 2) cutlass::arch::cp_async_zfill<4>(&s.scales.b[pos.stage][lane], b_src + kb, b_valid);
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.stages.full[pos.stage]);
        pos.advance();
      }
    }
  }

  // ---- padding rows: warps 1..3 of the producer warpgroup -------------------------------------------
  __device__ static void pad_rows(const Params& p, const SharedStorage& s, int t, int num_threads) {
    const int64_t first = s.table.row_start[p.num_groups];
    const int64_t rows = int64_t(p.num_rows) - first;
    const int64_t row_bytes = int64_t(p.n_out) * (kSwiGLU ? 1 : 2);
    const int64_t chunks_per_row = row_bytes / 16;
    auto* out = static_cast<uint8_t*>(p.out);
    const int64_t ld_bytes = p.out_ld * (kSwiGLU ? 1 : 2);
    const int64_t stride = int64_t(gridDim.x) * num_threads;
    for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < rows * chunks_per_row; idx += stride) {
      const int64_t row = first + idx / chunks_per_row, chunk = idx % chunks_per_row;
      *reinterpret_cast<uint4*>(out + row * ld_bytes + chunk * 16) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kSwiGLU) {  // an all-zero tile has scale 1 (mok_jax.fp8)
      const int64_t blocks = p.n_out / kFp8ScaleBlock;
      for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < rows * blocks; idx += stride)
        p.out_scale[(idx / rows) * p.num_rows + first + idx % rows] = 1.0f;
    }
  }

  // ---- consumers: two warpgroups, 64 rows each, both halves of the tile's columns ---------------------
  // The scales come with the stage, in shared memory (the producer's cp.async). Loaded by the consumers from
  // global memory, their latency stalled the chains: ncu on kimi-k2 had long-scoreboard stalls at a third of the
  // warps' stall cycles with the tensor pipe 53% busy; loaded one block ahead into registers, the stall stayed at
  // the compiler's copy of them before the block's first wgmma (970 and 526 us for the two GEMMs); copied by the
  // consumers' own cp.async, 1010 and 595 us. Brought by the producer: 849 and 512 us at a lower clock (-19% and
  // -4% in cycles), the tensor pipe 66% and 52% busy.
  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int n_blocks) {
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int wg = ct / 128, t = ct % 128;
    const int n_k = p.k / kBlockK;
    Tile::Accumulator total0, total1;
    RingPos pos;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      if (!Tile::mma_tile(s.stages, s.scales, pos, total0, total1, n_k, 0, ct, p.status)) return;
      const Tile::TileStore st{p.out, p.out_ld, p.out_scale, p.num_rows, tc.row_begin, tc.row_end,
                               tc.n_block * kOutCols, p.n_out};
      if constexpr (kSwiGLU) {
        Tile::store_swiglu_quant(total0, total1, st, wg, t);
      } else {
        Tile::store_bf16(total0, st, 0, wg, t);
        Tile::store_bf16(total1, st, 1, wg, t);
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
      for (int i = 0; i < kStages; ++i) {
        cutlass::arch::ClusterTransactionBarrier::init(&s.stages.full[i], 1 + 32);  // TMA bytes + the scale copies
        cutlass::arch::ClusterBarrier::init(&s.stages.empty[i], kConsumerWarpgroups * 4);
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
        producer(p, s, n_blocks, lane);
      } else {
        pad_rows(p, s, threadIdx.x - 32, 96);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      consumer(p, s, threadIdx.x - 128, n_blocks);
    }
  }
};

}  // namespace mok::gemm
