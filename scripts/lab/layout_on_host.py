"""The layout kernels of ffi/src/routing.cu (launch_expert_layout: COUNT, SCAN, PLACE) run on the CPU, every CUDA
thread a host thread, against mok_jax.expert_layout's padded_layout and rank_layout, all four arrays bit for bit.

A check of the kernels' logic where no GPU is lent, not of the GPU: the source is compiled by g++ (C++20) with a shim
of the few CUDA features it uses (__syncthreads and __syncwarp as barriers, __match_any_sync, __shfl_up_sync and
__reduce_add_sync through a warp's shared slots, shared-memory atomics), after textual rewrites (shared arrays, the
launches) and a shim of mok/comm/ptx.cuh's lanemask register. It says nothing of the memory model, of timing or of
the compiled SASS; tests/test_native_gpu.py is the test on the GPU. Run from the repository root:

    python scripts/lab/layout_on_host.py [seed]

about a minute on two cores (each CUDA block starts its threads anew).
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mok_jax.expert_layout import padded_layout, rank_layout  # noqa: E402
from mok_jax.ops.routing import layout_chunk  # noqa: E402

# Threads, blocks and warps: every CUDA thread a host thread, a warp's lanes meeting at a barrier to exchange values
# (shim_warp_exchange). Used alone by fp8_on_host.py, whose CUDA headers declare the runtime's types themselves.
THREAD_SHIM = r"""
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max;
using std::min;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
struct ShimDim { unsigned x = 0, y = 0, z = 0; };
inline thread_local ShimDim threadIdx, blockIdx, blockDim, gridDim;
struct ShimWarp { uint32_t vals[32]; std::barrier<>* bar; };
struct ShimBlock { std::barrier<>* bar; std::vector<ShimWarp> warps; std::vector<int32_t> dyn, stat; };
inline thread_local ShimBlock* shim_block;
inline int32_t* shim_dyn_smem() { return shim_block->dyn.data(); }
inline int32_t* shim_static_smem() { return shim_block->stat.data(); }
inline void __syncthreads() { shim_block->bar->arrive_and_wait(); }
inline ShimWarp& shim_warp() { return shim_block->warps[threadIdx.x / 32]; }
inline void __syncwarp() { shim_warp().bar->arrive_and_wait(); }
// Every lane of the warp posts its 32-bit value; read(vals, lane) runs once all are posted, before any is replaced.
template <class Read>
inline auto shim_warp_exchange(uint32_t mine, Read read) {
  ShimWarp& w = shim_warp();
  const int lane = threadIdx.x % 32;
  w.vals[lane] = mine;
  w.bar->arrive_and_wait();
  const auto r = read(w.vals, lane);
  w.bar->arrive_and_wait();
  return r;
}
inline uint32_t __match_any_sync(uint32_t, int32_t v) {
  return shim_warp_exchange(uint32_t(v), [v](const uint32_t* vals, int) {
    uint32_t m = 0;
    for (int l = 0; l < 32; ++l)
      if (vals[l] == uint32_t(v)) m |= 1u << l;
    return m;
  });
}
inline int32_t __shfl_up_sync(uint32_t, int32_t x, int o) {
  return shim_warp_exchange(uint32_t(x), [x, o](const uint32_t* vals, int lane) {
    return lane >= o ? int32_t(vals[lane - o]) : x;
  });
}
template <class T>
inline T __shfl_xor_sync(uint32_t, T x, int mask) {
  static_assert(sizeof(T) == 4, "32-bit values");
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return shim_warp_exchange(bits, [mask](const uint32_t* vals, int lane) {
    T r;
    std::memcpy(&r, &vals[lane ^ mask], 4);
    return r;
  });
}
inline int __any_sync(uint32_t, int p) {
  return shim_warp_exchange(uint32_t(p != 0), [](const uint32_t* vals, int) {
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= int(vals[l]);
    return any;
  });
}
inline int32_t __reduce_add_sync(uint32_t, int32_t v) {
  return shim_warp_exchange(uint32_t(v), [](const uint32_t* vals, int) {
    uint32_t sum = 0;
    for (int l = 0; l < 32; ++l) sum += vals[l];
    return int32_t(sum);
  });
}
inline int __popc(uint32_t m) { return __builtin_popcount(m); }
inline int32_t atomicAdd(int32_t* p, int32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline uint32_t shim_lanemask_lt() { return (1u << (threadIdx.x % 32)) - 1u; }
template <class K, class... A>
void shim_launch(K kernel, unsigned grid, unsigned threads, size_t smem, A... args) {
  for (unsigned b = 0; b < grid; ++b) {
    ShimBlock blk;
    std::barrier<> bar(threads);
    blk.bar = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
    blk.warps.resize(threads / 32);
    for (auto& w : blk.warps) {
      warp_bars.emplace_back(new std::barrier<>(32));
      w.bar = warp_bars.back().get();
    }
    blk.dyn.assign(smem / 4 + 1, 0x7eadbeef);  // not zero: a kernel must set what it reads
    blk.stat.assign(64, 0x7eadbeef);
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        threadIdx.x = t, blockIdx.x = b, blockDim.x = threads, gridDim.x = grid, shim_block = &blk;
        kernel(args...);
      });
    for (auto& t : ts) t.join();
  }
}
"""

# The CUDA runtime calls routing.cu makes, and mok/common.cuh's pieces it uses.
RUNTIME_SHIM = r"""
typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr int cudaSuccess = 0, cudaErrorInvalidValue = 1;
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) { std::memset(p, v, n); return 0; }
inline cudaError_t cudaGetLastError() { return 0; }
namespace mok {
template <typename T> constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }
}  // namespace mok
#define MOK_CUDA_RETURN_IF_ERROR(expr) do { cudaError_t e_ = (expr); if (e_) return e_; } while (0)
"""

SHIM = THREAD_SHIM + RUNTIME_SHIM

PTX_SHIM = r"""
#pragma once
namespace mok::comm {
inline uint32_t lanemask_lt() { return shim_lanemask_lt(); }  // the lanemask register
}  // namespace mok::comm
"""

HARNESS = r"""
#include "routing_host.cc"
extern "C" int run_layout(const int32_t* idx, int32_t first, int64_t slots, int32_t k, int32_t E, int32_t block,
                          int32_t chunk, int32_t* pos, int32_t* src_token, int32_t* src_slot, int32_t* gs,
                          int32_t* scratch) {
  mok::ExpertLayoutParams p{};
  p.topk_idx = idx, p.first_expert = &first, p.num_slots = slots, p.top_k = k, p.num_experts = E, p.block = block;
  p.chunk = chunk, p.pos = pos, p.src_token = src_token, p.src_slot = src_slot, p.group_sizes = gs;
  p.scratch = scratch;
  return mok::launch_expert_layout(p, nullptr);
}
"""


def build(tmp: pathlib.Path) -> ctypes.CDLL:
    src = (ROOT / "ffi/src/routing.cu").read_text()
    src = re.sub(r"extern __shared__ int32_t (\w+)\[\];", r"int32_t* \1 = shim_dyn_smem();", src)
    src = re.sub(r"__shared__ int32_t (\w+)\[[^\]]*\];", r"int32_t* \1 = shim_static_smem();", src)
    src = re.sub(r"(\w+)<<<([^,]+), ([^,]+), ([^,]+), stream>>>\(", r"shim_launch(\1, \2, \3, \4, ", src)
    assert "<<<" not in src and "asm(" not in src and "__shared__" not in src, "routing.cu changed: update the rewrites"
    (tmp / "mok").mkdir()
    (tmp / "mok/common.cuh").write_text(SHIM)  # found before ffi/include's: -I order
    (tmp / "mok/comm").mkdir()
    (tmp / "mok/comm/ptx.cuh").write_text(PTX_SHIM)
    (tmp / "routing_host.cc").write_text(src.replace('#include "mok/routing.cuh"', '#include "routing.cuh"'))
    (tmp / "routing.cuh").write_text((ROOT / "ffi/include/mok/routing.cuh").read_text())
    (tmp / "harness.cc").write_text(HARNESS)
    lib = tmp / "liblayout_host.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-Wall", "-Wno-unknown-pragmas", f"-I{tmp}",
                    str(tmp / "harness.cc"), "-o", str(lib), "-lpthread"], check=True)
    out = ctypes.CDLL(str(lib))
    out.run_layout.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64] + [ctypes.c_int32] * 4 + \
        [ctypes.c_void_p] * 5
    return out


def host_layout(lib, idx: np.ndarray, num_experts: int, block: int, first: int, chunk: int | None = None):
    idx = np.ascontiguousarray(idx, np.int32)
    tokens, k = idx.shape
    slots, rows = tokens * k, tokens * k + block * num_experts
    chunk = chunk or layout_chunk(slots, num_experts)
    poison = 0x5A5A5A5A  # every output word the kernels leave alone shows
    pos, src_token = np.full((tokens, k), poison, np.int32), np.full(rows, poison, np.int32)
    src_slot, sizes = src_token.copy(), np.full(num_experts, poison, np.int32)
    scratch = np.full(-(-slots // chunk) * num_experts + num_experts, poison, np.int32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    rc = lib.run_layout(ptr(idx), first, slots, k, num_experts, block, chunk, ptr(pos), ptr(src_token),
                        ptr(src_slot), ptr(sizes), ptr(scratch))
    assert rc == 0, rc
    return pos, src_token, src_slot, sizes


def main(seed: int) -> None:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(pathlib.Path(tmp))
        cases = 0

        def check(idx, num_experts, block, first=0, chunk=None, rank=None, what=""):
            nonlocal cases
            got = host_layout(lib, idx, num_experts, block, first, chunk)
            want = (padded_layout(jnp.asarray(idx), num_experts, block) if rank is None
                    else rank_layout(jnp.asarray(idx), num_experts, rank))
            for name, a, b in zip(("pos", "src_token", "src_slot", "group_sizes"), got, want):
                b = np.asarray(b)
                assert a.shape == b.shape and np.array_equal(a, b), f"{what}: {name} differs"
            cases += 1

        for tokens, k, experts, block in [(1, 1, 1, 128), (300, 4, 8, 128), (333, 6, 7, 16), (0, 8, 5, 128),
                                          (17, 0, 3, 128), (1000, 10, 16, 128), (2048, 8, 12, 1), (100, 32, 64, 3),
                                          (257, 3, 1, 128)]:
            idx = rng.integers(-1, experts + 2, size=(tokens, k), dtype=np.int32)
            for chunk in (None, 32, 96, 4096):  # the op's chunk, and others: the bits do not depend on it
                check(idx, experts, block, chunk=chunk, what=f"T={tokens} k={k} E={experts} block={block} {chunk=}")
        idx = rng.integers(-(2**31), 2**31 - 1, size=(200, 4), dtype=np.int64).astype(np.int32)
        idx[::3, 0] = rng.integers(0, 5, size=idx[::3, 0].shape)
        check(idx, 5, 128, what="ids across the int32 range")
        check(np.full((3000, 8), 2, np.int32), 4, 128, chunk=160, what="every slot to one expert")
        check(np.full((300, 8), -1, np.int32), 4, 128, what="every slot masked")
        for tokens, k, experts in [(4096, 8, 12 * 1024), (512, 16, 1024)]:
            idx = rng.integers(-1, experts + 1, size=(tokens, k), dtype=np.int32)
            idx[: tokens // 4] = 7
            check(idx, experts, 128, what=f"E={experts}")
        for ep, local, tokens, k in [(2, 4, 200, 3), (8, 6, 150, 8), (64, 2, 20, 4), (4, 100, 300, 8)]:
            idx = rng.integers(-1, ep * local + 1, size=(ep * tokens, k), dtype=np.int32)
            for r in sorted({0, 1, ep // 2, ep - 1}):
                for chunk in (None, 64):
                    check(idx, local, 128, first=r * local, rank=r, chunk=chunk, what=f"EP {ep} rank {r} {chunk=}")
    print(f"the host-run kernels give padded_layout's and rank_layout's bits in all {cases} cases (seed {seed})")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
