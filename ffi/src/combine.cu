// Kernels of mok/comm/combine.cuh. Buffer regions: mok/comm/workspace.cuh.
//
//   region                  size                           written by        read by
//   combine_rows[o][t] (push)       T rows of H bf16, on origin    owner o (send)    origin (reduce)
//   combine_rows[s][t] (pull)       T rows of H bf16, on owner     owner (send)      origin s (reduce)
//   sig_comb[o]             u64 on the origin              owner o           origin
//   ack_comb[s]             u64 on the owner               origin s          owner (next send)
#include <climits>

#include "mok/comm/combine.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/common.cuh"

namespace mok::comm {
namespace {

constexpr int kSumUnroll = 4;  // vectors per lane per slot in flight
constexpr int kSumGroup = 4;   // slots whose loads are in flight together (combine send)

__global__ void __launch_bounds__(kCommThreads) combine_send_kernel(CombineParams p) {
  const CommView& v = p.view;
  const uint64_t epoch = next_epoch(&v.state()->comb_epoch);
  if (!block_wait_peers(v, v.layout.ack_comb, (epoch - 1) * kSignalUnits, kErrTimeoutAck, kOpCombine, epoch)) return;
  const int ep = v.shape.ep, rank = v.rank, k = p.top_k;
  const int lane = threadIdx.x % 32;
  const int nvec = v.shape.hidden / 8;
  const int4* rows = reinterpret_cast<const int4*>(p.expert_out);
  const int warp_id = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int num_warps = gridDim.x * kCommWarps;
  const int items = ep * p.num_tokens;
  for (int item = warp_id; item < items; item += num_warps) {
    const int s = item % ep, t = item / ep;
    int row = -1;
    float w = 0.0f;
    if (lane < k) {
      const size_t slot = (size_t(s) * p.num_tokens + t) * k + lane;
      const int32_t r = p.row_table[slot];
      if (r >= 0 && r < p.capacity) {
        row = r;
        w = p.row_weight[slot];
      }
    }
    const uint32_t lanes = __ballot_sync(kFullMask, row >= 0);
    if (lanes == 0) continue;
    int4* dst = p.mode == CommMode::kPush
                    ? v.peer<int4>(s, v.layout.combine_rows) + (size_t(rank) * v.shape.max_tokens + t) * nvec
                    : v.local<int4>(v.layout.combine_rows) + (size_t(s) * v.shape.max_tokens + t) * nvec;
    warp_weighted_sum_row<kSumUnroll, kSumGroup>(rows, nvec, row, w, lanes, dst, lane);
  }
  block_signal_peers(v, v.layout.sig_comb);
}

__global__ void __launch_bounds__(kCommThreads) combine_reduce_kernel(CombineParams p) {
  const CommView& v = p.view;
  LocalState* st = v.state();
  const uint64_t epoch = next_epoch(&st->comb_epoch);
  const bool ok = block_wait_peers(v, v.layout.sig_comb, epoch * kSignalUnits, kErrTimeoutData, kOpCombine, epoch);
  if (ok) {
    const int rank = v.rank, k = p.top_k;
    const int lane = threadIdx.x % 32;
    const int nvec = v.shape.hidden / 8;
    const int L = v.shape.num_local_experts();
    int4* y = reinterpret_cast<int4*>(p.y);
    const int warp_id = blockIdx.x * kCommWarps + threadIdx.x / 32;
    const int num_warps = gridDim.x * kCommWarps;
    for (int t = warp_id; t < p.num_tokens; t += num_warps) {
      int owner = -1;
      if (lane < k) {
        const int32_t id = p.topk_idx[size_t(t) * k + lane];
        if (id >= 0 && id < v.shape.num_experts) owner = id / L;
      }
      // Distinct owners in ascending order: lane i receives the i-th.
      const int4* my_src = nullptr;
      int num_src = 0;
      for (int prev = -1;;) {
        const int cand = owner > prev ? owner : INT_MAX;
        const int o = __reduce_min_sync(kFullMask, cand);
        if (o == INT_MAX) break;
        if (lane == num_src)
          my_src = p.mode == CommMode::kPush
                       ? v.local<const int4>(v.layout.combine_rows) + (size_t(o) * v.shape.max_tokens + t) * nvec
                       : v.peer<const int4>(o, v.layout.combine_rows) + (size_t(rank) * v.shape.max_tokens + t) * nvec;
        ++num_src;
        prev = o;
      }
      warp_sum_rows<kSumUnroll>(my_src, num_src, nvec, y + size_t(t) * nvec, lane);
    }
    block_signal_peers(v, v.layout.ack_comb);
  }
  finish_op(v, &st->comb_done, &st->comb_epoch, epoch, p.status);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  if (p.num_blocks <= 0 || uint64_t(p.num_blocks) >= kSignalUnits) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, 4 * sizeof(int32_t), stream));
  combine_send_kernel<<<p.num_blocks, kCommThreads, 0, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  combine_reduce_kernel<<<p.num_blocks, kCommThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preload_combine_kernels() {
  cudaFuncAttributes attr;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, combine_send_kernel));
  return cudaFuncGetAttributes(&attr, combine_reduce_kernel);
}

}  // namespace mok::comm
