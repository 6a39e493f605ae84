// mok moe: the forward megakernel's work items as types. Each kind is a struct with its waits (wait: the producer
// thread, before the item is handed on), its run (the 256 consumer threads) and its completion (complete: one
// consumer thread, after every consumer finished the item's stores), the communication and schedule items each in
// its own header under items/; the four GEMM tile kinds are below (their run and load are forward_tiles.cuh's
// tile_item and load_item, one for all four). wait_deps and complete dispatch an Item to its type.
// Included by forward_kernel.cuh only.
#pragma once

#include <cstdint>

#include "mok/moe/forward_items.cuh"
#include "mok/moe/items/count.cuh"
#include "mok/moe/items/dispatch.cuh"
#include "mok/moe/items/place.cuh"
#include "mok/moe/items/post.cuh"
#include "mok/moe/items/reduce.cuh"
#include "mok/moe/items/scan.cuh"
#include "mok/moe/items/send.cuh"

namespace mok::moe {

// ================================================================================ GEMM tiles

// The shared expert's gate/up tile: waits for nothing (x is the call's input).
struct SharedGuItem {
  __device__ static __forceinline__ bool wait(const ItemContext& c, const Item& it) { return true; }
  __device__ static __forceinline__ void complete(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    bump(c.sync + p.o_sgu + it.mblock);
  }
};

// The shared expert's down tile: waits for its m-block's gate/up tiles.
struct SharedDnItem {
  __device__ static __forceinline__ bool wait(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    return wait_count(c.v, c.sync + p.o_sgu + it.mblock, p.nb_shared_gu, c.epoch);
  }
  __device__ static __forceinline__ void complete(const ItemContext& c, const Item& it) {
    bump(c.sync + kCtlSharedDn);
  }
};

// A routed gate/up tile of microbatch m: waits for the microbatch's DISPATCH.
struct GuItem {
  __device__ static __forceinline__ bool wait(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    return wait_count(c.v, c.sync + p.o_disp + it.mb, n_dispatch(p, it.mb), c.epoch);
  }
  __device__ static __forceinline__ void complete(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    bump(c.sync + p.o_gu + int64_t(it.mb) * p.mb_cap + it.mblock);
  }
};

// A routed down tile: waits for its m-block's gate/up tiles.
struct DnItem {
  __device__ static __forceinline__ bool wait(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    return wait_count(c.v, c.sync + p.o_gu + int64_t(it.mb) * p.mb_cap + it.mblock, p.nb_gu, c.epoch);
  }
  __device__ static __forceinline__ void complete(const ItemContext& c, const Item& it) {
    const Plan& p = c.p;
    bump(c.sync + p.o_dn + it.mb);
  }
};

// ================================================================================ dispatch

// The waits before an item starts (the producer thread).
__device__ inline bool wait_deps(const Plan& p, const RankParams& R, const Item& it, int ctas, uint64_t epoch) {
  const ItemContext c{p, R, R.view, R.sync, ctas, epoch};
  switch (it.kind) {
    case kPost: return PostItem::wait(c, it);
    case kCount: return CountItem::wait(c, it);
    case kScan: return ScanItem::wait(c, it);
    case kPlace: return PlaceItem::wait(c, it);
    case kDispatch: return DispatchItem::wait(c, it);
    case kSharedGu: return SharedGuItem::wait(c, it);
    case kSharedDn: return SharedDnItem::wait(c, it);
    case kGu: return GuItem::wait(c, it);
    case kDn: return DnItem::wait(c, it);
    case kSend: return SendItem::wait(c, it);
    case kReduce: return ReduceItem::wait(c, it);
    default: return true;
  }
}

// The counters an item bumps when done (one thread, after every consumer thread finished the item's stores).
__device__ inline void complete(const Plan& p, const RankParams& R, const Item& it, int ctas, uint64_t epoch) {
  const ItemContext c{p, R, R.view, R.sync, ctas, epoch};
  switch (it.kind) {
    case kPost: PostItem::complete(c, it); break;
    case kCount: CountItem::complete(c, it); break;
    case kScan: ScanItem::complete(c, it); break;
    case kPlace: PlaceItem::complete(c, it); break;
    case kDispatch: DispatchItem::complete(c, it); break;
    case kSharedGu: SharedGuItem::complete(c, it); break;
    case kSharedDn: SharedDnItem::complete(c, it); break;
    case kGu: GuItem::complete(c, it); break;
    case kDn: DnItem::complete(c, it); break;
    case kSend: SendItem::complete(c, it); break;
    case kReduce: ReduceItem::complete(c, it); break;
    default: break;
  }
}

}  // namespace mok::moe
