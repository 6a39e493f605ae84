"""Symmetric communication workspaces: set up outside ``jit``, used by the comm ops inside it.

A :class:`Workspace` owns, for one layer instance, one device region per EP rank, laid out at the same
offsets on every rank (``ffi/include/mok/comm/workspace.cuh``): staging buffers, routing, flags, the
device-side epoch counters and a poison word. Each rank gets a device table of its peers' base
addresses. Two backends sit behind the same interface:

* one process driving every GPU of the EP group: per-device ``cudaMalloc`` + peer access;
* one process per GPU (``jax.distributed``): CUDA IPC handles, exchanged between processes with
  ``jax.experimental.multihost_utils.process_allgather``.

EP rank = position along the mesh's ``axis_name`` axis; with other mesh axes there are several EP
groups, each with its own peer table (one workspace covers them all).

Typical use::

    with Workspace.create(mesh, "ep", max_tokens=4096, hidden_size=7168, top_k=8, num_experts=12) as ws:
        f = jax.jit(jax.shard_map(lambda x, i, w: ops.combine(ws, *ops.dispatch(ws, x, i, w)), ...))
        y, status = f(x, topk_idx, topk_weight)
        ws.check()   # raises CommTimeoutError naming the op and the rank if a peer never came

The comm ops' defaults (direction per operator, communication SMs) come from the workspace's
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
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import _native
from mok_jax.config import KernelConfig, _require

__all__ = ["CommConfig", "CommError", "CommTimeoutError", "InvalidRoutingError", "Workspace", "WorkspaceMemoryError",
           "cached_workspaces", "close_cached_workspaces", "emulated_workspace", "local_workspace", "moe_workspace"]

MODES: dict[str, int] = {"pull": 0, "push": 1}

# Limits of the kernels (ffi/include/mok/comm/workspace.cuh).
MAX_TOP_K = 32
MAX_LOCAL_EXPERTS = 2048
MAX_RANKS = 1024
# Error codes of the poison word (workspace.cuh ErrorCode).
_TIMEOUT_CODES = {1, 2, 3, 6}


class CommError(RuntimeError):
    """A communication op failed on the device (see the message for the op and the rank)."""


class CommTimeoutError(CommError):
    """A rank waited longer than ``timeout_s`` for a peer (a peer skipped a call, or hung)."""


class WorkspaceMemoryError(CommError, MemoryError):
    """The GPU had too little free memory for a workspace (the message names the bytes and the remedy)."""


class InvalidRoutingError(CommError, ValueError):
    """A megakernel call met routing it cannot honour: an expert id outside [-1, num_experts) (-1 is a masked
    slot), or one expert named twice in a token's row past what a ring slot holds. The tokens concerned got
    NaN rows; the workspace stays usable (the error is reported once)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """Static shape of a workspace, identical on every rank, and its timeout. Calls may use fewer tokens
    (``T <= max_tokens``) and a smaller top-k (``k <= top_k``).

    kernel: the tuning the standalone comm ops (``mok_jax.ops.dispatch`` / ``combine``) take as their
        defaults: ``num_sms`` = ``kernel.comm_sms_fwd``, ``dispatch_mode`` = ``kernel.dispatch``,
        ``combine_mode`` = ``kernel.combine`` (a call's own ``mode=`` / ``num_sms=`` wins). It does not
        change the layout: the megakernel takes its KernelConfig per call (``mok_jax.ops.moe_forward``)
        and never reads this one.
    """

    ep: int
    max_tokens: int
    hidden_size: int
    top_k: int
    num_experts: int
    timeout_s: float = 10.0
    kernel: KernelConfig = KernelConfig()

    def __post_init__(self):
        _require(isinstance(self.kernel, KernelConfig),
                 f"CommConfig.kernel must be a mok_jax.KernelConfig, got {type(self.kernel).__name__}", TypeError)
        for f in ("ep", "max_tokens", "hidden_size", "top_k", "num_experts"):
            v = getattr(self, f)
            _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0,
                     f"CommConfig.{f} must be a positive int, got {v!r}")
        _require(self.ep <= MAX_RANKS, f"CommConfig.ep must be <= {MAX_RANKS}, got {self.ep}")
        _require(self.hidden_size % 8 == 0,
                 f"CommConfig.hidden_size must be a multiple of 8 (rows move in 16-byte vectors), got {self.hidden_size}")
        _require(self.top_k <= MAX_TOP_K, f"CommConfig.top_k must be <= {MAX_TOP_K}, got {self.top_k}")
        _require(self.num_experts % self.ep == 0,
                 f"CommConfig.num_experts ({self.num_experts}) must be a multiple of ep ({self.ep})")
        _require(self.num_experts // self.ep <= MAX_LOCAL_EXPERTS,
                 f"CommConfig: num_experts / ep must be <= {MAX_LOCAL_EXPERTS}, got {self.num_experts // self.ep}")
        _require(self.ep * self.max_tokens * self.top_k < 2**31, "CommConfig: ep * max_tokens * top_k must fit int32")
        _require(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0,
                 f"CommConfig.timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def num_sms(self) -> int:
        """The comm ops' default number of communication blocks: ``kernel.comm_sms_fwd``."""
        return self.kernel.comm_sms_fwd

    @property
    def dispatch_mode(self) -> str:
        """``mok_jax.ops.dispatch``'s default direction: ``kernel.dispatch``."""
        return self.kernel.dispatch

    @property
    def combine_mode(self) -> str:
        """``mok_jax.ops.combine``'s default direction: ``kernel.combine``."""
        return self.kernel.combine

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep

    def capacity(self, tokens: int, top_k: int | None = None) -> int:
        """Dropless worst case of received rows per rank: ep * T * min(k, E_local)."""
        k = self.top_k if top_k is None else top_k
        return self.ep * tokens * min(k, self.num_local_experts)

    def workspace_bytes(self) -> int:
        """Bytes of the symmetric region per rank (the two bf16 staging buffers dominate; at ep > 1 the fused
        backward's buffers add (2 + top_k) * max_tokens * hidden_size * 2)."""
        lib = _native.library()
        if lib is None:  # same formula as make_layout, without the small control regions
            backward = (2 + self.top_k) * self.max_tokens * self.hidden_size * 2 if self.ep > 1 else 0
            return 2 * self.ep * self.max_tokens * self.hidden_size * 2 + backward
        _declare(lib)
        return int(lib.mok_comm_workspace_bytes(self.ep, self.max_tokens, self.hidden_size, self.top_k,
                                                self.num_experts))


_declared = False
_declare_lock = threading.Lock()


def _declare(lib: ctypes.CDLL) -> None:
    global _declared
    with _declare_lock:
        if _declared:
            return
        i32, i64, u64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
        lib.mok_comm_workspace_bytes.argtypes = [i32] * 5
        lib.mok_comm_workspace_bytes.restype = i64
        lib.mok_comm_ipc_handle_bytes.argtypes = []
        lib.mok_comm_ipc_handle_bytes.restype = i32
        lib.mok_comm_alloc.argtypes = [i64, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_double, i32, p, p, i32]
        lib.mok_comm_alloc.restype = i32
        lib.mok_comm_connect.argtypes = [i64, i32, p, p, i32]
        lib.mok_comm_connect.restype = i32
        lib.mok_comm_release_peers.argtypes = [i64]
        lib.mok_comm_release_peers.restype = i32
        lib.mok_comm_free.argtypes = [i64]
        lib.mok_comm_free.restype = i32
        lib.mok_comm_error_word.argtypes = [i64, i32]
        lib.mok_comm_error_word.restype = u64
        lib.mok_comm_describe_error.argtypes = [u64, p, i32]
        lib.mok_comm_describe_error.restype = i32
        lib.mok_comm_lookup_error.argtypes = [i64, i32, p, i32]
        lib.mok_comm_lookup_error.restype = i32
        lib.mok_comm_read_state.argtypes = [i64, i32, p]
        lib.mok_comm_read_state.restype = i32
        lib.mok_comm_alloc_emulated.argtypes = [i64, i32, i32, i32, i32, i32, i32, ctypes.c_double, p, i32]
        lib.mok_comm_alloc_emulated.restype = i32
        lib.mok_moe_error_words.argtypes = [i64, i32, i32, p]
        lib.mok_moe_error_words.restype = i32
        lib.mok_moe_clear_call_error.argtypes = [i64, i32]
        lib.mok_moe_clear_call_error.restype = i32
        lib.mok_moe_scratch_bytes.argtypes = [i32] * 12
        lib.mok_moe_scratch_bytes.restype = i64
        lib.mok_moe_unsupported.argtypes = [i32] * 11 + [p, i32]
        lib.mok_moe_unsupported.restype = i32
        _declared = True


# Tuning knobs the workspace once took one by one; KernelConfig holds them now.
_REMOVED_KNOBS = {"num_sms": "comm_sms_fwd", "dispatch_mode": "dispatch", "combine_mode": "combine"}


def _kernel_arg(what: str, kernel, removed: dict) -> KernelConfig:
    """``kernel`` (None: the defaults) checked, after refusing the old per-knob keywords in ``removed``."""
    for name in removed:
        if name in _REMOVED_KNOBS:
            raise TypeError(f"{what}: the keyword {name}= is gone; pass kernel=KernelConfig(comm_sms_fwd=..., "
                            f"dispatch=..., combine=...) instead (its {_REMOVED_KNOBS[name]} is the old {name})")
        raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
    if kernel is None:
        return KernelConfig()
    _require(isinstance(kernel, KernelConfig),
             f"{what}: kernel must be a mok_jax.KernelConfig or None, got {type(kernel).__name__}", TypeError)
    return kernel


def _lib() -> ctypes.CDLL:
    _native.require_native("mok_jax.Workspace")
    lib = _native.library()
    assert lib is not None
    _declare(lib)
    return lib


def _host_lib() -> ctypes.CDLL:
    """The native library for the calls that touch no GPU (messages, the registry's bookkeeping)."""
    lib = _native.library()
    if lib is None:
        _native.require_native("mok_jax.workspace")  # raises, naming why the library is missing
    _declare(lib)
    return lib


def describe_error(word: int) -> str:
    """The message of a packed error word (the op, the rank that detected it, the awaited peer)."""
    lib = _lib()
    buf = ctypes.create_string_buffer(1024)
    lib.mok_comm_describe_error(ctypes.c_uint64(word), buf, len(buf))
    return buf.value.decode()


def lookup_error(ws_id: int, device_ordinal: int) -> str:
    """What a handler would say about ``ws_id`` on CUDA device ``device_ordinal``: "" when this process holds a
    connected workspace there, else the handler's error (an unknown or closed id). No CUDA call."""
    lib = _host_lib()
    buf = ctypes.create_string_buffer(2048)
    lib.mok_comm_lookup_error(int(ws_id), int(device_ordinal), buf, len(buf))
    return buf.value.decode()


# Return codes of mok_comm_alloc / mok_comm_alloc_emulated (ffi/src/workspace.cu: kAlloc*).
_ALLOC_OUT_OF_MEMORY = 2

# The environment variables that decide how much GPU memory XLA takes at startup, in the order the
# remedy names them (jaxlib's xla_client reads them; XLA_PYTHON_CLIENT_MEM_FRACTION is the older name).
_XLA_MEMORY_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                   "XLA_PYTHON_CLIENT_ALLOCATOR")


def _out_of_memory_message(where: str, needed_bytes: int, detail: str, env: Mapping[str, str] | None = None) -> str:
    """The message of a :class:`WorkspaceMemoryError`: what was needed, what CUDA said, why, and what to set."""
    env = os.environ if env is None else env
    settings = ", ".join(f"{k}={env[k]}" if env.get(k) else f"{k} unset" for k in _XLA_MEMORY_ENV)
    return (f"{where}: the workspace needs {needed_bytes} bytes ({needed_bytes / 2**20:.1f} MiB) of GPU memory, "
            f"which CUDA could not give: {detail}. The workspace is allocated with cudaMalloc, outside XLA's memory "
            f"pool, from the memory XLA leaves free, and by default JAX preallocates 75% of each GPU when it "
            f"starts. Leave room for it: before JAX starts (the first jax call in the process), set "
            f"XLA_CLIENT_MEM_FRACTION (older name XLA_PYTHON_CLIENT_MEM_FRACTION) lower, e.g. 0.6, or "
            f"XLA_PYTHON_CLIENT_PREALLOCATE=false; or ask for a smaller workspace (max_tokens, hidden_size). "
            f"This process: {settings}")


# --- workspace ids (see the module docstring) -----------------------------------------------------------
_ID_COUNTER_BITS = 24  # 16.7M workspaces per process
_ID_TAG_BITS = 63 - _ID_COUNTER_BITS  # the sign bit stays 0: ids are positive int64


def _draw_tag() -> int:
    """A random tag in [1, 2^39): two processes share one with probability 2^-39."""
    return 1 + int.from_bytes(os.urandom(8), "little") % ((1 << _ID_TAG_BITS) - 1)


_id_lock = threading.Lock()
_id_tag = _draw_tag()
_id_counter = itertools.count(1)


def _reseed_ids_after_fork() -> None:
    global _id_tag, _id_counter, _id_lock
    _id_lock = threading.Lock()
    _id_tag, _id_counter = _draw_tag(), itertools.count(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed_ids_after_fork)


def _new_id() -> int:
    """A fresh workspace id: this process's tag in the high bits, the next count in the low bits."""
    with _id_lock:
        n, tag = next(_id_counter), _id_tag
    if n >= 1 << _ID_COUNTER_BITS:
        raise CommError(f"this process has created {(1 << _ID_COUNTER_BITS) - 1} workspaces, the most its ids "
                        f"can tell apart; close and reuse workspaces instead of creating one per call")
    return (tag << _ID_COUNTER_BITS) | n


def _agreed_id(ws_id: int) -> int:
    """Process 0's ``ws_id``, on every process (collective: a workspace that spans processes must carry one
    id everywhere, its barriers are named by it). Sent as 8 bytes: without jax_enable_x64 an int64 would be
    truncated."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(int(ws_id).to_bytes(8, "little"), np.uint8).copy()
    theirs = np.asarray(multihost_utils.broadcast_one_to_all(mine), np.uint8)
    return int.from_bytes(theirs.tobytes(), "little")


def _spans_processes(devices) -> bool:
    """Whether some of ``devices`` belong to another process (then set-up and teardown are collective)."""
    me = jax.process_index()
    return any(d.process_index != me for d in devices)


def _drain(devices) -> None:
    """Wait until the work already dispatched to ``devices`` has run: each device runs its programs in
    dispatch order, so once a trivial program on it is done, every earlier call's handler has looked its
    workspace up and launched. Best effort (teardown): a device in an error state does not stop a close."""
    try:
        jax.block_until_ready([jax.device_put(np.zeros((), np.int32), d) + 1 for d in devices])
    except Exception:  # noqa: BLE001 - the error belongs to the failed program, which reported it already
        pass


@dataclasses.dataclass(frozen=True)
class _LocalRank:
    device: jax.Device
    group: int
    rank: int

    @property
    def ordinal(self) -> int:
        return int(self.device.local_hardware_id)


def ep_groups(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """Devices of the mesh as [num_groups, ep]: row g is EP group g in rank order (the position along
    ``axis_name``); the other mesh axes enumerate the groups."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(np.asarray(mesh.devices), axis, -1)
    return devs.reshape(-1, devs.shape[-1])


class Workspace:
    """A library-owned symmetric workspace for one layer instance over ``mesh[axis_name]``.

    Create it outside ``jit`` with :meth:`create`; pass the object (a static Python value) to
    ``mok_jax.ops.dispatch`` / ``combine`` inside ``shard_map``; :meth:`close` it (or use ``with``).
    """

    def __init__(self, *, ws_id: int, config: CommConfig, mesh: jax.sharding.Mesh | None, axis_name: str | None,
                 local: list[_LocalRank], emulated: bool = False):
        self.id = ws_id
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.emulated = emulated
        self._local = local
        self._closed = False

    # --- setup / teardown -------------------------------------------------------------------------
    @classmethod
    def create(cls, mesh: jax.sharding.Mesh, axis_name: str = "ep", *, max_tokens: int, hidden_size: int,
               top_k: int, num_experts: int, dtype=jnp.bfloat16, timeout_s: float = 10.0,
               kernel: KernelConfig | None = None, **removed) -> "Workspace":
        """Allocate and connect the workspace on every local device of the mesh. When the mesh spans
        processes it is collective: every process must call it, in the same order as its other workspaces
        (they agree on process 0's id). Raises :class:`WorkspaceMemoryError` when a GPU lacks the memory.

        kernel: the comm ops' default tuning (None: ``KernelConfig()``); see :class:`CommConfig`."""
        kernel = _kernel_arg("Workspace.create", kernel, removed)
        if jnp.dtype(dtype) != jnp.bfloat16:
            raise NotImplementedError(f"Workspace: only bfloat16 rows are supported, got {jnp.dtype(dtype)}")
        groups = ep_groups(mesh, axis_name)
        config = CommConfig(ep=groups.shape[1], max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k,
                            num_experts=num_experts, timeout_s=float(timeout_s), kernel=kernel)
        lib = _lib()
        for d in groups.flat:
            if d.platform != "gpu":
                raise ValueError(f"Workspace needs GPU devices; the mesh holds {d.platform} device {d}")
        me = jax.process_index()
        multi = _spans_processes(groups.flat)
        ws_id = _agreed_id(_new_id()) if multi else _new_id()
        hbytes = int(lib.mok_comm_ipc_handle_bytes())
        handles = np.zeros((*groups.shape, hbytes), np.uint8)
        present = np.zeros(groups.shape, np.int32)
        local: list[_LocalRank] = []
        err = ctypes.create_string_buffer(1024)
        try:
            failure: CommError | None = None
            try:
                for g, row in enumerate(groups):
                    for r, d in enumerate(row):
                        if d.process_index != me:
                            continue
                        lr = _LocalRank(d, g, r)
                        out = np.zeros(hbytes, np.uint8)
                        rc = lib.mok_comm_alloc(ws_id, g, lr.ordinal, r, config.ep, config.max_tokens,
                                                config.hidden_size, config.top_k, config.num_experts,
                                                config.timeout_s, int(multi), out.ctypes.data, err, len(err))
                        where = f"Workspace.create: rank {r} of group {g} on {d}"
                        if rc == _ALLOC_OUT_OF_MEMORY:
                            raise WorkspaceMemoryError(_out_of_memory_message(where, config.workspace_bytes(),
                                                                              err.value.decode()))
                        if rc != 0:
                            raise CommError(f"{where}: {err.value.decode()}")
                        local.append(lr)
                        handles[g, r] = out
                        present[g, r] = 1
            except CommError as e:
                failure = e
            if multi:
                from jax.experimental import multihost_utils

                # Every process joins the exchange, also one whose allocation failed: its peers then raise
                # instead of waiting for it forever.
                all_handles, all_present, all_failed = multihost_utils.process_allgather(
                    (handles, present, np.int32(failure is not None)))
                failed = [int(i) for i in np.flatnonzero(np.asarray(all_failed))]
                if failure is None and failed:
                    failure = CommError(f"Workspace.create: process(es) {failed} could not allocate their EP ranks "
                                        f"(their own error says why); no rank was connected")
                if failure is None:
                    all_present = np.asarray(all_present)
                    all_handles = np.asarray(all_handles)
                    owner = np.argmax(all_present, axis=0)  # [G, ep]: the process that holds each rank
                    if not np.all(all_present.sum(axis=0) == 1):
                        raise CommError("Workspace.create: every EP rank must be held by exactly one process")
                    g_idx, r_idx = np.indices(groups.shape)
                    handles = np.ascontiguousarray(all_handles[owner, g_idx, r_idx])
            if failure is not None:
                raise failure
            for lr in local:
                table = np.ascontiguousarray(handles[lr.group])
                rc = lib.mok_comm_connect(ws_id, lr.ordinal, table.ctypes.data, err, len(err))
                if rc != 0:
                    raise CommError(f"Workspace.create: connecting rank {lr.rank} of group {lr.group}: "
                                    f"{err.value.decode()}")
            if multi:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"mok_comm_workspace_{ws_id}_connected")
        except BaseException:
            lib.mok_comm_release_peers(ws_id)
            lib.mok_comm_free(ws_id)
            raise
        return cls(ws_id=ws_id, config=config, mesh=mesh, axis_name=axis_name, local=local)

    @classmethod
    def create_emulated(cls, device: jax.Device, ep: int, *, max_tokens: int, hidden_size: int, top_k: int,
                        num_experts: int, timeout_s: float = 10.0, kernel: KernelConfig | None = None,
                        **removed) -> "Workspace":
        """All ``ep`` ranks of one EP group on one GPU, each with its own region, connected to each other:
        the one-GPU emulation (docs/design.md, "EP on one GPU (emulation)"). Only the megakernel runs on
        it (``mok_jax.emulation``); the standalone comm ops need one rank per device, so ``kernel`` (kept
        in :class:`CommConfig` like :meth:`create`'s) sets nothing that runs here."""
        kernel = _kernel_arg("Workspace.create_emulated", kernel, removed)
        config = CommConfig(ep=ep, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k,
                            num_experts=num_experts, timeout_s=float(timeout_s), kernel=kernel)
        if device.platform != "gpu":
            raise ValueError(f"Workspace.create_emulated needs a GPU device, got {device}")
        lib = _lib()
        ws_id = _new_id()
        err = ctypes.create_string_buffer(1024)
        ordinal = int(device.local_hardware_id)
        rc = lib.mok_comm_alloc_emulated(ws_id, ordinal, ep, max_tokens, hidden_size, top_k, num_experts,
                                         config.timeout_s, err, len(err))
        if rc != 0:
            lib.mok_comm_release_peers(ws_id)
            lib.mok_comm_free(ws_id)
            where = f"Workspace.create_emulated on {device}"
            if rc == _ALLOC_OUT_OF_MEMORY:  # all ep regions live on this one device
                raise WorkspaceMemoryError(_out_of_memory_message(where, ep * config.workspace_bytes(),
                                                                  err.value.decode()))
            raise CommError(f"{where}: {err.value.decode()}")
        return cls(ws_id=ws_id, config=config, mesh=None, axis_name=None,
                   local=[_LocalRank(device, 0, r) for r in range(ep)], emulated=True)

    def close(self) -> None:
        """Free every device allocation and remove the id from the native registry; a program still
        compiled against this workspace then fails with an error saying it was closed. Waits first for the
        work already dispatched to the local devices. Idempotent; drops the workspace from the layer's
        cache. Collective across processes when the mesh spans processes, like :meth:`create`."""
        if self._closed:
            return
        self._closed = True
        _forget(self)
        lib = _lib()
        _drain({lr.device for lr in self._local})
        lib.mok_comm_release_peers(self.id)
        if self.spans_processes:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"mok_comm_workspace_{self.id}_released")
        lib.mok_comm_free(self.id)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def spans_processes(self) -> bool:
        """Whether the workspace's mesh holds devices of other processes (its create and close are collective)."""
        return self.mesh is not None and _spans_processes(np.asarray(self.mesh.devices).flat)

    @property
    def device_kind(self) -> str | None:
        """The device kind of this process's ranks (what tuned tables are keyed by), None if it holds none."""
        return self._local[0].device.device_kind if self._local else None

    def require_open(self, what: str) -> None:
        if self._closed:
            raise CommError(f"{what}: workspace {self.id} is closed; create a new one (moe_workspace, "
                            f"Workspace.create) and pass that")

    # --- health -----------------------------------------------------------------------------------
    def error_words(self) -> dict[int, int]:
        """{EP rank: packed error word} for this process's ranks (0 = healthy); no device sync."""
        lib = _lib()
        return {lr.rank + lr.group * self.config.ep: int(lib.mok_comm_error_word(self.id, lr.ordinal))
                for lr in self._local}

    def check(self) -> None:
        """Raise if any local rank recorded an error: CommTimeoutError / CommError for a poisoned workspace
        (a timeout: a peer skipped a call or hung; fatal, close the workspace), InvalidRoutingError for a
        megakernel call with bad routing (reported once, then cleared). Call it after the results of the
        ops are ready (``jax.block_until_ready``)."""
        self.require_open("Workspace.check")
        lib = _lib()
        words = np.zeros(2, np.uint64)
        for lr in self._local:
            if lib.mok_moe_error_words(self.id, lr.ordinal, lr.rank, words.ctypes.data) != 0:
                continue
            poison, call = int(words[0]), int(words[1])
            where = f"[workspace {self.id}, EP group {lr.group}, rank {lr.rank}, device {lr.device}]"
            if poison:
                exc = CommTimeoutError if (poison & 0xFF) in _TIMEOUT_CODES else CommError
                raise exc(f"{describe_error(poison)} {where}")
            if call:
                lib.mok_moe_clear_call_error(self.id, lr.ordinal)
                raise InvalidRoutingError(f"{describe_error(call)} {where}")

    def device_state(self) -> dict[int, dict[str, int]]:
        """Diagnostics (synchronous device read, outside jit): per local EP rank, the device-side
        epochs, the device poison word and the rows the last dispatch received."""
        lib = _lib()
        out = {}
        for lr in self._local:
            buf = np.zeros(4, np.uint64)
            if lib.mok_comm_read_state(self.id, lr.ordinal, buf.ctypes.data) != 0:
                raise CommError(f"Workspace.device_state: cannot read rank {lr.rank} on {lr.device}")
            out[lr.rank + lr.group * self.config.ep] = {
                "dispatch_epoch": int(buf[0]), "combine_epoch": int(buf[1]), "error_word": int(buf[2]),
                "total_rows": int(buf[3:4].view(np.int64)[0]),
            }
        return out

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Workspace(id={self.id}, {self.config}, {state})"

    def __hash__(self) -> int:  # static argument of jitted functions
        return hash(("mok_workspace", self.id))

    def __eq__(self, other) -> bool:
        return isinstance(other, Workspace) and other.id == self.id


# --- workspaces the layer sets up for itself, once per (devices, shape) --------------------------------

_cache: dict[tuple, Workspace] = {}
_superseded: list[Workspace] = []  # replaced in _cache by a larger one, still open: compiled programs may name them
_cache_lock = threading.RLock()  # Workspace.close (which takes it) may run while a caller holds it


def _cached(key: tuple, max_tokens: int, make) -> Workspace:
    """The cached workspace of ``key`` that holds at least ``max_tokens`` tokens per rank, else a new one
    (an older, smaller one stays open, listed in :func:`cached_workspaces`: compiled programs may still name
    it)."""
    with _cache_lock:
        ws = _cache.get(key)
        if ws is None or ws.closed or ws.config.max_tokens < max_tokens:
            new = make()
            if ws is not None and not ws.closed:
                _superseded.append(ws)
            _cache[key] = ws = new
        return ws


def _forget(ws: Workspace) -> None:
    """Drop ``ws`` from the layer's cache (it is being closed)."""
    with _cache_lock:
        for key in [k for k, v in _cache.items() if v is ws]:
            del _cache[key]
        _superseded[:] = [w for w in _superseded if w is not ws]


def cached_workspaces() -> list[Workspace]:
    """The open workspaces the layer set up for itself (:func:`moe_workspace`, :func:`local_workspace`,
    :func:`emulated_workspace`), those still cached and those a larger one replaced, sorted by id."""
    with _cache_lock:
        return sorted({id(w): w for w in [*_cache.values(), *_superseded] if not w.closed}.values(),
                      key=lambda w: w.id)


def close_cached_workspaces() -> int:
    """Close every workspace of :func:`cached_workspaces` (when the layer is no longer needed) and return
    how many. The next layer call sets up new ones; a program compiled against a closed one fails with an
    error saying so: call ``jax.clear_caches()`` too if the same jitted functions will run again.
    Collective across processes when a workspace spans processes: every process calls it (they close in id
    order, the same on every process for the workspaces they share: those carry process 0's ids)."""
    victims = cached_workspaces()
    for ws in victims:
        ws.close()
    return len(victims)


def moe_workspace(mesh: jax.sharding.Mesh, axis_name: str, *, max_tokens: int, hidden_size: int, top_k: int,
                  num_experts: int, timeout_s: float = 10.0, kernel: KernelConfig | None = None,
                  **removed) -> Workspace:
    """The workspace the megakernel uses over ``mesh[axis_name]`` for this shape (created on first use,
    outside jit: call it before tracing, as ``mok_jax.expert_parallel_moe`` does).

    kernel only sets the standalone comm ops' defaults (:class:`CommConfig`): the megakernel takes its
    resolved KernelConfig per call (``mok_jax.ops.moe_forward``), so its callers leave it None and share one
    workspace; each other kernel config gets a workspace of its own."""
    kernel = _kernel_arg("moe_workspace", kernel, removed)
    key = ("mesh", tuple(d.id for d in np.asarray(mesh.devices).flat), tuple(mesh.axis_names),
           tuple(np.asarray(mesh.devices).shape), axis_name, hidden_size, top_k, num_experts, timeout_s, kernel)
    return _cached(key, max_tokens, lambda: Workspace.create(
        mesh, axis_name, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k, num_experts=num_experts,
        timeout_s=timeout_s, kernel=kernel))


def local_workspace(*, max_tokens: int, hidden_size: int, top_k: int, num_experts: int,
                    kernel: KernelConfig | None = None, **removed) -> Workspace:
    """An EP-1 workspace on every local GPU (each its own group): what ``mok_jax.moe`` uses without an
    expert-parallel axis (the kernel then needs only its flags, epoch and error words). kernel: as for
    :func:`moe_workspace`."""
    kernel = _kernel_arg("local_workspace", kernel, removed)
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        raise CommError("the megakernel needs a CUDA GPU; this JAX sees none")
    mesh = jax.sharding.Mesh(np.asarray(gpus).reshape(len(gpus), 1), ("local", "ep"))
    return moe_workspace(mesh, "ep", max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k,
                         num_experts=num_experts, kernel=kernel)


def emulated_workspace(device: jax.Device, ep: int, *, max_tokens: int, hidden_size: int, top_k: int,
                       num_experts: int, timeout_s: float = 10.0, kernel: KernelConfig | None = None,
                       **removed) -> Workspace:
    """The cached emulated workspace of ``ep`` ranks on ``device`` for this shape. kernel: as for
    :func:`moe_workspace` (only the megakernel runs on an emulated workspace, with its own per-call config)."""
    kernel = _kernel_arg("emulated_workspace", kernel, removed)
    key = ("emulated", device.id, ep, hidden_size, top_k, num_experts, timeout_s, kernel)
    return _cached(key, max_tokens, lambda: Workspace.create_emulated(
        device, ep, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k, num_experts=num_experts,
        timeout_s=timeout_s, kernel=kernel))
