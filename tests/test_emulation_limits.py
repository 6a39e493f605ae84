"""The EP sizes the one-GPU emulation takes (CPU, no GPU needed): the forward up to MAX_EMULATED_RANKS (64) ranks in
one launch and at most one per persistent CTA, and so does the fused backward (above 8 ranks each rank's kernel
parameters live in its counters scratch), its collectives path too. Each refusal is a ValueError that names ``ep`` (the
GPU side: tests/test_moe_ep64_gpu.py).
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import pytest
from helpers import layer_shape, random_problem

from mok_jax import _native, emulation
from mok_jax.backward_types import EXPERTS_BACKWARD_MAX_EMULATED_RANKS
from mok_jax.config import KernelConfig
from mok_jax.emulation import MAX_EMULATED_RANKS, emulated_moe, emulated_moe_backward
from mok_jax.memory import layer_memory_per_rank
from mok_jax.reference import experts_backward_reference
from mok_jax.workspace import native as wnative


def _args(ep: int, per_rank: int = 2, E: int | None = None):
    """Small global arrays of an emulated call at EP ``ep``: ``per_rank`` tokens and one expert per rank."""
    x, idx, w, W = random_problem(layer_shape(E or ep, 16, 8, 1), ep * per_rank, seed=ep)
    return x.astype(jnp.bfloat16), idx, w, W


def test_the_limits_agree():
    assert MAX_EMULATED_RANKS == 64 and EXPERTS_BACKWARD_MAX_EMULATED_RANKS == 64
    op = importlib.import_module("mok_jax.ops.moe_forward")
    assert op._MAX_EMULATED_RANKS == MAX_EMULATED_RANKS  # kMaxEmulatedRanks, the op's check


@pytest.mark.parametrize("ep", [0, -1, 65, 128, 1024, True, 2.0, "4"])
def test_forward_refuses_an_ep_outside_one_to_64(ep):
    x, idx, w, W = _args(4)
    with pytest.raises(ValueError, match=r"^ep must be an int in \[1, 64\] \(the ranks one emulated launch of the "
                                         r"forward carries\), got "):
        emulated_moe(x, idx, w, W, ep=ep)


@pytest.mark.parametrize("ep,num_sms", [(16, 8), (64, 63), (2, 1)])
def test_forward_refuses_more_ranks_than_ctas(ep, num_sms):
    """Every emulated rank needs a CTA of its own: num_sms (the launch's CTAs) below ep is refused before anything
    needs the native library or a GPU."""
    x, idx, w, W = _args(ep)
    with pytest.raises(ValueError, match=rf"^ep={ep} exceeds the {num_sms} persistent CTAs of one emulated launch "
                                         rf"\(num_sms={num_sms}\): every emulated rank needs a CTA of its own"):
        emulated_moe(x, idx, w, W, ep=ep, num_sms=num_sms)


class _Gpu:  # a device as jax describes a GPU: its SMs in core_count
    def __init__(self, sms: int):
        self.core_count = sms

    def __str__(self):
        return f"cuda:0 ({self.core_count} SMs)"


def test_ep_must_fit_the_devices_sms():
    emulation._check_ep_fits(64, _Gpu(132), 0)  # an H200: EP 64 fits, 2 CTAs per rank (1 for some)
    emulation._check_ep_fits(64, _Gpu(132), 64)
    emulation._check_ep_fits(16, None, 0)  # no device known (no GPU): the launch refuses what does not fit
    with pytest.raises(ValueError, match=r"^ep=64 exceeds the 48 persistent CTAs of one emulated launch \(the 48 SMs "
                                         r"of cuda:0 \(48 SMs\)\)"):
        emulation._check_ep_fits(64, _Gpu(48), 0)
    with pytest.raises(ValueError, match=r"^ep=32 exceeds the 16 persistent CTAs .*\(num_sms=16\)"):
        emulation._check_ep_fits(32, _Gpu(132), 16)
    with pytest.raises(ValueError, match=r"^ep=32 exceeds the 24 persistent CTAs .*\(the 24 SMs"):
        emulation._check_ep_fits(32, _Gpu(24), 100)  # num_sms above the SM count: every SM


def test_fused_backward_and_its_collectives_path_take_up_to_64():
    x, idx, w, W = _args(16)
    with pytest.raises(ValueError, match=r"^ep must be an int in \[1, 64\] \(the ranks one emulated launch of the "
                                         r"fused backward, mok_jax.ops.experts_backward_ep, carries\), got 65"):
        emulated_moe_backward(x, idx, w, W, x, ep=65, fused=True)
    with pytest.raises(ValueError, match=r"^ep must be an int in \[1, 64\] \(as the forward's emulation\), got 65"):
        emulated_moe_backward(x, idx, w, W, x, ep=65, experts_fn=experts_backward_reference)
    # EP 16 on the collectives path runs (the op's reference per rank), with every expert on its own rank
    dx, d_w, dW = emulated_moe_backward(x, idx, w, W, x, ep=16, experts_fn=experts_backward_reference)
    assert dx.shape == x.shape and d_w.shape == w.shape and dW.gate_up.shape == W.gate_up.shape


def test_the_scratch_holds_the_rank_parameters_above_8_ranks():
    """Above 8 ranks an emulated launch reads each rank's kernel parameters from its scratch: one 256-byte-aligned
    RankParams more per rank (tests/test_memory_formula.py checks the formula against the native layout)."""
    kw = dict(tokens=64, hidden=256, inter=128, shared_inter=0, top_k=4, local_experts=1,
              kernel=KernelConfig())
    for ep in (1, 2, 8, 16, 64):
        term = layer_memory_per_rank(ep=ep, **kw)["forward.rank_params"]
        assert term == (2560 if ep > 8 else 0), ep


@pytest.mark.skipif(_native.library() is None, reason=f"needs libmok_ffi.so: {_native.native_status()}")
def test_the_backward_counters_rows_hold_the_rank_parameters_above_8_ranks():
    """The expert-parallel backward's counters scratch per rank (the library's experts_backward_ep_counter_words): the
    counters' words, the Python formula's, up to 8 ranks; above that a row is a multiple of 16 words (64-byte aligned
    TMA descriptors) that holds the counters and then the rank's kernel parameters, the same size at every EP."""
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    lib = wnative._host_lib()
    native = lambda m, e, r: int(lib.mok_experts_backward_ep_counter_words(m, e, r))  # noqa: E731
    for m, e in ((128, 1), (1152, 4), (4096, 48)):
        counters = mb._counter_words(m, e)
        for ranks in (1, 2, 8):
            assert native(m, e, ranks) == mb._ep_counter_words(m, e, ranks) == counters, (m, e, ranks)
        params = native(m, e, 9) - -(-counters // 16) * 16
        assert params > 0 and params % 16 == 0, (m, e, params)
        for ranks in (9, 16, 64):
            words = mb._ep_counter_words(m, e, ranks)
            assert words == native(m, e, ranks) == -(-counters // 16) * 16 + params and words % 16 == 0, (m, e, ranks)
