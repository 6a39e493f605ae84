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
