// mok comm: host-side registry of symmetric workspaces (one entry per (workspace id, CUDA device, EP rank);
// one rank per device, except in an emulated workspace whose ranks share one device).
//
// Setup happens outside jit, from Python through the plain C functions of ffi/src/workspace.cu
// (mok_comm_*): alloc on every local rank, exchange IPC handles between processes, connect. The FFI
// handlers, which XLA may run concurrently from one thread per device, only look entries up; the
// registry is guarded by a mutex and an entry's CommView never changes once it is connected.
//
// Workspace ids: the int64 that each custom call carries as its ws_id attribute. Python (mok_jax/workspace/core.py)
// draws them unique across processes and runs (a random per-process tag in the high bits, a counter in the
// low bits; always > 0) and never reuses one. A lookup of an id this process does not hold fails with a
// message that says why: closed here (mok_comm_free remembers every id it freed), held by other devices
// only, or never created in this process (an executable from a persistent compilation cache, a serialized
// executable or another process): create the workspace in this process first. The registry is never
// destroyed, so a handler that runs while the process exits still finds valid state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/comm/workspace.cuh"

namespace mok::comm {

// Copies the connected view of (ws_id, device) into *view. Returns "" on success, else why not (an unknown,
// closed or unconnected id, or a device holding several emulated ranks). *host_error receives the current
// host-mapped error word (0 when healthy).
std::string lookup_view(int64_t ws_id, int device, CommView* view, uint64_t* host_error);

// The connected views of every rank of ws_id on device, in EP rank order (one, or all ranks of an emulated
// workspace). *host_error / *host_call_error receive the first nonzero poison / call error word among them.
std::string lookup_views(int64_t ws_id, int device, std::vector<CommView>* views, uint64_t* host_error,
                         uint64_t* host_call_error);

// Zeroes the call error words of ws_id's ranks on device (once an error has been reported).
void clear_call_errors(int64_t ws_id, int device);

// Human-readable description of a packed error word, naming the op, the rank and the awaited peer.
std::string describe_error(uint64_t packed);

}  // namespace mok::comm
