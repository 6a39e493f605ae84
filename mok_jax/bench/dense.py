"""The practical limit of the layer on one GPU: its FLOPs as dense SwiGLU FFNs (cuBLAS through XLA).

No grouping, no routing, no data movement: the T k routed slots of a rank become T k rows of ONE dense FFN with
one weight pair [H, 2I], [I, H], and the shared expert's T rows join them when its intermediate size is the routed
experts' (every benchmark model: one shared expert of the same size), else they are a second dense FFN:

    g | u = x W_gu;  h = silu(g) u;  y = h W_d        (bf16 matmul outputs, f32 accumulation inside the GEMM)

Its forward has the layer's forward FLOPs (2 T (k I + Is) 3 H) and its fwd+bwd, differentiated by XLA (which
keeps g | u in bf16 for the backward), the layer's 3x. This is the ``dense`` row of mok-bench and of
``mok_jax.bench.backward``: a time ratio to it ("x dense") says how far the layer is from the rate the card
sustains on its own FLOPs, under the same power cap in the same process.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["DenseProblem", "dense_ffn", "dense_groups", "dense_problem", "dense_step"]


def dense_groups(tokens: int, top_k: int, intermediate: int,
                 shared_intermediate: int = 0) -> tuple[tuple[int, int], ...]:
    """The dense FFNs of a rank's forward FLOPs: ((rows, intermediate size), ...). One FFN over T k (+ T) rows when
    the shared expert (if any) has the routed intermediate size, else a second one over the T tokens."""
    if min(tokens, top_k, intermediate) <= 0 or shared_intermediate < 0:
        raise ValueError(f"dense_groups: tokens, top_k and intermediate must be positive and shared_intermediate "
                         f">= 0, got {tokens}, {top_k}, {intermediate}, {shared_intermediate}")
    if shared_intermediate == intermediate:
        return ((tokens * (top_k + 1), intermediate),)
    groups = [(tokens * top_k, intermediate)]
    if shared_intermediate:
        groups.append((tokens, shared_intermediate))
    return tuple(groups)


def dense_ffn(x: jax.Array, w_gu: jax.Array, w_dn: jax.Array) -> jax.Array:
    """y = (silu(g) u) W_d with g | u = x W_gu: x [R, H], w_gu [H, 2I], w_dn [I, H] in one dtype; bf16 GEMM
    outputs (the einsums' default: f32 accumulation inside the GEMM), SwiGLU in f32, h rounded to x's dtype."""
    g, u = jnp.split(jnp.einsum("rh,hn->rn", x, w_gu), 2, axis=-1)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("ri,ih->rh", h, w_dn)


class DenseProblem(NamedTuple):
    """Per dense FFN its rows x [R, H], its (w_gu [H, 2I], w_dn [I, H]) and a cotangent dy [R, H]."""

    xs: tuple
    weights: tuple
    dys: tuple


def dense_problem(groups, hidden: int, *, dtype=jnp.bfloat16, seed: int = 0, device=None) -> DenseProblem:
    """Random (never zero) rows, weights (scaled by fan-in, as the layer's bench weights) and cotangents for
    ``groups`` (``dense_groups``), made on ``device`` (default: the first)."""
    key = jax.random.key(seed + 7)
    xs, ws, dys = [], [], []
    for i, (rows, inter) in enumerate(groups):
        kx, kg, kd, ky = jax.random.split(jax.random.fold_in(key, i), 4)
        normal = lambda k, s, fan_in: (jax.random.normal(k, s, jnp.float32) * fan_in ** -0.5).astype(dtype)
        xs.append(normal(kx, (rows, hidden), 1.0))
        ws.append((normal(kg, (hidden, 2 * inter), hidden), normal(kd, (inter, hidden), inter)))
        dys.append(normal(ky, (rows, hidden), 1.0))
    problem = DenseProblem(tuple(xs), tuple(ws), tuple(dys))
    return jax.device_put(problem, device or jax.devices()[0])


def dense_step(pass_: str):
    """The jitted step mok-bench times for ``pass_``: fwd(xs, weights) -> ys; fwd+bwd(xs, weights, dys) -> the
    gradient of sum_i sum(y_i dy_i) with respect to every x and weight (what the layer's fwd+bwd step computes)."""
    def forward(xs, ws):
        return tuple(dense_ffn(x, *w) for x, w in zip(xs, ws))

    if pass_ == "fwd":
        return jax.jit(forward)
    if pass_ != "fwd+bwd":
        raise ValueError(f"pass must be 'fwd' or 'fwd+bwd', got {pass_!r}")

    def loss(xs, ws, dys):
        return sum(jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) for y, dy in zip(forward(xs, ws), dys))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))
