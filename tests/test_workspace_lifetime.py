"""Workspace ids, memory and teardown (mok_jax/workspace/, ffi/src/workspace.cu).

CPU: ids are positive int64, unique in a process and across processes (fresh interpreters, and two
jax.distributed processes that agree on process 0's id for a workspace spanning them); the native registry
refuses an unknown or closed id with a message naming the cause, and never re-allocates a closed id; the
create / close bookkeeping (allocation failures, out of memory, the exchange between processes, close
idempotence, the layer's cache) runs against a fake native library and fake devices.
The GPU cases (the layer under JAX's default preallocation, refused ids): tests/test_workspace_lifetime_gpu.py.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from helpers import free_port, run_processes

from mok_jax import workspace as w
from mok_jax.workspace import cache as wcache, core as wcore, native as wnative

REPO = pathlib.Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT_S = 240
INT64_MAX = 2**63 - 1
# Memory settings a user does not make: the GPU workers run with JAX's defaults unless a case sets one.
XLA_MEMORY_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                  "XLA_PYTHON_CLIENT_ALLOCATOR")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in XLA_MEMORY_ENV and k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(**env), cwd=REPO, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)


def _tag(ws_id: int) -> int:

    return ws_id >> wcore._ID_COUNTER_BITS


# --- ids ---------------------------------------------------------------------------------------------------


def test_ids_are_positive_int64_increasing_with_one_tag():

    ids = [wcore._new_id() for _ in range(1000)]
    assert all(0 < i <= INT64_MAX for i in ids)
    assert ids == sorted(set(ids)), "ids must be strictly increasing: never reused"
    assert {_tag(i) for i in ids} == {wcore._id_tag} and wcore._id_tag > 0
    assert np.asarray(ids, np.int64).tolist() == ids  # what the custom call attribute carries


def test_id_range_bounds():

    assert wcore._ID_TAG_BITS + wcore._ID_COUNTER_BITS == 63
    largest = (((1 << wcore._ID_TAG_BITS) - 1) << wcore._ID_COUNTER_BITS) | ((1 << wcore._ID_COUNTER_BITS) - 1)
    assert largest == INT64_MAX
    assert all(1 <= wcore._draw_tag() < 1 << wcore._ID_TAG_BITS for _ in range(1000))


def test_id_counter_exhaustion_raises(monkeypatch):

    monkeypatch.setattr(wcore, "_id_counter", itertools.count((1 << wcore._ID_COUNTER_BITS) - 1))
    assert wcore._new_id() & ((1 << wcore._ID_COUNTER_BITS) - 1) == (1 << wcore._ID_COUNTER_BITS) - 1
    with pytest.raises(w.CommError, match="workspaces, the most its ids can tell apart"):
        wcore._new_id()


def test_forked_child_draws_a_new_tag(monkeypatch):

    before = wcore._new_id()
    for name in ("_id_tag", "_id_counter", "_id_lock"):  # restored after the test
        monkeypatch.setattr(wcore, name, getattr(wcore, name))
    wcore._reseed_ids_after_fork()  # what os.register_at_fork runs in a child
    after = wcore._new_id()
    assert _tag(after) != _tag(before) and after != before


def test_ids_differ_across_fresh_processes():

    code = "from mok_jax.workspace.core import _new_id; print(_new_id(), _new_id(), _new_id())"
    runs = [_run(["-c", code]) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = ([int(t) for t in r.stdout.split()] for r in runs)
    mine = [wcore._new_id() for _ in range(3)]
    for ids in (a, b):
        assert all(0 < i <= INT64_MAX for i in ids) and len({_tag(i) for i in ids}) == 1
    assert len({_tag(a[0]), _tag(b[0]), _tag(mine[0])}) == 3
    assert not set(a) & set(b) and not set(a) & set(mine) and not set(b) & set(mine)
    # The counters restart in every process: with a plain counter these ids would have been equal.
    assert [i & ((1 << wcore._ID_COUNTER_BITS) - 1) for i in a] == [1, 2, 3]


_AGREE_WORKER = """
import sys, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
from mok_jax.workspace import core as wcore
mine = wcore._new_id()
print("IDS", mine, wcore._agreed_id(mine), flush=True)
jax.distributed.shutdown()
"""


def test_processes_agree_on_process0_id():
    """A workspace spanning processes takes process 0's id on every process (its barriers are named by it)."""
    port = free_port()
    # CPU processes: on a one-GPU machine two GPU processes would share the device (NCCL refuses that)
    runs = run_processes([[sys.executable, "-c", _AGREE_WORKER, str(i), str(port)] for i in range(2)],
                         env=_env(JAX_PLATFORMS="cpu"), cwd=REPO, timeout=SUBPROCESS_TIMEOUT_S)
    if any("gloo" in out.lower() and rc != 0 for rc, out in runs):
        pytest.skip(f"CPU collectives (gloo) unavailable here (not a pass): {runs[0][1][-1000:]}")
    ids = []
    for rc, out in runs:
        assert rc == 0, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("IDS"))
        ids.append([int(t) for t in line.split()[1:]])
    (own0, agreed0), (own1, agreed1) = ids
    assert own0 != own1 and agreed0 == agreed1 == own0


# --- the native registry: unknown and closed ids (no CUDA call, runs without a GPU) -----------------------


def _native_or_skip():
    from mok_jax import _native

    if _native.library() is None:
        pytest.skip(f"native library unavailable (not a pass): {_native.native_status()}")
    return wnative._host_lib()


def test_registry_refuses_an_unknown_id_naming_the_cache_and_the_remedy():

    _native_or_skip()
    ws_id = wcore._new_id()
    why = w.lookup_error(ws_id, 0)
    assert f"mok workspace {ws_id} does not exist in this process" in why
    for phrase in ("persistent compilation cache", "another process", "Create the workspace in this process first"):
        assert phrase in why, why


def test_registry_refuses_a_closed_id_and_never_reallocates_it():

    lib = _native_or_skip()
    ws_id = wcore._new_id()
    lib.mok_comm_free(ws_id)
    why = w.lookup_error(ws_id, 3)
    assert f"mok workspace {ws_id} was closed in this process" in why and "jax.clear_caches()" in why, why
    err = ctypes.create_string_buffer(1024)
    handle = np.zeros(int(lib.mok_comm_handle_bytes()), np.uint8)
    for memory in (0, 1):  # ipc, vmm: the closed id is refused before any allocation
        rc = lib.mok_comm_alloc(ws_id, 0, 0, 0, 1, 16, 64, 2, 4, 1.0, memory, 0, handle.ctypes.data, err, len(err))
        assert rc == 1 and "was closed in this process; ids are never reused" in err.value.decode()
        rc = lib.mok_comm_alloc_emulated(ws_id, 0, 2, 16, 64, 2, 4, 1.0, memory, err, len(err))
        assert rc == 1 and "ids are never reused" in err.value.decode()


_EXIT_WORKER = """
from mok_jax import workspace as w
from mok_jax.workspace import CommConfig, Workspace, cache as wcache, core as wcore, native as wnative
lib = wnative._host_lib()
cfg = CommConfig(ep=1, max_tokens=8, hidden_size=8, top_k=1, num_experts=1)
for n in range(3):  # open (never closed) workspaces in the layer's cache at exit
    wcache._cached(("exit", n), 8, lambda: Workspace(ws_id=wcore._new_id(), config=cfg, mesh=None, axis_name=None, local=[]))
gone = wcore._new_id()
lib.mok_comm_free(gone)
assert "closed" in w.lookup_error(gone, 0)
print("EXIT_OK", len(w.cached_workspaces()), flush=True)
"""


def test_process_exits_cleanly_with_workspaces_open():
    _native_or_skip()
    r = _run(["-c", _EXIT_WORKER])
    assert r.returncode == 0 and "EXIT_OK 3" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])


# --- create / close bookkeeping against a fake native library ------------------------------------------------


class FakeDevice:
    platform = "gpu"
    device_kind = "fake GPU"

    def __init__(self, ordinal: int, process_index: int = 0):
        self.id = ordinal + 100 * process_index
        self.local_hardware_id = ordinal
        self.process_index = process_index

    def __repr__(self):
        return f"FakeDevice({self.local_hardware_id}, process {self.process_index})"


class FakeMesh:
    def __init__(self, devices):
        self.devices = np.array(devices, dtype=object)
        self.axis_names = ("ep",)


class FakeLib:
    """Records the native calls; alloc_rc[ordinal] (default 0) is what mok_comm_alloc returns there."""

    HANDLE_BYTES = 104

    def __init__(self, alloc_rc=None, emulated_rc=0):
        self.calls: list[tuple] = []
        self.alloc_rc = alloc_rc or {}
        self.emulated_rc = emulated_rc

    def mok_comm_handle_bytes(self):
        return self.HANDLE_BYTES

    def mok_comm_handle_descriptor(self, handle, fd):  # the fake's handles name no POSIX descriptor
        return 0

    def mok_comm_handle_name_local_descriptor(self, handle, fd):
        return -1

    def mok_comm_alloc(self, ws_id, g, ordinal, r, ep, T, H, k, E, timeout, memory, want_handle, out, err, err_len):
        self.calls.append(("alloc", ws_id, ordinal, r, want_handle) + ((memory,) if memory else ()))
        rc = self.alloc_rc.get(ordinal, 0)
        if rc:
            err.value = (b"cudaMalloc of the N-byte workspace region: cudaErrorMemoryAllocation (out of memory) "
                         b"(CUDA device 1 has 10 of 100 MiB free)" if rc == 2 else b"something else failed")
        else:
            ctypes.memset(out, ordinal + 1, self.HANDLE_BYTES)
        return rc

    def mok_comm_alloc_emulated(self, ws_id, ordinal, ep, T, H, k, E, timeout, memory, err, err_len):
        self.calls.append(("alloc_emulated", ws_id, ordinal, ep))
        if self.emulated_rc:
            err.value = b"emulated rank 2: cudaMalloc ...: cudaErrorMemoryAllocation (out of memory)"
        return self.emulated_rc

    def mok_comm_connect(self, ws_id, ordinal, table, err, err_len):
        row = np.ctypeslib.as_array(ctypes.cast(table, ctypes.POINTER(ctypes.c_uint8)), (2 * self.HANDLE_BYTES,))
        self.calls.append(("connect", ws_id, ordinal, tuple(row[::self.HANDLE_BYTES])))
        return 0

    def mok_comm_release_peers(self, ws_id):
        self.calls.append(("release", ws_id))
        return 0

    def mok_comm_free(self, ws_id):
        self.calls.append(("free", ws_id))
        return 0

    def names(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def fake(monkeypatch):
    """A fake native library, a recorded drain, and an empty layer cache, all restored afterwards."""

    lib = FakeLib()
    drained = []
    monkeypatch.setattr(wcore, "_lib", lambda: lib)
    monkeypatch.setattr(wcore, "_drain", lambda devices: drained.append(sorted(d.local_hardware_id for d in devices)))
    monkeypatch.setattr(wcache, "_cache", {})
    monkeypatch.setattr(wcache, "_superseded", [])
    lib.drained = drained
    return lib


def _create(mesh, **kw):
    from mok_jax.workspace import Workspace

    return Workspace.create(mesh, "ep", max_tokens=64, hidden_size=64, top_k=2, num_experts=4, **kw)


def test_create_and_close_one_process(fake):
    mesh = FakeMesh([FakeDevice(0), FakeDevice(1)])
    ws = _create(mesh)
    assert 0 < ws.id <= INT64_MAX and not ws.spans_processes and not ws.closed
    assert fake.calls == [("alloc", ws.id, 0, 0, 0), ("alloc", ws.id, 1, 1, 0),
                          ("connect", ws.id, 0, (1, 2)), ("connect", ws.id, 1, (1, 2))]
    fake.calls.clear()
    ws.close()
    ws.close()  # idempotent
    assert fake.calls == [("release", ws.id), ("free", ws.id)] and fake.drained == [[0, 1]]
    assert ws.closed
    from mok_jax.workspace import CommError

    with pytest.raises(CommError, match=rf"mok_jax.ops.moe_forward: workspace {ws.id} is closed"):
        ws.require_open("mok_jax.ops.moe_forward")
    assert _create(mesh).id > ws.id  # a fresh id, never the closed one


def test_create_out_of_memory_names_bytes_and_remedy_and_frees(fake, monkeypatch):
    from mok_jax.workspace import CommError, CommConfig, WorkspaceMemoryError

    fake.alloc_rc = {1: 2}
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    with pytest.raises(WorkspaceMemoryError) as info:
        _create(FakeMesh([FakeDevice(0), FakeDevice(1)]))
    assert isinstance(info.value, MemoryError) and isinstance(info.value, CommError)
    need = CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=2, num_experts=4).workspace_bytes()
    msg = str(info.value)
    assert msg.startswith("Workspace.create: rank 1 of group 0 on FakeDevice(1, process 0)")
    assert f"needs {need} bytes" in msg and "10 of 100 MiB free" in msg
    assert "XLA_CLIENT_MEM_FRACTION=0.9" in msg and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in msg
    ws_id = fake.calls[0][1]
    assert fake.names() == ["alloc", "alloc", "release", "free"] and fake.calls[-1] == ("free", ws_id)


def test_create_other_failure_is_a_comm_error(fake):
    from mok_jax.workspace import CommError, WorkspaceMemoryError

    fake.alloc_rc = {0: 1}
    with pytest.raises(CommError, match="rank 0 of group 0 .*: something else failed") as info:
        _create(FakeMesh([FakeDevice(0), FakeDevice(1)]))
    assert not isinstance(info.value, WorkspaceMemoryError)
    assert fake.names() == ["alloc", "release", "free"]


class FakeStore:
    """jax.distributed's key-value store, within this process: keys are set once, a missing key's get fails as the
    store's does at its deadline."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.deleted: list[str] = []
        self.barriers: list[tuple] = []

    def key_value_set(self, key, value):
        if key in self.values:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.values[key]

    def key_value_delete(self, key):
        self.deleted.append(key)
        self.values.pop(key, None)

    def wait_at_barrier(self, name, timeout_in_ms, process_ids=None):
        self.barriers.append((name, tuple(process_ids or ())))


def _fake_processes(monkeypatch, peer: str, agreed_id: int):
    """This process is 0 of 2; the peer (process 1) holds EP rank 1. ``peer``: "ok" (its record, handle bytes all 9,
    is in the store before this process publishes), "failed" (its record says its allocation failed) or "missing"
    (it never publishes). Returns (the close barriers, the store)."""
    import json

    from jax.experimental import multihost_utils

    from mok_jax.workspace import CommConfig, exchange

    barriers = []
    store = FakeStore()
    monkeypatch.setattr(wcore, "_agreed_id", lambda ws_id, *args: agreed_id)
    monkeypatch.setattr(exchange, "_client", lambda: store)
    config = CommConfig(ep=2, max_tokens=64, hidden_size=64, top_k=2, num_experts=4)
    if peer != "missing":
        record = {"fingerprint": wcore._fingerprint(config, (1, 2), FakeLib.HANDLE_BYTES),
                  "failure": "cudaMalloc failed there" if peer == "failed" else "",
                  "ranks": {} if peer == "failed" else {"0,1": bytes([9] * FakeLib.HANDLE_BYTES).hex()}}
        store.key_value_set(exchange.key(agreed_id, 1), json.dumps(record))
    monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
    return barriers, store


_SPANNING = FakeMesh([FakeDevice(0, 0), FakeDevice(0, 1)])


def test_create_spanning_processes_agrees_on_id_and_exchanges_handles(fake, monkeypatch):
    from mok_jax.workspace import exchange

    agreed = (12345 << 24) | 7
    barriers, store = _fake_processes(monkeypatch, "ok", agreed_id=agreed)
    ws = _create(_SPANNING)
    assert ws.id == agreed and ws.spans_processes
    assert fake.calls == [("alloc", agreed, 0, 0, 1), ("connect", agreed, 0, (1, 9))]
    assert store.barriers == [(f"mok_comm_workspace_{agreed}_exchanged", (0, 1)),
                              (f"mok_comm_workspace_{agreed}_connected", (0, 1))]
    assert store.deleted == [exchange.key(agreed, 0)]  # its record, once every process has read it
    ws.close()  # released, then the barrier through the store, then freed: no device collective
    assert store.barriers[-1] == (f"mok_comm_workspace_{agreed}_released", (0, 1)) and barriers == []
    assert fake.names()[-2:] == ["release", "free"]


def test_close_spanning_processes_keeps_its_regions_when_a_peer_never_releases(fake, monkeypatch):
    """A peer that never reaches close's barrier: this process raises, naming the barrier, after releasing its peer
    mappings, and does not free its own regions (the peer may still map them)."""
    from mok_jax.workspace import CommError

    agreed = (7 << 24) | 4
    barriers, store = _fake_processes(monkeypatch, "ok", agreed_id=agreed)
    ws = _create(_SPANNING)

    def never(name, timeout_in_ms, process_ids=None):
        raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {name} timed out")

    store.wait_at_barrier = never
    with pytest.raises(CommError, match=rf"Workspace.close: not every process of \[0, 1\] reached "
                                        rf"'mok_comm_workspace_{agreed}_released' within 120 s.*stay allocated"):
        ws.close()
    assert fake.names()[-1] == "release" and "free" not in fake.names() and ws.closed and barriers == []


def test_create_and_close_spanning_processes_with_vmm_memory(fake, monkeypatch):
    """memory="vmm" reaches the library's alloc (kind 1) and the exchange's fingerprint (a peer that made its ranks
    with "ipc" is refused there); a close whose barrier times out frees the VMM regions all the same."""
    import json

    from mok_jax.workspace import CommError, exchange

    agreed = (7 << 24) | 5
    barriers, store = _fake_processes(monkeypatch, "ok", agreed_id=agreed)
    with pytest.raises(CommError, match=r"memory=ipc.*memory=vmm|memory=vmm.*memory=ipc"):
        _create(_SPANNING, memory="vmm")  # the peer's record (ipc) does not match
    assert fake.calls[0] == ("alloc", agreed, 0, 0, 1, 1) and fake.names()[-2:] == ["release", "free"]
    agreed = (7 << 24) | 6
    fake.calls.clear()
    barriers, store = _fake_processes(monkeypatch, "ok", agreed_id=agreed)
    record = json.loads(store.values[exchange.key(agreed, 1)])
    record["fingerprint"] = record["fingerprint"].replace("memory=ipc", "memory=vmm")
    store.values[exchange.key(agreed, 1)] = json.dumps(record)
    ws = _create(_SPANNING, memory="vmm")
    assert ws.memory_kind == "vmm" and fake.calls[0] == ("alloc", agreed, 0, 0, 1, 1)

    def never(name, timeout_in_ms, process_ids=None):
        raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {name} timed out")

    store.wait_at_barrier = never
    with pytest.raises(CommError, match=r"released' within 120 s.*VMM regions freed"):
        ws.close()
    assert fake.names()[-2:] == ["release", "free"]


def test_create_spanning_processes_raises_when_a_peer_failed(fake, monkeypatch):
    """A process whose allocation failed still publishes, so its peers raise (at once) instead of waiting."""
    from mok_jax.workspace import CommError

    barriers, store = _fake_processes(monkeypatch, "failed", agreed_id=(7 << 24) | 1)
    with pytest.raises(CommError, match=r"process 1 could not allocate its EP ranks \(cudaMalloc failed there\); "
                                        r"no rank was connected"):
        _create(_SPANNING)
    assert fake.names() == ["alloc", "release", "free"] and barriers == [] and store.barriers == []


def test_create_spanning_processes_names_a_peer_that_never_publishes(fake, monkeypatch):
    from mok_jax.workspace import CommError

    barriers, store = _fake_processes(monkeypatch, "missing", agreed_id=(7 << 24) | 2)
    with pytest.raises(CommError, match=r"process\(es\) \[1\] did not publish their EP ranks' handles within 120 s"):
        _create(_SPANNING)
    assert fake.names() == ["alloc", "release", "free"] and barriers == [] and store.barriers == []


def test_create_spanning_processes_own_failure_is_published_and_raised(fake, monkeypatch):
    """This process's allocation fails: its record tells the peer why, it raises its own error (out of memory here),
    frees what it holds and meets no barrier."""
    import json

    from mok_jax.workspace import WorkspaceMemoryError, exchange

    agreed = (7 << 24) | 3
    fake.alloc_rc = {0: 2}
    barriers, store = _fake_processes(monkeypatch, "ok", agreed_id=agreed)
    with pytest.raises(WorkspaceMemoryError, match=r"^Workspace.create: rank 0 of group 0 on FakeDevice\(0, process 0\)"):
        _create(_SPANNING)
    mine = json.loads(store.values[exchange.key(agreed, 0)])
    assert mine["ranks"] == {} and mine["failure"].startswith("Workspace.create: rank 0 of group 0")
    assert fake.names() == ["alloc", "release", "free"] and barriers == [] and store.barriers == []


def test_create_emulated_out_of_memory_counts_every_rank(fake):
    from mok_jax.workspace import CommConfig, Workspace, WorkspaceMemoryError

    fake.emulated_rc = 2
    with pytest.raises(WorkspaceMemoryError) as info:
        Workspace.create_emulated(FakeDevice(0), 4, max_tokens=64, hidden_size=64, top_k=2, num_experts=8)
    need = 4 * CommConfig(ep=4, max_tokens=64, hidden_size=64, top_k=2, num_experts=8).workspace_bytes()
    assert f"needs {need} bytes" in str(info.value) and "create_emulated" in str(info.value)
    assert fake.names() == ["alloc_emulated", "release", "free"]


def test_out_of_memory_message_reports_the_settings():
    from mok_jax.workspace.errors import _out_of_memory_message

    msg = _out_of_memory_message("here", 3 * 2**20, "CUDA said no", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    assert msg.startswith("here: the workspace needs 3145728 bytes (3.0 MiB) of GPU memory")
    assert "CUDA said no" in msg and "75%" in msg
    assert ("This process: XLA_PYTHON_CLIENT_PREALLOCATE=true, XLA_CLIENT_MEM_FRACTION unset, "
            "XLA_PYTHON_CLIENT_MEM_FRACTION unset, XLA_PYTHON_CLIENT_ALLOCATOR unset") in msg


def test_layer_cache_supersedes_lists_and_closes(fake, monkeypatch, cpu_devices):
    """moe_workspace caches per key; a larger request replaces the cached one (which stays open and listed);
    closing one drops it from the cache; close_cached_workspaces closes the rest."""

    made = []

    def fake_create(mesh, axis_name="ep", memory="ipc", **kw):
        ws = w.Workspace(ws_id=wcore._new_id(), config=w.CommConfig(ep=mesh.shape[axis_name], **kw), mesh=mesh,
                         axis_name=axis_name, local=[])
        ws.fake_memory = memory
        made.append(ws)
        return ws

    monkeypatch.setattr(w.Workspace, "create", staticmethod(fake_create))
    import jax

    mesh = jax.sharding.Mesh(np.asarray(cpu_devices[:2]), ("ep",))
    get = lambda t, h=64: w.moe_workspace(mesh, "ep", max_tokens=t, hidden_size=h, top_k=2, num_experts=4)  # noqa: E731
    a = get(32)
    assert get(16) is a and get(32) is a
    b = get(64)
    assert b is not a and not a.closed and get(48) is b
    c = get(64, h=128)
    assert w.cached_workspaces() == [a, b, c]
    b.close()
    assert w.cached_workspaces() == [a, c] and get(64) is not b  # a new one replaces the closed b
    v = w.moe_workspace(mesh, "ep", max_tokens=64, hidden_size=128, top_k=2, num_experts=4, memory="vmm")
    assert v is not c and v.fake_memory == "vmm" and c.fake_memory == "ipc"  # each memory kind its own workspace
    with pytest.raises(ValueError, match=r"moe_workspace: memory must be one of \['ipc', 'vmm'\], got 'cuda'"):
        w.moe_workspace(mesh, "ep", max_tokens=64, hidden_size=128, top_k=2, num_experts=4, memory="cuda")
    assert w.close_cached_workspaces() == 4 and all(ws.closed for ws in made)
    assert w.cached_workspaces() == [] and w.close_cached_workspaces() == 0
    assert [n for n in fake.names()] == ["release", "free"] * 5
    assert sorted(c[1] for c in fake.calls if c[0] == "free") == sorted(ws.id for ws in made)


def test_drain_runs_on_host_devices(cpu_devices):

    wcore._drain(set(cpu_devices[:3]))  # a trivial program per device, then wait; nothing to raise
    wcore._drain(set())


def _packed(code: int, op: int, rank: int = 0, peer: int = 1, epoch: int = 7) -> int:
    """An error word as the kernels pack it (mok/comm/workspace.cuh, pack_error)."""
    return code | (op << 8) | (rank << 16) | (peer << 32) | (epoch << 48)


def test_error_text_tells_call_errors_from_poison():
    """A megakernel call error (bad routing) leaves the workspace usable and says so; a timeout poisons it."""
    import ctypes

    from mok_jax import _native

    lib = _native.library()
    if lib is None:
        pytest.skip("the native library is not built here (not a pass)")
    wnative._declare(lib)  # the text comes from host code: no GPU needed

    def describe_error(word: int) -> str:
        buf = ctypes.create_string_buffer(1024)
        lib.mok_comm_describe_error(ctypes.c_uint64(word), buf, len(buf))
        return buf.value.decode()

    bad_id = describe_error(_packed(5, 3))  # kErrBadExpert, kOpMoeForward
    assert "outside [-1, num_experts)" in bad_id and "stays usable" in bad_id and "poisoned" not in bad_id, bad_id
    overflow = describe_error(_packed(4, 3))  # kErrOverflow of the megakernel: a call error too
    assert "ring slot" in overflow and "stays usable" in overflow, overflow
    timeout = describe_error(_packed(2, 1))  # kErrTimeoutData of dispatch
    assert "timed out" in timeout and "poisoned" in timeout and "EP rank 1" in timeout, timeout
