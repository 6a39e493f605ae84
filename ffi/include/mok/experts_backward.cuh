// mok expert backward (bf16, Hopper sm_90a): the gradients of the routed SwiGLU experts of one rank's tokens,
// the routed half of the layer's backward pass at EP 1.
//
// The slots go to padded expert-major rows (mok_jax/expert_layout.py): expert e owns rows
// [start_e, start_e + group_sizes[e]), start = exclusive prefix sum (read on device), every group size a
// multiple of 128; row r holds slot s = src_slot[r] (-1: a padding row) and slot (t, j) sits at row
// pos[t, j] (outside [0, M): a masked slot). Per row r of expert e, token t = s / k, fp32 accumulation:
//   x_e[r], dy_e[r], w_e[r] = x[t], dy[t], topk_weight[t, j]           gathered; zeros for padding rows
//   g, u     = bf16(x_e[r] @ gate_up[e])                    fp32 accumulation, stored in bf16: recomputed, or the
//                                                             forward's kept copy (gu_in), rounded the same way
//   dh'      = dy_e[r] @ down[e]^T
//   dw_e[r]  = <dh', silu(g) * u>                           = <dy_t, expert_e(x_t)>: the router-weight gradient
//   dgu[r]   = bf16(SwiGLU backward of w_e[r] * dh')        (mok/gemm/swiglu_backward.cuh)
//   dx_e[r]  = bf16(dgu[r] @ gate_up[e]^T)
//   d_down[e]    = bf16(sum_r bf16(w_r h_r)^T dy_r)          [I, H]
//   d_gate_up[e] = bf16(sum_r x_r^T dgu_r)                   [H, 2I]; exact zeros for an empty expert
// and per token: dx[t] = sum_{j = 0..k-1} dx_e[pos[t, j]] in fp32 in slot order, dw[t, j] = dw_e[pos[t, j]]
// (0 for a masked slot).
//
// With a shared expert (shared_gate_up [H, 2Is], shared_down [Is, H]; Is = 0: none) the same items run its
// backward over the T tokens' own rows (x and dy, no gather; its weight is 1): gus = bf16(x @ shared_gate_up),
// dh' = dy @ shared_down^T, dgus = bf16(SwiGLU backward of dh'), hws = bf16(h), dxs = dgus @ shared_gate_up^T in
// fp32, d_shared_down = bf16(hws^T dy), d_shared_gate_up = bf16(x^T dgus) (K = T), and the slot sum adds dxs[t]
// after the slots: dx[t] = (sum_j dx_e[pos[t, j]]) + dxs[t], in fp32.
//
// One persistent launch (num_sms CTAs, one per SM, 384 threads: a TMA producer thread and two consumer
// warpgroups, as the forward megakernel). The CTAs take the items of one list by ticket (an atomic counter, in
// list order: a CTA that runs fast takes more); an item waits (bounded) only for items earlier in the list,
// through dependency counters in the scratch `counters` (zeroed by the launcher), so the phases overlap without a
// grid barrier:
//   SHARE(i)       expert parallel only: a share of this rank's x and dy rows into its workspace's bwd_x, bwd_dy
//                  (comm_items of them, then one that stamps kBwdSigX in every peer when they are done)
//                                                                    after every peer's previous call (kBwdDone)
//   GATHER(m)      x_e, dy_e, w_e of m-block m (128 rows); one warp per row, 16-byte copies
//                  (expert parallel: a remote token's rows from its rank's bwd_x, bwd_dy)  after kBwdSigX
//   GU(m, n)       gu = x_e @ gate_up, bf16 out                      after GATHER(m); none when g, u are kept
//                  (a no-op in a block of part-kept g, u: its GATHER copied them)
//   DH(m, n)       dh' = dy_e @ down^T, K-major B, SwiGLU backward epilogue -> dgu, hw, dw partials
//                                                                    after GATHER(m) and every GU(m, .)
//   DX(m, n)       dx_e = dgu @ gate_up^T, K-major B, bf16 out       after every DH(m, .)
//   DWSUM(m)       dw_e = sum of the partials, ascending n-blocks    after every DH(m, .)
//   SEND(m)        expert parallel only: each slot row's dx_e and dw_e into its token's rank's bwd_dx, bwd_dw
//                  at (t, j) (then one item that stamps kBwdSigDx in every peer when all are sent)
//                                                                    after DX(m, .), DWSUM(m), kBwdDone
//   WDOWN(e, ..)   d_down[e] = hw^T dy_e, K = expert e's rows        after every GATHER and DH of expert e
//   WGATEUP(e, ..) d_gate_up[e] = x_e^T dgu                          after the same
//   SLOT(i)        8 tokens, one per warp: dx, dw (the slot sum)     after every DX and DWSUM
//                  (expert parallel: of bwd_dx, bwd_dw, for the slots with an owner)     after kBwdSigDx
// The shared expert's tiles come first within GU, DH, DX, WDOWN and WGATEUP (its GU tiles wait for nothing, so
// CTAs take them while the gathers finish); they wait for the shared expert's earlier tiles as the routed ones do.
// (GEMM tiles: 128 x 256 over 128B-swizzled TMA stages, mok/gemm/sm90_tile.cuh; the weight-gradient tiles
// as sm90_weight_grad.cuh; band rasterisation as the grouped GEMM.) The producer waits for a tile's inputs
// before its TMA loads; the consumers publish an item with a release after its stores. No wait can close
// a cycle (each points to an earlier item, and tickets are claimed in list order), and every wait is
// bounded: a timeout sets gemm::kStatusWaitTimeout and the kernel stops early. Only items wait for items, and
// tickets go to CTAs that run, so the kernel needs no CTA to be resident with another (as the forward).
// Every output element is reduced by one thread or CTA in a fixed order: bitwise reproducible, and the same
// for any num_sms. No float atomics. Out-of-range pos or src_slot values read nothing out of bounds.
//
// Kept g, u (gu_kept): bf16 [M, 2I] in this row layout, row r = bf16(x_e[r] @ gate_up[e]) of the forward's fp32
// accumulators; rows that hold no slot may hold anything: GATHER zeroes the padding rows inside the groups
// (what the recompute gives them), and rows past the groups are never read. The outputs are then the bits the
// op gives when its own recompute equals the kept rows: DH reads the same values, nothing else changes.
//
// Part of them kept (gu_part, MoEConfig(keep="ring" | "balanced")): gu_part bf16 [R, 2I] holds some rows' g | u, row
// r's at gu_part_row[r] (outside [0, R): none), and gu_block[m] (s32 [ceil(M / 128)]) is 1 when every slot row of
// m-block m has one. Such a block's GATHER also copies its rows' g | u from gu_part into gu (zeros for a row
// without one: a padding row) and its GU items run no GEMM; every other block is recomputed, all its rows. So
// again the outputs are the bits of the recompute when gu_part equals it on those rows.
//
// Expert parallel (EP size P > 1, view set): the slots of every rank's tokens are laid out as at EP 1 over P T
// tokens in rank order (src_slot, topk_weight), restricted to this rank's experts, so every row, every slot's
// dx row and dw and every weight gradient are the bits of EP size 1; the rows cross NVLink in SHARE/GATHER and
// SEND, and each rank sums its own tokens' k slot rows in slot order, as at EP 1. Its workspace signals are
// epoch stamps (bwd_stamps, mok/comm/workspace.cuh): a rank shares its rows only after every peer finished its
// previous call (kBwdDone, stamped by the rank's last CTA to exit), so no row is overwritten while a peer reads it. Every
// cross-rank wait is bounded by the workspace's timeout and stops on its poison word; a failed wait poisons the
// workspace and sets kExpertsBackwardStatusComm | kStatusWaitTimeout, and the kernel stops early. Two limits:
// the waits inside a rank for an earlier item are bounded by max(10 s, 4 x the workspace's timeout) at EP > 1 (so
// that a late peer is named by the peer wait first), but the TMA stage ring's waits keep their own 10 s bound, so
// a peer more than 10 s late can fail the call (with kStatusWaitTimeout alone) under a longer workspace timeout;
// and an owner whose group sizes are bad sends no rows, so its peers' slot sums then read their buffers' previous
// contents: check every rank's status (the layer ORs them over the axis and gives NaN gradients).
//
// status (written every call: zeroed by the launcher, bits or-ed in): 0, or kGroupedFfnStatus* bits (bad
// sizes: every group is then empty, dx and dw are zero and the weight gradients NaN) |
// kExpertsBackwardStatusUnpadded (a size not a multiple of 128: the weight gradients are NaN) |
// gemm::kStatusWaitTimeout | kExpertsBackwardStatusComm. The layer never makes such sizes; NaN keeps a bug from
// passing for a gradient without a pass over the weight gradients to say so.
#pragma once

#include "mok/comm/workspace.cuh"
#include "mok/common.cuh"

namespace mok {

constexpr int32_t kExpertsBackwardStatusUnpadded = 4;
constexpr int32_t kExpertsBackwardStatusComm = 8;  // expert parallel: a wait for a peer failed (workspace poisoned)
constexpr int kExpertsBackwardParamRanks = 8;   // ranks whose kernel parameters one launch's parameter space holds
constexpr int kExpertsBackwardMaxRanks = 64;    // ranks one emulated call carries (above 8: see ..._ep_counter_words)
constexpr int kExpertsBackwardRowBlock = 128;  // group sizes are multiples of this

struct ExpertsBackwardParams {
  const void* x;               // bf16 [T, H]
  const void* dy;              // bf16 [T, H]
  const float* topk_weight;    // f32 [T, k]
  const int32_t* pos;          // s32 [T, k]: the row of each slot
  const int32_t* src_slot;     // s32 [M]: the slot of each row, -1 for padding
  const int32_t* group_sizes;  // s32 [E], device
  const void* gate_up;         // bf16 [E, H, 2I]
  const void* down;            // bf16 [E, I, H]
  void* gu_kept;               // bf16 [M, 2I]: the forward's kept g | u (== gu), or nullptr (GU recomputes)
  const void* gu_part;         // bf16 [gu_part_rows, 2I]: some rows' kept g | u, or nullptr (not with gu_kept)
  const int32_t* gu_part_row;  // s32 [M]: row r's row of gu_part (outside [0, gu_part_rows): none)
  const int32_t* gu_block;     // s32 [ceil(M / 128)]: 1 = every slot row of the m-block is in gu_part
  int64_t gu_part_rows;
  float* dx;                   // f32 [T, H]
  float* dw;                   // f32 [T, k]
  void* d_gate_up;             // bf16 [E, H, 2I]
  void* d_down;                // bf16 [E, I, H]
  int32_t* status;             // s32 [1]
  void* x_e;                   // scratch bf16 [M, H]
  void* dy_e;                  // scratch bf16 [M, H]
  float* w_e;                  // scratch f32 [M]
  void* gu;                    // scratch bf16 [M, 2I]: the recompute, or the kept g | u
  void* dgu;                   // scratch bf16 [M, 2I]
  void* hw;                    // scratch bf16 [M, I]
  float* dw_part;              // scratch f32 [M, ceil(I / 256)]
  void* dx_e;                  // scratch bf16 [M, H]
  float* dw_e;                 // scratch f32 [M]
  int32_t* counters;              // scratch s32 [experts_backward_counter_words(M, E, Ts)]: dependency counters
  const void* shared_gate_up;  // bf16 [H, 2Is], or nullptr with Is = 0 (no shared expert)
  const void* shared_down;     // bf16 [Is, H]
  void* d_shared_gate_up;      // bf16 [H, 2Is]
  void* d_shared_down;         // bf16 [Is, H]
  void* gus;                   // scratch bf16 [T, 2Is]: the shared expert's g | u
  void* dgus;                  // scratch bf16 [T, 2Is]
  void* hws;                   // scratch bf16 [T, Is]
  float* dxs;                  // scratch f32 [T, H]: the shared expert's dx
  int64_t num_tokens, top_k, num_rows, hidden, intermediate, num_experts;
  int64_t shared_intermediate;  // Is; 0: no shared expert
  int32_t num_sms;             // 0 = every SM
  // Expert parallel (the fused EP backward; view.base == nullptr: none). x, dy, dx, dw are then this rank's own
  // T tokens'; topk_weight [slot_tokens, k] and src_slot number the slots of every rank's tokens (slot_tokens
  // = ep T, rank-major); pos is not read. No shared expert (it runs in XLA at EP > 1).
  comm::CommView view;
  const int32_t* topk_idx;     // s32 [T, k]: this rank's own ids (its slot sum adds the slots with an owner)
  int64_t slot_tokens;         // T at EP 1
  int32_t comm_items;          // items the sharing of x and dy is split into (>= 1)
};

// Columns of I per dgrad tile (the n-blocks of dw_part).
constexpr int kExpertsBackwardColBlock = 256;

// Kinds of work item (SHARE .. SLOT above), and the words of the kernel's scratch `counters`: first each kind's
// device time, three u64 per kind summed over the CTAs (the consumers' ns per item, the ns the producer and the
// consumers waited for inputs, and of a GEMM tile's ns the part after its last MMA: its epilogue; integer sums,
// read by mok_jax.bench.backward), then the dependency counters:
// four per m-block (at most ceil(M / 128) + E routed m-blocks, then ceil(Ts / 128) of the shared expert's Ts
// rows: T with a shared expert, else 0), two per expert and two for the shared expert, and five totals (the
// third one counts the tickets), rounded up to a multiple of 4 words: the ranks of an emulated call lie back to
// back, and each one's u64 time words must stay 8-byte aligned. mok_jax/ops/moe_backward.py sizes the scratch
// with the same formula.
constexpr int kExpertsBackwardKinds = 10;
constexpr int64_t kExpertsBackwardTimeWords = 6 * kExpertsBackwardKinds;
constexpr int64_t experts_backward_counter_words(int64_t rows, int64_t experts, int64_t shared_rows) {
  return (kExpertsBackwardTimeWords +
          4 * ((rows + kExpertsBackwardRowBlock - 1) / kExpertsBackwardRowBlock + experts +
               (shared_rows + kExpertsBackwardRowBlock - 1) / kExpertsBackwardRowBlock) +
          2 * (experts + 1) + 5 + 3) / 4 * 4;
}

// One rank's counters scratch in a call of `ranks` ranks (the expert-parallel op; 1, or every rank of an emulated
// group), in words: experts_backward_counter_words(rows, experts, 0), and in an emulated call of more than
// kExpertsBackwardParamRanks ranks, from the next multiple of 16 words, the rank's kernel parameters (the launch
// reads them there: experts_backward.cu, experts_backward_kernel_many; their TMA descriptors need 64 bytes of
// alignment, so such a row is a multiple of 16 words too). mok_jax/ops/moe_backward.py asks the library for it.
int64_t experts_backward_ep_counter_words(int64_t rows, int64_t experts, int64_t ranks);

// The backward kernel's item list as its CTAs decode it, on the host (no GPU; for tests of its order): E routed
// experts of group_sizes over rows M, H, I, the shared expert's Is and rows Ts (0: none), ep, kept g | u (no GU
// items) and share_items (ep > 1). Writes up to `capacity` items of kExpertsBackwardItemWords int32 each (kind,
// shared, group, mb, m_block, n_block, row0, row_end) and returns the list's length; -1 for E outside [0, 1024].
constexpr int kExpertsBackwardItemWords = 8;
int32_t experts_backward_item_list(const int32_t* group_sizes, int32_t E, int32_t M, int32_t H, int32_t I, int32_t Is,
                                   int32_t Ts, int32_t ep, int32_t kept, int32_t share_items, int32_t* out,
                                   int32_t capacity);

const char* experts_backward_unsupported(const ExpertsBackwardParams& params);
cudaError_t launch_experts_backward(const ExpertsBackwardParams& params, cudaStream_t stream);
// One launch for num_ranks EP ranks (1, or all ep of an emulated group on one device: CTA b serves rank
// b % num_ranks); skip_rank (test mode, -1: none) is an emulated rank that makes no call: a call with one runs the
// kernel's lab form, the only one with that check (experts_backward.cu).
cudaError_t launch_experts_backward_ranks(const ExpertsBackwardParams* ranks, int num_ranks, int skip_rank,
                                          cudaStream_t stream);

}  // namespace mok
