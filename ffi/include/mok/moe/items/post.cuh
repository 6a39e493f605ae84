// mok moe: the forward megakernel's POST: a source's routing into every peer and its rows where their owners read
// them. An item type: its waits, its run by the 256 consumer threads and its completion by one of them
// (mok/moe/items.cuh dispatches an Item to it). Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// POST (source side, ep > 1): my routing into every peer, then my rows where the owners will look for them (FP8:
// quantised, the row's H E4M3 bytes then its H/128 scales).
struct PostItem {
  // Waits for every peer's ack of the previous call's DISPATCH (their copies of my rows and routing are free); when
  // the last POST item of the rank is done, stamps sig_x.
  __device__ static bool wait(const ItemContext& c, const Item& it);
  template <bool kFp8, class LaunchParams>
  __device__ static void run(const LaunchParams& P, const RankParams& R, const Item& it, int ct, uint64_t epoch);
  // A skipped POST item (its wait failed) still bumps the count of routing halves (kCtlPostRoute) as run does, so
  // that the count keeps its meaning for the rank's other POST items; it copies and publishes nothing.
  __device__ static void run_skipped(const RankParams& R, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

__device__ __forceinline__ bool PostItem::wait(const ItemContext& c, const Item& it) {
  const CommView& v = c.v;
  const uint64_t epoch = c.epoch;
  return wait_peers(v, comm::kMoeAckDisp, epoch - 1, comm::kErrTimeoutAck, epoch);
}

template <bool kFp8, class LaunchParams>
__device__ inline void PostItem::run(const LaunchParams& P, const RankParams& R, const Item& it, int ct,
                                     uint64_t epoch) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k;
  int64_t t0, t1;
  share(p.T, it.idx, it.count, &t0, &t1);
  for (int q = 0; q < p.ep; ++q) {
    if (q == v.rank) continue;
    int32_t* di = v.peer<int32_t>(q, v.layout.route_idx) + size_t(v.rank) * v.layout.route_stride;
    float* dw = v.peer<float>(q, v.layout.route_w) + size_t(v.rank) * v.layout.route_stride;
    for (int64_t i = t0 * k + ct; i < t1 * k; i += Tile::kConsumerThreads) {
      di[i] = R.topk_idx[i];
      dw[i] = R.topk_weight[i];
    }
  }
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
  if (ct == 0 && bump(R.sync + kCtlPostRoute) == p.n_post - 1) publish(v, comm::kMoeSigRoute, epoch);
  const int nvec = p.H / 8;
  const size_t dispatch_row0 = size_t(v.rank) * v.shape.max_tokens;
  for (int64_t t = t0 + warp; t < t1; t += kWorkerWarps) {
    const int32_t id = lane < k ? R.topk_idx[t * k + lane] : -1;
    const int owner = (id >= 0 && id < p.L * p.ep) ? id / p.L : -1;
    const uint32_t same = __match_any_sync(kFull, owner);
    const bool remote = lane == __ffs(same) - 1 && owner >= 0 && owner != v.rank;
    uint32_t lanes = __ballot_sync(kFull, remote);
    if (lanes == 0) continue;
    int4* my_dst = nullptr;
    if (!P.dispatch_push) {
      lanes &= -lanes;  // one copy, into my own dispatch_rows, for every owner to pull
      my_dst = v.local<int4>(v.layout.dispatch_rows) + (dispatch_row0 + t) * nvec;
    } else if (remote) {
      my_dst = v.peer<int4>(owner, v.layout.dispatch_rows) + (dispatch_row0 + t) * nvec;
    }
    if constexpr (kFp8) {
      auto* q = reinterpret_cast<uint8_t*>(my_dst);
      comm::warp_quantize_row<kQuantUnroll>(R.x + t * nvec, nvec, q, q ? reinterpret_cast<float*>(q + p.H) : nullptr,
                                            1, lanes, lane);
    } else {
      comm::warp_copy_row<kCopyUnroll>(R.x + t * nvec, nvec, my_dst, lanes, lane);
    }
  }
}

__device__ __forceinline__ void PostItem::run_skipped(const RankParams& R, int ct) {
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
  if (ct == 0) bump(R.sync + kCtlPostRoute);
}

__device__ __forceinline__ void PostItem::complete(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  if (bump(sync + kCtlPostRows) == p.n_post - 1) publish(v, comm::kMoeSigX, epoch);
}

}  // namespace mok::moe
