"""The functional MoE op under one ``jax.custom_vjp``.

    y_t = shared(x_t) + sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(x_t)

``implementation="xla"`` runs the pure-JAX reference (``mok_jax.reference``); its backward is the
reference's VJP. ``implementation="mok"`` runs the forward as one CUDA megakernel per rank and call
(``mok_jax.ops.moe_forward``); its backward kernel is not built yet, so differentiating it raises a
clear error (it never falls back to another implementation).

Dtypes (checked at trace time, errors name the argument, the expected and the given dtype):

* ``x``: bf16 or f32; it is the compute dtype (matmul inputs, the SwiGLU activation) and the output's.
  ``implementation="mok"`` takes bf16 only.
* expert weights (``MoEWeights``): x's dtype, or f32 when x is bf16: f32 master weights are cast to bf16
  inside ``moe`` (their gradients come back in f32). A weight narrower than x (bf16 with f32 x) is an error.
* ``topk_weight``: f32 (bf16 is accepted and widened exactly); the weighted sum over the top-k slots runs
  in f32 whatever x's dtype, so an f32 router output keeps its precision in the bf16 path.
* ``topk_idx``: int32 global expert ids.

Routing values. An expert id of -1 marks a masked slot: it is skipped and its weight ignored (even a NaN
weight), on both implementations. Any other id outside [0, E) is invalid:

* concrete (not traced) ids are checked before tracing: ValueError;
* under ``jit`` both implementations give NaN rows for the affected tokens (every other row is computed
  as usual, never silently dropped), and report the first bad id through ``jax.experimental.checkify``
  (a ``checkify.debug_check``: free unless the caller checkifies, e.g.
  ``err, y = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(...); err.throw()``). The
  megakernel also records it for ``Workspace.check()`` (``InvalidRoutingError``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

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


def _invalid_ids(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """bool[T, k]: ids that are neither an expert in [0, num_experts) nor -1 (a masked slot)."""
    return (topk_idx < -1) | (topk_idx >= num_experts)


def _forward_xla(x, topk_idx, topk_weight, weights, config: MoEConfig):
    if config.ep_axis is None:
        y = reference.moe(x, topk_idx, topk_weight, weights)
    else:
        y = reference.ep_moe(x, topk_idx, topk_weight, weights, axis_name=config.ep_axis)
    # The reference sends an invalid id's slot nowhere (ids are global; dispatch skips them); the layer
    # makes that visible as the megakernel does: NaN rows for the tokens concerned, and only for them.
    bad_token = jnp.any(_invalid_ids(topk_idx, weights.num_local_experts * _ep_size(config)), axis=1)
    return jnp.where(bad_token[:, None], jnp.nan, y)


def _report_invalid_ids(topk_idx: jax.Array, num_experts: int) -> None:
    """A checkify-able report of the first invalid id (row-major), a no-op unless the caller checkifies.
    The row is an index into this call's tokens: inside shard_map the rank's own (checkify names the shard)."""
    bad = _invalid_ids(topk_idx, num_experts)
    first = jnp.argmax(bad.reshape(-1))
    k = topk_idx.shape[1]
    checkify.debug_check(
        ~jnp.any(bad), "mok_jax.moe: topk_idx[{}, {}] = {} is neither an expert id in [0, " + str(num_experts)
        + ") nor -1 (masked); that token's output row is NaN", first // k, first % k, topk_idx.reshape(-1)[first])


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

    x: bf16|f32[T, H]; topk_idx: int32[T, k] (global expert ids; -1 = masked slot); topk_weight: f32[T, k]
    (bf16 accepted); weights: MoEWeights in x's dtype, or f32 with bf16 x (routed weights are this rank's
    local experts when ``config.ep_axis`` is set). Returns [T, H] in x.dtype; NaN rows for tokens with an
    invalid expert id (module docstring). Differentiable w.r.t. x, topk_weight and every weight.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a mok_jax.MoEConfig, got {type(config).__name__}")
    x, topk_weight = jnp.asarray(x), jnp.asarray(topk_weight)
    topk_idx = jnp.asarray(topk_idx)
    ep = _ep_size(config)
    check_moe_args(x, topk_idx, topk_weight, weights, num_ep_ranks=ep)
    num_experts = weights.num_local_experts * ep
    check_routing_values(topk_idx, num_experts)
    if config.implementation == "mok":
        require_native("implementation='mok'")
        if x.dtype != jnp.bfloat16:
            raise TypeError(f"implementation='mok' runs in bfloat16: x is {x.dtype} (cast x, or use "
                            f"implementation='xla')")
    if isinstance(topk_idx, jax.core.Tracer):  # concrete ids were checked above
        _report_invalid_ids(topk_idx, num_experts)
    # Casts outside the custom_vjp, so that autodiff hands f32 master weights f32 gradients and a bf16
    # topk_weight a bf16 one; no-ops when the dtypes already match.
    weights = jax.tree.map(lambda w: w.astype(x.dtype), weights)
    return _moe(x, topk_idx, topk_weight.astype(jnp.float32), weights, config)
