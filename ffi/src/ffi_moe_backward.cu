// XLA FFI handler for mok/experts_backward.cuh: mok_experts_backward.
//   x: bf16[T, H], dy: bf16[T, H], topk_weight: f32[T, k], pos: s32[T, k], src_slot: s32[M], group_sizes: s32[E],
//   gate_up: bf16[E, H, 2I], down: bf16[E, I, H], gu_in: bf16[M, 2I] (the forward's kept g | u) or bf16[0, 2I]
//   (none kept: the op recomputes them into its scratch gu), gu_part: bf16[R, 2I] (some rows' kept g | u) or
//   bf16[0, 2I], gu_part_row: s32[M] (each row's row of gu_part) or s32[0], gu_block: s32[ceil(M / 128)] (1: the
//   m-block's slot rows are all in gu_part) or s32[0], shared_gate_up: bf16[H, 2Is], shared_down: bf16[Is, H]
//   -> dx: f32[T, H], dw: f32[T, k], d_gate_up: bf16[E, H, 2I], d_down: bf16[E, I, H], status: s32[],
//      scratch: x_e: bf16[M, H], dy_e: bf16[M, H], w_e: f32[M], gu: bf16[M, 2I] (with gu_in kept: XLA aliases
//      it to gu_in, and the op zeroes its padding rows in place), dgu: bf16[M, 2I], hw: bf16[M, I],
//      dw_part: f32[M, ceil(I / 256)], dx_e: bf16[M, H], dw_e: f32[M],
//      counters: s32[60 + 4 (ceil(M / 128) + E + ceil(Ts / 128)) + 2 (E + 1) + 5, rounded up to 4] (time words,
//      dependency counters; zeroed by the launcher)
//   attrs: {num_sms: s32, 0 = all SMs}
//
// mok_experts_backward_ep: the fused expert-parallel form (EP size P > 1), every operand with a leading rank
// axis R (1: this device's rank; P: every rank of an emulated group on one device, one launch):
//   x, dy: bf16[R, T, H] (each rank's own tokens), topk_idx: s32[R, T, k] (its own ids), topk_weight: f32[R, P T, k]
//   (every rank's, rank-major: the all-gather), src_slot: s32[R, M] (slots numbered over the P T tokens),
//   group_sizes: s32[R, L], gate_up: bf16[R, L, H, 2I], down: bf16[R, L, I, H], gu_in: bf16[R, M | 0, 2I],
//   gu_part: bf16[R, Rp, 2I], gu_part_row: s32[R, M | 0], gu_block: s32[R, ceil(M / 128) | 0]
//   -> dx: f32[R, T, H], dw: f32[R, T, k], d_gate_up, d_down (as gate_up, down), status: s32[R], then the scratch
//      of the EP-1 op with a leading R (x_e .. dw_e), and counters:
//      s32[R, mok_experts_backward_ep_counter_words(M, L, R)]
//      (above 8 ranks each row also holds its rank's kernel parameters)
//   attrs: {ws_id: s64 (the workspace), num_sms: s32, comm_items: s32 (SHARE items), skip_rank: s32 (-1; a
//   fault-injection test mode: >= 0 in an emulated call runs the kernel's lab form, the only one with its code)}
#include <vector>

#include "ffi_common.h"
#include "mok/comm/registry.h"
#include "mok/experts_backward.cuh"

namespace ffi = xla::ffi;

struct ExpertsBackwardAttrs {
  int32_t num_sms;
};
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(ExpertsBackwardAttrs, ::xla::ffi::StructMember<int32_t>("num_sms"));

namespace {

using mok::ffi_util::dims_are;
using mok::ffi_util::dims_str;

// The problem's sizes, the same fields in both handlers.
void set_sizes(mok::ExpertsBackwardParams& p, int64_t t, int64_t k, int64_t m, int64_t hidden, int64_t inter,
               int64_t e, int32_t num_sms) {
  p.num_tokens = t, p.top_k = k, p.num_rows = m, p.hidden = hidden, p.intermediate = inter, p.num_experts = e;
  p.num_sms = num_sms;
}

// A buffer's dimensions and the ones it must have, for the handlers' shape checks.
struct Want {
  const char* name;
  ffi::Span<const int64_t> got;
  std::initializer_list<int64_t> want;
  const char* shape;
};

// The kept g, u operands of both handlers, with `ranks` leading rank entries (0: the EP-1 op's, no rank axis):
// gu_in [M | 0, 2I] (every row kept, or none), gu_part [rows, 2I] with gu_part_row [M] and gu_block
// [ceil(M / 128)] (some rows kept), or gu_part [0, 2I] with both empty; the two forms are exclusive. On success
// *kept and *part say which form came. With every row kept, the result gu is the kept buffer (XLA aliases it to
// gu_in; a caller that does not gets a copy here), whose padding rows the gather zeroes in place.
ffi::Error check_kept_gu(const char* op, cudaStream_t stream, int64_t ranks, int64_t m, int64_t inter,
                         const ffi::Buffer<ffi::BF16>& gu_in, const ffi::Buffer<ffi::BF16>& gu_part,
                         const ffi::Buffer<ffi::S32>& gu_part_row, const ffi::Buffer<ffi::S32>& gu_block,
                         ffi::ResultBuffer<ffi::BF16>& gu, bool* kept, bool* part) {
  using mok::ffi_util::invalid;
  const size_t lead = ranks > 0 ? 1 : 0;
  const std::string r = ranks > 0 ? "ranks, " : "";
  const auto gin = gu_in.dimensions(), gpart = gu_part.dimensions();
  const bool gin_ok = gin.size() == 2 + lead && (!lead || gin[0] == ranks) && gin[lead + 1] == 2 * inter &&
                      (gin[lead] == m || gin[lead] == 0);
  if (!gin_ok)
    return invalid(op, "gu_in (the kept g, u) must be bf16[" + r + "M or 0, 2I] with M = " + std::to_string(m) +
                           ", 2I = " + std::to_string(2 * inter) + ", got " + dims_str(gin));
  *kept = m > 0 && gin[lead] == m;
  if (gpart.size() != 2 + lead || (lead && gpart[0] != ranks) || gpart[lead + 1] != 2 * inter)
    return invalid(op, "gu_part must be bf16[" + r + "rows, 2I] with 2I = " + std::to_string(2 * inter) +
                           ", got " + dims_str(gpart));
  *part = gu_part_row.element_count() != 0;
  const int64_t m_blocks = (m + mok::kExpertsBackwardRowBlock - 1) / mok::kExpertsBackwardRowBlock;
  const bool rows_ok = lead ? dims_are(gu_part_row.dimensions(), {ranks, m}) &&
                                  dims_are(gu_block.dimensions(), {ranks, m_blocks})
                            : dims_are(gu_part_row.dimensions(), {m}) && dims_are(gu_block.dimensions(), {m_blocks});
  if (*part ? !rows_ok : gpart[lead] != 0 || gu_block.element_count() != 0)
    return invalid(op, "gu_part_row and gu_block must be s32[" + r + "M] and s32[" + r + "ceil(M / 128)] with M = " +
                           std::to_string(m) + ", or all three of gu_part, gu_part_row and gu_block empty; got " +
                           dims_str(gpart) + ", " + dims_str(gu_part_row.dimensions()) + ", " +
                           dims_str(gu_block.dimensions()));
  if (*part && *kept) return invalid(op, "gu_in (all rows kept) and gu_part (some rows kept) are exclusive");
  if (*kept && gu->untyped_data() != gu_in.untyped_data())
    if (cudaError_t err = cudaMemcpyAsync(gu->untyped_data(), gu_in.untyped_data(),
                                          gu_in.size_bytes(), cudaMemcpyDeviceToDevice,
                                          stream);
        err != cudaSuccess)
      return mok::ffi_util::cuda_error(op, err);
  return ffi::Error::Success();
}

// The scratch results both handlers bind after status, in this order (the EP op's with a leading rank axis).
template <typename Binding>
auto bind_scratch(Binding b) {
  return std::move(b).template Ret<ffi::Buffer<ffi::BF16>>()  // x_e
      .template Ret<ffi::Buffer<ffi::BF16>>()      // dy_e
      .template Ret<ffi::Buffer<ffi::F32>>()       // w_e
      .template Ret<ffi::Buffer<ffi::BF16>>()      // gu (with every row kept, aliased to gu_in)
      .template Ret<ffi::Buffer<ffi::BF16>>()      // dgu
      .template Ret<ffi::Buffer<ffi::BF16>>()      // hw
      .template Ret<ffi::Buffer<ffi::F32>>()       // dw_part
      .template Ret<ffi::Buffer<ffi::BF16>>()      // dx_e
      .template Ret<ffi::Buffer<ffi::F32>>()       // dw_e
      .template Ret<ffi::Buffer<ffi::S32>>();      // counters (the kernel's dependency counters)
}

ffi::Error experts_backward_impl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> dy,
                                 ffi::Buffer<ffi::F32> topk_weight, ffi::Buffer<ffi::S32> pos,
                                 ffi::Buffer<ffi::S32> src_slot, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                                 ffi::Buffer<ffi::BF16> gu_in, ffi::Buffer<ffi::BF16> gu_part,
                                 ffi::Buffer<ffi::S32> gu_part_row, ffi::Buffer<ffi::S32> gu_block,
                                 ffi::Buffer<ffi::BF16> shared_gate_up,
                                 ffi::Buffer<ffi::BF16> shared_down,
                                 ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw,
                                 ffi::ResultBuffer<ffi::BF16> d_gate_up, ffi::ResultBuffer<ffi::BF16> d_down,
                                 ffi::ResultBuffer<ffi::S32> status, ffi::ResultBuffer<ffi::BF16> x_e,
                                 ffi::ResultBuffer<ffi::BF16> dy_e, ffi::ResultBuffer<ffi::F32> w_e,
                                 ffi::ResultBuffer<ffi::BF16> gu, ffi::ResultBuffer<ffi::BF16> dgu,
                                 ffi::ResultBuffer<ffi::BF16> hw, ffi::ResultBuffer<ffi::F32> dw_part,
                                 ffi::ResultBuffer<ffi::BF16> dx_e, ffi::ResultBuffer<ffi::F32> dw_e,
                                 ffi::ResultBuffer<ffi::S32> counters, ffi::ResultBuffer<ffi::BF16> d_shared_gate_up,
                                 ffi::ResultBuffer<ffi::BF16> d_shared_down, ffi::ResultBuffer<ffi::BF16> gus,
                                 ffi::ResultBuffer<ffi::BF16> dgus, ffi::ResultBuffer<ffi::BF16> hws,
                                 ffi::ResultBuffer<ffi::F32> dxs, ExpertsBackwardAttrs attrs) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_experts_backward";
  using mok::ffi_util::invalid;
  if (x.dimensions().size() != 2) return invalid(kOp, "x must be rank 2 [T, H], got " + dims_str(x.dimensions()));
  if (topk_weight.dimensions().size() != 2)
    return invalid(kOp, "topk_weight must be rank 2 [T, k], got " + dims_str(topk_weight.dimensions()));
  if (src_slot.dimensions().size() != 1)
    return invalid(kOp, "src_slot must be rank 1 [M], got " + dims_str(src_slot.dimensions()));
  if (group_sizes.dimensions().size() != 1)
    return invalid(kOp, "group_sizes must be rank 1 [E], got " + dims_str(group_sizes.dimensions()));
  if (gate_up.dimensions().size() != 3 || gate_up.dimensions()[2] % 2 != 0)
    return invalid(kOp, "gate_up must be rank 3 [E, H, 2I], got " + dims_str(gate_up.dimensions()));
  const int64_t t = x.dimensions()[0], hidden = x.dimensions()[1], k = topk_weight.dimensions()[1];
  const int64_t m = src_slot.dimensions()[0], e = group_sizes.dimensions()[0];
  const int64_t inter = gate_up.dimensions()[2] / 2;
  const int64_t n_blocks = (inter + mok::kExpertsBackwardColBlock - 1) / mok::kExpertsBackwardColBlock;
  // the shared expert: shared_gate_up [H, 2Is], shared_down [Is, H]; [H, 0] and [0, H] for none
  if (shared_gate_up.dimensions().size() != 2 || shared_gate_up.dimensions()[1] % 2 != 0)
    return invalid(kOp, "shared_gate_up must be rank 2 [H, 2Is] ([H, 0]: no shared expert), got " +
                            dims_str(shared_gate_up.dimensions()));
  const int64_t s_inter = shared_gate_up.dimensions()[1] / 2, s_rows = s_inter > 0 ? t : 0;
  const Want checks[] = {
      {"dy", dy.dimensions(), {t, hidden}, "[T, H]"},
      {"topk_weight", topk_weight.dimensions(), {t, k}, "[T, k]"},
      {"pos", pos.dimensions(), {t, k}, "[T, k]"},
      {"gate_up", gate_up.dimensions(), {e, hidden, 2 * inter}, "[E, H, 2I]"},
      {"down", down.dimensions(), {e, inter, hidden}, "[E, I, H]"},
      {"dx", dx->dimensions(), {t, hidden}, "[T, H]"},
      {"dw", dw->dimensions(), {t, k}, "[T, k]"},
      {"d_gate_up", d_gate_up->dimensions(), {e, hidden, 2 * inter}, "[E, H, 2I]"},
      {"d_down", d_down->dimensions(), {e, inter, hidden}, "[E, I, H]"},
      {"x_e", x_e->dimensions(), {m, hidden}, "[M, H]"},
      {"dy_e", dy_e->dimensions(), {m, hidden}, "[M, H]"},
      {"w_e", w_e->dimensions(), {m}, "[M]"},
      {"gu", gu->dimensions(), {m, 2 * inter}, "[M, 2I]"},
      {"dgu", dgu->dimensions(), {m, 2 * inter}, "[M, 2I]"},
      {"hw", hw->dimensions(), {m, inter}, "[M, I]"},
      {"dw_part", dw_part->dimensions(), {m, n_blocks}, "[M, ceil(I / 256)]"},
      {"dx_e", dx_e->dimensions(), {m, hidden}, "[M, H]"},
      {"dw_e", dw_e->dimensions(), {m}, "[M]"},
      {"counters", counters->dimensions(), {mok::experts_backward_counter_words(m, e, s_rows)},
       "[40 + 4 (ceil(M / 128) + E + ceil(Ts / 128)) + 2 (E + 1) + 5, rounded up to 4], Ts = T with a shared "
       "expert, else 0"},
      {"shared_gate_up", shared_gate_up.dimensions(), {hidden, 2 * s_inter}, "[H, 2Is]"},
      {"shared_down", shared_down.dimensions(), {s_inter, hidden}, "[Is, H]"},
      {"d_shared_gate_up", d_shared_gate_up->dimensions(), {hidden, 2 * s_inter}, "[H, 2Is]"},
      {"d_shared_down", d_shared_down->dimensions(), {s_inter, hidden}, "[Is, H]"},
      {"gus", gus->dimensions(), {s_rows, 2 * s_inter}, "[Ts, 2Is]"},
      {"dgus", dgus->dimensions(), {s_rows, 2 * s_inter}, "[Ts, 2Is]"},
      {"hws", hws->dimensions(), {s_rows, s_inter}, "[Ts, Is]"},
      {"dxs", dxs->dimensions(), {s_rows, hidden}, "[Ts, H]"},
  };
  for (const Want& c : checks)
    if (!dims_are(c.got, c.want))
      return invalid(kOp, std::string(c.name) + " must be " + c.shape + ", got " + dims_str(c.got));
  if (status->element_count() != 1) return invalid(kOp, "status must be a scalar s32");
  bool kept = false, part = false;
  if (ffi::Error err = check_kept_gu(kOp, stream, 0, m, inter, gu_in, gu_part, gu_part_row, gu_block, gu, &kept,
                                     &part);
      err.failure())
    return err;

  mok::ExpertsBackwardParams p{};
  p.x = x.untyped_data();
  p.dy = dy.untyped_data();
  p.topk_weight = topk_weight.typed_data();
  p.pos = pos.typed_data();
  p.src_slot = src_slot.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.gate_up = gate_up.untyped_data();
  p.down = down.untyped_data();
  p.gu_kept = kept ? gu->typed_data() : nullptr;
  if (part) {
    p.gu_part = gu_part.typed_data();
    p.gu_part_row = gu_part_row.typed_data();
    p.gu_block = gu_block.typed_data();
    p.gu_part_rows = gu_part.dimensions()[0];
  }
  p.dx = dx->typed_data();
  p.dw = dw->typed_data();
  p.d_gate_up = d_gate_up->untyped_data();
  p.d_down = d_down->untyped_data();
  p.status = status->typed_data();
  p.x_e = x_e->untyped_data();
  p.dy_e = dy_e->untyped_data();
  p.w_e = w_e->typed_data();
  p.gu = gu->untyped_data();
  p.dgu = dgu->untyped_data();
  p.hw = hw->untyped_data();
  p.dw_part = dw_part->typed_data();
  p.dx_e = dx_e->untyped_data();
  p.dw_e = dw_e->typed_data();
  p.counters = counters->typed_data();
  set_sizes(p, t, k, m, hidden, inter, e, attrs.num_sms);
  p.slot_tokens = t;
  p.shared_intermediate = s_inter;
  if (s_inter > 0) {
    p.shared_gate_up = shared_gate_up.untyped_data();
    p.shared_down = shared_down.untyped_data();
    p.d_shared_gate_up = d_shared_gate_up->untyped_data();
    p.d_shared_down = d_shared_down->untyped_data();
    p.gus = gus->typed_data();
    p.dgus = dgus->untyped_data();
    p.hws = hws->untyped_data();
    p.dxs = dxs->typed_data();
  }
  if (const char* why = mok::experts_backward_unsupported(p)) return invalid(kOp, why);
  return mok::ffi_util::cuda_error(kOp, mok::launch_experts_backward(p, stream));
}

}  // namespace

MOK_FFI_HANDLER(MokExpertsBackward, experts_backward_impl,
                bind_scratch(ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Arg<ffi::Buffer<ffi::BF16>>() // x
                    .Arg<ffi::Buffer<ffi::BF16>>() // dy
                    .Arg<ffi::Buffer<ffi::F32>>()  // topk_weight
                    .Arg<ffi::Buffer<ffi::S32>>()  // pos
                    .Arg<ffi::Buffer<ffi::S32>>()  // src_slot
                    .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                    .Arg<ffi::Buffer<ffi::BF16>>() // gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>() // down
                    .Arg<ffi::Buffer<ffi::BF16>>() // gu_in: kept g | u, or [0, 2I]
                    .Arg<ffi::Buffer<ffi::BF16>>() // gu_part: some rows' kept g | u, or [0, 2I]
                    .Arg<ffi::Buffer<ffi::S32>>()  // gu_part_row [M], or [0]
                    .Arg<ffi::Buffer<ffi::S32>>()  // gu_block [ceil(M / 128)], or [0]
                    .Arg<ffi::Buffer<ffi::BF16>>() // shared_gate_up [H, 2Is] ([H, 0]: none)
                    .Arg<ffi::Buffer<ffi::BF16>>() // shared_down [Is, H]
                    .Ret<ffi::Buffer<ffi::F32>>()  // dx
                    .Ret<ffi::Buffer<ffi::F32>>()  // dw
                    .Ret<ffi::Buffer<ffi::BF16>>() // d_gate_up
                    .Ret<ffi::Buffer<ffi::BF16>>() // d_down
                    .Ret<ffi::Buffer<ffi::S32>>()  // status
                    ) // then the scratch, then the shared expert's
                    .Ret<ffi::Buffer<ffi::BF16>>() // d_shared_gate_up
                    .Ret<ffi::Buffer<ffi::BF16>>() // d_shared_down
                    .Ret<ffi::Buffer<ffi::BF16>>() // gus (scratch)
                    .Ret<ffi::Buffer<ffi::BF16>>() // dgus (scratch)
                    .Ret<ffi::Buffer<ffi::BF16>>() // hws (scratch)
                    .Ret<ffi::Buffer<ffi::F32>>()  // dxs (scratch)
                    .Attrs<ExpertsBackwardAttrs>());

struct ExpertsBackwardEpAttrs {
  int64_t ws_id;
  int32_t num_sms;
  int32_t comm_items;
  int32_t skip_rank;
};
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(ExpertsBackwardEpAttrs, ::xla::ffi::StructMember<int64_t>("ws_id"),
                                      ::xla::ffi::StructMember<int32_t>("num_sms"),
                                      ::xla::ffi::StructMember<int32_t>("comm_items"),
                                      ::xla::ffi::StructMember<int32_t>("skip_rank"));

namespace {

ffi::Error experts_backward_ep_impl(
    cudaStream_t stream, int32_t device_ordinal, ExpertsBackwardEpAttrs attrs, ffi::Buffer<ffi::BF16> x,
    ffi::Buffer<ffi::BF16> dy, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weight,
    ffi::Buffer<ffi::S32> src_slot, ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::BF16> gate_up,
    ffi::Buffer<ffi::BF16> down, ffi::Buffer<ffi::BF16> gu_in, ffi::Buffer<ffi::BF16> gu_part,
    ffi::Buffer<ffi::S32> gu_part_row, ffi::Buffer<ffi::S32> gu_block, ffi::ResultBuffer<ffi::F32> dx,
    ffi::ResultBuffer<ffi::F32> dw, ffi::ResultBuffer<ffi::BF16> d_gate_up, ffi::ResultBuffer<ffi::BF16> d_down,
    ffi::ResultBuffer<ffi::S32> status, ffi::ResultBuffer<ffi::BF16> x_e, ffi::ResultBuffer<ffi::BF16> dy_e,
    ffi::ResultBuffer<ffi::F32> w_e, ffi::ResultBuffer<ffi::BF16> gu, ffi::ResultBuffer<ffi::BF16> dgu,
    ffi::ResultBuffer<ffi::BF16> hw, ffi::ResultBuffer<ffi::F32> dw_part, ffi::ResultBuffer<ffi::BF16> dx_e,
    ffi::ResultBuffer<ffi::F32> dw_e, ffi::ResultBuffer<ffi::S32> counters) {
  mok::ffi_util::count_handler_run();
  constexpr const char* kOp = "mok_experts_backward_ep";
  using mok::ffi_util::invalid;
  std::vector<mok::comm::CommView> views;
  uint64_t poison = 0, call_error = 0;
  if (std::string why = mok::comm::lookup_views(attrs.ws_id, device_ordinal, &views, &poison, &call_error);
      !why.empty())
    return invalid(kOp, why);
  if (poison != 0)
    return ffi::Error::Internal(std::string(kOp) + " (CUDA device " + std::to_string(device_ordinal) +
                                "): " + mok::comm::describe_error(poison));
  const mok::comm::CommShape& ws = views[0].shape;
  if (ws.ep < 2) return invalid(kOp, "the workspace spans one EP rank: use mok_experts_backward");
  const auto xd = x.dimensions();
  if (xd.size() != 3) return invalid(kOp, "x must be [ranks, T, H], got " + dims_str(xd));
  const int64_t R = xd[0], t = xd[1], hidden = xd[2];
  if (R != int64_t(views.size()))
    return invalid(kOp, "x carries " + std::to_string(R) + " ranks but workspace " + std::to_string(attrs.ws_id) +
                            " has " + std::to_string(views.size()) + " on this device");
  if (R != 1 && R != ws.ep) return invalid(kOp, "an emulated call must carry every EP rank");
  if (R > mok::kExpertsBackwardMaxRanks)
    return invalid(kOp, "an emulated call carries at most " + std::to_string(mok::kExpertsBackwardMaxRanks) +
                            " ranks");
  if (topk_idx.dimensions().size() != 3 || topk_idx.dimensions()[0] != R || topk_idx.dimensions()[1] != t)
    return invalid(kOp, "topk_idx must be [ranks, T, k], got " + dims_str(topk_idx.dimensions()));
  const int64_t k = topk_idx.dimensions()[2], n = t * ws.ep;
  if (src_slot.dimensions().size() != 2 || src_slot.dimensions()[0] != R)
    return invalid(kOp, "src_slot must be [ranks, M], got " + dims_str(src_slot.dimensions()));
  if (group_sizes.dimensions().size() != 2 || group_sizes.dimensions()[0] != R)
    return invalid(kOp, "group_sizes must be [ranks, L], got " + dims_str(group_sizes.dimensions()));
  if (gate_up.dimensions().size() != 4 || gate_up.dimensions()[3] % 2 != 0)
    return invalid(kOp, "gate_up must be [ranks, L, H, 2I], got " + dims_str(gate_up.dimensions()));
  const int64_t m = src_slot.dimensions()[1], e = group_sizes.dimensions()[1], inter = gate_up.dimensions()[3] / 2;
  const int64_t n_blocks = (inter + mok::kExpertsBackwardColBlock - 1) / mok::kExpertsBackwardColBlock;
  const int64_t m_blocks = (m + mok::kExpertsBackwardRowBlock - 1) / mok::kExpertsBackwardRowBlock;
  const int64_t words = mok::experts_backward_ep_counter_words(m, e, R);
  const Want checks[] = {
      {"dy", dy.dimensions(), {R, t, hidden}, "[ranks, T, H]"},
      {"topk_weight", topk_weight.dimensions(), {R, n, k}, "[ranks, ep T, k]"},
      {"gate_up", gate_up.dimensions(), {R, e, hidden, 2 * inter}, "[ranks, L, H, 2I]"},
      {"down", down.dimensions(), {R, e, inter, hidden}, "[ranks, L, I, H]"},
      {"dx", dx->dimensions(), {R, t, hidden}, "[ranks, T, H]"},
      {"dw", dw->dimensions(), {R, t, k}, "[ranks, T, k]"},
      {"d_gate_up", d_gate_up->dimensions(), {R, e, hidden, 2 * inter}, "[ranks, L, H, 2I]"},
      {"d_down", d_down->dimensions(), {R, e, inter, hidden}, "[ranks, L, I, H]"},
      {"status", status->dimensions(), {R}, "[ranks]"},
      {"x_e", x_e->dimensions(), {R, m, hidden}, "[ranks, M, H]"},
      {"dy_e", dy_e->dimensions(), {R, m, hidden}, "[ranks, M, H]"},
      {"w_e", w_e->dimensions(), {R, m}, "[ranks, M]"},
      {"gu", gu->dimensions(), {R, m, 2 * inter}, "[ranks, M, 2I]"},
      {"dgu", dgu->dimensions(), {R, m, 2 * inter}, "[ranks, M, 2I]"},
      {"hw", hw->dimensions(), {R, m, inter}, "[ranks, M, I]"},
      {"dw_part", dw_part->dimensions(), {R, m, n_blocks}, "[ranks, M, ceil(I / 256)]"},
      {"dx_e", dx_e->dimensions(), {R, m, hidden}, "[ranks, M, H]"},
      {"dw_e", dw_e->dimensions(), {R, m}, "[ranks, M]"},
      {"counters", counters->dimensions(), {R, words}, "[ranks, experts_backward_ep_counter_words(M, L, ranks)]"},
  };
  for (const Want& c : checks)
    if (!dims_are(c.got, c.want))
      return invalid(kOp, std::string(c.name) + " must be " + c.shape + ", got " + dims_str(c.got));
  if (R > mok::kExpertsBackwardParamRanks && reinterpret_cast<uintptr_t>(counters->untyped_data()) % 64 != 0)
    return invalid(kOp, "counters: above " + std::to_string(mok::kExpertsBackwardParamRanks) +
                            " ranks each row holds its rank's kernel parameters (TMA descriptors): the buffer must be "
                            "64-byte aligned");
  bool kept = false, part = false;
  if (ffi::Error err = check_kept_gu(kOp, stream, R, m, inter, gu_in, gu_part, gu_part_row, gu_block, gu, &kept,
                                     &part);
      err.failure())
    return err;
  const int64_t gp_rows = gu_part.dimensions()[1];
  auto at = [](auto* base, int64_t r, int64_t per) { return base + r * per; };
  std::vector<mok::ExpertsBackwardParams> ranks(R);
  for (int64_t r = 0; r < R; ++r) {
    if (views[r].rank != (R == 1 ? views[r].rank : r)) return invalid(kOp, "emulated ranks out of order");
    mok::ExpertsBackwardParams& p = ranks[r];
    p.x = at(static_cast<const uint16_t*>(x.untyped_data()), r, t * hidden);
    p.dy = at(static_cast<const uint16_t*>(dy.untyped_data()), r, t * hidden);
    p.topk_idx = at(topk_idx.typed_data(), r, t * k);
    p.topk_weight = at(topk_weight.typed_data(), r, n * k);
    p.pos = nullptr;
    p.src_slot = at(src_slot.typed_data(), r, m);
    p.group_sizes = at(group_sizes.typed_data(), r, e);
    p.gate_up = at(static_cast<const uint16_t*>(gate_up.untyped_data()), r, e * hidden * 2 * inter);
    p.down = at(static_cast<const uint16_t*>(down.untyped_data()), r, e * inter * hidden);
    p.gu_kept = kept ? at(gu->typed_data(), r, m * 2 * inter) : nullptr;
    if (part) {
      p.gu_part = at(gu_part.typed_data(), r, gp_rows * 2 * inter);
      p.gu_part_row = at(gu_part_row.typed_data(), r, m);
      p.gu_block = at(gu_block.typed_data(), r, m_blocks);
      p.gu_part_rows = gp_rows;
    }
    p.dx = at(dx->typed_data(), r, t * hidden);
    p.dw = at(dw->typed_data(), r, t * k);
    p.d_gate_up = at(static_cast<uint16_t*>(d_gate_up->untyped_data()), r, e * hidden * 2 * inter);
    p.d_down = at(static_cast<uint16_t*>(d_down->untyped_data()), r, e * inter * hidden);
    p.status = at(status->typed_data(), r, 1);
    p.x_e = at(static_cast<uint16_t*>(x_e->untyped_data()), r, m * hidden);
    p.dy_e = at(static_cast<uint16_t*>(dy_e->untyped_data()), r, m * hidden);
    p.w_e = at(w_e->typed_data(), r, m);
    p.gu = at(gu->typed_data(), r, m * 2 * inter);
    p.dgu = at(static_cast<uint16_t*>(dgu->untyped_data()), r, m * 2 * inter);
    p.hw = at(static_cast<uint16_t*>(hw->untyped_data()), r, m * inter);
    p.dw_part = at(dw_part->typed_data(), r, m * n_blocks);
    p.dx_e = at(static_cast<uint16_t*>(dx_e->untyped_data()), r, m * hidden);
    p.dw_e = at(dw_e->typed_data(), r, m);
    p.counters = at(counters->typed_data(), r, words);
    set_sizes(p, t, k, m, hidden, inter, e, attrs.num_sms);
    p.view = views[r];
    p.slot_tokens = n;
    p.comm_items = attrs.comm_items;
    if (const char* why = mok::experts_backward_unsupported(p)) return invalid(kOp, why);
  }
  return mok::ffi_util::cuda_error(
      kOp, mok::launch_experts_backward_ranks(ranks.data(), int(R), R > 1 ? attrs.skip_rank : -1, stream));
}

}  // namespace

MOK_FFI_HANDLER(MokExpertsBackwardEp, experts_backward_ep_impl,
                bind_scratch(ffi::Ffi::Bind()
                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                    .Ctx<ffi::DeviceOrdinal>()
                    .Attrs<ExpertsBackwardEpAttrs>()
                    .Arg<ffi::Buffer<ffi::BF16>>()  // x
                    .Arg<ffi::Buffer<ffi::BF16>>()  // dy
                    .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx
                    .Arg<ffi::Buffer<ffi::F32>>()   // topk_weight (every rank's)
                    .Arg<ffi::Buffer<ffi::S32>>()   // src_slot
                    .Arg<ffi::Buffer<ffi::S32>>()   // group_sizes
                    .Arg<ffi::Buffer<ffi::BF16>>()  // gate_up
                    .Arg<ffi::Buffer<ffi::BF16>>()  // down
                    .Arg<ffi::Buffer<ffi::BF16>>()  // gu_in
                    .Arg<ffi::Buffer<ffi::BF16>>()  // gu_part
                    .Arg<ffi::Buffer<ffi::S32>>()   // gu_part_row
                    .Arg<ffi::Buffer<ffi::S32>>()   // gu_block
                    .Ret<ffi::Buffer<ffi::F32>>()   // dx
                    .Ret<ffi::Buffer<ffi::F32>>()   // dw
                    .Ret<ffi::Buffer<ffi::BF16>>()  // d_gate_up
                    .Ret<ffi::Buffer<ffi::BF16>>()  // d_down
                    .Ret<ffi::Buffer<ffi::S32>>())); // status, then the scratch

// The words of one rank's counters row of mok_experts_backward_ep (mok/experts_backward.cuh), for the Python side.
extern "C" __attribute__((visibility("default"))) int64_t mok_experts_backward_ep_counter_words(int64_t rows,
                                                                                            int64_t experts,
                                                                                            int64_t ranks) {
  return mok::experts_backward_ep_counter_words(rows, experts, ranks);
}

// The backward kernel's item list, decoded on the host (mok/experts_backward.cuh), for the tests of its order.
extern "C" __attribute__((visibility("default"))) int32_t mok_experts_backward_item_list(
    const int32_t* group_sizes, int32_t E, int32_t M, int32_t H, int32_t I, int32_t Is, int32_t Ts, int32_t ep,
    int32_t kept, int32_t share_items, int32_t* out, int32_t capacity) {
  return mok::experts_backward_item_list(group_sizes, E, M, H, I, Is, Ts, ep, kept, share_items, out, capacity);
}
