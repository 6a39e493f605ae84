// mok moe: the forward megakernel's types and constants. The CTA's threads and its setmaxnreg budget, the work
// ring's slots, the row movers' vectors in flight (kCopyUnroll etc.), the routed GEMMs' TMA descriptors of each form
// (RoutedTma), the parameters of one EP rank (RankParams) and of the launch (Params), a decoded work item (Item) and
// the CTA's shared memory (SharedStorage).
// Included by forward_kernel.cuh only (directly and through its other pieces).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/comm/workspace.cuh"
#include "mok/work_queue.cuh"
#include "mok/common.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

using Tile = gemm::Sm90Tile;
using Fp8Tile = gemm::Sm90Fp8Tile;
using comm::CommView;

constexpr int kThreads = 128 + Tile::kConsumerThreads;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// setmaxnreg moves registers between the warpgroups of a CTA; the CTA keeps what the launch gave it
// (65536 / 384 threads, rounded down to 8: 168 each). A consumer increase that the producer's decrease does
// not pay for never completes: the kernel would hang at its first instruction.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
static_assert(kProducerRegs * 128 + kConsumerRegs * Tile::kConsumerThreads <= kLaunchRegs * kThreads,
              "setmaxnreg budget of the CTA");
constexpr int kWorkSlots = 2;
constexpr int kGroupM = 16;          // raster band of m-blocks inside an expert (as the grouped FFN)
constexpr int kCopyUnroll = 8;       // 16-byte vectors per lane in flight when copying a row
// ... in the FP8 form. Its tiles hold 192 accumulator registers per consumer thread (the bf16 tile's 128), and the
// copy's vectors, though in another item, cost them registers in ptxas's allocation of the one consumer loop: with
// 8, the promotions' totals were spilled, 103 local loads and stores per 128-long K block and thread (SASS of the
// K loop); with 2, 23. With the consumer's item also read in its slot (consumer()): 88 with 8, 40 with 4, and 2 with
// 2 (both loads of loop invariants). The FP8 form copies only remote rows (EP > 1), of half the bf16 bytes.
constexpr int kCopyUnrollFp8 = 2;
constexpr int kQuantUnroll = 4;      // ... when quantising a row to FP8
constexpr int kSendUnroll = 2;       // ... when SEND copies a slot's row to its origin (both forms)
constexpr int kSendGroup = 2;        // rows whose loads are in flight together there
constexpr int kSendPrefetch = 1;     // passes (32 kSendUnroll vectors a row) its L2 prefetch runs ahead
constexpr int kReduceUnroll = 2;     // vectors per lane and row in flight in the origin's final sum
constexpr int kReduceGroup = 2;      // rows whose loads are in flight together there
constexpr int kReducePrefetch = 1;   // passes (32 kReduceUnroll vectors a row) its L2 prefetch runs ahead
constexpr uint32_t kConsumerBarrier = 3;  // named barrier of the 256 consumer threads (1, 2: epilogues)

// The routed GEMMs' TMA descriptors of one form of the kernel (a union: the parameter space holds 8 ranks).
struct Bf16RoutedTma {
  Tile::TmaA a_gu;    // received rows, [S * slot_rows, H]
  Tile::TmaA a_dn;    // h of the received rows, [S * slot_rows, I]
  Tile::TmaB b_gu;    // gate_up, L x [H, 2I]
  Tile::TmaB b_dn;    // down, L x [I, H]
};
struct Fp8RoutedTma {
  Fp8Tile::TmaA a_gu;      // x_q of the received rows, [S * slot_rows, H], row stride 2H (the ring's rows)
  Fp8Tile::TmaA a_dn;      // h_q, [S * slot_rows, I]
  Fp8Tile::TmaB b_gu;      // gate_up, L x [2I, H] (K-major)
  Fp8Tile::TmaB b_dn;      // down, L x [H, I] (K-major)
};
union RoutedTma {
  Bf16RoutedTma bf16;  // forward_kernel<false, *> (production and lab forms)
  Fp8RoutedTma fp8;    // forward_kernel<true, false>
  RoutedTma() {}
};

struct RankParams {
  RoutedTma routed;
  Tile::TmaA a_sgu;   // x, [T, H]
  Tile::TmaA a_sdn;   // shared h, [T, Is]
  Tile::TmaB b_sgu;   // shared gate_up, 1 x [H, 2Is]
  Tile::TmaB b_sdn;   // shared down, 1 x [Is, H]
  CommView view;
  const int4* x;
  const int32_t* topk_idx;
  const float* topk_weight;
  int4* y;
  int32_t* status;
  __nv_bfloat16* recv;   // [S][slot_rows][H]: dispatched rows, then (in place) the down projection's rows
  __nv_bfloat16* h;      // [S][slot_rows][I]
  __nv_bfloat16* shared_h;  // [T][Is]
  float* shared_out;     // [T][H]
  int32_t* sync;         // Plan::sync_words
  int32_t* row_slot;        // [M][slot_rows]: the slot (s T + t) k + j of each ring row (written with keep only)
  const int32_t* keep_pos;  // ForwardRank::keep_pos (nullptr: nothing kept)
  __nv_bfloat16* keep_gu;   // [keep_rows][2I]
  int32_t keep_rows;
  __nv_bfloat16* keep_shared_gu;  // ForwardRank::keep_shared_gu: [T][2Is] (nullptr: not kept)
  // FP8 routed experts (Plan::fp8; then h holds E4M3 values)
  const float* b_gu_scale;  // [L][2I/128][H/128]
  const float* b_dn_scale;  // [L][H/128][I/128]
  float* recv_scale;        // [H/128][scale_ld]: the scales of the received rows, k-block major (Fp8Tile::kScaleTail
  float* h_scale;           // [I/128][scale_ld]         floats of slack past each: the producer's bulk copies)
};

// A launch of at most kMaxVirtualRanks ranks (every call of the layer: one rank; an emulated group of up to 8), the
// kernel forward_kernel: every rank's RankParams in the kernel parameter space.
struct Params {
  Plan plan;
  int32_t num_ranks;
  int32_t skip_rank;      // read by the lab form only (run)
  int32_t dispatch_push;
  RankParams ranks[kMaxVirtualRanks];
};
static_assert(sizeof(Params) <= 32764, "kernel parameters (CUDA 12.1+ limit)");

// A launch of more ranks (an emulated group of 9 to kMaxEmulatedRanks), the kernel forward_kernel_many: the parameter
// space would hold 13 RankParams at most, so each rank's lives in its own scratch (ScratchLayout::rank_params), rank
// r's at rank_params + r * rank_stride, written before the launch on the call's stream by upload_rank_params. Its
// first members are Params's: the kernel's roles take either (their LaunchParams), so that forward_kernel's code is
// what it was before this form existed.
struct ManyParams {
  Plan plan;
  int32_t num_ranks;
  int32_t skip_rank;
  int32_t dispatch_push;
  const uint8_t* rank_params;  // rank 0's RankParams in device global memory, 64-byte aligned (its TMA descriptors)
  int64_t rank_stride;         // bytes from one rank's RankParams to the next's (the scratch of one rank)
};

// Every RankParams the kernel reads comes through here (run): the parameter space's, or the device copy.
__device__ __forceinline__ const RankParams& rank_params(const Params& P, int r) { return P.ranks[r]; }
__device__ __forceinline__ const RankParams& rank_params(const ManyParams& P, int r) {
  return *reinterpret_cast<const RankParams*>(P.rank_params + int64_t(r) * P.rank_stride);
}

// The launch that writes the RankParams of a forward_kernel_many launch: up to kUploadRanks of them travel in its own
// parameter space (by value, so a CUDA graph that records the call holds them: a copy from host memory would be
// read again, from a freed buffer, at every replay), and it stores them with the generic proxy, then releases them to
// the tensormap proxy (the forward kernel acquires each descriptor before it uses it: acquire_descriptors).
constexpr int kUploadRanks = 12;
using RankUpload = ParamUpload<RankParams, kUploadRanks>;  // mok/common.cuh
static_assert(sizeof(RankUpload) <= 32764, "kernel parameters (CUDA 12.1+ limit)");
static_assert(sizeof(RankParams) % 16 == 0 && alignof(RankParams) >= 64, "16-byte copies; 64-byte aligned tensormaps");

// The kernel's forms, forward_kernel<kFp8, kLab> (ffi/src/moe_forward.cu): kLab, the lab form (bf16 only), is the
// one launched when a call sets a mode that is not for users: Params::skip_rank (a fault-injection test: an emulated
// rank makes no call) or Plan::timing_mode (bench only: TimingMode bits). The production form (kLab false, every
// other call) carries no code for them: its timing bits are the constant 0 and it has no skip_rank check, so the
// mode checks fold away at compile time. identity_experts, the third test mode, has no device code (make_plan gives
// it no GEMM tiles and no shared expert), so it runs on either form.
template <bool kLab>
__device__ __forceinline__ int32_t timing_bits(const Plan& p) {
  if constexpr (kLab) {
    return p.timing_mode;
  } else {
    return 0;
  }
}

struct Item {
  int32_t kind, mb, idx, count;            // communication items: idx of count in the phase
  int32_t group, row0, row_end, n_block;   // GEMM tiles: matrix, rows [row0, row_end) of A/out, column block
  int32_t mblock;                          // GEMM tiles: the m-block counter this tile adds to
  int32_t skip;                            // a dependency failed (poisoned workspace): do nothing
};

struct SharedStorage {
  Tile::Stages stages;
  gemm::Fp8StageScales scales;  // the FP8 tiles' scales of each stage (unused by the bf16 form)
  alignas(16) uint32_t epi[Tile::kConsumerWarpgroups][Tile::kEpiWords];
  WorkQueue<Item, kWorkSlots> work;  // decoded items from the producer to the consumers
  int32_t scan_warp[kWorkerWarps];
  int32_t last_cta;  // finish_call: this CTA is the rank's last to finish
};
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

__device__ __forceinline__ bool is_tile(int kind) {
  return kind == kSharedGu || kind == kSharedDn || kind == kGu || kind == kDn;
}

}  // namespace mok::moe
