// mok backward: SEND(m), expert parallel only: m-block m's dx and dw rows into their tokens' ranks (bwd_dx,
// bwd_dw); the last SEND stamps kBwdSigDx in the peers. An item type: its run by the 256 consumer threads (its
// waits are the consumers') and its completion by one of them.
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

struct SendItem {
  // A block's SEND waits for its DX tiles and DWSUM item, and for the origins' slot sums of the previous call
  // (kBwdDone); the last waits for every other SEND. False: a wait failed.
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it) {
    const KernelParams& p = x.p;
    const Counters& c = x.c;
    if (it.mb >= 0) {  // the block's dx rows and dw; the origins' slot sums of the previous call are done
      if (!consumers_wait<1>(x.s, {c.out + it.mb}, {x.h.nb_dx + 1}, p, c.wait_ns + kSend, x.ct) ||
          !consumers_wait_peers(x.s, p, comm::kBwdDone, x.epoch - 1, comm::kErrTimeoutAck, x.epoch, c.wait_ns + kSend,
                                x.ct))
        return false;
      send_rows(p, it, x.ct);
    } else {  // the last: every block is sent, then the origins may sum them
      if (!consumers_wait<1>(x.s, {c.totals + 3}, {x.s.table.tile_start[p.E]}, p, c.wait_ns + kSend, x.ct))
        return false;
      if (x.ct == 0) publish(p, comm::kBwdSigDx, x.epoch);
    }
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    if (it.mb >= 0) comm::fence_sys(), atomicAdd(c.totals + 3, 1);  // rows written into peers' memory
  }
};

}  // namespace
}  // namespace mok
