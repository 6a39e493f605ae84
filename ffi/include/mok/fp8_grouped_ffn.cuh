// mok FP8 grouped expert FFN (E4M3, DeepSeek-V3 block scaling, Hopper sm_90a): the SwiGLU FFN of
// mok/grouped_ffn.cuh with FP8 GEMMs.
//
//   x_q, x_scale = quantize_rows(x)                      1 x 128 tiles, fp32 scales (amax * (1/448))
//   g | u = block_scaled(x_q, x_scale, gate_up[e])       fp32, promoted per 128-long k block
//   h_q, h_scale = quantize_rows(silu(g) * u)            in the gate/up GEMM's epilogue (fp32 h, never bf16)
//   y = bf16(block_scaled(h_q, h_scale, down[e]))        rows of expert e: [offset_e, offset_e + group_sizes[e])
//   rows r >= sum(group_sizes) are padding: y[r] = 0, h_q[r] = 0, h_scale[., r] = 1 (written)
//
// Three launches: the row quantisation of x (a small kernel), then two persistent FP8 grouped GEMMs
// (mok/gemm/sm90_fp8_grouped_gemm.cuh). The result does not depend on num_sms; no atomics on data.
// status as mok/grouped_ffn.cuh (bad group sizes: every group empty, y all zeros).
//
// Layouts (row-major; the weights are those of mok_jax.fp8.quantize_expert_weights: each matrix transposed
// so that the reduction dimension is contiguous, as FP8 wgmma needs both operands K-major):
//   x        bf16 [M, H]                  y        bf16 [M, H]
//   gate_up  e4m3 [E, 2I, H]  (gate rows [0, I), up rows [I, 2I))   gate_up_scale f32 [E, 2I/128, H/128]
//   down     e4m3 [E, H, I]                                          down_scale    f32 [E, H/128, I/128]
//   x_q      e4m3 [M, H]      x_scale f32 [H/128, M]   (k-block major: x_scale[b, r] scales x_q[r, 128b:128b+128])
//   h_q      e4m3 [M, I]      h_scale f32 [I/128, M]
// Supported: 1 <= E <= 1024, H and I positive multiples of 128, M < 2^31.
#pragma once

#include "mok/common.cuh"

namespace mok {

struct Fp8GroupedFfnParams {
  const void* x;               // bf16 [num_rows, hidden]
  const int32_t* group_sizes;  // s32 [num_experts], device
  const void* gate_up;         // e4m3 [num_experts, 2 * intermediate, hidden]
  const float* gate_up_scale;  // f32 [num_experts, 2 * intermediate / 128, hidden / 128]
  const void* down;            // e4m3 [num_experts, hidden, intermediate]
  const float* down_scale;     // f32 [num_experts, hidden / 128, intermediate / 128]
  void* y;                     // bf16 [num_rows, hidden], fully written
  void* h;                     // e4m3 [num_rows, intermediate], fully written
  float* h_scale;              // f32 [intermediate / 128, num_rows], fully written
  void* x_q;                   // e4m3 [num_rows, hidden], fully written
  float* x_scale;              // f32 [hidden / 128, num_rows], fully written
  int32_t* status;             // s32 [1], written
  int64_t num_rows;            // M
  int64_t hidden;              // H
  int64_t intermediate;        // I
  int64_t num_experts;         // E
  int32_t num_sms;             // persistent CTAs; 0 = every SM of the device
};

// nullptr when the shapes are supported, else a sentence saying what is not (naming the argument).
const char* fp8_grouped_ffn_unsupported(const Fp8GroupedFfnParams& params);

// Enqueue the op on `stream` (no host synchronisation).
cudaError_t launch_fp8_grouped_ffn(const Fp8GroupedFfnParams& params, cudaStream_t stream);

}  // namespace mok
