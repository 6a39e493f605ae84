"""What a mok-bench run times, and how: the layer's weights, routing and inputs on the devices, the dense FFN's
problem (the ``dense`` row), the timed step of each pass, the measurement (first call, then
``mok_jax.bench.timing.time_fn``) and the profile."""

from __future__ import annotations

import os
import time
from typing import Any

from mok_jax.bench import accounting as acc
from mok_jax.bench.options import DENSE, FP8_IMPL, MAX_CALLS_PER_SAMPLE, TARGET_SAMPLE_MS, BenchOptions
from mok_jax.bench.records import fill_timing

__all__ = ["RunArrays", "dense_inputs", "dense_timed_step", "init_weights", "layer_inputs", "layer_step", "measure",
           "routing_and_traffic", "write_profile"]


def init_weights(shape: acc.BenchShape, mesh, dtype, seed: int):
    """Random routed (sharded over ep) and shared (replicated) weights, made on the devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.weights import MoEWeights

    E, H, I, Is = shape.total_experts, shape.hidden_size, shape.intermediate_size, shape.shared_size
    routed, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())

    def make(key):
        k = jax.random.split(key, 4)
        normal = lambda key, s, fan_in: jax.random.normal(key, s, dtype) * jax.numpy.asarray(fan_in**-0.5, dtype)
        return MoEWeights(normal(k[0], (E, H, 2 * I), H), normal(k[1], (E, I, H), I),
                          normal(k[2], (H, 2 * Is), H) if Is else None, normal(k[3], (Is, H), Is) if Is else None)

    out = MoEWeights(routed, routed, rep if Is else None, rep if Is else None)
    return jax.jit(make, out_shardings=out)(jax.random.key(seed))


def routing_and_traffic(shape: acc.BenchShape, tokens: int, opts: BenchOptions):
    """(topk_idx, topk_weight) as numpy arrays, and their Traffic."""
    from mok_jax.bench.routing import make_routing

    idx, w = make_routing(opts.routing, num_ranks=shape.num_gpus, tokens_per_rank=tokens,
                          num_experts=shape.total_experts, top_k=shape.top_k, seed=opts.seed, zipf_s=opts.zipf_s)
    return (idx, w), acc.routing_traffic(idx, shape.num_gpus, shape.experts_per_gpu)


def layer_inputs(shape: acc.BenchShape, tokens: int, routing, mesh, dtype, seed: int):
    """(x, topk_idx, topk_weight, dy) on the devices, sharded over ep."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    tok = NamedSharding(mesh, P("ep"))
    kx, kdy = jax.random.split(jax.random.key(seed + 1))
    normal = jax.jit(lambda key: jax.random.normal(key, (shape.num_gpus * tokens, shape.hidden_size), dtype),
                     out_shardings=tok)
    return normal(kx), jax.device_put(routing[0], tok), jax.device_put(routing[1], tok), normal(kdy)


def layer_step(fn, pass_: str, *, fp8_weights: bool = False):
    """What one timed call runs: fn itself for fwd; for fwd+bwd the gradient of sum(y * dy) with respect to
    x, topk_weight and the weights (fixed random dy). ``fp8_weights`` (mok-fp8's fwd): the step takes the E4M3
    weights as a sixth argument, made outside it; its fwd+bwd passes none, so the layer quantises inside."""
    if pass_ == "fwd" and fp8_weights:
        return lambda x, idx, w, W, dy, W8: fn(x, idx, w, W, fp8_weights=W8)
    if pass_ == "fwd":
        return lambda x, idx, w, W, dy: fn(x, idx, w, W)
    import jax
    import jax.numpy as jnp

    def loss(x, idx, w, W, dy):
        y, _ = fn(x, idx, w, W)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 2, 3)))


def dense_inputs(shape: acc.BenchShape, tokens: int, mesh, dtype, seed: int):
    """The ``dense`` implementation's arguments: per device its own dense problem of the rank's forward FLOPs
    (mok_jax.bench.dense: T k (+ T shared) rows, one weight pair), stacked on a leading axis sharded over ep, so
    that every device runs its FFN at once, in one program, as every device runs its layer. (xs, weights, dys)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.bench.dense import dense_groups, dense_problem

    groups = dense_groups(tokens, shape.top_k, shape.intermediate_size, shape.shared_size)
    devices = list(mesh.devices.flat)
    per_device = [dense_problem(groups, shape.hidden_size, dtype=dtype, seed=seed, device=d) for d in devices]
    stacked = NamedSharding(mesh, P("ep"))
    stack = lambda *blocks: jax.make_array_from_single_device_arrays(
        (len(blocks), *blocks[0].shape), stacked, [b[None] for b in blocks])
    return tuple(jax.tree.map(stack, *per_device))


def dense_timed_step(pass_: str, mesh):
    """The ``dense`` step of ``pass_`` on ``dense_inputs``: mok_jax.bench.dense.dense_step on each device's own
    problem under shard_map. Each device's weights are its own (not replicated), so the backward has no
    collective: the dense FFN's FLOPs and bytes, nothing else. fwd(xs, weights), fwd+bwd(xs, weights, dys)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from mok_jax.bench.dense import dense_step

    inner = dense_step(pass_)

    def per_device(*args):  # each block [1, ...]: the device's problem
        out = inner(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


class RunArrays:
    """What the timed steps take, made on first use and kept while runs use them: the current model's weights (and
    their E4M3 form for mok-fp8's forward), the current tokens' layer inputs and dense problem (the previous ones
    freed first), and the built layers and steps."""

    def __init__(self, mesh, dtype, opts: BenchOptions):
        self.mesh, self.dtype, self.opts = mesh, dtype, opts
        self.fns: dict[tuple, Any] = {}  # per (impl, kernel): the built layer (baselines.build)
        self.steps: dict[tuple, Any] = {}  # per (impl, kernel, pass)
        self.clear()

    def clear(self) -> None:
        """Drop every array (the built callables stay)."""
        self.shape = self.tokens = None
        self.weights = self.fp8_weights = self.layer = self.dense = None

    def fn(self, impl: str, kernel):
        """The built layer of ``impl`` (a baseline or mok with ``kernel``)."""
        from mok_jax.bench import baselines

        if (impl, kernel) not in self.fns:
            self.fns[impl, kernel] = baselines.build(impl, self.mesh, capacity_factor=self.opts.capacity_factor,
                                                     kernel=kernel)
        return self.fns[impl, kernel]

    def step_and_args(self, shape: acc.BenchShape, tokens: int, routing, pass_: str, impl: str, kernel):
        """(the timed step of ``impl`` for ``pass_``, its arguments) on ``shape`` at ``tokens`` per GPU."""
        from mok_jax.bench import baselines

        if self.shape is not shape:
            self.clear()
            self.shape = shape
        if self.tokens != tokens:
            self.layer = self.dense = None  # free the previous inputs before making the next
            self.tokens = tokens
        key = (impl, kernel, pass_)
        if impl == DENSE:  # its own problem: T k (+ T) rows of one dense FFN per device
            if self.dense is None:
                self.dense = dense_inputs(shape, tokens, self.mesh, self.dtype, self.opts.seed)
            if key not in self.steps:
                self.steps[key] = dense_timed_step(pass_, self.mesh)
            xs, ws, dys = self.dense
            return self.steps[key], ((xs, ws) if pass_ == "fwd" else (xs, ws, dys))
        if self.weights is None:
            self.weights = init_weights(shape, self.mesh, self.dtype, self.opts.seed)
        if self.layer is None:
            self.layer = layer_inputs(shape, tokens, routing, self.mesh, self.dtype, self.opts.seed)
        fp8_weights = impl == FP8_IMPL and pass_ == "fwd"  # made outside the timed call (mok_jax.bench.cli)
        if key not in self.steps:
            self.steps[key] = layer_step(self.fn(impl, kernel), pass_, fp8_weights=fp8_weights)
        x, idx, w, dy = self.layer
        args = (x, idx, w, self.weights, dy)
        if fp8_weights:
            if self.fp8_weights is None:
                self.fp8_weights = baselines.quantize_weights(self.weights, self.mesh)
            args += (self.fp8_weights,)
        return self.steps[key], args


def measure(r: dict, step, args, *, slow: bool, opts: BenchOptions) -> None:
    """First call (compilation included), then time_fn; fills r's timing figures. ``slow``: 'ragged', timed with
    one warm-up and one call per sample."""
    import jax

    from mok_jax.bench.timing import time_fn

    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    r["first_call_s"] = time.perf_counter() - t0
    r["warmup"] = 1 if slow else opts.warmup
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    target = opts.target_sample_ms or TARGET_SAMPLE_MS[platform]
    timing = time_fn(step, *args, warmup=r["warmup"], samples=opts.ragged_samples if slow else opts.samples,
                     target_sample_ms=target, max_calls_per_sample=1 if slow else MAX_CALLS_PER_SAMPLE[platform])
    fill_timing(r, timing)


def write_profile(directory: str, r: dict, step, args) -> None:
    """A jax.profiler trace of three calls under DIR/<model>_<mode>_T<tokens>_<pass>_<impl>/."""
    import jax

    label = f"{r['model']}_{r['ep_mode']}_T{r['tokens_per_gpu']}_{r['pass'].replace('+', '_')}_{r['impl']}"
    if r.get("kernel"):
        k = r["kernel"]
        label += f"_g{k['granularity']}_s{k['comm_items_fwd']}_r{k['ring_slots']}_{k['dispatch']}_{k['combine']}"
    label = label.replace("/", "-")  # ep_mode E/32
    with jax.profiler.trace(os.path.join(directory, label)):
        with jax.profiler.TraceAnnotation(f"mok-bench {label}"):
            out = None
            for _ in range(3):
                out = step(*args)
            jax.block_until_ready(out)
