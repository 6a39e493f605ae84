"""The native library: it loads (or says once why not), and its ops refuse bad arguments and a machine without a GPU
before they need one. Its routing ops (counts, the padded layout) on the GPU: tests/test_native_gpu.py."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import _native
from mok_jax.ops import expert_counts, expert_layout

rt = importlib.import_module("mok_jax.ops.routing")


def test_native_status_is_one_clear_line():
    status = _native.native_status()
    assert "\n" not in status
    assert status.startswith("loaded from") or "not available" in status


def test_ops_reject_bad_arguments_before_needing_a_gpu():
    with pytest.raises(ValueError, match="topk_idx must be rank 2"):
        expert_counts(jnp.zeros((4,), jnp.int32), 8)
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        expert_counts(jnp.zeros((4, 2), jnp.float32), 8)
    with pytest.raises(ValueError, match=r"num_experts must be an int in \[1, 12288\], got 0"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 0)
    with pytest.raises(ValueError, match=r"num_experts must be an int in \[1, 12288\], got 12289"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 12 * 1024 + 1)
    with pytest.raises(ValueError, match=r"num_experts must be an int in \[1, 12288\], got True"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), True)


@pytest.mark.parametrize("args,exc,match", [
    (((4,), jnp.int32, 8, 128), ValueError, "topk_idx must be rank 2"),
    (((4, 2), jnp.int16, 8, 128), TypeError, "topk_idx must be int32"),
    (((4, 2), jnp.int32, 0, 128), ValueError, "num_experts must be an int in"),
    (((4, 2), jnp.int32, rt.MAX_LAYOUT_EXPERTS + 1, 128), ValueError, "num_experts must be an int in"),
    (((4, 2), jnp.int32, 8, 0), ValueError, "block must be a positive int"),
    (((4, 2), jnp.int32, 8, True), ValueError, "block must be a positive int"),
    (((2**21, 2**10), jnp.int32, 8, 128), ValueError, "must be below 2"),
])
def test_expert_layout_rejects_bad_arguments_naming_them(args, exc, match):
    shape, dtype, experts, block = args
    with pytest.raises(exc, match=match):
        expert_layout(jax.ShapeDtypeStruct(shape, dtype), experts, block)


def test_ops_without_gpu_raise_not_fall_back():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: the op runs (tests/test_native_gpu.py)")
    with pytest.raises(_native.NativeLibraryUnavailable, match="expert_counts"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 8)
    with pytest.raises(_native.NativeLibraryUnavailable, match="expert_layout"):
        expert_layout(jnp.zeros((4, 2), jnp.int32), 8)


@pytest.mark.parametrize("slots,experts", [(0, 4), (1, 1), (100, 3), (1025, 1), (65536, 16), (2**20, 6),
                                           (2**20, 384), (2**25, 1), (2**25, 12 * 1024)])
def test_layout_chunks_bound_the_scan_and_cover_the_slots(slots, experts):
    """The layout kernels' chunk (ops.routing.layout_chunk): a whole number of warp steps, no more chunks than
    chunks of LAYOUT_MIN_CHUNK slots would make, and a chunk table (chunks x experts, SCAN's CTA's work) of at most
    LAYOUT_MAX_CELLS words."""
    chunk = rt.layout_chunk(slots, experts)
    chunks = -(-slots // chunk)
    assert chunk % 32 == 0 and chunk * chunks >= slots and chunk < 2**31
    assert chunks <= -(-slots // rt.LAYOUT_MIN_CHUNK)
    assert chunks * experts <= max(experts, rt.LAYOUT_MAX_CELLS)


def test_expert_layout_lowers_to_one_call_with_its_scratch(monkeypatch):
    """The op's one custom call: topk_idx and first_expert in; pos, src_token, src_slot [M], group_sizes and the
    scratch (the chunk table and a word per expert) out, block and chunk as attributes (lowered on CPU: the call's
    types only)."""
    monkeypatch.setattr(rt, "require_native", lambda what: None)
    T, k, E, block = 3000, 6, 40, 64
    M, chunk = T * k + block * E, rt.layout_chunk(T * k, 40)
    f = jax.jit(lambda i, r: tuple(expert_layout(i, E, block, first_expert=r * E)))
    text = f.lower(jax.ShapeDtypeStruct((T, k), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)).as_text()
    [call] = [line for line in text.splitlines() if "custom_call @mok_expert_layout(" in line]
    words = -(-T * k // chunk) * E + E
    assert f"(tensor<{T}x{k}xi32>, tensor<i32>) -> (tensor<{T}x{k}xi32>, tensor<{M}xi32>, tensor<{M}xi32>, " \
           f"tensor<{E}xi32>, tensor<{words}xi32>)" in call, call
    assert f"block = {block} : i32" in call and f"chunk = {chunk} : i32" in call, call
    sds = jax.eval_shape(lambda i: expert_layout(i, E, block), jax.ShapeDtypeStruct((T, k), jnp.int32))
    assert [(a.shape, a.dtype) for a in sds] == [((T, k), np.int32), ((M,), np.int32), ((M,), np.int32),
                                                 ((E,), np.int32)]


def test_missing_library_is_reported_once_and_xla_still_works(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import warnings, jax.numpy as jnp, mok_jax, mok_jax.ops\n"
        "from mok_jax import _native\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    assert not _native.loaded()\n"
        "    print('QUIET', len(caught))\n"
        "    for _ in range(3): assert _native.library() is None\n"
        "    try:\n"
        "        mok_jax.ops.expert_counts(jnp.zeros((2, 1), jnp.int32), 4)\n"
        "    except _native.NativeLibraryUnavailable as e: print('RAISED', e)\n"
        "print('WARNINGS', sum('not available' in str(w.message) for w in caught))\n"
        "x = jnp.ones((2, 4)); W = mok_jax.MoEWeights(jnp.ones((2, 4, 4)), jnp.ones((2, 2, 4)))\n"
        "print('XLA', mok_jax.moe(x, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1)), W).shape)\n"
    )
    env = dict(os.environ, MOK_JAX_LIB=str(tmp_path / "absent.so"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "QUIET 0" in out.stdout  # loaded() (mok_jax.layer.op_layout's question) says nothing
    assert "WARNINGS 1" in out.stdout
    assert "RAISED" in out.stdout and "absent.so (missing)" in out.stdout
    assert "XLA (2, 4)" in out.stdout


@pytest.mark.skipif(_native.library() is None, reason="the check is the native library's")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_raw_grouped_ffn_refuses_misaligned_pointers(precision):
    """MokGroupedFfnRaw and MokFp8GroupedFfnRaw return -1 (unsupported, before any CUDA call) for a buffer that
    TMA or a 16-byte access would fault on, and go on to the launch (without a GPU, a CUDA error; on a GPU that call
    is not made) when every pointer is aligned. The pointers are never dereferenced on the host."""
    import ctypes

    lib = _native.library()
    a16, a4 = 0x10000, 0x20004  # 16-byte and 4-byte (not 16) aligned addresses
    names = ["x", "group_sizes", "gate_up", "down", "y", "h", "status"]
    if precision == "fp8":
        fn = lib.MokFp8GroupedFfnRaw
        names = ["x", "group_sizes", "gate_up", "gate_up_scale", "down", "down_scale", "y", "h", "h_scale", "x_q",
                 "x_scale", "status"]
    else:
        fn = lib.MokGroupedFfnRaw
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * len(names) + [ctypes.c_int64] * 4 + [ctypes.c_int32, ctypes.c_void_p]
    word = {"group_sizes", "status", "gate_up_scale", "down_scale", "h_scale", "x_scale"}  # 4-byte words
    good = {n: (a4 if n in word else a16) for n in names}

    def call(ptrs):
        return fn(*[ptrs[n] for n in names], 256, 256, 256, 4, 0, None)  # M, H, I, E, num_sms, stream

    for name in names:
        bad = dict(good, **{name: good[name] + (2 if name in word else 8)})
        assert call(bad) == -1, f"{precision}: a misaligned {name} was not refused"
    if not any(d.platform == "gpu" for d in jax.devices()):  # on a GPU it would launch on these fake pointers
        assert call(good) != -1, f"{precision}: aligned pointers were refused"


@pytest.mark.skipif(_native.library() is None, reason="the check is the native library's")
def test_row_gather_offsets_are_cutes_layouts():
    """The row-gathering loader (mok/gemm/sm90_row_gather.cuh) writes each 16-byte chunk where a TMA box with the
    128-byte swizzle puts it: its hand-written offsets against CuTe's layouts of the same stages, every place."""
    import ctypes

    fn = _native.library().mok_row_gather_offset_mismatches
    fn.restype, fn.argtypes = ctypes.c_int64, []
    assert fn() == 0
