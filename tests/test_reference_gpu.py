"""The reference layer runs on the GPU and agrees with the CPU (the GPU's XLA picks other kernels). Its
expert-parallel form on two GPUs: tests/test_reference_multigpu.py."""

import jax
import pytest

import mok_jax as mj
from helpers import random_problem, rel_err

# GPU vs CPU f32 matmuls: XLA GPU may use TF32-free cuBLAS paths with other blocking: a few f32 ulps,
# amplified by the SwiGLU; 1e-4 relative in norm still rejects any indexing or routing mistake.
TOL_GPU_VS_CPU_F32 = 1e-4


@pytest.mark.gpu
def test_reference_layer_on_gpu_matches_cpu(seed):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 256, seed=seed(30))
    with jax.default_matmul_precision("highest"):
        y_gpu = jax.device_get(jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("gpu")[0])))
        y_cpu = jax.device_get(jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("cpu")[0])))
    assert rel_err(y_gpu, y_cpu) < TOL_GPU_VS_CPU_F32

