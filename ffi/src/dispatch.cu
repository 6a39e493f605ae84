// Kernels of mok/comm/dispatch.cuh. Buffer regions: mok/comm/workspace.cuh.
//
//   region (owner's view)      size                          written by          read by
//   route_idx/route_w[s]       T*k int32 / f32               rank s (post)       owner (schedule)
//   stage[s][t] (pull)         T rows of H bf16, on rank s   rank s (post)       every owner of t (data)
//   stage[s][t] (push)         T rows of H bf16, on owner    rank s (post)       owner (data)
//   sig_route[s], sig_x[s]     u64 on the owner              rank s              owner
//   ack_disp[d]                u64 on the source             owner d (data)      source (next post)
//
// Rows move with the copy engine of rows.cuh (cp.async.bulk through shared memory, warp 0 of each block):
// post loads each needed token row once and stores it to its stage(s); data loads each (source, token)
// row once (over NVLink when pulled) and stores it to every local slot's output row. Padding rows are
// zeroed with bulk stores from a zeroed shared buffer.
#include "mok/comm/dispatch.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/schedule.cuh"
#include "mok/comm/sync.cuh"
#include "mok/common.cuh"

namespace mok::comm {
namespace {

static_assert(kCommThreads == kMoverThreads, "the comm kernels are mover blocks (rows.cuh)");

__device__ __forceinline__ int owner_of(const CommView& v, int32_t id) {
  return (id >= 0 && id < v.shape.num_experts) ? id / v.shape.num_local_experts() : -1;
}

// Post (copy engine): candidate t = token t of this rank, read from x; its values are the ranks whose
// stage receives it: pull, this rank once if any other rank needs t; push, every other rank that does.
struct PostRows {
  const CommView* v;
  const int32_t* topk_idx;
  const uint8_t* x;
  int32_t k, row_bytes;
  bool push;

  __device__ int32_t collect(int32_t t, int32_t* vals, float*) const {
    const int32_t* ids = topk_idx + size_t(t) * k;
    int32_t count = 0;
    for (int32_t j0 = 0; j0 < k; j0 += 8) {
      int32_t id[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) id[u] = j0 + u < k ? ids[j0 + u] : -1;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int o = owner_of(*v, id[u]);
        if (o < 0 || o == v->rank) continue;
        if (push) {
          count = insert_unique(vals, count, o);
        } else {
          vals[0] = v->rank;
          count = 1;
        }
      }
    }
    return count > 0 ? count : -1;
  }
  __device__ const uint8_t* src(int32_t t, int32_t) const { return x + size_t(t) * row_bytes; }
  __device__ uint8_t* dst(int32_t t, int32_t r) const {  // stage[my rank][t] of rank r
    return v->peer<uint8_t>(r, v->layout.stage) + (size_t(v->rank) * v->shape.max_tokens + t) * row_bytes;
  }
};

// Data (copy engine): candidate q = (source s = q % ep, token t = q / ep), interleaved so NVLink and
// local reads proceed together; values: its output rows (token_major: its one row s * T + t).
struct DataRows {
  const CommView* v;
  const int32_t* row_table;
  const uint8_t* x;
  uint8_t* recv;
  int32_t num_tokens, k, capacity, row_bytes;
  bool push, token_major;

  __device__ int32_t collect(int32_t q, int32_t* vals, float*) const {
    const int32_t ep = v->shape.ep, s = q % ep, t = q / ep;
    const int32_t* tab = row_table + (size_t(s) * num_tokens + t) * k;
    int32_t count = 0;
    for (int32_t j0 = 0; j0 < k; j0 += 8) {
      int32_t r[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) r[u] = j0 + u < k ? tab[j0 + u] : -1;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (r[u] < 0 || r[u] >= capacity) continue;
        if (token_major) {
          vals[0] = s * num_tokens + t;
          count = 1;
        } else {
          vals[count++] = r[u];
        }
      }
    }
    return count > 0 ? count : -1;
  }
  __device__ const uint8_t* src(int32_t q, int32_t) const {
    const int32_t ep = v->shape.ep, s = q % ep, t = q / ep;
    if (s == v->rank) return x + size_t(t) * row_bytes;
    const size_t at = (size_t(s) * v->shape.max_tokens + t) * row_bytes;
    return push ? v->local<const uint8_t>(v->layout.stage) + at : v->peer<const uint8_t>(s, v->layout.stage) + at;
  }
  __device__ uint8_t* dst(int32_t, int32_t row) const { return recv + size_t(row) * row_bytes; }
};

// The copy engine's layout for a dispatch kernel (host: launch size; device: offsets).
__host__ __device__ inline MoverLayout dispatch_layout(const DispatchParams& p) {
  return make_mover_layout(false, p.view.shape.hidden * 2, p.top_k);
}

__global__ void __launch_bounds__(kCommThreads, 1) dispatch_post_kernel(DispatchParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
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

  // 2. Token rows that some other rank needs, once per token (pull) or once per destination (push),
  //    by the copy engine of warp 0.
  const MoverSmem sm = mover_init(smem, dispatch_layout(p));
  const MoverCtx ctx{&v, kOpDispatch, epoch};
  const PostRows rows{&v, p.topk_idx, reinterpret_cast<const uint8_t*>(p.x), k, v.shape.hidden * 2,
                      p.mode == CommMode::kPush};
  bool good = true;
  if (threadIdx.x < 32)
    good = copy_rows(rows, sm, ctx, block_share(p.num_tokens, blockIdx.x, gridDim.x),
                     block_share(p.num_tokens, blockIdx.x + 1, gridDim.x), int(threadIdx.x));
  if (__syncthreads_and(good)) block_signal_peers(v, v.layout.sig_x);
}

// token_major with zero_padding: rows of (source, token) pairs with no local slot are zeroed (generic
// stores by warps 1..; the copy engine of warp 0 writes the other rows).
__device__ void zero_token_major_rows(const DispatchParams& p, int32_t begin, int32_t end, int warp, int lane) {
  const CommView& v = p.view;
  const int ep = v.shape.ep, k = p.top_k, nvec = v.shape.hidden / 8;
  int4* recv = reinterpret_cast<int4*>(p.recv_x);
  for (int32_t q = begin + warp - 1; q < end; q += kCommWarps - 1) {
    const int32_t s = q % ep, t = q / ep;
    bool valid = false;
    if (lane < k) {
      const int32_t r = p.row_table[(size_t(s) * p.num_tokens + t) * k + lane];
      valid = r >= 0 && r < p.capacity;
    }
    if (__ballot_sync(kFullMask, valid) != 0) continue;
    int4* dst = recv + (size_t(s) * p.num_tokens + t) * nvec;
    for (int i = lane; i < nvec; i += 32) st_v4(dst + i, make_int4(0, 0, 0, 0));
  }
}

__global__ void __launch_bounds__(kCommThreads, 1) dispatch_data_kernel(DispatchParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const CommView& v = p.view;
  LocalState* st = v.state();
  const uint64_t epoch = next_epoch(&st->disp_epoch);
  const bool ok = block_wait_peers(v, v.layout.sig_x, epoch * kSignalUnits, kErrTimeoutData, kOpDispatch, epoch);
  if (ok) {
    const int32_t row_bytes = v.shape.hidden * 2;
    const MoverSmem sm = mover_init(smem, dispatch_layout(p));
    const MoverCtx ctx{&v, kOpDispatch, epoch};
    const DataRows rows{&v, p.row_table, reinterpret_cast<const uint8_t*>(p.x), reinterpret_cast<uint8_t*>(p.recv_x),
                        p.num_tokens, p.top_k, p.capacity, row_bytes, p.mode == CommMode::kPush, p.token_major};
    const int32_t items = v.shape.ep * p.num_tokens;
    const int32_t begin = block_share(items, blockIdx.x, gridDim.x);
    const int32_t end = block_share(items, blockIdx.x + 1, gridDim.x);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    bool good = true;
    if (warp == 0)
      good = copy_rows(rows, sm, ctx, begin, end, lane);
    else if (p.token_major && p.zero_padding)
      zero_token_major_rows(p, begin, end, warp, lane);
    good = __syncthreads_and(good) != 0;
    if (good && p.zero_padding && !p.token_major) {
      // Rows [total, capacity) are padding: one contiguous span, split evenly over the blocks.
      const int32_t total = min(max(st->total_rows, 0), p.capacity);
      const size_t vecs = size_t(p.capacity - total) * (row_bytes / 16);
      const size_t v0 = vecs * blockIdx.x / gridDim.x, v1 = vecs * (blockIdx.x + 1) / gridDim.x;
      zero_fill(sm, reinterpret_cast<uint8_t*>(p.recv_x) + size_t(total) * row_bytes + v0 * 16, (v1 - v0) * 16);
    }
    if (good) block_signal_peers(v, v.layout.ack_disp);
  }
  finish_op(v, &st->disp_done, &st->disp_epoch, epoch, p.status);
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  if (p.num_blocks <= 0 || uint64_t(p.num_blocks) >= kSignalUnits) return cudaErrorInvalidValue;
  const MoverLayout ml = dispatch_layout(p);
  if (!mover_layout_ok(ml)) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, 4 * sizeof(int32_t), stream));
  dispatch_post_kernel<<<p.num_blocks, kCommThreads, ml.total, stream>>>(p);
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
  dispatch_data_kernel<<<p.num_blocks, kCommThreads, ml.total, stream>>>(p);
  return cudaGetLastError();
}

// Loads both kernels on the current device and lets them take kMoverSmemBytes of shared memory.
cudaError_t preload_dispatch_kernels() {
  cudaFuncAttributes attr;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, dispatch_post_kernel));
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, dispatch_data_kernel));
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(dispatch_post_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoverSmemBytes));
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(dispatch_data_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoverSmemBytes));
  return preload_schedule_kernels();
}

}  // namespace mok::comm
