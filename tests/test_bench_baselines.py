"""The mok-bench baselines compute the MoE layer: each equals the single-device reference (8 CPU devices), and
each asks XLA for bf16 GEMM outputs, forward and backward (their strongest form: no f32 cotangents).

``ragged`` runs with its all_gather stand-in for ragged_all_to_all at EP > 1 (XLA:CPU has no ragged-all-to-all),
which checks its offset bookkeeping and its ragged_dot experts; the real collective runs on GPU only. At EP 1 it
needs no collective. ``ragged-padded`` is ``ragged`` with tokamax's layout (each expert's rows padded to
TOKAMAX_ROW_ALIGN), so that layout is tested where tokamax is not installed; ``tokamax`` itself runs on its XLA
path here (its Mosaic GPU kernel needs an NVIDIA GPU), and is skipped, with the reason, where it is not installed.
"""

import functools
import importlib.util
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax as mj
from helpers import TOL_BF16_REORDER, TOL_F32_REORDER, random_problem, rel_err
from mok_jax.bench import baselines
from mok_jax.bench.accounting import capacity

# A capacity factor at which no (source rank, expert) slot can overflow: capacity >= T (E/k * T*k/E).
NO_DROP_FACTOR = 64.0
# The bf16 backward rounds each cotangent to bf16 once per GEMM it leaves (dy's expert rows, dh, dg | du, dx): a
# few roundings of 2^-9, measured at 1-2 bf16 ulps of the gradients' norm, inside the forward's 4-ulp tolerance.
TOL_BF16_GRADIENT = TOL_BF16_REORDER

HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
NEEDS_TOKAMAX = pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (pip install .[tokamax], "
                                   "Python >= 3.12): not a pass")

BUILDERS = {
    "xla": baselines.xla_dropless,
    "xla-capacity": functools.partial(baselines.xla_capacity, capacity_factor=NO_DROP_FACTOR),
    "ragged": functools.partial(baselines.ragged, emulate_collective=True),
    "ragged-padded": functools.partial(baselines.ragged, row_align=baselines.TOKAMAX_ROW_ALIGN,
                                       emulate_collective=True),
    "tokamax": functools.partial(baselines.tokamax, implementation="xla", emulate_collective=True),
    "reference": baselines.reference,
}


def _impl(name):
    """A BUILDERS name as a pytest parameter: tokamax's skipped, with the reason, where it is not installed."""
    return pytest.param(name, marks=NEEDS_TOKAMAX) if name == "tokamax" else name


def _mesh(ep):
    return jax.make_mesh((ep,), ("ep",), devices=jax.devices("cpu")[:ep])


_reference = jax.jit(mj.reference.moe)


@functools.cache
def _grad_problem():
    """A problem, dy and the reference's gradients (computed once for every implementation)."""
    x, idx, w, W = random_problem(mj.load_model("ci"), 32, seed=40)
    dy = jax.random.normal(jax.random.key(41), x.shape)
    want = jax.jit(jax.grad(lambda x, w, W: jnp.sum(mj.reference.moe(x, idx, w, W) * dy), argnums=(0, 1, 2)))(x, w, W)
    return (x, idx, w, W), dy, want


def _one_expert_idx(tokens, k):
    return jnp.tile(jnp.arange(k, dtype=jnp.int32)[None], (tokens, 1))


@pytest.mark.parametrize("impl,ep", [("xla", 1), ("xla", 2), ("xla", 8), ("xla-capacity", 8), ("ragged", 1),
                                     ("ragged", 2), ("ragged", 8), ("ragged-padded", 1), ("ragged-padded", 4),
                                     pytest.param("tokamax", 1, marks=NEEDS_TOKAMAX),
                                     pytest.param("tokamax", 4, marks=NEEDS_TOKAMAX), ("reference", 8)])
def test_forward_f32_equals_reference(cpu_devices, impl, ep):
    x, idx, w, W = random_problem(mj.load_model("ci"), 64, seed=20 + ep)
    y, stats = BUILDERS[impl](_mesh(ep))(x, idx, w, W)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, _reference(x, idx, w, W)) < TOL_F32_REORDER
    if impl == "xla-capacity":
        assert int(stats["dropped_slots"]) == 0


@pytest.mark.parametrize("impl", [_impl(n) for n in BUILDERS])
def test_forward_bf16_equals_reference(cpu_devices, impl):
    x, idx, w, W = random_problem(mj.load_model("ci"), 64, dtype=jnp.bfloat16, seed=31)
    y, _ = BUILDERS[impl](_mesh(4))(x, idx, w, W)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, _reference(x, idx, w, W)) < TOL_BF16_REORDER


@pytest.mark.parametrize("impl", [_impl(n) for n in BUILDERS])
def test_gradients_equal_reference(cpu_devices, impl):
    (x, idx, w, W), dy, want = _grad_problem()
    fn = BUILDERS[impl](_mesh(4))
    got = jax.jit(jax.grad(lambda x, w, W: jnp.sum(fn(x, idx, w, W)[0] * dy), argnums=(0, 1, 2)))(x, w, W)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(g, r) < TOL_F32_REORDER


def _bf16(tree):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


@pytest.mark.parametrize("impl,ep", [("xla", 1), ("xla", 4), ("xla-capacity", 4), ("ragged", 1), ("ragged-padded", 4),
                                     pytest.param("tokamax", 1, marks=NEEDS_TOKAMAX),
                                     pytest.param("tokamax", 4, marks=NEEDS_TOKAMAX)])
def test_bf16_gradients_equal_the_f32_reference(cpu_devices, impl, ep):
    """bf16 inputs, bf16 GEMM outputs and cotangents: the gradients are those of the f32 reference on the same
    (bf16-rounded) inputs, weights and dy, within the bf16 backward's roundings."""
    (x, idx, w, W), dy, _ = _grad_problem()
    x, W, dy = _bf16((x, W, dy))
    want = jax.jit(jax.grad(lambda x, w, W: jnp.sum(mj.reference.moe(x, idx, w, W) * _f32(dy)),
                            argnums=(0, 1, 2)))(_f32(x), w, _f32(W))
    fn = BUILDERS[impl](_mesh(ep))
    got = jax.jit(jax.grad(lambda x, w, W: jnp.sum(_f32(fn(x, idx, w, W)[0]) * _f32(dy)), argnums=(0, 1, 2)))(x, w, W)
    for name, g, r in zip(("dx", "dw", *W._fields), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == (jnp.float32 if name == "dw" else jnp.bfloat16), name  # the routing weights stay f32
        assert rel_err(g, r) < TOL_BF16_GRADIENT, name


# Every GEMM in the lowered program: stablehlo.dot / dot_general, and ragged_dot where it is not expanded.
_GEMM = re.compile(r"(?:stablehlo\.dot_general|stablehlo\.dot|ragged_dot)\b.*:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)"
                   r"\s*->\s*(tensor<[^>]*>)")


def _element_type(tensor_type: str) -> str:
    return tensor_type[len("tensor<"):-1].split("x")[-1]


@pytest.mark.parametrize("impl,ep", [("xla", 1), ("xla", 2), ("xla-capacity", 1), ("xla-capacity", 2), ("ragged", 1),
                                     ("ragged", 2)])
def test_every_gemm_of_fwd_bwd_is_bf16_in_and_out(cpu_devices, impl, ep):
    """The handicap of issue 33 cannot come back: in the lowered fwd+bwd (jax.grad of sum(y dy)) on bf16 inputs
    every GEMM takes bf16 operands and yields bf16 (no f32-output dot, so no f32 cotangent). The program as JAX
    hands it to XLA (StableHLO), before XLA:CPU's own lowering of bf16 dots. tokamax is not checked here: on CPU it
    runs its XLA fallback, which asks its ragged_dot for f32 by design; on a GPU its GEMMs are Mosaic kernels, not
    dots."""
    x, idx, w, W = random_problem(mj.load_model("ci"), 16, dtype=jnp.bfloat16, seed=95)
    dy = jax.random.normal(jax.random.key(96), x.shape, jnp.bfloat16)
    fn = baselines.build(impl, _mesh(ep))
    step = jax.jit(jax.grad(lambda x, w, W: jnp.sum(_f32(fn(x, idx, w, W)[0]) * _f32(dy)), argnums=(0, 1, 2)))
    gemms = _GEMM.findall(step.lower(x, w, W).as_text())
    # the backward alone has two (dgrad, wgrad) per routed and shared gate_up and down
    assert len(gemms) >= 8, f"{impl}: found only {len(gemms)} GEMMs in the lowered program"
    for types in gemms:
        assert [_element_type(t) for t in types] == ["bf16"] * 3, f"{impl}: a GEMM {types} is not bf16 in and out"


@pytest.mark.parametrize("impl", ["xla", "ragged", "ragged-padded", _impl("tokamax")])
def test_all_tokens_to_the_same_experts(cpu_devices, impl):
    # experts 0..k-1 all live on rank 0: the other ranks' experts idle, rank 0 receives everything
    shape = mj.load_model("ci")
    x, _, w, W = random_problem(shape, 32, seed=50)
    idx = _one_expert_idx(32, shape.top_k)
    y, _ = BUILDERS[impl](_mesh(4))(x, idx, w, W)
    assert rel_err(y, _reference(x, idx, w, W)) < TOL_F32_REORDER


@pytest.mark.parametrize("impl", ["xla", "xla-capacity", "ragged", _impl("tokamax")])
def test_no_shared_expert(cpu_devices, impl):
    shape = mj.load_model("ci").replace(num_shared_experts=0, shared_intermediate_size=0)
    x, idx, w, W = random_problem(shape, 16, seed=60)
    assert W.shared_gate_up is None
    y, _ = BUILDERS[impl](_mesh(2))(x, idx, w, W)
    assert rel_err(y, _reference(x, idx, w, W)) < TOL_F32_REORDER


def _kept_by_hand(idx: np.ndarray, ep: int, num_experts: int, cap: int) -> np.ndarray:
    """Each rank fills each expert's `cap` slots in token order, then slot order; the rest is dropped."""
    kept = np.zeros(idx.shape, bool)
    tokens = idx.shape[0] // ep
    for r in range(ep):
        used = np.zeros(num_experts, int)
        for t in range(r * tokens, (r + 1) * tokens):
            for j in range(idx.shape[1]):
                e = idx[t, j]
                if used[e] < cap:
                    kept[t, j] = True
                    used[e] += 1
    return kept


def test_capacity_drops_only_overflow_slots(cpu_devices):
    shape = mj.load_model("ci")
    ep, tokens = 4, 16  # per rank; T*k/E = 16*4/16 = 4 slots per (rank, expert) at factor 1
    x, idx, w, W = random_problem(shape, ep * tokens, seed=70)  # softmax router on random logits: uneven
    cap = capacity(tokens, shape.top_k, shape.num_experts, 1.0)
    assert cap == 4
    kept = _kept_by_hand(np.asarray(idx), ep, shape.num_experts, cap)
    assert 0 < (~kept).sum() < kept.size
    y, stats = baselines.xla_capacity(_mesh(ep), capacity_factor=1.0)(x, idx, w, W)
    assert int(stats["dropped_slots"]) == int((~kept).sum())
    # a dropped slot contributes nothing: the reference with those router weights zeroed
    want = _reference(x, idx, jnp.where(jnp.asarray(kept), w, 0.0), W)
    assert rel_err(y, want) < TOL_F32_REORDER


def test_capacity_drop_count_one_expert(cpu_devices):
    # every token picks experts 0..k-1: each of those gets T slots per rank and keeps cap of them,
    # so ep * k * (T - cap) = 4 * 4 * (16 - 4) = 192 slots are dropped
    shape = mj.load_model("ci")
    x, _, w, W = random_problem(shape, 64, seed=71)
    _, stats = baselines.xla_capacity(_mesh(4), capacity_factor=1.0)(x, _one_expert_idx(64, 4), w, W)
    assert int(stats["dropped_slots"]) == 192


def test_build_and_errors(cpu_devices):
    mesh = _mesh(2)
    assert set(baselines.IMPLEMENTATIONS) == {"xla", "xla-capacity", "ragged", "tokamax", "reference", "mok",
                                              "mok-recompute", "mok-ring", "mok-keep", "mok-fp8"}
    # the CLI names them without importing this module (jax) at its own import: the same names, in one order, and
    # dense (mok_jax.bench.dense: its own inputs, built by the runner, not here)
    from mok_jax.bench import options

    assert options.IMPLEMENTATIONS == (*baselines.BASELINES, options.DENSE, *baselines.MOK_IMPLEMENTATIONS)
    assert options.MOK_IMPLS == tuple(baselines.MOK_IMPLEMENTATIONS)
    with pytest.raises(ValueError, match="unknown implementation"):
        baselines.build("dense", mesh)
    with pytest.raises(ValueError, match="capacity factor"):
        baselines.xla_capacity(mesh, capacity_factor=0)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="row_align must be a positive int"):
            baselines.ragged(mesh, row_align=bad)
    with pytest.raises(ValueError, match="no axis"):
        baselines.xla_dropless(jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2]))
    x, idx, w, W = random_problem(mj.load_model("ci"), 8, seed=80)
    with pytest.raises(ValueError, match=r"axis size \(3\)"):
        baselines.xla_dropless(_mesh(3))(x[:6], idx[:6], w[:6], W)  # 16 experts over 3 ranks


def test_mok_builder_passes_the_kernel_config(cpu_devices, monkeypatch):
    # the real mok needs a GPU: stand in for expert_parallel_moe and check the MoEConfig it is handed
    from mok_jax import sharding

    seen = []

    def fake_ep_moe(x, topk_idx, topk_weight, weights, *, mesh, config, fp8_weights=None):
        seen.append(config)
        return x

    monkeypatch.setattr(sharding, "expert_parallel_moe", fake_ep_moe)
    x, idx, w, W = random_problem(mj.load_model("ci"), 8, seed=90)
    kernel = mj.KernelConfig(granularity=1024, comm_items_fwd=8, ring_slots=3, dispatch="push")
    for fn in (baselines.mok(_mesh(2), kernel=kernel), baselines.build("mok", _mesh(2), kernel=kernel),
               baselines.build("mok", _mesh(2))):
        y, stats = fn(x, idx, w, W)
        assert y.shape == x.shape and stats == {}
    assert [(c.implementation, c.ep_axis, c.kernel) for c in seen] == [("mok", "ep", kernel)] * 2 + [
        ("mok", "ep", None)]  # None: mok_jax.tuning resolves inside the layer
    with pytest.raises(TypeError, match="KernelConfig"):
        baselines.mok(_mesh(2), kernel={"granularity": 1024})


def test_mok_variants_set_keep_and_precision(cpu_devices, monkeypatch):
    """Each mok implementation's MoEConfig (keep, precision), and mok-fp8's fp8_weights reaching the layer."""
    from mok_jax import sharding

    seen = []

    def fake_ep_moe(x, topk_idx, topk_weight, weights, *, mesh, config, fp8_weights=None):
        seen.append((config.keep, config.precision, None if fp8_weights is None else fp8_weights.gate_up.shape))
        return x

    monkeypatch.setattr(sharding, "expert_parallel_moe", fake_ep_moe)
    x, idx, w, W = random_problem(mj.load_model("ci"), 8, seed=91)
    for name in ("mok", "mok-recompute", "mok-ring", "mok-keep", "mok-fp8"):
        baselines.build(name, _mesh(2))(x, idx, w, W)
    from mok_jax.fp8 import Fp8ExpertWeights

    W8 = Fp8ExpertWeights(*[jnp.zeros((16, 1))] * 4)  # any arrays: the fake reads their shape
    baselines.build("mok-fp8", _mesh(2))(x, idx, w, W, fp8_weights=W8)
    # mok is the default MoEConfig (keep="balanced"; fp8's default keeps nothing)
    assert seen == [("balanced", "bf16", None), ("nothing", "bf16", None), ("ring", "bf16", None),
                    ("everything", "bf16", None), ("nothing", "fp8", None), ("nothing", "fp8", (16, 1))]
    assert {n: v._asdict() for n, v in baselines.MOK_IMPLEMENTATIONS.items()} == {
        "mok": {"keep": None, "precision": "bf16"}, "mok-recompute": {"keep": "nothing", "precision": "bf16"},
        "mok-ring": {"keep": "ring", "precision": "bf16"}, "mok-keep": {"keep": "everything", "precision": "bf16"},
        "mok-fp8": {"keep": None, "precision": "fp8"}}


def test_quantize_weights_per_rank_equals_the_global_quantisation(cpu_devices):
    """Each rank quantising its own experts gives the bits of quantize_expert_weights on all of them (the blocks
    are per expert), sharded over ep like gate_up."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.fp8 import quantize_expert_weights

    k1, k2 = jax.random.split(jax.random.key(92))
    gate_up = jax.random.normal(k1, (4, 128, 256), jnp.bfloat16)
    down = jax.random.normal(k2, (4, 128, 128), jnp.bfloat16) * 3
    mesh = _mesh(2)
    got = baselines.quantize_weights(mj.MoEWeights(gate_up, down), mesh)
    want = quantize_expert_weights(gate_up, down)
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), name)
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, P("ep")), a.ndim), name
    with pytest.raises(ValueError, match="multiple of 128"):
        baselines.quantize_weights(mj.MoEWeights(gate_up[:, :64], down[:, :, :64]), mesh)


def test_tokamax_not_installed_says_how_to_install_it(cpu_devices, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # what an import finds where tokamax is not installed
    with pytest.raises(ImportError, match=r"tokamax is not installed .*pip install 'mok_jax\[tokamax\]'"):
        baselines.build("tokamax", _mesh(1))


@NEEDS_TOKAMAX
def test_tokamax_gets_each_experts_rows_padded_to_the_row_align(cpu_devices):
    """Both tokamax.ragged_dot calls of the layer see groups of a multiple of TOKAMAX_ROW_ALIGN rows (so every
    group starts on one: the padded layout its Mosaic GPU kernel needs), at EP 1 and 4; the backward (tokamax's
    own) reuses those group sizes, and the gradients are the reference's."""
    seen = []

    def spy(lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers, **kw):
        jax.debug.callback(lambda sizes: seen.append(np.asarray(sizes)), group_sizes)
        return baselines._import_tokamax().ragged_dot_general(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers, implementation="xla", **kw)

    (x, idx, w, W), dy, want = _grad_problem()
    for ep in (1, 4):
        seen.clear()
        fn = baselines.tokamax(_mesh(ep), implementation=[spy], emulate_collective=True)
        got = jax.jit(jax.grad(lambda x, w, W: jnp.sum(fn(x, idx, w, W)[0] * dy), argnums=(0, 1, 2)))(x, w, W)
        jax.block_until_ready(got)
        assert len(seen) == 2 * ep, f"EP {ep}: {len(seen)} ragged_dot calls seen, not gate_up and down per rank"
        for sizes in seen:
            assert sizes.sum() > 0 and np.all(sizes % baselines.TOKAMAX_ROW_ALIGN == 0), sizes
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert rel_err(g, r) < TOL_F32_REORDER
