// Kernels of mok/comm/schedule.cuh (see the layout and the row order there).
#include "mok/comm/schedule.cuh"
#include "mok/comm/sync.cuh"
#include "mok/common.cuh"

namespace mok::comm {
namespace {

struct ChunkItem {
  int32_t src, t0, t1;  // source rank and token range [t0, t1)
  bool valid;
};

__device__ __forceinline__ ChunkItem chunk_item(const ScheduleParams& p, int item) {
  const int nc = num_chunks(p.num_tokens);
  ChunkItem it;
  it.valid = item < p.view.shape.ep * nc;
  it.src = item / nc;
  const int c = item - it.src * nc;
  it.t0 = c * kChunkTokens;
  it.t1 = min(p.num_tokens, it.t0 + kChunkTokens);
  return it;
}

// Local expert of a global expert id, or -1 (other owner, or an invalid id which no one receives).
__device__ __forceinline__ int local_expert(const CommView& v, int32_t id) {
  const int L = v.shape.num_local_experts();
  if (id < 0 || id >= v.shape.num_experts) return -1;
  const int le = id - v.rank * L;
  return (le >= 0 && le < L) ? le : -1;
}

__global__ void __launch_bounds__(kScheduleWarps * 32) schedule_count_kernel(ScheduleParams p) {
  extern __shared__ int32_t hist_all[];  // [kScheduleWarps][L]
  const CommView& v = p.view;
  const uint64_t epoch = next_epoch(&v.state()->disp_epoch);
  if (!block_wait_peers(v, v.layout.sig_route, epoch * kSignalUnits, kErrTimeoutRouting, kOpDispatch, epoch)) return;
  const int L = v.shape.num_local_experts();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* hist = hist_all + warp * L;
  for (int i = lane; i < L; i += 32) hist[i] = 0;
  __syncwarp();
  const int item = blockIdx.x * kScheduleWarps + warp;
  const ChunkItem it = chunk_item(p, item);
  if (!it.valid) return;
  const int32_t* idx = v.local<int32_t>(v.layout.route_idx) + size_t(it.src) * v.layout.route_stride;
  for (int n = it.t0 * p.top_k + lane; n < it.t1 * p.top_k; n += 32) {
    const int le = local_expert(v, idx[n]);
    if (le >= 0) atomicAdd(&hist[le], 1);
  }
  __syncwarp();
  int32_t* out = v.local<int32_t>(v.layout.chunk_count) + size_t(item) * L;
  for (int i = lane; i < L; i += 32) out[i] = hist[i];
}

__global__ void __launch_bounds__(kScanThreads) schedule_scan_kernel(ScheduleParams p) {
  __shared__ int32_t warp_sums[kScanThreads / 32];
  __shared__ int32_t carry_s;
  const CommView& v = p.view;
  if (!block_healthy(v)) return;
  const uint64_t epoch = next_epoch(&v.state()->disp_epoch);
  const int L = v.shape.num_local_experts();
  const int ep = v.shape.ep;
  const int nc = num_chunks(p.num_tokens);
  const int per_expert = ep * nc;
  const int total_items = L * per_expert;
  const int32_t* counts = v.local<int32_t>(v.layout.chunk_count);
  int32_t* bases = v.local<int32_t>(v.layout.chunk_base);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) carry_s = 0;
  __syncthreads();
  for (int base = 0; base < total_items; base += kScanThreads) {
    const int i = base + tid;
    int32_t val = 0;
    size_t cell = 0;
    if (i < total_items) {
      const int e = i / per_expert;
      const int sc = i - e * per_expert;  // == s * nc + c
      cell = size_t(sc) * L + e;
      val = counts[cell];
    }
    int32_t x = val;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int32_t s = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += y;
      }
      warp_sums[lane] = s;
    }
    __syncthreads();
    const int32_t excl = x - val + (warp > 0 ? warp_sums[warp - 1] : 0);
    const int32_t carry = carry_s;
    if (i < total_items) bases[cell] = carry + excl;
    __syncthreads();
    if (tid == kScanThreads - 1) carry_s = carry + excl + val;
    __syncthreads();
  }
  const int32_t total = carry_s;
  // First row of expert e is the base of its first cell (s = 0, c = 0), i.e. bases[e].
  for (int e = tid; e < L; e += kScanThreads) {
    const int32_t first = bases[e];
    const int32_t next = e + 1 < L ? bases[e + 1] : total;
    p.group_sizes[e] = next - first;
  }
  if (tid == 0) {
    v.state()->total_rows = total;
    if (total > p.capacity) raise_error(v, kErrOverflow, kOpDispatch, -1, epoch);
  }
}

__global__ void __launch_bounds__(kScheduleWarps * 32) schedule_place_kernel(ScheduleParams p) {
  extern __shared__ int32_t run_all[];  // [kScheduleWarps][L]: next row of each local expert
  const CommView& v = p.view;
  if (!block_healthy(v)) return;
  const int L = v.shape.num_local_experts();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int item = blockIdx.x * kScheduleWarps + warp;
  const ChunkItem it = chunk_item(p, item);
  if (!it.valid) return;
  int32_t* run = run_all + warp * L;
  const int32_t* bases = v.local<int32_t>(v.layout.chunk_base) + size_t(item) * L;
  for (int i = lane; i < L; i += 32) run[i] = bases[i];
  __syncwarp();
  const int k = p.top_k;
  const int32_t* idx = v.local<int32_t>(v.layout.route_idx) + size_t(it.src) * v.layout.route_stride;
  const float* wts = v.local<float>(v.layout.route_w) + size_t(it.src) * v.layout.route_stride;
  const size_t out_base = size_t(it.src) * p.num_tokens * k;
  const int n_end = it.t1 * k;
  for (int n0 = it.t0 * k; n0 < n_end; n0 += 32) {
    const int n = n0 + lane;
    const bool active = n < n_end;
    int le = -1;
    float w = 0.0f;
    if (active) {
      le = local_expert(v, idx[n]);
      w = wts[n];
    }
    const uint32_t same = __match_any_sync(0xffffffffu, le);
    const int before = __popc(same & lanemask_lt());
    const int pos = le >= 0 ? run[le] + before : -1;
    __syncwarp();
    if (le >= 0 && before == 0) run[le] += __popc(same);
    __syncwarp();
    if (active) {
      const bool kept = pos >= 0 && pos < p.capacity;
      p.row_table[out_base + n] = kept ? pos : -1;
      p.row_weight[out_base + n] = w;
      if (kept) p.row_source[pos] = it.src * p.num_tokens + n / k;
    }
  }
}

}  // namespace

cudaError_t launch_schedule(const ScheduleParams& p, cudaStream_t stream) {
  const int L = p.view.shape.num_local_experts();
  if (L <= 0 || L > kMaxLocalExperts || p.top_k <= 0 || p.top_k > kMaxTopK) return cudaErrorInvalidValue;
  const int items = p.view.shape.ep * num_chunks(p.num_tokens);
  const int blocks = ceil_div(items, kScheduleWarps);
  const size_t smem = sizeof(int32_t) * kScheduleWarps * L;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.row_source, 0xff, sizeof(int32_t) * p.capacity, stream));  // -1
  schedule_count_kernel<<<blocks, kScheduleWarps * 32, smem, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  schedule_scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  schedule_place_kernel<<<blocks, kScheduleWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t preload_schedule_kernels() {
  cudaFuncAttributes attr;
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, schedule_count_kernel));
  MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, schedule_scan_kernel));
  return cudaFuncGetAttributes(&attr, schedule_place_kernel);
}

}  // namespace mok::comm
