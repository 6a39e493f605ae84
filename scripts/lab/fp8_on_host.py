"""The FP8 grouped FFN's data movement run on the CPU from its CUDA source, every CUDA thread a host thread:

- the row quantiser (ffi/src/grouped_ffn.cu's fp8_quantize_rows_kernel, with mok/gemm/fp8_quant.cuh) against
  mok_jax.fp8.quantize_rows: x_q and x_scale bit for bit (in a tile with an inf or a NaN: an E4M3 NaN for each such
  value, see check_quantiser());
- the FP8 tile's two epilogues (mok/gemm/sm90_fp8_tile.cuh: store_bf16_half, and store_swiglu_quant with its scales)
  from accumulators filled by the wgmma fragment's layout (PTX ISA, m64nNk32 f32 D) against the same values placed
  by row and column in numpy: every element where it belongs, rows past row_end and columns past n_out unwritten.

Every output is poisoned first. A check of the code's logic where no GPU is lent, not of the GPU: the source is
compiled by g++ (C++20) with CUDA's own host forms of the bf16 and E4M3 conversions, CuTe's host code,
layout_on_host.py's shim of threads, blocks and warps (with its __shfl_xor_sync and __any_sync), and host forms of
the other intrinsics the code calls (__byte_perm, __fmaf_rn, __ldg); intrinsics it only names abort if called.
tests/test_fp8_grouped_ffn_gpu.py and tests/test_moe_fp8_gpu.py are the tests on the GPU. Run from the repository
root:

    python scripts/lab/fp8_on_host.py [seed]

(tests/test_fp8_on_host.py runs it.)
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mok_jax import fp8  # noqa: E402

_spec = importlib.util.spec_from_file_location("layout_on_host", pathlib.Path(__file__).with_name("layout_on_host.py"))
_layout_on_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layout_on_host)

INTRINSICS = r"""
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int b = 0; b < 4; ++b) r |= uint32_t((v >> (8 * ((s >> (4 * b)) & 7))) & 0xff) << (8 * b);
  return r;
}
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
template <class T> inline T __ldg(const T* p) { return *p; }
// named by the headers, never called by what runs here
inline int atomicOr(int32_t*, int32_t) { std::abort(); }
inline size_t __cvta_generic_to_shared(const void*) { std::abort(); }
"""

HARNESS = r"""
#include <math.h>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#include "shim.h"
#include "mok/gemm/fp8_quant.cuh"
#include "mok/gemm/sm90_fp8_tile.cuh"
namespace mok {
KERNEL
}  // namespace mok
using Tile = mok::gemm::Sm90Fp8Tile;
extern "C" void run_quantize(const void* x, uint8_t* q, float* scale, int64_t rows, int64_t k, int32_t blocks) {
  shim_launch(mok::fp8_quantize_rows_kernel, unsigned(blocks), 256u, size_t(0),
              static_cast<const __nv_bfloat16*>(x), q, scale, rows, k);
}
// The two consumer warpgroups' accumulators of one tile from src [128][256] (columns 0..127: total0, 128..255:
// total1) by the fragment's layout: value i of thread (warp w, lane l) of warpgroup wg at row 64 wg + 16 w + l/4 +
// 8 ((i/2) % 2), column 8 (i/4) + 2 (l % 4) + i % 2.
static void fill(const float* src, int half, Tile::Accumulator& acc, int wg, int t) {
  const int warp = t / 32, lane = t % 32;
  for (int i = 0; i < 64; ++i) {
    const int r = 64 * wg + 16 * warp + lane / 4 + 8 * ((i / 2) % 2), c = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
    acc(i) = src[r * 256 + 128 * half + c];
  }
}
static void tile_bf16(const float* src, void* out, int64_t ld, int32_t row0, int32_t row_end, int32_t col0,
                      int32_t n_out) {
  const int ct = int(threadIdx.x), wg = ct / 128, t = ct % 128;
  Tile::Accumulator total0, total1;
  fill(src, 0, total0, wg, t);
  fill(src, 1, total1, wg, t);
  const Tile::TileStore st{{out, ld, row0, row_end, col0, n_out}};
  Tile::store_bf16_half(total0, st, 0, wg, t);
  Tile::store_bf16_half(total1, st, Tile::kHalfN, wg, t);
}
static void tile_swiglu(const float* src, void* out, float* scale, int64_t scale_ld, int64_t ld, int32_t row0,
                        int32_t row_end, int32_t col0, int32_t n_out) {
  const int ct = int(threadIdx.x), wg = ct / 128, t = ct % 128;
  Tile::Accumulator gate, up;  // gate: src's columns 0..127, up: 128..255
  fill(src, 0, gate, wg, t);
  fill(src, 1, up, wg, t);
  const Tile::TileStore st{{out, ld, row0, row_end, col0, n_out}, scale, scale_ld};
  Tile::store_swiglu_quant(gate, up, st, wg, t);
}
extern "C" void run_store_bf16(const float* src, void* out, int64_t ld, int32_t row0, int32_t row_end, int32_t col0,
                               int32_t n_out) {
  shim_launch(tile_bf16, 1u, 256u, size_t(0), src, out, ld, row0, row_end, col0, n_out);
}
extern "C" void run_store_swiglu(const float* src, void* out, float* scale, int64_t scale_ld, int64_t ld,
                                 int32_t row0, int32_t row_end, int32_t col0, int32_t n_out) {
  shim_launch(tile_swiglu, 1u, 256u, size_t(0), src, out, scale, scale_ld, ld, row0, row_end, col0, n_out);
}
"""


def kernel_source() -> str:
    """fp8_quantize_rows_kernel and its constants, as grouped_ffn.cu has them."""
    src = (ROOT / "ffi/src/grouped_ffn.cu").read_text()
    m = re.search(r"\nconstexpr int kPairsInFlight.*?\n__global__ void __launch_bounds__\(256\) "
                  r"fp8_quantize_rows_kernel.*?\n}\n", src, re.S)
    assert m, "grouped_ffn.cu changed: update kernel_source"
    return m.group(0).replace("__launch_bounds__(256) ", "")


def cuda_include_dir() -> pathlib.Path:
    """Where cuda_bf16.h is: $CUDA_HOME, /usr/local/cuda (scripts/build_native.sh's), or beside nvcc."""
    places = [pathlib.Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    places += [pathlib.Path("/usr/local/cuda/include"), pathlib.Path("/usr/local/cuda-13.0/include")]
    if shutil.which("nvcc"):
        places.append(pathlib.Path(shutil.which("nvcc")).resolve().parents[1] / "include")
    for p in places:
        if (p / "cuda_bf16.h").exists():
            return p
    raise FileNotFoundError(f"cuda_bf16.h is in none of {[str(p) for p in places]}")


def build(tmp: pathlib.Path) -> ctypes.CDLL:
    cuda_include = cuda_include_dir()
    (tmp / "shim.h").write_text(_layout_on_host.THREAD_SHIM + INTRINSICS)  # CUDA's headers declare the runtime
    (tmp / "harness.cc").write_text(HARNESS.replace("KERNEL", kernel_source()))
    lib = tmp / "libfp8_host.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-w", f"-I{tmp}", f"-I{ROOT / 'ffi/include'}",
                    f"-I{cuda_include}", f"-I{cuda_include / 'cccl'}", "-isystem", str(cutlass_include()),
                    str(tmp / "harness.cc"), "-o", str(lib), "-lpthread"], check=True)
    out = ctypes.CDLL(str(lib))
    out.run_quantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    out.run_store_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_int32] * 4
    out.run_store_swiglu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int32] * 4
    return out


def cutlass_include() -> pathlib.Path:
    """CuTe's and CUTLASS's headers, from the nvidia-cutlass wheel (as cmake/MokDependencies.cmake finds them)."""
    import cutlass_library
    return pathlib.Path(cutlass_library.__file__).parent / "source" / "include"


# What every output holds before a run (a NaN in bf16 and f32; 0xA5 is a finite e4m3): an unwritten one shows.
BF16_POISON, E4M3_POISON, SCALE_POISON = 0x7FA5, 0xA5, 0x7FC0DEAD


def check_quantiser(lib, x: np.ndarray, blocks: int, what: str) -> None:
    """x: bf16 [rows, k] (as uint16). Runs the kernel on `blocks` blocks and compares with quantize_rows."""
    rows, k = x.shape
    x = np.ascontiguousarray(x, np.uint16)
    q = np.full((rows, k), E4M3_POISON, np.uint8)
    scale = np.full((k // 128, rows), SCALE_POISON, np.uint32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.run_quantize(ptr(x), ptr(q), ptr(scale), rows, k, blocks)
    want_q, want_s = fp8.quantize_rows(jnp.asarray(x.view(jnp.bfloat16)))
    want_q = np.asarray(want_q).view(np.uint8)
    want_s = np.ascontiguousarray(np.asarray(want_s).T).view(np.uint32)
    # A tile with an inf or a NaN is not the reference's bit for bit (the kernels' fmaxf skips a NaN where jnp.max
    # returns it, and a NaN's sign differs): there each non-finite value must give an E4M3 NaN, as it does in the
    # reference, so that the row's GEMM outputs are NaN in both. Every other tile: bit for bit.
    finite = np.isfinite(np.asarray(x.view(jnp.bfloat16), np.float32))
    tile_ok = finite.reshape(rows, k // 128, 128).all(axis=2)  # [rows, k / 128]
    bytes_ok = np.repeat(tile_ok, 128, axis=1)
    bad = np.argwhere((q != want_q) & bytes_ok)
    assert bad.size == 0, f"{what}: {len(bad)} x_q bytes differ, first at {bad[0]}: {q[tuple(bad[0])]:#x} " \
                          f"against {want_q[tuple(bad[0])]:#x}"
    assert ((q[~finite] & 0x7F) == 0x7F).all() and ((want_q[~finite] & 0x7F) == 0x7F).all(), f"{what}: NaN lost"
    bad = np.argwhere((scale != want_s) & tile_ok.T)
    assert bad.size == 0, f"{what}: x_scale differs at {bad[:3].tolist()}"
    assert (scale != SCALE_POISON).all(), f"{what}: a scale was not written"


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16)).view(np.uint16)


def cases(rng: np.random.Generator):
    """(x bits, blocks, what): odd and even tile counts, a grid that strides several times and one with idle warps,
    zero tiles, -0, saturating and tiny values, infinities and NaNs (one value, a lane's 8, a whole tile)."""
    for rows, k, blocks in [(1, 128, 1), (3, 384, 1), (37, 256, 2), (64, 896, 5), (5, 128, 40)]:
        yield bf16_bits(rng.standard_normal((rows, k)) * 3.0), blocks, f"normal {rows} x {k}, {blocks} blocks"
    x = rng.standard_normal((11, 384)) * 1e-3
    x[1, 3] = -0.0
    x[2, :128] = 0.0                     # an all-zero tile: scale 1
    x[4, 128:256] *= 1e6                 # large values in one tile
    x[5, 7] = 1e-38                      # subnormal after the scale
    x[6, 300] = np.inf
    x[7, 5] = -np.inf
    x[8, 130] = np.nan
    x[9, 8:16] = np.nan                  # one lane's 8 values
    x[10, 256:] = np.nan                 # an all-NaN tile
    yield bf16_bits(x), 1, "zeros, -0, large, tiny, inf and NaN"


def check_store_bf16(lib, src: np.ndarray, shape: tuple[int, int], row0: int, row_end: int, col0: int, n_out: int,
                     what: str) -> None:
    """store_bf16_half for both halves of a tile whose accumulators hold src [128, 256], into a poisoned bf16
    out of `shape`: out[row0 + r, col0 + c] = bf16(src[r, c]) where row0 + r < row_end and col0 + c < n_out."""
    out = np.full(shape, BF16_POISON, np.uint16)
    src = np.ascontiguousarray(src, np.float32)
    lib.run_store_bf16(src.ctypes.data, out.ctypes.data, shape[1], row0, row_end, col0, n_out)
    want = np.full(shape, BF16_POISON, np.uint16)
    rows, cols = min(128, row_end - row0), min(256, n_out - col0)
    want[row0:row0 + rows, col0:col0 + cols] = np.asarray(jnp.asarray(src[:rows, :cols], jnp.bfloat16)).view(np.uint16)
    bad = np.argwhere(out != want)
    assert bad.size == 0, f"{what}: {len(bad)} bf16 outputs differ, first at {bad[0].tolist()}: " \
                          f"{out[tuple(bad[0])]:#x} against {want[tuple(bad[0])]:#x}"


def check_store_swiglu(lib, up: np.ndarray, gate: np.ndarray, shape: tuple[int, int], row0: int, row_end: int,
                       col0: int, what: str) -> None:
    """store_swiglu_quant of a tile whose gate and up accumulators hold gate, up [128, 128] (gate 100 or 0, where
    silu(g) is g exactly on every machine), into a poisoned e4m3 out of `shape` and its scales [n_out / 128, rows]:
    row r of the tile is quantize_rows(silu(gate) * up) of its 128 columns, where row0 + r < row_end."""
    rows_all, n_out = shape
    out = np.full(shape, E4M3_POISON, np.uint8)
    scale = np.full((n_out // 128, rows_all), SCALE_POISON, np.uint32)
    src = np.ascontiguousarray(np.concatenate([gate, up], axis=1), np.float32)
    lib.run_store_swiglu(src.ctypes.data, out.ctypes.data, scale.ctypes.data, rows_all, n_out, row0, row_end, col0,
                         n_out)
    rows = min(128, row_end - row0)
    h = (np.where(gate == 100.0, 100.0, 0.0).astype(np.float32) * up)[:rows]  # silu(g) * up: 0 * up keeps its sign
    q, sc = fp8.quantize_rows(jnp.asarray(h))
    want = np.full(shape, E4M3_POISON, np.uint8)
    want[row0:row0 + rows, col0:col0 + 128] = np.asarray(q).view(np.uint8)
    want_s = np.full_like(scale, SCALE_POISON)
    want_s[col0 // 128, row0:row0 + rows] = np.asarray(sc)[:, 0].view(np.uint32)
    bad = np.argwhere(out != want)
    assert bad.size == 0, f"{what}: {len(bad)} e4m3 outputs differ, first at {bad[0].tolist()}: " \
                          f"{out[tuple(bad[0])]:#x} against {want[tuple(bad[0])]:#x}"
    assert np.array_equal(scale, want_s), f"{what}: scales differ at {np.argwhere(scale != want_s)[:3].tolist()}"


def check_epilogues(lib, rng: np.random.Generator) -> int:
    """Both epilogues on whole tiles, on tiles cut by row_end, on a down tile whose second half lies past n_out,
    and at an offset in a larger output."""
    n = 0
    for shape, row0, row_end, col0, n_out, what in [((128, 256), 0, 128, 0, 256, "a whole tile"),
                                                    ((300, 768), 128, 205, 256, 768, "77 rows at an offset"),
                                                    ((128, 384), 0, 128, 256, 384, "the second half past n_out"),
                                                    ((200, 512), 128, 200, 0, 512, "rows past the output")]:
        check_store_bf16(lib, rng.standard_normal((128, 256)) * 4.0, shape, row0, row_end, col0, n_out,
                         f"store_bf16_half, {what}")
        n += 1
    for shape, row0, row_end, col0, what in [((128, 128), 0, 128, 0, "a whole tile"),
                                             ((300, 512), 128, 205, 256, "77 rows at an offset")]:
        up = (rng.standard_normal((128, 128)) * np.exp(rng.uniform(-6.0, 6.0, (128, 1)))).astype(np.float32)
        gate = np.where(rng.random((128, 128)) < 0.1, 0.0, 100.0).astype(np.float32)
        gate[5] = 0.0  # an all-zero h row: scale 1
        check_store_swiglu(lib, up, gate, shape, row0, row_end, col0, f"store_swiglu_quant, {what}")
        n += 1
    return n


def main(seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(pathlib.Path(tmp))
        for x, blocks, what in cases(rng):
            check_quantiser(lib, x, blocks, what)
            n += 1
        print(f"fp8_quantize_rows_kernel on the host: {n} cases, x_q and x_scale bit for bit")
        e = check_epilogues(lib, rng)
        print(f"the FP8 tile's epilogues on the host: {e} cases, every output in its place, bit for bit")
    return n + e


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
