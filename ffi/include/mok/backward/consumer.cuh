// mok backward: the backward megakernel's consumers, its two warpgroups. Each item from the work queue runs here:
// a GEMM tile's MMAs and its epilogue, or a row item (rows.cuh), after the waits it needs (consumers_wait: one
// thread waits, a named barrier gives all 256 the verdict); then one thread bumps its counters (complete).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "mok/backward/items.cuh"
#include "mok/backward/params.cuh"
#include "mok/backward/rows.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/gemm/swiglu_backward.cuh"

namespace mok {
namespace {

// One thread waits until every ctr[i] >= target[i], every consumer gets the verdict (the named barrier orders
// the others' later loads after its acquires too).
template <int kN>
__device__ bool consumers_wait(SharedStorage& s, const int32_t* const (&ctr)[kN], const int32_t (&target)[kN],
                               const KernelParams& p, unsigned long long* wait_ns, int ct) {
  if (ct == 0) {
    const uint64_t t0 = gemm::global_timer_ns();
    bool ok = true;
    for (int i = 0; i < kN && ok; ++i) ok = wait_count(ctr[i], target[i], p.status, p.local_timeout_ns);
    s.wait_ok = ok;
    atomicAdd(wait_ns, (unsigned long long)(gemm::global_timer_ns() - t0));
  }
  gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
  return s.wait_ok != 0;
}

// ---- consumers: completion -----------------------------------------------------------------------------
__device__ void complete(const KernelParams& p, const Item& it) {
  const Counters c = counters(p);
  __threadfence();
  switch (it.kind) {
    case kShare:
      if (it.index < p.share_items) comm::fence_sys(), atomicAdd(c.totals + 4, 1);  // rows that peers read
      break;
    case kGather: atomicAdd(c.gathered + it.mb, 1), atomicAdd(c.gathered_e + it.group, 1); break;
    case kGu: atomicAdd(c.gu + it.mb, 1); break;
    case kDh: atomicAdd(c.dh + it.mb, 1), atomicAdd(c.dh_e + it.group, 1); break;
    case kDx: atomicAdd(c.totals + 0, 1), atomicAdd(c.out + it.mb, 1); break;
    case kDwSum: atomicAdd(c.totals + 1, 1), atomicAdd(c.out + it.mb, 1); break;
    case kSend:
      if (it.mb >= 0) comm::fence_sys(), atomicAdd(c.totals + 3, 1);  // rows written into peers' memory
      break;
    default: break;
  }
}

__device__ void consumer(const KernelParams& p, SharedStorage& s, const Shape& h, int ct, uint64_t epoch) {
  const Counters c = counters(p);
  const int wg = ct / 128, t = ct % 128;
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
    const int col0 = it.n_block * kBlockN;
    switch (it.kind) {
      case kShare:  // no peer may still read the previous call's shared rows
        if (!consumers_wait_peers(s, p, comm::kBwdDone, epoch - 1, comm::kErrTimeoutAck, epoch, c.wait_ns + kShare,
                                  ct))
          return;
        if (it.index < p.share_items) {
          share_rows(p, it, ct);
        } else {  // the last: every SHARE(i) is done, then the peers may read the rows
          if (!consumers_wait<1>(s, {c.totals + 4}, {p.share_items}, p, c.wait_ns + kShare, ct)) return;
          if (ct == 0) publish(p, comm::kBwdSigX, epoch);
        }
        break;
      case kGather:
        if (p.ep > 1 && !consumers_wait_peers(s, p, comm::kBwdSigX, epoch, comm::kErrTimeoutData, epoch,
                                              c.wait_ns + kGather, ct))
          return;
        gather(p, it, ct);
        break;
      case kSend:
        if (it.mb >= 0) {  // the block's dx rows and dw; the origins' slot sums of the previous call are done
          if (!consumers_wait<1>(s, {c.out + it.mb}, {h.nb_dx + 1}, p, c.wait_ns + kSend, ct) ||
              !consumers_wait_peers(s, p, comm::kBwdDone, epoch - 1, comm::kErrTimeoutAck, epoch, c.wait_ns + kSend,
                                    ct))
            return;
          send_rows(p, it, ct);
        } else {  // the last: every block is sent, then the origins may sum them
          if (!consumers_wait<1>(s, {c.totals + 3}, {s.table.tile_start[p.E]}, p, c.wait_ns + kSend, ct)) return;
          if (ct == 0) publish(p, comm::kBwdSigDx, epoch);
        }
        break;
      case kGu: {
        if (!it.shared && block_kept(p, it.mb)) break;  // its GATHER copied the kept g, u
        TileGu::Accumulator acc;
        if (!TileGu::mma_tile(s.stages, pos, acc, p.H, ct, p.status)) return;
        if (ct == 0) t_epi = gemm::global_timer_ns();
        const int n = 2 * (it.shared ? p.Is : p.I);
        // bf16, as the forward keeps them (the same rounding of the same fp32 accumulators)
        TileGu::store_bf16<false>(acc, s.epi[wg], {it.shared ? p.gus : p.gu, n, it.row0, it.row_end, col0, n}, wg,
                                  t);
        gemm::fence_proxy_async_global();  // the DH tiles read g, u through TMA
        break;
      }
      case kDh: {
        // The epilogue reads the routed rows' router weights (w_e, which the gather items store) with ordinary
        // loads, issued before the MMAs so that their latency runs under them: once the tile's first stage is full
        // they are visible here (the producer acquired the gather's counter before that stage's loads, and the
        // stage's full barrier passes that on). Everything else the epilogue reads (g, u) comes through the stage ring.
        gemm::RowWeights rw;
        if (!it.shared) {
          if (!gemm::mbarrier_wait(&s.stages.full[pos.stage], pos.phase, p.status)) return;
          rw = gemm::swiglu_row_weights(p.bwd, it.row0, it.row_end, wg, t);
        }
        TileKK::Accumulator acc;
        if (!TileKK::mma_tile(s.stages, pos, acc, p.H, ct, p.status)) return;
        if (ct == 0) t_epi = gemm::global_timer_ns();
        const bool ok = it.shared  // weight 1, no router-weight partials
                            ? gemm::swiglu_backward_store<TileKK::Accumulator, false>(
                                  acc, p.sbwd, gemm::swiglu_row_weights<false>(p.sbwd, it.row0, it.row_end, wg, t),
                                  s.stages, pos, it.row0, it.row_end, col0, it.n_block, wg, t, p.status)
                            : gemm::swiglu_backward_store(acc, p.bwd, rw, s.stages, pos, it.row0, it.row_end, col0,
                                                          it.n_block, wg, t, p.status);
        if (!ok) return;
        gemm::fence_proxy_async_global();  // DX and the weight gradients read dgu and hw through TMA
        break;
      }
      case kDx: {
        TileKK::Accumulator acc;
        if (!TileKK::mma_tile(s.stages, pos, acc, 2 * (it.shared ? p.Is : p.I), ct, p.status)) return;
        if (ct == 0) t_epi = gemm::global_timer_ns();
        if (it.shared)  // fp32: the slot sum adds it to the routed sum before the one rounding
          TileKK::store_regs<float>(acc, {p.dxs, p.H, it.row0, it.row_end, col0, p.H}, 0, wg, t);
        else
          TileKK::store_bf16<false>(acc, s.epi[wg], {p.dx_e, p.H, it.row0, it.row_end, col0, p.H}, wg, t);
        break;
      }
      case kWDown:
      case kWGateUp: {
        const bool down = it.kind == kWDown;
        const int inter = it.shared ? p.Is : p.I;
        const int m_dim = down ? inter : p.H, n_dim = down ? p.H : 2 * inter;
        Bf16* out = it.shared ? (down ? p.d_shared_down : p.d_shared_gate_up)
                              : (down ? p.d_down : p.d_gate_up) + int64_t(it.group) * m_dim * n_dim;
        const TileW::TileStore st{out, n_dim, it.m_block * kBlockM, m_dim, col0, n_dim};
        if (it.k_len == 0) {  // an empty expert (or no tokens): exact zeros (the accumulator is not involved)
          gemm::Sm90WeightGrad::fill_tile(st, ct, s.bad && !it.shared);  // zeros, or NaN after bad sizes
          break;
        }
        TileW::Accumulator acc;
        if (!TileW::mma_tile(s.stages, pos, acc, it.k_len, ct, p.status)) return;
        if (ct == 0) t_epi = gemm::global_timer_ns();
        TileW::store_bf16<false>(acc, s.epi[wg], st, wg, t);
        break;
      }
      case kDwSum:
        if (!consumers_wait<1>(s, {c.dh + it.mb}, {h.nb_dh}, p, c.wait_ns + kDwSum, ct)) return;
        dw_sum(p, h, it, ct);
        break;
      default:  // kSlot
        // expert parallel: also this rank's own slot rows (its SEND items) and every peer's are in bwd_dx (one
        // wait of each kind: their verdicts have a word each)
        if (!consumers_wait<3>(s, {c.totals + 0, c.totals + 1, c.totals + 3},
                               {h.begin[kDx + 1] - h.begin[kDx], h.begin[kDwSum + 1] - h.begin[kDwSum],
                                p.ep > 1 ? s.table.tile_start[p.E] : 0},
                               p, c.wait_ns + kSlot, ct))
          return;
        if (p.ep > 1 && !consumers_wait_peers(s, p, comm::kBwdSigDx, epoch, comm::kErrTimeoutData, epoch,
                                              c.wait_ns + kSlot, ct))
          return;
        slot_sum(p, s, it, ct);
        break;
    }
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
