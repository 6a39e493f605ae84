"""API edges (CPU): vmap of the FFI ops, the Linen wrapper's arguments, mixed dtypes, dtype and shape errors,
bad routing values under jit (NaN rows + checkify), NaN isolation, the Flax module's workspace setup, and no module
shadowed by an attribute of its package."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax.experimental import checkify
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import mok_jax as mj
import mok_jax.flax as mflax
from helpers import GRAD_NAMES, fake_workspace, ffi_calls, random_problem
from mok_jax import _native, reference
from mok_jax.flax import LinenMoELayer, MoELayer
from mok_jax.workspace import Workspace

SHAPE = mj.load_model("ci")  # E 16, k 4, H 64, I 32, shared 48


def _fake_workspace(*, ep=1, max_tokens=64, hidden_size=64, top_k=4, num_experts=16, mesh=None, ws_id=7):
    return fake_workspace(ep=ep, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k, num_experts=num_experts,
                          mesh=mesh, ws_id=ws_id)


# ----------------------------------------------------------------------------- 4a: vmap of the FFI ops


def _custom_calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"custom_call @{target}(" in line]


def test_every_ffi_call_declares_a_vmap_method():
    """jax's default (vmap_method=None) makes vmap fail with a message naming no op: each call chooses."""
    ops_dir = pathlib.Path(mj.__file__).parent / "ops"
    calls = 0
    for path in sorted(ops_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "jax.ffi.ffi_call":
                calls += 1
                kw = {k.arg for k in node.keywords}
                assert "vmap_method" in kw, f"{path.name}:{node.lineno}: ffi_call without vmap_method"
    # grouped_ffn, fp8_grouped_ffn, expert_counts, expert_layout, dispatch, combine, moe_forward (bf16 and fp8),
    # experts_backward, experts_backward_ep
    assert calls == 10


def test_vmap_grouped_ffn_and_routing_ops_lower_as_loops_of_unbatched_calls(monkeypatch):
    gf = importlib.import_module("mok_jax.ops.grouped_ffn")
    rt = importlib.import_module("mok_jax.ops.routing")
    monkeypatch.setattr(gf, "require_native", lambda what: None)
    monkeypatch.setattr(rt, "require_native", lambda what: None)
    B, E, M, H, I = 3, 4, 40, 64, 32

    def ffn(x, sizes, gu, dn):
        return gf.grouped_ffn(x, sizes, gu, dn).y

    args = (jax.ShapeDtypeStruct((B, M, H), jnp.bfloat16), jax.ShapeDtypeStruct((B, E), jnp.int32),
            jax.ShapeDtypeStruct((E, H, 2 * I), jnp.bfloat16), jax.ShapeDtypeStruct((E, I, H), jnp.bfloat16))
    f = jax.vmap(ffn, in_axes=(0, 0, None, None))
    [(inside, eqn)] = ffi_calls(jax.make_jaxpr(f)(*args).jaxpr)
    assert inside == ("scan",) and eqn.params["vmap_method"] == "sequential"
    text = jax.jit(f).lower(*args).as_text()
    [call] = _custom_calls(text, "mok_grouped_ffn")
    assert "stablehlo.while" in text and f"(tensor<{M}x{H}xbf16>, tensor<{E}xi32>" in call  # unbatched operands

    g = jax.vmap(lambda i: rt.expert_counts(i, 16))
    idx = jax.ShapeDtypeStruct((B, 8, 4), jnp.int32)
    [(inside, eqn)] = ffi_calls(jax.make_jaxpr(g)(idx).jaxpr)
    assert inside == ("scan",) and eqn.params["vmap_method"] == "sequential"
    [call] = _custom_calls(jax.jit(g).lower(idx).as_text(), "mok_expert_counts")
    assert "(tensor<8x4xi32>)" in call

    # the layout: a batch of routings and of first experts, one unbatched call each
    h = jax.vmap(lambda i, f: tuple(rt.expert_layout(i, 16, first_expert=f)))
    first = jax.ShapeDtypeStruct((B,), jnp.int32)
    [(inside, eqn)] = ffi_calls(jax.make_jaxpr(h)(idx, first).jaxpr)
    assert inside == ("scan",) and eqn.params["vmap_method"] == "sequential"
    [call] = _custom_calls(jax.jit(h).lower(idx, first).as_text(), "mok_expert_layout")
    assert "(tensor<8x4xi32>, tensor<i32>)" in call


def test_vmap_comm_ops_lower_as_whole_calls_in_order(cpu_devices, monkeypatch):
    """Under shard_map every rank runs the same loop: B dispatch rounds, then B combine rounds."""
    comm = importlib.import_module("mok_jax.ops.comm")
    monkeypatch.setattr(comm, "require_native", lambda what: None)
    mesh = Mesh(np.array(cpu_devices[:2]), ("ep",))
    ws = _fake_workspace(ep=2, mesh=mesh, top_k=8, num_experts=12)
    B, T = 3, 32

    def per_rank(x, i, w):
        def one(x, i, w):
            recv, layout = comm.dispatch(ws, x, i, w)
            return comm.combine(ws, recv, layout)
        return jax.vmap(one)(x, i, w)

    spec = P(None, "ep")
    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, "ep")),
                              check_vma=False))
    args = (jax.ShapeDtypeStruct((B, 2 * T, 64), jnp.bfloat16), jax.ShapeDtypeStruct((B, 2 * T, 8), jnp.int32),
            jax.ShapeDtypeStruct((B, 2 * T, 8), jnp.float32))
    calls = ffi_calls(jax.make_jaxpr(f)(*args).jaxpr)
    assert [e.params["target_name"] for _, e in calls] == ["mok_comm_dispatch", "mok_comm_combine"]
    assert all(inside[-1] == "scan" and e.params["vmap_method"] == "sequential" for inside, e in calls)
    text = f.lower(*args).as_text()
    [d], [c] = _custom_calls(text, "mok_comm_dispatch"), _custom_calls(text, "mok_comm_combine")
    assert "has_side_effect = true" in d and "has_side_effect = true" in c
    assert f"(tensor<{T}x64xbf16>, tensor<{T}x8xi32>, tensor<{T}x8xf32>)" in d  # one rank's unbatched call
    assert text.count("stablehlo.while") >= 2


def test_vmap_megakernel_lowers_as_whole_calls_without_stacking_scratch(monkeypatch):
    mf = importlib.import_module("mok_jax.ops.moe_forward")
    monkeypatch.setattr(mf, "require_native", lambda what: None)
    scratch = 123456
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: scratch)  # the real one asks the native library
    ws = _fake_workspace()
    B, T, H, I, L, k = 3, 16, 64, 32, 16, 4

    def f(x, i, w, gu, dn):
        return mf.moe_forward(ws, x, i, w, gu, dn, None, None)

    args = (jax.ShapeDtypeStruct((B, 1, T, H), jnp.bfloat16), jax.ShapeDtypeStruct((B, 1, T, k), jnp.int32),
            jax.ShapeDtypeStruct((B, 1, T, k), jnp.float32), jax.ShapeDtypeStruct((1, L, H, 2 * I), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, L, I, H), jnp.bfloat16))
    g = jax.vmap(f, in_axes=(0, 0, 0, None, None))
    [(inside, eqn)] = ffi_calls(jax.make_jaxpr(g)(*args).jaxpr)
    assert inside == ("scan",) and eqn.params["vmap_method"] == "sequential"
    text = jax.jit(g).lower(*args).as_text()
    [call] = _custom_calls(text, "mok_moe_forward")
    assert "has_side_effect = true" in call and f"(tensor<1x{T}x{H}xbf16>" in call
    assert f"tensor<1x{scratch}xui8>" in call and f"tensor<{B}x1x{scratch}xui8>" not in text


# ----------------------------------------------------------------------------- 4b: the Linen wrapper


def _nnx_init_args():
    return [p for n, p in inspect.signature(MoELayer.__init__).parameters.items() if n not in ("self", "rngs")]


def test_linen_takes_every_argument_of_the_nnx_layer():
    nnx_args = {p.name: p.default for p in _nnx_init_args()}
    linen_fields = {f.name: f.default for f in dataclasses.fields(LinenMoELayer) if f.name not in ("parent", "name")}
    assert list(linen_fields) == list(nnx_args)
    for name, default in nnx_args.items():
        if default is not inspect.Parameter.empty:
            assert linen_fields[name] == default, name
    call = lambda cls: [(p.name, p.kind, p.default) for n, p in inspect.signature(cls.__call__).parameters.items()
                        if n != "self"]
    assert call(LinenMoELayer) == call(MoELayer)


def test_linen_forwards_every_argument(cpu_devices, monkeypatch):
    """Every argument, at a non-default value, reaches MoELayer as given (recorded before anything runs)."""
    mesh = jax.make_mesh((2, 4), ("dp", "expert"))
    values = dict(mesh=mesh, ep_axis="expert", token_axes=("expert",), implementation="mok",
                  kernel=mj.KernelConfig(granularity=1024), keep="everything", precision="fp8", max_tokens=64,
                  workspace=_fake_workspace(ep=4, mesh=mesh), checkify_ids=False, dtype=jnp.float32,
                  param_dtype=jnp.bfloat16, use_selection_bias=True)
    assert set(values) == {p.name for p in _nnx_init_args()} - {"shape"}
    seen = {}

    class Stop(Exception):
        pass

    def to_linen(cls, *args, **kwargs):
        seen.update(cls=cls, args=args, kwargs=kwargs)
        raise Stop

    monkeypatch.setattr(mflax.bridge, "to_linen", to_linen)
    with pytest.raises(Stop):
        LinenMoELayer(SHAPE, **values).init(jax.random.key(0), jnp.ones((8, SHAPE.hidden_size)))
    assert seen["cls"] is MoELayer and seen["args"] == (SHAPE,)
    assert {k: v for k, v in seen["kwargs"].items() if k != "name"} == values


def _record_configs(monkeypatch):
    configs = []
    real = mflax.expert_parallel_moe

    def recording(*args, config, **kw):
        configs.append(config)
        return real(*args, config=config, **kw)

    monkeypatch.setattr(mflax, "expert_parallel_moe", recording)
    return configs


def test_linen_with_the_added_arguments_behaves_like_nnx(cpu_devices, monkeypatch):
    mesh = jax.make_mesh((2, 4), ("dp", "ep"))
    kw = dict(mesh=mesh, token_axes=("ep",), kernel=mj.KernelConfig(granularity=1024), max_tokens=64,
              use_selection_bias=True, dtype=jnp.float32)
    configs = _record_configs(monkeypatch)
    x = jax.random.normal(jax.random.key(7), (8, 8, SHAPE.hidden_size))
    layer = LinenMoELayer(SHAPE, **kw)
    variables = layer.init(jax.random.key(0), x)
    variables["RouterBias"]["moe"]["selection_bias"] = jnp.zeros((16,)).at[5].set(1e3)
    model = MoELayer(SHAPE, **kw, rngs=nnx.Rngs(1))
    for name, v in variables["params"]["moe"].items():
        getattr(model, name)[...] = linen.unbox(v)
    model.selection_bias[...] = variables["RouterBias"]["moe"]["selection_bias"]

    y_l, aux_l = jax.jit(lambda v, x: layer.apply(v, x, return_aux_loss=True))(variables, x)
    y_n, aux_n = nnx.jit(lambda m, x: m(x, return_aux_loss=True))(model, x)
    np.testing.assert_array_equal(np.asarray(y_l), np.asarray(y_n))
    np.testing.assert_array_equal(np.asarray(aux_l), np.asarray(aux_n))
    assert y_l.sharding.spec == y_n.sharding.spec == P(("ep",), None, None)  # token_axes reached the layer
    assert np.all(np.any(np.asarray(model.route(x.reshape(-1, 64))[0]) == 5, axis=1))  # the bias took effect
    assert configs[-1] == configs[-2] and configs[-1].kernel == kw["kernel"]  # and so did kernel


# ----------------------------------------------------------------------------- 4c, 4d: dtypes, shapes


def test_f32_master_weights_are_cast_to_bf16_inside():
    x, idx, w, W = random_problem(SHAPE, 16, seed=30)  # f32
    xb = x.astype(jnp.bfloat16)
    Wb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), W)
    y = jax.jit(mj.moe)(xb, idx, w, W)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(mj.moe(xb, idx, w, Wb), np.float32))
    # gradients reach the f32 masters in f32: the bf16 gradient, widened
    loss = lambda W: jnp.sum(mj.moe(xb, idx, w, W).astype(jnp.float32) ** 2)
    g32, g16 = jax.grad(loss)(W), jax.grad(loss)(Wb)
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))
    # mixed: only the routed experts in f32
    Wm = Wb._replace(gate_up=W.gate_up, down=W.down)
    np.testing.assert_array_equal(np.asarray(mj.moe(xb, idx, w, Wm), np.float32), np.asarray(y, np.float32))


def test_topk_weight_runs_in_f32_and_bf16_is_widened():
    x, idx, w, W = random_problem(SHAPE, 16, seed=31, dtype=jnp.bfloat16)
    wb = w.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mj.moe(x, idx, wb, W), np.float32),
                                  np.asarray(mj.moe(x, idx, wb.astype(jnp.float32), W), np.float32))
    gw = jax.grad(lambda w: jnp.sum(mj.moe(x, idx, w, W).astype(jnp.float32)))(wb)
    assert gw.dtype == jnp.bfloat16
    # an f32 topk_weight is not rounded to x's bf16: the weighted sum is the reference's f32 one
    y = mj.moe(x, idx, w, W)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(reference.moe(x, idx, w, W), np.float32))


def test_flax_f32_params_bf16_compute():
    model = MoELayer(SHAPE, rngs=nnx.Rngs(0))  # dtype bf16, param_dtype f32
    x = jax.random.normal(jax.random.key(1), (16, SHAPE.hidden_size))
    assert all(w.dtype == jnp.bfloat16 for w in jax.tree.leaves(model.weights()))
    assert model(x).dtype == jnp.bfloat16 and model.route(x)[1].dtype == jnp.float32
    grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(model)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(nnx.state(grads, nnx.Param)))


@pytest.mark.parametrize("make,exc,match", [
    (lambda x, i, w, W: (x, i, w.astype(jnp.int32), W), TypeError,
     r"topk_weight must be float32 \(bfloat16 is widened to float32\), got int32"),
    (lambda x, i, w, W: (x, i, w.astype(jnp.float16), W), TypeError, r"topk_weight must be float32.*got float16"),
    (lambda x, i, w, W: (x[:, :32], i, w, W), ValueError,
     r"x must be \[tokens, hidden=64\] \(the hidden size of weights.gate_up \(16, 64, 64\)\), got x of shape "
     r"\(16, 32\): hidden size 32"),
    (lambda x, i, w, W: (x, i, w, W._replace(gate_up=W.gate_up.astype(jnp.bfloat16))), TypeError,
     r"weights.gate_up must be float32 \(x's dtype\), got bfloat16"),
    (lambda x, i, w, W: (x.astype(jnp.bfloat16), i, w, W._replace(down=W.down.astype(jnp.float16))), TypeError,
     r"weights.down must be bfloat16 \(x's dtype\) or float32 \(master weights, cast to bfloat16\), got float16"),
])
def test_dtype_and_hidden_size_errors_name_the_argument(make, exc, match):
    args = make(*random_problem(SHAPE, 16, seed=32))
    with pytest.raises(exc, match=match):
        mj.moe(*args)
    with pytest.raises(exc, match=match):
        jax.jit(mj.moe)(*args)



def test_forward_mode_autodiff_is_refused_and_reverse_mode_works():
    """The layer is a jax.custom_vjp: jax.jvp and jax.jacfwd raise JAX's TypeError saying so (what the README and
    docs/errors.md name), and jax.jacrev works."""
    x, idx, w, W = random_problem(SHAPE, 4, seed=38)
    f = lambda x: mj.moe(x, idx, w, W)  # noqa: E731
    for forward_mode in (lambda: jax.jvp(f, (x,), (x,)), lambda: jax.jacfwd(f)(x)):
        with pytest.raises(TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"):
            forward_mode()
    row = np.asarray(jax.jit(jax.jacrev(lambda x: f(x)[1, 3]))(x))
    assert row.shape == x.shape and row[1].any() and not row[[0, 2, 3]].any()  # y[1] depends on x[1] alone

# ----------------------------------------------------------------------------- 5e, 5f: bad values inside jit


def _mesh(kind: str):
    """The (2, 4) mesh of the tests over ("dp", "ep"), its axes of ``kind`` "auto" or "explicit" (jax.make_mesh's
    default)."""
    return jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(getattr(AxisType, kind.capitalize()),) * 2)


def _run(path: str):
    """The layer under jit on one device ("single"), or expert-parallel over 8 host devices on a mesh of Auto or
    Explicit axes ("auto", "explicit")."""
    if path == "single":
        return jax.jit(mj.moe)
    mesh = _mesh(path)
    return jax.jit(lambda x, i, w, W: mj.expert_parallel_moe(x, i, w, W, mesh=mesh))


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
def test_bad_expert_ids_give_nan_rows_and_a_checkify_error(cpu_devices, path):
    x, idx, w, W = random_problem(SHAPE, 16, seed=33)
    bad = idx.at[3, 1].set(16).at[9, 0].set(-7)
    f = _run(path)
    y = np.asarray(f(x, bad, w, W))
    rows = np.isnan(y).any(axis=1)
    assert np.flatnonzero(rows).tolist() == [3, 9] and np.isnan(y[[3, 9]]).all()
    ok = np.asarray(f(x, idx.at[3].set(-1).at[9].set(-1), w, W))
    np.testing.assert_array_equal(y[~rows], ok[~rows])  # every other token as usual

    # the index is of the caller's tokens, expert-parallel too (the global ids are checked before the shard_map)
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(x, bad, w, W)
    assert "mok_jax.moe: topk_idx[3, 1] = 16 is neither an expert id in [0, 16) nor -1" in err.get()
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(x, bad.at[3, 1].set(0), w, W)
    assert "mok_jax.moe: topk_idx[9, 0] = -7" in err.get()
    err, y = checkify.checkify(f, errors=checkify.user_checks)(x, idx, w, W)
    assert err.get() is None
    err.throw()  # what raised ShardingTypeError on an Explicit mesh, even with valid ids


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
def test_no_tokens_under_jit(cpu_devices, path):
    """T = 0 under jit, as eagerly: an empty output and gradients of the arguments' shapes, on one device and
    expert-parallel, through the function and the Flax module (the invalid-id report asked argmax of an empty
    sequence)."""
    x, idx, w, W = random_problem(SHAPE, 0, seed=37)
    mesh = None if path == "single" else _mesh(path)
    f = mj.moe if mesh is None else functools.partial(mj.expert_parallel_moe, mesh=mesh)
    y, grads = jax.jit(jax.value_and_grad(lambda x, w, W: jnp.sum(f(x, idx, w, W)), argnums=(0, 1, 2)))(x, w, W)
    assert y == 0 and jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, (x, w, W))
    assert jax.jit(f)(x, idx, w, W).shape == (0, SHAPE.hidden_size)
    layer = MoELayer(SHAPE, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert nnx.jit(lambda m, x: m(x))(layer, jnp.zeros((2, 0, SHAPE.hidden_size))).shape == (2, 0, SHAPE.hidden_size)


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
def test_checkify_ids_off_lets_jax_export_serialize_the_layer(cpu_devices, path):
    """checkify's debug_check leaves an effect jax.export cannot serialize; MoEConfig(checkify_ids=False) leaves it
    out, the weights go in as a MoEWeights (registered for serialization), and the bad id still gives its NaN row:
    on one device and expert-parallel on Auto and Explicit meshes."""
    from jax import export

    x, idx, w, W = random_problem(SHAPE, 16, seed=35)
    if path == "single":
        layer = lambda cfg: jax.jit(functools.partial(mj.moe, config=cfg))  # noqa: E731
    else:
        mesh = _mesh(path)
        layer = lambda cfg: jax.jit(functools.partial(mj.expert_parallel_moe, mesh=mesh, config=cfg))  # noqa: E731
    ep = None if path == "single" else "ep"
    with pytest.raises(NotImplementedError, match="serializ"):
        export.export(layer(mj.MoEConfig(ep_axis=ep)))(x, idx, w, W).serialize()
    blob = export.export(layer(mj.MoEConfig(ep_axis=ep, checkify_ids=False)))(x, idx, w, W).serialize()
    with contextlib.nullcontext() if path == "single" else jax.set_mesh(mesh):  # called on the exported devices
        y = np.asarray(export.deserialize(blob).call(x, idx.at[3, 1].set(16), w, W))
    assert np.flatnonzero(np.isnan(y).any(axis=1)).tolist() == [3]


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
def test_masked_slot_ignores_its_weight(cpu_devices, path):
    x, idx, w, W = random_problem(SHAPE, 16, seed=34)
    f = _run(path)
    masked = f(x, idx.at[:, 2].set(-1), w.at[:, 2].set(jnp.nan), W)  # -1: skipped, even a NaN weight
    zero_weight = f(x, idx, w.at[:, 2].set(0.0), W)  # the same sum: slot 2 adds nothing
    np.testing.assert_array_equal(np.asarray(masked), np.asarray(zero_weight))
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(x, idx.at[:, 2].set(-1), w, W)
    assert err.get() is None


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf])
def test_masked_slot_weight_reaches_no_gradient(cpu_devices, path, poison):
    """A masked slot (-1) whose weight is NaN or inf (a top-k over -inf logits gives one): the forward and the
    gradients of x, topk_weight and every weight are the bits of the same routing with 0 there, finite, and the
    slot's weight gradient is 0."""
    x, idx, w, W = random_problem(SHAPE, 16, seed=36)
    idx = idx.at[:, 2].set(-1).at[5].set(-1)
    masked = np.asarray(idx) < 0
    f = _run(path)
    run = jax.jit(jax.value_and_grad(lambda x, w, W: jnp.sum(f(x, idx, w, W) ** 2), argnums=(0, 1, 2)))
    got, want = run(x, jnp.where(masked, poison, w), W), run(x, jnp.where(masked, 0.0, w), W)
    for name, a, b in zip(("y",) + GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert not np.asarray(got[1][1])[masked].any()


@pytest.mark.parametrize("path", ["single", "auto", "explicit"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_in_one_token_stays_in_its_row(cpu_devices, path, dtype):
    x, idx, w, W = random_problem(SHAPE, 16, seed=35, dtype=dtype)
    f = _run(path)
    y = np.asarray(f(x.at[5, 7].set(jnp.nan), idx, w, W), np.float32)
    assert np.isnan(y[5]).all()
    others = np.arange(16) != 5
    assert np.isfinite(y[others]).all()
    np.testing.assert_array_equal(y[others], np.asarray(f(x, idx, w, W), np.float32)[others])


# ----------------------------------------------------------------------------- 3: the Flax module's workspace


def _no_workspace_allowed(monkeypatch):
    from mok_jax import workspace

    def refuse(*a, **k):
        raise AssertionError("implementation='xla' asked for a workspace")

    for name in ("moe_workspace", "local_workspace", "emulated_workspace"):
        monkeypatch.setattr(workspace, name, refuse)
    monkeypatch.setattr(Workspace, "create", refuse)


@pytest.mark.parametrize("with_mesh", [False, True])
def test_xla_layer_never_needs_a_workspace(cpu_devices, monkeypatch, with_mesh):
    _no_workspace_allowed(monkeypatch)
    mesh = jax.make_mesh((2, 4), ("dp", "ep")) if with_mesh else None
    model = MoELayer(SHAPE, mesh=mesh, max_tokens=64, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model.setup_workspace(128)  # a no-op for xla
    assert model.workspace is None
    x = jnp.ones((16, SHAPE.hidden_size))
    assert nnx.jit(lambda m, x: m(x))(model, x).shape == x.shape
    layer = LinenMoELayer(SHAPE, mesh=mesh, max_tokens=64, dtype=jnp.float32)
    assert jax.jit(layer.apply)(jax.jit(layer.init)(jax.random.key(0), x), x).shape == x.shape


@pytest.mark.parametrize("with_mesh", [False, True])
def test_mok_layer_without_workspace_raises_under_jit(cpu_devices, monkeypatch, with_mesh):
    """implementation="mok" on this machine (no GPU): every call, jitted or not, raises NativeLibraryUnavailable
    naming the layer (a jitted one said "has no workspace ... pass max_tokens", which no argument could fix)."""
    mesh = jax.make_mesh((2, 4), ("dp", "ep")) if with_mesh else None
    model = MoELayer(SHAPE, mesh=mesh, implementation="mok", rngs=nnx.Rngs(0))  # constructs on CPU: no workspace yet
    x = jnp.ones((16, SHAPE.hidden_size))
    layer = LinenMoELayer(SHAPE, mesh=mesh, implementation="mok")
    # on this machine, under jit as outside it, the error says why the kernels cannot run, not what to pass
    for call in (lambda: nnx.jit(lambda m, x: m(x))(model, x), lambda: jax.jit(layer.init)(jax.random.key(0), x),
                 lambda: model(x)):
        with pytest.raises(_native.NativeLibraryUnavailable, match=r"MoELayer\(implementation='mok'\) needs"):
            call()
    # where they can, a jitted call without a workspace says what to pass
    with monkeypatch.context() as m:
        m.setattr(_native, "require_native", lambda what: None)
        with pytest.raises(ValueError, match=r"has no workspace: the workspace is set up outside jit.*max_tokens=.*"
                                             r"at least 16.*layer.setup_workspace\(16\)"):
            nnx.jit(lambda m, x: m(x))(model, x)
        with pytest.raises(ValueError, match="has no workspace"):
            jax.jit(layer.init)(jax.random.key(0), x)
    with pytest.raises(_native.NativeLibraryUnavailable, match=r"MoELayer\(implementation='mok'\)"):
        MoELayer(SHAPE, mesh=mesh, implementation="mok", max_tokens=64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        MoELayer(SHAPE, max_tokens=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("with_mesh", [False, True])
def test_mok_layer_sets_its_workspace_up_at_construction(cpu_devices, monkeypatch, with_mesh):
    """With a (fake) workspace from mok_jax.workspace's public functions: sized per rank at construction,
    handed to the op under jit, and a call larger than it raises under jit."""
    from mok_jax import workspace

    made = []

    def fake(*args, max_tokens, hidden_size, top_k, num_experts, **kw):
        made.append(dict(args=args, max_tokens=max_tokens))
        return _fake_workspace(ep=4 if args else 1, max_tokens=max_tokens, ws_id=100 + len(made))

    monkeypatch.setattr(_native, "require_native", lambda what: None)
    monkeypatch.setattr(workspace, "moe_workspace", fake)
    monkeypatch.setattr(workspace, "local_workspace", fake)
    calls = []  # the workspace each call hands the op, beside its config
    fake_op = lambda x, *a, config, workspace, **kw: calls.append(workspace) or jnp.zeros(x.shape, x.dtype)
    monkeypatch.setattr(mflax, "moe", fake_op)
    monkeypatch.setattr(mflax, "expert_parallel_moe", fake_op)

    mesh = jax.make_mesh((2, 4), ("dp", "ep")) if with_mesh else None
    model = MoELayer(SHAPE, mesh=mesh, implementation="mok", max_tokens=64, rngs=nnx.Rngs(0))
    shards = 8 if with_mesh else 1
    assert [m["max_tokens"] for m in made] == [64 // shards]
    if with_mesh:
        assert made[0]["args"] == (mesh, "ep")
    ws = model.workspace
    step = nnx.jit(lambda m, x: m(x))
    step(model, jnp.ones((4, 16, SHAPE.hidden_size)))  # 64 tokens: fits
    assert calls[-1] is ws and len(made) == 1
    with pytest.raises(ValueError, match=rf"workspace for {64 // shards} tokens per rank; this call of 128 tokens "
                                         rf"needs {128 // shards}"):
        step(model, jnp.ones((128, SHAPE.hidden_size)))
    model.setup_workspace(128)  # outside jit: a larger one
    assert model.workspace is not ws and made[-1]["max_tokens"] == 128 // shards
    step(model, jnp.ones((128, SHAPE.hidden_size)))
    assert calls[-1] is model.workspace


# ----------------------------------------------------------------------------- one name per thing

# A function that mok_jax.ops exports under its module's name: the same trap, in code this change does not own
# (issue 35, "one name per thing"). A new one, or one of these fixed, fails the test below.
OPS_SHADOWED = {"mok_jax.ops.grouped_ffn", "mok_jax.ops.moe_forward"}

_SHADOWED = """
import importlib, pkgutil, sys
found = []
def walk(name):
    package = importlib.import_module(name)
    names = dict(vars(package))  # as its import left it, before a submodule's import binds the submodule there
    for info in pkgutil.iter_modules(package.__path__):
        full = f"{name}.{info.name}"
        if info.name in names and names[info.name] is not importlib.import_module(full):
            found.append(full)
        if info.ispkg:
            walk(full)
walk("mok_jax")
print(" ".join(sorted(found)))
"""


def test_no_module_is_shadowed_by_an_attribute_of_its_package():
    """For every module m of every package p of mok_jax, p.m is that module or absent, in a fresh process (a
    module and a function of one name: mok_jax.moe was both, and emulation.py, importing the module by that name,
    got the function)."""
    done = subprocess.run([sys.executable, "-c", _SHADOWED], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(done.stdout.split()) == OPS_SHADOWED


# ----------------------------------------------------------------------------- the workspace beside the config


@pytest.mark.parametrize("bad", ["ws", 7, mj.MoEConfig()])
def test_a_workspace_that_is_not_one_is_a_type_error_naming_workspace(cpu_devices, bad):
    """The workspace is its own argument of moe, expert_parallel_moe and MoELayer (MoEConfig no longer holds it),
    checked where it is used, on both implementations: a TypeError naming ``workspace`` and what was given."""
    x, idx, w, W = random_problem(SHAPE, 16, seed=0)
    mesh = jax.make_mesh((2,), ("ep",), devices=cpu_devices[:2])
    calls = {
        "mok_jax.moe": lambda: mj.moe(x, idx, w, W, workspace=bad),
        "mok_jax.expert_parallel_moe": lambda: mj.expert_parallel_moe(x, idx, w, W, mesh=mesh, workspace=bad),
        "MoELayer": lambda: MoELayer(SHAPE, implementation="mok", workspace=bad, rngs=nnx.Rngs(0)),
    }
    for where, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{where}: workspace must be a mok_jax\.workspace\.Workspace .*, got "
                                            rf"{type(bad).__name__}$"):
            call()
    with pytest.raises(ValueError, match=r"MoELayer: workspace spans 1 EP ranks; the layer runs on 2 \(mesh axis"):
        MoELayer(SHAPE, mesh=mesh, implementation="mok", workspace=_fake_workspace(), rngs=nnx.Rngs(0))


def test_the_callers_workspace_reaches_the_forward_and_the_backward(cpu_devices, monkeypatch):
    """moe(..., workspace=) inside a caller's shard_map at EP 2: jax.grad lowers the megakernel's forward and the
    fused backward op with that workspace's id (a static argument of the custom_vjp beside the config, so the
    backward sees the forward's); without one the call says how to pass it."""
    layer = importlib.import_module("mok_jax.layer")
    mf = importlib.import_module("mok_jax.ops.moe_forward")
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    for mod in (layer, mf, mb):
        monkeypatch.setattr(mod, "require_native", lambda what: None)
    monkeypatch.setattr(mf, "scratch_bytes", lambda **kw: 4096)
    monkeypatch.setattr(layer, "FUSED_EP_BACKWARD", True)
    T = 16
    mesh = jax.make_mesh((2,), ("ep",), devices=cpu_devices[:2], axis_types=(AxisType.Auto,))
    ws = _fake_workspace(ep=2, mesh=mesh, max_tokens=T, ws_id=4242)
    x, idx, w, W = random_problem(SHAPE, 2 * T, dtype=jnp.bfloat16, seed=1)
    cfg = mj.MoEConfig(implementation="mok", ep_axis="ep", keep="nothing")
    specs = (P("ep"), P("ep"), P("ep"), mj.MoEWeights(P("ep"), P("ep"), P(), P()))

    def grads(workspace):
        body = jax.shard_map(lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg, workspace=workspace), mesh=mesh,
                             in_specs=specs, out_specs=P("ep"))
        loss = lambda x, w, W: jnp.sum(body(x, idx, w, W).astype(jnp.float32))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, W).as_text().splitlines()

    lines = grads(ws)
    [fwd] = [line for line in lines if "custom_call @mok_moe_forward(" in line]
    [bwd] = [line for line in lines if "custom_call @mok_experts_backward_ep(" in line]
    assert "ws_id = 4242 : i64" in fwd and "ws_id = 4242 : i64" in bwd, (fwd, bwd)
    with pytest.raises(ValueError, match=r"needs the layer's workspace: call mok_jax\.expert_parallel_moe, or pass "
                                         r"moe\(\.\.\., workspace=mok_jax\.workspace\.moe_workspace\("):
        grads(None)
