"""Any EP size on one GPU: the megakernel's expert-parallel protocol with every rank on the same device.

docs/design.md, "EP on one GPU (emulation)": the kernels take their EP rank and peer table as parameters,
so ``ep`` ranks run against ``ep`` workspaces on one device, in one launch whose CTAs split into the
ranks. Everything of the real protocol runs (routing exchange, schedule, pull/push dispatch through the
peers' staging buffers, the ring, push/pull combine, the epoch-stamped flags, timeouts); only NVLink is
replaced by the device's own memory, so this checks correctness at any EP size, not NVLink speed.

    y, status = emulated_moe(x, topk_idx, topk_weight, weights, ep=4)   # x: [4 * T, H], weights: all E experts

Rank r holds tokens [r*T, (r+1)*T) and experts [r*E/ep, (r+1)*E/ep), as under ``expert_parallel_moe``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mok_jax import ops
from mok_jax._native import require_native
from mok_jax.config import KernelConfig
from mok_jax.validation import check_moe_args
from mok_jax.weights import MoEWeights
from mok_jax.workspace import Workspace, emulated_workspace

__all__ = ["emulated_moe"]


def emulated_moe(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, weights: MoEWeights, *, ep: int,
                 kernel: KernelConfig | None = None, workspace: Workspace | None = None, device: jax.Device | None = None,
                 identity_experts: bool = False, skip_rank: int = -1, timeout_s: float = 10.0,
                 num_sms: int = 0, timing_mode: int = 0) -> tuple[jax.Array, jax.Array]:
    """The layer forward at EP size ``ep``, every rank on one GPU (``device``, default the first GPU).

    x: bf16[ep * T, H]; topk_idx: int32[ep * T, k] (global ids, -1 = masked); topk_weight: f32[ep * T, k];
    weights: the global MoEWeights (gate_up [E, H, 2I] with E divisible by ep). Returns (y: bf16[ep * T, H],
    status: int32[ep, 4]) where rank r's tokens are rows [r*T, (r+1)*T). ``workspace``: an emulated one
    (default: cached per device, ep and shape); identity_experts, skip_rank: the kernel's test modes;
    timing_mode: its bench-only timing mode (ops.moe_forward).
    Jit-compatible when ``workspace`` is given or the shapes are static (the workspace is set up at trace time).
    """
    if not isinstance(ep, int) or not 1 <= ep <= 8:
        raise ValueError(f"ep must be an int in [1, 8] (ranks one emulated launch carries), got {ep!r}")
    x, topk_idx, topk_weight = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_weight)
    check_moe_args(x, topk_idx, topk_weight, weights, num_ep_ranks=1)
    num_experts = weights.num_local_experts
    if num_experts % ep:
        raise ValueError(f"the number of experts ({num_experts}) must be divisible by ep ({ep})")
    if x.shape[0] % ep:
        raise ValueError(f"x must hold ep * T tokens: {x.shape[0]} is not divisible by ep={ep}")
    if not -1 <= skip_rank < ep:
        raise ValueError(f"skip_rank must be -1 (none) or in [0, {ep}), got {skip_rank}")
    require_native("mok_jax.emulation.emulated_moe")
    tokens, H = x.shape[0] // ep, x.shape[1]
    k = topk_idx.shape[1]
    if device is None:
        device = next(d for d in jax.devices() if d.platform == "gpu")
    ws = workspace or emulated_workspace(device, ep, max_tokens=tokens, hidden_size=H, top_k=k,
                                         num_experts=num_experts, timeout_s=timeout_s)
    if not ws.emulated or ws.config.ep != ep:
        raise ValueError(f"workspace must be an emulated workspace of {ep} ranks, got {ws}")
    per_rank = lambda a: a.reshape(ep, a.shape[0] // ep, *a.shape[1:])
    y, status = ops.moe_forward(
        ws, per_rank(x).astype(jnp.bfloat16), per_rank(topk_idx), per_rank(topk_weight.astype(jnp.float32)),
        per_rank(weights.gate_up.astype(jnp.bfloat16)), per_rank(weights.down.astype(jnp.bfloat16)),
        None if weights.shared_gate_up is None else weights.shared_gate_up.astype(jnp.bfloat16),
        None if weights.shared_down is None else weights.shared_down.astype(jnp.bfloat16),
        kernel=kernel, identity_experts=identity_experts, skip_rank=skip_rank, num_sms=num_sms,
        timing_mode=timing_mode)
    return y.reshape(ep * tokens, H), status
