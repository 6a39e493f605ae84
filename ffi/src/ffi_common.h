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

inline bool dims_are(ffi::Span<const int64_t> d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
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
