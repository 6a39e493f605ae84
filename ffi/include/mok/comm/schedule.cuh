// mok comm: device-side dispatch schedule, built by every expert owner from all ranks' routing.
//
// Inputs (this rank's symmetric region, filled by every source rank s before it signals sig_route):
//   route_idx[s][t*k + j], route_w[s][t*k + j]       s < ep, t < T, j < k (k <= top_k of the setup)
// Outputs (XLA buffers of the dispatch op):
//   row_table[s][t][j]  output row of slot (s, t, j) on this owner, or -1 (expert not local / invalid)
//   row_weight[s][t][j] = route_w[s][t*k + j]      (what combine multiplies row_table's rows by)
//   group_sizes[e]      rows of local expert e;   state.total_rows = sum_e group_sizes[e]
//   row_source[row]     s * T + t of the slot that owns expert-major row `row`, -1 past the total
//                       (the gather index of a grouped GEMM that reads token-major rows)
//
// Order of rows (deterministic, no atomics on positions): expert-major, then source rank, then token,
// then slot j: row(s, t, j) = sum of rows of (e' < e, any) + (e, s' < s) + (e, s, (t', j') < (t, j)).
//
// Three kernels, all bounded and independent of the grid's residency:
//   count  one warp per (s, chunk of kChunkTokens tokens): rows per local expert -> chunk_count
//          (waits for every peer's sig_route first)
//   scan   one block: exclusive scan in (expert, source, chunk) order -> chunk_base, group_sizes
//   place  one warp per (s, chunk): walks its k*kChunkTokens slots 32 at a time in (t, j) order;
//          __match_any_sync ranks equal experts inside a step, a per-warp running counter per expert
//          carries across steps -> row_table (rows >= capacity are dropped and raise kErrOverflow)
// Shared memory: count and place keep kScheduleWarps * L int32 (L <= kMaxLocalExperts: 32 KB).
#pragma once

#include "mok/comm/workspace.cuh"

namespace mok::comm {

constexpr int kScheduleWarps = 4;
constexpr int kScanThreads = 1024;
static_assert(kScheduleWarps * kMaxLocalExperts * sizeof(int32_t) <= 48 * 1024,
              "schedule histogram must fit the default shared-memory carve-out");

struct ScheduleParams {
  CommView view;
  int32_t num_tokens;  // T of this call, equal on every rank
  int32_t top_k;       // k of this call
  int32_t capacity;    // rows of the dispatch output
  int32_t* group_sizes;
  int32_t* row_table;
  float* row_weight;
  int32_t* row_source;  // [capacity]
};

cudaError_t launch_schedule(const ScheduleParams& params, cudaStream_t stream);
cudaError_t preload_schedule_kernels();  // on the current device

}  // namespace mok::comm
