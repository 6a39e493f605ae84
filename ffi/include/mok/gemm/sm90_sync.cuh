// mok gemm: synchronisation wrappers for the Hopper (sm_90a) kernels.
//
// Every wait here is bounded and never traps (a trap kills the CUDA context and the process): a wait
// that outlives kWaitTimeoutNs (a lost TMA transaction, a broken arrive count) sets a status bit if the
// caller gave a status word and returns false; the caller then leaves its loop, so the kernel ends with
// the status saying why instead of hanging the stream. (No printf: a function call inside the wgmma
// pipeline would make ptxas serialise every wgmma, warning C7510.) Inline PTX lives only in these named
// wrappers; the mbarrier primitives themselves come from CUTLASS (cutlass/arch/barrier.h).
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace mok::gemm {

// Far above any legitimate intra-CTA wait (a k-tile takes microseconds), far below a test timeout.
constexpr uint64_t kWaitTimeoutNs = 10ull * 1000 * 1000 * 1000;
// Status bit set when a bounded wait timed out (the kernel then stops early; outputs are undefined).
constexpr int32_t kStatusWaitTimeout = 1 << 30;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Wait until the mbarrier phase with parity `phase` has completed. False on timeout (status bit set).
__device__ __forceinline__ bool mbarrier_wait(uint64_t* bar, uint32_t phase, int32_t* status) {
  if (cutlass::arch::ClusterBarrier::try_wait(bar, phase)) return true;
  const uint64_t start = global_timer_ns();
  uint32_t spins = 0;
  while (!cutlass::arch::ClusterBarrier::try_wait(bar, phase)) {
    if ((++spins & 0x3ff) == 0 && global_timer_ns() - start > kWaitTimeoutNs) {
      if (status) atomicOr(status, kStatusWaitTimeout);
      return false;
    }
  }
  return true;
}

// bar.sync on a named hardware barrier shared by `num_threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(uint32_t barrier_id, uint32_t num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(num_threads) : "memory");
}

// Orders this thread's generic-proxy global accesses with later async-proxy (TMA) accesses: a tile that
// ordinary stores wrote and that TMA reads next (h rows, dispatched rows) needs it on both sides of the
// release/acquire that hands it over.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The kernel's shared storage at the first 1024-byte boundary (128B-swizzle atoms) of its dynamic shared memory
// `raw` (launched with sizeof(Storage) + 1024 bytes). Offsetting from the __shared__ array itself keeps the
// compiler seeing shared-memory addresses (STS/LDS rather than generic ST/LD).
template <class Storage>
__device__ __forceinline__ Storage& aligned_shared_storage(char* raw) {
  const uint32_t misalign = uint32_t(__cvta_generic_to_shared(raw)) & 1023u;
  return *reinterpret_cast<Storage*>(raw + ((1024u - misalign) & 1023u));
}

}  // namespace mok::gemm
