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
// `stage`: k index pt / 2 of the k-tile is one gathered row, of which thread pt copies chunks [h, h + kN / 16) with
// h = pt % 2 * kN / 16, columns col0 + 8 c of the row; row is its first element (nullptr: a padding row) and n_end
// its length (a multiple of 8; chunks past it are zeros: columns a tile computes and never stores).
template <int kN>
__device__ __forceinline__ void load_mn_major(uint32_t stage, const cutlass::bfloat16_t* row, int col0, int n_end,
                                              int pt, const cutlass::bfloat16_t* any_valid) {
  static_assert(kN == 128 || kN == 256, "a stage's MN extent");
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
