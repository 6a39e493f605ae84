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

// Kernel parameters of more ranks than one launch's parameter space holds (an emulated group of more than 8): a
// launch of one CTA carries up to N ranks' parameters T by value (so a CUDA graph that records the call holds them;
// a copy from host memory would be read again at every replay), and store_rank_params puts them into device memory,
// rank i's at dst + i stride, then releases them to the tensormap proxy: their TMA descriptors are read through it,
// by a kernel that acquires each one first.
template <class T, int N>
struct ParamUpload {
  T ranks[N];
  uint8_t* dst;    // where ranks[0] goes
  int64_t stride;  // bytes from one rank's copy to the next's
  int32_t count;   // ranks in this launch, <= N
};

template <class T, int N>
__device__ __forceinline__ void store_rank_params(const ParamUpload<T, N>& up) {
  static_assert(sizeof(T) % 16 == 0, "16-byte copies");
  constexpr int kVecs = int(sizeof(T) / 16);
  for (int i = threadIdx.x; i < up.count * kVecs; i += blockDim.x) {
    const int r = i / kVecs, v = i % kVecs;
    reinterpret_cast<int4*>(up.dst + r * up.stride)[v] = reinterpret_cast<const int4*>(&up.ranks[r])[v];
  }
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" : : : "memory");
}

}  // namespace mok
