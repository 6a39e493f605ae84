// The memory behind a workspace region: cudaMalloc + CUDA IPC, or CUDA VMM with FABRIC or POSIX-descriptor
// handles (see workspace_memory.h).
#include "workspace_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace mok::comm::memory {
namespace {

// ---- the driver entry points (resolved once, through the runtime: no libcuda link) ----------------------
struct Driver {
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) device_attribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuGetErrorName) error_name = nullptr;
  std::string missing;  // the first entry point the driver did not give, "" when all resolved
};

template <class F>
void resolve(const char* name, F* fn, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    if (missing->empty()) *missing = name;
    return;
  }
  *fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static const Driver* d = [] {
    auto* r = new Driver;  // never destroyed: handlers may run while the process exits
    resolve("cuDeviceGet", &r->device_get, &r->missing);
    resolve("cuDeviceGetAttribute", &r->device_attribute, &r->missing);
    resolve("cuMemGetAllocationGranularity", &r->granularity, &r->missing);
    resolve("cuMemCreate", &r->create, &r->missing);
    resolve("cuMemRelease", &r->release, &r->missing);
    resolve("cuMemAddressReserve", &r->reserve, &r->missing);
    resolve("cuMemAddressFree", &r->address_free, &r->missing);
    resolve("cuMemMap", &r->map, &r->missing);
    resolve("cuMemUnmap", &r->unmap, &r->missing);
    resolve("cuMemSetAccess", &r->set_access, &r->missing);
    resolve("cuMemExportToShareableHandle", &r->export_handle, &r->missing);
    resolve("cuMemImportFromShareableHandle", &r->import_handle, &r->missing);
    resolve("cuGetErrorName", &r->error_name, &r->missing);
    return r;
  }();
  return *d;
}

std::string cu_msg(const std::string& what, CUresult rc) {
  const char* name = nullptr;
  if (driver().error_name == nullptr || driver().error_name(rc, &name) != CUDA_SUCCESS || name == nullptr)
    name = "an unknown driver error";
  return what + ": " + name + " (" + std::to_string(int(rc)) + ")";
}

std::string rt_msg(const std::string& what, cudaError_t e) {
  return what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

uint64_t fnv1a(const char* p, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ uint8_t(p[i])) * 1099511628211ull;
  return h;
}

// Whose process ids this process sees: the FNV-1a hash of the kernel's boot id (the host name where it cannot be
// read) and of its pid namespace. Two processes with the same value can name each other's descriptors by pid (two
// containers of one host share the boot id, not the pid namespace).
uint64_t host_id() {
  static const uint64_t id = [] {
    char buf[256] = {};
    size_t n = 0;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      n = std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
    }
    if (n == 0 && gethostname(buf, sizeof(buf) - 1) == 0) n = std::strlen(buf);
    uint64_t h = fnv1a(buf, n);
    char ns[128] = {};
    const ssize_t m = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    return m > 0 ? fnv1a(ns, size_t(m), h) : h;
  }();
  return id;
}

// A value drawn once per process (a handle with it comes from this very process, whatever its pid reads).
uint64_t process_id() {
  static const uint64_t id = [] {
    uint64_t v = 0;
    if (FILE* f = std::fopen("/dev/urandom", "rb")) {
      if (std::fread(&v, sizeof(v), 1, f) != 1) v = 0;
      std::fclose(f);
    }
    return v ^ (uint64_t(getpid()) << 32) ^ uint64_t(reinterpret_cast<uintptr_t>(&v));
  }();
  return id;
}

CUmemAllocationProp device_prop(int device, CUmemAllocationHandleType types) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = types;
  return prop;
}

// What a FABRIC handle needs that a failed FABRIC call most likely lacked.
constexpr const char* kImexHint =
    " (FABRIC handles need an IMEX channel: /dev/nvidia-caps-imex-channels/channel0 and a running nvidia-imex service)";

// Gives `device` read-write access to the mapping [va, va + bytes) (`what` names it in the message).
std::string allow_access(CUdeviceptr va, size_t bytes, int device, const std::string& what) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult rc = driver().set_access(va, bytes, &access, 1);
  if (rc == CUDA_SUCCESS) return "";
  return cu_msg("cuMemSetAccess of " + what + " for CUDA device " + std::to_string(device) +
                    " (is there an NVLink or PCIe peer path between the two GPUs?)",
                rc);
}

// Reserves an address range of r->bytes, maps vmm handle h there and gives `device` read-write access.
std::string map_for(CUmemGenericAllocationHandle h, int device, size_t align, Region* r, const std::string& what) {
  const Driver& d = driver();
  CUdeviceptr va = 0;
  CUresult rc = d.reserve(&va, r->bytes, align, 0, 0);
  if (rc != CUDA_SUCCESS) return cu_msg("cuMemAddressReserve of " + what, rc);
  if ((rc = d.map(va, r->bytes, 0, h, 0)) != CUDA_SUCCESS) {
    d.address_free(va, r->bytes);
    return cu_msg("cuMemMap of " + what, rc);
  }
  if (std::string why = allow_access(va, r->bytes, device, what); !why.empty()) {
    d.unmap(va, r->bytes);
    d.address_free(va, r->bytes);
    return why;
  }
  r->ptr = reinterpret_cast<uint8_t*>(va);
  r->vmm_handle = uint64_t(h);
  return "";
}

// A descriptor of process `pid` (same host and pid namespace; `local`: this very process), duplicated into this one.
std::string take_descriptor(bool local, int32_t pid, int32_t fd, const std::string& peer, int* out) {
  if (local) {
    *out = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (*out < 0) {
      const int err = errno;
      return "dup of " + peer + "'s descriptor: " + std::strerror(err);
    }
    return "";
  }
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) {
    const int err = errno;
    return "pidfd_open of process " + std::to_string(pid) + " (" + peer + "): " + std::strerror(err) +
           (err == ESRCH ? " (the process is gone)" : "");
  }
  const long got = syscall(SYS_pidfd_getfd, int(pidfd), fd, 0);
  const int err = errno;
  close(int(pidfd));
  if (got < 0)
    return "pidfd_getfd of " + peer + "'s memory descriptor in process " + std::to_string(pid) + ": " +
           std::strerror(err) +
           (err == EPERM || err == ENOSYS
                ? " (taking another process's descriptor needs ptrace permission over it: Yama's ptrace_scope 0 or "
                  "CAP_SYS_PTRACE, and a seccomp profile that allows pidfd_getfd; or use FABRIC handles, or "
                  "memory=\"ipc\" within one host)"
                : "");
  *out = int(got);
  return "";
#else
  return "this build has no pidfd_getfd (Linux 5.6+ headers): a POSIX-descriptor region of another process (" +
         peer + ") cannot be mapped";
#endif
}

}  // namespace

const char* kind_name(int32_t k) {
  return k == kMemoryIpc ? "ipc" : k == kMemoryVmm ? "vmm" : "";
}

std::string allocate(Kind kind, int device, size_t bytes, bool want_export, Region* out, bool* out_of_memory) {
  *out_of_memory = false;
  *out = Region{};
  out->kind = kind;
  if (kind == kMemoryIpc) {
    cudaError_t st = cudaMalloc(reinterpret_cast<void**>(&out->ptr), bytes);
    if (st != cudaSuccess) {
      *out_of_memory = st == cudaErrorMemoryAllocation;
      out->ptr = nullptr;
      return rt_msg("cudaMalloc of the " + std::to_string(bytes) + "-byte workspace region", st);
    }
    out->bytes = bytes;
    out->handle_type = want_export ? kHandleIpc : kHandleNone;
    return "";
  }
  if (kind != kMemoryVmm) return "unknown workspace memory kind " + std::to_string(int(kind));
  const Driver& d = driver();
  if (!d.missing.empty())
    return "the CUDA driver does not provide " + d.missing +
           " (CUDA virtual memory management needs a driver of CUDA 12 or later): use memory=\"ipc\"";
  CUdevice dev = 0;
  CUresult rc = d.device_get(&dev, device);
  if (rc != CUDA_SUCCESS) return cu_msg("cuDeviceGet(" + std::to_string(device) + ")", rc);
  int vmm = 0, fabric = 0;
  if ((rc = d.device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)) != CUDA_SUCCESS)
    return cu_msg("cuDeviceGetAttribute (virtual memory management)", rc);
  if (!vmm) return "CUDA device " + std::to_string(device) + " does not support virtual memory management";
  if (d.device_attribute(&fabric, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev) != CUDA_SUCCESS) fabric = 0;
  // FABRIC first (it crosses hosts and also serves one host); without it, a POSIX descriptor (one host).
  CUmemGenericAllocationHandle h = 0;
  size_t align = 0;
  // h with handle types `types`, of `bytes` rounded up to their recommended granularity (align, out->bytes): ""
  // and *created = cuMemCreate's result, or why the granularity query failed.
  auto create = [&](CUmemAllocationHandleType types, CUresult* created) -> std::string {
    CUmemAllocationProp prop = device_prop(device, types);
    const CUresult g = d.granularity(&align, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (g != CUDA_SUCCESS) return cu_msg("cuMemGetAllocationGranularity", g);
    out->bytes = (bytes + align - 1) / align * align;
    *created = d.create(&h, out->bytes, &prop, 0);
    return "";
  };
  bool allocated = false;
  if (fabric) {
    const auto types = CUmemAllocationHandleType(CU_MEM_HANDLE_TYPE_FABRIC | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (std::string why = create(types, &rc); !why.empty()) return why;
    if (rc == CUDA_SUCCESS) {
      // The allocation may succeed where the export does not (no IMEX channel open to this process): try it now,
      // so that such a region falls back to a descriptor instead of failing at connect.
      CUmemFabricHandle trial;
      const CUresult ex = d.export_handle(&trial, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
      if (ex == CUDA_SUCCESS) {
        allocated = true;
        out->handle_type = kHandleFabric;
      } else {
        d.release(h);
        h = 0;
        out->fabric_note = cu_msg("cuMemExportToShareableHandle (FABRIC)", ex) + kImexHint;
      }
    } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      *out_of_memory = true;
      return cu_msg("cuMemCreate of the " + std::to_string(out->bytes) + "-byte workspace region", rc);
    } else {
      out->fabric_note = cu_msg("cuMemCreate with a FABRIC handle type", rc) + kImexHint;
    }
  } else {
    out->fabric_note = "CUDA device " + std::to_string(device) + " does not support FABRIC handles";
  }
  if (!allocated) {
    if (std::string why = create(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, &rc); !why.empty()) return why;
    if (rc != CUDA_SUCCESS) {
      *out_of_memory = rc == CUDA_ERROR_OUT_OF_MEMORY;
      return cu_msg("cuMemCreate of the " + std::to_string(out->bytes) + "-byte workspace region", rc);
    }
    out->handle_type = kHandlePosixFd;
  }
  if (std::string why = map_for(h, device, align, out, "the workspace region"); !why.empty()) {
    d.release(h);
    *out = Region{};
    return why;
  }
  if (out->handle_type == kHandlePosixFd && want_export) {
    int fd = -1;
    if ((rc = d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) != CUDA_SUCCESS) {
      release(out);
      return cu_msg("cuMemExportToShareableHandle (POSIX descriptor)", rc);
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);  // a child process (a compiler XLA runs) must not keep the memory alive
    out->exported_fd = fd;
  }
  return "";
}

std::string export_handle(const Region& r, WireHandle* out) {
  *out = WireHandle{};
  out->type = r.handle_type;
  out->host = host_id();
  out->process = process_id();
  out->bytes = r.bytes;
  out->pid = int32_t(getpid());
  out->fd = -1;
  switch (r.handle_type) {
    case kHandleIpc: {
      cudaIpcMemHandle_t h;
      const cudaError_t st = cudaIpcGetMemHandle(&h, r.ptr);
      if (st != cudaSuccess) return rt_msg("cudaIpcGetMemHandle", st);
      static_assert(sizeof(h) <= sizeof(out->data), "an IPC handle fits the wire form");
      std::memcpy(out->data, &h, sizeof(h));
      return "";
    }
    case kHandleFabric: {
      CUmemFabricHandle fh;
      const CUresult rc = driver().export_handle(&fh, CUmemGenericAllocationHandle(r.vmm_handle),
                                                 CU_MEM_HANDLE_TYPE_FABRIC, 0);
      if (rc != CUDA_SUCCESS) return cu_msg("cuMemExportToShareableHandle (FABRIC)", rc);
      static_assert(sizeof(fh) <= sizeof(out->data), "a fabric handle fits the wire form");
      std::memcpy(out->data, &fh, sizeof(fh));
      return "";
    }
    case kHandlePosixFd:
      if (r.exported_fd < 0) return "the region was allocated without an exported descriptor";
      out->fd = r.exported_fd;
      return "";
    default:
      return "the region has no handle to export";
  }
}

std::string import_handle(const WireHandle& h, int device, size_t min_bytes, const std::string& peer, Region* out) {
  if (out->ptr != nullptr) return peer + "'s region is mapped already (the workspace was connected twice)";
  *out = Region{};
  if (h.bytes < min_bytes)
    return peer + "'s region has " + std::to_string(h.bytes) + " bytes where this workspace needs " +
           std::to_string(min_bytes) + " (its processes were created with different shapes)";
  if (h.type == kHandleIpc) {
    cudaIpcMemHandle_t ih;
    std::memcpy(&ih, h.data, sizeof(ih));
    void* ptr = nullptr;
    const cudaError_t st = cudaIpcOpenMemHandle(&ptr, ih, cudaIpcMemLazyEnablePeerAccess);
    if (st != cudaSuccess) return rt_msg("cudaIpcOpenMemHandle of " + peer, st);
    out->kind = kMemoryIpc;
    out->ptr = static_cast<uint8_t*>(ptr);
    out->bytes = h.bytes;
    out->ipc_opened = true;
    return "";
  }
  if (h.type != kHandleFabric && h.type != kHandlePosixFd)
    return peer + " sent no usable memory handle (type " + std::to_string(h.type) + ")";
  const Driver& d = driver();
  if (!d.missing.empty()) return "the CUDA driver does not provide " + d.missing + ": " + peer + " cannot be mapped";
  CUmemGenericAllocationHandle mh = 0;
  CUresult rc;
  if (h.type == kHandleFabric) {
    CUmemFabricHandle fh;
    std::memcpy(&fh, h.data, sizeof(fh));
    rc = d.import_handle(&mh, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
    if (rc != CUDA_SUCCESS)
      return cu_msg("cuMemImportFromShareableHandle of " + peer + "'s FABRIC handle", rc) +
             " (importing needs an IMEX channel on this host and the peer in the same NVLink domain)";
  } else {
    if (h.host != host_id())
      return peer + " runs on another host (or in another pid namespace) and its memory is exported as a POSIX file "
                    "descriptor, which only reaches processes that share its host and pid namespace: crossing hosts "
                    "needs FABRIC handles (an IMEX channel on every host: /dev/nvidia-caps-imex-channels/channel0)";
    int fd = -1;
    if (std::string why = take_descriptor(h.process == process_id(), h.pid, h.fd, peer, &fd); !why.empty()) return why;
    rc = d.import_handle(&mh, reinterpret_cast<void*>(uintptr_t(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (rc != CUDA_SUCCESS) return cu_msg("cuMemImportFromShareableHandle of " + peer + "'s descriptor", rc);
  }
  CUmemAllocationProp prop = device_prop(
      device, h.type == kHandleFabric ? CU_MEM_HANDLE_TYPE_FABRIC : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  size_t align = 0;
  if ((rc = d.granularity(&align, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS) {
    d.release(mh);
    return cu_msg("cuMemGetAllocationGranularity", rc);
  }
  if (align == 0 || h.bytes % align != 0) {
    d.release(mh);
    return peer + "'s region of " + std::to_string(h.bytes) + " bytes is not a multiple of this device's mapping "
                  "granularity (" + std::to_string(align) + " bytes)";
  }
  out->kind = kMemoryVmm;
  out->bytes = h.bytes;
  if (std::string why = map_for(mh, device, align, out, peer + "'s region"); !why.empty()) {
    d.release(mh);
    *out = Region{};
    return why;
  }
  return "";
}

std::string grant_access(const Region& r, int device, const std::string& peer) {
  if (r.kind != kMemoryVmm) return "";
  return allow_access(CUdeviceptr(r.ptr), r.bytes, device, peer + "'s region");
}

void release(Region* r) {
  if (r->ptr != nullptr) {
    if (r->kind == kMemoryIpc) {
      if (r->ipc_opened)
        cudaIpcCloseMemHandle(r->ptr);
      else
        cudaFree(r->ptr);
    } else {
      const Driver& d = driver();
      d.unmap(CUdeviceptr(r->ptr), r->bytes);
      d.address_free(CUdeviceptr(r->ptr), r->bytes);
      d.release(CUmemGenericAllocationHandle(r->vmm_handle));
    }
  }
  if (r->exported_fd >= 0) close(r->exported_fd);
  cudaGetLastError();
  *r = Region{};
}

DescriptorOwner handle_descriptor(const WireHandle& h, int32_t* fd) {
  if (h.type != kHandlePosixFd) return kDescriptorNone;
  *fd = h.fd;
  return h.process == process_id() ? kDescriptorOwn : kDescriptorPeer;
}

bool name_local_descriptor(WireHandle* h, int32_t fd) {
  if (h->type != kHandlePosixFd || fd < 0) return false;
  h->pid = int32_t(getpid());
  h->fd = fd;
  h->host = host_id();
  h->process = process_id();
  return true;
}

}  // namespace mok::comm::memory
