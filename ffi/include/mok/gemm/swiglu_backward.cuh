// mok gemm: the SwiGLU backward, as the epilogue of the down-projection dgrad GEMM.
//
// The tile's accumulator holds dh'[r, c] = sum_h dy[r, h] * down[e][c, h] for 256 columns c of I (the
// gradient of the expert's output before the router weight). With g, u = the gate/up pre-activations of
// the same row (the fp32 accumulators of the forward's epilogue, or of the recompute, rounded to bf16 when
// they were stored: the backward's one rounding of them, the same whichever produced them), w = the slot's
// router weight and s = sigmoid(g):
//   h        = silu(g) * u                            (fp32 from the bf16 g, u)
//   dw_part  = sum_c dh'[r, c] * h[r, c]              the router-weight gradient's share of this tile
//   dh       = w * dh'
//   dg       = dh * u * s * (1 + g * (1 - s)),   du = dh * silu(g)      -> dgu[r] = bf16([dg | du])
//   hw       = bf16(w * h)                            (the down projection's weight-gradient operand)
// The router-weight gradient needs no division by w, so a zero weight still gets its gradient.
//
// g, u reach the epilogue through the tile's stage ring, not by loads from its registers: the producer follows
// the tile's k-tiles with up to 4 chunk stages (load_gu_chunks), each the tile's 128 rows of 64 g columns (in the
// stage's A bytes) and of the 64 matching u columns (the first 16 KB of its B bytes), bf16 rows of 128 bytes,
// 128B-swizzled, by TMA. Loaded by each thread itself (64 loads of 8 bytes, a few in flight: more spill with the
// 128-value accumulator), the epilogue waited on memory latency ~32 times per tile: kimi-k2's DH items took
// 1.10 ms per SM where a plain GEMM of their FLOPs takes 0.73. The chunks' loads now run while the tile's last
// k-tiles and the previous chunks are computed. In bf16 a tile's g, u are half the bytes of fp32 (and of the
// forward's kept buffer): 4 chunk stages where fp32 took 8.
//
// dw_part is summed over a thread's columns in ascending order (chunk by chunk), then over the 4 lanes that share
// a row by an xor butterfly (a + b == b + a in floating point, so every lane holds the same bits); the caller
// sums the n-blocks' partials in ascending order: a fixed order, no atomics.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "mok/gemm/silu_math.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok::gemm {

struct SwigluBackwardOut {
  const __nv_bfloat16* gu;  // [M, 2I]: g in columns [0, I), u in [I, 2I) (read through the stage ring, by TMA)
  const float* w;           // [M]: the router weight of each row's slot (0 for padding rows); unread without
                            // a router weight (kWeighted = false: the shared expert's rows, weight 1)
  __nv_bfloat16* dgu;       // [M, 2I]: dg | du
  __nv_bfloat16* hw;        // [M, I]: bf16(w * h)
  float* dw_part;           // [M, n_blocks]: per-tile partial sums of dh' * h; unwritten without a router weight
  int32_t inter;            // I
  int32_t n_blocks;         // ceil(I / 256)
};

// ---- g, u chunks through the stage ring --------------------------------------------------------------
using GuElement = cutlass::bfloat16_t;  // g, u as stored (layout-compatible with __nv_bfloat16)
constexpr int kGuChunkRows = 128;  // the tile's rows
constexpr int kGuChunkCols = 64;   // bf16 columns per chunk: one 128-byte swizzle row
constexpr int kGuChunkElems = kGuChunkRows * kGuChunkCols;
constexpr uint32_t kGuChunkStageBytes = 2 * kGuChunkElems * sizeof(GuElement);  // g and u
using GuChunkLayout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<GuElement>{},
                                                   cute::Shape<cute::Int<kGuChunkRows>, cute::Int<kGuChunkCols>>{}));
static_assert(kGuChunkElems * sizeof(GuElement) <= sizeof(StageRing::a) / StageRing::kStages &&
                  kGuChunkElems * sizeof(GuElement) <= sizeof(StageRing::b) / StageRing::kStages,
              "a chunk's g fits a stage's A bytes and its u a stage's B bytes");
static_assert(sizeof(GuElement) == sizeof(__nv_bfloat16), "one bf16 element type in memory");
static_assert(2 * kGuChunkElems * sizeof(GuElement) <= sizeof(StageRing::b) / StageRing::kStages,
              "a chunk's hw fits the stage's B bytes past its u (swiglu_backward_store writes it there)");

// gu as TMA sees it: [rows, 2 inter] bf16, row-major, in boxes of 128 rows x 64 columns.
inline auto make_tma_gu(const __nv_bfloat16* gu, int rows, int inter) {
  using namespace cute;
  Tensor g = make_tensor(make_gmem_ptr(reinterpret_cast<const GuElement*>(gu)), make_shape(rows, 2 * inter),
                         make_stride(int64_t(2) * inter, Int<1>{}));
  return make_tma_copy(SM90_TMA_LOAD{}, g, GuChunkLayout{}, Shape<Int<kGuChunkRows>, Int<kGuChunkCols>>{}, Int<1>{});
}
using TmaGu = decltype(make_tma_gu(nullptr, 0, 0));

// Chunks of the tile at column col0 of I: those that hold a column below I (a tile's last ones may not).
__device__ __forceinline__ int gu_chunks(int inter, int col0) {
  const int left = (inter - col0 + kGuChunkCols - 1) / kGuChunkCols;
  return left < 256 / kGuChunkCols ? left : 256 / kGuChunkCols;
}

// Where value (r, c) of a chunk sits, in elements from the chunk's start: TMA's 128-byte swizzle over the chunk's
// 1024-byte-aligned 8-row atoms moves row r's 16-byte unit c / 8 (8 bf16) to unit (c / 8) ^ (r % 8).
// (GuChunkLayout{}(r, c) is not this: its swizzle functor is in bytes, meant for a swizzled smem pointer, not for
// element offsets.)
__device__ __forceinline__ int gu_chunk_at(int r, int c) {
  return kGuChunkCols * r + ((((c >> 3) ^ r) & 7) << 3) + (c & 7);
}

__device__ __forceinline__ GuElement* gu_chunk_g(StageRing& s, int stage) {
  return reinterpret_cast<GuElement*>(s.a) + stage * (sizeof(StageRing::a) / StageRing::kStages / sizeof(GuElement));
}
__device__ __forceinline__ GuElement* gu_chunk_u(StageRing& s, int stage) {
  return reinterpret_cast<GuElement*>(s.b) + stage * (sizeof(StageRing::b) / StageRing::kStages / sizeof(GuElement));
}

// Producer (one thread), after the tile's k-tiles: its g, u chunks, rows [row0, row0 + 128) of the rows x 2I
// matrix gu (tma must be a kernel parameter; rows past `rows` come as zeros and are never stored).
__device__ inline bool load_gu_chunks(const TmaGu& tma, StageRing& s, RingPos& pos, int rows, int inter, int row0,
                                      int col0, int32_t* status) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(make_shape(rows, 2 * inter));
  const int n = gu_chunks(inter, col0);
  for (int j = 0; j < n; ++j) {
    if (!mbarrier_wait(&s.empty[pos.stage], pos.phase ^ 1, status)) return false;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[pos.stage], kGuChunkStageBytes);
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {  // g columns col0 + 32 j.., then their u columns I + col0 + 32 j..
      Tensor gm = local_tile(domain_offset(make_coord(row0, half * inter + col0 + j * kGuChunkCols), m),
                             Shape<Int<kGuChunkRows>, Int<kGuChunkCols>>{}, make_coord(0, 0));
      Tensor sm = make_tensor(make_smem_ptr(half ? gu_chunk_u(s, pos.stage) : gu_chunk_g(s, pos.stage)),
                              GuChunkLayout{});
      auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sm), group_modes<0, 2>(gm));
      copy(tma.with(s.full[pos.stage]), tg, ts);
    }
    pos.advance();
  }
  return true;
}

// ---- the epilogue ------------------------------------------------------------------------------------
// One value of the SwiGLU backward (see the top of the file) from g's sigmoid s = 1 / x, x = 1 + exp(-g)
// (sigmoid_denominator, then rcp_in_range or an exact 1 / x); h is returned for the router-weight partial.
struct SwigluGrad {
  float dg, du, hw, h;
};
__device__ __forceinline__ SwigluGrad swiglu_grad(float dhp, float g, float u, float w, float s) {
  const float silu = g * s;
  const float h = silu * u;
  const float dh = w * dhp;
  return SwigluGrad{dh * u * s * (1.0f + g * (1.0f - s)), dh * silu, w * h, h};
}

// The router weights of the thread's two rows of the tile (see swiglu_backward_store: r_local and r_local + 8), 0
// past row_end, 1 without a router weight (kWeighted = false). The caller loads them before the tile's MMAs, once
// w is visible to it (the backward: the stage ring's first full barrier passes on the producer's acquire of the
// gather that wrote it): issued after the MMAs, the load's latency under a busy memory system was the DH epilogue's
// longest single wait (40% of its stall samples on kimi-k2).
struct RowWeights {
  float w[2];
};
template <bool kWeighted = true>
__device__ __forceinline__ RowWeights swiglu_row_weights(const SwigluBackwardOut& o, int tile_row0, int row_end,
                                                        int wg, int t) {
  const int r_local = 64 * wg + 16 * (t / 32) + (t % 32) / 4;
  RowWeights w;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = tile_row0 + r_local + 8 * hh;
    w.w[hh] = !(row < row_end) ? 0.0f : kWeighted ? o.w[row] : 1.0f;
  }
  return w;
}

// One chunk's dg, du and hw of warpgroup wg's 64 rows, from the stage (where the epilogue wrote them, in the chunk's
// swizzled layout) to dgu and hw, 16 bytes a store, 8 threads a row's 128 bytes: whole 128-byte lines where the
// epilogue's own stores wrote 4 bytes each. Rows past row_end and columns past I are not stored (I is a multiple
// of 8, so a 16-byte unit is wholly in or out).
__device__ __forceinline__ void store_chunk(const SwigluBackwardOut& o, const __nv_bfloat16* sg,
                                            const __nv_bfloat16* su, const __nv_bfloat16* sh, int tile_row0,
                                            int row_end, int chunk_col0, int wg, int t) {
  constexpr int kUnits = kGuChunkCols / 8;  // 16-byte units of a row's chunk
#pragma unroll
  for (int which = 0; which < 3; ++which) {  // dg, du, hw
    const __nv_bfloat16* src = which == 0 ? sg : which == 1 ? su : sh;
#pragma unroll
    for (int j = 0; j < 64 * kUnits / 128; ++j) {
      const int idx = t + 128 * j;
      const int r = 64 * wg + idx / kUnits, unit = idx % kUnits;
      const int row = tile_row0 + r, col = chunk_col0 + 8 * unit;
      const uint4 v = *reinterpret_cast<const uint4*>(src + gu_chunk_at(r, 8 * unit));
      if (row < row_end && col < o.inter) {
        __nv_bfloat16* dst = which == 2 ? o.hw + int64_t(row) * o.inter + col
                                        : o.dgu + int64_t(row) * (2 * int64_t(o.inter)) + col + which * o.inter;
        *reinterpret_cast<uint4*>(dst) = v;
      }
    }
  }
}

// acc: one consumer warpgroup's 64 x 256 wgmma fragment (value i of thread t sits at row
// 16 (t/32) + (t%32)/4 + 8 ((i/2)%2), column 8 (i/4) + 2 (t%4) + i%2). tile_row0: the tile's first row; wg: the
// warpgroup (rows 64 wg..). Consumes the tile's gu_chunks(inter, col0) chunk stages at pos, each freed by every
// consumer warp when it is done with it. kWeighted = false: rows without a router weight (w = 1, no dw partials:
// the shared expert), a separate instance so that the routed epilogue keeps its code.
//
// The accumulator first goes to the thread's local memory (32 stores of 16 bytes: dh[q] = the thread's column pair q
// of its two rows), and a loop over quarter chunks (2 column pairs, 8 values; more spill) reads it back at run time,
// the next quarter's loads in flight while this one is computed, and the 8 values computed side by side (one
// warp-wide check sends a quarter with a denominator outside rcp_in_range's range to the exact 1 / x, whose
// compiled form branches per value). Fully unrolled over the 128 values (the form before), the epilogue was about
// 13,500 instructions per instance: the warps streamed 216 KB of code from L2 once per tile and waited on
// instruction fetch for half their cycles. The values, the order of every sum and so every output bit are those of
// the unrolled form: the loops visit (chunk, column pair) in the same ascending order for each of the thread's two
// rows.
//
// The outputs leave through the chunk's stage: each value's dg over its g, du over its u, hw in the stage's B bytes
// past u at the same place, then, once the warpgroup's 64 rows are there (named barrier 1 + wg), store_chunk copies
// them out in 16-byte units, 8 threads to a row's 128 bytes. Stored from the registers, each of the 192 stores a
// thread made per tile wrote 4 bytes, 16 bytes of a row per warp store.
template <class Accumulator, bool kWeighted = true>
__device__ __forceinline__ bool swiglu_backward_store(const Accumulator& acc, const SwigluBackwardOut& o,
                                                      const RowWeights& w, StageRing& s, RingPos& pos,
                                                      int tile_row0, int row_end, int col0, int n_block, int wg,
                                                      int t, int32_t* status) {
  constexpr int kSteps = 4;                          // per chunk
  constexpr int kPairs = kGuChunkCols / 8 / kSteps;  // the thread's column pairs per step (8 columns apart)
  constexpr int kAhead = 2;  // steps between a dh' read and its use (3 spilled 32 / 64 bytes in the production form)
  const int lane = t % 32, warp = t / 32;
  const int r_local = 64 * wg + 16 * warp + lane / 4;  // and r_local + 8
  const int c_lane = 2 * (lane % 4);
  float4 dh[256 / 8];  // dh'[q]: the thread's column pair q of its rows r_local (x, y) and r_local + 8 (z, w)
#pragma unroll
  for (int q = 256 / 8 - 1; q >= 0; --q)  // last pair first: the pairs read first are the last written (in L1)
    dh[q] = make_float4(acc(4 * q), acc(4 * q + 1), acc(4 * q + 2), acc(4 * q + 3));
  float sum[2] = {0.0f, 0.0f};
  const int steps = kSteps * gu_chunks(o.inter, col0);
  // ahead[a]: the dh' of step st + 1 + a, read kAhead steps before it is computed (each read is an L2 round trip:
  // the 128 KB a CTA keeps there do not fit its L1 beside the shared memory)
  float4 cur[kPairs], ahead[kAhead][kPairs];
#pragma unroll
  for (int v = 0; v < kPairs; ++v) cur[v] = dh[v];
#pragma unroll
  for (int a = 0; a < kAhead; ++a)
#pragma unroll
    for (int v = 0; v < kPairs; ++v) ahead[a][v] = 1 + a < steps ? dh[kPairs * (1 + a) + v] : make_float4(0, 0, 0, 0);
#pragma unroll 1
  for (int st = 0; st < steps; ++st) {
    const int step = st % kSteps;  // of chunk st / kSteps
    if (step == 0 && !mbarrier_wait(&s.full[pos.stage], pos.phase, status)) return false;
    float4 next[kPairs];  // step st + 1 + kAhead's, in flight while this step and the kAhead - 1 after it run
    if (st + 1 + kAhead < steps) {
#pragma unroll
      for (int v = 0; v < kPairs; ++v) next[v] = dh[kPairs * (st + 1 + kAhead) + v];
    }
    auto* sg = reinterpret_cast<__nv_bfloat16*>(gu_chunk_g(s, pos.stage));
    auto* su = reinterpret_cast<__nv_bfloat16*>(gu_chunk_u(s, pos.stage));
    __nv_bfloat16* sh = su + kGuChunkElems;  // hw's place: the stage's B bytes past u
    float2 g2[kPairs][2], u2[kPairs][2], s2[kPairs][2];  // s2: the denominators x, then their reciprocals
    int at[kPairs][2];  // where each value pair's g, u are read and its dg, du, hw written back
    bool exact = false;
#pragma unroll
    for (int v = 0; v < kPairs; ++v) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        // two adjacent columns share a 16-byte swizzle unit, so they are adjacent in the chunk too; the swizzle
        // sees a row's r % 8 only, so row r_local + 8 sits 8 whole rows further
        at[v][hh] = gu_chunk_at(r_local, 8 * (kPairs * step + v) + c_lane) + 8 * kGuChunkCols * hh;
        g2[v][hh] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sg + at[v][hh]));
        u2[v][hh] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(su + at[v][hh]));
        s2[v][hh] = make_float2(sigmoid_denominator(g2[v][hh].x), sigmoid_denominator(g2[v][hh].y));
        exact |= !(s2[v][hh].x < kRcpInRangeEnd) || !(s2[v][hh].y < kRcpInRangeEnd);
      }
    }
    if (__any_sync(0xffffffffu, exact)) {  // g below about -87, or NaN: 1.0f / x itself
#pragma unroll
      for (int v = 0; v < kPairs; ++v)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) s2[v][hh] = make_float2(1.0f / s2[v][hh].x, 1.0f / s2[v][hh].y);
    } else {
#pragma unroll
      for (int v = 0; v < kPairs; ++v)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          s2[v][hh] = make_float2(rcp_in_range(s2[v][hh].x), rcp_in_range(s2[v][hh].y));
    }
#pragma unroll
    for (int v = 0; v < kPairs; ++v) {
      const int q = kPairs * st + v;  // the thread's column pair 8 q + c_lane of the tile
      // Past I the tile's second B half may not be loaded (sm90_tile.cuh skips a half that lies wholly past
      // n_b), so dh' there is stale shared memory, possibly NaN: those columns add nothing (and are not stored).
      const bool col_in = col0 + 8 * q + c_lane < o.inter;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float d0 = hh ? cur[v].z : cur[v].x, d1 = hh ? cur[v].w : cur[v].y;
        const SwigluGrad a = swiglu_grad(d0, g2[v][hh].x, u2[v][hh].x, w.w[hh], s2[v][hh].x);
        const SwigluGrad b = swiglu_grad(d1, g2[v][hh].y, u2[v][hh].y, w.w[hh], s2[v][hh].y);
        if (kWeighted && col_in) sum[hh] += d0 * a.h, sum[hh] += d1 * b.h;
        // dg over the g it came from, du over its u, hw in the same place of hw's: only this thread reads or
        // writes these 4 bytes of each, so no barrier stands between its reads and its writes
        *reinterpret_cast<__nv_bfloat162*>(sg + at[v][hh]) = __floats2bfloat162_rn(a.dg, b.dg);
        *reinterpret_cast<__nv_bfloat162*>(su + at[v][hh]) = __floats2bfloat162_rn(a.du, b.du);
        *reinterpret_cast<__nv_bfloat162*>(sh + at[v][hh]) = __floats2bfloat162_rn(a.hw, b.hw);
      }
    }
    if (step == kSteps - 1) {  // the chunk is done: its rows out in 16-byte units, then the stage freed
      // The stage is next written by TMA (the async proxy) over these generic writes.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      named_barrier_sync(1 + wg, 128);  // the warpgroup's 64 rows are in the stage
      store_chunk(o, sg, su, sh, tile_row0, row_end, col0 + kGuChunkCols * (st / kSteps), wg, t);
      __syncwarp();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[pos.stage]);
      pos.advance();
    }
#pragma unroll
    for (int v = 0; v < kPairs; ++v) {
      cur[v] = ahead[0][v];
#pragma unroll
      for (int a = 0; a + 1 < kAhead; ++a) ahead[a][v] = ahead[a + 1][v];
      ahead[kAhead - 1][v] = next[v];
    }
  }
  if constexpr (kWeighted) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float v = sum[hh];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      const int row = tile_row0 + r_local + 8 * hh;
      if (row < row_end && lane % 4 == 0) o.dw_part[int64_t(row) * o.n_blocks + n_block] = v;
    }
  }
  return true;
}

}  // namespace mok::gemm
