"""The FP8 grouped FFN's row quantiser (ffi/src/grouped_ffn.cu's fp8_quantize_rows_kernel, with
mok/gemm/fp8_quant.cuh) run on the CPU, every CUDA thread a host thread, against mok_jax.fp8.quantize_rows: x_q and
x_scale bit for bit, every output poisoned first (in a tile with an inf or a NaN: an E4M3 NaN for each such value,
see check()).

A check of the kernel's logic where no GPU is lent, not of the GPU: the kernel's source is compiled by g++ (C++20)
with CUDA's own host forms of the bf16 and E4M3 conversions and layout_on_host.py's shim of threads, blocks and warps,
plus __shfl_xor_sync through a warp's shared slots. tests/test_fp8_grouped_ffn_gpu.py is the test on the GPU. Run
from the repository root:

    python scripts/lab/fp8_quantize_on_host.py [seed]

(tests/test_fp8_quantize_on_host.py runs it on a few shapes.)
"""

from __future__ import annotations

import ctypes
import importlib.util
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

SHFL_XOR = r"""
inline float __shfl_xor_sync(uint32_t, float x, int mask) {
  ShimWarp& w = shim_warp();
  const int lane = threadIdx.x % 32;
  std::memcpy(&w.vals[lane], &x, 4);
  w.bar->arrive_and_wait();
  float r;
  std::memcpy(&r, &w.vals[lane ^ mask], 4);
  w.bar->arrive_and_wait();
  return r;
}
"""

HARNESS = r"""
#include <math.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#include "shim.h"
#include "mok/gemm/fp8_quant.cuh"
namespace mok {
KERNEL
}  // namespace mok
extern "C" void run_quantize(const void* x, uint8_t* q, float* scale, int64_t rows, int64_t k, int32_t blocks) {
  shim_launch(mok::fp8_quantize_rows_kernel, unsigned(blocks), 256u, size_t(0),
              static_cast<const __nv_bfloat16*>(x), q, scale, rows, k);
}
"""


def kernel_source() -> str:
    """fp8_quantize_rows_kernel and its constants, as grouped_ffn.cu has them."""
    src = (ROOT / "ffi/src/grouped_ffn.cu").read_text()
    m = re.search(r"\nconstexpr int kPairsInFlight.*?\n__global__ void __launch_bounds__\(256\) fp8_quantize_rows_kernel"
                  r".*?\n}\n", src, re.S)
    assert m, "grouped_ffn.cu changed: update kernel_source"
    return m.group(0).replace("__launch_bounds__(256) ", "")


def cuda_include_dir() -> pathlib.Path:
    """Where cuda_bf16.h is: $CUDA_HOME, /usr/local/cuda (scripts/build_native.sh's), or beside nvcc."""
    import os
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
    # CUDA's headers (for the conversions) declare the runtime's types, which the shim would declare again
    shim = "\n".join(line for line in _layout_on_host.SHIM.splitlines()
                      if not re.search(r"cudaError_t|cudaStream_t|cudaSuccess|MOK_CUDA_RETURN_IF_ERROR", line))
    (tmp / "shim.h").write_text(shim + SHFL_XOR)
    (tmp / "harness.cc").write_text(HARNESS.replace("KERNEL", kernel_source()))
    lib = tmp / "libfp8_quantize_host.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-Wall", "-Wno-unknown-pragmas",
                    f"-I{tmp}", f"-I{ROOT / 'ffi/include'}", f"-I{cuda_include}", str(tmp / "harness.cc"), "-o",
                    str(lib), "-lpthread"], check=True)
    out = ctypes.CDLL(str(lib))
    out.run_quantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    return out


def check(lib, x: np.ndarray, blocks: int, what: str) -> None:
    """x: bf16 [rows, k] (as uint16). Runs the kernel on `blocks` blocks and compares with quantize_rows."""
    rows, k = x.shape
    x = np.ascontiguousarray(x, np.uint16)
    q = np.full((rows, k), 0xA5, np.uint8)                      # poison: an unwritten byte shows
    scale = np.full((k // 128, rows), np.nan, np.float32).view(np.uint32)
    scale[...] = 0x7FC0DEAD
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
    assert (scale != 0x7FC0DEAD).all(), f"{what}: a scale was not written"


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


def main(seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(pathlib.Path(tmp))
        for x, blocks, what in cases(rng):
            check(lib, x, blocks, what)
            n += 1
    print(f"fp8_quantize_rows_kernel on the host: {n} cases, x_q and x_scale bit for bit")
    return n


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
