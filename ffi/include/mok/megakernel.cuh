// mok: the shell of the persistent megakernels, forward (mok/moe/forward_kernel.cuh) and backward
// (src/experts_backward.cu). One CTA per SM, each a general worker of one EP rank: CTA b serves rank b % num_ranks
// (one rank, or every rank of an emulated group), so the same code serves any EP size and any SM count. The shell
// owns what both have in common, in this order:
//   1. the CTA's rank, and in the lab form the test mode in which that rank makes no call (skip_rank);
//   2. the rank's parameters (in the launch's parameter space, or in global memory for a launch of many ranks,
//      whose TMA descriptors warp 0 then acquires) and the call's epoch;
//   3. the kernel's set-up of its shared memory (stage ring, work queue; the backward's group table), a CTA-wide
//      barrier, and what the kernel derives from it (the backward's status bits and list shape);
//   4. the roles: warp 0's elected lane is the producer, which claims items by ticket and hands them to the
//      consumers through the work queue (mok/work_queue.cuh), loading a GEMM tile's operands into the stage ring;
//      warps 1-3 of its warpgroup help where the kernel has work for them; warpgroups 1-2 are the consumers, which
//      run every item. Registers move from the producer warpgroup to the consumers (setmaxnreg);
//   5. the end of the call: the rank's last CTA to exit publishes the status and advances the epoch.
// A kernel is a type K with static members: Shared, Rank; kProducerRegs, kConsumerRegs; rank(P, r); epoch(R);
// in_global<Launch> and acquire_descriptors(R); init(P, R, s, warp, lane); setup(P, R, s, cta); producer(P, R, s,
// cta, epoch); helpers(P, R, s, t, cta) (warps 1-3, t in [0, 96)); consumer(P, R, s, ct, cta, epoch) (ct in
// [0, 256)); finish(P, R, s, cta, epoch). Each of those decides what a failed wait means for its call.
#pragma once

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "mok/gemm/sm90_sync.cuh"

namespace mok::megakernel {

// Where a CTA stands among those that serve its EP rank: how many they are, and its index.
struct Cta {
  int ctas;
  int index;
};

// The lab form (kLab) carries the code of skip_rank: a launch's rank that makes no call, for the tests of a peer
// that never comes. Production forms have none of it.
// `inline`, not __forceinline__, and so are K's members: forced inlining changes the order in which NVVM inlines the
// roles, and with it the forward's machine code (6 more named barriers, 1,152 more instructions when tried).
template <class K, bool kLab, class Launch>
__device__ inline void run(const Launch& P) {
  extern __shared__ __align__(1024) char smem_raw[];
  typename K::Shared& s = gemm::aligned_shared_storage<typename K::Shared>(smem_raw);
  const int vr = int(blockIdx.x) % P.num_ranks;
  if constexpr (kLab) {
    if (vr == P.skip_rank) return;  // test mode: this emulated rank makes no call
  }
  const Cta cta{(int(gridDim.x) - vr + P.num_ranks - 1) / P.num_ranks, int(blockIdx.x) / P.num_ranks};
  const typename K::Rank& R = K::rank(P, vr);
  const uint64_t epoch = K::epoch(R);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int lane = threadIdx.x % 32;
  if constexpr (K::template in_global<Launch>) {
    if (warp == 0) K::acquire_descriptors(R);  // warp 0 prefetches them and loads tiles through them
  }
  K::init(P, R, s, warp, lane);
  __syncthreads();
  K::setup(P, R, s, cta);
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    if (warp == 0) {
      if (cute::elect_one_sync()) K::producer(P, R, s, cta, epoch);
    } else {
      K::helpers(P, R, s, threadIdx.x - 32, cta);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
    K::consumer(P, R, s, threadIdx.x - 128, cta, epoch);  // unsigned, as before the shell: the same SASS
  }
  K::finish(P, R, s, cta, epoch);
}

}  // namespace mok::megakernel
