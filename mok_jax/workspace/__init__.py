"""Symmetric communication workspaces: set up outside ``jit``, used by the comm ops inside it.

A :class:`Workspace` owns, for one layer instance, one device region per EP rank, laid out at the same
offsets on every rank (``ffi/include/mok/comm/workspace.cuh``): row buffers, routing, signals and epoch stamps, the
device-side epoch counters and a poison word. Each rank gets a device table of its peers' base
addresses. Two backends sit behind the same interface:

* one process driving every GPU of the EP group: per-device ``cudaMalloc`` + peer access;
* one process per GPU (``jax.distributed``): CUDA IPC handles, exchanged between processes through
  ``jax.distributed``'s key-value store (``exchange``: bounded by a deadline; a process that never publishes, that
  made its ranks with another shape or that failed to allocate is named in a CommError at set-up).

EP rank = position along the mesh's ``axis_name`` axis; with other mesh axes there are several EP
groups, each with its own peer table (one workspace covers them all).

Typical use::

    with Workspace.create(mesh, "ep", max_tokens=4096, hidden_size=7168, top_k=8, num_experts=12) as ws:
        f = jax.jit(jax.shard_map(lambda x, i, w: ops.combine(ws, *ops.dispatch(ws, x, i, w)), ...))
        y, status = f(x, topk_idx, topk_weight)
        ws.check()   # raises CommTimeoutError naming the op and the rank if a peer never came

The comm ops' defaults (direction per operator, communication blocks) come from the workspace's
:class:`mok_jax.KernelConfig` (``Workspace.create(..., kernel=KernelConfig(dispatch="push"))``; None: its
defaults); a call's own ``mode=`` / ``num_sms=`` wins. The megakernel takes its KernelConfig per call.

Calls on one workspace must happen in the same order on every rank (SPMD programs do this); a rank
that skips a call makes its peers time out after ``timeout_s``: the op's status output says so, the
workspace becomes poisoned, :meth:`Workspace.check` raises, and the next call's handler fails.

Ids. Each custom call carries its workspace's id (``Workspace.id``) as an int64 attribute, and its handler
finds the device regions by that id in the native registry (``ffi/include/mok/comm/registry.h``). An id is
a random tag of this process (drawn from ``os.urandom`` at import, redrawn in a forked child) in the high
bits and a counter in the low bits: a positive int64, never reused in the process, different in every other
process and run (a workspace that spans processes takes process 0's id, so that its processes agree). A
persistent compilation cache is keyed by the program text, ids included, so a new process misses it and
compiles its own program rather than replaying another process's; a compiled program that reaches another
process all the same (a serialized executable, ``jax.export``, a cache shared by hand) names an id that
process does not hold, and its handler fails with an error saying so rather than binding to an unrelated
workspace: create the workspace in that process and trace the call there.

Memory. The regions are plain ``cudaMalloc`` allocations outside XLA's pool (they are exported to peer
processes through CUDA IPC and must outlive any XLA buffer), so they come out of what XLA leaves free. With
JAX's default preallocation (75% of each GPU at startup) that is a quarter of the GPU, more than a
workspace needs on a data-centre GPU (2 * ep * max_tokens * hidden_size * 2 bytes per rank, plus at ep > 1
the fused backward's (2 + top_k) * max_tokens * hidden_size * 2: 1.4 GiB at ep=8, 4096 tokens, hidden 7168,
top_k 8). Where it does not fit, :meth:`Workspace.create` raises
:class:`WorkspaceMemoryError` naming the bytes it needed, the device's free memory and the remedy: set
``XLA_CLIENT_MEM_FRACTION`` (older name ``XLA_PYTHON_CLIENT_MEM_FRACTION``) lower or
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX starts, or ask for a smaller workspace.

Lifetime. A workspace holds its memory until :meth:`Workspace.close` (or the end of its ``with`` block);
nothing frees it behind the caller's back, because compiled programs name it by id only (no reference
keeps the Python object alive while they run) and closing is collective across processes. ``close``
waits for the work already dispatched to its devices, frees the regions and removes the id from the
native registry: a program still compiled against it then fails with an error saying the workspace was
closed (retrace, e.g. after ``jax.clear_caches()``). The workspaces the layer sets up for itself
(:func:`moe_workspace`, :func:`local_workspace`, :func:`emulated_workspace`) are cached per (devices,
shape); :func:`cached_workspaces` lists them and :func:`close_cached_workspaces` closes them all when the
layer is no longer needed (the next call creates new ones). At process exit nothing is freed from Python:
no exit hook calls CUDA after JAX may have torn its backends down or runs a cross-process barrier that
could hang; the CUDA driver reclaims the memory and IPC mappings with the process, and the native registry
is never destroyed, so an XLA thread still running a handler then finds valid state.

The package's modules: ``core`` (CommConfig, the ids, Workspace), ``cache`` (the layer's own workspaces),
``errors`` (the exceptions), ``exchange`` (the handles between processes) and ``native`` (the library's workspace
functions).
"""

from mok_jax.workspace.cache import (cached_workspaces, close_cached_workspaces, emulated_workspace, local_workspace,
                                     moe_workspace)
from mok_jax.workspace.core import MAX_LOCAL_EXPERTS, MAX_RANKS, MAX_TOP_K, MODES, CommConfig, Workspace, ep_groups
from mok_jax.workspace.errors import CommError, CommTimeoutError, InvalidRoutingError, WorkspaceMemoryError
from mok_jax.workspace.native import describe_error, lookup_error

__all__ = ["CommConfig", "CommError", "CommTimeoutError", "InvalidRoutingError", "Workspace", "WorkspaceMemoryError",
           "cached_workspaces", "close_cached_workspaces", "emulated_workspace", "local_workspace", "moe_workspace",
           "MAX_LOCAL_EXPERTS", "MAX_RANKS", "MAX_TOP_K", "MODES", "describe_error", "ep_groups", "lookup_error"]
