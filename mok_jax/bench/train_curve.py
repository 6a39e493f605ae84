"""A small Flax NNX model with several MoE layers, trained with optax under each implementation.

    python -m mok_jax.bench.train_curve [--steps 50] [--layers 3] [--impl xla,mok] [--json F] [--plot F]
    python -m mok_jax.bench.train_curve --steps 200 --impl mok,mok-fp8 [--tolerance GAP]   # FP8 against bf16
    python -m mok_jax.bench.train_curve --replot F.json --plot F.png      # redraw an earlier run's plot

The model: token embedding -> ``--layers`` x (RMSNorm -> MoELayer, residual) -> RMSNorm -> vocabulary head,
trained on a fixed synthetic task: the target of each token is a fixed random permutation of it (the
model has no attention, so a token sees only itself), so the loss can fall from log(vocab) towards 0. Every
implementation starts from the same parameters and sees the same batches, so the loss curves differ only by the
layer's arithmetic (bf16 rounding, the order of sums; for mok-fp8 the E4M3 quantisation of its forward). The
router's auxiliary loss is added with a small weight, so the router weights get gradients through topk_weight and
the balance term.

The implementations (``IMPLEMENTATIONS``): ``xla`` and ``mok`` (MoELayer's implementation=) and ``mok-fp8``
(implementation="mok", precision="fp8": the routed experts' forward in FP8 E4M3, quantised from the parameters in
every call, the backward bf16). ``xla-fp8-st``, ``xla-fp8-dgrad`` and ``xla-fp8`` run the FP8 recipe's arithmetic in
pure JAX on any machine (``mok_jax.bench.fp8_recipe``: each GEMM operand quantised with the recipe's tiles, the GEMM in
f32): the FP8 forward with the bf16 backward that mok-fp8 trains with, with FP8 dgrads and bf16 weight gradients, and
with everything in FP8 (issue 34's choice of the FP8 backward, by its loss curve). The mok ones need a CUDA GPU and the kernels; asked for without them the tool
says why and exits 2 before training anything. SHAPE has H and I multiples of 128, as FP8 needs, so every
implementation trains the same model.

Prints one line per step every ``--every`` steps and a table last: final loss of each implementation
and the largest loss gap to the first implementation over all steps; with ``--tolerance`` also whether that gap
is within it (exit status 1 when one is not).
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

__all__ = ["IMPLEMENTATIONS", "MoEModel", "main", "parse_impls", "summarize", "train", "unavailable"]

# Small enough to train in seconds, large enough for several 128-row tiles per expert and two n-blocks
# of the intermediate size; H and I are multiples of 128, the FP8 scale block (mok-fp8).
SHAPE = ModelShape(name="train-curve", num_experts=8, top_k=2, hidden_size=256, intermediate_size=512,
                   num_shared_experts=1, shared_intermediate_size=256)
AUX_WEIGHT = 1e-2
# --impl name -> the MoELayer arguments it trains with
IMPLEMENTATIONS = {"xla": {"implementation": "xla"}, "mok": {"implementation": "mok"},
                   "mok-fp8": {"implementation": "mok", "precision": "fp8"},
                   # the FP8 recipe's arithmetic in pure JAX (mok_jax.bench.fp8_recipe), by its backward
                   "xla-fp8-st": {"implementation": "xla", "fp8_backward": "bf16"},
                   "xla-fp8-dgrad": {"implementation": "xla", "fp8_backward": "fp8-dgrad"},
                   "xla-fp8": {"implementation": "xla", "fp8_backward": "fp8"}}
PROG = "python -m mok_jax.bench.train_curve"


def parse_impls(text: str) -> list[str]:
    """The --impl list: names of IMPLEMENTATIONS, comma-separated, the first the reference of the gaps."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise ValueError(f"--impl: give at least one of {', '.join(IMPLEMENTATIONS)}")
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"--impl: {', '.join(map(repr, unknown))} is not one of {', '.join(IMPLEMENTATIONS)}")
    return names


def unavailable(impls: list[str]) -> dict[str, str]:
    """{name: why} for the implementations of ``impls`` that cannot run here (mok ones without a GPU or kernels)."""
    from mok_jax._native import NativeLibraryUnavailable, require_native

    out = {}
    for impl in impls:
        if IMPLEMENTATIONS[impl]["implementation"] == "mok":
            try:
                require_native(f"--impl {impl}")
            except NativeLibraryUnavailable as e:
                out[impl] = str(e)
    return out


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * self.scale[...]
        return y.astype(x.dtype)


class MoEModel(nnx.Module):
    def __init__(self, vocab: int, layers: int, *, impl: str, max_tokens: int, rngs: nnx.Rngs):
        """impl: a name of IMPLEMENTATIONS."""
        H = SHAPE.hidden_size
        layer = IMPLEMENTATIONS[impl]
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, H), jnp.float32))
        self.norms = nnx.List([RMSNorm(H) for _ in range(layers)])
        if "fp8_backward" in layer:
            from mok_jax.bench.fp8_recipe import Fp8RecipeLayer

            self.moes = nnx.List([Fp8RecipeLayer(SHAPE, backward=layer["fp8_backward"], rngs=rngs)
                                  for _ in range(layers)])
        else:
            self.moes = nnx.List([
                MoELayer(SHAPE, **layer, max_tokens=max_tokens if layer["implementation"] == "mok" else None,
                         rngs=rngs)
                for _ in range(layers)])
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


def train(impl: str, *, steps: int, layers: int, tokens: int, vocab: int, lr: float, seed: int) -> list[float]:
    """The loss of each step (before its update) of a fresh model trained with ``impl`` (IMPLEMENTATIONS)."""
    model = MoEModel(vocab, layers, impl=impl, max_tokens=tokens, rngs=nnx.Rngs(seed))
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
        args = ", ".join(f"{k}={v!r}" for k, v in IMPLEMENTATIONS.get(impl, {}).items())
        ax.plot(range(len(c)), c, label=f"{impl} ({args})" if args else impl)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(curves: dict[str, list[float]], tolerance: float | None = None) -> dict[str, dict]:
    """Per implementation: first and final loss, the largest |gap| to the first implementation's curve over all
    steps (key max_abs_gap_to_<first>), and with ``tolerance`` whether that gap is within it."""
    ref_name = next(iter(curves))
    ref = np.asarray(curves[ref_name])
    out = {}
    for impl, c in curves.items():
        gap = float(np.max(np.abs(np.asarray(c) - ref)))
        out[impl] = {"first_loss": c[0], "final_loss": c[-1], "max_abs_gap_to_" + ref_name: gap}
        if tolerance is not None:
            out[impl]["within_tolerance"] = gap <= tolerance
    return out


def _table(summary: dict[str, dict], ref_name: str, tolerance: float | None) -> str:
    gap = "max gap to " + ref_name
    lines = [f"{'implementation':<16} {'first loss':>10} {'final loss':>10} {gap:>16}"]
    for impl, s in summary.items():
        verdict = "" if tolerance is None else ("  within" if s["within_tolerance"] else "  OVER") + f" {tolerance:g}"
        lines.append(f"{impl:<16} {s['first_loss']:>10.4f} {s['final_loss']:>10.4f} "
                     f"{s['max_abs_gap_to_' + ref_name]:>16.4f}{verdict}")
    return "\n".join(lines)


def _title(args: dict, device: str) -> str:
    a = args
    return (f"{a['layers']} MoE layers ({SHAPE.num_experts} experts, top-{SHAPE.top_k}, H {SHAPE.hidden_size}, "
            f"I {SHAPE.intermediate_size}), {a['tokens']} tokens/step, {device}")


def replot(json_path: str, png_path: str) -> None:
    """Redraw the plot of a --json file written by an earlier run (on a machine with matplotlib)."""
    with open(json_path) as f:
        d = json.load(f)
    plot(d["curves"], png_path, _title(d["args"], d["device"]))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", default="xla,mok", help=f"comma-separated, of {', '.join(IMPLEMENTATIONS)}; the first "
                    "is the reference of the gaps")
    ap.add_argument("--tolerance", type=float, help="the largest loss gap to the first implementation that passes "
                    "(absolute, over all steps): the table says within/OVER and the exit status is 1 when one is over")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", help="write the curves here")
    ap.add_argument("--plot", help="write a PNG of the curves here (needs matplotlib)")
    ap.add_argument("--replot", metavar="JSON", help="only redraw --plot from this --json file of an earlier run")
    return ap


def main(argv=None) -> int:
    """Train each --impl and print the table; 2 for a bad option or an implementation that cannot run here, 1
    when a gap is over --tolerance, else 0."""
    ap = _parser()
    a = ap.parse_args(argv)
    if a.replot:
        if not a.plot:
            ap.error("--replot needs --plot")
        replot(a.replot, a.plot)
        return 0
    try:
        impls = parse_impls(a.impl)
    except ValueError as e:
        ap.error(str(e))
    if a.tolerance is not None and not a.tolerance >= 0:
        ap.error(f"--tolerance must be >= 0, got {a.tolerance}")
    missing = unavailable(impls)
    for why in missing.values():  # each names its --impl
        print(f"{PROG}: error: {why}", file=sys.stderr)
    if missing:
        return 2
    curves: dict[str, list[float]] = {}
    for impl in impls:
        t0 = time.perf_counter()
        curves[impl] = train(impl, steps=a.steps, layers=a.layers, tokens=a.tokens, vocab=a.vocab, lr=a.lr,
                             seed=a.seed)
        for i in range(0, a.steps, a.every):
            print(f"{impl} step {i}: loss {curves[impl][i]:.4f}", flush=True)
        print(f"{impl}: {a.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    summary = summarize(curves, a.tolerance)
    device = jax.devices()[0].device_kind
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": device, "curves": curves, "summary": summary}, f, indent=1)
    if a.plot:
        plot(curves, a.plot, _title(vars(a), device))
    print(_table(summary, impls[0], a.tolerance))
    return 0 if all(s.get("within_tolerance", True) for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
