"""GPU tests of the forward megakernel (implementation="mok") against mok_jax.reference.

Math: every case draws fresh random inputs (the seed is printed) and compares the kernel's y row by row
with the fp32 reference on upcast inputs (matmul precision "highest"); the bound of a row is a multiple of
the error of the same layer done naively in bf16 on that row, plus one bf16 rounding of the output. A
misplaced 16-byte chunk or a wrong row is far outside it (a row norm error of ~5e-2 at H = 7168).
Data movement: with identity experts (a test mode of the kernel) the whole data path (schedule, dispatch,
ring, combine, final sum) must equal the numpy oracle of mok_jax.reference.comm bit for bit, at EP 1, 2, 4
and 8 emulated on one GPU, for every tuning knob. Determinism: the knobs, the EP size (emulated 1, 2, 4, 8)
and 1,000 calls back to back give bitwise-identical outputs. Errors: bad expert ids give NaN rows and InvalidRoutingError, a rank that skips a
call gives CommTimeoutError; the process survives.
Set MOK_TEST_METRICS=path to append one JSON line of errors per case.
MOK_TEST_SEED=<seed> draws a run's inputs again: a failing test's report names its seed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (GRAD_NAMES, layer_problem, layer_shape, module_seed, readme_api_calls, readme_api_names,
                     record_metrics, seeded_key)

import mok_jax as mj
from mok_jax import reference
from mok_jax.config import KernelConfig
from mok_jax.emulation import emulated_moe
from mok_jax.reference.comm import moe_identity_numpy
from mok_jax.workspace import CommTimeoutError, InvalidRoutingError, Workspace, local_workspace

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# The kernel rounds h, each expert's output row and y to bf16 and accumulates in fp32; the naive bf16
# layer rounds every matmul output, the SwiGLU and every partial sum too, so the
# kernel sits at or below its error: 2x it is the bound of a row.
ERR_VS_NAIVE_BF16 = 2.0
# Added to a row's bound: one bf16 rounding of the output (2^-8 relative), for rows whose naive error is
# small by chance; a wrong 16-byte chunk of a row moves the row's error by ~sqrt(8 / H), 10x more at H 7168.
ERR_FLOOR = 2.0**-8

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)


def _record(case: str, **metrics):
    record_metrics(case, _SEED, **metrics)


def _key(tag: str):
    return seeded_key(_SEED, tag)


_shape = layer_shape
_problem = functools.partial(layer_problem, _SEED)  # (tag, shape, tokens, routing="uniform", ranks=1)


@jax.jit
def _reference_fp32(x, idx, w, W):
    with jax.default_matmul_precision("highest"):
        W32 = jax.tree.map(lambda a: a.astype(jnp.float32), W)
        return reference.moe(x.astype(jnp.float32), idx, w, W32)


@jax.jit
def _naive_bf16(x, idx, w, W):
    """The layer with every intermediate in bf16: matmul outputs, SwiGLU, weighted terms and partial sums."""
    bf = jnp.bfloat16
    y = jnp.zeros(x.shape, bf)
    for e in range(W.gate_up.shape[0]):
        gate, up = jnp.split(x @ W.gate_up[e], 2, axis=-1)
        ye = (jax.nn.silu(gate) * up).astype(bf) @ W.down[e]
        we = jnp.sum(jnp.where(idx == e, w, 0.0), axis=1).astype(bf)
        y = y + we[:, None] * ye
    if W.shared_gate_up is not None:
        gate, up = jnp.split(x @ W.shared_gate_up, 2, axis=-1)
        y = y + (jax.nn.silu(gate) * up).astype(bf) @ W.shared_down
    return y


def _row_errors(got, ref):
    num = np.linalg.norm(got - ref, axis=1)
    den = np.linalg.norm(ref, axis=1)
    return np.where(den > 0, num / np.maximum(den, 1e-30), num)


def _check_math(case: str, y, x, idx, w, W, *, nan_rows=()):
    """y against the fp32 reference, row by row; rows in nan_rows must be all NaN."""
    y32 = np.asarray(y, np.float32)
    ref = np.asarray(_reference_fp32(x, idx, w, W), np.float32)
    naive = np.asarray(_naive_bf16(x, idx, w, W), np.float32)
    nan_rows = np.asarray(sorted(nan_rows), np.int64)
    keep = np.ones(y32.shape[0], bool)
    keep[nan_rows] = False
    if nan_rows.size:
        assert np.isnan(y32[nan_rows]).all(), f"{case}: rows {nan_rows.tolist()} should be NaN"
    got, ref, naive = y32[keep], ref[keep], naive[keep]
    assert np.isfinite(got).all(), f"{case}: NaN/Inf in rows {np.where(~np.isfinite(got).all(1))[0][:8].tolist()}"
    err, err_nv = _row_errors(got, ref), _row_errors(naive, ref)
    bound = ERR_VS_NAIVE_BF16 * err_nv + ERR_FLOOR
    zero_ref = np.linalg.norm(ref, axis=1) == 0
    assert not got[zero_ref].any(), f"{case}: rows with no expert and no shared expert must be exactly zero"
    bad = np.where(err > bound)[0]
    _record(case, tokens=int(y32.shape[0]), max_row_err=float(err.max(initial=0)),
            max_row_err_naive=float(err_nv.max(initial=0)), worst_err_over_bound=float((err / bound).max(initial=0)))
    assert bad.size == 0, (f"{case}: {bad.size} rows over the bound, e.g. rows {bad[:6].tolist()}: err "
                           f"{err[bad[:6]].tolist()} > bound {bound[bad[:6]].tolist()}")


def _mok(kernel=None):
    return mj.MoEConfig(implementation="mok", kernel=kernel)


@functools.partial(jax.jit, static_argnames=("config",))
def _layer(x, idx, w, W, config):
    return mj.moe(x, idx, w, W, config=config)


def _identity_oracle(x, idx, w, E):  # the same at every EP size (the per-slot combine)
    return moe_identity_numpy(np.asarray(x).view(ml_dtypes.bfloat16), idx, w, E)


def _bits(a):
    return np.asarray(a).view(np.uint16)


# ----------------------------------------------------------------------------- math on one GPU (EP 1)


@pytest.mark.parametrize("model", ["kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro"])
def test_bench_model_shapes(model):
    # the one-GPU benchmark problem: E/32 experts (the whole 2-GPU ep64-slice problem), fewer tokens
    m = mj.load_model(model)
    shape = m.replace(num_experts=m.num_experts // 32)
    args = _problem(model, shape, 512)
    _check_math(f"model:{model}", _layer(*args, config=_mok()), *args)


@pytest.mark.parametrize("routing", ["uniform", "zipf", "one-expert"])
def test_routings(routing):
    shape = _shape(16, 1024, 512, 4)
    args = _problem(routing, shape, 1000, routing)
    _check_math(f"routing:{routing}", _layer(*args, config=_mok(KernelConfig(granularity=512))), *args)


def test_empty_experts_tails_and_no_shared():
    shape = _shape(8, 264, 200, 2, Is=0)  # H, I not multiples of any tile; no shared expert
    x, idx, w, W = _problem("tails", shape, 300)
    idx = jnp.where(idx >= 4, idx - 4, idx)  # experts 4..7 get nothing
    idx = jnp.where(idx[:, :1] == idx[:, 1:], jnp.stack([idx[:, 0], (idx[:, 0] + 1) % 4], 1), idx)
    _check_math("tails_empty_noshared", _layer(x, idx, w, W, config=_mok()), x, idx, w, W)


@pytest.mark.parametrize("tokens,k", [(1, 1), (1, 10), (77, 10), (130, 1)])
def test_few_tokens_and_top_k(tokens, k):
    shape = _shape(16, 512, 256, k)
    args = _problem(f"few{tokens}_{k}", shape, tokens)
    _check_math(f"tokens{tokens}_k{k}", _layer(*args, config=_mok()), *args)


def test_masked_slots():
    shape = _shape(8, 512, 256, 4)
    x, idx, w, W = _problem("masked", shape, 256)
    mask = jax.random.bernoulli(_key("mask"), 0.3, idx.shape).at[:8].set(True)  # 8 tokens fully masked
    idx = jnp.where(mask, -1, idx)
    _check_math("masked", _layer(x, idx, w, W, config=_mok()), x, idx, w, W)
    # a masked slot's weight is ignored, whatever it is
    y1 = _layer(x, idx, jnp.where(mask, 1e30, w), W, config=_mok())
    np.testing.assert_array_equal(_bits(y1), _bits(_layer(x, idx, w, W, config=_mok())))


def test_granularity_and_ring_across_microbatches():
    shape = _shape(8, 512, 256, 2)
    args = _problem("ring", shape, 2500)  # 5 microbatches of 512 through 1..3 ring slots
    ys = {}
    for slots in (1, 2, 3):
        cfg = KernelConfig(granularity=512, ring_slots=slots, comm_items_fwd=4)
        ys[slots] = _layer(*args, config=_mok(cfg))
    _check_math("ring", ys[2], *args)
    for slots in (1, 3):
        np.testing.assert_array_equal(_bits(ys[slots]), _bits(ys[2]), f"ring_slots={slots} changed bits")


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("shared", [True, False])
def test_knobs_never_change_bits(shared):
    """Every knob setting gives the same y bits, with and without a shared expert (without one, the first
    microbatch's dispatch is split over every CTA of the rank: mok/moe/plan.cuh, D0)."""
    shape = _shape(8, 768, 384, 4, Is=None if shared else 0)
    args = _problem(f"knobs{shared}", shape, 2048, "zipf")
    configs = [KernelConfig(granularity=g, comm_items_fwd=c, ring_slots=s)
               for g, c, s in [(2048, 24, 2), (512, 1, 1), (512, 8, 3), (1024, 16, 2), (2048, 128, 1)]]
    ys = [_layer(*args, config=_mok(c)) for c in configs]
    _check_math("knobs", ys[0], *args)
    for c, y in zip(configs[1:], ys[1:]):
        np.testing.assert_array_equal(_bits(y), _bits(ys[0]), f"{c} changed bits")
    # emulated EP 2: the dispatch directions and the knobs, against each other and against the layer
    eps = [emulated_moe(*args, ep=2, kernel=KernelConfig(granularity=g, dispatch=d, comm_items_fwd=n))[0]
           for g, d, n in [(512, "pull", 8), (1024, "push", 3), (2048, "push", 30), (512, "pull", 1)]]
    # fewer CTAs than SMs (num_sms), split unevenly among emulated ranks: a rank's CTAs set D0
    eps += [emulated_moe(*args, ep=ep, num_sms=n, kernel=KernelConfig(granularity=512, comm_items_fwd=2))[0]
            for ep, n in [(1, 7), (2, 9), (4, 13)]]
    for y in eps:
        np.testing.assert_array_equal(_bits(y), _bits(ys[0]), "emulated: a knob, num_sms or the EP size changed bits")


@pytest.mark.parametrize("shared", [True, False])
def test_y_bits_do_not_depend_on_the_ep_size(shared):
    """The owners push each slot's expert row and the origin sums w_j row_j over the slots in order, so y (the
    shared expert included) has the same bits at emulated EP 1, 2, 4 and 8, with uneven routing, a masked slot
    and a token whose slots all sit on one rank at EP 2."""
    shape = _shape(16, 512, 256, 6, Is=256 if shared else 0)
    x, idx, w, W = _problem(f"epbits{shared}", shape, 256, "zipf", ranks=8)
    idx = idx.at[5, 3].set(-1).at[7].set(jnp.arange(6, dtype=idx.dtype))  # a masked slot; rank 0's at EP 2
    cfg = KernelConfig(granularity=512, comm_items_fwd=4)
    y1 = _layer(x, idx, w, W, config=_mok(cfg))
    _check_math(f"epbits_shared{shared}", y1, x, idx, w, W)
    for ep in (1, 2, 4, 8):
        y, status = emulated_moe(x, idx, w, W, ep=ep, kernel=cfg)
        assert not np.asarray(status).any(), f"EP {ep}: status {np.asarray(status)}"
        differ = np.where((_bits(y) != _bits(y1)).any(1))[0]
        _record(f"epbits_shared{shared}_ep{ep}", rows_differing=int(differ.size))
        assert differ.size == 0, f"EP {ep}: {differ.size} rows of y differ from EP 1's, first {differ[:8].tolist()}"


def test_thousand_calls_bitwise():
    shape = _shape(8, 256, 128, 2)
    args = _problem("thousand", shape, 256)
    y0 = _layer(*args, config=_mok())
    same = jax.jit(lambda a, b: jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint16) ==
                                        jax.lax.bitcast_convert_type(b, jnp.uint16)))
    oks = [same(_layer(*args, config=_mok()), y0) for _ in range(1000)]
    assert all(bool(o) for o in oks), f"{sum(not bool(o) for o in oks)} of 1000 calls differ"
    _check_math("thousand", y0, *args)


def test_two_layers_in_one_program():
    s1, s2 = _shape(8, 512, 256, 2), _shape(4, 256, 128, 1)
    a1, a2 = _problem("two_a", s1, 200), _problem("two_b", s1, 200)
    b = _problem("two_c", s2, 96)

    @jax.jit
    def program(a1, a2, b):
        return (mj.moe(*a1, config=_mok()), mj.moe(a1[0], a1[1], a1[2], a2[3], config=_mok()),
                mj.moe(*b, config=_mok()))

    y1, y2, y3 = program(a1, a2, b)
    np.testing.assert_array_equal(_bits(y1), _bits(_layer(*a1, config=_mok())))
    np.testing.assert_array_equal(_bits(y2), _bits(_layer(a1[0], a1[1], a1[2], a2[3], config=_mok())))
    np.testing.assert_array_equal(_bits(y3), _bits(_layer(*b, config=_mok())))
    _check_math("two_layers_b", y3, *b)


# ----------------------------------------------------------------------------- emulated EP on one GPU


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_emulated_data_path_bitwise(ep, dispatch):
    shape = _shape(16, 264, 128, 10)  # 16 experts: 2 per rank at EP 8, k = 10 > experts per rank there
    x, idx, w, W = _problem(f"emu{ep}", shape, 300, "zipf", ranks=ep)
    idx = idx.at[5, 3].set(-1)  # a masked slot
    cfg = KernelConfig(granularity=512, dispatch=dispatch, comm_items_fwd=3)
    y, status = emulated_moe(x, idx, w, W, ep=ep, kernel=cfg, identity_experts=True)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    want = _identity_oracle(x, idx, w, 16)
    got = np.asarray(y).view(ml_dtypes.bfloat16)
    diff = np.where((got.view(np.uint16) != want.view(np.uint16)).any(1))[0]
    assert diff.size == 0, f"EP {ep}: {diff.size} rows differ from the oracle, first {diff[:8].tolist()}"


def test_many_microbatches_fit_the_schedule():
    """52 microbatches at EP 2 (26,624 tokens a rank at granularity 512): their dynamic segments (SEND, REDUCE,
    DISPATCH, GU, DN each) are 259, which overflowed the segment table's 256 words before Plan::max_segments counted
    SEND. y is the data path's oracle bit for bit, with every status word clear."""
    shape = _shape(4, 128, 128, 2)
    tokens = 52 * 512
    x, idx, w, W = _problem("microbatches", shape, tokens, "uniform", ranks=2)
    cfg = KernelConfig(granularity=512, comm_items_fwd=4)
    y, status = emulated_moe(x, idx, w, W, ep=2, kernel=cfg, identity_experts=True)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    want = _identity_oracle(x, idx, w, 4)
    diff = np.where((_bits(y) != want.view(np.uint16)).any(1))[0]
    assert diff.size == 0, f"{diff.size} rows differ from the oracle, first {diff[:8].tolist()}"


def test_timing_mode_reaches_the_kernel():
    """The bench-only timing variants (mok_jax.bench.breakdown) reach the kernel: with identity experts,
    dispatch rows left out change y; timing_mode=0 and the "twice" variants give the plain call's bits."""
    shape = _shape(16, 512, 256, 4)
    x, idx, w, W = _problem("leaveout", shape, 300, "uniform", ranks=2)
    cfg = KernelConfig(granularity=512, comm_items_fwd=3)
    want = _identity_oracle(x, idx, w, 16)
    for mode in (0, 8, 16, 24):
        y0, _ = emulated_moe(x, idx, w, W, ep=2, kernel=cfg, identity_experts=True, timing_mode=mode)
        assert (np.asarray(y0).view(np.uint16) == want.view(np.uint16)).all(), f"timing_mode {mode}"
    # other rows (-x), so that a ring left over from the call before cannot pass for this one's
    y1, _ = emulated_moe(-x, idx, w, W, ep=2, kernel=cfg, identity_experts=True, timing_mode=1)
    want1 = _identity_oracle(-x, idx, w, 16)
    assert (np.asarray(y1).view(np.uint16) != want1.view(np.uint16)).any(1).mean() > 0.5


@pytest.mark.parametrize("ep", [1, 2])
def test_lab_form_has_the_production_bits(ep):
    """A call with a timing mode runs the kernel's lab form (ffi/src/moe_forward.cu), every other call the production
    form, compiled without the mode checks: with the "twice" variants, whose outputs stay right, and with "shared down
    early" and "shared down late" (the two orders of the same tiles), the lab form gives the production form's bits
    on real experts with a shared expert."""
    shape = _shape(16, 512, 256, 4)
    args = _problem(f"lab{ep}", shape, 600, "zipf", ranks=ep)
    cfg = KernelConfig(granularity=512, comm_items_fwd=3)
    y0, status = emulated_moe(*args, ep=ep, kernel=cfg)  # the production form
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    _check_math(f"lab{ep}", y0, *args)
    for mode in (8, 16, 24, 64, 88, 128, 152):  # the lab form
        y1, status = emulated_moe(*args, ep=ep, kernel=cfg, timing_mode=mode)
        assert not np.asarray(status).any(), f"timing_mode {mode}: status {np.asarray(status)}"
        np.testing.assert_array_equal(np.asarray(y1).view(np.uint16), np.asarray(y0).view(np.uint16),
                                      err_msg=f"timing_mode {mode}")


@pytest.mark.parametrize("order", [0, 64, 128])
@pytest.mark.parametrize("ep", [1, 2])
def test_item_times_keep_the_bits_and_count_every_item(ep, order):
    """The "item times" timing mode (mok_jax.bench.breakdown --items) changes no work: y has the production form's
    bits, and each rank's times count the items the plan has (ffi/include/mok/moe/plan.cuh): 5 m-blocks of 600 tokens
    x 2 column blocks of the shared expert's tiles, DISPATCH over D = 3 items in each of the 2 microbatches but the
    first at EP 1 (D0: as many as the host's item list of the same plan has), REDUCE over 3 items and then over every
    CTA of the rank for the last microbatch. At EP 1 the production order takes the shared expert's down tiles from
    the dynamic part's segment table (a count off there would show here, or REDUCE would wait for them in vain);
    "shared down early" (64) and "shared down late" (128) run the same items in either order at either EP size."""
    from mok_jax.bench.breakdown import item_times
    from mok_jax.ops.moe_forward import ITEM_FIELDS, ITEM_TIME_KINDS, item_list

    shape = _shape(16, 512, 256, 4)
    args = _problem(f"times{ep}", shape, 600, "uniform", ranks=ep)
    cfg = KernelConfig(granularity=512, comm_items_fwd=3)
    y0, status = emulated_moe(*args, ep=ep, kernel=cfg)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    y1, status, words = emulated_moe(*args, ep=ep, kernel=cfg, timing_mode=32 + order)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    np.testing.assert_array_equal(np.asarray(y1).view(np.uint16), np.asarray(y0).view(np.uint16))
    assert words.shape == (ep, 12, 5, 2)
    sms = jax.devices()[0].core_count
    planned = item_list(np.zeros((2, 16 // ep), np.int32), tokens=600, hidden=512, inter=256, shared_inter=256,
                        top_k=4, local_experts=16 // ep, ep=ep, kernel=cfg, ctas=sms // ep, timing_mode=32 + order)
    n_dispatch = int((planned[:, ITEM_FIELDS.index("kind")] == ITEM_TIME_KINDS.index("dispatch")).sum())
    assert n_dispatch == 6 if ep > 1 else n_dispatch > 6, n_dispatch
    for r in range(ep):
        ctas = (sms - r + ep - 1) // ep  # CTA b serves rank b % ep
        t = item_times([np.asarray(words[r])])
        counts = {kind: v["items"] for kind, v in t.items()}
        assert counts["consumers"] == ctas, counts
        assert counts["scan"] == 1 and counts["shared gate/up"] == 10 and counts["shared down"] == 10, counts
        assert counts["dispatch"] == n_dispatch and counts["reduce"] == 3 + ctas, counts
        assert counts["gate/up"] >= 2 and counts["down"] >= 4, counts  # 2 microbatches, 2 column blocks of H
        assert ("send" in counts) == (ep > 1), counts
        end = t["consumers"]["last end us"]
        for kind, v in t.items():
            assert v["busy ms per CTA"] > 0 and v["waited ms per CTA"] >= 0, (kind, v)
            assert 0 <= v["first start us"] <= v["last end us"] <= end, (kind, v)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_emulated_math(ep):
    shape = _shape(16, 512, 256, 4)
    args = _problem(f"emumath{ep}", shape, 1100, "uniform", ranks=ep)
    y, status = emulated_moe(*args, ep=ep, kernel=KernelConfig(granularity=512, ring_slots=2, comm_items_fwd=4))
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    _check_math(f"emulated_ep{ep}", y, *args)


def test_readme_api_emulation_calls_run_as_written():
    """The README API section's emulation calls, evaluated as written (EP 4, the ci shape): the forward with a clean
    status within the bound of the fp32 reference, and the backward (by default the fused op, every rank in one
    launch) the bits of the collectives path (fused=False)."""
    from mok_jax.emulation import emulated_moe_backward

    names = readme_api_names(ep=4)
    args = [names[n] for n in ("x", "topk_idx", "topk_weight", "weights")]
    forward, backward = readme_api_calls("mok_jax.emulation.")
    y, status = eval(forward, names)
    assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    _check_math("readme_emulated", y, *args)
    got = eval(backward, names)
    want = emulated_moe_backward(*args, names["dy"], ep=4, fused=False)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)

def test_emulated_rank_that_skips_a_call_raises():
    shape = _shape(8, 256, 128, 2)
    args = _problem("skip", shape, 128, ranks=2)
    ws = Workspace.create_emulated(jax.devices("gpu")[0], 2, max_tokens=128, hidden_size=256, top_k=2,
                                   num_experts=8, timeout_s=0.5)
    try:
        y, status = emulated_moe(*args, ep=2, workspace=ws, skip_rank=1)
        y = np.asarray(jax.block_until_ready(y), np.float32)
        with pytest.raises(CommTimeoutError, match="EP rank 0.*timed out"):
            ws.check()
        assert np.isnan(y[:128]).all(), "rank 0's outputs must be NaN after the timeout"
        assert np.asarray(status)[0, 0] != 0
        with pytest.raises(Exception, match="poisoned"):  # the next call refuses to run on it
            jax.block_until_ready(emulated_moe(*args, ep=2, workspace=ws)[0])
    finally:
        ws.close()


# ----------------------------------------------------------------------------- errors


def test_bad_expert_ids_give_nan_rows_and_a_named_error():
    shape = _shape(8, 256, 128, 2)
    x, idx, w, W = _problem("badid", shape, 64)
    bad = idx.at[3, 1].set(8).at[9, 0].set(-7)
    y = _layer(x, bad, w, W, config=_mok())
    _check_math("bad_ids", y, x, idx.at[3].set(-1).at[9].set(-1), w, W, nan_rows=(3, 9))
    ws = local_workspace(max_tokens=64, hidden_size=256, top_k=2, num_experts=8)
    with pytest.raises(InvalidRoutingError, match="outside"):
        ws.check()
    ws.check()  # reported once; the workspace stays usable
    _check_math("after_bad_ids", _layer(x, idx, w, W, config=_mok()), x, idx, w, W)


def test_status_and_scratch_do_not_depend_on_routing():
    from mok_jax.ops.moe_forward import scratch_bytes

    shape = _shape(8, 512, 256, 4)
    sizes = {scratch_bytes(tokens=1024, hidden=512, inter=256, shared_inter=256, top_k=4, local_experts=4, ep=2,
                           kernel=KernelConfig(granularity=512))}
    for routing in ("uniform", "one-expert"):
        args = _problem(f"mem_{routing}", shape, 1024, routing, ranks=2)
        y, status = emulated_moe(*args, ep=2, kernel=KernelConfig(granularity=512))
        assert not np.asarray(status).any()
        _check_math(f"memory_{routing}", y, *args)
    assert len(sizes) == 1


# ----------------------------------------------------------------------------- through the modules


def test_flax_modules_forward():
    from flax import nnx

    from mok_jax.flax import LinenMoELayer, MoELayer

    shape = _shape(8, 512, 256, 2)
    x = jax.random.normal(_key("flax"), (2, 64, 512), jnp.float32)
    # the workspace is set up at construction, outside jit (max_tokens: the most tokens a call takes)
    layer = MoELayer(shape, implementation="mok", dtype=jnp.bfloat16, max_tokens=128, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x: m(x))(layer, x)
    tokens = x.reshape(-1, 512).astype(jnp.bfloat16)
    idx, w, _ = layer.route(tokens)
    _check_math("flax_nnx", y.reshape(-1, 512), tokens, idx, w, layer.weights())
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]), ("ep",))
    layer_m = MoELayer(shape, mesh=mesh, implementation="mok", dtype=jnp.bfloat16, max_tokens=128,
                       rngs=nnx.Rngs(0))
    y_m = nnx.jit(lambda m, x: m(x))(layer_m, x)
    np.testing.assert_array_equal(_bits(y_m), _bits(y))
    lin = LinenMoELayer(shape, implementation="mok", max_tokens=128)
    params = lin.init(jax.random.key(0), x)  # outside jit: sets the workspace up
    y_l = np.asarray(jax.jit(lin.apply)(params, x), np.float32).reshape(-1, 512)
    y_x = np.asarray(jax.jit(LinenMoELayer(shape, implementation="xla").apply)(params, x), np.float32).reshape(-1, 512)
    # both are bf16 layers within a few bf16 roundings of the fp32 one: 4 roundings per row bounds them
    err = _row_errors(y_l, y_x)
    assert np.isfinite(y_l).all() and err.max() < 4 * ERR_FLOOR, f"Linen mok vs xla: max row error {err.max()}"
