// mok comm: named wrappers for the PTX the communication kernels use (memory-model operations at
// system scope, the global timer, vector loads and stores). Nothing else in mok/comm writes inline PTX.
//
// Why system scope: a stamp written by GPU A into GPU B's memory (or read by B from A's memory over
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

// Acquire load / release store at GPU scope: counters between work items of one rank (one device).
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Release store at system scope: an epoch stamp that another GPU acquires.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
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

// A hint, no data: the bulk-copy engine brings [p, p + bytes) of global memory into L2 (p 16-byte aligned, bytes a
// multiple of 16). One instruction of one lane fetches a whole row's span, with no registers held while it flies,
// so the loads that follow it wait on L2 instead of on HBM.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
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

}  // namespace mok::comm
