"""The reference layer runs on the GPU and agrees with the CPU (the GPU's XLA picks other kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax as mj
from helpers import random_problem, rel_err

# GPU vs CPU f32 matmuls: XLA GPU may use TF32-free cuBLAS paths with other blocking: a few f32 ulps,
# amplified by the SwiGLU; 1e-4 relative in norm still rejects any indexing or routing mistake.
TOL_GPU_VS_CPU_F32 = 1e-4


@pytest.mark.gpu
def test_reference_layer_on_gpu_matches_cpu():
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 256, seed=30)
    with jax.default_matmul_precision("highest"):
        y_gpu = jax.device_get(jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("gpu")[0])))
        y_cpu = jax.device_get(jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("cpu")[0])))
    assert rel_err(y_gpu, y_cpu) < TOL_GPU_VS_CPU_F32


@pytest.mark.multigpu
def test_expert_parallel_reference_on_two_gpus():
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 128, dtype=jnp.bfloat16, seed=31)
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("gpu")[:2])
    host = jax.tree.map(np.asarray, (x, idx, w, W))  # uncommitted inputs: expert_parallel_moe lays them out
    got = jax.jit(lambda *a: mj.expert_parallel_moe(*a, mesh=mesh))(*host)
    want = jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("cpu")[0]))
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 4 * 2.0**-8
