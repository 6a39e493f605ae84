// mok comm: expert-parallel combine over the symmetric workspace (push or pull).
//
//   partial(o, s, t) = bf16( sum_{j: row_table[s][t][j] >= 0, ascending j}  row_weight[s][t][j] *
//                            expert_out[row_table[s][t][j]] )          on owner o, fp32 inside
//   y_t (on origin s) = bf16( sum_{owners o of any of t's experts, ascending o} partial(o, s, t) )
//
// One row per (token, owner rank) crosses NVLink. Owners that hold none of t's experts send
// nothing and are skipped in the sum (adding their +0 partial would not change any bit).
//
// Kernels of one call, in stream order (epoch e = completed combines + 1):
//   send    waits ack_comb >= (e-1) from every peer (the previous call's partials were consumed),
//           computes partial(me, s, t) for every (s, t) with local slots and stores it
//             push: into origin s's combine_rows[me][t]      pull: into my own combine_rows[s][t]
//           then signals sig_comb on every peer.
//   reduce  waits sig_comb >= e from every peer, then for each of my tokens sums the partials of its
//           owner ranks in rank order (push: my combine_rows[o][t]; pull: peer o's combine_rows[me][t]), writes y,
//           acks ack_comb to every peer; the last block advances the epoch and writes status.
#pragma once

#include <cuda_bf16.h>

#include "mok/comm/dispatch.cuh"
#include "mok/comm/workspace.cuh"

namespace mok::comm {

struct CombineParams {
  CommView view;
  CommMode mode;
  int32_t num_tokens;  // T
  int32_t top_k;       // k
  int32_t capacity;    // rows of expert_out
  int32_t num_blocks;
  const __nv_bfloat16* expert_out;  // [capacity][H], rows as dispatch produced them
  const int32_t* row_table;         // [ep][T][k] from dispatch
  const float* row_weight;          // [ep][T][k] from dispatch
  const int32_t* topk_idx;          // [T][k] this rank's own routing (which owners hold each token)
  __nv_bfloat16* y;                 // [T][H]
  int32_t* status;                  // [4]
};

cudaError_t launch_combine(const CombineParams& params, cudaStream_t stream);
cudaError_t preload_combine_kernels();  // on the current device

}  // namespace mok::comm
