// XLA FFI handlers for mok/comm: mok_comm_dispatch and mok_comm_combine.
//
//   mok_comm_dispatch(x: bf16[T, H], topk_idx: s32[T, k], topk_weight: f32[T, k])
//     -> recv_x: bf16[C, H] (token_major: bf16[ep * T, H]), group_sizes: s32[L], row_table: s32[ep, T, k],
//        row_weight: f32[ep, T, k], row_source: s32[C], status: s32[4]
//   mok_comm_combine(expert_out: bf16[C, H], row_table: s32[ep, T, k], row_weight: f32[ep, T, k],
//                    topk_idx: s32[T, k]) -> y: bf16[T, H], status: s32[4]
//   attributes (one dictionary, CommCallAttrs): ws_id, mode (0 pull, 1 push), num_sms, zero_padding,
//   token_major
//
// The handler finds this device's workspace by (ws_id, XLA's device ordinal), refuses to
// launch on a poisoned workspace (returning the recorded error, which names the op and the rank),
// checks shapes, fills Params and launches. No host synchronisation, no device-to-host copy.
#include <cuda_bf16.h>


#include <string>

#include "ffi_common.h"
#include "mok/comm/combine.cuh"
#include "mok/comm/dispatch.cuh"
#include "mok/comm/registry.h"

namespace ffi = xla::ffi;

struct CommCallAttrs {
  int64_t ws_id;
  int32_t mode;
  int32_t num_sms;
  int32_t zero_padding;
  int32_t token_major;
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(CommCallAttrs, StructMember<int64_t>("ws_id"), StructMember<int32_t>("mode"),
                                      StructMember<int32_t>("num_sms"), StructMember<int32_t>("zero_padding"),
                                      StructMember<int32_t>("token_major"));

namespace {

using mok::ffi_util::cuda_error;
using mok::ffi_util::invalid;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Resolve (ws_id, XLA's device ordinal) to a connected, healthy view, or an error naming the op. The ordinal,
// not cudaStreamGetDevice (ffi_common.h).
ffi::Error resolve(const char* op, int32_t device_ordinal, const CommCallAttrs& attrs, mok::comm::CommView* view) {
  uint64_t host_error = 0;
  const std::string why = mok::comm::lookup_view(attrs.ws_id, device_ordinal, view, &host_error);
  if (!why.empty()) return invalid(op, why);
  if (host_error != 0)
    return ffi::Error::Internal(std::string(op) + " (CUDA device " + std::to_string(device_ordinal) +
                                "): " + mok::comm::describe_error(host_error));
  if (attrs.mode != 0 && attrs.mode != 1) return invalid(op, "mode must be 0 (pull) or 1 (push)");
  if (attrs.num_sms < 1 || attrs.num_sms > 4096) return invalid(op, "num_sms must be in [1, 4096]");
  return ffi::Error::Success();
}

ffi::Error check_routing_shapes(const char* op, const mok::comm::CommView& v, int64_t tokens, int64_t top_k) {
  if (tokens < 1 || tokens > v.shape.max_tokens)
    return invalid(op, "tokens (" + std::to_string(tokens) + ") must be in [1, max_tokens = " +
                           std::to_string(v.shape.max_tokens) + "]");
  if (top_k < 1 || top_k > v.shape.top_k)
    return invalid(op, "top_k (" + std::to_string(top_k) + ") must be in [1, " + std::to_string(v.shape.top_k) + "]");
  return ffi::Error::Success();
}

ffi::Error dispatch_impl(cudaStream_t stream, int32_t device_ordinal, CommCallAttrs attrs,
                         ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weight,
                         ffi::ResultBuffer<ffi::BF16> recv_x, ffi::ResultBuffer<ffi::S32> group_sizes,
                         ffi::ResultBuffer<ffi::S32> row_table, ffi::ResultBuffer<ffi::F32> row_weight,
                         ffi::ResultBuffer<ffi::S32> row_source, ffi::ResultBuffer<ffi::S32> status) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_comm_dispatch";
  mok::comm::CommView v{};
  if (ffi::Error e = resolve(kOp, device_ordinal, attrs, &v); e.failure()) return e;
  if (x.dimensions().size() != 2 || x.dimensions()[1] != v.shape.hidden)
    return invalid(kOp, "x must be [tokens, hidden_size = " + std::to_string(v.shape.hidden) + "]");
  const int64_t T = x.dimensions()[0];
  if (topk_idx.dimensions().size() != 2 || topk_idx.dimensions()[0] != T)
    return invalid(kOp, "topk_idx must be [tokens, top_k]");
  const int64_t k = topk_idx.dimensions()[1];
  if (ffi::Error e = check_routing_shapes(kOp, v, T, k); e.failure()) return e;
  if (topk_weight.dimensions().size() != 2 || topk_weight.dimensions()[0] != T || topk_weight.dimensions()[1] != k)
    return invalid(kOp, "topk_weight must have topk_idx's shape");
  const int64_t ep = v.shape.ep, L = v.shape.num_local_experts();
  const int64_t capacity = row_source->element_count();
  if (capacity < 1 || capacity >= (int64_t(1) << 31)) return invalid(kOp, "capacity must be in [1, 2^31)");
  const int64_t recv_rows = attrs.token_major ? ep * T : capacity;
  if (recv_x->dimensions().size() != 2 || recv_x->dimensions()[0] != recv_rows ||
      recv_x->dimensions()[1] != v.shape.hidden)
    return invalid(kOp, attrs.token_major ? "recv_x must be [ep * tokens, hidden_size] (token_major)"
                                          : "recv_x must be [capacity, hidden_size] (capacity = row_source's size)");
  if (group_sizes->element_count() != L) return invalid(kOp, "group_sizes must be [num_experts / ep]");
  if (row_table->element_count() != ep * T * k || row_weight->element_count() != ep * T * k)
    return invalid(kOp, "row_table and row_weight must be [ep, tokens, top_k]");
  if (status->element_count() != 4) return invalid(kOp, "status must be int32[4]");
  if (!aligned16(x.untyped_data()) || !aligned16(recv_x->untyped_data()))
    return invalid(kOp, "x and recv_x must be 16-byte aligned");
  mok::comm::DispatchParams p{};
  p.view = v;
  p.mode = attrs.mode == 0 ? mok::comm::CommMode::kPull : mok::comm::CommMode::kPush;
  p.num_tokens = int32_t(T);
  p.top_k = int32_t(k);
  p.capacity = int32_t(capacity);
  p.num_blocks = attrs.num_sms;
  p.zero_padding = attrs.zero_padding != 0;
  p.token_major = attrs.token_major != 0;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.untyped_data());
  p.topk_idx = topk_idx.typed_data();
  p.topk_weight = topk_weight.typed_data();
  p.recv_x = reinterpret_cast<__nv_bfloat16*>(recv_x->untyped_data());
  p.group_sizes = group_sizes->typed_data();
  p.row_table = row_table->typed_data();
  p.row_weight = row_weight->typed_data();
  p.row_source = row_source->typed_data();
  p.status = status->typed_data();
  return cuda_error(kOp, mok::comm::launch_dispatch(p, stream));
}

ffi::Error combine_impl(cudaStream_t stream, int32_t device_ordinal, CommCallAttrs attrs,
                        ffi::Buffer<ffi::BF16> expert_out, ffi::Buffer<ffi::S32> row_table,
                        ffi::Buffer<ffi::F32> row_weight, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::S32> status) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_comm_combine";
  mok::comm::CommView v{};
  if (ffi::Error e = resolve(kOp, device_ordinal, attrs, &v); e.failure()) return e;
  if (expert_out.dimensions().size() != 2 || expert_out.dimensions()[1] != v.shape.hidden)
    return invalid(kOp, "expert_out must be [capacity, hidden_size = " + std::to_string(v.shape.hidden) + "]");
  const int64_t capacity = expert_out.dimensions()[0];
  if (capacity < 1 || capacity >= (int64_t(1) << 31)) return invalid(kOp, "capacity must be in [1, 2^31)");
  if (topk_idx.dimensions().size() != 2) return invalid(kOp, "topk_idx must be [tokens, top_k]");
  const int64_t T = topk_idx.dimensions()[0], k = topk_idx.dimensions()[1];
  if (ffi::Error e = check_routing_shapes(kOp, v, T, k); e.failure()) return e;
  const int64_t ep = v.shape.ep;
  if (row_table.dimensions().size() != 3 || row_table.dimensions()[0] != ep || row_table.dimensions()[1] != T ||
      row_table.dimensions()[2] != k)
    return invalid(kOp, "row_table must be [ep, tokens, top_k]");
  if (row_weight.element_count() != ep * T * k) return invalid(kOp, "row_weight must be [ep, tokens, top_k]");
  if (y->dimensions().size() != 2 || y->dimensions()[0] != T || y->dimensions()[1] != v.shape.hidden)
    return invalid(kOp, "y must be [tokens, hidden_size]");
  if (status->element_count() != 4) return invalid(kOp, "status must be int32[4]");
  if (!aligned16(expert_out.untyped_data()) || !aligned16(y->untyped_data()))
    return invalid(kOp, "expert_out and y must be 16-byte aligned");
  mok::comm::CombineParams p{};
  p.view = v;
  p.mode = attrs.mode == 0 ? mok::comm::CommMode::kPull : mok::comm::CommMode::kPush;
  p.num_tokens = int32_t(T);
  p.top_k = int32_t(k);
  p.capacity = int32_t(capacity);
  p.num_blocks = attrs.num_sms;
  p.expert_out = reinterpret_cast<const __nv_bfloat16*>(expert_out.untyped_data());
  p.row_table = row_table.typed_data();
  p.row_weight = row_weight.typed_data();
  p.topk_idx = topk_idx.typed_data();
  p.y = reinterpret_cast<__nv_bfloat16*>(y->untyped_data());
  p.status = status->typed_data();
  return cuda_error(kOp, mok::comm::launch_combine(p, stream));
}

}  // namespace

MOK_FFI_HANDLER(MokCommDispatch, dispatch_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Ctx<ffi::DeviceOrdinal>()
                    .Attrs<CommCallAttrs>()
                    .Arg<ffi::Buffer<ffi::BF16>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Arg<ffi::Buffer<ffi::F32>>()
                    .Ret<ffi::Buffer<ffi::BF16>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::F32>>()
                    .Ret<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::S32>>());

MOK_FFI_HANDLER(MokCommCombine, combine_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Ctx<ffi::DeviceOrdinal>()
                    .Attrs<CommCallAttrs>()
                    .Arg<ffi::Buffer<ffi::BF16>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Arg<ffi::Buffer<ffi::F32>>()
                    .Arg<ffi::Buffer<ffi::S32>>()
                    .Ret<ffi::Buffer<ffi::BF16>>()
                    .Ret<ffi::Buffer<ffi::S32>>());
