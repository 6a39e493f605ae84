// Helpers shared by the XLA FFI handlers: thin decode -> Params -> launch wrappers.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace mok::ffi_util

// Define an FFI handler as an exported C symbol (the library hides every other symbol). Python
// looks the symbol up with ctypes and registers it with jax.ffi.register_ffi_target.
#define MOK_FFI_HANDLER(name, impl, binding)                                                   \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, binding)


// No handler declares XLA's command-buffer trait: recording the megakernel's handler into a CUDA graph
// was tried on the H200 and the capture failed (cudaErrorStreamCaptureInvalidated), and XLA's default
// command-buffer types include custom calls, so the trait would break ordinary runs.
