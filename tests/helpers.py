"""Shared test helpers: random MoE problems (never zeros) and named tolerances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax.config import ModelShape
from mok_jax.reference import route
from mok_jax.weights import MoEWeights
from mok_jax.workspace import CommConfig, Workspace


def fake_workspace(*, ep: int = 1, max_tokens: int, hidden_size: int, top_k: int, num_experts: int, mesh=None,
                   ws_id: int = 7) -> Workspace:
    """A Workspace object with no device memory behind it: enough to trace and lower the ops on CPU."""
    config = CommConfig(ep=ep, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k, num_experts=num_experts)
    return Workspace(ws_id=ws_id, config=config, mesh=mesh, axis_name=None if mesh is None else "ep", local=[])

# fp32 math reordered (per-rank partial sums, different matmul blocking): a few ulps of the output.
TOL_F32_REORDER = 2e-5
# bf16 outputs: one rounding of the output is 2^-8 relative; the expert-parallel path also rounds
# each owner's partial to bf16 before the final sum (the wire format, docs/kernel.md), so allow 4 ulps.
TOL_BF16_REORDER = 4 * 2.0**-8


# The MoE layer's gradients, in jax.tree.leaves order of (dx, d topk_weight, d MoEWeights).
GRAD_NAMES = ("dx", "d topk_weight", "d gate_up", "d down", "d shared_gate_up", "d shared_down")


def random_problem(shape: ModelShape, num_tokens: int, *, dtype=jnp.float32, seed: int = 0, scale: float = 1.0):
    """x, topk_idx, topk_weight, weights for ``shape`` with fresh random values."""
    ks = jax.random.split(jax.random.key(seed), 7)
    E, H, I, Is = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.shared_size
    x = (jax.random.normal(ks[0], (num_tokens, H)) * scale).astype(dtype)
    logits = jax.random.normal(ks[1], (num_tokens, E))
    idx, w = route(logits, top_k=shape.top_k, score_func=shape.score_func, norm_topk_prob=shape.norm_topk_prob,
                   routed_scaling_factor=shape.routed_scaling_factor)
    weights = MoEWeights(
        (jax.random.normal(ks[2], (E, H, 2 * I)) * H**-0.5).astype(dtype),
        (jax.random.normal(ks[3], (E, I, H)) * I**-0.5).astype(dtype),
        (jax.random.normal(ks[4], (H, 2 * Is)) * H**-0.5).astype(dtype) if Is else None,
        (jax.random.normal(ks[5], (Is, H)) * Is**-0.5).astype(dtype) if Is else None,
    )
    return x, idx, w, weights


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def max_ulp_err(a, b, dtype) -> float:
    """max |a - b| / (eps(dtype) * max(|b|, tiny)) per element: error in units of the output's rounding."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    return float(np.max(np.abs(a - b) / (eps * np.maximum(np.abs(b), 1e-3))))


# --- GPU kernel tests: skip reasons, seeded keys, per-case metrics --------------------------------------------


def gpu_skip_reason() -> str | None:
    """Why the GPU kernel tests cannot run here (no GPU, or no native library), or None."""
    from mok_jax import _native

    try:
        if not jax.devices("gpu"):
            return "no CUDA GPU visible to JAX (not a pass)"
    except RuntimeError:
        return "no CUDA GPU visible to JAX (not a pass)"
    if _native.library() is None:
        return "mok native library unavailable (not a pass): " + _native.native_status()
    return None


def readme_api_calls(prefix: str) -> list[str]:
    """The calls in the README's API section whose code span starts with ``prefix`` (e.g. "mok_jax.emulation."), as
    written there, for a test to evaluate."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = re.search(r"^## API\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "README.md has no section '## API'"
    return re.findall(rf"`({re.escape(prefix)}\w+\([^`]*\))`", section.group(1))


def readme_api_names(ep: int = 4) -> dict:
    """The names the API section's emulation calls use, for ``ep`` ranks of 8 tokens each (the ci shape, bf16), and
    mok_jax with the module they name imported."""
    import mok_jax
    import mok_jax.emulation  # noqa: F401 (a dotted name in the README is a module to import)

    x, topk_idx, topk_weight, weights = random_problem(mok_jax.load_model("ci"), 8 * ep, seed=4)
    dy = jax.random.normal(jax.random.key(5), x.shape)
    bf16 = lambda a: None if a is None else a.astype(jnp.bfloat16)  # noqa: E731
    return dict(mok_jax=mok_jax, x=bf16(x), topk_idx=topk_idx, topk_weight=topk_weight,
                weights=type(weights)(*map(bf16, weights)), dy=bf16(dy))


# Seeds a failed GPU run can reproduce (issue 35, item 5). One base seed, $MOK_TEST_SEED, reaches every random input
# of the GPU tests, and a failing test's report names the value that draws its inputs again (conftest.py):
#     MOK_TEST_SEED=<n> python -m pytest 'tests/<file>::<test>'
# - A test written with fixed seeds (seed=7, default_rng(tokens)) asks conftest.py's ``seed`` fixture for each:
#   seed(7) is 7 itself at the base seed 0 (MOK_TEST_SEED unset: the inputs it always drew), else derived_seed's mix
#   of the base, the test's name and 7.
# - A module whose cases draw fresh inputs every run takes _SEED = module_seed(__name__): MOK_TEST_SEED when set,
#   else a fresh seed, as before. Its fixed seeds (nnx.Rngs(0)) stay as written: fixed under any MOK_TEST_SEED, they
#   reproduce as they are.
SEED_ENV = "MOK_TEST_SEED"
MODULE_SEEDS: dict[str, int] = {}  # module name -> the seed module_seed gave it, for the failure report


def base_seed() -> int:
    """$MOK_TEST_SEED, an int in [0, 2^32) (decimal or 0x...), else 0: the base at which every test draws the fixed
    seeds it was written with."""
    import os

    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return 0
    try:
        seed = int(text, 0)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={text!r} is not an integer seed") from None
    if not 0 <= seed < 2**32:
        raise ValueError(f"{SEED_ENV}={seed} is outside [0, 2^32)")
    return seed


def derived_seed(name: str, today: int, base: int | None = None) -> int:
    """The seed that test ``name`` (its own name, parameters included: moving it to another file keeps its seeds)
    draws where it was written with the fixed seed ``today``: ``today`` itself at the base seed 0, else a 31-bit mix
    of the base (default: base_seed()), the name and ``today``, so that each test and each of its seeds gets its own
    and two draws written with the same seed stay equal."""
    import zlib

    base = base_seed() if base is None else base
    if base == 0:
        return today
    return zlib.crc32(f"{base}/{name}/{today}".encode()) & 0x7FFFFFFF


def module_seed(module: str) -> int:
    """The seed of test module ``module`` whose cases draw fresh random inputs every run: $MOK_TEST_SEED when it is
    set (a failed run's seed: the same inputs again), else a fresh 32-bit seed. Printed, and named in the report of
    a failing test of the module (conftest.py)."""
    import os

    seed = base_seed() if os.environ.get(SEED_ENV, "").strip() else int.from_bytes(os.urandom(4), "little")
    MODULE_SEEDS[module] = seed
    print(f"{module}: seed {seed}")
    return seed


def seeded_key(seed: int, tag: str):
    """A JAX key for case ``tag`` of a run seeded with ``seed`` (a module's module_seed)."""
    import zlib

    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(tag.encode()) % (2**31))


def layer_shape(E: int, H: int, I: int, k: int, Is: int | None = None, name: str = "t") -> ModelShape:
    """A small model shape for the layer's GPU tests: one shared expert of intermediate size Is (default I; 0: none)."""
    Is = I if Is is None else Is
    return ModelShape(name=name, num_experts=E, top_k=k, hidden_size=H, intermediate_size=I,
                      num_shared_experts=1 if Is else 0, shared_intermediate_size=Is)


def layer_problem(seed: int, tag: str, shape: ModelShape, tokens: int, routing: str = "uniform", ranks: int = 1):
    """Fresh random bf16 inputs of case ``tag`` (scaled so every step is O(1)) and routing of ``ranks`` x ``tokens``
    (mok_jax.bench.routing), the router weights scaled by a factor in [0.5, 1.5]: (x, topk_idx, topk_weight,
    MoEWeights)."""
    import zlib

    from mok_jax.bench.routing import make_routing

    kx, kg, kd, ksg, ksd = jax.random.split(seeded_key(seed, tag), 5)
    E, H, I, Is, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.shared_size, shape.top_k
    x = jax.random.normal(kx, (ranks * tokens, H), jnp.float32).astype(jnp.bfloat16)
    W = MoEWeights(
        (jax.random.normal(kg, (E, H, 2 * I)) * H**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(kd, (E, I, H)) * I**-0.5).astype(jnp.bfloat16),
        (jax.random.normal(ksg, (H, 2 * Is)) * H**-0.5).astype(jnp.bfloat16) if Is else None,
        (jax.random.normal(ksd, (Is, H)) * Is**-0.5).astype(jnp.bfloat16) if Is else None,
    )
    idx, w = make_routing(routing, num_ranks=ranks, tokens_per_rank=tokens, num_experts=E, top_k=k,
                          seed=zlib.crc32(f"{seed}{tag}".encode()))
    w = np.asarray(w, np.float32) * np.random.default_rng(zlib.crc32(tag.encode())).uniform(0.5, 1.5, w.shape)
    return x, jnp.asarray(idx, jnp.int32), jnp.asarray(w, jnp.float32), W


def record_metrics(case: str, seed: int, **metrics) -> None:
    """Print one JSON line of a case's errors; append it to $MOK_TEST_METRICS when set."""
    import json
    import os

    line = json.dumps({"case": case, "seed": seed, **metrics})
    print(line)
    if path := os.environ.get("MOK_TEST_METRICS"):
        with open(path, "a") as f:
            f.write(line + "\n")


def program_problem(seed: int, tag: str, E=16, H=512, I=256, k=4, Is=256, T=600, layers=None):
    """The GPU program tests' problem (tests/test_programs*_gpu.py), fresh for (seed, tag): x: bf16[T, H];
    topk_idx int32 and topk_weight f32 ([T, k], or [layers, T, k]: a routing per layer); bf16 weights (with a
    leading layer axis when ``layers`` is given) scaled so every step is O(1); dy: bf16[T, H] (an output
    gradient)."""
    import zlib

    from mok_jax.bench.routing import make_routing

    keys = jax.random.split(seeded_key(seed, tag), 6)
    lead = () if layers is None else (layers,)
    normal = lambda key, s, fan_in: (jax.random.normal(key, lead + s) * fan_in**-0.5).astype(jnp.bfloat16)  # noqa: E731
    W = MoEWeights(normal(keys[0], (E, H, 2 * I), H), normal(keys[1], (E, I, H), I),
                   normal(keys[2], (H, 2 * Is), H), normal(keys[3], (Is, H), Is))
    x = jax.random.normal(keys[4], (T, H), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[5], (T, H), jnp.float32).astype(jnp.bfloat16)
    route_seed = zlib.crc32(f"{seed}{tag}".encode())
    routes = [make_routing("uniform", num_ranks=1, tokens_per_rank=T, num_experts=E, top_k=k, seed=route_seed + layer)
              for layer in range(layers or 1)]
    idx = np.stack([r[0] for r in routes]).astype(np.int32)
    w = np.stack([r[1] for r in routes]).astype(np.float32)
    if layers is None:
        idx, w = idx[0], w[0]
    return x, jnp.asarray(idx), jnp.asarray(w), W, dy


def free_port() -> int:
    """A TCP port of localhost that is free now: for a jax.distributed coordinator of the test's processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argvs: list[list[str]], *, env: dict, cwd, timeout: float) -> list[tuple[int, str]]:
    """Start one process per argv at once (they meet each other, e.g. under jax.distributed), wait for all, and
    return each one's (return code, stdout and stderr together). A process still running after ``timeout`` s
    has every process killed (the others would wait on it) and its output so far returned."""
    import subprocess

    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv in argvs]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0])
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def ffi_calls(jaxpr, inside=()) -> list:
    """(enclosing primitive names, eqn) of every ffi_call in ``jaxpr``, nested jaxprs (a cond's branches, a
    shard_map's body) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call":
            found.append((inside, eqn))
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += ffi_calls(sub, inside + (eqn.primitive.name,))
    return found


def bits(a) -> np.ndarray:
    """a's raw bits (16- or 32-bit elements), for bit-for-bit comparisons."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(case: str, got, want) -> None:
    """Every field of two outputs of the experts' backward (NamedTuples) the same bits; a field None in one is
    None in the other."""
    for name, a, b in zip(want._fields, got, want):
        assert (a is None) == (b is None), f"{case}: {name}"
        if a is not None:
            np.testing.assert_array_equal(bits(a), bits(b), f"{case}: {name} changed bits")


def use_fused_ep_backward(monkeypatch, ep: int, fused: bool = True) -> None:
    """The layer's backward at EP > 1 on CPU: with ``fused`` through the fused op (mok_jax.layer.FUSED_EP_BACKWARD,
    the layer's default), its reference standing in for the kernel (collectives over the mesh axis 'ep' where the
    kernel moves rows over NVLink) and a stand-in for the workspace this machine cannot create; without, over the
    collectives path around the EP-1 op."""
    import functools
    import importlib
    import types

    import mok_jax.ops
    from mok_jax.reference import experts_backward_ep_reference

    moe_mod = importlib.import_module("mok_jax.layer")
    monkeypatch.setattr(mok_jax.ops, "experts_backward_ep", functools.partial(experts_backward_ep_reference,
                                                                                axis_name="ep"))
    fake_ws = types.SimpleNamespace(config=types.SimpleNamespace(ep=ep), device_kind=None)
    monkeypatch.setattr(moe_mod, "_workspace", lambda *args: fake_ws)
    monkeypatch.setattr(moe_mod, "FUSED_EP_BACKWARD", fused)


def ring_part(gu, src_slot, k: int, first: int):
    """(gu_part, gu_part_row, rows kept): the g, u of a layout's slot rows whose token is >= first (as
    MoEConfig(keep="ring") keeps the ring's tokens'), numbered in row order; gu: [M, 2I] of every row."""
    mine = np.asarray((src_slot >= 0) & (src_slot // k >= first))
    row = jnp.asarray(np.where(mine, np.cumsum(mine) - 1, -1).astype(np.int32))
    return gu[np.nonzero(mine)[0]], row, mine


def used_kept_blocks(src_slot, row, kept_rows: int, slots: int, group_sizes) -> np.ndarray:
    """mok_jax.expert_layout.kept_blocks over the 128-row blocks the groups use (sum(group_sizes) / 128 of them):
    1 where the experts' backward copies the kept g, u, 0 where it recomputes."""
    from mok_jax.expert_layout import kept_blocks

    used = int(np.sum(np.asarray(group_sizes))) // 128
    return np.asarray(kept_blocks(src_slot, row, kept_rows, slots))[:used]
