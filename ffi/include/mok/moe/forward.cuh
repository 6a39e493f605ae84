// mok moe: the forward megakernel's host interface (no JAX and no CuTe in here).
//
//   y_t = bf16( sum_{owner ranks o of t's experts, ascending}  partial_o(t)  +  shared(x_t) )
//   partial_o(t) = bf16( sum_{slots j of t whose expert is on o, ascending j}  w_tj * expert_j(x_t) )
//   expert_e(x) = bf16( bf16( silu(x W_gate[e]) * (x W_up[e]) ) W_down[e] )     fp32 accumulation
//
// One persistent kernel per call runs the whole data path of every EP rank it was given: the routing
// exchange, the device-side schedule, dispatch, the shared expert, the routed gate/up GEMM with SwiGLU,
// the down GEMM, combine and the final sum (mok/moe/forward_kernel.cuh says how). A call normally carries
// one rank (the caller's, inside shard_map); an emulated call carries all `ep` ranks of one EP group on
// one device (docs/design.md, "EP on one GPU (emulation)"), each against its own workspace.
//
// Memory per rank: the workspace (symmetric: signals and stamps, routing, row buffers; mok/comm/workspace.cuh) and one
// scratch buffer that the caller allocates per call (forward_scratch_layout): the ring of `ring_slots`
// microbatch slots of received rows (the down GEMM's output overwrites them in place), the SwiGLU
// activations of those rows, the shared expert's activations and fp32 output, the call's schedule and
// counters, and at ep > kMaxVirtualRanks the rank's kernel parameters (an emulated launch of that many ranks reads
// them there). Nothing in it outlives the call.
//
// FP8 routed experts (ForwardShape::routed_fp8): the received rows arrive quantised, H E4M3 bytes at the start
// of each ring row (the down GEMM's bf16 output still overwrites the whole row), with their 1 x 128 scales in
// recv_scale; h is E4M3 with its scales in h_scale. What changes in the math: expert_e(x) is the FP8 pipeline
// of mok_jax.fp8.grouped_ffn_reference (x and h quantised in 1 x 128 tiles, block-scaled GEMMs promoted per
// 128-long K block), rounded to bf16 as above; the shared expert and the combine are unchanged.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "mok/comm/workspace.cuh"

namespace mok::moe {

// Ranks one launch carries: up to kMaxVirtualRanks with every rank's parameters in the kernel parameter space (every
// call of the layer: one rank), up to kMaxEmulatedRanks (an emulated group) with them in device memory, each in its
// own rank's scratch (mok/moe/forward_params.cuh, ManyParams). Every rank needs a CTA: at most the launch's CTAs.
constexpr int kMaxVirtualRanks = 8;
constexpr int kMaxEmulatedRanks = 64;
constexpr int kMaxLocalExperts = 1024; // experts per rank
constexpr int kMaxRingSlots = 8;

struct ForwardShape {
  int32_t tokens;         // T, per rank (equal on every rank)
  int32_t hidden;         // H, a multiple of 8
  int32_t inter;          // I, a multiple of 8
  int32_t shared_inter;   // Is (all shared experts fused), a multiple of 8; 0 = no shared expert
  int32_t top_k;          // k
  int32_t local_experts;  // L = E / ep
  int32_t ep;             // EP ranks of the group
  int32_t routed_fp8 = 0; // 1: routed experts in FP8 E4M3 with DeepSeek-V3 block scales (H, I multiples of 128)
};

// The first five are speed only: the outputs are bitwise the same for every value. The last three are modes that are
// not for users. identity_experts only shapes the plan (no GEMM tiles, no shared expert; bf16 only). skip_rank and
// timing_mode have code in the kernel's lab form only (forward_kernel<false, true>, bf16 only: FP8 with one of them
// is refused), which launch_forward launches when a call sets one of them (timing_mode != 0 or skip_rank >= 0);
// every other call runs a production form, compiled without their checks (mok/moe/forward_params.cuh, timing_bits).
struct ForwardKnobs {
  int32_t granularity;    // G: tokens per microbatch, a multiple of 64 in [512, 32768]
  int32_t comm_items;     // work items per communication phase (how many SMs move rows at once)
  int32_t ring_slots;     // S: microbatch slots of the receive ring
  int32_t dispatch_push;  // 0 pull (owners read the sources' posted rows), 1 push
  int32_t num_sms;        // persistent CTAs (0: every SM)
  int32_t identity_experts;  // test mode: every expert is the identity, the shared expert is skipped
  int32_t skip_rank;         // test mode (lab form): this emulated rank makes no call (-1: none)
  int32_t timing_mode;       // bench only (lab form): TimingMode bits (leaving rows out makes the outputs wrong)
};

// Timing variants that leave one phase's row moves out or do them twice (every stamp and counter still runs),
// so that a bench can take differences: what a phase costs the whole call beyond what the overlap hides.
// Leaving rows out also changes what the GEMMs read (stale ring rows, maybe zeros, which run faster), so
// the "twice" variants, whose outputs stay right, are the sound measure. Only the kernel's lab form (bf16) has
// their code: a bench's timings of them come from that form, whose code otherwise is the production bf16 form's.
enum TimingMode : int32_t {
  kTimingNoDispatchRows = 1,     // DISPATCH copies no rows into the ring
  kTimingNoSendRows = 2,         // SEND writes no partials (ep > 1)
  kTimingNoReduceRows = 4,       // REDUCE writes no y rows
  kTimingTwiceDispatchRows = 8,  // DISPATCH copies every row twice (the same bytes to the same place)
  kTimingTwiceReduceRows = 16,   // REDUCE computes and writes every y row twice
  kTimingItemTimes = 32,         // no change to the work: each CTA's consumers time their items (ItemTimes)
  kTimingSharedDownEarly = 64,   // the same work in another order: SHARED_DN's tiles in the static prefix (plan.cuh)
  kTimingSharedDownLate = 128,   // the same work in another order: SHARED_DN's tiles after GU(0)'s (plan.cuh)
};

struct ForwardRank {
  comm::CommView view;           // this rank's workspace (connected)
  const void* x;                 // bf16 [T][H]
  const int32_t* topk_idx;       // [T][k] global expert ids; -1 = masked slot
  const float* topk_weight;      // [T][k]
  const void* gate_up;           // bf16 [L][H][2I]; FP8: e4m3 [L][2I][H] (K-major, mok_jax.fp8.quantize_expert_weights)
  const void* down;              // bf16 [L][I][H]; FP8: e4m3 [L][H][I]
  const float* gate_up_scale;    // FP8 only: [L][2I/128][H/128], one scale per 128 x 128 block
  const float* down_scale;       // FP8 only: [L][H/128][I/128]
  const void* shared_gate_up;    // bf16 [H][2Is] (unused when Is == 0)
  const void* shared_down;       // bf16 [Is][H]
  void* y;                       // bf16 [T][H], fully written
  int32_t* status;               // int32[4]: {error code, op, rank that saw it, peer or token}; 0s when fine
  void* scratch;                 // forward_scratch_layout(...).total bytes, 256-byte aligned
  // Kept g, u for the backward (nullptr: none kept). keep_pos[(s T + t) k + j]: the row of slot (s, t, j) (source
  // rank s, its token t, slot j) in keep_gu, or any value outside [0, keep_rows) for none; keep_gu: bf16
  // [keep_rows][2I], the fp32 gate/up accumulators of every kept slot (g | u) rounded to bf16, as the backward's
  // recompute stores them; rows no slot names are not written (the backward op zeroes the padding rows it reads).
  const int32_t* keep_pos;       // [ep T k]
  void* keep_gu;
  int32_t keep_rows;
  // The shared expert's g, u for the backward (nullptr: none kept): bf16 [T][2Is], each token's fp32 gate/up
  // accumulators rounded to bf16 (g in columns [0, Is), u in [Is, 2Is)), as the routed experts' keep_gu.
  void* keep_shared_gu;
};

// Byte offsets inside one rank's scratch buffer, and the counts behind them.
struct ScratchLayout {
  int32_t microbatches;   // M = ceil(T / G)
  int32_t slots;          // min(S, M)
  int32_t slot_rows;      // rows of one ring slot: ep * min(G, T) * min(k, L) (the dropless worst case)
  size_t recv, h, shared_h, shared_out, row_slot, sync;
  size_t recv_scale, h_scale;  // FP8 only (else empty): the ring rows' and h's scales, [blocks][scale_ld] f32
  size_t rank_params;     // ep > kMaxVirtualRanks only (else empty): this rank's parameters in an emulated launch
  size_t sync_bytes;      // zeroed before every call
  size_t item_times;      // inside the sync region: the lab form's item times (kItemTimeWords in plan.cuh)
  size_t total;
};

// nullptr when the call is supported, else a sentence saying what is not.
const char* forward_unsupported(const ForwardShape& shape, const ForwardKnobs& knobs);

ScratchLayout forward_scratch_layout(const ForwardShape& shape, const ForwardKnobs& knobs);

// The kernel's work items of one rank in ticket order, decoded on the host with the kernel's own plan, segment
// writer and decoder, for the tests of its order. rows: int32[M][L], the rows each microbatch brings each local
// expert (M = ceil(T / G')); ctas: the rank's CTAs (launch_forward's grid / ranks: the ranks with the fewest).
// Writes up to `capacity` items of kForwardItemWords words to out (kind, mb, idx, count, group, row0, row_end,
// n_block, mblock: mok/moe/forward_params.cuh's Item) and returns how many there are; -1 for an unsupported call,
// -2 when SCAN's segments would pass the plan's bound (max_segments).
constexpr int kForwardItemWords = 9;
int32_t forward_item_list(const ForwardShape& shape, const ForwardKnobs& knobs, int32_t ctas, const int32_t* rows,
                          int32_t* out, int32_t capacity);

// Enqueue one call on `stream`: num_ranks == 1 (the caller's rank) or == shape.ep (an emulated group, at most
// kMaxEmulatedRanks; above kMaxVirtualRanks the ranks' scratch buffers one stride apart). No host synchronisation.
cudaError_t launch_forward(const ForwardShape& shape, const ForwardKnobs& knobs, const ForwardRank* ranks,
                           int num_ranks, cudaStream_t stream);

cudaError_t preload_forward_kernel();  // on the current device

}  // namespace mok::moe
