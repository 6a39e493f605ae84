// mok moe: the forward megakernel's DISPATCH(m): the rows of microbatch m into its ring slot. An item type: its
// waits, its run by the 256 consumer threads and its completion by one of them (mok/moe/items.cuh dispatches an Item
// to it). Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// DISPATCH(m): every (source, token) of microbatch m with local slots -> its rows of the ring slot. FP8: my own
// rows are quantised here, a source's posted row (quantised by its POST) is copied as E4M3 bytes and scales.
struct DispatchItem {
  // Waits for PLACE, every peer's rows (sig_x) and the ring slot's previous microbatch (its SEND and REDUCE);
  // when the rank's last DISPATCH item is done, acks every peer (ack_disp).
  __device__ static bool wait(const ItemContext& c, const Item& it);
  template <bool kFp8, bool kLab, class LaunchParams>
  __device__ static void run(const LaunchParams& P, const RankParams& R, const Item& it, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

__device__ __forceinline__ bool DispatchItem::wait(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const int ctas = c.ctas;
  const uint64_t epoch = c.epoch;
  if (!wait_count(v, sync + kCtlPlace, p.n_place, epoch)) return false;
  if (!wait_peers(v, comm::kMoeSigX, epoch, comm::kErrTimeoutData, epoch)) return false;
  const int m = it.mb - p.S;  // the microbatch that used this ring slot last
  if (m < 0) return true;
  return wait_count(v, sync + p.o_send + m, n_send(p, m, ctas), epoch) &&
         wait_count(v, sync + p.o_reduce + m, n_reduce(p, m, ctas), epoch);
}

template <bool kFp8, bool kLab, class LaunchParams>
__device__ inline void DispatchItem::run(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, ep = p.ep;
  const int nvec = p.H / 8;
  int64_t q0, q1;
  const int t_lo = mb_share(p, it, ep, &q0, &q1);
  int4* slot = ring_slot(p, R, it.mb);
  const int32_t* row_table = R.sync + p.o_row;
  if (timing_bits<kLab>(p) & kTimingNoDispatchRows) q1 = q0;  // timing mode (lab form)
  for (int64_t q = q0 + warp; q < q1; q += kWorkerWarps) {
    const int64_t t = t_lo + q / ep;
    const int s = int(q % ep);  // sources interleaved: NVLink and local reads proceed together
    const int32_t row = lane < k ? row_table[(int64_t(s) * p.T + t) * k + lane] : -1;
    const uint32_t lanes = __ballot_sync(kFull, row >= 0);
    if (lanes == 0) continue;
    const int4* src = s == v.rank ? R.x + t * nvec
                      : P.dispatch_push ? v.local<const int4>(v.layout.dispatch_rows) + dispatch_row(v, s, t) * nvec
                                        : v.peer<const int4>(s, v.layout.dispatch_rows) + dispatch_row(v, s, t) * nvec;
    int4* my_dst = row >= 0 ? slot + size_t(row) * nvec : nullptr;
    for (int rep = (timing_bits<kLab>(p) & kTimingTwiceDispatchRows) ? 2 : 1; rep > 0; --rep) {
      if constexpr (kFp8) {
        float* my_scale = row >= 0 ? R.recv_scale + size_t(it.mb % p.S) * p.slot_rows + row : nullptr;
        auto* my_q = reinterpret_cast<uint8_t*>(my_dst);
        if (s == v.rank) {
          comm::warp_quantize_row<kQuantUnroll>(src, nvec, my_q, my_scale, p.scale_ld, lanes, lane);
        } else {
          comm::warp_copy_row<kCopyUnrollFp8>(src, p.H / 16, my_dst, lanes, lane);
          comm::warp_scatter_scales(reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(src) + p.H),
                                    p.H / gemm::kFp8ScaleBlock, my_scale, p.scale_ld, lanes, lane);
        }
      } else {
        comm::warp_copy_row<kCopyUnroll>(src, nvec, my_dst, lanes, lane);
      }
    }
  }
  gemm::fence_proxy_async_global();  // the GU tiles read these rows with TMA
}

__device__ __forceinline__ void DispatchItem::complete(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  bump(sync + p.o_disp + it.mb);
  if (bump(sync + kCtlDispatchAll) == (p.M - 1) * p.D + p.D0 - 1) publish(v, comm::kMoeAckDisp, epoch);
}

}  // namespace mok::moe
