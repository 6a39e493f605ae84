// A lab program (issue 33; docs/design.md, "Tried: the backward's epilogues under the MMAs"), not part of
// the package. The backward's weight-gradient tiles (WGATEUP, WDOWN) run as one 128 x 256 output of both consumer
// warpgroups together: both finish the MMAs, then both store the tile, with the tensor cores idle. On one H100 that
// store took 0.239 ms per SM of kimi-k2's d_gate_up (704 MB of bf16 gradient, at about the HBM's write rate). This
// program asks, before any kernel changes, whether ping-pong consumers or epilogue warps hide it:
//   mode 0  the library's grouped weight-gradient kernel as it is (gemm::Sm90WeightGrad: cooperative 128 x 256
//           tiles over a 4-stage ring of 48 KB, the bf16 epilogue through a 64 x 64 buffer per warpgroup)
//   mode 1  ping-pong: each consumer warpgroup owns every other tile of its CTA, 128 x 128 outputs (two m64n128k16
//           wgmmas per k-step, the same 128 accumulator registers a thread), over a 6-stage ring of 32 KB; a pair
//           of mbarriers hands the tensor cores from one warpgroup's mainloop to the other's, so one stores its tile
//           while the other computes
//   mode 2  epilogue warps: mode 0's tile over a 3-stage ring; its consumers write the bf16 tile into a 66 KB
//           staging buffer and go on to the next tile's MMAs while warps 1-3 of the producer warpgroup (idle in
//           mode 0) copy it out
//   mode 3  mode 0's tile, ring and epilogue in 2-CTA clusters: the two CTAs take the same B (adjacent m-blocks) and
//           each loads one of its two boxes, multicast into both (32 KB a k-tile out of L2 per CTA instead of 48)
// All four reduce each output over its group's rows in ascending 64-row k-tiles with fp32 accumulation, so the
// outputs are expected to be the same bits; the program compares them all (each output poisoned with 0xff first)
// and checks sampled outputs of mode 0 against an fp32 dot product on the GPU (bound: one bf16 rounding plus the
// fp32 sums' error). Then the median ms of each mode over sustained launches, in the order 0 1 2 3 3 2 1 0.
// The problem (default: kimi-k2's d_gate_up at T = 2048 on one GPU): 12 groups (experts) of 1408 rows (multiples
// of 128, as the backward pads them), A = x_e [rows, H = 7168], B = dgu [rows, 2I = 4096], out[g] = A_g^T B_g.
// Run on H100s (thirty-third session), every mode the same bits: modes 0-2 (before mode 3 existed) on one card
// 1.524 / 1.814 / 1.480 ms (651 / 547 / 670 TFLOP/s); all four on another 1.426 / 1.838 / 1.391 / 1.445 (696 / 540 /
// 713 / 686), where cuBLAS's grouped GEMM (scripts/lab/cublas_wgrad.py) took 1.375. So ping-pong at 128 x 128 loses,
// epilogue warps gain 2-3%, multicast loses 1%: docs/design.md, "Tried: the backward's epilogues under the MMAs".
// Build (from the repository root; CUTLASS from the nvidia-cutlass wheel, as CMake finds it):
//   CUTLASS=$(python3 -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I ffi/include \
//     -isystem $CUTLASS -o wgrad_pingpong scripts/lab/wgrad_pingpong.cu
//   ./wgrad_pingpong [groups rows_per_group m_dim n_dim]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mok/gemm/sm90_weight_grad.cuh"

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
using Element = cutlass::bfloat16_t;
using Coop = Sm90WeightGrad;

__global__ void __launch_bounds__(Coop::kThreads, 1) coop_kernel(const __grid_constant__ Coop::Params p) {
  Coop::run(p);
}

// ---- what modes 1-3 share ----------------------------------------------------------------------------------------
// Tiles of kBlockM x kBlockN outputs over a ring of kStages stages (A 128 x 64, B kBlockN x 64, both MN-major: the
// stage layouts of Sm90WeightGrad, whose TMA descriptors load them in 128 x 64 boxes), their list (a CTA takes tiles
// c, c + num_ctas, ..., bands of 16 m-blocks, as Sm90WeightGrad), the producer's loads and a consumer mainloop.
template <int kBlockN_, int kStages_>
struct LabTiles {
  static constexpr int kBlockM = 128, kBlockN = kBlockN_, kBlockK = 64, kStages = kStages_;
  static constexpr int kGroupM = 16, kBoxN = 128;
  static constexpr int kThreads = 384;
  using SmemLayoutA = detail::StageRing<Element, false, kBlockM, kBlockK, kStages>;
  using SmemLayoutB = detail::StageRing<Element, false, kBlockN, kBlockK, kStages>;
  using SmemLayoutBBox = detail::StageTile<Element, false, kBoxN, kBlockK>;
  static constexpr int kStageElemsA = kBlockM * kBlockK, kStageElemsB = kBlockN * kBlockK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + kStageElemsB) * sizeof(Element);
  using Params = Coop::Params;  // the same descriptors, sizes and output
  using Table = GroupTable<Coop::kMaxGroups>;

  struct Ring {
    alignas(1024) Element a[kStages * kStageElemsA];
    alignas(1024) Element b[kStages * kStageElemsB];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
  };
  // full[s]: the producer's arrive and the TMA bytes; empty[s]: one arrive per warp of the consumers that read s.
  __device__ static void init_ring(Ring& s, int consumer_warps) {  // one thread, before the CTA's first barrier
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterTransactionBarrier::init(&s.full[i], 1);
      cutlass::arch::ClusterBarrier::init(&s.empty[i], consumer_warps);
    }
  }

  struct Pos {
    int stage = 0;
    uint32_t phase = 0;
    __device__ void advance(int n = 1) {
      for (int i = 0; i < n; ++i)
        if (++stage == kStages) stage = 0, phase ^= 1;
    }
  };

  struct TileRef {
    int group, m_block, n_block, k0, n_k;
  };
  __device__ static int num_tiles(const Params& p) {
    return (p.m_dim + kBlockM - 1) / kBlockM * ((p.n_dim + kBlockN - 1) / kBlockN) * p.num_groups;
  }
  __device__ static TileRef decode(const Params& p, const Table& table, int tile) {
    const int nb = (p.n_dim + kBlockN - 1) / kBlockN, per_group = (p.m_dim + kBlockM - 1) / kBlockM * nb;
    TileRef r;
    r.group = tile / per_group;
    band_tile<kBlockM, kGroupM>(tile - r.group * per_group, p.m_dim, nb, &r.m_block, &r.n_block);
    r.k0 = table.row_start[r.group];
    r.n_k = (table.row_start[r.group + 1] - r.k0) / kBlockK;
    return r;
  }

  // The producer (one thread): every tile of the CTA, k-tile by k-tile, A in one box and B in kBlockN / 128.
  __device__ static void producer(const Params& p, Ring& s, const Table& table) {
    using namespace cute;
    Pos pos;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m_dim, p.num_rows));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_dim, p.num_rows, 1));
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    for (int tile = blockIdx.x; tile < num_tiles(p); tile += gridDim.x) {
      const TileRef r = decode(p, table, tile);
      Tensor gA = local_tile(domain_offset(make_coord(r.m_block * kBlockM, r.k0), mA),
                             Shape<Int<kBlockM>, Int<kBlockK>>{}, make_coord(0, _));
      auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      for (int k = 0; k < r.n_k; ++k) {
        if (!mbarrier_wait(&s.empty[pos.stage], pos.phase ^ 1, p.status)) return;
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[pos.stage], kStageBytes);
        copy(p.tma_a.with(s.full[pos.stage]), tAgA(_, k), tAsA(_, pos.stage));
        CUTE_UNROLL
        for (int box = 0; box < kBlockN / kBoxN; ++box) {
          Tensor gB = local_tile(domain_offset(make_coord(r.n_block * kBlockN + box * kBoxN, r.k0), mB(_, _, 0)),
                                 Shape<Int<kBoxN>, Int<kBlockK>>{}, make_coord(0, _));
          Tensor sB = make_tensor(make_smem_ptr(s.b + pos.stage * kStageElemsB + box * kBoxN * kBlockK),
                                  SmemLayoutBBox{});
          auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                          group_modes<0, 2>(gB(_, _, k)));
          copy(p.tma_b.with(s.full[pos.stage]), tBg, tBs);
        }
        pos.advance();
      }
    }
  }

  // The consumers' MMAs of one tile (Sm90TileT::mma_tile's loop over this ring): one batch of wgmmas per k-tile in
  // flight, each stage freed once the next batch is issued. after_issue() runs once the tile's last batch is issued,
  // before its wait. thread: the thread's index among the TiledMma's.
  // kCtas: the CTAs of the cluster whose consumers read each stage (mode 3 multicasts B into both): a warp frees
  // a stage in every one of them.
  template <class TiledMma, int kCtas = 1, class Accumulator, class AfterIssue>
  __device__ static bool mainloop(Ring& s, Pos& pos, Accumulator& acc, int n_k, int thread, int32_t* status,
                                  AfterIssue after_issue) {
    using namespace cute;
    TiledMma mma;
    auto thr = mma.get_thread_slice(thread);
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stages)
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, stages)
    const int lane = thread % 32;
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int prev_stage = -1;
    bool ok = true;
    for (int kt = 0; kt < n_k; ++kt) {
      if (!mbarrier_wait(&s.full[pos.stage], pos.phase, status)) {
        ok = false;
        break;
      }
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(mma, tCrA(_, _, kb, pos.stage), tCrB(_, _, kb, pos.stage), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k-tile's wgmmas are done: free its stage
      warpgroup_fence_operand(acc);
      if (prev_stage >= 0) arrive_warp<kCtas>(&s.empty[prev_stage], lane);
      prev_stage = pos.stage;
      pos.advance();
    }
    after_issue();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (prev_stage >= 0) arrive_warp<kCtas>(&s.empty[prev_stage], lane);
    return ok;
  }

  // One arrive for the warp, after all its lanes' earlier accesses (kCtas > 1: one on the barrier at the same place
  // in each CTA of the cluster).
  template <int kCtas = 1>
  __device__ static void arrive_warp(uint64_t* bar, int lane) {
    __syncwarp();
    if (lane != 0) return;
    if constexpr (kCtas == 1) {
      cutlass::arch::ClusterBarrier::arrive(bar);
    } else {
      for (int c = 0; c < kCtas; ++c) cutlass::arch::ClusterBarrier::arrive(bar, c, 1);
    }
  }

  // Thread 0's set-up of the TMA descriptors (after init_ring and the mode's own barriers).
  __device__ static void prefetch_descriptors(const Params& p) {
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  }
};

// ---- mode 1: ping-pong ------------------------------------------------------------------------------------------
struct PingPong : LabTiles<128, 6> {
  static constexpr int kEpiCols = 64, kEpiPitch = kEpiCols + 8;  // as Sm90TileT's buffer: conflict-free bf16x2 writes
  static constexpr int kEpiWords = 64 * kEpiPitch / 2;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::MN>{},
      cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  using Accumulator = decltype(cute::partition_fragment_C(
      std::declval<TiledMma>(), cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));

  struct SharedStorage {
    Ring ring;
    alignas(8) uint64_t order[2];  // order[w]: warpgroup w may run its next mainloop
    alignas(16) uint32_t epi[2][kEpiWords];
    Table table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  // bf16 out of one warpgroup's 128 x 128 accumulator: 4 passes of 64 rows x 64 columns through its buffer, then
  // 16-byte row stores (as Sm90TileT::store_bf16). Value v of MMA_M block m of thread (warp w, lane l): row
  // 64 m + 16 w + l/4 + 8 ((v/2)%2), column 8 (v/4) + 2 (l%4) + v%2 (PTX m64nNk16 f32 D).
  __device__ static void store(const Accumulator& acc, uint32_t* buf, const Params& p, Element* out, int row0,
                               int col0, int wg, int t) {
    constexpr int kPitchWords = kEpiPitch / 2;
    const int lane = t % 32, warp = t / 32;
    CUTE_UNROLL
    for (int m = 0; m < 2; ++m) {
      CUTE_UNROLL
      for (int pass = 0; pass < kBlockN / kEpiCols; ++pass) {
        CUTE_UNROLL
        for (int j = 0; j < 32; j += 2) {
          const int v = 32 * pass + j;
          const int r = 16 * warp + lane / 4 + 8 * ((v >> 1) & 1);
          const int c = 8 * ((v >> 2) - 8 * pass) + 2 * (lane % 4);
          buf[r * kPitchWords + c / 2] = Coop::Tile::pack_bf16x2(acc(v, m, 0), acc(v + 1, m, 0));
        }
        named_barrier_sync(1 + wg, 128);
        CUTE_UNROLL
        for (int j = 0; j < 64 * kEpiCols / 8 / 128; ++j) {
          const int idx = t + 128 * j;
          const int r = idx / (kEpiCols / 8), chunk = idx % (kEpiCols / 8);
          const int row = row0 + 64 * m + r;
          const int col = col0 + pass * kEpiCols + chunk * 8;
          if (row < p.m_dim && col < p.n_dim) {
            const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kPitchWords + chunk * 4);
            *reinterpret_cast<uint4*>(out + int64_t(row) * p.n_dim + col) = v;
          }
        }
        named_barrier_sync(1 + wg, 128);
      }
    }
  }

  // Warpgroup wg runs tiles j = wg, wg + 2, ... of its CTA's sequence and steps its ring position over the other
  // warpgroup's tiles; order[wg] is armed once for warpgroup 0's first tile, then each mainloop arms the other's
  // once its last wgmmas are issued (thread 0 of the warpgroup, after the warpgroup's named barrier).
  __device__ static void consumer(const Params& p, SharedStorage& s, int wg, int t) {
    Accumulator acc;
    Pos pos;
    uint32_t turn = 0;
    int j = 0;
    for (int tile = blockIdx.x; tile < num_tiles(p); tile += gridDim.x, ++j) {
      const TileRef r = decode(p, s.table, tile);
      if (j % 2 != wg) {
        pos.advance(r.n_k);
        continue;
      }
      if (!mbarrier_wait(&s.order[wg], turn, p.status)) return;
      turn ^= 1;
      const bool ok = mainloop<TiledMma>(s.ring, pos, acc, r.n_k, t, p.status, [&] {
        named_barrier_sync(1 + wg, 128);  // every warp of this warpgroup has issued its last wgmmas
        if (t == 0) cutlass::arch::ClusterBarrier::arrive(&s.order[1 - wg]);
      });
      if (!ok) return;
      Element* out = p.out + int64_t(r.group) * p.m_dim * p.n_dim;
      store(acc, s.epi[wg], p, out, r.m_block * kBlockM, r.n_block * kBlockN, wg, t);
    }
  }

  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& s = aligned_shared_storage<SharedStorage>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      init_ring(s.ring, 4);  // the 4 warps of the one warpgroup that reads a stage
      cutlass::arch::ClusterBarrier::init(&s.order[0], 1);
      cutlass::arch::ClusterBarrier::init(&s.order[1], 1);
      prefetch_descriptors(p);
    }
    if (warp == 1) build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, 1, lane);
    __syncthreads();
    if (threadIdx.x == 0) cutlass::arch::ClusterBarrier::arrive(&s.order[0]);  // warpgroup 0 goes first
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp == 0 && cute::elect_one_sync()) producer(p, s.ring, s.table);
    } else {
      cutlass::arch::warpgroup_reg_alloc<232>();
      consumer(p, s, (threadIdx.x - 128) / 128, threadIdx.x % 128);
    }
  }
};

__global__ void __launch_bounds__(PingPong::kThreads, 1) pingpong_kernel(const __grid_constant__ PingPong::Params p) {
  PingPong::run(p);
}

// ---- mode 2: epilogue warps -------------------------------------------------------------------------------------
// The cooperative 128 x 256 tile of mode 0 over a 3-stage ring of 48 KB, whose consumers write the tile's bf16
// outputs into a staging buffer in shared memory (128 rows x 256 columns, padded) and go on to the next tile's MMAs;
// warps 1-3 of the producer warpgroup (idle in mode 0) copy it out in 16-byte row stores meanwhile. staged_full:
// the consumers' 8 warps have written a tile; staged_empty: the 3 copy warps have read it all.
struct EpilogueWarps : LabTiles<256, 3> {
  static constexpr int kCopyWarps = 3;
  static constexpr int kPitch = kBlockN + 8;  // bf16: 528-byte rows, so the consumers' 4-byte writes miss no bank
  using TiledMma = Coop::Tile::TiledMma;  // two warpgroups of 64x256x16
  using Accumulator = Coop::Tile::Accumulator;

  struct SharedStorage {
    Ring ring;
    alignas(16) Element staged[kBlockM * kPitch];
    alignas(8) uint64_t staged_full, staged_empty;
    Table table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  __device__ static void consumer(const Params& p, SharedStorage& s, int ct) {
    Accumulator acc;
    Pos pos;
    uint32_t staged = 0;
    const int wg = ct / 128, t = ct % 128, lane = t % 32, warp = t / 32;
    for (int tile = blockIdx.x; tile < num_tiles(p); tile += gridDim.x) {
      const TileRef r = decode(p, s.table, tile);
      if (!mainloop<TiledMma>(s.ring, pos, acc, r.n_k, ct, p.status, [] {})) return;
      if (!mbarrier_wait(&s.staged_empty, staged ^ 1, p.status)) return;  // the previous tile is copied out
      staged ^= 1;
      // Value i of thread (warp w, lane l) of warpgroup wg: row 64 wg + 16 w + l/4 + 8 ((i/2)%2), column
      // 8 (i/4) + 2 (l%4) + i%2 (PTX m64nNk16 f32 D).
      auto* words = reinterpret_cast<uint32_t*>(s.staged);
      CUTE_UNROLL
      for (int i = 0; i < 128; i += 2) {
        const int row = 64 * wg + 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
        const int col = 8 * (i >> 2) + 2 * (lane % 4);
        words[(row * kPitch + col) / 2] = Coop::Tile::pack_bf16x2(acc(i), acc(i + 1));
      }
      arrive_warp(&s.staged_full, lane);
    }
  }

  // Warps 1-3: each staged tile out, 16 bytes a thread at a time, rows in order.
  __device__ static void copier(const Params& p, SharedStorage& s, int ct) {
    uint32_t staged = 0;
    const int lane = ct % 32;
    for (int tile = blockIdx.x; tile < num_tiles(p); tile += gridDim.x) {
      const TileRef r = decode(p, s.table, tile);
      if (!mbarrier_wait(&s.staged_full, staged, p.status)) return;
      staged ^= 1;
      Element* out = p.out + int64_t(r.group) * p.m_dim * p.n_dim;
      const int row0 = r.m_block * kBlockM, col0 = r.n_block * kBlockN;
      for (int c = ct; c < kBlockM * kBlockN / 8; c += 32 * kCopyWarps) {
        const int row = c / (kBlockN / 8), col = (c % (kBlockN / 8)) * 8;
        const uint4 v = *reinterpret_cast<const uint4*>(s.staged + row * kPitch + col);
        if (row0 + row < p.m_dim && col0 + col < p.n_dim)
          *reinterpret_cast<uint4*>(out + int64_t(row0 + row) * p.n_dim + col0 + col) = v;
      }
      arrive_warp(&s.staged_empty, lane);
    }
  }

  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& s = aligned_shared_storage<SharedStorage>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      init_ring(s.ring, 8);  // both consumer warpgroups read every stage
      cutlass::arch::ClusterBarrier::init(&s.staged_full, 8);           // the consumers' 8 warps
      cutlass::arch::ClusterBarrier::init(&s.staged_empty, kCopyWarps);  // the copy warps
      prefetch_descriptors(p);
    }
    if (warp == 1) build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, 1, lane);
    __syncthreads();
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp == 0) {
        if (cute::elect_one_sync()) producer(p, s.ring, s.table);
      } else {
        copier(p, s, threadIdx.x - 32);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<232>();
      consumer(p, s, threadIdx.x - 128);
    }
  }
};

__global__ void __launch_bounds__(EpilogueWarps::kThreads, 1)
    epilogue_warps_kernel(const __grid_constant__ EpilogueWarps::Params p) {
  EpilogueWarps::run(p);
}

// ---- mode 3: two CTAs of a cluster multicast B --------------------------------------------------------------------
// Mode 0's tile, ring and epilogue, run by 2-CTA clusters: the CTAs of a cluster take the tiles (group, m-block
// 2q + rank, n-block) of one (group, q, n-block), so both read the same B. Each loads its own A (16 KB a k-tile) and
// one of B's two 128-column boxes, multicast into both CTAs: 32 KB a k-tile leave L2 for each CTA instead of 48.
// full[s] takes the CTA's producer arrive and 48 KB (its A, its box and the peer's box); empty[s] one arrive per
// consumer warp of both CTAs (16), since the peer's producer writes into this CTA's stage too.
// B [rows, n_dim] read as n_dim x rows, in 128 x 64 boxes, each loaded once and multicast (outside the struct: its
// type is deduced from the body).
inline auto make_tma_b_multicast(const Element* ptr, int rows, int n_dim) {
  using namespace cute;
  using Box = LabTiles<256, 4>;
  Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(n_dim, rows), make_stride(Int<1>{}, int64_t(n_dim)));
  return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, g, Box::SmemLayoutBBox{},
                       Shape<Int<Box::kBoxN>, Int<Box::kBlockK>>{}, Int<1>{});
}

struct Multicast : LabTiles<256, 4> {
  static constexpr int kCtas = 2;
  using TiledMma = Coop::Tile::TiledMma;
  using Accumulator = Coop::Tile::Accumulator;
  using TmaB = decltype(make_tma_b_multicast(nullptr, 0, 0));
  struct Params {
    Coop::TmaA tma_a;
    TmaB tma_b;
    const int32_t* group_sizes;
    int32_t num_groups, num_rows, m_dim, n_dim;
    Element* out;
    int32_t* status;
  };
  struct SharedStorage {
    Ring ring;
    alignas(16) uint32_t epi[Coop::Tile::kConsumerWarpgroups][Coop::Tile::kEpiWords];
    Table table;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one sm_90 CTA");

  __device__ static int num_pairs(const Params& p) {
    return (p.m_dim + 2 * kBlockM - 1) / (2 * kBlockM) * ((p.n_dim + kBlockN - 1) / kBlockN) * p.num_groups;
  }
  // Pair `pair` in the order of mode 0's list, with 256-row m-blocks; this CTA's m-block of it.
  __device__ static TileRef decode(const Params& p, const Table& table, int pair, int rank) {
    const int nb = (p.n_dim + kBlockN - 1) / kBlockN, per_group = (p.m_dim + 2 * kBlockM - 1) / (2 * kBlockM) * nb;
    TileRef r;
    r.group = pair / per_group;
    int m_pair;
    band_tile<2 * kBlockM, kGroupM / 2>(pair - r.group * per_group, p.m_dim, nb, &m_pair, &r.n_block);
    r.m_block = 2 * m_pair + rank;
    r.k0 = table.row_start[r.group];
    r.n_k = (table.row_start[r.group + 1] - r.k0) / kBlockK;
    return r;
  }

  __device__ static void producer(const Params& p, Ring& s, const Table& table, int rank) {
    using namespace cute;
    Pos pos;
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m_dim, p.num_rows));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n_dim, p.num_rows));
    Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
    for (int pair = blockIdx.x / kCtas; pair < num_pairs(p); pair += gridDim.x / kCtas) {
      const TileRef r = decode(p, table, pair, rank);
      Tensor gA = local_tile(domain_offset(make_coord(r.m_block * kBlockM, r.k0), mA),
                             Shape<Int<kBlockM>, Int<kBlockK>>{}, make_coord(0, _));
      auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      Tensor gB = local_tile(domain_offset(make_coord(r.n_block * kBlockN + rank * kBoxN, r.k0), mB),
                             Shape<Int<kBoxN>, Int<kBlockK>>{}, make_coord(0, _));
      for (int k = 0; k < r.n_k; ++k) {
        if (!mbarrier_wait(&s.empty[pos.stage], pos.phase ^ 1, p.status)) return;
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[pos.stage], kStageBytes);
        copy(p.tma_a.with(s.full[pos.stage]), tAgA(_, k), tAsA(_, pos.stage));
        Tensor sB = make_tensor(make_smem_ptr(s.b + pos.stage * kStageElemsB + rank * kBoxN * kBlockK),
                                SmemLayoutBBox{});
        auto [tBg, tBs] = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                        group_modes<0, 2>(gB(_, _, k)));
        copy(p.tma_b.with(s.full[pos.stage], uint16_t((1u << kCtas) - 1)), tBg, tBs);
        pos.advance();
      }
    }
  }

  __device__ static void consumer(const Params& p, SharedStorage& s, int ct, int rank) {
    Accumulator acc;
    Pos pos;
    const int wg = ct / 128, t = ct % 128;
    for (int pair = blockIdx.x / kCtas; pair < num_pairs(p); pair += gridDim.x / kCtas) {
      const TileRef r = decode(p, s.table, pair, rank);
      if (!mainloop<TiledMma, kCtas>(s.ring, pos, acc, r.n_k, ct, p.status, [] {})) return;
      Element* out = p.out + int64_t(r.group) * p.m_dim * p.n_dim;
      const Coop::Tile::TileStore st{out, p.n_dim, r.m_block * kBlockM, p.m_dim, r.n_block * kBlockN, p.n_dim};
      Coop::Tile::store_bf16<false>(acc, s.epi[wg], st, wg, t);
    }
  }

  __device__ static void run(const Params& p) {
    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& s = aligned_shared_storage<SharedStorage>(smem_raw);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = threadIdx.x % 32;
    const int rank = int(cute::block_rank_in_cluster());
    if (warp == 0 && lane == 0) {
      init_ring(s.ring, 8 * kCtas);  // the consumer warps of both CTAs free each stage
      cutlass::arch::fence_barrier_init();
      cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
    }
    if (warp == 1) build_group_table(s.table, p.group_sizes, p.num_groups, p.num_rows, kBlockM, 1, lane);
    cute::cluster_sync();  // both CTAs' barriers are initialised before either multicasts or arrives into the other
    if (threadIdx.x < 128) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp == 0 && cute::elect_one_sync()) producer(p, s.ring, s.table, rank);
    } else {
      cutlass::arch::warpgroup_reg_alloc<232>();
      consumer(p, s, threadIdx.x - 128, rank);
    }
    cute::cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers or load into its stages
  }
};

__global__ void __launch_bounds__(Multicast::kThreads, 1)
    multicast_kernel(const __grid_constant__ Multicast::Params p) {
  Multicast::run(p);
}

// ---- inputs, reference, comparison ----------------------------------------------------------------------------
__global__ void fill(Element* x, int64_t n, uint32_t seed) {  // values in [-1, 1), none zero by construction
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    x[i] = Element(((h >> 8) + 0.5f) / float(1u << 23) - 1.0f);
  }
}

// out[g][m, n] in fp32 and the sum of |terms| (for the bound), for sampled (g, m, n).
__global__ void reference(const Element* a, const Element* b, const int* starts, int m_dim, int n_dim,
                          const int3* samples, int num, float* ref, float* mag) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num) return;
  const int3 s = samples[i];
  float acc = 0.0f, abs_acc = 0.0f;
  for (int r = starts[s.x]; r < starts[s.x + 1]; ++r) {
    const float v = float(a[int64_t(r) * m_dim + s.y]) * float(b[int64_t(r) * n_dim + s.z]);
    acc += v, abs_acc += fabsf(v);
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
  const int groups = argc > 1 ? std::atoi(argv[1]) : 12;
  const int rows_per_group = argc > 2 ? std::atoi(argv[2]) : 1408;
  const int m_dim = argc > 3 ? std::atoi(argv[3]) : 7168;
  const int n_dim = argc > 4 ? std::atoi(argv[4]) : 4096;
  if (groups < 1 || rows_per_group < 128 || rows_per_group % 128 || m_dim % 128 || n_dim % 128) {
    std::fprintf(stderr, "groups >= 1; rows_per_group, m_dim, n_dim positive multiples of 128\n");
    return 2;
  }
  const int rows = groups * rows_per_group;
  const int64_t out_elems = int64_t(groups) * m_dim * n_dim;
  std::printf("problem: %d groups x %d rows, out[g] = A_g^T B_g of %d x %d (%.1f GFLOP)\n", groups, rows_per_group,
              m_dim, n_dim, 2.0 * rows * double(m_dim) * n_dim / 1e9);

  constexpr int kModes = 4;
  Element *a, *b, *outs[kModes];
  int *sizes, *starts, *status;
  CHECK(cudaMalloc(&a, int64_t(rows) * m_dim * sizeof(Element)));
  CHECK(cudaMalloc(&b, int64_t(rows) * n_dim * sizeof(Element)));
  for (auto& o : outs) CHECK(cudaMalloc(&o, out_elems * sizeof(Element)));
  CHECK(cudaMalloc(&sizes, groups * sizeof(int)));
  CHECK(cudaMalloc(&starts, (groups + 1) * sizeof(int)));
  CHECK(cudaMalloc(&status, kModes * sizeof(int)));
  fill<<<1024, 256>>>(a, int64_t(rows) * m_dim, 0x1234u);
  fill<<<1024, 256>>>(b, int64_t(rows) * n_dim, 0x9876u);
  std::vector<int> h_sizes(groups, rows_per_group), h_starts(groups + 1);
  for (int g = 0; g <= groups; ++g) h_starts[g] = g * rows_per_group;
  CHECK(cudaMemcpy(sizes, h_sizes.data(), groups * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(starts, h_starts.data(), (groups + 1) * sizeof(int), cudaMemcpyHostToDevice));

  Coop::Params p{};
  p.tma_a = Coop::make_tma_a(a, rows, m_dim);
  p.tma_b = Coop::make_tma_b(b, rows, n_dim);
  p.group_sizes = sizes, p.num_groups = groups, p.num_rows = rows, p.m_dim = m_dim, p.n_dim = n_dim;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(coop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Coop::kSmemBytes));
  CHECK(cudaFuncSetAttribute(pingpong_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, PingPong::kSmemBytes));
  CHECK(cudaFuncSetAttribute(epilogue_warps_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             EpilogueWarps::kSmemBytes));
  CHECK(cudaFuncSetAttribute(multicast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Multicast::kSmemBytes));
  Multicast::Params pm{};
  pm.tma_a = p.tma_a;
  pm.tma_b = make_tma_b_multicast(b, rows, n_dim);
  pm.group_sizes = sizes, pm.num_groups = groups, pm.num_rows = rows, pm.m_dim = m_dim, pm.n_dim = n_dim;
  const int cluster_grid = sms / Multicast::kCtas * Multicast::kCtas;
  auto launch = [&](int mode) {
    Coop::Params q = p;
    q.out = outs[mode];
    q.status = status + mode;
    if (mode == 0) coop_kernel<<<sms, Coop::kThreads, Coop::kSmemBytes>>>(q);
    else if (mode == 1) pingpong_kernel<<<sms, PingPong::kThreads, PingPong::kSmemBytes>>>(q);
    else if (mode == 2) epilogue_warps_kernel<<<sms, EpilogueWarps::kThreads, EpilogueWarps::kSmemBytes>>>(q);
    else {
      Multicast::Params qm = pm;
      qm.out = outs[mode];
      qm.status = status + mode;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(cluster_grid), cfg.blockDim = dim3(Multicast::kThreads);
      cfg.dynamicSmemBytes = Multicast::kSmemBytes;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = Multicast::kCtas, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr, cfg.numAttrs = 1;
      CHECK(cudaLaunchKernelEx(&cfg, multicast_kernel, qm));
    }
  };

  // Correctness: every output poisoned, one launch each, every element of modes 1-3 against mode 0; mode 0
  // against fp32 samples.
  for (auto o : outs) CHECK(cudaMemset(o, 0xff, out_elems * sizeof(Element)));
  CHECK(cudaMemset(status, 0, kModes * sizeof(int)));
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
      std::printf("differs from mode 0 in %lld of %lld outputs, first at group %lld row %lld col %lld\n",
                  (long long)differ, (long long)out_elems, (long long)(first / (int64_t(m_dim) * n_dim)),
                  (long long)(first / n_dim % m_dim), (long long)(first % n_dim));
    else
      std::printf("the bits of mode 0 in all %lld outputs\n", (long long)out_elems);
    wrong += differ != 0 || unwritten != 0;
  }

  const int num = 4096;
  std::vector<int3> h_samples(num);
  uint32_t lcg = 12345u;
  auto next = [&](int n) { lcg = lcg * 1664525u + 1013904223u; return int((lcg >> 8) % uint32_t(n)); };
  for (auto& s : h_samples) s = make_int3(next(groups), next(m_dim), next(n_dim));
  int3* samples;
  float *ref, *mag;
  CHECK(cudaMalloc(&samples, num * sizeof(int3)));
  CHECK(cudaMalloc(&ref, num * sizeof(float)));
  CHECK(cudaMalloc(&mag, num * sizeof(float)));
  CHECK(cudaMemcpy(samples, h_samples.data(), num * sizeof(int3), cudaMemcpyHostToDevice));
  reference<<<(num + 127) / 128, 128>>>(a, b, starts, m_dim, n_dim, samples, num, ref, mag);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> h_ref(num), h_mag(num);
  CHECK(cudaMemcpy(h_ref.data(), ref, num * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(h_mag.data(), mag, num * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < num; ++i) {
    const int3 s = h_samples[i];
    const uint32_t bits = uint32_t(h0[(int64_t(s.x) * m_dim + s.y) * n_dim + s.z]) << 16;
    float got;
    std::memcpy(&got, &bits, 4);
    // bf16's rounding of the result plus two fp32 sums' errors (rows * 2^-24 of the sum of |terms| each)
    const float bound = std::ldexp(std::fabs(h_ref[i]), -8) + 2.0f * rows_per_group * std::ldexp(h_mag[i], -24);
    if (!(std::fabs(got - h_ref[i]) <= bound) && bad++ < 5)
      std::printf("  sample (%d, %d, %d): mode 0 %g, fp32 %g, bound %g\n", s.x, s.y, s.z, got, h_ref[i], bound);
  }
  std::printf("mode 0 against fp32: %d of %d samples outside the bound\n", bad, num);

  // Speed: 3 warm-up launches each, then 5 samples of 10 launches per mode, in the order 0 1 2 3 3 2 1 0.
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms[kModes];
  for (int mode = 0; mode < kModes; ++mode)
    for (int i = 0; i < 3; ++i) launch(mode);
  for (int mode : {0, 1, 2, 3, 3, 2, 1, 0}) {
    for (int sample = 0; sample < 5; ++sample) {
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < 10; ++i) launch(mode);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      ms[mode].push_back(t / 10);
    }
  }
  CHECK(cudaMemcpy(h_status, status, sizeof(h_status), cudaMemcpyDeviceToHost));
  const double flop = 2.0 * rows * double(m_dim) * n_dim;
  const char* names[kModes] = {"cooperative 128 x 256, 4 stages", "ping-pong 128 x 128, 6 stages",
                               "cooperative 128 x 256, 3 stages, epilogue warps",
                               "cooperative 128 x 256, 4 stages, 2-CTA clusters multicasting B"};
  for (int mode = 0; mode < kModes; ++mode) {
    const float m = median(ms[mode]);
    std::printf("mode %d (%s): median %.3f ms of %zu samples, %.0f TFLOP/s\n", mode, names[mode], m,
                ms[mode].size(), flop / m / 1e9);
  }
  std::printf("status after the timed launches: %d %d %d %d\n", h_status[0], h_status[1], h_status[2], h_status[3]);
  return (wrong || bad || h_status[0] || h_status[1] || h_status[2] || h_status[3]) ? 1 : 0;
}
