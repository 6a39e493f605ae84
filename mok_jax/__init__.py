"""mok_jax: an expert-parallel Mixture-of-Experts layer for JAX (dispatch, shared and routed expert
FFNs and combine in one deterministic CUDA megakernel), with a pure-JAX reference path.

Public API: ``moe`` (functional op), ``MoEConfig``/``KernelConfig``/``ModelShape`` (static config),
``MoEWeights`` (weights pytree), ``load_model``/``list_models`` (model shapes), ``ep_moe`` /
``expert_parallel_moe`` (under ``shard_map``), ``mok_jax.flax`` (Flax modules), ``mok_jax.reference``.
"""

from mok_jax.config import KernelConfig, ModelShape, MoEConfig, list_models, load_model
from mok_jax.layer import moe
from mok_jax.reference import ep_moe
from mok_jax.sharding import expert_parallel_moe
from mok_jax.weights import MoEWeights

__all__ = [
    "KernelConfig", "ModelShape", "MoEConfig", "MoEWeights", "ep_moe", "expert_parallel_moe", "list_models",
    "load_model", "moe",
]
__version__ = "0.1.0"
