// mok backward: the backward megakernel's row items, which the consumer warps run without a GEMM: SHARE
// (share_rows), GATHER (gather), SEND (send_rows), DWSUM (dw_sum) and SLOT (slot_sum), one warp per row or per
// token; and, expert parallel, the epoch stamps they publish to the peers and wait for (publish,
// consumers_wait_peers) and where a slot's rows live (slot_home).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/backward/items.cuh"
#include "mok/backward/params.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok {
namespace {

// ---- consumers: row items --------------------------------------------------------------------------------
// Expert parallel, one thread: this call's epoch into row `row` of every peer's bwd_stamps (after a system fence
// that orders every store this rank's items made before, through the counters the caller acquired).
__device__ void publish(const KernelParams& p, int row, uint64_t epoch) {
  comm::publish_stamps(p.view, p.view.layout.bwd_stamps, row, epoch);
}

// The consumers wait until every peer stamped row `row` of this rank's bwd_stamps with at least `target` (one
// thread waits, bounded; a timeout poisons the workspace, a poisoned one stops it). On failure the status bits
// stop every other wait of the rank too. Its verdict has its own word (SharedStorage::peer_ok): an item makes at
// most one such wait and one consumers_wait, in either order.
__device__ bool consumers_wait_peers(SharedStorage& s, const KernelParams& p, int row, uint64_t target, uint32_t code,
                                     uint64_t epoch, unsigned long long* wait_ns, int ct) {
  if (ct == 0) {
    const uint64_t t0 = gemm::global_timer_ns();
    const bool ok = comm::wait_stamps(p.view, p.view.layout.bwd_stamps, row, target, code, comm::kOpMoeBackward, epoch);
    if (!ok) atomicOr(p.status, gemm::kStatusWaitTimeout | kExpertsBackwardStatusComm);
    s.peer_ok = ok;
    atomicAdd(wait_ns, (unsigned long long)(gemm::global_timer_ns() - t0));
  }
  gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
  return s.peer_ok != 0;
}

// Expert parallel: where the rows of slot `slot` (< Tn k) come from and go to: its token's rank and row there.
struct SlotHome {
  int32_t rank, t, j;
};
__device__ __forceinline__ SlotHome slot_home(const KernelParams& p, int64_t slot) {
  const int64_t tg = slot / p.k;
  return SlotHome{int32_t(tg / p.T), int32_t(tg % p.T), int32_t(slot % p.k)};
}

// SHARE(i), i < share_items: rows [T i / n, T (i + 1) / n) of x and dy into this rank's bwd_x, bwd_dy (one warp
// per row), where the owners of its slots read them.
__device__ void share_rows(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32, chunks = p.H / 8;
  const int64_t r0 = int64_t(p.T) * it.index / p.share_items, r1 = int64_t(p.T) * (it.index + 1) / p.share_items;
  int4* xd = p.view.local<int4>(p.view.layout.bwd_x);
  int4* dd = p.view.local<int4>(p.view.layout.bwd_dy);
  const int4* xs = reinterpret_cast<const int4*>(p.x);
  const int4* ds = reinterpret_cast<const int4*>(p.dy);
  for (int64_t r = r0 + warp; r < r1; r += kConsumers / 32) {  // one destination each: lane 0's
    comm::warp_copy_row<kCopyVecs>(xs + r * chunks, chunks, xd + r * chunks, 1u, lane);
    comm::warp_copy_row<kCopyVecs>(ds + r * chunks, chunks, dd + r * chunks, 1u, lane);
  }
}

// Rows [row0, row_end): x_e[r] = x[s / k], dy_e[r] = dy[s / k], w_e[r] = topk_weight[s] for the row's slot s,
// zeros for a padding row (or a slot id out of range), and with kept g, u zeros in a padding row's g | u. In a
// block of part-kept g, u (block_kept) also gu[r] = gu_part[gu_part_row[r]] (zeros for a row without one: a
// padding row, what the recompute gives it); the block's DH items read it after this item's release.
// Expert parallel: a token of another rank is read from that rank's shared bwd_x, bwd_dy (over NVLink).
// One warp per row, kGatherVecs 16-byte vectors of each source in flight per lane.
__device__ void gather(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32;
  const int chunks = p.H / 8;
  const int64_t slots = int64_t(p.Tn) * p.k;
  const bool copy_gu = block_kept(p, it.mb);
  for (int r = it.row0 + warp; r < it.row_end; r += kConsumers / 32) {
    const int64_t slot = p.src_slot[r];
    const bool valid = slot >= 0 && slot < slots;
    uint4* xd = p.x_e + int64_t(r) * chunks;
    uint4* dd = p.dy_e + int64_t(r) * chunks;
    if (valid) {
      const uint4* xs = p.x + (slot / p.k) * chunks;
      const uint4* ds = p.dy + (slot / p.k) * chunks;
      if (p.ep > 1) {
        const SlotHome home = slot_home(p, slot);
        const int64_t at = int64_t(home.t) * chunks;
        xs = home.rank == p.view.rank ? p.x + at : p.view.peer<const uint4>(home.rank, p.view.layout.bwd_x) + at;
        ds = home.rank == p.view.rank ? p.dy + at : p.view.peer<const uint4>(home.rank, p.view.layout.bwd_dy) + at;
      }
      for (int c0 = lane; c0 < chunks; c0 += 32 * kGatherVecs) {
        int4 a[kGatherVecs], b[kGatherVecs];
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u)
          if (c0 + 32 * u < chunks)
            a[u] = comm::ld_v4_na(reinterpret_cast<const int4*>(xs) + c0 + 32 * u),
            b[u] = comm::ld_v4_na(reinterpret_cast<const int4*>(ds) + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u)
          if (c0 + 32 * u < chunks)
            xd[c0 + 32 * u] = *reinterpret_cast<const uint4*>(&a[u]),
            dd[c0 + 32 * u] = *reinterpret_cast<const uint4*>(&b[u]);
      }
    } else {
      for (int c = lane; c < chunks; c += 32) xd[c] = make_uint4(0, 0, 0, 0), dd[c] = make_uint4(0, 0, 0, 0);
      if (p.kept) {  // a row's 2I bf16 are I / 4 16-byte vectors (I is a multiple of 8)
        uint4* g = reinterpret_cast<uint4*>(p.gu + int64_t(r) * 2 * p.I);
        for (int c = lane; c < p.I / 4; c += 32) g[c] = make_uint4(0, 0, 0, 0);
      }
    }
    if (copy_gu) {
      const int32_t src = p.gu_part_row[r];
      const bool has = src >= 0 && src < p.gu_part_rows;
      const uint4* gs = reinterpret_cast<const uint4*>(p.gu_part + int64_t(has ? src : 0) * 2 * p.I);
      uint4* g = reinterpret_cast<uint4*>(p.gu + int64_t(r) * 2 * p.I);
#pragma unroll 4
      for (int c = lane; c < p.I / 4; c += 32) g[c] = has ? __ldg(gs + c) : make_uint4(0, 0, 0, 0);
    }
    if (lane == 0) p.w_e[r] = valid ? p.topk_weight[slot] : 0.0f;
  }
  gemm::fence_proxy_async_global();  // the GEMM tiles read x_e and dy_e through TMA
}

// SEND(m) (expert parallel): each slot row r of m-block m: dx_e[r] into its token's rank's bwd_dx at (t, j) and
// dw_e[r] into its bwd_dw (a peer's over NVLink, or this rank's own); padding rows send nothing.
__device__ void send_rows(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32, chunks = p.H / 8;
  const int64_t slots = int64_t(p.Tn) * p.k;
  const int4* dx_e = reinterpret_cast<const int4*>(p.dx_e);
  for (int r = it.row0 + warp; r < it.row_end; r += kConsumers / 32) {
    const int64_t slot = p.src_slot[r];
    if (slot < 0 || slot >= slots) continue;
    const SlotHome home = slot_home(p, slot);
    const int64_t cell = int64_t(home.t) * p.k + home.j;
    int4* dst = p.view.peer<int4>(home.rank, p.view.layout.bwd_dx) + cell * chunks;
    comm::warp_copy_row<kCopyVecs>(dx_e + int64_t(r) * chunks, chunks, dst, 1u, lane);  // one destination
    if (lane == 0) p.view.peer<float>(home.rank, p.view.layout.bwd_dw)[cell] = p.dw_e[r];
  }
}

// dw_e[r] = the sum over n-blocks (ascending) of dw_part[r, :], rows of m-block mb.
__device__ void dw_sum(const KernelParams& p, const Shape& h, const Item& it, int ct) {
  for (int r = it.row0 + ct; r < it.row_end; r += kConsumers) {
    float acc = 0.0f;
    for (int b = 0; b < h.nb_dh; ++b) acc += p.bwd.dw_part[int64_t(r) * h.nb_dh + b];
    p.dw_e[r] = acc;
  }
}

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
  if (lane < p.k) {
    const int32_t r = pos[lane];
    const bool in = r >= 0 && r < used;
    p.dw[int64_t(t) * p.k + lane] =
        !in ? 0.0f : ep ? p.view.local<const float>(p.view.layout.bwd_dw)[int64_t(t) * p.k + lane] : p.dw_e[r];
  }
  // No shuffles in this loop: when 32 does not divide H / 8, the lanes leave it at different trip counts.
  for (int c = lane; c < chunks; c += 32) {
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

}  // namespace
}  // namespace mok
