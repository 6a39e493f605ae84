"""Bad arguments raise ValueError or TypeError naming the argument, at trace time, and the process lives on."""

import jax
import jax.numpy as jnp
import pytest

import mok_jax as mj
from helpers import random_problem
from mok_jax._native import NativeLibraryUnavailable


@pytest.fixture
def problem():
    return random_problem(mj.load_model("ci"), 16, seed=20)


def test_bad_ranks_shapes_dtypes(problem):
    x, idx, w, W = problem
    cases = [
        ((x[None], idx, w, W), ValueError, "x must be rank 2"),
        ((x.astype(jnp.int32), idx, w, W), TypeError, "x must be bfloat16 or float32"),
        ((x, idx[:, 0], w, W), ValueError, "topk_idx must be"),
        ((x, idx[:-1], w, W), ValueError, "topk_idx must be"),
        ((x, idx.astype(jnp.float32), w, W), TypeError, "topk_idx must be int32"),
        ((x, idx, w[:, :-1], W), ValueError, "topk_weight must have the shape"),
        ((x, idx, w.astype(jnp.int32), W), TypeError, "topk_weight must be"),
        ((x, idx, w, W._replace(gate_up=W.gate_up[..., :-1])), ValueError, "weights.gate_up"),
        ((x, idx, w, W._replace(down=W.down[:, :, :-1])), ValueError, "weights.down"),
        ((x, idx, w, W._replace(down=W.down.astype(jnp.bfloat16))), TypeError,
         r"weights.down must be float32 \(x's dtype\), got bfloat16"),
        ((x, idx, w, W._replace(shared_down=None)), ValueError, "both be given"),
        ((x, idx, w, W._replace(shared_down=W.shared_down[:-1])), ValueError, "weights.shared_down"),
        ((x, idx, w, (W.gate_up, W.down)), TypeError, "weights must be a mok_jax.MoEWeights"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            mj.moe(*args)
        with pytest.raises(exc, match=msg):  # also at trace time under jit
            jax.jit(lambda *a: mj.moe(*a))(*args)


def test_top_k_larger_than_experts(problem):
    x, _, w, W = problem
    W4 = W._replace(gate_up=W.gate_up[:2], down=W.down[:2])
    idx = jnp.zeros((16, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"top_k \(4, from topk_idx\) must not exceed the number of experts \(2\)"):
        mj.moe(x, idx, jnp.ones((16, 4)), W4)
    with pytest.raises(ValueError, match="top_k"):
        mj.load_model("ci").replace(top_k=17)


def test_concrete_routing_values_checked(problem):
    x, idx, w, W = problem
    with pytest.raises(ValueError, match=r"topk_idx values must be in \[0, 16\)"):
        mj.moe(x, idx.at[0, 0].set(16), w, W)
    with pytest.raises(ValueError, match="distinct experts"):
        mj.moe(x, idx.at[0, 1].set(idx[0, 0]), w, W)


def test_config_errors(problem):
    x, idx, w, W = problem
    with pytest.raises(ValueError, match="implementation"):
        mj.MoEConfig(implementation="cuda")
    with pytest.raises(TypeError, match="ep_axis"):
        mj.MoEConfig(ep_axis=3)
    with pytest.raises(TypeError, match="config must be a mok_jax.MoEConfig"):
        mj.moe(x, idx, w, W, config={"implementation": "xla"})
    with pytest.raises(ValueError, match="ep_axis='ep' is not a mesh axis bound here"):
        mj.moe(x, idx, w, W, config=mj.MoEConfig(ep_axis="ep"))
    with pytest.raises(ValueError, match="granularity"):
        mj.KernelConfig(granularity=100)
    with pytest.raises(ValueError, match="dispatch"):
        mj.KernelConfig(dispatch="broadcast")


def test_mesh_errors(cpu_devices, problem):
    x, idx, w, W = problem
    mesh = jax.make_mesh((2, 4), ("dp", "ep"))
    with pytest.raises(ValueError, match="mesh has no axis named 'expert'"):
        mj.expert_parallel_moe(x, idx, w, W, mesh=mesh, config=mj.MoEConfig(ep_axis="expert"))
    mesh3 = jax.make_mesh((1, 3), ("dp", "ep"), devices=jax.devices("cpu")[:3])
    with pytest.raises(ValueError, match=r"number of experts \(16, weights.gate_up.shape\[0\]\) must be divisible"):
        mj.expert_parallel_moe(x, idx, w, W, mesh=mesh3)
    with pytest.raises(ValueError, match="tokens divisible by the 8 token shards"):
        mj.expert_parallel_moe(x[:12], idx[:12], w[:12], W, mesh=mesh)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        mj.expert_parallel_moe(x, idx, w, W, mesh="ep")
    with pytest.raises(ValueError, match="token_axes"):
        mj.expert_parallel_moe(x, idx, w, W, mesh=mesh, token_axes=("dp",))


def test_mok_implementation_never_falls_back(problem):
    x, idx, w, W = problem
    with pytest.raises((NativeLibraryUnavailable, NotImplementedError), match="implementation='mok'"):
        mj.moe(x, idx, w, W, config=mj.MoEConfig(implementation="mok"))


def test_unknown_model_names_known_ones():
    with pytest.raises(ValueError, match="unknown model 'kimi'.*kimi-k2"):
        mj.load_model("kimi")
