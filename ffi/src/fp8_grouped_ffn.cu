// Host side of mok/fp8_grouped_ffn.cuh: the row quantisation of x, TMA descriptors, the two FP8 grouped-GEMM
// launches.
#include <climits>

#include "mok/fp8_grouped_ffn.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/grouped_ffn.cuh"             // the limits and the M == 0 path, shared with the bf16 op

namespace mok {
namespace {

using GateUpGemm = gemm::Sm90GroupedGemm<gemm::Fp8BlockScaledMainloop, gemm::Epilogue::kSwiGLUQuant>;
using DownGemm = gemm::Sm90GroupedGemm<gemm::Fp8BlockScaledMainloop, gemm::Epilogue::kBf16>;
using E4M3 = cutlass::float_e4m3_t;
static_assert(GateUpGemm::kMaxGroups == kGroupedFfnMaxExperts, "expert limit");

// x [M, K] -> x_q [M, K], x_scale [K/128, M]: one warp per 1 x 128 tile, grid-stride.
__global__ void __launch_bounds__(256) fp8_quantize_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                                               uint8_t* __restrict__ q, float* __restrict__ scale,
                                                               int64_t num_rows, int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t blocks = k / gemm::kFp8ScaleBlock;
  const int64_t tiles = num_rows * blocks;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t tile = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; tile < tiles; tile += warps) {
    const int64_t row = tile / blocks, kb = tile % blocks;
    const int64_t offset = row * k + kb * gemm::kFp8ScaleBlock;
    const float sc = gemm::fp8_quantize_tile_warp(x + offset, q + offset, lane);
    if (lane == 0) scale[kb * num_rows + row] = sc;
  }
}

}  // namespace

const char* fp8_grouped_ffn_unsupported(const Fp8GroupedFfnParams& p) {
  if (const char* why = grouped_ffn_limits_unsupported(p.hidden, p.intermediate, p.num_experts, p.num_sms))
    return why;
  // whole scale blocks along both reductions
  if (p.hidden <= 0 || p.hidden % 128 != 0) return "x: hidden size H must be a positive multiple of 128";
  if (p.intermediate <= 0 || p.intermediate % 128 != 0)
    return "gate_up: intermediate size I must be a positive multiple of 128";
  if (p.num_rows < 0 || p.num_rows > INT_MAX) return "x: rows M must be in [0, 2^31)";
  return nullptr;
}

cudaError_t launch_fp8_grouped_ffn(const Fp8GroupedFfnParams& p, cudaStream_t stream) {
  if (fp8_grouped_ffn_unsupported(p)) return cudaErrorInvalidValue;
  const int num_experts = int(p.num_experts);
  if (p.num_rows == 0) return launch_grouped_ffn_status(p.group_sizes, num_experts, p.status, stream);
  int grid = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p.num_sms, &grid));
  const int m = int(p.num_rows), hidden = int(p.hidden), inter = int(p.intermediate);

  // Row quantisation of x: 8 warps (tiles) per block; a few waves of blocks per SM, grid-stride beyond.
  const int64_t tiles = int64_t(m) * (hidden / gemm::kFp8ScaleBlock);
  const int64_t quant_blocks = std::min<int64_t>((tiles + 7) / 8, int64_t(grid) * 16);
  fp8_quantize_rows_kernel<<<int(quant_blocks), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(p.x), static_cast<uint8_t*>(p.x_q), p.x_scale, m, hidden);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  GateUpGemm::Params up{};
  up.tma_a = GateUpGemm::make_tma_a(static_cast<const E4M3*>(p.x_q), m, hidden);
  up.tma_b = GateUpGemm::make_tma_b(static_cast<const E4M3*>(p.gate_up), 2 * inter, hidden, num_experts);
  up.scales.a = p.x_scale;
  up.scales.b = p.gate_up_scale;
  up.group_sizes = p.group_sizes;
  up.num_groups = num_experts;
  up.num_rows = m;
  up.k = hidden;
  up.n_out = inter;
  up.n_b = 2 * inter;
  up.b_second_offset = inter;  // the tile's up columns sit I after its gate columns
  up.out.ptr = p.h;
  up.out.ld = inter;
  up.out.scale = p.h_scale;
  up.status = p.status;
  up.write_status = 1;

  DownGemm::Params dn{};
  dn.tma_a = DownGemm::make_tma_a(static_cast<const E4M3*>(p.h), m, inter);
  dn.tma_b = DownGemm::make_tma_b(static_cast<const E4M3*>(p.down), hidden, inter, num_experts);
  dn.scales.a = p.h_scale;
  dn.scales.b = p.down_scale;
  dn.group_sizes = p.group_sizes;
  dn.num_groups = num_experts;
  dn.num_rows = m;
  dn.k = inter;
  dn.n_out = hidden;
  dn.n_b = hidden;
  dn.b_second_offset = DownGemm::kHalfN;  // the two halves are adjacent
  dn.out.ptr = p.y;
  dn.out.ld = hidden;
  dn.out.scale = nullptr;
  dn.status = p.status;
  dn.write_status = 0;

  MOK_CUDA_RETURN_IF_ERROR(gemm::launch_persistent_gemm<GateUpGemm>(up, grid, stream));
  return gemm::launch_persistent_gemm<DownGemm>(dn, grid, stream);
}

}  // namespace mok
