// XLA FFI handler for mok/routing.cuh: mok_expert_counts.
//   topk_idx: s32[T, k]  ->  counts: s32[E], num_invalid: s32[]
#include "ffi_common.h"
#include "mok/routing.cuh"

namespace ffi = xla::ffi;

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

}  // namespace

MOK_FFI_HANDLER(MokExpertCounts, expert_counts_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>());

