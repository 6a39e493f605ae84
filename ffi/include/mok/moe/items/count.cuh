// mok moe: the forward megakernel's COUNT: rows per (source rank, 64-token chunk, local expert). An item type: its
// waits, its run by the 256 consumer threads and its completion by one of them (mok/moe/items.cuh dispatches an Item
// to it). Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// COUNT: rows per (source rank, 64-token chunk, local expert); one chunk per warp.
struct CountItem {
  // Waits for every peer's routing (sig_route).
  __device__ static bool wait(const ItemContext& c, const Item& it);
  __device__ static void run(const Plan& p, const RankParams& R, const Item& it, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

__device__ __forceinline__ bool CountItem::wait(const ItemContext& c, const Item& it) {
  const CommView& v = c.v;
  const uint64_t epoch = c.epoch;
  return wait_peers(v, comm::kMoeSigRoute, epoch, comm::kErrTimeoutRouting, epoch);
}

__device__ inline void CountItem::run(const Plan& p, const RankParams& R, const Item& it, int ct) {
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32;
  const int chunk = it.idx * kChunksPerCountItem + warp;
  if (chunk >= p.ep * p.nchunks) return;
  const int s = chunk / p.nchunks, c = chunk % p.nchunks;
  const int64_t t0 = int64_t(c) * comm::kChunkTokens, t1 = min(int64_t(p.T), t0 + comm::kChunkTokens);
  const int32_t* idx = s == v.rank ? R.topk_idx
                                   : v.local<int32_t>(v.layout.route_idx) + size_t(s) * v.layout.route_stride;
  int32_t* cnt = R.sync + p.o_cnt + int64_t(chunk) * p.L;
  for (int64_t n = t0 * p.k + lane; n < t1 * p.k; n += 32) {
    const int le = local_expert(p, v.rank, idx[n]);
    if (le >= 0) atomicAdd(cnt + le, 1);
  }
}

__device__ __forceinline__ void CountItem::complete(const ItemContext& c, const Item& it) {
  int32_t* sync = c.sync;
  bump(sync + kCtlCount);
}

}  // namespace mok::moe
