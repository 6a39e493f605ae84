// XLA FFI handlers of the MoE forward megakernel (mok/moe/forward.cuh): mok_moe_forward and, with the routed
// experts in FP8, mok_moe_forward_fp8; plus the C entry points that tell Python how large the per-call scratch
// output is and why a call is unsupported.
//
//   mok_moe_forward(x: bf16[R, T, H], topk_idx: s32[R, T, k], topk_weight: f32[R, T, k],
//                   gate_up: bf16[R, L, H, 2I], down: bf16[R, L, I, H],
//                   shared_gate_up: bf16[H, 2Is], shared_down: bf16[Is, H],       (Is = 0: no shared expert)
//                   keep_pos: s32[R, ep T k] or s32[R, 0])
//     -> y: bf16[R, T, H], status: s32[R, 4], scratch: u8[R, bytes], keep_gu: bf16[R, rows, 2I] (rows = 0 with
//        keep_pos [R, 0]: nothing kept; else the kept g, u of mok/moe/forward.cuh's ForwardRank::keep_gu),
//        keep_shared_gu: bf16[R, T, 2Is] (the shared expert's kept g, u: ForwardRank::keep_shared_gu) or
//        bf16[R, 0, 2Is] (not kept)
//   R = 1 (the calling rank) or R = ep (every rank of an emulated workspace on this device, at most
//   kMaxEmulatedRanks; above kMaxVirtualRanks each rank's kernel parameters travel in its row of scratch).
//   mok_moe_forward_fp8(x, topk_idx, topk_weight, gate_up: f8e4m3fn[R, L, 2I, H], gate_up_scale: f32[R, L, 2I/128,
//                       H/128], down: f8e4m3fn[R, L, H, I], down_scale: f32[R, L, H/128, I/128], shared_gate_up,
//                       shared_down) -> y, status, scratch        (mok_jax.fp8.quantize_expert_weights per rank)
//   attributes (one dictionary, MoeForwardAttrs): ws_id, granularity, comm_items, ring_slots, dispatch_push,
//   num_sms, identity_experts (a test mode), skip_rank (a fault-injection test mode), timing_mode (a bench-only timing
//   mode: TimingMode bits). A call with skip_rank >= 0 or timing_mode != 0 runs the kernel's lab form (bf16 only: the
//   FP8 handler refuses them), the only form with their code (mok/moe/forward.cuh, ForwardKnobs). The combine has no
//   knob: the owners push each slot's row into the origin's combine_rows (mok/moe/items/send.cuh, SendItem).
//
// The handler finds the rank(s) of (ws_id, XLA's device ordinal), refuses to launch on a poisoned workspace
// and reports (then clears) a call error that an earlier call left, checks every shape against the
// workspace, fills the launch arguments and launches. No host synchronisation, no device-to-host copy.
#include <cuda_bf16.h>

#include <cstdio>
#include <string>
#include <vector>

#include "ffi_common.h"
#include "mok/comm/registry.h"
#include "mok/moe/forward.cuh"

namespace ffi = xla::ffi;

struct MoeForwardAttrs {
  int64_t ws_id;
  int32_t granularity;
  int32_t comm_items;
  int32_t ring_slots;
  int32_t dispatch_push;
  int32_t num_sms;
  int32_t identity_experts;
  int32_t skip_rank;
  int32_t timing_mode;
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(MoeForwardAttrs, StructMember<int64_t>("ws_id"),
                                      StructMember<int32_t>("granularity"), StructMember<int32_t>("comm_items"),
                                      StructMember<int32_t>("ring_slots"), StructMember<int32_t>("dispatch_push"),
                                      StructMember<int32_t>("num_sms"), StructMember<int32_t>("identity_experts"),
                                      StructMember<int32_t>("skip_rank"), StructMember<int32_t>("timing_mode"));

namespace {

using mok::ffi_util::cuda_error;
using mok::ffi_util::dims_are;
using mok::ffi_util::dims_str;
using mok::ffi_util::invalid;

mok::moe::ForwardKnobs knobs_of(const MoeForwardAttrs& a) {
  return mok::moe::ForwardKnobs{a.granularity, a.comm_items, a.ring_slots, a.dispatch_push,
                                a.num_sms, a.identity_experts, a.skip_rank, a.timing_mode};
}

// The routed weights of a call as a handler decoded them: rank r's gate_up at gate_up + r * gate_up_rank bytes,
// and so on; the scales only with FP8.
struct RoutedWeights {
  int64_t L = 0, I = 0;
  const uint8_t* gate_up = nullptr;
  const uint8_t* down = nullptr;
  int64_t gate_up_rank = 0, down_rank = 0;  // bytes per rank
  const float* gate_up_scale = nullptr;
  const float* down_scale = nullptr;
  int64_t gate_up_scale_rank = 0, down_scale_rank = 0;  // floats per rank
  bool fp8 = false;
};

// bf16 routed weights: gate_up [R, L, H, 2I], down [R, L, I, H].
ffi::Error decode_bf16_routed(const char* op, int64_t R, int64_t H, int64_t num_local, ffi::Buffer<ffi::BF16>& gate_up,
                              ffi::Buffer<ffi::BF16>& down, RoutedWeights* rw) {
  const auto gu = gate_up.dimensions();
  if (gu.size() != 4 || gu[0] != R || gu[2] != H || gu[3] % 2)
    return invalid(op, "gate_up must be [ranks, experts per rank, H, 2I], got " + dims_str(gu));
  rw->L = gu[1], rw->I = gu[3] / 2;
  if (rw->L != num_local)
    return invalid(op, "gate_up holds " + std::to_string(rw->L) + " experts per rank, the workspace " +
                           std::to_string(num_local));
  if (!dims_are(down.dimensions(), {R, rw->L, rw->I, H}))
    return invalid(op, "down must be [ranks, L, I, H], got " + dims_str(down.dimensions()));
  rw->gate_up = static_cast<const uint8_t*>(gate_up.untyped_data());
  rw->down = static_cast<const uint8_t*>(down.untyped_data());
  rw->gate_up_rank = rw->L * H * 2 * rw->I * 2;
  rw->down_rank = rw->L * rw->I * H * 2;
  return ffi::Error::Success();
}

// FP8 routed weights (mok_jax.fp8.quantize_expert_weights per rank): gate_up e4m3 [R, L, 2I, H] with gate_up_scale
// f32 [R, L, 2I/128, H/128], down e4m3 [R, L, H, I] with down_scale f32 [R, L, H/128, I/128].
ffi::Error decode_fp8_routed(const char* op, int64_t R, int64_t H, int64_t num_local, ffi::AnyBuffer& gate_up,
                             ffi::Buffer<ffi::F32>& gate_up_scale, ffi::AnyBuffer& down,
                             ffi::Buffer<ffi::F32>& down_scale, RoutedWeights* rw) {
  // The FFI has no native type for float8 buffers: they arrive untyped and their dtype is checked here.
  if (gate_up.element_type() != ffi::DataType::F8E4M3FN || down.element_type() != ffi::DataType::F8E4M3FN)
    return invalid(op, "gate_up and down must be float8_e4m3fn");
  const auto gu = gate_up.dimensions();
  if (gu.size() != 4 || gu[0] != R || gu[3] != H || gu[2] % 2)
    return invalid(op, "gate_up must be [ranks, experts per rank, 2I, H] (K-major E4M3), got " + dims_str(gu));
  rw->L = gu[1], rw->I = gu[2] / 2, rw->fp8 = true;
  if (rw->L != num_local)
    return invalid(op, "gate_up holds " + std::to_string(rw->L) + " experts per rank, the workspace " +
                           std::to_string(num_local));
  if (H % 128 || rw->I % 128)
    return invalid(op, "FP8 routed experts need H and I multiples of 128, got H " + std::to_string(H) + ", I " +
                           std::to_string(rw->I));
  const int64_t L = rw->L, I = rw->I, hb = H / 128, ib = I / 128;
  if (!dims_are(down.dimensions(), {R, L, H, I}))
    return invalid(op, "down must be [ranks, L, H, I] (K-major E4M3), got " + dims_str(down.dimensions()));
  if (!dims_are(gate_up_scale.dimensions(), {R, L, 2 * ib, hb}))
    return invalid(op, "gate_up_scale must be [ranks, L, 2I/128, H/128], got " + dims_str(gate_up_scale.dimensions()));
  if (!dims_are(down_scale.dimensions(), {R, L, hb, ib}))
    return invalid(op, "down_scale must be [ranks, L, H/128, I/128], got " + dims_str(down_scale.dimensions()));
  rw->gate_up = static_cast<const uint8_t*>(gate_up.untyped_data());
  rw->down = static_cast<const uint8_t*>(down.untyped_data());
  rw->gate_up_rank = L * 2 * I * H;
  rw->down_rank = L * H * I;
  rw->gate_up_scale = gate_up_scale.typed_data();
  rw->down_scale = down_scale.typed_data();
  rw->gate_up_scale_rank = L * 2 * ib * hb;
  rw->down_scale_rank = L * hb * ib;
  return ffi::Error::Success();
}

// Both handlers: look the rank(s) up, check every shape against the workspace, fill the launch arguments, launch.
// decode_routed(R, H, experts per rank, &rw) decodes the routed weights of the handler's precision. keep_pos and
// keep_gu and keep_shared_gu are null for the FP8 handler (it keeps nothing).
template <class DecodeRouted>
ffi::Error forward_impl_common(const char* kOp, cudaStream_t stream, int32_t device_ordinal,
                               const MoeForwardAttrs& attrs, ffi::Buffer<ffi::BF16>& x,
                               ffi::Buffer<ffi::S32>& topk_idx, ffi::Buffer<ffi::F32>& topk_weight,
                               DecodeRouted decode_routed, ffi::Buffer<ffi::BF16>& shared_gate_up,
                               ffi::Buffer<ffi::BF16>& shared_down, ffi::Buffer<ffi::S32>* keep_pos,
                               ffi::ResultBuffer<ffi::BF16>& y, ffi::ResultBuffer<ffi::S32>& status,
                               ffi::ResultBuffer<ffi::U8>& scratch, ffi::ResultBuffer<ffi::BF16>* keep_gu,
                               ffi::ResultBuffer<ffi::BF16>* keep_shared_gu) {
  mok::ffi_util::count_handler_run();
  std::vector<mok::comm::CommView> views;
  uint64_t poison = 0, call_error = 0;
  if (std::string why = mok::comm::lookup_views(attrs.ws_id, device_ordinal, &views, &poison, &call_error);
      !why.empty())
    return invalid(kOp, why);
  if (poison != 0)
    return ffi::Error::Internal(std::string(kOp) + " (CUDA device " + std::to_string(device_ordinal) +
                                "): " + mok::comm::describe_error(poison));
  if (call_error != 0) {
    mok::comm::clear_call_errors(attrs.ws_id, device_ordinal);
    return ffi::Error::InvalidArgument(std::string(kOp) + ": an earlier call on CUDA device " +
                                       std::to_string(device_ordinal) + " failed: " +
                                       mok::comm::describe_error(call_error));
  }
  const auto xd = x.dimensions();
  if (xd.size() != 3) return invalid(kOp, "x must be [ranks, tokens, hidden], got " + dims_str(xd));
  const int64_t R = xd[0], T = xd[1], H = xd[2];
  const mok::comm::CommShape& ws = views[0].shape;
  if (R != int64_t(views.size()))
    return invalid(kOp, "x carries " + std::to_string(R) + " ranks but workspace " + std::to_string(attrs.ws_id) +
                            " has " + std::to_string(views.size()) + " on this device");
  if (R != 1 && R != ws.ep) return invalid(kOp, "an emulated call must carry every EP rank");
  if (R > mok::moe::kMaxEmulatedRanks)
    return invalid(kOp, "an emulated call carries at most " + std::to_string(mok::moe::kMaxEmulatedRanks) +
                            " ranks (one launch), got " + std::to_string(R));
  if (H != ws.hidden)
    return invalid(kOp, "x: hidden size " + std::to_string(H) + " differs from the workspace's " +
                            std::to_string(ws.hidden));
  if (topk_idx.dimensions().size() != 3 || topk_idx.dimensions()[0] != R || topk_idx.dimensions()[1] != T)
    return invalid(kOp, "topk_idx must be [ranks, tokens, top_k], got " + dims_str(topk_idx.dimensions()));
  const int64_t k = topk_idx.dimensions()[2];
  if (!dims_are(topk_weight.dimensions(), {R, T, k}))
    return invalid(kOp, "topk_weight must have topk_idx's shape, got " + dims_str(topk_weight.dimensions()));
  if (k < 1 || k > ws.top_k)
    return invalid(kOp, "top_k (" + std::to_string(k) + ") must be in [1, " + std::to_string(ws.top_k) +
                            "] (the workspace's)");
  RoutedWeights rw;
  if (ffi::Error err = decode_routed(R, H, int64_t(ws.num_experts / ws.ep), &rw); err.failure()) return err;
  const int64_t L = rw.L, I = rw.I;
  const auto sgu = shared_gate_up.dimensions(), sdn = shared_down.dimensions();
  if (sgu.size() != 2 || sgu[0] != H || sgu[1] % 2)
    return invalid(kOp, "shared_gate_up must be [H, 2Is] (Is = 0: none), got " + dims_str(sgu));
  const int64_t Is = sgu[1] / 2;
  if (!dims_are(sdn, {Is, H})) return invalid(kOp, "shared_down must be [Is, H], got " + dims_str(sdn));
  if (ws.ep > 1 && T > ws.max_tokens)
    return invalid(kOp, "tokens (" + std::to_string(T) + ") exceed the workspace's max_tokens (" +
                            std::to_string(ws.max_tokens) + ")");
  mok::moe::ForwardShape shape{int32_t(T), int32_t(H), int32_t(I), int32_t(Is), int32_t(k), int32_t(L), ws.ep};
  shape.routed_fp8 = rw.fp8 ? 1 : 0;
  const mok::moe::ForwardKnobs knobs = knobs_of(attrs);
  if (const char* why = mok::moe::forward_unsupported(shape, knobs)) return invalid(kOp, why);
  const mok::moe::ScratchLayout sl = mok::moe::forward_scratch_layout(shape, knobs);
  if (ws.ep > 1 && sl.microbatches > mok::comm::max_microbatches(ws.max_tokens))
    return invalid(kOp, "more microbatches than the workspace has stamps for");
  if (!dims_are(y->dimensions(), {R, T, H})) return invalid(kOp, "y must be [ranks, tokens, hidden]");
  if (!dims_are(status->dimensions(), {R, 4})) return invalid(kOp, "status must be [ranks, 4]");
  if (scratch->dimensions().size() != 2 || scratch->dimensions()[0] != R ||
      size_t(scratch->dimensions()[1]) < sl.total || scratch->dimensions()[1] % 256)
    return invalid(kOp, "scratch must be u8[ranks, mok_moe_scratch_bytes(...)], got " +
                            dims_str(scratch->dimensions()));
  const size_t bytes = size_t(scratch->dimensions()[1]);
  // Kept g, u: keep_pos [R, ep T k] and keep_gu [R, rows, 2I], or keep_pos [R, 0] and keep_gu [R, 0, 2I] (none).
  const int64_t slots_all = int64_t(ws.ep) * T * k;
  bool keep = false;
  int64_t keep_rows = 0;
  if (keep_pos != nullptr) {
    const auto kp = keep_pos->dimensions(), kg = (*keep_gu)->dimensions();
    if (kp.size() != 2 || kp[0] != R || (kp[1] != 0 && kp[1] != slots_all))
      return invalid(kOp, "keep_pos must be [ranks, 0] or [ranks, ep * tokens * top_k = " +
                              std::to_string(slots_all) + "], got " + dims_str(kp));
    if (kg.size() != 3 || kg[0] != R || kg[2] != 2 * I || (kp[1] == 0) != (kg[1] == 0) ||
        kg[1] >= (int64_t(1) << 31))
      return invalid(kOp, "keep_gu must be [ranks, rows, 2I] with rows > 0 exactly when keep_pos is given, got " +
                              dims_str(kg));
    keep = kp[1] != 0;
    keep_rows = kg[1];
  }
  // The shared expert's kept g, u: keep_shared_gu [R, T, 2Is], or [R, 0, 2Is] (none).
  bool keep_shared = false;
  if (keep_shared_gu != nullptr) {
    const auto ks = (*keep_shared_gu)->dimensions();
    if (ks.size() != 3 || ks[0] != R || ks[2] != 2 * Is || (ks[1] != 0 && ks[1] != T))
      return invalid(kOp, "keep_shared_gu must be [ranks, tokens or 0, 2Is], got " + dims_str(ks));
    keep_shared = ks[1] != 0 && Is > 0;
  }
  std::vector<mok::moe::ForwardRank> ranks(R);
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const auto* ip = topk_idx.typed_data();
  const auto* wp = topk_weight.typed_data();
  auto* yp = static_cast<uint8_t*>(y->untyped_data());
  auto* sp = static_cast<uint8_t*>(scratch->untyped_data());
  for (int64_t r = 0; r < R; ++r) {
    mok::moe::ForwardRank& fr = ranks[r];
    fr.view = views[r];
    fr.x = xp + r * T * H * 2;
    fr.topk_idx = ip + r * T * k;
    fr.topk_weight = wp + r * T * k;
    fr.gate_up = rw.gate_up + r * rw.gate_up_rank;
    fr.down = rw.down + r * rw.down_rank;
    fr.gate_up_scale = rw.fp8 ? rw.gate_up_scale + r * rw.gate_up_scale_rank : nullptr;
    fr.down_scale = rw.fp8 ? rw.down_scale + r * rw.down_scale_rank : nullptr;
    fr.shared_gate_up = shared_gate_up.untyped_data();
    fr.shared_down = shared_down.untyped_data();
    fr.y = yp + r * T * H * 2;
    fr.status = status->typed_data() + r * 4;
    fr.scratch = sp + r * bytes;
    fr.keep_pos = keep ? keep_pos->typed_data() + r * slots_all : nullptr;
    fr.keep_gu = keep ? (*keep_gu)->typed_data() + r * keep_rows * 2 * I : nullptr;
    fr.keep_rows = keep ? int32_t(keep_rows) : 0;
    fr.keep_shared_gu = keep_shared ? (*keep_shared_gu)->typed_data() + r * T * 2 * Is : nullptr;
    if (views[r].rank != (R == 1 ? views[r].rank : r)) return invalid(kOp, "emulated ranks out of order");
  }
  return cuda_error(kOp, mok::moe::launch_forward(shape, knobs, ranks.data(), int(R), stream));
}

ffi::Error forward_impl(cudaStream_t stream, int32_t device_ordinal, MoeForwardAttrs attrs,
                        ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weight,
                        ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                        ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                        ffi::Buffer<ffi::S32> keep_pos, ffi::ResultBuffer<ffi::BF16> y,
                        ffi::ResultBuffer<ffi::S32> status, ffi::ResultBuffer<ffi::U8> scratch,
                        ffi::ResultBuffer<ffi::BF16> keep_gu, ffi::ResultBuffer<ffi::BF16> keep_shared_gu) {
  constexpr const char* kOp = "mok_moe_forward";
  auto decode = [&](int64_t R, int64_t H, int64_t num_local, RoutedWeights* rw) {
    return decode_bf16_routed(kOp, R, H, num_local, gate_up, down, rw);
  };
  return forward_impl_common(kOp, stream, device_ordinal, attrs, x, topk_idx, topk_weight, decode, shared_gate_up,
                             shared_down, &keep_pos, y, status, scratch, &keep_gu, &keep_shared_gu);
}

ffi::Error forward_fp8_impl(cudaStream_t stream, int32_t device_ordinal, MoeForwardAttrs attrs,
                            ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> topk_idx,
                            ffi::Buffer<ffi::F32> topk_weight, ffi::AnyBuffer gate_up,
                            ffi::Buffer<ffi::F32> gate_up_scale, ffi::AnyBuffer down, ffi::Buffer<ffi::F32> down_scale,
                            ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                            ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::S32> status,
                            ffi::ResultBuffer<ffi::U8> scratch) {
  constexpr const char* kOp = "mok_moe_forward_fp8";
  auto decode = [&](int64_t R, int64_t H, int64_t num_local, RoutedWeights* rw) {
    return decode_fp8_routed(kOp, R, H, num_local, gate_up, gate_up_scale, down, down_scale, rw);
  };
  return forward_impl_common(kOp, stream, device_ordinal, attrs, x, topk_idx, topk_weight, decode, shared_gate_up,
                             shared_down, nullptr, y, status, scratch, nullptr, nullptr);
}

}  // namespace

MOK_FFI_HANDLER(MokMoeForward, forward_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Ctx<ffi::DeviceOrdinal>()
                    .Attrs<MoeForwardAttrs>()
                    .Arg<ffi::Buffer<ffi::BF16>>()   // x
                    .Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
                    .Arg<ffi::Buffer<ffi::F32>>()    // topk_weight
                    .Arg<ffi::Buffer<ffi::BF16>>()   // gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>()   // down
                    .Arg<ffi::Buffer<ffi::BF16>>()   // shared_gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>()   // shared_down
                    .Arg<ffi::Buffer<ffi::S32>>()    // keep_pos
                    .Ret<ffi::Buffer<ffi::BF16>>()   // y
                    .Ret<ffi::Buffer<ffi::S32>>()    // status
                    .Ret<ffi::Buffer<ffi::U8>>()     // scratch
                    .Ret<ffi::Buffer<ffi::BF16>>()   // keep_gu
                    .Ret<ffi::Buffer<ffi::BF16>>());  // keep_shared_gu

// The same call with the routed experts in FP8 (ForwardShape::routed_fp8); it keeps nothing for the backward.
MOK_FFI_HANDLER(MokMoeForwardFp8, forward_fp8_impl,
                ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Ctx<ffi::DeviceOrdinal>()
                    .Attrs<MoeForwardAttrs>()
                    .Arg<ffi::Buffer<ffi::BF16>>()   // x
                    .Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
                    .Arg<ffi::Buffer<ffi::F32>>()    // topk_weight
                    .Arg<ffi::AnyBuffer>()           // gate_up (f8e4m3fn, K-major)
                    .Arg<ffi::Buffer<ffi::F32>>()    // gate_up_scale
                    .Arg<ffi::AnyBuffer>()           // down (f8e4m3fn, K-major)
                    .Arg<ffi::Buffer<ffi::F32>>()    // down_scale
                    .Arg<ffi::Buffer<ffi::BF16>>()   // shared_gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>()   // shared_down
                    .Ret<ffi::Buffer<ffi::BF16>>()   // y
                    .Ret<ffi::Buffer<ffi::S32>>()    // status
                    .Ret<ffi::Buffer<ffi::U8>>());   // scratch

namespace {

// The shape and knobs that the sizing entry points below describe (no test modes beyond identity).
void sizing_problem(int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k,
                    int32_t local_experts, int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots,
                    int32_t routed_fp8, int32_t identity_experts, mok::moe::ForwardShape* shape,
                    mok::moe::ForwardKnobs* knobs) {
  *shape = mok::moe::ForwardShape{tokens, hidden, inter, identity_experts ? 0 : shared_inter, top_k,
                                  local_experts, ep, routed_fp8 ? 1 : 0};
  *knobs = mok::moe::ForwardKnobs{};
  knobs->granularity = granularity;
  knobs->comm_items = comm_items;
  knobs->ring_slots = ring_slots;
  knobs->identity_experts = identity_experts;
  knobs->skip_rank = -1;
}

// The scratch layout of a call with these arguments, or false for an unsupported call.
bool sizing_layout(int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k,
                   int32_t local_experts, int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots,
                   int32_t routed_fp8, int32_t identity_experts, mok::moe::ScratchLayout* layout) {
  mok::moe::ForwardShape shape;
  mok::moe::ForwardKnobs knobs;
  sizing_problem(tokens, hidden, inter, shared_inter, top_k, local_experts, ep, granularity, comm_items, ring_slots,
                 routed_fp8, identity_experts, &shape, &knobs);
  if (mok::moe::forward_unsupported(shape, knobs)) return false;
  *layout = mok::moe::forward_scratch_layout(shape, knobs);
  return true;
}

}  // namespace

// Bytes of one rank's scratch output (a multiple of 256), or -1 for an unsupported call.
extern "C" __attribute__((visibility("default"))) int64_t mok_moe_scratch_bytes(
    int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k, int32_t local_experts,
    int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots, int32_t routed_fp8,
    int32_t identity_experts) {
  mok::moe::ScratchLayout l;
  return sizing_layout(tokens, hidden, inter, shared_inter, top_k, local_experts, ep, granularity, comm_items,
                       ring_slots, routed_fp8, identity_experts, &l) ? int64_t(l.total) : -1;
}

// Where in one rank's scratch output the lab form's item times lie (timing mode "item times": kItemTimeWords
// words, u64 fields), or -1 for an unsupported call; the same arguments as mok_moe_scratch_bytes.
extern "C" __attribute__((visibility("default"))) int64_t mok_moe_item_times_offset(
    int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k, int32_t local_experts,
    int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots, int32_t routed_fp8,
    int32_t identity_experts) {
  mok::moe::ScratchLayout l;
  return sizing_layout(tokens, hidden, inter, shared_inter, top_k, local_experts, ep, granularity, comm_items,
                       ring_slots, routed_fp8, identity_experts, &l) ? int64_t(l.item_times) : -1;
}

// The forward kernel's work items of one rank, decoded on the host (mok/moe/forward.cuh, forward_item_list), for the
// tests of its order: the arguments of mok_moe_scratch_bytes (without the test modes) and the lab's timing_mode,
// the rank's CTAs, and rows: int32[microbatches][local_experts].
extern "C" __attribute__((visibility("default"))) int32_t mok_moe_item_list(
    int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k, int32_t local_experts,
    int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots, int32_t timing_mode, int32_t ctas,
    const int32_t* rows, int32_t* out, int32_t capacity) {
  mok::moe::ForwardShape shape;
  mok::moe::ForwardKnobs knobs;
  sizing_problem(tokens, hidden, inter, shared_inter, top_k, local_experts, ep, granularity, comm_items, ring_slots,
                 0, 0, &shape, &knobs);
  knobs.timing_mode = timing_mode;
  return mok::moe::forward_item_list(shape, knobs, ctas, rows, out, capacity);
}

// Why a call is unsupported ("" when it is): the same checks as the handler's, for Python's trace-time errors.
extern "C" __attribute__((visibility("default"))) int32_t mok_moe_unsupported(
    int32_t tokens, int32_t hidden, int32_t inter, int32_t shared_inter, int32_t top_k, int32_t local_experts,
    int32_t ep, int32_t granularity, int32_t comm_items, int32_t ring_slots, int32_t routed_fp8, char* out,
    int32_t out_len) {
  mok::moe::ForwardShape shape;
  mok::moe::ForwardKnobs knobs;
  sizing_problem(tokens, hidden, inter, shared_inter, top_k, local_experts, ep, granularity, comm_items, ring_slots,
                 routed_fp8, 0, &shape, &knobs);
  const char* why = mok::moe::forward_unsupported(shape, knobs);
  if (out != nullptr && out_len > 0) std::snprintf(out, size_t(out_len), "%s", why ? why : "");
  return why ? 1 : 0;
}

// How many times a handler of this library ran in this process (ffi_common.h: the command-buffer tests).
extern "C" __attribute__((visibility("default"))) int64_t mok_handler_runs() {
  return mok::ffi_util::handler_runs().load(std::memory_order_relaxed);
}
