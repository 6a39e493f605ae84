"""The CRC of every gradient of the layer (implementation="mok", keep = nothing, everything, ring) on the one-GPU
bench problems (mok_jax.bench.breakdown._problem, two seeds): run once per library (MOK_JAX_LIB) and diff the lines.
    python scripts/lab/ab_bits_session14.py kimi-k2,qwen3.5-397b-a17b

A lab script (the fourteenth session's A/B; docs/performance_history.md), not part of the package.
"""
import argparse, dataclasses, zlib
import jax, jax.numpy as jnp, numpy as np
from mok_jax import tuning
from mok_jax.bench.breakdown import _problem
from mok_jax.config import MoEConfig
from mok_jax import moe

def crc(a):
    a = np.asarray(a)
    return zlib.crc32(a.view(np.uint8).tobytes())

def main(models: str) -> None:
    for name in models.split(","):
        for seed in (3, 4):
            m, x, idx, w, W, flops = _problem(name, 2048, seed)
            E, H, I, k = W.gate_up.shape[0], m.hidden_size, m.intermediate_size, m.top_k
            key = tuning.ProblemKey(hidden=H, intermediate=I, top_k=k, experts_per_rank=E, ep=1, tokens=2048)
            cfg = MoEConfig(implementation="mok", kernel=tuning.resolve(None, key, jax.devices()[0].device_kind))
            dy = jax.random.normal(jax.random.key(seed + 1), x.shape, jnp.float32).astype(jnp.bfloat16)
            for keep in ("nothing", "everything", "ring"):
                c = dataclasses.replace(cfg, keep=keep)
                g = jax.jit(jax.grad(lambda x, i, w, W, dy: jnp.sum(moe(x, i, w, W, config=c).astype(jnp.float32) * dy),
                                     argnums=(0, 2, 3)))(x, idx, w, W, dy)
                leaves = jax.tree_util.tree_leaves(g)
                print(f"BITS {name} seed={seed} keep={keep} " + " ".join(f"{crc(l):08x}" for l in leaves), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", help="comma-separated model names, e.g. kimi-k2,qwen3.5-397b-a17b")
    main(ap.parse_args().models)
