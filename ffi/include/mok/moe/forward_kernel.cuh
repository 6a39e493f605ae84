// mok moe: the forward megakernel (sm_90a). One persistent launch per call runs, for each EP rank it
// carries, the whole MoE forward: routing exchange, schedule, dispatch, shared expert, gate/up GEMM with
// SwiGLU, down GEMM, combine, final sum. The math is in forward.cuh, the work items and their order in
// plan.cuh, the symmetric buffers in mok/comm/workspace.cuh.
//
// Roles. One CTA per SM (384 threads), every CTA a general worker of one EP rank (CTA b serves rank
// b % num_ranks); nothing is tied to an SM, so the same code serves any EP size and any SM count:
//   warp 0, one lane ("producer"): claims the rank's next ticket (atomicAdd), decodes it into an item,
//       waits (bounded) for the item's dependencies, hands it to the consumers through a 2-slot work queue
//       in shared memory, and for a GEMM tile issues its TMA loads into the stage ring (Sm90Tile::load_tile).
//       It then claims the next ticket while the consumers still work: loads of tile n+1 overlap MMAs of n.
//   warps 1-3: idle (registers given to the consumers).
//   warpgroups 1-2 ("consumers", 8 warps): execute every item: a GEMM tile (Sm90Tile::mma_tile, 64 rows
//       each, then an epilogue policy), or a communication/schedule item (the warps move rows with 16-byte
//       vectors, one row per warp at a time). Then one thread publishes the item's completion.
// Communication therefore time-shares SMs with compute: a communication phase is split into comm_items
// items, so that many CTAs move rows while the rest run tiles (KernelConfig.comm_items_fwd).
//
// Registers: producer warpgroup 40, consumers 232 per thread (setmaxnreg; the CTA's 168 x 384 in all). Shared memory: stage ring
// 192 KB + the FP8 stages' scales 2 KB + epilogue buffers 18 KB + work queue and scan scratch; one CTA per SM.
//
// FP8 routed experts (the kernel's kFp8 form, Plan::fp8): each token row is quantised once in 1 x 128 tiles by
// its source (POST into its posted row at EP > 1, DISPATCH for its own rows: comm::warp_quantize_row), so the
// posted rows carry H E4M3 bytes and H/128 scales and DISPATCH copies those into the ring: the E4M3 bytes at
// the start of the ring row (whose 2H bytes the down tile's bf16 output overwrites in place, as in the bf16
// form) and the scales into the ring's k-block-major recv_scale. GU and DN tiles are gemm::Sm90Fp8Tile's (the
// standalone FP8 FFN's chains, promotions and epilogues: the same bits per row), fed through the same stage ring
// by the same producer thread (row scales by a bulk copy); GU's epilogue writes h in E4M3 with its scales. The shared
// expert, SEND, REDUCE and y are the bf16 form's.
//
// Lab form (kLab; bf16 only): the only form with the code of skip_rank (run) and of the timing modes (DISPATCH,
// SEND, REDUCE: timing_bits), launched only for a call that sets one of them; every other call runs a production
// form, which has none of it (forward_params.cuh, timing_bits).
//
// Synchronisation. Within a rank: counters in the call's scratch (zeroed before the launch), bumped with
// a release after an item's stores (and a proxy fence where TMA reads the data next), polled with acquire
// loads. Across ranks: epoch stamps in the workspace's moe_stamps, stored by the last item of what they
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

#include <type_traits>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/megakernel.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/plan.cuh"

#include "mok/moe/forward_params.cuh"
#include "mok/moe/forward_items.cuh"
#include "mok/moe/forward_tiles.cuh"
#include "mok/moe/items.cuh"

namespace mok::moe {

// ================================================================================ roles

template <bool kFp8, class LaunchParams>
__device__ inline void producer(const LaunchParams& P, const RankParams& R, SharedStorage& s, int ctas,
                                uint64_t epoch) {
  const Plan& p = P.plan;
  Tile::StagePos pos;
  WorkCursor w;
  for (;;) {
    const int32_t ticket = atomicAdd(R.sync + kCtlTickets, 1);
    Item it = decode(p, R, ticket, epoch);
    if (it.kind != kEnd) it.skip = wait_deps(p, R, it, ctas, epoch) ? 0 : 1;
    if (!s.work.wait_free(w, nullptr)) {
      comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
      return;
    }
    s.work.publish(w, it);
    s.work.advance(w);
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

// The lab form's item times (kTimingItemTimes; plan.cuh, kItemTimeWords): one consumer thread adds the times of an
// item of `kind` (or, at kEnd, of the consumers' whole run) that waited from `since` and ran from t0 to t1.
__device__ inline void add_item_time(const Plan& p, const RankParams& R, int kind, uint64_t since, uint64_t t0,
                                     uint64_t t1) {
  auto* f = reinterpret_cast<unsigned long long*>(R.sync + p.o_item_times) + kItemTimeFields * kind;
  atomicAdd(f + 0, (unsigned long long)(t1 - t0));
  atomicAdd(f + 1, (unsigned long long)(t0 - since));
  atomicAdd(f + 2, 1ull);
  atomicMax(f + 3, (unsigned long long)~t0);
  atomicMax(f + 4, (unsigned long long)t1);
}

template <bool kFp8, bool kLab, class LaunchParams>
__device__ inline void consumer(const LaunchParams& P, const RankParams& R, SharedStorage& s, int ct, int ctas,
                                uint64_t epoch) {
  const Plan& p = P.plan;
  Tile::StagePos pos;
  const int lane = ct % 32;
  WorkCursor w;
  const bool timed = (timing_bits<kLab>(p) & kTimingItemTimes) && ct == 0;  // false in the production forms
  const uint64_t t_start = timed ? comm::global_timer_ns() : 0;
  uint64_t t_free = t_start;  // the end of the consumers' previous item
  for (;;) {
    if (!s.work.wait_ready(w, nullptr)) {
      comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
      return;
    }
    // The item is read from its slot where it is used, and the slot is given back only when the item is done: a
    // copy in registers would stay live across a tile's K loop, where the FP8 tiles' 192 accumulators leave none.
    const Item& it = s.work.at(w);
    const uint64_t t0 = timed ? comm::global_timer_ns() : 0;
    if (it.kind == kEnd) {
      if (timed) add_item_time(p, R, kEnd, t_start, t_start, t0);
      return;
    }
    if (is_tile(it.kind)) {
      // FP8: the thread's index is read afresh for each tile (opaque to the compiler), so that the epilogues'
      // addresses derived from it are recomputed per tile instead of hoisted out of the loop, where beside the 192
      // accumulators they were spilled.
      int tile_ct = ct;
      if constexpr (kFp8) asm volatile("mov.b32 %0, %0;" : "+r"(tile_ct));
      if (!it.skip && !tile_item<kFp8>(p, R, s, pos, it, tile_ct)) {
        comm::raise_error(R.view, comm::kErrTimeoutLocal, comm::kOpMoeForward, -1, epoch);
        return;
      }
    } else if (!it.skip || it.kind == kReduce) {
      switch (it.kind) {
        case kPost: PostItem::run<kFp8>(P, R, it, ct, epoch); break;
        case kCount: CountItem::run(p, R, it, ct); break;
        case kScan: ScanItem::run(p, R, s, ct, ctas); break;
        case kPlace: PlaceItem::run(p, R, it, ct); break;
        case kDispatch: DispatchItem::run<kFp8, kLab>(P, R, it, ct); break;
        case kSend: SendItem::run<kLab>(P, R, it, ct); break;
        case kReduce: ReduceItem::run<kLab>(P, R, it, ct); break;
        default: break;
      }
    } else if (it.kind == kPost) {
      PostItem::run_skipped(R, ct);
    }
    gemm::named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
    if (ct == 0) complete(p, R, it, ctas, epoch);
    if (timed) {
      const uint64_t t1 = comm::global_timer_ns();
      add_item_time(p, R, it.kind, t_free, t0, t1);
      t_free = t1;
    }
    s.work.give_back(w, lane);
    s.work.advance(w);
  }
}

// The last CTA of a rank to finish: status, the call error word, the epoch; NaN everywhere if the call failed.
__device__ inline void finish_call(const Plan& p, const RankParams& R, SharedStorage& s, int ctas, uint64_t epoch) {
  const CommView& v = R.view;
  comm::LocalState* st = v.state();
  if (threadIdx.x == 0) {
    __threadfence();
    s.last_cta = atomicAdd(&st->moe_exit, 1u) == uint32_t(ctas - 1);
  }
  __syncthreads();
  if (!s.last_cta) return;
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

// A forward_kernel_many launch found its RankParams in global memory, where upload_rank_params stored them through
// the generic proxy: each thread that reads a descriptor through the tensormap proxy (prefetch, the TMA loads) first
// acquires it (the CUDA Programming Guide's rule for a tensor map in global memory; that launch released them).
template <bool kFp8>
__device__ inline void acquire_descriptors(const RankParams& R) {
  auto acquire = [](const void* d) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" : : "l"(d) : "memory");
  };
  if constexpr (kFp8) {
    const Fp8RoutedTma& d = R.routed.fp8;
    acquire(d.a_gu.get_tma_descriptor()), acquire(d.a_dn.get_tma_descriptor());
    acquire(d.b_gu.get_tma_descriptor()), acquire(d.b_dn.get_tma_descriptor());
  } else {
    const Bf16RoutedTma& d = R.routed.bf16;
    acquire(d.a_gu.get_tma_descriptor()), acquire(d.a_dn.get_tma_descriptor());
    acquire(d.b_gu.get_tma_descriptor()), acquire(d.b_dn.get_tma_descriptor());
  }
  acquire(R.a_sgu.get_tma_descriptor()), acquire(R.a_sdn.get_tma_descriptor());
  acquire(R.b_sgu.get_tma_descriptor()), acquire(R.b_sdn.get_tma_descriptor());
}

// The forward on the megakernel shell (mok/megakernel.cuh). LaunchParams: Params (the RankParams in the parameter
// space) or ManyParams (in global memory), whose RankParams rank_params reads.
template <bool kFp8, bool kLab>
struct ForwardKernel {
  using Shared = SharedStorage;
  using Rank = RankParams;
  using Cta = megakernel::Cta;
  static constexpr int kProducerRegs = moe::kProducerRegs;
  static constexpr int kConsumerRegs = moe::kConsumerRegs;
  template <class LaunchParams>
  static constexpr bool in_global = !std::is_same_v<LaunchParams, Params>;

  template <class LaunchParams>
  static __device__ const RankParams& rank(const LaunchParams& P, int r) {
    return rank_params(P, r);
  }
  static __device__ uint64_t epoch(const RankParams& R) {
    return *reinterpret_cast<volatile uint64_t*>(&R.view.state()->moe_epoch) + 1;
  }
  static __device__ void acquire_descriptors(const RankParams& R) {
    moe::acquire_descriptors<kFp8>(R);
  }
  // Thread 0: the stage ring, the work queue, and the routed GEMMs' descriptors into the cache.
  template <class LaunchParams>
  static __device__ void init(const LaunchParams&, const RankParams& R, SharedStorage& s, int, int) {
    if (threadIdx.x != 0) return;
    Tile::init_stages(s.stages);
    s.work.init(kWorkerWarps);
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
  template <class LaunchParams>
  static __device__ void setup(const LaunchParams&, const RankParams&, SharedStorage&, Cta) {}
  template <class LaunchParams>
  static __device__ void producer(const LaunchParams& P, const RankParams& R, SharedStorage& s,
                                                  Cta cta, uint64_t epoch) {
    moe::producer<kFp8>(P, R, s, cta.ctas, epoch);
  }
  template <class LaunchParams>  // warps 1-3 are idle: their registers went to the consumers
  static __device__ void helpers(const LaunchParams&, const RankParams&, SharedStorage&, int, Cta) {}
  template <class LaunchParams>
  static __device__ void consumer(const LaunchParams& P, const RankParams& R, SharedStorage& s,
                                                  int ct, Cta cta, uint64_t epoch) {
    moe::consumer<kFp8, kLab>(P, R, s, ct, cta.ctas, epoch);
  }
  template <class LaunchParams>
  static __device__ void finish(const LaunchParams& P, const RankParams& R, SharedStorage& s,
                                                Cta cta, uint64_t epoch) {
    __syncthreads();
    finish_call(P.plan, R, s, cta.ctas, epoch);
  }
};

template <bool kFp8, bool kLab, class LaunchParams>
__device__ inline void run(const LaunchParams& P) {
  megakernel::run<ForwardKernel<kFp8, kLab>, kLab>(P);
}

}  // namespace mok::moe
