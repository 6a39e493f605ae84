"""The native library: it loads (or says once why not), and its ops refuse bad arguments and a machine without a GPU
before they need one. Its routing-count op on the GPU: tests/test_native_gpu.py."""

import jax
import jax.numpy as jnp
import pytest

from mok_jax import _native
from mok_jax.ops import expert_counts


def test_native_status_is_one_clear_line():
    status = _native.native_status()
    assert "\n" not in status
    assert status.startswith("loaded from") or "not available" in status


def test_ops_reject_bad_arguments_before_needing_a_gpu():
    with pytest.raises(ValueError, match="topk_idx must be rank 2"):
        expert_counts(jnp.zeros((4,), jnp.int32), 8)
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        expert_counts(jnp.zeros((4, 2), jnp.float32), 8)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 0)


def test_ops_without_gpu_raise_not_fall_back():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: the op runs (tests/test_native_gpu.py)")
    with pytest.raises(_native.NativeLibraryUnavailable, match="expert_counts"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 8)


def test_missing_library_is_reported_once_and_xla_still_works(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import warnings, jax.numpy as jnp, mok_jax, mok_jax.ops\n"
        "from mok_jax import _native\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
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
    assert "WARNINGS 1" in out.stdout
    assert "RAISED" in out.stdout and "absent.so (missing)" in out.stdout
    assert "XLA (2, 4)" in out.stdout


@pytest.mark.skipif(_native.library() is None, reason="the check is the native library's")
def test_row_gather_offsets_are_cutes_layouts():
    """The row-gathering loader (mok/gemm/sm90_row_gather.cuh) writes each 16-byte chunk where a TMA box with the
    128-byte swizzle puts it: its hand-written offsets against CuTe's layouts of the same stages, every place."""
    import ctypes

    fn = _native.library().mok_row_gather_offset_mismatches
    fn.restype, fn.argtypes = ctypes.c_int64, []
    assert fn() == 0
