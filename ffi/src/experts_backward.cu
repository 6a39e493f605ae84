// Host side of mok/experts_backward.cuh: the row gather and the slot sum, TMA descriptors, the launches.
#include <climits>

#include "mok/experts_backward.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/grouped_ffn.cuh"

namespace mok {
namespace {

using KMajor = cute::GMMA::Major;
using GuGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kF32>;                                 // x @ gate_up
using DhGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kSwiGLUBackward, KMajor::K>;           // dy @ down^T
using DxGemm = gemm::Sm90GroupedGemm<gemm::Epilogue::kBf16, KMajor::K>;                     // dgu @ gate_up^T
using WGrad = gemm::Sm90WeightGrad;
using Bf16 = cutlass::bfloat16_t;
static_assert(gemm::kStatusUnpaddedGroup == kExpertsBackwardStatusUnpadded, "status bits");
static_assert(gemm::kGroupAlign == kExpertsBackwardRowBlock, "group alignment");
static_assert(DhGemm::kOutCols == kExpertsBackwardColBlock, "dgrad n-block");

// The rows in use, sum(group_sizes), or 0 when the sizes are bad (as the GEMMs' group tables treat them).
// One thread; E <= 1024 loads.
__device__ int64_t rows_in_use(const int32_t* __restrict__ sizes, int num_groups, int64_t num_rows) {
  int64_t total = 0;
  bool bad = false;
  for (int g = 0; g < num_groups; ++g) bad |= sizes[g] < 0, total += sizes[g] < 0 ? 0 : sizes[g];
  return (bad || total > num_rows) ? 0 : total;
}

// Rows r < rows in use: x_e[r] = x[s / k], dy_e[r] = dy[s / k], w_e[r] = topk_weight[s] for the row's slot s,
// zeros for a padding row (or a slot id out of range), and with kept g, u (gu_kept, gu_vecs float4 per row)
// zeros in a padding row's g | u. One warp per row, 16-byte copies (H % 8 == 0).
__global__ void gather_rows_kernel(const uint4* __restrict__ x, const uint4* __restrict__ dy,
                                   const float* __restrict__ topk_weight, const int32_t* __restrict__ src_slot,
                                   const int32_t* __restrict__ sizes, int num_groups, int64_t num_rows,
                                   int64_t num_slots, int top_k, int chunks, uint4* __restrict__ x_e,
                                   uint4* __restrict__ dy_e, float* __restrict__ w_e, float4* __restrict__ gu_kept,
                                   int gu_vecs) {
  __shared__ int64_t used_s;
  if (threadIdx.x == 0) used_s = rows_in_use(sizes, num_groups, num_rows);
  __syncthreads();
  const int64_t used = used_s;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; r < used; r += warps) {
    const int64_t slot = src_slot[r];
    const bool valid = slot >= 0 && slot < num_slots;
    const int64_t t = valid ? slot / top_k : 0;
    for (int c = lane; c < chunks; c += 32) {
      x_e[r * chunks + c] = valid ? x[t * chunks + c] : make_uint4(0, 0, 0, 0);
      dy_e[r * chunks + c] = valid ? dy[t * chunks + c] : make_uint4(0, 0, 0, 0);
    }
    if (lane == 0) w_e[r] = valid ? topk_weight[slot] : 0.0f;
    if (gu_kept != nullptr && !valid)
      for (int c = lane; c < gu_vecs; c += 32) gu_kept[r * gu_vecs + c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Per token t: dx[t] = sum_{j ascending} dx_e[pos[t, j]] in fp32, dw[t, j] = dw_e[pos[t, j]]; a pos outside
// [0, M) adds nothing (dw 0). One block per token (grid-stride), 8 columns per thread.
__global__ void slot_sum_kernel(const uint4* __restrict__ dx_e, const float* __restrict__ dw_e,
                                const int32_t* __restrict__ pos, int64_t num_tokens, int top_k, int64_t num_rows,
                                int chunks, float4* __restrict__ dx, float* __restrict__ dw) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t* p = pos + t * top_k;
    if (threadIdx.x < top_k) {
      const int64_t r = p[threadIdx.x];
      dw[t * top_k + threadIdx.x] = (r >= 0 && r < num_rows) ? dw_e[r] : 0.0f;
    }
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int j = 0; j < top_k; ++j) {
        const int64_t r = p[j];
        if (r < 0 || r >= num_rows) continue;
        const uint4 v = dx_e[r * chunks + c];
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h[q]);
          acc[2 * q] += f.x;
          acc[2 * q + 1] += f.y;
        }
      }
      dx[(t * chunks + c) * 2] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dx[(t * chunks + c) * 2 + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
}

// dw_e[r] = sum over n-blocks (ascending) of dw_part[r, :] for rows in use, 0 past them.
__global__ void dw_sum_kernel(const float* __restrict__ part, int n_blocks, const int32_t* __restrict__ sizes,
                              int num_groups, int64_t num_rows, float* __restrict__ dw) {
  __shared__ int64_t used_s;
  if (threadIdx.x == 0) used_s = rows_in_use(sizes, num_groups, num_rows);
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
  GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, p.num_rows, p.hidden,
                     p.intermediate, p.num_experts, p.num_sms};
  if (const char* why = grouped_ffn_unsupported(f)) return why;
  if (p.num_tokens < 0 || p.num_tokens > INT_MAX) return "tokens T must be in [0, 2^31)";
  if (p.top_k < 1 || p.top_k > 32) return "top_k must be in [1, 32]";
  if (p.num_tokens * p.top_k > INT_MAX || p.num_tokens * p.hidden > INT_MAX) return "T * k and T * H must be below 2^31";
  if (p.num_rows * 2 * p.intermediate > INT_MAX || p.num_rows * p.hidden > INT_MAX)
    return "rows M times H or 2I must be below 2^31";
  return nullptr;
}

cudaError_t launch_experts_backward(const ExpertsBackwardParams& p, cudaStream_t stream) {
  if (experts_backward_unsupported(p)) return cudaErrorInvalidValue;
  using gemm::launch_persistent_gemm;
  int grid = 0, sm_count = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p.num_sms, &grid));
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(0, &sm_count));  // every SM: the row kernels' grids
  const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts);
  const int n_blocks = (I + kExpertsBackwardColBlock - 1) / kExpertsBackwardColBlock;
  const auto* x_e = static_cast<const Bf16*>(p.x_e);
  const auto* dy_e = static_cast<const Bf16*>(p.dy_e);
  const auto* gate_up = static_cast<const Bf16*>(p.gate_up);
  const auto* down = static_cast<const Bf16*>(p.down);
  const bool kept = p.gu_kept != nullptr;  // the forward's g, u: no launch 1
  const float* gu = kept ? p.gu_kept : static_cast<const float*>(p.gu);
  auto* dgu = static_cast<Bf16*>(p.dgu);
  auto* hw = static_cast<Bf16*>(p.hw);
  const int chunks = H / 8;
  const int k = int(p.top_k);
  const int64_t slots = p.num_tokens * p.top_k;
  if (p.num_rows == 0) {  // no rows: zero gradients, and the status of the sizes
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_gate_up, 0, size_t(E) * H * 2 * I * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_down, 0, size_t(E) * I * H * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dx, 0, size_t(p.num_tokens) * H * sizeof(float), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dw, 0, size_t(slots) * sizeof(float), stream));
    GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, 0, p.hidden, p.intermediate,
                       p.num_experts, p.num_sms};
    return launch_grouped_ffn(f, stream);  // M = 0: writes the status only
  }
  // 0: the rows
  {
    const int64_t blocks = (p.num_rows + 7) / 8;
    gather_rows_kernel<<<int(blocks < 8 * int64_t(sm_count) ? blocks : 8 * int64_t(sm_count)), 256, 0, stream>>>(
        static_cast<const uint4*>(p.x), static_cast<const uint4*>(p.dy), p.topk_weight, p.src_slot, p.group_sizes, E,
        p.num_rows, slots, k, chunks, static_cast<uint4*>(p.x_e), static_cast<uint4*>(p.dy_e), p.w_e,
        reinterpret_cast<float4*>(p.gu_kept), I / 2);
    MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  // 1: gu = x_e @ gate_up in fp32 (writes the status word), unless the forward kept g, u
  // (fp32 g, u: the gradients are those of what the forward computed, which rounds only h)
  if (!kept)
    MOK_CUDA_RETURN_IF_ERROR(launch_persistent_gemm<GuGemm>(
        grouped<GuGemm>(p, x_e, H, gate_up, 2 * I, 2 * I, p.gu, 2 * I, 1), grid, stream));
  // 2: dh' = dy_e @ down^T, SwiGLU backward in the epilogue (the first GEMM when kept: it writes the status)
  auto dh = grouped<DhGemm>(p, dy_e, H, down, I, I, dgu, 2 * I, kept ? 1 : 0);
  dh.bwd = gemm::SwigluBackwardOut{gu, p.w_e,
                                   reinterpret_cast<__nv_bfloat16*>(dgu), reinterpret_cast<__nv_bfloat16*>(hw),
                                   p.dw_part, I, n_blocks};
  MOK_CUDA_RETURN_IF_ERROR(launch_persistent_gemm<DhGemm>(dh, grid, stream));
  // 3: dw_e
  const int64_t sum_blocks = (p.num_rows + 255) / 256;
  dw_sum_kernel<<<int(sum_blocks < 1024 ? sum_blocks : 1024), 256, 0, stream>>>(p.dw_part, n_blocks, p.group_sizes,
                                                                                E, p.num_rows, p.dw_e);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // 4: dx_e = dgu @ gate_up^T (zero rows past the groups)
  MOK_CUDA_RETURN_IF_ERROR(
      launch_persistent_gemm<DxGemm>(grouped<DxGemm>(p, dgu, 2 * I, gate_up, H, H, p.dx_e, H, 0), grid, stream));
  // 5, 6: weight gradients
  MOK_CUDA_RETURN_IF_ERROR(launch_persistent_gemm<WGrad>(weight_grad(p, hw, I, dy_e, H, p.d_down), grid, stream));
  MOK_CUDA_RETURN_IF_ERROR(
      launch_persistent_gemm<WGrad>(weight_grad(p, x_e, H, dgu, 2 * I, p.d_gate_up), grid, stream));
  // 7: per token
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t blocks = p.num_tokens < 4 * int64_t(sm_count) ? p.num_tokens : 4 * int64_t(sm_count);
  slot_sum_kernel<<<int(blocks), 256, 0, stream>>>(static_cast<const uint4*>(p.dx_e), p.dw_e, p.pos, p.num_tokens, k,
                                                  p.num_rows, chunks, reinterpret_cast<float4*>(p.dx), p.dw);
  return cudaGetLastError();
}

}  // namespace mok
