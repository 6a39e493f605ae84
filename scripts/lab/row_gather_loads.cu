// A lab program (issue 33, "the gather fused into the GEMM's load stage"; benchmarks/results/training.md, "The bytes
// the backward moves"), not part of the package. Today the backward first copies the rows of x and dy into the
// expert-major x_e, dy_e (GATHER items), and its GEMM tiles load those by TMA, one 128-row box per stage. To load the
// rows from x and dy directly, the producer must gather a stage's 128 rows itself. Hopper's TMA has no gather (that
// is Blackwell's tile::gather4), so the two candidates are a TMA box of one row per row, or 16-byte cp.async copies
// with the 128-byte swizzle computed by hand. This program answers, before any kernel changes:
//   1. correctness: does a one-row TMA box written at row r of a 1024-byte-aligned stage land with the swizzle of a
//      whole 128-row box (the TMA swizzle following the shared-memory address), and does the hand-swizzled cp.async
//      give the same bytes? Every stage's bytes of every mode are copied out and compared with mode 0's, byte for
//      byte, over all tiles (the output poisoned with 0xff before each run);
//   2. speed: how fast each mode fills the stages of a 4-stage ring on every SM, with a consumer warpgroup that
//      only waits for each stage and frees it (no MMA): the rate a GEMM's mainloop could be fed at.
// The rows: qwen3-30b-a3b's backward, T = 8192 tokens, H = 2048, top-8 of 16 experts, M = 65,536 rows in
// expert-major order (each token k times, ascending within an expert), a stage = 128 rows x 64 columns (16 KB).
// Modes:
//   0  one TMA box of 128 rows x 64 columns from the pre-gathered x_e (what the GEMM tiles do today)
//   1  128 TMA boxes of 1 row x 64 columns from x at the rows' tokens, issued by the 32 lanes of one warp
//   2  16-byte cp.async from x at the rows' tokens by 128 threads (8 copies each), swizzled by hand, each thread's
//      completion counted on the stage's barrier by cp.async.mbarrier.arrive.noinc. This is how SonicMoE gathers on
//      Hopper (sonicmoe/functional/grouped_gemm.py, load_A_gather: the 4 producer warps, 8 threads a 128-byte row,
//      a full barrier of 1 + 128 arrivals, registers 56 / 224); a one-row TMA box should land right too (the
//      128-byte swizzle follows the destination's address bits, (address / 128) % 8, CUDA Programming Guide
//      13.1 10.29.3.2), at 128 TMA issues a stage
//   3  as 2 by the 32 lanes of one warp (32 copies each, 8 lanes a row), each lane's completion tracked by
//      cp.async.mbarrier.arrive without .noinc (it raises the pending count, so the barrier keeps its count of 1),
//      then lane 0's own arrive: the backward megakernel's one producer warp, with the ring's barriers unchanged
// Measured (H100, twenty-ninth session; every mode the same bytes as mode 0), ms per pass of stage fills: mode 0
// 0.0877 (3.06 TB/s, the HBM), 1 0.453, 2 0.0414 (6.48 TB/s: x sits in the L2), 3 0.0655 (4.10 TB/s). Mode 3 in the
// backward's GEMM tiles (branch next/direct-rows) could not keep their MMAs fed: docs/performance_history.md.
// Build here or there, run on a GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o row_gather_loads scripts/lab/row_gather_loads.cu
//   ./row_gather_loads [123] -> per mode: "same bytes as mode 0" or the first differing tile, then GB/s of stage fill
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      printf("ERR %s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                    \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int kT = 8192, kH = 2048, kK = 8, kE = 16;
constexpr int kM = kT * kK;                       // rows of the expert-major layout
constexpr int kRows = 128, kCols = 64;            // a stage: 128 rows x 64 bf16 columns = 128 bytes a row
constexpr int kStageBytes = kRows * kCols * 2;    // 16 KB
constexpr int kStages = 4;
constexpr int kMBlocks = kM / kRows, kKBlocks = kH / kCols;
constexpr int kThreads = 256;                     // warps 0-3: producers; warps 4-7: the consumer warpgroup
constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8 + 1024;

__device__ __forceinline__ uint32_t sa(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
// Set by a wait that gave up; the host reads it after each run.
__device__ int g_timed_out;

// Waits for the barrier's phase; false after about 2 s, or once another wait gave up (checked every 1024 spins), so
// that a copy that never lands (a wrong box, a byte count the barrier never reaches) ends the run, which the host
// then reports, instead of hanging the machine.
__device__ __forceinline__ bool bar_wait(uint64_t* b, uint32_t parity) {
  uint64_t start = 0;
  for (uint32_t n = 0;; ++n) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(sa(b)), "r"(parity)
        : "memory");
    if (done) return true;
    if ((n & 1023u) == 0) {
      if (*reinterpret_cast<volatile int*>(&g_timed_out)) return false;
      uint64_t now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (n == 0) {
        start = now;
      } else if (now - start > 2000000000ull) {
        atomicExch(&g_timed_out, 1);
        return false;
      }
    }
  }
}
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, int col, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(sa(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(sa(bar))
      : "memory");
}

// Every CTA takes m-blocks blockIdx.x, + gridDim.x, ... and each one's kKBlocks stages in order (a GEMM tile's
// k-loop over its rows); copy_out: the consumer writes each stage's raw (swizzled) bytes to out[tile].
__global__ void __launch_bounds__(kThreads, 1)
    fill_kernel(const __grid_constant__ CUtensorMap map_xe, const __grid_constant__ CUtensorMap map_row,
                const uint16_t* __restrict__ x, const int32_t* __restrict__ token, int mode, uint8_t* out,
                unsigned long long* sink) {
  extern __shared__ uint8_t raw[];
  uint8_t* sm = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) bar_init(full + s, mode == 2 ? 128 : 1), bar_init(empty + s, 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = ((kMBlocks - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x)) * kKBlocks;
  if (warp < 4) {  // producers
    if (mode != 2 && warp != 0) return;
    for (int i = 0; i < tiles; ++i) {
      const int s = i % kStages;
      const uint32_t phase = (i / kStages) & 1;
      const int mb = int(blockIdx.x) + (i / kKBlocks) * int(gridDim.x), kb = i % kKBlocks;
      uint8_t* stage = sm + s * kStageBytes;
      if (i >= kStages && !bar_wait(empty + s, phase ^ 1)) return;
      if (mode == 0) {
        if (lane == 0) bar_expect(full + s, kStageBytes), tma_2d(stage, &map_xe, kb * kCols, mb * kRows, full + s);
      } else if (mode == 1) {
        if (lane == 0) bar_expect(full + s, kStageBytes);
        __syncwarp();
        for (int r = lane; r < kRows; r += 32)
          tma_2d(stage + r * 128, &map_row, kb * kCols, token[mb * kRows + r], full + s);
      } else if (mode == 3) {  // warp 0: rows 4 j + lane / 8, 16-byte unit lane % 8
        const int u = lane % 8;
#pragma unroll 8
        for (int j = 0; j < 32; ++j) {
          const int r = 4 * j + lane / 8;
          const uint16_t* src = x + size_t(token[mb * kRows + r]) * kH + kb * kCols + u * 8;
          const uint32_t dst = sa(stage + r * 128 + ((u ^ (r & 7)) << 4));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(sa(full + s)) : "memory");
        __syncwarp();
        if (lane == 0) bar_arrive(full + s);
      } else {
        const int t = threadIdx.x;  // 0..127: rows t / 8 + 16 j, 16-byte unit t % 8
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int r = t / 8 + 16 * j, u = t % 8;
          const uint16_t* src = x + size_t(token[mb * kRows + r]) * kH + kb * kCols + u * 8;
          const uint32_t dst = sa(stage + r * 128 + ((u ^ (r & 7)) << 4));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sa(full + s)) : "memory");
      }
    }
    return;
  }
  // the consumer warpgroup
  const int ct = threadIdx.x - 128;
  unsigned long long acc = 0;
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    if (!bar_wait(full + s, (i / kStages) & 1)) return;
    const uint8_t* stage = sm + s * kStageBytes;
    if (out != nullptr) {
      const int mb = int(blockIdx.x) + (i / kKBlocks) * int(gridDim.x), kb = i % kKBlocks;
      int4* o = reinterpret_cast<int4*>(out + (size_t(mb) * kKBlocks + kb) * kStageBytes);
      for (int v = ct; v < kStageBytes / 16; v += 128) o[v] = reinterpret_cast<const int4*>(stage)[v];
    } else {
      acc += reinterpret_cast<const unsigned long long*>(stage)[ct];  // the stage is read, not only awaited
    }
    __syncwarp();
    if (lane == 0) bar_arrive(empty + s);
  }
  if (acc == 0x1234567u) *sink = acc;  // keeps the reads
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    printf("ERR cuTensorMapEncodeTiled not found\n");
    exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

static CUtensorMap make_map(const void* base, int rows, int box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(kH), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kH) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kCols), cuuint32_t(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                                 estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("ERR cuTensorMapEncodeTiled: %d\n", int(r));
    exit(1);
  }
  return m;
}

// Whether a wait of the runs since the last call gave up (g_timed_out), clearing the flag for the next runs.
static bool gave_up() {
  int flag = 0;
  const int zero = 0;
  CK(cudaMemcpyFromSymbol(&flag, g_timed_out, sizeof(int)));
  CK(cudaMemcpyToSymbol(g_timed_out, &zero, sizeof(int)));
  return flag != 0;
}

int main(int argc, char** argv) {
  // argv[1]: the modes to try besides mode 0 (default "123"), so that one that faults can be left out: a fault
  // (an illegal box, say) ends the process. A mode whose stages never complete is reported and not timed.
  const char* modes = argc > 1 ? argv[1] : "123";
  bool timed_out[4] = {false, false, false, false};
  auto wanted = [&](int mode) { return !timed_out[mode] && (mode == 0 || strchr(modes, '0' + mode) != nullptr); };
  // x: every element's bits name its (row, column), so a misplaced 16 bytes shows; the rows' tokens in expert-major
  // order, uniform routing (k distinct experts per token, seeded).
  std::vector<uint16_t> hx(size_t(kT) * kH);
  for (size_t i = 0; i < hx.size(); ++i) {  // splitmix64's finaliser: every 16 bytes of x distinct (checked in numpy)
    uint64_t z = i;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull, z = (z ^ (z >> 27)) * 0x94d049bb133111ebull, z ^= z >> 31;
    hx[i] = uint16_t(z);
  }
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> rows_of(kE);
  std::vector<int> e(kE);
  std::iota(e.begin(), e.end(), 0);
  for (int t = 0; t < kT; ++t) {
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < kK; ++j) rows_of[e[j]].push_back(t);
  }
  std::vector<int32_t> htok;
  for (auto& v : rows_of) htok.insert(htok.end(), v.begin(), v.end());
  std::vector<uint16_t> hxe(size_t(kM) * kH);
  for (int r = 0; r < kM; ++r) memcpy(&hxe[size_t(r) * kH], &hx[size_t(htok[r]) * kH], kH * 2);

  uint16_t *x, *xe;
  int32_t* tok;
  uint8_t* out;
  unsigned long long* sink;
  const size_t out_bytes = size_t(kMBlocks) * kKBlocks * kStageBytes;
  CK(cudaMalloc(&x, hx.size() * 2));
  CK(cudaMalloc(&xe, hxe.size() * 2));
  CK(cudaMalloc(&tok, htok.size() * 4));
  CK(cudaMalloc(&out, out_bytes));
  CK(cudaMalloc(&sink, 8));
  CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(xe, hxe.data(), hxe.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(tok, htok.data(), htok.size() * 4, cudaMemcpyHostToDevice));
  const CUtensorMap map_xe = make_map(xe, kM, kRows), map_row = make_map(x, kT, 1);
  CK(cudaFuncSetAttribute(fill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs; M %d rows x H %d, stages of %d x %d bf16\n", prop.name, sms, kM, kH, kRows, kCols);

  std::vector<uint8_t> want(out_bytes), got(out_bytes);
  const char* names[4] = {"TMA box from x_e (today)", "TMA per row from x", "cp.async per 16 B from x",
                          "cp.async, one warp"};
  for (int mode = 0; mode < 4; ++mode) {
    if (!wanted(mode)) continue;
    CK(cudaMemset(out, 0xff, out_bytes));
    fill_kernel<<<sms, kThreads, kSmem>>>(map_xe, map_row, x, tok, mode, out, sink);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (gave_up()) {
      timed_out[mode] = true;
      printf("mode %d %-26s TIMED OUT: a stage did not complete within 2 s\n", mode, names[mode]);
      if (mode == 0) return 1;  // nothing to compare the others with
      continue;
    }
    CK(cudaMemcpy(mode == 0 ? want.data() : got.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    if (mode == 0) {  // mode 0 against the host's own swizzle of x_e: (r, unit u) at r * 128 + (u ^ r % 8) * 16
      size_t bad = 0;
      for (int mb = 0; mb < kMBlocks && bad == 0; ++mb)
        for (int kb = 0; kb < kKBlocks; ++kb)
          for (int r = 0; r < kRows; ++r)
            for (int u = 0; u < 8; ++u) {
              const uint8_t* o = &want[(size_t(mb) * kKBlocks + kb) * kStageBytes + r * 128 + ((u ^ (r & 7)) << 4)];
              if (memcmp(o, &hxe[size_t(mb * kRows + r) * kH + kb * kCols + u * 8], 16) != 0) ++bad;
            }
      printf("mode 0 %-26s %s\n", names[0], bad ? "DIFFERS from the host's swizzle of x_e" : "the host's swizzle of x_e");
    } else {
      size_t first = out_bytes;
      for (size_t i = 0; i < out_bytes; ++i)
        if (got[i] != want[i]) {
          first = i;
          break;
        }
      if (first == out_bytes)
        printf("mode %d %-26s same bytes as mode 0 (%zu tiles)\n", mode, names[mode], out_bytes / kStageBytes);
      else
        printf("mode %d %-26s DIFFERS: tile %zu, byte %zu of its stage\n", mode, names[mode], first / kStageBytes,
               first % kStageBytes);
    }
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const int reps = 20;
  printf("%-34s %10s %10s\n", "mode (stages awaited and freed, no MMA)", "ms/pass", "GB/s");
  for (int round = 0; round < 2; ++round)  // the second round is the one to read (the first warms clocks and L2)
    for (int mode = 0; mode < 4; ++mode) {
      if (!wanted(mode)) continue;
      for (int w = 0; w < 3; ++w) fill_kernel<<<sms, kThreads, kSmem>>>(map_xe, map_row, x, tok, mode, nullptr, sink);
      CK(cudaEventRecord(a));
      for (int i = 0; i < reps; ++i) fill_kernel<<<sms, kThreads, kSmem>>>(map_xe, map_row, x, tok, mode, nullptr, sink);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      ms /= reps;
      if (gave_up()) {  // the times would be of runs that stopped early
        timed_out[mode] = true;
        printf("mode %d %-27s TIMED OUT while timed\n", mode, names[mode]);
        continue;
      }
      if (round == 1)
        printf("mode %d %-27s %10.4f %10.0f\n", mode, names[mode], ms, double(kM) * kH * 2 / (ms * 1e-3) / 1e9);
    }
  CK(cudaGetLastError());
  return 0;
}
