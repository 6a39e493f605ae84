// Host side of mok/experts_backward.cuh: TMA descriptors and the six launches.
#include <climits>

#include "mok/experts_backward.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/grouped_ffn.cuh"

namespace mok {
namespace {

using KMajor = cute::GMMA::Major;
using GuGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kBf16>;                                // x @ gate_up
using DhGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kSwiGLUBackward, KMajor::K>;           // dy @ down^T
using DxGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kBf16, KMajor::K>;                     // dgu @ gate_up^T
using WGrad = gemm::Sm90WeightGrad;
using Bf16 = cutlass::bfloat16_t;
static_assert(gemm::kStatusUnpaddedGroup == kExpertsBackwardStatusUnpadded, "status bits");
static_assert(DhGemm::kOutCols == kExpertsBackwardColBlock, "dgrad n-block");

// dw[r] = sum over n-blocks (ascending) of dw_part[r, :] for rows inside the groups, 0 past them. Every
// block derives the rows in use from the sizes (0 when they are bad, as the GEMMs treat them).
__global__ void dw_sum_kernel(const float* __restrict__ part, int n_blocks, const int32_t* __restrict__ sizes,
                              int num_groups, int64_t num_rows, float* __restrict__ dw) {
  __shared__ int64_t used_s;
  if (threadIdx.x == 0) {
    int64_t total = 0;
    bool bad = false;
    for (int g = 0; g < num_groups; ++g) bad |= sizes[g] < 0, total += sizes[g] < 0 ? 0 : sizes[g];
    used_s = (bad || total > num_rows) ? 0 : total;
  }
  __syncthreads();
  const int64_t used = used_s;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < num_rows; r += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    if (r < used)
      for (int b = 0; b < n_blocks; ++b) acc += part[r * n_blocks + b];
    dw[r] = acc;
  }
}

template <class Gemm>
cudaError_t launch(const typename Gemm::Params& params, int grid, cudaStream_t stream) {
  auto* kernel = &gemm::sm90_grouped_gemm_kernel<Gemm>;
  cudaFuncAttributes attr{};
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  if (attr.binaryVersion != 90) return cudaErrorNoKernelImageForDevice;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Gemm::kSmemBytes));
  kernel<<<grid, Gemm::kThreads, Gemm::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <class Gemm>
typename Gemm::Params grouped(const ExpertsBackwardParams& p, const Bf16* a, int k, const Bf16* b, int n_b,
                              int n_out, void* out, int64_t out_ld, int write_status) {
  typename Gemm::Params g{};
  g.tma_a = Gemm::make_tma_a(a, int(p.num_rows), k);
  g.tma_b = Gemm::make_tma_b(b, n_b, k, int(p.num_experts));
  g.group_sizes = p.group_sizes;
  g.num_groups = int(p.num_experts);
  g.num_rows = int(p.num_rows);
  g.k = k;
  g.n_out = n_out;
  g.n_b = n_b;
  g.b_second_offset = Gemm::kHalfN;  // 256 adjacent columns per tile
  g.out = static_cast<Bf16*>(out);
  g.out_ld = out_ld;
  g.status = p.status;
  g.write_status = write_status;
  return g;
}

WGrad::Params weight_grad(const ExpertsBackwardParams& p, const Bf16* a, int m_dim, const Bf16* b, int n_dim, void* out) {
  WGrad::Params g{};
  g.tma_a = WGrad::make_tma_a(a, int(p.num_rows), m_dim);
  g.tma_b = WGrad::make_tma_b(b, int(p.num_rows), n_dim);
  g.group_sizes = p.group_sizes;
  g.num_groups = int(p.num_experts);
  g.num_rows = int(p.num_rows);
  g.m_dim = m_dim;
  g.n_dim = n_dim;
  g.out = static_cast<Bf16*>(out);
  g.status = p.status;
  return g;
}

}  // namespace

const char* experts_backward_unsupported(const ExpertsBackwardParams& p) {
  GroupedFfnParams f{p.x, p.group_sizes, p.gate_up, p.down, p.dx, p.gu, p.status, p.num_rows, p.hidden,
                     p.intermediate, p.num_experts, p.num_sms};
  if (const char* why = grouped_ffn_unsupported(f)) return why;
  if (p.num_rows * 2 * p.intermediate > INT_MAX || p.num_rows * p.hidden > INT_MAX)
    return "rows M times H or 2I must be below 2^31";
  return nullptr;
}

cudaError_t launch_experts_backward(const ExpertsBackwardParams& p, cudaStream_t stream) {
  if (experts_backward_unsupported(p)) return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  MOK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const int grid = p.num_sms > 0 && p.num_sms < sm_count ? p.num_sms : sm_count;
  const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts);
  const int n_blocks = (I + kExpertsBackwardColBlock - 1) / kExpertsBackwardColBlock;
  const auto* x = static_cast<const Bf16*>(p.x);
  const auto* dy = static_cast<const Bf16*>(p.dy);
  const auto* gate_up = static_cast<const Bf16*>(p.gate_up);
  const auto* down = static_cast<const Bf16*>(p.down);
  auto* gu = static_cast<Bf16*>(p.gu);
  auto* dgu = static_cast<Bf16*>(p.dgu);
  auto* hw = static_cast<Bf16*>(p.hw);

  if (p.num_rows == 0) {  // nothing to reduce: zero weight gradients, and the status of the sizes
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_gate_up, 0, size_t(E) * H * 2 * I * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_down, 0, size_t(E) * I * H * sizeof(Bf16), stream));
    GroupedFfnParams f{p.x, p.group_sizes, p.gate_up, p.down, p.dx, p.gu, p.status, 0, p.hidden, p.intermediate,
                       p.num_experts, p.num_sms};
    return launch_grouped_ffn(f, stream);  // M = 0: writes the status only
  }
  // 1: gu = x @ gate_up (writes the status word; zero rows past the groups)
  MOK_CUDA_RETURN_IF_ERROR(launch<GuGemm>(grouped<GuGemm>(p, x, H, gate_up, 2 * I, 2 * I, gu, 2 * I, 1), grid, stream));
  // 2: dh' = dy @ down^T, SwiGLU backward in the epilogue
  auto dh = grouped<DhGemm>(p, dy, H, down, I, I, dgu, 2 * I, 0);
  dh.bwd = gemm::SwigluBackwardOut{reinterpret_cast<const __nv_bfloat16*>(gu), p.w,
                                   reinterpret_cast<__nv_bfloat16*>(dgu), reinterpret_cast<__nv_bfloat16*>(hw),
                                   p.dw_part, I, n_blocks};
  MOK_CUDA_RETURN_IF_ERROR(launch<DhGemm>(dh, grid, stream));
  // 3: dw
  const int64_t sum_blocks = (p.num_rows + 255) / 256;
  dw_sum_kernel<<<int(sum_blocks < 1024 ? sum_blocks : 1024), 256, 0, stream>>>(p.dw_part, n_blocks, p.group_sizes,
                                                                                E, p.num_rows, p.dw);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 4: dx = dgu @ gate_up^T (zero rows past the groups)
  MOK_CUDA_RETURN_IF_ERROR(launch<DxGemm>(grouped<DxGemm>(p, dgu, 2 * I, gate_up, H, H, p.dx, H, 0), grid, stream));
  // 5, 6: weight gradients
  MOK_CUDA_RETURN_IF_ERROR(launch<WGrad>(weight_grad(p, hw, I, dy, H, p.d_down), grid, stream));
  return launch<WGrad>(weight_grad(p, x, H, dgu, 2 * I, p.d_gate_up), grid, stream);
}

}  // namespace mok
