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

// One 1 x 128 tile of a bf16 row -> e4m3 with its scale, by one warp (4 values per lane): amax * (1/448) (1 for
// an all-zero tile), q = e4m3_rn_satfinite(x / scale): mok_jax.fp8.quantize_rows, bit for bit (max is exact,
// the division IEEE). Returns the scale (every lane).
__device__ __forceinline__ float fp8_quantize_tile_warp(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q,
                                                        int lane) {
  const uint2 raw = *reinterpret_cast<const uint2*>(x + 4 * lane);
  const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  float amax = fmaxf(fmaxf(fabsf(v01.x), fabsf(v01.y)), fmaxf(fabsf(v23.x), fabsf(v23.y)));
  for (int d = 16; d >= 1; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  const float sc = fp8_scale_of(amax);
  const float inv = 1.0f / sc;  // q = x * (1 / scale), as mok_jax.fp8 (kInvE4M3Max)
  const __nv_fp8x2_storage_t q01 = fp8_pack2(v01.x, v01.y, inv);
  const __nv_fp8x2_storage_t q23 = fp8_pack2(v23.x, v23.y, inv);
  *reinterpret_cast<uint32_t*>(q + 4 * lane) = uint32_t(q01) | (uint32_t(q23) << 16);
  return sc;
}

}  // namespace mok::gemm
