// mok moe: the forward megakernel's REDUCE(m): y of this rank's tokens of microbatch m. An item type: its waits, its
// run by the 256 consumer threads and its completion by one of them (mok/moe/items.cuh dispatches an Item to it).
// Included by mok/moe/items.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_comm.cuh"
#include "mok/moe/forward_items.cuh"

namespace mok::moe {

// REDUCE(m) (origin side): y of this rank's tokens of microbatch m.
struct ReduceItem {
  // Waits for the microbatch's DISPATCH and DN tiles, every shared DN tile and every peer's SEND of it
  // (sig_comb[m]); when the call's last REDUCE item is done, acks every peer (ack_comb).
  __device__ static bool wait(const ItemContext& c, const Item& it);
  template <bool kLab, class LaunchParams>
  __device__ static void run(const LaunchParams& P, const RankParams& R, const Item& it, int ct);
  __device__ static void complete(const ItemContext& c, const Item& it);
};

// y_t = bf16( sum over t's slots j, ascending, of w_j * row_j  +  shared_row ), fp32, one rounding per operation:
// row_j is slot j's expert output row, bf16 (my ring's row when its expert is mine, else the one its owner pushed
// into my combine_rows[t][j]); lane j holds its address (my_src) and weight, `used` the slots with an expert. The
// terms and their order do not depend on which rank owns which expert, so y has the same bits at every EP size.
// The loads of a pass wait on kReduceGroup rows at a time; kReducePrefetch passes ahead, each slot's lane (and lane
// 31 for the shared row) prefetches its row's bytes of that pass into L2, so that all of a pass's rows are on their
// way from HBM at once.
__device__ inline void reduce_row(const int4* my_src, float my_w, uint32_t used, const float* shared_row, int nvec,
                                  int4* dst, int lane) {
  constexpr int kU = kReduceUnroll, kPass = 32 * kU;  // vectors a pass
  const auto prefetch = [&](int v) {
    if (v >= nvec) return;
    const uint32_t n = uint32_t(min(kPass, nvec - v));
    if ((used >> lane) & 1u) comm::prefetch_l2(my_src + v, 16 * n);
    if (lane == 31 && shared_row != nullptr) comm::prefetch_l2(shared_row + 8 * v, 32 * n);
  };
  for (int a = 0; a < kReducePrefetch; ++a) prefetch(a * kPass);
  for (int v0 = 0; v0 < nvec; v0 += kPass) {
    prefetch(v0 + kReducePrefetch * kPass);
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    comm::warp_weighted_sources<kU, kReduceGroup>(my_src, my_w, used, nvec, v0, acc, lane);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int vi = v0 + u * 32 + lane;
      if (vi >= nvec) continue;
      if (shared_row != nullptr) {
        const float4 a = *reinterpret_cast<const float4*>(shared_row + 8 * vi);
        const float4 b = *reinterpret_cast<const float4*>(shared_row + 8 * vi + 4);
        const float sv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = __fadd_rn(acc[u][e], sv[e]);
      }
      comm::st_v4(dst + vi, comm::round8(acc[u]));
    }
  }
}

__device__ __forceinline__ bool ReduceItem::wait(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const uint64_t epoch = c.epoch;
  return wait_count(v, sync + p.o_disp + it.mb, n_dispatch(p, it.mb), epoch) &&
         wait_count(v, sync + p.o_dn + it.mb, dn_tiles(p, sync, it.mb), epoch) &&
         wait_count(v, sync + kCtlSharedDn, p.n_shared_dn, epoch) &&
         wait_peers(v, comm::kMoeSigComb + it.mb, epoch, comm::kErrTimeoutData, epoch);
}

template <bool kLab, class LaunchParams>
__device__ inline void ReduceItem::run(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, rank = v.rank;
  const int nvec = p.H / 8;
  const int num_experts = p.L * p.ep;
  int64_t b, e;
  const int t_lo = mb_share(p, it, 1, &b, &e);
  const int4* rows = ring_slot(p, R, it.mb);
  const int4* combine_rows = v.local<const int4>(v.layout.combine_rows);
  if (timing_bits<kLab>(p) & kTimingNoReduceRows) e = b;  // timing mode (lab form)
  for (int64_t t = t_lo + b + warp; t < t_lo + e; t += kWorkerWarps) {
    int4* dst = R.y + t * nvec;
    if (it.skip) {
      nan_row(dst, nvec, lane);
      continue;
    }
    const int32_t id = lane < k ? R.topk_idx[t * k + lane] : -1;
    const bool bad = lane < k && (id < -1 || id >= num_experts);
    if (__any_sync(kFull, bad)) {
      const uint32_t bad_lanes = __ballot_sync(kFull, bad);
      if (lane == __ffs(bad_lanes) - 1) record_call_error(R, comm::kErrBadExpert, int32_t(t));
      nan_row(dst, nvec, lane);
      continue;
    }
    const bool mine = id >= 0 && id / p.L == rank;
    const int32_t my_row = mine ? R.sync[p.o_row + (int64_t(rank) * p.T + t) * k + lane] : -1;
    if (__any_sync(kFull, mine && my_row < 0)) {  // a slot past the ring slot (ring overflow)
      nan_row(dst, nvec, lane);
      continue;
    }
    const int4* my_src = mine ? rows + size_t(my_row) * nvec
                         : id >= 0 ? combine_rows + (size_t(t) * k + lane) * nvec : nullptr;
    const float my_w = id >= 0 ? R.topk_weight[t * k + lane] : 0.0f;
    const uint32_t used = __ballot_sync(kFull, id >= 0);
    const float* shared_row = p.Is > 0 ? R.shared_out + t * p.H : nullptr;
    for (int rep = (timing_bits<kLab>(p) & kTimingTwiceReduceRows) ? 2 : 1; rep > 0; --rep)
      reduce_row(my_src, my_w, used, shared_row, nvec, dst, lane);
  }
}

__device__ __forceinline__ void ReduceItem::complete(const ItemContext& c, const Item& it) {
  const Plan& p = c.p;
  const CommView& v = c.v;
  int32_t* sync = c.sync;
  const int ctas = c.ctas;
  const uint64_t epoch = c.epoch;
  bump(sync + p.o_reduce + it.mb);
  int32_t total = 0;
  for (int m = 0; m < p.M; ++m) total += n_reduce(p, m, ctas);
  if (bump(sync + kCtlReduceAll) == total - 1) publish(v, comm::kMoeAckComb, epoch);
}

}  // namespace mok::moe
