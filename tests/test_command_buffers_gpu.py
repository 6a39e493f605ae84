"""GPU tests of the mok custom calls inside XLA command buffers (CUDA graphs), issue 11 item 2.

Every handler declares XLA's command-buffer trait (ffi/src/ffi_common.h), so XLA may record a step's custom calls
into a CUDA graph once and replay it. Each case runs the same jitted steps in two child processes, one with
command buffers off and one with custom calls in command buffers (and every sequence, however short, captured),
and checks that (a) the replays give the bits of the steps run without command buffers, every time, and (b) in
the second process the handlers ran fewer times than the steps called them: the kernels were replayed from the
graph (the library counts its handler runs: ``mok_handler_runs``). XLA's command-buffer flags are per process,
hence the child processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import module_seed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

_SEED = module_seed(__name__) % 100000  # MOK_TEST_SEED, else fresh (helpers.py: seeds)

_STEPS = 5

# One child: a forward step, a 4-layer lax.scan step and a gradient step (forward + backward handlers) of
# implementation="mok", each called _STEPS times on the same inputs after one warm-up call.
_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys, zlib
    import jax, jax.numpy as jnp, numpy as np
    import mok_jax as mj
    from mok_jax import _native
    from mok_jax.bench.routing import make_routing
    from mok_jax.config import KernelConfig, MoEConfig
    from mok_jax.weights import MoEWeights
    seed, steps = int(sys.argv[1]), int(sys.argv[2])
    E, H, I, k, Is, T = 16, 512, 256, 4, 256, 600
    ks = jax.random.split(jax.random.key(seed), 5)
    n = lambda key, s, f: (jax.random.normal(key, s) * f**-0.5).astype(jnp.bfloat16)
    W = MoEWeights(n(ks[0], (E, H, 2 * I), H), n(ks[1], (E, I, H), I), n(ks[2], (H, 2 * Is), H), n(ks[3], (Is, H), Is))
    x = jax.random.normal(ks[4], (T, H)).astype(jnp.bfloat16)
    idx, w = make_routing("uniform", num_ranks=1, tokens_per_rank=T, num_experts=E, top_k=k, seed=seed % 1000)
    idx, w = jnp.asarray(idx, jnp.int32), jnp.asarray(w, jnp.float32)
    cfg = MoEConfig(implementation="mok", kernel=KernelConfig(granularity=512, comm_items_fwd=8))
    layer = lambda x, W: mj.moe(x, idx, w, W, config=cfg)
    Ws = jax.tree.map(lambda a: jnp.stack([a] * 4), W)
    def scan(x):
        body = lambda h, Wl: ((layer(h, Wl).astype(jnp.float32) * 0.5).astype(jnp.bfloat16), None)
        return jax.lax.scan(body, x, Ws)[0]
    def grad(x, W):
        loss = lambda x, w_, W: jnp.sum(mj.moe(x, idx, w_, W, config=cfg).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, W)
    cases = {"forward": (jax.jit(lambda x: layer(x, W) * 2), (x,)), "scan": (jax.jit(scan), (x,)),
             "grad": (jax.jit(grad), (x, W))}
    lib = _native.library()
    lib.mok_handler_runs.restype = ctypes.c_int64
    bits = lambda tree: [np.asarray(a).view(np.uint8).tobytes() for a in jax.tree.leaves(tree)]
    out = {}
    for name, (f, args) in cases.items():
        jax.block_until_ready(f(*args))
        before = lib.mok_handler_runs()
        runs = [bits(jax.block_until_ready(f(*args))) for _ in range(steps)]
        out[name] = {"handler_runs": lib.mok_handler_runs() - before,
                     "replays_equal": all(r == runs[0] for r in runs),
                     "crc": [zlib.crc32(b) for b in runs[0]]}
    print(json.dumps(out))
""")

# the fewest calls of the library's handlers per step: forward 1; scan 4 (a forward per layer; XLA's while loop
# ran 8 on the H200, jax 0.11.2); grad: forward + backward
_HANDLERS_PER_STEP = {"forward": 1, "scan": 4, "grad": 2}


def _run(xla_flags: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(_SEED), str(_STEPS)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    plain = _run("--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=")
    graph = _run("--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE "
                 "--xla_gpu_graph_min_graph_size=1")
    return plain, graph


@pytest.mark.parametrize("case", sorted(_HANDLERS_PER_STEP))
def test_command_buffer_replays_give_the_bits_of_plain_steps(runs, case):
    plain, graph = runs[0][case], runs[1][case]
    print(f"{case}: handler runs in {_STEPS} steps: {plain['handler_runs']} plain, {graph['handler_runs']} with "
          f"command buffers")
    assert plain["handler_runs"] >= _STEPS * _HANDLERS_PER_STEP[case], plain
    assert plain["handler_runs"] % _STEPS == 0, plain  # the same calls every step
    assert plain["replays_equal"] and graph["replays_equal"], (plain, graph)
    assert graph["crc"] == plain["crc"], (plain, graph)
    assert graph["handler_runs"] < plain["handler_runs"], (
        f"{case}: the handlers ran {graph['handler_runs']} times in {_STEPS} steps with command buffers on: "
        f"the custom calls were not replayed from a command buffer")
