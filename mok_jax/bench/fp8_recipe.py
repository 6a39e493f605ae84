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
from mok_jax.flax import MoELayer, load_balancing_loss
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


def _row_tiles(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, int]:
    """For expert-major rows with ``group_sizes``: each row's 128-row tile (tiles start at each group's first row and
    never straddle two groups), and a static bound on the tile count."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(num_rows)
    group = jnp.searchsorted(ends, row, side="right")  # rows past the last group: group E (never read)
    group_c = jnp.minimum(group, group_sizes.shape[0] - 1)
    tiles_before = jnp.cumsum(-(-group_sizes // fp8.BLOCK)) - (-(-group_sizes // fp8.BLOCK))
    tile = tiles_before[group_c] + (row - starts[group_c]) // fp8.BLOCK
    bound = num_rows // fp8.BLOCK + group_sizes.shape[0]
    return jnp.where(group < group_sizes.shape[0], tile, bound), bound


def fake_quantize_columns(a: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """a [M, N] (expert-major rows, ``group_sizes``) -> f32: each 128 x 1 tile (128 rows of one expert by one column)
    quantised to E4M3 with its own scale and back, as the FP8 weight gradients read their operands."""
    a = a.astype(_F32)
    tile, bound = _row_tiles(group_sizes, a.shape[0])
    amax = jax.ops.segment_max(jnp.abs(a), tile, num_segments=bound + 1)  # [tiles, N]; empty tiles -inf
    scale = fp8._scale_of(jnp.maximum(amax, 0.0))[tile]  # noqa: SLF001 - the recipe's scale, one definition
    q = jnp.clip(a * (1.0 / scale), -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.astype(_F32) * scale


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

    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        if x.shape[-1] != self.shape.hidden_size:
            raise ValueError(f"x must end in hidden_size={self.shape.hidden_size}, got shape {x.shape}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        idx, w, probs = self.route(tokens)
        y = recipe_moe(tokens, idx, w, self.weights(), self.backward).reshape(*lead, -1)
        if return_aux_loss:
            return y, load_balancing_loss(probs, idx, self.shape.num_experts)
        return y
