"""GPU tests of mok_jax.ops.experts_backward given the forward's kept g, u (``gu``): the op then skips its gate/up
recompute (launch 1) and reads gu instead.

Against the reference: fresh random bf16 problems (tests/test_moe_backward_gpu.py's builders and bounds), gu made
in XLA as the forward keeps it (x_r @ gate_up[e] of each row's expert, bf16 x bf16 with f32 accumulation rounded to
bf16, zeros for rows without a slot), the op and experts_backward_reference both given that gu.
Bitwise: the op fed its own recompute (return_gu) gives the bits of the op that recomputes, for every output and
any SM count; NaN in the rows past sum(group_sizes) (which hold no slot) changes nothing, since nothing reads
them; and the status word, which the skipped launch used to write, is still written by the op (launch 2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bits, ring_part, used_kept_blocks
from test_moe_backward_gpu import _check_op, _check_rows, _op_problem

from mok_jax import ops
from mok_jax.expert_layout import gather_rows
from mok_jax.ops.moe_backward import (
    EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP,
    EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW,
    EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP,
)
from mok_jax.reference import experts_backward_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

# The op's own g, u (return_gu) against XLA's bf16 x bf16 -> f32 matmul of the same rows rounded to bf16, per row:
# the same exact products summed over H <= 320 in another order (~2^-20 of the row) may round an element to its
# neighbouring bf16 (2^-8 of the element), so at most 2^-8 of the row's norm; a wrong row or expert is O(1).
GU_ROW_TOL = 2.0**-8

_F32 = jnp.float32
_BF16 = jnp.bfloat16


@functools.partial(jax.jit, static_argnames="top_k")
def _xla_gu(x, src_slot, group_sizes, gate_up, *, top_k):
    """bf16[M, 2I] as the forward keeps it: row r of expert e (the group holding r) is x_r @ gate_up[e], bf16
    operands with f32 accumulation rounded to bf16, x_r = x[src_slot[r] // k] (zeros for padding rows); rows past
    sum(group_sizes) are zeros."""
    m = src_slot.shape[0]
    slot_ok = (src_slot >= 0) & (src_slot < x.shape[0] * top_k)
    x_e = gather_rows(x, jnp.where(slot_ok, src_slot // top_k, -1))
    expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    gu = jnp.zeros((m, gate_up.shape[2]), _F32)
    for e in range(gate_up.shape[0]):
        full = jax.lax.dot_general(x_e, gate_up[e], (((1,), (0,)), ((), ())), preferred_element_type=_F32)
        gu = jnp.where((expert_of_row == e)[:, None], full, gu)
    return gu.astype(_BF16)


_CASES = [
    (300, 8, 4, 256, 512, "uniform"),  # rows past the sum (M = T k + 128 E)
    (200, 8, 2, 320, 384, "masked_empty"),  # empty experts, masked slots; I not a multiple of 256; H = 2.5 x 128
    (1, 8, 3, 256, 384, "uniform"),  # one token
]


@pytest.mark.parametrize("T,E,k,H,I,routing", _CASES)
def test_op_with_kept_gu_matches_reference(T, E, k, H, I, routing):
    case = f"kept:{T}x{E}x{k}x{H}x{I}:{routing}"
    args, idx = _op_problem(case, T, E, k, H, I, routing)
    x, _, _, _, src_slot, gs, gate_up, _ = args
    gu = _xla_gu(x, src_slot, gs, gate_up, top_k=k)
    got = jax.jit(lambda *a: ops.experts_backward(*a[:-1], gu=a[-1]))(*args, gu)
    want = jax.jit(lambda *a: experts_backward_reference(*a[:-1], gu=a[-1]))(*args, gu)
    _check_op(case, args, got, want, idx)


@pytest.mark.parametrize("T,E,k,H,I,routing", _CASES)
def test_op_fed_its_own_gu_gives_its_bits(T, E, k, H, I, routing):
    case = f"own gu:{T}x{E}x{k}x{H}x{I}:{routing}"
    args, _ = _op_problem(case, T, E, k, H, I, routing)
    want, gu = jax.jit(functools.partial(ops.experts_backward, return_gu=True))(*args)
    assert gu.shape == (args[4].shape[0], 2 * I) and gu.dtype == _BF16
    kept = jax.jit(lambda *a, num_sms=None: ops.experts_backward(*a[:-1], gu=a[-1], num_sms=num_sms),
                   static_argnames="num_sms")
    assert_same_bits(case, kept(*args, gu), want)
    assert_same_bits(f"{case}: num_sms=3", kept(*args, gu, num_sms=3), want)
    past = jnp.arange(gu.shape[0]) >= jnp.sum(args[5])
    assert bool(past.any())
    assert_same_bits(f"{case}: NaN past the groups", kept(*args, jnp.where(past[:, None], jnp.nan, gu)), want)
    # padding rows inside the groups: the op zeroes them itself (the forward leaves them unwritten)
    pad = (args[4] < 0) & ~past
    assert_same_bits(f"{case}: NaN in padding rows", kept(*args, jnp.where(pad[:, None], jnp.nan, gu)), want)
    # what return_gu gives is the forward's g, u: XLA's matmul of the same rows, zeros where no slot is
    ref = _xla_gu(args[0], args[4], args[5], args[6], top_k=k)
    _check_rows(f"{case}: gu", gu, ref, GU_ROW_TOL, GU_ROW_TOL)
    assert not np.asarray(gu)[np.asarray(ref == 0).all(1)].any(), f"{case}: a row without a slot is not zeros"


def test_op_with_kept_gu_writes_the_status():
    """Launch 1 (skipped with gu given) wrote the status word; launch 2 writes it then: the bits of bad sizes,
    and 0 for good ones. Bad and good sizes alternate, so a word left unwritten would show a stale value if
    XLA hands the call the same buffer again (or garbage if not)."""
    args, _ = _op_problem("kept status", 128, 2, 1, 256, 256)  # M = 128 + 2 * 128 = 384
    x, dy, w, pos, src_slot, gs, gate_up, down = args
    gu = _xla_gu(x, src_slot, gs, gate_up, top_k=1)
    f = jax.jit(lambda sizes: ops.experts_backward(x, dy, w, pos, src_slot, sizes, gate_up, down, gu=gu))
    for sizes, bits in (([128, -128], EXPERTS_BACKWARD_STATUS_NEGATIVE_GROUP),
                        ([128, 128], 0),
                        ([256, 256], EXPERTS_BACKWARD_STATUS_ROW_OVERFLOW),
                        ([128, 128], 0),
                        ([128, 100], EXPERTS_BACKWARD_STATUS_UNALIGNED_GROUP),
                        ([128, 128], 0)):
        out = f(jnp.asarray(sizes, jnp.int32))
        status = int(out.status)
        assert status == bits, f"group sizes {sizes} (M = 384): status {status}, want {bits}"
        for name in ("d_gate_up", "d_down"):
            g = np.asarray(getattr(out, name), np.float32)
            assert np.all(np.isnan(g)) if bits else np.all(np.isfinite(g)), f"group sizes {sizes}: {name}"


@pytest.mark.parametrize("T,E,k,H,I", [(1200, 4, 2, 256, 384), (700, 8, 3, 320, 512)])
def test_op_with_part_kept_gu(T, E, k, H, I):
    """gu_part with the g, u of the slots of tokens >= T / 2 (as keep="ring" keeps the ring's tokens'): a 128-row
    block whose slot rows all have one copies them, the others recompute. Fed its own recompute's rows, the op
    gives the bits of the op that recomputes everything, for any SM count; NaN in the rows that only the
    recomputed blocks hold changes nothing; and with gu_part + 1 the g, u it used (return_gu) are those in the
    copied blocks (zeros in their padding rows) and its recompute elsewhere, as the reference takes them."""
    case = f"part:{T}x{E}x{k}x{H}x{I}"
    args, idx = _op_problem(case, T, E, k, H, I)
    src = args[4]
    op = jax.jit(lambda *a, num_sms=None: ops.experts_backward(*a[:-2], gu_part=a[-2], gu_part_row=a[-1],
                                                               num_sms=num_sms, return_gu=True),
                 static_argnames="num_sms")
    want, gu = jax.jit(functools.partial(ops.experts_backward, return_gu=True))(*args)
    part, row, mine = ring_part(gu, src, k, T // 2)
    blocks = used_kept_blocks(src, row, part.shape[0], T * k, args[5])
    assert 0 < blocks.sum() < blocks.size, f"{case}: want blocks of both kinds, got {blocks}"
    copied = np.pad(np.repeat(blocks, 128) == 1, (0, src.shape[0] - 128 * blocks.size))  # rows of copied blocks
    got, got_gu = op(*args, part, row)
    assert_same_bits(case, got, want)
    assert_same_bits(f"{case}: num_sms=3", op(*args, part, row, num_sms=3)[0], want)
    recomputed_rows = np.asarray(row)[mine & ~copied]
    assert recomputed_rows.size, case
    assert_same_bits(f"{case}: NaN in rows of recomputed blocks", op(*args, part.at[recomputed_rows].set(jnp.nan),
                                                                      row)[0], want)
    got, got_gu = op(*args, part + 1, row)
    plus_one, gu32 = np.asarray(gu + 1, np.float32), np.asarray(gu, np.float32)  # bf16 + 1, rounded as part + 1 is
    want_gu = np.where(copied[:, None] & mine[:, None], plus_one, np.where(copied[:, None], 0, gu32))
    np.testing.assert_array_equal(np.asarray(got_gu, np.float32), want_gu, f"{case}: the g, u the op used")
    ref = jax.jit(lambda *a: experts_backward_reference(*a[:-2], gu_part=a[-2], gu_part_row=a[-1]))(*args, part + 1,
                                                                                                   row)
    _check_op(f"{case}: gu_part + 1", args, got, ref, idx)
