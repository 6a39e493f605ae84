// Host side of the MoE forward megakernel (mok/moe/forward.cuh, mok/moe/forward_kernel.cuh): the plan, the
// scratch layout, the TMA descriptors of every rank, and the launch.
#include <algorithm>
#include <climits>
#include <vector>

#include "mok/common.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/forward_kernel.cuh"

namespace mok::moe {

// kFp8: the form with FP8 routed experts (forward_kernel.cuh); the bf16 form has none of its code. kLab: the lab
// form, with the code of skip_rank and timing_mode (forward_params.cuh, timing_bits); instantiated for bf16 only, and
// launched only when a call sets one of them. Three forms: <false, false>, <true, false> (production), <false, true>.
template <bool kFp8, bool kLab>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  run<kFp8, kLab>(params);
#endif
  // Without sm_90a machine code the kernel does nothing; the host refuses to launch such a build.
}

// The same kernel for a launch of more than kMaxVirtualRanks ranks (an emulated group of 9 to kMaxEmulatedRanks): its
// RankParams are in global memory (ManyParams), uploaded before it by upload_rank_params. The same three forms.
template <bool kFp8, bool kLab>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel_many(const __grid_constant__ ManyParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  run<kFp8, kLab>(params);
#endif
}

constexpr int kUploadThreads = 256;

// Stores up to kUploadRanks RankParams from this launch's parameter space into their places in global memory, then
// releases them to the tensormap proxy (forward_params.cuh, RankUpload).
__global__ void __launch_bounds__(kUploadThreads) upload_rank_params(const __grid_constant__ RankUpload up) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  store_rank_params(up);
#endif
}

namespace {

using Bf16 = cutlass::bfloat16_t;
using E4M3 = cutlass::float_e4m3_t;

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// A call that needs the lab form: one of the modes that are not for users (identity_experts needs none: a plan).
bool lab_modes(const ForwardKnobs& k) { return k.timing_mode != 0 || k.skip_rank >= 0; }

// The knobs of a rank with rank_ctas CTAs: a phase's items never exceed them (launch_forward, forward_item_list).
ForwardKnobs rank_knobs(const ForwardKnobs& k, int rank_ctas) {
  ForwardKnobs kn = k;
  kn.comm_items = std::min(kn.comm_items, rank_ctas);
  return kn;
}

}  // namespace

const char* forward_unsupported(const ForwardShape& s, const ForwardKnobs& k) {
  if (s.tokens < 1) return "tokens must be >= 1";
  if (s.hidden <= 0 || s.hidden % 8) return "hidden size H must be a positive multiple of 8";
  if (s.inter <= 0 || s.inter % 8) return "intermediate size I must be a positive multiple of 8";
  if (s.shared_inter < 0 || s.shared_inter % 8) return "shared intermediate size must be a multiple of 8 (0: none)";
  if (s.top_k < 1 || s.top_k > comm::kMaxTopK) return "top_k must be in [1, 32]";
  if (s.local_experts < 1 || s.local_experts > kMaxLocalExperts) return "experts per rank must be in [1, 1024]";
  if (s.ep < 1 || s.ep > comm::kMaxRanks) return "ep must be in [1, 1024]";
  if (int64_t(s.ep) * s.tokens * s.top_k >= (int64_t(1) << 31)) return "ep * tokens * top_k must fit int32";
  if (int64_t(s.hidden) * 2 >= INT_MAX || int64_t(s.inter) * 2 >= INT_MAX || int64_t(s.shared_inter) * 2 >= INT_MAX)
    return "H, 2I and 2Is must be below 2^31";
  if (k.granularity < comm::kMinGranularity || k.granularity > 32768 || k.granularity % comm::kChunkTokens)
    return "granularity must be a multiple of 64 in [512, 32768]";
  if (k.comm_items < 1) return "comm_items must be >= 1";
  if (k.ring_slots < 1 || k.ring_slots > kMaxRingSlots) return "ring_slots must be in [1, 8]";
  if (k.num_sms < 0) return "num_sms must be >= 0 (0 = every SM)";
  if (s.routed_fp8) {  // whole scale blocks along both reductions
    if (s.hidden % gemm::kFp8ScaleBlock) return "FP8 routed experts need the hidden size H to be a multiple of 128";
    if (s.inter % gemm::kFp8ScaleBlock) return "FP8 routed experts need the intermediate size I to be a multiple of 128";
    if (k.identity_experts) return "identity_experts runs no GEMM: it has no FP8 form";
    if (k.timing_mode != 0) return "timing_mode (bench only) has no FP8 form of the kernel";
    if (k.skip_rank >= 0) return "skip_rank (a test mode) has no FP8 form of the kernel";
  }
  const Plan p = make_plan(s, k);
  if (int64_t(p.S) * p.slot_rows >= INT_MAX / 2) return "ring_slots * rows per slot must fit int32";
  if (p.sync_words >= (int64_t(1) << 31)) return "the schedule does not fit int32 offsets";
  return nullptr;
}

ScratchLayout forward_scratch_layout(const ForwardShape& s, const ForwardKnobs& k) {
  const Plan p = make_plan(s, k);
  ScratchLayout l{};
  l.microbatches = p.M;
  l.slots = p.S;
  l.slot_rows = p.slot_rows;
  const size_t rows = size_t(p.S) * p.slot_rows;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align256(off + bytes);
    return at;
  };
  l.recv = take(rows * s.hidden * 2);  // FP8: the E4M3 row in its first H bytes, then the bf16 output
  l.h = take(rows * s.inter * (s.routed_fp8 ? 1 : 2));
  // the scales, k-block major, with the slack that the tiles' bulk copies of 132 row scales read past the end
  auto scales = [&](int32_t n) { return s.routed_fp8 ? (size_t(p.scale_ld) * (n / 128) + Fp8Tile::kScaleTail) * 4 : 0; };
  l.recv_scale = take(scales(s.hidden));
  l.h_scale = take(scales(s.inter));
  l.shared_h = take(size_t(s.tokens) * p.Is * 2);
  l.shared_out = take(p.Is ? size_t(s.tokens) * s.hidden * 4 : 0);
  // The slot of each ring row, for the kept g, u: outside the zeroed sync words (PLACE writes every entry a
  // gate/up tile reads before that tile runs).
  l.row_slot = take(size_t(p.M) * p.slot_rows * 4);
  l.sync_bytes = size_t(p.sync_words) * 4;
  l.sync = take(l.sync_bytes);
  l.item_times = l.sync + size_t(p.o_item_times) * 4;
  // This rank's RankParams, for an emulated launch of every rank of a group too large for the kernel parameter space
  // (forward_kernel_many); the region exists at every call of such a group, used by that launch only.
  l.rank_params = take(s.ep > kMaxVirtualRanks ? sizeof(RankParams) : 0);
  l.total = off;
  return l;
}

namespace {

// The members that Params and ManyParams share.
template <class LaunchParams>
void set_head(LaunchParams& lp, const Plan& plan, int num_ranks, const ForwardKnobs& knobs) {
  lp.plan = plan;
  lp.num_ranks = num_ranks;
  lp.skip_rank = knobs.skip_rank;
  lp.dispatch_push = knobs.dispatch_push;
}

// Rank `in`'s parameters: its pointers, its scratch's parts and its TMA descriptors.
void fill_rank(const ForwardShape& shape, const Plan& p, const ScratchLayout& sl, const ForwardRank& in,
               RankParams& rp) {
  const int rows = p.S * p.slot_rows;
  const int L = shape.local_experts, H = shape.hidden, I = shape.inter, Is = p.Is, T = shape.tokens;
  auto* base = static_cast<uint8_t*>(in.scratch);
  rp.view = in.view;
  rp.x = static_cast<const int4*>(in.x);
  rp.topk_idx = in.topk_idx;
  rp.topk_weight = in.topk_weight;
  rp.y = static_cast<int4*>(in.y);
  rp.status = in.status;
  rp.recv = reinterpret_cast<__nv_bfloat16*>(base + sl.recv);
  rp.h = reinterpret_cast<__nv_bfloat16*>(base + sl.h);
  rp.shared_h = reinterpret_cast<__nv_bfloat16*>(base + sl.shared_h);
  rp.shared_out = reinterpret_cast<float*>(base + sl.shared_out);
  rp.sync = reinterpret_cast<int32_t*>(base + sl.sync);
  rp.row_slot = reinterpret_cast<int32_t*>(base + sl.row_slot);
  rp.keep_pos = in.keep_pos;
  rp.keep_gu = in.keep_pos != nullptr ? static_cast<__nv_bfloat16*>(in.keep_gu) : nullptr;
  rp.keep_rows = in.keep_rows;
  rp.keep_shared_gu = p.Is > 0 ? static_cast<__nv_bfloat16*>(in.keep_shared_gu) : nullptr;
  const auto* x = static_cast<const Bf16*>(in.x);
  rp.a_sgu = Tile::make_tma_a(x, T, H);
  if (shape.routed_fp8) {
    rp.recv_scale = reinterpret_cast<float*>(base + sl.recv_scale);
    rp.h_scale = reinterpret_cast<float*>(base + sl.h_scale);
    rp.b_gu_scale = in.gate_up_scale;
    rp.b_dn_scale = in.down_scale;
    Fp8RoutedTma& d = rp.routed.fp8;  // the ring's E4M3 rows keep the bf16 rows' stride (2H bytes)
    d.a_gu = Fp8Tile::make_tma_a(reinterpret_cast<const E4M3*>(rp.recv), rows, H, 2 * int64_t(H));
    d.a_dn = Fp8Tile::make_tma_a(reinterpret_cast<const E4M3*>(rp.h), rows, I, I);
    d.b_gu = Fp8Tile::make_tma_b(static_cast<const E4M3*>(in.gate_up), 2 * I, H, L);
    d.b_dn = Fp8Tile::make_tma_b(static_cast<const E4M3*>(in.down), H, I, L);
  } else {
    Bf16RoutedTma& d = rp.routed.bf16;
    d.a_gu = Tile::make_tma_a(reinterpret_cast<const Bf16*>(rp.recv), rows, H);
    d.a_dn = Tile::make_tma_a(reinterpret_cast<const Bf16*>(rp.h), rows, I);
    d.b_gu = Tile::make_tma_b(static_cast<const Bf16*>(in.gate_up), 2 * I, H, L);
    d.b_dn = Tile::make_tma_b(static_cast<const Bf16*>(in.down), H, I, L);
  }
  if (Is > 0) {
    rp.a_sdn = Tile::make_tma_a(reinterpret_cast<const Bf16*>(rp.shared_h), T, Is);
    rp.b_sgu = Tile::make_tma_b(static_cast<const Bf16*>(in.shared_gate_up), 2 * Is, H, 1);
    rp.b_sdn = Tile::make_tma_b(static_cast<const Bf16*>(in.shared_down), H, Is, 1);
  } else {  // never used: valid descriptors of existing tensors
    rp.a_sdn = rp.a_sgu;
    rp.b_sgu = rp.b_sdn = Tile::make_tma_b(x, H, T, 1);  // x read as a T x H matrix
  }
}

// A launch of more than kMaxVirtualRanks ranks: each rank's RankParams go into its own scratch (ScratchLayout::
// rank_params), the ranks' scratch buffers one stride apart (the rows of the handler's u8[R, bytes]), uploaded in
// launches of kUploadRanks on `stream` before the kernel, which reads them there (ManyParams).
cudaError_t launch_many(const ForwardShape& shape, const ForwardKnobs& knobs, const ForwardRank* ranks,
                        int num_ranks, const Plan& plan, const ScratchLayout& sl, int grid, cudaStream_t stream) {
  auto* base0 = static_cast<uint8_t*>(ranks[0].scratch);
  const int64_t stride = static_cast<uint8_t*>(ranks[1].scratch) - base0;
  if (stride < int64_t(sl.total) || stride % 256 || reinterpret_cast<uintptr_t>(base0 + sl.rank_params) % 64)
    return cudaErrorInvalidValue;  // the copies' TMA descriptors must be 64-byte aligned
  for (int r = 0; r < num_ranks; ++r)
    if (static_cast<uint8_t*>(ranks[r].scratch) != base0 + r * stride) return cudaErrorInvalidValue;
  RankUpload up{};  // tens of KB, like Params
  up.stride = stride;
  for (int r0 = 0; r0 < num_ranks; r0 += kUploadRanks) {
    up.count = std::min(kUploadRanks, num_ranks - r0);
    up.dst = base0 + r0 * stride + sl.rank_params;
    for (int i = 0; i < up.count; ++i) fill_rank(shape, plan, sl, ranks[r0 + i], up.ranks[i]);
    MOK_CUDA_RETURN_IF_ERROR(launch_sm90a(&upload_rank_params, 1, kUploadThreads, 0, stream, up));
  }
  ManyParams params{};
  set_head(params, plan, num_ranks, knobs);
  params.rank_params = base0 + sl.rank_params;
  params.rank_stride = stride;
  auto* kernel = shape.routed_fp8 ? &forward_kernel_many<true, false>
                 : lab_modes(knobs) ? &forward_kernel_many<false, true>
                                    : &forward_kernel_many<false, false>;
  return launch_sm90a(kernel, grid, kThreads, kSmemBytes, stream, params);
}

}  // namespace

cudaError_t launch_forward(const ForwardShape& shape, const ForwardKnobs& knobs, const ForwardRank* ranks,
                           int num_ranks, cudaStream_t stream) {
  if (forward_unsupported(shape, knobs)) return cudaErrorInvalidValue;
  if (num_ranks < 1 || num_ranks > kMaxEmulatedRanks || (num_ranks != 1 && num_ranks != shape.ep))
    return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  MOK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const int grid = knobs.num_sms > 0 && knobs.num_sms < sm_count ? knobs.num_sms : sm_count;
  if (grid < num_ranks) return cudaErrorInvalidValue;  // every rank needs a CTA
  const ForwardKnobs kn = rank_knobs(knobs, grid / num_ranks);

  const ScratchLayout sl = forward_scratch_layout(shape, kn);
  for (int r = 0; r < num_ranks; ++r)
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(static_cast<uint8_t*>(ranks[r].scratch) + sl.sync, 0, sl.sync_bytes,
                                             stream));
  const Plan plan = make_plan(shape, kn, grid / num_ranks);
  if (num_ranks > kMaxVirtualRanks) return launch_many(shape, knobs, ranks, num_ranks, plan, sl, grid, stream);
  Params params{};  // tens of KB: the launch copies it into the kernel's parameter space
  set_head(params, plan, num_ranks, knobs);
  for (int r = 0; r < num_ranks; ++r) fill_rank(shape, plan, sl, ranks[r], params.ranks[r]);
  auto* kernel = shape.routed_fp8 ? &forward_kernel<true, false>  // no FP8 lab form: forward_unsupported
                 : lab_modes(knobs) ? &forward_kernel<false, true>
                                    : &forward_kernel<false, false>;
  return launch_sm90a(kernel, grid, kThreads, kSmemBytes, stream, params);
}

int32_t forward_item_list(const ForwardShape& s, const ForwardKnobs& k, int32_t ctas, const int32_t* rows,
                          int32_t* out, int32_t capacity) {
  if (forward_unsupported(s, k) || ctas < 1) return -1;
  const Plan p = make_plan(s, rank_knobs(k, ctas), ctas);
  // The sync region as SCAN leaves it, with slack past its end so that a segment table past its bound is seen here
  // (the kernel would write those words into the next table).
  std::vector<int32_t> sync(size_t(p.sync_words) + 64 * (size_t(p.M) + 2), 0);
  for (int m = 0; m < p.M; ++m) {  // SCAN's tables: each expert's first row in the slot (capped) and m-block prefix
    int32_t* row_start = sync.data() + p.o_row_start + int64_t(m) * (p.L + 1);
    int32_t* mblock = sync.data() + p.o_mblock + int64_t(m) * (p.L + 1);
    int64_t carry = 0;
    for (int e = 0; e < p.L; ++e) {
      row_start[e] = int32_t(std::min<int64_t>(carry, p.slot_rows));
      carry += rows[int64_t(m) * p.L + e];
    }
    row_start[p.L] = int32_t(std::min<int64_t>(carry, p.slot_rows));
    mblock[0] = 0;
    for (int e = 0; e < p.L; ++e) mblock[e + 1] = mblock[e] + (row_start[e + 1] - row_start[e] + kTileM - 1) / kTileM;
  }
  write_segments(p, sync.data(), ctas);
  if (sync[kCtlSegments] > p.max_segments) return -2;
  int32_t n = 0;
  for (int32_t t = 0;; ++t) {
    const Item it = t < p.t_dynamic ? decode_static(p, t) : decode_dynamic(p, sync.data(), t);
    if (it.kind == kEnd) return n;
    if (n < capacity) {
      const int32_t words[kForwardItemWords] = {it.kind, it.mb, it.idx, it.count, it.group, it.row0, it.row_end,
                                                it.n_block, it.mblock};
      std::copy(words, words + kForwardItemWords, out + int64_t(n) * kForwardItemWords);
    }
    ++n;
  }
}

cudaError_t preload_forward_kernel() {
  for (auto* kernel : {&forward_kernel<false, false>, &forward_kernel<true, false>, &forward_kernel<false, true>}) {
    cudaFuncAttributes attr;
    MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
    MOK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  }
  for (auto* kernel : {&forward_kernel_many<false, false>, &forward_kernel_many<true, false>,
                       &forward_kernel_many<false, true>}) {
    cudaFuncAttributes attr;
    MOK_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
    MOK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  }
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, &upload_rank_params);
}

}  // namespace mok::moe
