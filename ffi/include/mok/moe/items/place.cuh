// mok moe: the forward megakernel's PLACE: the ring-slot row of every slot. An item type: its waits, its run by the
// 256 consumer threads and its completion by one of them (mok/moe/items.cuh dispatches an Item to it). Included by
// mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// PLACE: the ring-slot row of every slot (s, t, j), in (expert, source, token, slot) order; one chunk per warp.
struct PlaceItem {
  // Waits for SCAN.
  __device__ static bool wait(const ItemContext& c, const Item& it);
  __device__ static void run(const Plan& p, const RankParams& R, const Item& it, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

__device__ __forceinline__ bool PlaceItem::wait(const ItemContext& c, const Item& it) {
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  return wait_count(v, sync + kCtlScan, 1, epoch);
}

__device__ inline void PlaceItem::run(const Plan& p, const RankParams& R, const Item& it, int ct) {
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k;
  const int chunk = it.idx * kChunksPerCountItem + warp;
  if (chunk >= p.ep * p.nchunks) return;
  const int s = chunk / p.nchunks, c = chunk % p.nchunks;
  const int64_t t0 = int64_t(c) * comm::kChunkTokens, t1 = min(int64_t(p.T), t0 + comm::kChunkTokens);
  const bool own = s == v.rank;
  const int32_t* idx = own ? R.topk_idx : v.local<int32_t>(v.layout.route_idx) + size_t(s) * v.layout.route_stride;
  const float* wts = own ? R.topk_weight : v.local<float>(v.layout.route_w) + size_t(s) * v.layout.route_stride;
  volatile int32_t* run = R.sync + p.o_base + int64_t(chunk) * p.L;  // this warp's own cells: a running count
  int32_t* row_table = R.sync + p.o_row + int64_t(s) * p.T * k;
  float* row_w = reinterpret_cast<float*>(R.sync + p.o_w) + int64_t(s) * p.T * k;
  for (int64_t n0 = t0 * k; n0 < t1 * k; n0 += 32) {
    const int64_t n = n0 + lane;
    const bool active = n < t1 * k;
    const int le = active ? local_expert(p, v.rank, idx[n]) : -1;
    const float w = active ? wts[n] : 0.0f;
    const uint32_t same = __match_any_sync(kFull, le);
    const int before = __popc(same & comm::lanemask_lt());
    const int32_t pos = le >= 0 ? run[le] + before : -1;
    __syncwarp();
    if (le >= 0 && before == 0) run[le] = run[le] + __popc(same);
    __syncwarp();
    if (active) {
      row_table[n] = le < 0 ? -1 : (pos < p.slot_rows ? pos : -2);  // -2: past the slot (overflow)
      row_w[n] = w;
      if (R.keep_gu != nullptr && le >= 0 && pos < p.slot_rows)  // the ring row's slot, for the kept g, u
        R.row_slot[int64_t(n / k / p.G) * p.slot_rows + pos] = int32_t(int64_t(s) * p.T * k + n);
    }
  }
}

__device__ __forceinline__ void PlaceItem::complete(const ItemContext& c, const Item& it) {
  int32_t* sync = c.sync;
  bump(sync + kCtlPlace);
}

}  // namespace mok::moe
