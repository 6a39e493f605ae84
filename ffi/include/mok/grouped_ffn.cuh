// mok grouped expert FFN (bf16, Hopper sm_90a): a SwiGLU FFN over expert-major rows.
//
//   rows of expert e: [offset_e, offset_e + group_sizes[e]), offset = exclusive prefix sum (read on device)
//   h[r, :] = silu(x[r] @ gate_up[e][:, :I]) * (x[r] @ gate_up[e][:, I:])     fp32 accumulation, bf16 h
//   y[r, :] = h[r] @ down[e]                                                   fp32 accumulation, bf16 y
//   rows r >= sum(group_sizes) are padding: y[r] = h[r] = 0 (written).
//
// Two launches of one persistent, warp-specialised TMA + wgmma grouped GEMM (mok/gemm/sm90_grouped_gemm.cuh):
// gate/up with SwiGLU fused in its epilogue writes h; down reads h and writes y. Each uses num_sms CTAs
// (one per SM) with a static tile stride, so it runs correctly on any subset of SMs while other kernels
// hold the rest, and the result does not depend on num_sms. No atomics on data: bitwise reproducible.
//
// status (written every call): 0, or kStatusNegativeGroup | kStatusRowOverflow when the group sizes are
// bad; then every group is treated as empty (nothing is read out of bounds) and y, h are all zeros.
//
// Layouts (row-major): x [M, H], h [M, I], y [M, H], gate_up [E, H, 2I] (gate = columns [0, I), up =
// [I, 2I)), down [E, I, H]. Supported: 1 <= E <= 1024, H and I multiples of 8, M < 2^31.
#pragma once

#include "mok/common.cuh"

namespace mok {

constexpr int32_t kGroupedFfnStatusNegativeGroup = 1;  // a group size < 0
constexpr int32_t kGroupedFfnStatusRowOverflow = 2;    // sum(group_sizes) > M
constexpr int kGroupedFfnMaxExperts = 1024;

struct GroupedFfnParams {
  const void* x;               // bf16 [num_rows, hidden]
  const int32_t* group_sizes;  // s32 [num_experts], device
  const void* gate_up;         // bf16 [num_experts, hidden, 2 * intermediate]
  const void* down;            // bf16 [num_experts, intermediate, hidden]
  void* y;                     // bf16 [num_rows, hidden], fully written
  void* h;                     // bf16 [num_rows, intermediate], fully written
  int32_t* status;             // s32 [1], written
  int64_t num_rows;            // M
  int64_t hidden;              // H
  int64_t intermediate;        // I
  int64_t num_experts;         // E
  int32_t num_sms;             // persistent CTAs; 0 = every SM of the device
};

// nullptr when the shapes are supported, else a sentence saying what is not.
const char* grouped_ffn_unsupported(const GroupedFfnParams& params);

// The limits of the grouped GEMMs under this op and the FP8 one (mok/fp8_grouped_ffn.cuh): 1 <= E <= 1024, H and
// 2I below 2^31, num_sms >= 0. nullptr when they hold, else a sentence naming the argument. Each op adds its own
// alignment of H and I and its bound on M.
const char* grouped_ffn_limits_unsupported(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                           int32_t num_sms);

// M == 0: no GEMM to run, but status (s32 [1]) still reports bad group sizes. Enqueues the one small kernel that
// writes it; this op and the FP8 one both take this path.
cudaError_t launch_grouped_ffn_status(const int32_t* group_sizes, int num_experts, int32_t* status,
                                      cudaStream_t stream);

// Enqueue the op on `stream` (no host synchronisation; CUDA-graph capturable).
cudaError_t launch_grouped_ffn(const GroupedFfnParams& params, cudaStream_t stream);

// Test helper: `num_blocks` blocks, each taking a whole SM (200 KB of shared memory), that count
// themselves into *started and then idle for duration_ns. Used to show the FFN runs on the SMs left.
cudaError_t launch_occupy_sms(int32_t num_blocks, int64_t duration_ns, int32_t* started, cudaStream_t stream);

}  // namespace mok
