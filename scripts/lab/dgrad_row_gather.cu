// A lab program (issue 33; docs/performance_history.md, "Rows gathered in the loader, as SonicMoE does on Hopper"),
// not part of the package. The backward copies the rows of x and dy into the expert-major x_e, dy_e (GATHER: 0.27 ms
// per SM of qwen3-30b-a3b's backward on one H100) so that its GEMM tiles load 128-row TMA boxes. row_gather_loads.cu
// (twenty-ninth session) filled a stage ring from x by token fastest with 16-byte cp.async from all 128 producer
// threads, each arriving on the stage's full barrier with cp.async.mbarrier.arrive.noinc (its mode 2: 6.48 TB/s,
// no MMA beside it); the megakernel only ever tried one producer warp (its mode 3), which starved the MMAs. This
// program asks whether mode 2's loader keeps a 128 x 256 wgmma tile at its rate, before any kernel changes:
//   mode 0  DH's GEMM as the backward runs it: dh' = dy_e down^T, A (dy_e) and B (down, K-major) by TMA, one
//           producer thread, registers 40 / 232 (the library's gemm::Sm90TileT<K, K>: its ring, loads and mainloop)
//   mode 1  A gathered from dy by each row's token: the 128 producer threads, 8 cp.async.cg of 16 bytes each per
//           k-tile (8 threads to a row's 128 bytes, swizzled by hand as TMA's 128-byte swizzle places them), every
//           thread waiting on the stage's empty barrier itself and arriving with .noinc (the full barrier takes
//           1 + 128 arrivals; its bytes are B's, whose TMA one thread issues first); each thread's 8 row pointers
//           read once per tile; registers 56 / 224 (SonicMoE's split with a gather)
//   mode 2  mode 1's loader reading dy_e's rows in order (no gather): the loader's cost apart from the gather's
// The same bytes reach the stages in every mode, so the outputs are expected to be the same bits: the program compares
// every output of modes 1 and 2 with mode 0's (each poisoned with 0xff first) and sampled outputs of mode 0 with an
// fp32 dot product on the GPU (bound: one bf16 rounding plus two fp32 sums' errors). Then the median ms of each mode
// over sustained launches, in the order 0 1 2 2 1 0.
// The problem (default: qwen3-30b-a3b's one-GPU backward): T = 8192 tokens, H = 2048, top-8 of 16 experts, uniform
// routing, I = 768; the layout pads each expert's rows to a multiple of 128, as the backward's does.
// Built here (thirty-ninth session, no spills); not yet run. Build (from the repository root; CUTLASS from the
// nvidia-cutlass wheel, as CMake finds it):
//   CUTLASS=$(python3 -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I ffi/include \
//     -isystem $CUTLASS -o dgrad_row_gather scripts/lab/dgrad_row_gather.cu
//   ./dgrad_row_gather [tokens hidden inter experts top_k]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cutlass/arch/reg_reconfig.h>

#include "mok/gemm/sm90_row_gather.cuh"
#include "mok/gemm/sm90_tile.cuh"

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace lab {
using namespace mok::gemm;
using Tile = Sm90TileT<cute::GMMA::Major::K, cute::GMMA::Major::K>;  // the backward's TileKK
using Element = Tile::Element;
constexpr int kThreads = 384;
constexpr int kLoaders = 128;  // modes 1 and 2: the producer warpgroup

struct Params {
  Tile::TmaA tma_a;           // dy_e [M, H] (mode 0)
  Tile::TmaB tma_b;           // down [E][I][H]: (n_b = I, k = H, groups = E), K-major
  const Element* rows;        // modes 1, 2: where row r's data starts is rows + H * index[r]
  const int32_t* index;       // [M]: mode 1 the row's token, mode 2 the row itself; -1 for a padding row
  const int32_t* mblock_group;  // [M / 128]: each m-block's expert
  __nv_bfloat16* out;         // [M, I]: dh'
  int32_t rows_m, hidden, inter, experts, m_blocks, n_blocks;
  int32_t* status;
};

struct Smem {
  Tile::Stages ring;
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;

__device__ __forceinline__ Tile::TileLoad tile_load(const Params& p, int mb, int nb) {
  Tile::TileLoad t{};
  t.a_rows = p.rows_m, t.k = p.hidden, t.a_row0 = mb * Tile::kBlockM;
  t.n_b = p.inter, t.groups = p.experts, t.group = p.mblock_group[mb];
  t.col0 = nb * Tile::kBlockN, t.col1 = nb * Tile::kBlockN + Tile::kHalfN;
  return t;
}

// Modes 1 and 2, every thread of the producer warpgroup (pt = 0..127): one tile's k-tiles. Thread pt copies 16-byte
// chunk pt % 8 of rows pt / 8 + 16 i (i < 8) of each k-tile; thread 0 also issues B's TMA, before its copies.
__device__ bool load_gathered(const Params& p, Smem& s, Tile::StagePos& pos, const Tile::TileLoad& t, int pt) {
  using namespace cute;
  const Element* src[8];
  const int r0 = pt / 8;
  CUTE_UNROLL
  for (int i = 0; i < 8; ++i) {
    const int32_t at = p.index[t.a_row0 + r0 + 16 * i];
    src[i] = at >= 0 ? p.rows + int64_t(at) * p.hidden : nullptr;
  }
  Tensor mB = p.tma_b.get_tma_tensor(make_shape(t.n_b, t.k, t.groups));
  Tensor mBg = mB(_, _, t.group);
  Tensor gB0 = local_tile(domain_offset(make_coord(t.col0, 0), mBg), Shape<Int<Tile::kHalfN>, Int<Tile::kBlockK>>{},
                          make_coord(0, _));
  const bool load_second = t.col1 < t.n_b;
  Tensor gB1 = local_tile(domain_offset(make_coord(load_second ? t.col1 : 0, 0), mBg),
                          Shape<Int<Tile::kHalfN>, Int<Tile::kBlockK>>{}, make_coord(0, _));
  const uint32_t b_bytes = (load_second ? Tile::kStageElemsB : Tile::kHalfElemsB) * sizeof(Element);
  const int n_k = Tile::k_tiles(t.k);
  for (int k = 0; k < n_k; ++k) {
    if (!mbarrier_wait(&s.ring.empty[pos.stage], pos.phase ^ 1, p.status)) return false;
    if (pt == 0) {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.ring.full[pos.stage], b_bytes);
      Tensor sB0 = make_tensor(make_smem_ptr(s.ring.b + pos.stage * Tile::kStageElemsB), Tile::SmemLayoutBHalf{});
      auto [tB0g, tB0s] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB0),
                                        group_modes<0, 2>(gB0(_, _, k)));
      copy(p.tma_b.with(s.ring.full[pos.stage]), tB0g, tB0s);
      if (load_second) {
        Tensor sB1 = make_tensor(make_smem_ptr(s.ring.b + pos.stage * Tile::kStageElemsB + Tile::kHalfElemsB),
                                 Tile::SmemLayoutBHalf{});
        auto [tB1g, tB1s] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB1),
                                          group_modes<0, 2>(gB1(_, _, k)));
        copy(p.tma_b.with(s.ring.full[pos.stage]), tB1g, tB1s);
      }
    }
    // K-major, 128-byte swizzle (mok/gemm/sm90_row_gather.cuh: the offsets of a TMA box's bytes)
    const uint32_t a_stage = cute::cast_smem_ptr_to_uint(s.ring.a + pos.stage * Tile::kStageElemsA);
    row_gather::load_k_major(a_stage, src, k * Tile::kBlockK, p.hidden, pt, p.rows);
    row_gather::arrive_when_landed(&s.ring.full[pos.stage]);
    pos.advance();
  }
  return true;
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) dgrad_kernel(const __grid_constant__ Params p) {
  extern __shared__ char raw[];
  Smem& s = aligned_shared_storage<Smem>(raw);
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (threadIdx.x == 0) Tile::init_stages(s.ring, kMode == 0 ? 1 : 1 + kLoaders);
  __syncthreads();
  const int tiles = p.m_blocks * p.n_blocks;
  if (wg == 0) {
    if constexpr (kMode == 0) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (t != 0) return;
    } else {
      cutlass::arch::warpgroup_reg_dealloc<56>();
    }
    Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const Tile::TileLoad tl = tile_load(p, tile / p.n_blocks, tile % p.n_blocks);
      const bool ok = kMode == 0 ? Tile::load_tile(p.tma_a, p.tma_b, s.ring, pos, tl, p.status)
                                 : load_gathered(p, s, pos, tl, t);
      if (!ok) return;
    }
  } else {
    if constexpr (kMode == 0) cutlass::arch::warpgroup_reg_alloc<232>();
    else cutlass::arch::warpgroup_reg_alloc<224>();
    const int ct = threadIdx.x - 128;
    Tile::StagePos pos;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int mb = tile / p.n_blocks, nb = tile % p.n_blocks;
      Tile::Accumulator acc;
      if (!Tile::mma_tile(s.ring, pos, acc, p.hidden, ct, p.status)) return;
      Tile::TileStore st{p.out, p.inter, mb * Tile::kBlockM, p.rows_m, nb * Tile::kBlockN, p.inter};
      Tile::store_regs<__nv_bfloat16>(acc, st, 0, ct / 128, ct % 128);
    }
  }
}

// ---- inputs, reference ------------------------------------------------------------------------------------------
__global__ void fill(Element* x, int64_t n, uint32_t seed) {  // values in [-1, 1), none zero by construction
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    x[i] = Element(((h >> 8) + 0.5f) / float(1u << 23) - 1.0f);
  }
}

// dy_e[r] = dy[token[r]], zeros for a padding row (what GATHER writes)
__global__ void gather_rows(const Element* dy, const int32_t* token, Element* dy_e, int64_t rows, int hidden) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * hidden;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t tok = token[i / hidden];
    dy_e[i] = tok >= 0 ? dy[int64_t(tok) * hidden + i % hidden] : Element(0.0f);
  }
}

// dh'[r, c] in fp32 and the sum of |terms|, for sampled (r, c)
__global__ void reference(const Element* dy, const Element* down, const int32_t* token, const int32_t* mblock_group,
                          int hidden, int inter, const int2* samples, int num, float* ref, float* mag) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num) return;
  const int2 s = samples[i];
  const int32_t tok = token[s.x];
  float acc = 0.0f, abs_acc = 0.0f;
  if (tok >= 0) {
    const Element* w = down + (int64_t(mblock_group[s.x / 128]) * inter + s.y) * hidden;
    for (int h = 0; h < hidden; ++h) {
      const float v = float(dy[int64_t(tok) * hidden + h]) * float(w[h]);
      acc += v, abs_acc += fabsf(v);
    }
  }
  ref[i] = acc, mag[i] = abs_acc;
}

}  // namespace lab

using namespace lab;

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 8192;
  const int hidden = argc > 2 ? std::atoi(argv[2]) : 2048;
  const int inter = argc > 3 ? std::atoi(argv[3]) : 768;
  const int experts = argc > 4 ? std::atoi(argv[4]) : 16;
  const int top_k = argc > 5 ? std::atoi(argv[5]) : 8;
  if (tokens < 1 || hidden % 64 || inter % 128 || experts < top_k || top_k < 1) {
    std::fprintf(stderr, "tokens >= 1, hidden a multiple of 64, inter of 128, experts >= top_k >= 1\n");
    return 2;
  }
  // routing: top_k distinct experts per token, uniform; the layout: each expert's slots in token order, padded to 128
  std::mt19937 rng(1234);
  std::vector<std::vector<int32_t>> rows_of(experts);
  std::vector<int> perm(experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) perm[e] = e;
    for (int j = 0; j < top_k; ++j) {
      std::swap(perm[j], perm[j + rng() % (experts - j)]);
      rows_of[perm[j]].push_back(t);
    }
  }
  std::vector<int32_t> h_token, h_row, h_group;
  for (int e = 0; e < experts; ++e) {
    std::vector<int32_t>& r = rows_of[e];
    while (r.size() % 128) r.push_back(-1);
    for (int32_t tok : r) h_token.push_back(tok);
    for (size_t b = 0; b < r.size() / 128; ++b) h_group.push_back(e);
  }
  const int rows = int(h_token.size()), m_blocks = rows / 128, n_blocks = (inter + 255) / 256;
  for (int r = 0; r < rows; ++r) h_row.push_back(h_token[r] >= 0 ? r : -1);
  const double flop = 2.0 * rows * double(hidden) * inter;
  std::printf("problem: %d tokens, top-%d of %d experts, %d rows (%d m-blocks), dh' = dy_e down^T of %d x %d "
              "(%.1f GFLOP)\n", tokens, top_k, experts, rows, m_blocks, hidden, inter, flop / 1e9);

  constexpr int kModes = 3;
  Element *dy, *dy_e, *down;
  __nv_bfloat16* outs[kModes];
  int32_t *token, *row, *group, *status;
  const int64_t out_elems = int64_t(rows) * inter;
  CHECK(cudaMalloc(&dy, int64_t(tokens) * hidden * sizeof(Element)));
  CHECK(cudaMalloc(&dy_e, int64_t(rows) * hidden * sizeof(Element)));
  CHECK(cudaMalloc(&down, int64_t(experts) * inter * hidden * sizeof(Element)));
  for (auto& o : outs) CHECK(cudaMalloc(&o, out_elems * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&token, rows * sizeof(int32_t)));
  CHECK(cudaMalloc(&row, rows * sizeof(int32_t)));
  CHECK(cudaMalloc(&group, m_blocks * sizeof(int32_t)));
  CHECK(cudaMalloc(&status, kModes * sizeof(int32_t)));
  CHECK(cudaMemcpy(token, h_token.data(), rows * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(row, h_row.data(), rows * sizeof(int32_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(group, h_group.data(), m_blocks * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill<<<1024, 256>>>(dy, int64_t(tokens) * hidden, 0x1234u);
  fill<<<1024, 256>>>(down, int64_t(experts) * inter * hidden, 0x9876u);
  gather_rows<<<1024, 256>>>(dy, token, dy_e, rows, hidden);
  CHECK(cudaGetLastError());

  Params p{};
  p.tma_a = Tile::make_tma_a(dy_e, rows, hidden);
  p.tma_b = Tile::make_tma_b(down, inter, hidden, experts);
  p.mblock_group = group;
  p.rows_m = rows, p.hidden = hidden, p.inter = inter, p.experts = experts;
  p.m_blocks = m_blocks, p.n_blocks = n_blocks;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(dgrad_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK(cudaFuncSetAttribute(dgrad_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK(cudaFuncSetAttribute(dgrad_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  auto launch = [&](int mode) {
    Params q = p;
    q.out = outs[mode];
    q.status = status + mode;
    q.rows = mode == 1 ? dy : dy_e;
    q.index = mode == 1 ? token : row;
    if (mode == 0) dgrad_kernel<0><<<sms, kThreads, kSmemBytes>>>(q);
    else if (mode == 1) dgrad_kernel<1><<<sms, kThreads, kSmemBytes>>>(q);
    else dgrad_kernel<2><<<sms, kThreads, kSmemBytes>>>(q);
  };

  // Correctness: every output poisoned, one launch each, every element of modes 1 and 2 against mode 0; mode 0
  // against fp32 samples.
  for (auto o : outs) CHECK(cudaMemset(o, 0xff, out_elems * sizeof(__nv_bfloat16)));
  CHECK(cudaMemset(status, 0, kModes * sizeof(int32_t)));
  for (int mode = 0; mode < kModes; ++mode) launch(mode);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  int h_status[kModes];
  CHECK(cudaMemcpy(h_status, status, sizeof(h_status), cudaMemcpyDeviceToHost));
  std::vector<uint16_t> h0(out_elems), hm(out_elems);
  CHECK(cudaMemcpy(h0.data(), outs[0], out_elems * 2, cudaMemcpyDeviceToHost));
  int64_t unwritten0 = 0, wrong = 0;
  for (int64_t i = 0; i < out_elems; ++i) unwritten0 += h0[i] == 0xffff;
  std::printf("mode 0: status %d, unwritten (0xffff) %lld\n", h_status[0], (long long)unwritten0);
  wrong += unwritten0 != 0;
  for (int mode = 1; mode < kModes; ++mode) {
    CHECK(cudaMemcpy(hm.data(), outs[mode], out_elems * 2, cudaMemcpyDeviceToHost));
    int64_t differ = 0, unwritten = 0, first = -1;
    for (int64_t i = 0; i < out_elems; ++i) {
      unwritten += hm[i] == 0xffff;
      if (hm[i] != h0[i] && differ++ == 0) first = i;
    }
    std::printf("mode %d: status %d, unwritten %lld, ", mode, h_status[mode], (long long)unwritten);
    if (differ)
      std::printf("differs from mode 0 in %lld of %lld outputs, first at row %lld col %lld\n", (long long)differ,
                  (long long)out_elems, (long long)(first / inter), (long long)(first % inter));
    else
      std::printf("the bits of mode 0 in all %lld outputs\n", (long long)out_elems);
    wrong += differ != 0 || unwritten != 0;
  }

  const int num = 4096;
  std::vector<int2> h_samples(num);
  uint32_t lcg = 12345u;
  auto next = [&](int n) { lcg = lcg * 1664525u + 1013904223u; return int((lcg >> 8) % uint32_t(n)); };
  for (auto& s : h_samples) s = make_int2(next(rows), next(inter));
  int2* samples;
  float *ref, *mag;
  CHECK(cudaMalloc(&samples, num * sizeof(int2)));
  CHECK(cudaMalloc(&ref, num * sizeof(float)));
  CHECK(cudaMalloc(&mag, num * sizeof(float)));
  CHECK(cudaMemcpy(samples, h_samples.data(), num * sizeof(int2), cudaMemcpyHostToDevice));
  reference<<<(num + 127) / 128, 128>>>(dy, down, token, group, hidden, inter, samples, num, ref, mag);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> h_ref(num), h_mag(num);
  CHECK(cudaMemcpy(h_ref.data(), ref, num * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(h_mag.data(), mag, num * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < num; ++i) {
    const int2 s = h_samples[i];
    const uint32_t bits = uint32_t(h0[int64_t(s.x) * inter + s.y]) << 16;
    float got;
    std::memcpy(&got, &bits, 4);
    // bf16's rounding of the result plus two fp32 sums' errors (hidden * 2^-24 of the sum of |terms| each)
    const float bound = std::ldexp(std::fabs(h_ref[i]), -8) + 2.0f * hidden * std::ldexp(h_mag[i], -24);
    if (!(std::fabs(got - h_ref[i]) <= bound) && bad++ < 5)
      std::printf("  sample (%d, %d): mode 0 %g, fp32 %g, bound %g\n", s.x, s.y, got, h_ref[i], bound);
  }
  std::printf("mode 0 against fp32: %d of %d samples outside the bound\n", bad, num);

  // Speed: 3 warm-up launches each, then 5 samples of 20 launches per mode, in the order 0 1 2 2 1 0.
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms[kModes];
  for (int mode = 0; mode < kModes; ++mode)
    for (int i = 0; i < 3; ++i) launch(mode);
  for (int mode : {0, 1, 2, 2, 1, 0}) {
    for (int sample = 0; sample < 5; ++sample) {
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < 20; ++i) launch(mode);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms[mode].push_back(t / 20);
    }
  }
  CHECK(cudaMemcpy(h_status, status, sizeof(h_status), cudaMemcpyDeviceToHost));
  const char* names[kModes] = {"A by TMA from the gathered dy_e (today)",
                               "A gathered from dy by token, 128 loader threads",
                               "A from dy_e's rows in order by the same loader"};
  for (int mode = 0; mode < kModes; ++mode) {
    const float m = median(ms[mode]);
    std::printf("mode %d (%s): median %.4f ms of %zu samples, %.0f TFLOP/s\n", mode, names[mode], m,
                ms[mode].size(), flop / m / 1e9);
  }
  std::printf("status after the timed launches: %d %d %d\n", h_status[0], h_status[1], h_status[2]);
  return (wrong || bad || h_status[0] || h_status[1] || h_status[2]) ? 1 : 0;
}
