// mok comm: warp-cooperative row movers shared by dispatch and combine.
//
// A row is `nvec` 16-byte vectors (H bf16 values, H a multiple of 8). One warp moves one row:
// lane l handles vectors l, l + 32, ...; each pass keeps kUnroll vectors per lane in flight
// (32 * kUnroll * 16 bytes per warp), which is what hides NVLink and HBM latency with few SMs.
// Destinations (or sources) are held one per lane (lane j <-> top-k slot j, or j-th owner rank)
// and broadcast with shuffles, so one load feeds every destination: a token row crosses NVLink
// once per destination rank and is expanded to its local experts' rows from registers.
//
// Arithmetic of the reductions is fixed: fp32, one rounding per multiply and per add
// (__fmul_rn/__fadd_rn never contract into FMA), slots in ascending lane order, so results are
// bitwise reproducible and equal to the reference.
//
// FP8 rows (the megakernel's FP8 routed experts): a bf16 row is quantised in 1 x 128 tiles as it moves
// (warp_quantize_row: H E4M3 bytes plus H/128 fp32 scales, gemm/fp8_quant.cuh's rule, so the bits of
// mok_jax.fp8.quantize_rows), and a quantised row's scales are scattered to their destinations' scale columns
// (warp_scatter_scales) while its E4M3 bytes move with warp_copy_row.
#pragma once

#include "mok/comm/ptx.cuh"
#include "mok/gemm/fp8_quant.cuh"

namespace mok::comm {

constexpr uint32_t kFullMask = 0xffffffffu;

// Copy src (nvec vectors) to the destination of every lane in `lanes` (lane j's is my_dst).
template <int kUnroll>
__device__ __forceinline__ void warp_copy_row(const int4* src, int nvec, int4* my_dst, uint32_t lanes, int lane) {
  for (int v0 = 0; v0 < nvec; v0 += 32 * kUnroll) {
    int4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v < nvec) buf[u] = ld_v4_na(src + v);
    }
    uint32_t m = lanes;
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      int4* dst = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v < nvec) st_v4(dst + v, buf[u]);
      }
    }
  }
}

// Copy the row of every lane j in `lanes` (my_src, nvec vectors) to its destination (my_dst), kGroup rows' loads in
// flight together; kPrefetch passes (32 kUnroll vectors) ahead of them, lane g prefetches row g's bytes into L2.
template <int kUnroll, int kGroup, int kPrefetch = 0>
__device__ __forceinline__ void warp_copy_rows(const int4* my_src, int4* my_dst, uint32_t lanes, int nvec, int lane) {
  constexpr int kPass = 32 * kUnroll;
  while (lanes) {
    const int4* src[kGroup];
    int4* dst[kGroup];
    bool use[kGroup];  // warp-uniform
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      use[g] = lanes != 0;
      const int j = use[g] ? __ffs(lanes) - 1 : 0;
      if (use[g]) lanes &= lanes - 1;
      src[g] = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), j));
      dst[g] = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), j));
    }
    const auto prefetch = [&](int v) {
      if (v >= nvec) return;
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
        if (use[g] && lane == g) prefetch_l2(src[g] + v, 16 * uint32_t(min(kPass, nvec - v)));
    };
    for (int a = 0; a < kPrefetch; ++a) prefetch(a * kPass);
    for (int v0 = 0; v0 < nvec; v0 += kPass) {
      if (kPrefetch > 0) prefetch(v0 + kPrefetch * kPass);
      int4 buf[kGroup][kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
          if (use[g] && v < nvec) buf[g][u] = ld_v4_na(src[g] + v);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
          if (use[g] && v < nvec) st_v4(dst[g] + v, buf[g][u]);
      }
    }
  }
}

__device__ __forceinline__ void accumulate8(float* acc, const int4& x) {
  const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], bf16_lo(w[i]));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], bf16_hi(w[i]));
  }
}

__device__ __forceinline__ void accumulate8_weighted(float* acc, const int4& x, float wt) {
  const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(wt, bf16_lo(w[i])));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(wt, bf16_hi(w[i])));
  }
}

__device__ __forceinline__ int4 round8(const float* acc) {
  int4 r;
  r.x = int(pack_bf16x2(acc[0], acc[1]));
  r.y = int(pack_bf16x2(acc[2], acc[3]));
  r.z = int(pack_bf16x2(acc[4], acc[5]));
  r.w = int(pack_bf16x2(acc[6], acc[7]));
  return r;
}

// acc[u] (+)= sum over lanes j in `lanes`, ascending, of my_w[j] * rows[my_row[j]] at vector
// v0 + 32u + lane (u < kUnroll), fp32. Slots are taken kGroup at a time so kGroup rows' loads
// (kGroup * kUnroll vectors per lane) are in flight before any is accumulated; the accumulation order
// stays ascending. The loop is latency-bound on HBM reads, so bytes in flight per SM set its speed.
template <int kUnroll, int kGroup>
__device__ __forceinline__ void warp_weighted_partial(const int4* rows, int nvec, int v0, int my_row, float my_w,
                                                      uint32_t lanes, float (&acc)[kUnroll][8], int lane) {
  uint32_t m = lanes;
  while (m) {
    const int4* src[kGroup];
    float wt[kGroup];
    bool use[kGroup];  // warp-uniform
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      use[g] = m != 0;
      const int j = use[g] ? __ffs(m) - 1 : 0;
      if (use[g]) m &= m - 1;
      src[g] = rows + size_t(__shfl_sync(kFullMask, my_row, j)) * nvec;
      wt[g] = __shfl_sync(kFullMask, my_w, j);
    }
    int4 buf[kGroup][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
        if (use[g] && v < nvec) buf[g][u] = ld_v4_na(src[g] + v);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 + lane < nvec)
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
          if (use[g]) accumulate8_weighted(acc[u], buf[g][u], wt[g]);
  }
}

// acc[u] += sum over lanes j in `lanes`, ascending, of my_w[j] * src_j[v0 + 32 u + lane] for u < kUnroll, where lane
// j holds its row's address (my_src) and weight: fp32, one rounding per operation, kGroup rows' loads in flight.
// The rows may sit anywhere (the megakernel's origin sums its own ring rows and its peers' pushed rows so).
template <int kUnroll, int kGroup>
__device__ __forceinline__ void warp_weighted_sources(const int4* my_src, float my_w, uint32_t lanes, int nvec, int v0,
                                                      float (&acc)[kUnroll][8], int lane) {
  uint32_t m = lanes;
  while (m) {
    const int4* src[kGroup];
    float wt[kGroup];
    bool use[kGroup];  // warp-uniform
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      use[g] = m != 0;
      const int j = use[g] ? __ffs(m) - 1 : 0;
      if (use[g]) m &= m - 1;
      src[g] = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), j));
      wt[g] = __shfl_sync(kFullMask, my_w, j);
    }
    int4 buf[kGroup][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
        if (use[g] && v < nvec) buf[g][u] = ld_v4_na(src[g] + v);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 + lane < nvec)
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
          if (use[g]) accumulate8_weighted(acc[u], buf[g][u], wt[g]);
  }
}

// dst = bf16( sum over lanes j in `lanes`, ascending, of my_w[j] * rows[my_row[j]] ), fp32 inside.
template <int kUnroll, int kGroup>
__device__ __forceinline__ void warp_weighted_sum_row(const int4* rows, int nvec, int my_row, float my_w,
                                                      uint32_t lanes, int4* dst, int lane) {
  for (int v0 = 0; v0 < nvec; v0 += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    warp_weighted_partial<kUnroll, kGroup>(rows, nvec, v0, my_row, my_w, lanes, acc, lane);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v < nvec) st_v4(dst + v, round8(acc[u]));
    }
  }
}

// dst = bf16( sum over i < num_src, ascending, of src_i ), fp32 inside; lane i holds src_i.
// Sources are taken two at a time (loads of both in flight), accumulated in ascending order.
template <int kUnroll>
__device__ __forceinline__ void warp_sum_rows(const int4* my_src, int num_src, int nvec, int4* dst, int lane) {
  for (int v0 = 0; v0 < nvec; v0 += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    for (int i = 0; i < num_src; i += 2) {
      const bool two = i + 1 < num_src;  // warp-uniform
      const auto* src_a = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), i));
      const auto* src_b = reinterpret_cast<const int4*>(
          __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_src), two ? i + 1 : i));
      int4 buf_a[kUnroll], buf_b[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v < nvec) {
          buf_a[u] = ld_v4_na(src_a + v);
          if (two) buf_b[u] = ld_v4_na(src_b + v);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * 32 + lane < nvec) {
          accumulate8(acc[u], buf_a[u]);
          if (two) accumulate8(acc[u], buf_b[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v < nvec) st_v4(dst + v, round8(acc[u]));
    }
  }
}

// Quantise src (nvec 16-byte vectors: H = 8 nvec bf16 values, nvec a multiple of 16) in 1 x 128 tiles and store
// it to the destination of every lane in `lanes`: lane j's my_q (H E4M3 bytes) and my_scale (the row's H/128
// scales, scale_stride floats apart). A tile is 16 vectors, one per lane of a half-warp: its amax takes four
// xor-shuffles inside the half, so each pass of a warp quantises two tiles per unrolled vector.
template <int kUnroll>
__device__ __forceinline__ void warp_quantize_row(const int4* src, int nvec, uint8_t* my_q, float* my_scale,
                                                  int64_t scale_stride, uint32_t lanes, int lane) {
  for (int v0 = 0; v0 < nvec; v0 += 32 * kUnroll) {
    int4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      buf[u] = v < nvec ? ld_v4_na(src + v) : make_int4(0, 0, 0, 0);  // a half-warp is all in or all out
    }
    uint2 q[kUnroll];
    float sc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t w[4] = {uint32_t(buf[u].x), uint32_t(buf[u].y), uint32_t(buf[u].z), uint32_t(buf[u].w)};
      float f[8];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = bf16_lo(w[i]);
        f[2 * i + 1] = bf16_hi(w[i]);
        amax = fmaxf(amax, fmaxf(fabsf(f[2 * i]), fabsf(f[2 * i + 1])));
      }
#pragma unroll
      for (int d = 1; d < 16; d *= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, d));
      sc[u] = gemm::fp8_scale_of(amax);
      const float inv = 1.0f / sc[u];  // q = x * (1 / scale), as mok_jax.fp8
      q[u].x = uint32_t(gemm::fp8_pack2(f[0], f[1], inv)) | (uint32_t(gemm::fp8_pack2(f[2], f[3], inv)) << 16);
      q[u].y = uint32_t(gemm::fp8_pack2(f[4], f[5], inv)) | (uint32_t(gemm::fp8_pack2(f[6], f[7], inv)) << 16);
    }
    uint32_t m = lanes;
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      auto* dst = reinterpret_cast<uint2*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_q), j));
      auto* sdst = reinterpret_cast<float*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_scale), j));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v >= nvec) continue;
        dst[v] = q[u];
        if ((lane & 15) == 0) sdst[int64_t(v / 16) * scale_stride] = sc[u];
      }
    }
  }
}

// The num_scales fp32 scales at src (a quantised row's, contiguous) to every lane's my_scale in `lanes`, scale_stride
// floats apart.
__device__ __forceinline__ void warp_scatter_scales(const float* src, int num_scales, float* my_scale,
                                                    int64_t scale_stride, uint32_t lanes, int lane) {
  for (int b0 = 0; b0 < num_scales; b0 += 32) {
    const int b = b0 + lane;
    const float sc = b < num_scales ? __ldcg(src + b) : 0.0f;  // written by a peer in this call: from L2
    uint32_t m = lanes;
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      auto* dst = reinterpret_cast<float*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_scale), j));
      if (b < num_scales) dst[int64_t(b) * scale_stride] = sc;
    }
  }
}

}  // namespace mok::comm
