"""GPU tests of the expert-parallel comm ops, one process driving every GPU of the EP group
(peer-access backend), at every EP size the machine offers.

Everything is checked bitwise with self-identifying rows (columns 0..2 of a row encode its source
rank and token) against two oracles: the numpy loops and the pure-JAX reference
(mok_jax.reference.comm) run on host devices. Each test runs once per EP size (test ids ``[ep2]``,
``[ep4]``, ``[ep8]``): by default 8, 4, 2 and the GPU count, largest first (so a run cut short loses
the EP 2 cases, which the 2-GPU machine already covers); sizes above the GPU count are skipped with
the reason. ``MOK_COMM_EP=4,2`` (or ``all`` = the GPU count) picks the sizes. Run on the 2-GPU machine
by scripts/gpu_comm.sh, on the 4- and 8-GPU machines by scripts/gpu_ep_scaling.sh. Each test's routing and
rows come from the seeds it was written with, through conftest.py's ``seed`` fixture: others of its own under
MOK_TEST_SEED=<n>, which a failing test's report names.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mok_jax import ops
from mok_jax.bench.comm import decode_row, routing_case, self_identifying_tokens
from mok_jax.config import KernelConfig
from mok_jax.reference.comm import (
    dispatch_combine_identity_numpy,
    dispatch_layout_numpy,
    ep_dispatch_combine_identity,
    ep_dispatch_layout,
)
from mok_jax.workspace import CommError, CommTimeoutError, Workspace

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

EXPERTS = 16       # 8 per GPU at EP 2, 4 at EP 4, 2 at EP 8
MAX_TOKENS = 512
HIDDEN = 264       # 33 16-byte vectors: not a multiple of any copy tile
TOP_K = 10         # calls use k <= TOP_K
TIMEOUT_S = 5.0    # correctness runs; the timeout test uses its own short one
SPEC = P("ep")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def ep_sizes(env: str | None = None, num_gpus: int | None = None) -> list[int]:
    """The EP sizes to test, largest first: ``MOK_COMM_EP`` (comma-separated; ``all`` = the GPU
    count), else 2, 4, 8 and the GPU count when it is larger than 2."""
    env = os.environ.get("MOK_COMM_EP", "") if env is None else env
    n = len(_gpus()) if num_gpus is None else num_gpus
    if env.strip():
        sizes = {n if tok.strip() == "all" else int(tok) for tok in env.split(",") if tok.strip()}
    else:
        sizes = {2, 4, 8} | ({n} if n > 2 else set())
    return sorted((e for e in sizes if e >= 1), reverse=True)


@pytest.fixture(scope="module", params=ep_sizes(), ids=lambda e: f"ep{e}")
def mesh(request):
    from mok_jax._native import library, native_status

    ep = request.param
    gpus = _gpus()
    if len(gpus) < ep:
        pytest.skip(f"EP {ep} needs {ep} GPUs, this machine has {len(gpus)} (not a pass)")
    if EXPERTS % ep:
        pytest.skip(f"EP {ep} does not divide the tests' {EXPERTS} experts (not a pass)")
    if library() is None:
        pytest.skip(f"native library unavailable: {native_status()} (not a pass)")
    return Mesh(np.array(gpus[:ep]), ("ep",))


def _create(mesh, hidden=HIDDEN, **kw):
    kw.setdefault("timeout_s", TIMEOUT_S)
    return Workspace.create(mesh, "ep", max_tokens=kw.pop("max_tokens", MAX_TOKENS), hidden_size=hidden,
                            top_k=kw.pop("top_k", TOP_K), num_experts=kw.pop("num_experts", EXPERTS), **kw)


@pytest.fixture(scope="module")
def ws(mesh):
    w = _create(mesh)
    yield w
    w.close()


def _cpu_mesh(ep):
    cpus = jax.devices("cpu")
    return Mesh(np.array(cpus[:ep]), ("ep",)) if len(cpus) >= ep else None


def _flat(a):
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def expected(x, idx, w, experts=EXPERTS):
    """Numpy oracles, cross-checked against the JAX reference on host devices when there are ep of
    them (tests/conftest.py asks for 8)."""
    ep, tokens, k = idx.shape
    layout = dispatch_layout_numpy(x, idx, w, experts)
    y = dispatch_combine_identity_numpy(x, idx, w, experts)
    cpu = _cpu_mesh(ep)
    if cpu is not None:
        args = (_flat(x), _flat(idx), _flat(w))
        fy = jax.jit(jax.shard_map(lambda a, b, c: ep_dispatch_combine_identity(a, b, c, axis_name="ep",
                                                                                num_experts=experts),
                                   mesh=cpu, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False))
        y_jax = np.asarray(fy(*args)).reshape(y.shape)
        np.testing.assert_array_equal(y_jax.view(np.uint16), y.view(np.uint16), "JAX reference != numpy oracle")
        fl = jax.jit(jax.shard_map(
            lambda a, b, c: tuple(o[None] for o in ep_dispatch_layout(a, b, c, axis_name="ep", num_experts=experts)),
            mesh=cpu, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False))
        recv, sizes, table, _, source = (np.asarray(o) for o in fl(*args))
        for r in range(ep):
            np.testing.assert_array_equal(table[r], layout[r]["row_table"])
            np.testing.assert_array_equal(source[r], layout[r]["row_source"])
            np.testing.assert_array_equal(sizes[r], layout[r]["group_sizes"])
            np.testing.assert_array_equal(recv[r].view(np.uint16), layout[r]["recv_x"].view(np.uint16))
    return layout, y


def comm_fn(ws, *, modes=(("pull", "push"), ("push", "pull")), num_sms=None):
    """jit(shard_map): for each (dispatch mode, combine mode): dispatch, identity experts, combine."""
    def body(x, i, w):
        outs = []
        for dmode, cmode in modes:
            recv, lay = ops.dispatch(ws, x, i, w, mode=dmode, num_sms=num_sms)
            y, st = ops.combine(ws, recv, lay, mode=cmode, num_sms=num_sms)
            outs += [recv[None], lay.group_sizes[None], lay.row_table[None], lay.row_weight[None],
                     lay.status[None], y, st[None], lay.row_source[None]]
        return tuple(outs)
    return jax.jit(jax.shard_map(body, mesh=ws.mesh, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False))


def run(ws, x, idx, w, **kw):
    """Returns one dict per mode pair, numpy, per rank."""
    ep, tokens, k = idx.shape
    outs = comm_fn(ws, **kw)(jnp.asarray(_flat(x)), jnp.asarray(_flat(idx)), jnp.asarray(_flat(w)))
    outs = [np.asarray(o) for o in jax.block_until_ready(outs)]
    res = []
    for m in range(len(outs) // 8):
        recv, sizes, table, weight, dstatus, y, cstatus, source = outs[8 * m: 8 * m + 8]
        res.append(dict(recv_x=recv, group_sizes=sizes, row_table=table, row_weight=weight, dstatus=dstatus,
                        y=y.reshape(ep, tokens, -1), cstatus=cstatus, row_source=source))
    return res


def _rows_report(got, want, limit=4):
    bad = np.nonzero(np.any(got.view(np.uint16) != want.view(np.uint16), axis=-1))[0]
    lines = [f"{bad.size} of {got.shape[0]} rows differ"]
    for r in bad[:limit]:
        lines.append(f"  row {r}: got {decode_row(got[r])}, want {decode_row(want[r])}")
    return "\n".join(lines)


def check(res, layout, y, label):
    ep = len(layout)
    for m, out in enumerate(res):
        tag = f"{label} / mode pair {m}"
        np.testing.assert_array_equal(out["dstatus"], 0, f"{tag}: dispatch status")
        np.testing.assert_array_equal(out["cstatus"], 0, f"{tag}: combine status")
        for r in range(ep):
            e = layout[r]
            np.testing.assert_array_equal(out["group_sizes"][r], e["group_sizes"], f"{tag}: group sizes rank {r}")
            np.testing.assert_array_equal(out["row_table"][r], e["row_table"], f"{tag}: row table rank {r}")
            np.testing.assert_array_equal(out["row_weight"][r], e["row_weight"], f"{tag}: row weight rank {r}")
            np.testing.assert_array_equal(out["row_source"][r], e["row_source"], f"{tag}: row source rank {r}")
            got, want = out["recv_x"][r], e["recv_x"]
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
                f"{tag}: recv_x rank {r}: " + _rows_report(got, want)
        assert np.array_equal(out["y"].view(np.uint16), y.view(np.uint16)), \
            f"{tag}: combine output: " + _rows_report(out["y"].reshape(-1, y.shape[-1]), y.reshape(-1, y.shape[-1]))
    for out in res[1:]:  # pull and push agree exactly
        for key in ("recv_x", "y"):
            assert np.array_equal(out[key].view(np.uint16), res[0][key].view(np.uint16))


CASES = [  # (routing kind, tokens, top_k)
    ("uniform", 300, 8),
    ("zipf", 257, 8),
    ("one-expert", 200, 1),      # every token to expert 1: only rank 0 (its owner) receives
    ("sparse-experts", 129, 4),  # 2 of every 3 experts get zero tokens
    ("with-invalid", 100, 6),    # ids of -1 go nowhere
    ("uniform", 1, 8),           # one token
    ("uniform", 77, 10),         # k = 10
    ("zipf", 512, 1),            # k = 1, max tokens
]


@pytest.mark.parametrize("kind,tokens,k", CASES)
def test_dispatch_combine_bitwise(ws, kind, tokens, k, seed):
    ep = ws.config.ep
    idx, w = routing_case(kind, ep=ep, tokens=tokens, top_k=k, num_experts=EXPERTS, seed=seed(tokens))
    x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(tokens))
    layout, y = expected(x, idx, w)
    check(run(ws, x, idx, w), layout, y, f"{kind} T={tokens} k={k}")


def test_full_hidden_size_and_few_sms(mesh, seed):
    """H = 7168 (the benchmark's rows), uniform k = 8, and 3 communication blocks."""
    tokens, k, ep = 256, 8, mesh.devices.size
    with _create(mesh, hidden=7168, max_tokens=tokens, top_k=k) as big:
        idx, w = routing_case("uniform", ep=ep, tokens=tokens, top_k=k, num_experts=EXPERTS, seed=seed(7))
        x = self_identifying_tokens(ep, tokens, 7168, seed=seed(7))
        layout, y = expected(x, idx, w)
        check(run(big, x, idx, w, num_sms=3), layout, y, "H=7168")


def test_workspace_kernel_config_sets_the_defaults(mesh, seed):
    """Calls that name no mode and no SM count run the workspace's KernelConfig (here push dispatch, pull
    combine, 3 communication blocks: none of them the defaults), bitwise as the oracles say."""
    tokens, k, ep = 200, 8, mesh.devices.size
    kernel = KernelConfig(comm_items_fwd=3, dispatch="push", combine="pull")
    with _create(mesh, kernel=kernel) as tuned:
        assert (tuned.config.num_sms, tuned.config.dispatch_mode, tuned.config.combine_mode) == (3, "push", "pull")
        idx, w = routing_case("zipf", ep=ep, tokens=tokens, top_k=k, num_experts=EXPERTS, seed=seed(11))
        x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(11))
        layout, y = expected(x, idx, w)
        check(run(tuned, x, idx, w, modes=((None, None),)), layout, y, "workspace kernel config")


def test_thousand_calls_back_to_back(ws, seed):
    tokens, k, ep = 64, 8, ws.config.ep
    idx, w = routing_case("uniform", ep=ep, tokens=tokens, top_k=k, num_experts=EXPERTS, seed=seed(3))
    x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(3))
    _, y_ref = expected(x, idx, w)
    f = comm_fn(ws, modes=(("pull", "push"),))
    args = (jnp.asarray(_flat(x)), jnp.asarray(_flat(idx)), jnp.asarray(_flat(w)))
    before = ws.device_state()
    ys, sts = [], []
    for _ in range(1000):
        out = f(*args)
        ys.append(out[5])
        sts.append(out[4] + out[6])  # dispatch + combine status
    jax.block_until_ready(ys)
    ws.check()
    ys = np.stack([np.asarray(a) for a in ys])
    assert np.all(np.stack([np.asarray(s) for s in sts]) == 0), "a status was nonzero"
    assert np.array_equal(ys[0].view(np.uint16), y_ref.reshape(ys[0].shape).view(np.uint16))
    assert np.all(ys.view(np.uint16) == ys[:1].view(np.uint16)), "results differ between calls"
    after = ws.device_state()
    for r in after:
        assert after[r]["dispatch_epoch"] - before[r]["dispatch_epoch"] == 1000
        assert after[r]["combine_epoch"] - before[r]["combine_epoch"] == 1000


def test_two_workspaces_in_one_jit(mesh, seed):
    tokens, ep = 96, mesh.devices.size
    with _create(mesh) as a, _create(mesh) as b:
        xa = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(11))
        xb = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(12))
        ia, wa = routing_case("uniform", ep=ep, tokens=tokens, top_k=8, num_experts=EXPERTS, seed=seed(11))
        ib, wb = routing_case("zipf", ep=ep, tokens=tokens, top_k=4, num_experts=EXPERTS, seed=seed(12))

        def body(x1, i1, w1, x2, i2, w2):
            r1, l1 = ops.dispatch(a, x1, i1, w1)
            r2, l2 = ops.dispatch(b, x2, i2, w2, mode="push")
            y1, s1 = ops.combine(a, r1, l1)
            y2, s2 = ops.combine(b, r2, l2, mode="pull")
            return y1, y2, jnp.stack([l1.status, s1, l2.status, s2])[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 6, out_specs=SPEC, check_vma=False))
        y1, y2, st = f(*(jnp.asarray(_flat(v)) for v in (xa, ia, wa, xb, ib, wb)))
        assert np.all(np.asarray(st) == 0)
        for got, (x, i, w) in ((y1, (xa, ia, wa)), (y2, (xb, ib, wb))):
            want = dispatch_combine_identity_numpy(x, i, w, EXPERTS)
            assert np.array_equal(np.asarray(got).view(np.uint16), want.reshape(-1, HIDDEN).view(np.uint16))
        a.check()
        b.check()


def test_setup_teardown_setup_and_rank_order(mesh, seed):
    """Close frees everything and a new workspace works; EP rank follows the mesh, not the CUDA
    ordinal (the second mesh lists the GPUs in reverse order: GPU ep-1 is rank 0)."""
    tokens, ep = 50, mesh.devices.size
    idx, w = routing_case("zipf", ep=ep, tokens=tokens, top_k=8, num_experts=EXPERTS, seed=seed(5))
    x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(5))
    layout, y = expected(x, idx, w)
    first = _create(mesh)
    check(run(first, x, idx, w), layout, y, "first workspace")
    first.close()
    first.close()  # idempotent
    with pytest.raises(CommError, match="closed"):
        run(first, x, idx, w)
    reversed_mesh = Mesh(np.array(list(mesh.devices.flat)[::-1]), ("ep",))
    with _create(reversed_mesh) as second:
        check(run(second, x, idx, w), layout, y, "second workspace, reversed mesh")


def test_timeout_when_a_rank_skips_the_call(mesh, ws, seed):
    """Rank 0 skips dispatch: every other rank times out (no hang, no crash), its status names the op,
    the rank that detected it and the awaited peer, check() raises, and the next call fails in the
    handler with the reason.

    At EP 2 the detector is rank 1. With more ranks, each of ranks 1..ep-1 either times out itself or
    is poisoned first by one that did (the first error wins per rank's poison word), so the detector
    is some rank in [1, ep), the same in a rank's status and in check()'s message, and the awaited
    peer is always rank 0 (every rank waits for its peers in rank order and rank 0 never comes)."""
    tokens, ep = 32, mesh.devices.size
    idx, w = routing_case("uniform", ep=ep, tokens=tokens, top_k=4, num_experts=EXPERTS, seed=seed(9))
    x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(9))
    args = (jnp.asarray(_flat(x)), jnp.asarray(_flat(idx)), jnp.asarray(_flat(w)))
    short = _create(mesh, timeout_s=0.25)
    try:
        def body(x, i, w):
            def call():
                return ops.dispatch(short, x, i, w)[1].status

            def skip():
                return jnp.zeros(4, jnp.int32)

            return jax.lax.cond(jax.lax.axis_index("ep") == 0, skip, call)[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False))
        status = np.asarray(jax.block_until_ready(f(*args)))
        np.testing.assert_array_equal(status[0], 0)
        if ep == 2:
            # rank 1 waited for rank 0's routing: [timeout-routing, dispatch, rank 1, peer 0]
            np.testing.assert_array_equal(status[1], [1, 1, 1, 0])
        for r in range(1, ep):
            # [timeout-routing, dispatch, detecting rank in [1, ep), peer 0]
            assert status[r][0] == 1 and status[r][1] == 1 and status[r][3] == 0, f"rank {r}: status {status[r]}"
            assert 1 <= status[r][2] < ep, f"rank {r}: detecting rank {status[r][2]} not in [1, {ep})"
        with pytest.raises(CommTimeoutError, match=r"dispatch on EP rank 1.*EP rank 0" if ep == 2 else
                           r"dispatch on EP rank \d+: timed out waiting for the routing of EP rank 0\b") as info:
            short.check()
        # check() reports the first local rank with an error: rank 1, whose word is its status
        detector = int(re.search(r"dispatch on EP rank (\d+)", str(info.value)).group(1))
        assert detector == status[1][2], (str(info.value), status)
        with pytest.raises(Exception, match=r"mok_comm_dispatch.*EP rank 1" if ep == 2 else
                           r"mok_comm_dispatch.*on EP rank \d+: timed out waiting for the routing of EP rank 0\b") \
                as info:
            jax.block_until_ready(f(*args))
        assert not isinstance(info.value, AssertionError)
    finally:
        short.close()
    # the other workspace is untouched
    idx2, w2 = routing_case("uniform", ep=ep, tokens=40, top_k=8, num_experts=EXPERTS, seed=seed(10))
    x2 = self_identifying_tokens(ep, 40, HIDDEN, seed=seed(10))
    layout, y = expected(x2, idx2, w2)
    check(run(ws, x2, idx2, w2), layout, y, "after another workspace timed out")


def test_two_ep_groups_on_a_dp_axis(mesh, seed):
    """Mesh ("dp", "ep") = (2, ep/2): two EP groups (of one rank each at EP 2), each with its own
    peer table; the ops of one group never see the other's tokens (rows name their global rank)."""
    tokens, k, experts = 60, 4, 8
    n = mesh.devices.size
    group = n // 2
    if n % 2 or experts % group:
        pytest.skip(f"{n} GPUs do not split into 2 EP groups over {experts} experts (not a pass)")
    dp_mesh = Mesh(np.array(list(mesh.devices.flat)).reshape(2, group), ("dp", "ep"))
    spec = P(("dp", "ep"))
    idx, w = routing_case("zipf", ep=n, tokens=tokens, top_k=k, num_experts=experts, seed=seed(31))
    x = self_identifying_tokens(n, tokens, HIDDEN, seed=seed(31))
    with Workspace.create(dp_mesh, "ep", max_tokens=tokens, hidden_size=HIDDEN, top_k=k, num_experts=experts,
                          timeout_s=TIMEOUT_S) as one:
        assert one.config.ep == group

        def body(xs, i, ww):
            recv, lay = ops.dispatch(one, xs, i, ww)
            y, st = ops.combine(one, recv, lay, mode="pull")
            return recv[None], y, jnp.stack([lay.status, st])[None]

        f = jax.jit(jax.shard_map(body, mesh=dp_mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))
        recv, y, st = (np.asarray(o) for o in f(*(jnp.asarray(_flat(v)) for v in (x, idx, w))))
        assert np.all(st == 0)
        y = y.reshape(2, group, tokens, HIDDEN)
        for g in range(2):
            sl = slice(g * group, (g + 1) * group)
            lays = dispatch_layout_numpy(x[sl], idx[sl], w[sl], experts)
            want = dispatch_combine_identity_numpy(x[sl], idx[sl], w[sl], experts)
            for r in range(group):
                got = recv[g * group + r]
                assert np.array_equal(got.view(np.uint16), lays[r]["recv_x"].view(np.uint16)), \
                    f"group {g} rank {r} recv_x: " + _rows_report(got, lays[r]["recv_x"])
            assert np.array_equal(y[g].view(np.uint16), want.view(np.uint16)), f"group {g} combine"


@pytest.mark.parametrize("kind,tokens,k,dmode", [("uniform", 300, 8, "pull"), ("zipf", 257, 8, "push"),
                                                 ("with-invalid", 100, 6, "pull")])
def test_token_major_dispatch(ws, kind, tokens, k, dmode, seed):
    """token_major: one row per (source rank, token) at s*T + t (zeros where this rank holds none of
    its experts); gathering it by row_source gives the expert-major rows, and combine on those rows
    gives the same bits as the reference."""
    ep = ws.config.ep
    idx, w = routing_case(kind, ep=ep, tokens=tokens, top_k=k, num_experts=EXPERTS, seed=seed(tokens + 1))
    x = self_identifying_tokens(ep, tokens, HIDDEN, seed=seed(tokens + 1))
    layout, y_ref = expected(x, idx, w)

    def body(xs, i, ww):
        recv_tok, lay = ops.dispatch(ws, xs, i, ww, mode=dmode, token_major=True)
        rows = jnp.where((lay.row_source >= 0)[:, None], recv_tok[jnp.maximum(lay.row_source, 0)], 0)
        y, st = ops.combine(ws, rows.astype(jnp.bfloat16), lay)
        return recv_tok[None], lay.row_source[None], rows[None], y, jnp.stack([lay.status, st])[None]

    f = jax.jit(jax.shard_map(body, mesh=ws.mesh, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False))
    recv_tok, source, rows, y, st = (np.asarray(o) for o in f(*(jnp.asarray(_flat(v)) for v in (x, idx, w))))
    assert np.all(st == 0), st
    for r in range(ep):
        e = layout[r]
        np.testing.assert_array_equal(source[r], e["row_source"])
        assert np.array_equal(recv_tok[r].view(np.uint16), e["recv_tokens"].view(np.uint16)), \
            f"token-major rows, rank {r}: " + _rows_report(recv_tok[r], e["recv_tokens"])
        assert np.array_equal(rows[r].view(np.uint16), e["recv_x"].view(np.uint16))
    assert np.array_equal(y.view(np.uint16), y_ref.reshape(y.shape).view(np.uint16))
