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
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory_sm80.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/float8.h>

#include "mok/common.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok::gemm {

enum class Fp8Epilogue { kSwiGLUQuant, kBf16 };

namespace detail {
// A K-major shared-memory tile of 8-bit values (rows x 128 k, 128B swizzle): a column of 8-row x 128-byte
// atoms. (sm90_tile.cuh's StageTile instantiates its MN-major branch too, which has no 64-row form for
// 8-bit values.)
template <int kRows, int kCols>
using Fp8KTile = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<cutlass::float_e4m3_t>{},
                                              cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{}));
}  // namespace detail

constexpr int kFp8ScaleBlock = 128;   // 1 x 128 activation tiles, 128 x 128 weight blocks
constexpr float kE4M3Max = 448.0f;    // largest finite E4M3 value
// A scale is amax * (1/448), the reciprocal rounded to f32 once, and a value is quantised as v * (1 / scale)
// (one IEEE division per scale), as mok_jax.fp8 computes them, bit for bit: XLA rewrites a division by a
// constant into such a product, so the reference cannot keep amax / 448.
constexpr float kInvE4M3Max = 1.0f / 448.0f;

template <Fp8Epilogue kEpi>
struct Sm90Fp8GroupedGemm {
  using Element = cutlass::float_e4m3_t;
  static constexpr bool kSwiGLU = kEpi == Fp8Epilogue::kSwiGLUQuant;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;              // MMA columns of a CTA tile: two halves of 128
  static constexpr int kBlockK = kFp8ScaleBlock;   // one stage = one scale block
  static constexpr int kHalfN = 128;               // one wgmma chain (m64n128k32) covers a half
  static constexpr int kBox = 64;                  // B rows (columns of the product) per TMA box
  static constexpr int kBoxes = kBlockN / kBox;    // 4: boxes 2 hf, 2 hf + 1 make half hf
  static constexpr int kStages = 4;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kOutCols = kSwiGLU ? kHalfN : kBlockN;  // output columns per tile
  static_assert(kBlockM == 4 * 32, "each producer lane copies 4 row scales");
  static constexpr int kGroupM = 16;   // raster band (m-blocks), as the bf16 grouped GEMM
  static constexpr int kMaxGroups = 1024;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg budget of the CTA");

  using SmemLayoutAStage = detail::Fp8KTile<kBlockM, kBlockK>;
  using SmemLayoutAWg = detail::Fp8KTile<kRowsPerConsumer, kBlockK>;
  using SmemLayoutBox = detail::Fp8KTile<kBox, kBlockK>;
  using SmemLayoutBHalf = detail::Fp8KTile<kHalfN, kBlockK>;
  static constexpr int kStageElemsA = kBlockM * kBlockK;
  static constexpr int kBoxElems = kBox * kBlockK;
  static constexpr int kStageElemsB = kBlockN * kBlockK;
  // A K-major SW128 tile of 8-bit values is a column of 8-row x 128-byte atoms, so any 8k-row slice of it is
  // the same layout at an offset: warpgroup w's A rows are the 8 KB at w * 8 KB of the A stage, box j of B the
  // 8 KB at j * 8 KB of the B stage, and half hf of B the 16 KB at hf * 16 KB.
  static_assert(cute::cosize_v<SmemLayoutAWg> == kRowsPerConsumer * kBlockK &&
                    cute::cosize_v<SmemLayoutBox> == kBoxElems && cute::cosize_v<SmemLayoutBHalf> == 2 * kBoxElems,
                "stage slices tile contiguously");

  using TiledMma = decltype(cute::make_tiled_mma(cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>{}));
  using Accumulator = decltype(cute::partition_fragment_C(
      std::declval<TiledMma>(), cute::Shape<cute::Int<kRowsPerConsumer>, cute::Int<kHalfN>>{}));
  static_assert(decltype(cute::size(std::declval<Accumulator&>()))::value == 64, "64 values per thread");

  // A: rows x k, k contiguous. B: (n_b, k, groups), k contiguous (each weight matrix transposed).
  static auto make_tma_a(const Element* ptr, int rows, int k) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(rows, k), make_stride(int64_t(k), Int<1>{}));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutAStage{}, Shape<Int<kBlockM>, Int<kBlockK>>{}, Int<1>{});
  }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_b, k, groups),
                           make_stride(int64_t(k), Int<1>{}, int64_t(n_b) * k));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutBox{}, Shape<Int<kBox>, Int<kBlockK>>{}, Int<1>{});
  }
  using TmaA = decltype(make_tma_a(nullptr, 0, 0));
  using TmaB = decltype(make_tma_b(nullptr, 0, 0, 0));

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
    alignas(1024) Element a[kStages * kStageElemsA];
    alignas(1024) Element b[kStages * kStageElemsB];
    alignas(16) float a_scale[kStages][kBlockM];  // the stage's k block: the scales of the tile's rows
    alignas(16) float b_scale[kStages][4];        // and of its two column halves ([2], [3] unused)
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
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
  // memory after the stage's wait, so no global load sits in their loop.
  __device__ static void producer(const Params& p, SharedStorage& s, int n_blocks, int lane) {
    using namespace cute;
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int n_k = p.k / kBlockK;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.num_rows, p.k));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_b, p.k, p.num_groups));
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      Tensor gA = local_tile(domain_offset(make_coord(tc.row_begin, 0), mA), Shape<Int<kBlockM>, Int<kBlockK>>{},
                             make_coord(0, _));  // (BM, BK, k)
      Tensor mBg = mB(_, _, tc.group);
      const int b_col = half_col(p, tc.n_block, lane % 2);
      const bool b_valid = lane < 2 && b_col < p.n_b;
      const float* b_src =
          p.b_scale + (int64_t(tc.group) * (p.n_b / kFp8ScaleBlock) + (b_valid ? b_col : 0) / kFp8ScaleBlock) * n_k;
      uint32_t bytes = kStageElemsA * sizeof(Element);
      CUTE_UNROLL
      for (int j = 0; j < kBoxes; ++j)
        if (box_col(p, tc.n_block, j) < p.n_b) bytes += kBoxElems * sizeof(Element);
      for (int kb = 0; kb < n_k; ++kb) {
        if (!mbarrier_wait(&s.empty[stage], phase ^ 1, p.status)) return;
        if (lane == 0) {
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[stage], bytes);
          Tensor sA = make_tensor(make_smem_ptr(s.a + stage * kStageElemsA), SmemLayoutAStage{});
          auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                          group_modes<0, 2>(gA(_, _, kb)));
          copy(p.tma_a.with(s.full[stage]), tAg, tAs);
          CUTE_UNROLL
          for (int j = 0; j < kBoxes; ++j) {
            const int col = box_col(p, tc.n_block, j);
            if (col >= p.n_b) continue;  // the N tail of the down GEMM: never stored
            Tensor gB = local_tile(domain_offset(make_coord(col, 0), mBg), Shape<Int<kBox>, Int<kBlockK>>{},
                                   make_coord(0, _));  // (box, BK, k)
            Tensor sB = make_tensor(make_smem_ptr(s.b + stage * kStageElemsB + j * kBoxElems), SmemLayoutBox{});
            auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                            group_modes<0, 2>(gB(_, _, kb)));
            copy(p.tma_b.with(s.full[stage]), tBg, tBs);
          }
        }
        const float* a_src = p.a_scale + int64_t(kb) * p.num_rows;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const int r = 4 * lane + i, row = tc.row_begin + r;
          cutlass::arch::cp_async_zfill<4>(&s.a_scale[stage][r], row < p.num_rows ? a_src + row : p.a_scale,
                                           row < p.num_rows);
        }
        if (lane < 2) cutlass::arch::cp_async_zfill<4>(&s.b_scale[stage][lane], b_src + kb, b_valid);
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
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
  // One wgmma chain (4 x m64n128k32 over the 128-long k block) into `partial` per half, then wait and promote
  // it into that half's total: 64 + 2 x 64 fp32 registers per thread. The tensor core idles while a
  // warpgroup promotes; the other warpgroup's chain fills it.
  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int n_blocks) {
    using namespace cute;
    const int num_tiles = s.table.tile_start[p.num_groups];
    const int wg = ct / 128, t = ct % 128, lane = t % 32, warp = t / 32;
    const int n_k = p.k / kBlockK;
    // wgmma accumulator fragment (PTX ISA, m64nNk16/k32 f32 D): value i of thread (warp, lane) of the
    // warpgroup sits at row 16 warp + lane/4 + 8 ((i/2) % 2), column 8 (i/4) + 2 (lane % 4) + i % 2.
    const int r_local = kRowsPerConsumer * wg + 16 * warp + lane / 4;  // and r_local + 8
    TiledMma mma;
    auto thr = mma.get_thread_slice(t);
    Accumulator partial, total0, total1;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord tc = decode_tile<kMaxGroups, kBlockM, kGroupM>(s.table, p.num_groups, tile, n_blocks);
      CUTE_UNROLL
      for (int i = 0; i < size(total0); ++i) total0(i) = 0.0f, total1(i) = 0.0f;
      // The k block's scales come with its stage, in shared memory (the producer's cp.async). Loaded by the
      // consumers from global memory, their latency stalled the chains: ncu on kimi-k2 had long-scoreboard stalls
      // at a third of the warps' stall cycles with the tensor pipe 53% busy; loaded one block ahead into registers,
      // the stall stayed at the compiler's copy of them before the block's first wgmma (970 and 526 us for the two
      // GEMMs); copied by the consumers' own cp.async, 1010 and 595 us. Brought by the producer: 849 and 512 us at a
      // lower clock (-19% and -4% in cycles), the tensor pipe 66% and 52% busy.
      for (int kb = 0; kb < n_k; ++kb) {
        if (!mbarrier_wait(&s.full[stage], phase, p.status)) return;
        const float a0 = s.a_scale[stage][r_local], a1 = s.a_scale[stage][r_local + 8];
        const float b0 = s.b_scale[stage][0], b1 = s.b_scale[stage][1];
        Tensor sA = make_tensor(make_smem_ptr(s.a + stage * kStageElemsA + wg * kRowsPerConsumer * kBlockK),
                                SmemLayoutAWg{});
        Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, 1, 4) descriptors
        mma_half(mma, thr, tCrA, s.b + stage * kStageElemsB, partial);
        promote(partial, total0, a0 * b0, a1 * b0);
        mma_half(mma, thr, tCrA, s.b + stage * kStageElemsB + 2 * kBoxElems, partial);
        __syncwarp();
        if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[stage]);  // both chains are done
        promote(partial, total1, a0 * b1, a1 * b1);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      if constexpr (kSwiGLU) {
        store_swiglu_quant(total0, total1, p, tc, wg, t);
      } else {
        store_bf16(total0, p, tc, 0, wg, t);
        store_bf16(total1, p, tc, 1, wg, t);
      }
    }
  }

  // One half's chain: partial = A_wg (64 x 128) @ B_half (128 x 128)^T, waited for. (Issuing the two warpgroups'
  // chains in turn, 0, 1, 0, 1, ..., ordered by a pair of mbarriers so that the tensor core runs one warpgroup's
  // chain while the other promotes, made both GEMMs slower: kimi-k2's pair 1.80 against 1.72 ms.)
  template <class Thr, class FragA>
  __device__ static void mma_half(TiledMma& mma, Thr& thr, FragA& tCrA, Element* b_half, Accumulator& partial) {
    using namespace cute;
    Tensor sB = make_tensor(make_smem_ptr(b_half), SmemLayoutBHalf{});
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, 1, 4) descriptors
    warpgroup_fence_operand(partial);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tCrA); ++kk) {
      cute::gemm(mma, tCrA(_, _, kk), tCrB(_, _, kk), partial);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(partial);
  }

  // total += partial * scale of its row (s0: rows r, s1: rows r + 8), one fma per value.
  __device__ static void promote(const Accumulator& partial, Accumulator& total, float s0, float s1) {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(total); ++i) total(i) = fmaf(partial(i), ((i >> 1) & 1) ? s1 : s0, total(i));
  }

  // ---- epilogues --------------------------------------------------------------------------------------
  __device__ static float silu(float g) { return g / (1.0f + expf(-g)); }

  // h = silu(gate) * up for the tile's 128 h columns (gate value i of total0 pairs with up value i of total1),
  // quantised with each row's amax over those 128 columns: the thread's own 32 values of the row, then the
  // 4 lanes that share the row. q = e4m3_rn_satfinite(h / scale), scale = amax * (1/448) (1 when amax is 0): the
  // same f32 operations as mok_jax.fp8.quantize_rows.
  __device__ static void store_swiglu_quant(const Accumulator& gate, const Accumulator& up, const Params& p,
                                            const TileCoord& tc, int wg, int t) {
    const int lane = t % 32, warp = t / 32;
    float h[64];
    float amax0 = 0.0f, amax1 = 0.0f;
    CUTE_UNROLL
    for (int i = 0; i < 64; ++i) {
      h[i] = silu(gate(i)) * up(i);
      if ((i >> 1) & 1) amax1 = fmaxf(amax1, fabsf(h[i]));
      else amax0 = fmaxf(amax0, fabsf(h[i]));
    }
    CUTE_UNROLL
    for (int d = 1; d < 4; d *= 2) {
      amax0 = fmaxf(amax0, __shfl_xor_sync(0xffffffffu, amax0, d));
      amax1 = fmaxf(amax1, __shfl_xor_sync(0xffffffffu, amax1, d));
    }
    const float sc0 = amax0 > 0.0f ? amax0 * kInvE4M3Max : 1.0f;
    const float sc1 = amax1 > 0.0f ? amax1 * kInvE4M3Max : 1.0f;
    const float inv0 = 1.0f / sc0, inv1 = 1.0f / sc1;  // q = h * (1 / scale), as mok_jax.fp8 (kInvE4M3Max)
    const int row0 = tc.row_begin + kRowsPerConsumer * wg + 16 * warp + lane / 4, row1 = row0 + 8;
    auto* out = static_cast<uint8_t*>(p.out);
    const int col_base = tc.n_block * kOutCols + 2 * (lane % 4);
    CUTE_UNROLL
    for (int i = 0; i < 64; i += 2) {
      const bool second_row = (i >> 1) & 1;
      const float inv = second_row ? inv1 : inv0;
      const int row = second_row ? row1 : row0;
      const int col = col_base + 8 * (i >> 2);
      const __nv_fp8x2_storage_t q =
          __nv_cvt_float2_to_fp8x2(make_float2(h[i] * inv, h[i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
      if (row < tc.row_end) *reinterpret_cast<__nv_fp8x2_storage_t*>(out + int64_t(row) * p.out_ld + col) = q;
    }
    if (lane % 4 == 0) {
      float* scale = p.out_scale + int64_t(tc.n_block) * p.num_rows;
      if (row0 < tc.row_end) scale[row0] = sc0;
      if (row1 < tc.row_end) scale[row1] = sc1;
    }
  }

  // bf16 out of half hf straight from registers (two columns per store).
  __device__ static void store_bf16(const Accumulator& acc, const Params& p, const TileCoord& tc, int hf, int wg,
                                    int t) {
    const int lane = t % 32, warp = t / 32;
    const int row0 = tc.row_begin + kRowsPerConsumer * wg + 16 * warp + lane / 4;
    const int col_base = half_col(p, tc.n_block, hf) + 2 * (lane % 4);
    auto* out = static_cast<__nv_bfloat16*>(p.out);
    CUTE_UNROLL
    for (int i = 0; i < 64; i += 2) {
      const int row = row0 + 8 * ((i >> 1) & 1);
      const int col = col_base + 8 * (i >> 2);
      if (row < tc.row_end && col < p.n_out)
        *reinterpret_cast<__nv_bfloat162*>(out + int64_t(row) * p.out_ld + col) =
            __floats2bfloat162_rn(acc(i), acc(i + 1));
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
        cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], 1 + 32);  // TMA bytes + the warp's scale copies
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

// One 1 x 128 tile of a bf16 row -> e4m3 with its scale, by one warp (4 values per lane): amax * (1/448) (1 for
// an all-zero tile), q = e4m3_rn_satfinite(x / scale): mok_jax.fp8.quantize_rows, bit for bit (max is exact,
// the division IEEE). Returns the scale (every lane).
__device__ __forceinline__ float fp8_quantize_tile_warp(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q,
                                                        int lane) {
  const uint2 raw = *reinterpret_cast<const uint2*>(x + 4 * lane);
  const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  float amax = fmaxf(fmaxf(fabsf(v01.x), fabsf(v01.y)), fmaxf(fabsf(v23.x), fabsf(v23.y)));
  for (int d = 16; d >= 1; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  const float sc = amax > 0.0f ? amax * kInvE4M3Max : 1.0f;
  const float inv = 1.0f / sc;  // q = x * (1 / scale), as mok_jax.fp8 (kInvE4M3Max)
  const __nv_fp8x2_storage_t q01 =
      __nv_cvt_float2_to_fp8x2(make_float2(v01.x * inv, v01.y * inv), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t q23 =
      __nv_cvt_float2_to_fp8x2(make_float2(v23.x * inv, v23.y * inv), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint32_t*>(q + 4 * lane) = uint32_t(q01) | (uint32_t(q23) << 16);
  return sc;
}

}  // namespace mok::gemm
