"""Flax modules of the MoE layer: ``MoELayer`` (NNX) and ``LinenMoELayer`` (a thin Linen wrapper).

The module holds the router, the routed experts (partitioned over ``ep`` on the expert dimension)
and the shared expert (replicated), routes in ordinary JAX, and calls ``mok_jax.moe`` through
``expert_parallel_moe`` when given a mesh, or on one device otherwise.

Dtypes: parameters are stored in ``param_dtype`` (f32 master weights by default); each call casts the
expert weights and x to ``dtype`` (the compute dtype, bf16 by default) and routes in f32 (f32 logits
from f32 x and router weights, f32 topk_weight). The output is in ``dtype``.

Workspace (``implementation="mok"`` only): the megakernel's symmetric workspace, a runtime resource the module
holds beside its static MoEConfig (``layer.workspace``), is set up outside jit, at construction when
``max_tokens`` is given, else by ``setup_workspace(max_tokens)`` or by the first call made outside jit; or the
caller passes its own (``workspace=``). A jitted call of a layer without one (or with one too small for the call) raises
a ValueError saying so; it never allocates device memory while tracing. Where the kernels cannot run (no GPU, or
no native library), every call, jitted or not, raises NativeLibraryUnavailable saying why.
``implementation="xla"`` never needs or creates a workspace.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx import bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mok_jax.config import KernelConfig, ModelShape, MoEConfig
from mok_jax.layer import check_workspace, moe
from mok_jax.reference.router import route
from mok_jax.sharding import expert_parallel_moe, is_explicit, resolve_token_axes
from mok_jax.weights import MoEWeights

if TYPE_CHECKING:
    from mok_jax.workspace import Workspace

__all__ = ["LinenMoELayer", "MoELayer", "RouterBias", "load_balancing_loss"]


class RouterBias(nnx.Variable):
    """Selection bias of auxiliary-loss-free balancing (updated by the user, not by gradients)."""


def load_balancing_loss(probs: jax.Array, topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Switch/GShard auxiliary loss: num_experts * sum_e f_e * P_e, where f_e is the fraction of
    routed slots that chose expert e and P_e the mean router probability of e. probs: f32[T, E]."""
    f = jnp.mean(jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.float32).sum(1), axis=0) / topk_idx.shape[1]
    p = jnp.mean(probs, axis=0)
    return num_experts * jnp.sum(f * p)


def _param(rngs: nnx.Rngs, shape, fan_in: int, dtype, names, mesh: Mesh | None) -> nnx.Param:
    # One jitted init with or without a mesh: XLA may fuse the scaling into the normal's arithmetic, so an eager
    # init and a jitted one can differ in the last bit (seen on an H200: a layer on a 1-device mesh routed 2% of y's
    # elements an ulp away from the same layer without one).
    init = lambda key: jax.random.normal(key, shape, dtype) * (fan_in ** -0.5)  # noqa: E731
    if mesh is None:
        return nnx.Param(jax.jit(init)(rngs.params()), out_sharding=names, eager_sharding=False)
    value = jax.jit(init, out_shardings=NamedSharding(mesh, P(*names)))(rngs.params())
    return nnx.Param(value, out_sharding=names, mesh=mesh)


class MoELayer(nnx.Module):
    """The MoE block of ``shape``: x [..., H] -> [..., H].

    mesh / ep_axis: run expert-parallel over ``ep_axis`` of ``mesh`` (tokens sharded over every mesh
        axis unless ``token_axes`` says otherwise); without a mesh every expert is local.
    implementation: "xla" (pure JAX) or "mok" (the CUDA megakernel).
    kernel: the megakernel's KernelConfig (None: tuned table or heuristic); ignored by "xla".
    keep: "mok" only: what the forward keeps for the backward (MoEConfig.keep: "nothing", "ring", "balanced" or
        "everything"; None, the default: "balanced" in bf16, "nothing" in fp8).
    precision: "mok" only: "bf16" or "fp8" routed experts in the forward (MoEConfig.precision; the E4M3 weights are
        quantised from the parameters in every call, which is once per optimizer step without accumulation).
    max_tokens: "mok" only: the most tokens one call takes (x's leading dimensions flattened, over the
        whole mesh); given, the workspace is set up here, at construction (module docstring).
    workspace: "mok" only: a workspace the caller set up outside jit, used instead of one of the layer's own:
        ``mok_jax.workspace.moe_workspace(mesh, ep_axis, max_tokens=<tokens per rank>, ...)``, or
        ``local_workspace(...)`` without a mesh. A call it cannot hold sets up a larger one, as without it. The
        layer's workspace is ``layer.workspace``, beside its static ``layer.config``.
    checkify_ids: report an invalid expert id through jax.experimental.checkify (MoEConfig.checkify_ids); False to
        export the layer with jax.export, which cannot serialize the check's effect.
    dtype: compute dtype of x and the expert weights (bf16 or f32); param_dtype: storage dtype.
    use_selection_bias: add a RouterBias (auxiliary-loss-free balancing) to expert selection.
    """

    def __init__(
        self,
        shape: ModelShape,
        *,
        mesh: Mesh | None = None,
        ep_axis: str = "ep",
        token_axes: tuple[str, ...] | None = None,
        implementation: str = "xla",
        kernel: KernelConfig | None = None,
        keep: str | None = None,
        precision: str = "bf16",
        max_tokens: int | None = None,
        workspace: Workspace | None = None,
        checkify_ids: bool = True,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.float32,
        use_selection_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        if not isinstance(shape, ModelShape):
            raise TypeError(f"shape must be a mok_jax.ModelShape, got {type(shape).__name__}")
        self.shape = shape
        self.mesh, self.ep_axis, self.dtype = mesh, ep_axis, dtype
        self.token_axes = token_axes if mesh is None else resolve_token_axes(mesh, ep_axis, token_axes)
        if mesh is not None:
            if shape.num_experts % mesh.shape[ep_axis]:
                raise ValueError(f"shape.num_experts ({shape.num_experts}) must be divisible by the size of mesh "
                                 f"axis {ep_axis!r} ({mesh.shape[ep_axis]})")
        self.config = MoEConfig(implementation=implementation, ep_axis=ep_axis if mesh is not None else None,
                                kernel=kernel, keep=keep, precision=precision, checkify_ids=checkify_ids)
        check_workspace(workspace, "MoELayer")
        ep = 1 if mesh is None else mesh.shape[ep_axis]
        if workspace is not None and workspace.config.ep != ep:
            raise ValueError(f"MoELayer: workspace spans {workspace.config.ep} EP ranks; the layer runs on {ep} "
                             f"({'no mesh' if mesh is None else f'mesh axis {ep_axis!r}'})")
        self.workspace = workspace  # the runtime resource beside the static config
        E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size
        self.router = _param(rngs, (H, E), H, param_dtype, (None, None), mesh)
        self.gate_up = _param(rngs, (E, H, 2 * I), H, param_dtype, (ep_axis, None, None), mesh)
        self.down = _param(rngs, (E, I, H), I, param_dtype, (ep_axis, None, None), mesh)
        if shape.shared_size:
            Is = shape.shared_size
            self.shared_gate_up = _param(rngs, (H, 2 * Is), H, param_dtype, (None, None), mesh)
            self.shared_down = _param(rngs, (Is, H), Is, param_dtype, (None, None), mesh)
        else:
            self.shared_gate_up = self.shared_down = None
        self.selection_bias = RouterBias(jnp.zeros((E,), jnp.float32)) if use_selection_bias else None
        if max_tokens is not None:
            self.setup_workspace(max_tokens)

    def _token_shards(self) -> int:
        """The shards a call's tokens split into: the product of the token axes' sizes (1 without a mesh)."""
        return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.token_axes)

    def _per_rank(self, num_tokens: int) -> int:
        """Tokens per rank of a call of ``num_tokens`` tokens (what a workspace is sized by)."""
        return -(-num_tokens // self._token_shards())

    def _workspace_holds(self, num_tokens: int) -> bool:
        ws = self.workspace
        return ws is not None and not ws.closed and ws.config.max_tokens >= self._per_rank(num_tokens)

    def setup_workspace(self, max_tokens: int) -> None:
        """Set up (outside jit) the megakernel's workspace for calls of up to ``max_tokens`` tokens (x's
        leading dimensions flattened). A no-op for implementation="xla", and when the workspace it has
        already holds that many. Raises NativeLibraryUnavailable where the kernels cannot run."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if self.config.implementation != "mok" or self._workspace_holds(max_tokens):
            return
        from mok_jax import workspace
        from mok_jax._native import require_native

        require_native("MoELayer(implementation='mok')")
        s = self.shape
        size = dict(max_tokens=self._per_rank(max_tokens), hidden_size=s.hidden_size, top_k=s.top_k,
                    num_experts=s.num_experts)
        if self.mesh is None:
            ws = workspace.local_workspace(**size)
        else:
            ws = workspace.moe_workspace(self.mesh, self.ep_axis, **size)
        self.workspace = ws

    def _require_workspace(self, x: jax.Array, num_tokens: int) -> None:
        """implementation="mok": make sure the workspace holds ``num_tokens``; set it up if outside jit."""
        if self.config.implementation != "mok" or self._workspace_holds(num_tokens):
            return
        tracing = any(isinstance(a, jax.core.Tracer) for a in (x, self.gate_up[...]))
        if not tracing:
            self.setup_workspace(num_tokens)
            return
        from mok_jax._native import require_native

        require_native("MoELayer(implementation='mok')")  # where the kernels cannot run, no workspace would help
        ws = self.workspace
        if ws is None:
            why = "has no workspace"
        elif ws.closed:
            why = f"has a closed workspace ({ws!r})"
        else:
            why = (f"has a workspace for {ws.config.max_tokens} tokens per rank; this call of {num_tokens} "
                   f"tokens needs {self._per_rank(num_tokens)}")
        raise ValueError(
            f"MoELayer(implementation='mok') {why}: the workspace is set up outside jit, never while tracing. "
            f"Pass max_tokens=<the most tokens a call takes> (here at least {num_tokens}) when constructing the "
            f"layer, or call layer.setup_workspace({num_tokens}) outside jit before the first jitted call")

    def weights(self) -> MoEWeights:
        """The expert weights in the compute dtype."""
        cast = lambda p: None if p is None else p[...].astype(self.dtype)
        return MoEWeights(cast(self.gate_up), cast(self.down), cast(self.shared_gate_up), cast(self.shared_down))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, H] -> (topk_idx int32[T, k], topk_weight f32[T, k], probs f32[T, E])."""
        s = self.shape
        logits = jnp.einsum("th,he->te", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = None if self.selection_bias is None else self.selection_bias[...]
        idx, w = route(logits, top_k=s.top_k, score_func=s.score_func, norm_topk_prob=s.norm_topk_prob,
                       routed_scaling_factor=s.routed_scaling_factor, selection_bias=bias)
        probs = jax.nn.softmax(logits, -1) if s.score_func == "softmax" else jax.nn.sigmoid(logits)
        return idx, w, probs

    def _unflatten(self, y: jax.Array, lead: tuple[int, ...]) -> jax.Array:
        """[T, H] -> [*lead, H]. On a mesh of Explicit axes the result keeps the token sharding on the
        leading dimension when it divides evenly, else it is replicated."""
        mesh = self.mesh
        if mesh is None or not is_explicit(mesh):
            return y.reshape(*lead, y.shape[-1])
        axes = self.token_axes
        shards = math.prod(mesh.shape[a] for a in axes)
        first = axes if lead and lead[0] % shards == 0 else None
        spec = P(first, *([None] * len(lead)))
        if first is None:
            y = jax.sharding.reshard(y, NamedSharding(mesh, P()))
        return jax.lax.reshape(y, (*lead, y.shape[-1]), out_sharding=NamedSharding(mesh, spec))

    def _experts(self, tokens: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
        """The routed and shared experts and the combine of the routed tokens [T, H] -> [T, H]."""
        if self.mesh is None:
            return moe(tokens, idx, w, self.weights(), config=self.config, workspace=self.workspace)
        return expert_parallel_moe(tokens, idx, w, self.weights(), mesh=self.mesh, config=self.config,
                                   token_axes=self.token_axes, workspace=self.workspace)

    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        if x.shape[-1] != self.shape.hidden_size:
            raise ValueError(f"x must end in hidden_size={self.shape.hidden_size}, got shape {x.shape}")
        lead = x.shape[:-1]
        num_tokens = math.prod(lead)
        if num_tokens % (shards := self._token_shards()):
            raise ValueError(f"x: its {num_tokens} tokens (x.shape {x.shape}, the leading dimensions flattened) "
                             f"must be divisible by the {shards} token shards (mesh axes {self.token_axes})")
        self._require_workspace(x, num_tokens)
        tokens = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        idx, w, probs = self.route(tokens)
        y = self._unflatten(self._experts(tokens, idx, w), lead)
        if return_aux_loss:
            return y, load_balancing_loss(probs, idx, self.shape.num_experts)
        return y


class LinenMoELayer(linen.Module):
    """Linen wrapper of ``MoELayer``: the same arguments (every one of ``MoELayer.__init__`` but ``rngs``,
    forwarded as is) and the same call. Parameters live in the 'params' collection, the RouterBias
    (``use_selection_bias``) in its own collection, under the submodule 'moe'.

    implementation="mok": the inner MoELayer is built again at every ``init``/``apply`` (Linen keeps no
    module objects), so pass ``max_tokens``: each build then finds the workspace that the first one set
    up (cached per mesh and shape); call ``init`` outside jit so that this first one is not under jit.
    """

    shape: ModelShape
    mesh: Mesh | None = None
    ep_axis: str = "ep"
    token_axes: tuple[str, ...] | None = None
    implementation: str = "xla"
    kernel: KernelConfig | None = None
    keep: str | None = None
    precision: str = "bf16"
    max_tokens: int | None = None
    workspace: Workspace | None = None
    checkify_ids: bool = True
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    use_selection_bias: bool = False

    @linen.compact
    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        kwargs = {name: getattr(self, name) for name in _linen_forwarded()}
        layer = bridge.to_linen(MoELayer, self.shape, **kwargs, name="moe")
        return layer(x, return_aux_loss=return_aux_loss)


def _linen_forwarded() -> tuple[str, ...]:
    """The keyword arguments of MoELayer.__init__ that LinenMoELayer forwards: all but ``rngs``."""
    params = inspect.signature(MoELayer.__init__).parameters
    return tuple(n for n, p in params.items() if p.kind == p.KEYWORD_ONLY and n != "rngs")
