"""Router: scores, top-k, normalisation (ordinary JAX; the kernel takes its outputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["route"]


def route(
    logits: jax.Array,
    *,
    top_k: int,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    selection_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pick ``top_k`` experts per token.

    logits: f32[T, E]. selection_bias: optional f32[E] added to the scores for *selection only*
    (DeepSeek-V3's auxiliary-loss-free balancing); the weights use the unbiased scores.
    Returns topk_idx: int32[T, k] and topk_weight: f32[T, k].
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    logits = logits.astype(jnp.float32)
    if score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    choice = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
    _, topk_idx = jax.lax.top_k(choice, top_k)
    topk_weight = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if norm_topk_prob:
        topk_weight = topk_weight / jnp.sum(topk_weight, axis=-1, keepdims=True)
    topk_weight = topk_weight * routed_scaling_factor
    return topk_idx.astype(jnp.int32), topk_weight
