"""One tree's side of a backward A/B (scripts/gpu_backward_ab.sh runs it once per tree, A B B A, each in its own
process): for each problem, the CRC32 of every gradient of the layer (default MoEConfig and keep="nothing", two
seeds: the bits), then the median ms of the dense FFN of the same FLOPs, of the layer's fwd+bwd with the default
config, and the backward op's ms per SM per kind of work item (kept g, u, as the default hands them). One JSON
line per problem on stdout.

    python scripts/ab_backward.py kimi-k2 qwen3.5-397b-a17b qwen3-30b-a3b:8192:16
"""
import dataclasses
import json
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import ops, tuning
from mok_jax.bench.breakdown import _problem, _timed
from mok_jax.bench.dense import dense_groups, dense_problem, dense_step
from mok_jax.config import MoEConfig
from mok_jax.expert_layout import padded_layout
from mok_jax.layer import moe
from mok_jax.ops.moe_backward import EXPERTS_BACKWARD_GROUP_ALIGN, ITEM_KINDS


def crc(tree) -> str:
    return "%08x" % zlib.crc32(b"".join(np.asarray(a).view(np.uint8).tobytes() for a in jax.tree_util.tree_leaves(tree)))


def case(spec: str, samples: int) -> dict:
    name, tokens, experts = (spec.split(":") + [None, None])[:3]
    tokens = int(tokens or 2048)
    experts = int(experts) if experts else None
    timing_kw = {"samples": samples, "target_sample_ms": 100.0}
    res = {"problem": spec, "bits": {}}
    for seed in (3, 4):
        m, x, idx, w, W, _ = _problem(name, tokens, seed, experts)
        E, H, I, k = W.gate_up.shape[0], m.hidden_size, m.intermediate_size, m.top_k
        key = tuning.ProblemKey(hidden=H, intermediate=I, top_k=k, experts_per_rank=E, ep=1, tokens=tokens)
        cfg = MoEConfig(implementation="mok", kernel=tuning.resolve(None, key, jax.devices()[0].device_kind))
        dy = jax.random.normal(jax.random.key(seed + 1), x.shape, jnp.float32).astype(jnp.bfloat16)
        grads = {}
        for keep in (None, "nothing"):
            c = cfg if keep is None else dataclasses.replace(cfg, keep=keep)
            grads[keep or "default"] = jax.jit(jax.grad(
                lambda x, i, w, W, dy, c=c: jnp.sum(moe(x, i, w, W, config=c).astype(jnp.float32) * dy),
                argnums=(0, 2, 3)))
            res["bits"][f"seed{seed} {keep or 'default'}"] = crc(grads[keep or "default"](x, idx, w, W, dy))
    dense = dense_problem(dense_groups(tokens, k, I, m.shared_size), H, seed=seed)
    res["dense fwd+bwd"] = _timed(dense_step("fwd+bwd"), tuple(dense), timing_kw)["ms"]
    res["fwd+bwd"] = _timed(grads["default"], (x, idx, w, W, dy), timing_kw)["ms"]
    res["dense fwd+bwd after"] = _timed(dense_step("fwd+bwd"), tuple(dense), timing_kw)["ms"]
    lay = padded_layout(idx, E, block=EXPERTS_BACKWARD_GROUP_ALIGN)
    shared = dict(shared_gate_up=W.shared_gate_up, shared_down=W.shared_down) if W.has_shared else {}
    args = ((x, dy, w.astype(jnp.float32), lay.pos, lay.src_slot, lay.group_sizes, W.gate_up, W.down), shared)
    _, gu = jax.jit(lambda a, s: ops.experts_backward(*a, **s, return_gu=True))(*args)
    ctas = getattr(jax.devices()[0], "core_count", None) or 132
    items = {}
    for _ in range(3):  # the median of three calls' counters
        _, ns = jax.jit(lambda a, s, gu: ops.experts_backward(*a, **s, gu=gu, return_item_ns=True))(*args, gu)
        ns = jax.device_get(ns)
        for q, kind in enumerate(ITEM_KINDS):
            items.setdefault(kind, []).append(float(ns[0, q]) / ctas / 1e6)
    res["items kept busy ms per SM"] = {k: sorted(v)[1] for k, v in items.items() if max(v) > 0}
    return res


def main(argv) -> int:
    samples = 7
    for spec in argv:
        print(json.dumps(case(spec, samples)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
