// mok backward: SLOT(i), the list's last kind: dx and dw of kSlotTokens tokens, each token's slot rows summed in
// slot order. An item type: its run by the 256 consumer threads (its waits are the consumers'); it completes
// nothing that another item waits for.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/backward/waits.cuh"
#include "mok/comm/ptx.cuh"

namespace mok {
namespace {

// Per token t of the item (one per consumer warp): dx[t] = sum_{j ascending} dx_e[pos[t, j]] in fp32, then
// + dxs[t] (the shared expert's, when there is one), dw[t, j] = dw_e[pos[t, j]]; a pos outside the groups'
// rows adds nothing (dw 0). Each lane sums 8 columns at a time, the
// rows of up to kSlotVecs slots loaded before any is added (in slot order).
// Expert parallel: slot j's row is row (t, j) of this rank's bwd_dx (its owner's SEND wrote it) and its dw that
// of bwd_dw, for a slot whose id has an owner ([0, ep E)); the others add nothing and get dw 0, as at EP 1.
__device__ void slot_sum(const KernelParams& p, const SharedStorage& s, const Item& it, int ct) {
  const int lane = ct % 32, t = it.index * kSlotTokens + ct / 32;
  if (t >= p.T) return;
  const int chunks = p.H / 8;
  const bool ep = p.ep > 1;
  const uint4* dx_e = reinterpret_cast<const uint4*>(p.dx_e);
  const int4* recv = ep ? p.view.local<const int4>(p.view.layout.bwd_dx) + int64_t(t) * p.k * chunks : nullptr;
  float4* dx = reinterpret_cast<float4*>(p.dx) + int64_t(t) * chunks * 2;
  const int32_t* pos = ep ? p.topk_idx + int64_t(t) * p.k : p.pos + int64_t(t) * p.k;
  // Rows past the groups hold zeros (dx_rows) but are not read here: their zeroing is no item of the list, so
  // waiting for it would tie the sum to CTAs that may not have started. Adding nothing is adding those zeros
  // (an f32 sum that starts at +0 never holds -0).
  const int32_t used = ep ? p.experts_all : s.table.row_start[p.E];  // pos (EP 1) or the id (EP) is in [0, used)
  const int4* my_row = nullptr;  // lane j < k: slot j's row, when it adds something
  if (lane < p.k) {
    const int32_t r = pos[lane];
    const bool in = r >= 0 && r < used;
    p.dw[int64_t(t) * p.k + lane] =
        !in ? 0.0f : ep ? p.view.local<const float>(p.view.layout.bwd_dw)[int64_t(t) * p.k + lane] : p.dw_e[r];
    if (in) my_row = ep ? recv + int64_t(lane) * chunks : reinterpret_cast<const int4*>(p.dx_e) + int64_t(r) * chunks;
  }
  // kSlotPrefetch passes (32 vectors) ahead of the loads, lane j prefetches slot j's row into L2 and lane 31 the
  // shared expert's dx row (f32): the loads of a pass then wait on L2, not on HBM.
  const float4* xs_row = p.Ts > 0 ? reinterpret_cast<const float4*>(p.dxs) + int64_t(t) * chunks * 2 : nullptr;
  const auto prefetch = [&](int v) {
    if (v >= chunks) return;
    const uint32_t n = uint32_t(min(32, chunks - v));
    if (my_row != nullptr) comm::prefetch_l2(my_row + v, 16 * n);
    if (lane == 31 && xs_row != nullptr) comm::prefetch_l2(xs_row + 2 * v, 32 * n);
  };
  for (int a = 0; a < kSlotPrefetch; ++a) prefetch(32 * a);
  // No shuffles in this loop: when 32 does not divide H / 8, the lanes leave it at different trip counts (a lane
  // that leaves early has issued its prefetches: those of pass i are issued in pass i - kSlotPrefetch, which every
  // lane runs).
  for (int c = lane; c < chunks; c += 32) {
    prefetch(c - lane + 32 * kSlotPrefetch);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 < p.k; j0 += kSlotVecs) {
      uint4 v[kSlotVecs];
      bool in[kSlotVecs];
#pragma unroll
      for (int u = 0; u < kSlotVecs; ++u) {
        const int32_t r = j0 + u < p.k ? pos[j0 + u] : -1;
        in[u] = r >= 0 && r < used;
        if (!in[u]) {
          v[u] = make_uint4(0, 0, 0, 0);
        } else if (ep) {
          const int4 w = comm::ld_v4_na(recv + int64_t(j0 + u) * chunks + c);
          v[u] = *reinterpret_cast<const uint4*>(&w);
        } else {
          v[u] = dx_e[int64_t(r) * chunks + c];
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotVecs; ++u) {
        if (!in[u]) continue;
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(b[q]);
          acc[2 * q] += f.x;
          acc[2 * q + 1] += f.y;
        }
      }
    }
    if (p.Ts > 0) {
      const float4* xs = reinterpret_cast<const float4*>(p.dxs) + int64_t(t) * chunks * 2;
      const float4 a = xs[2 * c], b = xs[2 * c + 1];
      acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
      acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
    }
    dx[2 * c] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dx[2 * c + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

struct SlotItem {
  // Waits for every DX tile and DWSUM item and, expert parallel, every SEND of this rank (its own slot rows are in
  // bwd_dx too) and every peer's (kBwdSigDx): one wait of each kind, as their verdicts have a word each. False: a
  // wait failed.
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it) {
    const KernelParams& p = x.p;
    const Counters& c = x.c;
    const Shape& h = x.h;
    if (!consumers_wait<3>(x.s, {c.totals + 0, c.totals + 1, c.totals + 3},
                           {h.begin[kDx + 1] - h.begin[kDx], h.begin[kDwSum + 1] - h.begin[kDwSum],
                            p.ep > 1 ? x.s.table.tile_start[p.E] : 0},
                           p, c.wait_ns + kSlot, x.ct))
      return false;
    if (p.ep > 1 && !consumers_wait_peers(x.s, p, comm::kBwdSigDx, x.epoch, comm::kErrTimeoutData, x.epoch,
                                          c.wait_ns + kSlot, x.ct))
      return false;
    slot_sum(p, x.s, it, x.ct);
    return true;
  }
};

}  // namespace
}  // namespace mok
