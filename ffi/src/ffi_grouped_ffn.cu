// XLA FFI handlers for mok/grouped_ffn.cuh, one per precision: mok_grouped_ffn (bf16) and mok_fp8_grouped_ffn (FP8),
// plus C entry points on raw device pointers (used by tests that must place the op next to another kernel on a
// second stream, and by benchmarks). Both decode x and group_sizes, check the weights of their precision, fill the
// one GroupedFfnParams and take one path to launch_grouped_ffn.
//   mok_grouped_ffn:     x: bf16[M, H], group_sizes: s32[E], gate_up: bf16[E, H, 2I], down: bf16[E, I, H]
//                        -> y: bf16[M, H], h: bf16[M, I], status: s32[]
//   mok_fp8_grouped_ffn: x: bf16[M, H], group_sizes: s32[E],
//                        gate_up: f8e4m3fn[E, 2I, H], gate_up_scale: f32[E, 2I/128, H/128],
//                        down: f8e4m3fn[E, H, I], down_scale: f32[E, H/128, I/128]
//                        -> y: bf16[M, H], h: f8e4m3fn[M, I], h_scale: f32[I/128, M], x_q: f8e4m3fn[M, H],
//                           x_scale: f32[H/128, M], status: s32[]
//   attrs (both): {num_sms: s32, 0 = all SMs}
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
using mok::ffi_util::invalid;
using mok::ffi_util::shape_str;

// The FP8 op's scale and quantised-x buffers against the sizes (after the op's limits: they count whole 128-blocks).
ffi::Error check_fp8_buffers(const char* op, const mok::ffi_util::GroupedFfnSizes& s, ffi::AnyBuffer& down,
                             ffi::Buffer<ffi::F32>& gate_up_scale, ffi::Buffer<ffi::F32>& down_scale,
                             ffi::ResultBuffer<ffi::F32>& h_scale, ffi::Result<ffi::AnyBuffer>& x_q,
                             ffi::ResultBuffer<ffi::F32>& x_scale) {
  const int64_t m = s.rows, hidden = s.hidden, inter = s.intermediate, e = s.experts;
  const int64_t hb = hidden / 128, ib = inter / 128;
  if (!dims_are(gate_up_scale.dimensions(), {e, 2 * ib, hb}))
    return invalid(op, "gate_up_scale must be [E, 2I/128, H/128] = " + shape_str({e, 2 * ib, hb}) + ", got " +
                           dims_str(gate_up_scale.dimensions()));
  if (!dims_are(down.dimensions(), {e, hidden, inter}))
    return invalid(op, "down must be [E, H, I] = " + shape_str({e, hidden, inter}) + ", got " +
                           dims_str(down.dimensions()));
  if (!dims_are(down_scale.dimensions(), {e, hb, ib}))
    return invalid(op, "down_scale must be [E, H/128, I/128] = " + shape_str({e, hb, ib}) + ", got " +
                           dims_str(down_scale.dimensions()));
  if (!dims_are(h_scale->dimensions(), {ib, m}))
    return invalid(op, "h_scale must be [I/128, M], got " + dims_str(h_scale->dimensions()));
  if (!dims_are(x_q->dimensions(), {m, hidden}))
    return invalid(op, "x_q must be [M, H], got " + dims_str(x_q->dimensions()));
  if (!dims_are(x_scale->dimensions(), {hb, m}))
    return invalid(op, "x_scale must be [H/128, M], got " + dims_str(x_scale->dimensions()));
  return ffi::Error::Success();
}

ffi::Error grouped_ffn_impl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                            ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::BF16> h,
                            ffi::ResultBuffer<ffi::S32> status, GroupedFfnAttrs attrs) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_grouped_ffn";
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
  p.precision = mok::GroupedFfnPrecision::kBf16;
  p.gate_up = gate_up.untyped_data();
  p.down = down.untyped_data();
  if (ffi::Error err = mok::ffi_util::fill_grouped_ffn(kOp, s, attrs.num_sms, x, group_sizes, y, h, status, &p);
      err.failure())
    return err;
  if (const char* why = mok::grouped_ffn_unsupported(p)) return invalid(kOp, why);
  return mok::ffi_util::cuda_error(kOp, mok::launch_grouped_ffn(p, stream));
}

ffi::Error fp8_grouped_ffn_impl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> gate_up_scale,
                                ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                                ffi::ResultBuffer<ffi::BF16> y, ffi::Result<ffi::AnyBuffer> h,
                                ffi::ResultBuffer<ffi::F32> h_scale, ffi::Result<ffi::AnyBuffer> x_q,
                                ffi::ResultBuffer<ffi::F32> x_scale, ffi::ResultBuffer<ffi::S32> status,
                                GroupedFfnAttrs attrs) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_fp8_grouped_ffn";
  // The FFI has no native type for float8 buffers: they arrive untyped and their dtype is checked here.
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"gate_up", &gate_up}, {"down", &down},
                           {"h", &*h}, {"x_q", &*x_q}})
    if (buf->element_type() != ffi::DataType::F8E4M3FN)
      return invalid(kOp, std::string(name) + " must be float8_e4m3fn");
  mok::ffi_util::GroupedFfnSizes s{};
  if (ffi::Error err = mok::ffi_util::grouped_ffn_sizes(kOp, x.dimensions(), group_sizes.dimensions(), &s);
      err.failure())
    return err;
  const auto gu = gate_up.dimensions();
  if (gu.size() != 3) return invalid(kOp, "gate_up must be rank 3 [E, 2I, H], got " + dims_str(gu));
  if (gu[0] != s.experts || gu[1] % 2 != 0 || gu[2] != s.hidden)
    return invalid(kOp, "gate_up must be [E, 2I, H] = [" + std::to_string(s.experts) + ", 2I, " +
                            std::to_string(s.hidden) + "], got " + dims_str(gu));
  s.intermediate = gu[1] / 2;

  mok::GroupedFfnParams p{};
  p.precision = mok::GroupedFfnPrecision::kFp8;
  p.gate_up = gate_up.untyped_data();
  p.down = down.untyped_data();
  p.scales = {gate_up_scale.typed_data(), down_scale.typed_data(), h_scale->typed_data(), x_q->untyped_data(),
              x_scale->typed_data()};
  if (ffi::Error err = mok::ffi_util::fill_grouped_ffn(kOp, s, attrs.num_sms, x, group_sizes, y, h, status, &p);
      err.failure())
    return err;
  // The op's limits first: the scales' shapes count whole 128-blocks of H and I.
  if (const char* why = mok::grouped_ffn_unsupported(p)) return invalid(kOp, why);
  if (ffi::Error err = check_fp8_buffers(kOp, s, down, gate_up_scale, down_scale, h_scale, x_q, x_scale);
      err.failure())
    return err;
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

MOK_FFI_HANDLER(MokFp8GroupedFfn, fp8_grouped_ffn_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::BF16>>()       // x
                    .Arg<ffi::Buffer<ffi::S32>>()        // group_sizes
                    .Arg<ffi::AnyBuffer>()              // gate_up (f8e4m3fn)
                    .Arg<ffi::Buffer<ffi::F32>>()        // gate_up_scale
                    .Arg<ffi::AnyBuffer>()              // down (f8e4m3fn)
                    .Arg<ffi::Buffer<ffi::F32>>()        // down_scale
                    .Ret<ffi::Buffer<ffi::BF16>>()       // y
                    .Ret<ffi::AnyBuffer>()              // h (f8e4m3fn)
                    .Ret<ffi::Buffer<ffi::F32>>()        // h_scale
                    .Ret<ffi::AnyBuffer>()              // x_q (f8e4m3fn)
                    .Ret<ffi::Buffer<ffi::F32>>()        // x_scale
                    .Ret<ffi::Buffer<ffi::S32>>()        // status
                    .Attrs<GroupedFfnAttrs>());

// Raw entry points (C ABI). Return a cudaError_t value; -1 for unsupported shapes.
namespace {
int launch_raw(const mok::GroupedFfnParams& p, void* stream) {
  if (mok::grouped_ffn_unsupported(p)) return -1;
  return int(mok::launch_grouped_ffn(p, static_cast<cudaStream_t>(stream)));
}
}  // namespace

extern "C" __attribute__((visibility("default"))) int MokGroupedFfnRaw(
    const void* x, const int32_t* group_sizes, const void* gate_up, const void* down, void* y, void* h,
    int32_t* status, int64_t num_rows, int64_t hidden, int64_t intermediate, int64_t num_experts, int32_t num_sms,
    void* stream) {
  return launch_raw({x, group_sizes, gate_up, down, y, h, status, num_rows, hidden, intermediate, num_experts, num_sms,
                     mok::GroupedFfnPrecision::kBf16},
                    stream);
}

extern "C" __attribute__((visibility("default"))) int MokFp8GroupedFfnRaw(
    const void* x, const int32_t* group_sizes, const void* gate_up, const float* gate_up_scale, const void* down,
    const float* down_scale, void* y, void* h, float* h_scale, void* x_q, float* x_scale, int32_t* status,
    int64_t num_rows, int64_t hidden, int64_t intermediate, int64_t num_experts, int32_t num_sms, void* stream) {
  return launch_raw({x, group_sizes, gate_up, down, y, h, status, num_rows, hidden, intermediate, num_experts, num_sms,
                     mok::GroupedFfnPrecision::kFp8, {gate_up_scale, down_scale, h_scale, x_q, x_scale}},
                    stream);
}

extern "C" __attribute__((visibility("default"))) int MokOccupySmsRaw(int32_t num_blocks, int64_t duration_ns,
                                                                     int32_t* started, void* stream) {
  return int(mok::launch_occupy_sms(num_blocks, duration_ns, started, static_cast<cudaStream_t>(stream)));
}
