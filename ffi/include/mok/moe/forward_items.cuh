// mok moe: the forward megakernel's work items from ticket to completion (plan.cuh says which items a call has, in
// which order, and what each waits for). The epoch stamps across ranks and the counters within one (publish,
// wait_peers, wait_count) and the call error word (record_call_error); a microbatch's schedule tables (tables,
// local_expert, band_tile); a ticket decoded into its item (decode); what an item's waits and completion read
// (ItemContext: each item's own are its type's, items.cuh).
// Included by forward_kernel.cuh only (directly and through its other pieces).
#pragma once

#include <cstdint>

#include "mok/comm/ptx.cuh"
#include "mok/comm/sync.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/moe/forward_params.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

// ================================================================================ stamps and counters

// Store this call's epoch into stamp row `row` of moe_stamps, slot [my rank], of every peer (after a system fence).
__device__ inline void publish(const CommView& v, int row, uint64_t epoch) {
  comm::publish_stamps(v, v.layout.moe_stamps, row, epoch);
}

// Wait until every peer stamped row `row` of my moe_stamps with at least `target`.
__device__ inline bool wait_peers(const CommView& v, int row, uint64_t target, uint32_t code, uint64_t epoch) {
  return comm::wait_stamps(v, v.layout.moe_stamps, row, target, code, comm::kOpMoeForward, epoch);
}

// Wait until a counter of this rank's scratch reaches target (bounded by comm::local_timeout_ns; stops on poison).
__device__ inline bool wait_count(const CommView& v, const int32_t* ctr, int32_t target, uint64_t epoch) {
  if (comm::ld_acquire_gpu(ctr) >= target) return true;
  const uint64_t start = comm::global_timer_ns();
  for (uint32_t it = 1;; ++it) {
    if (comm::ld_acquire_gpu(ctr) >= target) return true;
    if ((it & 31u) == 0) {
      const uint64_t err = comm::read_poison(v);
      if (err != 0) {
        comm::publish_host_error(v, err);
        return false;
      }
      if (comm::global_timer_ns() - start > comm::local_timeout_ns(v.timeout_ns)) {
        comm::raise_error(v, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
        return false;
      }
    }
  }
}

__device__ inline int32_t bump(int32_t* ctr) {
  __threadfence();
  return atomicAdd(ctr, 1);
}

// First call error of this rank wins (bad expert id, ring overflow); it does not poison the workspace.
__device__ inline void record_call_error(const RankParams& R, uint32_t code, int32_t token) {
  if (atomicCAS(R.sync + kCtlCallError, 0, int32_t(code)) == 0) atomicExch(R.sync + kCtlCallErrorToken, token);
}

// What an item's waits and completion read, made once per dispatch (items.cuh: wait_deps, complete).
struct ItemContext {
  const Plan& p;
  const RankParams& R;
  const CommView& v;
  int32_t* sync;
  int ctas;
  uint64_t epoch;
};

// ================================================================================ schedule tables

struct Tables {  // one microbatch's rows and m-blocks per local expert (written by SCAN)
  const int32_t* row_start;  // [L + 1], rows inside the microbatch's ring slot
  const int32_t* mblock;     // [L + 1], prefix of m-blocks
};
__host__ __device__ __forceinline__ Tables tables(const Plan& p, const int32_t* sync, int m) {
  const int64_t off = int64_t(m) * (p.L + 1);
  return Tables{sync + p.o_row_start + off, sync + p.o_mblock + off};
}

__device__ __forceinline__ int32_t local_expert(const Plan& p, int rank, int32_t id) {
  if (id < 0 || id >= p.L * p.ep) return -1;
  const int32_t le = id - rank * p.L;
  return (le >= 0 && le < p.L) ? le : -1;
}

__host__ __device__ __forceinline__ void band_tile(int local, int rows, int nb, int* m_block, int* n_block) {
  gemm::band_tile<kTileM, kGroupM>(local, rows, nb, m_block, n_block);
}

// ================================================================================ the ticket decoder

// (The decoder's pieces are __host__ as well: forward_item_list gives the list on the host, for tests.)
__host__ __device__ inline Item comm_item(int kind, int mb, int idx, int count) {
  Item it{};
  it.kind = kind, it.mb = mb, it.idx = idx, it.count = count;
  return it;
}

__host__ __device__ inline Item shared_tile(const Plan& p, int kind, int local) {
  Item it{};
  it.kind = kind;
  const int nb = kind == kSharedGu ? p.nb_shared_gu : p.nb_shared_dn;
  int mblk, nblk;
  band_tile(local, p.T, nb, &mblk, &nblk);
  it.group = 0, it.row0 = mblk * kTileM, it.row_end = p.T, it.n_block = nblk, it.mblock = mblk;
  return it;
}

// A routed tile of microbatch m: expert by binary search over the m-block prefix, then the band raster.
__host__ __device__ inline Item routed_tile(const Plan& p, const int32_t* sync, int kind, int m, int local) {
  const Tables tb = tables(p, sync, m);
  const int nb = kind == kGu ? p.nb_gu : p.nb_dn;
  const int e = gemm::last_group_at([&](int g) { return tb.mblock[g] * nb; }, p.L, local);
  int mblk, nblk;
  band_tile(local - tb.mblock[e] * nb, tb.row_start[e + 1] - tb.row_start[e], nb, &mblk, &nblk);
  const int slot_row0 = (m % p.S) * p.slot_rows;
  Item it{};
  it.kind = kind, it.mb = m, it.group = e;
  it.row0 = slot_row0 + tb.row_start[e] + mblk * kTileM;
  it.row_end = slot_row0 + tb.row_start[e + 1];
  it.n_block = nblk;
  it.mblock = tb.mblock[e] + mblk;
  return it;
}

// A ticket of the dynamic part (t >= p.t_dynamic), from SCAN's segment table in sync; kEnd past its last segment.
__host__ __device__ __forceinline__ Item decode_dynamic(const Plan& p, const int32_t* sync, int32_t t) {
  Item end{};
  end.kind = kEnd;
  const int32_t nseg = sync[kCtlSegments];
  const int32_t* begin = sync + p.o_seg_begin;
  if (t >= begin[nseg]) return end;
  int lo = 0, hi = nseg;  // last segment with begin <= t (segments are never empty)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (begin[mid] <= t) lo = mid; else hi = mid;
  }
  const int kind = sync[p.o_seg_kind + lo], m = sync[p.o_seg_mb + lo];
  const int local = t - begin[lo];
  if (kind == kGu || kind == kDn) return routed_tile(p, sync, kind, m, local);
  if (kind == kSharedDn) return shared_tile(p, kSharedDn, local);  // Plan::shared_dn_late
  return comm_item(kind, m, local, begin[lo + 1] - begin[lo]);
}

// A ticket of the static prefix (t < p.t_dynamic), from the plan alone.
__host__ __device__ __forceinline__ Item decode_static(const Plan& p, int32_t t) {
  if (t < p.t_count) return comm_item(kPost, 0, t, p.n_post);
  if (t < p.t_scan) return comm_item(kCount, 0, t - p.t_count, p.n_count);
  if (t < p.t_place) return comm_item(kScan, 0, 0, 1);
  if (t < p.t_disp0) return comm_item(kPlace, 0, t - p.t_place, p.n_place);
  if (t < p.t_sgu) return comm_item(kDispatch, 0, t - p.t_disp0, p.D0);
  if (t < p.t_sdn) return shared_tile(p, kSharedGu, t - p.t_sgu);
  return shared_tile(p, kSharedDn, t - p.t_sdn);
}

__device__ inline Item decode(const Plan& p, const RankParams& R, int32_t t, uint64_t epoch) {
  if (t < p.t_dynamic) return decode_static(p, t);
  Item end{};
  end.kind = kEnd;
  if (!wait_count(R.view, R.sync + kCtlScan, 1, epoch)) return end;
  return decode_dynamic(p, R.sync, t);
}

__device__ inline int32_t dn_tiles(const Plan& p, const int32_t* sync, int m) {
  return tables(p, sync, m).mblock[p.L] * p.nb_dn;
}

}  // namespace mok::moe
