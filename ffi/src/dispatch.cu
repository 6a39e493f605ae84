// Kernels of mok/comm/dispatch.cuh. Buffer regions: mok/comm/workspace.cuh.
//
//   region (owner's view)      size                          written by          read by
//   route_idx/route_w[s]       T*k int32 / f32               rank s (post)       owner (schedule)
//   dispatch_rows[s][t] (pull)         T rows of H bf16, on rank s   rank s (post)       every owner of t (data)
//   dispatch_rows[s][t] (push)         T rows of H bf16, on owner    rank s (post)       owner (data)
//   sig_route[s], sig_x[s]     u64 on the owner              rank s              owner
//   ack_disp[d]                u64 on the source             owner d (data)      source (next post)
#include "mok/comm/dispatch.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/schedule.cuh"
#include "mok/comm/sync.cuh"
#include "mok/common.cuh"

namespace mok::comm {
namespace {

constexpr int kCopyUnroll = 8;

__device__ __forceinline__ int owner_of(const CommView& v, int32_t id) {
  return (id >= 0 && id < v.shape.num_experts) ? id / v.shape.num_local_experts() : -1;
}

__global__ void __launch_bounds__(kCommThreads) dispatch_post_kernel(DispatchParams p) {
  const CommView& v = p.view;
  const uint64_t epoch = next_epoch(&v.state()->disp_epoch);
  if (!block_wait_peers(v, v.layout.ack_disp, (epoch - 1) * kSignalUnits, kErrTimeoutAck, kOpDispatch, epoch)) return;
  const int ep = v.shape.ep, rank = v.rank, k = p.top_k;
  const size_t n_route = size_t(p.num_tokens) * k;
  const size_t gtid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gthreads = size_t(gridDim.x) * blockDim.x;

  // 1. Routing into route_idx/route_w[rank] of every rank (mine included; coalesced 4-byte stores).
  for (int q = 0; q < ep; ++q) {
    int32_t* di = v.peer<int32_t>(q, v.layout.route_idx) + size_t(rank) * v.layout.route_stride;
    float* dw = v.peer<float>(q, v.layout.route_w) + size_t(rank) * v.layout.route_stride;
    for (size_t i = gtid; i < n_route; i += gthreads) {
      di[i] = p.topk_idx[i];
      dw[i] = p.topk_weight[i];
    }
  }
  block_signal_peers(v, v.layout.sig_route);

  // 2. Token rows that some other rank needs, once per token (pull) or once per destination (push).
  const int lane = threadIdx.x % 32;
  const int nvec = v.shape.hidden / 8;
  const int4* x = reinterpret_cast<const int4*>(p.x);
  const size_t dispatch_row0 = size_t(rank) * v.shape.max_tokens;  // dispatch_rows[rank][0]
  const int warp_id = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int num_warps = gridDim.x * kCommWarps;
  for (int t = warp_id; t < p.num_tokens; t += num_warps) {
    const int owner = lane < k ? owner_of(v, p.topk_idx[size_t(t) * k + lane]) : -1;
    const uint32_t same = __match_any_sync(kFullMask, owner);
    const bool first_of_owner = lane == __ffs(same) - 1;
    const bool remote = first_of_owner && owner >= 0 && owner != rank;
    uint32_t lanes = __ballot_sync(kFullMask, remote);
    if (lanes == 0) continue;
    int4* my_dst = nullptr;
    if (p.mode == CommMode::kPull) {
      lanes &= -lanes;  // one copy, into my own dispatch_rows
      my_dst = v.local<int4>(v.layout.dispatch_rows) + (dispatch_row0 + t) * nvec;
    } else if (remote) {
      my_dst = v.peer<int4>(owner, v.layout.dispatch_rows) + (dispatch_row0 + t) * nvec;
    }
    warp_copy_row<kCopyUnroll>(x + size_t(t) * nvec, nvec, my_dst, lanes, lane);
  }
  block_signal_peers(v, v.layout.sig_x);
}

__global__ void __launch_bounds__(kCommThreads) dispatch_data_kernel(DispatchParams p) {
  const CommView& v = p.view;
  LocalState* st = v.state();
  const uint64_t epoch = next_epoch(&st->disp_epoch);
  const bool ok = block_wait_peers(v, v.layout.sig_x, epoch * kSignalUnits, kErrTimeoutData, kOpDispatch, epoch);
  if (ok) {
    const int ep = v.shape.ep, rank = v.rank, k = p.top_k;
    const int lane = threadIdx.x % 32;
    const int nvec = v.shape.hidden / 8;
    const int4* x = reinterpret_cast<const int4*>(p.x);
    int4* recv = reinterpret_cast<int4*>(p.recv_x);
    const int warp_id = blockIdx.x * kCommWarps + threadIdx.x / 32;
    const int num_warps = gridDim.x * kCommWarps;
    const int items = ep * p.num_tokens;
    // Sources interleaved (item % ep) so NVLink reads and local reads proceed together.
    for (int item = warp_id; item < items; item += num_warps) {
      const int s = item % ep, t = item / ep;
      int row = -1;
      if (lane < k) {
        const int32_t r = p.row_table[(size_t(s) * p.num_tokens + t) * k + lane];
        if (r >= 0 && r < p.capacity) row = r;
      }
      uint32_t lanes = __ballot_sync(kFullMask, row >= 0);
      if (p.token_major) {
        int4* dst = recv + (size_t(s) * p.num_tokens + t) * nvec;
        if (lanes == 0) {
          if (p.zero_padding)
            for (int i = lane; i < nvec; i += 32) st_v4(dst + i, make_int4(0, 0, 0, 0));
          continue;
        }
        lanes &= -lanes;  // one copy per (source, token)
      } else if (lanes == 0) {
        continue;
      }
      const size_t src_row = size_t(s) * v.shape.max_tokens + t;  // dispatch_rows[s][t]
      const int4* src = s == rank ? x + size_t(t) * nvec
                        : p.mode == CommMode::kPull ? v.peer<const int4>(s, v.layout.dispatch_rows) + src_row * nvec
                                                    : v.local<const int4>(v.layout.dispatch_rows) + src_row * nvec;
      int4* my_dst = p.token_major ? recv + (size_t(s) * p.num_tokens + t) * nvec
                                   : (row >= 0 ? recv + size_t(row) * nvec : nullptr);
      warp_copy_row<kCopyUnroll>(src, nvec, my_dst, lanes, lane);
    }
    if (p.zero_padding && !p.token_major) {
      const int32_t total = min(max(st->total_rows, 0), p.capacity);
      const size_t n = size_t(p.capacity - total) * nvec;
      int4* pad = recv + size_t(total) * nvec;
      const int4 zero = make_int4(0, 0, 0, 0);
      for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        st_v4(pad + i, zero);
    }
    block_signal_peers(v, v.layout.ack_disp);
  }
  finish_op(v, &st->disp_done, &st->disp_epoch, epoch, p.status);
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  if (p.num_blocks <= 0 || uint64_t(p.num_blocks) >= kSignalUnits) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, 4 * sizeof(int32_t), stream));
  dispatch_post_kernel<<<p.num_blocks, kCommThreads, 0, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  ScheduleParams sp{};
  sp.view = p.view;
  sp.num_tokens = p.num_tokens;
  sp.top_k = p.top_k;
  sp.capacity = p.capacity;
  sp.group_sizes = p.group_sizes;
  sp.row_table = p.row_table;
  sp.row_weight = p.row_weight;
  sp.row_source = p.row_source;
  MOK_CUDA_RETURN_IF_ERROR(launch_schedule(sp, stream));
  dispatch_data_kernel<<<p.num_blocks, kCommThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preload_dispatch_kernels() {
  cudaFuncAttributes attr;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, dispatch_post_kernel));
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, dispatch_data_kernel));
  return preload_schedule_kernels();
}

}  // namespace mok::comm
