"""Running the layer over a device mesh: ``jax.shard_map`` over the expert-parallel axis.

Tokens are sharded over the token axes (by default every mesh axis: data axes and ``ep``); routed
expert weights are sharded over ``ep`` on their expert dimension (rank r holds experts
[r*E/ep, (r+1)*E/ep)); the shared expert is replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mok_jax.config import MoEConfig
from mok_jax.fp8 import Fp8ExpertWeights
from mok_jax.layer import check_workspace, moe, report_invalid_ids
from mok_jax.weights import MoEWeights

if TYPE_CHECKING:
    from mok_jax.workspace import Workspace

__all__ = ["expert_parallel_moe", "is_explicit", "place", "resolve_token_axes"]


def is_explicit(mesh: Mesh) -> bool:
    """True when every axis of ``mesh`` is Explicit (jax.make_mesh's default since jax 0.11)."""
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def place(a: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Lay ``a`` out as ``sharding`` eagerly or under jit, for meshes of Explicit or Auto axes."""
    if is_explicit(sharding.mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def resolve_token_axes(mesh: Mesh, ep_axis: str, token_axes: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The mesh axes tokens are sharded over (every axis unless ``token_axes`` names them), checked."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if ep_axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis named {ep_axis!r} (ep_axis); its axes are {mesh.axis_names}")
    token_axes = tuple(mesh.axis_names) if token_axes is None else tuple(token_axes)
    for a in token_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"token_axes names {a!r}, which is not an axis of the mesh {mesh.axis_names}")
    if ep_axis not in token_axes:
        raise ValueError(f"token_axes {token_axes} must include the expert-parallel axis {ep_axis!r}")
    return token_axes


def expert_parallel_moe(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weight: jax.Array,
    weights: MoEWeights,
    *,
    mesh: Mesh,
    config: MoEConfig = MoEConfig(ep_axis="ep"),
    token_axes: tuple[str, ...] | None = None,
    workspace: Workspace | None = None,
    fp8_weights: Fp8ExpertWeights | None = None,
) -> jax.Array:
    """The MoE layer on global arrays over ``mesh``, expert-parallel over ``config.ep_axis``.

    x: [T, H] (T divisible by the number of token shards), topk_idx: int32[T, k] with global expert
    ids, topk_weight: f32[T, k], weights: global MoEWeights (gate_up [E, H, 2I], E divisible by
    the ep size). Returns [T, H], sharded like x. fp8_weights (config.precision "fp8"): the E4M3 form of all
    E routed experts (mok_jax.fp8.quantize_expert_weights), sharded over the EP axis like gate_up; None: each
    rank quantises its experts in every call.

    workspace (config.implementation "mok"; ignored by "xla"): the megakernel's symmetric workspace over ``mesh``'s
    EP axis, ``mok_jax.workspace.moe_workspace(mesh, ep_axis, max_tokens=<tokens per rank>, ...)``, set up outside
    jit; None: the cached one of this mesh and shape, set up here (outside the shard_map body).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a mok_jax.MoEConfig, got {type(config).__name__}")
    check_workspace(workspace, "mok_jax.expert_parallel_moe")
    ep_axis = config.ep_axis or "ep"
    config = dataclasses.replace(config, ep_axis=ep_axis)
    axes = resolve_token_axes(mesh, ep_axis, token_axes)
    ep = mesh.shape[ep_axis]
    num_experts = weights.gate_up.shape[0]
    if num_experts % ep:
        raise ValueError(f"the number of experts ({num_experts}, weights.gate_up.shape[0]) must be divisible "
                         f"by the size of mesh axis {ep_axis!r} ({ep})")
    shards = math.prod(mesh.shape[a] for a in axes)
    if x.ndim != 2 or x.shape[0] % shards:
        raise ValueError(f"x must be [tokens, hidden] with tokens divisible by the {shards} token shards "
                         f"(mesh axes {axes}), got shape {x.shape}")
    if config.implementation == "mok" and workspace is None:
        from mok_jax._native import require_native
        from mok_jax.workspace import moe_workspace

        require_native("implementation='mok'")  # the workspace is set up here, outside the shard_map body
        workspace = moe_workspace(mesh, ep_axis, max_tokens=x.shape[0] // shards, hidden_size=x.shape[1],
                                  top_k=topk_idx.shape[1], num_experts=num_experts)
    tok = P(axes)
    shared = P() if weights.shared_gate_up is not None else None
    wspec = MoEWeights(P(ep_axis), P(ep_axis), shared, shared)

    args = (x, topk_idx, topk_weight, weights, fp8_weights)
    specs = (tok, tok, tok, wspec, None if fp8_weights is None else Fp8ExpertWeights(*[P(ep_axis)] * 4))
    args = jax.tree.map(lambda a, spec: place(a, NamedSharding(mesh, spec)), args, specs)
    # Invalid ids are reported after the shard_map, on the global ids, not by each rank inside it: the row is then
    # the caller's, and a checkify error that went through a shard_map over Explicit axes cannot be read (checkify's
    # own reduction of it raises ShardingTypeError in jax 0.11: docs/errors.md).
    report = config.checkify_ids and isinstance(args[1], jax.core.Tracer)
    config = dataclasses.replace(config, checkify_ids=False)
    body = jax.shard_map(
        lambda x, i, w, W, W8: moe(x, i, w, W, config=config, workspace=workspace, fp8_weights=W8), mesh=mesh,
        in_specs=specs, out_specs=tok)
    y = body(*args)
    if report:
        report_invalid_ids(args[1], num_experts)
    return y
