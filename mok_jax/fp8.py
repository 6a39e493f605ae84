"""FP8 (E4M3) block quantisation of the routed experts, DeepSeek-V3's recipe for Hopper (issue 12).

Hopper has no hardware block scaling, so the scales are fp32 and applied in software at each K block:

* weights: one scale per 128 x 128 block of each expert matrix (``quantize_weight_blocks``), done once per
  optimizer step by the user;
* activations: one scale per 1 x 128 tile of a row (``quantize_rows``), done by the kernels on the fly (dispatch,
  and the SwiGLU epilogue for h);
* a GEMM multiplies E4M3 values with fp32 accumulation per 128-long K block and adds each block's partial times
  its two scales into an fp32 accumulator (``block_scaled_matmul``, the reference the FP8 kernels are checked
  against).

A scale is amax * (1/448) in f32 (448 = the largest finite E4M3 value; the product, not a division, because
XLA rewrites a division by a constant into it), so every scaled value lies in [-448, 448] up to an f32 ulp
(clipped there) and rounds to a finite E4M3 number; an all-zero block gets scale 1 (its values are exact
zeros). A value v is quantised as v * (1 / scale): one division per scale, then products, the form the kernels
compute too, bit for bit. Rounding is to nearest even (XLA's convert).

Error of one quantised value v = q * scale (E4M3: 3 mantissa bits, smallest normal 2^-6, subnormal spacing
2^-9): for |v| >= 2^-6 scale the relative error is at most 2^-4 (half an ulp of 3 mantissa bits); below that
the absolute error is at most 2^-10 scale (half the subnormal spacing). So |v - w| <= max(2^-4 |w|, 2^-10 scale)
for every element, up to the f32 roundings of w / scale and q * scale; ``quantization_error_bound`` gives that
bound.

This module is pure JAX: it runs anywhere, and it is the oracle of the FP8 kernels
(``mok_jax.ops.fp8_grouped_ffn``): ``quantize_expert_weights`` makes the weights in the kernels' layout,
``grouped_ffn_reference`` runs the same pipeline, and ``ffn_error_sigma`` estimates its distance from the
unquantised FFN. ``moe_reference`` is the whole layer with FP8 routed experts (the plan of docs/design.md: rows
quantised at dispatch, routed experts in FP8, the shared expert and the combine as the bf16 layer's), the oracle
of the FP8 layer forward.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax.reference.experts import shared_expert
from mok_jax.weights import MoEWeights

__all__ = ["BLOCK", "E4M3_MAX", "Fp8ExpertWeights", "Fp8FfnReference", "Fp8MoeReference", "block_scaled_matmul",
           "dequantize_rows", "dequantize_weight_blocks", "ffn_error_sigma", "grouped_ffn_reference", "moe_reference",
           "quantization_error_bound", "quantize_expert_weights", "quantize_rows", "quantize_weight_blocks",
           "reference_layout"]

BLOCK = 128  # the scale block: 1 x 128 for activations, 128 x 128 for weights
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_F8 = jnp.float8_e4m3fn
_F32 = jnp.float32


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _pad_to_blocks(a: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    pad = [(0, 0)] * a.ndim
    for ax in axes:
        pad[ax] = (0, _blocks(a.shape[ax]) * BLOCK - a.shape[ax])
    return jnp.pad(a, pad)


_INV_E4M3_MAX = 1.0 / E4M3_MAX  # rounded to f32 once where it meets the f32 amax


def _scale_of(amax: jax.Array) -> jax.Array:
    # amax * (1/448), not amax / 448: XLA rewrites a division by a constant into this product, so the product is
    # what any XLA build computes, and the kernels compute the same (bit for bit, the test of the row quantiser)
    return jnp.where(amax > 0, amax * jnp.float32(_INV_E4M3_MAX), 1.0).astype(_F32)


def _weight_scale_of(blocks: jax.Array) -> jax.Array:
    """The scale of each 128 x 128 block of blocks [..., kb, 128, nb, 128]. A block that holds a NaN or an inf gets
    a NaN scale, so its values quantise to NaN and every product with the block is NaN, as a NaN weight makes the
    bf16 layer's rows NaN. With _scale_of alone a NaN block quantised with scale 1 (its finite values rounded to
    E4M3's coarse subnormals; XLA's max may drop a NaN) and an inf block flushed its finite values to 0: wrong
    numbers, silently. Finite blocks: _scale_of's bits."""
    finite = jnp.all(jnp.isfinite(blocks), axis=(-3, -1))
    return jnp.where(finite, _scale_of(jnp.max(jnp.abs(blocks), axis=(-3, -1))), jnp.float32(jnp.nan))


def _check(name: str, a, min_ndim: int) -> jax.Array:
    a = jnp.asarray(a)
    if a.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == _F8:
        raise TypeError(f"{name} must be a bf16/f16/f32 array to quantise, got {a.dtype}")
    return a


def quantize_weight_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w: [..., K, N] (e.g. gate_up [E, H, 2I] or down [E, I, H]) -> (q: float8_e4m3fn [..., K, N],
    scale: f32 [..., ceil(K/128), ceil(N/128)]) with w ~= q * scale of its 128 x 128 block. A block with a NaN or
    an inf in it comes out all NaN (scale and values): the rows that meet it are NaN, never a silent wrong value."""
    w = _check("w", w, 2)
    *lead, k, n = w.shape
    wp = _pad_to_blocks(w.astype(_F32), (w.ndim - 2, w.ndim - 1))
    kb, nb = _blocks(k), _blocks(n)
    blocks = wp.reshape(*lead, kb, BLOCK, nb, BLOCK)
    scale = _weight_scale_of(blocks)  # [..., kb, nb]
    q = jnp.clip(blocks * (1.0 / scale)[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(_F8)
    return q.reshape(*lead, kb * BLOCK, nb * BLOCK)[..., :k, :n], scale


def dequantize_weight_blocks(q: jax.Array, scale: jax.Array) -> jax.Array:
    """The f32 values q * scale of quantize_weight_blocks' output."""
    k, n = q.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)[..., :k, :n]
    return q.astype(_F32) * s


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [..., K] -> (q: float8_e4m3fn [..., K], scale: f32 [..., ceil(K/128)]): one scale per 1 x 128 tile."""
    x = _check("x", x, 1)
    *lead, k = x.shape
    kb = _blocks(k)
    tiles = _pad_to_blocks(x.astype(_F32), (x.ndim - 1,)).reshape(*lead, kb, BLOCK)
    scale = _scale_of(jnp.max(jnp.abs(tiles), axis=-1))
    q = jnp.clip(tiles * (1.0 / scale)[..., None], -E4M3_MAX, E4M3_MAX).astype(_F8)
    return q.reshape(*lead, kb * BLOCK)[..., :k], scale


def dequantize_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """The f32 values q * scale of quantize_rows' output."""
    return q.astype(_F32) * jnp.repeat(scale, BLOCK, axis=-1)[..., :q.shape[-1]]


def quantization_error_bound(w: jax.Array, scale_per_element: jax.Array) -> jax.Array:
    """max(2^-4 |w|, 2^-10 scale) + 2^-21 |w|, elementwise: the bound of |dequantised - w| (module docstring),
    plus the f32 roundings of w / scale and of q * scale (2^-24 each, relative), which a value exactly half an
    E4M3 ulp from its neighbours otherwise pushes over the first term."""
    a = jnp.abs(w.astype(_F32))
    return jnp.maximum(2.0**-4 * a, 2.0**-10 * scale_per_element) + 2.0**-21 * a


def block_scaled_matmul(xq: jax.Array, x_scale: jax.Array, wq: jax.Array, w_scale: jax.Array) -> jax.Array:
    """The FP8 GEMM of the recipe, in f32: xq [M, K] e4m3 with x_scale [M, ceil(K/128)], wq [K, N] e4m3 with
    w_scale [ceil(K/128), ceil(N/128)] -> f32 [M, N] = sum over K blocks b (in order) of
    (xq[:, b] @ wq[b, :]) * x_scale[:, b] * w_scale[b, n-block]: each block's partial summed in f32, then
    promoted with its two scales into the f32 total, as the kernels will (their tensor cores sum a block's
    products in their own order, so they agree with this to f32 rounding, not bitwise)."""
    m, k = xq.shape
    n = wq.shape[1]
    kb = _blocks(k)
    xp = _pad_to_blocks(xq.astype(_F32), (1,)).reshape(m, kb, BLOCK)
    wp = _pad_to_blocks(wq.astype(_F32), (0,)).reshape(kb, BLOCK, n)
    ws = jnp.repeat(w_scale, BLOCK, axis=1)[:, :n]  # [kb, N]
    acc = jnp.zeros((m, n), _F32)
    for b in range(kb):
        part = jnp.einsum("mk,kn->mn", xp[:, b], wp[b], precision=jax.lax.Precision.HIGHEST)
        acc = acc + part * x_scale[:, b, None] * ws[b][None, :]
    return acc


# --- the routed experts' weights in the FP8 kernels' layout -------------------------------------------------------


class Fp8ExpertWeights(NamedTuple):
    """Routed expert weights quantised for ``mok_jax.ops.fp8_grouped_ffn`` (``quantize_expert_weights``).

    FP8 wgmma reads both operands K-major (the reduction dimension contiguous), so each matrix is stored
    transposed relative to the bf16 weights, with its 128 x 128 block scales transposed the same way:

    * gate_up: float8_e4m3fn [E, 2I, H]; gate_up[e, n, k] ~= bf16 gate_up[e, k, n] (rows [0, I) gate, [I, 2I) up)
    * gate_up_scale: f32 [E, 2I/128, H/128]; gate_up_scale[e, nb, kb] scales the block of rows
      [128 nb, 128 nb + 128) and columns [128 kb, 128 kb + 128) of gate_up[e]
    * down: float8_e4m3fn [E, H, I]; down[e, n, k] ~= bf16 down[e, k, n]
    * down_scale: f32 [E, H/128, I/128]
    """

    gate_up: jax.Array
    gate_up_scale: jax.Array
    down: jax.Array
    down_scale: jax.Array


# Weight elements (of gate_up) the quantiser takes in one step of its loop over the experts. XLA's temporaries (the
# blocks in f32) grow with what one step holds: all experts at once took twice the bf16 weights' bytes on the CPU, and
# on an 80 GB H100 deepseek-v4-pro's ep2 slice (25 GB of bf16 weights) ran out of memory in XLA's autotuning.
QUANT_STEP_ELEMENTS = 1 << 27


def quantize_expert_weights(gate_up: jax.Array, down: jax.Array) -> Fp8ExpertWeights:
    """gate_up [E, H, 2I], down [E, I, H] (bf16 or f32; H and I multiples of 128) -> Fp8ExpertWeights: E4M3
    values with one fp32 scale per 128 x 128 block (``quantize_weight_blocks``), each matrix transposed to
    the K-major layout of the FP8 kernels (``Fp8ExpertWeights``). Pure JAX, jit-able; done once per
    optimizer step. A block never straddles gate and up because I is a multiple of 128. The experts go
    through in equal steps of at most ``QUANT_STEP_ELEMENTS`` gate_up elements (``lax.map``; one expert a step
    when it alone is larger), so that the temporary memory is a step's, not the whole weights'; the bits do not
    depend on the step."""
    gate_up = _check("gate_up", gate_up, 3)
    down = _check("down", down, 3)
    if gate_up.ndim != 3 or gate_up.shape[2] % 2:
        raise ValueError(f"gate_up must be [E, H, 2I], got shape {gate_up.shape}")
    e, hidden, two_i = gate_up.shape
    inter = two_i // 2
    if down.shape != (e, inter, hidden):
        raise ValueError(f"down must be [E, I, H] = {(e, inter, hidden)}, got shape {down.shape}")
    if hidden % BLOCK or hidden == 0:
        raise ValueError(f"gate_up: hidden size H must be a positive multiple of {BLOCK}, got {hidden}")
    if inter % BLOCK or inter == 0:
        raise ValueError(f"gate_up: intermediate size I must be a positive multiple of {BLOCK}, got {inter}")
    most = max(1, QUANT_STEP_ELEMENTS // (hidden * two_i))
    if e <= most:
        return _quantize_experts(gate_up, down)
    # a divisor of E: lax.map's remainder step would concatenate the outputs, a temporary copy of all of them
    step = max(d for d in range(1, most + 1) if e % d == 0)
    steps = jax.lax.map(lambda w: _quantize_experts(*w),  # each step on [step, ...] arrays, as one-step's
                        (gate_up.reshape(e // step, step, *gate_up.shape[1:]),
                         down.reshape(e // step, step, *down.shape[1:])))
    return Fp8ExpertWeights(*(a.reshape(e, *a.shape[2:]) for a in steps))


def _quantize_experts(gate_up: jax.Array, down: jax.Array) -> Fp8ExpertWeights:
    """quantize_expert_weights' arithmetic, for any leading dimensions (one expert or several)."""
    gq, gs = quantize_weight_blocks(gate_up)
    dq, ds = quantize_weight_blocks(down)
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    return Fp8ExpertWeights(t(gq), t(gs), t(dq), t(ds))


def reference_layout(w: Fp8ExpertWeights) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(gate_up_q [E, H, 2I], gate_up_scale [E, H/128, 2I/128], down_q [E, I, H], down_scale [E, I/128, H/128]):
    the weights back in the bf16 layout (K x N), as ``block_scaled_matmul`` takes them."""
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    return t(w.gate_up), t(w.gate_up_scale), t(w.down), t(w.down_scale)


# --- the FP8 grouped FFN, as the kernels compute it -------------------------------------------------------------


class Fp8FfnReference(NamedTuple):
    """The FP8 expert FFN's pipeline in f32 (``grouped_ffn_reference``); row-major scales ([rows, blocks])."""

    y: jax.Array        # f32 [M, H]
    h: jax.Array        # f32 [M, I]: silu(gate) * up before quantisation
    h_q: jax.Array      # e4m3 [M, I]
    h_scale: jax.Array  # f32 [M, I/128]
    x_q: jax.Array      # e4m3 [M, H]
    x_scale: jax.Array  # f32 [M, H/128]
    gate: jax.Array     # f32 [M, I]
    up: jax.Array       # f32 [M, I]


def grouped_ffn_reference(x: jax.Array, group_sizes: Sequence[int], w: Fp8ExpertWeights) -> Fp8FfnReference:
    """The FP8 grouped FFN of ``mok_jax.ops.fp8_grouped_ffn`` in f32, group by group (group_sizes are host
    ints here: rows [offset_e, offset_e + group_sizes[e]) are expert e's): x quantised in 1 x 128 tiles,
    gate/up by ``block_scaled_matmul``, h = silu(gate) * up quantised in 1 x 128 tiles, y by
    ``block_scaled_matmul``. Padding rows (past sum(group_sizes)): y = h = h_q = 0, h_scale = 1, gate = up = 0;
    x_q of every row is quantised."""
    sizes = [int(s) for s in np.asarray(group_sizes).reshape(-1)]
    m, hidden = x.shape
    gu_q, gu_s, dn_q, dn_s = reference_layout(w)
    inter = dn_q.shape[1]
    x_q, x_scale = quantize_rows(x)
    ys, gates, ups = [], [], []
    off = 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        gu = block_scaled_matmul(x_q[off:off + n], x_scale[off:off + n], gu_q[e], gu_s[e])
        gates.append(gu[:, :inter])
        ups.append(gu[:, inter:])
        off += n
    pad = m - off
    zeros = jnp.zeros((pad, inter), _F32)
    gate = jnp.concatenate(gates + [zeros], axis=0) if gates else zeros
    up = jnp.concatenate(ups + [zeros], axis=0) if ups else zeros
    h = jax.nn.silu(gate) * up
    h_q, h_scale = quantize_rows(h)
    off = 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        ys.append(block_scaled_matmul(h_q[off:off + n], h_scale[off:off + n], dn_q[e], dn_s[e]))
        off += n
    yz = jnp.zeros((pad, hidden), _F32)
    y = jnp.concatenate(ys + [yz], axis=0) if ys else yz
    return Fp8FfnReference(y, h, h_q, h_scale, x_q, x_scale, gate, up)


def ffn_error_sigma(x: jax.Array, group_sizes: Sequence[int], gate_up: jax.Array, down: jax.Array,
                    w: Fp8ExpertWeights, *, accumulation_rel: float | None = None) -> jax.Array:
    """f32 [M, H]: per element, the standard deviation that E4M3 rounding gives y_fp8 - y, where y is the
    unquantised FFN of the f32 values of x, gate_up [E, H, 2I], down [E, I, H] and y_fp8 the FP8 pipeline of
    ``grouped_ffn_reference`` with w = quantize_expert_weights(gate_up, down). Padding rows get 0.

    The model (the standard one of probabilistic rounding-error analysis): each quantised value's error is
    zero-mean, independent of the others, and bounded by B(v) = quantization_error_bound(v, scale), so its
    variance is at most B(v)^2 (a uniform error would have B^2 / 3: a factor sqrt(3) of margin). Propagated
    to first order, with squares elementwise:

      gate/up:  Var g = B(x)^2 @ W^2 + x^2 @ B(W)^2 (+ accumulation, below)
      h = silu(g) u:  Var h = (silu'(g) u)^2 Var g + silu(g)^2 Var u + B(h)^2     (h's own quantisation)
      y:  Var y = Var h @ D^2 + h^2 @ B(D)^2

    plus, for each GEMM, (accumulation_rel * block magnitude sum)^2 per 128-long block, at most
    accumulation_rel^2 * 128 * (x^2 @ W^2) (Cauchy-Schwarz): None means f32 sums, 2^-24 K. The worst case
    (absolute values instead of squares) is a useless ~100 |y| for random data because it ignores the
    cancellation that makes y small; the sigma is ~the actual error. A test compares a row's error norm with
    the root of the row's summed variances (a sum of H >= 128 near-independent terms: it concentrates)."""
    sizes = [int(s) for s in np.asarray(group_sizes).reshape(-1)]
    x = x.astype(_F32)
    m, hidden = x.shape
    _, gu_s, _, dn_s = reference_layout(w)
    inter = gate_up.shape[2] // 2
    _, x_scale = quantize_rows(x)
    bx2 = quantization_error_bound(x, jnp.repeat(x_scale, BLOCK, axis=-1)[:, :hidden]) ** 2
    hi = jax.lax.Precision.HIGHEST
    mm = lambda a, b: jnp.matmul(a, b, precision=hi)  # noqa: E731
    out, off = [], 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        rows = slice(off, off + n)
        wg = gate_up[e].astype(_F32)
        bw2 = quantization_error_bound(wg, jnp.repeat(jnp.repeat(gu_s[e], BLOCK, 0), BLOCK, 1)) ** 2
        x2 = x[rows] ** 2
        acc_gu = hidden * 2.0**-24 if accumulation_rel is None else accumulation_rel
        var_gu = mm(bx2[rows], wg**2) + mm(x2, bw2) + acc_gu**2 * BLOCK * mm(x2, wg**2)
        gu = mm(x[rows], wg)
        g, u = gu[:, :inter], gu[:, inter:]
        sig = jax.nn.sigmoid(g)
        dsilu = sig * (1.0 + g * (1.0 - sig))
        h = g * sig * u
        var_h = (dsilu * u) ** 2 * var_gu[:, :inter] + (g * sig) ** 2 * var_gu[:, inter:]
        _, h_scale = quantize_rows(h)
        var_h = var_h + quantization_error_bound(h, jnp.repeat(h_scale, BLOCK, axis=-1)) ** 2
        wd = down[e].astype(_F32)
        bd2 = quantization_error_bound(wd, jnp.repeat(jnp.repeat(dn_s[e], BLOCK, 0), BLOCK, 1)) ** 2
        acc_dn = inter * 2.0**-24 if accumulation_rel is None else accumulation_rel
        var_y = mm(var_h, wd**2) + mm(h**2, bd2) + acc_dn**2 * BLOCK * mm(h**2, wd**2)
        out.append(jnp.sqrt(var_y))
        off += n
    out.append(jnp.zeros((m - off, hidden), _F32))
    return jnp.concatenate(out, axis=0)


# --- the layer with FP8 routed experts ---------------------------------------------------------------------------


class Fp8MoeReference(NamedTuple):
    """The layer with FP8 routed experts (``moe_reference``)."""

    y: jax.Array        # [T, H] in x's dtype: routed + shared, rounded once
    routed: jax.Array   # f32 [T, H]: sum_j topk_weight[t, j] * the FP8 expert's output, in slot order
    shared: jax.Array   # f32 [T, H]: the shared expert as the bf16 layer computes it (zeros without one)
    sigma: jax.Array    # f32 [T, H]: the E4M3 error's standard deviation in ``routed`` (ffn_error_sigma, combined)


def moe_reference(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights,
                  w: Fp8ExpertWeights, *,
                  accumulation_rel: float | None = None) -> Fp8MoeReference:
    """y_t = sum_j topk_weight[t, j] * fp8_expert_{topk_idx[t, j]}(x_t) + shared(x_t), on the host's values.

    x: [T, H] (bf16 or f32); topk_idx: int32[T, k] (ids outside [0, E) are masked slots: they add nothing, whatever
    their weight); topk_weight: f32[T, k]; weights: the layer's MoEWeights (its shared expert runs as in
    mok_jax.reference.moe, and its routed weights give ``sigma``); w = quantize_expert_weights(weights.gate_up,
    weights.down). Each routed slot runs ``grouped_ffn_reference``'s pipeline on its token's row (x quantised in
    1 x 128 tiles, as the FP8 dispatch will send it); the slots are summed in f32 in slot order j = 0..k-1, then
    the shared expert is added and the sum rounded to x's dtype, as the bf16 layer does. ``sigma`` combines the
    slots' ``ffn_error_sigma`` as independent errors: sqrt(sum_j (topk_weight[t, j] sigma_slot)^2).
    Not jit-able: the experts' row counts are taken from topk_idx on the host."""
    x = jnp.asarray(x)
    idx = np.asarray(topk_idx)
    if x.ndim != 2 or idx.ndim != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, H] and topk_idx [T, k] over the same tokens, got {x.shape}, {idx.shape}")
    topk_weight = jnp.asarray(topk_weight, _F32)
    if topk_weight.shape != idx.shape:
        raise ValueError(f"topk_weight must be [T, k] = {idx.shape} (topk_idx's shape), got {topk_weight.shape}")
    num_experts = w.gate_up.shape[0]
    tokens, k = idx.shape
    slots = idx.reshape(-1)
    valid = (slots >= 0) & (slots < num_experts)
    order = np.argsort(np.where(valid, slots, num_experts), kind="stable")[:int(valid.sum())]  # expert-major
    sizes = np.bincount(slots[order], minlength=num_experts).astype(np.int32)
    if len(order):
        rows = x[jnp.asarray(order // k)]
        y_rows = grouped_ffn_reference(rows, sizes, w).y
        sig_rows = ffn_error_sigma(rows, sizes, weights.gate_up, weights.down, w, accumulation_rel=accumulation_rel)
    else:  # every slot masked
        y_rows = sig_rows = jnp.zeros((0, x.shape[1]), _F32)
    where = np.full(tokens * k, len(order), np.int64)  # each slot's row of y_rows; masked: a zero row
    where[order] = np.arange(len(order))
    zero = jnp.zeros((1, x.shape[1]), _F32)
    per_slot = jnp.concatenate([y_rows, zero])[jnp.asarray(where)].reshape(tokens, k, -1)
    sig_slot = jnp.concatenate([sig_rows, zero])[jnp.asarray(where)].reshape(tokens, k, -1)
    mine = jnp.asarray(valid.reshape(tokens, k))
    routed = jnp.zeros((tokens, x.shape[1]), _F32)
    var = jnp.zeros((tokens, x.shape[1]), _F32)
    for j in range(k):
        wj = topk_weight[:, j, None]
        routed = routed + jnp.where(mine[:, j, None], wj * per_slot[:, j], 0.0)
        var = var + jnp.where(mine[:, j, None], (wj * sig_slot[:, j]) ** 2, 0.0)
    shared = shared_expert(x, weights)
    return Fp8MoeReference((routed + shared).astype(x.dtype), routed, shared, jnp.sqrt(var))
