// mok backward: the backward megakernel's types and constants (mok/experts_backward.cuh says what it computes).
// The tiles of its five GEMMs, the CTA's roles and budgets (threads, setmaxnreg, blocking, the work queue), the
// kinds of work item in their list's order, the TMA descriptors over one set of rows (Operands, and the host's
// make_operands) and the kernel's parameters: one EP rank's (KernelParams) and the launch's (LaunchParams, or
// ManyLaunchParams for an emulated call of more ranks than the parameter space holds).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/comm/workspace.cuh"
#include "mok/common.cuh"
#include "mok/experts_backward.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/gemm/swiglu_backward.cuh"

namespace mok {
namespace {

using KMajor = cute::GMMA::Major;
using TileGu = gemm::Sm90TileT<KMajor::K, KMajor::MN>;  // x_e @ gate_up
using TileKK = gemm::Sm90TileT<KMajor::K, KMajor::K>;   // dy_e @ down^T, dgu @ gate_up^T (K-major B)
using TileW = gemm::Sm90TileT<KMajor::MN, KMajor::MN>;  // hw^T dy_e, x_e^T dgu (the rows are the k index)
using Bf16 = cutlass::bfloat16_t;
static_assert(gemm::kStatusUnpaddedGroup == kExpertsBackwardStatusUnpadded, "status bits");
static_assert(gemm::kGroupAlign == kExpertsBackwardRowBlock, "group alignment");
static_assert(TileKK::kBlockN == kExpertsBackwardColBlock, "dgrad n-block");

constexpr int kThreads = 128 + TileKK::kConsumerThreads;
constexpr int kConsumers = TileKK::kConsumerThreads;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumers <= (65536 / kThreads / 8 * 8) * kThreads,
              "setmaxnreg budget of the CTA");
constexpr int kBlockM = TileKK::kBlockM, kBlockN = TileKK::kBlockN, kHalfN = TileKK::kHalfN;
constexpr int kGroupM = 16;  // raster band height, as the grouped GEMM
constexpr int kMaxGroups = 1024;
constexpr int kSlotTokens = 8;  // tokens per SLOT item: one per consumer warp
constexpr int kGatherVecs = 4;  // 16-byte vectors in flight per lane and source in GATHER (more spill)
constexpr int kSlotVecs = 8;    // slot rows loaded per lane before any is added, in SLOT
constexpr int kSlotPrefetch = 2;  // passes (32 vectors a row) the L2 prefetch of SLOT's rows runs ahead
constexpr int kCopyVecs = 4;    // 16-byte vectors per lane in flight when SHARE and SEND copy a row
constexpr uint32_t kConsumerBarrier = 3;  // named barrier of the 256 consumer threads (1, 2: epilogues)
constexpr int kWorkSlots = 2;             // tickets the producer hands the consumers ahead

// The list's order: every item waits only for kinds before it. DWSUM sits after DX (whose tiles need every DH
// tile too, so it never waits there), SEND after both (its rows leave as their blocks finish, while the
// weight-gradient tiles run) and SLOT last: CTAs that are done with their weight-gradient tiles sum the tokens
// while the others finish theirs. SHARE and SEND exist only expert parallel.
enum Kind : int32_t { kShare, kGather, kGu, kDh, kDx, kDwSum, kSend, kWDown, kWGateUp, kSlot, kKinds };
static_assert(kKinds == kExpertsBackwardKinds, "the kinds the time words count");

// The TMA descriptors of the five GEMMs over one set of rows: the routed experts' gathered rows (M of them,
// x_e, dy_e, dgu, hw; the weights of E experts) or the shared expert's (the T tokens' x and dy, dgus, hws; one
// weight matrix each), with I the experts' intermediate size.
struct Operands {
  TileGu::TmaA gu_a;  // x rows [rows, H]
  TileGu::TmaB gu_b;  // gate_up [groups][H, 2I]
  TileKK::TmaA dh_a;  // dy rows [rows, H]
  TileKK::TmaB dh_b;  // down [groups][I, H] read as down^T
  TileKK::TmaA dx_a;  // dgu [rows, 2I]
  TileKK::TmaB dx_b;  // gate_up read as gate_up^T
  TileW::TmaA wd_a;   // hw [rows, I] read as I x rows
  TileW::TmaB wd_b;   // dy rows [rows, H]
  TileW::TmaA wg_a;   // x rows read as H x rows
  TileW::TmaB wg_b;   // dgu [rows, 2I]
  gemm::TmaGu dh_gu;  // g | u [rows, 2I] bf16: the DH tiles' epilogue operands, through the stage ring
};

__device__ void prefetch(const Operands& o) {
  cute::prefetch_tma_descriptor(o.gu_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.gu_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dx_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dx_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wd_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wd_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wg_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wg_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_gu.get_tma_descriptor());
}

// Host: the descriptors over rows x of x_rows / dy_rows (and dgu, hw, gu of as many rows), weights of `groups`
// experts.
Operands make_operands(const Bf16* x_rows, const Bf16* dy_rows, const Bf16* gate_up, const Bf16* down, const Bf16* dgu,
                       const Bf16* hw, const __nv_bfloat16* gu, int rows, int H, int I, int groups) {
  Operands o;
  o.gu_a = TileGu::make_tma_a(x_rows, rows, H);
  o.gu_b = TileGu::make_tma_b(gate_up, 2 * I, H, groups);
  o.dh_a = TileKK::make_tma_a(dy_rows, rows, H);
  o.dh_b = TileKK::make_tma_b(down, I, H, groups);
  o.dx_a = TileKK::make_tma_a(dgu, rows, 2 * I);
  o.dx_b = TileKK::make_tma_b(gate_up, H, 2 * I, groups);
  o.wd_a = TileW::make_tma_a(hw, I, rows);
  o.wd_b = TileW::make_tma_b(dy_rows, H, rows, 1);
  o.wg_a = TileW::make_tma_a(x_rows, H, rows);
  o.wg_b = TileW::make_tma_b(dgu, 2 * I, rows, 1);
  o.dh_gu = gemm::make_tma_gu(gu, rows, I);
  return o;
}

struct KernelParams {  // one EP rank's
  Operands routed;
  const uint4* x;
  const uint4* dy;
  const float* topk_weight;
  const int32_t* pos;
  const int32_t* src_slot;
  const int32_t* group_sizes;
  uint4* x_e;
  uint4* dy_e;
  float* w_e;
  __nv_bfloat16* gu;  // the recompute's scratch, or the kept g | u (bf16 [M, 2I])
  int32_t kept;       // g, u kept: no GU items; GATHER zeroes gu's padding rows
  const __nv_bfloat16* gu_part;  // part of them kept: the kept rows, each row's row of them, the blocks they cover
  const int32_t* gu_part_row;  // (nullptr: none)
  const int32_t* gu_block;
  int32_t gu_part_rows, gu_blocks;
  gemm::SwigluBackwardOut bwd;
  Bf16* dx_e;
  float* dw_e;
  float* dx;
  float* dw;
  Bf16* d_gate_up;
  Bf16* d_down;
  int32_t* status;
  int32_t* counters;
  gemm::SwigluBackwardOut sbwd;  // the shared expert's epilogue: weight 1, no dw partials
  __nv_bfloat16* gus;
  float* dxs;
  Bf16* d_shared_gate_up;
  Bf16* d_shared_down;
  int32_t T, k, M, H, I, E;
  int32_t Is, Ts;  // the shared expert's I and rows (T, or 0 without one)
  uint64_t local_timeout_ns;  // bound of a wait for an item of the same rank
  // Expert parallel (ep > 1): the workspace, this rank's own ids, the slot numbering's tokens (ep T; T at EP 1)
  comm::CommView view;
  const int32_t* topk_idx;
  int32_t ep, experts_all, share_items, Tn;
};

struct LaunchParams {
  Operands shared;  // the shared expert's (EP 1 only), set when it has rows
  int32_t num_ranks, skip_rank;  // skip_rank: read by the lab form only (experts_backward_kernel<true>)
  KernelParams ranks[kExpertsBackwardParamRanks];
};
static_assert(sizeof(LaunchParams) <= 32764, "kernel parameters (CUDA 12.1+ limit)");
static_assert(sizeof(KernelParams) % 64 == 0 && alignof(KernelParams) >= 64, "16-byte copies; 64-byte aligned tensormaps");

// The launch of an emulated call of more than kExpertsBackwardParamRanks ranks (experts_backward_kernel_many): each
// rank's KernelParams live in device memory, in its row of the counters scratch (experts_backward_ep_counter_words),
// where upload_rank_params stored them before the launch. Such a call is expert parallel: no shared expert in the op.
struct ManyLaunchParams {
  Operands shared;  // unused (zeros): the run's code is LaunchParams'
  int32_t num_ranks, skip_rank;
  const uint8_t* rank_params;  // rank 0's KernelParams, 64-byte aligned
  int64_t rank_stride;         // bytes from one rank's KernelParams to the next's
};

__device__ __forceinline__ const KernelParams& rank_params(const LaunchParams& P, int r) { return P.ranks[r]; }
__device__ __forceinline__ const KernelParams& rank_params(const ManyLaunchParams& P, int r) {
  return *reinterpret_cast<const KernelParams*>(P.rank_params + int64_t(r) * P.rank_stride);
}

// The launch that stores the KernelParams of an experts_backward_kernel_many launch: up to kUploadRanks of them in
// its own parameter space (by value, so a CUDA graph that records the call holds them), stored with the generic proxy
// and released to the tensormap proxy (the kernel's warp 0 acquires each descriptor before it uses it).
constexpr int kUploadRanks = int(30000 / sizeof(KernelParams));
using RankUpload = ParamUpload<KernelParams, kUploadRanks>;  // mok/common.cuh
static_assert(kUploadRanks >= 1 && sizeof(RankUpload) <= 32764, "kernel parameters (CUDA 12.1+ limit)");

}  // namespace
}  // namespace mok
