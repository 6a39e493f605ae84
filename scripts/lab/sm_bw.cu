// A lab program (issue 6, run 4 of the standalone comm ops on two H200s; benchmarks/results/comm_ep2.md), not part
// of the package: the per-SM copy ceilings the projection uses (mok_jax/bench/project.py: SM_STORE_GBPS, SM_LOAD_GBPS,
// SM_PEER_GBPS). Build and run on a GPU machine (two GPUs for the peer lines):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o sm_bw scripts/lab/sm_bw.cu && ./sm_bw
// Per-SM copy throughput on one GPU (and to/from its peer): register (LSU) 16-byte loads/stores vs the
// bulk-copy engine (cp.async.bulk, TMA) vs both at once in one block. One 512-thread block per SM.
//   ./sm_bw   -> lines "op where mode blocks GB/s_total GB/s_per_block"
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int kThreads = 512, kChunk = 16384, kStages = 12;
constexpr int kSmem = kStages * kChunk + 1024;
__device__ __forceinline__ uint32_t sa(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// mode 0: LSU only, 1: TMA only, 2: TMA (warp 0) on the first half + LSU (warps 1..15) on the rest
__global__ void __launch_bounds__(kThreads, 1) store_kernel(uint8_t* dst, size_t per_block, int mode) {
  extern __shared__ __align__(1024) uint8_t sm[];
  for (int i = threadIdx.x; i < kChunk / 16; i += blockDim.x) reinterpret_cast<int4*>(sm)[i] = make_int4(0, 0, 0, 0);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  uint8_t* base = dst + size_t(blockIdx.x) * per_block;
  const size_t tma = mode == 0 ? 0 : mode == 1 ? per_block : per_block / 2 / kChunk * kChunk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (tma && warp == 0) {
    const size_t n = (tma + kChunk - 1) / kChunk;
    for (size_t i = lane; i < n; i += 32) {
      const size_t off = i * kChunk;
      const uint32_t b = uint32_t(tma - off < kChunk ? tma - off : kChunk);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(base + off), "r"(sa(sm)), "r"(b) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  const size_t lsu = per_block - tma;
  const int t0 = mode == 0 ? int(threadIdx.x) : int(threadIdx.x) - 32, nt = mode == 0 ? kThreads : kThreads - 32;
  if (lsu && t0 >= 0) {
    int4* p = reinterpret_cast<int4*>(base + tma);
    const size_t nv = lsu / 16;
    for (size_t i = t0; i < nv; i += nt) asm volatile("st.global.v4.s32 [%0], {%1,%1,%1,%1};" ::"l"(p + i), "r"(0) : "memory");
  }
}

__global__ void __launch_bounds__(kThreads, 1) load_kernel(const uint8_t* src, size_t per_block, int mode, int* sink) {
  extern __shared__ __align__(1024) uint8_t sm[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm + kStages * kChunk);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(bars + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const uint8_t* base = src + size_t(blockIdx.x) * per_block;
  const size_t tma = mode == 0 ? 0 : mode == 1 ? per_block / kChunk * kChunk : per_block / 2 / kChunk * kChunk;
  if (tma && threadIdx.x == 0) {
    const size_t n = tma / kChunk;
    for (size_t i = 0; i < n + kStages; ++i) {
      const int s = int(i % kStages);
      if (i >= kStages) {  // wait for load i - kStages
        const uint32_t par = uint32_t((i / kStages) - 1) & 1u;
        uint32_t done = 0;
        while (!done)
          asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                       : "=r"(done) : "r"(sa(bars + s)), "r"(par) : "memory");
      }
      if (i < n) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(bars + s)), "r"(kChunk) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(sm + size_t(s) * kChunk)),
                     "l"(base + i * kChunk), "r"(kChunk), "r"(sa(bars + s)) : "memory");
      }
    }
  }
  const size_t lsu = (per_block - tma) / 16 * 16;
  const int t0 = mode == 0 ? int(threadIdx.x) : int(threadIdx.x) - 32, nt = mode == 0 ? kThreads : kThreads - 32;
  int acc = 0;
  if (lsu && t0 >= 0) {
    const int4* p = reinterpret_cast<const int4*>(base + tma);
    const size_t nv = lsu / 16;
    size_t i = t0;
    for (; i + 3 * nt < nv; i += 4 * size_t(nt)) {
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + i + u * nt));
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < nv; i += nt) { int4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  if (acc == 0x1234567) sink[0] = acc;
}

int main() {
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const size_t local_bytes = size_t(4) << 30, peer_bytes = size_t(2) << 30;
  uint8_t *a = nullptr, *b = nullptr;
  int* sink;
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&a, local_bytes));
  CK(cudaMemset(a, 1, local_bytes));
  CK(cudaMalloc(&sink, 64));
  if (ndev > 1) {
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&b, peer_bytes));
    CK(cudaMemset(b, 1, peer_bytes));
    CK(cudaDeviceSynchronize());
    CK(cudaSetDevice(0));
    CK(cudaDeviceEnablePeerAccess(1, 0));
  }
  CK(cudaFuncSetAttribute(store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  CK(cudaFuncSetAttribute(load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const char* modes[] = {"lsu", "tma", "tma+lsu"};
  for (int op = 0; op < 2; ++op)
    for (int where = 0; where < (ndev > 1 ? 2 : 1); ++where)
      for (int blocks : {1, 8, 16, 24, 32, 132})
        for (int mode = 0; mode < 3; ++mode) {
          uint8_t* buf = where == 0 ? a : b;
          const size_t cap = where == 0 ? local_bytes : peer_bytes;
          size_t per = std::min<size_t>(size_t(64) << 20, cap / blocks) / kChunk * kChunk;
          auto launch = [&]() {
            if (op == 0) store_kernel<<<blocks, kThreads, kSmem>>>(buf, per, mode);
            else load_kernel<<<blocks, kThreads, kSmem>>>(buf, per, mode, sink);
          };
          launch();
          CK(cudaDeviceSynchronize());
          std::vector<float> ms;
          for (int r = 0; r < 5; ++r) {
            CK(cudaEventRecord(e0));
            launch();
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float t;
            CK(cudaEventElapsedTime(&t, e0, e1));
            ms.push_back(t);
          }
          std::sort(ms.begin(), ms.end());
          const double gbps = double(per) * blocks / (ms[2] * 1e-3) / 1e9;
          printf("%s %s %-7s blocks=%3d  %8.1f GB/s total  %6.1f GB/s per block\n", op == 0 ? "store" : "load ",
                 where == 0 ? "local" : "peer ", modes[mode], blocks, gbps, gbps / blocks);
        }
  return 0;
}
