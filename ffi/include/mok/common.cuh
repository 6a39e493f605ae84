// mok: shared helpers for the CUDA side of mok_jax (no JAX, no Python in here).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace mok {

// Ceil-divide for sizes and grid math.
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

}  // namespace mok

// Evaluate a CUDA runtime call and return its error from the enclosing function (host side).
#define MOK_CUDA_RETURN_IF_ERROR(expr)        \
  do {                                        \
    cudaError_t mok_err_ = (expr);            \
    if (mok_err_ != cudaSuccess) return mok_err_; \
  } while (0)

namespace mok {

// Launch `kernel`, which needs sm_90a machine code (wgmma, setmaxnreg), with `smem` bytes of dynamic shared
// memory. A build without that code is refused (cudaErrorNoKernelImageForDevice) rather than launched: such a
// kernel would only set a status bit.
template <class Params>
cudaError_t launch_sm90a(void (*kernel)(Params), int grid, int threads, int smem, cudaStream_t stream,
                         const Params& params) {
  cudaFuncAttributes attr{};
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  if (attr.binaryVersion != 90) return cudaErrorNoKernelImageForDevice;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, threads, smem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mok
