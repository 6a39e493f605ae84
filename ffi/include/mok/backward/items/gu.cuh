// mok backward: a GU tile: g | u = x_e @ gate_up, recomputed (the forward kept none of this block's), stored as
// bf16 as the forward rounds them.
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

struct GuItem {
  // Waits for its m-block's GATHER (the shared expert's: for nothing, x is an input).
  template <bool kShared>
  __device__ static __forceinline__ bool wait(const KernelParams& p, const SharedStorage& s, const Shape& h,
                                              const Counters& c, const Item& it) {
    if constexpr (kShared) return true;
    return wait_count(c.gathered + it.mb, 1, p.status, p.local_timeout_ns);
  }
  __device__ static __forceinline__ bool load(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                              int rows, int H, int inter, int groups, int group, int32_t* status) {
    const int col0 = it.n_block * kBlockN, col1 = col0 + kHalfN;
    return TileGu::load_tile(o.gu_a, o.gu_b, s.stages, pos, {rows, H, it.row0, 2 * inter, groups, group, col0, col1},
                             status);
  }
  // False: the stage ring's wait failed (the status says why).
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it, gemm::RingPos& pos,
                                             uint64_t& t_epi) {
    const KernelParams& p = x.p;
    const int ct = x.ct, wg = x.wg, t = x.t, col0 = it.n_block * kBlockN;
    if (!it.shared && block_kept(p, it.mb)) return true;  // its GATHER copied the kept g, u
    TileGu::Accumulator acc;
    if (!TileGu::mma_tile(x.s.stages, pos, acc, p.H, ct, p.status)) return false;
    if (ct == 0) t_epi = gemm::global_timer_ns();
    const int n = 2 * (it.shared ? p.Is : p.I);
    // bf16, as the forward keeps them (the same rounding of the same fp32 accumulators)
    TileGu::store_bf16<false>(acc, x.s.epi[wg], {it.shared ? p.gus : p.gu, n, it.row0, it.row_end, col0, n}, wg, t);
    gemm::fence_proxy_async_global();  // the DH tiles read g, u through TMA
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    atomicAdd(c.gu + it.mb, 1);
  }
};

}  // namespace
}  // namespace mok
