"""The layer's combine (CPU): the megakernel's owners push one row per slot and the origin sums w_j row_j over the
slots in order, so y's bits do not depend on the EP size (the GPU tests check those bits: tests/test_moe_gpu.py,
tests/test_moe_fp8_gpu.py). Here: the one form the layer takes, its numpy oracle, and the workspace bytes it needs.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import fake_workspace

import mok_jax as mj
from mok_jax import memory
from mok_jax.reference.comm import dispatch_combine_identity_numpy, moe_identity_numpy


def test_the_layer_refuses_the_pull_combine(monkeypatch):
    mf = importlib.import_module("mok_jax.ops.moe_forward")
    monkeypatch.setattr(mf, "require_native", lambda what: None)
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: 256)  # the real one asks the native library
    ws = fake_workspace(max_tokens=64, hidden_size=64, top_k=4, num_experts=16)
    T, H, I, L, k = 16, 64, 32, 16, 4
    args = (jax.ShapeDtypeStruct((1, T, H), jnp.bfloat16), jax.ShapeDtypeStruct((1, T, k), jnp.int32),
            jax.ShapeDtypeStruct((1, T, k), jnp.float32), jax.ShapeDtypeStruct((1, L, H, 2 * I), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, L, I, H), jnp.bfloat16))

    def call(kernel):
        return jax.eval_shape(lambda *a: mf.moe_forward(ws, *a, None, None, kernel=kernel), *args)

    with pytest.raises(ValueError, match=r"KernelConfig.combine='pull' is not a form of the layer"):
        call(mj.KernelConfig(combine="pull"))
    y, status = call(mj.KernelConfig(combine="push"))  # the push form traces
    assert y.shape == (1, T, H) and status.shape == (1, 4)


def _routing(rng, tokens, k, E):
    idx = rng.integers(0, E, (tokens, k)).astype(np.int32)
    idx[3, 1] = -1  # a masked slot
    idx[4] = np.arange(k)  # every slot on the first experts
    return idx, rng.uniform(0.1, 1.5, (tokens, k)).astype(np.float32)


def test_the_identity_oracle_is_the_per_owner_oracle_at_ep1_and_not_past_it():
    """The layer's oracle sums the slots in order: at EP 1 that is the per-owner form's one partial (same bits);
    at EP 2 and 4 the per-owner form rounds a partial per owner, which moves some rows by an ulp: the two oracles
    tell the two forms apart, so the GPU tests' bitwise checks can fail."""
    rng = np.random.default_rng(5)
    T, H, k, E = 64, 128, 6, 16
    x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
    idx, w = _routing(rng, T, k, E)
    want = moe_identity_numpy(x, idx, w, E).view(np.uint16)
    per_owner = {ep: dispatch_combine_identity_numpy(x.reshape(ep, T // ep, H), idx.reshape(ep, T // ep, k),
                                                     w.reshape(ep, T // ep, k), E).reshape(T, H).view(np.uint16)
                 for ep in (1, 2, 4)}
    np.testing.assert_array_equal(per_owner[1], want)
    for ep in (2, 4):
        assert (per_owner[ep] != want).any(), f"EP {ep}: the per-owner rounding moved no element"
    # and the oracle itself: an f32 sum in slot order, one rounding per operation, over the valid slots only
    x32 = x.astype(np.float32)
    acc = np.zeros((T, H), np.float32)
    for j in range(k):
        acc = acc + np.where((idx[:, j] >= 0)[:, None], np.float32(1) * w[:, j, None] * x32, np.float32(0))
    np.testing.assert_array_equal(acc.astype(ml_dtypes.bfloat16).view(np.uint16), want)


@pytest.mark.parametrize("ep,rows", [(1, 1), (2, 8), (4, 8), (8, 8), (16, 16), (64, 64)])
def test_the_combine_buffer_holds_a_row_per_slot(ep, rows):
    """combine_rows: [T][k][H] slot rows for the layer at EP > 1 (none at EP 1, which sends nothing), [ep][T][H]
    partials for the standalone combine op: max(ep, k) rows of [T][H] past EP 1; the native layout sizes it so too."""
    T, H, k, L = 2048, 7168, 8, 6
    terms = memory.layer_memory_per_rank(ep=ep, tokens=T, hidden=H, inter=2048, shared_inter=2048, top_k=k,
                                         local_experts=L, kernel=mj.KernelConfig(), keep="balanced")
    assert terms["workspace.combine_rows"] == rows * 2 * T * H
