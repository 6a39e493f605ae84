"""The symmetric workspace (see the package's docstring): its static shape (:class:`CommConfig`), its ids, and
:class:`Workspace`, which allocates, connects, checks and closes the device regions."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax import _native
from mok_jax.config import KernelConfig, _require
from mok_jax.workspace import exchange
from mok_jax.workspace.descriptors import DescriptorServer, fetch_descriptors
from mok_jax.workspace.errors import (_ALLOC_OUT_OF_MEMORY, _TIMEOUT_CODES, CommError, CommTimeoutError,
                                      InvalidRoutingError, WorkspaceMemoryError, _out_of_memory_message)
from mok_jax.workspace.native import _declare, _lib, describe_error

__all__ = ["CommConfig", "MODES", "Workspace", "ep_groups"]

MODES: dict[str, int] = {"pull": 0, "push": 1}

# Limits of the kernels (ffi/include/mok/comm/workspace.cuh).
MAX_TOP_K = 32
MAX_LOCAL_EXPERTS = 2048
MAX_RANKS = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """Static shape of a workspace, identical on every rank, and its timeout. Calls may use fewer tokens
    (``T <= max_tokens``) and a smaller top-k (``k <= top_k``).

    kernel: the tuning the standalone comm ops (``mok_jax.ops.dispatch`` / ``combine``) take as their
        defaults: ``num_sms`` = ``kernel.comm_items_fwd``, ``dispatch_mode`` = ``kernel.dispatch``,
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
        """The comm ops' default number of communication blocks: ``kernel.comm_items_fwd``."""
        return self.kernel.comm_items_fwd

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
        """Bytes of the symmetric region per rank (the two bf16 row buffers, dispatch_rows and combine_rows,
        dominate; at ep > 1 the fused backward's buffers add (2 + top_k) * max_tokens * hidden_size * 2)."""
        lib = _native.library()
        if lib is None:  # same formula as make_layout, without the small control regions
            backward = (2 + self.top_k) * self.max_tokens * self.hidden_size * 2 if self.ep > 1 else 0
            return 2 * self.ep * self.max_tokens * self.hidden_size * 2 + backward
        _declare(lib)
        return int(lib.mok_comm_workspace_bytes(self.ep, self.max_tokens, self.hidden_size, self.top_k,
                                                self.num_experts))



# Tuning knobs the workspace once took one by one; KernelConfig holds them now.
_REMOVED_KNOBS = {"num_sms": "comm_items_fwd", "dispatch_mode": "dispatch", "combine_mode": "combine"}


def _kernel_arg(what: str, kernel, removed: dict) -> KernelConfig:
    """``kernel`` (None: the defaults) checked, after refusing the old per-knob keywords in ``removed``."""
    for name in removed:
        if name in _REMOVED_KNOBS:
            raise TypeError(f"{what}: the keyword {name}= is gone; pass kernel=KernelConfig(comm_items_fwd=..., "
                            f"dispatch=..., combine=...) instead (its {_REMOVED_KNOBS[name]} is the old {name})")
        raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
    if kernel is None:
        return KernelConfig()
    _require(isinstance(kernel, KernelConfig),
             f"{what}: kernel must be a mok_jax.KernelConfig or None, got {type(kernel).__name__}", TypeError)
    return kernel



# Called with a workspace that is being closed, before its memory is freed (the layer's cache registers one).
_on_close: list[Callable[["Workspace"], None]] = []


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


def _agreed_id(ws_id: int, processes=None, timeout_s: float = exchange.EXCHANGE_TIMEOUT_S) -> int:
    """The ``ws_id`` of the lowest of ``processes`` (default: every process), on each of them: a workspace that
    spans processes must carry one id everywhere, its keys and barriers are named by it. Through jax.distributed's
    key-value store, bounded by ``timeout_s`` (exchange.agree_id)."""
    procs = range(jax.process_count()) if processes is None else processes
    return exchange.agree_id(ws_id, process=jax.process_index(), processes=procs, timeout_s=timeout_s)


def _fingerprint(config: CommConfig, groups_shape: tuple, handle_bytes: int, memory: str = "ipc") -> str:
    """What every process of a workspace must agree on, as the handle exchange compares it."""
    return (f"ep={config.ep} groups={groups_shape[0]} max_tokens={config.max_tokens} "
            f"hidden_size={config.hidden_size} top_k={config.top_k} num_experts={config.num_experts} "
            f"timeout_s={config.timeout_s:g} handle_bytes={handle_bytes} memory={memory}")


# The memory behind a workspace region (ffi/src/workspace_memory.h): "ipc", cudaMalloc exported as CUDA IPC handles
# (one host); "vmm", CUDA virtual memory management exported as FABRIC handles where the driver supports them and an
# IMEX channel is open (the form that crosses the hosts of an NVL72 rack), else as POSIX file descriptors (one host).
MEMORY_KINDS = {"ipc": 0, "vmm": 1}


def _memory_arg(what: str, memory) -> int:
    if not isinstance(memory, str) or memory not in MEMORY_KINDS:
        raise ValueError(f"{what}: memory must be one of {sorted(MEMORY_KINDS)}, got {memory!r}")
    return MEMORY_KINDS[memory]


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


_DESCRIPTOR_OWN, _DESCRIPTOR_PEER = 1, 2  # mok_comm_handle_descriptor


def _serve_descriptors(lib, ws_id: int, handles: np.ndarray, local) -> DescriptorServer | None:
    """A server of this process's ranks' POSIX descriptors (memory="vmm" without FABRIC), None when it has none."""
    fd = ctypes.c_int32()
    fds = {}
    for lr in local:
        if lib.mok_comm_handle_descriptor(handles[lr.group, lr.rank].ctypes.data, ctypes.byref(fd)) == _DESCRIPTOR_OWN:
            fds[f"{lr.group},{lr.rank}"] = fd.value
    return DescriptorServer(fds, label=f"workspace/{ws_id}") if fds else None


def _take_descriptors(lib, handles: np.ndarray, sockets: dict, wanted_groups, timeout_s: float) -> list[int]:
    """Receive, from the processes that serve them, the POSIX descriptors of the other processes' ranks in
    ``wanted_groups`` and make their handles name the received descriptors (the native connect then duplicates
    those, needing no ptrace permission over their exporters). Returns the received descriptors (to close once
    connected). A socket this process cannot reach (another host or network namespace) leaves its ranks' handles to
    the native path (``pidfd_getfd``, or its error)."""
    fd = ctypes.c_int32()
    by_socket: dict[str, list[tuple[int, int]]] = {}
    for (g, r), address in sorted(sockets.items()):
        if g in wanted_groups and address and lib.mok_comm_handle_descriptor(
                handles[g, r].ctypes.data, ctypes.byref(fd)) == _DESCRIPTOR_PEER:
            by_socket.setdefault(address, []).append((g, r))
    taken: list[int] = []
    try:
        for address, grs in by_socket.items():
            try:
                got = fetch_descriptors(address, [f"{g},{r}" for g, r in grs], timeout_s=timeout_s,
                                        peer=f"the process holding (group, rank) {grs}")
            except ConnectionError:
                continue
            taken.extend(got.values())
            for g, r in grs:
                if lib.mok_comm_handle_name_local_descriptor(handles[g, r].ctypes.data, got[f"{g},{r}"]) != 0:
                    raise CommError(f"Workspace.create: (group, rank) ({g}, {r}) sent a descriptor for a handle "
                                    f"that names none")
    except BaseException:
        for d in taken:
            os.close(d)
        raise
    return taken


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
                 local: list[_LocalRank], emulated: bool = False, memory_kind: str = "ipc"):
        self.id = ws_id
        self.memory_kind = memory_kind  # what create() was asked for ("ipc" or "vmm"); memory says what it got
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
               kernel: KernelConfig | None = None, memory: str = "ipc", **removed) -> "Workspace":
        """Allocate and connect the workspace on every local device of the mesh. When the mesh spans
        processes it is collective: every process must call it, in the same order as its other workspaces
        (they agree on process 0's id). Raises :class:`WorkspaceMemoryError` when a GPU lacks the memory.

        kernel: the comm ops' default tuning (None: ``KernelConfig()``); see :class:`CommConfig`.
        memory: what backs each rank's region (``MEMORY_KINDS``): "ipc" (cudaMalloc and CUDA IPC handles, one host)
        or "vmm" (CUDA VMM: FABRIC handles where the driver and an IMEX channel allow, else POSIX descriptors
        within one host). Every process must pass the same; :attr:`memory` says what was used."""
        kernel = _kernel_arg("Workspace.create", kernel, removed)
        memory_kind = _memory_arg("Workspace.create", memory)
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
        procs = sorted({d.process_index for d in groups.flat})
        setup_s = max(config.timeout_s, exchange.EXCHANGE_TIMEOUT_S)  # the set-up's deadline across processes
        ws_id = _agreed_id(_new_id(), procs, setup_s) if multi else _new_id()
        hbytes = int(lib.mok_comm_handle_bytes())
        handles = np.zeros((*groups.shape, hbytes), np.uint8)
        local: list[_LocalRank] = []
        err = ctypes.create_string_buffer(1024)
        server: DescriptorServer | None = None
        taken: list[int] = []
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
                                                config.timeout_s, memory_kind, int(multi), out.ctypes.data, err,
                                                len(err))
                        where = f"Workspace.create: rank {r} of group {g} on {d}"
                        if rc == _ALLOC_OUT_OF_MEMORY:
                            raise WorkspaceMemoryError(_out_of_memory_message(where, config.workspace_bytes(),
                                                                              err.value.decode()))
                        if rc != 0:
                            raise CommError(f"{where}: {err.value.decode()}")
                        local.append(lr)
                        handles[g, r] = out
            except CommError as e:
                failure = e
            sockets: dict[tuple[int, int], str] = {}
            if multi:
                if failure is None and memory == "vmm":
                    server = _serve_descriptors(lib, ws_id, handles, local)
                # Every process publishes its record, also one whose allocation failed: its peers then raise
                # instead of waiting for it; one that never publishes is named after the exchange's deadline.
                theirs = exchange.exchange_handles(
                    ws_id, process=me, processes=procs, fingerprint=_fingerprint(config, groups.shape, hbytes, memory),
                    handles={(lr.group, lr.rank): handles[lr.group, lr.rank].tobytes() for lr in local},
                    failure=None if failure is None else str(failure),
                    ranks=[(g, r) for g in range(groups.shape[0]) for r in range(groups.shape[1])],
                    timeout_s=setup_s, descriptor_socket="" if server is None else server.address, sockets=sockets)
                for (g, r), h in theirs.items():
                    handles[g, r] = np.frombuffer(h, np.uint8)
            if failure is not None:
                raise failure
            if multi:  # every process read every record and found it sound, or each raises: none connects alone
                exchange.barrier(f"mok_comm_workspace_{ws_id}_exchanged", processes=procs, timeout_s=setup_s)
                if memory == "vmm":
                    taken = _take_descriptors(lib, handles, sockets, {lr.group for lr in local}, setup_s)
            for lr in local:
                table = np.ascontiguousarray(handles[lr.group])
                rc = lib.mok_comm_connect(ws_id, lr.ordinal, table.ctypes.data, err, len(err))
                if rc != 0:
                    raise CommError(f"Workspace.create: connecting rank {lr.rank} of group {lr.group}: "
                                    f"{err.value.decode()}")
            if multi:
                exchange.barrier(f"mok_comm_workspace_{ws_id}_connected", processes=procs, timeout_s=setup_s)
                exchange.forget(ws_id, me)  # every process has read it
        except BaseException:
            lib.mok_comm_release_peers(ws_id)
            lib.mok_comm_free(ws_id)
            raise
        finally:  # every process has connected (or this one failed): no descriptor is asked for any more
            if server is not None:
                server.close()
            for d in taken:  # the native connect duplicated each
                os.close(d)
        return cls(ws_id=ws_id, config=config, mesh=mesh, axis_name=axis_name, local=local, memory_kind=memory)

    @classmethod
    def create_emulated(cls, device: jax.Device, ep: int, *, max_tokens: int, hidden_size: int, top_k: int,
                        num_experts: int, timeout_s: float = 10.0, kernel: KernelConfig | None = None,
                        memory: str = "ipc", **removed) -> "Workspace":
        """All ``ep`` ranks of one EP group on one GPU, each with its own region, connected to each other:
        the one-GPU emulation (docs/design.md, "EP on one GPU (emulation)"). Only the megakernel runs on
        it (``mok_jax.emulation``); the standalone comm ops need one rank per device, so ``kernel`` (kept
        in :class:`CommConfig` like :meth:`create`'s) sets nothing that runs here. memory: as :meth:`create`'s;
        with "vmm" each rank maps its peers' regions through their exported handles, the path another process
        takes, so one GPU runs it."""
        kernel = _kernel_arg("Workspace.create_emulated", kernel, removed)
        memory_kind = _memory_arg("Workspace.create_emulated", memory)
        config = CommConfig(ep=ep, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k,
                            num_experts=num_experts, timeout_s=float(timeout_s), kernel=kernel)
        if device.platform != "gpu":
            raise ValueError(f"Workspace.create_emulated needs a GPU device, got {device}")
        lib = _lib()
        ws_id = _new_id()
        err = ctypes.create_string_buffer(1024)
        ordinal = int(device.local_hardware_id)
        rc = lib.mok_comm_alloc_emulated(ws_id, ordinal, ep, max_tokens, hidden_size, top_k, num_experts,
                                         config.timeout_s, memory_kind, err, len(err))
        if rc != 0:
            lib.mok_comm_release_peers(ws_id)
            lib.mok_comm_free(ws_id)
            where = f"Workspace.create_emulated on {device}"
            if rc == _ALLOC_OUT_OF_MEMORY:  # all ep regions live on this one device
                raise WorkspaceMemoryError(_out_of_memory_message(where, ep * config.workspace_bytes(),
                                                                  err.value.decode()))
            raise CommError(f"{where}: {err.value.decode()}")
        return cls(ws_id=ws_id, config=config, mesh=None, axis_name=None,
                   local=[_LocalRank(device, 0, r) for r in range(ep)], emulated=True, memory_kind=memory)

    def close(self) -> None:
        """Free every device allocation and remove the id from the native registry; a program still
        compiled against this workspace then fails with an error saying it was closed. Waits first for the
        work already dispatched to the local devices. Idempotent; drops the workspace from the layer's
        cache. Collective across processes when the mesh spans processes, like :meth:`create`: every process must
        close it, within the set-up's deadline, or each that did raises CommError naming the barrier."""
        if self._closed:
            return
        self._closed = True
        for hook in _on_close:  # the layer's cache drops it (mok_jax.workspace.cache)
            hook(self)
        lib = _lib()
        _drain({lr.device for lr in self._local})
        lib.mok_comm_release_peers(self.id)
        if self.spans_processes:
            # Every process has unmapped its peers before any frees its own regions; bounded like the set-up. A
            # process that never comes: a VMM region is freed all the same (each process that maps it holds its own
            # reference to the memory), a cudaMalloc one stays allocated until this process exits (the late peer may
            # still map it).
            vmm = self.memory_kind == "vmm"
            procs = sorted({d.process_index for d in np.asarray(self.mesh.devices).flat})
            try:
                exchange.barrier(
                    f"mok_comm_workspace_{self.id}_released", processes=procs,
                    timeout_s=max(self.config.timeout_s, exchange.EXCHANGE_TIMEOUT_S), what="Workspace.close",
                    consequence="its peer mappings are released and " + (
                        "its VMM regions freed (a late peer keeps its own reference)" if vmm else
                        "its regions stay allocated until this process exits (a peer may still map them)"))
            except CommError:
                if vmm:
                    lib.mok_comm_free(self.id)
                raise
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
    def memory(self) -> str | None:
        """What backs this process's first rank, in words: "ipc", "vmm (FABRIC handles)" or "vmm (POSIX descriptors;
        why not FABRIC)", then how many peer regions it maps through their handles; None when it holds no rank or
        is closed."""
        if not self._local or self._closed:
            return None
        buf = ctypes.create_string_buffer(512)
        if _lib().mok_comm_memory_info(self.id, self._local[0].ordinal, buf, len(buf)) != 0:
            return None
        return buf.value.decode()

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


