// Kernels of mok/routing.cuh.
#include "mok/routing.cuh"

#include "mok/comm/ptx.cuh"

namespace mok {
namespace {

constexpr int kCountThreads = 256;
constexpr uint32_t kFullMask = 0xffffffffu;

// launch_expert_layout's kernels (the design: mok/routing.cuh).
constexpr int kLayoutCountThreads = 128;
constexpr int kLayoutScanThreads = 1024;
constexpr int kLayoutScanWarps = kLayoutScanThreads / 32;
constexpr int kLayoutScanItems = 4;  // consecutive table cells per SCAN thread and round
constexpr int kLayoutPlaceBatch = 8;  // PLACE steps whose ids a lane loads before it ranks them
static_assert(kMaxExpertsForCount * sizeof(int32_t) <= 48 * 1024,
              "COUNT's and PLACE's per-expert words must fit the default shared-memory carve-out");

__global__ void expert_counts_kernel(ExpertCountParams p) {
  // [num_experts]: at most kMaxExpertsForCount words, the 48 KB a launch gets without opting in. Invalid indices
  // are counted in registers, added over the warp, and added to num_invalid by lane 0 (integers: any order).
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  int32_t invalid = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.num_assignments; i += stride) {
    const int32_t e = p.topk_idx[i];
    if (e >= 0 && e < p.num_experts)
      atomicAdd(&hist[e], 1);
    else
      ++invalid;
  }
  invalid = __reduce_add_sync(0xffffffffu, invalid);  // every lane reaches here: the loop has no early exit
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
    if (hist[e]) atomicAdd(&p.counts[e], hist[e]);
  if ((threadIdx.x & 31) == 0 && invalid) atomicAdd(p.num_invalid, invalid);
}

// The local expert of a slot whose id is `id`, or -1 for a slot that gets no row (masked, invalid, another rank's
// expert). In 64 bits: rank_layout's (id >= first) & (id < first + E) and then id - first, without a wrap.
__device__ __forceinline__ int32_t local_expert(int32_t id, int64_t first, int32_t num_experts) {
  const int64_t e = int64_t(id) - first;
  return (e >= 0 && e < num_experts) ? int32_t(e) : -1;
}

// COUNT: chunk blockIdx.x's slots per expert -> table[e * nc + c]. The lanes of a warp with one expert add once
// (their leader adds their number), so routing that sends every slot to one expert costs no more than any other.
__global__ void __launch_bounds__(kLayoutCountThreads) expert_layout_count_kernel(ExpertLayoutParams p) {
  extern __shared__ int32_t hist[];  // [num_experts]
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t first = *p.first_expert;
  const int64_t begin = int64_t(blockIdx.x) * p.chunk;
  const int64_t end = min(p.num_slots, begin + p.chunk);
  for (int64_t n0 = begin; n0 < end; n0 += blockDim.x) {  // the same trip count in every lane: match_any needs all
    const int64_t n = n0 + threadIdx.x;
    const int32_t e = n < end ? local_expert(p.topk_idx[n], first, E) : -1;
    const uint32_t same = __match_any_sync(kFullMask, e);
    if (e >= 0 && (same & comm::lanemask_lt()) == 0) atomicAdd(&hist[e], __popc(same));
  }
  __syncthreads();
  const int64_t nc = gridDim.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) p.scratch[e * nc + blockIdx.x] = hist[e];
}

// The exclusive scan of one value per thread over SCAN's CTA, in thread order; *total gets the CTA's sum. Every
// thread calls it; warp_sums is free again when it returns.
__device__ __forceinline__ int32_t cta_exclusive_scan(int32_t v, int32_t* warp_sums, int32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < kLayoutScanWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(kFullMask, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kLayoutScanWarps) warp_sums[lane] = w;
  }
  __syncthreads();
  const int32_t out = x - v + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[kLayoutScanWarps - 1];
  __syncthreads();
  return out;
}

// SCAN: the table in (e, c) order, scanned in place: cell (e, c) becomes the slots of experts e' < e plus those of e
// in chunks c' < c, i.e. chunk c's first row among the unpadded groups. Then each expert's count (the difference of
// its first cell and the next expert's), group_sizes, and shift[e] = the padding rows of the groups before e, so
// that a row is table + shift + the slot's rank in its chunk.
__global__ void __launch_bounds__(kLayoutScanThreads) expert_layout_scan_kernel(ExpertLayoutParams p, int32_t nc) {
  __shared__ int32_t warp_sums[kLayoutScanWarps];
  const int E = p.num_experts;
  int32_t* table = p.scratch;
  int32_t* shift = p.scratch + int64_t(E) * nc;
  const int64_t cells = int64_t(E) * nc;
  int32_t carry = 0;  // the same in every thread
  for (int64_t base = 0; base < cells; base += int64_t(kLayoutScanThreads) * kLayoutScanItems) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kLayoutScanItems;
    int32_t v[kLayoutScanItems];
    int32_t sum = 0;
#pragma unroll
    for (int u = 0; u < kLayoutScanItems; ++u) {
      v[u] = i0 + u < cells ? table[i0 + u] : 0;
      sum += v[u];
    }
    int32_t round_total;
    int32_t row = carry + cta_exclusive_scan(sum, warp_sums, &round_total);
#pragma unroll
    for (int u = 0; u < kLayoutScanItems; ++u) {
      if (i0 + u < cells) table[i0 + u] = row;
      row += v[u];
    }
    carry += round_total;
  }
  __syncthreads();  // the scanned table, read across threads below
  int32_t pad_carry = 0;
  for (int base = 0; base < E; base += kLayoutScanThreads) {
    const int e = base + threadIdx.x;
    int32_t pad = 0;
    if (e < E) {
      const int32_t count = (e + 1 < E ? table[int64_t(e + 1) * nc] : carry) - table[int64_t(e) * nc];
      const int32_t size = (count + p.block - 1) / p.block * p.block;  // < M: no overflow
      p.group_sizes[e] = size;
      pad = size - count;
    }
    int32_t round_total;
    const int32_t before = pad_carry + cta_exclusive_scan(pad, warp_sums, &round_total);
    if (e < E) shift[e] = before;
    pad_carry += round_total;
  }
}

// PLACE: one warp walks chunk blockIdx.x 32 slots a step in slot order. The lanes of one expert (match_any) take
// consecutive rows in lane order from the expert's running row, which their leader then advances: each slot's row
// is its group's start plus the slots of its expert before it, as padded_layout's stable sort gives.
__global__ void __launch_bounds__(32) expert_layout_place_kernel(ExpertLayoutParams p, int32_t nc, int32_t num_rows) {
  extern __shared__ int32_t next_row[];  // [num_experts]
  const int E = p.num_experts, lane = threadIdx.x;
  const int32_t* table = p.scratch;
  const int32_t* shift = p.scratch + int64_t(E) * nc;
  for (int e = lane; e < E; e += 32) next_row[e] = table[int64_t(e) * nc + blockIdx.x] + shift[e];
  __syncwarp();
  const int64_t first = *p.first_expert;
  const int64_t begin = int64_t(blockIdx.x) * p.chunk;
  const int64_t end = min(p.num_slots, begin + p.chunk);
  const uint32_t lower = comm::lanemask_lt();
  for (int64_t b0 = begin; b0 < end; b0 += 32 * kLayoutPlaceBatch) {
    int32_t ids[kLayoutPlaceBatch];
#pragma unroll
    for (int s = 0; s < kLayoutPlaceBatch; ++s) {
      const int64_t n = b0 + 32 * s + lane;
      ids[s] = n < end ? p.topk_idx[n] : 0;
    }
#pragma unroll
    for (int s = 0; s < kLayoutPlaceBatch; ++s) {
      const int64_t n = b0 + 32 * s + lane;
      if (b0 + 32 * s >= end) break;  // the same in every lane
      const int32_t e = n < end ? local_expert(ids[s], first, E) : -1;
      const uint32_t same = __match_any_sync(kFullMask, e);
      const int32_t row = e >= 0 ? next_row[e] + __popc(same & lower) : num_rows;
      __syncwarp();
      if (e >= 0 && (same & lower) == 0) next_row[e] += __popc(same);
      __syncwarp();
      if (n < end) {
        p.pos[n] = row;
        if (e >= 0) {
          p.src_slot[row] = int32_t(n);
          p.src_token[row] = int32_t(n / p.top_k);
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_expert_counts(const ExpertCountParams& p, cudaStream_t stream) {
  if (p.num_experts <= 0 || p.num_experts > kMaxExpertsForCount) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * p.num_experts, stream));
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.num_invalid, 0, sizeof(int32_t), stream));
  if (p.num_assignments == 0) return cudaSuccess;
  const int64_t want = ceil_div<int64_t>(p.num_assignments, kCountThreads);
  const int blocks = int(want < 1024 ? want : 1024);
  const size_t smem = sizeof(int32_t) * p.num_experts;
  expert_counts_kernel<<<blocks, kCountThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_expert_layout(const ExpertLayoutParams& p, cudaStream_t stream) {
  const int E = p.num_experts;
  if (E <= 0 || E > kMaxExpertsForCount || p.block <= 0 || p.chunk <= 0 || p.num_slots < 0 ||
      (p.num_slots > 0 && p.top_k <= 0))
    return cudaErrorInvalidValue;
  const int64_t rows = p.num_slots + int64_t(p.block) * E;  // M
  const int64_t nc = ceil_div<int64_t>(p.num_slots, p.chunk);
  if (rows >= (int64_t(1) << 31) || nc * E >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.src_token, 0xff, sizeof(int32_t) * rows, stream));  // -1: padding
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.src_slot, 0xff, sizeof(int32_t) * rows, stream));
  if (nc == 0) return cudaMemsetAsync(p.group_sizes, 0, sizeof(int32_t) * E, stream);  // no slots: empty groups
  const size_t smem = sizeof(int32_t) * E;
  expert_layout_count_kernel<<<unsigned(nc), kLayoutCountThreads, smem, stream>>>(p);
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  expert_layout_scan_kernel<<<1, kLayoutScanThreads, 0, stream>>>(p, int32_t(nc));
  MOK_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  expert_layout_place_kernel<<<unsigned(nc), 32, smem, stream>>>(p, int32_t(nc), int32_t(rows));
  return cudaGetLastError();
}

}  // namespace mok
