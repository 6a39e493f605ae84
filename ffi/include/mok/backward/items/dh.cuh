// mok backward: a DH tile: dh = dy_e @ down^T, and in its epilogue the SwiGLU backward (dgu, hw and the
// router-weight partials; gemm/swiglu_backward.cuh).
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
#include "mok/gemm/swiglu_backward.cuh"

namespace mok {
namespace {

struct DhItem {
  // Waits for its m-block's GATHER and, unless g, u were kept, its GU tiles (the shared expert's: its GU tiles).
  template <bool kShared>
  __device__ static __forceinline__ bool wait(const KernelParams& p, const SharedStorage& s, const Shape& h,
                                              const Counters& c, const Item& it) {
    if constexpr (kShared) return wait_count(c.gu + it.mb, h.s_nb_gu, p.status, p.local_timeout_ns);
    return wait_count(c.gathered + it.mb, 1, p.status, p.local_timeout_ns) &&
           (p.kept || wait_count(c.gu + it.mb, h.nb_gu, p.status, p.local_timeout_ns));
  }
  // The k-tiles, then the epilogue's g, u chunks.
  __device__ static __forceinline__ bool load(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                              int rows, int H, int inter, int groups, int group, int32_t* status) {
    const int col0 = it.n_block * kBlockN, col1 = col0 + kHalfN;
    return TileKK::load_tile(o.dh_a, o.dh_b, s.stages, pos, {rows, H, it.row0, inter, groups, group, col0, col1},
                             status) &&
           gemm::load_gu_chunks(o.dh_gu, s.stages, pos, rows, inter, it.row0, col0, status);
  }
  // False: the stage ring's wait failed (the status says why).
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it, gemm::RingPos& pos,
                                             uint64_t& t_epi) {
    const KernelParams& p = x.p;
    SharedStorage& s = x.s;
    const int ct = x.ct, wg = x.wg, t = x.t, col0 = it.n_block * kBlockN;
    // The epilogue reads the routed rows' router weights (w_e, which the gather items store) with ordinary
    // loads, issued before the MMAs so that their latency runs under them: once the tile's first stage is full
    // they are visible here (the producer acquired the gather's counter before that stage's loads, and the
    // stage's full barrier passes that on). Everything else the epilogue reads (g, u) comes through the stage ring.
    gemm::RowWeights rw;
    if (!it.shared) {
      if (!gemm::mbarrier_wait(&s.stages.full[pos.stage], pos.phase, p.status)) return false;
      rw = gemm::swiglu_row_weights(p.bwd, it.row0, it.row_end, wg, t);
    }
    TileKK::Accumulator acc;
    if (!TileKK::mma_tile(s.stages, pos, acc, p.H, ct, p.status)) return false;
    if (ct == 0) t_epi = gemm::global_timer_ns();
    const bool ok = it.shared  // weight 1, no router-weight partials
                        ? gemm::swiglu_backward_store<TileKK::Accumulator, false>(
                              acc, p.sbwd, gemm::swiglu_row_weights<false>(p.sbwd, it.row0, it.row_end, wg, t),
                              s.stages, pos, it.row0, it.row_end, col0, it.n_block, wg, t, p.status)
                        : gemm::swiglu_backward_store(acc, p.bwd, rw, s.stages, pos, it.row0, it.row_end, col0,
                                                      it.n_block, wg, t, p.status);
    if (!ok) return false;
    gemm::fence_proxy_async_global();  // DX and the weight gradients read dgu and hw through TMA
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    atomicAdd(c.dh + it.mb, 1), atomicAdd(c.dh_e + it.group, 1);
  }
};

}  // namespace
}  // namespace mok
