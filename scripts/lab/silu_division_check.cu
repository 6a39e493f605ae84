// Lab check (issue 33): can the SwiGLU epilogue's silu(g) = g / (1 + exp(-g)) drop the compiler's checked division
// (FCHK and a branch to the slow path around every value) for a branch-free sequence with the same bits?
//
// silu is a function of one fp32 value, so this checks every one of the 2^32 bit patterns of g on the GPU: where
// the proposed in-range predicate holds (x = 1 + __expf(-g) below 2^126, |g| in [2^-100, 2^100]), the branch-free
// sequence (the compiler's own fast path: rcp.approx, one Newton step, q0 = fma(g, r, +0), one residual step) must
// give the bits of the compiled `g / x`. It prints the mismatches (must be 0), the first few, and how many g fall
// outside the predicate (those would take the exact division after a warp vote, as the DH epilogue does).
// It also checks, for every g, that x = 1 + exp(-g) has the same bits with __expf (whose non-FTZ form scales inputs
// below -126 to return subnormals) as with a bare ex2.approx.ftz of the same product: 1 + a subnormal is 1, so the
// three instructions of range handling per value (FSETP and two predicated FMULs) could go from both epilogues.
//
//   nvcc -O3 -arch=sm_90a -I ffi/include -o silu_division_check scripts/lab/silu_division_check.cu
//   ./silu_division_check
#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

#include "mok/gemm/silu_math.cuh"

// The sequences under test are the epilogues' own (mok/gemm/silu_math.cuh): div_in_range_value (the fast division),
// div_in_range (its predicate) and sigmoid_denominator (the bare ex2.approx.ftz denominator).
using mok::gemm::div_in_range;
using mok::gemm::div_in_range_value;
using mok::gemm::sigmoid_denominator;

__global__ void check(unsigned long long* counts, uint32_t* first, uint32_t start, uint32_t n) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = start + uint32_t(i);
    const float g = __uint_as_float(bits);
    const float x = 1.0f + __expf(-g);
    if (__float_as_uint(x) != __float_as_uint(sigmoid_denominator(g)) && !(x != x)) atomicAdd(&counts[2], 1ull);
    if (!div_in_range(g, x)) {
      atomicAdd(&counts[1], 1ull);
      // outside the predicate: how many non-NaN g would the branch-free sequence still get right (to widen it)?
      if (!(g != g) && __float_as_uint(g / x) != __float_as_uint(div_in_range_value(g, x))) {
        const unsigned long long k = atomicAdd(&counts[3], 1ull);
        if (k < 8) first[8 + k] = bits;
      }
      continue;
    }
    const float exact = g / x;
    const float fast = div_in_range_value(g, x);
    if (__float_as_uint(exact) != __float_as_uint(fast)) {
      const unsigned long long k = atomicAdd(&counts[0], 1ull);
      if (k < 8) first[k] = bits;
    }
  }
}

int main() {
  unsigned long long* counts;
  uint32_t* first;
  cudaMalloc(&counts, 4 * sizeof(unsigned long long));
  cudaMalloc(&first, 16 * sizeof(uint32_t));
  cudaMemset(counts, 0, 4 * sizeof(unsigned long long));
  cudaMemset(first, 0xff, 16 * sizeof(uint32_t));
  const uint32_t chunk = 1u << 30;
  for (uint64_t s = 0; s < (1ull << 32); s += chunk) check<<<132 * 8, 256>>>(counts, first, uint32_t(s), chunk);
  unsigned long long h[4];
  uint32_t f[16];
  cudaMemcpy(h, counts, sizeof(h), cudaMemcpyDeviceToHost);
  cudaMemcpy(f, first, sizeof(f), cudaMemcpyDeviceToHost);
  const cudaError_t err = cudaGetLastError();
  printf("silu division check: %s; mismatches in range %llu, g outside the range %llu of 2^32; denominators that "
         "differ with ex2.approx.ftz %llu\n", cudaGetErrorString(err), h[0], h[1], h[2]);
  for (int i = 0; i < 8 && i < int(h[0]); ++i) printf("  mismatch at g bits 0x%08x (%g)\n", f[i], *(float*)&f[i]);
  printf("outside the range, non-NaN g where the branch-free sequence differs: %llu\n", h[3]);
  for (int i = 0; i < 8 && i < int(h[3]); ++i)
    printf("  outside: g bits 0x%08x (%g)\n", f[8 + i], *(float*)&f[8 + i]);
  return err != cudaSuccess || h[0] != 0 || h[2] != 0;
}
