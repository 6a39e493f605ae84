"""The FP8 training recipe's numerics in pure JAX, for choosing the FP8 backward by a loss curve (issue 34).

Issue 34 asks for an FP8 backward of the routed experts whose dgrads run in E4M3 with 1 x 128 scales of dy and dh,
and whose weight gradients stay bf16 or run in FP8 as DeepSeek-V3 trains them, "chosen by a measured loss curve".
The kernels of that backward do not exist yet; this module gives the curve its arithmetic first, on any machine.
Each GEMM operand is quantised and dequantised with the recipe's tiles (``mok_jax.fp8``'s functions, so the same
scales and E4M3 roundings as the kernels), and the GEMM then runs in f32. The kernels sum each 128-long K block in
the tensor core and promote it with its two scales, which differs from this only by f32 rounding, far below the
E4M3 error. ``BACKWARDS`` names the choices:

* ``"bf16"``: the FP8 forward, then the gradient of the bf16 layer at that point, recomputed from the bf16 weights
  and inputs. This is what ``precision="fp8"`` trains with today ("straight-through").
* ``"fp8-dgrad"``: dy in 1 x 128 tiles (along H) against the down weights' 128 x 128 blocks gives dh. The SwiGLU
  backward takes the forward's g and u. dgu = [dg | du] in 1 x 128 tiles (along 2I) against gate_up's blocks gives
  dx. The weight gradients stay bf16: bf16 x, h, dgu, dy, f32 accumulation.
* ``"fp8"``: the dgrads as ``"fp8-dgrad"``, and the weight gradients in FP8 too. Their reduction runs over an
  expert's rows, so x, h, dy and dgu are quantised in 128 x 1 tiles: 128 consecutive rows of one expert (the
  expert-major order, each expert's rows starting a new tile) by one column, DeepSeek-V3's tiles for wgrad.

``Fp8RecipeLayer`` is ``mok_jax.flax.MoELayer`` with its routed experts in one of these forms. Its router, shared
expert (bf16, as the FP8 layer keeps it) and the weighted sum of the slots are MoELayer's. ``mok_jax.bench.train_curve``
trains it as ``--impl xla-fp8-st`` (backward "bf16"), ``xla-fp8-dgrad`` and ``xla-fp8``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mok_jax import fp8
from mok_jax.flax import MoELayer
from mok_jax.reference.experts import routed_sum, shared_expert, swiglu_backward

__all__ = ["BACKWARDS", "Fp8RecipeLayer", "fake_quantize_columns", "fake_quantize_rows", "fake_quantize_weights",
           "routed_experts"]

BACKWARDS = ("bf16", "fp8-dgrad", "fp8")
_F32 = jnp.float32
_BF16 = jnp.bfloat16


def fake_quantize_rows(x: jax.Array) -> jax.Array:
    """x [..., K] -> f32: each 1 x 128 tile quantised to E4M3 with its scale and back (``fp8.quantize_rows``)."""
    return fp8.dequantize_rows(*fp8.quantize_rows(x))


def fake_quantize_weights(w: jax.Array) -> jax.Array:
    """w [..., K, N] -> f32: each 128 x 128 block quantised and back (``fp8.quantize_weight_blocks``)."""
    return fp8.dequantize_weight_blocks(*fp8.quantize_weight_blocks(w))


def _padded_positions(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, int]:
    """For expert-major rows with ``group_sizes``: each row's place in the same rows with every expert's group padded
    to a multiple of 128 (so that 128-row tiles never straddle two experts), and the padded length. Rows past the
    groups get the padded length: a place outside it."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    padded = -(-group_sizes // fp8.BLOCK) * fp8.BLOCK
    padded_starts = jnp.cumsum(padded) - padded
    row = jnp.arange(num_rows)
    group = jnp.searchsorted(ends, row, side="right")  # rows past the last group: group E
    group_c = jnp.minimum(group, group_sizes.shape[0] - 1)
    length = (num_rows // fp8.BLOCK + group_sizes.shape[0]) * fp8.BLOCK  # a static bound on sum(padded)
    return jnp.where(group < group_sizes.shape[0], padded_starts[group_c] + row - starts[group_c], length), length


def fake_quantize_columns(a: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """a [M, N] (expert-major rows, ``group_sizes``) -> f32: each 128 x 1 tile (128 rows of one expert by one column)
    quantised to E4M3 with its own scale and back, as the FP8 weight gradients read their operands: ``fp8``'s
    1 x 128 tiles of the transposed rows, each expert's group padded with zeros (which leave a tile's amax as it is).
    Rows past the groups come back 0."""
    pos, length = _padded_positions(group_sizes, a.shape[0])
    padded = jnp.zeros((length, a.shape[1]), _F32).at[pos].set(a.astype(_F32), mode="drop")
    q = fake_quantize_rows(padded.T).T
    return q.at[pos].get(mode="fill", fill_value=0.0)


def _weight_grad(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[E, Ka, Nb]: a_e^T b_e for each expert's rows, f32 accumulation."""
    dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[])
    return lax.ragged_dot_general(a, b, group_sizes, dn, preferred_element_type=_F32)


def _ragged(a: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return lax.ragged_dot(a, w, group_sizes, preferred_element_type=_F32)


def _forward(x, group_sizes, gate_up, down):
    """The FP8 forward of the routed experts on expert-major rows: (y f32 [M, H], g, u f32 [M, I])."""
    gu = _ragged(fake_quantize_rows(x), fake_quantize_weights(gate_up), group_sizes)
    g, u = jnp.split(gu, 2, axis=-1)
    h = jax.nn.silu(g) * u
    return _ragged(fake_quantize_rows(h), fake_quantize_weights(down), group_sizes), g, u


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def routed_experts(x: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array,
                   backward: str) -> jax.Array:
    """The routed SwiGLU experts with the FP8 forward, on expert-major rows. x: [M, H] (bf16); group_sizes:
    int32 [E] (summing to at most M; rows past them give zeros and get no gradient); gate_up: [E, H, 2I];
    down: [E, I, H] -> f32 [M, H]. ``backward``: one of BACKWARDS."""
    return _forward(x, group_sizes, gate_up, down)[0]


def _routed_fwd(x, group_sizes, gate_up, down, backward):
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    y, g, u = _forward(x, group_sizes, gate_up, down)
    return y, (x, group_sizes, gate_up, down, g, u)


def _routed_bwd(backward, res, dy):
    x, group_sizes, gate_up, down, g, u = res
    if backward == "bf16":  # the bf16 layer's gradient at this point: g, u recomputed from the bf16 operands
        gu = _ragged(x, gate_up, group_sizes)
        g, u = jnp.split(gu, 2, axis=-1)
        dh = _ragged(dy.astype(_BF16), jnp.swapaxes(down, 1, 2), group_sizes)
        h, dg, du = swiglu_backward(g, u, dh)
        dgu = jnp.concatenate([dg, du], axis=-1).astype(_BF16)
        dx = _ragged(dgu, jnp.swapaxes(gate_up, 1, 2), group_sizes)
    else:
        dh = _ragged(fake_quantize_rows(dy), jnp.swapaxes(fake_quantize_weights(down), 1, 2), group_sizes)
        h, dg, du = swiglu_backward(g, u, dh)
        dgu = jnp.concatenate([dg, du], axis=-1)
        dx = _ragged(fake_quantize_rows(dgu), jnp.swapaxes(fake_quantize_weights(gate_up), 1, 2), group_sizes)
    if backward == "fp8":
        col = functools.partial(fake_quantize_columns, group_sizes=group_sizes)
        d_gate_up = _weight_grad(col(x), col(dgu), group_sizes)
        d_down = _weight_grad(col(h), col(dy), group_sizes)
    else:
        d_gate_up = _weight_grad(x.astype(_BF16), dgu.astype(_BF16), group_sizes)
        d_down = _weight_grad(h.astype(_BF16), dy.astype(_BF16), group_sizes)
    return (dx.astype(x.dtype), None, d_gate_up.astype(gate_up.dtype), d_down.astype(down.dtype))


routed_experts.defvjp(_routed_fwd, _routed_bwd)


def recipe_moe(x, topk_idx, topk_weight, weights, backward: str):
    """The layer with its routed experts in ``routed_experts``: y = sum_j topk_weight[t, j] expert(x_t) + shared(x_t)
    in x's dtype. Every slot must be valid (an id in [0, E)), as the router gives."""
    tokens, k = topk_idx.shape
    num_experts = weights.gate_up.shape[0]
    slots = topk_idx.reshape(-1)
    order = jnp.argsort(slots, stable=True)  # expert-major
    sizes = jnp.bincount(slots, length=num_experts).astype(jnp.int32)
    y_rows = routed_experts(x[order // k], sizes, weights.gate_up, weights.down, backward)
    per_slot = jnp.zeros_like(y_rows).at[order].set(y_rows).reshape(tokens, k, -1)  # [T, k, H], slot order
    # the slots summed as the bf16 layer sums them (routed_sum: f32, slot order), each slot's row its only "expert"
    routed = routed_sum(jnp.swapaxes(per_slot, 0, 1), jnp.broadcast_to(jnp.arange(k), (tokens, k)), topk_weight)
    return (routed + shared_expert(x, weights)).astype(x.dtype)


class Fp8RecipeLayer(MoELayer):
    """MoELayer (implementation="xla", no mesh) with its routed experts in the FP8 recipe of ``backward``."""

    def __init__(self, shape, *, backward: str, **kwargs):
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if kwargs.get("mesh") is not None:
            raise ValueError("Fp8RecipeLayer: mesh must be None (the recipe's layer runs every expert locally)")
        super().__init__(shape, implementation="xla", **kwargs)
        self.backward = backward

    def _experts(self, tokens: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
        return recipe_moe(tokens, idx, w, self.weights(), self.backward)
