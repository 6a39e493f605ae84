"""CPU tests of the communication reference (mok_jax.reference.comm) and the comm ops' validation.

The pure-JAX reference runs under shard_map on host devices and must equal the numpy oracles
(explicit loops in the documented order) bitwise; the GPU tests then hold the kernels to both.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mok_jax.bench.comm import routing_case, self_identifying_tokens, unique_remote_rows
from mok_jax.reference.comm import (
    dispatch_combine_identity_numpy,
    dispatch_layout_numpy,
    ep_dispatch_combine_identity,
    ep_dispatch_layout,
)
from mok_jax.config import KernelConfig
from mok_jax.workspace import CommConfig

CASES = [  # (routing kind, ep, tokens, top_k, num_experts)
    ("uniform", 2, 37, 8, 16),
    ("zipf", 2, 50, 8, 16),
    ("one-expert", 2, 33, 1, 16),
    ("sparse-experts", 2, 29, 4, 16),
    ("with-invalid", 2, 31, 6, 16),
    ("uniform", 2, 1, 8, 16),
    ("uniform", 2, 24, 10, 16),
    ("uniform", 4, 19, 3, 12),
    ("zipf", 4, 23, 8, 16),
    # EP 4 and EP 8, the sizes of the 4- and 8-GPU machines: every routing kind of the GPU tests,
    # T = 1, k = 10, and the ep64-slice shape (6 experts per GPU, k 8)
    ("one-expert", 4, 21, 1, 16),         # every token to expert 1: only rank 0 receives
    ("sparse-experts", 4, 17, 4, 16),
    ("with-invalid", 4, 26, 6, 16),
    ("uniform", 4, 1, 8, 16),
    ("uniform", 4, 15, 10, 16),
    ("uniform", 4, 22, 8, 24),            # 6 experts per GPU
    ("uniform", 8, 13, 8, 16),            # 2 experts per GPU
    ("zipf", 8, 18, 8, 16),
    ("one-expert", 8, 9, 1, 16),
    ("one-expert", 8, 7, 3, 16),          # experts 1, 2, 3: ranks 0 and 1 receive, ranks 2..7 nothing
    ("sparse-experts", 8, 11, 4, 16),     # experts 0, 3, 6, ...: some ranks own no picked expert
    ("with-invalid", 8, 12, 6, 16),
    ("uniform", 8, 1, 8, 16),
    ("uniform", 8, 10, 10, 16),
    ("uniform", 8, 16, 8, 48),            # kimi-k2 in ep64-slice on 8 GPUs: 384/64 = 6 per GPU
    ("zipf", 8, 20, 8, 8),                # 1 expert per GPU: every slot is a different rank
]


def _mesh(ep: int, cpu_devices) -> Mesh:
    return Mesh(np.array(cpu_devices[:ep]), ("ep",))


def _case(kind, ep, tokens, k, experts, hidden=24):
    idx, w = routing_case(kind, ep=ep, tokens=tokens, top_k=k, num_experts=experts, seed=tokens)
    x = self_identifying_tokens(ep, tokens, hidden, seed=tokens)
    return x, idx, w


def _run_layout(mesh, x, idx, w, experts):
    ep, tokens, k = idx.shape
    f = jax.jit(jax.shard_map(
        lambda a, b, c: tuple(o[None] for o in ep_dispatch_layout(a, b, c, axis_name="ep", num_experts=experts)),
        mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"), check_vma=False))
    outs = f(jnp.asarray(x.reshape(ep * tokens, -1)), jnp.asarray(idx.reshape(ep * tokens, k)),
             jnp.asarray(w.reshape(ep * tokens, k)))
    return [np.asarray(o) for o in outs]


@pytest.mark.parametrize("kind,ep,tokens,k,experts", CASES)
def test_dispatch_layout_reference_matches_loops(kind, ep, tokens, k, experts, cpu_devices):
    x, idx, w = _case(kind, ep, tokens, k, experts)
    recv, sizes, table, weight, source = _run_layout(_mesh(ep, cpu_devices), x, idx, w, experts)
    expect = dispatch_layout_numpy(x, idx, w, experts)
    for r in range(ep):
        e = expect[r]
        np.testing.assert_array_equal(sizes[r], e["group_sizes"], err_msg=f"group sizes, rank {r}")
        np.testing.assert_array_equal(table[r], e["row_table"], err_msg=f"row table, rank {r}")
        np.testing.assert_array_equal(weight[r], e["row_weight"], err_msg=f"row weight, rank {r}")
        np.testing.assert_array_equal(source[r], e["row_source"], err_msg=f"row source, rank {r}")
        # the token-major layout gathers back to the expert-major one
        total = int(e["group_sizes"].sum())
        gathered = e["recv_tokens"][e["row_source"][:total]]
        np.testing.assert_array_equal(gathered.view(np.uint16), e["recv_x"][:total].view(np.uint16))
        np.testing.assert_array_equal(recv[r].view(np.uint16), e["recv_x"].view(np.uint16),
                                      err_msg=f"recv_x, rank {r}")
        assert sizes[r].sum() <= recv[r].shape[0]


@pytest.mark.parametrize("kind,ep,tokens,k,experts", CASES)
def test_identity_combine_reference_matches_loops_bitwise(kind, ep, tokens, k, experts, cpu_devices):
    x, idx, w = _case(kind, ep, tokens, k, experts, hidden=40)
    mesh = _mesh(ep, cpu_devices)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: ep_dispatch_combine_identity(a, b, c, axis_name="ep", num_experts=experts),
        mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"), check_vma=False))
    y = np.asarray(f(jnp.asarray(x.reshape(ep * tokens, -1)), jnp.asarray(idx.reshape(ep * tokens, k)),
                     jnp.asarray(w.reshape(ep * tokens, k)))).reshape(x.shape)
    expect = dispatch_combine_identity_numpy(x, idx, w, experts)
    np.testing.assert_array_equal(y.view(np.uint16), expect.view(np.uint16))


@pytest.mark.parametrize("ep,tokens,k,experts,capacity", [(4, 20, 8, 16, 37), (8, 12, 8, 16, 5), (8, 9, 4, 48, 1)])
def test_dispatch_layout_reference_with_capacity_drops(ep, tokens, k, experts, capacity, cpu_devices):
    """A capacity below the rows received: rows past it are dropped (row_table -1, no row_source), the
    kept ones keep their expert-major positions, and group_sizes still count every slot."""
    x, idx, w = _case("uniform", ep, tokens, k, experts)
    mesh = _mesh(ep, cpu_devices)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: tuple(o[None] for o in ep_dispatch_layout(a, b, c, axis_name="ep", num_experts=experts,
                                                                  capacity=capacity)),
        mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"), check_vma=False))
    recv, sizes, table, weight, source = (np.asarray(o) for o in f(
        jnp.asarray(x.reshape(ep * tokens, -1)), jnp.asarray(idx.reshape(ep * tokens, k)),
        jnp.asarray(w.reshape(ep * tokens, k))))
    expect = dispatch_layout_numpy(x, idx, w, experts, capacity=capacity)
    assert recv.shape[1] == capacity
    dropped = 0
    for r in range(ep):
        e = expect[r]
        np.testing.assert_array_equal(sizes[r], e["group_sizes"], err_msg=f"group sizes, rank {r}")
        np.testing.assert_array_equal(table[r], e["row_table"], err_msg=f"row table, rank {r}")
        np.testing.assert_array_equal(source[r], e["row_source"], err_msg=f"row source, rank {r}")
        np.testing.assert_array_equal(recv[r].view(np.uint16), e["recv_x"].view(np.uint16), err_msg=f"recv_x, rank {r}")
        kept = int((table[r] >= 0).sum())
        assert kept == min(int(sizes[r].sum()), capacity)
        dropped += int(sizes[r].sum()) - kept
    assert dropped > 0, "the case should overflow the capacity on some rank"


@pytest.mark.parametrize("ep,experts", [(2, 12), (4, 24), (8, 48), (8, 16)])
def test_unique_remote_rows_matches_loops(ep, experts):
    """Per receiving rank r: the (source rank != r, token) pairs with at least one expert on r, counted
    by explicit loops (the bytes the comm benchmark reports at every EP size)."""
    for kind in ("uniform", "zipf", "with-invalid", "one-expert"):
        idx, _ = routing_case(kind, ep=ep, tokens=40, top_k=8 if kind != "one-expert" else 2,
                              num_experts=experts, seed=ep)
        local = experts // ep
        want = [0] * ep
        for r in range(ep):
            for s in range(ep):
                if s == r:
                    continue
                for t in range(idx.shape[1]):
                    if any(0 <= g < experts and g // local == r for g in idx[s, t]):
                        want[r] += 1
        assert list(unique_remote_rows(idx, experts)) == want, kind


def test_unique_remote_rows_ep64_slice_shapes():
    """The comm benchmark's ep64-slice setting (kimi-k2: 6 experts per GPU, k 8, 2048 tokens/GPU):
    with 2 GPUs every token needs the other GPU; with more, a token's 8 experts land on fewer than all
    ranks, so each GPU receives fewer than (ep - 1) * T rows but more than T."""
    for ep in (2, 4, 8):
        idx, _ = routing_case("uniform", ep=ep, tokens=2048, top_k=8, num_experts=6 * ep, seed=2048)
        rows = unique_remote_rows(idx, 6 * ep)
        if ep == 2:
            assert list(rows) == [2048, 2048]
        else:
            assert np.all(rows > 2048) and np.all(rows < (ep - 1) * 2048), (ep, rows)


def test_comm_bench_ranks_and_experts():
    from mok_jax.bench.comm import experts_for, parse_ranks

    assert parse_ranks("", 8) == [8] and parse_ranks(None, 2) == [2] and parse_ranks(0, 4) == [4]
    assert parse_ranks("8,4,2", 8) == [8, 4, 2] and parse_ranks("all,2,all", 4) == [4, 2]
    with pytest.raises(ValueError):
        parse_ranks("-1", 8)
    assert experts_for(8, 12, 6) == 48 and experts_for(2, 12) == 12
    with pytest.raises(ValueError, match="experts-per-gpu"):
        experts_for(8, 12)


def test_gpu_test_ep_sizes_and_process_counts():
    """The EP sizes that tests/test_comm_multigpu.py and the process counts that
    tests/test_comm_multiprocess_multigpu.py parametrize over (largest first)."""
    from test_comm_multigpu import ep_sizes
    from test_comm_multiprocess_multigpu import proc_counts

    assert ep_sizes("", 0) == [8, 4, 2]  # sizes above the GPU count are collected, then skipped
    assert ep_sizes("", 2) == [8, 4, 2] and ep_sizes("", 8) == [8, 4, 2] and ep_sizes("", 16) == [16, 8, 4, 2]
    assert ep_sizes("", 6) == [8, 6, 4, 2]
    assert ep_sizes("all", 4) == [4] and ep_sizes("2, all", 8) == [8, 2] and ep_sizes("4,2", 8) == [4, 2]
    assert proc_counts("", 8) == [2] and proc_counts("all,4,2", 8) == [8, 4, 2] and proc_counts("8", 0) == [8]


def test_identity_combine_is_weighted_sum():
    """Sanity of the oracle itself: with one owner, y = bf16(sum_j w_j x) up to one bf16 rounding."""
    x, idx, w = _case("uniform", 2, 16, 4, 4, hidden=16)
    idx[:] = np.array([0, 1, 0, 1], np.int32)  # every slot on rank 0
    y = dispatch_combine_identity_numpy(x, idx, w, 4).astype(np.float32)
    ref = (w[..., None] * x[:, :, None, :].astype(np.float32)).sum(axis=2)
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=1e-6)


def test_routing_cases_are_what_they_say():
    idx, _ = routing_case("one-expert", ep=2, tokens=10, top_k=1, num_experts=8)
    assert np.all(idx == 1)
    idx, _ = routing_case("sparse-experts", ep=2, tokens=50, top_k=2, num_experts=12)
    assert set(np.unique(idx)) <= {0, 3, 6, 9}
    idx, w = routing_case("uniform", ep=2, tokens=50, top_k=8, num_experts=12)
    assert all(len(set(row)) == 8 for row in idx.reshape(-1, 8))
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    idx, _ = routing_case("with-invalid", ep=2, tokens=200, top_k=6, num_experts=12)
    assert np.any(idx == -1)
    x = self_identifying_tokens(2, 300, 8)
    assert float(x[1, 299, 0]) == 2 and float(x[1, 299, 1]) == 299 % 256 and float(x[1, 299, 2]) == 1


def test_unique_remote_rows_uniform_goal_shape():
    """The issue's goal workload: 4096 tokens/GPU, k 8 of 12 experts: every token needs both GPUs,
    so 4096 rows x 7168 x 2 bytes = 58.7 MB cross NVLink per GPU."""
    idx, _ = routing_case("uniform", ep=2, tokens=4096, top_k=8, num_experts=12)
    rows = unique_remote_rows(idx, 12)
    assert list(rows) == [4096, 4096]
    assert abs(rows[0] * 7168 * 2 / 1e6 - 58.7) < 0.1


@pytest.mark.parametrize("bad,msg", [
    (dict(num_experts=13), "multiple of ep"),
    (dict(hidden_size=12), "multiple of 8"),
    (dict(top_k=33), "top_k"),
    (dict(timeout_s=0.0), "timeout_s"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_comm_config_validation(bad, msg):
    kw = dict(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12)
    kw.update(bad)
    with pytest.raises(ValueError, match=msg):
        CommConfig(**kw)


def test_comm_config_knobs_follow_its_kernel_config():
    """The comm ops' defaults are read from CommConfig.kernel: num_sms = comm_items_fwd, dispatch_mode =
    dispatch, combine_mode = combine; the properties are read-only."""
    shape = dict(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12)
    plain = CommConfig(**shape)
    assert plain.kernel == KernelConfig()
    assert (plain.num_sms, plain.dispatch_mode, plain.combine_mode) == (24, "pull", "push")
    k = KernelConfig(comm_items_fwd=5, comm_items_bwd=7, dispatch="push", combine="pull")
    cfg = CommConfig(**shape, kernel=k)
    assert (cfg.num_sms, cfg.dispatch_mode, cfg.combine_mode) == (5, "push", "pull")
    for name in ("num_sms", "dispatch_mode", "combine_mode"):
        with pytest.raises(AttributeError):
            setattr(cfg, name, getattr(plain, name))
    assert cfg != plain and cfg.workspace_bytes() == plain.workspace_bytes()  # tuning, not layout


@pytest.mark.parametrize("bad", ["push", None, {"dispatch": "push"}, 24])
def test_comm_config_kernel_must_be_a_kernel_config(bad):
    with pytest.raises(TypeError, match=r"CommConfig\.kernel must be a mok_jax\.KernelConfig"):
        CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12, kernel=bad)


@pytest.mark.parametrize("name,value", [("num_sms", 16), ("dispatch_mode", "push"), ("combine_mode", "pull")])
def test_comm_config_has_no_knob_fields(name, value):
    with pytest.raises(TypeError, match=name):
        CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12, **{name: value})


def _workspace_makers(cpu_devices):
    """Each entry point that takes a workspace's kernel config, called with a CPU mesh or device."""
    from mok_jax.workspace import Workspace, emulated_workspace, local_workspace, moe_workspace

    mesh = _mesh(2, cpu_devices)
    shape = dict(max_tokens=8, hidden_size=8, top_k=2, num_experts=4)
    return {
        "Workspace.create": lambda **kw: Workspace.create(mesh, "ep", **shape, **kw),
        "Workspace.create_emulated": lambda **kw: Workspace.create_emulated(cpu_devices[0], 2, **shape, **kw),
        "moe_workspace": lambda **kw: moe_workspace(mesh, "ep", **shape, **kw),
        "local_workspace": lambda **kw: local_workspace(**shape, **kw),
        "emulated_workspace": lambda **kw: emulated_workspace(cpu_devices[0], 2, **shape, **kw),
    }


@pytest.mark.parametrize("name,value", [("num_sms", 16), ("dispatch_mode", "push"), ("combine_mode", "pull")])
def test_workspace_old_knob_keywords_say_what_replaces_them(cpu_devices, name, value):
    for what, make in _workspace_makers(cpu_devices).items():
        with pytest.raises(TypeError, match=rf"{what}: the keyword {name}= is gone; pass kernel=KernelConfig\("):
            make(**{name: value})


def test_workspace_unknown_keyword_and_bad_kernel_are_named(cpu_devices):
    for what, make in _workspace_makers(cpu_devices).items():
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_blocks'"):
            make(num_blocks=4)
        with pytest.raises(TypeError, match=rf"{what}: kernel must be a mok_jax\.KernelConfig or None, got dict"):
            make(kernel={"dispatch": "push"})


def test_comm_config_capacity():
    cfg = CommConfig(ep=2, max_tokens=4096, hidden_size=7168, top_k=8, num_experts=12)
    assert cfg.num_local_experts == 6
    assert cfg.capacity(4096) == 2 * 4096 * 6
    assert cfg.capacity(100, 1) == 200


def test_op_argument_validation_names_the_argument():
    from mok_jax.ops.comm import check_dispatch_args
    from mok_jax.workspace import Workspace

    ws = Workspace(ws_id=-1, config=CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12),
                   mesh=None, axis_name="ep", local=[])
    x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16)
    i = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    assert check_dispatch_args(ws, x, i, w, None) == 2 * 16 * 6
    with pytest.raises(ValueError, match="hidden_size"):
        check_dispatch_args(ws, jax.ShapeDtypeStruct((16, 32), jnp.bfloat16), i, w, None)
    with pytest.raises(TypeError, match="bfloat16"):
        check_dispatch_args(ws, jax.ShapeDtypeStruct((16, 64), jnp.float32), i, w, None)
    with pytest.raises(ValueError, match="max_tokens"):
        check_dispatch_args(ws, jax.ShapeDtypeStruct((65, 64), jnp.bfloat16),
                            jax.ShapeDtypeStruct((65, 8), jnp.int32), jax.ShapeDtypeStruct((65, 8), jnp.float32), None)
    with pytest.raises(TypeError, match="int32"):
        check_dispatch_args(ws, x, jax.ShapeDtypeStruct((16, 8), jnp.int64), w, None)
    with pytest.raises(ValueError, match="topk_weight"):
        check_dispatch_args(ws, x, i, jax.ShapeDtypeStruct((16, 7), jnp.float32), None)


def test_workspace_on_cpu_says_why(cpu_devices):
    from mok_jax._native import NativeLibraryUnavailable
    from mok_jax.workspace import Workspace

    mesh = _mesh(2, cpu_devices)
    with pytest.raises((NativeLibraryUnavailable, ValueError), match="GPU|gpu|CUDA"):
        Workspace.create(mesh, "ep", max_tokens=8, hidden_size=8, top_k=2, num_experts=4)


def _lowered_comm_calls(cpu_devices, monkeypatch, kernel=None, dispatch_kw=None, combine_kw=None):
    """The custom calls (dispatch's, combine's) of dispatch + combine on a fake workspace (id 7) whose
    config holds ``kernel``, lowered inside lax.cond under shard_map on host devices."""
    import mok_jax.ops.comm as comm_ops
    from mok_jax.workspace import Workspace

    monkeypatch.setattr(comm_ops, "require_native", lambda what: None)
    mesh = _mesh(2, cpu_devices)
    config = CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=8, num_experts=12,
                        **({} if kernel is None else dict(kernel=kernel)))
    ws = Workspace(ws_id=7, config=config, mesh=mesh, axis_name="ep", local=[])

    def body(x, i, w):
        def call():
            recv, lay = comm_ops.dispatch(ws, x, i, w, **(dispatch_kw or {}))
            return comm_ops.combine(ws, recv, lay, **(combine_kw or {}))

        return jax.lax.cond(jax.lax.axis_index("ep") == 0, lambda: (jnp.zeros_like(x), jnp.zeros(4, jnp.int32)), call)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=(P("ep"), P("ep")),
                              check_vma=False))
    text = f.lower(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8), jnp.int32),
                   jax.ShapeDtypeStruct((64, 8), jnp.float32)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line]
    dispatch = [c for c in calls if "@mok_comm_dispatch" in c]
    combine = [c for c in calls if "@mok_comm_combine" in c]
    assert len(dispatch) == 1 and len(combine) == 1, calls
    return dispatch[0], combine[0]


def test_ops_lower_to_side_effecting_custom_calls(cpu_devices, monkeypatch):
    """The thin wrappers emit one side-effecting custom call each, with the workspace id, mode, SM
    count and padding flag as typed attributes, also inside lax.cond under shard_map."""
    dispatch, combine = _lowered_comm_calls(cpu_devices, monkeypatch, dispatch_kw=dict(mode="push", num_sms=5),
                                            combine_kw=dict(mode="pull"))
    assert "has_side_effect = true" in dispatch and "has_side_effect = true" in combine
    assert "mode = 1 : i32" in dispatch and "num_sms = 5 : i32" in dispatch and "ws_id = 7 : i64" in dispatch
    assert "mode = 0 : i32" in combine and "zero_padding = 0 : i32" in combine
    assert "num_sms = 24 : i32" in combine  # KernelConfig().comm_items_fwd


def test_comm_ops_defaults_come_from_the_workspace_kernel_config(cpu_devices, monkeypatch):
    """Without mode= / num_sms= a call runs the workspace's KernelConfig; a call's own arguments win."""
    k = KernelConfig(comm_items_fwd=5, comm_items_bwd=9, dispatch="push", combine="pull")
    dispatch, combine = _lowered_comm_calls(cpu_devices, monkeypatch, kernel=k)
    assert "mode = 1 : i32" in dispatch and "num_sms = 5 : i32" in dispatch  # push, comm_items_fwd
    assert "mode = 0 : i32" in combine and "num_sms = 5 : i32" in combine    # pull, comm_items_fwd
    dispatch, combine = _lowered_comm_calls(cpu_devices, monkeypatch, kernel=k,
                                            dispatch_kw=dict(mode="pull", num_sms=3),
                                            combine_kw=dict(mode="push", num_sms=40))
    assert "mode = 0 : i32" in dispatch and "num_sms = 3 : i32" in dispatch
    assert "mode = 1 : i32" in combine and "num_sms = 40 : i32" in combine
