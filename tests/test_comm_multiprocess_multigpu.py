"""Multi-process backend of the comm workspace: N processes with 1 GPU each under jax.distributed
(local coordinator), the workspace regions shared through CUDA IPC handles that Workspace.create
exchanges with process_allgather. Each process checks its own rank's outputs bitwise against the
numpy oracles. The same file is the worker: ``python tests/test_comm_multiprocess_multigpu.py PID PORT [N [SEED]]``
(SEED: of the routing and rows, default 21; the test passes its ``seed`` fixture's draw of 21).

N (the EP size): ``MOK_COMM_PROCS`` (comma-separated, largest run first; ``all`` = the GPU count),
default 2; a count above the GPU count is skipped with the reason. scripts/gpu_ep_scaling.sh sets it
to every EP size of the machine (e.g. ``8,4,2``).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_PROCS = "2"
WORKER_TIMEOUT_S = float(os.environ.get("MOK_COMM_MP_TIMEOUT_S", "180"))
EXPERTS = 16  # 8 per GPU at 2 processes, 2 at 8


def _gpu_count() -> int:
    import jax

    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def proc_counts(env: str | None = None, num_gpus: int | None = None) -> list[int]:
    """Process counts to test, largest first: ``MOK_COMM_PROCS`` (``all`` = the GPU count), else 2.
    Counting the GPUs (which starts JAX) happens only when ``all`` asks for it."""
    env = os.environ.get("MOK_COMM_PROCS", "") if env is None else env
    toks = [t.strip() for t in (env.strip() or DEFAULT_PROCS).split(",") if t.strip()]
    n = (_gpu_count() if num_gpus is None else num_gpus) if "all" in toks else 0
    return sorted({n if t == "all" else int(t) for t in toks} - {0}, reverse=True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("num_procs", proc_counts(), ids=lambda n: f"{n}procs")
def test_processes_one_gpu_each(num_procs, seed):
    from mok_jax._native import library, native_status

    if num_procs < 2:
        pytest.skip(f"{num_procs} process(es): the multi-process backend needs at least 2 (not a pass)")
    if _gpu_count() < num_procs:
        pytest.skip(f"{num_procs} processes need {num_procs} GPUs, this machine has {_gpu_count()} (not a pass)")
    if EXPERTS % num_procs:
        pytest.skip(f"{num_procs} ranks do not divide the test's {EXPERTS} experts (not a pass)")
    if library() is None:
        pytest.skip(f"native library unavailable: {native_status()} (not a pass)")
    from helpers import free_port, run_processes  # not at the top: the workers import this file before JAX starts

    port = free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [str(port), str(num_procs), str(seed(21))]
    runs = run_processes([[sys.executable, __file__, str(i), *argv] for i in range(num_procs)], env=env, cwd=REPO,
                         timeout=WORKER_TIMEOUT_S)
    for i, (rc, out) in enumerate(runs):
        assert rc == 0, f"process {i} failed (rc {rc}):\n{out[-4000:]}"
        assert f"MP_OK process {i}" in out, out[-4000:]


def _worker(pid: int, port: int, num_procs: int, data_seed: int) -> None:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_procs, process_id=pid,
                               local_device_ids=[pid], initialization_timeout=120)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mok_jax import ops
    from mok_jax.bench.comm import routing_case, self_identifying_tokens
    from mok_jax.reference.comm import dispatch_combine_identity_numpy, dispatch_layout_numpy
    from mok_jax.workspace import Workspace

    devices = jax.devices()
    assert len(devices) == num_procs and len(jax.local_devices()) == 1, (devices, jax.local_devices())
    mesh = Mesh(np.array(devices), ("ep",))
    rank = list(mesh.devices.flat).index(jax.local_devices()[0])
    ep, tokens, k, experts, hidden = num_procs, 200, 8, EXPERTS, 264
    idx, w = routing_case("zipf", ep=ep, tokens=tokens, top_k=k, num_experts=experts, seed=data_seed)
    x = self_identifying_tokens(ep, tokens, hidden, seed=data_seed)
    layout = dispatch_layout_numpy(x, idx, w, experts)[rank]
    y_ref = dispatch_combine_identity_numpy(x, idx, w, experts)[rank]
    sharding = NamedSharding(mesh, P("ep"))

    def global_array(a):
        flat = a.reshape(ep * tokens, *a.shape[2:])
        return jax.make_array_from_callback(flat.shape, sharding, lambda index: flat[index])

    args = [global_array(a) for a in (x, idx, w)]
    with Workspace.create(mesh, "ep", max_tokens=256, hidden_size=hidden, top_k=k, num_experts=experts,
                          timeout_s=10.0) as ws:
        def body(xs, i, ww):
            outs = []
            for dmode, cmode in (("pull", "push"), ("push", "pull")):
                recv, lay = ops.dispatch(ws, xs, i, ww, mode=dmode)
                y, st = ops.combine(ws, recv, lay, mode=cmode)
                outs += [recv[None], lay.group_sizes[None], y, jnp.stack([lay.status, st])[None]]
            return tuple(outs)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"), check_vma=False))
        for _ in range(3):  # a few calls: epochs advance on both processes
            outs = jax.block_until_ready(f(*args))
        ws.check()
        local = [np.asarray(o.addressable_shards[0].data) for o in outs]
        for m in range(2):
            recv, sizes, y, status = local[4 * m: 4 * m + 4]
            assert np.all(status == 0), f"mode pair {m}: status {status}"
            np.testing.assert_array_equal(sizes[0], layout["group_sizes"])
            assert np.array_equal(recv[0].view(np.uint16), layout["recv_x"].view(np.uint16)), f"recv_x, pair {m}"
            assert np.array_equal(y.view(np.uint16), y_ref.view(np.uint16)), f"combine output, pair {m}"
        state = ws.device_state()
        assert all(s["dispatch_epoch"] == 6 and s["combine_epoch"] == 6 for s in state.values()), state
    jax.distributed.shutdown()
    print(f"MP_OK process {pid} (EP rank {rank})", flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2,
            int(sys.argv[4]) if len(sys.argv) > 4 else 21)
