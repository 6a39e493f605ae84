// mok comm: host-side registry of symmetric workspaces (one entry per (workspace id, CUDA device)).
//
// Setup happens outside jit, from Python through the plain C functions of ffi/src/workspace.cu
// (mok_comm_*): alloc on every local rank, exchange IPC handles between processes, connect. The FFI
// handlers, which XLA may run concurrently from one thread per device, only look entries up; the
// registry is guarded by a mutex and an entry's CommView never changes once it is connected.
#pragma once

#include <cstdint>
#include <string>

#include "mok/comm/workspace.cuh"

namespace mok::comm {

// Copies the connected view of (ws_id, device) into *view. Returns "" on success, else why not.
// *host_error receives the current host-mapped error word (0 when healthy).
std::string lookup_view(int64_t ws_id, int device, CommView* view, uint64_t* host_error);

// Human-readable description of a packed error word, naming the op, the rank and the awaited peer.
std::string describe_error(uint64_t packed);

}  // namespace mok::comm
