// mok gemm: one 128 x 256 tile of a block-scaled FP8 (E4M3) GEMM on Hopper (sm_90a), DeepSeek-V3's recipe.
//
//   total[r, n] = sum_{kb} partial_kb[r, n] * a_scale[kb, r] * b_scale[group][n / 128, kb]
//   partial_kb[r, n] = sum_{k in block kb (128 long)} A[r, k] * B[group][n, k]        E4M3 x E4M3 -> fp32
//
// The pieces every FP8 GEMM of the library is built from: the grouped GEMM's block-scaled mainloop
// (sm90_mainloop.cuh's Fp8BlockScaledMainloop) and the MoE megakernel's routed tiles (mok/moe/forward_tiles.cuh). Hopper has
// no hardware block scaling, so each 128-long K block is one wgmma chain of 4 x k32 into a `partial`
// accumulator started from zero, and the CUDA cores promote it into an fp32 `total` with the two block scales
// (the tensor core keeps only ~14 bits while it accumulates, so its chains stay 128 long).
//
// Tile: 128 rows x 256 MMA columns, one 128-long K block per stage. The 256 columns are two halves of 128
// (each two 64-row TMA boxes of B) starting at B rows col0 and col1: a SwiGLU tile pairs gate columns
// [c, c + 128) with up columns [c + I, c + I + 128); a plain tile takes [n0, n0 + 128) and [n0 + 128, n0 + 256).
// Consumer warpgroup w owns rows [64 w, 64 w + 64) and both halves: per K block and half one chain, waited
// for, then promoted into that half's total (64 + 2 x 64 fp32 registers per thread).
//
// Operands (FP8 wgmma reads both K-major only):
//   A [rows, k] e4m3, k contiguous, row stride ld (x_q, dispatched rows, h_q);
//   a_scale f32 [k / 128][scale_ld], k-block major, so a tile's 128 row scales of one K block are contiguous;
//   B [groups, n_b, k] e4m3 (each weight matrix transposed), b_scale f32 [groups, n_b / 128, k / 128].
//
// Stages: the bf16 tiles' StageRing (sm90_tile.cuh) holds one FP8 stage in the same bytes (16 KB of A as
// 128 x 128 e4m3, 32 KB of B as 256 x 128), so a kernel that runs both kinds walks one ring with one RingPos;
// the scales of a stage's K block sit beside it in Fp8StageScales. Two producers fill them:
//   load_tile (one thread, the megakernel's): the row scales come by one 1-D bulk copy (cp.async.bulk, counted
//     in full[s]'s bytes) of the 132 floats from the tile's first row rounded down to a multiple of 4 (a bulk
//     copy's source must be 16-byte aligned), so the consumers read them kScaleShift = row0 % 4 further on; the
//     thread loads the two weight scales itself before it waits for the stage and stores them to shared memory
//     before its arrive (whose release the consumers' wait acquires), so full[s] takes one arrival;
//   the grouped GEMM's producer warp (Fp8BlockScaledMainloop::load_tile), which copies the scales by cp.async (its
//     own arrival count).
// The consumers (mma_tile) do not depend on which producer ran.
//
// Invariants: every output element comes from one tile with a fixed K order and fixed per-thread arithmetic,
// so it is bitwise reproducible and the same in every kernel built from these pieces. Rows of a tile past
// its group (the next group's rows, or TMA zero fill) are computed but never stored; a half past n_b is not
// loaded and never stored (its chain runs on stale shared memory with scale 0). k is a multiple of 128.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/float8.h>

#include "mok/gemm/fp8_quant.cuh"
#include "mok/gemm/silu_math.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok::gemm {

// The scales of each stage's K block: the tile's 128 row scales (from index a_shift on: the one-thread producer's
// bulk copy starts at a 16-byte boundary of global memory, up to 3 rows early) and its two halves' weight scales
// ([2], [3] unused).
constexpr int kFp8RowScaleSlack = 4;
struct Fp8StageScales {
  alignas(128) float a[StageRing::kStages][128 + kFp8RowScaleSlack];
  alignas(16) float b[StageRing::kStages][4];
};

// A class template only so that the TMA types below can be deduced from the member functions' bodies inside
// the class (as sm90_tile.cuh's Sm90TileT); Sm90Fp8Tile is its one form.
template <int kForm = 0>
struct Sm90Fp8TileT : Sm90TileBase {
  using Element = cutlass::float_e4m3_t;
  static constexpr int kBlockK = kFp8ScaleBlock;   // one stage = one scale block
  static constexpr int kBoxes = kBlockN / kBox;    // 4 boxes of 64 B rows: boxes 2 hf, 2 hf + 1 make half hf
  static_assert(kHalfN == 128, "one wgmma chain (m64n128k32) covers a half");

  using SmemLayoutAStage = detail::StageTile<Element, true, kBlockM, kBlockK>;
  using SmemLayoutAWg = detail::StageTile<Element, true, kRowsPerConsumer, kBlockK>;
  using SmemLayoutBox = detail::StageTile<Element, true, kBox, kBlockK>;
  using SmemLayoutBHalf = detail::StageTile<Element, true, kHalfN, kBlockK>;
  static constexpr int kStageElemsA = kBlockM * kBlockK;
  static constexpr int kBoxElems = kBox * kBlockK;
  static constexpr int kStageElemsB = kBlockN * kBlockK;
  // One stage's row scales as load_tile copies them: 128 + 4 floats from a 16-byte boundary. A scale buffer it
  // reads must hold kScaleBytes past the start of its last K block's column (kScaleTail floats past its end).
  static constexpr uint32_t kScaleBytes = (kBlockM + kFp8RowScaleSlack) * sizeof(float);
  static constexpr int kScaleTail = kBlockM + kFp8RowScaleSlack;
  // A K-major SW128 tile of 8-bit values is a column of 8-row x 128-byte atoms, so any 8k-row slice of it is
  // the same layout at an offset: warpgroup w's A rows are the 8 KB at w * 8 KB of the A stage, box j of B the
  // 8 KB at j * 8 KB of the B stage, and half hf of B the 16 KB at hf * 16 KB.
  static_assert(cute::cosize_v<SmemLayoutAWg> == kRowsPerConsumer * kBlockK &&
                    cute::cosize_v<SmemLayoutBox> == kBoxElems && cute::cosize_v<SmemLayoutBHalf> == 2 * kBoxElems,
                "stage slices tile contiguously");
  static_assert(kStageElemsA * sizeof(Element) == sizeof(StageRing::a) / kStages &&
                    kStageElemsB * sizeof(Element) == sizeof(StageRing::b) / kStages,
                "an FP8 stage fills one bf16 stage's bytes");

  using TiledMma = decltype(cute::make_tiled_mma(cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>{}));
  using Accumulator = decltype(cute::partition_fragment_C(
      std::declval<TiledMma>(), cute::Shape<cute::Int<kRowsPerConsumer>, cute::Int<kHalfN>>{}));
  static_assert(decltype(cute::size(std::declval<Accumulator&>()))::value == 64, "64 values per thread");

  // A: rows x k, k contiguous, row stride ld elements (bytes; a multiple of 16).
  static auto make_tma_a(const Element* ptr, int rows, int k, int64_t ld) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(rows, k), make_stride(ld, Int<1>{}));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutAStage{}, Shape<Int<kBlockM>, Int<kBlockK>>{}, Int<1>{});
  }
  // B: (n_b, k, groups), k contiguous (each weight matrix transposed).
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    using namespace cute;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_b, k, groups),
                           make_stride(int64_t(k), Int<1>{}, int64_t(n_b) * k));
    return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutBox{}, Shape<Int<kBox>, Int<kBlockK>>{}, Int<1>{});
  }
  using TmaA = decltype(make_tma_a(nullptr, 0, 0, 0));
  using TmaB = decltype(make_tma_b(nullptr, 0, 0, 0));

  static __device__ Element* stage_a(StageRing& s, int stage) {
    return reinterpret_cast<Element*>(s.a) + stage * kStageElemsA;
  }
  static __device__ Element* stage_b(StageRing& s, int stage) {
    return reinterpret_cast<Element*>(s.b) + stage * kStageElemsB;
  }

  // ---- producer (one thread): the TMA loads of one tile's K blocks and its scales -------------------------
  // tma_a / tma_b must be kernel parameters (__grid_constant__): TMA reads the descriptor from there. a_scale: A's
  // scales [k / 128][scale_ld] (scale_ld a multiple of 4, the buffer 16-byte aligned with kScaleTail floats of slack
  // past its end); b_scale: the weights' [groups, n_b / 128, k / 128] scales (read-only for the kernel: __ldg).
  __device__ static bool load_tile(const TmaA& tma_a, const TmaB& tma_b, const float* a_scale, int64_t scale_ld,
                                   const float* b_scale, StageRing& s, Fp8StageScales& sc, RingPos& pos,
                                   const TileLoad& t, int32_t* status) {
    using namespace cute;
    const int n_k = t.k / kBlockK;
    Tensor mA = tma_a.get_tma_tensor(make_shape(t.a_rows, t.k));
    Tensor mB = tma_b.get_tma_tensor(make_shape(t.n_b, t.k, t.groups));
    Tensor gA = local_tile(domain_offset(make_coord(t.a_row0, 0), mA), Shape<Int<kBlockM>, Int<kBlockK>>{},
                           make_coord(0, _));  // (BM, BK, k)
    const float* a_src = a_scale + (t.a_row0 & ~(kFp8RowScaleSlack - 1));  // 16-byte aligned
    Tensor mBg = mB(_, _, t.group);
    const bool valid0 = t.col0 < t.n_b, valid1 = t.col1 < t.n_b;
    const int n_cb = t.n_b / kFp8ScaleBlock;
    const float* b_src0 = b_scale + (int64_t(t.group) * n_cb + (valid0 ? t.col0 : 0) / kFp8ScaleBlock) * n_k;
    const float* b_src1 = b_scale + (int64_t(t.group) * n_cb + (valid1 ? t.col1 : 0) / kFp8ScaleBlock) * n_k;
    uint32_t bytes = kStageElemsA * sizeof(Element) + kScaleBytes;
    CUTE_UNROLL
    for (int j = 0; j < kBoxes; ++j)
      if (t.col(j) < t.n_b) bytes += kBoxElems * sizeof(Element);
    // the weight scales one K block ahead: their loads are in flight while this block waits for its stage
    float b0 = valid0 ? __ldg(b_src0) : 0.0f, b1 = valid1 ? __ldg(b_src1) : 0.0f;
    for (int kb = 0; kb < n_k; ++kb) {
      const bool more = kb + 1 < n_k;
      const float b0_next = valid0 && more ? __ldg(b_src0 + kb + 1) : 0.0f;
      const float b1_next = valid1 && more ? __ldg(b_src1 + kb + 1) : 0.0f;
      if (!mbarrier_wait(&s.empty[pos.stage], pos.phase ^ 1, status)) return false;
      sc.b[pos.stage][0] = b0;
      sc.b[pos.stage][1] = b1;
      b0 = b0_next, b1 = b1_next;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[pos.stage], bytes);
      Tensor sA = make_tensor(make_smem_ptr(stage_a(s, pos.stage)), SmemLayoutAStage{});
      auto [tAg, tAs] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                      group_modes<0, 2>(gA(_, _, kb)));
      copy(tma_a.with(s.full[pos.stage]), tAg, tAs);
      SM90_BULK_COPY_G2S::copy(a_src + kb * scale_ld, &s.full[pos.stage], &sc.a[pos.stage][0], kScaleBytes);
      CUTE_UNROLL
      for (int j = 0; j < kBoxes; ++j) {
        const int col = t.col(j);
        if (col >= t.n_b) continue;  // the N tail of a down projection: never stored
        Tensor gB = local_tile(domain_offset(make_coord(col, 0), mBg), Shape<Int<kBox>, Int<kBlockK>>{},
                               make_coord(0, _));  // (box, BK, k)
        Tensor sB = make_tensor(make_smem_ptr(stage_b(s, pos.stage) + j * kBoxElems), SmemLayoutBox{});
        auto [tBg, tBs] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                        group_modes<0, 2>(gB(_, _, kb)));
        copy(tma_b.with(s.full[pos.stage]), tBg, tBs);
      }
      pos.advance();
    }
    return true;
  }

  // ---- consumers (two warpgroups): the chains and promotions of one tile into total0, total1 ---------------
  // ct: thread index among the 256 consumer threads; n_k: K blocks (>= 1); a_shift: where the tile's row 0 sits in
  // the stage's row scales (load_tile: row0 % 4; the standalone producer: 0). Per K block and half one chain into
  // `partial`, waited for, then promoted; the stage is freed after the second chain. The tensor core idles
  // while a warpgroup promotes; the other warpgroup's chain fills it.
  __device__ static bool mma_tile(StageRing& s, const Fp8StageScales& sc, RingPos& pos, Accumulator& total0,
                                  Accumulator& total1, int n_k, int a_shift, int ct, int32_t* status) {
    using namespace cute;
    const int wg = ct / 128, t = ct % 128, lane = t % 32, warp = t / 32;
    // wgmma accumulator fragment (PTX ISA, m64nNk16/k32 f32 D): value i of thread (warp, lane) of the
    // warpgroup sits at row 16 warp + lane/4 + 8 ((i/2) % 2), column 8 (i/4) + 2 (lane % 4) + i % 2.
    const int r_local = a_shift + kRowsPerConsumer * wg + 16 * warp + lane / 4;  // and r_local + 8
    TiledMma mma;
    auto thr = mma.get_thread_slice(t);
    Accumulator partial;
    CUTE_UNROLL
    for (int i = 0; i < size(total0); ++i) total0(i) = 0.0f, total1(i) = 0.0f;
    for (int left = n_k; left > 0; --left) {  // counted down: no bound held in a register
      if (!mbarrier_wait(&s.full[pos.stage], pos.phase, status)) return false;
      const float a0 = sc.a[pos.stage][r_local], a1 = sc.a[pos.stage][r_local + 8];
      const float b0 = sc.b[pos.stage][0], b1 = sc.b[pos.stage][1];
      Tensor sA = make_tensor(make_smem_ptr(stage_a(s, pos.stage) + wg * kRowsPerConsumer * kBlockK), SmemLayoutAWg{});
      Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, 1, 4) descriptors
      mma_half(mma, thr, tCrA, stage_b(s, pos.stage), partial);
      promote(partial, total0, a0 * b0, a1 * b0);
      mma_half(mma, thr, tCrA, stage_b(s, pos.stage) + 2 * kBoxElems, partial);
      if (cute::elect_one_sync()) cutlass::arch::ClusterBarrier::arrive(&s.empty[pos.stage]);  // both chains are done
      promote(partial, total1, a0 * b1, a1 * b1);
      pos.advance();
    }
    return true;
  }

  // One half's chain: partial = A_wg (64 x 128) @ B_half (128 x 128)^T, waited for. (Issuing the two warpgroups'
  // chains in turn, 0, 1, 0, 1, ..., ordered by a pair of mbarriers so that the tensor core runs one warpgroup's
  // chain while the other promotes, made both GEMMs of the standalone FFN slower: kimi-k2's pair 1.80 against
  // 1.72 ms.)
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
  // Where a tile's output goes (Sm90TileBase::TileStore), and for the quantised SwiGLU also the scales of column
  // block col0 / 128 at out_scale[(col0 / 128) * scale_ld + row]. (TileLoad is Sm90TileBase's.)
  //
  // Both epilogues store 16 bytes a thread. In the accumulator fragment the 4 lanes of a quad (lane / 4) share a
  // row and hold 2 adjacent columns of each 8-column group; a store straight from it writes 4 (bf16) or 2 (e4m3)
  // bytes a lane, 8 rows a warp instruction. ncu on qwen3.5-397b-a17b's ep64 down GEMM had those stores at 32% of
  // its stall samples. So the quad first transposes its words (quad_transpose, two shuffles a word), and then each
  // warp store writes 64 contiguous bytes of each of its 8 rows. Only the store pattern changes, not the bits.
  struct TileStore : Sm90TileBase::TileStore {
    float* out_scale = nullptr;  // SwiGLU only
    int64_t scale_ld = 0;
  };
  // SwiGLU values computed together (silu_math.cuh's swiglu_values, one range vote per group): the bf16 epilogue's
  // sequence, so h has the bf16 path's f32 bits before it is quantised.
  static constexpr int kSwiGLUGroup = 8;

  // The quad's 4 x 4 words transposed: lane q holds w[j] = M[q][j] and gets M[j][q] (q = lane % 4). Two exchanges,
  // across q's bit 0 and then bit 1, each moving the two words the lane does not keep (register-indexed by
  // selects, not by a local array).
  __device__ static void quad_transpose(uint32_t (&w)[4], int lane) {
    const bool q0 = lane & 1, q1 = lane & 2;
    CUTE_UNROLL
    for (int j1 = 0; j1 < 2; ++j1) {  // within each 2 x 2 block
      const uint32_t r = __shfl_xor_sync(0xffffffffu, q0 ? w[2 * j1] : w[2 * j1 + 1], 1);
      if (q0) w[2 * j1] = r;
      else w[2 * j1 + 1] = r;
    }
    CUTE_UNROLL
    for (int j0 = 0; j0 < 2; ++j0) {  // the off-diagonal 2 x 2 blocks
      const uint32_t r = __shfl_xor_sync(0xffffffffu, q1 ? w[j0] : w[2 + j0], 2);
      if (q1) w[j0] = r;
      else w[2 + j0] = r;
    }
  }

  // out (bf16) = one half's 128 columns of `acc` from column col0 + col_off, rows masked by row_end, 16-byte chunks
  // by n_out (a multiple of 8; the row pitch ld * 2 bytes and out a multiple of 16 bytes). Row half h of the
  // thread holds word g (values 4g + 2h, 4g + 2h + 1) at columns 8g + 2q; after the transpose of words 4m .. 4m + 3
  // the lane holds all 8 columns of group 4m + q.
  __device__ static void store_bf16_half(const Accumulator& acc, const TileStore& st, int col_off, int wg, int t) {
    const int lane = t % 32, warp = t / 32;
    auto* out = static_cast<__nv_bfloat16*>(st.out);
    const int row_h0 = st.row0 + kRowsPerConsumer * wg + 16 * warp + lane / 4;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int row = row_h0 + 8 * h;
      CUTE_UNROLL
      for (int m = 0; m < 4; ++m) {
        uint32_t w[4];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * (4 * m + j) + 2 * h;
          w[j] = pack_bf16x2(acc(i), acc(i + 1));
        }
        quad_transpose(w, lane);
        const int col = st.col0 + col_off + 8 * (4 * m + lane % 4);
        if (row < st.row_end && col < st.n_out)
          *reinterpret_cast<uint4*>(out + int64_t(row) * st.ld + col) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // h = silu(gate) * up for the tile's 128 h columns (gate value i of total0 pairs with up value i of total1),
  // quantised with each row's amax over those 128 columns: the thread's own 32 values of the row, then the
  // 4 lanes that share the row. q = e4m3_rn_satfinite(h / scale), scale = amax * (1/448) (1 when amax is 0): the
  // same f32 operations as mok_jax.fp8.quantize_rows. out: e4m3.
  __device__ static void store_swiglu_quant(const Accumulator& gate, const Accumulator& up, const TileStore& st,
                                            int wg, int t) {
    const int lane = t % 32, warp = t / 32;
    float h[64];
    float amax0 = 0.0f, amax1 = 0.0f;
    CUTE_UNROLL
    for (int i0 = 0; i0 < 64; i0 += kSwiGLUGroup) {
      float hg[kSwiGLUGroup];
      swiglu_values(gate, i0, up, i0, hg);
      CUTE_UNROLL
      for (int k = 0; k < kSwiGLUGroup; ++k) {
        const int i = i0 + k;
        h[i] = hg[k];
        if ((i >> 1) & 1) amax1 = fmaxf(amax1, fabsf(h[i]));
        else amax0 = fmaxf(amax0, fabsf(h[i]));
      }
    }
    CUTE_UNROLL
    for (int d = 1; d < 4; d *= 2) {
      amax0 = fmaxf(amax0, __shfl_xor_sync(0xffffffffu, amax0, d));
      amax1 = fmaxf(amax1, __shfl_xor_sync(0xffffffffu, amax1, d));
    }
    const float sc0 = fp8_scale_of(amax0), sc1 = fp8_scale_of(amax1);
    const float inv0 = 1.0f / sc0, inv1 = 1.0f / sc1;  // q = h * (1 / scale), as mok_jax.fp8 (kInvE4M3Max)
    const int row0 = st.row0 + kRowsPerConsumer * wg + 16 * warp + lane / 4, row1 = row0 + 8;
    auto* out = static_cast<uint8_t*>(st.out);
    // Row half hr of the thread: word k = its e4m3 pairs of groups 2k, 2k + 1 (columns 16k + 2q and 16k + 8 + 2q);
    // after the transpose of words 4s .. 4s + 3, word j holds lane j's pairs of groups 8s + 2q and 8s + 2q + 1,
    // which the byte permutes put in column order: the 16 bytes from column 16 (4s + q).
    CUTE_UNROLL
    for (int hr = 0; hr < 2; ++hr) {
      const float inv = hr ? inv1 : inv0;
      const int row = hr ? row1 : row0;
      CUTE_UNROLL
      for (int sblk = 0; sblk < 2; ++sblk) {
        uint32_t w[4];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * (2 * (4 * sblk + j)) + 2 * hr;  // value index of group 2k, k = 4 sblk + j
          w[j] = uint32_t(fp8_pack2(h[i], h[i + 1], inv)) | (uint32_t(fp8_pack2(h[i + 4], h[i + 5], inv)) << 16);
        }
        quad_transpose(w, lane);
        const uint4 v = make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                                   __byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632));
        const int col = st.col0 + 16 * (4 * sblk + lane % 4);
        if (row < st.row_end) *reinterpret_cast<uint4*>(out + int64_t(row) * st.ld + col) = v;
      }
    }
    if (lane % 4 == 0) {
      float* scale = st.out_scale + int64_t(st.col0 / kFp8ScaleBlock) * st.scale_ld;
      if (row0 < st.row_end) scale[row0] = sc0;
      if (row1 < st.row_end) scale[row1] = sc1;
    }
  }
};

using Sm90Fp8Tile = Sm90Fp8TileT<>;

}  // namespace mok::gemm
