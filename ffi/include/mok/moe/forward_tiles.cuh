// mok moe: the forward megakernel's GEMM tiles, the shared and the routed experts' gate/up and down: the
// producer's TMA loads of a tile (load_item: tile_load, and fp8_tile_load in the FP8 form), the consumers' MMAs and
// epilogues (tile_item: store_item, store_kept_gu for the kept g, u, and fp8_tile_item in the FP8 form).
// Included by forward_kernel.cuh only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/moe/forward_params.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

// ================================================================================ GEMM tiles

// FP8 routed tiles (kFp8): GU reads the ring's x_q and gate_up, DN reads h_q and down (both K-major).
__device__ inline Fp8Tile::TileLoad fp8_tile_load(const Plan& p, const Item& it) {
  const int rows = p.S * p.slot_rows;
  if (it.kind == kGu)
    return Fp8Tile::TileLoad{rows, p.H, it.row0, 2 * p.I, p.L, it.group, it.n_block * kGuCols,
                             it.n_block * kGuCols + p.I};
  return Fp8Tile::TileLoad{rows, p.I, it.row0, p.H, p.L, it.group, it.n_block * kDnCols,
                           it.n_block * kDnCols + Fp8Tile::kHalfN};
}

__device__ __forceinline__ bool is_routed(int kind) { return kind == kGu || kind == kDn; }

__device__ inline Tile::TileLoad tile_load(const Plan& p, const Item& it) {
  const int rows = p.S * p.slot_rows;
  switch (it.kind) {
    case kGu:
      return Tile::TileLoad{rows, p.H, it.row0, 2 * p.I, p.L, it.group, it.n_block * kGuCols,
                            it.n_block * kGuCols + p.I};
    case kDn:
      return Tile::TileLoad{rows, p.I, it.row0, p.H, p.L, it.group, it.n_block * kDnCols,
                            it.n_block * kDnCols + Tile::kHalfN};
    case kSharedGu:
      return Tile::TileLoad{p.T, p.H, it.row0, 2 * p.Is, 1, 0, it.n_block * kGuCols, it.n_block * kGuCols + p.Is};
    default:  // kSharedDn
      return Tile::TileLoad{p.T, p.Is, it.row0, p.H, 1, 0, it.n_block * kDnCols, it.n_block * kDnCols + Tile::kHalfN};
  }
}

template <bool kFp8>
__device__ inline bool load_item(const RankParams& R, SharedStorage& s, Tile::StagePos& pos, const Plan& p,
                                 const Item& it, int32_t* status) {
  if constexpr (kFp8) {
    if (is_routed(it.kind)) {
      const Fp8Tile::TileLoad t = fp8_tile_load(p, it);
      const Fp8RoutedTma& d = R.routed.fp8;
      return it.kind == kGu
                 ? Fp8Tile::load_tile(d.a_gu, d.b_gu, R.recv_scale, p.scale_ld, R.b_gu_scale, s.stages, s.scales,
                                      pos, t, status)
                 : Fp8Tile::load_tile(d.a_dn, d.b_dn, R.h_scale, p.scale_ld, R.b_dn_scale, s.stages, s.scales, pos,
                                      t, status);
    }
  }
  const Tile::TileLoad t = tile_load(p, it);
  switch (it.kind) {
    case kGu: return Tile::load_tile(R.routed.bf16.a_gu, R.routed.bf16.b_gu, s.stages, pos, t, status);
    case kDn: return Tile::load_tile(R.routed.bf16.a_dn, R.routed.bf16.b_dn, s.stages, pos, t, status);
    case kSharedGu: return Tile::load_tile(R.a_sgu, R.b_sgu, s.stages, pos, t, status);
    default: return Tile::load_tile(R.a_sdn, R.b_sdn, s.stages, pos, t, status);
  }
}

__device__ inline int tile_k(const Plan& p, int kind) {
  return kind == kGu || kind == kSharedGu ? p.H : kind == kDn ? p.I : p.Is;
}

// Kept g, u: the gate/up tile's fp32 accumulators of its rows rounded to bf16 (round to nearest even, as the
// backward's recompute stores them), row by row to the row dst_of(row) of the [rows][2 inter] buffer gu (g in columns
// [0, inter), u in [inter, 2 inter); a negative dst: not kept), straight from registers (4-byte stores; a row's 4 lanes
// write 16 contiguous bytes). Value i of thread t: row 16 (t/32) + (t%32)/4 + 8 ((i/2)%2), column 8 (i/4) + 2 (t%4) +
// i%2 of the 256 MMA columns, whose first 128 are gate columns and last 128 the matching up columns.
template <class DstOf>
__device__ __forceinline__ void store_gu_rows(const Tile::Accumulator& acc, const Item& it, int inter,
                                              __nv_bfloat16* gu, DstOf dst_of, int wg, int t) {
  const int lane = t % 32, warp = t / 32;
  const int r_base = it.row0 + Tile::kRowsPerConsumer * wg + 16 * warp + lane / 4;
  const int c_base = it.n_block * kGuCols + 2 * (lane % 4);
  CUTE_UNROLL
  for (int hh = 0; hh < 2; ++hh) {
    const int row = r_base + 8 * hh;
    const int32_t dst = row < it.row_end ? dst_of(row) : -1;
    if (dst < 0) continue;
    __nv_bfloat16* g = gu + int64_t(dst) * 2 * inter;
    CUTE_UNROLL
    for (int q = 0; q < kGuCols / 8; ++q) {
      const int i = 4 * q + 2 * hh;
      const int col = c_base + 8 * q;
      if (col < inter) {  // volatile: issued in order, so the compiler does not hold 64 addresses at once
        asm volatile("st.global.b32 [%0], %1;" ::"l"(g + col), "r"(Tile::pack_bf16x2(acc(i), acc(i + 1))));
        asm volatile("st.global.b32 [%0], %1;" ::"l"(g + inter + col),
                     "r"(Tile::pack_bf16x2(acc(i + 64), acc(i + 65))));
      }
    }
  }
}

// The routed experts' kept g, u (ForwardRank::keep_gu): each ring row to its slot's row of keep_gu.
__device__ inline void store_kept_gu(const Plan& p, const RankParams& R, const Tile::Accumulator& acc, const Item& it,
                                     int wg, int t) {
  const int ring_row0 = (it.mb % p.S) * p.slot_rows;
  const int32_t* row_slot = R.row_slot + int64_t(it.mb) * p.slot_rows;
  store_gu_rows(acc, it, p.I, R.keep_gu, [&](int row) -> int32_t {
    const int32_t d = R.keep_pos[__ldcg(row_slot + (row - ring_row0))];  // written by PLACE items (L2)
    return d >= 0 && d < R.keep_rows ? d : -1;
  }, wg, t);
}

// The FP8 form's bf16 tiles are the shared expert's only (its routed tiles are fp8_tile_item's), so the routed
// epilogues are not compiled into it: their registers spilled into the FP8 consumer's.
template <bool kFp8>
__device__ inline void store_item(const Plan& p, const RankParams& R, SharedStorage& s, const Tile::Accumulator& acc,
                                  const Item& it, int wg, int t) {
  switch (it.kind) {
    case kGu:
      if constexpr (!kFp8) {
        if (R.keep_gu != nullptr) store_kept_gu(p, R, acc, it, wg, t);
        Tile::store_bf16<true>(acc, s.epi[wg],
                               Tile::TileStore{R.h, p.I, it.row0, it.row_end, it.n_block * kGuCols, p.I}, wg, t);
        gemm::fence_proxy_async_global();  // the DN tiles read h with TMA
      }
      break;
    case kDn:
      if constexpr (!kFp8) {
        Tile::store_bf16<false>(acc, s.epi[wg],
                                Tile::TileStore{R.recv, p.H, it.row0, it.row_end, it.n_block * kDnCols, p.H}, wg, t);
      }
      break;
    case kSharedGu:
      if constexpr (!kFp8) {  // the shared expert's kept g, u: a token's row is its own (the FP8 form keeps none)
        if (R.keep_shared_gu != nullptr)
          store_gu_rows(acc, it, p.Is, R.keep_shared_gu, [](int row) { return row; }, wg, t);
      }
      Tile::store_bf16<true>(acc, s.epi[wg],
                             Tile::TileStore{R.shared_h, p.Is, it.row0, it.row_end, it.n_block * kGuCols, p.Is}, wg, t);
      gemm::fence_proxy_async_global();
      break;
    default:
      Tile::store_regs<float>(acc, Tile::TileStore{R.shared_out, p.H, it.row0, it.row_end, it.n_block * kDnCols, p.H},
                               0, wg, t);
      break;
  }
}

// A GEMM tile: MMAs, then the epilogue. (Kept inline: as a called function its accumulators spilled.) The
// accumulators' 128 registers stay allocated across the whole consumer loop, which is why the row movers of
// the communication items keep few vectors in flight (kSendUnroll etc.): more spilled.
// An FP8 routed tile: chains and promotions into two 64-value totals, then GU's SwiGLU with h quantised (E4M3 and
// its scales, read by DN's TMA next) or DN's bf16 rows over the ring rows, in place.
__device__ __forceinline__ bool fp8_tile_item(const Plan& p, const RankParams& R, SharedStorage& s, Tile::StagePos& pos,
                                           const Item& it, int ct) {
  Fp8Tile::Accumulator total0, total1;
  const int n_k = (it.kind == kGu ? p.H : p.I) / gemm::kFp8ScaleBlock;
  if (!Fp8Tile::mma_tile(s.stages, s.scales, pos, total0, total1, n_k, it.row0 % gemm::kFp8RowScaleSlack, ct,
                         nullptr))
    return false;
  const int wg = ct / 128, t = ct % 128;
  if (it.kind == kGu) {
    Fp8Tile::store_swiglu_quant(total0, total1,
                                Fp8Tile::TileStore{{R.h, p.I, it.row0, it.row_end, it.n_block * kGuCols, p.I},
                                                   R.h_scale, p.scale_ld},
                                wg, t);
    gemm::fence_proxy_async_global();  // the DN tiles read h and its scales with TMA
  } else {
    const Fp8Tile::TileStore st{{R.recv, p.H, it.row0, it.row_end, it.n_block * kDnCols, p.H}};
    Fp8Tile::store_bf16_half(total0, st, 0, wg, t);
    Fp8Tile::store_bf16_half(total1, st, Fp8Tile::kHalfN, wg, t);
  }
  return true;
}

template <bool kFp8>
__device__ __forceinline__ bool tile_item(const Plan& p, const RankParams& R, SharedStorage& s, Tile::StagePos& pos,
                                       const Item& it, int ct) {
  if constexpr (kFp8) {
    if (is_routed(it.kind)) return fp8_tile_item(p, R, s, pos, it, ct);
  }
  Tile::Accumulator acc;
  if (!Tile::mma_tile(s.stages, pos, acc, tile_k(p, it.kind), ct, nullptr)) return false;
  store_item<kFp8>(p, R, s, acc, it, ct / 128, ct % 128);
  return true;
}

}  // namespace mok::moe
