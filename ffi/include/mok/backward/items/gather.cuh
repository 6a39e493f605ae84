// mok backward: GATHER(m): the rows of m-block m (x, dy and the router weight of each row's slot; kept g, u) into
// the op's row layout. An item type: its run by the 256 consumer threads and its completion by one of them.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/backward/waits.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok {
namespace {

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

struct GatherItem {
  // Expert parallel, every peer's rows are shared first (kBwdSigX). False: the wait failed.
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it) {
    const KernelParams& p = x.p;
    if (p.ep > 1 && !consumers_wait_peers(x.s, p, comm::kBwdSigX, x.epoch, comm::kErrTimeoutData, x.epoch,
                                          x.c.wait_ns + kGather, x.ct))
      return false;
    gather(p, it, x.ct);
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    atomicAdd(c.gathered + it.mb, 1), atomicAdd(c.gathered_e + it.group, 1);
  }
};

}  // namespace
}  // namespace mok
