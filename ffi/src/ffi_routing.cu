// XLA FFI handlers for mok/routing.cuh: mok_expert_counts and mok_expert_layout.
//   mok_expert_counts(topk_idx: s32[T, k])  ->  counts: s32[E], num_invalid: s32[]
//   mok_expert_layout(topk_idx: s32[T, k], first_expert: s32[])
//     -> pos: s32[T, k], src_token: s32[M], src_slot: s32[M], group_sizes: s32[E], scratch: s32[words]
//     attributes block (group sizes are multiples of it) and chunk (slots per chunk of the kernels);
//     M = T * k + block * E, words = mok::expert_layout_scratch_words(T * k, E, chunk)
#include "ffi_common.h"
#include "mok/routing.cuh"

namespace ffi = xla::ffi;

struct ExpertLayoutAttrs {
  int32_t block;
  int32_t chunk;
};
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(ExpertLayoutAttrs, ::xla::ffi::StructMember<int32_t>("block"),
                                      ::xla::ffi::StructMember<int32_t>("chunk"));

namespace {

ffi::Error expert_counts_impl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                              ffi::ResultBuffer<ffi::S32> counts, ffi::ResultBuffer<ffi::S32> num_invalid) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_expert_counts";
  if (topk_idx.dimensions().size() != 2)
    return mok::ffi_util::invalid(kOp, "topk_idx must be rank 2 [tokens, top_k]");
  if (counts->dimensions().size() != 1) return mok::ffi_util::invalid(kOp, "counts must be rank 1 [num_experts]");
  const int64_t num_experts = counts->dimensions()[0];
  if (num_experts <= 0 || num_experts > mok::kMaxExpertsForCount)
    return mok::ffi_util::invalid(kOp, "num_experts must be in [1, " + std::to_string(mok::kMaxExpertsForCount) + "]");
  mok::ExpertCountParams p{};
  p.topk_idx = topk_idx.typed_data();
  p.num_assignments = static_cast<int64_t>(topk_idx.element_count());
  p.num_experts = static_cast<int32_t>(num_experts);
  p.counts = counts->typed_data();
  p.num_invalid = num_invalid->typed_data();
  return mok::ffi_util::cuda_error(kOp, mok::launch_expert_counts(p, stream));
}

ffi::Error expert_layout_impl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> first_expert,
                              ffi::ResultBuffer<ffi::S32> pos, ffi::ResultBuffer<ffi::S32> src_token,
                              ffi::ResultBuffer<ffi::S32> src_slot, ffi::ResultBuffer<ffi::S32> group_sizes,
                              ffi::ResultBuffer<ffi::S32> scratch, ExpertLayoutAttrs attrs) {
  using mok::ffi_util::dims_are;
  using mok::ffi_util::dims_str;
  using mok::ffi_util::invalid;
  using mok::ffi_util::shape_str;
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_expert_layout";
  const auto idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2)
    return invalid(kOp, "topk_idx must be rank 2 [tokens, top_k], got " + dims_str(idx_dims));
  if (first_expert.dimensions().size() != 0) return invalid(kOp, "first_expert must be a scalar s32");
  if (group_sizes->dimensions().size() != 1)
    return invalid(kOp, "group_sizes must be rank 1 [num_experts], got " + dims_str(group_sizes->dimensions()));
  const int64_t tokens = idx_dims[0], top_k = idx_dims[1];
  const int64_t num_experts = group_sizes->dimensions()[0];
  if (num_experts <= 0 || num_experts > mok::kMaxExpertsForCount)
    return invalid(kOp, "num_experts must be in [1, " + std::to_string(mok::kMaxExpertsForCount) + "], got " +
                            std::to_string(num_experts));
  if (attrs.block <= 0) return invalid(kOp, "block must be positive, got " + std::to_string(attrs.block));
  if (attrs.chunk <= 0) return invalid(kOp, "chunk must be positive, got " + std::to_string(attrs.chunk));
  const int64_t slots = tokens * top_k;
  const int64_t rows = slots + int64_t(attrs.block) * num_experts;
  if (rows >= (int64_t(1) << 31))
    return invalid(kOp, "the layout's rows T * k + block * E = " + std::to_string(rows) + " must be below 2^31");
  if (!dims_are(pos->dimensions(), {tokens, top_k}))
    return invalid(kOp, "pos must be " + shape_str({tokens, top_k}) + ", got " + dims_str(pos->dimensions()));
  if (!dims_are(src_token->dimensions(), {rows}))
    return invalid(kOp, "src_token must be " + shape_str({rows}) + " (T * k + block * E), got " +
                            dims_str(src_token->dimensions()));
  if (!dims_are(src_slot->dimensions(), {rows}))
    return invalid(kOp, "src_slot must be " + shape_str({rows}) + " (T * k + block * E), got " +
                            dims_str(src_slot->dimensions()));
  const int64_t words = mok::expert_layout_scratch_words(slots, num_experts, attrs.chunk);
  if (words >= (int64_t(1) << 31)) return invalid(kOp, "chunk is too small: " + std::to_string(words) + " words");
  if (!dims_are(scratch->dimensions(), {words}))
    return invalid(kOp, "scratch must be " + shape_str({words}) + ", got " + dims_str(scratch->dimensions()));
  mok::ExpertLayoutParams p{};
  p.topk_idx = topk_idx.typed_data();
  p.first_expert = first_expert.typed_data();
  p.num_slots = slots;
  p.top_k = static_cast<int32_t>(top_k);
  p.num_experts = static_cast<int32_t>(num_experts);
  p.block = attrs.block;
  p.chunk = attrs.chunk;
  p.pos = pos->typed_data();
  p.src_token = src_token->typed_data();
  p.src_slot = src_slot->typed_data();
  p.group_sizes = group_sizes->typed_data();
  p.scratch = scratch->typed_data();
  return mok::ffi_util::cuda_error(kOp, mok::launch_expert_layout(p, stream));
}

}  // namespace

MOK_FFI_HANDLER(MokExpertCounts, expert_counts_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>());

MOK_FFI_HANDLER(MokExpertLayout, expert_layout_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Attrs<ExpertLayoutAttrs>());
