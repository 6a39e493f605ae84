// mok expert backward (bf16, Hopper sm_90a): the gradients of the routed SwiGLU experts over padded
// expert-major rows, the routed half of the layer's backward pass.
//
// Rows of expert e: [start_e, start_e + group_sizes[e]), start = exclusive prefix sum (read on device);
// every group size is a multiple of 128 (padding rows inside a group hold zeros in x and dy and w = 0,
// and produce zeros). Per row r of expert e, fp32 accumulation throughout:
//   g, u     = bf16(x[r] @ gate_up[e])                     recomputed (the forward keeps no activations)
//   dh'      = dy[r] @ down[e]^T
//   dw[r]    = <dh', silu(g) * u>                           = <dy_r, expert_e(x_r)>: the router-weight gradient
//   dgu[r]   = bf16(SwiGLU backward of w[r] * dh')          (mok/gemm/swiglu_backward.cuh)
//   dx[r]    = bf16(dgu[r] @ gate_up[e]^T)
//   d_down[e]    = bf16(sum_r bf16(w_r h_r)^T dy_r)          [I, H]
//   d_gate_up[e] = bf16(sum_r x_r^T dgu_r)                   [H, 2I]; exact zeros for an empty expert
// Rows r >= sum(group_sizes): dx[r] = 0, dw[r] = 0.
//
// Six stream-ordered launches, each a persistent TMA + wgmma kernel on num_sms SMs (or a tiny one):
//   1 gu = x @ gate_up          grouped GEMM, plain bf16 epilogue            (sm90_grouped_gemm.cuh)
//   2 dh' = dy @ down^T         grouped GEMM, K-major B, SwiGLU backward epilogue -> dgu, hw, dw partials
//   3 dw = sum of the partials  in ascending n-block order
//   4 dx = dgu @ gate_up^T      grouped GEMM, K-major B, plain bf16 epilogue
//   5 d_down = hw^T dy          weight-gradient GEMM, K = a group's rows     (sm90_weight_grad.cuh)
//   6 d_gate_up = x^T dgu       weight-gradient GEMM
// Every output element is reduced by one CTA in a fixed order: bitwise reproducible, and the same for
// any num_sms. No float atomics.
//
// status (written every call): 0, or kGroupedFfnStatus* bits (bad sizes: every group is then empty and
// every output is zero) | kExpertsBackwardStatusUnpadded (a size not a multiple of 128: the weight
// gradients are then zero).
#pragma once

#include "mok/common.cuh"

namespace mok {

constexpr int32_t kExpertsBackwardStatusUnpadded = 4;
constexpr int kExpertsBackwardRowBlock = 128;  // group sizes are multiples of this

struct ExpertsBackwardParams {
  const void* x;               // bf16 [M, H]
  const void* dy;              // bf16 [M, H]
  const float* w;              // f32 [M]
  const int32_t* group_sizes;  // s32 [E], device
  const void* gate_up;         // bf16 [E, H, 2I]
  const void* down;            // bf16 [E, I, H]
  void* dx;                    // bf16 [M, H]
  float* dw;                   // f32 [M]
  void* d_gate_up;             // bf16 [E, H, 2I]
  void* d_down;                // bf16 [E, I, H]
  int32_t* status;             // s32 [1]
  void* gu;                    // scratch bf16 [M, 2I]
  void* dgu;                   // scratch bf16 [M, 2I]
  void* hw;                    // scratch bf16 [M, I]
  float* dw_part;              // scratch f32 [M, ceil(I / 256)]
  int64_t num_rows, hidden, intermediate, num_experts;
  int32_t num_sms;             // 0 = every SM
};

// Columns of I per dgrad tile (the n-blocks of dw_part).
constexpr int kExpertsBackwardColBlock = 256;

const char* experts_backward_unsupported(const ExpertsBackwardParams& params);
cudaError_t launch_experts_backward(const ExpertsBackwardParams& params, cudaStream_t stream);

}  // namespace mok
