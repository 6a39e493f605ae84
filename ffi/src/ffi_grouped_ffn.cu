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

using mok::ffi_util::dims_are;
using mok::ffi_util::dims_str;
using mok::ffi_util::shape_str;

ffi::Error grouped_ffn_impl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                            ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::BF16> h,
                            ffi::ResultBuffer<ffi::S32> status, GroupedFfnAttrs attrs) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_grouped_ffn";
  using mok::ffi_util::invalid;
  mok::ffi_util::GroupedFfnSizes s{};
  if (ffi::Error err = mok::ffi_util::grouped_ffn_sizes(kOp, x.dimensions(), group_sizes.dimensions(), &s);
      err.failure())
    return err;
  const auto gu = gate_up.dimensions();
  if (gu.size() != 3) return invalid(kOp, "gate_up must be rank 3 [E, H, 2I], got " + dims_str(gu));
  if (down.dimensions().size() != 3)
    return invalid(kOp, "down must be rank 3 [E, I, H], got " + dims_str(down.dimensions()));
  if (gu[0] != s.experts || gu[1] != s.hidden || gu[2] % 2 != 0)
    return invalid(kOp, "gate_up must be [E, H, 2I] = [" + std::to_string(s.experts) + ", " +
                            std::to_string(s.hidden) + ", 2I], got " + dims_str(gu));
  s.intermediate = gu[2] / 2;
  if (!dims_are(down.dimensions(), {s.experts, s.intermediate, s.hidden}))
    return invalid(kOp, "down must be [E, I, H] = " + shape_str({s.experts, s.intermediate, s.hidden}) + ", got " +
                            dims_str(down.dimensions()));

  mok::GroupedFfnParams p{};
  p.gate_up = gate_up.untyped_data();
  p.down = down.untyped_data();
  if (ffi::Error err = mok::ffi_util::fill_grouped_ffn(kOp, s, attrs.num_sms, x, group_sizes, y, h, status, &p);
      err.failure())
    return err;
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
