// mok moe: the forward megakernel's SCAN: the ring-slot rows of every cell and the dynamic part of the ticket order.
// An item type: its waits, its run by the 256 consumer threads and its completion by one of them (mok/moe/items.cuh
// dispatches an Item to it). Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// SCAN (one item): per microbatch, the first ring-slot row of every (expert, source, chunk) cell in that
// order, each expert's rows and m-blocks; then the dynamic part of the ticket order.
struct ScanItem {
  // Waits for every COUNT item; releases the schedule (kCtlScan) that the decoder and PLACE wait for.
  __device__ static bool wait(const ItemContext& c, const Item& it);
  __device__ static void run(const Plan& p, const RankParams& R, SharedStorage& s, int ct, int ctas);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

// The dynamic part of the ticket order, in the order of plan.cuh, from the m-block tables of every microbatch:
// its segments (first ticket, kind, microbatch; empty ones left out) and their count, in the sync region. One
// thread of SCAN; forward_item_list on the host, from tables made there.
__host__ __device__ __forceinline__ void write_segments(const Plan& p, int32_t* sync, int ctas) {
  const int L = p.L;
  int32_t* seg_begin = sync + p.o_seg_begin;
  int32_t* seg_kind = sync + p.o_seg_kind;
  int32_t* seg_mb = sync + p.o_seg_mb;
  int32_t n = 0, t = p.t_dynamic;
  auto add = [&](int kind, int m, int32_t count) {
    if (count <= 0) return;
    seg_begin[n] = t, seg_kind[n] = kind, seg_mb[n] = m;
    t += count;
    ++n;
  };
  for (int i = 0; i <= p.M + p.g; ++i) {
    const int c = i - p.g - 1;
    if (c >= 0 && c < p.M) {
      add(kSend, c, n_send(p, c, ctas));
      add(kReduce, c, n_reduce(p, c, ctas));
    }
    if (i >= 1 && i < p.M) add(kDispatch, i, p.D);
    const int g = i - p.g;
    if (g >= 0 && g < p.M) {
      const int32_t mblocks = sync[p.o_mblock + int64_t(g) * (L + 1) + L];
      add(kGu, g, mblocks * p.nb_gu);
      if (g == 0 && p.shared_dn_late) add(kSharedDn, 0, p.n_shared_dn);
      add(kDn, g, mblocks * p.nb_dn);
    }
  }
  seg_begin[n] = t;
  sync[kCtlSegments] = n;
}

// Exclusive scan of one value per consumer thread; *total = the sum of all 256.
__device__ inline int32_t block_scan(int32_t val, int32_t* warp_sums, int ct, int32_t* total) {
  const int lane = ct % 32, warp = ct / 32;
  int32_t x = val;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
  if (warp == 0) {
    int32_t s = lane < kWorkerWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(kFull, s, o);
      if (lane >= o) s += y;
    }
    if (lane < kWorkerWarps) warp_sums[lane] = s;
  }
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
  const int32_t excl = x - val + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[kWorkerWarps - 1];
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);  // warp_sums is reused next
  return excl;
}

__device__ __forceinline__ bool ScanItem::wait(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  return wait_count(v, sync + kCtlCount, p.n_count, epoch);
}

__device__ inline void ScanItem::run(const Plan& p, const RankParams& R, SharedStorage& s, int ct, int ctas) {
  int32_t* sync = R.sync;
  const int32_t* cnt = sync + p.o_cnt;
  int32_t* base = sync + p.o_base;
  const int ep = p.ep, L = p.L;
  for (int m = 0; m < p.M; ++m) {
    const int c0 = m * p.chunks_per_mb, ncm = min(p.nchunks, c0 + p.chunks_per_mb) - c0;
    const int per_expert = ep * ncm;
    const int cells = L * per_expert;
    int32_t* row_start = sync + p.o_row_start + int64_t(m) * (L + 1);
    int32_t* mblock = sync + p.o_mblock + int64_t(m) * (L + 1);
    int32_t carry = 0;
    for (int b = 0; b < cells; b += Tile::kConsumerThreads) {
      const int i = b + ct;
      int32_t val = 0;
      int64_t cell = 0;
      int e = 0, rem = 0;
      if (i < cells) {
        e = i / per_expert, rem = i % per_expert;
        const int src = rem / ncm, c = c0 + rem % ncm;
        cell = (int64_t(src) * p.nchunks + c) * L + e;
        val = cnt[cell];
      }
      int32_t total;
      const int32_t excl = block_scan(val, s.scan_warp, ct, &total);
      if (i < cells) {
        base[cell] = carry + excl;
        if (rem == 0) row_start[e] = min(carry + excl, p.slot_rows);
      }
      carry += total;
    }
    if (carry > p.slot_rows && ct == 0) record_call_error(R, comm::kErrOverflow, m * p.G);
    gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);  // row_start is complete
    // m-blocks per expert, and their prefix
    int32_t mb_carry = 0;
    for (int b = 0; b < L; b += Tile::kConsumerThreads) {
      const int e = b + ct;
      int32_t val = 0;
      if (e < L) {
        const int32_t r1 = e + 1 < L ? row_start[e + 1] : min(carry, p.slot_rows);
        val = (r1 - row_start[e] + kTileM - 1) / kTileM;
      }
      int32_t total;
      const int32_t excl = block_scan(val, s.scan_warp, ct, &total);
      if (e < L) mblock[e] = mb_carry + excl;
      mb_carry += total;
    }
    if (ct == 0) {
      row_start[L] = min(carry, p.slot_rows);
      mblock[L] = mb_carry;
    }
  }
  gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
  if (ct != 0) return;
  write_segments(p, sync, ctas);
}

__device__ __forceinline__ void ScanItem::complete(const ItemContext& c, const Item& it) {
  int32_t* sync = c.sync;
  __threadfence();
  comm::st_release_gpu(sync + kCtlScan, 1);
}

}  // namespace mok::moe
