"""GPU tests of the emulation above 8 ranks (issue 36, item 2): EP 16, 32 and 64 on one GPU, every rank in one launch
of the kernels' forms whose ranks' parameters live in device memory (forward_kernel_many: each rank's RankParams in
its own scratch, ffi/include/mok/moe/forward_params.cuh; experts_backward_kernel_many: each rank's KernelParams in
its row of the counters scratch, ffi/include/mok/backward/params.cuh).

The combine is per slot (the owners push each slot's expert row and the origin sums w_j row_j over the slots in
order), so y's bits do not depend on the EP size: each case compares the emulated y at EP 16-64 bit for bit with the
EP 1 layer (mok_jax.moe, implementation="mok") on the same global inputs, and that y with the fp32 reference within
tests/test_moe_gpu.py's bound. Routing extremes at EP 64: every token to one rank's experts (63 ranks receive
nothing), a handful of ranks receive everything, ranks and experts that receive nothing, masked slots and a rank
whose every slot is masked (it sends nothing). Also the data path with identity experts against the numpy oracle,
FP8 routed experts, and the lab form (skip_rank) at EP 16. The fused backward: every gradient at EP 16, 32 and 64
the bits of jax.grad of the EP 1 layer (that one against the fp32 reference, per row), and the routing extremes at
EP 64. Small shapes: each case runs in seconds.
Set MOK_TEST_METRICS=path to append one JSON line of errors per case; MOK_TEST_SEED=<seed> draws a run again.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import GRAD_NAMES, layer_problem, layer_shape, module_seed, record_metrics
from test_moe_backward_gpu import _check_layer
from test_moe_gpu import _check_math

import mok_jax as mj
from mok_jax.config import KernelConfig
from mok_jax.emulation import emulated_moe, emulated_moe_backward
from mok_jax.reference.comm import moe_identity_numpy
from mok_jax.workspace import CommTimeoutError, Workspace

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

_SEED = module_seed(__name__)
_problem = functools.partial(layer_problem, _SEED)  # (tag, shape, tokens, routing="uniform", ranks=1)
# Two CTAs per rank at EP 64 on an H200 (132 SMs); the communication items of a phase are capped at a rank's CTAs.
_CFG = KernelConfig(granularity=512, comm_items_fwd=4)
_GLOBAL_TOKENS = 1024  # 16 tokens per rank at EP 64, 32 at EP 32, 64 at EP 16


def _bits(a):
    return np.asarray(a).view(np.uint16)


@functools.partial(jax.jit, static_argnames=("config",))
def _layer(x, idx, w, W, config):
    return mj.moe(x, idx, w, W, config=config)


def _mok(precision: str = "bf16"):
    return mj.MoEConfig(implementation="mok", kernel=_CFG, precision=precision)


def _assert_ep_bits(case: str, ep: int, x, idx, w, W, y1, precision: str = "bf16"):
    """The emulated forward at EP ``ep``: a clean status and y bit for bit the EP 1 layer's ``y1``."""
    y, status = emulated_moe(x, idx, w, W, ep=ep, kernel=_CFG, precision=precision)
    status = np.asarray(status)
    assert status.shape == (ep, 4) and not status.any(), f"{case} EP {ep}: status {status[status.any(1)][:4]}"
    differ = np.where((_bits(y) != _bits(y1)).any(1))[0]
    record_metrics(f"{case}_ep{ep}", _SEED, rows_differing=int(differ.size))
    assert differ.size == 0, (f"{case} EP {ep}: {differ.size} rows of y differ from EP 1's, first "
                              f"{differ[:8].tolist()} (ranks {sorted(set((differ // (x.shape[0] // ep)).tolist()))[:8]})")


def _no_repeats(ids: np.ndarray) -> np.ndarray:
    """A token's repeated expert ids masked (-1): each token picks k distinct experts."""
    ids = ids.copy()
    for row in ids:
        seen = set()
        for j, e in enumerate(row):
            row[j] = -1 if e in seen else e
            seen.add(int(e))
    return ids


# ----------------------------------------------------------------------------- EP 16, 32, 64: the bits of EP 1


@pytest.mark.parametrize("shared", [True, False])
def test_y_bits_at_ep_16_32_64_are_those_of_ep_1(shared):
    """64 experts (1 per rank at EP 64), k 6, zipf routing with a masked slot: the same y at EP 1, 16, 32 and 64."""
    shape = layer_shape(64, 256, 128, 6, Is=128 if shared else 0)
    x, idx, w, W = _problem(f"ep64bits{shared}", shape, _GLOBAL_TOKENS, "zipf")
    idx = idx.at[5, 3].set(-1)
    y1 = _layer(x, idx, w, W, config=_mok())
    _check_math(f"ep64bits_shared{shared}", y1, x, idx, w, W)
    for ep in (16, 32, 64):
        _assert_ep_bits(f"ep64bits_shared{shared}", ep, x, idx, w, W, y1)


def test_k8_and_several_experts_per_rank():
    """256 experts (4 per rank at EP 64), k 8 > experts per rank, uniform routing."""
    shape = layer_shape(256, 256, 128, 8)
    x, idx, w, W = _problem("ep64k8", shape, _GLOBAL_TOKENS)
    y1 = _layer(x, idx, w, W, config=_mok())
    _check_math("ep64k8", y1, x, idx, w, W)
    for ep in (16, 64):
        _assert_ep_bits("ep64k8", ep, x, idx, w, W, y1)


# ----------------------------------------------------------------------------- routing extremes at EP 64


def _extreme(case: str):
    """(x, topk_idx, topk_weight, weights) of a routing extreme over 64 ranks of 16 tokens."""
    rng = np.random.default_rng(zlib.crc32(f"{_SEED}{case}".encode()))
    n = _GLOBAL_TOKENS
    if case == "one_rank":  # every slot of every token on rank 37's 4 experts: 63 ranks receive nothing
        shape = layer_shape(256, 256, 128, 4)
        x, _, w, W = _problem(case, shape, n)
        ids = np.stack([rng.permutation(4) + 4 * 37 for _ in range(n)])
    elif case == "few_ranks":  # every token on experts 0..5 (ranks 0..5 at 1 expert per rank), 58 ranks idle
        shape = layer_shape(64, 256, 128, 6)
        x, idx, w, W = _problem(case, shape, n, "one-expert")
        ids = np.asarray(idx)
    elif case == "idle_experts":  # only expert 1 of each odd rank: even ranks and 3 of each odd rank's 4 idle
        shape = layer_shape(256, 256, 128, 8)
        x, _, w, W = _problem(case, shape, n)
        used = 4 * np.arange(1, 64, 2) + 1
        ids = np.stack([rng.choice(used, 8, replace=False) for _ in range(n)])
    elif case == "masked":  # 30% of the slots masked, 8 tokens and all of rank 10's tokens fully masked
        shape = layer_shape(64, 256, 128, 6)
        x, idx, w, W = _problem(case, shape, n)
        ids = np.asarray(idx).copy()
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[:8] = -1
        ids[10 * 16:11 * 16] = -1  # rank 10 sends nothing
    else:
        raise AssertionError(case)
    return x, jnp.asarray(_no_repeats(ids), jnp.int32), w, W


@pytest.mark.parametrize("case", ["one_rank", "few_ranks", "idle_experts", "masked"])
def test_routing_extremes_at_ep_64(case):
    x, idx, w, W = _extreme(case)
    y1 = _layer(x, idx, w, W, config=_mok())
    _check_math(f"ep64_{case}", y1, x, idx, w, W)
    _assert_ep_bits(f"ep64_{case}", 64, x, idx, w, W, y1)
    if case == "masked":  # a masked slot's weight is ignored, whatever it is
        w_big = jnp.where(idx < 0, 1e30, w)
        _assert_ep_bits("ep64_masked_weights", 64, x, idx, w_big, W, y1)


# ----------------------------------------------------------------------------- the fused backward at EP 16, 32, 64


def _dy(case: str, x):
    return jax.random.normal(jax.random.key(zlib.crc32(f"{_SEED}{case}dy".encode())), x.shape).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("config",))
def _grads(x, idx, w, W, dy, config):
    """(dx, d topk_weight, d weights) of <moe(x), dy> at EP 1."""
    def loss(x, w, W):
        return jnp.sum(mj.moe(x, idx, w, W, config=config).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(x, w, W)


def _assert_backward_ep_bits(case: str, ep: int, x, idx, w, W, dy, one, exact=GRAD_NAMES):
    """The fused backward emulated at EP ``ep``: a clean status and the gradients named in ``exact`` bit for bit EP
    1's (``one``). Without a shared expert that is every one (each slot has one owner; the layouts keep global slot
    order, so the weight gradients' K order is EP 1's)."""
    *got, status = emulated_moe_backward(x, idx, w, W, dy, ep=ep, kernel=_CFG, fused=True, return_status=True)
    status = np.asarray(status)
    assert status.shape == (ep,) and not status.any(), f"{case} EP {ep}: status {status}"
    checked = 0
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(one)):
        if name not in exact:
            continue
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        differ = np.where((a.view(np.uint32) != b.view(np.uint32)).reshape(a.shape[0], -1).any(1))[0]
        record_metrics(f"{case}_bwd_ep{ep}_{name}", _SEED, rows_differing=int(differ.size))
        assert differ.size == 0, (f"{case} EP {ep}: {name}: {differ.size} rows differ from EP 1's, first "
                                  f"{differ[:8].tolist()}")
        checked += 1
    assert checked == len([n for n in GRAD_NAMES[:4] if n in exact]), (case, checked)


@pytest.mark.parametrize("shared", [False, True])
def test_backward_bits_at_ep_16_32_64_are_those_of_ep_1(shared):
    """64 experts (1 per rank at EP 64), k 6, zipf routing with a masked slot: the EP 1 layer's gradients against
    the fp32 reference, then the fused backward at EP 16, 32 and 64 bit for bit those. With a shared expert its
    backward runs per rank in XLA (at EP 1: in the op), so dx is checked against the reference instead, and the
    routed experts' and router weights' gradients still bit for bit."""
    case = f"ep64bwd_shared{shared}"
    shape = layer_shape(64, 256, 128, 6, Is=128 if shared else 0)
    x, idx, w, W = _problem(case, shape, _GLOBAL_TOKENS, "zipf")
    idx = idx.at[5, 3].set(-1)
    dy = _dy(case, x)
    one = _grads(x, idx, w, W, dy, config=_mok())
    _check_layer(f"{case}_ep1", x, idx, w, W, dy, got=one)
    exact = ("d topk_weight", "d gate_up", "d down") if shared else GRAD_NAMES
    for ep in (16, 32, 64):
        _assert_backward_ep_bits(case, ep, x, idx, w, W, dy, one, exact)
        if shared and ep == 64:
            got = emulated_moe_backward(x, idx, w, W, dy, ep=ep, kernel=_CFG, fused=True)
            _check_layer(f"{case}_ep{ep}", x, idx, w, W, dy, got=got)


@pytest.mark.parametrize("case", ["one_rank", "few_ranks", "idle_experts", "masked"])
def test_backward_routing_extremes_at_ep_64(case):
    """The routing extremes of the forward's test (each with a shared expert) through the fused backward at EP 64:
    the routed experts' and router weights' gradients bit for bit EP 1's; dx and the shared expert's gradients (its
    backward runs per rank in XLA, at EP 1 in the op) against the fp32 reference, per row, as EP 1's are."""
    x, idx, w, W = _extreme(case)
    assert W.shared_gate_up is not None
    dy = _dy(case, x)
    one = _grads(x, idx, w, W, dy, config=_mok())
    _check_layer(f"ep64bwd_{case}_ep1", x, idx, w, W, dy, got=one)
    _assert_backward_ep_bits(f"ep64bwd_{case}", 64, x, idx, w, W, dy, one, ("d topk_weight", "d gate_up", "d down"))
    got = emulated_moe_backward(x, idx, w, W, dy, ep=64, kernel=_CFG, fused=True)
    _check_layer(f"ep64bwd_{case}_ep64", x, idx, w, W, dy, got=got)


# ----------------------------------------------------------------------------- the data path, FP8, the lab form


@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_identity_data_path_at_ep_64(dispatch):
    """Identity experts (a test mode): the schedule, dispatch, ring, combine and final sum of 64 ranks, bit for bit
    the numpy oracle, zipf routing (uneven loads) with a masked slot."""
    E = 64
    shape = layer_shape(E, 264, 128, 6)
    x, idx, w, W = _problem(f"ep64identity{dispatch}", shape, _GLOBAL_TOKENS, "zipf")
    idx = idx.at[5, 3].set(-1)
    cfg = KernelConfig(granularity=512, dispatch=dispatch, comm_items_fwd=3)
    y, status = emulated_moe(x, idx, w, W, ep=64, kernel=cfg, identity_experts=True)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    want = moe_identity_numpy(np.asarray(x).view(ml_dtypes.bfloat16), idx, w, E)
    diff = np.where((_bits(y) != want.view(np.uint16)).any(1))[0]
    assert diff.size == 0, f"{diff.size} rows differ from the oracle, first {diff[:8].tolist()}"


def test_fp8_routed_experts_at_ep_16_and_64():
    """precision="fp8" (forward_kernel_many's FP8 form): the bits of the EP 1 FP8 layer."""
    shape = layer_shape(64, 256, 128, 4)
    x, idx, w, W = _problem("ep64fp8", shape, _GLOBAL_TOKENS, "zipf")
    y1 = _layer(x, idx, w, W, config=_mok("fp8"))
    assert np.isfinite(np.asarray(y1, np.float32)).all()
    for ep in (16, 64):
        _assert_ep_bits("ep64fp8", ep, x, idx, w, W, y1, precision="fp8")


def test_rank_that_skips_a_call_at_ep_16_times_out():
    """The lab form of forward_kernel_many (skip_rank): the ranks that wait on rank 9 time out, poison the
    workspace and give NaN rows; the next call refuses to run on it; on a new workspace, as the error says, the
    call runs again and gives EP 1's bits."""
    shape = layer_shape(16, 256, 128, 2)
    x, idx, w, W = _problem("ep16skip", shape, 16 * 16)
    new_ws = functools.partial(Workspace.create_emulated, jax.devices("gpu")[0], 16, max_tokens=16, hidden_size=256,
                               top_k=2, num_experts=16, timeout_s=0.5)
    ws = new_ws()
    try:
        y, status = emulated_moe(x, idx, w, W, ep=16, workspace=ws, skip_rank=9)
        y = np.asarray(jax.block_until_ready(y), np.float32)
        with pytest.raises(CommTimeoutError, match="timed out"):
            ws.check()
        assert np.isnan(y[:16]).all(), "rank 0's outputs must be NaN after the timeout"
        assert np.asarray(status)[0, 0] != 0
        with pytest.raises(Exception, match="poisoned"):
            jax.block_until_ready(emulated_moe(x, idx, w, W, ep=16, workspace=ws)[0])
        ws.close()
        # The recovery the error prescribes. It also leaves JAX's runtime token of the device on a call that
        # succeeded: the refused call's error stays in it otherwise and is printed again at the process's exit.
        ws = new_ws()
        y, status = emulated_moe(x, idx, w, W, ep=16, workspace=ws)
        assert not np.asarray(status).any(), f"status {np.asarray(status)} on a new workspace"
        want, _ = emulated_moe(x, idx, w, W, ep=1)
        np.testing.assert_array_equal(_bits(y), _bits(want), "EP 16 on a new workspace: not EP 1's bits")
    finally:
        ws.close()
