// mok gemm: a stage of the ring (sm90_tile.cuh) filled with rows gathered by index, by the 128 threads of a
// producer warpgroup, in place of a TMA box over rows copied into expert-major order beforehand (the backward's
// GATHER writes x_e and dy_e for that; docs/performance_history.md, "Rows gathered in the loader"). SonicMoE's
// Hopper loader does this: each thread copies 16-byte chunks with cp.async (sixteen zero bytes for a padding row)
// and arrives on the stage's full barrier once its own copies have landed (cp.async.mbarrier.arrive.noinc), so a
// ring fed this way takes 1 + kThreads arrivals a phase: the producer thread's, with the bytes of the stage's TMA
// loads (the other operand), and one of each loader thread.
//
// The chunks land where a TMA box with the 128-byte swizzle puts them; the offsets below are CuTe's layouts of the
// stage (row_gather_offsets_checked, a host check that the tests run through the native library):
//   K-major  128 rows x 64 k:  row r at r * 128 bytes, its chunk c (k in [8c, 8c + 8)) at (c ^ r % 8) * 16
//   MN-major n x 64 k:         atoms of 64 n x 8 k (1 KB) tiled along k first; k index kk's chunk c (n in
//                              [8c, 8c + 8)) in atom (c / 8, kk / 8), at kk % 8 * 128 + (c % 8 ^ kk % 8) * 16
#pragma once

#include <cstdint>

#include <cutlass/bfloat16.h>

namespace mok::gemm::row_gather {

constexpr int kThreads = 128;  // the producer warpgroup
constexpr int kChunkElems = 8;  // bf16 in a 16-byte chunk

__host__ __device__ constexpr uint32_t k_major_offset(int r, int c) {
  return uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
}
__host__ __device__ constexpr uint32_t mn_major_offset(int kk, int c) {
  return uint32_t(((c / 8) * 8 + kk / 8) * 1024 + (kk % 8) * 128 + (((c % 8) ^ (kk % 8)) << 4));
}

#if defined(__CUDACC__)
// 16 bytes from src to shared address dst, or sixteen zero bytes where src is nullptr (a padding row).
__device__ __forceinline__ void copy_chunk(uint32_t dst, const cutlass::bfloat16_t* src,
                                           const cutlass::bfloat16_t* any_valid) {
  const uint32_t bytes = src != nullptr ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src != nullptr ? src : any_valid),
               "r"(bytes)
               : "memory");
}

// This thread's arrival on the stage's full barrier once its copies have landed (the barrier counts it: .noinc).
__device__ __forceinline__ void arrive_when_landed(uint64_t* full) {
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// K-major A, 128 rows x 64 k, of a stage at shared address `stage`: thread pt copies chunk pt % 8 of rows
// pt / 8 + 16 i (i < 8); row[i] is that row's first element (nullptr: a padding row), col the k-tile's first column,
// k_end the row's length (a multiple of 8; chunks past it are zeros, as TMA fills past a matrix). Each row's 128
// bytes are read by 8 neighbouring threads.
__device__ __forceinline__ void load_k_major(uint32_t stage, const cutlass::bfloat16_t* const (&row)[8], int col,
                                             int k_end, int pt, const cutlass::bfloat16_t* any_valid) {
  const int c = pt % 8, r0 = pt / 8;
  const bool in = col + c * kChunkElems < k_end;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 16 * i;
    copy_chunk(stage + k_major_offset(r, c), in && row[i] != nullptr ? row[i] + col + c * kChunkElems : nullptr,
               any_valid);
  }
}

// MN-major, kN x 64 k (kN 128 or 256: an A tile of a weight gradient, or its B), of a stage at shared address
// `stage`: the k-tile's 64 k indices are 64 gathered rows, columns col0 + 8 c of each (n_end: the row's length, a
// multiple of 8; chunks past it are zeros, columns a tile computes and never stores). Lane l of each warp holds the
// first elements of rows l and l + 32 (lo, hi; nullptr: a padding row), and the warp hands them round by shuffles.
// Thread pt copies chunk pt % (kN / 8) of rows pt / (kN / 8) + (128 / (kN / 8)) i: each row's kN * 2 bytes are read
// by neighbouring threads in whole 128-byte lines, as in load_k_major (a thread pair a row, each with half its
// chunks, left every 32-byte sector half used by each instruction: the weight gradients ran 2-3x slower).
template <int kN>
__device__ __forceinline__ void load_mn_major(uint32_t stage, const cutlass::bfloat16_t* lo,
                                              const cutlass::bfloat16_t* hi, int col0, int n_end, int pt,
                                              const cutlass::bfloat16_t* any_valid) {
  static_assert(kN == 128 || kN == 256, "a stage's MN extent");
  constexpr int kChunks = kN / kChunkElems;        // a row's chunks: 16 or 32
  constexpr int kRowsAPass = kThreads / kChunks;   // 8 or 4
  constexpr int kPasses = 64 / kRowsAPass;         // 8 or 16; the first half reads rows < 32 (lo)
  const int c = pt % kChunks, r0 = pt / kChunks, col = col0 + c * kChunkElems;
  const bool in = col < n_end;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int kk = r0 + kRowsAPass * i;
    const auto from = reinterpret_cast<unsigned long long>(i < kPasses / 2 ? lo : hi);
    const auto row = reinterpret_cast<const cutlass::bfloat16_t*>(__shfl_sync(0xffffffffu, from, kk % 32));
    copy_chunk(stage + mn_major_offset(kk, c), in && row != nullptr ? row + col : nullptr, any_valid);
  }
}
// The thread-pair form of load_mn_major (lab): k index pt / 2 is one gathered row, of which thread pt copies chunks
// [h, h + kN / 16) with h = pt % 2 * kN / 16.
template <int kN>
__device__ __forceinline__ void load_mn_major_pairs(uint32_t stage, const cutlass::bfloat16_t* row, int col0,
                                                    int n_end, int pt, const cutlass::bfloat16_t* any_valid) {
  constexpr int kPerThread = kN / 16;
  const int kk = pt / 2, c0 = pt % 2 * kPerThread;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int c = c0 + j, col = col0 + c * kChunkElems;
    copy_chunk(stage + mn_major_offset(kk, c), row != nullptr && col < n_end ? row + col : nullptr, any_valid);
  }
}
#endif

}  // namespace mok::gemm::row_gather
