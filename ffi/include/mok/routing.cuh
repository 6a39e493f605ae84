// mok routing: per-expert token counts from the router's top-k choices, and the backward's padded expert-major
// layout of the slots (launch_expert_layout, below).
//
//   counts[e]   = #{(t, j) : topk_idx[t, j] == e}          for e in [0, num_experts)
//   num_invalid = #{(t, j) : topk_idx[t, j] outside [0, num_experts)}
//
// This is the first step of the device-side schedule (docs/kernel.md, "Work items and their order"). Integer atomics only,
// so the result is exact and independent of execution order. Each block builds a histogram in shared
// memory (num_experts int32) and folds it into global memory once.
#pragma once

#include "mok/common.cuh"

namespace mok {

struct ExpertCountParams {
  const int32_t* topk_idx;   // [num_assignments] (token-major, k fastest)
  int64_t num_assignments;   // T * k
  int32_t num_experts;
  int32_t* counts;           // [num_experts], fully overwritten
  int32_t* num_invalid;      // [1], fully overwritten
};

// Shared-memory histogram bound: 48 KB of int32 without opting in to a larger carve-out.
constexpr int kMaxExpertsForCount = 12 * 1024;

cudaError_t launch_expert_counts(const ExpertCountParams& params, cudaStream_t stream);

// The padded expert-major layout of the slots (mok_jax/expert_layout.py, padded_layout and rank_layout: the same
// four arrays, bit for bit). Slot n = t * k + j with id = topk_idx[n] belongs to local expert
// e = id - first_expert when first_expert <= id < first_expert + num_experts; any other slot (-1, another rank's
// expert, an invalid id) gets no row. With S = T * k slots and E = num_experts the buffer has M = S + block * E rows:
//
//   group_sizes[e] = the slots of e rounded up to a multiple of block;  start[e] = sum of group_sizes[e' < e]
//   pos[n]         = start[e] + #{slots n' < n of e}, or M for a slot with no row
//   src_slot[r]    = the slot n whose pos is r, else -1;  src_token[r] = src_slot[r] / k, else -1
//
// Integers only, and every position comes from an order (slot order, chunk order), never from the order in which
// atomics land. The slots split into chunks of `chunk` consecutive slots, c = n / chunk, nc = ceil(S / chunk):
//   COUNT  one CTA per chunk: its slots per expert (shared-memory counts: the order of the additions cannot change a
//          sum) -> table[e * nc + c]
//   SCAN   one CTA: the exclusive scan of the table in (e, c) order (each chunk's first row among its expert's slots,
//          plus the slots of the experts before), then group_sizes, and shift[e], the padding rows before e's group
//   PLACE  one warp per chunk: walks its slots 32 at a time in slot order; __match_any_sync ranks the lanes of one
//          expert, a running row per expert (from table + shift) carries across steps -> pos, src_slot, src_token
// src_token and src_slot are filled with -1 first (cudaMemsetAsync 0xff). scratch holds table [E * nc] and shift [E].
// Shared memory: E int32 per CTA (E <= kMaxExpertsForCount: 48 KB, the default carve-out).
struct ExpertLayoutParams {
  const int32_t* topk_idx;      // [num_slots] (token-major, k fastest)
  const int32_t* first_expert;  // [1], device memory: the id of local expert 0 (rank * num_experts under EP)
  int64_t num_slots;            // S = T * k
  int32_t top_k;                // k
  int32_t num_experts;          // E, the local experts
  int32_t block;                // group sizes are multiples of this
  int32_t chunk;                // slots per chunk (COUNT's CTA, PLACE's warp)
  int32_t* pos;                 // [num_slots]
  int32_t* src_token;           // [M]
  int32_t* src_slot;            // [M]
  int32_t* group_sizes;         // [E]
  int32_t* scratch;             // [expert_layout_scratch_words(num_slots, num_experts, chunk)]
};

// int32 words of ExpertLayoutParams::scratch: the per-chunk table and shift.
inline int64_t expert_layout_scratch_words(int64_t num_slots, int64_t num_experts, int64_t chunk) {
  return (num_slots + chunk - 1) / chunk * num_experts + num_experts;
}

cudaError_t launch_expert_layout(const ExpertLayoutParams& params, cudaStream_t stream);

}  // namespace mok
