// mok routing: per-expert token counts from the router's top-k choices.
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

}  // namespace mok
