"""The workspaces the layer sets up for itself, cached once per (devices, shape): :func:`moe_workspace`,
:func:`local_workspace`, :func:`emulated_workspace`, and :func:`cached_workspaces` /
:func:`close_cached_workspaces` to list and close them."""

from __future__ import annotations

import threading

import jax
import numpy as np

from mok_jax.config import KernelConfig
from mok_jax.workspace.core import Workspace, _kernel_arg, _memory_arg, _on_close
from mok_jax.workspace.errors import CommError

__all__ = ["cached_workspaces", "close_cached_workspaces", "emulated_workspace", "local_workspace", "moe_workspace"]

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
                  num_experts: int, timeout_s: float = 10.0, kernel: KernelConfig | None = None, memory: str = "ipc",
                  **removed) -> Workspace:
    """The workspace the megakernel uses over ``mesh[axis_name]`` for this shape (created on first use,
    outside jit: call it before tracing, as ``mok_jax.expert_parallel_moe`` does).

    kernel only sets the standalone comm ops' defaults (:class:`CommConfig`): the megakernel takes its
    resolved KernelConfig per call (``mok_jax.ops.moe_forward``), so its callers leave it None and share one
    workspace; each other kernel config gets a workspace of its own. memory: what backs the regions, as
    :meth:`Workspace.create`'s ("ipc" or "vmm"); each kind gets a workspace of its own."""
    kernel = _kernel_arg("moe_workspace", kernel, removed)
    _memory_arg("moe_workspace", memory)
    key = ("mesh", tuple(d.id for d in np.asarray(mesh.devices).flat), tuple(mesh.axis_names),
           tuple(np.asarray(mesh.devices).shape), axis_name, hidden_size, top_k, num_experts, timeout_s, kernel,
           memory)
    return _cached(key, max_tokens, lambda: Workspace.create(
        mesh, axis_name, max_tokens=max_tokens, hidden_size=hidden_size, top_k=top_k, num_experts=num_experts,
        timeout_s=timeout_s, kernel=kernel, memory=memory))


def local_workspace(*, max_tokens: int, hidden_size: int, top_k: int, num_experts: int,
                    kernel: KernelConfig | None = None, **removed) -> Workspace:
    """An EP-1 workspace on every local GPU (each its own group): what ``mok_jax.moe`` uses without an
    expert-parallel axis (the kernel then needs only its stamps, epoch and error words). kernel: as for
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


_on_close.append(_forget)
