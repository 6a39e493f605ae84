// Host side of mok/grouped_ffn.cuh: TMA descriptors, the two grouped-GEMM launches, test helpers.
#include <climits>

#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/grouped_ffn.cuh"

namespace mok {
namespace {

using GateUpGemm = gemm::Sm90GroupedGemm<gemm::Bf16Mainloop<>, gemm::Epilogue::kSwiGLU>;
using DownGemm = gemm::Sm90GroupedGemm<gemm::Bf16Mainloop<>, gemm::Epilogue::kBf16>;
using Bf16 = cutlass::bfloat16_t;
static_assert(gemm::kStatusNegativeGroup == kGroupedFfnStatusNegativeGroup, "status bits");
static_assert(gemm::kStatusRowOverflow == kGroupedFfnStatusRowOverflow, "status bits");
static_assert(GateUpGemm::kMaxGroups == kGroupedFfnMaxExperts, "expert limit");

// M == 0: no GEMM to run, but the status still reports bad group sizes.
__global__ void grouped_ffn_status_kernel(const int32_t* sizes, int num_groups, int32_t* status) {
  __shared__ gemm::GroupTable<kGroupedFfnMaxExperts> table;
  gemm::build_group_table(table, sizes, num_groups, 0, 128, 1, int(threadIdx.x));
  __syncwarp();
  if (threadIdx.x == 0) *status = table.status;
}

__global__ void occupy_sms_kernel(int64_t duration_ns, int32_t* started) {
  if (threadIdx.x != 0) return;
  atomicAdd(started, 1);
  const uint64_t t0 = gemm::global_timer_ns();
  while (gemm::global_timer_ns() - t0 < uint64_t(duration_ns)) __nanosleep(10000);
}

}  // namespace

const char* grouped_ffn_limits_unsupported(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                           int32_t num_sms) {
  if (num_experts < 1 || num_experts > kGroupedFfnMaxExperts)
    return "group_sizes: the number of experts E must be in [1, 1024]";
  if (hidden > INT_MAX / 2 || 2 * intermediate > INT_MAX) return "gate_up: H and 2I must be below 2^31";
  if (num_sms < 0) return "num_sms must be >= 0 (0 = all SMs)";
  return nullptr;
}

cudaError_t launch_grouped_ffn_status(const int32_t* group_sizes, int num_experts, int32_t* status,
                                      cudaStream_t stream) {
  grouped_ffn_status_kernel<<<1, 32, 0, stream>>>(group_sizes, num_experts, status);
  return cudaGetLastError();
}

const char* grouped_ffn_unsupported(const GroupedFfnParams& p) {
  if (const char* why = grouped_ffn_limits_unsupported(p.hidden, p.intermediate, p.num_experts, p.num_sms))
    return why;
  // 16-byte rows for TMA
  if (p.hidden <= 0 || p.hidden % 8 != 0) return "x: hidden size H must be a positive multiple of 8";
  if (p.intermediate <= 0 || p.intermediate % 8 != 0)
    return "gate_up: intermediate size I must be a positive multiple of 8";
  if (p.num_rows < 0 || p.num_rows > INT_MAX) return "rows M must be in [0, 2^31)";
  return nullptr;
}

cudaError_t launch_grouped_ffn(const GroupedFfnParams& p, cudaStream_t stream) {
  if (grouped_ffn_unsupported(p)) return cudaErrorInvalidValue;
  const int num_experts = int(p.num_experts);
  if (p.num_rows == 0) return launch_grouped_ffn_status(p.group_sizes, num_experts, p.status, stream);
  int grid = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p.num_sms, &grid));

  const int m = int(p.num_rows), hidden = int(p.hidden), inter = int(p.intermediate);
  auto* h = static_cast<Bf16*>(p.h);

  GateUpGemm::Params up{};
  up.tma_a = GateUpGemm::make_tma_a(static_cast<const Bf16*>(p.x), m, hidden);
  up.tma_b = GateUpGemm::make_tma_b(static_cast<const Bf16*>(p.gate_up), 2 * inter, hidden, num_experts);
  up.group_sizes = p.group_sizes;
  up.num_groups = num_experts;
  up.num_rows = m;
  up.k = hidden;
  up.n_out = inter;
  up.n_b = 2 * inter;
  up.b_second_offset = inter;  // up columns start I after the gate columns
  up.out.ptr = h;
  up.out.ld = inter;
  up.status = p.status;
  up.write_status = 1;

  DownGemm::Params dn{};
  dn.tma_a = DownGemm::make_tma_a(h, m, inter);
  dn.tma_b = DownGemm::make_tma_b(static_cast<const Bf16*>(p.down), hidden, inter, num_experts);
  dn.group_sizes = p.group_sizes;
  dn.num_groups = num_experts;
  dn.num_rows = m;
  dn.k = inter;
  dn.n_out = hidden;
  dn.n_b = hidden;
  dn.b_second_offset = DownGemm::kHalfN;  // the two halves are adjacent
  dn.out.ptr = p.y;
  dn.out.ld = hidden;
  dn.status = p.status;
  dn.write_status = 0;

  MOK_CUDA_RETURN_IF_ERROR(gemm::launch_persistent_gemm<GateUpGemm>(up, grid, stream));
  return gemm::launch_persistent_gemm<DownGemm>(dn, grid, stream);
}

cudaError_t launch_occupy_sms(int32_t num_blocks, int64_t duration_ns, int32_t* started, cudaStream_t stream) {
  if (num_blocks <= 0) return cudaSuccess;
  constexpr int kSmem = 200 * 1024;  // more than half an SM's shared memory: one block per SM
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(occupy_sms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  occupy_sms_kernel<<<num_blocks, 32, kSmem, stream>>>(duration_ns, started);
  return cudaGetLastError();
}

}  // namespace mok
