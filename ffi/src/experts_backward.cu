// Host side and kernel of mok/experts_backward.cuh: the experts' backward as one persistent launch.
#include <algorithm>
#include <climits>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/sync.cuh"
#include "mok/experts_backward.cuh"
#include "mok/gemm/group_scheduler.cuh"
#include "mok/gemm/sm90_grouped_gemm.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/gemm/sm90_weight_grad.cuh"
#include "mok/gemm/swiglu_backward.cuh"
#include "mok/grouped_ffn.cuh"

namespace mok {
namespace {

using KMajor = cute::GMMA::Major;
using TileGu = gemm::Sm90TileT<KMajor::K, KMajor::MN>;  // x_e @ gate_up
using TileKK = gemm::Sm90TileT<KMajor::K, KMajor::K>;   // dy_e @ down^T, dgu @ gate_up^T (K-major B)
using TileW = gemm::Sm90TileT<KMajor::MN, KMajor::MN>;  // hw^T dy_e, x_e^T dgu (the rows are the k index)
using Bf16 = cutlass::bfloat16_t;
static_assert(gemm::kStatusUnpaddedGroup == kExpertsBackwardStatusUnpadded, "status bits");
static_assert(gemm::kGroupAlign == kExpertsBackwardRowBlock, "group alignment");
static_assert(TileKK::kBlockN == kExpertsBackwardColBlock, "dgrad n-block");

constexpr int kThreads = 128 + TileKK::kConsumerThreads;
constexpr int kConsumers = TileKK::kConsumerThreads;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumers <= (65536 / kThreads / 8 * 8) * kThreads,
              "setmaxnreg budget of the CTA");
constexpr int kBlockM = TileKK::kBlockM, kBlockN = TileKK::kBlockN, kHalfN = TileKK::kHalfN;
constexpr int kGroupM = 16;  // raster band height, as the grouped GEMM
constexpr int kMaxGroups = 1024;
constexpr int kSlotTokens = 8;  // tokens per SLOT item: one per consumer warp
constexpr int kGatherVecs = 4;  // 16-byte vectors in flight per lane and source in GATHER (more spill)
constexpr int kSlotVecs = 8;    // slot rows loaded per lane before any is added, in SLOT
constexpr int kCopyVecs = 4;    // 16-byte vectors per lane in flight when STAGE and SEND copy a row
constexpr uint32_t kConsumerBarrier = 3;  // named barrier of the 256 consumer threads (1, 2: epilogues)
constexpr int kWorkSlots = 2;             // tickets the producer hands the consumers ahead

// The list's order: every item waits only for kinds before it. DWSUM sits after DX (whose tiles need every DH
// tile too, so it never waits there), SEND after both (its rows leave as their blocks finish, while the
// weight-gradient tiles run) and SLOT last: CTAs that are done with their weight-gradient tiles sum the tokens
// while the others finish theirs. STAGE and SEND exist only expert parallel.
enum Kind : int32_t { kStage, kGather, kGu, kDh, kDx, kDwSum, kSend, kWDown, kWGateUp, kSlot, kKinds };
static_assert(kKinds == kExpertsBackwardKinds, "the kinds the time words count");

// The TMA descriptors of the five GEMMs over one set of rows: the routed experts' gathered rows (M of them,
// x_e, dy_e, dgu, hw; the weights of E experts) or the shared expert's (the T tokens' x and dy, dgus, hws; one
// weight matrix each), with I the experts' intermediate size.
struct Operands {
  TileGu::TmaA gu_a;  // x rows [rows, H]
  TileGu::TmaB gu_b;  // gate_up [groups][H, 2I]
  TileKK::TmaA dh_a;  // dy rows [rows, H]
  TileKK::TmaB dh_b;  // down [groups][I, H] read as down^T
  TileKK::TmaA dx_a;  // dgu [rows, 2I]
  TileKK::TmaB dx_b;  // gate_up read as gate_up^T
  TileW::TmaA wd_a;   // hw [rows, I] read as I x rows
  TileW::TmaB wd_b;   // dy rows [rows, H]
  TileW::TmaA wg_a;   // x rows read as H x rows
  TileW::TmaB wg_b;   // dgu [rows, 2I]
  gemm::TmaGu dh_gu;  // g | u [rows, 2I] bf16: the DH tiles' epilogue operands, through the ring
};

__device__ void prefetch(const Operands& o) {
  cute::prefetch_tma_descriptor(o.gu_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.gu_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dx_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dx_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wd_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wd_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wg_a.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.wg_b.get_tma_descriptor());
  cute::prefetch_tma_descriptor(o.dh_gu.get_tma_descriptor());
}

// Host: the descriptors over rows x of x_rows / dy_rows (and dgu, hw, gu of as many rows), weights of `groups`
// experts.
Operands make_operands(const Bf16* x_rows, const Bf16* dy_rows, const Bf16* gate_up, const Bf16* down, const Bf16* dgu,
                       const Bf16* hw, const __nv_bfloat16* gu, int rows, int H, int I, int groups) {
  Operands o;
  o.gu_a = TileGu::make_tma_a(x_rows, rows, H);
  o.gu_b = TileGu::make_tma_b(gate_up, 2 * I, H, groups);
  o.dh_a = TileKK::make_tma_a(dy_rows, rows, H);
  o.dh_b = TileKK::make_tma_b(down, I, H, groups);
  o.dx_a = TileKK::make_tma_a(dgu, rows, 2 * I);
  o.dx_b = TileKK::make_tma_b(gate_up, H, 2 * I, groups);
  o.wd_a = TileW::make_tma_a(hw, I, rows);
  o.wd_b = TileW::make_tma_b(dy_rows, H, rows, 1);
  o.wg_a = TileW::make_tma_a(x_rows, H, rows);
  o.wg_b = TileW::make_tma_b(dgu, 2 * I, rows, 1);
  o.dh_gu = gemm::make_tma_gu(gu, rows, I);
  return o;
}

struct KernelParams {  // one EP rank's
  Operands routed;
  const uint4* x;
  const uint4* dy;
  const float* topk_weight;
  const int32_t* pos;
  const int32_t* src_slot;
  const int32_t* group_sizes;
  uint4* x_e;
  uint4* dy_e;
  float* w_e;
  __nv_bfloat16* gu;  // the recompute's scratch, or the kept g | u (bf16 [M, 2I])
  int32_t kept;       // g, u kept: no GU items; GATHER zeroes gu's padding rows
  const __nv_bfloat16* gu_part;  // part of them kept: the kept rows, each row's row of them, the blocks they cover
  const int32_t* gu_part_row;  // (nullptr: none)
  const int32_t* gu_block;
  int32_t gu_part_rows, gu_blocks;
  gemm::SwigluBackwardOut bwd;
  Bf16* dx_e;
  float* dw_e;
  float* dx;
  float* dw;
  Bf16* d_gate_up;
  Bf16* d_down;
  int32_t* status;
  int32_t* flags;
  gemm::SwigluBackwardOut sbwd;  // the shared expert's epilogue: weight 1, no dw partials
  __nv_bfloat16* gus;
  float* dxs;
  Bf16* d_shared_gate_up;
  Bf16* d_shared_down;
  int32_t T, k, M, H, I, E;
  int32_t Is, Ts;  // the shared expert's I and rows (T, or 0 without one)
  uint64_t local_timeout_ns;  // bound of a wait for an item of the same rank
  // Expert parallel (ep > 1): the workspace, this rank's own ids, the slot numbering's tokens (ep T; T at EP 1)
  comm::CommView view;
  const int32_t* topk_idx;
  int32_t ep, experts_all, stage_items, Tn;
};

struct LaunchParams {
  Operands shared;  // the shared expert's (EP 1 only), set when it has rows
  int32_t num_ranks, skip_rank;
  KernelParams ranks[kExpertsBackwardMaxRanks];
};
static_assert(sizeof(LaunchParams) <= 32764, "kernel parameters (CUDA 12.1+ limit)");

// ---- the item list ------------------------------------------------------------------------------------
struct Shape {
  int32_t nb_gu, nb_dh, nb_dx;        // column blocks of the row GEMMs (2I, I, H over 256)
  int32_t mb_wd, nb_wd, mb_wg, nb_wg;  // tiles of one expert's d_down [I, H] and d_gate_up [H, 2I]
  int32_t s_nb_gu, s_nb_dh;           // the shared expert's column blocks of 2Is and Is
  int32_t s_mb_wd, s_nb_wg;           // its weight-gradient tiles: d_shared_down [Is, H], d_shared_gate_up [H, 2Is]
  int32_t s_mb, s_mb0;                // its m-blocks (of Ts rows), and the first one's index in the counters
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
  Shape shape;      // the item list (from the table)
  int32_t work[kWorkSlots];  // tickets (item indices; -1: no more) from the producer to the consumers
  alignas(8) uint64_t work_full[kWorkSlots];
  alignas(8) uint64_t work_empty[kWorkSlots];
};
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

// ---- the dependency counters (p.flags) ------------------------------------------------------------------
struct Flags {
  unsigned long long* busy_ns;  // [kind]: consumers' time in items of that kind, over the CTAs
  unsigned long long* wait_ns;  // [kind]: time spent waiting for their inputs
  int32_t* gathered;  // [mb]: 1 when GATHER(mb) is done
  int32_t* gu;        // [mb]: GU tiles of m-block mb done
  int32_t* dh;        // [mb]: DH tiles of m-block mb done
  int32_t* out;       // [mb]: DX tiles and the DWSUM item of m-block mb done (SEND reads their rows)
  int32_t* gathered_e;  // [E + 1]: GATHER items of expert e done
  int32_t* dh_e;        // [E + 1]: DH tiles of expert e done (index E: the shared expert's)
  int32_t* totals;      // [0] DX tiles, [1] DWSUM items, [2] tickets, [3] SEND items, [4] STAGE items (not
                        // the last item of either: that one stamps the peers' flags)
};
__device__ __forceinline__ Flags flags(const KernelParams& p) {
  const int mbs = ceil_div(p.M, kBlockM) + p.E + ceil_div(p.Ts, kBlockM);
  auto* ns = reinterpret_cast<unsigned long long*>(p.flags);
  int32_t* c = p.flags + kExpertsBackwardTimeWords;
  const int es = p.E + 1;  // the experts, then the shared expert (index E)
  return Flags{ns, ns + kKinds, c, c + mbs, c + 2 * mbs, c + 3 * mbs, c + 4 * mbs, c + 4 * mbs + es,
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

__device__ Shape make_shape(const KernelParams& p, const SharedStorage& s) {
  Shape h;
  h.nb_gu = ceil_div(2 * p.I, kBlockN), h.nb_dh = ceil_div(p.I, kBlockN), h.nb_dx = ceil_div(p.H, kBlockN);
  h.mb_wd = ceil_div(p.I, kBlockM), h.nb_wd = ceil_div(p.H, kBlockN);
  h.mb_wg = ceil_div(p.H, kBlockM), h.nb_wg = ceil_div(2 * p.I, kBlockN);
  const int nmb = s.table.tile_start[p.E];
  const bool sh = p.Is > 0;
  h.s_nb_gu = ceil_div(2 * p.Is, kBlockN), h.s_nb_dh = ceil_div(p.Is, kBlockN);
  h.s_mb_wd = ceil_div(p.Is, kBlockM), h.s_nb_wg = ceil_div(2 * p.Is, kBlockN);
  h.s_mb = ceil_div(p.Ts, kBlockM), h.s_mb0 = ceil_div(p.M, kBlockM) + p.E;
  const bool ep = p.ep > 1;  // STAGE: comm_items + the stamp; SEND: one per m-block + the stamp
  const int shared[kKinds] = {0, 0, h.s_mb * h.s_nb_gu, h.s_mb * h.s_nb_dh, h.s_mb * h.nb_dx, 0, 0,
                              sh ? h.s_mb_wd * h.nb_wd : 0, sh ? h.mb_wg * h.s_nb_wg : 0, 0};
  const int count[kKinds] = {ep ? p.stage_items + 1 : 0, nmb, p.kept ? 0 : nmb * h.nb_gu, nmb * h.nb_dh,
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

__device__ Item decode(const KernelParams& p, const SharedStorage& s, const Shape& h, int i) {
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
    case kStage: break;
    case kSend:
      if (it.index == tb.tile_start[p.E]) {  // the last one: the stamp
        it.mb = -1;
        break;
      }
      [[fallthrough]];
    case kGather:
    case kDwSum: {
      const int mb = it.index;
      const int g = gemm::last_group_at([&](int e) { return tb.tile_start[e]; }, p.E, mb);
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

// ---- producer (one thread): wait for a tile's inputs, then its TMA loads ---------------------------------
__device__ bool wait_inputs(const KernelParams& p, const SharedStorage& s, const Shape& h, const Item& it) {
  const Flags f = flags(p);
  if (it.shared) {
    switch (it.kind) {
      case kGu: return true;  // x is an input
      case kDh: return wait_count(f.gu + it.mb, h.s_nb_gu, p.status, p.local_timeout_ns);
      case kDx: return wait_count(f.dh + it.mb, h.s_nb_dh, p.status, p.local_timeout_ns);
      default: return wait_count(f.dh_e + p.E, h.s_mb * h.s_nb_dh, p.status, p.local_timeout_ns);
    }
  }
  switch (it.kind) {
    case kGu: return wait_count(f.gathered + it.mb, 1, p.status, p.local_timeout_ns);
    case kDh:
      return wait_count(f.gathered + it.mb, 1, p.status, p.local_timeout_ns) &&
             (p.kept || wait_count(f.gu + it.mb, h.nb_gu, p.status, p.local_timeout_ns));
    case kDx: return wait_count(f.dh + it.mb, h.nb_dh, p.status, p.local_timeout_ns);
    default: {  // weight gradients: every row of the expert
      const int mbs = s.table.tile_start[it.group + 1] - s.table.tile_start[it.group];
      return wait_count(f.gathered_e + it.group, mbs, p.status, p.local_timeout_ns) &&
             wait_count(f.dh_e + it.group, mbs * h.nb_dh, p.status, p.local_timeout_ns);
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
  const Flags f = flags(p);
  gemm::RingPos pos;
  int w = 0;
  uint32_t phase = 0;
  for (;;) {
    const int32_t ticket = atomicAdd(f.totals + 2, 1);
    const int32_t i = ticket < h.begin[kKinds] ? ticket : -1;
    if (!gemm::mbarrier_wait(&s.work_empty[w], phase ^ 1, p.status)) return;
    s.work[w] = i;
    cutlass::arch::ClusterBarrier::arrive(&s.work_full[w]);
    if (++w == kWorkSlots) w = 0, phase ^= 1;
    if (i < 0) return;
    const Item it = decode(p, s, h, i);
    if (!is_tile(it.kind) || ((it.kind == kWDown || it.kind == kWGateUp) && it.k_len == 0) ||
        (it.kind == kGu && !it.shared && block_kept(p, it.mb)))
      continue;
    const uint64_t t0 = gemm::global_timer_ns();
    if (!wait_inputs(p, s, h, it)) return;
    if (const uint64_t waited = gemm::global_timer_ns() - t0; waited > 0)
      atomicAdd(f.wait_ns + it.kind, (unsigned long long)waited);
    gemm::fence_proxy_async_global();  // rows that other CTAs stored are read next through TMA
    const bool ok = it.shared ? load_item(shared, s, pos, it, p.Ts, p.H, p.Is, 1, 0, p.status)
                              : load_item(p.routed, s, pos, it, p.M, p.H, p.I, p.E, it.group, p.status);
    if (!ok) return;
  }
}

// ---- consumers: row items --------------------------------------------------------------------------------
// Expert parallel, one thread: this call's epoch into row `row` of every peer's bwd_flags (after a system fence
// that orders every store this rank's items made before, through the counters the caller acquired).
__device__ void publish(const KernelParams& p, int row, uint64_t epoch) {
  comm::publish_stamps(p.view, p.view.layout.bwd_flags, row, epoch);
}

// The consumers wait until every peer stamped flag row `row` of this rank's region with at least `target` (one
// thread waits, bounded; a timeout poisons the workspace, a poisoned one stops it). On failure the status bits
// stop every other wait of the rank too. Its verdict has its own word (SharedStorage::peer_ok): an item makes at
// most one such wait and one consumers_wait, in either order.
__device__ bool consumers_wait_peers(SharedStorage& s, const KernelParams& p, int row, uint64_t target, uint32_t code,
                                     uint64_t epoch, unsigned long long* wait_ns, int ct) {
  if (ct == 0) {
    const uint64_t t0 = gemm::global_timer_ns();
    const bool ok = comm::wait_stamps(p.view, p.view.layout.bwd_flags, row, target, code, comm::kOpMoeBackward, epoch);
    if (!ok) atomicOr(p.status, gemm::kStatusWaitTimeout | kExpertsBackwardStatusComm);
    s.peer_ok = ok;
    atomicAdd(wait_ns, (unsigned long long)(gemm::global_timer_ns() - t0));
  }
  gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
  return s.peer_ok != 0;
}

// Expert parallel: where the rows of slot `slot` (< Tn k) come from and go to: its token's rank and row there.
struct SlotHome {
  int32_t rank, t, j;
};
__device__ __forceinline__ SlotHome slot_home(const KernelParams& p, int64_t slot) {
  const int64_t tg = slot / p.k;
  return SlotHome{int32_t(tg / p.T), int32_t(tg % p.T), int32_t(slot % p.k)};
}

// STAGE(i), i < stage_items: rows [T i / n, T (i + 1) / n) of x and dy into this rank's bwd_x, bwd_dy (one warp
// per row), where the owners of its slots read them.
__device__ void stage_rows(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32, chunks = p.H / 8;
  const int64_t r0 = int64_t(p.T) * it.index / p.stage_items, r1 = int64_t(p.T) * (it.index + 1) / p.stage_items;
  int4* xd = p.view.local<int4>(p.view.layout.bwd_x);
  int4* dd = p.view.local<int4>(p.view.layout.bwd_dy);
  const int4* xs = reinterpret_cast<const int4*>(p.x);
  const int4* ds = reinterpret_cast<const int4*>(p.dy);
  for (int64_t r = r0 + warp; r < r1; r += kConsumers / 32) {  // one destination each: lane 0's
    comm::warp_copy_row<kCopyVecs>(xs + r * chunks, chunks, xd + r * chunks, 1u, lane);
    comm::warp_copy_row<kCopyVecs>(ds + r * chunks, chunks, dd + r * chunks, 1u, lane);
  }
}

// Rows [row0, row_end): x_e[r] = x[s / k], dy_e[r] = dy[s / k], w_e[r] = topk_weight[s] for the row's slot s,
// zeros for a padding row (or a slot id out of range), and with kept g, u zeros in a padding row's g | u. In a
// block of part-kept g, u (block_kept) also gu[r] = gu_part[gu_part_row[r]] (zeros for a row without one: a
// padding row, what the recompute gives it); the block's DH items read it after this item's release.
// Expert parallel: a token of another rank is read from that rank's staged bwd_x, bwd_dy (over NVLink).
// One warp per row, kGatherVecs 16-byte vectors of each source in flight per lane.
__device__ void gather(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32;
  const int chunks = p.H / 8;
  const int64_t slots = int64_t(p.Tn) * p.k;
  const bool copy_gu = block_kept(p, it.mb);
  for (int r = it.row0 + warp; r < it.row_end; r += kConsumers / 32) {
    const int64_t slot = p.src_slot[r];
    const bool valid = slot >= 0 && slot < slots;
    uint4* xd = p.x_e + int64_t(r) * chunks;
    uint4* dd = p.dy_e + int64_t(r) * chunks;
    if (valid) {
      const uint4* xs = p.x + (slot / p.k) * chunks;
      const uint4* ds = p.dy + (slot / p.k) * chunks;
      if (p.ep > 1) {
        const SlotHome home = slot_home(p, slot);
        const int64_t at = int64_t(home.t) * chunks;
        xs = home.rank == p.view.rank ? p.x + at : p.view.peer<const uint4>(home.rank, p.view.layout.bwd_x) + at;
        ds = home.rank == p.view.rank ? p.dy + at : p.view.peer<const uint4>(home.rank, p.view.layout.bwd_dy) + at;
      }
      for (int c0 = lane; c0 < chunks; c0 += 32 * kGatherVecs) {
        int4 a[kGatherVecs], b[kGatherVecs];
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u)
          if (c0 + 32 * u < chunks)
            a[u] = comm::ld_v4_na(reinterpret_cast<const int4*>(xs) + c0 + 32 * u),
            b[u] = comm::ld_v4_na(reinterpret_cast<const int4*>(ds) + c0 + 32 * u);
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u)
          if (c0 + 32 * u < chunks)
            xd[c0 + 32 * u] = *reinterpret_cast<const uint4*>(&a[u]),
            dd[c0 + 32 * u] = *reinterpret_cast<const uint4*>(&b[u]);
      }
    } else {
      for (int c = lane; c < chunks; c += 32) xd[c] = make_uint4(0, 0, 0, 0), dd[c] = make_uint4(0, 0, 0, 0);
      if (p.kept) {  // a row's 2I bf16 are I / 4 16-byte vectors (I is a multiple of 8)
        uint4* g = reinterpret_cast<uint4*>(p.gu + int64_t(r) * 2 * p.I);
        for (int c = lane; c < p.I / 4; c += 32) g[c] = make_uint4(0, 0, 0, 0);
      }
    }
    if (copy_gu) {
      const int32_t src = p.gu_part_row[r];
      const bool has = src >= 0 && src < p.gu_part_rows;
      const uint4* gs = reinterpret_cast<const uint4*>(p.gu_part + int64_t(has ? src : 0) * 2 * p.I);
      uint4* g = reinterpret_cast<uint4*>(p.gu + int64_t(r) * 2 * p.I);
#pragma unroll 4
      for (int c = lane; c < p.I / 4; c += 32) g[c] = has ? __ldg(gs + c) : make_uint4(0, 0, 0, 0);
    }
    if (lane == 0) p.w_e[r] = valid ? p.topk_weight[slot] : 0.0f;
  }
  gemm::fence_proxy_async_global();  // the GEMM tiles read x_e and dy_e through TMA
}

// SEND(m) (expert parallel): each slot row r of m-block m: dx_e[r] into its token's rank's bwd_dx at (t, j) and
// dw_e[r] into its bwd_dw (a peer's over NVLink, or this rank's own); padding rows send nothing.
__device__ void send_rows(const KernelParams& p, const Item& it, int ct) {
  const int lane = ct % 32, warp = ct / 32, chunks = p.H / 8;
  const int64_t slots = int64_t(p.Tn) * p.k;
  const int4* dx_e = reinterpret_cast<const int4*>(p.dx_e);
  for (int r = it.row0 + warp; r < it.row_end; r += kConsumers / 32) {
    const int64_t slot = p.src_slot[r];
    if (slot < 0 || slot >= slots) continue;
    const SlotHome home = slot_home(p, slot);
    const int64_t cell = int64_t(home.t) * p.k + home.j;
    int4* dst = p.view.peer<int4>(home.rank, p.view.layout.bwd_dx) + cell * chunks;
    comm::warp_copy_row<kCopyVecs>(dx_e + int64_t(r) * chunks, chunks, dst, 1u, lane);  // one destination
    if (lane == 0) p.view.peer<float>(home.rank, p.view.layout.bwd_dw)[cell] = p.dw_e[r];
  }
}

// dw_e[r] = the sum over n-blocks (ascending) of dw_part[r, :], rows of m-block mb.
__device__ void dw_sum(const KernelParams& p, const Shape& h, const Item& it, int ct) {
  for (int r = it.row0 + ct; r < it.row_end; r += kConsumers) {
    float acc = 0.0f;
    for (int b = 0; b < h.nb_dh; ++b) acc += p.bwd.dw_part[int64_t(r) * h.nb_dh + b];
    p.dw_e[r] = acc;
  }
}

// Per token t of the item (one per consumer warp): dx[t] = sum_{j ascending} dx_e[pos[t, j]] in fp32, then
// + dxs[t] (the shared expert's, when there is one), dw[t, j] = dw_e[pos[t, j]]; a pos outside the groups'
// rows adds nothing (dw 0). Each lane sums 8 columns at a time, the
// rows of up to kSlotVecs slots loaded before any is added (in slot order).
// Expert parallel: slot j's row is row (t, j) of this rank's bwd_dx (its owner's SEND wrote it) and its dw that
// of bwd_dw, for a slot whose id has an owner ([0, ep E)); the others add nothing and get dw 0, as at EP 1.
__device__ void slot_sum(const KernelParams& p, const SharedStorage& s, const Item& it, int ct) {
  const int lane = ct % 32, t = it.index * kSlotTokens + ct / 32;
  if (t >= p.T) return;
  const int chunks = p.H / 8;
  const bool ep = p.ep > 1;
  const uint4* dx_e = reinterpret_cast<const uint4*>(p.dx_e);
  const int4* recv = ep ? p.view.local<const int4>(p.view.layout.bwd_dx) + int64_t(t) * p.k * chunks : nullptr;
  float4* dx = reinterpret_cast<float4*>(p.dx) + int64_t(t) * chunks * 2;
  const int32_t* pos = ep ? p.topk_idx + int64_t(t) * p.k : p.pos + int64_t(t) * p.k;
  // Rows past the groups hold zeros (dx_rows) but are not read here: their zeroing is no item of the list, so
  // waiting for it would tie the sum to CTAs that may not have started. Adding nothing is adding those zeros
  // (an f32 sum that starts at +0 never holds -0).
  const int32_t used = ep ? p.experts_all : s.table.row_start[p.E];  // pos (EP 1) or the id (EP) is in [0, used)
  if (lane < p.k) {
    const int32_t r = pos[lane];
    const bool in = r >= 0 && r < used;
    p.dw[int64_t(t) * p.k + lane] =
        !in ? 0.0f : ep ? p.view.local<const float>(p.view.layout.bwd_dw)[int64_t(t) * p.k + lane] : p.dw_e[r];
  }
  // No shuffles in this loop: when 32 does not divide H / 8, the lanes leave it at different trip counts.
  for (int c = lane; c < chunks; c += 32) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 < p.k; j0 += kSlotVecs) {
      uint4 v[kSlotVecs];
      bool in[kSlotVecs];
#pragma unroll
      for (int u = 0; u < kSlotVecs; ++u) {
        const int32_t r = j0 + u < p.k ? pos[j0 + u] : -1;
        in[u] = r >= 0 && r < used;
        if (!in[u]) {
          v[u] = make_uint4(0, 0, 0, 0);
        } else if (ep) {
          const int4 w = comm::ld_v4_na(recv + int64_t(j0 + u) * chunks + c);
          v[u] = *reinterpret_cast<const uint4*>(&w);
        } else {
          v[u] = dx_e[int64_t(r) * chunks + c];
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotVecs; ++u) {
        if (!in[u]) continue;
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(b[q]);
          acc[2 * q] += f.x;
          acc[2 * q + 1] += f.y;
        }
      }
    }
    if (p.Ts > 0) {
      const float4* xs = reinterpret_cast<const float4*>(p.dxs) + int64_t(t) * chunks * 2;
      const float4 a = xs[2 * c], b = xs[2 * c + 1];
      acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
      acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
    }
    dx[2 * c] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dx[2 * c + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

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
  const Flags f = flags(p);
  __threadfence();
  switch (it.kind) {
    case kStage:
      if (it.index < p.stage_items) comm::fence_sys(), atomicAdd(f.totals + 4, 1);  // rows that peers read
      break;
    case kGather: atomicAdd(f.gathered + it.mb, 1), atomicAdd(f.gathered_e + it.group, 1); break;
    case kGu: atomicAdd(f.gu + it.mb, 1); break;
    case kDh: atomicAdd(f.dh + it.mb, 1), atomicAdd(f.dh_e + it.group, 1); break;
    case kDx: atomicAdd(f.totals + 0, 1), atomicAdd(f.out + it.mb, 1); break;
    case kDwSum: atomicAdd(f.totals + 1, 1), atomicAdd(f.out + it.mb, 1); break;
    case kSend:
      if (it.mb >= 0) comm::fence_sys(), atomicAdd(f.totals + 3, 1);  // rows written into peers' memory
      break;
    default: break;
  }
}

__device__ void consumer(const KernelParams& p, SharedStorage& s, const Shape& h, int ct, uint64_t epoch) {
  const Flags f = flags(p);
  const int wg = ct / 128, t = ct % 128;
  gemm::RingPos pos;
  const int lane = ct % 32;
  int w = 0;
  uint32_t phase = 0;
  for (;;) {
    if (!gemm::mbarrier_wait(&s.work_full[w], phase, p.status)) return;
    const int32_t i = s.work[w];
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.work_empty[w]);
    if (++w == kWorkSlots) w = 0, phase ^= 1;
    if (i < 0) return;
    const Item it = decode(p, s, h, i);
    const uint64_t t0 = ct == 0 ? gemm::global_timer_ns() : 0;
    const int col0 = it.n_block * kBlockN;
    switch (it.kind) {
      case kStage:  // no peer may still read the previous call's staged rows
        if (!consumers_wait_peers(s, p, comm::kBwdDone, epoch - 1, comm::kErrTimeoutAck, epoch, f.wait_ns + kStage,
                                  ct))
          return;
        if (it.index < p.stage_items) {
          stage_rows(p, it, ct);
        } else {  // the last: every share is staged, then the peers may read them
          if (!consumers_wait<1>(s, {f.totals + 4}, {p.stage_items}, p, f.wait_ns + kStage, ct)) return;
          if (ct == 0) publish(p, comm::kBwdSigX, epoch);
        }
        break;
      case kGather:
        if (p.ep > 1 && !consumers_wait_peers(s, p, comm::kBwdSigX, epoch, comm::kErrTimeoutData, epoch,
                                              f.wait_ns + kGather, ct))
          return;
        gather(p, it, ct);
        break;
      case kSend:
        if (it.mb >= 0) {  // the block's dx rows and dw; the origins' slot sums of the previous call are done
          if (!consumers_wait<1>(s, {f.out + it.mb}, {h.nb_dx + 1}, p, f.wait_ns + kSend, ct) ||
              !consumers_wait_peers(s, p, comm::kBwdDone, epoch - 1, comm::kErrTimeoutAck, epoch, f.wait_ns + kSend,
                                    ct))
            return;
          send_rows(p, it, ct);
        } else {  // the last: every block is sent, then the origins may sum them
          if (!consumers_wait<1>(s, {f.totals + 3}, {s.table.tile_start[p.E]}, p, f.wait_ns + kSend, ct)) return;
          if (ct == 0) publish(p, comm::kBwdSigDx, epoch);
        }
        break;
      case kGu: {
        if (!it.shared && block_kept(p, it.mb)) break;  // its GATHER copied the kept g, u
        TileGu::Accumulator acc;
        if (!TileGu::mma_tile(s.stages, pos, acc, p.H, ct, p.status)) return;
        const int n = 2 * (it.shared ? p.Is : p.I);
        // bf16, as the forward keeps them (the same rounding of the same fp32 accumulators)
        TileGu::store_bf16<false>(acc, s.epi[wg], {it.shared ? p.gus : p.gu, n, it.row0, it.row_end, col0, n}, wg,
                                  t);
        gemm::fence_proxy_async_global();  // the DH tiles read g, u through TMA
        break;
      }
      case kDh: {
        TileKK::Accumulator acc;
        if (!TileKK::mma_tile(s.stages, pos, acc, p.H, ct, p.status)) return;
        // the epilogue reads w_e with ordinary loads: acquire what the producer waited for (one thread, so that
        // every consumer leaves together if it fails); g, u come through the ring
        if (!consumers_wait<2>(s, {f.gathered + it.mb, f.gu + it.mb},
                               {it.shared ? 0 : 1, it.shared ? h.s_nb_gu : p.kept ? 0 : h.nb_gu}, p,
                               f.wait_ns + kDh, ct))
          return;
        const bool ok = it.shared  // weight 1, no router-weight partials
                            ? gemm::swiglu_backward_store<TileKK::Accumulator, false>(
                                  acc, p.sbwd, s.stages, pos, it.row0, it.row_end, col0, it.n_block, wg, t, p.status)
                            : gemm::swiglu_backward_store(acc, p.bwd, s.stages, pos, it.row0, it.row_end, col0,
                                                          it.n_block, wg, t, p.status);
        if (!ok) return;
        gemm::fence_proxy_async_global();  // DX and the weight gradients read dgu and hw through TMA
        break;
      }
      case kDx: {
        TileKK::Accumulator acc;
        if (!TileKK::mma_tile(s.stages, pos, acc, 2 * (it.shared ? p.Is : p.I), ct, p.status)) return;
        if (it.shared)  // fp32: the slot sum adds it to the routed sum before the one rounding
          TileKK::store_f32(acc, {p.dxs, p.H, it.row0, it.row_end, col0, p.H}, wg, t);
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
        TileW::store_bf16<false>(acc, s.epi[wg], st, wg, t);
        break;
      }
      case kDwSum:
        if (!consumers_wait<1>(s, {f.dh + it.mb}, {h.nb_dh}, p, f.wait_ns + kDwSum, ct)) return;
        dw_sum(p, h, it, ct);
        break;
      default:  // kSlot
        // expert parallel: also this rank's own slot rows (its SEND items) and every peer's are in bwd_dx (one
        // wait of each kind: their verdicts have a word each)
        if (!consumers_wait<3>(s, {f.totals + 0, f.totals + 1, f.totals + 3},
                               {h.begin[kDx + 1] - h.begin[kDx], h.begin[kDwSum + 1] - h.begin[kDwSum],
                                p.ep > 1 ? s.table.tile_start[p.E] : 0},
                               p, f.wait_ns + kSlot, ct))
          return;
        if (p.ep > 1 && !consumers_wait_peers(s, p, comm::kBwdSigDx, epoch, comm::kErrTimeoutData, epoch,
                                              f.wait_ns + kSlot, ct))
          return;
        slot_sum(p, s, it, ct);
        break;
    }
    gemm::named_barrier_sync(kConsumerBarrier, kConsumers);
    if (ct == 0) {
      complete(p, it);
      atomicAdd(f.busy_ns + it.kind, (unsigned long long)(gemm::global_timer_ns() - t0));
    }
  }
}

// Warps 1..3 of the producer warpgroup: zeros in the rows past the groups of dx_e (the per-row dx the
// expert-parallel backward reads) and dw_e. Nothing in the kernel reads those rows.
__device__ void zero_past_groups(const KernelParams& p, const SharedStorage& s, int t, int cta, int ctas) {
  const int64_t first = s.table.row_start[p.E];
  const int64_t chunks = p.H / 8, total = (int64_t(p.M) - first) * chunks;
  const int64_t step = int64_t(ctas) * 96;
  uint4* dx_e = reinterpret_cast<uint4*>(p.dx_e);
  for (int64_t idx = int64_t(cta) * 96 + t; idx < total; idx += step)
    dx_e[first * chunks + idx] = make_uint4(0, 0, 0, 0);
  for (int64_t r = first + int64_t(cta) * 96 + t; r < p.M; r += step) p.dw_e[r] = 0.0f;
}

// Expert parallel: the rank's last CTA to exit advances its epoch and stamps kBwdDone in every peer (it read
// every peer's staged rows and its own bwd_dx, bwd_dw for the last time); a poisoned workspace sets the status.
__device__ void finish_call(const KernelParams& p, SharedStorage& s, int ctas, uint64_t epoch) {
  comm::LocalState* st = p.view.state();
  if (threadIdx.x == 0) {
    __threadfence();
    s.last = atomicAdd(&st->bwd_exit, 1u) == uint32_t(ctas - 1);
  }
  __syncthreads();
  if (!s.last || threadIdx.x != 0) return;
  __threadfence();
  if (const uint64_t poison = comm::read_poison(p.view); poison != 0) {
    comm::publish_host_error(p.view, poison);
    atomicOr(p.status, kExpertsBackwardStatusComm);
  }
  *reinterpret_cast<volatile uint32_t*>(&st->bwd_exit) = 0;
  *reinterpret_cast<volatile uint64_t*>(&st->bwd_epoch) = epoch;
  publish(p, comm::kBwdDone, epoch);
}

// CTA b serves EP rank b % num_ranks (one rank, or every rank of an emulated group).
__device__ void run(const LaunchParams& P) {
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& s = gemm::aligned_shared_storage<SharedStorage>(smem_raw);
  const int vr = int(blockIdx.x) % P.num_ranks;
  if (vr == P.skip_rank) return;  // test mode: this emulated rank makes no call
  const int ctas = (int(gridDim.x) - vr + P.num_ranks - 1) / P.num_ranks, cta = int(blockIdx.x) / P.num_ranks;
  const KernelParams& p = P.ranks[vr];
  const uint64_t epoch = p.ep > 1 ? comm::ld_volatile(&p.view.state()->bwd_epoch) + 1 : 0;
  const int warp = cutlass::canonical_warp_idx_sync();
  const int lane = threadIdx.x % 32;
  if (warp == 0 && lane == 0) {
    TileKK::init_stages(s.stages);
    for (int i = 0; i < kWorkSlots; ++i) {
      cutlass::arch::ClusterBarrier::init(&s.work_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&s.work_empty[i], kConsumers / 32);
    }
    cutlass::arch::fence_barrier_init();
    prefetch(p.routed);
    if (p.Ts > 0) prefetch(P.shared);
  }
  if (warp == 1) {
    gemm::build_group_table(s.table, p.group_sizes, p.E, p.M, kBlockM, 1, lane);
    const bool unpadded = gemm::any_unpadded_group(p.group_sizes, p.E, lane);
    if (lane == 0) s.unpadded = unpadded, s.bad = unpadded || s.table.status != 0;
  }
  __syncthreads();
  const int32_t bits = s.table.status | (s.unpadded ? gemm::kStatusUnpaddedGroup : 0);
  if (cta == 0 && threadIdx.x == 0 && bits) atomicOr(p.status, bits);
  if (threadIdx.x == 0) s.shape = make_shape(p, s);
  __syncthreads();
  const Shape& h = s.shape;
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp == 0) {
      if (cute::elect_one_sync()) producer(p, P.shared, s, h);
    } else {
      zero_past_groups(p, s, threadIdx.x - 32, cta, ctas);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consumer(p, s, h, threadIdx.x - 128, epoch);
  }
  if (p.ep > 1) {
    __syncthreads();
    finish_call(p, s, ctas, epoch);
  }
}

__global__ void __launch_bounds__(kThreads, 1) experts_backward_kernel(const __grid_constant__ LaunchParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  run(params);
#elif defined(__CUDA_ARCH__)
  if (threadIdx.x == 0 && blockIdx.x < params.num_ranks)
    atomicOr(params.ranks[blockIdx.x].status, gemm::kStatusNoSm90a);
#endif
}

}  // namespace

const char* experts_backward_unsupported(const ExpertsBackwardParams& p) {
  GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, p.num_rows, p.hidden,
                     p.intermediate, p.num_experts, p.num_sms};
  if (const char* why = grouped_ffn_unsupported(f)) return why;
  if (p.num_experts > kMaxGroups) return "experts E must be at most 1024";
  if (p.num_tokens < 0 || p.num_tokens > INT_MAX) return "tokens T must be in [0, 2^31)";
  if (p.top_k < 1 || p.top_k > 32) return "top_k must be in [1, 32]";
  if (p.num_tokens * p.top_k > INT_MAX || p.num_tokens * p.hidden > INT_MAX) return "T * k and T * H must be below 2^31";
  if (p.slot_tokens * p.top_k > INT_MAX || p.slot_tokens < 0) return "ep * T * k must be below 2^31";
  if (p.num_rows * 2 * p.intermediate > INT_MAX || p.num_rows * p.hidden > INT_MAX)
    return "rows M times H or 2I must be below 2^31";
  if (p.flags == nullptr) return "the dependency counters (flags) are missing";
  if (p.view.base != nullptr && p.view.shape.ep > 1) {  // the fused expert-parallel backward
    const comm::CommShape& w = p.view.shape;
    if (p.shared_intermediate != 0) return "shared_gate_up: expert parallel, the shared expert runs outside the op";
    if (p.topk_idx == nullptr) return "topk_idx: expert parallel, this rank's expert ids are missing";
    if (p.num_rows < 1) return "src_slot: expert parallel, rows M must be at least 1";
    if (p.num_tokens > w.max_tokens) return "x: tokens exceed the workspace's max_tokens";
    if (p.hidden != w.hidden) return "x: the hidden size differs from the workspace's";
    if (p.top_k > w.top_k) return "topk_idx: top_k exceeds the workspace's";
    if (p.num_experts * w.ep != w.num_experts) return "gate_up: experts per rank differ from the workspace's";
    if (p.slot_tokens != p.num_tokens * w.ep) return "topk_weight: expert parallel, it must hold ep * T tokens";
    if (p.comm_items < 1) return "comm_items must be >= 1";
  } else if (p.slot_tokens != p.num_tokens) {
    return "topk_weight: without expert parallelism it holds the T tokens";
  }
  if (p.gu_part != nullptr) {
    if (p.gu_kept != nullptr) return "gu_part: a part of g, u kept, and all of them (gu): give one";
    if (p.gu_part_row == nullptr || p.gu_block == nullptr) return "gu_part: its row map or block flags are missing";
    if (p.gu_part_rows < 0 || p.gu_part_rows * 2 * p.intermediate > INT64_MAX / 4 || p.gu_part_rows > INT_MAX)
      return "gu_part: its rows must be in [0, 2^31)";
  }
  if (p.shared_intermediate < 0 || p.shared_intermediate % 8 != 0)
    return "shared_gate_up: the shared expert's intermediate size Is must be 0 (none) or a positive multiple of 8";
  if (p.shared_intermediate > 0) {
    if (!p.shared_gate_up || !p.shared_down || !p.d_shared_gate_up || !p.d_shared_down || !p.gus || !p.dgus ||
        !p.hws || !p.dxs)
      return "the shared expert's weights, gradients or scratch are missing";
    if (p.num_rows == 0) return "src_slot: rows M must be at least 1 with a shared expert";
    if (p.num_tokens * 2 * p.shared_intermediate > INT_MAX || p.hidden * 2 * p.shared_intermediate > INT_MAX)
      return "tokens T and H times 2Is must be below 2^31";
  }
  return nullptr;
}

namespace {

// One rank's kernel parameters and its memsets (status, flags); `shared`: the shared expert's descriptors.
cudaError_t fill_rank(const ExpertsBackwardParams& p, int grid_of_rank, KernelParams& k, Operands* shared,
                      cudaStream_t stream) {
  const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts), M = int(p.num_rows);
  const auto* x_e = static_cast<const Bf16*>(p.x_e);
  const auto* dy_e = static_cast<const Bf16*>(p.dy_e);
  const auto* gate_up = static_cast<const Bf16*>(p.gate_up);
  const auto* down = static_cast<const Bf16*>(p.down);
  const auto* dgu = static_cast<const Bf16*>(p.dgu);
  const auto* hw = static_cast<const Bf16*>(p.hw);
  const bool kept = p.gu_kept != nullptr;  // the forward's g, u: no GU items
  auto* gu = static_cast<__nv_bfloat16*>(kept ? p.gu_kept : p.gu);
  k.routed = make_operands(x_e, dy_e, gate_up, down, dgu, hw, gu, M, H, I, E);
  k.x = static_cast<const uint4*>(p.x);
  k.dy = static_cast<const uint4*>(p.dy);
  k.topk_weight = p.topk_weight;
  k.pos = p.pos;
  k.src_slot = p.src_slot;
  k.group_sizes = p.group_sizes;
  k.x_e = static_cast<uint4*>(p.x_e);
  k.dy_e = static_cast<uint4*>(p.dy_e);
  k.w_e = p.w_e;
  k.gu = gu;
  k.kept = kept;
  if (p.gu_part != nullptr) {
    k.gu_part = static_cast<const __nv_bfloat16*>(p.gu_part), k.gu_part_row = p.gu_part_row, k.gu_block = p.gu_block;
    k.gu_part_rows = int(p.gu_part_rows), k.gu_blocks = (M + kBlockM - 1) / kBlockM;
  }
  k.bwd = gemm::SwigluBackwardOut{k.gu, p.w_e, static_cast<__nv_bfloat16*>(p.dgu), static_cast<__nv_bfloat16*>(p.hw),
                                  p.dw_part, I, (I + kBlockN - 1) / kBlockN};
  k.dx_e = static_cast<Bf16*>(p.dx_e);
  k.dw_e = p.dw_e;
  k.dx = p.dx;
  k.dw = p.dw;
  k.d_gate_up = static_cast<Bf16*>(p.d_gate_up);
  k.d_down = static_cast<Bf16*>(p.d_down);
  k.status = p.status;
  k.flags = p.flags;
  k.T = int(p.num_tokens), k.k = int(p.top_k), k.M = M, k.H = H, k.I = I, k.E = E;
  const int Is = int(p.shared_intermediate), T = int(p.num_tokens);
  k.Is = Is, k.Ts = Is > 0 ? T : 0;
  if (Is > 0) {
    if (T > 0)  // no descriptor of an empty matrix: without rows no shared tile loads anything
      *shared = make_operands(static_cast<const Bf16*>(p.x), static_cast<const Bf16*>(p.dy),
                              static_cast<const Bf16*>(p.shared_gate_up), static_cast<const Bf16*>(p.shared_down),
                              static_cast<const Bf16*>(p.dgus), static_cast<const Bf16*>(p.hws),
                              static_cast<const __nv_bfloat16*>(p.gus), T, H, Is, 1);
    k.gus = static_cast<__nv_bfloat16*>(p.gus);
    k.sbwd = gemm::SwigluBackwardOut{k.gus, nullptr, static_cast<__nv_bfloat16*>(p.dgus),
                                     static_cast<__nv_bfloat16*>(p.hws), nullptr, Is, (Is + kBlockN - 1) / kBlockN};
    k.dxs = p.dxs;
    k.d_shared_gate_up = static_cast<Bf16*>(p.d_shared_gate_up);
    k.d_shared_down = static_cast<Bf16*>(p.d_shared_down);
  }
  const bool ep = p.view.base != nullptr && p.view.shape.ep > 1;
  k.ep = ep ? p.view.shape.ep : 1;
  k.Tn = int(p.slot_tokens);
  k.local_timeout_ns = gemm::kWaitTimeoutNs;
  if (ep) {
    k.view = p.view;
    k.topk_idx = p.topk_idx;
    k.experts_all = int(p.num_experts) * p.view.shape.ep;
    k.stage_items = std::max(1, std::min(p.comm_items, grid_of_rank));
    // a wait for an item of the same rank outlasts the wait for a peer, which then names the peer
    k.local_timeout_ns = std::max<uint64_t>(gemm::kWaitTimeoutNs, 4 * p.view.timeout_ns);
  }
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.status, 0, sizeof(int32_t), stream));
  return cudaMemsetAsync(p.flags, 0, size_t(experts_backward_flag_words(p.num_rows, p.num_experts, k.Ts)) * 4, stream);
}

}  // namespace

cudaError_t launch_experts_backward_ranks(const ExpertsBackwardParams* ranks, int num_ranks, int skip_rank,
                                          cudaStream_t stream) {
  if (num_ranks < 1 || num_ranks > kExpertsBackwardMaxRanks) return cudaErrorInvalidValue;
  for (int r = 0; r < num_ranks; ++r) {
    const ExpertsBackwardParams& p = ranks[r];
    if (experts_backward_unsupported(p)) return cudaErrorInvalidValue;
    if (num_ranks > 1 && (p.view.base == nullptr || p.view.shape.ep != num_ranks || p.view.rank != r))
      return cudaErrorInvalidValue;  // an emulated call carries every rank of its group, in order
  }
  const ExpertsBackwardParams& p0 = ranks[0];
  if (num_ranks == 1 && p0.view.base == nullptr && p0.num_rows == 0) {  // EP 1, no rows: zero gradients
    const ExpertsBackwardParams& p = p0;
    const int H = int(p.hidden), I = int(p.intermediate), E = int(p.num_experts);
    const int64_t slots = p.num_tokens * p.top_k;
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_gate_up, 0, size_t(E) * H * 2 * I * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.d_down, 0, size_t(E) * I * H * sizeof(Bf16), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dx, 0, size_t(p.num_tokens) * H * sizeof(float), stream));
    MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.dw, 0, size_t(slots) * sizeof(float), stream));
    GroupedFfnParams f{p.x_e, p.group_sizes, p.gate_up, p.down, p.dx_e, p.gu, p.status, 0, p.hidden, p.intermediate,
                       p.num_experts, p.num_sms};
    return launch_grouped_ffn(f, stream);  // M = 0: writes the status only
  }
  int grid = 0;
  MOK_CUDA_RETURN_IF_ERROR(gemm::persistent_grid(p0.num_sms, &grid));
  if (grid < num_ranks) return cudaErrorInvalidValue;  // every rank needs a CTA
  LaunchParams lp{};  // about 16 KB with 8 ranks: the launch copies it into the kernel's parameter space
  lp.num_ranks = num_ranks;
  lp.skip_rank = skip_rank;
  for (int r = 0; r < num_ranks; ++r)
    MOK_CUDA_RETURN_IF_ERROR(fill_rank(ranks[r], (grid - r + num_ranks - 1) / num_ranks, lp.ranks[r], &lp.shared,
                                       stream));
  return launch_sm90a(&experts_backward_kernel, grid, kThreads, kSmemBytes, stream, lp);
}

cudaError_t launch_experts_backward(const ExpertsBackwardParams& p, cudaStream_t stream) {
  return launch_experts_backward_ranks(&p, 1, -1, stream);
}

}  // namespace mok
