"""GPU tests of the gradients of implementation="mok" (EP size 1) inside real JAX programs (issue 11, item 1).

Each case compares jax.grad of mok under a transformation with the same gradient computed without it, bit for
bit: the math is the same (mok's forward and backward are custom calls with fixed sum orders; the XLA code
around them, the expert layout and the shared expert's backward, is the same ops in each program), so the bits
must be. Cases: ``jax.checkpoint`` with the default, a names-based and the nothing-saveable policy; ``lax.scan``
over a stack of 4 residual layers against the Python loop of jitted layers; gradient accumulation over 3
microbatches in one jit against 3 jitted steps; two layers of different shapes in one program; donated
arguments; jit callers of ``mj.expert_parallel_moe`` on 1-GPU meshes of Auto and of Explicit axes against plain
``mj.moe``. Last, a Flax NNX training step (``nnx.value_and_grad``, ``optax.sgd``, ``nnx.jit``): finite, its
gradients near those of the same module with implementation="xla" (row by row, NNX_GRAD_TOL), and under
``nnx.remat`` the same bits of the experts' gradients (the router's, XLA's f32 code, within f32 reordering).
The forward in these programs: tests/test_programs_gpu.py; the gradients' accuracy against the f32 reference:
tests/test_moe_backward_gpu.py.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GRAD_NAMES, TOL_F32_REORDER, module_seed, program_problem, seeded_key
from jax.ad_checkpoint import checkpoint_name

import mok_jax as mj
from mok_jax.config import KernelConfig, ModelShape, MoEConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# The NNX module with implementation="mok" against the same module with implementation="xla", both in bf16: each
# is within a few bf16 roundings of the f32 gradient (tests/test_moe_backward_gpu.py holds mok to 2x the xla
# path's own error plus 4 x 2^-8 of the row and 4 x 2^-8 of the rms row norm, and the xla path's own error is a
# few roundings of 2^-8 too), so the two differ by at most ~16 x 2^-8 = 2^-4 of the row's norm plus the rms row
# norm (weight gradients are sums over tokens that cancel, so a row's error follows the rms, not its own size);
# a wrong slot, expert or router row is O(1) of the row.
NNX_GRAD_TOL = 2.0**-4
# Their losses: y differs by a rounding of each bf16 output (2^-8 of it) in random directions, which moves
# mean_t ||y_t - target_t||^2 by far less than 2^-6 of it; a wrong layer moves it by O(1).
NNX_LOSS_TOL = 2.0**-6
# optax.sgd's update p - lr g in f32 rounds lr itself to f32, lr g, and the sum (once if fused into an FMA):
# each at most 2^-24 of |p| + lr |g| (relative to p - lr g, which may cancel to ~0, it can be any size); 2x that
# bound was exceeded on the H200 by 4 of 4M elements (lr's own rounding); a missed or doubled update is off by
# lr |g|.
SGD_TOL = 4 * 2.0**-24
# A gradient under nnx.remat against the plain one, per row (times the row's norm plus the rms row norm): a few
# bf16 roundings turned the other way (each 2^-8 of an element); a wrong or missing slot is O(1).
REMAT_GRAD_TOL = 4 * 2.0**-8
# The router's gradient (f32) under nnx.remat: XLA's softmax VJP of cotangents that carry those bf16 roundings;
# on the H200 it came within 1.1x of 2e-5 (f32 reordering alone) per row: 2^-12 leaves room, a wrong row is O(1).
REMAT_ROUTER_TOL = 2.0**-12

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)
MOK = MoEConfig(implementation="mok", kernel=KernelConfig(granularity=512, comm_items_fwd=8))
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def _problem(tag: str, **shape):
    return program_problem(_SEED, tag, **shape)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _assert_same_bits(got, want, what: str, names=GRAD_NAMES):
    """Leaf by leaf: the same dtype, shape and bits; the wanted leaf finite and not all zeros (two NaN or two
    zero gradients would agree and prove nothing). A failure names every leaf that differs, how many elements
    and how far."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want) == len(names), f"{what}: {len(got)} and {len(want)} leaves, want {len(names)}"
    wrong = []
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {name}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        b32 = b.astype(np.float32)
        assert np.isfinite(b32).all() and b32.any(), f"{what}: {name}: the plain gradient is not finite or all 0"
        differ = _bits(a) != _bits(b)
        if differ.any():
            diff = float(np.abs(a.astype(np.float32) - b32).max())
            wrong.append(f"{name}: {int(differ.sum())} of {differ.size} elements differ, max |diff| {diff:.3g} "
                         f"(max |want| {float(np.abs(b32).max()):.3g})")
    assert not wrong, f"{what}: not the same bits: " + "; ".join(wrong)


def _layer(x, idx, w, W):
    return mj.moe(x, idx, w, W, config=MOK)


def _loss(layer):
    """<layer(x, idx, w, W), dy> in f32: a function of (x, w, W, idx, dy) (d loss / d y = dy)."""
    def loss(x, w, W, idx, dy):
        return jnp.sum(layer(x, idx, w, W).astype(_F32) * dy.astype(_F32))

    return loss


# (dx, d topk_weight, d weights) of the plain layer: one compilation, shared by the cases of this shape.
_grads = jax.jit(jax.grad(_loss(_layer), argnums=(0, 1, 2)))


def _block(x, idx, w, W):
    """The layer with work on both sides whose backward needs it: x / 2 (exact) goes in, so the layer's backward
    reads an intermediate, which jax.checkpoint recomputes; the layer's output, named "moe_out", is squared in f32,
    so the square's VJP (dz 2y, one rounding) reads it. jax.checkpoint never runs the forward kernel again,
    whatever the policy: the call has a side effect (ffi_call has_side_effect=True), and JAX keeps the outputs of
    effectful operations rather than repeat them."""
    y = checkpoint_name(_layer(x * jnp.asarray(0.5, x.dtype), idx, w, W), "moe_out")
    return jnp.square(y.astype(_F32))


def test_checkpoint_policies_give_the_same_gradients():
    x, idx, w, W, dy = _problem("remat")
    grad = lambda block: jax.jit(jax.grad(_loss(block), argnums=(0, 1, 2)))(x, w, W, idx, dy)
    want = grad(_block)
    policies = {"default": None,
                "save_only_these_names('moe_out')": jax.checkpoint_policies.save_only_these_names("moe_out"),
                "nothing_saveable": jax.checkpoint_policies.nothing_saveable}
    for name, policy in policies.items():
        _assert_same_bits(grad(jax.checkpoint(_block, policy=policy)), want, f"jax.checkpoint(policy={name})")


def test_scan_over_four_layers_equals_the_loop():
    """h <- h + layer_l(h) (bf16 residual) over 4 layers, each with its own weights and routing: jax.grad through
    lax.scan over the stacked layers against the Python loop over the same layers, one jitted layer (forward)
    and one jitted layer VJP (backward, in reverse) at a time, chained by hand. A loop iteration is where a scan
    step ends, so each layer's values are the bf16 arrays that the scan carries. (One jit over the unrolled
    loop lets XLA keep f32 excess precision across the layers' bf16 casts, allowed by default: on the CPU
    that changes the bits of the weights' gradients, so it is not the same math.)"""
    x, idx, w, Ws, dy = _problem("scan", layers=4)

    def block(h, layer):
        i, w, W = layer
        return h + _layer(h, i, w, W), None

    def loss_scan(x, w, Ws, idx):
        h = jax.lax.scan(block, x, (idx, w, Ws))[0]
        return jnp.sum(h.astype(_F32) * dy.astype(_F32))  # d loss / d h = dy

    scanned = jax.jit(jax.grad(loss_scan, argnums=(0, 1, 2)))(x, w, Ws, idx)

    @jax.jit
    def forward(h, layer):
        return block(h, layer)[0]

    @jax.jit
    def backward(h, layer, ct):  # (d h, d w, d W) of layer l's block for the output gradient ct
        i, w, W = layer
        return jax.vjp(lambda h, w, W: block(h, (i, w, W))[0], h, w, W)[1](ct)

    layers = [jax.tree.map(lambda a: a[layer], (idx, w, Ws)) for layer in range(4)]
    hs = [x]
    for layer in layers[:-1]:
        hs.append(forward(hs[-1], layer))
    ct, dws, dWs = dy, [], []
    for h, layer in reversed(list(zip(hs, layers))):
        ct, dw, dW = backward(h, layer, ct)
        dws.insert(0, dw)
        dWs.insert(0, dW)
    looped = (ct, jnp.stack(dws), jax.tree.map(lambda *a: jnp.stack(a), *dWs))
    _assert_same_bits(scanned, looped, "lax.scan over 4 layers against the loop")


def test_gradient_accumulation_in_one_jit_equals_separate_steps():
    """f32 master weights (mj.moe casts them to bf16; their gradients come back in f32), 3 microbatches: the f32
    sum of the weights' gradients in one jit (lax.scan over the microbatches) against 3 jitted gradient calls
    summed eagerly in f32 in the same order, and each microbatch's dx and d topk_weight. The barrier keeps a
    microbatch's gradients a finished value, as a separate call's are: without it XLA may fold the accumulation
    into the shared expert's weight-gradient GEMM (a cuBLAS bias epilogue, possibly another algorithm), which is
    XLA's choice about its own GEMM, not mok's."""
    micro = [_problem(f"accum{m}") for m in range(3)]
    W32 = jax.tree.map(lambda a: a.astype(_F32), micro[0][3])

    def step(W, x, w, idx, dy):
        dx, dw, dW = jax.grad(_loss(_layer), argnums=(0, 1, 2))(x, w, W, idx, dy)
        return dW, dx, dw

    def accumulate(W, xs, ws, idxs, dys):
        def body(acc, mb):
            dW, dx, dw = jax.lax.optimization_barrier(step(W, *mb))
            return jax.tree.map(jnp.add, acc, dW), (dx, dw)

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, W), (xs, ws, idxs, dys))

    stacked = [jnp.stack([m[i] for m in micro]) for i in (0, 2, 1, 4)]  # x, w, idx, dy
    acc, (dxs, dws) = jax.jit(accumulate)(W32, *stacked)
    one = jax.jit(step)
    want = jax.tree.map(jnp.zeros_like, W32)
    for m, (x, idx, w, _, dy) in enumerate(micro):
        dW, dx, dw = one(W32, x, w, idx, dy)
        want = jax.tree.map(jnp.add, want, dW)  # f32, microbatch order
        _assert_same_bits((dxs[m], dws[m]), (dx, dw), f"microbatch {m} in one jit", names=GRAD_NAMES[:2])
    assert all(a.dtype == _F32 for a in jax.tree.leaves(acc))
    _assert_same_bits(acc, want, "the f32 sum over 3 microbatches", names=GRAD_NAMES[2:])


def test_two_shapes_in_one_program():
    """Both layers' losses summed in one program: each gradient is its own layer's, as if computed alone."""
    loss = _loss(_layer)
    a = _problem("shape_a")
    b = _problem("shape_b", E=8, H=768, I=384, k=2, Is=128, T=300)
    # (x, w, W) differentiated, (idx, dy) constant, of each problem (x, idx, w, W, dy)
    (pa, ca), (pb, cb) = (((x, w, W), (idx, dy)) for x, idx, w, W, dy in (a, b))
    both = lambda pa, pb, ca, cb: loss(*pa, *ca) + loss(*pb, *cb)
    ga, gb = jax.jit(jax.grad(both, argnums=(0, 1)))(pa, pb, ca, cb)
    _assert_same_bits(ga, _grads(*pa, *ca), "shape a next to shape b")
    _assert_same_bits(gb, _grads(*pb, *cb), "shape b next to shape a")


def test_donated_arguments():
    """x, topk_weight and the weights donated: the gradients have exactly their shapes and dtypes, so XLA may
    write them into the donated buffers while the backward pass still reads x and the weights."""
    x, idx, w, W, dy = _problem("donate")
    want = _grads(x, w, W, idx, dy)
    donating = jax.jit(jax.grad(_loss(_layer), argnums=(0, 1, 2)), donate_argnums=(0, 1, 2))
    for call in range(2):
        args = jax.tree.map(jnp.copy, (x, w, W))  # fresh buffers: donated ones die
        got = donating(*args, idx, dy)
        assert all(a.is_deleted() for a in jax.tree.leaves(args)), "the donated buffers are still alive"
        _assert_same_bits(got, want, f"donated arguments, call {call}")


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_gradients_through_expert_parallel_moe_on_auto_and_explicit_meshes(axis_type):
    """At EP size 1 the shard_map'd layer is the same math as plain mj.moe: the same gradient bits."""
    x, idx, w, W, dy = _problem(f"mesh_{axis_type}")
    want = _grads(x, w, W, idx, dy)
    gpus = [d for d in jax.devices() if d.platform == "gpu"][:1]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(getattr(jax.sharding.AxisType, axis_type),), devices=gpus)
    cfg = MoEConfig(implementation="mok", ep_axis="ep", kernel=MOK.kernel)
    layer = lambda x, i, w, W: mj.expert_parallel_moe(x, i, w, W, mesh=mesh, config=cfg)
    got = jax.jit(jax.grad(_loss(layer), argnums=(0, 1, 2)))(x, w, W, idx, dy)
    _assert_same_bits(got, want, f"expert_parallel_moe on a 1-GPU mesh of {axis_type} axes")


# ----------------------------------------------------------------------------- a Flax NNX training step


def _rows(a) -> np.ndarray:
    a = np.asarray(a, np.float64)
    return a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a[:, None]


def _assert_rows_near(what: str, got, want, tol: float):
    """||got_r - want_r|| <= tol * (||want_r|| + rms row norm), row by row (rows: the last axis)."""
    got, want = _rows(got), _rows(want)
    assert np.isfinite(got).all(), f"{what}: NaN/Inf in rows {np.where(~np.isfinite(got).all(1))[0][:8].tolist()}"
    norm = np.linalg.norm(want, axis=1)
    bound = tol * (norm + np.sqrt(np.mean(norm**2)))
    err = np.linalg.norm(got - want, axis=1)
    bad = np.where(~(err <= bound))[0]
    assert bad.size == 0, (f"{what}: {bad.size} of {len(err)} rows over the bound, e.g. rows {bad[:6].tolist()}: "
                           f"err {err[bad[:6]].tolist()} > bound {bound[bad[:6]].tolist()}")


def test_nnx_training_step():
    """MoELayer(implementation="mok") in nnx.value_and_grad + an optax.sgd update under nnx.jit: a finite loss
    and gradients near the same module's with implementation="xla"; the update is p - lr g; under nnx.remat
    (the routing recomputed by XLA) the loss within f32 reordering, every gradient within a few roundings of the
    plain one per row, and the update p - lr g of its own gradient."""
    import optax
    from flax import nnx

    from mok_jax.flax import MoELayer

    shape = ModelShape(name="nnx_step", num_experts=16, top_k=4, hidden_size=512, intermediate_size=256,
                       num_shared_experts=1, shared_intermediate_size=256)
    T, lr = 600, 0.1
    kx, kt = jax.random.split(seeded_key(_SEED, "nnx_step"))
    x = jax.random.normal(kx, (T, shape.hidden_size), _F32).astype(_BF16)
    target = 0.5 * jax.random.normal(kt, (T, shape.hidden_size), _F32)

    def make(implementation):  # the same seed: the same parameters
        return MoELayer(shape, implementation=implementation, kernel=MOK.kernel,
                        max_tokens=T if implementation == "mok" else None, rngs=nnx.Rngs(_SEED % 1000))

    def train_step(call):
        def loss_fn(model, x, target):
            y, aux = call(model, x)
            return jnp.mean(jnp.sum(jnp.square(y.astype(_F32) - target), axis=-1)) + 1e-2 * aux

        @nnx.jit
        def step(model, optimizer, x, target):
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, target)
            optimizer.update(model, grads)
            return loss, grads

        return step

    plain = lambda model, x: model(x, return_aux_loss=True)
    params = lambda model: [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    mok, mok_remat, xla = make("mok"), make("mok"), make("xla")
    before = params(mok)
    for other in (mok_remat, xla):
        assert all(np.array_equal(a, b) for a, b in zip(params(other), before)), "not the same initial parameters"

    results = {}
    for name, model, call in (("mok", mok, plain), ("mok under nnx.remat", mok_remat, nnx.remat(plain)),
                              ("xla", xla, plain)):
        optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
        loss, grads = train_step(call)(model, optimizer, x, target)
        grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
        assert np.isfinite(float(loss)), f"{name}: loss {float(loss)}"
        assert all(np.isfinite(g).all() and g.any() for g in grads), f"{name}: gradients not finite or all 0"
        results[name] = float(loss), grads, params(model)

    loss, grads, after = results["mok"]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(mok, nnx.Param))]
    for name, p0, g, p1 in zip(names, before, grads, after):
        assert not np.array_equal(p1, p0), f"{name}: the step left the parameter unchanged"
        p0, g, p1 = (a.astype(np.float64) for a in (p0, g, p1))
        err = np.abs(p1 - (p0 - lr * g))
        bound = SGD_TOL * (np.abs(p0) + lr * np.abs(g))
        assert (err <= bound).all(), (f"{name}: the update is not p - lr g: worst |err| {err.max():.3g}, "
                                      f"{int((err > bound).sum())} elements over the bound")

    loss_x, grads_x, _ = results["xla"]
    assert abs(loss - loss_x) <= NNX_LOSS_TOL * abs(loss_x), f"loss: mok {loss}, xla {loss_x}"
    for name, g, gx in zip(names, grads, grads_x):
        _assert_rows_near(f"d{name}: mok against xla", g, gx, NNX_GRAD_TOL)

    # nnx.remat recomputes the routing in XLA, in another program: its f32 softmax may fuse differently, and so
    # may the loss's f32 sum over the rows (one ulp apart on the H200, jax 0.11.2). A topk_weight an f32 ulp
    # away turns some bf16 roundings of the experts' gradients the other way (seen: up to 2% of the elements, by
    # one bf16 ulp), so those are compared per row within REMAT_GRAD_TOL, the router's within REMAT_ROUTER_TOL,
    # and each update must be p - lr g of its own gradient. (Under jax.checkpoint with the routing given, the
    # gradients are the plain ones bit for bit: tests/test_moe_backward_gpu.py.)
    loss_r, grads_r, after_r = results["mok under nnx.remat"]
    assert abs(loss_r - loss) <= TOL_F32_REORDER * abs(loss), f"loss {loss_r} != {loss}"
    for name, g_r, g, p0, p_r in zip(names, grads_r, grads, before, after_r):
        _assert_rows_near(f"nnx.remat: d{name}", g_r, g, REMAT_ROUTER_TOL if "router" in name else REMAT_GRAD_TOL)
        p0, g_r, p_r = (a.astype(np.float64) for a in (p0, g_r, p_r))
        err = np.abs(p_r - (p0 - lr * g_r))
        assert (err <= SGD_TOL * (np.abs(p0) + lr * np.abs(g_r))).all(), f"nnx.remat: {name}: not p - lr g"
