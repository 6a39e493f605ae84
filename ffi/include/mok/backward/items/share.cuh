// mok backward: SHARE, expert parallel only: a rank's x and dy rows into its workspace (bwd_x, bwd_dy), where
// the owners of its slots read them (GATHER). An item type: its run by the 256 consumer threads (its waits are
// the consumers') and its completion by one of them.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/backward/waits.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"

namespace mok {
namespace {

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

struct ShareItem {
  // No peer may still read the previous call's shared rows (their kBwdDone); SHARE(i < share_items) copies its
  // rows, the last waits for every other SHARE, then stamps kBwdSigX in the peers. False: a wait failed.
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it) {
    const KernelParams& p = x.p;
    const Counters& c = x.c;
    if (!consumers_wait_peers(x.s, p, comm::kBwdDone, x.epoch - 1, comm::kErrTimeoutAck, x.epoch, c.wait_ns + kShare,
                              x.ct))
      return false;
    if (it.index < p.share_items) {
      share_rows(p, it, x.ct);
    } else {  // the last: every SHARE(i) is done, then the peers may read the rows
      if (!consumers_wait<1>(x.s, {c.totals + 4}, {p.share_items}, p, c.wait_ns + kShare, x.ct)) return false;
      if (x.ct == 0) publish(p, comm::kBwdSigX, x.epoch);
    }
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    if (it.index < p.share_items) comm::fence_sys(), atomicAdd(c.totals + 4, 1);  // rows that peers read
  }
};

}  // namespace
}  // namespace mok
