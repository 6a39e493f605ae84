// mok backward: the backward megakernel's list of work items and its dependency counters. The CTA's shared
// memory (SharedStorage), the list's shape (make_shape: where each kind's items begin), an item decoded from its
// index (decode), the counters in p.counters by which an item waits for earlier ones (counters, wait_count), what
// an item's run reads (ItemContext) and where a slot's rows live (slot_home). Each kind's waits, loads, run and
// completion are its type's (items.cuh and items/).
// Included by experts_backward.cu only: its definitions live in that translation unit's unnamed namespace.
#pragma once

#include <climits>
#include <cstdint>

#include "mok/backward/params.cuh"
#include "mok/comm/ptx.cuh"
#include "mok/common.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/work_queue.cuh"

namespace mok {
namespace {

// ---- the item list ------------------------------------------------------------------------------------
struct Shape {
  int32_t nb_gu, nb_dh, nb_dx;        // column blocks of the row GEMMs (2I, I, H over 256)
  int32_t mb_wd, nb_wd, mb_wg, nb_wg;  // tiles of one expert's d_down [I, H] and d_gate_up [H, 2I]
  int32_t s_nb_gu, s_nb_dh;           // the shared expert's column blocks of 2Is and Is
  int32_t s_mb_wd, s_nb_wg;           // its weight-gradient tiles: d_shared_down [Is, H], d_shared_gate_up [H, 2Is]
  int32_t s_mb, s_mb0;                // its m-blocks (of Ts rows), and the first one's index in the counters
  int32_t gather_rounds;              // GATHER's rounds over every expert (decode): its fewest m-blocks
  int32_t shared[kKinds];             // the shared expert's items of each kind, first in the kind's range
  int32_t begin[kKinds + 1];           // the list: kind q holds items [begin[q], begin[q + 1])
};

struct SharedStorage {
  gemm::StageRing stages;
  alignas(16) uint32_t epi[TileKK::kConsumerWarpgroups][TileKK::kEpiWords];
  gemm::GroupTable<kMaxGroups> table;  // built with one column block: tile_start is the m-block prefix
  int32_t unpadded;
  int32_t bad;      // table.status or unpadded: every weight-gradient tile is NaN
  int32_t wait_ok;  // a consumer-side wait's verdict, for all consumers
  int32_t peer_ok;  // ... of a wait for the peers (its own word: an item may wait for both, one after the other,
                    // and a slow warp may still be reading the first verdict when the second is written)
  int32_t last;     // this CTA is the rank's last to exit
  int32_t fewest_blocks;  // the fewest m-blocks of any expert (0 for a bad table): Shape::gather_rounds
  Shape shape;      // the item list (from the table)
  WorkQueue<int32_t, kWorkSlots> work;  // tickets (item indices; -1: no more) from the producer to the consumers
};
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

// ---- the dependency counters (p.counters) ------------------------------------------------------------------
struct Counters {
  unsigned long long* busy_ns;  // [kind]: consumers' time in items of that kind, over the CTAs
  unsigned long long* wait_ns;  // [kind]: time spent waiting for their inputs
  unsigned long long* epi_ns;   // [kind]: of busy_ns, a GEMM tile's time after its last MMA (its epilogue)
  int32_t* gathered;  // [mb]: 1 when GATHER(mb) is done
  int32_t* gu;        // [mb]: GU tiles of m-block mb done
  int32_t* dh;        // [mb]: DH tiles of m-block mb done
  int32_t* out;       // [mb]: DX tiles and the DWSUM item of m-block mb done (SEND reads their rows)
  int32_t* gathered_e;  // [E + 1]: GATHER items of expert e done
  int32_t* dh_e;        // [E + 1]: DH tiles of expert e done (index E: the shared expert's)
  int32_t* totals;      // [0] DX tiles, [1] DWSUM items, [2] tickets, [3] SEND items, [4] SHARE items (not
                        // the last item of either: that one stamps the peers' bwd_stamps)
};
__device__ __forceinline__ Counters counters(const KernelParams& p) {
  const int mbs = ceil_div(p.M, kBlockM) + p.E + ceil_div(p.Ts, kBlockM);
  auto* ns = reinterpret_cast<unsigned long long*>(p.counters);
  int32_t* c = p.counters + kExpertsBackwardTimeWords;
  const int es = p.E + 1;  // the experts, then the shared expert (index E)
  return Counters{ns, ns + kKinds, ns + 2 * kKinds, c, c + mbs, c + 2 * mbs, c + 3 * mbs, c + 4 * mbs, c + 4 * mbs + es,
               c + 4 * mbs + 2 * es};
}

// Spin (acquire) until *ctr >= target. False on timeout (status bit set) or when another wait already timed out.
__device__ bool wait_count(const int32_t* ctr, int32_t target, int32_t* status,
                           uint64_t bound_ns = gemm::kWaitTimeoutNs) {
  if (comm::ld_acquire_gpu(ctr) >= target) return true;
  const uint64_t start = gemm::global_timer_ns();
  for (uint32_t it = 1;; ++it) {
    if (comm::ld_acquire_gpu(ctr) >= target) return true;
    if ((it & 1023u) == 0) {
      if (*reinterpret_cast<volatile int32_t*>(status) & gemm::kStatusWaitTimeout) return false;
      if (gemm::global_timer_ns() - start > bound_ns) {
        atomicOr(status, gemm::kStatusWaitTimeout);
        return false;
      }
    }
  }
}

// The fewest m-blocks of experts first, first + step, ... of E (0 when E is 0): GATHER's rounds (Shape). Warp 1
// takes it over its lanes at the kernel's start; mok_experts_backward_item_list over all of them on the host.
__host__ __device__ inline int fewest_blocks(const int32_t* group_sizes, int E, int first, int step) {
  int fewest = E > 0 ? INT_MAX : 0;
  for (int e = first; e < E; e += step) fewest = min(fewest, ceil_div(max(group_sizes[e], 0), kBlockM));
  return fewest;
}

// (__host__ as well, with decode: mok_experts_backward_item_list gives the list on the host, for tests.)
__host__ __device__ Shape make_shape(const KernelParams& p, const SharedStorage& s) {
  Shape h;
  h.nb_gu = ceil_div(2 * p.I, kBlockN), h.nb_dh = ceil_div(p.I, kBlockN), h.nb_dx = ceil_div(p.H, kBlockN);
  h.mb_wd = ceil_div(p.I, kBlockM), h.nb_wd = ceil_div(p.H, kBlockN);
  h.mb_wg = ceil_div(p.H, kBlockM), h.nb_wg = ceil_div(2 * p.I, kBlockN);
  const int nmb = s.table.tile_start[p.E];
  const bool sh = p.Is > 0;
  h.s_nb_gu = ceil_div(2 * p.Is, kBlockN), h.s_nb_dh = ceil_div(p.Is, kBlockN);
  h.s_mb_wd = ceil_div(p.Is, kBlockM), h.s_nb_wg = ceil_div(2 * p.Is, kBlockN);
  h.s_mb = ceil_div(p.Ts, kBlockM), h.s_mb0 = ceil_div(p.M, kBlockM) + p.E;
  h.gather_rounds = s.bad ? 0 : s.fewest_blocks;
  const bool ep = p.ep > 1;  // SHARE: comm_items + the stamp; SEND: one per m-block + the stamp
  const int shared[kKinds] = {0, 0, h.s_mb * h.s_nb_gu, h.s_mb * h.s_nb_dh, h.s_mb * h.nb_dx, 0, 0,
                              sh ? h.s_mb_wd * h.nb_wd : 0, sh ? h.mb_wg * h.s_nb_wg : 0, 0};
  const int count[kKinds] = {ep ? p.share_items + 1 : 0, nmb, p.kept ? 0 : nmb * h.nb_gu, nmb * h.nb_dh,
                             nmb * h.nb_dx, nmb, ep ? nmb + 1 : 0, p.E * h.mb_wd * h.nb_wd, p.E * h.mb_wg * h.nb_wg,
                             ceil_div(p.T, kSlotTokens)};
  h.begin[0] = 0;
  for (int q = 0; q < kKinds; ++q) h.shared[q] = shared[q], h.begin[q + 1] = h.begin[q] + shared[q] + count[q];
  return h;
}

struct Item {
  int32_t kind, index;      // index within its kind (past the shared expert's items, among the routed ones)
  int32_t shared;           // 1: a tile of the shared expert (group E)
  int32_t group, mb;        // expert; global m-block (row items and row GEMMs)
  int32_t row0, row_end;    // row GEMMs: the tile's first row, the group's end; row items: the m-block's rows
  int32_t m_block, n_block;
  int32_t k0, k_len;        // weight gradients: the expert's rows
};

__host__ __device__ Item decode(const KernelParams& p, const SharedStorage& s, const Shape& h, int i) {
  const auto& tb = s.table;
  Item it{};
  int q = 0;
  while (i >= h.begin[q + 1]) ++q;
  it.kind = q;
  it.index = i - h.begin[q];
  if (it.index < h.shared[q]) {  // the shared expert's tile: group E, rows [0, Ts) of its own operands
    it.shared = 1, it.group = p.E;
    if (q == kWDown || q == kWGateUp) {
      const bool down = q == kWDown;
      gemm::band_tile<kBlockM, kGroupM>(it.index, down ? p.Is : p.H, down ? h.nb_wd : h.s_nb_wg, &it.m_block,
                                        &it.n_block);
      it.k0 = 0, it.k_len = p.Ts;
    } else {
      const int nb = q == kGu ? h.s_nb_gu : q == kDh ? h.s_nb_dh : h.nb_dx;
      gemm::band_tile<kBlockM, kGroupM>(it.index, p.Ts, nb, &it.m_block, &it.n_block);
      it.mb = h.s_mb0 + it.m_block;
      it.row0 = it.m_block * kBlockM, it.row_end = p.Ts;
    }
    return it;
  }
  it.index -= h.shared[q];
  switch (q) {
    case kShare: break;
    case kSend:
      if (it.index == tb.tile_start[p.E]) {  // the last one: the stamp
        it.mb = -1;
        break;
      }
      [[fallthrough]];
    case kGather:
    case kDwSum: {
      int mb = it.index, g;
      const int r = q == kGather ? h.gather_rounds : 0;
      // GATHER's first E r items go round by round, m-block b of every expert before b + 1: an expert's rows are in
      // token order, so the CTAs gathering at once read the same tokens' x and dy rows, which L2 then serves to
      // the k - 1 other experts of each token (expert by expert, every token's rows were read k times from HBM).
      if (it.index < p.E * r) {
        g = it.index % p.E, mb = tb.tile_start[g] + it.index / p.E;
      } else {  // the rest of each expert's m-blocks, expert by expert (all of them when r is 0)
        const int j = it.index - p.E * r;
        g = gemm::last_group_at([&](int e) { return tb.tile_start[e] - e * r; }, p.E, j);
        mb = j + g * r + r;
      }
      it.group = g, it.mb = mb;
      it.row0 = tb.row_start[g] + (mb - tb.tile_start[g]) * kBlockM;
      it.row_end = min(it.row0 + kBlockM, tb.row_start[g + 1]);
      break;
    }
    case kGu:
    case kDh:
    case kDx: {
      const int nb = q == kGu ? h.nb_gu : q == kDh ? h.nb_dh : h.nb_dx;
      const int t = it.index;
      const int g = gemm::last_group_at([&](int e) { return tb.tile_start[e] * nb; }, p.E, t);
      const int rows = tb.row_start[g + 1] - tb.row_start[g];
      gemm::band_tile<kBlockM, kGroupM>(t - tb.tile_start[g] * nb, rows, nb, &it.m_block, &it.n_block);
      it.group = g, it.mb = tb.tile_start[g] + it.m_block;
      it.row0 = tb.row_start[g] + it.m_block * kBlockM;
      it.row_end = tb.row_start[g + 1];
      break;
    }
    case kWDown:
    case kWGateUp: {
      const bool down = q == kWDown;
      const int mb = down ? h.mb_wd : h.mb_wg, nb = down ? h.nb_wd : h.nb_wg;
      const int g = it.index / (mb * nb);
      gemm::band_tile<kBlockM, kGroupM>(it.index - g * mb * nb, down ? p.I : p.H, nb, &it.m_block, &it.n_block);
      it.group = g;
      it.k0 = tb.row_start[g];
      it.k_len = s.unpadded ? 0 : tb.row_start[g + 1] - it.k0;
      break;
    }
    default:
      break;
  }
  return it;
}

__device__ __forceinline__ bool is_tile(int kind) {
  return kind == kGu || kind == kDh || kind == kDx || kind == kWDown || kind == kWGateUp;
}

// Whether m-block mb's g, u were kept (gu_part): its GATHER copies them, its GU items do nothing.
__device__ __forceinline__ bool block_kept(const KernelParams& p, int mb) {
  return p.gu_block != nullptr && mb < p.gu_blocks && p.gu_block[mb] != 0;
}

// Expert parallel: where the rows of slot `slot` (< Tn k) come from and go to: its token's rank and row there.
struct SlotHome {
  int32_t rank, t, j;
};
__device__ __forceinline__ SlotHome slot_home(const KernelParams& p, int64_t slot) {
  const int64_t tg = slot / p.k;
  return SlotHome{int32_t(tg / p.T), int32_t(tg % p.T), int32_t(slot % p.k)};
}

// What an item's run reads (the consumer thread ct's, made once; items.cuh: run_item).
struct ItemContext {
  const KernelParams& p;
  SharedStorage& s;
  const Shape& h;
  const Counters& c;
  uint64_t epoch;
  int ct;      // the consumer thread, 0-255
  int wg, t;   // its warpgroup (0, 1) and thread in it: a tile's epilogue
};

}  // namespace
}  // namespace mok
