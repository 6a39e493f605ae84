"""Steps per second of a Flax NNX training step whose MoE layers run one implementation or another.

    python -m mok_jax.bench.train_step [--model kimi-k2] [--layers 4] [--tokens 2048] [--experts E/32]
        [--impl mok,xla-capacity] [--steps 10] [--samples 3] [--json F]

The model: ``--layers`` x (router + MoE layer + residual) on x [T, H] (bf16 activations, f32 master parameters:
the router [H, E], the routed experts' gate_up [E, H, 2I] and down [E, I, H], the shared expert's), the loss the
mean square of the last layer's output against a fixed random target, one optax adam step per call. The router is
the model's (``mok_jax.reference.route``: its score function, top-k, normalisation, scaling) and the same for
every implementation; the MoE layer is ``mok_jax.bench.baselines.build(impl)``, the function mok-bench times (on a
one-device mesh here): ``mok`` (the default MoEConfig), or the JAX layers a user writes instead, ``xla-capacity``
(capacity factor 1.25, bf16 einsums) first among them. Every implementation starts from the same parameters and
takes the same batch.

Timed: after two warm-up steps (compilation), ``--samples`` samples of ``--steps`` back-to-back steps each, the
device synchronised once per sample; reported: the median ms per step and steps per second, the loss of the first
and the last step of each implementation, and the ratio to the first implementation. GPU only: the shapes are real
model layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

__all__ = ["main", "run"]

PROG = "python -m mok_jax.bench.train_step"


def _model(shape, experts: int, layers: int, moe_fn, seed: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mok_jax.reference import route
    from mok_jax.weights import MoEWeights

    H, I, Is, k = shape.hidden_size, shape.intermediate_size, shape.shared_size, shape.top_k

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            normal = lambda s, fan_in: nnx.Param(jax.random.normal(rngs.params(), s, jnp.float32) * fan_in ** -0.5)
            self.router = normal((H, experts), H)
            self.gate_up, self.down = normal((experts, H, 2 * I), H), normal((experts, I, H), I)
            self.shared_gate_up = normal((H, 2 * Is), H) if Is else None
            self.shared_down = normal((Is, H), Is) if Is else None

        def __call__(self, x):
            logits = x.astype(jnp.float32) @ self.router[...]
            idx, w = route(logits, top_k=k, score_func=shape.score_func, norm_topk_prob=shape.norm_topk_prob,
                           routed_scaling_factor=shape.routed_scaling_factor)
            bf = lambda p: None if p is None else p[...].astype(jnp.bfloat16)  # noqa: E731
            W = MoEWeights(bf(self.gate_up), bf(self.down), bf(self.shared_gate_up), bf(self.shared_down))
            y, _ = moe_fn(x, idx, w, W)
            return x + y

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return Model(nnx.Rngs(seed))


def _case(impl: str, shape, experts: int, layers: int, tokens: int, steps: int, samples: int, seed: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from mok_jax.bench import baselines

    # Auto axes: the model's own matmuls (router, residual, loss) take no sharding annotations on one device
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    model = _model(shape, experts, layers, baselines.build(impl, mesh), seed)
    opt = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    kx, ky = jax.random.split(jax.random.key(seed + 1))
    x = jax.random.normal(kx, (tokens, shape.hidden_size), jnp.float32).astype(jnp.bfloat16)
    target = jax.random.normal(ky, x.shape, jnp.float32)

    @nnx.jit
    def step(model, opt, x, target):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x).astype(jnp.float32) - target) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x, target)) for _ in range(2)]  # compiles; the first two losses
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(model, opt, x, target)
        losses.append(float(loss))  # synchronises
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    ms = statistics.median(times)
    return {"impl": impl, "ms_per_step": ms, "steps_per_s": 1e3 / ms, "min_ms": min(times), "max_ms": max(times),
            "first_loss": losses[0], "last_loss": losses[-1], "losses": losses}


def run(model: str = "kimi-k2", *, layers: int = 4, tokens: int = 2048, experts: str = "E/32",
        impls=("mok", "xla-capacity"), steps: int = 10, samples: int = 3, seed: int = 0) -> dict:
    import jax

    from mok_jax.bench.accounting import experts_per_gpu_count
    from mok_jax.config import load_model

    shape = load_model(model)
    e = experts_per_gpu_count(shape, experts)
    res = {"model": model, "layers": layers, "tokens": tokens, "experts": e, "device": jax.devices()[0].device_kind,
           "steps": steps, "samples": samples, "cases": []}
    for impl in impls:
        res["cases"].append(_case(impl, shape, e, layers, tokens, steps, samples, seed))
    return res


def table(res: dict) -> str:
    base = res["cases"][0]["ms_per_step"] if res["cases"] else None
    lines = [f"{res['model']}: {res['layers']} x (router + MoE + residual), {res['experts']} experts, "
             f"{res['tokens']} tokens per step, optax adam, {res['device']}",
             f"{'implementation':<16} {'ms/step':>9} {'steps/s':>8} {'vs ' + res['cases'][0]['impl']:>14} "
             f"{'first loss':>11} {'last loss':>10}"]
    for c in res["cases"]:
        lines.append(f"{c['impl']:<16} {c['ms_per_step']:>9.2f} {c['steps_per_s']:>8.2f} "
                     f"{base / c['ms_per_step']:>13.2f}x {c['first_loss']:>11.5f} {c['last_loss']:>10.5f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Train and print the table; 2 on a bad option or without a GPU and the kernels."""
    from mok_jax.bench import baselines

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", default="E/32", help="routed experts on the GPU: N or E/d (default E/32)")
    ap.add_argument("--impl", default="mok,xla-capacity", help="comma-separated implementations of mok-bench "
                    "(mok_jax.bench.baselines); the first is the reference of the ratios")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed sample")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    impls = [s.strip() for s in a.impl.split(",") if s.strip()]
    bad = [i for i in impls if i not in baselines.IMPLEMENTATIONS]
    if not impls or bad:
        ap.error(f"--impl: {', '.join(bad) or 'none given'}; choose from {', '.join(baselines.IMPLEMENTATIONS)}")
    for name, v in (("--layers", a.layers), ("--tokens", a.tokens), ("--steps", a.steps), ("--samples", a.samples)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    from mok_jax.bench.timing import kernels_unavailable, warn_if_untuned_xla

    warn_if_untuned_xla(PROG)
    why = kernels_unavailable()
    if why:
        print(f"{PROG}: {why}")
        return 2
    res = run(a.model, layers=a.layers, tokens=a.tokens, experts=a.experts, impls=tuple(impls), steps=a.steps,
              samples=a.samples, seed=a.seed)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
