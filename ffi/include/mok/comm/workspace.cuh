// mok comm: the symmetric workspace of one (layer instance, EP rank).
//
// Every rank of an EP group of `ep` ranks allocates one region of the same size, laid out at the
// same offsets (make_layout is a pure function of CommShape), so "region R of rank p" is
// peer_bases[p] + layout.R on every rank. Kernels read and write peers' regions only through this
// table; XLA's buffers are never touched across devices.
//
// Layout (byte offsets from the region's base; every region starts 256-byte aligned).
// Names with [ep] are indexed by the *other* rank of a pair, as seen by the owner of the region:
//
//   sig_route   u64[ep]        routing of rank s has landed here (dispatch), written by s
//   sig_x       u64[ep]        token rows of rank s are ready (pull: in s's dispatch_rows; push: in mine)
//   ack_disp    u64[ep]        rank d finished reading what I published for dispatch
//   sig_comb    u64[ep]        partial sums of owner o for my tokens are ready
//   ack_comb    u64[ep]        origin s finished reading my partials (pull) / its buffer (push)
//   error       u64            poison word: 0, or a packed ErrorInfo (first error to reach it wins)
//   state       LocalState     device-side epochs and counters, touched by this rank only
//   chunk_count i32[ep][num_chunks][L]   schedule scratch: rows per (source, token chunk, expert)
//   chunk_base  i32[ep][num_chunks][L]   schedule scratch: first output row of each of those
//   route_idx   i32[ep][route_stride]    topk_idx of rank s (T*k used, k <= top_k)
//   route_w     f32[ep][route_stride]    topk_weight of rank s
//   moe_stamps  u64[kMoeStampRows + max_microbatches][ep]   the MoE megakernel's epoch stamps (mok/moe/forward.cuh):
//                                        row kMoeSigRoute/kMoeSigX/kMoeAckDisp/kMoeAckComb, then one
//                                        row per microbatch (kMoeSigComb + m); [row][s] is written by rank s
//                                        and holds the epoch of the call that last set it
//   dispatch_rows  bf16[ep][max_tokens][H]  [s][t] = x_t of rank s
//                                        (pull: rank s fills its own [s]; push: s fills peers' [s])
//   combine_rows   bf16[max(ep, top_k)][max_tokens][H] (ep 1: [1][..]). The comm ops' combine: partials [ep][T][H]
//                                        (push: [o][t] on the origin, from owner o; pull: [s][t] on the owner,
//                                        for origin s). The megakernel: one row per slot, [T][top_k][H] on the
//                                        origin, pushed by the slot's owner (the same terms at every EP size)
//   the fused backward's buffers (ep > 1 only; none at ep 1, whose backward does not communicate):
//   bwd_stamps  u64[kBwdStampRows][ep]   epoch stamps of the experts' backward (mok/experts_backward.cuh):
//                                        rows kBwdSigX, kBwdSigDx, kBwdDone; [row][s] is written by rank s
//   bwd_x       bf16[max_tokens][H]      this rank's x rows, shared with the owners of its slots (SHARE)
//   bwd_dy      bf16[max_tokens][H]      its dy rows, likewise
//   bwd_dx      bf16[max_tokens][top_k][H]  the dx row of each of its slots (t, j), written by the slot's owner
//   bwd_dw      f32[max_tokens][top_k]   the router-weight gradient of each slot, likewise
//
// The megakernel's stamps are epochs, not counts: the last of the items that a stamp guards stores
// the call's epoch with a release at system scope, and a consumer waits for stamp >= epoch. So a call may
// use any number of microbatches, and calls of the comm ops and of the megakernel never share a stamp.
//
// Sizes: the two bf16 buffers dominate: (ep + max(ep, top_k)) * max_tokens * H * 2 bytes at ep > 1, linear in ep past top_k
// (H 7168, 4096 tokens, k 8: 587 MB per rank at ep 2, 940 MB at ep 8; docs/memory.md). At ep > 1 the backward's buffers add (2 + top_k) * max_tokens * H * 2 bytes, independent of ep
// (H 7168, 4096 tokens, k 8: 587 MB). Nothing else depends on ep beyond the [ep]-indexed regions above: every
// loop over peers runs to shape.ep and the peer table holds ep pointers. Everything is zeroed once at setup and
// never memset again: signals are monotonic counters compared against epoch * kSignalUnits.
//
// Signals: every block of a producing kernel adds its share of kSignalUnits (block 0 adds
// kSignalUnits - (gridDim.x - 1), the others 1) with a release reduction at system scope, so one
// epoch adds exactly kSignalUnits whatever the grid size, and the consumer waits for
// counter >= epoch * kSignalUnits. A producer of epoch e first waits for the consumers' acks of
// epoch e - 1, so counts of two epochs never mix.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mok::comm {

constexpr uint64_t kSignalUnits = uint64_t(1) << 20;   // > any grid size we launch
constexpr int kMaxRanks = 1024;                         // error word keeps 16 bits of rank
constexpr int kMaxTopK = 32;                            // one warp lane per top-k slot
constexpr int kMaxLocalExperts = 2048;                  // schedule histogram in shared memory
constexpr int kChunkTokens = 64;                        // schedule granularity (tokens per warp)
constexpr size_t kRegionAlign = 256;
constexpr int kMinGranularity = 512;                    // smallest microbatch of the megakernel (tokens)
constexpr int kMoeSigRoute = 0, kMoeSigX = 1, kMoeAckDisp = 2, kMoeAckComb = 3, kMoeSigComb = 4;
constexpr int kMoeStampRows = kMoeSigComb;               // rows before the per-microbatch ones
constexpr int kBwdSigX = 0, kBwdSigDx = 1, kBwdDone = 2, kBwdStampRows = 3;  // the backward's stamp rows

// Fixed at setup, identical on every rank of the group.
struct CommShape {
  int32_t ep;
  int32_t max_tokens;
  int32_t hidden;       // H, a multiple of 8 (16-byte rows)
  int32_t top_k;        // the largest k a call may use
  int32_t num_experts;  // E, a multiple of ep
  __host__ __device__ int32_t num_local_experts() const { return num_experts / ep; }
};

struct LocalState {
  uint64_t disp_epoch;  // completed dispatch calls
  uint64_t comb_epoch;  // completed combine calls
  uint32_t disp_done;   // blocks of the last dispatch kernel that finished (reset by the last one)
  uint32_t comb_done;
  int32_t total_rows;   // rows this rank received in the current dispatch (before capacity clamp)
  int32_t pad;
  uint64_t moe_epoch;   // completed megakernel calls
  uint32_t moe_exit;    // CTAs of the current megakernel call that finished (reset by the last one)
  uint32_t pad2;
  uint64_t bwd_epoch;   // completed calls of the fused experts' backward
  uint32_t bwd_exit;    // CTAs of its current call that finished (reset by the last one)
  uint32_t pad3;
};

struct SymLayout {
  size_t sig_route, sig_x, ack_disp, sig_comb, ack_comb, error, state, moe_stamps;
  size_t chunk_count, chunk_base, route_idx, route_w, dispatch_rows, combine_rows;
  size_t bwd_stamps, bwd_x, bwd_dy, bwd_dx, bwd_dw;  // ep > 1 only (0 at ep 1)
  size_t route_stride;  // elements per source rank in route_idx / route_w
  size_t total_bytes;
};

__host__ __device__ inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

__host__ __device__ inline int32_t num_chunks(int32_t tokens) { return (tokens + kChunkTokens - 1) / kChunkTokens; }

// Microbatches a megakernel call may have: ceil(max_tokens / smallest granularity).
__host__ __device__ inline int32_t max_microbatches(int32_t max_tokens) {
  return (max_tokens + kMinGranularity - 1) / kMinGranularity;
}

__host__ __device__ inline SymLayout make_layout(const CommShape& s) {
  SymLayout l{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes, kRegionAlign);
    return at;
  };
  const size_t signal = sizeof(uint64_t) * size_t(s.ep);
  l.sig_route = take(signal);
  l.sig_x = take(signal);
  l.ack_disp = take(signal);
  l.sig_comb = take(signal);
  l.ack_comb = take(signal);
  l.error = take(sizeof(uint64_t));
  l.state = take(sizeof(LocalState));
  l.moe_stamps = take(sizeof(uint64_t) * size_t(kMoeStampRows + max_microbatches(s.max_tokens)) * s.ep);
  const size_t chunk_cells = size_t(s.ep) * num_chunks(s.max_tokens) * s.num_local_experts();
  l.chunk_count = take(sizeof(int32_t) * chunk_cells);
  l.chunk_base = take(sizeof(int32_t) * chunk_cells);
  l.route_stride = align_up(size_t(s.max_tokens) * s.top_k, 4);  // 16-byte aligned per source
  l.route_idx = take(sizeof(int32_t) * s.ep * l.route_stride);
  l.route_w = take(sizeof(float) * s.ep * l.route_stride);
  const size_t rows = size_t(s.ep) * s.max_tokens * s.hidden * 2;  // bf16
  l.dispatch_rows = take(rows);
  // the comm ops' [ep][T][H] partials; the megakernel's [T][top_k][H] slot rows, which EP 1 never sends
  l.combine_rows = take(size_t(s.ep == 1 || s.ep > s.top_k ? s.ep : s.top_k) * s.max_tokens * s.hidden * 2);
  if (s.ep > 1) {
    const size_t own = size_t(s.max_tokens) * s.hidden * 2;  // bf16 [max_tokens][H]
    l.bwd_stamps = take(sizeof(uint64_t) * kBwdStampRows * s.ep);
    l.bwd_x = take(own);
    l.bwd_dy = take(own);
    l.bwd_dx = take(own * s.top_k);
    l.bwd_dw = take(sizeof(float) * size_t(s.max_tokens) * s.top_k);
  }
  l.total_bytes = off;
  return l;
}

// The error word: 0 while healthy, else the first error, packed so one 64-bit CAS publishes it.
enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrTimeoutRouting = 1,  // waited too long for a peer's routing (dispatch)
  kErrTimeoutData = 2,     // waited too long for a peer's rows (dispatch) or partials (combine)
  kErrTimeoutAck = 3,      // waited too long for a peer to release a buffer of the previous call
  kErrOverflow = 4,        // more rows than the output capacity
  kErrBadExpert = 5,       // topk_idx holds an id outside [-1, E) (-1 = masked slot)
  kErrTimeoutLocal = 6,    // a work item of this rank waited too long for another of the same call
};
enum OpCode : uint32_t { kOpNone = 0, kOpDispatch = 1, kOpCombine = 2, kOpMoeForward = 3, kOpMoeBackward = 4 };

struct ErrorInfo {
  uint32_t code, op;
  int32_t rank, peer;  // rank that detected it; the rank it waited for (-1 if none)
  uint32_t epoch_lo;   // low 16 bits of that op's epoch
};

__host__ __device__ inline uint64_t pack_error(uint32_t code, uint32_t op, int32_t rank, int32_t peer, uint64_t epoch) {
  return uint64_t(code & 0xff) | (uint64_t(op & 0xff) << 8) | (uint64_t(uint32_t(rank) & 0xffff) << 16) |
         (uint64_t(uint32_t(peer) & 0xffff) << 32) | (uint64_t(epoch & 0xffff) << 48);
}

__host__ __device__ inline ErrorInfo unpack_error(uint64_t w) {
  ErrorInfo e;
  e.code = uint32_t(w & 0xff);
  e.op = uint32_t((w >> 8) & 0xff);
  e.rank = int32_t((w >> 16) & 0xffff);
  const uint32_t peer = uint32_t((w >> 32) & 0xffff);
  e.peer = peer == 0xffff ? -1 : int32_t(peer);
  e.epoch_lo = uint32_t(w >> 48);
  return e;
}

// What every communication kernel gets (by value, inside its Params).
struct CommView {
  uint8_t* base;                // this rank's symmetric region
  uint8_t* const* peer_bases;   // device array [ep]; peer_bases[rank] == base
  uint64_t* host_error;         // host-mapped pinned word (device pointer), mirror of the error word
  uint64_t* host_call_error;    // host-mapped pinned word: the first per-call error (bad ids, overflow) of
                                // a megakernel call; it does not poison the workspace
  uint64_t timeout_ns;          // bound of every spin-wait
  CommShape shape;
  SymLayout layout;
  int32_t rank;

  template <typename T>
  __device__ __forceinline__ T* local(size_t off) const {
    return reinterpret_cast<T*>(base + off);
  }
  template <typename T>
  __device__ __forceinline__ T* peer(int p, size_t off) const {
    return reinterpret_cast<T*>(peer_bases[p] + off);
  }
  __device__ __forceinline__ LocalState* state() const { return local<LocalState>(layout.state); }
  __device__ __forceinline__ uint64_t* error_word() const { return local<uint64_t>(layout.error); }
};

}  // namespace mok::comm
