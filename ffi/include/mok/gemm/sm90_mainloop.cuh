// mok gemm: the mainloops of the one grouped GEMM (sm90_grouped_gemm.cuh), CUTLASS's collective mainloop in this
// library's words: what a tile's operands are, how the producer brings them into the stage ring, how the consumers
// turn the stages into accumulators, and the epilogues that read those accumulators. The precision of a grouped
// GEMM is its mainloop; the kernel shell (roles, group scheduler, padding rows, status) is the same for each.
//
//   Bf16Mainloop<kMajorB>    bf16 x bf16 -> fp32: sm90_tile.cuh's Sm90TileT (one wgmma batch per 64-long k-tile,
//                            one accumulator of 128 x 256); producer: one thread, TMA only.
//                            Epilogues: kSwiGLU (bf16 h), kBf16, kF32.
//   Fp8BlockScaledMainloop   E4M3 x E4M3 with DeepSeek-V3 block scales: sm90_fp8_tile.cuh's Sm90Fp8Tile (per
//                            128-long k block and 128-column half one chain into `partial`, promoted into that
//                            half's fp32 total with the row and weight scales); producer: one warp, TMA for A and
//                            B, cp.async for the stage's scales. Epilogues: kSwiGLUQuant (e4m3 h + its scales),
//                            kBf16.
//
// What the shell asks of a mainloop:
//   Tile, Element                 the tile pieces (kBlockM, kBlockN, kHalfN, kConsumerThreads) and A's element
//   TmaA, TmaB, make_tma_a/b      the operand descriptors (host side)
//   Operands                      the kernel parameters it reads: tma_a, tma_b, and for FP8 the `scales` member. The
//                                 shell's Params derives from it (the scales sit right after the descriptors; a bf16
//                                 Params has none)
//   Out                           where its epilogues write: ptr, ld, and for FP8 `scale` (the quantised h's scales)
//   SharedExtra                   shared memory beside the stage ring: bf16 the epilogue buffers, FP8 the stage scales
//   kProducerLanes                1 (the shell elects one lane of warp 0) or 32 (all of warp 0)
//   init_stages                   the ring's barriers (one thread, before the CTA's first barrier)
//   load_init, load_tile          the producer's state, set up once before its tile loop (CUTLASS's load_init), and
//                                 its loads of one tile (false: a bounded wait timed out)
//   with_accumulators(f)          calls f with the consumer's accumulators (bf16: one 128 x 256 fragment; FP8: the two
//                                 halves' fp32 totals), each its own local: one aggregate of both makes ptxas
//                                 allocate the FP8 totals' registers differently
//   mma_init, mma_tile            the consumers' state, set up once, and their MMAs of one tile into the
//                                 accumulators (false: a bounded wait timed out)
//   store<kEpi>                   the epilogue of one tile
//   zero_padding_rows<kEpi>       rows [table.row_start[num_groups], M) of out (warps 1..3 of the producer warpgroup)
//
// sm_100 (a note; nothing here is built for it): the operand layouts are the mainloop's, not the shell's. Hopper's
// FP8 wgmma reads both operands K-major from shared memory, so Fp8BlockScaledMainloop fixes K-major A and B (the
// weights arrive transposed, mok_jax.fp8.quantize_expert_weights) where Bf16Mainloop takes B's major as a template
// argument. Blackwell's tcgen05 MMA reads 8-bit operands of either major and scales blocks in hardware
// (kind::mxf8f6f4 with per-32 UE8M0 scales, or kind::f8f6f4 with the fp32 promotion kept): an sm_100 block-scaled
// mainloop would take kMajorA/kMajorB as Bf16Mainloop does, bring the scales into tensor memory beside the
// operands, drop the promotion, and hand the epilogues a tensor-memory accumulator; Operands, Out, SharedExtra and
// the functions above are the whole of what would change, so the shell and the host launcher stay as they are.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory_sm80.h>

#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok::gemm {

// The epilogues of the grouped GEMM (each mainloop has the ones it lists above):
//   kSwiGLU       the tile's 256 MMA columns are 128 gate columns [n0, n0+128) and the 128 matching up columns
//                 [n0 + I, n0 + I + 128) of gate_up[g]; out = bf16(silu(gate) * up)  (h, M x I)
//   kSwiGLUQuant  as kSwiGLU with h = silu(gate) * up in fp32 quantised to E4M3, one fp32 scale per row and 128 h
//                 columns (amax * (1/448)): out = h_q [M, I] e4m3, out.scale [I/128, M] f32
//   kBf16         the 256 MMA columns are [n0, n0 + 256) of B[g]; out = bf16(acc)  (y = h @ down, M x H)
//   kF32          as kBf16 with fp32 out (the backward's g, u at the forward's precision)
enum class Epilogue { kSwiGLU, kSwiGLUQuant, kBf16, kF32 };

// Output columns of one tile: a SwiGLU tile's 256 MMA columns give 128 h columns.
template <class Tile, Epilogue kEpi>
constexpr int kTileOutCols = kEpi == Epilogue::kSwiGLU || kEpi == Epilogue::kSwiGLUQuant ? Tile::kHalfN : Tile::kBlockN;

struct NoMainloopState {};

// ---- bf16 ------------------------------------------------------------------------------------------------------
template <cute::GMMA::Major kMajorB = cute::GMMA::Major::MN>
struct Bf16Mainloop {
  using Tile = Sm90TileT<cute::GMMA::Major::K, kMajorB>;
  using Element = typename Tile::Element;
  using TmaA = typename Tile::TmaA;
  using TmaB = typename Tile::TmaB;
  static constexpr int kProducerLanes = 1;

  static auto make_tma_a(const Element* ptr, int rows, int k) { return Tile::make_tma_a(ptr, rows, k); }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    return Tile::make_tma_b(ptr, n_b, k, groups);
  }

  struct Operands {
    TmaA tma_a;
    TmaB tma_b;
  };
  struct Out {
    void* ptr;   // bf16 [num_rows, ld] (kF32: float)
    int64_t ld;
  };
  struct SharedExtra {  // the epilogue buffers, one per consumer warpgroup
    alignas(16) uint32_t epi[Tile::kConsumerWarpgroups][Tile::kEpiWords];
  };
  template <class F>
  __device__ static void with_accumulators(F&& f) {
    typename Tile::Accumulator acc;
    f(acc);
  }

  __device__ static void init_stages(StageRing& s) { Tile::init_stages(s); }

  template <class Params>
  __device__ static NoMainloopState load_init(const Params&) { return {}; }
  // The tile's second B half starts b_second_offset columns after its first.
  template <Epilogue kEpi, class Params>
  __device__ static bool load_tile(const NoMainloopState&, const Params& p, StageRing& s, SharedExtra&, RingPos& pos,
                                   const TileCoord& tc, int /*lane*/) {
    const int col0 = tc.n_block * kTileOutCols<Tile, kEpi>;
    const typename Tile::TileLoad t{p.num_rows, p.k, tc.row_begin, p.n_b, p.num_groups, tc.group, col0,
                                    col0 + p.b_second_offset};
    return Tile::load_tile(p.tma_a, p.tma_b, s, pos, t, p.status);
  }

  template <class Params>
  __device__ static NoMainloopState mma_init(const Params&) { return {}; }
  template <class Params>
  __device__ static bool mma_tile(const NoMainloopState&, const Params& p, StageRing& s, SharedExtra&, RingPos& pos,
                                  int ct, typename Tile::Accumulator& acc) {
    return Tile::mma_tile(s, pos, acc, p.k, ct, p.status);
  }

  template <Epilogue kEpi, class Params>
  __device__ static void store(const Params& p, SharedExtra& x, const TileCoord& tc, int wg, int t,
                               const typename Tile::Accumulator& acc) {
    static_assert(kEpi == Epilogue::kSwiGLU || kEpi == Epilogue::kBf16 || kEpi == Epilogue::kF32,
                  "the bf16 mainloop's epilogues");
    const typename Tile::TileStore st{p.out.ptr, p.out.ld, tc.row_begin, tc.row_end,
                                      tc.n_block * kTileOutCols<Tile, kEpi>, p.n_out};
    if constexpr (kEpi == Epilogue::kF32) {
      Tile::template store_regs<float>(acc, st, 0, wg, t);
    } else {
      Tile::template store_bf16<kEpi == Epilogue::kSwiGLU>(acc, x.epi[wg], st, wg, t);
    }
  }

  // Zeros in rows [first, num_rows) of a bf16 out, 16 bytes per store.
  template <Epilogue kEpi, class Params, class Table>
  __device__ static void zero_padding_rows(const Params& p, const Table& table, int t, int num_threads) {
    const int64_t first = table.row_start[p.num_groups];
    auto* out = static_cast<Element*>(p.out.ptr);
    const int64_t chunks_per_row = p.n_out / 8;
    const int64_t total = (int64_t(p.num_rows) - first) * chunks_per_row;
    for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < total; idx += int64_t(gridDim.x) * num_threads) {
      const int64_t row = first + idx / chunks_per_row, col = (idx % chunks_per_row) * 8;
      *reinterpret_cast<uint4*>(out + row * p.out.ld + col) = make_uint4(0, 0, 0, 0);
    }
  }
};

// ---- FP8 with block scales -------------------------------------------------------------------------------------
// Operands (FP8 wgmma reads both from shared memory K-major only):
//   A [num_rows, k] e4m3, k contiguous (x_q or h_q), scales.a [k/128, num_rows] f32 (k-block major, so the rows of
//     one tile read consecutive floats)
//   B [groups, n_b, k] e4m3, k contiguous (the weight transposed), scales.b [groups, n_b/128, k/128] f32
// k and the column counts must be multiples of 128 (the host checks). Stage ring: full[s] 1 + 32 producer arrives
// (lane 0's with the TMA bytes, then each lane's when its scale copies land); empty[s] one arrive per consumer warp.
// A B box past n_b (the last 128 columns of an H that is an odd multiple of 128) is not loaded and its columns never
// stored (its chain runs on stale shared memory, with scale 0).
struct Fp8BlockScaledMainloop {
  using Tile = Sm90Fp8Tile;
  using Element = Tile::Element;
  using TmaA = Tile::TmaA;
  using TmaB = Tile::TmaB;
  static constexpr int kProducerLanes = 32;
  static constexpr int kBlockK = Tile::kBlockK;
  static constexpr int kBox = Tile::kBox;
  static_assert(Tile::kBlockM == 4 * 32, "each producer lane copies 4 row scales");

  // A: rows x k, k contiguous. B: (n_b, k, groups), k contiguous (each weight matrix transposed).
  static auto make_tma_a(const Element* ptr, int rows, int k) { return Tile::make_tma_a(ptr, rows, k, k); }
  static auto make_tma_b(const Element* ptr, int n_b, int k, int groups) {
    return Tile::make_tma_b(ptr, n_b, k, groups);
  }

  struct Scales {
    const float* a;  // [k / 128, num_rows]
    const float* b;  // [num_groups, n_b / 128, k / 128]
  };
  struct Operands {
    TmaA tma_a;
    TmaB tma_b;
    Scales scales;
  };
  struct Out {
    void* ptr;       // kSwiGLUQuant: e4m3 [num_rows, ld]; kBf16: bf16 [num_rows, ld]
    int64_t ld;
    float* scale;    // kSwiGLUQuant: [n_out / 128, num_rows], the scales of out
  };
  using SharedExtra = Fp8StageScales;
  template <class F>
  __device__ static void with_accumulators(F&& f) {
    Tile::Accumulator total0, total1;  // the tile's two 128-column halves
    f(total0, total1);
  }

  __device__ static void init_stages(StageRing& s) { Tile::init_stages(s, 1 + 32); }  // TMA bytes + the scale copies

  // ---- producer: one warp, one tile ---------------------------------------------------------------------
  // Lane 0 issues the stage's TMA loads (full[s] counts their bytes); every lane copies 4 of the tile's 128 row
  // scales of the k block by cp.async (lanes 0, 1 also a half's column scale; rows past M and a half past n_b
  // read as 0) and arrives on full[s] when its copies land. The consumers then read the scales from shared
  // memory after the stage's wait, so no global load sits in their loop. (The megakernel's one-thread producer,
  // Sm90Fp8Tile::load_tile, brings the row scales by TMA instead.)
  template <class TensorA, class TensorB>
  struct LoadState {
    int n_k;     // k blocks
    TensorA mA;  // A and the B matrices as TMA coordinate tensors
    TensorB mB;
  };
  template <class Params>
  __device__ static auto load_init(const Params& p) {
    using namespace cute;
    const int n_k = p.k / kBlockK;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.num_rows, p.k));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_b, p.k, p.num_groups));
    return LoadState<decltype(mA), decltype(mB)>{n_k, mA, mB};
  }
  // First column (row of B) of half hf of tile column block n_block, and of box j (half j / 2).
  template <Epilogue kEpi, class Params>
  __device__ static int half_col(const Params& p, int n_block, int hf) {
    return n_block * kTileOutCols<Tile, kEpi> + hf * p.b_second_offset;
  }
  template <Epilogue kEpi, class Params>
  __device__ static int box_col(const Params& p, int n_block, int j) {
    return half_col<kEpi>(p, n_block, j / 2) + (j % 2) * kBox;
  }
  template <Epilogue kEpi, class State, class Params>
  __device__ static bool load_tile(const State& ls, const Params& p, StageRing& stages, Fp8StageScales& scales,
                                   RingPos& pos, const TileCoord& tc, int lane) {
    using namespace cute;
    const int n_k = ls.n_k;
    Tensor gA = local_tile(domain_offset(make_coord(tc.row_begin, 0), ls.mA),
                           Shape<Int<Tile::kBlockM>, Int<kBlockK>>{}, make_coord(0, _));  // (BM, BK, k)
    Tensor mBg = ls.mB(_, _, tc.group);
    const int b_col = half_col<kEpi>(p, tc.n_block, lane % 2);
    const bool b_valid = lane < 2 && b_col < p.n_b;
    const float* b_src =
        p.scales.b + (int64_t(tc.group) * (p.n_b / kFp8ScaleBlock) + (b_valid ? b_col : 0) / kFp8ScaleBlock) * n_k;
    uint32_t bytes = Tile::kStageElemsA * sizeof(Element);
    CUTE_UNROLL
    for (int j = 0; j < Tile::kBoxes; ++j)
      if (box_col<kEpi>(p, tc.n_block, j) < p.n_b) bytes += Tile::kBoxElems * sizeof(Element);
    for (int kb = 0; kb < n_k; ++kb) {
      if (!mbarrier_wait(&stages.empty[pos.stage], pos.phase ^ 1, p.status)) return false;
      if (lane == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&stages.full[pos.stage], bytes);
        Tensor sA = make_tensor(make_smem_ptr(Tile::stage_a(stages, pos.stage)), Tile::SmemLayoutAStage{});
        auto [tAg, tAs] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                        group_modes<0, 2>(gA(_, _, kb)));
        copy(p.tma_a.with(stages.full[pos.stage]), tAg, tAs);
        CUTE_UNROLL
        for (int j = 0; j < Tile::kBoxes; ++j) {
          const int col = box_col<kEpi>(p, tc.n_block, j);
          if (col >= p.n_b) continue;  // the N tail of the down GEMM: never stored
          Tensor gB = local_tile(domain_offset(make_coord(col, 0), mBg), Shape<Int<kBox>, Int<kBlockK>>{},
                                 make_coord(0, _));  // (box, BK, k)
          Tensor sB = make_tensor(make_smem_ptr(Tile::stage_b(stages, pos.stage) + j * Tile::kBoxElems),
                                  Tile::SmemLayoutBox{});
          auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                          group_modes<0, 2>(gB(_, _, kb)));
          copy(p.tma_b.with(stages.full[pos.stage]), tBg, tBs);
        }
      }
      const float* a_src = p.scales.a + int64_t(kb) * p.num_rows;
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int r = 4 * lane + i, row = tc.row_begin + r;
        cutlass::arch::cp_async_zfill<4>(&scales.a[pos.stage][r], row < p.num_rows ? a_src + row : p.scales.a,
                                         row < p.num_rows);
      }
      if (lane < 2) cutlass::arch::cp_async_zfill<4>(&scales.b[pos.stage][lane], b_src + kb, b_valid);
      cutlass::arch::cpasync_barrier_arrive_noinc(&stages.full[pos.stage]);
      pos.advance();
    }
    return true;
  }

  // ---- consumers: two warpgroups, 64 rows each, both halves of the tile's columns ---------------------------
  // The scales come with the stage, in shared memory (the producer's cp.async). Loaded by the consumers from
  // global memory, their latency stalled the chains: ncu on kimi-k2 had long-scoreboard stalls at a third of the
  // warps' stall cycles with the tensor pipe 53% busy; loaded one block ahead into registers, the stall stayed at
  // the compiler's copy of them before the block's first wgmma (970 and 526 us for the two GEMMs); copied by the
  // consumers' own cp.async, 1010 and 595 us. Brought by the producer: 849 and 512 us at a lower clock (-19% and
  // -4% in cycles), the tensor pipe 66% and 52% busy.
  struct MmaState {
    int n_k;  // k blocks
  };
  template <class Params>
  __device__ static MmaState mma_init(const Params& p) { return {p.k / kBlockK}; }
  template <class Params>
  __device__ static bool mma_tile(const MmaState& ms, const Params& p, StageRing& s, Fp8StageScales& scales,
                                  RingPos& pos, int ct, Tile::Accumulator& total0, Tile::Accumulator& total1) {
    return Tile::mma_tile(s, scales, pos, total0, total1, ms.n_k, 0, ct, p.status);
  }

  // kSwiGLUQuant: half 0 = gate columns [c, c + 128), half 1 = up columns [c + I, c + I + 128), so gate value i of
  // total0 pairs with up value i of total1 in the same thread, and a row's 128 h columns (one scale block) lie in
  // the 4 lanes of one warpgroup that share the row: its amax is a max over the thread's 32 values and a 2-step
  // shuffle, no shared memory. kBf16: the halves are columns [n0, n0 + 128) and [n0 + 128, n0 + 256).
  template <Epilogue kEpi, class Params>
  __device__ static void store(const Params& p, Fp8StageScales&, const TileCoord& tc, int wg, int t,
                               const Tile::Accumulator& total0, const Tile::Accumulator& total1) {
    static_assert(kEpi == Epilogue::kSwiGLUQuant || kEpi == Epilogue::kBf16, "the FP8 mainloop's epilogues");
    const Tile::TileStore st{{p.out.ptr, p.out.ld, tc.row_begin, tc.row_end, tc.n_block * kTileOutCols<Tile, kEpi>,
                              p.n_out},
                             p.out.scale,
                             p.num_rows};
    if constexpr (kEpi == Epilogue::kSwiGLUQuant) {
      Tile::store_swiglu_quant(total0, total1, st, wg, t);
    } else {
      Tile::store_bf16_half(total0, st, 0, wg, t);
      Tile::store_bf16_half(total1, st, Tile::kHalfN, wg, t);
    }
  }

  // Zeros in rows [first, num_rows) of out (e4m3 or bf16), and for kSwiGLUQuant scale 1 for each of their
  // 128-column blocks (an all-zero tile has scale 1, mok_jax.fp8).
  template <Epilogue kEpi, class Params, class Table>
  __device__ static void zero_padding_rows(const Params& p, const Table& table, int t, int num_threads) {
    constexpr bool kQuant = kEpi == Epilogue::kSwiGLUQuant;
    const int64_t first = table.row_start[p.num_groups];
    const int64_t rows = int64_t(p.num_rows) - first;
    const int64_t row_bytes = int64_t(p.n_out) * (kQuant ? 1 : 2);
    const int64_t chunks_per_row = row_bytes / 16;
    auto* out = static_cast<uint8_t*>(p.out.ptr);
    const int64_t ld_bytes = p.out.ld * (kQuant ? 1 : 2);
    const int64_t stride = int64_t(gridDim.x) * num_threads;
    for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < rows * chunks_per_row; idx += stride) {
      const int64_t row = first + idx / chunks_per_row, chunk = idx % chunks_per_row;
      *reinterpret_cast<uint4*>(out + row * ld_bytes + chunk * 16) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kQuant) {
      const int64_t blocks = p.n_out / kFp8ScaleBlock;
      for (int64_t idx = int64_t(blockIdx.x) * num_threads + t; idx < rows * blocks; idx += stride)
        p.out.scale[(idx / rows) * p.num_rows + first + idx % rows] = 1.0f;
    }
  }
};

}  // namespace mok::gemm
