// mok gemm: the sigmoid and silu of the SwiGLU epilogues (forward and backward), as branch-free sequences with the
// bits of the compiled expressions.
//
// Compiled without fast-math, `1.0f / x` and `g / x` are each an approximate reciprocal refined by fused
// multiply-adds, plus a range check and a branch to an exact slow path around every value: the epilogue then has one
// value in flight per branch. Here the caller checks the range of a whole group of values first, votes across the
// warp, and takes the exact expression only when one lane of the warp needs it (g below about -87, a zero or tiny g,
// NaN): the fast sequences are the compiler's own fast paths, so the bits are the same either way.
// scripts/lab/silu_division_check.cu checks that claim for every one of the 2^32 fp32 g on the GPU.
#pragma once

#include <cstdint>

namespace mok::gemm {

// x = 1 + exp(-g), the sigmoid's denominator. __expf(-g) is ex2.approx of -g log2(e) with two instructions of range
// handling that scale inputs below -126 to return a subnormal; 1 + a subnormal is 1, so the bare ex2.approx.ftz of the
// same product gives x with the same bits for every g (the lab check covers all 2^32).
__device__ __forceinline__ float sigmoid_denominator(float g) {
  float e;
#ifdef __CUDA_ARCH__
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
#else  // the host labs (scripts/lab/*_on_host.py), whose values need no approximation's bits
  e = exp2f(g * -1.4426950408889634f);
  e = fabsf(e) < 0x1p-126f ? 0.0f : e;  // .ftz
#endif
  return 1.0f + e;
}

// 1 / x rounded to nearest for x in [1, 2^126): the sequence the compiler emits for 1.0f / x there (an approximate
// reciprocal and one Newton step in fused multiply-adds; its error term 1 - x r is 0 or far from subnormal), without
// the branch to its exact slow path, which it takes outside [2^-126, 2^126) and for NaN.
constexpr float kRcpInRangeEnd = 0x1p126f;
__device__ __forceinline__ float rcp_in_range(float x) {
  float r;
#ifdef __CUDA_ARCH__
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
#else  // the host labs
  r = 1.0f / x;
#endif
  return __fmaf_rn(r, __fmaf_rn(-x, r, 1.0f), r);
}

// Whether div_in_range(g, x) has the bits of g / x, for x = sigmoid_denominator(g): x below 2^126 and |g| in
// [2^-100, 2^100], where the compiler's fast path needs no rescaling of the dividend or the quotient.
__device__ __forceinline__ bool div_in_range(float g, float x) {
  const float a = fabsf(g);
  return x < kRcpInRangeEnd && a >= 0x1p-100f && a <= 0x1p100f;
}

// g / x rounded to nearest where div_in_range(g, x): the compiler's fast path for the division (the reciprocal above,
// the quotient g r, one residual step), without its check and branch.
__device__ __forceinline__ float div_in_range_value(float g, float x) {
  const float r = rcp_in_range(x);
  float q0;
#ifdef __CUDA_ARCH__
  asm("fma.rn.f32 %0, %1, %2, 0f00000000;" : "=f"(q0) : "f"(g), "f"(r));  // + 0: the sign of a zero product
#else
  q0 = fmaf(g, r, 0.0f);
#endif
  return __fmaf_rn(r, __fmaf_rn(-x, q0, g), q0);
}

// h[k] = silu(gate(gi + k)) * up(ui + k) for N values of a thread, silu(g) = g / (1 + exp(-g)) with the bits of
// g / (1 + __expf(-g)): the ranges of all N divisions are checked first and voted across the warp (every lane of it
// must call this together), so the N values are in flight together instead of one per branch; the bits are those of
// the plain expression either way. gate and up: anything indexed by (i), such as a wgmma accumulator fragment. The
// bf16 SwiGLU epilogue (sm90_tile.cuh) and the FP8 one (sm90_fp8_tile.cuh) both use it, so h has the same f32 bits
// before bf16 rounding or E4M3 quantisation.
template <int N, class Gate, class Up>
__device__ __forceinline__ void swiglu_values(const Gate& gate, int gi, const Up& up, int ui, float (&h)[N]) {
  float x[N];
  bool exact = false;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    x[k] = sigmoid_denominator(gate(gi + k));
    exact |= !div_in_range(gate(gi + k), x[k]);
  }
  if (__any_sync(0xffffffffu, exact)) {
#pragma unroll
    for (int k = 0; k < N; ++k) h[k] = gate(gi + k) / x[k] * up(ui + k);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) h[k] = div_in_range_value(gate(gi + k), x[k]) * up(ui + k);
  }
}

}  // namespace mok::gemm
