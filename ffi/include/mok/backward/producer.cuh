// mok backward: the backward megakernel's producer, one thread per CTA. It claims the items by ticket, hands
// each to the consumers through the work queue, and for a GEMM tile waits (bounded) for its inputs' counters
// (wait_inputs), then issues its TMA loads into the stage ring (load_item).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "mok/backward/items.cuh"
#include "mok/backward/params.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/swiglu_backward.cuh"

namespace mok {
namespace {

// ---- producer (one thread): wait for a tile's inputs, then its TMA loads ---------------------------------
__device__ bool wait_inputs(const KernelParams& p, const SharedStorage& s, const Shape& h, const Item& it) {
  const Counters c = counters(p);
  if (it.shared) {
    switch (it.kind) {
      case kGu: return true;  // x is an input
      case kDh: return wait_count(c.gu + it.mb, h.s_nb_gu, p.status, p.local_timeout_ns);
      case kDx: return wait_count(c.dh + it.mb, h.s_nb_dh, p.status, p.local_timeout_ns);
      default: return wait_count(c.dh_e + p.E, h.s_mb * h.s_nb_dh, p.status, p.local_timeout_ns);
    }
  }
  switch (it.kind) {
    case kGu: return wait_count(c.gathered + it.mb, 1, p.status, p.local_timeout_ns);
    case kDh:
      return wait_count(c.gathered + it.mb, 1, p.status, p.local_timeout_ns) &&
             (p.kept || wait_count(c.gu + it.mb, h.nb_gu, p.status, p.local_timeout_ns));
    case kDx: return wait_count(c.dh + it.mb, h.nb_dh, p.status, p.local_timeout_ns);
    default: {  // weight gradients: every row of the expert
      const int mbs = s.table.tile_start[it.group + 1] - s.table.tile_start[it.group];
      return wait_count(c.gathered_e + it.group, mbs, p.status, p.local_timeout_ns) &&
             wait_count(c.dh_e + it.group, mbs * h.nb_dh, p.status, p.local_timeout_ns);
    }
  }
}

template <class Tile, class TmaA, class TmaB>
__device__ __forceinline__ bool load(const TmaA& a, const TmaB& b, SharedStorage& s, gemm::RingPos& pos,
                                     const typename Tile::TileLoad& t, int32_t* status) {
  return Tile::load_tile(a, b, s.stages, pos, t, status);
}

// The TMA loads of tile item `it` over one set of operands (the routed experts' or the shared expert's): `rows`
// rows, intermediate size `inter`, `groups` weight matrices of which the tile's is `group`. Weight-gradient tiles
// reduce over the item's k range.
__device__ __forceinline__ bool load_item(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                          int rows, int H, int inter, int groups, int group, int32_t* status) {
  const int col0 = it.n_block * kBlockN, col1 = col0 + kHalfN, m0 = it.m_block * kBlockM;
  switch (it.kind) {
    case kGu:
      return load<TileGu>(o.gu_a, o.gu_b, s, pos, {rows, H, it.row0, 2 * inter, groups, group, col0, col1}, status);
    case kDh:  // the k-tiles, then the epilogue's g, u chunks
      return load<TileKK>(o.dh_a, o.dh_b, s, pos, {rows, H, it.row0, inter, groups, group, col0, col1}, status) &&
             gemm::load_gu_chunks(o.dh_gu, s.stages, pos, rows, inter, it.row0, col0, status);
    case kDx:
      return load<TileKK>(o.dx_a, o.dx_b, s, pos, {rows, 2 * inter, it.row0, H, groups, group, col0, col1}, status);
    case kWDown:
      return load<TileW>(o.wd_a, o.wd_b, s, pos, {inter, rows, m0, H, 1, 0, col0, col1, it.k0, it.k_len}, status);
    default:
      return load<TileW>(o.wg_a, o.wg_b, s, pos, {H, rows, m0, 2 * inter, 1, 0, col0, col1, it.k0, it.k_len}, status);
  }
}

// Items go out by ticket (one atomic counter): a CTA that runs fast takes more of them, and since tickets are
// claimed in list order every wait still points to an earlier, already claimed item.
__device__ void producer(const KernelParams& p, const Operands& shared, SharedStorage& s, const Shape& h) {
  const Counters c = counters(p);
  gemm::RingPos pos;
  WorkCursor w;
  for (;;) {
    const int32_t ticket = atomicAdd(c.totals + 2, 1);
    const int32_t i = ticket < h.begin[kKinds] ? ticket : -1;
    if (!s.work.wait_free(w, p.status)) return;
    s.work.publish(w, i);
    s.work.advance(w);
    if (i < 0) return;
    const Item it = decode(p, s, h, i);
    if (!is_tile(it.kind) || ((it.kind == kWDown || it.kind == kWGateUp) && it.k_len == 0) ||
        (it.kind == kGu && !it.shared && block_kept(p, it.mb)))
      continue;
    const uint64_t t0 = gemm::global_timer_ns();
    if (!wait_inputs(p, s, h, it)) return;
    if (const uint64_t waited = gemm::global_timer_ns() - t0; waited > 0)
      atomicAdd(c.wait_ns + it.kind, (unsigned long long)waited);
    gemm::fence_proxy_async_global();  // rows that other CTAs stored are read next through TMA
    const bool ok = it.shared ? load_item(shared, s, pos, it, p.Ts, p.H, p.Is, 1, 0, p.status)
                              : load_item(p.routed, s, pos, it, p.M, p.H, p.I, p.E, it.group, p.status);
    if (!ok) return;
  }
}

}  // namespace
}  // namespace mok
