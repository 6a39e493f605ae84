// mok backward: the backward megakernel's consumers, its two warpgroups. Each item from the work queue runs here
// (run_item: a GEMM tile's MMAs and its epilogue, or a row item, after the waits it makes in the consumers), then
// one thread bumps its counters (complete) and its time words.
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/items.cuh"
#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"

namespace mok {
namespace {

__device__ void consumer(const KernelParams& p, SharedStorage& s, const Shape& h, int ct, uint64_t epoch) {
  const Counters c = counters(p);
  const ItemContext x{p, s, h, c, epoch, ct, ct / 128, ct % 128};
  gemm::RingPos pos;
  const int lane = ct % 32;
  WorkCursor w;
  for (;;) {
    if (!s.work.wait_ready(w, p.status)) return;
    const int32_t i = s.work.at(w);
    s.work.give_back(w, lane);
    s.work.advance(w);
    if (i < 0) return;
    const Item it = decode(p, s, h, i);
    const uint64_t t0 = ct == 0 ? gemm::global_timer_ns() : 0;
    uint64_t t_epi = 0;  // a GEMM tile's end of MMAs (thread 0): the rest of the item is its epilogue
    if (!run_item(x, it, pos, t_epi)) return;
    gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
    if (ct == 0) {
      complete(p, it);
      const uint64_t t1 = gemm::global_timer_ns();
      atomicAdd(c.busy_ns + it.kind, (unsigned long long)(t1 - t0));
      if (t_epi != 0) atomicAdd(c.epi_ns + it.kind, (unsigned long long)(t1 - t_epi));
    }
  }
}

}  // namespace
}  // namespace mok
