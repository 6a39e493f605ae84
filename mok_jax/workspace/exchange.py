"""The workspace's handle exchange between processes, through ``jax.distributed``'s key-value store.

Every process of a workspace that spans processes publishes one record under the workspace's id: the shape it
created its ranks with (a fingerprint), and either the memory handle of each EP rank it holds or the reason its
allocation failed. Then it reads every other process's record, each with what is left of one deadline
(``timeout_s``, the workspace's own timeout). What a process can learn there it raises as a
:class:`~mok_jax.workspace.errors.CommError` at set-up, naming the process and what is missing, so that no rank is
connected and no kernel waits for a peer that will never come:

* a process that never publishes (it did not make the same ``Workspace.create`` call, or it died);
* a process that created its ranks with another shape (``max_tokens``, ``hidden_size``, ...);
* a process whose allocation failed (its own error says why);
* an EP rank held by no process, or by two.

The rest of a multi-process set-up goes through the same store with the same deadline: the processes agree on the
lowest one's workspace id (``agree_id``) and meet at barriers after the exchange and after connecting (``barrier``),
so a process that fails or never comes stops every other one with an error rather than a hang.

A key-value store rather than a collective (``process_allgather``): a collective waits for every process with no
bound and says nothing about who is missing; a blocking get has a deadline and a key names its process. The record
is plain text (JSON, handles in hex), so any handle type fits (CUDA IPC handles today; the store does not care).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterable, Mapping

from mok_jax.workspace.errors import CommError

__all__ = ["EXCHANGE_TIMEOUT_S", "agree_id", "barrier", "exchange_handles", "forget"]

_PREFIX = "mok_jax/workspace"
# The exchange's deadline at least (the workspace's timeout_s when longer): processes reach Workspace.create at
# times that differ by their start-up and compilation, seconds apart, where a kernel's wait for a peer is not.
EXCHANGE_TIMEOUT_S = 120.0


def _client():
    """The ``jax.distributed`` client of this process (the coordination service's key-value store)."""
    from jax._src import distributed  # the client has no public accessor; multihost_utils reads it the same way

    client = distributed.global_state.client
    if client is None:
        raise CommError("Workspace.create: the workspace spans processes but jax.distributed is not initialized in "
                        "this one (call jax.distributed.initialize first)")
    return client


def _deadline_error(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


# Multi-process set-ups made so far by this process, per set of processes: the same count on every process of a
# set, since they must create their workspaces in the same order; it names the key of the id they agree on.
_creates: dict[tuple[int, ...], itertools.count] = {}
_creates_lock = threading.Lock()


def agree_id(ws_id: int, *, process: int, processes: Iterable[int], timeout_s: float, client=None) -> int:
    """The workspace id of the lowest of ``processes`` (every process of a workspace must carry one id: its keys and
    barriers are named by it), on each of them, through the store: the lowest publishes its own ``ws_id``, the
    others read it within ``timeout_s``. Raises CommError naming that process if it did not publish."""
    client = _client() if client is None else client
    procs = tuple(sorted(set(processes)))
    with _creates_lock:
        seq = next(_creates.setdefault(procs, itertools.count()))
    name = f"{_PREFIX}/create/{'-'.join(map(str, procs))}/{seq}"
    if process == procs[0]:
        _set(client, name, str(int(ws_id)))
        return int(ws_id)
    try:
        return int(client.blocking_key_value_get(name, max(1, int(timeout_s * 1000))))
    except Exception as e:  # noqa: BLE001 - the store's error type is jaxlib's; its code says what it was
        if not _deadline_error(e):
            raise CommError(f"Workspace.create: reading the workspace id of process {procs[0]} failed: {e}") from e
        raise CommError(f"Workspace.create: process {procs[0]} did not start workspace number {seq} of processes "
                        f"{list(procs)} within {timeout_s:g} s: every process must call Workspace.create on the same "
                        f"mesh, in the same order as its other workspaces; a process that did not, or that died, "
                        f"causes this") from None


def barrier(name: str, *, processes: Iterable[int], timeout_s: float, client=None, what: str = "Workspace.create",
            consequence: str = "no rank of this process stays connected") -> None:
    """Every one of ``processes`` reaches ``name`` within ``timeout_s``, or each that did raises CommError (``what``
    names the caller, ``consequence`` what the failure leaves)."""
    client = _client() if client is None else client
    procs = sorted(set(processes))
    try:
        client.wait_at_barrier(name, max(1, int(timeout_s * 1000)), procs)
    except Exception as e:  # noqa: BLE001 - the store's error type is jaxlib's
        raise CommError(f"{what}: not every process of {procs} reached {name!r} within {timeout_s:g} s "
                        f"(one failed, or never came: its own error says why); {consequence}: {e}") from e


def _set(client, name: str, value: str) -> None:
    try:
        client.key_value_set(name, value)
    except Exception as e:  # noqa: BLE001 - the store's error type is jaxlib's
        raise CommError(f"Workspace.create: publishing {name!r} in jax.distributed's key-value store failed: "
                        f"{e}") from e


def key(ws_id: int, process: int) -> str:
    """Where process ``process`` publishes its record for workspace ``ws_id``."""
    return f"{_PREFIX}/{ws_id}/handles/{process}"


def exchange_handles(ws_id: int, *, process: int, processes: Iterable[int], fingerprint: str,
                     handles: Mapping[tuple[int, int], bytes], failure: str | None, ranks: Iterable[tuple[int, int]],
                     timeout_s: float, client=None, descriptor_socket: str = "",
                     sockets: dict[tuple[int, int], str] | None = None) -> dict[tuple[int, int], bytes]:
    """Publish this process's record, read those of the other ``processes`` (the processes that hold the workspace's
    devices) within ``timeout_s``, and return the handle of every (group, rank) in ``ranks``.

    ``handles``: this process's own ranks' handles ({(group, rank): bytes}); ``failure``: why its allocation failed
    (None: it did not), published so that its peers raise at once instead of waiting for it; ``fingerprint``: the
    shape its ranks were made with (every process must agree); ``descriptor_socket``: where this process serves its
    ranks' POSIX descriptors (mok_jax.workspace.descriptors; "" none), and ``sockets``, when given, receives each
    returned rank's owner's. With a ``failure`` it only publishes (returns {}: its
    caller raises its own error). Raises CommError naming the processes that did not publish within ``timeout_s``,
    whose shape differs, that failed, or a rank held by none or by two. ``client``: the key-value store (default:
    jax.distributed's).
    """
    client = _client() if client is None else client
    record = {"fingerprint": fingerprint, "failure": failure or "", "descriptors": descriptor_socket,
              "ranks": {f"{g},{r}": bytes(h).hex() for (g, r), h in handles.items()}}
    where = f"Workspace.create (workspace {ws_id})"
    if failure:
        try:  # its caller raises its own error; the peers read why from the record
            client.key_value_set(key(ws_id, process), json.dumps(record))
        except Exception:  # noqa: BLE001 - this process's own failure is the error to raise, not the store's
            pass
        return {}
    _set(client, key(ws_id, process), json.dumps(record))
    records = {process: record}
    missing = []
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    for p in sorted(set(processes)):
        if p == process:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            records[p] = rec = json.loads(client.blocking_key_value_get(key(ws_id, p), left_ms))
        except Exception as e:  # noqa: BLE001 - the store's error type is jaxlib's; its code says what it was
            if not _deadline_error(e):
                raise CommError(f"Workspace.create: reading process {p}'s workspace handles failed: {e}") from e
            missing.append(p)
            continue
        if rec["failure"]:  # at once: no need to wait for the others
            raise CommError(f"{where}: process {p} could not allocate its EP ranks ({rec['failure']}); no rank was "
                            f"connected")
    if missing:
        raise CommError(f"{where}: process(es) {missing} did not publish their EP ranks' handles within "
                        f"{timeout_s:g} s: each must call Workspace.create on the same mesh, in the same order as its "
                        f"other workspaces; a process that did not, or that died, causes this. No rank was connected")
    differ = sorted(p for p, rec in records.items() if rec["fingerprint"] != fingerprint)
    if differ:
        theirs = "; ".join(f"process {p}: {records[p]['fingerprint']}" for p in differ)
        raise CommError(f"{where}: the processes created their EP ranks with different shapes (this process, "
                        f"{process}: {fingerprint}; {theirs}): every process must pass the same arguments. No rank "
                        f"was connected")
    owner: dict[tuple[int, int], list[int]] = {}
    table: dict[tuple[int, int], bytes] = {}
    served: dict[tuple[int, int], str] = {}
    for p in sorted(records):
        for name, h in records[p]["ranks"].items():
            g, r = (int(v) for v in name.split(","))
            owner.setdefault((g, r), []).append(p)
            table[(g, r)] = bytes.fromhex(h)
            served[(g, r)] = records[p].get("descriptors", "")
    wanted = list(ranks)
    bad = {gr: owner.get(gr, []) for gr in wanted if len(owner.get(gr, [])) != 1}
    extra = sorted(set(owner) - set(wanted))
    if bad or extra:
        raise CommError(f"{where}: every EP rank must be held by exactly one process; (group, rank): processes "
                        f"{ {gr: ps for gr, ps in sorted(bad.items())} }"
                        + (f", ranks outside the mesh {extra}" if extra else "") + ". No rank was connected")
    if sockets is not None:
        sockets.update({gr: served[gr] for gr in wanted})
    return {gr: table[gr] for gr in wanted}


def forget(ws_id: int, process: int, client=None) -> None:
    """Remove this process's record (after every process has read it: the workspace's connected barrier)."""
    client = _client() if client is None else client
    try:
        client.key_value_delete(key(ws_id, process))
    except Exception:  # noqa: BLE001 - best effort: a record left behind names an id that is never reused
        pass
