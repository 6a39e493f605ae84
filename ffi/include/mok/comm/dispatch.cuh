// mok comm: expert-parallel dispatch over the symmetric workspace (pull or push).
//
//   recv_x[row(s, t, j)] = x_t of rank s      for every slot j of token t of every source rank s whose
//                                             expert topk_idx[s][t][j] is local to this rank
//   rows are expert-major (expert, source rank, token, slot) as in schedule.cuh; rows past the total
//   are zeroed when zero_padding is set; group_sizes, row_table, row_weight and row_source come from
//   the schedule.
// token_major (opt-in, for a grouped GEMM that gathers its rows): recv_x is [ep * T][H] and row
//   s * T + t holds x_t of rank s once, whatever its number of local slots (zeros if it has none and
//   zero_padding); expert-major row i is recv_x[row_source[i]]. This writes 1/(local slots per token)
//   of the expert-major bytes.
//
// A token row crosses NVLink at most once per destination rank: the owner loads it once and writes
// it to each of its local experts' rows from registers (rows.cuh).
//
// Kernels of one call, in stream order (epoch e = completed dispatches + 1, read from LocalState):
//   post   waits ack_disp >= (e-1) from every peer (they finished reading what I published last time),
//          writes my routing into every rank's route_idx/route_w[my rank], signals sig_route; then
//            pull: copies the rows some peer needs into my own dispatch_rows[my rank]
//            push: writes each such row into dispatch_rows[my rank] of every peer that needs it
//          and signals sig_x.
//   schedule (schedule.cuh; waits sig_route >= e from every peer)
//   data   waits sig_x >= e from every peer, then for every (s, t) with local slots loads the row
//          (s == me: from x; pull: from peer s's dispatch_rows[s]; push: from my dispatch_rows[s]) and stores it to
//          its rows; zeroes the padding rows; acks ack_disp to every peer; the last block advances the
//          epoch and writes status (int32[4]: error code, op, rank that detected it, awaited peer).
// Grid: num_blocks blocks of kCommThreads threads for post and data (the communication SM count).
#pragma once

#include <cuda_bf16.h>

#include "mok/comm/workspace.cuh"

namespace mok::comm {

constexpr int kCommThreads = 512;
constexpr int kCommWarps = kCommThreads / 32;

enum class CommMode : int32_t { kPull = 0, kPush = 1 };

struct DispatchParams {
  CommView view;
  CommMode mode;
  int32_t num_tokens;  // T, equal on every rank, <= shape.max_tokens
  int32_t top_k;       // k of this call, <= shape.top_k
  int32_t capacity;    // rows of recv_x
  int32_t num_blocks;  // communication blocks (the op's num_sms)
  bool zero_padding;
  bool token_major;
  const __nv_bfloat16* x;     // [T][H]
  const int32_t* topk_idx;    // [T][k] global expert ids
  const float* topk_weight;   // [T][k]
  __nv_bfloat16* recv_x;      // [capacity][H], or [ep * T][H] when token_major
  int32_t* group_sizes;       // [L]
  int32_t* row_table;         // [ep][T][k]
  float* row_weight;          // [ep][T][k]
  int32_t* row_source;        // [capacity]
  int32_t* status;            // [4]
};

cudaError_t launch_dispatch(const DispatchParams& params, cudaStream_t stream);
cudaError_t preload_dispatch_kernels();  // on the current device

}  // namespace mok::comm
