// mok backward: a DX tile: the per-row dx = dgu @ gate_up^T (the shared expert's in f32, which SLOT adds before
// its one rounding).
// An item type: its waits and TMA loads (the producer thread), its run (the 256 consumer threads: the MMAs, then
// the epilogue) and its completion (one consumer thread). A tile of the shared expert (it.shared) reads the
// shared expert's operands, whose rows are the T tokens'.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok {
namespace {

struct DxItem {
  // Waits for its m-block's DH tiles.
  template <bool kShared>
  __device__ static __forceinline__ bool wait(const KernelParams& p, const SharedStorage& s, const Shape& h,
                                              const Counters& c, const Item& it) {
    return wait_count(c.dh + it.mb, kShared ? h.s_nb_dh : h.nb_dh, p.status, p.local_timeout_ns);
  }
  __device__ static __forceinline__ bool load(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                              int rows, int H, int inter, int groups, int group, int32_t* status) {
    const int col0 = it.n_block * kBlockN, col1 = col0 + kHalfN;
    return TileKK::load_tile(o.dx_a, o.dx_b, s.stages, pos, {rows, 2 * inter, it.row0, H, groups, group, col0, col1},
                             status);
  }
  // False: the stage ring's wait failed (the status says why).
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it, gemm::RingPos& pos,
                                             uint64_t& t_epi) {
    const KernelParams& p = x.p;
    const int ct = x.ct, wg = x.wg, t = x.t, col0 = it.n_block * kBlockN;
    TileKK::Accumulator acc;
    if (!TileKK::mma_tile(x.s.stages, pos, acc, 2 * (it.shared ? p.Is : p.I), ct, p.status)) return false;
    if (ct == 0) t_epi = gemm::global_timer_ns();
    if (it.shared)  // fp32: the slot sum adds it to the routed sum before the one rounding
      TileKK::store_regs<float>(acc, {p.dxs, p.H, it.row0, it.row_end, col0, p.H}, 0, wg, t);
    else
      TileKK::store_bf16<false>(acc, x.s.epi[wg], {p.dx_e, p.H, it.row0, it.row_end, col0, p.H}, wg, t);
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    atomicAdd(c.totals + 0, 1), atomicAdd(c.out + it.mb, 1);
  }
};

}  // namespace
}  // namespace mok
