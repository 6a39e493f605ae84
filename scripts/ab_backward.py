"""One tree's side of a backward A/B (scripts/gpu_backward_ab.sh runs it once per tree, A B B A, each in its own
process): for each problem, the CRC32 of every gradient of the layer (default MoEConfig and keep="nothing", two
seeds: the bits), then the median ms of the dense FFN of the same FLOPs, of the layer's fwd+bwd with the default
config, and the backward op's ms per SM per kind of work item (kept g, u, as the default hands them). One JSON
line per problem on stdout.

    python scripts/ab_backward.py kimi-k2 qwen3.5-397b-a17b qwen3-30b-a3b:8192:16
    python scripts/ab_backward.py --summary LOGS A B    (what gpu_backward_ab.sh prints last)
"""
import dataclasses
import json
import sys
import zlib

import numpy as np

SAMPLES = 7
SEEDS = (3, 4)  # the bits of both; the times of the last


def crc(tree) -> str:
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    return "%08x" % zlib.crc32(b"".join(np.asarray(a).view(np.uint8).tobytes() for a in leaves))


def case(spec: str) -> dict:
    import jax  # here, so that --summary runs where the package is not installed
    import jax.numpy as jnp

    from mok_jax import ops
    from mok_jax.bench.backward import grad_of, item_ms, layer_config, op_args
    from mok_jax.bench.breakdown import _problem, _timed
    from mok_jax.bench.dense import dense_groups, dense_problem, dense_step

    name, tokens, experts = (spec.split(":") + [None, None])[:3]
    tokens = int(tokens or 2048)
    experts = int(experts) if experts else None
    timing_kw = {"samples": SAMPLES, "target_sample_ms": 100.0}
    res = {"problem": spec, "bits": {}}
    for seed in SEEDS:
        m, x, idx, w, W, _ = _problem(name, tokens, seed, experts)
        cfg = layer_config(m, W, tokens)
        dy = jax.random.normal(jax.random.key(seed + 1), x.shape, jnp.float32).astype(jnp.bfloat16)
        grads = {"default": grad_of(cfg), "nothing": grad_of(dataclasses.replace(cfg, keep="nothing"))}
        for keep, grad in grads.items():
            res["bits"][f"seed{seed} {keep}"] = crc(grad(x, idx, w, W, dy))
    dense = dense_problem(dense_groups(tokens, m.top_k, m.intermediate_size, m.shared_size), m.hidden_size,
                          seed=seed)
    res["dense fwd+bwd"] = _timed(dense_step("fwd+bwd"), tuple(dense), timing_kw)["ms"]
    res["fwd+bwd"] = _timed(grads["default"], (x, idx, w, W, dy), timing_kw)["ms"]
    res["dense fwd+bwd after"] = _timed(dense_step("fwd+bwd"), tuple(dense), timing_kw)["ms"]
    args = op_args(x, dy, idx, w, W)
    _, gu = jax.jit(lambda a, s: ops.experts_backward(*a, **s, return_gu=True))(*args)
    counted = jax.jit(lambda a, s, gu: ops.experts_backward(*a, **s, gu=gu, return_item_ns=True))
    calls = [item_ms(counted(*args, gu)[1]) for _ in range(3)]  # the median of three calls' counters
    for what in ("busy", "wait", "epilogue"):  # a tree from before the epilogue counters has none (.get)
        res[f"items kept {what} ms per SM"] = {kind: sorted(c[kind].get(f"{what}_ms", 0.0) for c in calls)[1]
                                               for kind in calls[0] if any(c[kind]["busy_ms"] > 0 for c in calls)}
    return res


def ab_rows(logs: str, *trees: str):
    """Per problem, in order: the trees of the runs (A B .. B A: each tree, then each again in reverse order) and
    each run's JSON line (None: missing)."""
    order = [*trees, *reversed(trees)]
    runs = [[json.loads(line) for line in open(f"{logs}/ab_{i}.jsonl") if line.startswith("{")]
            for i in range(1, len(order) + 1)]
    for p in range(max(len(r) for r in runs)):
        yield p, order, [r[p] if p < len(r) else None for r in runs]


def ab_main(argv, case, summary) -> int:
    """``--summary LOGS A B [C ...]``: the side-by-side print; else one JSON line of ``case(spec)`` per problem."""
    if argv[:1] == ["--summary"]:
        summary(argv[1], *argv[2:])
        return 0
    from mok_jax.bench.timing import warn_if_untuned_xla  # here, as case's imports: --summary needs no package

    warn_if_untuned_xla(sys.argv[0].rsplit("/", 1)[-1])  # the dense times beside the trees' need XLA's autotuning
    for spec in argv:
        print(json.dumps(case(spec)), flush=True)
    return 0


def summary(logs: str, *trees: str) -> None:
    for p, order, rows in ab_rows(logs, *trees):
        ok = [r for r in rows if r]
        same = all(r["bits"] == ok[0]["bits"] for r in ok) if ok else False
        print(f"== {ok[0]['problem'] if ok else p}: bits {'identical in all runs' if same else 'DIFFER'}")
        if not same:
            for t, r in zip(order, rows):
                print(f"   {t}: {r and r['bits']}")
        for t, r in zip(order, rows):
            if r:
                epi = r.get("items kept epilogue ms per SM", {})
                wait = r.get("items kept wait ms per SM", {})  # waiting for inputs (a tile: its producer)
                items = ", ".join(f"{k} {v:.3f}" + "".join(f" ({n} {d[k]:.3f})" for n, d in (("epi", epi),
                                                                                            ("wait", wait))
                                                           if d.get(k, 0.0) >= 0.0005)
                                  for k, v in r["items kept busy ms per SM"].items())
                print(f"   {t:>10}: dense {r['dense fwd+bwd']:.3f}/{r['dense fwd+bwd after']:.3f} fwd+bwd "
                      f"{r['fwd+bwd']:.3f} ({r['fwd+bwd'] / r['dense fwd+bwd']:.3f}x dense)  items: {items}")


if __name__ == "__main__":
    sys.exit(ab_main(sys.argv[1:], case, summary))
