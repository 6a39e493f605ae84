"""The reference layer's expert-parallel form on two GPUs agrees with the single-device reference on the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax as mj
from helpers import random_problem, rel_err


@pytest.mark.multigpu
def test_expert_parallel_reference_on_two_gpus(seed):
    shape = mj.load_model("ci")
    x, idx, w, W = random_problem(shape, 128, dtype=jnp.bfloat16, seed=seed(31))
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("gpu")[:2])
    host = jax.tree.map(np.asarray, (x, idx, w, W))  # uncommitted inputs: expert_parallel_moe lays them out
    got = jax.jit(lambda *a: mj.expert_parallel_moe(*a, mesh=mesh))(*host)
    want = jax.jit(mj.moe)(*jax.device_put((x, idx, w, W), jax.devices("cpu")[0]))
    assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 4 * 2.0**-8
