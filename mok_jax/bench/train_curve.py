"""A small Flax NNX model with several MoE layers, trained with optax under each implementation.

    python -m mok_jax.bench.train_curve [--steps 50] [--layers 3] [--impl xla,mok] [--json F] [--plot F]
    python -m mok_jax.bench.train_curve --replot F.json --plot F.png      # redraw an earlier run's plot

The model: token embedding -> ``--layers`` x (RMSNorm -> MoELayer, residual) -> RMSNorm -> vocabulary head,
trained on a fixed synthetic task: the target of each token is a fixed random permutation of it (the
model has no attention, so a token sees only itself), so the loss can fall from log(vocab) towards 0. Every implementation starts from the same
parameters and sees the same batches, so the loss curves differ only by the layer's arithmetic (bf16
rounding, the order of sums). The router's auxiliary loss is added with a small weight, so the router
weights get gradients through topk_weight and the balance term.

Prints one line per step every ``--every`` steps and a table last: final loss of each implementation
and the largest loss gap to the first implementation over all steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mok_jax.config import ModelShape
from mok_jax.flax import MoELayer

__all__ = ["MoEModel", "main", "train"]

# Small enough to train in seconds, large enough for several 128-row tiles per expert and two n-blocks
# of the intermediate size.
SHAPE = ModelShape(name="train-curve", num_experts=8, top_k=2, hidden_size=256, intermediate_size=512,
                   num_shared_experts=1, shared_intermediate_size=256)
AUX_WEIGHT = 1e-2


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * self.scale[...]
        return y.astype(x.dtype)


class MoEModel(nnx.Module):
    def __init__(self, vocab: int, layers: int, *, implementation: str, max_tokens: int, rngs: nnx.Rngs):
        H = SHAPE.hidden_size
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, H), jnp.float32))
        self.norms = nnx.List([RMSNorm(H) for _ in range(layers)])
        self.moes = nnx.List([
            MoELayer(SHAPE, implementation=implementation, max_tokens=max_tokens if implementation == "mok" else None,
                     rngs=rngs) for _ in range(layers)])
        self.final_norm = RMSNorm(H)
        self.head = nnx.Param(jax.random.normal(rngs.params(), (H, vocab), jnp.float32) * H ** -0.5)

    def __call__(self, tokens):
        x = self.embed[...][tokens].astype(jnp.bfloat16)  # [T, H]
        aux = jnp.float32(0)
        for norm, moe in zip(self.norms, self.moes):
            y, a = moe(norm(x), return_aux_loss=True)
            x, aux = x + y, aux + a
        logits = self.final_norm(x).astype(jnp.float32) @ self.head[...]
        return logits, aux


def _batches(vocab: int, tokens: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab)
    for _ in range(steps):
        cur = rng.integers(0, vocab, size=tokens)
        yield jnp.asarray(cur, jnp.int32), jnp.asarray(perm[cur], jnp.int32)


def train(implementation: str, *, steps: int, layers: int, tokens: int, vocab: int, lr: float, seed: int) -> list[float]:
    """The loss of each step (before its update) of a fresh model trained with ``implementation``."""
    model = MoEModel(vocab, layers, implementation=implementation, max_tokens=tokens, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tok, tgt):
        def loss_fn(model):
            logits, aux = model(tok)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()
            return ce + AUX_WEIGHT * aux, ce

        (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return ce

    return [float(step(model, opt, tok, tgt)) for tok, tgt in _batches(vocab, tokens, steps, seed + 1)]


def plot(curves: dict[str, list[float]], path: str, title: str) -> None:
    """The loss curves on a log scale, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, c in curves.items():
        ax.plot(range(len(c)), c, label=f"implementation={impl!r}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: str, png_path: str) -> None:
    """Redraw the plot of a --json file written by an earlier run (on a machine with matplotlib)."""
    with open(json_path) as f:
        d = json.load(f)
    a = d["args"]
    plot(d["curves"], png_path, f"{a['layers']} MoE layers ({SHAPE.num_experts} experts, top-{SHAPE.top_k}), "
                                f"{a['tokens']} tokens/step, {d['device']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_jax.bench.train_curve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="xla,mok", help="comma-separated implementations; the first is the reference")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", help="write the curves here")
    ap.add_argument("--plot", help="write a PNG of the curves here (needs matplotlib)")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot from this --json file of an earlier run")
    a = ap.parse_args(argv)
    if a.replot:
        if not a.plot:
            ap.error("--replot needs --plot")
        replot(a.replot, a.plot)
        return 0
    impls = [s for s in a.impl.split(",") if s]
    curves: dict[str, list[float]] = {}
    for impl in impls:
        t0 = time.perf_counter()
        curves[impl] = train(impl, steps=a.steps, layers=a.layers, tokens=a.tokens, vocab=a.vocab, lr=a.lr,
                             seed=a.seed)
        for i in range(0, a.steps, a.every):
            print(f"{impl} step {i}: loss {curves[impl][i]:.4f}", flush=True)
        print(f"{impl}: {a.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = curves[impls[0]]
    summary = {impl: {"first_loss": c[0], "final_loss": c[-1],
                      "max_abs_gap_to_" + impls[0]: float(np.max(np.abs(np.asarray(c) - np.asarray(ref))))}
               for impl, c in curves.items()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": jax.devices()[0].device_kind, "curves": curves, "summary": summary},
                      f, indent=1)
    if a.plot:
        plot(curves, a.plot, f"{a.layers} MoE layers ({SHAPE.num_experts} experts, top-{SHAPE.top_k}), "
                             f"{a.tokens} tokens/step, {jax.devices()[0].device_kind}")
    print(f"{'implementation':<16} {'first loss':>10} {'final loss':>10} {'max gap to ' + impls[0]:>16}")
    for impl, s in summary.items():
        print(f"{impl:<16} {s['first_loss']:>10.4f} {s['final_loss']:>10.4f} {s['max_abs_gap_to_' + impls[0]]:>16.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
