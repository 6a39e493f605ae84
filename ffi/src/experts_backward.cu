// Host side and kernel of mok/experts_backward.cuh: the experts' backward as one persistent launch. The device
// code's pieces are in mok/backward/ (included here only, in this order); here BackwardKernel (the steps it gives
// the megakernel shell, mok/megakernel.cuh), the kernel's entry, the checks and the launch.
#include <algorithm>
#include <climits>
#include <memory>
#include <type_traits>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/experts_backward.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/gemm/sm90_row_gather.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/gemm/swiglu_backward.cuh"
#include "mok/grouped_ffn.cuh"
#include "mok/megakernel.cuh"

#include "mok/backward/params.cuh"
#include "mok/backward/list.cuh"
#include "mok/backward/waits.cuh"
#include "mok/backward/items.cuh"
#include "mok/backward/producer.cuh"
#include "mok/backward/consumer.cuh"

namespace mok {
namespace {

static_assert(comm::kLocalTimeoutFloorNs == gemm::kWaitTimeoutNs, "a local wait outlasts the ring's and queue's");

// Warps 1..3 of the producer warpgroup: zeros in the rows past the groups of dx_e (the per-row dx the
// expert-parallel backward reads) and dw_e. Nothing in the kernel reads those rows.
__device__ void zero_past_groups(const KernelParams& p, const SharedStorage& s, int t, int cta, int ctas) {
  const int64_t first = s.table.row_start[p.E];
  const int64_t chunks = p.H / 8, total = (int64_t(p.M) - first) * chunks;
  const int64_t step = int64_t(ctas) * 96;
  uint4* dx_e = reinterpret_cast<uint4*>(p.dx_e);
  for (int64_t idx = int64_t(cta) * 96 + t; idx < total; idx += step)
    dx_e[first * chunks + idx] = make_uint4(0, 0, 0, 0);
  for (int64_t r = first + int64_t(cta) * 96 + t; r < p.M; r += step) p.dw_e[r] = 0.0f;
}

// Expert parallel: the rank's last CTA to exit advances its epoch and stamps kBwdDone in every peer (it read
// every peer's shared rows and its own bwd_dx, bwd_dw for the last time); a poisoned workspace sets the status.
// A wait of this call that timed out (the status bit) and poisoned nothing yet poisons the workspace here with
// kErrTimeoutLocal, as the forward's local timeouts do: the next call on the workspace names it.
__device__ void finish_call(const KernelParams& p, SharedStorage& s, int ctas, uint64_t epoch) {
  comm::LocalState* st = p.view.state();
  if (threadIdx.x == 0) {
    __threadfence();
    s.last = atomicAdd(&st->bwd_exit, 1u) == uint32_t(ctas - 1);
  }
  __syncthreads();
  if (!s.last || threadIdx.x != 0) return;
  __threadfence();
  if (comm::read_poison(p.view) == 0 && (*reinterpret_cast<volatile int32_t*>(p.status) & gemm::kStatusWaitTimeout))
    comm::raise_error(p.view, comm::kErrTimeoutLocal, comm::kOpMoeBackward, -1, epoch);
  if (const uint64_t poison = comm::read_poison(p.view); poison != 0) {
    comm::publish_host_error(p.view, poison);
    atomicOr(p.status, kExpertsBackwardStatusComm);
  }
  *reinterpret_cast<volatile uint32_t*>(&st->bwd_exit) = 0;
  *reinterpret_cast<volatile uint64_t*>(&st->bwd_epoch) = epoch;
  publish(p, comm::kBwdDone, epoch);
}

// An experts_backward_kernel_many launch found its KernelParams in global memory, where upload_rank_params stored
// them through the generic proxy: each thread that reads a descriptor through the tensormap proxy (the prefetch,
// the producer's TMA loads; all in warp 0) first acquires it (the CUDA Programming Guide's rule for a tensor map in
// global memory; that launch released them).
__device__ void acquire_descriptors(const Operands& o) {
  auto acquire = [](const void* d) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" : : "l"(d) : "memory");
  };
  acquire(o.gu_a.get_tma_descriptor()), acquire(o.gu_b.get_tma_descriptor());
  acquire(o.dh_a.get_tma_descriptor()), acquire(o.dh_b.get_tma_descriptor());
  acquire(o.dx_a.get_tma_descriptor()), acquire(o.dx_b.get_tma_descriptor());
  acquire(o.wd_a.get_tma_descriptor()), acquire(o.wd_b.get_tma_descriptor());
  acquire(o.wg_a.get_tma_descriptor()), acquire(o.wg_b.get_tma_descriptor());
  acquire(o.dh_gu.get_tma_descriptor());
}

// The backward on the megakernel shell (mok/megakernel.cuh). Launch: LaunchParams (every rank's KernelParams in the
// parameter space) or ManyLaunchParams (in global memory).
struct BackwardKernel {
  using Shared = SharedStorage;
  using Rank = KernelParams;
  using Cta = megakernel::Cta;
  static constexpr int kProducerRegs = mok::kProducerRegs;
  static constexpr int kConsumerRegs = mok::kConsumerRegs;
  template <class Launch>
  static constexpr bool in_global = std::is_same_v<Launch, ManyLaunchParams>;

  template <class Launch>
  static __device__ const KernelParams& rank(const Launch& P, int r) {
    return rank_params(P, r);
  }
  // Without expert parallelism there is no workspace, and no epoch.
  static __device__ uint64_t epoch(const KernelParams& p) {
    return p.ep > 1 ? comm::ld_volatile(&p.view.state()->bwd_epoch) + 1 : 0;
  }
  static __device__ void acquire_descriptors(const KernelParams& p) {
    mok::acquire_descriptors(p.routed);  // no shared expert at EP > 1: P.shared is never read
  }
  // Lane 0 of warp 0: the stage ring, the work queue, the descriptors into the cache. Warp 1: the group table.
  template <class Launch>
  static __device__ void init(const Launch& P, const KernelParams& p, SharedStorage& s, int warp,
                                              int lane) {
    if (warp == 0 && lane == 0) {
      TileKK::init_stages(s.stages);
      s.work.init(kConsumers / 32);
      cutlass::arch::fence_barrier_init();
      prefetch(p.routed);
      if (p.Ts > 0) prefetch(P.shared);
    }
    if (warp == 1) {
      gemm::build_group_table(s.table, p.group_sizes, p.E, p.M, kBlockM, 1, lane);
      const bool unpadded = gemm::any_unpadded_group(p.group_sizes, p.E, lane);
      int fewest = fewest_blocks(p.group_sizes, p.E, lane, 32);
      for (int d = 16; d > 0; d /= 2) fewest = min(fewest, __shfl_xor_sync(0xffffffffu, fewest, d));
      if (lane == 0) s.unpadded = unpadded, s.bad = unpadded || s.table.status != 0, s.fewest_blocks = fewest;
    }
  }
  // The table's status bits (CTA 0), and the list's shape for every role.
  template <class Launch>
  static __device__ void setup(const Launch&, const KernelParams& p, SharedStorage& s, Cta cta) {
    const int32_t bits = s.table.status | (s.unpadded ? gemm::kStatusUnpaddedGroup : 0);
    if (cta.index == 0 && threadIdx.x == 0 && bits) atomicOr(p.status, bits);
    if (threadIdx.x == 0) s.shape = make_shape(p, s);
    __syncthreads();
  }
  template <class Launch>
  static __device__ void producer(const Launch& P, const KernelParams& p, SharedStorage& s, Cta,
                                                  uint64_t) {
    mok::producer(p, P.shared, s, s.shape);
  }
  template <class Launch>
  static __device__ void helpers(const Launch&, const KernelParams& p, SharedStorage& s, int t,
                                                 Cta cta) {
    zero_past_groups(p, s, t, cta.index, cta.ctas);
  }
  template <class Launch>
  static __device__ void consumer(const Launch&, const KernelParams& p, SharedStorage& s, int ct,
                                                  Cta, uint64_t epoch) {
    mok::consumer(p, s, s.shape, ct, epoch);
  }
  template <class Launch>
  static __device__ void finish(const Launch&, const KernelParams& p, SharedStorage& s, Cta cta,
                                                uint64_t epoch) {
    if (p.ep > 1) {
      __syncthreads();
      finish_call(p, s, cta.ctas, epoch);
    }
  }
};

// kLab: the lab form, the only one with the code of skip_rank (a fault-injection test), launched only for a call
// that sets it.
template <bool kLab>
__global__ void __launch_bounds__(kThreads, 1) experts_backward_kernel(const __grid_constant__ LaunchParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  megakernel::run<BackwardKernel, kLab>(params);
#elif defined(__CUDA_ARCH__)
  if (threadIdx.x == 0 && blockIdx.x < params.num_ranks)
    atomicOr(params.ranks[blockIdx.x].status, gemm::kStatusNoSm90a);
#endif
}

// The same kernel for an emulated call of more than kExpertsBackwardParamRanks ranks (up to
// kExpertsBackwardMaxRanks): its KernelParams are in global memory (ManyLaunchParams), stored there before it by
// upload_rank_params. The same two forms.
template <bool kLab>
__global__ void __launch_bounds__(kThreads, 1)
    experts_backward_kernel_many(const __grid_constant__ ManyLaunchParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  megakernel::run<BackwardKernel, kLab>(params);
#elif defined(__CUDA_ARCH__)
  if (threadIdx.x == 0 && blockIdx.x < params.num_ranks)
    atomicOr(rank_params(params, blockIdx.x).status, gemm::kStatusNoSm90a);
#endif
}

constexpr int kUploadThreads = 256;

// Stores up.count KernelParams from this launch's parameter space into their places in global memory, then
// releases them to the tensormap proxy (params.cuh, RankUpload).
__global__ void __launch_bounds__(kUploadThreads) upload_rank_params(const __grid_constant__ RankUpload up) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  store_rank_params(up);
#endif
}

}  // namespace

int64_t experts_backward_ep_counter_words(int64_t rows, int64_t experts, int64_t ranks) {
  const int64_t words = experts_backward_counter_words(rows, experts, 0);
  if (ranks <= kExpertsBackwardParamRanks) return words;
  return (words + 15) / 16 * 16 + int64_t(sizeof(KernelParams)) / 4;
}

int32_t experts_backward_item_list(const int32_t* group_sizes, int32_t E, int32_t M, int32_t H, int32_t I, int32_t Is,
                                   int32_t Ts, int32_t ep, int32_t kept, int32_t share_items, int32_t* out,
                                   int32_t capacity) {
  if (E < 0 || E > kMaxGroups) return -1;
  KernelParams p{};
  p.group_sizes = group_sizes, p.E = E, p.M = M, p.H = H, p.I = I, p.Is = Is, p.Ts = Ts, p.ep = ep;
  p.kept = kept, p.share_items = share_items;
  // The table and flags as warp 1 makes them (gemm::build_group_table, gemm::any_unpadded_group): all zeros when a
  // size is negative or the sizes pass M.
  auto s = std::make_unique<SharedStorage>();
  int64_t rows = 0, tiles = 0;
  bool negative = false, unpadded = false;
  for (int e = 0; e <= E; ++e) {
    s->table.row_start[e] = int32_t(rows), s->table.tile_start[e] = int32_t(tiles);
    if (e == E) break;
    const int64_t size = std::max(group_sizes[e], 0);
    negative |= group_sizes[e] < 0, unpadded |= group_sizes[e] % gemm::kGroupAlign != 0;
    rows += size, tiles += ceil_div<int64_t>(size, kBlockM);
  }
  if (negative || rows > M) {
    std::fill_n(s->table.row_start, E + 1, 0);
    std::fill_n(s->table.tile_start, E + 1, 0);
  }
  s->unpadded = unpadded, s->bad = unpadded || negative || rows > M;
  s->fewest_blocks = fewest_blocks(group_sizes, E, 0, 1);
  const Shape h = make_shape(p, *s);
  const int32_t n = h.begin[kKinds];
  for (int32_t i = 0; i < n && i < capacity; ++i) {
    const Item it = decode(p, *s, h, i);
    const int32_t words[kExpertsBackwardItemWords] = {it.kind, it.shared, it.group, it.mb, it.m_block, it.n_block,
                                                      it.row0, it.row_end};
    for (int w = 0; w < kExpertsBackwardItemWords; ++w) out[int64_t(i) * kExpertsBackwardItemWords + w] = words[w];
  }
  return n;
}

const char* experts_backward_unsupported(const ExpertsBackwardParams& p) {
  GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, p.num_rows, p.hidden,
                     p.intermediate, p.num_experts, p.num_sms};
  if (const char* why = grouped_ffn_unsupported(f)) return why;
  if (p.num_experts > kMaxGroups) return "experts E must be at most 1024";
  if (p.num_tokens < 0 || p.num_tokens > INT_MAX) return "tokens T must be in [0, 2^31)";
  if (p.top_k < 1 || p.top_k > 32) return "top_k must be in [1, 32]";
  if (p.num_tokens * p.top_k > INT_MAX || p.num_tokens * p.hidden > INT_MAX) return "T * k and T * H must be below 2^31";
  if (p.slot_tokens * p.top_k > INT_MAX || p.slot_tokens < 0) return "ep * T * k must be below 2^31";
  if (p.num_rows * 2 * p.intermediate > INT_MAX || p.num_rows * p.hidden > INT_MAX)
    return "rows M times H or 2I must be below 2^31";
  if (p.counters == nullptr) return "the dependency counters are missing";
  if (p.view.base != nullptr && p.view.shape.ep > 1) {  // the fused expert-parallel backward
    const comm::CommShape& w = p.view.shape;
    if (p.shared_intermediate != 0) return "shared_gate_up: expert parallel, the shared expert runs outside the op";
    if (p.topk_idx == nullptr) return "topk_idx: expert parallel, this rank's expert ids are missing";
    if (p.num_rows < 1) return "src_slot: expert parallel, rows M must be at least 1";
    if (p.num_tokens > w.max_tokens) return "x: tokens exceed the workspace's max_tokens";
    if (p.hidden != w.hidden) return "x: the hidden size differs from the workspace's";
    if (p.top_k > w.top_k) return "topk_idx: top_k exceeds the workspace's";
    if (p.num_experts * w.ep != w.num_experts) return "gate_up: experts per rank differ from the workspace's";
    if (p.slot_tokens != p.num_tokens * w.ep) return "topk_weight: expert parallel, it must hold ep * T tokens";
    if (p.comm_items < 1) return "comm_items must be >= 1";
  } else if (p.slot_tokens != p.num_tokens) {
    return "topk_weight: without expert parallelism it holds the T tokens";
  }
  if (p.gu_part != nullptr) {
    if (p.gu_kept != nullptr) return "gu_part: a part of g, u kept, and all of them (gu): give one";
    if (p.gu_part_row == nullptr || p.gu_block == nullptr) return "gu_part: its row map or kept blocks are missing";
    if (p.gu_part_rows < 0 || p.gu_part_rows * 2 * p.intermediate > INT64_MAX / 4 || p.gu_part_rows > INT_MAX)
      return "gu_part: its rows must be in [0, 2^31)";
  }
  if (p.shared_intermediate < 0 || p.shared_intermediate % 8 != 0)
    return "shared_gate_up: the shared expert's intermediate size Is must be 0 (none) or a positive multiple of 8";
  if (p.shared_intermediate > 0) {
    if (!p.shared_gate_up || !p.shared_down || !p.d_shared_gate_up || !p.d_shared_down || !p.gus || !p.dgus ||
        !p.hws || !p.dxs)
      return "the shared expert's weights, gradients or scratch are missing";
    if (p.num_rows == 0) return "src_slot: rows M must be at least 1 with a shared expert";
    if (p.num_tokens * 2 * p.shared_intermediate > INT_MAX || p.hidden * 2 * p.shared_intermediate > INT_MAX)
      return "tokens T and H times 2Is must be below 2^31";
  }
  return nullptr;
}

namespace {

// One rank's kernel parameters and its memsets (status, counters); `shared`: the shared expert's descriptors.
cudaError_t fill_rank(const ExpertsBackwardParams& p, int grid_of_rank, KernelParams& k, Operands* shared,
                      cudaStream_t stream) {
  const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts), M = int(p.num_rows);
  const auto* x_e = static_cast<const Bf16*>(p.x_e);
  const auto* dy_e = static_cast<const Bf16*>(p.dy_e);
  const auto* gate_up = static_cast<const Bf16*>(p.gate_up);
  const auto* down = static_cast<const Bf16*>(p.down);
  const auto* dgu = static_cast<const Bf16*>(p.dgu);
  const auto* hw = static_cast<const Bf16*>(p.hw);
  const bool kept = p.gu_kept != nullptr;  // the forward's g, u: no GU items
  auto* gu = static_cast<__nv_bfloat16*>(kept ? p.gu_kept : p.gu);
  k.routed = make_operands(x_e, dy_e, gate_up, down, dgu, hw, gu, M, H, I, E);
  k.x = static_cast<const uint4*>(p.x);
  k.dy = static_cast<const uint4*>(p.dy);
  k.topk_weight = p.topk_weight;
  k.pos = p.pos;
  k.src_slot = p.src_slot;
  k.group_sizes = p.group_sizes;
  k.x_e = static_cast<uint4*>(p.x_e);
  k.dy_e = static_cast<uint4*>(p.dy_e);
  k.w_e = p.w_e;
  k.gu = gu;
  k.kept = kept;
  if (p.gu_part != nullptr) {
    k.gu_part = static_cast<const __nv_bfloat16*>(p.gu_part), k.gu_part_row = p.gu_part_row, k.gu_block = p.gu_block;
    k.gu_part_rows = int(p.gu_part_rows), k.gu_blocks = (M + kBlockM - 1) / kBlockM;
  }
  k.bwd = gemm::SwigluBackwardOut{k.gu, p.w_e, static_cast<__nv_bfloat16*>(p.dgu), static_cast<__nv_bfloat16*>(p.hw),
                                  p.dw_part, I, (I + kBlockN - 1) / kBlockN};
  k.dx_e = static_cast<Bf16*>(p.dx_e);
  k.dw_e = p.dw_e;
  k.dx = p.dx;
  k.dw = p.dw;
  k.d_gate_up = static_cast<Bf16*>(p.d_gate_up);
  k.d_down = static_cast<Bf16*>(p.d_down);
  k.status = p.status;
  k.counters = p.counters;
  k.T = int(p.num_tokens), k.k = int(p.top_k), k.M = M, k.H = H, k.I = I, k.E = E;
  const int Is = int(p.shared_intermediate), T = int(p.num_tokens);
  k.Is = Is, k.Ts = Is > 0 ? T : 0;
  if (Is > 0) {
    if (T > 0)  // no descriptor of an empty matrix: without rows no shared tile loads anything
      *shared = make_operands(static_cast<const Bf16*>(p.x), static_cast<const Bf16*>(p.dy),
                              static_cast<const Bf16*>(p.shared_gate_up), static_cast<const Bf16*>(p.shared_down),
                              static_cast<const Bf16*>(p.dgus), static_cast<const Bf16*>(p.hws),
                              static_cast<const __nv_bfloat16*>(p.gus), T, H, Is, 1);
    k.gus = static_cast<__nv_bfloat16*>(p.gus);
    k.sbwd = gemm::SwigluBackwardOut{k.gus, nullptr, static_cast<__nv_bfloat16*>(p.dgus),
                                     static_cast<__nv_bfloat16*>(p.hws), nullptr, Is, (Is + kBlockN - 1) / kBlockN};
    k.dxs = p.dxs;
    k.d_shared_gate_up = static_cast<Bf16*>(p.d_shared_gate_up);
    k.d_shared_down = static_cast<Bf16*>(p.d_shared_down);
  }
  const bool ep = p.view.base != nullptr && p.view.shape.ep > 1;
  k.ep = ep ? p.view.shape.ep : 1;
  k.Tn = int(p.slot_tokens);
  k.local_timeout_ns = gemm::kWaitTimeoutNs;
  if (ep) {
    k.view = p.view;
    k.topk_idx = p.topk_idx;
    k.experts_all = int(p.num_experts) * p.view.shape.ep;
    k.share_items = std::max(1, std::min(p.comm_items, grid_of_rank));
    k.local_timeout_ns = comm::local_timeout_ns(p.view.timeout_ns);  // the forward's bound (comm/sync.cuh)
  }
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, sizeof(int32_t), stream));
  return cudaMemsetAsync(p.counters, 0,
                         size_t(experts_backward_counter_words(p.num_rows, p.num_experts, k.Ts)) * 4, stream);
}

// An emulated call of more than kExpertsBackwardParamRanks ranks: each rank's KernelParams go into its row of the
// counters scratch, past the counters (experts_backward_ep_counter_words; the rows one stride apart, as the handler
// lays them out), uploaded in launches of kUploadRanks on `stream` before the kernel, which reads them there.
cudaError_t launch_many(const ExpertsBackwardParams* ranks, int num_ranks, int skip_rank, int grid,
                        cudaStream_t stream) {
  const ExpertsBackwardParams& p0 = ranks[0];
  const int64_t at = (experts_backward_counter_words(p0.num_rows, p0.num_experts, 0) + 15) / 16 * 16 * 4;
  auto* base0 = reinterpret_cast<uint8_t*>(p0.counters) + at;
  const int64_t stride = reinterpret_cast<uint8_t*>(ranks[1].counters) - reinterpret_cast<uint8_t*>(p0.counters);
  if (stride < at + int64_t(sizeof(KernelParams)) || stride % 64 || reinterpret_cast<uintptr_t>(base0) % 64)
    return cudaErrorInvalidValue;  // the copies' TMA descriptors must be 64-byte aligned
  for (int r = 0; r < num_ranks; ++r)
    if (reinterpret_cast<uint8_t*>(ranks[r].counters) + at != base0 + r * stride ||
        ranks[r].num_rows != p0.num_rows || ranks[r].num_experts != p0.num_experts)
      return cudaErrorInvalidValue;
  Operands unused{};  // fill_rank sets the shared expert's descriptors only with one (never at EP > 1)
  RankUpload up{};    // tens of KB, like LaunchParams
  up.stride = stride;
  for (int r0 = 0; r0 < num_ranks; r0 += kUploadRanks) {
    up.count = std::min(kUploadRanks, num_ranks - r0);
    up.dst = base0 + r0 * stride;
    for (int i = 0; i < up.count; ++i) {
      const int r = r0 + i;
      MOK_CUDA_RETURN_IF_ERROR(fill_rank(ranks[r], (grid - r + num_ranks - 1) / num_ranks, up.ranks[i], &unused,
                                         stream));
    }
    MOK_CUDA_RETURN_IF_ERROR(launch_sm90a(&upload_rank_params, 1, kUploadThreads, 0, stream, up));
  }
  ManyLaunchParams mp{};
  mp.num_ranks = num_ranks;
  mp.skip_rank = skip_rank;
  mp.rank_params = base0;
  mp.rank_stride = stride;
  return launch_sm90a(skip_rank >= 0 ? &experts_backward_kernel_many<true> : &experts_backward_kernel_many<false>,
                      grid, kThreads, kSmemBytes, stream, mp);
}

}  // namespace

cudaError_t launch_experts_backward_ranks(const ExpertsBackwardParams* ranks, int num_ranks, int skip_rank,
                                          cudaStream_t stream) {
  if (num_ranks < 1 || num_ranks > kExpertsBackwardMaxRanks) return cudaErrorInvalidValue;
  for (int r = 0; r < num_ranks; ++r) {
    const ExpertsBackwardParams& p = ranks[r];
    if (experts_backward_unsupported(p)) return cudaErrorInvalidValue;
    if (num_ranks > 1 && (p.view.base == nullptr || p.view.shape.ep != num_ranks || p.view.rank != r))
      return cudaErrorInvalidValue;  // an emulated call carries every rank of its group, in order
  }
  const ExpertsBackwardParams& p0 = ranks[0];
  if (num_ranks == 1 && p0.view.base == nullptr && p0.num_rows == 0) {  // EP 1, no rows: zero gradients
    const ExpertsBackwardParams& p = p0;
    const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts);
    const int64_t slots = p.num_tokens * p.top_k;
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_gate_up, 0, size_t(E) * H * 2 * I * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_down, 0, size_t(E) * I * H * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dx, 0, size_t(p.num_tokens) * H * sizeof(float), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dw, 0, size_t(slots) * sizeof(float), stream));
    GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, 0, p.hidden, p.intermediate,
                       p.num_experts, p.num_sms};
    return launch_grouped_ffn(f, stream);  // M = 0: writes the status only
  }
  int grid = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p0.num_sms, &grid));
  if (grid < num_ranks) return cudaErrorInvalidValue;  // every rank needs a CTA
  if (num_ranks > kExpertsBackwardParamRanks) return launch_many(ranks, num_ranks, skip_rank, grid, stream);
  LaunchParams lp{};  // about 16 KB with 8 ranks: the launch copies it into the kernel's parameter space
  lp.num_ranks = num_ranks;
  lp.skip_rank = skip_rank;
  for (int r = 0; r < num_ranks; ++r)
    MOK_CUDA_RETURN_IF_ERROR(fill_rank(ranks[r], (grid - r + num_ranks - 1) / num_ranks, lp.ranks[r], &lp.shared,
                                       stream));
  return launch_sm90a(skip_rank >= 0 ? &experts_backward_kernel<true> : &experts_backward_kernel<false>, grid, kThreads,
                      kSmemBytes, stream, lp);
}

cudaError_t launch_experts_backward(const ExpertsBackwardParams& p, cudaStream_t stream) {
  return launch_experts_backward_ranks(&p, 1, -1, stream);
}

}  // namespace mok

// Host only, for the tests: where the byte offsets of mok/gemm/sm90_row_gather.cuh (the stages the row-gathering
// loader fills) differ from CuTe's layouts of the same stages, whose swizzle acts on byte addresses: the number of
// (row, column) places that differ in a K-major 128 x 64 A stage, an MN-major 128 x 64 one and the MN-major ring of
// 256 x 64 B stages. 0 when they agree.
extern "C" __attribute__((visibility("default"))) int64_t mok_row_gather_offset_mismatches() {
  namespace rg = mok::gemm::row_gather;
  using E = cutlass::bfloat16_t;
  auto bytes = [](const auto& layout, auto... coord) {
    return uint32_t(layout.layout_a()(2 * int(layout.layout_b()(coord...))));
  };
  int64_t bad = 0;
  const mok::gemm::detail::StageTile<E, true, 128, 64> k_major{};
  const mok::gemm::detail::StageTile<E, false, 128, 64> mn_major{};
  const mok::gemm::detail::StageRing<E, false, 256, 64, mok::gemm::StageRing::kStages> mn_ring{};
  for (int r = 0; r < 128; ++r)
    for (int k = 0; k < 64; ++k) {
      bad += bytes(k_major, r, k) != rg::k_major_offset(r, k / 8) + 2 * (k % 8);
      bad += bytes(mn_major, r, k) != rg::mn_major_offset(k, r / 8) + 2 * (r % 8);
    }
  for (int s = 0; s < mok::gemm::StageRing::kStages; ++s)
    for (int n = 0; n < 256; ++n)
      for (int k = 0; k < 64; ++k)
        bad += bytes(mn_ring, n, k, s) != s * 256 * 64 * 2 + rg::mn_major_offset(k, n / 8) + 2 * (n % 8);
  return bad;
}
