// mok backward: the backward megakernel's work items as types, each kind in its own header under items/: its
// waits and TMA loads (wait, load: the producer thread, GEMM tiles only; a row item waits in the consumers, inside
// its run), its run (the 256 consumer threads; false: a wait failed, the consumers stop) and its completion
// (complete: one consumer thread, after every consumer finished the item's stores). wait_inputs, load_item,
// run_item and complete dispatch an Item to its type.
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/items/dh.cuh"
#include "mok/backward/items/dw_sum.cuh"
#include "mok/backward/items/dx.cuh"
#include "mok/backward/items/gather.cuh"
#include "mok/backward/items/gu.cuh"
#include "mok/backward/items/send.cuh"
#include "mok/backward/items/share.cuh"
#include "mok/backward/items/slot.cuh"
#include "mok/backward/items/weight_grad.cuh"
#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok {
namespace {

// The producer's waits for a GEMM tile's inputs (bounded; false on timeout, with the status bit set). A tile of the
// shared expert waits for its own tiles' counters (its type's wait<true>).
__device__ bool wait_inputs(const KernelParams& p, const SharedStorage& s, const Shape& h, const Item& it) {
  const Counters c = counters(p);
  if (it.shared) {
    switch (it.kind) {
      case kGu: return GuItem::wait<true>(p, s, h, c, it);
      case kDh: return DhItem::wait<true>(p, s, h, c, it);
      case kDx: return DxItem::wait<true>(p, s, h, c, it);
      default: return WeightGradItem::wait<true>(p, s, h, c, it);
    }
  }
  switch (it.kind) {
    case kGu: return GuItem::wait<false>(p, s, h, c, it);
    case kDh: return DhItem::wait<false>(p, s, h, c, it);
    case kDx: return DxItem::wait<false>(p, s, h, c, it);
    default: return WeightGradItem::wait<false>(p, s, h, c, it);
  }
}

// The TMA loads of tile item `it` over one set of operands (the routed experts' or the shared expert's): `rows`
// rows, intermediate size `inter`, `groups` weight matrices of which the tile's is `group`.
__device__ __forceinline__ bool load_item(const Operands& o, SharedStorage& s, gemm::RingPos& pos, const Item& it,
                                          int rows, int H, int inter, int groups, int group, int32_t* status) {
  switch (it.kind) {
    case kGu: return GuItem::load(o, s, pos, it, rows, H, inter, groups, group, status);
    case kDh: return DhItem::load(o, s, pos, it, rows, H, inter, groups, group, status);
    case kDx: return DxItem::load(o, s, pos, it, rows, H, inter, groups, group, status);
    default: return WeightGradItem::load(o, s, pos, it, rows, H, inter, groups, group, status);
  }
}

// An item's run in the consumers. A GEMM tile's thread 0 records the end of its MMAs in t_epi. False: a wait
// failed (the status and, expert parallel, the workspace say why), and the consumers stop.
__device__ __forceinline__ bool run_item(const ItemContext& x, const Item& it, gemm::RingPos& pos, uint64_t& t_epi) {
  switch (it.kind) {
    case kShare: return ShareItem::run(x, it);
    case kGather: return GatherItem::run(x, it);
    case kSend: return SendItem::run(x, it);
    case kGu: return GuItem::run(x, it, pos, t_epi);
    case kDh: return DhItem::run(x, it, pos, t_epi);
    case kDx: return DxItem::run(x, it, pos, t_epi);
    case kWDown:
    case kWGateUp: return WeightGradItem::run(x, it, pos, t_epi);
    case kDwSum: return DwSumItem::run(x, it);
    default: return SlotItem::run(x, it);  // kSlot
  }
}

// The counters an item bumps when done (one thread, after every consumer thread finished the item's stores).
__device__ void complete(const KernelParams& p, const Item& it) {
  const Counters c = counters(p);
  __threadfence();
  switch (it.kind) {
    case kShare: ShareItem::complete(p, c, it); break;
    case kGather: GatherItem::complete(p, c, it); break;
    case kGu: GuItem::complete(p, c, it); break;
    case kDh: DhItem::complete(p, c, it); break;
    case kDx: DxItem::complete(p, c, it); break;
    case kDwSum: DwSumItem::complete(p, c, it); break;
    case kSend: SendItem::complete(p, c, it); break;
    default: break;  // the weight-gradient tiles and SLOT: nothing waits for them
  }
}

}  // namespace
}  // namespace mok
