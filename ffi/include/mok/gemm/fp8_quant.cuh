// mok gemm: the FP8 (E4M3) quantisation rule of the FP8 GEMMs' operands, DeepSeek-V3's recipe, in the form every
// kernel of the library uses (the standalone row quantiser, the SwiGLU epilogue, the megakernel's dispatch), so
// that they give mok_jax.fp8.quantize_rows' bits: a 1 x 128 tile (or a 128 x 128 weight block) gets the scale
// amax * (1/448) (1 for an all-zero tile), and each value v becomes e4m3_rn_satfinite(v * (1 / scale)).
// No CuTe in here: the communication code includes it too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace mok::gemm {

constexpr int kFp8ScaleBlock = 128;   // 1 x 128 activation tiles, 128 x 128 weight blocks
constexpr float kE4M3Max = 448.0f;    // largest finite E4M3 value
// A scale is amax * (1/448), the reciprocal rounded to f32 once, and a value is quantised as v * (1 / scale)
// (one IEEE division per scale), as mok_jax.fp8 computes them, bit for bit: XLA rewrites a division by a
// constant into such a product, so the reference cannot keep amax / 448.
constexpr float kInvE4M3Max = 1.0f / 448.0f;

__device__ __forceinline__ float fp8_scale_of(float amax) { return amax > 0.0f ? amax * kInvE4M3Max : 1.0f; }

// Two values times 1 / scale, to E4M3 with round-to-nearest-even and saturation (mok_jax.fp8's convert).
__device__ __forceinline__ __nv_fp8x2_storage_t fp8_pack2(float a, float b, float inv) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inv, b * inv), __NV_SATFINITE, __NV_E4M3);
}

// Two consecutive 1 x 128 tiles of bf16 -> e4m3 with their scales, by one warp, 8 values a lane: lanes 0-15 hold the
// first tile's 128 values, 16-31 the second's, 8 consecutive ones a lane (raw, loaded by the caller, so that the loads
// of several pairs can be in flight together). Each half-warp's amax * (1/448) (1 for an all-zero tile) is its
// tile's scale, q = e4m3_rn_satfinite(x / scale): mok_jax.fp8.quantize_rows, bit for bit (max is exact, the division
// IEEE, each value converted alone), except in a tile with a NaN, whose scale fmaxf takes from the tile's other values
// where jnp.max gives NaN; the NaN stays an E4M3 NaN either way. Returns the lane's 8 e4m3 values (for q + 8 lane from
// the first tile's start) and sets *scale to its tile's scale.
__device__ __forceinline__ uint2 fp8_quantize_tile_pair(const uint4 raw, float* scale) {
  float v[8];
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int d = 8; d >= 1; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));  // the half-warp's
  const float sc = fp8_scale_of(amax);
  const float inv = 1.0f / sc;  // q = x * (1 / scale), as mok_jax.fp8 (kInvE4M3Max)
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) packed[i] = fp8_pack2(v[2 * i], v[2 * i + 1], inv);
  *scale = sc;
  return make_uint2(packed[0] | (packed[1] << 16), packed[2] | (packed[3] << 16));
}

}  // namespace mok::gemm
