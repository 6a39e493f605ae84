// mok grouped expert FFN (Hopper sm_90a): a SwiGLU FFN over expert-major rows, in bf16 or in FP8 (E4M3 with
// DeepSeek-V3 block scales); the precision is the grouped GEMMs' mainloop (mok/gemm/sm90_mainloop.cuh).
//
//   rows of expert e: [offset_e, offset_e + group_sizes[e]), offset = exclusive prefix sum (read on device)
//   bf16:  h[r, :] = silu(x[r] @ gate_up[e][:, :I]) * (x[r] @ gate_up[e][:, I:])     fp32 accumulation, bf16 h
//          y[r, :] = h[r] @ down[e]                                                   fp32 accumulation, bf16 y
//   FP8:   x_q, x_scale = quantize_rows(x)                   1 x 128 tiles, fp32 scales (amax * (1/448))
//          g | u = block_scaled(x_q, x_scale, gate_up[e])    fp32, promoted per 128-long k block
//          h, h_scale = quantize_rows(silu(g) * u)           in the gate/up GEMM's epilogue (fp32 h, never bf16)
//          y = bf16(block_scaled(h, h_scale, down[e]))
//   rows r >= sum(group_sizes) are padding: y[r] = h[r] = 0 (written; FP8: h_scale[., r] = 1).
//
// Two launches of one persistent, warp-specialised TMA + wgmma grouped GEMM (mok/gemm/sm90_grouped_gemm.cuh),
// after (FP8) the row quantisation of x: gate/up with SwiGLU fused in its epilogue writes h; down reads h and
// writes y. Each uses num_sms CTAs (one per SM) with a static tile stride, so it runs correctly on any subset of
// SMs while other kernels hold the rest, and the result does not depend on num_sms. No atomics on data: bitwise
// reproducible.
//
// status (written every call): 0, or kStatusNegativeGroup | kStatusRowOverflow when the group sizes are
// bad; then every group is treated as empty (nothing is read out of bounds) and y, h are all zeros.
//
// Layouts (row-major):
//   bf16: x [M, H], h [M, I], y [M, H], gate_up [E, H, 2I] (gate = columns [0, I), up = [I, 2I)), down [E, I, H].
//         Supported: 1 <= E <= 1024, H and I multiples of 8, M < 2^31.
//   FP8 (the weights of mok_jax.fp8.quantize_expert_weights: each matrix transposed so that the reduction dimension
//   is contiguous, as FP8 wgmma needs both operands K-major):
//     x        bf16 [M, H]                  y        bf16 [M, H]
//     gate_up  e4m3 [E, 2I, H]  (gate rows [0, I), up rows [I, 2I))   gate_up_scale f32 [E, 2I/128, H/128]
//     down     e4m3 [E, H, I]                                          down_scale    f32 [E, H/128, I/128]
//     x_q      e4m3 [M, H]      x_scale f32 [H/128, M]   (k-block major: x_scale[b, r] scales x_q[r, 128b:128b+128])
//     h        e4m3 [M, I]      h_scale f32 [I/128, M]
//   Supported: 1 <= E <= 1024, H and I positive multiples of 128, M < 2^31.
#pragma once

#include "mok/common.cuh"

namespace mok {

constexpr int32_t kGroupedFfnStatusNegativeGroup = 1;  // a group size < 0
constexpr int32_t kGroupedFfnStatusRowOverflow = 2;    // sum(group_sizes) > M
constexpr int kGroupedFfnMaxExperts = 1024;

enum class GroupedFfnPrecision { kBf16, kFp8 };

// The FP8 op's scales and its quantised x (unused in bf16).
struct GroupedFfnScales {
  const float* gate_up_scale;  // f32 [num_experts, 2 * intermediate / 128, hidden / 128]
  const float* down_scale;     // f32 [num_experts, hidden / 128, intermediate / 128]
  float* h_scale;              // f32 [intermediate / 128, num_rows], fully written
  void* x_q;                   // e4m3 [num_rows, hidden], fully written
  float* x_scale;              // f32 [hidden / 128, num_rows], fully written
};

struct GroupedFfnParams {
  const void* x;               // bf16 [num_rows, hidden]
  const int32_t* group_sizes;  // s32 [num_experts], device
  const void* gate_up;         // bf16 [num_experts, hidden, 2 * intermediate]; FP8: e4m3 [.., 2 * intermediate, hidden]
  const void* down;            // bf16 [num_experts, intermediate, hidden]; FP8: e4m3 [.., hidden, intermediate]
  void* y;                     // bf16 [num_rows, hidden], fully written
  void* h;                     // bf16 (FP8: e4m3) [num_rows, intermediate], fully written
  int32_t* status;             // s32 [1], written
  int64_t num_rows;            // M
  int64_t hidden;              // H
  int64_t intermediate;        // I
  int64_t num_experts;         // E
  int32_t num_sms;             // persistent CTAs; 0 = every SM of the device
  GroupedFfnPrecision precision = GroupedFfnPrecision::kBf16;
  GroupedFfnScales scales{};   // FP8 only
};

// nullptr when the shapes are supported (the limits above, for the precision), else a sentence saying what is not
// (naming the argument).
const char* grouped_ffn_unsupported(const GroupedFfnParams& params);

// Enqueue the op on `stream` (no host synchronisation; CUDA-graph capturable). M == 0: no GEMM to run, but status
// still reports bad group sizes (one small kernel writes it).
cudaError_t launch_grouped_ffn(const GroupedFfnParams& params, cudaStream_t stream);

// Test helper: `num_blocks` blocks, each taking a whole SM (200 KB of shared memory), that count
// themselves into *started and then idle for duration_ns. Used to show the FFN runs on the SMs left.
cudaError_t launch_occupy_sms(int32_t num_blocks, int64_t duration_ns, int32_t* started, cudaStream_t stream);

}  // namespace mok
