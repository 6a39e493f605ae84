// mok comm: named wrappers for the PTX the communication kernels use (memory-model operations at
// system scope, the global timer, vector loads and stores, and the Hopper bulk-copy engine:
// cp.async.bulk, mbarriers, bulk async-groups, proxy fences). Nothing else in mok/comm writes inline PTX.
//
// Why system scope: a flag written by GPU A into GPU B's memory (or read by B from A's memory over
// NVLink) is only ordered with the data it guards if both the release (writer) and the acquire
// (reader) are at .sys scope; .gpu scope orders memory operations of one device only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mok::comm {

// Acquire load at system scope: later loads of this thread see everything the releasing writer
// wrote before its release.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed (but not cached stale: .volatile) load, for poison words that need no ordering.
__device__ __forceinline__ uint64_t ld_volatile(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Release reduction at system scope: everything this thread wrote (and, through bar.sync
// cumulativity, everything its block wrote before the barrier) is visible before the add.
__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

// Nanoseconds since an arbitrary origin; coarse (about a microsecond) but monotonic: for timeouts.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// 16-byte load that does not allocate in L1 (each row is read once; the data may come from a peer).
__device__ __forceinline__ int4 ld_v4_na(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// 16-byte store (local or peer memory).
__device__ __forceinline__ void st_v4(int4* p, const int4& v) {
  asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// bf16x2 <-> float helpers (exact widening; round-to-nearest-even narrowing).
__device__ __forceinline__ float bf16_lo(uint32_t packed) { return __uint_as_float(packed << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t packed) { return __uint_as_float(packed & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat16 l = __float2bfloat16_rn(lo);
  const __nv_bfloat16 h = __float2bfloat16_rn(hi);
  return uint32_t(__bfloat16_as_ushort(l)) | (uint32_t(__bfloat16_as_ushort(h)) << 16);
}

// ---- Hopper bulk-copy engine (sm_90) ----------------------------------------------------------
// cp.async.bulk moves a contiguous run of bytes (a multiple of 16, both ends 16-byte aligned)
// between global memory (local, or a peer's through its mapped address) and shared memory. Loads
// complete on an mbarrier (complete_tx); stores are tracked per issuing thread in bulk
// async-groups. The engine is the "async proxy": ordering it against ordinary ("generic") loads
// and stores needs the proxy fences below.

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// mbarrier of `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised mbarriers visible to the async proxy (then bar.sync for the other threads).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` more bytes of transactions in this phase (release, CTA).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One arrival (release, CTA scope).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// True once the phase of parity `parity` has completed (acquire, CTA scope). Does not block for
// long: the hardware may suspend the thread for a short system-defined time.
__device__ __forceinline__ bool mbar_try_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Bulk load global -> shared (this CTA), completing `bytes` transactions on `bar`.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Bulk store shared -> global (local or peer), in this thread's current bulk async-group.
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

// Closes this thread's current bulk async-group (an empty group is allowed).
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups still read their shared-memory sources.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's committed groups are incomplete (writes performed).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// bulk_wait_group_read with a run-time N in [0, 16] (the instruction takes an immediate).
__device__ __forceinline__ void bulk_wait_group_read_dyn(int n) {
  switch (n) {
    case 0: bulk_wait_group_read<0>(); break;
    case 1: bulk_wait_group_read<1>(); break;
    case 2: bulk_wait_group_read<2>(); break;
    case 3: bulk_wait_group_read<3>(); break;
    case 4: bulk_wait_group_read<4>(); break;
    case 5: bulk_wait_group_read<5>(); break;
    case 6: bulk_wait_group_read<6>(); break;
    case 7: bulk_wait_group_read<7>(); break;
    case 8: bulk_wait_group_read<8>(); break;
    case 9: bulk_wait_group_read<9>(); break;
    case 10: bulk_wait_group_read<10>(); break;
    case 11: bulk_wait_group_read<11>(); break;
    case 12: bulk_wait_group_read<12>(); break;
    case 13: bulk_wait_group_read<13>(); break;
    case 14: bulk_wait_group_read<14>(); break;
    case 15: bulk_wait_group_read<15>(); break;
    default: bulk_wait_group_read<16>(); break;
  }
}

// Orders this thread's generic accesses of global memory against its async-proxy (bulk) accesses,
// both ways.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Makes this thread's generic stores to shared memory visible to later bulk stores that read it.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads (a multiple of 32) that
// also ANDs a predicate over them: every participant gets the same verdict.
__device__ __forceinline__ bool named_barrier_and(uint32_t id, uint32_t count, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n\t.reg .pred p, q;\n\t"
      "setp.ne.u32 p, %1, 0;\n\t"
      "bar.red.and.pred q, %2, %3, p;\n\t"
      "selp.u32 %0, 1, 0, q;\n\t}"
      : "=r"(all)
      : "r"(uint32_t(pred)), "r"(id), "r"(count)
      : "memory");
  return all != 0;
}

}  // namespace mok::comm
