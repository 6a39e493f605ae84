"""The experts' backward given the forward's kept g, u (``gu``), on CPU: the reference fed its own recompute gives
its bits, the op's argument errors for a bad ``gu`` come before it needs a GPU, and the call that reaches the
handler carries gu as its ninth operand with an empty [0, 2I] scratch gu (XLA allocates nothing for it).
The op itself on the GPU: tests/test_moe_backward_kept_gpu.py.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, ring_part, used_kept_blocks
from test_moe_backward import (I_, M_, _assert_rows_close, _call_types, _custom_call_lines, _layout_problem,
                                _op_args)

from mok_jax import _native
from mok_jax.expert_layout import gather_rows
from mok_jax.ops import experts_backward
from mok_jax.reference import experts_backward_reference

_F32 = jnp.float32


@functools.partial(jax.jit, static_argnames="top_k")
def _reference_gu(x, src_slot, group_sizes, gate_up, *, top_k):
    """[M, 2I] in x's dtype, what the forward keeps, computed as the reference recomputes it: row r of expert e (the
    group holding r) is x_r @ gate_up[e] at matmul precision "highest", rounded to x's dtype, with x_r =
    x[src_slot[r] // k] (zeros for padding rows); rows past sum(group_sizes) are zeros."""
    m = src_slot.shape[0]
    slot_ok = (src_slot >= 0) & (src_slot < x.shape[0] * top_k)
    x32 = gather_rows(x, jnp.where(slot_ok, src_slot // top_k, -1)).astype(_F32)
    expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    gu = jnp.zeros((m, gate_up.shape[2]), _F32)
    with jax.default_matmul_precision("highest"):
        for e in range(gate_up.shape[0]):
            gu = jnp.where((expert_of_row == e)[:, None], x32 @ gate_up[e].astype(_F32), gu)
    return gu.astype(x.dtype)


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case,T,E,k,H,I", [
    ("random", 150, 4, 2, 64, 48),
    ("masked", 90, 8, 3, 32, 40),  # masked slots (pos = M), tokens with every slot masked
    ("empty_experts", 70, 8, 2, 24, 16),  # experts 4.. get nothing
    ("one_expert", 130, 8, 4, 16, 24),  # all tokens to expert 2: one group of 256 rows
    ("one_token", 1, 8, 3, 16, 8),
])
def test_reference_fed_its_own_gu_gives_its_bits(case, T, E, k, H, I, dtype):
    """gu = the reference's own recompute: every output (dx, dw, both weight gradients, status, dx_rows) is the
    bits of gu=None; rows past sum(group_sizes) are not read and padding rows are taken as zeros (NaN in either
    changes nothing)."""
    args, _ = _layout_problem(T + E + 7, T, E, k, H, I, case, dtype=dtype)
    x, _, _, _, src_slot, gs, gate_up, _ = args
    ref = jax.jit(experts_backward_reference)
    want = ref(*args)
    gu = _reference_gu(x, src_slot, gs, gate_up, top_k=k)
    assert gu.shape == (src_slot.shape[0], 2 * I) and gu.dtype == dtype
    assert_same_bits(case, ref(*args, gu=gu), want)
    past = jnp.arange(src_slot.shape[0]) >= jnp.sum(gs)
    assert bool(past.any()), "M = T k + 128 E leaves rows past the groups"
    assert_same_bits(f"{case}: NaN past the groups", ref(*args, gu=jnp.where(past[:, None], jnp.nan, gu)), want)
    pad = (src_slot < 0) & ~past  # padding rows inside the groups: zeros whatever gu holds, as the op makes them
    assert_same_bits(f"{case}: NaN in padding rows", ref(*args, gu=jnp.where(pad[:, None], jnp.nan, gu)), want)


def test_reference_reads_the_given_gu():
    """A changed g of one slot's row changes that token's dx and that slot's dw, and nothing of the other
    tokens' (the kept values are used, not recomputed)."""
    T, E, k, H, I = 40, 4, 2, 16, 8
    args, idx = _layout_problem(11, T, E, k, H, I)
    x, _, _, pos, src_slot, gs, gate_up, _ = args
    gu = _reference_gu(x, src_slot, gs, gate_up, top_k=k)
    want = experts_backward_reference(*args, gu=gu)
    r = int(pos[5, 1])
    got = experts_backward_reference(*args, gu=gu.at[r, :I].add(1.0))
    changed = np.flatnonzero(np.any(np.asarray(got.dx) != np.asarray(want.dx), axis=1))
    np.testing.assert_array_equal(changed, [5])
    assert got.dw[5, 1] != want.dw[5, 1]
    np.testing.assert_array_equal(np.asarray(got.dw)[np.arange(T) != 5], np.asarray(want.dw)[np.arange(T) != 5])


# ----------------------------------------------------------------------------- argument errors


_BF16 = jnp.bfloat16
_BAD_GU = [  # _op_args is bf16: the kept g, u must be bf16 too (the kernel stores them so)
    (jnp.ones((M_, 2 * I_), _F32), TypeError, r"gu \(the kept g, u\) must be bfloat16\[M, 2I\] = "
     rf"bfloat16\[{M_}, {2 * I_}\], got float32\[{M_}, {2 * I_}\]"),
    (jnp.ones((M_, 2 * I_), jnp.float16), TypeError, "gu .* must be bfloat16.*got float16"),
    (jnp.ones((M_, 2 * I_), jnp.int32), TypeError, "gu .* must be bfloat16.*got int32"),
    (jnp.ones((M_ - 1, 2 * I_), _BF16), ValueError,
     rf"gu \(the kept g, u\) must be \[M, 2I\] = \({M_}, {2 * I_}\) .*got \({M_ - 1}, {2 * I_}\)"),
    (jnp.ones((M_, I_), _BF16), ValueError, rf"gu .* must be \[M, 2I\] = \({M_}, {2 * I_}\) .*got \({M_}, {I_}\)"),
    (jnp.ones((0, 2 * I_), _BF16), ValueError, rf"gu .* must be \[M, 2I\] .*got \(0, {2 * I_}\)"),
    (jnp.ones((M_ * 2 * I_,), _BF16), ValueError, r"gu .* must be \[M, 2I\]"),
    (jnp.ones((M_, 2 * I_, 1), _BF16), ValueError, r"gu .* must be \[M, 2I\]"),
]


@pytest.mark.parametrize("gu,exc,match", _BAD_GU)
def test_op_rejects_a_bad_gu_naming_it(gu, exc, match):
    """Before it needs the native library or a GPU: eagerly, at trace time under jit, and in the reference."""
    with pytest.raises(exc, match=match):
        experts_backward(**_op_args(), gu=gu)
    with pytest.raises(exc, match=match):
        jax.jit(lambda a, g: experts_backward(**a, gu=g))(_op_args(), gu)
    with pytest.raises(exc, match=match):
        experts_backward_reference(**_op_args(), gu=gu)


def test_op_with_a_good_gu_without_gpu_raises_not_falls_back():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: the op runs (tests/test_moe_backward_kept_gpu.py)")
    with pytest.raises(_native.NativeLibraryUnavailable, match="experts_backward"):
        experts_backward(**_op_args(), gu=jnp.zeros((M_, 2 * I_), _BF16))


# ----------------------------------------------------------------------------- what reaches the handler


def test_op_lowers_with_the_kept_gu_as_its_ninth_operand(monkeypatch):
    """gu given: operands x, dy, topk_weight, pos, src_slot, group_sizes, gate_up, down, gu_in bf16[M, 2I]; the
    results as without it, the scratch gu (result 8) aliased to gu_in: the op zeroes its padding rows in place
    (ffi/src/ffi_moe_backward.cu). return_gu (the test hook) gives back the gu the op read, without a second
    call."""
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    T, k, M, H, I, E = 100, 3, 812, 64, 384, 4
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H), jnp.bfloat16), sds((T, H), jnp.bfloat16), sds((T, k), _F32), sds((T, k), jnp.int32),
            sds((M,), jnp.int32), sds((E,), jnp.int32), sds((E, H, 2 * I), jnp.bfloat16),
            sds((E, I, H), jnp.bfloat16))
    gu = sds((M, 2 * I), _BF16)
    text = jax.jit(lambda *a: mb.experts_backward(*a[:-1], gu=a[-1])).lower(*args, gu).as_text()
    [call] = _custom_call_lines(text, "mok_experts_backward")
    assert _call_types(T, k, M, H, I, E, M) in call, call
    assert "output_operand_alias<output_tuple_indices = [8], operand_index = 8," in call, call

    for given in (None, gu):
        out, back = jax.eval_shape(functools.partial(mb.experts_backward, return_gu=True), *args, gu=given)
        assert back.shape == (M, 2 * I) and back.dtype == _BF16, given
        assert out.dx.shape == (T, H) and out.dx_rows.shape == (M, H), given
    assert len(_custom_call_lines(text, "mok_experts_backward")) == 1


# ----------------------------------------------------------------------------- part of g, u kept (keep="ring")


# Two different XLA programs of the same f32 math (the reference with and without gu_part) need not give the same
# bits on CPU: XLA may lower a dot of one (here dgu @ gate_up^T, over 2I) to another summation order, which it did
# on an AVX2 machine and not on an AVX-512 one. Such outputs agree to the f32 sum order (~2^-20 of a row) and, for
# the bf16 ones (dx_rows, the weight gradients), to roundings turned the other way (each at most 2^-8 of its
# element, so at most 2^-8 of the row's norm together); 2^-7 of the row's norm is above both and far below a wrong
# g, u block (O(1)).
_ACROSS_PROGRAMS = 2.0**-7


def _assert_outputs_close(case: str, got, want) -> None:
    """Every field of two outputs of the experts' backward: the status the same, each float array row by row (its
    last axis) within _ACROSS_PROGRAMS of the row's norm (test_moe_backward's _assert_rows_close)."""
    for name, a, b in zip(want._fields, got, want):
        assert (a is None) == (b is None), f"{case}: {name}"
        if a is None:
            continue
        a, b = np.asarray(a), np.asarray(b)
        if b.dtype.kind in "biu":  # the status
            np.testing.assert_array_equal(a, b, f"{case}: {name}")
        else:
            _assert_rows_close(f"{case}: {name}", a.reshape(-1, b.shape[-1]), b.reshape(-1, b.shape[-1]),
                               _ACROSS_PROGRAMS)


def test_reference_with_part_kept_gu_copies_whole_blocks_and_recomputes_the_rest():
    """Blocks of 128 rows whose slot rows all have a kept row use those (a changed value shows, in its token's dx
    only); a block with one row short is recomputed (NaN in its kept rows changes no bit); fed its own recompute
    the reference gives the outputs of gu_part=None (row by row: another XLA program)."""
    T, E, k, H, I = 600, 2, 2, 16, 8
    args, _ = _layout_problem(3, T, E, k, H, I)
    x, _, _, pos, src_slot, gs, gate_up, _ = args
    ref = jax.jit(lambda *a: experts_backward_reference(*a[:-2], gu_part=a[-2], gu_part_row=a[-1]))
    want = jax.jit(experts_backward_reference)(*args)
    gu = _reference_gu(x, src_slot, gs, gate_up, top_k=k)
    part, row, mine = ring_part(gu, src_slot, k, T // 2)
    blocks = used_kept_blocks(src_slot, row, part.shape[0], T * k, gs)
    copied = np.pad(np.repeat(blocks, 128) == 1, (0, src_slot.shape[0] - 128 * blocks.size))  # rows of copied blocks
    assert 0 < blocks.sum() < blocks.size, blocks
    own = ref(*args, part, row)
    _assert_outputs_close("own recompute", own, want)
    # the same program from here on: bits
    assert_same_bits("NaN in recomputed blocks", ref(*args, part.at[np.asarray(row)[mine & ~copied]].set(jnp.nan),
                                                      row), own)
    r = int(np.flatnonzero(mine & copied)[0])  # a copied row: its token's dx changes, no other
    got = ref(*args, part.at[int(row[r])].add(1.0), row)
    t = int(src_slot[r]) // k
    np.testing.assert_array_equal(np.flatnonzero(np.any(np.asarray(got.dx) != np.asarray(own.dx), axis=1)), [t])
    # no kept row at all: every block recomputes
    _assert_outputs_close("nothing kept", ref(*args, jnp.zeros((0, 2 * I), x.dtype), jnp.full(src_slot.shape, -1)),
                          want)


def test_kept_blocks_flags_blocks_whose_slot_rows_all_have_a_kept_row():
    from mok_jax.expert_layout import kept_blocks

    src = jnp.asarray([0, 1, -1, -1, 2, 3, 4, -1, 5], jnp.int32)  # blocks of 4: rows 0-3, 4-7, 8 (+ 3 padding)
    row = jnp.asarray([0, 1, 5, -1, 2, -1, 3, -1, 9], jnp.int32)
    np.testing.assert_array_equal(np.asarray(kept_blocks(src, row, 4, 6, block=4)), [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(kept_blocks(src, row, 10, 6, block=4)), [1, 0, 1])
    # slot 5 counts as padding when slots = 5: its row (9) need not be kept
    np.testing.assert_array_equal(np.asarray(kept_blocks(src, row, 4, 5, block=4)), [1, 0, 1])


_BAD_PART = [
    (dict(gu_part=jnp.zeros((4, 2 * I_), _BF16)), ValueError,
     "gu_part and gu_part_row .* both be given or both be None"),
    (dict(gu_part_row=jnp.zeros((M_,), jnp.int32)), ValueError, "gu_part and gu_part_row .* both"),
    (dict(gu_part=jnp.zeros((4, 2 * I_), _BF16), gu_part_row=jnp.zeros((M_,), jnp.int32),
          gu=jnp.zeros((M_, 2 * I_), _BF16)), ValueError, r"gu \(every row's kept g, u\) and gu_part .* exclusive"),
    (dict(gu_part=jnp.zeros((4, I_), _BF16), gu_part_row=jnp.zeros((M_,), jnp.int32)), ValueError,
     rf"gu_part \(some rows' kept g, u\) must be bfloat16\[R, 2I\] with 2I = {2 * I_}, got bfloat16\[4, {I_}\]"),
    (dict(gu_part=jnp.zeros((4, 2 * I_), _F32), gu_part_row=jnp.zeros((M_,), jnp.int32)), ValueError,
     r"gu_part .* must be bfloat16\[R, 2I\].*got float32"),
    (dict(gu_part=jnp.zeros((4, 2 * I_), _BF16), gu_part_row=jnp.zeros((M_ - 1,), jnp.int32)), ValueError,
     rf"gu_part_row \(each row's row of gu_part\) must be int32\[M\] = int32\[{M_}\] .*got int32\[{M_ - 1}\]"),
    (dict(gu_part=jnp.zeros((4, 2 * I_), _BF16), gu_part_row=jnp.zeros((M_,), jnp.float32)), ValueError,
     r"gu_part_row .* must be int32\[M\].*got float32"),
]


@pytest.mark.parametrize("kw,exc,match", _BAD_PART)
def test_op_rejects_a_bad_gu_part_naming_it(kw, exc, match):
    with pytest.raises(exc, match=match):
        experts_backward(**_op_args(), **kw)
    with pytest.raises(exc, match=match):
        experts_backward_reference(**_op_args(), **kw)


def test_op_lowers_with_the_part_kept_gu_after_gu_in(monkeypatch):
    """gu_part given: operands ..., gu_in bf16[0, 2I], gu_part bf16[R, 2I], gu_part_row s32[M], the kept blocks
    s32[ceil(M / 128)]; the scratch gu is the op's own (no alias)."""
    mb = importlib.import_module("mok_jax.ops.moe_backward")
    monkeypatch.setattr(mb, "require_native", lambda what: None)
    T, k, M, H, I, E, R = 100, 3, 812, 64, 384, 4, 150
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H), jnp.bfloat16), sds((T, H), jnp.bfloat16), sds((T, k), _F32), sds((T, k), jnp.int32),
            sds((M,), jnp.int32), sds((E,), jnp.int32), sds((E, H, 2 * I), jnp.bfloat16),
            sds((E, I, H), jnp.bfloat16))
    text = jax.jit(lambda *a: mb.experts_backward(*a[:-2], gu_part=a[-2], gu_part_row=a[-1])).lower(
        *args, sds((R, 2 * I), _BF16), sds((M,), jnp.int32)).as_text()
    [call] = _custom_call_lines(text, "mok_experts_backward")
    assert _call_types(T, k, M, H, I, E, 0, part_rows=R) in call, call
    assert "output_operand_alias" not in call, call
