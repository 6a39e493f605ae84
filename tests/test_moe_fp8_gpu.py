"""GPU tests of the forward megakernel with FP8 routed experts (MoEConfig(precision="fp8")).

Data path, bitwise: every routed slot's expert output must be the standalone FP8 grouped FFN's row for the same
token row (mok_jax.ops.fp8_grouped_ffn: the same quantiser, chains, promotions and epilogues, so the same bits
per row), combined as the bf16 layer combines them (every slot's row weighted and summed in f32 in slot order,
then rounded to bf16: the same at every EP size). That checks the quantisation at the source, the E4M3 rows and
scales through the row buffers and the receive ring, the FP8 tiles and the combine at EP 1, 2, 4 and 8 emulated on
one GPU, dispatch pull and push, without a shared expert (whose f32 output the numpy oracle
cannot reproduce bit for bit).
Math: with the shared expert, y per token against the unquantised f32 layer within the derived E4M3 sigma of
mok_jax.fp8 (as tests/test_fp8_layer.py bounds the FP8 reference itself), and against the FP8 reference.
Determinism: the knobs never change bits. Gradients: the backward is the bf16 layer's (it recomputes from the
bf16 weights), so for the same dy they are the bits of precision="bf16". Errors: H or I not a multiple of 128,
bad ids (NaN rows and InvalidRoutingError); the process survives.
Set MOK_TEST_METRICS=path to append one JSON line of errors per case.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import layer_problem, layer_shape, module_seed, record_metrics, seeded_key

import mok_jax as mj
from mok_jax import fp8, reference
from mok_jax.config import KernelConfig
from mok_jax.emulation import emulated_moe
from mok_jax.ops.grouped_ffn import fp8_grouped_ffn
from mok_jax.workspace import InvalidRoutingError, local_workspace

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# A token's error norm against the unquantised f32 layer, in units of the root of its summed E4M3 variances
# (mok_jax.fp8.ffn_error_sigma combined over its slots): the FP8 reference itself measures 0.31-0.59 of it
# (tests/test_fp8_layer.py); the kernel adds the tensor core's accumulation and bf16 roundings, both far below.
ROW_SIGMA_FACTOR = 1.0
# Plus the bf16 roundings the kernel has and the f32 layer not: each expert row and y
# (2^-9 relative each, 2 in a row's path), and the shared expert's bf16 h: 2^-7 of the row's norm.
ROW_BF16_FLOOR = 2.0**-7
# Against the FP8 reference (same quantised pipeline): bf16 roundings as above, and the E4M3 values of h that the
# tensor core's accumulation order (~2^-12 relative) moves across a rounding boundary (a fraction ~2^-8 of them,
# each by one E4M3 step, within the quantisation error sigma already counts): half a sigma bounds those.
REF_SIGMA_FACTOR = 0.5

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)


def _record(case: str, **metrics):
    record_metrics(case, _SEED, **metrics)


_shape = layer_shape
_problem = functools.partial(layer_problem, _SEED)  # (tag, shape, tokens, routing="uniform", ranks=1)


def _fp8(kernel=None):
    return mj.MoEConfig(implementation="mok", precision="fp8", kernel=kernel)


@functools.partial(jax.jit, static_argnames=("config",))
def _layer(x, idx, w, W, config, W8=None):
    return mj.moe(x, idx, w, W, config=config, fp8_weights=W8)


def _bits(a):
    return np.asarray(a).view(np.uint16)


def _standalone_oracle(x, idx, w, W) -> np.ndarray:
    """y of the FP8 layer without a shared expert, from the standalone FP8 FFN's rows (module docstring): the same
    at every EP size (the per-slot combine)."""
    E = W.gate_up.shape[0]
    idx_np, w_np = np.asarray(idx), np.asarray(w, np.float32)
    tokens, k = idx_np.shape
    flat = idx_np.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    order = np.argsort(np.where(valid, flat, E), kind="stable")[:int(valid.sum())]  # expert-major slots
    sizes = np.bincount(flat[order], minlength=E).astype(np.int32)
    rows = np.zeros((tokens * k, x.shape[1]), np.float32)
    if order.size:
        out = fp8_grouped_ffn(x[jnp.asarray(order // k)], jnp.asarray(sizes), fp8.quantize_expert_weights(W.gate_up,
                                                                                                          W.down))
        assert int(out.status) == 0
        rows[order] = np.asarray(out.y, np.float32)
    rows = rows.reshape(tokens, k, -1)
    used = (idx_np >= 0) & (idx_np < E)
    y = np.zeros((tokens, x.shape[1]), np.float32)
    for j in range(k):  # ascending slots, f32: one rounding per operation
        y = np.where(used[:, j, None], y + w_np[:, j, None] * rows[:, j], y)
    return y.astype(ml_dtypes.bfloat16)


def _assert_bitwise(case: str, y, want):
    got = np.asarray(y).view(np.uint16)
    diff = np.where((got != want.view(np.uint16)).any(1))[0]
    _record(case, rows=int(got.shape[0]), rows_differing=int(diff.size))
    assert diff.size == 0, f"{case}: {diff.size} rows differ from the standalone FFN's, first {diff[:8].tolist()}"


# ----------------------------------------------------------------------------- the data path, bitwise


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_emulated_fp8_layer_is_the_standalone_ffn_bitwise(ep, dispatch):
    shape = _shape(16, 384, 256, 4, Is=0)  # H an odd multiple of 128: the down tiles' N tail
    x, idx, w, W = _problem(f"bits{ep}", shape, 300, "zipf", ranks=ep)
    idx = idx.at[5, 3].set(-1)  # a masked slot
    cfg = KernelConfig(granularity=512, dispatch=dispatch, comm_items_fwd=3)
    y, status = emulated_moe(x, idx, w, W, ep=ep, kernel=cfg, precision="fp8")
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    _assert_bitwise(f"fp8_bits_ep{ep}_{dispatch}", y, _standalone_oracle(x, idx, w, W))


@pytest.mark.parametrize("case", ["one_token_k10", "k10", "one_expert", "empty_experts_masked", "ring"])
def test_awkward_cases_bitwise(case):
    tokens, k, routing, kernel = {"one_token_k10": (1, 10, "uniform", None), "k10": (77, 10, "uniform", None),
                                  "one_expert": (300, 2, "one-expert", None),
                                  "empty_experts_masked": (260, 3, "uniform", None),
                                  "ring": (2500, 2, "uniform", KernelConfig(granularity=512, ring_slots=2))}[case]
    shape = _shape(16, 256, 128, k, Is=0)
    x, idx, w, W = _problem(case, shape, tokens, routing)
    if case == "empty_experts_masked":  # experts 8..15 get nothing, a third of the slots masked, no repeats
        ids = np.asarray(idx) % 8
        ids[np.random.default_rng(zlib.crc32(f"{_SEED}m".encode())).random(ids.shape) < 0.3] = -1
        for row in ids:
            seen = set()
            for j, e in enumerate(row):
                row[j] = -1 if e in seen else e
                seen.add(e)
        idx = jnp.asarray(ids, jnp.int32)
    _assert_bitwise(f"fp8_{case}", _layer(x, idx, w, W, config=_fp8(kernel)), _standalone_oracle(x, idx, w, W))


def test_knobs_never_change_bits_and_given_weights_are_the_quantised_ones():
    shape = _shape(8, 512, 256, 4)
    x, idx, w, W = _problem("knobs", shape, 2048, "zipf")
    configs = [KernelConfig(granularity=g, comm_items_fwd=c, ring_slots=s)
               for g, c, s in [(2048, 24, 2), (512, 1, 1), (512, 8, 3), (1024, 16, 2)]]
    ys = [_layer(x, idx, w, W, config=_fp8(c)) for c in configs]
    for c, y in zip(configs[1:], ys[1:]):
        np.testing.assert_array_equal(_bits(y), _bits(ys[0]), f"{c} changed bits")
    w8 = jax.jit(fp8.quantize_expert_weights)(W.gate_up, W.down)
    np.testing.assert_array_equal(_bits(_layer(x, idx, w, W, config=_fp8(configs[0]), W8=w8)), _bits(ys[0]))
    eps = [emulated_moe(x, idx, w, W, ep=2, precision="fp8",
                        kernel=KernelConfig(granularity=g, dispatch=d, comm_items_fwd=n))[0]
           for g, d, n in [(512, "pull", 8), (1024, "push", 3), (2048, "push", 30)]]
    for y in eps:
        np.testing.assert_array_equal(_bits(y), _bits(ys[0]), "emulated EP 2: a knob or the EP size changed bits")


# ----------------------------------------------------------------------------- math


def _check_math(case: str, y, x, idx, w, W):
    w8 = jax.jit(fp8.quantize_expert_weights)(W.gate_up, W.down)
    ref = fp8.moe_reference(x, idx, w, W, w8)
    with jax.default_matmul_precision("highest"):
        f32 = jax.tree.map(lambda a: a.astype(jnp.float32), W)
        exact = np.asarray(jax.jit(reference.moe)(x.astype(jnp.float32), idx, w, f32), np.float32)
    got = np.asarray(y, np.float32)
    assert np.isfinite(got).all(), f"{case}: NaN/Inf in rows {np.where(~np.isfinite(got).all(1))[0][:8].tolist()}"
    sigma = np.linalg.norm(np.asarray(ref.sigma), axis=1)
    scale = np.linalg.norm(exact, axis=1)
    err = np.linalg.norm(got - exact, axis=1)
    err_ref = np.linalg.norm(got - np.asarray(ref.routed + ref.shared), axis=1)
    bound = ROW_SIGMA_FACTOR * sigma + ROW_BF16_FLOOR * scale
    bound_ref = REF_SIGMA_FACTOR * sigma + ROW_BF16_FLOOR * scale
    _record(case, tokens=int(got.shape[0]), worst_err_over_bound=float((err / bound).max()),
            worst_ref_err_over_bound=float((err_ref / bound_ref).max()), median_err_over_sigma=float(
                np.median(err / np.maximum(sigma, 1e-30))))
    bad = np.where(err > bound)[0]
    assert bad.size == 0, (f"{case}: {bad.size} tokens over the E4M3 bound, e.g. {bad[:6].tolist()}: err "
                           f"{err[bad[:6]].tolist()} > {bound[bad[:6]].tolist()}")
    bad = np.where(err_ref > bound_ref)[0]
    assert bad.size == 0, (f"{case}: {bad.size} tokens too far from the FP8 reference, e.g. {bad[:6].tolist()}: "
                           f"{err_ref[bad[:6]].tolist()} > {bound_ref[bad[:6]].tolist()}")


@pytest.mark.parametrize("model", ["kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro"])
def test_bench_model_shapes_within_the_e4m3_bound(model):
    m = mj.load_model(model)
    shape = m.replace(num_experts=m.num_experts // 32)  # the one-GPU benchmark problem, fewer tokens
    args = _problem(model, shape, 256)
    _check_math(f"fp8_model:{model}", _layer(*args, config=_fp8()), *args)


@pytest.mark.parametrize("ep", [2, 4])
def test_emulated_math_with_the_shared_expert(ep):
    shape = _shape(16, 512, 256, 4)
    args = _problem(f"emumath{ep}", shape, 600, "uniform", ranks=ep)
    y, status = emulated_moe(*args, ep=ep, kernel=KernelConfig(granularity=512, comm_items_fwd=4), precision="fp8")
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    _check_math(f"fp8_emulated_ep{ep}", y, *args)


# ----------------------------------------------------------------------------- gradients, modules, errors


def test_gradients_are_the_bf16_layers():
    shape = _shape(8, 256, 128, 2)
    x, idx, w, W = _problem("grad", shape, 192)
    c = jax.random.normal(seeded_key(_SEED, "dy"), x.shape, jnp.float32).astype(jnp.bfloat16)

    def grads(config):
        loss = lambda x, w, W: jnp.sum(mj.moe(x, idx, w, W, config=config).astype(jnp.float32) * c)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, W)

    # FP8 keeps no g | u (its forward's are E4M3 products): the bf16 layer that recomputes them, as FP8's backward
    # does, gives the same bits (keeping the shared expert's g | u rounds them in the kernel's order, not XLA's).
    got, want = grads(_fp8()), grads(mj.MoEConfig(implementation="mok", keep="nothing"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_flax_module_fp8():
    from flax import nnx

    from mok_jax.flax import MoELayer

    shape = _shape(8, 256, 128, 2)
    x = jax.random.normal(seeded_key(_SEED, "flax"), (2, 64, 256), jnp.float32)
    layer = MoELayer(shape, implementation="mok", precision="fp8", dtype=jnp.bfloat16, max_tokens=128,
                     rngs=nnx.Rngs(0))
    tokens = x.reshape(-1, 256).astype(jnp.bfloat16)
    # the routing the module used, from the same program: routed again outside it, a router weight can differ in its
    # last bit (XLA fuses the router's f32 math differently), and so can a y element that it scales
    y, (idx, w) = nnx.jit(lambda m, x: (m(x), m.route(x.reshape(-1, 256).astype(jnp.bfloat16))[:2]))(layer, x)
    W = jax.tree.map(lambda a: a.astype(jnp.bfloat16), layer.weights())
    np.testing.assert_array_equal(_bits(y.reshape(-1, 256)), _bits(_layer(tokens, idx, w, W, config=_fp8())))
    _check_math("fp8_flax", y.reshape(-1, 256), tokens, idx, w, W)


def test_bad_ids_give_nan_rows_and_a_named_error():
    shape = _shape(8, 256, 128, 2)
    x, idx, w, W = _problem("badid", shape, 64)
    bad = idx.at[3, 1].set(8).at[9, 0].set(-7)
    y = np.asarray(_layer(x, bad, w, W, config=_fp8()), np.float32)
    assert np.isnan(y[[3, 9]]).all() and np.isfinite(np.delete(y, [3, 9], axis=0)).all()
    ws = local_workspace(max_tokens=64, hidden_size=256, top_k=2, num_experts=8)
    with pytest.raises(InvalidRoutingError, match="outside"):
        ws.check()
    ok = idx.at[3].set(-1).at[9].set(-1)
    _assert_bitwise("fp8_after_bad_ids", _layer(x, ok, w, W._replace(shared_gate_up=None, shared_down=None),
                                                 config=_fp8()),
                    _standalone_oracle(x, ok, w, W))


def test_sizes_that_are_not_whole_scale_blocks_raise():
    shape = _shape(8, 264, 128, 2)
    x, idx, w, W = _problem("tails", shape, 32)
    with pytest.raises(ValueError, match="multiples of 128"):
        _layer(x, idx, w, W, config=_fp8())
