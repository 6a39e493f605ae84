// mok moe: what the forward megakernel's communication items (items/*.cuh) share: the row helpers nan_row,
// dispatch_row, ring_slot and mb_share.
// Included by the item headers only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mok/comm/ptx.cuh"
#include "mok/comm/rows.cuh"
#include "mok/comm/workspace.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
#include "mok/gemm/sm90_sync.cuh"
#include "mok/gemm/sm90_tile.cuh"
#include "mok/moe/forward.cuh"
#include "mok/moe/forward_items.cuh"
#include "mok/moe/forward_params.cuh"
#include "mok/moe/plan.cuh"

namespace mok::moe {

// ================================================================================ communication items
// Executed by the 256 consumer threads: warp w (0..7) and lane of thread ct.

constexpr uint32_t kFull = 0xffffffffu;

__device__ __forceinline__ void nan_row(int4* dst, int nvec, int lane) {
  const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
  for (int i = lane; i < nvec; i += 32) comm::st_v4(dst + i, nan);
}

__device__ __forceinline__ size_t dispatch_row(const CommView& v, int s, int64_t t) {
  return size_t(s) * v.shape.max_tokens + size_t(t);
}

// The ring slot of microbatch m: its rows, nvec 16-byte vectors each.
__device__ __forceinline__ int4* ring_slot(const Plan& p, const RankParams& R, int m) {
  return reinterpret_cast<int4*>(R.recv) + size_t(m % p.S) * p.slot_rows * (p.H / 8);
}

// The first token of microbatch m, and this item's share [*q0, *q1) of the microbatch's per_token * tokens units.
__device__ __forceinline__ int mb_share(const Plan& p, const Item& it, int per_token, int64_t* q0, int64_t* q1) {
  int t_lo, t_hi;
  mb_tokens(p, it.mb, &t_lo, &t_hi);
  share(int64_t(t_hi - t_lo) * per_token, it.idx, it.count, q0, q1);
  return t_lo;
}

}  // namespace mok::moe
