// mok: the work queue of the persistent megakernels (forward and backward), the first piece of the shell they share.
// A CTA's producer claims items by ticket and hands them, in order, to the CTA's consumers through kSlots slots in
// shared memory. Each slot has two mbarriers: `full` completes when the producer has written the slot (one arrival),
// `empty` when every consumer warp has given it back (one arrival per warp). Both sides walk the slots with a
// WorkCursor; every wait is bounded (gemm::mbarrier_wait: false after kWaitTimeoutNs, with the status bit set when
// the caller gives a status word), and each kernel decides what a failed wait means for its call.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "mok/gemm/sm90_sync.cuh"

namespace mok {

// A side's position in the queue: the slot, and the parity of the phase its barriers are in.
struct WorkCursor {
  int slot = 0;
  uint32_t phase = 0;
};

template <class T, int kSlots>
struct WorkQueue {
  T item[kSlots];
  alignas(8) uint64_t full[kSlots];
  alignas(8) uint64_t empty[kSlots];

  // One thread, before the roles start (then cutlass::arch::fence_barrier_init and a CTA-wide barrier).
  __device__ __forceinline__ void init(uint32_t consumer_warps) {
    for (int i = 0; i < kSlots; ++i) {
      cutlass::arch::ClusterBarrier::init(&full[i], 1);
      cutlass::arch::ClusterBarrier::init(&empty[i], consumer_warps);
    }
  }

  // The producer: wait until the consumers gave the cursor's slot back, then write it and publish it.
  __device__ __forceinline__ bool wait_free(const WorkCursor& c, int32_t* status) {
    return gemm::mbarrier_wait(&empty[c.slot], c.phase ^ 1, status);
  }
  __device__ __forceinline__ void publish(const WorkCursor& c, const T& value) {
    item[c.slot] = value;
    cutlass::arch::ClusterBarrier::arrive(&full[c.slot]);
  }

  // The consumers: wait until the cursor's slot is written, read it (in place: the slot stays theirs until they give
  // it back), then give it back, one arrival per warp.
  __device__ __forceinline__ bool wait_ready(const WorkCursor& c, int32_t* status) {
    return gemm::mbarrier_wait(&full[c.slot], c.phase, status);
  }
  __device__ __forceinline__ const T& at(const WorkCursor& c) const { return item[c.slot]; }
  __device__ __forceinline__ void give_back(const WorkCursor& c, int lane) {
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty[c.slot]);
  }

  static __device__ __forceinline__ void advance(WorkCursor& c) {
    if (++c.slot == kSlots) c.slot = 0, c.phase ^= 1;
  }
};

}  // namespace mok
