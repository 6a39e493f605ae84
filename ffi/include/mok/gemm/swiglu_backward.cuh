// mok gemm: the SwiGLU backward, as the epilogue of the down-projection dgrad GEMM.
//
// The tile's accumulator holds dh'[r, c] = sum_h dy[r, h] * down[e][c, h] for 256 columns c of I (the
// gradient of the expert's output before the router weight). With g, u = the gate/up pre-activations of
// the same row (recomputed in fp32, as the forward's epilogue has them), w = the slot's router weight and
// s = sigmoid(g):
//   h        = silu(g) * u                            (fp32; the forward rounds it to bf16 only after)
//   dw_part  = sum_c dh'[r, c] * h[r, c]              the router-weight gradient's share of this tile
//   dh       = w * dh'
//   dg       = dh * u * s * (1 + g * (1 - s)),   du = dh * silu(g)      -> dgu[r] = bf16([dg | du])
//   hw       = bf16(w * h)                            (the down projection's weight-gradient operand)
// The router-weight gradient needs no division by w, so a zero weight still gets its gradient.
//
// dw_part is summed over a thread's columns in ascending order, then over the 4 lanes that share a row by
// an xor butterfly (a + b == b + a in floating point, so every lane holds the same bits); the caller sums
// the n-blocks' partials in ascending order: a fixed order, no atomics.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::gemm {

struct SwigluBackwardOut {
  const float* gu;          // [M, 2I]: g in columns [0, I), u in [I, 2I)
  const float* w;           // [M]: the router weight of each row's slot (0 for padding rows); unread without
                            // a router weight (kWeighted = false: the shared expert's rows, weight 1)
  __nv_bfloat16* dgu;       // [M, 2I]: dg | du
  __nv_bfloat16* hw;        // [M, I]: bf16(w * h)
  float* dw_part;           // [M, n_blocks]: per-tile partial sums of dh' * h; unwritten without a router weight
  int32_t inter;            // I
  int32_t n_blocks;         // ceil(I / 256)
};

// acc: one consumer warpgroup's 64 x 256 wgmma fragment (value i of thread t sits at row
// 16 (t/32) + (t%32)/4 + 8 ((i/2)%2), column 8 (i/4) + 2 (t%4) + i%2). row0: the warpgroup's first row.
// kWeighted = false: rows without a router weight (w = 1, no dw partials: the shared expert), a separate
// instance so that the routed epilogue keeps its code.
template <class Accumulator, int kBatch = 2, bool kWeighted = true>
__device__ __forceinline__ void swiglu_backward_store(const Accumulator& acc, const SwigluBackwardOut& o, int row0,
                                                      int row_end, int col0, int n_block, int t) {
  const int lane = t % 32, warp = t / 32;
  const int r_base = row0 + 16 * warp + lane / 4;
  const int c_base = col0 + 2 * (lane % 4);
  const int64_t ld2 = 2 * int64_t(o.inter);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r_base + 8 * hh;
    const bool in = row < row_end;
    const float w = !in ? 0.0f : kWeighted ? o.w[row] : 1.0f;
    float sum = 0.0f;
    // Two column pairs at a time (four spill with fp32 g, u): their 4 loads are issued before any is used,
    // so the epilogue waits on memory once per batch rather than once per pair.
#pragma unroll
    for (int qb = 0; qb < 32; qb += kBatch) {
      float2 g2[kBatch], u2[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int col = c_base + 8 * (qb + b);
        const bool ok = in && col < o.inter;
        g2[b] = ok ? *reinterpret_cast<const float2*>(o.gu + row * ld2 + col) : make_float2(0.f, 0.f);
        u2[b] = ok ? *reinterpret_cast<const float2*>(o.gu + row * ld2 + o.inter + col) : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int q = qb + b;
        const int i = 4 * q + 2 * hh;
        const int col = c_base + 8 * q;
        const float g[2] = {g2[b].x, g2[b].y};
        const float u[2] = {u2[b].x, u2[b].y};
        float dg[2], du[2], hw[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float s = 1.0f / (1.0f + __expf(-g[e]));
          const float silu = g[e] * s;
          const float h = silu * u[e];
          const float dhp = acc(i + e);
          // Past I the tile's second B half may not be loaded (sm90_tile.cuh skips a half that lies wholly
          // past n_b), so dh' there is stale shared memory, possibly NaN: those columns add nothing.
          if (kWeighted && col < o.inter) sum += dhp * h;
          const float dh = w * dhp;
          dg[e] = dh * u[e] * s * (1.0f + g[e] * (1.0f - s));
          du[e] = dh * silu;
          hw[e] = w * h;
        }
        if (in && col < o.inter) {
          *reinterpret_cast<__nv_bfloat162*>(o.dgu + row * ld2 + col) = __floats2bfloat162_rn(dg[0], dg[1]);
          *reinterpret_cast<__nv_bfloat162*>(o.dgu + row * ld2 + o.inter + col) = __floats2bfloat162_rn(du[0], du[1]);
          *reinterpret_cast<__nv_bfloat162*>(o.hw + row * int64_t(o.inter) + col) = __floats2bfloat162_rn(hw[0], hw[1]);
        }
      }
    }
    if constexpr (kWeighted) {
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (in && lane % 4 == 0) o.dw_part[int64_t(row) * o.n_blocks + n_block] = sum;
    }
  }
}

}  // namespace mok::gemm
