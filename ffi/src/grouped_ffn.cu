// Host side of mok/grouped_ffn.cuh: the limits, the row quantisation of x (FP8), TMA descriptors and the two
// grouped-GEMM launches of either precision, test helpers.
#include <algorithm>
#include <climits>

#include "mok/gemm/fp8_quant.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/grouped_ffn.cuh"

namespace mok {
namespace {

static_assert(gemm::kStatusNegativeGroup == kGroupedFfnStatusNegativeGroup, "status bits");
static_assert(gemm::kStatusRowOverflow == kGroupedFfnStatusRowOverflow, "status bits");

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

// x [M, K] -> x_q [M, K], x_scale [K/128, M]. x's 1 x 128 tiles are consecutive 128-value pieces of memory (tile t =
// row t / (K/128), k block t % (K/128)); a warp quantises two at a time (fp8_quantize_tile_pair, 16 bytes a lane) and
// loads kPairsInFlight pairs before it computes the first, grid-stride: 32 bytes a lane in flight, where the earlier
// form (one tile a warp at a time) had 8.
constexpr int kPairsInFlight = 2;
__global__ void __launch_bounds__(256) fp8_quantize_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                                               uint8_t* __restrict__ q, float* __restrict__ scale,
                                                               int64_t num_rows, int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t blocks = k / gemm::kFp8ScaleBlock;
  const int64_t tiles = num_rows * blocks;
  const int64_t pairs = (tiles + 1) / 2;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t warp = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  for (int64_t p0 = warp * kPairsInFlight; p0 < pairs; p0 += warps * kPairsInFlight) {
    uint4 raw[kPairsInFlight];
#pragma unroll
    for (int j = 0; j < kPairsInFlight; ++j) {
      const int64_t tile = 2 * (p0 + j) + lane / 16;
      raw[j] = tile < tiles ? *reinterpret_cast<const uint4*>(x + tile * gemm::kFp8ScaleBlock + 8 * (lane % 16))
                            : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kPairsInFlight; ++j) {
      if (p0 + j >= pairs) break;  // the same for the whole warp: its shuffles see every lane
      float sc;
      const uint2 v = gemm::fp8_quantize_tile_pair(raw[j], &sc);
      const int64_t tile = 2 * (p0 + j) + lane / 16;
      if (tile < tiles) {  // the second tile of the last pair may not exist
        *reinterpret_cast<uint2*>(q + tile * gemm::kFp8ScaleBlock + 8 * (lane % 16)) = v;
        if (lane % 16 == 0) scale[(tile % blocks) * num_rows + tile / blocks] = sc;
      }
    }
  }
}

// The op's two grouped GEMMs with `Mainloop` (its precision): gate/up (A = x, or x_q) with the SwiGLU epilogue
// kGateUpEpi writes h; down reads h and writes y.
template <class Mainloop, gemm::Epilogue kGateUpEpi>
cudaError_t launch_gemm_pair(const GroupedFfnParams& p, const void* a, int grid, cudaStream_t stream) {
  using GateUpGemm = gemm::Sm90GroupedGemm<Mainloop, kGateUpEpi>;
  using DownGemm = gemm::Sm90GroupedGemm<Mainloop, gemm::Epilogue::kBf16>;
  using Element = typename Mainloop::Element;
  constexpr bool kFp8 = kGateUpEpi == gemm::Epilogue::kSwiGLUQuant;
  static_assert(GateUpGemm::kMaxGroups == kGroupedFfnMaxExperts, "expert limit");
  const int num_experts = int(p.num_experts);
  const int m = int(p.num_rows), hidden = int(p.hidden), inter = int(p.intermediate);

  typename GateUpGemm::Params up{};
  up.tma_a = GateUpGemm::make_tma_a(static_cast<const Element*>(a), m, hidden);
  up.tma_b = GateUpGemm::make_tma_b(static_cast<const Element*>(p.gate_up), 2 * inter, hidden, num_experts);
  if constexpr (kFp8) up.scales = {p.scales.x_scale, p.scales.gate_up_scale};
  up.group_sizes = p.group_sizes;
  up.num_groups = num_experts;
  up.num_rows = m;
  up.k = hidden;
  up.n_out = inter;
  up.n_b = 2 * inter;
  up.b_second_offset = inter;  // the tile's up columns sit I after its gate columns
  up.out.ptr = p.h;
  up.out.ld = inter;
  if constexpr (kFp8) up.out.scale = p.scales.h_scale;
  up.status = p.status;
  up.write_status = 1;

  typename DownGemm::Params dn{};
  dn.tma_a = DownGemm::make_tma_a(static_cast<const Element*>(p.h), m, inter);
  dn.tma_b = DownGemm::make_tma_b(static_cast<const Element*>(p.down), hidden, inter, num_experts);
  if constexpr (kFp8) dn.scales = {p.scales.h_scale, p.scales.down_scale};
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

}  // namespace

const char* grouped_ffn_unsupported(const GroupedFfnParams& p) {
  if (p.num_experts < 1 || p.num_experts > kGroupedFfnMaxExperts)
    return "group_sizes: the number of experts E must be in [1, 1024]";
  if (p.hidden > INT_MAX / 2 || 2 * p.intermediate > INT_MAX) return "gate_up: H and 2I must be below 2^31";
  if (p.num_sms < 0) return "num_sms must be >= 0 (0 = all SMs)";
  // TMA reads x (bf16), x_q, h and the weights from 16-byte aligned addresses, and the epilogues and the FP8 row
  // quantiser move 16 bytes at a time; the scales and the counts are 4-byte words. (XLA's buffers always are; a raw
  // caller's might not be, and would fault in the kernel.)
  const auto aligned = [](const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  if (!aligned(p.x, 16) || !aligned(p.gate_up, 16) || !aligned(p.down, 16) || !aligned(p.y, 16) ||
      !aligned(p.h, 16))
    return "x, gate_up, down, y and h must be 16-byte aligned";
  if (!aligned(p.group_sizes, 4) || !aligned(p.status, 4)) return "group_sizes and status must be 4-byte aligned";
  if (p.precision == GroupedFfnPrecision::kFp8 &&
      (!aligned(p.scales.x_q, 16) || !aligned(p.scales.gate_up_scale, 4) || !aligned(p.scales.down_scale, 4) ||
       !aligned(p.scales.h_scale, 4) || !aligned(p.scales.x_scale, 4)))
    return "x_q must be 16-byte aligned, and the scales 4-byte aligned";
  if (p.precision == GroupedFfnPrecision::kFp8) {  // whole scale blocks along both reductions
    if (p.hidden <= 0 || p.hidden % 128 != 0) return "x: hidden size H must be a positive multiple of 128";
    if (p.intermediate <= 0 || p.intermediate % 128 != 0)
      return "gate_up: intermediate size I must be a positive multiple of 128";
    if (p.num_rows < 0 || p.num_rows > INT_MAX) return "x: rows M must be in [0, 2^31)";
  } else {  // 16-byte rows for TMA
    if (p.hidden <= 0 || p.hidden % 8 != 0) return "x: hidden size H must be a positive multiple of 8";
    if (p.intermediate <= 0 || p.intermediate % 8 != 0)
      return "gate_up: intermediate size I must be a positive multiple of 8";
    if (p.num_rows < 0 || p.num_rows > INT_MAX) return "rows M must be in [0, 2^31)";
  }
  return nullptr;
}

cudaError_t launch_grouped_ffn(const GroupedFfnParams& p, cudaStream_t stream) {
  if (grouped_ffn_unsupported(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) {
    grouped_ffn_status_kernel<<<1, 32, 0, stream>>>(p.group_sizes, int(p.num_experts), p.status);
    return cudaGetLastError();
  }
  int grid = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p.num_sms, &grid));
  if (p.precision == GroupedFfnPrecision::kBf16)
    return launch_gemm_pair<gemm::Bf16Mainloop<>, gemm::Epilogue::kSwiGLU>(p, p.x, grid, stream);

  // Row quantisation of x: 8 warps per block, 2 x kPairsInFlight tiles a warp at a time; a few waves of blocks per SM,
  // grid-stride beyond.
  const int64_t m = p.num_rows, hidden = p.hidden;
  const int64_t tiles = m * (hidden / gemm::kFp8ScaleBlock);
  const int64_t quant_blocks = std::min<int64_t>((tiles + 2 * 8 * kPairsInFlight - 1) / (2 * 8 * kPairsInFlight),
                                                 int64_t(grid) * 16);
  fp8_quantize_rows_kernel<<<int(quant_blocks), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(p.x), static_cast<uint8_t*>(p.scales.x_q), p.scales.x_scale, m, hidden);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return launch_gemm_pair<gemm::Fp8BlockScaledMainloop, gemm::Epilogue::kSwiGLUQuant>(p, p.scales.x_q, grid, stream);
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
