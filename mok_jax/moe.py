"""The functional MoE op under one ``jax.custom_vjp``.

    y_t = shared(x_t) + sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x_t)

``implementation="xla"`` runs the pure-JAX reference (``mok_jax.reference``); its backward is the
reference's VJP. ``implementation="mok"`` is the CUDA megakernel; until it lands it raises a clear
error and never falls back to another implementation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import reference
from mok_jax._native import require_native
from mok_jax.config import MoEConfig
from mok_jax.validation import check_moe_args, check_routing_values
from mok_jax.weights import MoEWeights

__all__ = ["moe"]


class MoEResiduals(NamedTuple):
    """What the backward pass keeps from the forward pass (the reference recomputes the rest)."""

    x: jax.Array
    topk_idx: jax.Array
    topk_weight: jax.Array
    weights: MoEWeights


def _ep_size(config: MoEConfig) -> int:
    if config.ep_axis is None:
        return 1
    try:
        return jax.lax.axis_size(config.ep_axis)
    except NameError as e:
        raise ValueError(
            f"MoEConfig.ep_axis={config.ep_axis!r} is not a mesh axis bound here: call moe inside "
            f"jax.shard_map over a mesh with that axis (mok_jax.expert_parallel_moe does this), or set ep_axis=None"
        ) from e


def _forward_xla(x, topk_idx, topk_weight, weights, config: MoEConfig):
    if config.ep_axis is None:
        return reference.moe(x, topk_idx, topk_weight, weights)
    return reference.ep_moe(x, topk_idx, topk_weight, weights, axis_name=config.ep_axis)


def _forward(x, topk_idx, topk_weight, weights, config: MoEConfig):
    if config.implementation == "mok":
        require_native("implementation='mok'")
        raise NotImplementedError(
            "implementation='mok': the fused megakernel is not part of this build yet (its grouped-GEMM and "
            "communication parts are standalone ops in mok_jax.ops); use implementation='xla'"
        )
    return _forward_xla(x, topk_idx, topk_weight, weights, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _moe(x, topk_idx, topk_weight, weights, config):
    return _forward(x, topk_idx, topk_weight, weights, config)


def _moe_fwd(x, topk_idx, topk_weight, weights, config):
    y = _forward(x, topk_idx, topk_weight, weights, config)
    return y, MoEResiduals(x, topk_idx, topk_weight, weights)


def _moe_bwd(config, residuals, dy):
    _, vjp = jax.vjp(
        lambda x, w, W: _forward_xla(x, residuals.topk_idx, w, W, config),
        residuals.x, residuals.topk_weight, residuals.weights,
    )
    dx, dw, dW = vjp(dy)
    d_idx = np.zeros(residuals.topk_idx.shape, jax.dtypes.float0)
    return dx, d_idx, dw, dW


_moe.defvjp(_moe_fwd, _moe_bwd)


def moe(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weight: jax.Array,
    weights: MoEWeights,
    *,
    config: MoEConfig = MoEConfig(),
) -> jax.Array:
    """The MoE layer on one rank's tokens.

    x: bf16|f32[T, H]; topk_idx: int32[T, k] (global expert ids); topk_weight: f32[T, k];
    weights: MoEWeights (routed weights are this rank's local experts when ``config.ep_axis`` is set).
    Returns [T, H] in x.dtype. Differentiable w.r.t. x, topk_weight and every weight.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a mok_jax.MoEConfig, got {type(config).__name__}")
    x, topk_weight = jnp.asarray(x), jnp.asarray(topk_weight)
    topk_idx = jnp.asarray(topk_idx)
    ep = _ep_size(config)
    check_moe_args(x, topk_idx, topk_weight, weights, num_ep_ranks=ep)
    check_routing_values(topk_idx, weights.num_local_experts * ep)
    # Weights are cast (not checked) so that an f32 router weight works in the bf16 path.
    return _moe(x, topk_idx, topk_weight.astype(jnp.float32), weights, config)
