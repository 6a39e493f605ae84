"""Trace-time checks of the layer's arguments. Every error names the argument, what was expected and
what it got.

The dtype rule of ``mok_jax.moe`` (its docstring says why):

* x: bfloat16 or float32; it sets the compute and output dtype.
* every expert weight: x's dtype, or float32 when x is bfloat16 (float32 master weights, cast to
  bfloat16 inside ``moe``); never narrower than x.
* topk_weight: float32 (bfloat16 is accepted and widened exactly: the weighted sum runs in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax.weights import MoEWeights

__all__ = ["KEPT_GU_DTYPE", "check_experts_backward_args", "check_fp8_expert_weights", "check_fp8_weights",
           "check_kept_gu", "check_moe_args", "check_routing_values", "check_workspace_call"]

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float32)
# What the kernels' backward stores g, u in (kept by the forward, or recomputed by the op): the compute dtype, its
# fp32 accumulators rounded once, half the bytes of fp32 through HBM and the SwiGLU epilogue's stage ring. (The
# pure-JAX reference takes g, u in its inputs' dtype: f32 with f32 inputs.)
KEPT_GU_DTYPE = jnp.bfloat16


def _is_float(dtype) -> bool:
    return any(dtype == d for d in _FLOAT_DTYPES)


def _check_weight_dtype(name: str, w, x_dtype) -> None:
    if w.dtype == x_dtype or (x_dtype == jnp.bfloat16 and w.dtype == jnp.float32):
        return
    allowed = "bfloat16 (x's dtype) or float32 (master weights, cast to bfloat16)" if x_dtype == jnp.bfloat16 \
        else f"{jnp.dtype(x_dtype).name} (x's dtype)"
    raise TypeError(f"{name} must be {allowed}, got {w.dtype}")


def check_moe_args(x, topk_idx, topk_weight, weights, *, num_ep_ranks: int = 1) -> None:
    """Shapes and dtypes of one rank's arguments to ``moe``. Raises ValueError or TypeError."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a mok_jax.MoEWeights, got {type(weights).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x must be rank 2 [tokens, hidden], got shape {x.shape}")
    if not _is_float(x.dtype):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    num_tokens, hidden = x.shape
    if topk_idx.ndim != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be [tokens={num_tokens}, top_k], got shape {topk_idx.shape}")
    if topk_idx.dtype != jnp.int32:
        raise TypeError(f"topk_idx must be int32, got {topk_idx.dtype}")
    top_k = topk_idx.shape[1]
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(f"topk_weight must have the shape of topk_idx {topk_idx.shape}, got {topk_weight.shape}")
    if not _is_float(topk_weight.dtype):
        raise TypeError(f"topk_weight must be float32 (bfloat16 is widened to float32), got {topk_weight.dtype}")

    gu, dn = weights.gate_up, weights.down
    if gu.ndim != 3 or gu.shape[2] % 2:
        raise ValueError(f"weights.gate_up must be [experts, hidden, 2*intermediate], got {gu.shape}")
    if gu.shape[1] != hidden:
        raise ValueError(f"x must be [tokens, hidden={gu.shape[1]}] (the hidden size of weights.gate_up "
                         f"{gu.shape}), got x of shape {x.shape}: hidden size {hidden}")
    num_local, inter = gu.shape[0], gu.shape[2] // 2
    if dn.shape != (num_local, inter, hidden):
        raise ValueError(f"weights.down must be [experts={num_local}, intermediate={inter}, hidden={hidden}], "
                         f"got {dn.shape}")
    for name, w in (("weights.gate_up", gu), ("weights.down", dn)):
        _check_weight_dtype(name, w, x.dtype)
    if (weights.shared_gate_up is None) != (weights.shared_down is None):
        raise ValueError("weights.shared_gate_up and weights.shared_down must both be given or both be None")
    if weights.shared_gate_up is not None:
        sgu, sdn = weights.shared_gate_up, weights.shared_down
        if sgu.ndim != 2 or sgu.shape[0] != hidden or sgu.shape[1] % 2:
            raise ValueError(f"weights.shared_gate_up must be [hidden={hidden}, 2*shared_intermediate], got {sgu.shape}")
        if sdn.shape != (sgu.shape[1] // 2, hidden):
            raise ValueError(f"weights.shared_down must be [{sgu.shape[1] // 2}, {hidden}], got {sdn.shape}")
        for name, w in (("weights.shared_gate_up", sgu), ("weights.shared_down", sdn)):
            _check_weight_dtype(name, w, x.dtype)
    num_experts = num_local * num_ep_ranks
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}, from topk_idx) must not exceed the number of experts ({num_experts})")


def check_routing_values(topk_idx, num_experts: int) -> None:
    """When ``topk_idx`` holds concrete values (not traced), check that each row names distinct
    experts in [0, num_experts), or -1 (a masked slot, skipped; it may repeat). Traced values cannot be
    checked at trace time: ``mok_jax.moe`` gives their tokens NaN rows and reports them through
    ``jax.experimental.checkify`` (and the megakernel through ``Workspace.check``)."""
    if isinstance(topk_idx, jax.core.Tracer):
        return
    idx = np.asarray(topk_idx)
    if idx.size == 0:
        return
    if idx.min() < -1 or idx.max() >= num_experts:
        raise ValueError(f"topk_idx values must be in [0, {num_experts}) or -1 (masked), got min {idx.min()} "
                         f"max {idx.max()}")
    sorted_idx = np.sort(idx, axis=1)
    if np.any((sorted_idx[:, 1:] == sorted_idx[:, :-1]) & (sorted_idx[:, 1:] >= 0)):
        raise ValueError("topk_idx must name distinct experts within each token's row")


def check_expert_weights(gate_up, down, num_experts: int, hidden: int, *, max_experts: int | None = None,
                         prefix: str = "") -> int:
    """The routed weights of the grouped ops: gate_up [E, H, 2I] and down [E, I, H] for E experts (from
    group_sizes) and hidden size H (from x), H and I multiples of 8 (16-byte rows for TMA). Returns I; errors
    name the argument (after ``prefix``)."""
    if gate_up.shape[0] != num_experts or gate_up.shape[1] != hidden or gate_up.shape[2] % 2:
        raise ValueError(f"{prefix}gate_up must be [E, H, 2I] = [{num_experts}, {hidden}, 2I] (E from group_sizes, "
                         f"H from x), got {gate_up.shape}")
    inter = gate_up.shape[2] // 2
    if down.shape != (num_experts, inter, hidden):
        raise ValueError(f"{prefix}down must be [E, I, H] = {(num_experts, inter, hidden)}, got {down.shape}")
    if num_experts < 1 or (max_experts is not None and num_experts > max_experts):
        raise ValueError(f"{prefix}group_sizes: the number of experts must be in [1, {max_experts or 'inf'}], "
                         f"got {num_experts}")
    if hidden <= 0 or hidden % 8:
        raise ValueError(f"{prefix}x: hidden size H must be a positive multiple of 8 (16-byte rows for TMA), "
                         f"got {hidden}")
    if inter <= 0 or inter % 8:
        raise ValueError(f"{prefix}gate_up: intermediate size I must be a positive multiple of 8, got {inter}")
    return inter


def check_fp8_expert_weights(w, num_experts: int, hidden: int, *, max_experts: int | None = None,
                             name: str = "weights", source: str = "E from group_sizes, H from x") -> int:
    """Routed weights in the FP8 kernels' form (mok_jax.fp8.Fp8ExpertWeights from quantize_expert_weights) for E
    experts and hidden size H: E4M3 values, K-major ([E, 2I, H], [E, H, I]) with f32 128 x 128 block scales, H and I
    multiples of 128. Returns I; errors name the argument ``name`` and say where E and H come from (``source``)."""
    from mok_jax.fp8 import BLOCK, Fp8ExpertWeights

    if not isinstance(w, Fp8ExpertWeights):
        raise TypeError(f"{name} must be a mok_jax.fp8.Fp8ExpertWeights (from quantize_expert_weights), "
                        f"got {type(w).__name__}")
    for field in ("gate_up", "down"):
        a = getattr(w, field)
        if getattr(a, "dtype", None) != jnp.float8_e4m3fn:
            raise TypeError(f"{name}.{field} must be float8_e4m3fn, got {getattr(a, 'dtype', None)}")
        if a.ndim != 3:
            raise ValueError(f"{name}.{field} must be rank 3, got shape {a.shape}")
    for field in ("gate_up_scale", "down_scale"):
        a = getattr(w, field)
        if getattr(a, "dtype", None) != jnp.float32:
            raise TypeError(f"{name}.{field} must be float32, got {getattr(a, 'dtype', None)}")
    gu = w.gate_up
    if gu.shape[0] != num_experts or gu.shape[2] != hidden or gu.shape[1] % 2:
        raise ValueError(f"{name}.gate_up must be [E, 2I, H] = [{num_experts}, 2I, {hidden}] ({source}; K-major, "
                         f"as quantize_expert_weights makes it), got {gu.shape}")
    inter = gu.shape[1] // 2
    if num_experts < 1 or (max_experts is not None and num_experts > max_experts):
        raise ValueError(f"group_sizes: the number of experts must be in [1, {max_experts or 'inf'}], got {num_experts}")
    if hidden <= 0 or hidden % BLOCK:
        raise ValueError(f"x: hidden size H must be a positive multiple of {BLOCK} (the FP8 scale block), "
                         f"got {hidden}")
    if inter <= 0 or inter % BLOCK:
        raise ValueError(f"{name}.gate_up: intermediate size I must be a positive multiple of {BLOCK} (the FP8 "
                         f"scale block), got {inter}")
    hb, ib = hidden // BLOCK, inter // BLOCK
    for field, want in (("gate_up_scale", (num_experts, 2 * ib, hb)), ("down", (num_experts, hidden, inter)),
                        ("down_scale", (num_experts, hb, ib))):
        got = getattr(w, field).shape
        if got != want:
            raise ValueError(f"{name}.{field} must have shape {want} (E={num_experts}, H={hidden}, I={inter}), "
                             f"got {got}")
    return inter


def check_fp8_weights(fp8_weights, weights: MoEWeights) -> None:
    """``moe(..., fp8_weights=)``: the E4M3 form of ``weights``' routed experts (the same E, H and I)."""
    inter = check_fp8_expert_weights(fp8_weights, weights.num_local_experts, weights.hidden_size, name="fp8_weights",
                                     source="E and H from weights.gate_up")
    if inter != weights.intermediate_size:
        raise ValueError(f"fp8_weights has intermediate size {inter}, weights {weights.intermediate_size}: quantise "
                         f"this layer's weights with mok_jax.fp8.quantize_expert_weights(gate_up, down)")


def check_workspace_call(ws, where: str, arrays, *, ranks: int, tokens: int, hidden: int,
                         max_ranks: int = 8) -> None:
    """A call of the megakernel or the fused EP backward on workspace ``ws`` with ``ranks`` leading rank rows of
    ``tokens`` x ``hidden``: ws open, each of ``arrays`` ((name, array, rank, dtype)) of that rank and dtype, the
    ranks those of the workspace (an emulated one takes all of them in one call, at most ``max_ranks``; a mesh one
    its own), x's hidden size the workspace's, and at EP > 1 no more tokens than its max_tokens."""
    from mok_jax.workspace import Workspace

    if not isinstance(ws, Workspace):
        raise TypeError(f"{where}: ws must be a mok_jax.workspace.Workspace, got {type(ws).__name__}")
    ws.require_open(where)
    for name, a, rank, dtype in arrays:
        if a.ndim != rank:
            raise ValueError(f"{where}: {name} must have rank {rank} (a leading rank axis), got shape {a.shape}")
        if a.dtype != dtype:
            raise TypeError(f"{where}: {name} must be {jnp.dtype(dtype).name}, got {a.dtype}")
    cfg = ws.config
    want = cfg.ep if ws.emulated else 1
    if ranks != want or ranks > max_ranks:
        raise ValueError(f"{where}: x carries {ranks} ranks; this workspace takes {want} per call (an emulated one all "
                         f"its ranks, at most {max_ranks}; a mesh one its own)")
    if hidden != cfg.hidden_size:
        raise ValueError(f"{where}: x's hidden size {hidden} differs from the workspace's {cfg.hidden_size}")
    if cfg.ep > 1 and tokens > cfg.max_tokens:
        raise ValueError(f"{where}: x: {tokens} tokens per rank exceed the workspace's max_tokens ({cfg.max_tokens})")


def check_num_sms(num_sms) -> None:
    """A kernel op's ``num_sms``: None (every SM) or a positive int."""
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer))
                                or num_sms < 1):
        raise ValueError(f"num_sms must be None (all SMs) or a positive int, got {num_sms!r}")


def _check_shared_expert(shared_gate_up, shared_down, hidden: int, tokens: int, where: str, dtype) -> None:
    """The shared expert's weights of an experts' backward call (none, or both): shapes and dtypes (``dtype``:
    x's); errors name the argument."""
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError(f"{where}: shared_gate_up and shared_down come together (the shared expert), got "
                         f"{'shared_gate_up' if shared_down is None else 'shared_down'} alone")
    if shared_gate_up is None:
        return
    for name, a in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
        if getattr(a, "dtype", None) != dtype:
            raise TypeError(f"{where}: {name} must be {jnp.dtype(dtype).name} (x's dtype), got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
    if shared_gate_up.ndim != 2 or shared_gate_up.shape[0] != hidden or shared_gate_up.shape[1] % 2:
        raise ValueError(f"{where}: shared_gate_up must be [H, 2Is] with H = {hidden} (x's columns), got "
                         f"{tuple(shared_gate_up.shape)}")
    s_inter = shared_gate_up.shape[1] // 2
    if shared_down.shape != (s_inter, hidden):
        raise ValueError(f"{where}: shared_down must be [Is, H] = {(s_inter, hidden)} (shared_gate_up's Is, x's H), "
                         f"got {tuple(shared_down.shape)}")
    if s_inter < 1 or s_inter % 8:
        raise ValueError(f"{where}: shared_gate_up: the shared expert's Is must be a positive multiple of 8 (16-byte "
                         f"rows for TMA), got {s_inter}")
    if tokens * 2 * s_inter >= 2**31 or hidden * 2 * s_inter >= 2**31:
        raise ValueError(f"{where}: shared_gate_up: T and H times 2Is must be below 2^31 (the kernel's 32-bit "
                         f"offsets), got T = {tokens}, H = {hidden}, Is = {s_inter}")


def check_experts_backward_args(x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, *, where: str,
                                dtypes=(jnp.bfloat16,), max_experts: int | None = None, gu=None,
                                shared_gate_up=None, shared_down=None, gu_part=None,
                                gu_part_row=None) -> tuple[int, int, int, int, int, int]:
    """Shapes and dtypes of the experts' backward arguments (mok_jax.ops.experts_backward and its reference);
    returns (T, k, M, H, I, E). ``where`` opens each message; ``dtypes``: the floating dtypes allowed for x (dy
    and the weights must be x's); ``max_experts``: the most experts the caller takes (None: no limit); ``gu``:
    None, or the forward's kept g, u, [M, 2I] in x's dtype; ``gu_part``, ``gu_part_row``: None, or some rows' kept
    g, u, [R, 2I] in x's dtype, and int32[M], each row's row of them (both or neither; not with ``gu``);
    ``shared_gate_up``,
    ``shared_down``: None, or the shared expert's [H, 2Is] and [Is, H] in x's dtype (both or neither). The values
    of pos, src_slot, group_sizes and gu are not checked (they are device values)."""
    for name, a, rank, shape in (("x", x, 2, "[T, H]"), ("dy", dy, 2, "[T, H]"),
                                 ("topk_weight", topk_weight, 2, "[T, k]"), ("pos", pos, 2, "[T, k]"),
                                 ("src_slot", src_slot, 1, "[M]"),
                                 ("group_sizes", group_sizes, 1, "[E]"), ("gate_up", gate_up, 3, "[E, H, 2I]"),
                                 ("down", down, 3, "[E, I, H]")):
        if getattr(a, "ndim", None) != rank:
            raise ValueError(f"{where}: {name} must be rank {rank} {shape}, got shape {getattr(a, 'shape', None)}")
    dtype = x.dtype
    if dtype not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"{where}: x must be {' or '.join(jnp.dtype(d).name for d in dtypes)}, got {dtype}")
    for name, a, want in (("dy", dy, dtype), ("topk_weight", topk_weight, jnp.float32), ("pos", pos, jnp.int32),
                          ("src_slot", src_slot, jnp.int32), ("group_sizes", group_sizes, jnp.int32),
                          ("gate_up", gate_up, dtype), ("down", down, dtype)):
        if a.dtype != want:
            raise TypeError(f"{where}: {name} must be {jnp.dtype(want).name}, got {a.dtype}")
    tokens, hidden = x.shape
    if dy.shape != (tokens, hidden):
        raise ValueError(f"{where}: dy must be [T, H] = {(tokens, hidden)} (x's shape), got {dy.shape}")
    if topk_weight.shape[0] != tokens:
        raise ValueError(f"{where}: topk_weight must be [T, k] with T = {tokens} (x's rows), got {topk_weight.shape}")
    top_k = topk_weight.shape[1]
    if pos.shape != topk_weight.shape:
        raise ValueError(f"{where}: pos must be [T, k] = {topk_weight.shape} (topk_weight's shape), got {pos.shape}")
    if tokens < 1 or top_k < 1:
        raise ValueError(f"{where}: topk_weight: tokens T and slots per token k must be at least 1, got "
                         f"{topk_weight.shape}")
    (m,) = src_slot.shape
    if m < 1:
        raise ValueError(f"{where}: src_slot: the number of rows M must be at least 1, got {m}")
    (num_experts,) = group_sizes.shape
    inter = check_expert_weights(gate_up, down, num_experts, hidden, max_experts=max_experts, prefix=f"{where}: ")
    if m >= 2**31:
        raise ValueError(f"{where}: src_slot: rows M must be below 2^31, got {m}")
    if tokens * top_k >= 2**31:
        raise ValueError(f"{where}: topk_weight: slots T * k must be below 2^31 (int32 slot ids in src_slot), got "
                         f"{tokens} * {top_k}")
    check_kept_gu(where, gu, gu_part, gu_part_row, m, inter, dtype=dtype)
    _check_shared_expert(shared_gate_up, shared_down, hidden, tokens, where, dtype)
    return tokens, top_k, m, hidden, inter, num_experts


def check_kept_gu(where: str, gu, gu_part, gu_part_row, m: int, inter: int, ranks: int | None = None,
                  dtype=KEPT_GU_DTYPE) -> None:
    """The kept g, u operands of the experts' backward ops, in ``dtype`` (the kernels': KEPT_GU_DTYPE; the
    reference's: its inputs'): gu [M, 2I] (every row's), or gu_part [R, 2I] with gu_part_row int32[M] (some rows'
    and each row's row of them), or none; with ``ranks`` (the fused EP op) each has that leading rank axis. A wrong
    dtype of gu is a TypeError, anything else a ValueError naming the argument."""
    lead, lead_name = ((), "") if ranks is None else ((ranks,), "ranks, ")
    name = jnp.dtype(dtype).name
    if gu is not None:
        want = (*lead, m, 2 * inter)
        if getattr(gu, "dtype", None) != dtype:
            raise TypeError(f"{where}: gu (the kept g, u) must be {name}[{lead_name}M, 2I] = {name}{list(want)}, "
                            f"got {getattr(gu, 'dtype', type(gu).__name__)}{list(getattr(gu, 'shape', ()))}")
        if tuple(gu.shape) != want:
            raise ValueError(f"{where}: gu (the kept g, u) must be [{lead_name}M, 2I] = {want} (src_slot's rows, "
                             f"twice gate_up's I), got {tuple(gu.shape)}")
    if (gu_part is None) != (gu_part_row is None):
        raise ValueError(f"{where}: gu_part and gu_part_row (some rows' kept g, u and each row's row of them) must "
                         f"both be given or both be None")
    if gu_part is None:
        return
    if gu is not None:
        raise ValueError(f"{where}: gu (every row's kept g, u) and gu_part (some rows') are exclusive")
    shape = tuple(getattr(gu_part, "shape", ()))
    if getattr(gu_part, "dtype", None) != dtype or len(shape) != len(lead) + 2 or shape[:len(lead)] != lead \
            or shape[-1] != 2 * inter:
        raise ValueError(f"{where}: gu_part (some rows' kept g, u) must be {name}[{lead_name}R, 2I] with "
                         f"{f'ranks = {ranks}, ' if lead else ''}2I = {2 * inter}, got "
                         f"{getattr(gu_part, 'dtype', type(gu_part).__name__)}{list(shape)}")
    want_row = (*lead, m)
    if getattr(gu_part_row, "dtype", None) != jnp.int32 or tuple(getattr(gu_part_row, "shape", ())) != want_row:
        raise ValueError(f"{where}: gu_part_row (each row's row of gu_part) must be int32[{lead_name}M] = "
                         f"int32{list(want_row)} (src_slot's rows), got "
                         f"{getattr(gu_part_row, 'dtype', type(gu_part_row).__name__)}"
                         f"{list(getattr(gu_part_row, 'shape', ()))}")
    if shape[-2] >= 2**31:
        raise ValueError(f"{where}: gu_part: rows R must be below 2^31, got {shape[-2]}")
