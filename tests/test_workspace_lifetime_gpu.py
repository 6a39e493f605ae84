"""Workspace memory and teardown on the GPU (mok_jax/workspace/, ffi/src/workspace.cu), in subprocesses, each
with its own environment: the layer and a large workspace work under JAX's default preallocation; a workspace larger
than what XLA left raises WorkspaceMemoryError and the process goes on; a program compiled against a closed
workspace, against an id this process never created, or exported from another process is refused by its handler
with that message. The same file is the GPU worker: ``python tests/test_workspace_lifetime_gpu.py CASE SEED [ARGS]``
(SEED: of the layer's problem; each test passes its ``seed`` fixture's draw of 3).
The CPU side (ids, the native registry, create / close against a fake library): tests/test_workspace_lifetime.py.
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest
from test_workspace_lifetime import XLA_MEMORY_ENV, _run

REPO = pathlib.Path(__file__).resolve().parent.parent
# A smoke bound on the layer's output against the fp32 reference (bf16 inputs and outputs: ~1e-2 relative);
# a missing or misplaced row is O(1).
LAYER_REL_TOL = 5e-2


# --- GPU: run in subprocesses, each with JAX's default memory settings unless the case sets one ---------------


def _gpu_case(case: str, data_seed: int, *args: str, **env) -> str:
    from helpers import gpu_skip_reason

    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    r = _run([__file__, case, str(data_seed), *args], **env)
    assert r.returncode == 0 and f"CASE_OK {case}" in r.stdout, (r.returncode, r.stdout[-3000:], r.stderr[-5000:])
    return r.stdout


@pytest.mark.gpu
def test_gpu_default_preallocation_layer_and_workspace_memory(seed):
    _gpu_case("preallocated", seed(3))


@pytest.mark.gpu
def test_gpu_closed_and_unknown_ids_refused_by_the_handler(seed):
    _gpu_case("refused", seed(3))


@pytest.mark.gpu
def test_gpu_program_exported_from_another_process_is_refused(tmp_path, seed):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers (not a pass)")
    blob = tmp_path / "moe.jax_export"
    out = _gpu_case("export", seed(3), str(blob))
    exported_id = int(next(line for line in out.splitlines() if line.startswith("WS_ID")).split()[1])
    out = _gpu_case("replay", seed(3), str(blob), str(exported_id))
    assert "REFUSED" in out


def _layer_problem(data_seed: int):
    import jax.numpy as jnp

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import random_problem

    from mok_jax.config import ModelShape

    shape = ModelShape(name="t", num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                       num_shared_experts=0, shared_intermediate_size=0)
    return random_problem(shape, 64, dtype=jnp.bfloat16, seed=data_seed)


def _check_layer(y, problem):
    import jax.numpy as jnp

    from mok_jax import reference

    x, idx, w, W = problem
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    ref = reference.moe(x.astype(jnp.float32), idx, w, type(W)(*(f32(a) for a in W)))
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < LAYER_REL_TOL, err


def _layer_fn(**config):
    import jax

    import mok_jax as mj

    cfg = mj.MoEConfig(implementation="mok", **config)
    return jax.jit(lambda x, i, w, W: mj.moe(x, i, w, W, config=cfg))


def _worker(case: str, data_seed: int, args: list[str]) -> None:
    import jax

    import mok_jax as mj
    from mok_jax import workspace as w
    from mok_jax.workspace import core as wcore

    problem = _layer_problem(data_seed)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices("gpu")[:1]), ("ep",))
    if case == "preallocated":
        assert not any(os.environ.get(k) for k in XLA_MEMORY_ENV), "must run with JAX's default preallocation"
        layer = _layer_fn()
        _check_layer(layer(*problem), problem)
        big = w.Workspace.create(mesh, "ep", max_tokens=4096, hidden_size=7168, top_k=8, num_experts=256)
        print("big workspace", big.config.workspace_bytes(), "bytes", flush=True)
        big.close()
        # 2 * 2^21 tokens * 7168 * 2 bytes = 60 GB: more than the 25% of the GPU XLA leaves (35 GB on an H200).
        try:
            w.Workspace.create(mesh, "ep", max_tokens=2**21, hidden_size=7168, top_k=8, num_experts=256)
            raise AssertionError("a 60 GB workspace must not fit beside JAX's preallocation")
        except w.WorkspaceMemoryError as e:
            msg = str(e)
            print("refused:", msg, flush=True)
            assert "bytes" in msg and "MiB free" in msg and "XLA_CLIENT_MEM_FRACTION" in msg, msg
        _check_layer(layer(*problem), problem)  # the process goes on
        w.close_cached_workspaces()
    elif case == "refused":
        layer = _layer_fn()
        _check_layer(layer(*problem), problem)
        (ws,) = w.cached_workspaces()
        ordinal = ws._local[0].ordinal
        assert w.lookup_error(ws.id, ordinal) == ""
        assert w.close_cached_workspaces() == 1
        assert "was closed in this process" in w.lookup_error(ws.id, ordinal)
        try:
            jax.block_until_ready(layer(*problem))  # the jit cache still holds the program naming ws
            raise AssertionError("a program compiled against a closed workspace must fail")
        except Exception as e:  # noqa: BLE001 - XLA's runtime error type
            assert f"mok workspace {ws.id} was closed in this process" in str(e), e
        jax.clear_caches()
        _check_layer(layer(*problem), problem)  # retraced: a new workspace
        (ws2,) = w.cached_workspaces()
        assert ws2.id != ws.id
        stranger = w.Workspace(ws_id=wcore._new_id(), config=ws2.config, mesh=ws2.mesh, axis_name=ws2.axis_name,
                               local=ws2._local)  # never allocated: an id this process does not hold
        f = jax.jit(lambda x, i, wt, W: mj.moe(x, i, wt, W, config=mj.MoEConfig(implementation="mok"),
                                               workspace=stranger))
        try:
            jax.block_until_ready(f(*problem))
            raise AssertionError("an id this process never created must be refused")
        except Exception as e:  # noqa: BLE001
            assert "does not exist in this process" in str(e) and "compilation cache" in str(e), e
        w.close_cached_workspaces()
    elif case in ("export", "replay"):
        from jax import export

        if case == "export":
            layer = _layer_fn(checkify_ids=False)  # checkify's effect cannot be serialized
            flat = jax.jit(lambda x, i, wt, *W: layer(x, i, wt, type(problem[3])(*W)))  # arrays only: serializable
            exp = export.export(flat, disabled_checks=[export.DisabledSafetyCheck.custom_call("mok_moe_forward")])(
                *problem[:3], *problem[3])
            pathlib.Path(args[0]).write_bytes(exp.serialize())
            (ws,) = w.cached_workspaces()
            print("WS_ID", ws.id, flush=True)
            w.close_cached_workspaces()
        else:
            exported_id = int(args[1])
            _check_layer(_layer_fn()(*problem), problem)  # this process's own workspace, same shape
            (ws,) = w.cached_workspaces()
            assert ws.id != exported_id
            exp = export.deserialize(bytearray(pathlib.Path(args[0]).read_bytes()))
            try:
                jax.block_until_ready(exp.call(*problem[:3], *problem[3]))
                raise AssertionError("a program exported from another process must be refused")
            except Exception as e:  # noqa: BLE001
                assert f"mok workspace {exported_id} does not exist in this process" in str(e), e
                print("REFUSED", e, flush=True)
            w.close_cached_workspaces()
    else:
        raise SystemExit(f"unknown case {case!r}")
    print(f"CASE_OK {case}", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
