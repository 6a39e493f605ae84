// mok moe: the forward megakernel's SEND(m): the owner's rows of microbatch m into their origins' combine_rows. An
// item type: its waits, its run by the 256 consumer threads and its completion by one of them (mok/moe/items.cuh
// dispatches an Item to it). Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// SEND(m) (owner side, ep > 1): the row of every remote slot (s, t, j) of microbatch m that is mine, as the down
// tile left it in the ring (bf16, before the router weight), into origin s's combine_rows[t][j]: one row per slot, so
// that the origin sums the same terms in the same order at every EP size (ReduceItem::run). A slot past the ring slot
// (row -2) gets a NaN row there.
struct SendItem {
  // Waits for the microbatch's DISPATCH and DN tiles and every peer's ack of the previous call's REDUCE; when the
  // microbatch's last SEND item is done, stamps sig_comb[m] of every peer.
  __device__ static bool wait(const ItemContext& c, const Item& it);
  template <bool kLab, class LaunchParams>
  __device__ static void run(const LaunchParams& P, const RankParams& R, const Item& it, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

__device__ __forceinline__ bool SendItem::wait(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  return wait_count(v, sync + p.o_disp + it.mb, n_dispatch(p, it.mb), epoch) &&
         wait_count(v, sync + p.o_dn + it.mb, dn_tiles(p, sync, it.mb), epoch) &&
         wait_peers(v, comm::kMoeAckComb, epoch - 1, comm::kErrTimeoutAck, epoch);
}

template <bool kLab, class LaunchParams>
__device__ inline void SendItem::run(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, ep = p.ep;
  const int nvec = p.H / 8;
  int64_t q0, q1;
  const int t_lo = mb_share(p, it, ep - 1, &q0, &q1);
  const int4* slot = ring_slot(p, R, it.mb);
  if (timing_bits<kLab>(p) & kTimingNoSendRows) q1 = q0;  // timing mode (lab form)
  for (int64_t q = q0 + warp; q < q1; q += kWorkerWarps) {
    const int64_t t = t_lo + q / (ep - 1);
    const int so = int(q % (ep - 1));
    const int s = so < v.rank ? so : so + 1;
    const int32_t row = lane < k ? R.sync[p.o_row + (int64_t(s) * p.T + t) * k + lane] : -1;
    int4* cell = v.peer<int4>(s, v.layout.combine_rows) + size_t(t) * k * nvec;  // origin s's combine_rows[t][0]
    const uint32_t dropped = __ballot_sync(kFull, row == -2);
    for (uint32_t m = dropped; m; m &= m - 1) nan_row(cell + size_t(__ffs(m) - 1) * nvec, nvec, lane);
    const int4* my_src = row >= 0 ? slot + size_t(row) * nvec : nullptr;
    comm::warp_copy_rows<kSendUnroll, kSendGroup, kSendPrefetch>(my_src, cell + size_t(lane) * nvec,
                                                                 __ballot_sync(kFull, row >= 0), nvec, lane);
  }
}

__device__ __forceinline__ void SendItem::complete(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  comm::fence_sys();
  if (bump(sync + p.o_send + it.mb) == it.count - 1) publish(v, comm::kMoeSigComb + it.mb, epoch);
}

}  // namespace mok::moe
