// Kernels of mok/comm/combine.cuh. Buffer regions: mok/comm/workspace.cuh.
//
//   region                  size                           written by        read by
//   comb[o][t] (push)       T rows of H bf16, on origin    owner o (send)    origin (reduce)
//   comb[s][t] (pull)       T rows of H bf16, on owner     owner (send)      origin s (reduce)
//   sig_comb[o]             u64 on the origin              owner o           origin
//   ack_comb[s]             u64 on the owner               origin s          owner (next send)
//
// Partials move with the gather engine of rows.cuh: warp 0 bulk-loads each item's rows into
// shared-memory stages, warps 1.. sum them in fp32 in the fixed order from shared memory, and one
// bulk store sends the bf16 result (to the origin's comb in push mode, over NVLink).
#include "mok/comm/combine.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/common.cuh"

namespace mok::comm {
namespace {

static_assert(kCommThreads == kMoverThreads, "the comm kernels are mover blocks (rows.cuh)");

// Send: candidate q = (origin s = q % ep, token t = q / ep); values: its local slots' expert_out rows
// in ascending slot order j, with their router weights; destination: partial(me, s, t).
struct SendRows {
  const CommView* v;
  const int32_t* row_table;
  const float* row_weight;
  const uint8_t* expert_out;
  int32_t num_tokens, k, capacity, row_bytes;
  bool push;

  __device__ int32_t collect(int32_t q, int32_t* vals, float* wts) const {
    const int32_t ep = v->shape.ep, s = q % ep, t = q / ep;
    const size_t slot0 = (size_t(s) * num_tokens + t) * k;
    int32_t count = 0;
    for (int32_t j0 = 0; j0 < k; j0 += 8) {
      int32_t r[8];
      float w[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const bool in = j0 + u < k;
        r[u] = in ? row_table[slot0 + j0 + u] : -1;
        w[u] = in ? row_weight[slot0 + j0 + u] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (r[u] < 0 || r[u] >= capacity) continue;
        vals[count] = r[u];
        wts[count] = w[u];
        ++count;
      }
    }
    return count > 0 ? count : -1;  // owners holding none of t's experts send nothing
  }
  __device__ const uint8_t* src(int32_t, int32_t row) const { return expert_out + size_t(row) * row_bytes; }
  __device__ uint8_t* dst(int32_t q, int32_t) const {
    const int32_t ep = v->shape.ep, s = q % ep, t = q / ep;
    return push ? v->peer<uint8_t>(s, v->layout.comb) + (size_t(v->rank) * v->shape.max_tokens + t) * row_bytes
                : v->local<uint8_t>(v->layout.comb) + (size_t(s) * v->shape.max_tokens + t) * row_bytes;
  }
};

// Reduce: candidate t = my token t; values: the distinct owner ranks of its experts, ascending (a token
// with none gets a zero row); destination: y[t].
struct ReduceRows {
  const CommView* v;
  const int32_t* topk_idx;
  uint8_t* y;
  int32_t k, row_bytes;
  bool push;

  __device__ int32_t collect(int32_t t, int32_t* vals, float*) const {
    const int32_t* ids = topk_idx + size_t(t) * k;
    const int32_t E = v->shape.num_experts, L = v->shape.num_local_experts();
    int32_t count = 0;
    for (int32_t j0 = 0; j0 < k; j0 += 8) {
      int32_t id[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) id[u] = j0 + u < k ? ids[j0 + u] : -1;
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (id[u] >= 0 && id[u] < E) count = insert_sorted_unique(vals, count, id[u] / L);
    }
    return count;
  }
  __device__ const uint8_t* src(int32_t t, int32_t o) const {
    return push ? v->local<const uint8_t>(v->layout.comb) + (size_t(o) * v->shape.max_tokens + t) * row_bytes
                : v->peer<const uint8_t>(o, v->layout.comb) + (size_t(v->rank) * v->shape.max_tokens + t) * row_bytes;
  }
  __device__ uint8_t* dst(int32_t t, int32_t) const { return y + size_t(t) * row_bytes; }
};

__host__ __device__ inline MoverLayout combine_layout(const CombineParams& p) {
  return make_mover_layout(true, p.view.shape.hidden * 2, p.top_k);
}

__global__ void __launch_bounds__(kCommThreads, 1) combine_send_kernel(CombineParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const CommView& v = p.view;
  const uint64_t epoch = next_epoch(&v.state()->comb_epoch);
  if (!block_wait_peers(v, v.layout.ack_comb, (epoch - 1) * kSignalUnits, kErrTimeoutAck, kOpCombine, epoch)) return;
  const MoverSmem sm = mover_init(smem, combine_layout(p));
  const MoverCtx ctx{&v, kOpCombine, epoch};
  const SendRows rows{&v, p.row_table, p.row_weight, reinterpret_cast<const uint8_t*>(p.expert_out), p.num_tokens,
                      p.top_k, p.capacity, v.shape.hidden * 2, p.mode == CommMode::kPush};
  const int32_t items = v.shape.ep * p.num_tokens;
  if (gather_rows<true>(rows, sm, ctx, block_share(items, blockIdx.x, gridDim.x),
                        block_share(items, blockIdx.x + 1, gridDim.x)))
    block_signal_peers(v, v.layout.sig_comb);
}

__global__ void __launch_bounds__(kCommThreads, 1) combine_reduce_kernel(CombineParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const CommView& v = p.view;
  LocalState* st = v.state();
  const uint64_t epoch = next_epoch(&st->comb_epoch);
  const bool ok = block_wait_peers(v, v.layout.sig_comb, epoch * kSignalUnits, kErrTimeoutData, kOpCombine, epoch);
  if (ok) {
    const MoverSmem sm = mover_init(smem, combine_layout(p));
    const MoverCtx ctx{&v, kOpCombine, epoch};
    const ReduceRows rows{&v, p.topk_idx, reinterpret_cast<uint8_t*>(p.y), p.top_k, v.shape.hidden * 2,
                          p.mode == CommMode::kPush};
    if (gather_rows<false>(rows, sm, ctx, block_share(p.num_tokens, blockIdx.x, gridDim.x),
                           block_share(p.num_tokens, blockIdx.x + 1, gridDim.x)))
      block_signal_peers(v, v.layout.ack_comb);
  }
  finish_op(v, &st->comb_done, &st->comb_epoch, epoch, p.status);
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  if (p.num_blocks <= 0 || uint64_t(p.num_blocks) >= kSignalUnits) return cudaErrorInvalidValue;
  const MoverLayout ml = combine_layout(p);
  if (!mover_layout_ok(ml)) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, 4 * sizeof(int32_t), stream));
  combine_send_kernel<<<p.num_blocks, kCommThreads, ml.total, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  combine_reduce_kernel<<<p.num_blocks, kCommThreads, ml.total, stream>>>(p);
  return cudaGetLastError();
}

// Loads both kernels on the current device and lets them take kMoverSmemBytes of shared memory.
cudaError_t preload_combine_kernels() {
  cudaFuncAttributes attr;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, combine_send_kernel));
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, combine_reduce_kernel));
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(combine_send_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoverSmemBytes));
  return cudaFuncSetAttribute(combine_reduce_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoverSmemBytes);
}

}  // namespace mok::comm
