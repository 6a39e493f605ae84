// mok comm: row movers on the Hopper bulk-copy engine (cp.async.bulk), shared by dispatch and combine.
//
// A row is H bf16 values (row_bytes = 2H, a multiple of 16). Rows move between global memory (local,
// or a peer's through its symmetric address, which peer access maps as an ordinary global address)
// and a ring of shared-memory stages: bulk loads complete on one mbarrier per stage (complete_tx),
// bulk stores are tracked in the issuing thread's bulk async-groups. Why: an SM moving rows through
// registers with 16-byte loads and stores reached only ~55-90 GB/s (benchmarks/results/comm_h200x2.md);
// the copy engine keeps a dozen 14 KB rows in flight per SM without spending registers or threads.
//
// One block (kMoverThreads threads, one per SM: it takes most of the shared memory) moves a contiguous
// range of candidates. What a candidate is (a (source rank, token), or a token) is the kernel's: its
// Source type says which values a candidate has (collect: destination rows, owner ranks, ...), where
// the bytes come from (src) and where they go (dst).
//
//   copy_rows     one row in, the same row out to each of its 1..k destinations (dispatch: the row
//                 crosses NVLink once and is expanded from shared memory). One warp runs it: lane 0
//                 loads a row into a stage; `lag` entries later lane j issues the store to destination
//                 j (one bulk group per lane per entry, empty for lanes without one); a stage is
//                 reloaded only after every lane's stores of its previous row finished reading it
//                 (wait_group.read).
//   gather_rows   n rows in, one row out (combine). Warp 0 produces: collects candidates, publishes a
//                 unit descriptor (count, weights, destination) and loads the unit's rows into stages.
//                 Warps 1.. consume: fp32 sum over the unit's rows in their order, read from shared
//                 memory with exactly the arithmetic of accumulate8 / accumulate8_weighted (no FMA),
//                 rounded to bf16 into an output stage, sent with one bulk store.
//
// Shared memory (dynamic; MoverLayout computes the offsets identically on host and device):
//   stage[S][stride]       row pieces in flight (S <= kMaxStages; stride = piece bytes rounded to 128)
//   out[kOutStages]        gather: rounded results waiting for their bulk store
//   full[S], empty[S]      mbarriers: a stage's load landed (1 arrival + tx) / its consumer warps are done
//   unit_full/empty[U]     gather: a unit descriptor is published / consumed (U = S + 1)
//   desc                   copy: per stage {count, bytes, dst[k]}; gather: per unit {count, bytes, first
//                          entry, dst, w[k]}
//   batch                  kBatch candidates' values (and weights), the kept-candidate list
//   abort                  a wait of this block failed: every waiter gives up
// A row longer than kMaxStageBytes moves as pieces of equal size (multiples of 16 bytes), each its own
// entry (copy) or unit (gather).
//
// Memory ordering (the async proxy is the correctness risk):
//   - each issuing thread runs fence.proxy.async.global before its first bulk operation: rows written
//     by generic stores (a peer's, observed through the block's system-scope acquire and bar.sync) are
//     what the bulk loads read, and bulk stores stay after the generic accesses ordered before them;
//   - a stage is read by threads only after its full mbarrier phase completed, and written by the next
//     load only after its consumer warps arrived on empty (gather) or the stores reading it finished
//     reading (wait_group.read, copy);
//   - shared memory written by threads (out, zeros) is fenced with fence.proxy.async.shared::cta by
//     every writer before the barrier after which a bulk store reads it;
//   - at the end each issuing thread waits for all its groups (wait_group 0: writes performed, at a
//     peer too), then fence.proxy.async.global and fence.sc.sys, before the block's bar.sync and the
//     system-scope release of its signal (sync.cuh): a rank that acquires the signal sees the rows.
// Every mbarrier wait is bounded by the workspace timeout (kErrTimeoutCopy) and by the abort flag.
#pragma once

#include "mok/comm/ptx.cuh"
#include "mok/comm/sync.cuh"

namespace mok::comm {

constexpr uint32_t kFullMask = 0xffffffffu;

constexpr int kMoverThreads = 512;
constexpr int kMoverWarps = kMoverThreads / 32;
constexpr int kConsumerWarps = kMoverWarps - 1;       // gather: warp 0 produces
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kBatch = 32;                            // candidates collected at once (one per lane)
constexpr int kMaxStages = 16;
constexpr int kMaxUnits = kMaxStages + 1;
constexpr int kOutStages = 2;
constexpr int kMaxStageBytes = 16384;                 // larger rows move in pieces
constexpr int kMoverSmemBytes = 224 * 1024;           // H100/H200 allow 227 KB per block (opt-in)
constexpr int kMaxVecPerThread = (kMaxStageBytes / 16 + kConsumerThreads - 1) / kConsumerThreads;
constexpr uint32_t kConsumerBarrier = 1;              // named barrier of the consumer warps
static_assert(kOutStages >= 2, "gather waits for the store of unit u+1-kOutStages before unit u's barrier");
static_assert(kMaxTopK <= 32, "one lane per destination or source of a candidate");
static_assert(kMaxStages <= 16, "bulk_wait_group_read_dyn covers 0..16");

// ---- fixed-order fp32 arithmetic (bitwise reproducible: __fmul_rn/__fadd_rn never contract) -----

__device__ __forceinline__ void accumulate8(float* acc, const int4& x) {
  const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], bf16_lo(w[i]));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], bf16_hi(w[i]));
  }
}

__device__ __forceinline__ void accumulate8_weighted(float* acc, const int4& x, float wt) {
  const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(wt, bf16_lo(w[i])));
    acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(wt, bf16_hi(w[i])));
  }
}

__device__ __forceinline__ int4 round8(const float* acc) {
  int4 r;
  r.x = int(pack_bf16x2(acc[0], acc[1]));
  r.y = int(pack_bf16x2(acc[2], acc[3]));
  r.z = int(pack_bf16x2(acc[4], acc[5]));
  r.w = int(pack_bf16x2(acc[6], acc[7]));
  return r;
}

// ---- small helpers for Source::collect (per-lane lists in shared memory) ---------------------------

// Appends v to list[0, n) unless present; returns the new length.
__device__ __forceinline__ int32_t insert_unique(int32_t* list, int32_t n, int32_t v) {
  for (int32_t i = 0; i < n; ++i)
    if (list[i] == v) return n;
  list[n] = v;
  return n + 1;
}

// Inserts v into the ascending list[0, n) unless present; returns the new length.
__device__ __forceinline__ int32_t insert_sorted_unique(int32_t* list, int32_t n, int32_t v) {
  for (int32_t i = 0; i < n; ++i)
    if (list[i] == v) return n;
  int32_t i = n;
  for (; i > 0 && list[i - 1] > v; --i) list[i] = list[i - 1];
  list[i] = v;
  return n + 1;
}

// [begin, end) of `n` candidates for block b of g: contiguous, sizes differing by at most one.
__device__ __forceinline__ int32_t block_share(int32_t n, uint32_t b, uint32_t g) {
  return int32_t(int64_t(n) * b / g);
}

// ---- shared-memory layout ------------------------------------------------------------------------

struct MoverLayout {
  int32_t k;            // values per candidate (destinations or sources), <= kMaxTopK
  int32_t row_bytes;
  int32_t piece_bytes;  // bytes per stage load (the last piece of a row may be shorter)
  int32_t pieces;       // per row
  int32_t stride;       // bytes between stages
  int32_t stages;       // S
  int32_t lag;          // copy: entries between a row's load and its stores
  int32_t desc_stride;  // bytes per entry (copy) or unit (gather) descriptor
  uint32_t off_out, off_bar, off_desc, off_vals, off_wts, off_meta;
  uint32_t total;       // dynamic shared memory of the block
};

// Copy descriptors: {int32 count, int32 bytes, u64 dst[k]}. Unit descriptors: {int32 count (-1: no
// more units), int32 bytes, u32 first entry, pad, u64 dst, f32 w[k]}.
constexpr int kCopyDescHeader = 8;
constexpr int kUnitDescHeader = 24;

__host__ __device__ inline MoverLayout make_mover_layout(bool gather, int32_t row_bytes, int32_t k) {
  MoverLayout m{};
  m.k = k;
  m.row_bytes = row_bytes;
  m.pieces = (row_bytes + kMaxStageBytes - 1) / kMaxStageBytes;
  const int32_t vecs = row_bytes / 16;
  m.piece_bytes = (vecs + m.pieces - 1) / m.pieces * 16;
  m.stride = int32_t(align_up(size_t(m.piece_bytes), 128));
  m.desc_stride = int32_t(gather ? align_up(kUnitDescHeader + 4 * size_t(k), 16)
                                 : align_up(kCopyDescHeader + 8 * size_t(k), 16));
  const size_t bars = sizeof(uint64_t) * (2 * kMaxStages + 2 * kMaxUnits);
  const size_t descs = align_up(size_t(gather ? kMaxUnits : kMaxStages) * m.desc_stride, 16);
  const size_t vals = align_up(sizeof(int32_t) * kBatch * size_t(k), 16);
  const size_t meta = align_up(sizeof(int32_t) * (2 * kBatch + 4), 16);
  const size_t fixed = bars + descs + 2 * vals + meta;
  const int32_t fit = int32_t((kMoverSmemBytes - fixed) / size_t(m.stride)) - (gather ? kOutStages : 0);
  m.stages = fit < kMaxStages ? fit : kMaxStages;
  m.lag = m.stages / 2 > 1 ? m.stages / 2 : 1;
  size_t off = size_t(m.stages) * m.stride;
  m.off_out = uint32_t(off);
  off += size_t(gather ? kOutStages : 0) * m.stride;
  m.off_bar = uint32_t(off);
  off += bars;
  m.off_desc = uint32_t(off);
  off += descs;
  m.off_vals = uint32_t(off);
  off += vals;
  m.off_wts = uint32_t(off);
  off += vals;
  m.off_meta = uint32_t(off);
  off += meta;
  m.total = uint32_t(off);
  return m;
}

// Host check of a layout before launching with it.
inline bool mover_layout_ok(const MoverLayout& m) {
  return m.stages >= 2 && m.total <= uint32_t(kMoverSmemBytes) && m.k >= 1 && m.k <= kMaxTopK &&
         m.row_bytes > 0 && m.row_bytes % 16 == 0;
}

struct MoverSmem {
  uint8_t* base;
  MoverLayout m;
  __device__ uint8_t* stage(uint32_t e) const { return base + size_t(e) * m.stride; }
  __device__ uint8_t* out(uint32_t o) const { return base + m.off_out + size_t(o) * m.stride; }
  __device__ uint64_t* bar(uint32_t i) const { return reinterpret_cast<uint64_t*>(base + m.off_bar) + i; }
  __device__ uint64_t* full(uint32_t e) const { return bar(e); }
  __device__ uint64_t* empty(uint32_t e) const { return bar(kMaxStages + e); }
  __device__ uint64_t* unit_full(uint32_t u) const { return bar(2 * kMaxStages + u); }
  __device__ uint64_t* unit_empty(uint32_t u) const { return bar(2 * kMaxStages + kMaxUnits + u); }
  __device__ uint8_t* desc(uint32_t i) const { return base + m.off_desc + size_t(i) * m.desc_stride; }
  __device__ int32_t* vals(int lane) const { return reinterpret_cast<int32_t*>(base + m.off_vals) + lane * m.k; }
  __device__ float* wts(int lane) const { return reinterpret_cast<float*>(base + m.off_wts) + lane * m.k; }
  __device__ int32_t* batch_count() const { return reinterpret_cast<int32_t*>(base + m.off_meta); }
  __device__ int32_t* batch_item() const { return batch_count() + kBatch; }
  __device__ volatile int32_t* abort_flag() const {
    return reinterpret_cast<volatile int32_t*>(batch_count() + 2 * kBatch);
  }
};

// All threads: initialise the mbarriers and the abort flag.
__device__ inline MoverSmem mover_init(uint8_t* smem, const MoverLayout& m) {
  const MoverSmem sm{smem, m};
  if (threadIdx.x == 0) {
    for (uint32_t e = 0; e < kMaxStages; ++e) {
      mbar_init(sm.full(e), 1);
      mbar_init(sm.empty(e), kConsumerWarps);
    }
    for (uint32_t u = 0; u < kMaxUnits; ++u) {
      mbar_init(sm.unit_full(u), 1);
      mbar_init(sm.unit_empty(u), kConsumerWarps);
    }
    *sm.abort_flag() = 0;
    fence_mbarrier_init();
  }
  __syncthreads();
  return sm;
}

// What a failed wait reports.
struct MoverCtx {
  const CommView* view;
  uint32_t op;
  uint64_t epoch;
};

// Bounded wait for the phase of parity `parity` of `bar`. False on timeout (raises kErrTimeoutCopy
// and sets the abort flag) or when another waiter of the block already gave up.
__device__ inline bool mover_wait(const MoverCtx& c, const MoverSmem& sm, uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait_parity(bar, parity)) return true;
  const uint64_t start = global_timer_ns();
  for (uint32_t it = 1;; ++it) {
    if (mbar_try_wait_parity(bar, parity)) return true;
    if ((it & 15u) == 0) {
      if (*sm.abort_flag() != 0) return false;
      if (global_timer_ns() - start > c.view->timeout_ns) {
        *sm.abort_flag() = 1;
        raise_error(*c.view, kErrTimeoutCopy, c.op, -1, c.epoch);
        return false;
      }
    }
  }
}

// One warp: collects candidates [first, min(first + kBatch, end)), lane i the (first + i)-th, into the
// batch area. Source::collect returns the number of values written (< 0: drop the candidate). Returns
// the number kept; batch_item lists their lanes in candidate order.
template <class Source>
__device__ int build_batch(const Source& src, const MoverSmem& sm, int32_t first, int32_t end, int lane) {
  __syncwarp();  // every lane is done with the previous batch
  int32_t count = -1;
  if (first + lane < end) count = src.collect(first + lane, sm.vals(lane), sm.wts(lane));
  const bool keep = count >= 0;
  const uint32_t kept = __ballot_sync(kFullMask, keep);
  if (keep) {
    sm.batch_item()[__popc(kept & lanemask_lt())] = lane;
    sm.batch_count()[lane] = count;
  }
  __syncwarp();
  return __popc(kept);
}

// ---- copy engine: one row in, the same row out to each of its destinations -----------------------

// One whole warp. Source: collect(q, vals, wts) -> destinations' values (<= k); src(q, 0) -> row;
// dst(q, value) -> destination row. Returns false if a wait failed (the block must not signal).
template <class Source>
__device__ bool copy_rows(const Source& src, const MoverSmem& sm, const MoverCtx& c, int32_t begin, int32_t end,
                          int lane) {
  const MoverLayout& m = sm.m;
  const uint32_t S = uint32_t(m.stages), lag = uint32_t(m.lag);
  fence_proxy_async_global();
  uint32_t loaded = 0, stored = 0;  // entries (row pieces)
  bool ok = true;
  // Lane j stores the oldest loaded entry to its destination j (every lane commits a group).
  auto store_oldest = [&]() {
    const uint32_t e = stored % S;
    ok = __all_sync(kFullMask, mover_wait(c, sm, sm.full(e), (stored / S) & 1u)) != 0;
    if (!ok) return;
    const uint8_t* d = sm.desc(e);
    const int32_t count = reinterpret_cast<const int32_t*>(d)[0];
    const int32_t bytes = reinterpret_cast<const int32_t*>(d)[1];
    if (lane < count) bulk_store(reinterpret_cast<uint8_t* const*>(d + kCopyDescHeader)[lane], sm.stage(e), bytes);
    bulk_commit_group();
    ++stored;
  };
  for (int32_t first = begin; ok && first < end; first += kBatch) {
    const int items = build_batch(src, sm, first, end, lane);
    for (int i = 0; ok && i < items; ++i) {
      const int cl = sm.batch_item()[i];
      const int32_t q = first + cl;
      const int32_t count = sm.batch_count()[cl];
      const uint8_t* from = src.src(q, 0);
      uint8_t* to = lane < count ? src.dst(q, sm.vals(cl)[lane]) : nullptr;
      for (int32_t p = 0; p < m.pieces; ++p) {
        const int32_t off = p * m.piece_bytes;
        const int32_t bytes = m.row_bytes - off < m.piece_bytes ? m.row_bytes - off : m.piece_bytes;
        if (loaded - stored == lag) {
          store_oldest();
          if (!ok) break;
        }
        const uint32_t e = loaded % S;
        // Stage e last held entry loaded - S, whose stores were committed at least S - lag groups ago.
        if (loaded >= S) bulk_wait_group_read_dyn(int(S - lag));
        uint8_t* d = sm.desc(e);
        if (lane < count) reinterpret_cast<uint8_t**>(d + kCopyDescHeader)[lane] = to + off;
        if (lane == 0) {
          reinterpret_cast<int32_t*>(d)[0] = count;
          reinterpret_cast<int32_t*>(d)[1] = bytes;
        }
        __syncwarp();
        if (lane == 0) {
          mbar_arrive_expect_tx(sm.full(e), uint32_t(bytes));
          bulk_load(sm.stage(e), from + off, uint32_t(bytes), sm.full(e));
        }
        ++loaded;
      }
    }
  }
  while (ok && stored < loaded) store_oldest();
  bulk_wait_group<0>();  // this lane's stores are complete (also on peers) and done reading the stages
  fence_proxy_async_global();
  __threadfence_system();
  return ok;
}

// ---- gather engine: n rows in, their fp32 (weighted) sum out ---------------------------------------

// Warp 0. Source: collect(q, vals, wts) -> sources' values in summation order (0 is kept: a zero row
// is written); src(q, value) -> source row; dst(q, 0) -> destination row.
template <class Source>
__device__ bool gather_produce(const Source& src, const MoverSmem& sm, const MoverCtx& c, int32_t begin,
                               int32_t end, int lane) {
  const MoverLayout& m = sm.m;
  const uint32_t S = uint32_t(m.stages), U = S + 1;
  fence_proxy_async_global();
  uint32_t entries = 0, units = 0;
  bool ok = true;
  // Waits until unit slot units % U is consumed (its previous unit's store was issued).
  auto claim_unit = [&]() -> uint8_t* {
    if (units >= U) {
      int good = 1;
      if (lane == 0) good = mover_wait(c, sm, sm.unit_empty(units % U), ((units / U) - 1) & 1u);
      ok = __shfl_sync(kFullMask, good, 0) != 0;
    }
    return sm.desc(units % U);
  };
  for (int32_t first = begin; ok && first < end; first += kBatch) {
    const int items = build_batch(src, sm, first, end, lane);
    for (int i = 0; ok && i < items; ++i) {
      const int cl = sm.batch_item()[i];
      const int32_t q = first + cl;
      const int32_t count = sm.batch_count()[cl];
      const uint8_t* from = lane < count ? src.src(q, sm.vals(cl)[lane]) : nullptr;
      const float w = lane < count ? sm.wts(cl)[lane] : 0.0f;
      uint8_t* to = src.dst(q, 0);
      for (int32_t p = 0; ok && p < m.pieces; ++p) {
        const int32_t off = p * m.piece_bytes;
        const int32_t bytes = m.row_bytes - off < m.piece_bytes ? m.row_bytes - off : m.piece_bytes;
        uint8_t* d = claim_unit();
        if (!ok) break;
        if (lane < count) reinterpret_cast<float*>(d + kUnitDescHeader)[lane] = w;
        if (lane == 0) {
          reinterpret_cast<int32_t*>(d)[0] = count;
          reinterpret_cast<int32_t*>(d)[1] = bytes;
          reinterpret_cast<uint32_t*>(d)[2] = entries;
          *reinterpret_cast<uint8_t**>(d + 16) = to + off;
        }
        __syncwarp();
        // Published before its rows are loaded: a unit of more rows than stages is consumed while
        // its later rows wait for stages.
        if (lane == 0) mbar_arrive(sm.unit_full(units % U));
        ++units;
        for (int32_t j = 0; j < count; ++j) {
          const auto* row = reinterpret_cast<const uint8_t*>(
              __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(from), j));
          const uint32_t e = entries % S;
          int good = 1;
          if (lane == 0) {
            if (entries >= S) good = mover_wait(c, sm, sm.empty(e), ((entries / S) - 1) & 1u);
            if (good) {
              mbar_arrive_expect_tx(sm.full(e), uint32_t(bytes));
              bulk_load(sm.stage(e), row + off, uint32_t(bytes), sm.full(e));
            }
          }
          ok = __shfl_sync(kFullMask, good, 0) != 0;
          if (!ok) break;
          ++entries;
        }
      }
    }
  }
  if (ok) {  // no more units
    uint8_t* d = claim_unit();
    if (ok) {
      if (lane == 0) reinterpret_cast<int32_t*>(d)[0] = -1;
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.unit_full(units % U));
    }
  }
  if (!ok && lane == 0) *sm.abort_flag() = 1;  // consumers must not wait for units that never come
  return ok;
}

// Warps 1..kMoverWarps-1; ctid in [0, kConsumerThreads). Consumer thread 0 issues the stores.
template <bool kWeighted>
__device__ bool gather_consume(const MoverSmem& sm, const MoverCtx& c, int ctid, int lane) {
  const MoverLayout& m = sm.m;
  const uint32_t S = uint32_t(m.stages), U = S + 1;
  if (ctid == 0) fence_proxy_async_global();
  bool good = true;  // warp-uniform
  for (uint32_t units = 0;; ++units) {
    const uint32_t u = units % U;
    good = __all_sync(kFullMask, good && mover_wait(c, sm, sm.unit_full(u), (units / U) & 1u)) != 0;
    const uint8_t* d = sm.desc(u);
    const int32_t count = good ? reinterpret_cast<const int32_t*>(d)[0] : -1;
    const int32_t bytes = reinterpret_cast<const int32_t*>(d)[1];
    const uint32_t first = reinterpret_cast<const uint32_t*>(d)[2];
    const int nvec = bytes / 16;
    float acc[kMaxVecPerThread][8];
#pragma unroll
    for (int i = 0; i < kMaxVecPerThread; ++i)
#pragma unroll
      for (int x = 0; x < 8; ++x) acc[i][x] = 0.0f;
    for (int32_t j = 0; j < count; ++j) {  // count is warp-uniform
      const uint32_t n = first + uint32_t(j);
      const uint32_t e = n % S;
      good = __all_sync(kFullMask, good && mover_wait(c, sm, sm.full(e), (n / S) & 1u)) != 0;
      if (good) {
        const float w = kWeighted ? reinterpret_cast<const float*>(d + kUnitDescHeader)[j] : 1.0f;
        const int4* row = reinterpret_cast<const int4*>(sm.stage(e));
#pragma unroll
        for (int i = 0; i < kMaxVecPerThread; ++i) {
          const int v = ctid + i * kConsumerThreads;
          if (v < nvec) {
            const int4 x = row[v];
            if constexpr (kWeighted) {
              accumulate8_weighted(acc[i], x, w);
            } else {
              accumulate8(acc[i], x);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.empty(e));
    }
    const bool last = count < 0;
    uint8_t* out = sm.out(units % kOutStages);
    if (good && !last) {
#pragma unroll
      for (int i = 0; i < kMaxVecPerThread; ++i) {
        const int v = ctid + i * kConsumerThreads;
        if (v < nvec) reinterpret_cast<int4*>(out)[v] = round8(acc[i]);
      }
      fence_proxy_async_shared();
    }
    // After this barrier every consumer writes out[(units + 1) % kOutStages], last read by the store
    // of unit units + 1 - kOutStages: wait for that store's reads first.
    if (ctid == 0) bulk_wait_group_read<kOutStages - 2>();
    if (!named_barrier_and(kConsumerBarrier, kConsumerThreads, good)) {
      good = false;
      break;
    }
    if (last) break;
    if (ctid == 0) {
      bulk_store(*reinterpret_cast<uint8_t* const*>(d + 16), out, uint32_t(bytes));
      bulk_commit_group();
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.unit_empty(u));
  }
  if (ctid == 0) {
    bulk_wait_group<0>();
    fence_proxy_async_global();
    __threadfence_system();
  }
  if (!good) *sm.abort_flag() = 1;
  return good;
}

// Whole block: gather engine over candidates [begin, end). Block-uniform result.
template <bool kWeighted, class Source>
__device__ bool gather_rows(const Source& src, const MoverSmem& sm, const MoverCtx& c, int32_t begin, int32_t end) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool ok = warp == 0 ? gather_produce(src, sm, c, begin, end, lane)
                            : gather_consume<kWeighted>(sm, c, int(threadIdx.x) - 32, lane);
  return __syncthreads_and(ok) != 0;
}

// Whole block, after the stages are free: zero `bytes` (a multiple of 16) at dst with bulk stores
// from a zeroed part of the stage area. Warp 0 issues and waits for completion.
__device__ inline void zero_fill(const MoverSmem& sm, uint8_t* dst, size_t bytes) {
  const size_t area = size_t(sm.m.stages) * sm.m.stride;
  const uint32_t chunk = uint32_t((area < 32768 ? area : 32768) / 16 * 16);
  int4* z = reinterpret_cast<int4*>(sm.base);
  for (uint32_t i = threadIdx.x; i < chunk / 16; i += blockDim.x) z[i] = make_int4(0, 0, 0, 0);
  fence_proxy_async_shared();
  __syncthreads();
  if (threadIdx.x < 32) {
    fence_proxy_async_global();
    const size_t n = (bytes + chunk - 1) / chunk;
    for (size_t i = threadIdx.x; i < n; i += 32) {
      const size_t off = i * chunk;
      bulk_store(dst + off, sm.base, uint32_t(bytes - off < chunk ? bytes - off : chunk));
    }
    bulk_commit_group();
    bulk_wait_group<0>();
    fence_proxy_async_global();
  }
}

}  // namespace mok::comm
