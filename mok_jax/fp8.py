"""FP8 (E4M3) block quantisation of the routed experts, DeepSeek-V3's recipe for Hopper (issue 12).

Hopper has no hardware block scaling, so the scales are fp32 and applied in software at each K block:

* weights: one scale per 128 x 128 block of each expert matrix (``quantize_weight_blocks``), done once per
  optimizer step by the user;
* activations: one scale per 1 x 128 tile of a row (``quantize_rows``), done by the kernels on the fly (dispatch,
  and the SwiGLU epilogue for h);
* a GEMM multiplies E4M3 values with fp32 accumulation per 128-long K block and adds each block's partial times
  its two scales into an fp32 accumulator (``block_scaled_matmul``, the reference the FP8 kernels are checked
  against).

A scale is amax / 448 (448 = the largest finite E4M3 value), so every scaled value lies in [-448, 448] and
rounds to a finite E4M3 number; an all-zero block gets scale 1 (its values are exact zeros). Rounding is to
nearest even (XLA's convert).

Error of one quantised value v = q * scale (E4M3: 3 mantissa bits, smallest normal 2^-6, subnormal spacing
2^-9): for |v| >= 2^-6 scale the relative error is at most 2^-4 (half an ulp of 3 mantissa bits); below that
the absolute error is at most 2^-10 scale (half the subnormal spacing). So |v - w| <= max(2^-4 |w|, 2^-10 scale)
for every element, up to the f32 roundings of w / scale and q * scale; ``quantization_error_bound`` gives that
bound.

This module is pure JAX: it runs anywhere, and it is the oracle of the FP8 kernels to come. The FP8 grouped
GEMMs and the FP8 layer are not built yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BLOCK", "E4M3_MAX", "block_scaled_matmul", "dequantize_rows", "dequantize_weight_blocks",
           "quantization_error_bound", "quantize_rows", "quantize_weight_blocks"]

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


def _scale_of(amax: jax.Array) -> jax.Array:
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(_F32)


def _check(name: str, a, min_ndim: int) -> jax.Array:
    a = jnp.asarray(a)
    if a.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == _F8:
        raise TypeError(f"{name} must be a bf16/f16/f32 array to quantise, got {a.dtype}")
    return a


def quantize_weight_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w: [..., K, N] (e.g. gate_up [E, H, 2I] or down [E, I, H]) -> (q: float8_e4m3fn [..., K, N],
    scale: f32 [..., ceil(K/128), ceil(N/128)]) with w ~= q * scale of its 128 x 128 block."""
    w = _check("w", w, 2)
    *lead, k, n = w.shape
    wp = _pad_to_blocks(w.astype(_F32), (w.ndim - 2, w.ndim - 1))
    kb, nb = _blocks(k), _blocks(n)
    blocks = wp.reshape(*lead, kb, BLOCK, nb, BLOCK)
    scale = _scale_of(jnp.max(jnp.abs(blocks), axis=(-3, -1)))  # [..., kb, nb]
    q = jnp.clip(blocks / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(_F8)
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
    q = jnp.clip(tiles / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(_F8)
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
