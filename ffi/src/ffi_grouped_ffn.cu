// XLA FFI handler for mok/grouped_ffn.cuh: mok_grouped_ffn, plus a C entry point on raw device pointers
// (used by tests that must place the op next to another kernel on a second stream, and by benchmarks).
//   x: bf16[M, H], group_sizes: s32[E], gate_up: bf16[E, H, 2I], down: bf16[E, I, H]
//   -> y: bf16[M, H], h: bf16[M, I], status: s32[]            attrs: {num_sms: s32, 0 = all SMs}
#include "ffi_common.h"
#include "mok/grouped_ffn.cuh"

namespace ffi = xla::ffi;

struct GroupedFfnAttrs {
  int32_t num_sms;
};
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(GroupedFfnAttrs, ::xla::ffi::StructMember<int32_t>("num_sms"));

namespace {

using mok::ffi_util::dims_str;

ffi::Error grouped_ffn_impl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                            ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::BF16> h,
                            ffi::ResultBuffer<ffi::S32> status, GroupedFfnAttrs attrs) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_grouped_ffn";
  using mok::ffi_util::invalid;
  if (x.dimensions().size() != 2) return invalid(kOp, "x must be rank 2 [M, H], got " + dims_str(x.dimensions()));
  if (group_sizes.dimensions().size() != 1)
    return invalid(kOp, "group_sizes must be rank 1 [E], got " + dims_str(group_sizes.dimensions()));
  if (gate_up.dimensions().size() != 3)
    return invalid(kOp, "gate_up must be rank 3 [E, H, 2I], got " + dims_str(gate_up.dimensions()));
  if (down.dimensions().size() != 3)
    return invalid(kOp, "down must be rank 3 [E, I, H], got " + dims_str(down.dimensions()));
  const int64_t m = x.dimensions()[0], hidden = x.dimensions()[1], e = group_sizes.dimensions()[0];
  const auto gu = gate_up.dimensions();
  if (gu[0] != e || gu[1] != hidden || gu[2] % 2 != 0)
    return invalid(kOp, "gate_up must be [E, H, 2I] = [" + std::to_string(e) + ", " + std::to_string(hidden) +
                            ", 2I], got " + dims_str(gu));
  const int64_t inter = gu[2] / 2;
  const auto dn = down.dimensions();
  if (dn[0] != e || dn[1] != inter || dn[2] != hidden)
    return invalid(kOp, "down must be [E, I, H] = [" + std::to_string(e) + ", " + std::to_string(inter) + ", " +
                            std::to_string(hidden) + "], got " + dims_str(dn));
  if (y->dimensions().size() != 2 || y->dimensions()[0] != m || y->dimensions()[1] != hidden)
    return invalid(kOp, "y must be [M, H], got " + dims_str(y->dimensions()));
  if (h->dimensions().size() != 2 || h->dimensions()[0] != m || h->dimensions()[1] != inter)
    return invalid(kOp, "h must be [M, I], got " + dims_str(h->dimensions()));
  if (status->element_count() != 1) return invalid(kOp, "status must be a scalar s32");

  mok::GroupedFfnParams p{};
  p.x = x.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.gate_up = gate_up.untyped_data();
  p.down = down.untyped_data();
  p.y = y->untyped_data();
  p.h = h->untyped_data();
  p.status = status->typed_data();
  p.num_rows = m;
  p.hidden = hidden;
  p.intermediate = inter;
  p.num_experts = e;
  p.num_sms = attrs.num_sms;
  if (const char* why = mok::grouped_ffn_unsupported(p)) return invalid(kOp, why);
  return mok::ffi_util::cuda_error(kOp, mok::launch_grouped_ffn(p, stream));
}

}  // namespace

MOK_FFI_HANDLER(MokGroupedFfn, grouped_ffn_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::BF16>>()   // x
                    .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes
                    .Arg<ffi::Buffer<ffi::BF16>>()   // gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>()   // down
                    .Ret<ffi::Buffer<ffi::BF16>>()   // y
                    .Ret<ffi::Buffer<ffi::BF16>>()   // h
                    .Ret<ffi::Buffer<ffi::S32>>()    // status
                    .Attrs<GroupedFfnAttrs>());

// Raw entry points (C ABI). Return a cudaError_t value; -1 for unsupported shapes.
extern "C" __attribute__((visibility("default"))) int MokGroupedFfnRaw(
    const void* x, const int32_t* group_sizes, const void* gate_up, const void* down, void* y, void* h,
    int32_t* status, int64_t num_rows, int64_t hidden, int64_t intermediate, int64_t num_experts, int32_t num_sms,
    void* stream) {
  mok::GroupedFfnParams p{x, group_sizes, gate_up, down, y, h, status, num_rows, hidden, intermediate, num_experts,
                          num_sms};
  if (mok::grouped_ffn_unsupported(p)) return -1;
  return int(mok::launch_grouped_ffn(p, static_cast<cudaStream_t>(stream)));
}

extern "C" __attribute__((visibility("default"))) int MokOccupySmsRaw(int32_t num_blocks, int64_t duration_ns,
                                                                     int32_t* started, void* stream) {
  return int(mok::launch_occupy_sms(num_blocks, duration_ns, started, static_cast<cudaStream_t>(stream)));
}
