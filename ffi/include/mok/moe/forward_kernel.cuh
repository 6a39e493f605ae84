// mok moe: the forward megakernel (sm_90a). One persistent launch per call runs, for each EP rank it
// carries, the whole MoE forward: routing exchange, schedule, dispatch, shared expert, gate/up GEMM with
// SwiGLU, down GEMM, combine, final sum. The math is in forward.cuh, the work items and their order in
// plan.cuh, the symmetric buffers in mok/comm/workspace.cuh.
//
// Roles. One CTA per SM (384 threads), every CTA a general worker of one EP rank (CTA b serves rank
// b % num_ranks); nothing is tied to an SM, so the same code serves any EP size and any SM count:
//   warp 0, one lane ("producer"): claims the rank's next ticket (atomicAdd), decodes it into an item,
//       waits (bounded) for the item's dependencies, hands it to the consumers through a 2-slot work ring
//       in shared memory, and for a GEMM tile issues its TMA loads into the stage ring (Sm90Tile::load_tile).
//       It then claims the next ticket while the consumers still work: loads of tile n+1 overlap MMAs of n.
//   warps 1-3: idle (registers given to the consumers).
//   warpgroups 1-2 ("consumers", 8 warps): execute every item: a GEMM tile (Sm90Tile::mma_tile, 64 rows
//       each, then an epilogue policy), or a communication/schedule item (the warps move rows with 16-byte
//       vectors, one row per warp at a time). Then one thread publishes the item's completion.
// Communication therefore time-shares SMs with compute: a communication stage is split into comm_items
// items, so that many SMs move rows while the rest run tiles (the "communication SMs" knob).
//
// Registers: producer warpgroup 40, consumers 232 per thread (setmaxnreg; the CTA's 168 x 384 in all). Shared memory: stage ring
// 192 KB + the FP8 stages' scales 2 KB + epilogue staging 18 KB + work ring and scan scratch; one CTA per SM.
//
// FP8 routed experts (the kernel's kFp8 form, Plan::fp8): each token row is quantised once in 1 x 128 tiles by
// its source (POST into its staged row at EP > 1, DISPATCH for its own rows: comm::warp_quantize_row), so the
// staged rows carry H E4M3 bytes and H/128 scales and DISPATCH copies those into the ring: the E4M3 bytes at
// the start of the ring row (whose 2H bytes the down tile's bf16 output overwrites in place, as in the bf16
// form) and the scales into the ring's k-block-major recv_scale. GU and DN tiles are gemm::Sm90Fp8Tile's (the
// standalone FP8 FFN's chains, promotions and epilogues: the same bits per row), fed through the same stage ring
// by the same producer thread (row scales by a bulk copy); GU's epilogue writes h in E4M3 with its scales. The shared
// expert, SEND, REDUCE and y are the bf16 form's.
//
// Synchronisation. Within a rank: counters in the call's scratch (zeroed before the launch), bumped with
// a release after an item's stores (and a proxy fence where TMA reads the data next), polled with acquire
// loads. Across ranks: epoch stamps in the workspace's moe_flags, stored by the last item of what they
// guard with a release at system scope. Every wait is bounded by the workspace's timeout and gives up at
// once when the workspace is poisoned; a producer whose wait fails marks the item skipped (consumers do
// nothing but count it), so a failed call ends quickly; its last CTA then fills y with NaN and writes the
// status. No traps. Bad expert ids give NaN rows for their tokens and a call error (not a poison).
//
// Determinism: every output element is computed by one item in a fixed order (GEMM k order; y as one fp32 sum over
// a token's slots j in ascending order, __fmul_rn/__fadd_rn, of the bf16 expert rows: the owners push each slot's
// row, not a pre-summed partial), and no float is ever reduced with atomics, so outputs are bitwise the same for
// every knob value, every assignment of items to CTAs and every EP size.
#pragma once

#include <cuda_bf16.h>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

using Tile = gemm::Sm90Tile;
using Fp8Tile = gemm::Sm90Fp8Tile;
using comm::CommView;

constexpr int kThreads = 128 + Tile::kConsumerThreads;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// setmaxnreg moves registers between the warpgroups of a CTA; the CTA keeps what the launch gave it
// (65536 / 384 threads, rounded down to 8: 168 each). A consumer increase that the producer's decrease does
// not pay for never completes: the kernel would hang at its first instruction.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
static_assert(kProducerRegs * 128 + kConsumerRegs * Tile::kConsumerThreads <= kLaunchRegs * kThreads,
              "setmaxnreg budget of the CTA");
constexpr int kWorkSlots = 2;
constexpr int kGroupM = 16;          // raster band of m-blocks inside an expert (as the grouped FFN)
constexpr int kCopyUnroll = 8;       // 16-byte vectors per lane in flight when copying a row
// ... in the FP8 form. Its tiles hold 192 accumulator registers per consumer thread (the bf16 tile's 128), and the
// copy's vectors, though in another item, cost them registers in ptxas's allocation of the one consumer loop: with
// 8, the promotions' totals were spilled, 103 local loads and stores per 128-long K block and thread (SASS of the
// K loop); with 2, 23. With the consumer's item also read in its slot (consumer()): 88 with 8, 40 with 4, and 2 with
// 2 (both loads of loop invariants). The FP8 form copies only remote rows (EP > 1), of half the bf16 bytes.
constexpr int kCopyUnrollFp8 = 2;
constexpr int kQuantUnroll = 4;      // ... when quantising a row to FP8
constexpr int kSendUnroll = 2;       // ... when SEND copies a slot's row to its origin (both forms)
constexpr int kSendGroup = 2;        // rows whose loads are in flight together there
constexpr int kReduceUnroll = 2;     // vectors per lane and row in flight in the origin's final sum
constexpr int kReduceGroup = 2;      // rows whose loads are in flight together there
constexpr uint32_t kConsumerBarrier = 3;  // named barrier of the 256 consumer threads (1, 2: epilogues)

// The routed GEMMs' TMA descriptors of one form of the kernel (a union: the parameter space holds 8 ranks).
struct Bf16RoutedTma {
  Tile::TmaA a_gu;    // received rows, [S * slot_rows, H]
  Tile::TmaA a_dn;    // h of the received rows, [S * slot_rows, I]
  Tile::TmaB b_gu;    // gate_up, L x [H, 2I]
  Tile::TmaB b_dn;    // down, L x [I, H]
};
struct Fp8RoutedTma {
  Fp8Tile::TmaA a_gu;      // x_q of the received rows, [S * slot_rows, H], row stride 2H (the ring's rows)
  Fp8Tile::TmaA a_dn;      // h_q, [S * slot_rows, I]
  Fp8Tile::TmaB b_gu;      // gate_up, L x [2I, H] (K-major)
  Fp8Tile::TmaB b_dn;      // down, L x [H, I] (K-major)
};
union RoutedTma {
  Bf16RoutedTma bf16;  // forward_kernel<false>
  Fp8RoutedTma fp8;    // forward_kernel<true>
  RoutedTma() {}
};

struct RankParams {
  RoutedTma routed;
  Tile::TmaA a_sgu;   // x, [T, H]
  Tile::TmaA a_sdn;   // shared h, [T, Is]
  Tile::TmaB b_sgu;   // shared gate_up, 1 x [H, 2Is]
  Tile::TmaB b_sdn;   // shared down, 1 x [Is, H]
  CommView view;
  const int4* x;
  const int32_t* topk_idx;
  const float* topk_weight;
  int4* y;
  int32_t* status;
  __nv_bfloat16* recv;   // [S][slot_rows][H]: dispatched rows, then (in place) the down projection's rows
  __nv_bfloat16* h;      // [S][slot_rows][I]
  __nv_bfloat16* shared_h;  // [T][Is]
  float* shared_out;     // [T][H]
  int32_t* sync;         // Plan::sync_words
  int32_t* row_slot;        // [M][slot_rows]: the slot (s T + t) k + j of each ring row (written with keep only)
  const int32_t* keep_pos;  // ForwardRank::keep_pos (nullptr: nothing kept)
  __nv_bfloat16* keep_gu;   // [keep_rows][2I]
  int32_t keep_rows;
  // FP8 routed experts (Plan::fp8; then h holds E4M3 values)
  const float* b_gu_scale;  // [L][2I/128][H/128]
  const float* b_dn_scale;  // [L][H/128][I/128]
  float* recv_scale;        // [H/128][scale_ld]: the scales of the received rows, k-block major (Fp8Tile::kScaleTail
  float* h_scale;           // [I/128][scale_ld]         floats of slack past each: the producer's bulk copies)
};

struct Params {
  Plan plan;
  int32_t num_ranks;
  int32_t skip_rank;
  int32_t dispatch_push;
  RankParams ranks[kMaxVirtualRanks];
};
static_assert(sizeof(Params) <= 32764, "kernel parameters (CUDA 12.1+ limit)");

struct Item {
  int32_t kind, mb, idx, count;            // communication items: idx of count in the stage
  int32_t group, row0, row_end, n_block;   // GEMM tiles: matrix, rows [row0, row_end) of A/out, column block
  int32_t mblock;                          // GEMM tiles: the m-block counter this tile adds to
  int32_t skip;                            // a dependency failed (poisoned workspace): do nothing
};

struct SharedStorage {
  Tile::Stages stages;
  gemm::Fp8StageScales scales;  // the FP8 tiles' scales of each stage (unused by the bf16 form)
  alignas(16) uint32_t epi[Tile::kConsumerWarpgroups][Tile::kEpiWords];
  Item work[kWorkSlots];
  alignas(8) uint64_t work_full[kWorkSlots];
  alignas(8) uint64_t work_empty[kWorkSlots];
  int32_t scan_warp[kWorkerWarps];
  int32_t flag;
};
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

__device__ __forceinline__ bool is_tile(int kind) {
  return kind == kSharedGu || kind == kSharedDn || kind == kGu || kind == kDn;
}

// ================================================================================ flags and counters

// Store this call's epoch into flag row `row` of moe_flags, slot [my rank], of every peer (after a system fence).
__device__ inline void publish(const CommView& v, int row, uint64_t epoch) {
  comm::publish_stamps(v, v.layout.moe_flags, row, epoch);
}

// Wait until every peer stamped flag row `row` of my moe_flags with at least `target`.
__device__ inline bool wait_peers(const CommView& v, int row, uint64_t target, uint32_t code, uint64_t epoch) {
  return comm::wait_stamps(v, v.layout.moe_flags, row, target, code, comm::kOpMoeForward, epoch);
}

// A wait for an item of the same rank outlasts the cross-rank bound: when a peer never comes, the wait for
// the peer times out first and names it, and the local waits behind it then see the poison.
constexpr uint64_t kLocalTimeoutFactor = 4;

// Wait until a counter of this rank's scratch reaches target (bounded; stops on poison).
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
      if (comm::global_timer_ns() - start > kLocalTimeoutFactor * v.timeout_ns) {
        comm::raise_error(v, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
        return false;
      }
    }
  }
}

// First call error of this rank wins (bad expert id, ring overflow); it does not poison the workspace.
__device__ inline void record_call_error(const RankParams& R, uint32_t code, int32_t token) {
  if (atomicCAS(R.sync + kCtlCallError, 0, int32_t(code)) == 0) atomicExch(R.sync + kCtlCallErrorToken, token);
}

// ================================================================================ schedule tables

struct Tables {  // one microbatch's rows and m-blocks per local expert (written by SCAN)
  const int32_t* row_start;  // [L + 1], rows inside the microbatch's ring slot
  const int32_t* mblock;     // [L + 1], prefix of m-blocks
};
__device__ __forceinline__ Tables tables(const Plan& p, const int32_t* sync, int m) {
  const int64_t off = int64_t(m) * (p.L + 1);
  return Tables{sync + p.o_row_start + off, sync + p.o_mblock + off};
}

__device__ __forceinline__ int32_t local_expert(const Plan& p, int rank, int32_t id) {
  if (id < 0 || id >= p.L * p.ep) return -1;
  const int32_t le = id - rank * p.L;
  return (le >= 0 && le < p.L) ? le : -1;
}

__device__ __forceinline__ void band_tile(int local, int rows, int nb, int* m_block, int* n_block) {
  gemm::band_tile<kTileM, kGroupM>(local, rows, nb, m_block, n_block);
}

// ================================================================================ the ticket decoder

__device__ inline Item comm_item(int kind, int mb, int idx, int count) {
  Item it{};
  it.kind = kind, it.mb = mb, it.idx = idx, it.count = count;
  return it;
}

__device__ inline Item shared_tile(const Plan& p, int kind, int local) {
  Item it{};
  it.kind = kind;
  const int nb = kind == kSharedGu ? p.nb_shared_gu : p.nb_shared_dn;
  int mblk, nblk;
  band_tile(local, p.T, nb, &mblk, &nblk);
  it.group = 0, it.row0 = mblk * kTileM, it.row_end = p.T, it.n_block = nblk, it.mblock = mblk;
  return it;
}

// A routed tile of microbatch m: expert by binary search over the m-block prefix, then the band raster.
__device__ inline Item routed_tile(const Plan& p, const int32_t* sync, int kind, int m, int local) {
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

__device__ inline Item decode(const Plan& p, const RankParams& R, int32_t t, uint64_t epoch) {
  if (t < p.t_count) return comm_item(kPost, 0, t, p.n_post);
  if (t < p.t_scan) return comm_item(kCount, 0, t - p.t_count, p.n_count);
  if (t < p.t_place) return comm_item(kScan, 0, 0, 1);
  if (t < p.t_disp0) return comm_item(kPlace, 0, t - p.t_place, p.n_place);
  if (t < p.t_sgu) return comm_item(kDispatch, 0, t - p.t_disp0, p.D);
  if (t < p.t_sdn) return shared_tile(p, kSharedGu, t - p.t_sgu);
  if (t < p.t_dynamic) return shared_tile(p, kSharedDn, t - p.t_sdn);
  Item end{};
  end.kind = kEnd;
  if (!wait_count(R.view, R.sync + kCtlScan, 1, epoch)) return end;
  const int32_t nseg = R.sync[kCtlSegments];
  const int32_t* begin = R.sync + p.o_seg_begin;
  if (t >= begin[nseg]) return end;
  int lo = 0, hi = nseg;  // last segment with begin <= t (segments are never empty)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (begin[mid] <= t) lo = mid; else hi = mid;
  }
  const int kind = R.sync[p.o_seg_kind + lo], m = R.sync[p.o_seg_mb + lo];
  const int local = t - begin[lo];
  if (kind == kGu || kind == kDn) return routed_tile(p, R.sync, kind, m, local);
  return comm_item(kind, m, local, begin[lo + 1] - begin[lo]);
}

// ================================================================================ dependencies

__device__ inline int32_t dn_tiles(const Plan& p, const int32_t* sync, int m) {
  return tables(p, sync, m).mblock[p.L] * p.nb_dn;
}

__device__ inline bool wait_deps(const Plan& p, const RankParams& R, const Item& it, int ctas, uint64_t epoch) {
  const CommView& v = R.view;
  const int32_t* sync = R.sync;
  switch (it.kind) {
    case kPost:
      return wait_peers(v, comm::kMoeAckDisp, epoch - 1, comm::kErrTimeoutAck, epoch);
    case kCount:
      return wait_peers(v, comm::kMoeSigRoute, epoch, comm::kErrTimeoutRouting, epoch);
    case kScan:
      return wait_count(v, sync + kCtlCount, p.n_count, epoch);
    case kPlace:
      return wait_count(v, sync + kCtlScan, 1, epoch);
    case kDispatch: {
      if (!wait_count(v, sync + kCtlPlace, p.n_place, epoch)) return false;
      if (!wait_peers(v, comm::kMoeSigX, epoch, comm::kErrTimeoutData, epoch)) return false;
      const int m = it.mb - p.S;  // the microbatch that used this ring slot last
      if (m < 0) return true;
      return wait_count(v, sync + p.o_send + m, n_send(p, m, ctas), epoch) &&
             wait_count(v, sync + p.o_reduce + m, n_reduce(p, m, ctas), epoch);
    }
    case kSharedGu:
      return true;
    case kSharedDn:
      return wait_count(v, sync + p.o_sgu + it.mblock, p.nb_shared_gu, epoch);
    case kGu:
      return wait_count(v, sync + p.o_disp + it.mb, p.D, epoch);
    case kDn:
      return wait_count(v, sync + p.o_gu + int64_t(it.mb) * p.mb_cap + it.mblock, p.nb_gu, epoch);
    case kSend:
      return wait_count(v, sync + p.o_disp + it.mb, p.D, epoch) &&
             wait_count(v, sync + p.o_dn + it.mb, dn_tiles(p, sync, it.mb), epoch) &&
             wait_peers(v, comm::kMoeAckComb, epoch - 1, comm::kErrTimeoutAck, epoch);
    case kReduce:
      return wait_count(v, sync + p.o_disp + it.mb, p.D, epoch) &&
             wait_count(v, sync + p.o_dn + it.mb, dn_tiles(p, sync, it.mb), epoch) &&
             wait_count(v, sync + kCtlSharedDn, p.n_shared_dn, epoch) &&
             wait_peers(v, comm::kMoeSigComb + it.mb, epoch, comm::kErrTimeoutData, epoch);
    default:
      return true;
  }
}

// ================================================================================ completion

__device__ inline int32_t bump(int32_t* ctr) {
  __threadfence();
  return atomicAdd(ctr, 1);
}

// One thread, after every consumer thread finished the item's stores.
__device__ inline void complete(const Plan& p, const RankParams& R, const Item& it, int ctas, uint64_t epoch) {
  int32_t* sync = R.sync;
  const CommView& v = R.view;
  switch (it.kind) {
    case kPost:
      if (bump(sync + kCtlPostRows) == p.n_post - 1) publish(v, comm::kMoeSigX, epoch);
      break;
    case kCount: bump(sync + kCtlCount); break;
    case kScan:
      __threadfence();
      comm::st_release_gpu(sync + kCtlScan, 1);
      break;
    case kPlace: bump(sync + kCtlPlace); break;
    case kDispatch:
      bump(sync + p.o_disp + it.mb);
      if (bump(sync + kCtlDispatchAll) == p.M * p.D - 1) publish(v, comm::kMoeAckDisp, epoch);
      break;
    case kSharedGu: bump(sync + p.o_sgu + it.mblock); break;
    case kSharedDn: bump(sync + kCtlSharedDn); break;
    case kGu: bump(sync + p.o_gu + int64_t(it.mb) * p.mb_cap + it.mblock); break;
    case kDn: bump(sync + p.o_dn + it.mb); break;
    case kSend:
      comm::fence_sys();
      if (bump(sync + p.o_send + it.mb) == it.count - 1) publish(v, comm::kMoeSigComb + it.mb, epoch);
      break;
    case kReduce: {
      bump(sync + p.o_reduce + it.mb);
      int32_t total = 0;
      for (int m = 0; m < p.M; ++m) total += n_reduce(p, m, ctas);
      if (bump(sync + kCtlReduceAll) == total - 1) publish(v, comm::kMoeAckComb, epoch);
      break;
    }
    default: break;
  }
}

// ================================================================================ communication items
// Executed by the 256 consumer threads: warp w (0..7) and lane of thread ct.

constexpr uint32_t kFull = 0xffffffffu;

__device__ __forceinline__ void nan_row(int4* dst, int nvec, int lane) {
  const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
  for (int i = lane; i < nvec; i += 32) comm::st_v4(dst + i, nan);
}

// POST (source side, ep > 1): my routing into every peer, then my rows where the owners will look for them (FP8:
// quantised, the row's H E4M3 bytes then its H/128 scales).
template <bool kFp8>
__device__ inline void run_post(const Params& P, const RankParams& R, const Item& it, int ct, uint64_t epoch) {
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
  const size_t stage_row0 = size_t(v.rank) * v.shape.max_tokens;
  for (int64_t t = t0 + warp; t < t1; t += kWorkerWarps) {
    const int32_t id = lane < k ? R.topk_idx[t * k + lane] : -1;
    const int owner = (id >= 0 && id < p.L * p.ep) ? id / p.L : -1;
    const uint32_t same = __match_any_sync(kFull, owner);
    const bool remote = lane == __ffs(same) - 1 && owner >= 0 && owner != v.rank;
    uint32_t lanes = __ballot_sync(kFull, remote);
    if (lanes == 0) continue;
    int4* my_dst = nullptr;
    if (!P.dispatch_push) {
      lanes &= -lanes;  // one copy, into my own stage, for every owner to pull
      my_dst = v.local<int4>(v.layout.stage) + (stage_row0 + t) * nvec;
    } else if (remote) {
      my_dst = v.peer<int4>(owner, v.layout.stage) + (stage_row0 + t) * nvec;
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

__device__ __forceinline__ size_t stage_row(const CommView& v, int s, int64_t t) {
  return size_t(s) * v.shape.max_tokens + size_t(t);
}

// The ring slot of microbatch m: its rows, nvec 16-byte vectors each.
__device__ __forceinline__ int4* ring_slot(const Plan& p, const RankParams& R, int m) {
  return reinterpret_cast<int4*>(R.recv) + size_t(m % p.S) * p.slot_rows * (p.H / 8);
}

// The first token of microbatch m, and this item's share [*q0, *q1) of the stage's per_token * tokens units.
__device__ __forceinline__ int stage_share(const Plan& p, const Item& it, int per_token, int64_t* q0, int64_t* q1) {
  int t_lo, t_hi;
  mb_tokens(p, it.mb, &t_lo, &t_hi);
  share(int64_t(t_hi - t_lo) * per_token, it.idx, it.count, q0, q1);
  return t_lo;
}

// DISPATCH(m): every (source, token) of microbatch m with local slots -> its rows of the ring slot. FP8: my own
// rows are quantised here, a source's staged row (quantised by its POST) is copied as E4M3 bytes and scales.
template <bool kFp8>
__device__ inline void run_dispatch(const Params& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, ep = p.ep;
  const int nvec = p.H / 8;
  int64_t q0, q1;
  const int t_lo = stage_share(p, it, ep, &q0, &q1);
  int4* slot = ring_slot(p, R, it.mb);
  const int32_t* row_table = R.sync + p.o_row;
  if (p.timing_mode & kTimingNoDispatchRows) q1 = q0;  // timing mode
  for (int64_t q = q0 + warp; q < q1; q += kWorkerWarps) {
    const int64_t t = t_lo + q / ep;
    const int s = int(q % ep);  // sources interleaved: NVLink and local reads proceed together
    const int32_t row = lane < k ? row_table[(int64_t(s) * p.T + t) * k + lane] : -1;
    const uint32_t lanes = __ballot_sync(kFull, row >= 0);
    if (lanes == 0) continue;
    const int4* src = s == v.rank ? R.x + t * nvec
                      : P.dispatch_push ? v.local<const int4>(v.layout.stage) + stage_row(v, s, t) * nvec
                                        : v.peer<const int4>(s, v.layout.stage) + stage_row(v, s, t) * nvec;
    int4* my_dst = row >= 0 ? slot + size_t(row) * nvec : nullptr;
    for (int rep = (p.timing_mode & kTimingTwiceDispatchRows) ? 2 : 1; rep > 0; --rep) {
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
// tile left it in the ring (bf16, before the router weight), into origin s's comb[t][j]: one row per slot, so that
// the origin sums the same terms in the same order at every EP size (run_reduce). A slot past the ring slot (row
// -2) gets a NaN row there.
__device__ inline void run_send(const Params& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, ep = p.ep;
  const int nvec = p.H / 8;
  int64_t q0, q1;
  const int t_lo = stage_share(p, it, ep - 1, &q0, &q1);
  const int4* slot = ring_slot(p, R, it.mb);
  if (p.timing_mode & kTimingNoSendRows) q1 = q0;  // timing mode
  for (int64_t q = q0 + warp; q < q1; q += kWorkerWarps) {
    const int64_t t = t_lo + q / (ep - 1);
    const int so = int(q % (ep - 1));
    const int s = so < v.rank ? so : so + 1;
    const int32_t row = lane < k ? R.sync[p.o_row + (int64_t(s) * p.T + t) * k + lane] : -1;
    int4* cell = v.peer<int4>(s, v.layout.comb) + size_t(t) * k * nvec;  // origin s's comb[t][0]
    const uint32_t dropped = __ballot_sync(kFull, row == -2);
    for (uint32_t m = dropped; m; m &= m - 1) nan_row(cell + size_t(__ffs(m) - 1) * nvec, nvec, lane);
    const int4* my_src = row >= 0 ? slot + size_t(row) * nvec : nullptr;
    comm::warp_copy_rows<kSendUnroll, kSendGroup>(my_src, cell + size_t(lane) * nvec, __ballot_sync(kFull, row >= 0),
                                                  nvec, lane);
  }
}

// y_t = bf16( sum over t's slots j, ascending, of w_j * row_j  +  shared_row ), fp32, one rounding per operation:
// row_j is slot j's expert output row, bf16 (my ring's row when its expert is mine, else the one its owner pushed
// into my comb[t][j]); lane j holds its address (my_src) and weight, `used` the slots with an expert. The terms and
// their order do not depend on which rank owns which expert, so y has the same bits at every EP size.
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
__device__ inline void run_reduce(const Params& P, const RankParams& R, const Item& it, int ct) {
  const Plan& p = P.plan;
  const CommView& v = R.view;
  const int warp = ct / 32, lane = ct % 32, k = p.k, rank = v.rank;
  const int nvec = p.H / 8;
  const int num_experts = p.L * p.ep;
  int64_t b, e;
  const int t_lo = stage_share(p, it, 1, &b, &e);
  const int4* rows = ring_slot(p, R, it.mb);
  const int4* comb = v.local<const int4>(v.layout.comb);
  if (p.timing_mode & kTimingNoReduceRows) e = b;  // timing mode
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
                         : id >= 0 ? comb + (size_t(t) * k + lane) * nvec : nullptr;
    const float my_w = id >= 0 ? R.topk_weight[t * k + lane] : 0.0f;
    const uint32_t used = __ballot_sync(kFull, id >= 0);
    const float* shared_row = p.Is > 0 ? R.shared_out + t * p.H : nullptr;
    for (int rep = (p.timing_mode & kTimingTwiceReduceRows) ? 2 : 1; rep > 0; --rep)
      reduce_row(my_src, my_w, used, shared_row, nvec, dst, lane);
  }
}

// ================================================================================ GEMM tiles

// FP8 routed tiles (kFp8): GU reads the ring's x_q and gate_up, DN reads h_q and down (both K-major).
__device__ inline Fp8Tile::TileLoad fp8_tile_load(const Plan& p, const Item& it) {
  const int rows = p.S * p.slot_rows;
  if (it.kind == kGu)
    return Fp8Tile::TileLoad{rows, p.H, it.row0, 2 * p.I, p.L, it.group, it.n_block * kGuCols,
                             it.n_block * kGuCols + p.I};
  return Fp8Tile::TileLoad{rows, p.I, it.row0, p.H, p.L, it.group, it.n_block * kDnCols,
                           it.n_block * kDnCols + Fp8Tile::kHalfN};
}

__device__ __forceinline__ bool is_routed(int kind) { return kind == kGu || kind == kDn; }

__device__ inline Tile::TileLoad tile_load(const Plan& p, const Item& it) {
  const int rows = p.S * p.slot_rows;
  switch (it.kind) {
    case kGu:
      return Tile::TileLoad{rows, p.H, it.row0, 2 * p.I, p.L, it.group, it.n_block * kGuCols,
                            it.n_block * kGuCols + p.I};
    case kDn:
      return Tile::TileLoad{rows, p.I, it.row0, p.H, p.L, it.group, it.n_block * kDnCols,
                            it.n_block * kDnCols + Tile::kHalfN};
    case kSharedGu:
      return Tile::TileLoad{p.T, p.H, it.row0, 2 * p.Is, 1, 0, it.n_block * kGuCols, it.n_block * kGuCols + p.Is};
    default:  // kSharedDn
      return Tile::TileLoad{p.T, p.Is, it.row0, p.H, 1, 0, it.n_block * kDnCols, it.n_block * kDnCols + Tile::kHalfN};
  }
}

template <bool kFp8>
__device__ inline bool load_item(const RankParams& R, SharedStorage& s, Tile::StagePos& pos, const Plan& p,
                                 const Item& it, int32_t* status) {
  if constexpr (kFp8) {
    if (is_routed(it.kind)) {
      const Fp8Tile::TileLoad t = fp8_tile_load(p, it);
      const Fp8RoutedTma& d = R.routed.fp8;
      return it.kind == kGu
                 ? Fp8Tile::load_tile(d.a_gu, d.b_gu, R.recv_scale, p.scale_ld, R.b_gu_scale, s.stages, s.scales,
                                      pos, t, status)
                 : Fp8Tile::load_tile(d.a_dn, d.b_dn, R.h_scale, p.scale_ld, R.b_dn_scale, s.stages, s.scales, pos,
                                      t, status);
    }
  }
  const Tile::TileLoad t = tile_load(p, it);
  switch (it.kind) {
    case kGu: return Tile::load_tile(R.routed.bf16.a_gu, R.routed.bf16.b_gu, s.stages, pos, t, status);
    case kDn: return Tile::load_tile(R.routed.bf16.a_dn, R.routed.bf16.b_dn, s.stages, pos, t, status);
    case kSharedGu: return Tile::load_tile(R.a_sgu, R.b_sgu, s.stages, pos, t, status);
    default: return Tile::load_tile(R.a_sdn, R.b_sdn, s.stages, pos, t, status);
  }
}

__device__ inline int tile_k(const Plan& p, int kind) {
  return kind == kGu || kind == kSharedGu ? p.H : kind == kDn ? p.I : p.Is;
}

// Kept g, u (ForwardRank::keep_gu): the gate/up tile's fp32 accumulators of its rows rounded to bf16 (round to
// nearest even, as the backward's recompute stores them), each to its slot's row of keep_gu (g in columns [0, I),
// u in [I, 2I)), straight from registers (4-byte stores; a row's 4 lanes write 16 contiguous bytes). Value i of
// thread t: row 16 (t/32) + (t%32)/4 + 8 ((i/2)%2), column 8 (i/4) + 2 (t%4) + i%2 of the 256 MMA columns, whose
// first 128 are gate columns and last 128 the matching up columns.
__device__ inline void store_kept_gu(const Plan& p, const RankParams& R, const Tile::Accumulator& acc, const Item& it,
                                     int wg, int t) {
  const int lane = t % 32, warp = t / 32;
  const int r_base = it.row0 + Tile::kRowsPerConsumer * wg + 16 * warp + lane / 4;
  const int c_base = it.n_block * kGuCols + 2 * (lane % 4);
  const int ring_row0 = (it.mb % p.S) * p.slot_rows;
  const int32_t* row_slot = R.row_slot + int64_t(it.mb) * p.slot_rows;
  CUTE_UNROLL
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r_base + 8 * hh;
    int32_t dst = -1;
    if (row < it.row_end) {
      const int32_t d = R.keep_pos[__ldcg(row_slot + (row - ring_row0))];  // written by PLACE items (L2)
      if (d >= 0 && d < R.keep_rows) dst = d;
    }
    if (dst < 0) continue;
    __nv_bfloat16* g = R.keep_gu + int64_t(dst) * 2 * p.I;
    CUTE_UNROLL
    for (int q = 0; q < kGuCols / 8; ++q) {
      const int i = 4 * q + 2 * hh;
      const int col = c_base + 8 * q;
      if (col < p.I) {  // volatile: issued in order, so the compiler does not hold 64 addresses at once
        asm volatile("st.global.b32 [%0], %1;" ::"l"(g + col), "r"(Tile::pack_bf16x2(acc(i), acc(i + 1))));
        asm volatile("st.global.b32 [%0], %1;" ::"l"(g + p.I + col),
                     "r"(Tile::pack_bf16x2(acc(i + 64), acc(i + 65))));
      }
    }
  }
}

__device__ inline void store_item(const Plan& p, const RankParams& R, SharedStorage& s, const Tile::Accumulator& acc,
                                  const Item& it, int wg, int t) {
  switch (it.kind) {
    case kGu:
      if (R.keep_gu != nullptr) store_kept_gu(p, R, acc, it, wg, t);
      Tile::store_bf16<true>(acc, s.epi[wg], Tile::TileStore{R.h, p.I, it.row0, it.row_end, it.n_block * kGuCols, p.I},
                             wg, t);
      gemm::fence_proxy_async_global();  // the DN tiles read h with TMA
      break;
    case kDn:
      Tile::store_bf16<false>(acc, s.epi[wg],
                              Tile::TileStore{R.recv, p.H, it.row0, it.row_end, it.n_block * kDnCols, p.H}, wg, t);
      break;
    case kSharedGu:
      Tile::store_bf16<true>(acc, s.epi[wg],
                             Tile::TileStore{R.shared_h, p.Is, it.row0, it.row_end, it.n_block * kGuCols, p.Is}, wg, t);
      gemm::fence_proxy_async_global();
      break;
    default:
      Tile::store_f32(acc, Tile::TileStore{R.shared_out, p.H, it.row0, it.row_end, it.n_block * kDnCols, p.H}, wg, t);
      break;
  }
}

// A GEMM tile: MMAs, then the epilogue. (Kept inline: as a called function its accumulators spilled.) The
// accumulators' 128 registers stay allocated across the whole consumer loop, which is why the row movers of
// the communication items keep few vectors in flight (kSendUnroll etc.): more spilled.
// An FP8 routed tile: chains and promotions into two 64-value totals, then GU's SwiGLU with h quantised (E4M3 and
// its scales, read by DN's TMA next) or DN's bf16 rows over the ring rows, in place.
__device__ __forceinline__ bool fp8_tile_item(const Plan& p, const RankParams& R, SharedStorage& s, Tile::StagePos& pos,
                                           const Item& it, int ct) {
  Fp8Tile::Accumulator total0, total1;
  const int n_k = (it.kind == kGu ? p.H : p.I) / gemm::kFp8ScaleBlock;
  if (!Fp8Tile::mma_tile(s.stages, s.scales, pos, total0, total1, n_k, it.row0 % gemm::kFp8RowScaleSlack, ct,
                         nullptr))
    return false;
  const int wg = ct / 128, t = ct % 128;
  if (it.kind == kGu) {
    Fp8Tile::store_swiglu_quant(total0, total1,
                                Fp8Tile::TileStore{R.h, p.I, R.h_scale, p.scale_ld, it.row0, it.row_end,
                                                   it.n_block * kGuCols, p.I},
                                wg, t);
    gemm::fence_proxy_async_global();  // the DN tiles read h and its scales with TMA
  } else {
    const Fp8Tile::TileStore st{R.recv, p.H, nullptr, 0, it.row0, it.row_end, it.n_block * kDnCols, p.H};
    Fp8Tile::store_bf16(total0, st, 0, wg, t);
    Fp8Tile::store_bf16(total1, st, 1, wg, t);
  }
  return true;
}

template <bool kFp8>
__device__ __forceinline__ bool tile_item(const Plan& p, const RankParams& R, SharedStorage& s, Tile::StagePos& pos,
                                       const Item& it, int ct) {
  if constexpr (kFp8) {
    if (is_routed(it.kind)) return fp8_tile_item(p, R, s, pos, it, ct);
  }
  Tile::Accumulator acc;
  if (!Tile::mma_tile(s.stages, pos, acc, tile_k(p, it.kind), ct, nullptr)) return false;
  store_item(p, R, s, acc, it, ct / 128, ct % 128);
  return true;
}

// ================================================================================ roles

template <bool kFp8>
__device__ inline void producer(const Params& P, const RankParams& R, SharedStorage& s, int ctas, uint64_t epoch) {
  const Plan& p = P.plan;
  Tile::StagePos pos;
  int w = 0;
  uint32_t phase = 0;
  for (;;) {
    const int32_t ticket = atomicAdd(R.sync + kCtlTickets, 1);
    Item it = decode(p, R, ticket, epoch);
    if (it.kind != kEnd) it.skip = wait_deps(p, R, it, ctas, epoch) ? 0 : 1;
    if (!gemm::mbarrier_wait(&s.work_empty[w], phase ^ 1, nullptr)) {
      comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
      return;
    }
    s.work[w] = it;
    cutlass::arch::ClusterBarrier::arrive(&s.work_full[w]);
    if (++w == kWorkSlots) w = 0, phase ^= 1;
    if (it.kind == kEnd) return;
    if (is_tile(it.kind) && !it.skip) {
      gemm::fence_proxy_async_global();  // rows that other CTAs stored are read next through TMA
      if (!load_item<kFp8>(R, s, pos, p, it, nullptr)) {
        comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
        return;
      }
    }
  }
}

template <bool kFp8>
__device__ inline void consumer(const Params& P, const RankParams& R, SharedStorage& s, int ct, int ctas,
                                uint64_t epoch) {
  const Plan& p = P.plan;
  Tile::StagePos pos;
  const int lane = ct % 32;
  int w = 0;
  uint32_t phase = 0;
  for (;;) {
    if (!gemm::mbarrier_wait(&s.work_full[w], phase, nullptr)) {
      comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
      return;
    }
    // The item is read from its slot where it is used, and the slot is given back only when the item is done: a
    // copy in registers would stay live across a tile's K loop, where the FP8 tiles' 192 accumulators leave none.
    const Item& it = s.work[w];
    if (it.kind == kEnd) return;
    if (is_tile(it.kind)) {
      if (!it.skip && !tile_item<kFp8>(p, R, s, pos, it, ct)) {
        comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
        return;
      }
    } else if (!it.skip || it.kind == kReduce) {
      switch (it.kind) {
        case kPost: run_post<kFp8>(P, R, it, ct, epoch); break;
        case kCount: run_count(p, R, it, ct); break;
        case kScan: run_scan(p, R, s, ct, ctas); break;
        case kPlace: run_place(p, R, it, ct); break;
        case kDispatch: run_dispatch<kFp8>(P, R, it, ct); break;
        case kSend: run_send(P, R, it, ct); break;
        case kReduce: run_reduce(P, R, it, ct); break;
        default: break;
      }
    } else if (it.kind == kPost) {  // skipped: still count the routing half, which run_post signals
      gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
      if (ct == 0) bump(R.sync + kCtlPostRoute);
    }
    gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
    if (ct == 0) complete(p, R, it, ctas, epoch);
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.work_empty[w]);
    if (++w == kWorkSlots) w = 0, phase ^= 1;
  }
}

// The last CTA of a rank to finish: status, the call error word, the epoch; NaN everywhere if the call failed.
__device__ inline void finish_call(const Plan& p, const RankParams& R, SharedStorage& s, int ctas, uint64_t epoch) {
  const CommView& v = R.view;
  comm::LocalState* st = v.state();
  if (threadIdx.x == 0) {
    __threadfence();
    s.flag = atomicAdd(&st->moe_exit, 1u) == uint32_t(ctas - 1);
  }
  __syncthreads();
  if (!s.flag) return;
  __threadfence();
  const uint64_t poison = comm::read_poison(v);
  if (poison != 0) {  // outputs are defined: every row NaN
    const int nvec = p.H / 8;
    const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
    for (int64_t i = threadIdx.x; i < int64_t(p.T) * nvec; i += blockDim.x) comm::st_v4(R.y + i, nan);
  }
  if (threadIdx.x != 0) return;
  const int32_t call = *reinterpret_cast<volatile int32_t*>(R.sync + kCtlCallError);
  const int32_t token = *reinterpret_cast<volatile int32_t*>(R.sync + kCtlCallErrorToken);
  if (poison != 0) {
    comm::publish_host_error(v, poison);
    const comm::ErrorInfo info = comm::unpack_error(poison);
    R.status[0] = int32_t(info.code), R.status[1] = int32_t(info.op), R.status[2] = info.rank;
    R.status[3] = info.peer;
  } else if (call != 0) {
    R.status[0] = call, R.status[1] = comm::kOpMoeForward, R.status[2] = v.rank, R.status[3] = token;
    volatile uint64_t* h = v.host_call_error;
    if (*h == 0) {
      *h = comm::pack_error(uint32_t(call), comm::kOpMoeForward, v.rank, -1, epoch);
      __threadfence_system();
    }
  } else {
    R.status[0] = R.status[1] = R.status[2] = R.status[3] = 0;
  }
  *reinterpret_cast<volatile uint32_t*>(&st->moe_exit) = 0;
  *reinterpret_cast<volatile uint64_t*>(&st->moe_epoch) = epoch;
  __threadfence();
}

template <bool kFp8>
__device__ inline void run(const Params& P) {
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& s = gemm::aligned_shared_storage<SharedStorage>(smem_raw);
  const int vr = int(blockIdx.x) % P.num_ranks;
  if (vr == P.skip_rank) return;  // test mode: this emulated rank makes no call
  const int ctas = (int(gridDim.x) - vr + P.num_ranks - 1) / P.num_ranks;
  const RankParams& R = P.ranks[vr];
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&R.view.state()->moe_epoch) + 1;
  const int warp = cutlass::canonical_warp_idx_sync();
  if (threadIdx.x == 0) {
    Tile::init_stages(s.stages);
    for (int i = 0; i < kWorkSlots; ++i) {
      cutlass::arch::ClusterBarrier::init(&s.work_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&s.work_empty[i], kWorkerWarps);
    }
    cutlass::arch::fence_barrier_init();
    if constexpr (kFp8) {
      const Fp8RoutedTma& d = R.routed.fp8;
      cute::prefetch_tma_descriptor(d.a_gu.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.a_dn.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.b_gu.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.b_dn.get_tma_descriptor());
    } else {
      const Bf16RoutedTma& d = R.routed.bf16;
      cute::prefetch_tma_descriptor(d.a_gu.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.a_dn.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.b_gu.get_tma_descriptor());
      cute::prefetch_tma_descriptor(d.b_dn.get_tma_descriptor());
    }
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) producer<kFp8>(P, R, s, ctas, epoch);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consumer<kFp8>(P, R, s, threadIdx.x - 128, ctas, epoch);
  }
  __syncthreads();
  finish_call(P.plan, R, s, ctas, epoch);
}

}  // namespace mok::moe
