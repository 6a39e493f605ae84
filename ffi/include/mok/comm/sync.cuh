// mok comm: device-side synchronisation between the ranks of an EP group.
//
//   block_wait_peers   thread 0 spins (bounded) until counter[p] >= target for every peer p, in this
//                      rank's own region; the verdict is block-uniform.
//   block_signal_peers after the block's work: every thread's writes are published (bar.sync, then a
//                      system-scope fence and release reduction by thread 0) and the block's share of
//                      kSignalUnits is added to counter[my rank] in every peer's region.
//   raise_error        first error wins (CAS on the poison word); it is copied into every peer's
//                      poison word, so their spinning kernels stop at once, and into the host-mapped
//                      word that the FFI handler and Workspace.check() read. "First" is per word: with
//                      more than 2 ranks, two ranks that fail at about the same time each keep their
//                      own error and every other rank keeps whichever reached it first, so ranks agree
//                      that the workspace is poisoned but may name different detecting ranks.
//   finish_op          the last block of an op's last kernel advances the device-side epoch and writes
//                      the op's status output.
//
// Every spin is bounded by CommView::timeout_ns (%globaltimer) and also stops when the poison word is
// set; a kernel that stops early skips its work and its signals, never its bounds checks.
//
// A wait for work of the same call (a counter of this rank's scratch, in either megakernel) is bounded by
// local_timeout_ns instead: kLocalTimeoutFactor times the workspace's timeout, so that when a peer never comes
// the wait for the peer times out first and names it, and never below kLocalTimeoutFloorNs, the bound of the
// stage ring's and the work queue's waits (gemm::kWaitTimeoutNs). When one times out with a workspace, the
// workspace is poisoned with kErrTimeoutLocal (docs/errors.md): one convention for both megakernels.
#pragma once

#include "mok/comm/ptx.cuh"
#include "mok/comm/workspace.cuh"

namespace mok::comm {

__device__ inline void publish_host_error(const CommView& v, uint64_t err) {
  volatile uint64_t* h = v.host_error;
  if (*h == 0) {
    *h = err;
    __threadfence_system();
  }
}

constexpr uint64_t kLocalTimeoutFactor = 4;
constexpr uint64_t kLocalTimeoutFloorNs = 10ull * 1000 * 1000 * 1000;

__host__ __device__ constexpr uint64_t local_timeout_ns(uint64_t timeout_ns) {
  return kLocalTimeoutFactor * timeout_ns > kLocalTimeoutFloorNs ? kLocalTimeoutFactor * timeout_ns
                                                                 : kLocalTimeoutFloorNs;
}

__device__ inline uint64_t read_poison(const CommView& v) { return ld_volatile(v.error_word()); }

__device__ inline void raise_error(const CommView& v, uint32_t code, uint32_t op, int32_t peer, uint64_t epoch) {
  const unsigned long long w = pack_error(code, op, v.rank, peer, epoch);
  const unsigned long long prev =
      atomicCAS_system(reinterpret_cast<unsigned long long*>(v.error_word()), 0ull, w);
  if (prev != 0) {  // someone was first; keep theirs
    publish_host_error(v, prev);
    return;
  }
  for (int p = 0; p < v.shape.ep; ++p)
    if (p != v.rank)
      atomicCAS_system(reinterpret_cast<unsigned long long*>(v.peer<uint64_t>(p, v.layout.error)), 0ull, w);
  publish_host_error(v, w);
}

// Spin until *counter >= target. Returns false on timeout (after raising) or on poison.
__device__ inline bool wait_at_least(const CommView& v, const uint64_t* counter, uint64_t target, uint32_t code,
                                     uint32_t op, int32_t peer, uint64_t epoch) {
  if (ld_acquire_sys(counter) >= target) return true;
  const uint64_t start = global_timer_ns();
  for (uint32_t it = 1;; ++it) {
    if (ld_acquire_sys(counter) >= target) return true;
    if ((it & 31u) == 0) {
      const uint64_t err = read_poison(v);
      if (err != 0) {
        publish_host_error(v, err);
        return false;
      }
      if (global_timer_ns() - start > v.timeout_ns) {
        raise_error(v, code, op, peer, epoch);
        return false;
      }
    }
  }
}

// Block-uniform: true when the workspace is healthy and every peer's counter reached target.
__device__ inline bool block_wait_peers(const CommView& v, size_t region, uint64_t target, uint32_t code, uint32_t op,
                                        uint64_t epoch) {
  int good = 1;
  if (threadIdx.x == 0) {
    const uint64_t err = read_poison(v);
    if (err != 0) {
      publish_host_error(v, err);
      good = 0;
    }
    const uint64_t* counters = v.local<uint64_t>(region);
    for (int p = 0; good && p < v.shape.ep; ++p)
      if (p != v.rank) good = wait_at_least(v, counters + p, target, code, op, p, epoch);
  }
  return __syncthreads_and(good) != 0;
}

// Block-uniform health check without waiting.
__device__ inline bool block_healthy(const CommView& v) {
  int good = 1;
  if (threadIdx.x == 0) {
    const uint64_t err = read_poison(v);
    if (err != 0) {
      publish_host_error(v, err);
      good = 0;
    }
  }
  return __syncthreads_and(good) != 0;
}

__device__ inline void block_signal_peers(const CommView& v, size_t region) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();
    const uint64_t share = blockIdx.x == 0 ? kSignalUnits - (gridDim.x - 1) : 1;
    for (int p = 0; p < v.shape.ep; ++p)
      if (p != v.rank) red_add_release_sys(v.peer<uint64_t>(p, region) + v.rank, share);
  }
}

__device__ inline uint64_t next_epoch(const uint64_t* counter) { return ld_volatile(counter) + 1; }

// Epoch-stamp tables (the megakernel's moe_stamps, the fused backward's bwd_stamps): u64[rows][ep] at `region` of
// every rank; [row][s] is written by rank s and holds the epoch of the call that last stamped it.
__device__ __forceinline__ uint64_t* stamp_row(const CommView& v, size_t region, int rank_of_region, int row) {
  return v.peer<uint64_t>(rank_of_region, region) + size_t(row) * v.shape.ep;
}

// One thread: this call's epoch into row `row`, slot [my rank], of every peer's table (after a system fence).
__device__ inline void publish_stamps(const CommView& v, size_t region, int row, uint64_t epoch) {
  fence_sys();
  for (int p = 0; p < v.shape.ep; ++p)
    if (p != v.rank) st_release_sys(stamp_row(v, region, p, row) + v.rank, epoch);
}

// One thread: until every peer stamped row `row` of my table with at least `target` (bounded, per peer; false
// after raising `code` for op `op`, or on poison).
__device__ inline bool wait_stamps(const CommView& v, size_t region, int row, uint64_t target, uint32_t code,
                                   uint32_t op, uint64_t epoch) {
  const uint64_t* stamps = stamp_row(v, region, v.rank, row);
  for (int p = 0; p < v.shape.ep; ++p)
    if (p != v.rank && !wait_at_least(v, stamps + p, target, code, op, p, epoch)) return false;
  return true;
}

// Every block of an op's last kernel calls this once, at its very end (all threads).
__device__ inline void finish_op(const CommView& v, uint32_t* done, uint64_t* epoch_counter, uint64_t epoch,
                                 int32_t* status) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(done, 1u) != gridDim.x - 1) return;
  *reinterpret_cast<volatile uint32_t*>(done) = 0;
  *reinterpret_cast<volatile uint64_t*>(epoch_counter) = epoch;
  const uint64_t err = read_poison(v);
  if (err != 0) publish_host_error(v, err);
  const ErrorInfo info = unpack_error(err);
  status[0] = int32_t(info.code);
  status[1] = int32_t(info.op);
  status[2] = err ? info.rank : 0;
  status[3] = err ? info.peer : 0;
  __threadfence();
}

}  // namespace mok::comm
