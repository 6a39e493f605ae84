// The memory behind one rank's workspace region, and how a peer maps it (host code; ffi/src/workspace.cu uses it).
//
// Two kinds, chosen per workspace (Workspace.create(memory=...)):
//   kMemoryIpc  cudaMalloc, exported as a CUDA IPC handle: one host only (the form every earlier release used).
//   kMemoryVmm  CUDA virtual memory management: cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess,
//               exported as a FABRIC handle where the device reports support for it and the allocation with that
//               handle type succeeds (an IMEX channel is open: the form that crosses hosts in an NVL72 rack), else
//               as a POSIX file descriptor, which another process of the same host receives over a UNIX socket
//               (mok_jax/workspace/descriptors.py; handle_descriptor, name_local_descriptor) or takes over with
//               pidfd_getfd.
//               A peer on another host with only a file descriptor, or a peer its device cannot reach, is an error
//               at set-up that names what is missing.
// The driver calls go through cudaGetDriverEntryPointByVersion, so the library still links only the static CUDA
// runtime and loads on a machine without a driver (the CPU machines that build it and run the reference path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::comm::memory {

enum Kind : int32_t { kMemoryIpc = 0, kMemoryVmm = 1 };
enum Handle : uint32_t { kHandleNone = 0, kHandleIpc = 1, kHandlePosixFd = 2, kHandleFabric = 3 };

// What travels between processes for one rank's region (Python treats it as opaque bytes of handle_bytes()).
struct WireHandle {
  uint32_t type;       // Handle
  int32_t pid;         // kHandlePosixFd: the exporting process and its descriptor
  int32_t fd;
  uint32_t reserved;
  uint64_t host;       // a hash of the exporter's boot id and pid namespace: whose process ids and descriptors
  uint64_t process;    // a random value drawn once per process: the handle comes from this very process
  uint64_t bytes;      // the mapped size (a multiple of the allocation granularity for VMM)
  uint8_t data[64];    // the cudaIpcMemHandle_t or the CUmemFabricHandle
};
static_assert(sizeof(WireHandle) == 104, "the wire form's size is part of the exchange's fingerprint");
constexpr int32_t handle_bytes() { return int32_t(sizeof(WireHandle)); }

// One region: owned (allocated here) or imported (a peer's, mapped into this process).
struct Region {
  Kind kind = kMemoryIpc;
  uint8_t* ptr = nullptr;
  size_t bytes = 0;           // mapped bytes (>= what was asked for)
  uint64_t vmm_handle = 0;    // CUmemGenericAllocationHandle
  bool ipc_opened = false;    // an imported IPC mapping (cudaIpcCloseMemHandle)
  int32_t exported_fd = -1;   // an owned VMM region's exported descriptor, open until the region is freed
  uint32_t handle_type = kHandleNone;  // what export() sends for an owned region
  std::string fabric_note;    // why an owned VMM region has no FABRIC handle ("" when it has one)
};

// The name of a memory kind (for messages); "" when k is not one.
const char* kind_name(int32_t k);

// Allocates `bytes` on `device` (current device set by the caller). want_export: the region will be exported.
// On failure returns why; *out_of_memory tells whether the device lacked the memory.
std::string allocate(Kind kind, int device, size_t bytes, bool want_export, Region* out, bool* out_of_memory);

// The wire form of an owned region (its handle; for a descriptor, this process's pid and the descriptor).
std::string export_handle(const Region& r, WireHandle* out);

// Maps a peer's region of at least min_bytes into this process for access from `device` (*out must hold no
// mapping). `peer` names the peer in messages.
std::string import_handle(const WireHandle& h, int device, size_t min_bytes, const std::string& peer, Region* out);

// Grants `device` access to an owned VMM region of another device of this process (peer access does not cover
// VMM mappings). A no-op for kMemoryIpc regions (the caller enables peer access for those).
std::string grant_access(const Region& r, int device, const std::string& peer);

// Descriptor passing (mok_jax/workspace/descriptors.py hands a POSIX-descriptor region's descriptor to the other
// processes of its host over a UNIX socket, so that no process needs ptrace permission over another):
// the descriptor a handle names: kDescriptorOwn when it is this very process's (*fd: its number here),
// kDescriptorPeer when another process's of the same host (*fd: its number there), kDescriptorNone otherwise.
enum DescriptorOwner : int32_t { kDescriptorNone = 0, kDescriptorOwn = 1, kDescriptorPeer = 2 };
DescriptorOwner handle_descriptor(const WireHandle& h, int32_t* fd);
// Makes a descriptor handle name descriptor `fd` of this process (one received from its exporter), so that
// import_handle duplicates it instead of taking the exporter's. False when h is not a descriptor handle.
bool name_local_descriptor(WireHandle* h, int32_t fd);

// Unmaps and frees (owned) or unmaps (imported); best effort, leaves no sticky CUDA error.
void release(Region* r);

}  // namespace mok::comm::memory
