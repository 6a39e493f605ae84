"""The workspace's handle exchange between processes (mok_jax/workspace/exchange.py), on CPU: two jax.distributed
processes meet in its key-value store, as two GPU processes of one workspace do in Workspace.create (issue 36: the
exchange and its failure cases run in CI).

Cases, each a workspace id of its own in the same pair of processes: both publish and each gets every rank's
handle; one never publishes and the other names it after the deadline (bounded: no hang); the two created their
ranks with different shapes and each names the other's; one failed to allocate and the other raises its reason at
once; a rank held by two processes; a rank held by none. And the rest of a set-up: the processes agree on the lowest
one's id, or name it when it never publishes; a barrier one process never reaches is an error after the deadline.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from helpers import free_port, run_processes

REPO = pathlib.Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT_S = 180
DEADLINE_S = 3.0  # the "never publishes" case waits this long

_WORKER = """
import json, sys, time
import jax
pid, port, deadline = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
from mok_jax.workspace import exchange
from mok_jax.workspace.errors import CommError

RANKS = [(0, 0), (0, 1)]
def run(ws_id, fingerprint="ep=2 shape=a", handles=None, failure=None, publish=True, ranks=RANKS):
    handles = {(0, pid): bytes([pid + 1]) * 8} if handles is None else handles
    if not publish:
        return "skipped"
    t0 = time.monotonic()
    try:
        got = exchange.exchange_handles(ws_id, process=pid, processes=[0, 1], fingerprint=fingerprint,
                                        handles=handles, failure=failure, ranks=ranks, timeout_s=deadline)
        return {"ok": {f"{g},{r}": h.hex() for (g, r), h in got.items()}, "s": time.monotonic() - t0}
    except CommError as e:
        return {"error": str(e), "s": time.monotonic() - t0}

from jax._src import distributed
cases = {
    "both": lambda: run(101),
    "silent": lambda: run(102, publish=pid == 0),
    "shape": lambda: run(103, fingerprint=f"ep=2 shape={'a' if pid == 0 else 'b'}"),
    "failed": lambda: run(104, failure="cudaMalloc: out of memory" if pid == 1 else None),
    "twice": lambda: run(105, handles={(0, 0): b"x" * 8} if pid == 1 else None),
    "none": lambda: run(106, handles={} if pid == 1 else None),
}
def agree(procs_publish):
    t0 = time.monotonic()
    try:
        if pid not in procs_publish and pid == 0:
            return "skipped"
        return {"ok": exchange.agree_id(1000 + pid, process=pid, processes=[0, 1], timeout_s=deadline),
                "s": time.monotonic() - t0}
    except CommError as e:
        return {"error": str(e), "s": time.monotonic() - t0}

def meet(arrive):
    t0 = time.monotonic()
    if not arrive:
        return "skipped"
    try:
        exchange.barrier("mok_test_exchange_lonely", processes=[0, 1], timeout_s=deadline)
        return {"ok": True, "s": time.monotonic() - t0}
    except CommError as e:
        return {"error": str(e), "s": time.monotonic() - t0}

def descriptors():
    # Each process serves a descriptor of its rank's "region" (a memfd) and publishes the socket in its record; each
    # receives the other's through the socket the exchange names, as Workspace.create does for memory="vmm".
    import os
    from mok_jax.workspace.descriptors import DescriptorServer, fetch_descriptors
    fd = os.memfd_create("region")
    os.write(fd, f"region of process {pid}".encode())
    with DescriptorServer({f"0,{pid}": fd}, label="test") as server:
        sockets = {}
        exchange.exchange_handles(107, process=pid, processes=[0, 1], fingerprint="f", handles={(0, pid): b"h"},
                                  failure=None, ranks=RANKS, timeout_s=deadline, descriptor_socket=server.address,
                                  sockets=sockets)
        other = 1 - pid
        got = fetch_descriptors(sockets[(0, other)], [f"0,{other}"], timeout_s=deadline, peer=f"process {other}")
        text = os.pread(got[f"0,{other}"], 64, 0).decode()
        os.close(got[f"0,{other}"])
        own = sockets[(0, pid)] == server.address
        distributed.global_state.client.wait_at_barrier("mok_test_exchange_descriptors_read", 60_000)
    os.close(fd)
    return {"read": text, "own socket listed": own}

cases["descriptors"] = descriptors
cases["agree"] = lambda: agree({0, 1})
cases["noid"] = lambda: agree({1})  # process 0 never publishes the id
out = {}
for name, case in cases.items():  # one case at a time: a barrier after each
    out[name] = case()
    distributed.global_state.client.wait_at_barrier(f"mok_test_exchange_{name}", 60_000)
out["lonely"] = meet(pid == 0)  # process 1 never comes (last: a failed barrier may end the job's barriers)
print("RESULT", json.dumps(out), flush=True)
time.sleep(deadline + 1)  # process 0 hosts the store: it outlives process 1's reads
import os
os._exit(0)
"""


@pytest.fixture(scope="module")
def results():
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    runs = run_processes([[sys.executable, "-c", _WORKER, str(i), str(port), str(DEADLINE_S)] for i in range(2)],
                         env=env, cwd=REPO, timeout=SUBPROCESS_TIMEOUT_S)
    out = []
    for rc, text in runs:
        assert rc == 0, text[-3000:]
        out.append(json.loads(next(line for line in text.splitlines() if line.startswith("RESULT"))[7:]))
    return out


def test_both_publish_and_each_gets_every_rank(results):
    want = {"0,0": (b"\x01" * 8).hex(), "0,1": (b"\x02" * 8).hex()}
    assert results[0]["both"]["ok"] == want and results[1]["both"]["ok"] == want


def test_descriptor_sockets_travel_in_the_records_and_pass_each_region(results):
    """memory="vmm" with POSIX descriptors: the exchange names each rank's owner's descriptor socket, and each
    process receives the other's descriptor through it (mok_jax/workspace/descriptors.py)."""
    for pid in (0, 1):
        assert results[pid]["descriptors"] == {"read": f"region of process {1 - pid}", "own socket listed": True}


def test_a_process_that_never_publishes_is_named_after_the_deadline(results):
    got = results[0]["silent"]
    assert "error" in got, got
    assert got["error"].startswith("Workspace.create (workspace 102): process(es) [1] did not publish their EP "
                                   "ranks' handles within 3 s: "), got["error"]
    assert "No rank was connected" in got["error"]
    assert DEADLINE_S - 0.5 <= got["s"] <= DEADLINE_S + 30, got["s"]  # bounded by the deadline: no hang


def test_different_shapes_are_named_on_both_sides(results):
    for pid, mine, theirs in ((0, "a", "b"), (1, "b", "a")):
        msg = results[pid]["shape"]["error"]
        assert "created their EP ranks with different shapes" in msg, msg
        assert f"(this process, {pid}: ep=2 shape={mine}; process {1 - pid}: ep=2 shape={theirs})" in msg, msg


def test_a_failed_allocation_is_raised_by_its_peer_at_once(results):
    assert results[1]["failed"]["ok"] == {}  # the failed process only publishes; its caller raises its own error
    msg = results[0]["failed"]["error"]
    assert msg == ("Workspace.create (workspace 104): process 1 could not allocate its EP ranks (cudaMalloc: out of "
                   "memory); no rank was connected"), msg
    assert results[0]["failed"]["s"] < DEADLINE_S, "the peer's failure is read at once, not at the deadline"


@pytest.mark.parametrize("case,where", [("twice", "(0, 0): [0, 1]"), ("none", "(0, 1): []")])
def test_every_rank_is_held_by_exactly_one_process(results, case, where):
    for pid in (0, 1):
        msg = results[pid][case]["error"]
        assert "every EP rank must be held by exactly one process" in msg and where in msg, msg


def test_the_processes_agree_on_the_lowest_ones_id(results):
    assert results[0]["agree"]["ok"] == results[1]["agree"]["ok"] == 1000


def test_an_id_never_published_is_named_after_the_deadline(results):
    msg = results[1]["noid"]["error"]
    assert msg.startswith("Workspace.create: process 0 did not start workspace number 1 of processes [0, 1] within "
                          "3 s"), msg
    assert DEADLINE_S - 0.5 <= results[1]["noid"]["s"] <= DEADLINE_S + 30


def test_a_barrier_a_process_never_reaches_is_an_error_not_a_hang(results):
    got = results[0]["lonely"]
    assert "error" in got and "not every process of [0, 1] reached 'mok_test_exchange_lonely' within 3 s" in got["error"]
    assert got["s"] <= DEADLINE_S + 30
