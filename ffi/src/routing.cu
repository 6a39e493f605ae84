// Kernels of mok/routing.cuh.
#include "mok/routing.cuh"

namespace mok {
namespace {

constexpr int kCountThreads = 256;

__global__ void expert_counts_kernel(ExpertCountParams p) {
  extern __shared__ int32_t hist[];  // [num_experts + 1]: the last slot counts invalid indices
  for (int e = threadIdx.x; e <= p.num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_assignments; i += stride) {
    const int32_t e = p.topk_idx[i];
    const bool valid = e >= 0 && e < p.num_experts;
    atomicAdd(&hist[valid ? e : p.num_experts], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
    if (hist[e]) atomicAdd(&p.counts[e], hist[e]);
  if (threadIdx.x == 0 && hist[p.num_experts]) atomicAdd(p.num_invalid, hist[p.num_experts]);
}

}  // namespace

cudaError_t launch_expert_counts(const ExpertCountParams& p, cudaStream_t stream) {
  if (p.num_experts <= 0 || p.num_experts > kMaxExpertsForCount) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * p.num_experts, stream));
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.num_invalid, 0, sizeof(int32_t), stream));
  if (p.num_assignments == 0) return cudaSuccess;
  const int64_t want = ceil_div<int64_t>(p.num_assignments, kCountThreads);
  const int blocks = int(want < 1024 ? want : 1024);
  const size_t smem = sizeof(int32_t) * (p.num_experts + 1);
  expert_counts_kernel<<<blocks, kCountThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mok
