// mok backward: the waits an item's run makes in the consumers (one thread waits, bounded; a named barrier gives
// all 256 the verdict): for counters of this rank (consumers_wait) and, expert parallel, for the epoch stamps the
// peers publish into this rank's bwd_stamps (consumers_wait_peers; publish stamps them).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/comm/sync.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok {
namespace {

// One thread waits until every ctr[i] >= target[i], every consumer gets the verdict (the named barrier orders
// the others' later loads after its acquires too).
template <int kN>
__device__ bool consumers_wait(SharedStorage& s, const int32_t* const (&ctr)[kN], const int32_t (&target)[kN],
                               const KernelParams& p, unsigned long long* wait_ns, int ct) {
  if (ct == 0) {
    const uint64_t t0 = gemm::global_timer_ns();
    bool ok = true;
    for (int i = 0; i < kN && ok; ++i) ok = wait_count(ctr[i], target[i], p.status, p.local_timeout_ns);
    s.wait_ok = ok;
    atomicAdd(wait_ns, (unsigned long long)(gemm::global_timer_ns() - t0));
  }
  gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
  return s.wait_ok != 0;
}

// Expert parallel, one thread: this call's epoch into row `row` of every peer's bwd_stamps (after a system fence
// that orders every store this rank's items made before, through the counters the caller acquired).
__device__ void publish(const KernelParams& p, int row, uint64_t epoch) {
  comm::publish_stamps(p.view, p.view.layout.bwd_stamps, row, epoch);
}

// The consumers wait until every peer stamped row `row` of this rank's bwd_stamps with at least `target` (one
// thread waits, bounded; a timeout poisons the workspace, a poisoned one stops it). On failure the status bits
// stop every other wait of the rank too. Its verdict has its own word (SharedStorage::peer_ok): an item makes at
// most one such wait and one consumers_wait, in either order.
__device__ bool consumers_wait_peers(SharedStorage& s, const KernelParams& p, int row, uint64_t target, uint32_t code,
                                     uint64_t epoch, unsigned long long* wait_ns, int ct) {
  if (ct == 0) {
    const uint64_t t0 = gemm::global_timer_ns();
    const bool ok = comm::wait_stamps(p.view, p.view.layout.bwd_stamps, row, target, code, comm::kOpMoeBackward, epoch);
    if (!ok) atomicOr(p.status, gemm::kStatusWaitTimeout | kExpertsBackwardStatusComm);
    s.peer_ok = ok;
    atomicAdd(wait_ns, (unsigned long long)(gemm::global_timer_ns() - t0));
  }
  gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
  return s.peer_ok != 0;
}

}  // namespace
}  // namespace mok
