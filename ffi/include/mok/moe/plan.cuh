// mok moe: the forward megakernel's work plan: which work items a call has, in which order, and the
// per-call counters and tables in the sync part of a rank's scratch (host and device code).
//
// Work items of one rank, in ticket order (each CTA claims the next ticket with one atomicAdd, so an item
// only ever waits for items of smaller tickets, which running CTAs hold: no deadlock whatever the number
// of resident CTAs; the results do not depend on which CTA runs which item):
//
//   static prefix   POST x P | COUNT x C | SCAN | PLACE x C | DISPATCH(0) x D0 | SHARED_GU tiles | SHARED_DN (EP > 1)
//   dynamic part    for step i = 0 .. M + g:   COMBINE(i-g-1) = SEND x D' + REDUCE x D'  |  DISPATCH(i) x D
//                                              |  GU(i-g) tiles  |  SHARED_DN (i-g = 0, EP 1)  |  DN(i-g) tiles
//   At EP 1, SHARED_DN's tiles are not in the static prefix but one segment of the dynamic part, between GU(0)'s
//   and DN(0)'s (Plan::shared_dn_late): in the prefix, the first SHARED_DN tiles would wait for SHARED_GU's last
//   wave (both go m fastest, so every m-block's last gate/up tile is in it), where GU(0) runs instead. At EP > 1
//   they stay in the prefix: there they fill the wait for DISPATCH(0), whose rows come from the peers (emulated
//   EP 8 measured the late order 2-3% slower). The lab's timing bits kTimingSharedDownEarly and
//   kTimingSharedDownLate choose either order at any EP size, to price it.
//   g = 1 when the ring has two or more slots (dispatch runs one microbatch ahead of compute), else 0;
//   the last microbatch's SEND and REDUCE are split over every CTA of the rank (D' = CTAs), the others over
//   D = comm_items. So is the first microbatch's DISPATCH when the layer has no shared expert (D0 = CTAs, else
//   D): no tile can start before it, and nothing else is there to overlap it with. The dynamic part's tile
//   counts come from the schedule, so SCAN writes its segment table.
//
// Dependencies (waited for by the CTA's producer thread before the item starts; every wait is bounded):
//   POST        peers' ack of the previous call's dispatch (they are done with my posted rows and routing)
//   COUNT       peers' routing (sig_route)          SCAN     every COUNT        PLACE    SCAN
//   DISPATCH(m) every PLACE, peers' posted rows (sig_x), and COMBINE(m - S) (its ring slot is free again)
//   SHARED_DN   the SHARED_GU tiles of its m-block  GU(m)    DISPATCH(m)        DN(m)    GU(m) of its m-block
//   SEND(m)     DISPATCH(m), DN(m), peers' ack of the previous call's combine
//   REDUCE(m)   DISPATCH(m), DN(m), SHARED_DN, every peer's SEND(m) (sig_comb[m])
// Every constraint points backwards in ticket order (DISPATCH(m) follows COMBINE(m - S) because S > g).
#pragma once

#include <cstddef>
#include <cstdint>

#include "mok/comm/workspace.cuh"
#include "mok/moe/forward.cuh"

namespace mok::moe {

enum ItemKind : int32_t {
  kPost = 0, kCount, kScan, kPlace, kDispatch, kSharedGu, kSharedDn, kGu, kDn, kSend, kReduce, kEnd,
};

constexpr int kTileM = 128;          // GEMM tile rows (Sm90Tile::kBlockM)
constexpr int kGuCols = 128;         // output columns of a gate/up tile (SwiGLU halves of 256 MMA columns)
constexpr int kDnCols = 256;         // output columns of a down tile
constexpr int kWorkerWarps = 8;      // consumer warps, which execute every item
constexpr int kChunksPerCountItem = kWorkerWarps;

// The lab form's item times (kTimingItemTimes), in the sync region (zeroed before every call): per item kind, and
// at kEnd for the consumers' whole run, 5 u64: the consumers' busy ns (an item's start to its completion, over the
// CTAs), their ns waiting for the item (from the end of their previous item, or their start), the items, the first
// start (as its complement: the words start at 0 and atomicMax keeps the largest) and the last end, in globaltimer ns.
constexpr int kItemTimeFields = 5;
constexpr int kItemTimeWords = 2 * kItemTimeFields * (kEnd + 1);

// Words of the control block at the start of the sync region.
enum Ctl : int32_t {
  kCtlTickets = 0, kCtlPostRoute, kCtlPostRows, kCtlCount, kCtlScan, kCtlPlace, kCtlSharedDn,
  kCtlDispatchAll, kCtlReduceAll, kCtlSegments, kCtlCallError, kCtlCallErrorToken, kCtlWords = 16,
};

// Everything a CTA needs to turn a ticket into an item, derived from the shape and the knobs alone.
struct Plan {
  int32_t T, H, I, Is, k, L, ep;
  int32_t G, M, S, slot_rows;
  int32_t nchunks, chunks_per_mb;
  int32_t D;                        // items per communication phase
  int32_t D0;                       // items of DISPATCH(0): D; the rank's CTAs without a shared expert; at EP 1
                                    // with one, dispatch_share of them (at least D)
  int32_t n_post, n_count, n_place, n_shared_gu, n_shared_dn;
  int32_t nb_gu, nb_dn, nb_shared_gu, nb_shared_dn;   // output column blocks of each GEMM
  int32_t shared_mblocks;           // ceil(T / 128)
  int32_t mb_cap;                   // m-blocks one microbatch can have (gu counter stride)
  int32_t max_segments;
  int32_t g;                        // compute lag behind dispatch (0 or 1)
  int32_t identity;                 // test mode: no GEMMs
  int32_t timing_mode;                // timing mode: TimingMode bits
  int32_t shared_dn_late;           // SHARED_DN's tiles in the dynamic part, after GU(0)'s (else in the static
                                    // prefix): at EP 1, or with the lab's kTimingSharedDownLate
  int32_t fp8;                      // routed experts in FP8 E4M3 (ForwardShape::routed_fp8)
  int32_t scale_ld;                 // FP8: floats per K block of the ring's scales (S * slot_rows, rounded up to 4)
  // ticket bounds of the static prefix
  int32_t t_count, t_scan, t_place, t_disp0, t_sgu, t_sdn, t_dynamic;
  // word offsets in the sync region (int32 words)
  int64_t o_disp, o_send, o_reduce, o_dn, o_sgu, o_gu, o_cnt, o_base, o_row, o_w;
  int64_t o_row_start, o_tile_gu, o_tile_dn, o_mblock, o_seg_begin, o_seg_kind, o_seg_mb, o_item_times;
  int64_t sync_words;
};

__host__ __device__ inline int32_t cdiv(int64_t a, int64_t b) { return int32_t((a + b - 1) / b); }

// rank_ctas: the CTAs that serve one rank (the fewest of any rank of the launch); 0 when the plan only sizes the
// scratch (its layout does not depend on it; its ticket bounds then assume D0 = D).
// At EP 1 with a shared expert, the share of the rank's CTAs that DISPATCH(0) takes (Plan::D0, at least D): the
// share that makes it end when the SHARED_GU tiles beside it do, GU(0) waiting for both. Their costs per CTA, from
// the forward's item times on one H100 (thirty-eighth session, kimi-k2, glm-5, qwen3.5, deepseek-v4-pro): a CTA
// dispatches 37-46 GB/s of rows and runs shared gate/up tiles at 5.3-5.7 TFLOP/s, about 135 FLOP per byte. At
// T = 2048 (E/32 experts) kimi-k2, glm-5 and deepseek-v4-pro come to 15-28 CTAs, below D = 32 (no change); qwen3.5
// (Is 1024 beside k = 10 rows of H 4096 per token) to 52, where 32 CTAs ended DISPATCH(0) 110 us after SHARED_GU.
constexpr double kDispatchFlopPerByte = 135.0;
__host__ inline double dispatch_share(int32_t mb_tokens, int32_t tokens, int32_t hidden, int32_t per_token,
                                      int32_t shared_inter) {
  const double bytes = double(mb_tokens) * per_token * hidden * 2;    // the rows DISPATCH(0) writes (bf16)
  const double flops = 2.0 * tokens * hidden * (2.0 * shared_inter);  // the SHARED_GU tiles (every token)
  return bytes * kDispatchFlopPerByte / (bytes * kDispatchFlopPerByte + flops);
}

__host__ inline Plan make_plan(const ForwardShape& s, const ForwardKnobs& kn, int32_t rank_ctas = 0) {
  Plan p{};
  p.T = s.tokens, p.H = s.hidden, p.I = s.inter, p.Is = kn.identity_experts ? 0 : s.shared_inter;
  p.k = s.top_k, p.L = s.local_experts, p.ep = s.ep;
  p.G = kn.granularity < s.tokens ? kn.granularity : s.tokens;
  p.G = cdiv(p.G, comm::kChunkTokens) * comm::kChunkTokens;  // whole schedule chunks
  p.M = cdiv(s.tokens, p.G);
  p.S = kn.ring_slots < p.M ? kn.ring_slots : p.M;
  p.g = p.S >= 2 ? 1 : 0;
  const int32_t per_token = s.top_k < s.local_experts ? s.top_k : s.local_experts;
  p.slot_rows = s.ep * (p.G < s.tokens ? p.G : s.tokens) * per_token;
  p.fp8 = s.routed_fp8;
  p.scale_ld = (p.S * p.slot_rows + 3) / 4 * 4;  // every K block's column 16-byte aligned (the tiles' bulk copies)
  p.nchunks = comm::num_chunks(s.tokens);
  p.chunks_per_mb = p.G / comm::kChunkTokens;
  p.D = kn.comm_items;
  p.identity = kn.identity_experts;
  p.timing_mode = kn.timing_mode;
  p.n_post = s.ep > 1 ? p.D : 0;
  p.n_count = cdiv(int64_t(s.ep) * p.nchunks, kChunksPerCountItem);
  p.n_place = p.n_count;
  p.shared_mblocks = cdiv(s.tokens, kTileM);
  p.nb_gu = p.identity ? 0 : cdiv(s.inter, kGuCols);
  p.nb_dn = p.identity ? 0 : cdiv(s.hidden, kDnCols);
  p.nb_shared_gu = p.Is ? cdiv(p.Is, kGuCols) : 0;
  p.nb_shared_dn = p.Is ? cdiv(s.hidden, kDnCols) : 0;
  p.n_shared_gu = p.shared_mblocks * p.nb_shared_gu;
  p.n_shared_dn = p.shared_mblocks * p.nb_shared_dn;
  p.D0 = p.D;
  if (rank_ctas > p.D && p.n_shared_gu == 0) {
    p.D0 = rank_ctas;
  } else if (rank_ctas > p.D && s.ep == 1) {  // (dispatch_share)
    const int32_t mb_tokens = p.G < s.tokens ? p.G : s.tokens;
    const int32_t d0 = int32_t(rank_ctas * dispatch_share(mb_tokens, s.tokens, s.hidden, per_token, p.Is) + 0.5);
    p.D0 = d0 > p.D ? d0 : p.D;
  }
  p.mb_cap = cdiv(p.slot_rows, kTileM) + s.local_experts;
  const bool late = kn.timing_mode & kTimingSharedDownLate ? true
                    : kn.timing_mode & kTimingSharedDownEarly ? false
                                                              : s.ep == 1;
  p.shared_dn_late = p.n_shared_dn > 0 && late ? 1 : 0;
  // The dynamic part's segments (scan.cuh writes them): SEND (ep > 1) and REDUCE of each microbatch, DISPATCH of
  // each but the first, GU and DN of each: (ep > 1 ? 5 : 4) M - 1; one more, SHARED_DN, when it runs late.
  p.max_segments = (s.ep > 1 ? 5 : 4) * p.M;
  p.t_count = p.n_post;
  p.t_scan = p.t_count + p.n_count;
  p.t_place = p.t_scan + 1;
  p.t_disp0 = p.t_place + p.n_place;
  p.t_sgu = p.t_disp0 + p.D0;
  p.t_sdn = p.t_sgu + p.n_shared_gu;
  p.t_dynamic = p.t_sdn + (p.shared_dn_late ? 0 : p.n_shared_dn);
  int64_t o = kCtlWords;
  auto take = [&](int64_t words) {
    const int64_t at = o;
    o += (words + 63) / 64 * 64;  // 256-byte aligned blocks
    return at;
  };
  const int64_t cells = int64_t(s.ep) * p.nchunks * s.local_experts;
  const int64_t slots = int64_t(s.ep) * s.tokens * s.top_k;
  const int64_t tables = int64_t(p.M) * (s.local_experts + 1);
  p.o_disp = take(p.M);
  p.o_send = take(p.M);
  p.o_reduce = take(p.M);
  p.o_dn = take(p.M);
  p.o_sgu = take(p.shared_mblocks);
  p.o_gu = take(int64_t(p.M) * p.mb_cap);
  p.o_cnt = take(cells);
  p.o_base = take(cells);
  p.o_row = take(slots);
  p.o_w = take(slots);
  p.o_row_start = take(tables);
  p.o_tile_gu = take(tables);
  p.o_tile_dn = take(tables);
  p.o_mblock = take(tables);
  p.o_seg_begin = take(p.max_segments + 1);
  p.o_seg_kind = take(p.max_segments);
  p.o_seg_mb = take(p.max_segments);
  p.o_item_times = take(kItemTimeWords);  // a bench finds them through mok_moe_item_times_offset (ffi_moe.cu)
  p.sync_words = o;
  return p;
}

// Items of a communication phase: the last microbatch's combine is split over every CTA of the rank (there
// is nothing left to overlap it with), the rest over D; the first microbatch's dispatch over D0.
__host__ __device__ inline int32_t n_dispatch(const Plan& p, int m) { return m == 0 ? p.D0 : p.D; }
__host__ __device__ inline int32_t n_send(const Plan& p, int m, int ctas) {
  return p.ep > 1 ? (m == p.M - 1 ? ctas : p.D) : 0;
}
__host__ __device__ inline int32_t n_reduce(const Plan& p, int m, int ctas) { return m == p.M - 1 ? ctas : p.D; }

// Tokens [t0, t1) of microbatch m.
__host__ __device__ inline void mb_tokens(const Plan& p, int m, int* t0, int* t1) {
  *t0 = m * p.G;
  *t1 = (m + 1) * p.G < p.T ? (m + 1) * p.G : p.T;
}

// Item i of n over `count` units: the contiguous share [*b, *e).
__host__ __device__ inline void share(int64_t count, int i, int n, int64_t* b, int64_t* e) {
  *b = count * i / n;
  *e = count * (i + 1) / n;
}

}  // namespace mok::moe
