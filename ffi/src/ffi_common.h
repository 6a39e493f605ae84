// Helpers shared by the XLA FFI handlers: thin decode -> Params -> launch wrappers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace mok::ffi_util {

namespace ffi = xla::ffi;

// Turn a CUDA error from a launch into an FFI error that names the op.
inline ffi::Error cuda_error(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error " + cudaGetErrorName(err) + ": " +
                              cudaGetErrorString(err));
}

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// "[d0, d1, ...]", for error messages that name a buffer's shape.
inline std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// "[d0, d1, ...]" of the dimensions a buffer must have, for the same messages.
inline std::string shape_str(std::initializer_list<int64_t> d) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t v : d) s += (i++ ? ", " : "") + std::to_string(v);
  return s + "]";
}

inline bool dims_are(ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

// The grouped FFN handlers (mok_grouped_ffn, mok_fp8_grouped_ffn: ffi_grouped_ffn.cu) take x [M, H] and group_sizes
// [E] and write y [M, H], h [M, I] and status []: only the weights (their dtype and layout, which give I) and the
// FP8 op's scales differ, and each handler checks those itself.
struct GroupedFfnSizes {
  int64_t rows = 0;          // M, from x
  int64_t hidden = 0;        // H, from x
  int64_t intermediate = 0;  // I, from the op's gate_up layout
  int64_t experts = 0;       // E, from group_sizes
};

// x must be rank 2 [M, H] and group_sizes rank 1 [E]; sets rows, hidden and experts.
inline ffi::Error grouped_ffn_sizes(const char* op, ffi::Span<const int64_t> x, ffi::Span<const int64_t> group_sizes,
                                    GroupedFfnSizes* s) {
  if (x.size() != 2) return invalid(op, "x must be rank 2 [M, H], got " + dims_str(x));
  if (group_sizes.size() != 1) return invalid(op, "group_sizes must be rank 1 [E], got " + dims_str(group_sizes));
  s->rows = x[0];
  s->hidden = x[1];
  s->experts = group_sizes[0];
  return ffi::Error::Success();
}

// Check y [M, H], h [M, I] and status [], then fill the GroupedFfnParams members that both precisions share: x,
// group_sizes, y, h, status, the sizes and num_sms (the handler sets the precision, the weights and the FP8 scales).
template <class Params, class HResult>
ffi::Error fill_grouped_ffn(const char* op, const GroupedFfnSizes& s, int32_t num_sms, ffi::Buffer<ffi::BF16>& x,
                            ffi::Buffer<ffi::S32>& group_sizes, ffi::ResultBuffer<ffi::BF16>& y, HResult& h,
                            ffi::ResultBuffer<ffi::S32>& status, Params* p) {
  if (!dims_are(y->dimensions(), {s.rows, s.hidden}))
    return invalid(op, "y must be [M, H], got " + dims_str(y->dimensions()));
  if (!dims_are(h->dimensions(), {s.rows, s.intermediate}))
    return invalid(op, "h must be [M, I], got " + dims_str(h->dimensions()));
  if (status->element_count() != 1) return invalid(op, "status must be a scalar s32");
  p->x = x.untyped_data();
  p->group_sizes = group_sizes.typed_data();
  p->y = y->untyped_data();
  p->h = h->untyped_data();
  p->status = status->typed_data();
  p->num_rows = s.rows;
  p->hidden = s.hidden;
  p->intermediate = s.intermediate;
  p->num_experts = s.experts;
  p->num_sms = num_sms;
  return ffi::Error::Success();
}

// Count of handler runs in this process (every handler adds one when XLA calls it), for the tests: a step that
// XLA replays from a command buffer runs the kernels without calling the handlers again.
inline std::atomic<int64_t>& handler_runs() {
  static std::atomic<int64_t> runs{0};
  return runs;
}
inline void count_handler_run() { handler_runs().fetch_add(1, std::memory_order_relaxed); }

}  // namespace mok::ffi_util

// Define an FFI handler as an exported C symbol (the library hides every other symbol). Python
// looks the symbol up with ctypes and registers it with jax.ffi.register_ffi_target.
//
// Every handler declares XLA's command-buffer trait: it only enqueues kernels and memsets on XLA's stream,
// allocates nothing, never waits for or queries the device or the stream (cudaStreamGetDevice on a capturing
// stream invalidates the capture: the device is XLA's ordinal). XLA may then record the call into a CUDA graph
// once and replay it: the handler's host-side checks (shapes, a poisoned workspace, an earlier call's error)
// run when XLA records, the kernels' own checks (status words, epochs, timeouts) at every replay.
#define MOK_FFI_HANDLER(name, impl, binding)                                                   \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible})
