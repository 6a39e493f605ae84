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

A key-value store rather than a collective (``process_allgather``): a collective waits for every process with no
bound and says nothing about who is missing; a blocking get has a deadline and a key names its process. The record
is plain text (JSON, handles in hex), so any handle type fits (CUDA IPC handles today; the store does not care).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping

from mok_jax.workspace.errors import CommError

__all__ = ["EXCHANGE_TIMEOUT_S", "exchange_handles", "forget"]

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


def key(ws_id: int, process: int) -> str:
    """Where process ``process`` publishes its record for workspace ``ws_id``."""
    return f"{_PREFIX}/{ws_id}/handles/{process}"


def exchange_handles(ws_id: int, *, process: int, processes: Iterable[int], fingerprint: str,
                     handles: Mapping[tuple[int, int], bytes], failure: str | None, ranks: Iterable[tuple[int, int]],
                     timeout_s: float, client=None) -> dict[tuple[int, int], bytes]:
    """Publish this process's record, read those of the other ``processes`` (the processes that hold the workspace's
    devices), and return the handle of every (group, rank) in ``ranks``.

    ``handles``: this process's own ranks' handles ({(group, rank): bytes}); ``failure``: why its allocation failed
    (None: it did not), published so that its peers raise at once instead of waiting for it; ``fingerprint``: the
    shape its ranks were made with (every process must agree). With a ``failure`` it only publishes (returns {}: its
    caller raises its own error). Raises CommError naming the processes that did not publish within ``timeout_s``,
    whose shape differs, that failed, or a rank held by none or by two. ``client``: the key-value store (default:
    jax.distributed's).
    """
    client = _client() if client is None else client
    record = {"fingerprint": fingerprint, "failure": failure or "",
              "ranks": {f"{g},{r}": bytes(h).hex() for (g, r), h in handles.items()}}
    client.key_value_set(key(ws_id, process), json.dumps(record))
    if failure:
        return {}  # its caller raises its own error; the peers read why from the record
    records = {process: record}
    missing = []
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    for p in sorted(set(processes)):
        if p == process:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            records[p] = json.loads(client.blocking_key_value_get(key(ws_id, p), left_ms))
        except Exception as e:  # noqa: BLE001 - the store's error type is jaxlib's; its code says what it was
            if "DEADLINE_EXCEEDED" not in str(e):
                raise CommError(f"Workspace.create: reading process {p}'s workspace handles failed: {e}") from e
            missing.append(p)
    where = f"Workspace.create (workspace {ws_id})"
    if missing:
        raise CommError(f"{where}: process(es) {missing} did not publish their EP ranks' handles within "
                        f"{timeout_s:g} s (timeout_s): each must call Workspace.create on the same mesh, in the same "
                        f"order as its other workspaces; a process that did not, or that died, causes this. No rank "
                        f"was connected")
    differ = sorted(p for p, rec in records.items() if rec["fingerprint"] != fingerprint)
    if differ:
        theirs = "; ".join(f"process {p}: {records[p]['fingerprint']}" for p in differ)
        raise CommError(f"{where}: the processes created their EP ranks with different shapes (this process, "
                        f"{process}: {fingerprint}; {theirs}): every process must pass the same arguments. No rank "
                        f"was connected")
    failed = sorted(p for p, rec in records.items() if rec["failure"])
    if failed:
        why = "; ".join(f"process {p}: {records[p]['failure']}" for p in failed)
        raise CommError(f"{where}: process(es) {failed} could not allocate their EP ranks ({why}); no rank was "
                        f"connected")
    owner: dict[tuple[int, int], list[int]] = {}
    table: dict[tuple[int, int], bytes] = {}
    for p in sorted(records):
        for name, h in records[p]["ranks"].items():
            g, r = (int(v) for v in name.split(","))
            owner.setdefault((g, r), []).append(p)
            table[(g, r)] = bytes.fromhex(h)
    wanted = list(ranks)
    bad = {gr: owner.get(gr, []) for gr in wanted if len(owner.get(gr, [])) != 1}
    extra = sorted(set(owner) - set(wanted))
    if bad or extra:
        raise CommError(f"{where}: every EP rank must be held by exactly one process; (group, rank): processes "
                        f"{ {gr: ps for gr, ps in sorted(bad.items())} }"
                        + (f", ranks outside the mesh {extra}" if extra else "") + ". No rank was connected")
    return {gr: table[gr] for gr in wanted}


def forget(ws_id: int, process: int, client=None) -> None:
    """Remove this process's record (after every process has read it: the workspace's connected barrier)."""
    client = _client() if client is None else client
    try:
        client.key_value_delete(key(ws_id, process))
    except Exception:  # noqa: BLE001 - best effort: a record left behind names an id that is never reused
        pass
