// mok gemm: one 128 x 256 output tile of a bf16 GEMM on Hopper (sm_90a), TMA + wgmma through CuTe.
//
//   acc[r, n] = sum_{k in [k0, k0 + k_len)} A[row0 + r, k] * B[group][k, cols(n)]     fp32 accumulation
//   cols(n) = col0 + n for n < 128 and col1 + n - 128 for n >= 128 (two 128-column halves of B, so a
//   SwiGLU tile can pair gate columns [c, c+128) with their up columns [c+I, c+I+128))
//
// The pieces every GEMM role of the library is built from (the standalone grouped FFN, the MoE
// megakernel and the expert backward): the shared-memory stage ring, the producer's loads of one tile
// (one thread, TMA), the consumers' MMAs of one tile (two warpgroups, 64 rows each: wgmma 64x256x16 from
// 128B-swizzled shared memory, one batch of 4 in flight), and the epilogue policies:
//   store_swiglu_bf16  out[r, c] = bf16(silu(acc[r, c]) * acc[r, c + 128])     128 columns
//   store_bf16         out[r, c] = bf16(acc[r, c])                             256 columns
//   store_regs<float>  out[r, c] = acc[r, c]                                   256 columns (Sm90TileBase's)
// Each epilogue writes rows [row, row_end) and columns [.., n_out) only, so rows of the next group that a
// tile reads past its own group's end and TMA's zero fill past the matrix are computed but never stored.
//
// Operand majors (template arguments; wgmma reads 16-bit operands of either major from shared memory):
//   A K-major  (rows x k, k contiguous): x, dispatched rows, h, dy, dgu            (forward, dgrad)
//   A MN-major (k x rows in memory, rows contiguous): h^T, x^T of expert-major rows (weight gradients)
//   B MN-major (k x n in memory, n contiguous): gate_up, down; dy, dgu rows        (forward, weight grads)
//   B K-major  (n x k in memory, k contiguous): down^T, gate_up^T                   (dgrad)
// The k range [k0, k0 + k_len) lets a weight-gradient tile reduce over one expert's rows only; an empty
// range (k_len = 0) gives acc = 0.
//
// Stage ring: kStages x (16 KB A + 32 KB B) = 192 KB; full[s] gets 1 producer arrive + the TMA bytes,
// empty[s] one arrive per consumer warp (8). Producer and consumers each keep a StagePos and walk the
// same sequence of tiles, so the ring carries over from one tile to the next. All waits are bounded.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "mok/gemm/silu_math.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok::gemm {

namespace detail {
// Shared-memory layouts (128B swizzle) of one operand tile (rows x cols, cols = the k extent) and of a ring of
// them, for 16-bit (bf16) and 8-bit (FP8, K-major only) elements. Only the asked major is instantiated: an 8-bit
// MN-major atom has no 64-row form.
template <class E, bool kKMajor, int... kExtents>
struct StageLayout {  // K-major: 8-row x 128-byte atoms tiled along rows first
  using type =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E>{}, cute::Shape<cute::Int<kExtents>...>{}));
};
template <class E, int kRows, int kCols>
struct StageLayout<E, false, kRows, kCols> {  // MN-major: atoms tiled along k first
  using type = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<E>{},
                                            cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{},
                                            cute::Step<cute::_2, cute::_1>{}));
};
template <class E, int kRows, int kCols, int kStages>
struct StageLayout<E, false, kRows, kCols, kStages> {
  using type = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<E>{},
                                            cute::Shape<cute::Int<kRows>, cute::Int<kCols>, cute::Int<kStages>>{},
                                            cute::Step<cute::_2, cute::_1, cute::_3>{}));
};
template <class E, bool kKMajor, int kRows, int kCols>
using StageTile = typename StageLayout<E, kKMajor, kRows, kCols>::type;
template <class E, bool kKMajor, int kRows, int kCols, int kStages>
using StageRing = typename StageLayout<E, kKMajor, kRows, kCols, kStages>::type;
}  // namespace detail

// The stage ring of every bf16 tile kind below (128 x 64 A and 256 x 64 B per stage, 4 stages), and a
// position in it.
struct StageRing {
  static constexpr int kStages = 4;
  alignas(1024) cutlass::bfloat16_t a[kStages * 128 * 64];
  alignas(1024) cutlass::bfloat16_t b[kStages * 256 * 64];
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == StageRing::kStages) stage = 0, phase ^= 1;
  }
};

// What every tile kind shares, bf16 (Sm90TileT below) and FP8 (sm90_fp8_tile.cuh's Sm90Fp8TileT, whose operand
// precision is its own mainloop): the 128 x 256 output tile of two consumer warpgroups (64 rows each), the stage
// ring, what the producer loads for a tile and where its output goes, and the register epilogues.
struct Sm90TileBase {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 256;                  // MMA columns of a tile: two halves of 128
  static constexpr int kHalfN = kBlockN / 2;
  static constexpr int kBox = 64;                      // B rows of one of the FP8 tile's TMA boxes (TileLoad::col)
  static constexpr int kStages = StageRing::kStages;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;

  // The ring and a position in it do not depend on the operands: kernels that mix tile kinds (the experts'
  // backward, the FP8 megakernel) walk one ring with one position through tiles of every kind.
  using Stages = StageRing;
  using StagePos = RingPos;

  // full[s] takes full_arrivals arrives (a one-thread producer's one, with the TMA bytes), empty[s] one per
  // consumer warp.
  __device__ static void init_stages(Stages& s, int full_arrivals = 1) {  // one thread, before the CTA's first barrier
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], full_arrivals);
      cutlass::arch::ClusterBarrier::init(&s.empty[i], kConsumerWarpgroups * 4);
    }
    cutlass::arch::fence_barrier_init();
  }

  // What the producer loads for one tile. A B half (bf16) or box (FP8) that starts past the last column of B is
  // skipped (and never stored): the N tail of a down projection.
  struct TileLoad {
    int32_t a_rows, k;            // shape of A as its TMA descriptor sees it
    int32_t a_row0;               // first row of the tile in A
    int32_t n_b, groups, group;   // shape of B, and this tile's matrix
    int32_t col0, col1;           // first column (B row) of each 128-column half of B
    int32_t k0 = 0;               // bf16: the k range this tile reduces over: [k0, k0 + k_len)
    int32_t k_len = -1;           // -1: all of k (the FP8 tile always reduces over all of k)
    __device__ int32_t k_count() const { return k_len < 0 ? k : k_len; }
    __device__ int32_t col(int j) const { return (j < 2 ? col0 : col1) + (j % 2) * kBox; }  // box j's first row
  };

  // Where a tile's output goes: rows [row0, row_end) of `out` (row0 = the tile's first row; warpgroup wg writes
  // its 64 rows), columns [col0, ..) below n_out. (The FP8 tile's TileStore extends it by the scales' place. Not
  // here with defaults: two more fields, though never read, change the bf16 megakernel's register allocation.)
  struct TileStore {
    void* out;
    int64_t ld;                   // elements per row of out
    int32_t row0, row_end;
    int32_t col0, n_out;
  };

  __device__ static uint32_t pack_bf16x2(float lo, float hi) {  // lo in the low half: the lower column
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }

  // Out (float or bf16) straight from a wgmma accumulator's registers, two columns per store, columns from
  // col0 + col_off on: fp32 (each warp store 8 rows x 32 bytes, whole sectors) or bf16 (4 bytes a lane: the
  // dgrad_row_gather lab's; the FP8 tile's bf16 halves go through Sm90Fp8TileT::store_bf16_half, 16 bytes a lane).
  // n_out must be even. Fragment (PTX ISA, m64nNk16 f32 D): value i of
  // thread (warp w, lane l) of the warpgroup sits at row 16w + l/4 + 8*((i/2)%2), column 8*(i/4) + 2*(l%4) + i%2.
  template <class Out, class Acc>
  __device__ static void store_regs(const Acc& acc, const TileStore& st, int col_off, int wg, int t) {
    constexpr int kValues = decltype(cute::size(std::declval<const Acc&>()))::value;
    auto* out = static_cast<Out*>(st.out);
    const int lane = t % 32, warp = t / 32;
    const int r_base = st.row0 + kRowsPerConsumer * wg + 16 * warp + lane / 4;
    const int c_base = st.col0 + col_off + 2 * (lane % 4);
    CUTE_UNROLL
    for (int i = 0; i < kValues; i += 2) {
      const int row = r_base + 8 * ((i >> 1) & 1);
      const int col = c_base + 8 * (i >> 2);
      if (row < st.row_end && col < st.n_out) {
        if constexpr (std::is_same_v<Out, float>)
          *reinterpret_cast<float2*>(out + int64_t(row) * st.ld + col) = make_float2(acc(i), acc(i + 1));
        else
          *reinterpret_cast<__nv_bfloat162*>(out + int64_t(row) * st.ld + col) =
              __floats2bfloat162_rn(acc(i), acc(i + 1));
      }
    }
  }
};

// A class template (also) so that the TMA types below can be deduced from the member functions' bodies
// inside the class (a plain class would see them undefined); Sm90Tile is the forward's K-major A,
// MN-major B tile.
template <cute::GMMA::Major kMajorA = cute::GMMA::Major::K, cute::GMMA::Major kMajorB = cute::GMMA::Major::MN>
struct Sm90TileT : Sm90TileBase {
  using Element = cutlass::bfloat16_t;
  static constexpr bool kAKMajor = kMajorA == cute::GMMA::Major::K;
  static constexpr bool kBKMajor = kMajorB == cute::GMMA::Major::K;

  // 128 x 256 x 64 is the tile cuBLAS/CUTLASS pick for large bf16 GEMMs on H100: 64x256 wgmma per
  // consumer warpgroup has the lowest shared-memory traffic per FLOP, and 4 stages of 48 KB cover the
  // TMA latency.
  static constexpr int kBlockK = 64;
  static constexpr int kEpiCols = 64;
  static constexpr int kEpiPitch = kEpiCols + 8;  // bf16; +16 B per row makes the bf16x2 writes conflict-free
  static constexpr int kEpiWords = kRowsPerConsumer * kEpiPitch / 2;  // per consumer warpgroup

  // K-major operands: 8-row x 64-k swizzle atoms tiled along rows. MN-major operands: swizzle atoms
  // (64 rows x 8 k) tiled along k first, so each 64-row strip of a stage is one contiguous 8 KB box for
  // TMA and the strips sit at a uniform stride for the wgmma descriptor.
  using SmemLayoutA = detail::StageRing<Element, kAKMajor, kBlockM, kBlockK, kStages>;
  using SmemLayoutB = detail::StageRing<Element, kBKMajor, kBlockN, kBlockK, kStages>;
  // One 128-column half of one B stage: the same strides as the matching part of SmemLayoutB.
  using SmemLayoutBHalf = detail::StageTile<Element, kBKMajor, kHalfN, kBlockK>;
  using SmemLayoutAStage = detail::StageTile<Element, kAKMajor, kBlockM, kBlockK>;
  static constexpr int kStageElemsA = kBlockM * kBlockK;
  static constexpr int kStageElemsB = kBlockN * kBlockK;
  static constexpr int kHalfElemsB = kHalfN * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + kStageElemsB) * sizeof(Element);

  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<kMajorA, kMajorB>{},
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using Accumulator = decltype(cute::partition_fragment_C(
      std::declval<TiledMma>(), cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));

  // A as a rows x k matrix: K-major (row r at r * k, x or h rows) or MN-major (k index kk at kk * rows:
  // the expert-major rows of x or h read as their transpose).
  static auto make_tma_a(const Element* ptr, int rows, int k) {
    using namespace cute;
    if constexpr (kAKMajor) {
      Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(rows, k), make_stride(int64_t(k), Int<1>{}));
      return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutAStage{}, Shape<Int<kBlockM>, Int<kBlockK>>{}, Int<1>{});
    } else {
      Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(rows, k), make_stride(Int<1>{}, int64_t(rows)));
      return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutAStage{}, Shape<Int<kBlockM>, Int<kBlockK>>{}, Int<1>{});
    }
  }
  // B: one k x n_b matrix per group, viewed as (n_b, k, groups): MN-major is row-major k x n_b (n
  // contiguous: weights of the forward, rows of dy); K-major is row-major n_b x k (k contiguous: a
  // weight read as its transpose).
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    using namespace cute;
    if constexpr (kBKMajor) {
      Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_b, k, groups),
                             make_stride(int64_t(k), Int<1>{}, int64_t(n_b) * k));
      return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutBHalf{}, Shape<Int<kHalfN>, Int<kBlockK>>{}, Int<1>{});
    } else {
      Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_b, k, groups),
                             make_stride(Int<1>{}, int64_t(n_b), int64_t(n_b) * k));
      return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutBHalf{}, Shape<Int<kHalfN>, Int<kBlockK>>{}, Int<1>{});
    }
  }
  using TmaA = decltype(make_tma_a(nullptr, 0, 0));
  using TmaB = decltype(make_tma_b(nullptr, 0, 0, 0));

  static_assert(cute::cosize_v<SmemLayoutA> == kStageElemsA * kStages &&
                    cute::cosize_v<SmemLayoutB> == kStageElemsB * kStages,
                "the stage ring holds the tiles of either major");

  static constexpr int k_tiles(int k) { return (k + kBlockK - 1) / kBlockK; }

  // ---- producer (one thread): the TMA loads of one tile's k-tiles ----------------------------------
  // tma_a / tma_b must be kernel parameters (__grid_constant__): TMA reads the descriptor from there.
  __device__ static bool load_tile(const TmaA& tma_a, const TmaB& tma_b, Stages& s, StagePos& pos,
                                   const TileLoad& t, int32_t* status) {
    using namespace cute;
    Tensor mA = tma_a.get_tma_tensor(make_shape(t.a_rows, t.k));
    Tensor mB = tma_b.get_tma_tensor(make_shape(t.n_b, t.k, t.groups));
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    Tensor gA = local_tile(domain_offset(make_coord(t.a_row0, t.k0), mA), Shape<Int<kBlockM>, Int<kBlockK>>{},
                           make_coord(0, _));  // (BM, BK, k)
    auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    Tensor mBg = mB(_, _, t.group);
    Tensor gB0 = local_tile(domain_offset(make_coord(t.col0, t.k0), mBg), Shape<Int<kHalfN>, Int<kBlockK>>{},
                            make_coord(0, _));  // (BN/2, BK, k)
    const bool load_second = t.col1 < t.n_b;
    Tensor gB1 = local_tile(domain_offset(make_coord(load_second ? t.col1 : 0, t.k0), mBg),
                            Shape<Int<kHalfN>, Int<kBlockK>>{}, make_coord(0, _));
    const uint32_t stage_bytes = load_second ? kStageBytes : kStageBytes - kHalfElemsB * sizeof(Element);
    const int n_k = k_tiles(t.k_count());
    for (int k = 0; k < n_k; ++k) {
      if (!mbarrier_wait(&s.empty[pos.stage], pos.phase ^ 1, status)) return false;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[pos.stage], stage_bytes);
      copy(tma_a.with(s.full[pos.stage]), tAgA(_, k), tAsA(_, pos.stage));
      Tensor sB0 = make_tensor(make_smem_ptr(s.b + pos.stage * kStageElemsB), SmemLayoutBHalf{});
      auto [tB0g, tB0s] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB0),
                                        group_modes<0, 2>(gB0(_, _, k)));
      copy(tma_b.with(s.full[pos.stage]), tB0g, tB0s);
      if (load_second) {
        Tensor sB1 = make_tensor(make_smem_ptr(s.b + pos.stage * kStageElemsB + kHalfElemsB), SmemLayoutBHalf{});
        auto [tB1g, tB1s] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB1),
                                          group_modes<0, 2>(gB1(_, _, k)));
        copy(tma_b.with(s.full[pos.stage]), tB1g, tB1s);
      }
      pos.advance();
    }
    return true;
  }

  // ---- consumers (two warpgroups): the MMAs of one tile into acc --------------------------------------
  // ct: thread index among the 256 consumer threads; k: the tile's k_count(), at least 1 (a caller with
  // an empty k range clears acc itself: a branch here makes ptxas spill the accumulator).
  __device__ static bool mma_tile(Stages& s, StagePos& pos, Accumulator& acc, int k, int ct, int32_t* status) {
    using namespace cute;
    TiledMma mma;
    auto thr = mma.get_thread_slice(ct);
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stages) descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, stages) descriptors
    const int lane = ct % 32;
    const int n_k = k_tiles(k);
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int prev_stage = -1;
    bool ok = true;
    for (int kt = 0; kt < n_k; ++kt) {
      if (!mbarrier_wait(&s.full[pos.stage], pos.phase, status)) {
        ok = false;
        break;
      }
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(mma, tCrA(_, _, kb, pos.stage), tCrB(_, _, kb, pos.stage), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k-tile's wgmmas are done: free its stage
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0) release_stage(s, prev_stage, lane);
      prev_stage = pos.stage;
      pos.advance();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (prev_stage >= 0) release_stage(s, prev_stage, lane);
    return ok;
  }

  __device__ static void release_stage(Stages& s, int stage, int lane) {
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[stage]);
  }

  // ---- epilogues --------------------------------------------------------------------------------------
  // wgmma accumulator fragment (PTX ISA, m64nNk16 f32 D): value i of thread (warp w, lane l) of the
  // warpgroup sits at row 16w + l/4 + 8*((i/2)%2), column 8*(i/4) + 2*(l%4) + i%2. For SwiGLU the up
  // partner of gate column c (< 128) is column c + 128, i.e. value i + 64 of the same thread.
  // bf16 out through a per-warpgroup epilogue buffer (64 x 64, padded rows) into 16-byte row-masked stores.
  template <bool kSwiGLU>
  __device__ static void store_bf16(const Accumulator& acc, uint32_t* buf, const TileStore& st, int wg, int t) {
    constexpr int kOutCols = kSwiGLU ? kHalfN : kBlockN;
    constexpr int kPitchWords = kEpiPitch / 2;
    auto* out = static_cast<Element*>(st.out);
    const int lane = t % 32, warp = t / 32;
    const int r_base = 16 * warp + lane / 4;
    const int c_base = 2 * (lane % 4);
    const int row0 = st.row0 + kRowsPerConsumer * wg;
    constexpr int kGroup = 8;  // SwiGLU values whose divisions share one range vote
    CUTE_UNROLL
    for (int pass = 0; pass < kOutCols / kEpiCols; ++pass) {
      CUTE_UNROLL
      for (int j0 = 0; j0 < 32; j0 += kGroup) {
        float h[kGroup];
        if constexpr (kSwiGLU) swiglu_values(acc, 32 * pass + j0, acc, 32 * pass + j0 + 64, h);  // up: i + 64
        CUTE_UNROLL
        for (int j = j0; j < j0 + kGroup; j += 2) {
          const int i = 32 * pass + j;
          const int r = r_base + 8 * ((i >> 1) & 1);
          const int c = 8 * ((i >> 2) - 8 * pass) + c_base;
          const float v0 = kSwiGLU ? h[j - j0] : acc(i);
          const float v1 = kSwiGLU ? h[j - j0 + 1] : acc(i + 1);
          buf[r * kPitchWords + c / 2] = pack_bf16x2(v0, v1);
        }
      }
      named_barrier_sync(1 + wg, 128);
      CUTE_UNROLL
      for (int j = 0; j < kRowsPerConsumer * kEpiCols / 8 / 128; ++j) {
        const int idx = t + 128 * j;
        const int r = idx / (kEpiCols / 8), chunk = idx % (kEpiCols / 8);
        const int row = row0 + r;
        const int col = st.col0 + pass * kEpiCols + chunk * 8;
        if (row < st.row_end && col < st.n_out) {
          const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kPitchWords + chunk * 4);
          *reinterpret_cast<uint4*>(out + int64_t(row) * st.ld + col) = v;
        }
      }
      named_barrier_sync(1 + wg, 128);
    }
  }
};

using Sm90Tile = Sm90TileT<>;

}  // namespace mok::gemm
