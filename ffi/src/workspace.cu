// Host side of the symmetric workspace (mok/comm/workspace.cuh): allocation, peer mapping, kernel
// preloading, error reporting and teardown, as plain C functions that Python calls through ctypes.
//
// Life cycle, per workspace id and EP group (Python: mok_jax/workspace/core.py):
//   1. mok_comm_alloc     on every local rank: allocate one region of make_layout().total_bytes (cudaMalloc,
//                         or CUDA VMM: workspace_memory.h), zero it, a host-mapped pinned error word, a device
//                         peer table, preload every comm kernel on that device (lazy loading can deadlock a
//                         kernel that spins on a peer), and export the region's handle (memory::WireHandle).
//   2. (multi-process)    Python exchanges the handles between processes (jax.distributed's key-value store).
//   3. mok_comm_connect   fills the peer table: a rank of this process is reached through peer access
//                         (cudaDeviceEnablePeerAccess, or cuMemSetAccess for a VMM region), a rank of another
//                         process by mapping its handle (memory::import_handle); the table is copied to the
//                         device.
//   4. mok_comm_release_peers, then (after a barrier between processes) mok_comm_free, which also marks the
//      id closed for the rest of the process: a later lookup or alloc of it is refused, naming why.
// NVLink multicast is never used.
//
// Workspace ids (registry.h): Python draws them unique across processes and runs, so a compiled program
// that reaches another process (a serialized executable, jax.export, a compilation cache copied by hand)
// names an id this registry does not hold, and its handler fails with a message that says so instead of
// binding to an unrelated workspace.
//
// Memory: every region is allocated outside XLA's pool (cudaMalloc or cuMemCreate), so it comes out of what XLA's
// preallocation (by default 75% of the GPU) leaves free. A cudaErrorMemoryAllocation anywhere in
// mok_comm_alloc / mok_comm_alloc_emulated returns kAllocOutOfMemory, the message naming the bytes asked
// for and the device's free memory; Python adds the remedy (mok_jax/workspace/errors.py).
//
// The registry is allocated once and never destroyed: XLA threads may still run a handler while the
// process exits, after static destructors would have run.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "mok/comm/combine.cuh"
#include "mok/comm/dispatch.cuh"
#include "mok/comm/registry.h"
#include "mok/moe/forward.cuh"
#include "workspace_memory.h"

namespace mok::comm {
namespace {

struct RankEntry {
  int64_t ws_id = 0;
  int32_t group = 0, rank = 0, device = 0;
  CommShape shape{};
  SymLayout layout{};
  uint64_t timeout_ns = 0;
  memory::Region region;  // the rank's own region (region.ptr: its base)
  uint8_t** d_peer_bases = nullptr;
  uint64_t* host_error = nullptr;      // host address of the mapped words: [0] poison mirror, [1] call error
  uint64_t* host_error_dev = nullptr;  // their device address
  std::vector<uint8_t*> peers;
  std::vector<memory::Region> imported;  // [ep]: peers' regions mapped into this process (empty: not mapped)
  bool connected = false;
  CommView view{};
};

// Keyed by (workspace id, CUDA device, EP rank + group * ep): one rank per device, except in an emulated
// workspace, whose ranks all live on one device (docs/design.md, "EP on one GPU (emulation)").
using Key = std::tuple<int64_t, int, int64_t>;
std::mutex& g_mu = *new std::mutex;                                           // never destroyed (see the top)
std::map<Key, std::unique_ptr<RankEntry>>& g_entries = *new std::map<Key, std::unique_ptr<RankEntry>>;
std::set<int64_t>& g_closed = *new std::set<int64_t>;                         // ids freed in this process

// Return codes of mok_comm_alloc / mok_comm_alloc_emulated (mok_jax/workspace/errors.py: _ALLOC_*).
constexpr int32_t kAllocOk = 0, kAllocFailed = 1, kAllocOutOfMemory = 2;

Key key_of(const RankEntry& e) { return Key{e.ws_id, e.device, int64_t(e.rank) + int64_t(e.group) * e.shape.ep}; }

// Entries of ws_id on device, in EP rank order (several only in an emulated workspace).
std::vector<RankEntry*> entries_on(int64_t ws_id, int device) {
  std::vector<RankEntry*> out;
  for (auto& kv : g_entries)
    if (std::get<0>(kv.first) == ws_id && std::get<1>(kv.first) == device) out.push_back(kv.second.get());
  return out;
}

// Why (ws_id, device) has no entry (g_mu held): closed here, held by other devices only, or never created in
// this process.
std::string missing_message(int64_t ws_id, int device) {
  const std::string id = "mok workspace " + std::to_string(ws_id);
  if (g_closed.count(ws_id))
    return id + " was closed in this process (Workspace.close or close_cached_workspaces), but a compiled "
                "program still names it: keep a workspace open while programs that use it run, or retrace "
                "(jax.clear_caches()) so the call is compiled against a workspace that is open";
  std::set<int> devices;
  for (const auto& kv : g_entries)
    if (std::get<0>(kv.first) == ws_id) devices.insert(std::get<1>(kv.first));
  if (!devices.empty()) {
    std::string list;
    for (int d : devices) list += (list.empty() ? "" : ", ") + std::to_string(d);
    return id + " has no rank on CUDA device " + std::to_string(device) + " (its ranks in this process are on "
                "CUDA device(s) " + list + "): the call runs on a device outside the workspace's mesh";
  }
  return id + " does not exist in this process. A workspace id is valid only in the process that created it: "
              "this executable may come from a persistent compilation cache, a serialized executable or another "
              "process. Create the workspace in this process first (mok_jax.workspace.moe_workspace or "
              "Workspace.create, outside jit), then trace and compile the call with it";
}

void set_err(char* buf, int32_t len, const std::string& msg) {
  if (buf != nullptr && len > 0) std::snprintf(buf, size_t(len), "%s", msg.c_str());
}

std::string cuda_msg(const std::string& what, cudaError_t e) {
  return what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Restores the calling thread's current device on scope exit.
struct DeviceGuard {
  int prev = -1;
  DeviceGuard() { cudaGetDevice(&prev); }
  ~DeviceGuard() {
    if (prev >= 0) cudaSetDevice(prev);
  }
};

std::string validate_shape(const CommShape& s, int32_t rank) {
  if (s.ep < 1 || s.ep > kMaxRanks) return "ep must be in [1, " + std::to_string(kMaxRanks) + "]";
  if (rank < 0 || rank >= s.ep) return "rank must be in [0, ep)";
  if (s.max_tokens < 1) return "max_tokens must be >= 1";
  if (s.hidden < 8 || s.hidden % 8 != 0) return "hidden_size must be a positive multiple of 8 (16-byte rows)";
  if (s.top_k < 1 || s.top_k > kMaxTopK) return "top_k must be in [1, " + std::to_string(kMaxTopK) + "]";
  if (s.num_experts < s.ep || s.num_experts % s.ep != 0) return "num_experts must be a positive multiple of ep";
  if (s.num_local_experts() > kMaxLocalExperts)
    return "num_experts / ep must be <= " + std::to_string(kMaxLocalExperts);
  if (int64_t(s.ep) * s.max_tokens * s.top_k >= (int64_t(1) << 31)) return "ep * max_tokens * top_k must fit int32";
  return "";
}

void free_entry(RankEntry& e) {
  DeviceGuard guard;
  cudaSetDevice(e.device);
  cudaDeviceSynchronize();
  for (memory::Region& r : e.imported) memory::release(&r);
  memory::release(&e.region);
  if (e.d_peer_bases) cudaFree(e.d_peer_bases);
  if (e.host_error) cudaFreeHost(e.host_error);
  cudaGetLastError();  // teardown is best effort; never leave a sticky error for the next call
  e = RankEntry{};
}

const char* op_name(uint32_t op) {
  switch (op) {
    case kOpDispatch: return "dispatch";
    case kOpCombine: return "combine";
    case kOpMoeForward: return "moe forward";
    case kOpMoeBackward: return "moe backward";
    default: return "comm op";
  }
}

}  // namespace

std::string lookup_views(int64_t ws_id, int device, std::vector<CommView>* views, uint64_t* host_error,
                         uint64_t* host_call_error) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::vector<RankEntry*> found = entries_on(ws_id, device);
  if (found.empty()) return missing_message(ws_id, device);
  views->clear();
  *host_error = 0;
  if (host_call_error) *host_call_error = 0;
  for (const RankEntry* e : found) {
    if (!e->connected)
      return "mok workspace " + std::to_string(ws_id) + " is allocated but not connected to its peers";
    views->push_back(e->view);
    volatile uint64_t* words = e->host_error;
    if (*host_error == 0) *host_error = words[0];
    if (host_call_error && *host_call_error == 0) *host_call_error = words[1];
  }
  return "";
}

std::string lookup_view(int64_t ws_id, int device, CommView* view, uint64_t* host_error) {
  std::vector<CommView> views;
  std::string why = lookup_views(ws_id, device, &views, host_error, nullptr);
  if (!why.empty()) return why;
  if (views.size() != 1)
    return "mok workspace " + std::to_string(ws_id) + " holds " + std::to_string(views.size()) +
           " emulated EP ranks on CUDA device " + std::to_string(device) +
           "; the communication ops need one rank per device";
  *view = views[0];
  return "";
}

void clear_call_errors(int64_t ws_id, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (RankEntry* e : entries_on(ws_id, device)) reinterpret_cast<volatile uint64_t*>(e->host_error)[1] = 0;
}

std::string describe_error(uint64_t packed) {
  if (packed == 0) return "no error";
  const ErrorInfo e = unpack_error(packed);
  std::string what;
  switch (e.code) {
    case kErrTimeoutRouting: what = "timed out waiting for the routing of EP rank " + std::to_string(e.peer); break;
    case kErrTimeoutData:
      what = std::string("timed out waiting for the ") +
             (e.op == kOpCombine ? "partial sums" : e.op == kOpMoeBackward ? "shared rows or dx rows" : "token rows") +
             " of EP rank " + std::to_string(e.peer);
      break;
    case kErrTimeoutAck:
      what = "timed out waiting for EP rank " + std::to_string(e.peer) +
             " to release the buffers of the previous call";
      break;
    case kErrOverflow:
      what = e.op == kOpMoeForward ? "a microbatch sent more rows to this rank than its ring slot holds "
                                     "(topk_idx names one expert twice in a token's row)"
                                   : "received more rows than the output capacity";
      break;
    case kErrBadExpert:
      what = "topk_idx holds an expert id outside [-1, num_experts) (-1 marks a masked slot); the tokens "
             "that name one got NaN rows";
      break;
    case kErrTimeoutLocal:
      what = "a work item waited too long for another work item of the same call (internal error)";
      break;
    default: what = "error code " + std::to_string(e.code); break;
  }
  const std::string where = std::string("mok ") + op_name(e.op) + " on EP rank " + std::to_string(e.rank) +
                            ": " + what + " (epoch " + std::to_string(e.epoch_lo) + " mod 65536)";
  // The megakernel's call errors (bad routing) are reported once and leave the workspace usable.
  const bool call_error = e.op == kOpMoeForward && (e.code == kErrBadExpert || e.code == kErrOverflow);
  if (call_error) return where + ". The workspace stays usable; fix the routing of the call";
  return where + ". A rank that did not make the same call, a too-short timeout_s, or a crashed peer causes "
                 "this; the workspace is poisoned: close it and create a new one";
}

}  // namespace mok::comm

using namespace mok::comm;

#define MOK_EXPORT extern "C" __attribute__((visibility("default")))

MOK_EXPORT int64_t mok_comm_workspace_bytes(int32_t ep, int32_t max_tokens, int32_t hidden, int32_t top_k,
                                            int32_t num_experts) {
  const CommShape s{ep, max_tokens, hidden, top_k, num_experts};
  if (!validate_shape(s, 0).empty()) return -1;
  return int64_t(make_layout(s).total_bytes);
}

// The bytes of one rank's handle as the processes exchange it (memory::WireHandle; opaque to Python).
MOK_EXPORT int32_t mok_comm_handle_bytes() { return memory::handle_bytes(); }

// Descriptor passing (memory::handle_descriptor): 1 when `handle` names a POSIX descriptor of this process, 2 one
// of another process, 0 neither (*fd: the descriptor's number in its process).
MOK_EXPORT int32_t mok_comm_handle_descriptor(const uint8_t* handle, int32_t* fd) {
  memory::WireHandle h;
  std::memcpy(&h, handle, sizeof(h));
  return memory::handle_descriptor(h, fd);
}

// Rewrites `handle` in place to name descriptor `fd` of this process (memory::name_local_descriptor): 0, or -1
// when it is no descriptor handle or fd is negative.
MOK_EXPORT int32_t mok_comm_handle_name_local_descriptor(uint8_t* handle, int32_t fd) {
  memory::WireHandle h;
  std::memcpy(&h, handle, sizeof(h));
  if (!memory::name_local_descriptor(&h, fd)) return -1;
  std::memcpy(handle, &h, sizeof(h));
  return 0;
}

namespace {

// " (CUDA device d has F of T MiB free)", or "" when the driver cannot say.
std::string free_memory_note(int device) {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return " (CUDA device " + std::to_string(device) + " has " + std::to_string(free_b >> 20) + " of " +
         std::to_string(total_b >> 20) + " MiB free)";
}

// Allocates one rank's region (of memory kind `kind`), error words and peer table on `device`, preloads every
// kernel that spins on a peer, and (handle_out) exports the region's handle. Returns "" or why not;
// *out_of_memory tells whether a CUDA call failed for want of device memory.
std::string alloc_rank(int64_t ws_id, int32_t group, int32_t device, int32_t rank, const CommShape& shape,
                       double timeout_s, memory::Kind kind, uint8_t* handle_out, bool shared_device,
                       bool* out_of_memory) {
  *out_of_memory = false;
  if (std::string why = validate_shape(shape, rank); !why.empty()) return why;
  if (!(timeout_s > 0.0)) return "timeout_s must be > 0";
  if (*memory::kind_name(kind) == '\0') return "memory must be \"ipc\" or \"vmm\"";
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_closed.count(ws_id))
      return "workspace id " + std::to_string(ws_id) + " was closed in this process; ids are never reused";
    if (!shared_device && !entries_on(ws_id, device).empty())
      return "workspace " + std::to_string(ws_id) + " already has CUDA device " + std::to_string(device) +
             " (one rank per device per workspace)";
  }
  DeviceGuard guard;
  auto e = std::make_unique<RankEntry>();
  e->ws_id = ws_id;
  e->group = group;
  e->rank = rank;
  e->device = device;
  e->shape = shape;
  e->layout = make_layout(shape);
  e->timeout_ns = uint64_t(timeout_s * 1e9);
  e->peers.assign(shape.ep, nullptr);
  e->imported.assign(shape.ep, memory::Region{});
  auto fail = [&](const std::string& msg) {
    free_entry(*e);
    return msg;
  };
  // Out of memory: name what was asked for and what the device has left (before freeing what we got).
  auto fail_cuda = [&](const std::string& what, cudaError_t st) {
    std::string msg = cuda_msg(what, st);
    if (st == cudaErrorMemoryAllocation) {
      *out_of_memory = true;
      cudaGetLastError();
      msg += free_memory_note(device);
    }
    return fail(msg);
  };
  cudaError_t st = cudaSetDevice(device);
  if (st != cudaSuccess) return fail_cuda("cudaSetDevice(" + std::to_string(device) + ")", st);
  {
    bool oom = false;
    // An emulated VMM workspace exports too: its ranks map each other's regions through the handles (connect).
    const bool want_export = handle_out != nullptr || (kind == memory::kMemoryVmm && shared_device);
    std::string why = memory::allocate(kind, device, e->layout.total_bytes, want_export, &e->region, &oom);
    if (!why.empty()) {
      if (oom) {
        *out_of_memory = true;
        cudaGetLastError();
        why += free_memory_note(device);
      }
      return fail(why);
    }
  }
  if ((st = cudaMemset(e->region.ptr, 0, e->layout.total_bytes)) != cudaSuccess) return fail_cuda("cudaMemset", st);
  if ((st = cudaMalloc(reinterpret_cast<void**>(&e->d_peer_bases), sizeof(uint8_t*) * shape.ep)) != cudaSuccess)
    return fail_cuda("cudaMalloc of the peer table", st);
  if ((st = cudaHostAlloc(reinterpret_cast<void**>(&e->host_error), 2 * sizeof(uint64_t),
                          cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess)
    return fail(cuda_msg("cudaHostAlloc of the error words", st));  // host memory: not XLA's to give back
  reinterpret_cast<volatile uint64_t*>(e->host_error)[0] = 0;
  reinterpret_cast<volatile uint64_t*>(e->host_error)[1] = 0;
  if ((st = cudaHostGetDevicePointer(reinterpret_cast<void**>(&e->host_error_dev), e->host_error, 0)) != cudaSuccess)
    return fail_cuda("cudaHostGetDevicePointer", st);
  if ((st = preload_dispatch_kernels()) != cudaSuccess) return fail_cuda("preloading dispatch kernels", st);
  if ((st = preload_combine_kernels()) != cudaSuccess) return fail_cuda("preloading combine kernels", st);
  if ((st = mok::moe::preload_forward_kernel()) != cudaSuccess)
    return fail_cuda("preloading the MoE forward kernel", st);
  if (handle_out != nullptr) {
    memory::WireHandle h;
    if (std::string why = memory::export_handle(e->region, &h); !why.empty()) return fail(why);
    std::memcpy(handle_out, &h, sizeof(h));
  }
  if ((st = cudaDeviceSynchronize()) != cudaSuccess) return fail_cuda("cudaDeviceSynchronize", st);
  std::lock_guard<std::mutex> lock(g_mu);
  g_entries[key_of(*e)] = std::move(e);
  return "";
}

// Fills e's peer table (g_mu held): a rank on the same device is reached directly, one on another device of
// this process through peer access (cuMemSetAccess for a VMM region), one of another process by mapping its
// handle (handles: [ep] memory::WireHandle). In an emulated VMM workspace a rank maps its peers' regions through
// their handles too, so that one GPU runs the import path that other processes take.
std::string connect_entry(RankEntry& e, const uint8_t* handles) {
  if (e.connected) return "EP rank " + std::to_string(e.rank) + " is connected already";
  DeviceGuard guard;
  cudaError_t st = cudaSetDevice(e.device);
  if (st != cudaSuccess) return cuda_msg("cudaSetDevice", st);
  for (int p = 0; p < e.shape.ep; ++p) {
    if (p == e.rank) {
      e.peers[p] = e.region.ptr;
      continue;
    }
    const RankEntry* local_peer = nullptr;
    for (const auto& kv : g_entries) {
      const RankEntry& o = *kv.second;
      if (o.ws_id == e.ws_id && o.group == e.group && o.rank == p) local_peer = &o;
    }
    const std::string peer = "EP rank " + std::to_string(p);
    if (local_peer != nullptr && local_peer->device == e.device && e.region.kind == memory::kMemoryVmm) {
      memory::WireHandle h;
      std::string why = memory::export_handle(local_peer->region, &h);
      if (why.empty()) why = memory::import_handle(h, e.device, e.layout.total_bytes, peer, &e.imported[p]);
      if (!why.empty()) return why;
      e.peers[p] = e.imported[p].ptr;
    } else if (local_peer != nullptr && local_peer->device == e.device) {
      e.peers[p] = local_peer->region.ptr;
    } else if (local_peer != nullptr) {
      int can = 0;
      cudaDeviceCanAccessPeer(&can, e.device, local_peer->device);
      if (!can)
        return "CUDA device " + std::to_string(e.device) + " cannot access device " +
               std::to_string(local_peer->device) + " as a peer (no NVLink/P2P path)";
      if (local_peer->region.kind == memory::kMemoryVmm) {
        if (std::string why = memory::grant_access(local_peer->region, e.device, peer); !why.empty()) return why;
      } else {
        st = cudaDeviceEnablePeerAccess(local_peer->device, 0);
        if (st == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (st != cudaSuccess) {
          return cuda_msg("cudaDeviceEnablePeerAccess", st);
        }
      }
      e.peers[p] = local_peer->region.ptr;
    } else {
      if (handles == nullptr) return peer + " is not in this process and no handle was given";
      memory::WireHandle h;
      std::memcpy(&h, handles + size_t(p) * sizeof(h), sizeof(h));
      const bool peer_ipc = h.type == memory::kHandleIpc;
      if (peer_ipc != (e.region.kind == memory::kMemoryIpc))
        return peer + "'s workspace uses memory=\"" + (peer_ipc ? "ipc" : "vmm") + "\" and this one memory=\"" +
               memory::kind_name(e.region.kind) + "\": every process must pass the same memory";
      if (std::string why = memory::import_handle(h, e.device, e.layout.total_bytes, peer, &e.imported[p]);
          !why.empty())
        return why;
      e.peers[p] = e.imported[p].ptr;
    }
  }
  st = cudaMemcpy(e.d_peer_bases, e.peers.data(), sizeof(uint8_t*) * e.shape.ep, cudaMemcpyHostToDevice);
  if (st != cudaSuccess) return cuda_msg("copying the peer table", st);
  e.view.base = e.region.ptr;
  e.view.peer_bases = e.d_peer_bases;
  e.view.host_error = e.host_error_dev;
  e.view.host_call_error = e.host_error_dev + 1;
  e.view.timeout_ns = e.timeout_ns;
  e.view.shape = e.shape;
  e.view.layout = e.layout;
  e.view.rank = e.rank;
  e.connected = true;
  return "";
}

}  // namespace

// memory: memory::Kind; want_handle: export the region's handle into handle_out (mok_comm_handle_bytes()).
MOK_EXPORT int32_t mok_comm_alloc(int64_t ws_id, int32_t group, int32_t device, int32_t rank, int32_t ep,
                                  int32_t max_tokens, int32_t hidden, int32_t top_k, int32_t num_experts,
                                  double timeout_s, int32_t memory, int32_t want_handle, uint8_t* handle_out,
                                  char* err, int32_t err_len) {
  const CommShape shape{ep, max_tokens, hidden, top_k, num_experts};
  bool oom = false;
  const std::string why = alloc_rank(ws_id, group, device, rank, shape, timeout_s, memory::Kind(memory),
                                     want_handle ? handle_out : nullptr, /*shared_device=*/false, &oom);
  if (why.empty()) return kAllocOk;
  set_err(err, err_len, why);
  return oom ? kAllocOutOfMemory : kAllocFailed;
}

// An emulated workspace: all `ep` ranks of one EP group on one device, connected to each other.
MOK_EXPORT int32_t mok_comm_alloc_emulated(int64_t ws_id, int32_t device, int32_t ep, int32_t max_tokens,
                                           int32_t hidden, int32_t top_k, int32_t num_experts, double timeout_s,
                                           int32_t memory, char* err, int32_t err_len) {
  const CommShape shape{ep, max_tokens, hidden, top_k, num_experts};
  for (int r = 0; r < ep; ++r) {
    bool oom = false;
    const std::string why =
        alloc_rank(ws_id, 0, device, r, shape, timeout_s, memory::Kind(memory), nullptr, /*shared_device=*/true,
                   &oom);
    if (!why.empty()) {
      set_err(err, err_len, "emulated rank " + std::to_string(r) + ": " + why);
      return oom ? kAllocOutOfMemory : kAllocFailed;
    }
  }
  std::lock_guard<std::mutex> lock(g_mu);
  for (RankEntry* e : entries_on(ws_id, device)) {
    const std::string why = connect_entry(*e, nullptr);
    if (!why.empty()) {
      set_err(err, err_len, "connecting emulated rank " + std::to_string(e->rank) + ": " + why);
      return kAllocFailed;
    }
  }
  return kAllocOk;
}

MOK_EXPORT int32_t mok_comm_connect(int64_t ws_id, int32_t device, const uint8_t* ipc_handles, char* err,
                                    int32_t err_len) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::vector<RankEntry*> found = entries_on(ws_id, device);
  if (found.size() != 1) {
    set_err(err, err_len, "connect: no workspace " + std::to_string(ws_id) + " on device " + std::to_string(device));
    return 1;
  }
  const std::string why = connect_entry(*found[0], ipc_handles);
  if (why.empty()) return 0;
  set_err(err, err_len, why);
  return 1;
}

// What memory the workspace's first rank on `device` uses, in words: "ipc", or "vmm (FABRIC handles)", or "vmm
// (POSIX descriptors; <why no FABRIC>)", then how many of its peers it maps through their handles. 1 when there is
// no such rank.
MOK_EXPORT int32_t mok_comm_memory_info(int64_t ws_id, int32_t device, char* out, int32_t out_len) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::vector<RankEntry*> found = entries_on(ws_id, device);
  if (found.empty()) return 1;
  const memory::Region& r = found[0]->region;
  std::string what = memory::kind_name(r.kind);
  if (r.kind == memory::kMemoryVmm)
    what += r.handle_type == memory::kHandleFabric ? " (FABRIC handles)"
            : r.handle_type == memory::kHandlePosixFd ? " (POSIX descriptors; " + r.fabric_note + ")"
                                                      : " (not exported; " + r.fabric_note + ")";
  int mapped = 0;  // peers reached through a mapping of their exported handle
  for (const memory::Region& m : found[0]->imported) mapped += m.ptr != nullptr;
  what += "; " + std::to_string(mapped) + " peer region(s) mapped through handles";
  set_err(out, out_len, what);
  return 0;
}

// Waits for each local device of the workspace and unmaps the peers this process mapped (its imported regions).
MOK_EXPORT int32_t mok_comm_release_peers(int64_t ws_id) {
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceGuard guard;
  for (auto& kv : g_entries) {
    RankEntry& e = *kv.second;
    if (e.ws_id != ws_id) continue;
    cudaSetDevice(e.device);
    cudaDeviceSynchronize();
    for (memory::Region& r : e.imported) memory::release(&r);
    for (uint8_t*& peer : e.peers) peer = nullptr;
    e.connected = false;
  }
  cudaGetLastError();
  return 0;
}

// Frees every local allocation of the workspace (after every process released its peers) and marks the id
// closed: handlers and allocs that name it later are refused with a message saying so.
MOK_EXPORT int32_t mok_comm_free(int64_t ws_id) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_closed.insert(ws_id);
  for (auto it = g_entries.begin(); it != g_entries.end();) {
    if (std::get<0>(it->first) == ws_id) {
      free_entry(*it->second);
      it = g_entries.erase(it);
    } else {
      ++it;
    }
  }
  return 0;
}

// The host-mapped poison word of (ws_id, device): 0 when healthy (no device synchronisation). In an
// emulated workspace, the first nonzero one of its ranks.
MOK_EXPORT uint64_t mok_comm_error_word(int64_t ws_id, int32_t device) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (RankEntry* e : entries_on(ws_id, device))
    if (uint64_t w = reinterpret_cast<volatile uint64_t*>(e->host_error)[0]) return w;
  return 0;
}

// out[2] = {poison word, call error word} of EP rank `rank` of the workspace on `device`, as the device last
// wrote them (no synchronisation); 1 when there is no such rank.
MOK_EXPORT int32_t mok_moe_error_words(int64_t ws_id, int32_t device, int32_t rank, uint64_t* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (RankEntry* e : entries_on(ws_id, device)) {
    if (e->rank != rank) continue;
    volatile uint64_t* words = e->host_error;
    out[0] = words[0];
    out[1] = words[1];
    return 0;
  }
  return 1;
}

// Clears the call error words of the workspace's ranks on `device` (after the error was reported).
MOK_EXPORT int32_t mok_moe_clear_call_error(int64_t ws_id, int32_t device) {
  clear_call_errors(ws_id, device);
  return 0;
}

// What a handler would say about (ws_id, device): 0 when it finds a connected workspace there, else 1 and
// the handler's message in out (no CUDA call: callable without a GPU).
MOK_EXPORT int32_t mok_comm_lookup_error(int64_t ws_id, int32_t device, char* out, int32_t out_len) {
  std::vector<CommView> views;
  uint64_t poison = 0;
  const std::string why = lookup_views(ws_id, device, &views, &poison, nullptr);
  set_err(out, out_len, why);
  return why.empty() ? 0 : 1;
}

MOK_EXPORT int32_t mok_comm_describe_error(uint64_t packed, char* out, int32_t out_len) {
  set_err(out, out_len, describe_error(packed));
  return 0;
}

// Diagnostics outside jit (synchronous copy): out = {dispatch epoch, combine epoch, device error word,
// rows received by the last dispatch}.
MOK_EXPORT int32_t mok_comm_read_state(int64_t ws_id, int32_t device, uint64_t* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::vector<RankEntry*> found = entries_on(ws_id, device);
  if (found.empty()) return 1;
  const RankEntry& e = *found[0];
  DeviceGuard guard;
  cudaSetDevice(e.device);
  LocalState st{};
  uint64_t err_word = 0;
  if (cudaMemcpy(&st, e.region.ptr + e.layout.state, sizeof(st), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(&err_word, e.region.ptr + e.layout.error, sizeof(err_word), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  out[0] = st.disp_epoch;
  out[1] = st.comb_epoch;
  out[2] = err_word;
  out[3] = uint64_t(int64_t(st.total_rows));
  return 0;
}
