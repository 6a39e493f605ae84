// mok backward: the weight-gradient tiles, both kinds: WDOWN (d_down = hw^T dy_e) and WGATEUP (d_gate_up =
// x_e^T dgu), each over its expert's rows as the k range; an empty expert's tile is exact zeros (NaN after bad
// group sizes).
// An item type: its waits and TMA loads (the producer thread), its run (the 256 consumer threads: the MMAs, then
// the epilogue) and its completion (one consumer thread). A tile of the shared expert (it.shared) reads the
// shared expert's operands, whose rows are the T tokens'. They complete nothing that another item waits for.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"

namespace mok {
namespace {

struct WeightGradItem {
  // Waits for every row of its expert: the expert's GATHER items and DH tiles (the shared expert's: its DH tiles).
  template <bool kShared>
  __device__ static __forceinline__ bool wait(const KernelParams& p, const SharedStorage& s, const Shape& h,
                                              const Counters& c, const Item& it) {
    if constexpr (kShared) return wait_count(c.dh_e + p.E, h.s_mb * h.s_nb_dh, p.status, p.local_timeout_ns);
    const int mbs = s.table.tile_start[it.group + 1] - s.table.tile_start[it.group];
    return wait_count(c.gathered_e + it.group, mbs, p.status, p.local_timeout_ns) &&
           wait_count(c.dh_e + it.group, mbs * h.nb_dh, p.status, p.local_timeout_ns);
  }
  // The rows are the k range: the item's [k0, k0 + k_len).
  __device__ static __forceinline__ bool load(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                              int rows, int H, int inter, int groups, int group, int32_t* status) {
    const int col0 = it.n_block * kBlockN, col1 = col0 + kHalfN, m0 = it.m_block * kBlockM;
    if (it.kind == kWDown)
      return TileW::load_tile(o.wd_a, o.wd_b, s.stages, pos, {inter, rows, m0, H, 1, 0, col0, col1, it.k0, it.k_len},
                              status);
    return TileW::load_tile(o.wg_a, o.wg_b, s.stages, pos,
                            {H, rows, m0, 2 * inter, 1, 0, col0, col1, it.k0, it.k_len}, status);
  }
  // False: the stage ring's wait failed (the status says why).
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it, gemm::RingPos& pos,
                                             uint64_t& t_epi) {
    const KernelParams& p = x.p;
    const int ct = x.ct, wg = x.wg, t = x.t, col0 = it.n_block * kBlockN;
    const bool down = it.kind == kWDown;
    const int inter = it.shared ? p.Is : p.I;
    const int m_dim = down ? inter : p.H, n_dim = down ? p.H : 2 * inter;
    Bf16* out = it.shared ? (down ? p.d_shared_down : p.d_shared_gate_up)
                          : (down ? p.d_down : p.d_gate_up) + int64_t(it.group) * m_dim * n_dim;
    const TileW::TileStore st{out, n_dim, it.m_block * kBlockM, m_dim, col0, n_dim};
    if (it.k_len == 0) {  // an empty expert (or no tokens): exact zeros (the accumulator is not involved)
      gemm::Sm90WeightGrad::fill_tile(st, ct, x.s.bad && !it.shared);  // zeros, or NaN after bad sizes
      return true;
    }
    TileW::Accumulator acc;
    if (!TileW::mma_tile(x.s.stages, pos, acc, it.k_len, ct, p.status)) return false;
    if (ct == 0) t_epi = gemm::global_timer_ns();
    TileW::store_bf16<false>(acc, x.s.epi[wg], st, wg, t);
    return true;
  }
};

}  // namespace
}  // namespace mok
