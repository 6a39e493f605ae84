// mok moe: the forward megakernel's communication and schedule items, which the 256 consumer threads run without a
// GEMM, a warp per row at a time: POST (run_post), COUNT (run_count), SCAN (run_scan, block_scan), PLACE
// (run_place), DISPATCH (run_dispatch), SEND (run_send) and REDUCE, the final sum into y (run_reduce, reduce_row).
// Included by forward_kernel.cuh only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/forward_items.cuh"
#include "mok/moe/forward_params.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

// ================================================================================ communication items
// Executed by the 256 consumer threads: warp w (0..7) and lane of thread ct.

constexpr uint32_t kFull = 0xffffffffu;

__device__ __forceinline__ void nan_row(int4* dst, int nvec, int lane) {
  const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
  for (int i = lane; i < nvec; i += 32) comm::st_v4(dst + i, nan);
}

// POST (source side, ep > 1): my routing into every peer, then my rows where the owners will look for them (FP8:
// quantised, the row's H E4M3 bytes then its H/128 scales).
template <bool kFp8, class LaunchParams>
__device__ inline void run_post(const LaunchParams& P, const RankParams& R, const Item& it, int ct, uint64_t epoch) {
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

// COUNT: rows per (source rank, 64-token chunk, local expert); one chunk per warp.
__device__ inline void run_count(const Plan& p, const RankParams& R, const Item& it, int ct) {
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

// SCAN (one item): per microbatch, the first ring-slot row of every (expert, source, chunk) cell in that
// order, each expert's rows and m-blocks; then the dynamic part of the ticket order.
__device__ inline void run_scan(const Plan& p, const RankParams& R, SharedStorage& s, int ct, int ctas) {
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
  // the dynamic segments, in the order of plan.cuh
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
      add(kDn, g, mblocks * p.nb_dn);
    }
  }
  seg_begin[n] = t;
  sync[kCtlSegments] = n;
}

// PLACE: the ring-slot row of every slot (s, t, j), in (expert, source, token, slot) order; one chunk per warp.
__device__ inline void run_place(const Plan& p, const RankParams& R, const Item& it, int ct) {
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

__device__ __forceinline__ size_t dispatch_row(const CommView& v, int s, int64_t t) {
  return size_t(s) * v.shape.max_tokens + size_t(t);
}

// The ring slot of microbatch m: its rows, nvec 16-byte vectors each.
__device__ __forceinline__ int4* ring_slot(const Plan& p, const RankParams& R, int m) {
  return reinterpret_cast<int4*>(R.recv) + size_t(m % p.S) * p.slot_rows * (p.H / 8);
}

// The first token of microbatch m, and this item's share [*q0, *q1) of the microbatch's per_token * tokens units.
__device__ __forceinline__ int mb_share(const Plan& p, const Item& it, int per_token, int64_t* q0, int64_t* q1) {
  int t_lo, t_hi;
  mb_tokens(p, it.mb, &t_lo, &t_hi);
  share(int64_t(t_hi - t_lo) * per_token, it.idx, it.count, q0, q1);
  return t_lo;
}

// DISPATCH(m): every (source, token) of microbatch m with local slots -> its rows of the ring slot. FP8: my own
// rows are quantised here, a source's posted row (quantised by its POST) is copied as E4M3 bytes and scales.
template <bool kFp8, bool kLab, class LaunchParams>
__device__ inline void run_dispatch(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
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

// SEND(m) (owner side, ep > 1): the row of every remote slot (s, t, j) of microbatch m that is mine, as the down
// tile left it in the ring (bf16, before the router weight), into origin s's combine_rows[t][j]: one row per slot, so
// that the origin sums the same terms in the same order at every EP size (run_reduce). A slot past the ring slot
// (row -2) gets a NaN row there.
template <bool kLab, class LaunchParams>
__device__ inline void run_send(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
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
    comm::warp_copy_rows<kSendUnroll, kSendGroup>(my_src, cell + size_t(lane) * nvec, __ballot_sync(kFull, row >= 0),
                                                  nvec, lane);
  }
}

// y_t = bf16( sum over t's slots j, ascending, of w_j * row_j  +  shared_row ), fp32, one rounding per operation:
// row_j is slot j's expert output row, bf16 (my ring's row when its expert is mine, else the one its owner pushed
// into my combine_rows[t][j]); lane j holds its address (my_src) and weight, `used` the slots with an expert. The
// terms and their order do not depend on which rank owns which expert, so y has the same bits at every EP size.
__device__ inline void reduce_row(const int4* my_src, float my_w, uint32_t used, const float* shared_row, int nvec,
                                  int4* dst, int lane) {
  constexpr int kU = kReduceUnroll;
  for (int v0 = 0; v0 < nvec; v0 += 32 * kU) {
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

// REDUCE(m) (origin side): y of this rank's tokens of microbatch m.
template <bool kLab, class LaunchParams>
__device__ inline void run_reduce(const LaunchParams& P, const RankParams& R, const Item& it, int ct) {
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

}  // namespace mok::moe
