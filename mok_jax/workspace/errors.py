"""The workspace's errors: the exceptions a communication op or the megakernel raises, and the message of a
workspace that did not fit in GPU memory."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CommError", "CommTimeoutError", "InvalidRoutingError", "WorkspaceMemoryError"]

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

