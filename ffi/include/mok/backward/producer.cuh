// mok backward: the backward megakernel's producer, one thread per CTA. It claims the items by ticket, hands
// each to the consumers through the work queue, and for a GEMM tile waits (bounded) for its inputs' counters
// (wait_inputs), then issues its TMA loads into the stage ring (load_item): the item types' (items.cuh).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "mok/backward/items.cuh"
#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/gemm/sm90_sync.cuh"

namespace mok {
namespace {

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
