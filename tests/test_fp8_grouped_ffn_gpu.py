"""GPU tests of mok_jax.ops.fp8_grouped_ffn (the Hopper FP8 E4M3 block-scaled grouped expert FFN).

Every case draws fresh random inputs (the seed is printed) and checks each step of the kernel against
mok_jax.fp8's reference of the same pipeline, group by group and row by row:

1. x_q, x_scale: bit for bit mok_jax.fp8.quantize_rows(x) (the same f32 max, IEEE division and RNE convert).
2. h (E4M3 with 1 x 128 scales, quantised in the gate/up GEMM's epilogue): dequantised, against the f32
   h = silu(gate) * up of block_scaled_matmul on the same x_q, per element within E4M3's rounding bound plus
   the tensor core's accumulation error, and per row against the reference's own quantisation error.
3. y against block_scaled_matmul of the kernel's own (h, h_scale) with the same weights, per row: only the
   tensor core's accumulation and the bf16 output rounding separate them.
4. y against the unquantised fp32 FFN per row, within mok_jax.fp8.ffn_error_sigma's derived E4M3 error.

Padding rows must be exactly zero (h scale 1), nothing may be NaN, status must be 0 unless the sizes are bad;
two runs, and runs on different numbers of SMs, give the same bits; a run through the raw C entry point on
outputs poisoned with NaN bytes writes every byte and matches the XLA run. Set MOK_TEST_METRICS=path to
append one JSON line of errors per case. Run with XLA_FLAGS=--xla_gpu_autotune_level=0 (the reference's
dots otherwise autotune for a long time).
MOK_TEST_SEED=<seed> draws a run's inputs again: a failing test's report names its seed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import module_seed, record_metrics, seeded_key

from mok_jax import _native, fp8, reference
from mok_jax.config import load_model
from mok_jax.ops.grouped_ffn import fp8_grouped_ffn
from mok_jax.ops.grouped_ffn import GROUPED_FFN_STATUS_NEGATIVE_GROUP, GROUPED_FFN_STATUS_ROW_OVERFLOW

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# Hopper's FP8 wgmma adds a 128-long block's products with ~14 retained bits (DeepSeek-V3 §3.3.2: without
# promotion, K = 4096 lost ~2% relative; the kernel promotes every 128). 2^-10 relative to the block's
# magnitude sum is the accumulation error allowed per GEMM: ~16x that figure, still 2^-6 below E4M3's own
# rounding (2^-4), which dominates every check below.
TC_ACC_REL = 2.0**-10
# h per element: the E4M3 bound of the reference's h with the kernel's scale, plus the effect of g and u
# differing by the accumulation error (~2^-12 of |g| for 128-long chains, so ~2^-13 of the tile's amax),
# allowed up to 2^-8 of the tile's amax (= 1.75 scales, under 2 E4M3 ulps of values near amax / 16): a
# wrong row, column or scale is off by O(amax).
H_ACC_FLOOR_OF_AMAX = 2.0**-8
# h per row: its error against the f32 h is E4M3 rounding, as the reference's own quantised h; the kernel's
# rounds from slightly different g and u, so its error norm is within 1.25x of the reference's, plus 2^-8 of
# the row's norm for the accumulation.
H_ROW_FACTOR = 1.25
H_ROW_FLOOR = 2.0**-8
# h scale = amax * (1/448) of the kernel's h: the relative accumulation error of the largest |h| of a tile
# (2 x TC_ACC_REL times sqrt(K)-ish cancellation, 2^-7 is generous).
TOL_H_SCALE = 2.0**-7
# y against the same pipeline on the kernel's own h: bf16 output rounding (2^-9 relative per element) and the
# accumulation error of the down GEMM; per row, relative L2.
TOL_Y_SAME_PIPELINE = 2.0**-6
# y against the fp32 FFN: a row's error norm within ROW_SIGMA_FACTOR x the root of its summed E4M3 variances
# (tests/test_fp8_grouped_ffn.py: the reference itself measures 0.31-0.53 of it; the kernel adds the tensor
# core's accumulation, in sigma through TC_ACC_REL, and bf16 rounding, ~0.2% against ~6%).
ROW_SIGMA_FACTOR = 1.0

_SEED = module_seed(__name__)  # MOK_TEST_SEED, else fresh (helpers.py: seeds)


def _record(case: str, **metrics):
    record_metrics(case, _SEED, **metrics)


def _key(tag: str):
    return seeded_key(_SEED, tag)


_quantize_weights = jax.jit(fp8.quantize_expert_weights)


def _problem(tag: str, m: int, hidden: int, inter: int, sizes):
    """Fresh random x, bf16 weights (scaled so every step is O(1)), their FP8 form, device group sizes."""
    kx, kg, kd = jax.random.split(_key(tag), 3)
    e = len(sizes)
    x = jax.random.normal(kx, (m, hidden), jnp.float32).astype(jnp.bfloat16)
    gate_up = (jax.random.normal(kg, (e, hidden, 2 * inter), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (e, inter, hidden), jnp.float32) * inter**-0.5).astype(jnp.bfloat16)
    return x, jnp.asarray(np.asarray(sizes, np.int32)), gate_up, down, _quantize_weights(gate_up, down)


_run = jax.jit(fp8_grouped_ffn, static_argnames=("num_sms",))
_bsm = jax.jit(fp8.block_scaled_matmul)
_quantize_rows = jax.jit(fp8.quantize_rows)


def _bucket(n: int) -> int:
    return max(64, 1 << (n - 1).bit_length())


def _per_group_bsm(a_q, a_scale, w_q, w_scale, sizes):
    """block_scaled_matmul for each group's rows (f32 [rows, N] numpy), rows padded to a power of two so few
    shapes compile."""
    out, off = [], 0
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        b = _bucket(n)
        pad = lambda v: jnp.pad(v[off:off + n], ((0, b - n), (0, 0)))  # noqa: E731
        out.append(np.asarray(_bsm(pad(a_q), pad(a_scale), w_q[e], w_scale[e]))[:n])
        off += n
    return np.concatenate(out, axis=0) if out else np.zeros((0, w_q.shape[-1]), np.float32)


def _row_norm(a):
    return np.linalg.norm(a, axis=1)


def _check(case: str, x, group_sizes, gate_up, down, w, *, num_sms=None):
    """Run the kernel and check every step (module docstring); returns the outputs (numpy)."""
    outs = jax.block_until_ready(_run(x, group_sizes, w, num_sms=num_sms))
    y, h, hs, xq, xs, status = (np.asarray(a) for a in outs)
    sizes = [int(s) for s in np.asarray(group_sizes)]
    used = sum(sizes)
    m, hidden = x.shape
    inter = h.shape[1]
    assert int(status) == 0, f"{case}: status {int(status)} for valid group sizes"
    y32 = y.astype(np.float32)
    h_deq = h.astype(np.float32) * np.repeat(hs.T, 128, axis=1)
    assert np.isfinite(y32).all() and np.isfinite(h_deq).all() and np.isfinite(xs).all(), f"{case}: NaN/Inf"

    # 1. x quantisation, bit for bit (the reference on the CPU: IEEE division, whatever XLA:GPU does)
    with jax.default_device(jax.devices("cpu")[0]):
        xq_ref, xs_ref = (np.asarray(a) for a in jax.jit(fp8.quantize_rows)(np.asarray(x)))
    bad_q = int(np.sum(xq.view(np.uint8) != xq_ref.view(np.uint8)))
    assert bad_q == 0, f"{case}: {bad_q} x_q values differ from quantize_rows"
    assert np.array_equal(xs.T.view(np.uint32), xs_ref.view(np.uint32)), f"{case}: x_scale differs"

    # padding rows
    assert not y[used:].view(np.uint16).any(), f"{case}: padding rows of y are not exactly zero"
    assert not h[used:].view(np.uint8).any(), f"{case}: padding rows of h are not exactly zero"
    assert (hs[:, used:] == 1.0).all(), f"{case}: padding rows of h_scale are not 1"

    gu_q, gu_s, dn_q, dn_s = fp8.reference_layout(w)
    failures, metrics = [], {}
    if used:
        # 2. h against the f32 h of the same x_q
        gu = _per_group_bsm(jnp.asarray(xq_ref), jnp.asarray(xs_ref), gu_q, gu_s, sizes)
        h_ref = np.asarray(jax.nn.silu(gu[:, :inter]) * gu[:, inter:])
        hq_ref, hs_ref = (np.asarray(a) for a in _quantize_rows(jnp.asarray(h_ref)))
        hs_k = hs.T[:used]
        s_el = np.repeat(hs_k, 128, axis=1)
        bound_h = np.asarray(fp8.quantization_error_bound(jnp.asarray(h_ref), jnp.asarray(s_el)))
        bound_h = bound_h + H_ACC_FLOOR_OF_AMAX * fp8.E4M3_MAX * s_el
        err_h = np.abs(h_deq[:used] - h_ref)
        worst_h = float(np.max(err_h / bound_h))
        if worst_h > 1:
            r, c = np.unravel_index(np.argmax(err_h / bound_h), err_h.shape)
            failures.append(f"h[{r}, {c}] = {h_deq[r, c]:.6g}, reference {h_ref[r, c]:.6g} (err/bound {worst_h:.3g})")
        err_hq_ref = _row_norm(np.asarray(fp8.dequantize_rows(jnp.asarray(hq_ref), jnp.asarray(hs_ref))) - h_ref)
        h_row_bound = H_ROW_FACTOR * err_hq_ref + H_ROW_FLOOR * _row_norm(h_ref)
        worst_h_row = float(np.max(_row_norm(h_deq[:used] - h_ref) / np.maximum(h_row_bound, 1e-30)))
        if worst_h_row > 1:
            failures.append(f"h row error norm {worst_h_row:.3g} x its bound")
        scale_err = float(np.max(np.abs(hs_k - hs_ref) / hs_ref))
        if scale_err > TOL_H_SCALE:
            failures.append(f"h_scale relative error {scale_err:.3g} > {TOL_H_SCALE:.3g}")

        # 3. y against the same pipeline on the kernel's own h
        y_same = _per_group_bsm(jnp.asarray(h[:used]), jnp.asarray(hs_k), dn_q, dn_s, sizes)
        rel_same = _row_norm(y32[:used] - y_same) / np.maximum(_row_norm(y_same), 1e-30)
        if rel_same.max() > TOL_Y_SAME_PIPELINE:
            r = int(np.argmax(rel_same))
            failures.append(f"y row {r} vs the block-scaled reference on the kernel's h: rel err {rel_same[r]:.3g} "
                            f"> {TOL_Y_SAME_PIPELINE:.3g}")

        # 4. y against the unquantised fp32 FFN, within the derived E4M3 error
        with jax.default_matmul_precision("highest"):
            y_true = np.asarray(reference.grouped_ffn(x.astype(jnp.float32), group_sizes, gate_up.astype(jnp.float32),
                                                      down.astype(jnp.float32)))[:used]
        sigma = np.asarray(fp8.ffn_error_sigma(x, sizes, gate_up, down, w, accumulation_rel=TC_ACC_REL))[:used]
        ratio = _row_norm(y32[:used] - y_true) / np.maximum(_row_norm(sigma), 1e-30)
        if ratio.max() > ROW_SIGMA_FACTOR:
            r = int(np.argmax(ratio))
            failures.append(f"y row {r} vs fp32: error norm {ratio[r]:.3g} x sigma > {ROW_SIGMA_FACTOR}")
        rel_true = _row_norm(y32[:used] - y_true) / np.maximum(_row_norm(y_true), 1e-30)
        metrics = dict(worst_h_err_over_bound=worst_h, worst_h_row_over_bound=worst_h_row, h_scale_rel_err=scale_err,
                       max_rel_err_y_same_pipeline=float(rel_same.max()), max_row_err_over_sigma=float(ratio.max()),
                       mean_row_err_over_sigma=float(ratio.mean()), max_rel_err_y_fp32=float(rel_true.max()),
                       mean_rel_err_y_fp32=float(rel_true.mean()))
    _record(case, m=int(m), hidden=int(hidden), inter=int(inter), experts=len(sizes), rows_used=used, num_sms=num_sms,
            **metrics)
    assert not failures, f"{case}: " + "; ".join(failures[:8])
    return y, h, hs, xq, xs


def _random_sizes(rng, total, experts):
    return rng.multinomial(total, np.full(experts, 1.0 / experts)).astype(np.int32)


def _zipf_sizes(rng, total, experts, s=1.2):
    p = 1.0 / np.arange(1, experts + 1) ** s
    return rng.multinomial(total, rng.permutation(p / p.sum())).astype(np.int32)


def test_small_with_padding_rows():
    rng = np.random.default_rng(_SEED)
    _check("small", *_problem("small", 1000, 512, 256, _random_sizes(rng, 963, 4)))


@pytest.mark.parametrize("model", ["kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro"])
def test_model_expert_shapes(model):
    shape = load_model(model)
    rng = np.random.default_rng([_SEED, len(model)])
    sizes = _random_sizes(rng, 1184, 4)  # 16 padding rows; groups ~296 rows: 5 m-blocks of 64, the last partial
    _check(f"model:{model}", *_problem(model, 1200, shape.hidden_size, shape.intermediate_size, sizes))


def test_zipf_skewed_groups():
    rng = np.random.default_rng([_SEED, 7])
    _check("zipf", *_problem("zipf", 3000, 4096, 1024, _zipf_sizes(rng, 3000, 16)))


def test_empty_and_one_row_groups():
    _check("empty_one_row", *_problem("empty_one_row", 480, 1024, 512, [0, 1, 0, 300, 1, 0, 129, 1]))


def test_smallest_sizes_and_the_down_n_tail():
    # H = 384: the down GEMM's last 256-column tile has only 128 columns (its second warpgroup's boxes are
    # not loaded); H = I = 128: one k block, one tile column; M = 1.
    _check("n_tail", *_problem("n_tail", 200, 384, 128, [70, 0, 120]))
    _check("one_row", *_problem("one_row", 1, 128, 128, [1]))
    _check("one_block", *_problem("one_block", 65, 128, 256, [64, 1]))


def test_all_rows_to_one_expert():
    _check("one_expert", *_problem("one_expert", 777, 1024, 512, [0, 777, 0, 0]))


def test_bad_group_sizes_report_status_and_zero_outputs():
    x, _, _, _, w = _problem("bad", 300, 256, 128, [100, 100, 100])
    for sizes, want in (([100, -1, 50], GROUPED_FFN_STATUS_NEGATIVE_GROUP),
                        ([200, 100, 1], GROUPED_FFN_STATUS_ROW_OVERFLOW),
                        ([-5, 400, 0], GROUPED_FFN_STATUS_NEGATIVE_GROUP | GROUPED_FFN_STATUS_ROW_OVERFLOW),
                        ([2**31 - 1, 2**31 - 1, 5], GROUPED_FFN_STATUS_ROW_OVERFLOW)):
        y, h, hs, _, _, status = jax.block_until_ready(_run(x, jnp.asarray(sizes, jnp.int32), w))
        assert int(status) == want, f"sizes {sizes}: status {int(status)}, want {want}"
        assert not np.asarray(y).view(np.uint16).any() and not np.asarray(h).view(np.uint8).any(), sizes
        assert (np.asarray(hs) == 1.0).all(), sizes
    _record("bad_sizes", ok=True)


def test_zero_rows():
    x = jnp.zeros((0, 256), jnp.bfloat16)
    _, _, _, _, w = _problem("zero_rows", 8, 256, 128, [4, 4])
    y, h, hs, xq, xs, status = _run(x, jnp.asarray([0, 0], jnp.int32), w)
    assert y.shape == (0, 256) and h.shape == (0, 128) and hs.shape == (1, 0) and int(status) == 0
    *_, status = _run(x, jnp.asarray([1, 0], jnp.int32), w)
    assert int(status) == GROUPED_FFN_STATUS_ROW_OVERFLOW


def test_bitwise_repeatable_and_independent_of_sm_count():
    rng = np.random.default_rng([_SEED, 11])
    x, gs, gate_up, down, w = _problem("repeat", 2500, 2048, 768, _zipf_sizes(rng, 2400, 12))
    first = [np.asarray(a) for a in jax.block_until_ready(_run(x, gs, w))]
    for num_sms in (None, 16, 7, 1):
        again = [np.asarray(a) for a in jax.block_until_ready(_run(x, gs, w, num_sms=num_sms))]
        for a, b, name in zip(first, again, ("y", "h", "h_scale", "x_q", "x_scale", "status")):
            same = np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
            assert same, f"{name} differs (num_sms={num_sms})"
    _check("repeat_16_sms", x, gs, gate_up, down, w, num_sms=16)
    _record("bitwise", ok=True)


_POISON_SCRIPT = textwrap.dedent(
    r"""
    import ctypes, sys
    import numpy as np
    import torch
    lib = ctypes.CDLL(sys.argv[1]); src = np.load(sys.argv[2]); dst = sys.argv[3]
    M, H, I, E = (int(v) for v in sys.argv[4:8])
    ffn = lib.MokFp8GroupedFfnRaw
    ffn.restype = ctypes.c_int
    ffn.argtypes = [ctypes.c_void_p] * 12 + [ctypes.c_int64] * 4 + [ctypes.c_int32, ctypes.c_void_p]
    dev = torch.device("cuda")
    t = {k: torch.from_numpy(np.ascontiguousarray(src[k])).to(dev) for k in src.files}
    def poisoned(*shape, dtype):  # every byte 0xff: NaN in bf16, e4m3 and f32
        return torch.full(shape, 255, dtype=torch.uint8, device=dev).view(dtype)
    y = poisoned(M, H * 2, dtype=torch.bfloat16)
    h = poisoned(M, I, dtype=torch.uint8); hs = poisoned(I // 128, M * 4, dtype=torch.float32)
    xq = poisoned(M, H, dtype=torch.uint8); xs = poisoned(H // 128, M * 4, dtype=torch.float32)
    st = torch.full((1,), -7, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream()
    rc = ffn(t["x"].data_ptr(), t["sizes"].data_ptr(), t["gate_up"].data_ptr(), t["gate_up_scale"].data_ptr(),
             t["down"].data_ptr(), t["down_scale"].data_ptr(), y.data_ptr(), h.data_ptr(), hs.data_ptr(),
             xq.data_ptr(), xs.data_ptr(), st.data_ptr(), M, H, I, E, 5, stream.cuda_stream)
    assert rc == 0, f"launch returned {rc}"
    torch.cuda.synchronize()
    np.savez(dst, y=y.view(torch.uint8).cpu().numpy(), h=h.cpu().numpy(), hs=hs.view(torch.uint8).cpu().numpy(),
             xq=xq.cpu().numpy(), xs=xs.view(torch.uint8).cpu().numpy(), status=st.cpu().numpy())
    """
)


def test_poisoned_outputs_are_fully_written_through_the_raw_entry(tmp_path):
    """Outputs poisoned with 0xff bytes (NaN) before a run on 5 SMs through MokFp8GroupedFfnRaw (torch, in a
    subprocess) come back with every byte written and equal, bit for bit, to the XLA run's."""
    pytest.importorskip("torch")
    x, gs, _, _, w = _problem("poison", 700, 384, 256, [300, 0, 1, 350])  # 49 padding rows
    y, h, hs, xq, xs, status = (np.asarray(a) for a in jax.block_until_ready(_run(x, gs, w)))
    u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    src = tmp_path / "in.npz"
    np.savez(src, x=u8(x), sizes=np.asarray(gs), gate_up=u8(w.gate_up), gate_up_scale=np.asarray(w.gate_up_scale),
             down=u8(w.down), down_scale=np.asarray(w.down_scale))
    dst = tmp_path / "out.npz"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    dims = [str(v) for v in (x.shape[0], x.shape[1], h.shape[1], gs.shape[0])]
    proc = subprocess.run([sys.executable, "-c", _POISON_SCRIPT, _native.library()._name, str(src), str(dst), *dims],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(dst)
    assert int(got["status"][0]) == int(status) == 0
    for name, want in (("y", y), ("h", h), ("hs", hs), ("xq", xq), ("xs", xs)):
        assert np.array_equal(got[name].reshape(-1), u8(want).reshape(-1)), f"{name} differs from the XLA run"
    _record("poisoned_raw", ok=True)
