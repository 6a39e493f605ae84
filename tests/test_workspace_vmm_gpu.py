"""The workspace on CUDA VMM memory (``memory="vmm"``: ffi/src/workspace_memory.cu) against the cudaMalloc one, on one
GPU through the emulation: with "vmm" every emulated rank maps its peers' regions through their exported handles
(cuMemExportToShareableHandle, cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess), the path a rank of another
process takes, so the forward megakernel's and the fused backward's communication run over imported mappings here.

- The forward y and every gradient of the fused EP backward have the bits of the same calls on a cudaMalloc ("ipc")
  workspace, at EP 2 and 4, on fresh random inputs (the seed is printed; MOK_TEST_SEED draws them again).
- The data path alone (identity experts) equals the numpy oracle bit for bit on the VMM workspace.
- The workspace says what it used: "vmm (FABRIC handles)" or "vmm (POSIX descriptors; why not FABRIC)", and that
  each rank maps its ep - 1 peers through their handles (not through the peers' own pointers).
- Closing it unmaps and frees everything: the native registry no longer knows it, the process holds no more file
  descriptors than before (the exported ones are closed), a new VMM workspace of the same shape follows, and a bad
  ``memory`` is a ValueError naming the argument before anything is allocated.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import numpy as np
import pytest
from helpers import layer_problem, layer_shape, module_seed

from mok_jax.config import KernelConfig
from mok_jax.emulation import emulated_moe, emulated_moe_backward
from mok_jax.reference.comm import moe_identity_numpy
from mok_jax.workspace import Workspace

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_kernels")]

_SEED = module_seed(__name__)
_problem = functools.partial(layer_problem, _SEED)


def _workspace(memory: str, ep: int, tokens: int, shape) -> Workspace:
    return Workspace.create_emulated(jax.devices("gpu")[0], ep, max_tokens=tokens, hidden_size=shape.hidden_size,
                                     top_k=shape.top_k, num_experts=shape.num_experts, memory=memory)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("ep", [2, 4])
def test_vmm_workspace_gives_the_bits_of_the_cudamalloc_one(ep):
    shape = layer_shape(16, 256, 128, 4)
    tokens = 192
    x, idx, w, W = _problem(f"vmm{ep}", shape, tokens, "zipf", ranks=ep)
    dy = (np.asarray(x, np.float32)[::-1] * 0.5).astype(x.dtype)  # not x itself, not zeros
    results = {}
    for memory in ("ipc", "vmm"):
        with _workspace(memory, ep, tokens, shape) as ws:
            if memory == "vmm":
                assert ws.memory.startswith("vmm (") and f"; {ep - 1} peer region(s) mapped" in ws.memory, ws.memory
            else:
                assert ws.memory == "ipc; 0 peer region(s) mapped through handles", ws.memory
            y, status = emulated_moe(x, idx, w, W, ep=ep, workspace=ws)
            assert not np.asarray(status).any(), f"{memory}: status {np.asarray(status)}"
            grads = emulated_moe_backward(x, idx, w, W, dy, ep=ep, workspace=ws, fused=True)
            results[memory] = [_bits(y)] + [_bits(g) for g in jax.tree.leaves(grads)]
    assert len(results["ipc"]) == len(results["vmm"]) > 3
    names = ["y"] + [f"gradient {i}" for i in range(len(results["ipc"]) - 1)]
    for name, a, b in zip(names, results["ipc"], results["vmm"]):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        rows = np.where((a != b).reshape(a.shape[0], -1).any(1))[0]
        assert rows.size == 0, f"EP {ep}: {name} differs on the VMM workspace in rows {rows[:8].tolist()}"


def test_vmm_workspace_data_path_matches_the_oracle():
    shape = layer_shape(16, 264, 128, 10)
    ep, tokens = 4, 300
    x, idx, w, W = _problem("vmm-identity", shape, tokens, "zipf", ranks=ep)
    idx = idx.at[5, 3].set(-1)  # a masked slot
    with _workspace("vmm", ep, tokens, shape) as ws:
        y, status = emulated_moe(x, idx, w, W, ep=ep, workspace=ws, identity_experts=True,
                                 kernel=KernelConfig(granularity=512, comm_items_fwd=3))
        assert not np.asarray(status).any(), f"status {np.asarray(status)}"
    want = moe_identity_numpy(np.asarray(x), np.asarray(idx), np.asarray(w), 16)
    diff = np.where((_bits(y) != want.view(np.uint16)).any(1))[0]
    assert diff.size == 0, f"{diff.size} rows differ from the oracle, first {diff[:8].tolist()}"


def test_vmm_workspace_closes_and_a_new_one_follows():
    from mok_jax.workspace import native

    lib = native._host_lib()
    shape = layer_shape(8, 128, 128, 2)
    fds = len(os.listdir("/proc/self/fd"))
    buf = ctypes.create_string_buffer(512)
    for _ in range(3):  # unmapped and freed each time: the same shape again, no error
        ws = _workspace("vmm", 2, 64, shape)
        assert ws.memory.startswith("vmm") and "; 1 peer region(s) mapped" in ws.memory, ws.memory
        ordinal = int(jax.devices("gpu")[0].local_hardware_id)
        ws.close()
        assert lib.mok_comm_memory_info(ws.id, ordinal, buf, len(buf)) == 1  # the registry no longer holds it
    assert len(os.listdir("/proc/self/fd")) == fds  # every exported descriptor closed
    with pytest.raises(ValueError, match="memory must be one of"):
        _workspace("nvshmem", 2, 64, shape)
