"""The FP8 layer forward's Python surface on the CPU (MoEConfig(precision="fp8"), moe(..., fp8_weights=),
ops.moe_forward(fp8_weights=), the emulation's precision): what is refused and how it says so, what the op
lowers to, and the scratch it sizes. Its kernel runs in tests/test_moe_fp8_gpu.py."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest
from helpers import fake_workspace

import mok_jax as mj
from mok_jax import fp8
from mok_jax.emulation import emulated_moe
from mok_jax.weights import MoEWeights

T, E, H, I, K = 16, 8, 256, 128, 2


def _args(H=H, I=I):
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (T, H)).astype(jnp.bfloat16)
    W = MoEWeights((jax.random.normal(ks[1], (E, H, 2 * I)) * 0.05).astype(jnp.bfloat16),
                   (jax.random.normal(ks[2], (E, I, H)) * 0.05).astype(jnp.bfloat16))
    idx = jnp.stack([jnp.arange(T) % E, (jnp.arange(T) + 3) % E], axis=1).astype(jnp.int32)
    return x, idx, jnp.full((T, K), 0.5, jnp.float32), W


def test_config_precision_rules():
    assert mj.MoEConfig(implementation="mok", precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match="precision must be one of 'bf16', 'fp8'"):
        mj.MoEConfig(implementation="mok", precision="e4m3")
    with pytest.raises(ValueError, match="runs on implementation='mok'"):
        mj.MoEConfig(precision="fp8")
    for keep in ("ring", "everything"):
        with pytest.raises(ValueError, match="needs keep='nothing'"):
            mj.MoEConfig(implementation="mok", precision="fp8", keep=keep)


def test_moe_refuses_fp8_weights_it_cannot_use():
    x, idx, w, W = _args()
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    with pytest.raises(ValueError, match="fp8_weights is given but MoEConfig.precision is 'bf16'"):
        mj.moe(x, idx, w, W, config=mj.MoEConfig(), fp8_weights=w8)
    cfg = mj.MoEConfig(implementation="mok", precision="fp8")
    with pytest.raises(TypeError, match="fp8_weights must be a mok_jax.fp8.Fp8ExpertWeights"):
        mj.moe(x, idx, w, W, config=cfg, fp8_weights=(w8.gate_up, w8.down))
    with pytest.raises(ValueError, match=r"fp8_weights.gate_up must be \[E, 2I, H\]"):
        mj.moe(x, idx, w, W, config=cfg, fp8_weights=w8._replace(gate_up=w8.gate_up[1:]))
    with pytest.raises(TypeError, match="fp8_weights.down must be float8_e4m3fn"):
        mj.moe(x, idx, w, W, config=cfg, fp8_weights=w8._replace(down=w8.down.astype(jnp.bfloat16)))
    other = fp8.quantize_expert_weights(*_args(I=256)[3][:2])  # another layer's
    with pytest.raises(ValueError, match="fp8_weights has intermediate size 256, weights 128"):
        mj.moe(x, idx, w, W, config=cfg, fp8_weights=other)


def test_moe_needs_whole_scale_blocks():
    x, idx, w, W = _args(H=264)
    with pytest.raises(ValueError, match="H and I multiples of 128"):
        mj.moe(x, idx, w, W, config=mj.MoEConfig(implementation="mok", precision="fp8"))


def _fake_workspace():
    return fake_workspace(max_tokens=T, hidden_size=H, top_k=K, num_experts=E)


def _op_args():
    x, idx, w, W = _args()
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    return (x[None], idx[None], w[None], W.gate_up[None], W.down[None]), jax.tree.map(lambda a: a[None], w8)


def test_fp8_forward_lowers_to_its_own_target(monkeypatch):
    mf = importlib.import_module("mok_jax.ops.moe_forward")

    monkeypatch.setattr(mf, "require_native", lambda what: None)
    sizes = []
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: sizes.append(kw["fp8"]) or 4096)
    args, w8 = _op_args()
    text = jax.jit(lambda a, w8: mf.moe_forward(_fake_workspace(), *a, None, None, fp8_weights=w8)).lower(
        args, w8).as_text()
    [call] = [line for line in text.splitlines() if "custom_call @mok_moe_forward_fp8(" in line]
    assert "mok_moe_forward(" not in text and sizes == [True]
    # x, ids, weights, E4M3 gate_up [R, L, 2I, H] and its scales, E4M3 down [R, L, H, I] and its scales, the (empty)
    # shared expert
    for t in (f"tensor<1x{T}x{H}xbf16>", f"tensor<1x{E}x{2 * I}x{H}xf8E4M3FN>", f"tensor<1x{E}x{2 * I // 128}x"
              f"{H // 128}xf32>", f"tensor<1x{E}x{H}x{I}xf8E4M3FN>", f"tensor<1x{E}x{H // 128}x{I // 128}xf32>"):
        assert t in call, t


def test_ops_fp8_argument_errors(monkeypatch):
    mf = importlib.import_module("mok_jax.ops.moe_forward")

    monkeypatch.setattr(mf, "require_native", lambda what: None)
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: 4096)
    args, w8 = _op_args()
    ws = _fake_workspace()
    with pytest.raises(ValueError, match="cannot be combined with keep_pos, keep_shared or identity_experts"):
        mf.moe_forward(ws, *args, None, None, fp8_weights=w8, identity_experts=True)
    with pytest.raises(ValueError, match="cannot be combined with keep_pos"):
        mf.moe_forward(ws, *args, None, None, fp8_weights=w8, keep_pos=jnp.zeros((1, T * K), jnp.int32), keep_rows=8)
    shared = (jnp.zeros((H, 256), jnp.bfloat16), jnp.zeros((128, H), jnp.bfloat16))
    with pytest.raises(ValueError, match="cannot be combined with keep_pos, keep_shared"):
        mf.moe_forward(ws, *args, *shared, fp8_weights=w8, keep_shared=True)
    with pytest.raises(ValueError, match="keep_shared needs a shared expert"):
        mf.moe_forward(ws, *args, None, None, keep_shared=True)
    with pytest.raises(TypeError, match="keep_shared must be a bool, got int"):
        mf.moe_forward(ws, *args, *shared, keep_shared=1)
    with pytest.raises(ValueError, match="timing_mode 192 asks for both orders of the shared expert's down tiles"):
        mf.moe_forward(ws, *args, *shared, timing_mode=64 + 128)
    for lab in (dict(timing_mode=8), dict(skip_rank=0)):  # compiled into the bf16 lab form of the kernel only
        with pytest.raises(ValueError, match=f"{next(iter(lab))} with fp8_weights: .* bf16 lab form only"):
            mf.moe_forward(ws, *args, None, None, fp8_weights=w8, **lab)
    with pytest.raises(ValueError, match=r"fp8_weights.gate_up must be \[1, 8, ...\]"):
        mf.moe_forward(ws, *args, None, None, fp8_weights=jax.tree.map(lambda a: a[0], w8))
    with pytest.raises(TypeError, match="fp8_weights must be a mok_jax.fp8.Fp8ExpertWeights"):
        mf.moe_forward(ws, *args, None, None, fp8_weights=tuple(w8))


def test_scratch_of_the_fp8_ring():
    from mok_jax import _native
    from mok_jax.ops.moe_forward import scratch_bytes

    if _native.library() is None:
        pytest.skip("the native library is not built here (the FP8 scratch is sized by it)")
    kw = dict(tokens=2048, hidden=7168, inter=2048, shared_inter=2048, top_k=8, local_experts=12, ep=1,
              kernel=mj.KernelConfig())
    bf16, f8 = scratch_bytes(**kw), scratch_bytes(**kw, fp8=True)
    rows = 2048 * 8  # one ring slot (the 2048 tokens make one microbatch)
    # h holds E4M3 (I bytes a row, not 2I) and two scale columns are added: (H + I) / 128 floats a row, plus slack
    assert bf16 - f8 == pytest.approx(rows * 2048 - rows * (7168 + 2048) // 128 * 4, abs=4096)
    with pytest.raises(ValueError, match="multiple of 128"):
        scratch_bytes(**{**kw, "hidden": 7000}, fp8=True)


def test_emulation_precision_arguments():
    x, idx, w, W = _args()
    with pytest.raises(ValueError, match="precision must be 'bf16' or 'fp8'"):
        emulated_moe(x, idx, w, W, ep=2, precision="fp16")
    w8 = fp8.quantize_expert_weights(W.gate_up, W.down)
    with pytest.raises(ValueError, match="fp8_weights is given but precision is 'bf16'"):
        emulated_moe(x, idx, w, W, ep=2, fp8_weights=w8)
