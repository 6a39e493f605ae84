// mok backward: DWSUM(m): the router-weight gradient of m-block m's rows, the sum of the DH tiles' partials in
// n-block order. An item type: its run by the 256 consumer threads and its completion by one of them.
// Included by mok/backward/items.cuh only: its definitions live in experts_backward.cu's unnamed namespace.
#pragma once

#include <cstdint>

#include "mok/backward/list.cuh"
#include "mok/backward/params.cuh"
#include "mok/backward/waits.cuh"

namespace mok {
namespace {

// dw_e[r] = the sum over n-blocks (ascending) of dw_part[r, :], rows of m-block mb.
__device__ void dw_sum(const KernelParams& p, const Shape& h, const Item& it, int ct) {
  for (int r = it.row0 + ct; r < it.row_end; r += kConsumers) {
    float acc = 0.0f;
    for (int b = 0; b < h.nb_dh; ++b) acc += p.bwd.dw_part[int64_t(r) * h.nb_dh + b];
    p.dw_e[r] = acc;
  }
}

struct DwSumItem {
  // Waits for the m-block's DH tiles. False: the wait failed.
  __device__ static __forceinline__ bool run(const ItemContext& x, const Item& it) {
    if (!consumers_wait<1>(x.s, {x.c.dh + it.mb}, {x.h.nb_dh}, x.p, x.c.wait_ns + kDwSum, x.ct)) return false;
    dw_sum(x.p, x.h, it, x.ct);
    return true;
  }
  __device__ static __forceinline__ void complete(const KernelParams& p, const Counters& c, const Item& it) {
    atomicAdd(c.totals + 1, 1), atomicAdd(c.out + it.mb, 1);
  }
};

}  // namespace
}  // namespace mok
