"""The functional MoE op under one ``jax.custom_vjp``.

    y_t = shared(x_t) + sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x_t)

``implementation="xla"`` runs the pure-JAX reference (``mok_jax.reference``); its backward is the
reference's VJP. ``implementation="mok"`` runs the forward as one CUDA megakernel per rank and call
(``mok_jax.ops.moe_forward``); its backward kernel is not built yet, so differentiating it raises a
clear error (it never falls back to another implementation). An expert id of -1 marks a masked slot:
it is skipped and its weight ignored.
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


def _forward_mok(x, topk_idx, topk_weight, weights: MoEWeights, config: MoEConfig):
    """moe() checked the arguments (bf16 x; every weight in x's dtype) and that the kernels are here."""
    from mok_jax import ops
    from mok_jax.workspace import local_workspace

    ep = _ep_size(config)
    tokens, k = topk_idx.shape
    num_experts = weights.num_local_experts * ep
    ws = config.workspace
    if ws is None:
        if config.ep_axis is not None:
            raise ValueError(
                f"implementation='mok' inside shard_map over {config.ep_axis!r} needs the layer's workspace: "
                f"call mok_jax.expert_parallel_moe, or pass MoEConfig(workspace=mok_jax.workspace.moe_workspace("
                f"mesh, {config.ep_axis!r}, ...)) created outside jit")
        ws = local_workspace(max_tokens=tokens, hidden_size=x.shape[1], top_k=k, num_experts=num_experts)
    if ws.config.ep != ep:
        raise ValueError(f"MoEConfig.workspace spans {ws.config.ep} EP ranks, the mesh axis {config.ep_axis!r} {ep}")
    y, _ = ops.moe_forward(ws, x[None], topk_idx[None], topk_weight[None], weights.gate_up[None],
                           weights.down[None], weights.shared_gate_up, weights.shared_down, kernel=config.kernel)
    return y[0]


def _forward(x, topk_idx, topk_weight, weights, config: MoEConfig):
    if config.implementation == "mok":
        return _forward_mok(x, topk_idx, topk_weight, weights, config)
    return _forward_xla(x, topk_idx, topk_weight, weights, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _moe(x, topk_idx, topk_weight, weights, config):
    return _forward(x, topk_idx, topk_weight, weights, config)


def _moe_fwd(x, topk_idx, topk_weight, weights, config):
    y = _forward(x, topk_idx, topk_weight, weights, config)
    return y, MoEResiduals(x, topk_idx, topk_weight, weights)


def _moe_bwd(config, residuals, dy):
    if config.implementation == "mok":
        raise NotImplementedError(
            "differentiating implementation='mok': the backward megakernel is not built yet, and mok never "
            "falls back to another implementation silently; use implementation='xla' to train for now")
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
    if config.implementation == "mok":
        require_native("implementation='mok'")
        if x.dtype != jnp.bfloat16:  # check_moe_args holds every weight to x's dtype
            raise TypeError(f"implementation='mok' runs in bfloat16: x is {x.dtype} (cast x and the weights, or use "
                            f"implementation='xla')")
    # Weights are cast (not checked) so that an f32 router weight works in the bf16 path.
    return _moe(x, topk_idx, topk_weight.astype(jnp.float32), weights, config)
