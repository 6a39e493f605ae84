"""Loading the native library (CUDA kernels + XLA FFI handlers) and registering its FFI targets.

The library has no Python ABI: it is found on disk, opened with ctypes, and each exported handler
symbol is registered with ``jax.ffi.register_ffi_target`` for the CUDA platform. Where the library
is missing (no nvcc at install time) or cannot load, the package says so once and the pure-JAX
implementation keeps working; asking for ``implementation="mok"`` then raises with the reason.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys
import threading
import warnings

import jax

__all__ = ["FFI_TARGETS", "NativeLibraryUnavailable", "library", "loaded", "native_status", "require_native"]

LIBRARY_NAME = "libmok_ffi.so"

# FFI target name -> exported handler symbol. One entry per handler in ffi/src/ffi_*.cu.
FFI_TARGETS: dict[str, str] = {
    "mok_expert_counts": "MokExpertCounts", "mok_expert_layout": "MokExpertLayout",  # ffi_routing.cu
    "mok_grouped_ffn": "MokGroupedFfn", "mok_fp8_grouped_ffn": "MokFp8GroupedFfn",  # ffi_grouped_ffn.cu
    "mok_comm_dispatch": "MokCommDispatch", "mok_comm_combine": "MokCommCombine",  # ffi_comm.cu
    "mok_moe_forward": "MokMoeForward", "mok_moe_forward_fp8": "MokMoeForwardFp8",  # ffi_moe.cu
    "mok_experts_backward": "MokExpertsBackward",  # ffi_moe_backward.cu
    "mok_experts_backward_ep": "MokExpertsBackwardEp",  # ffi_moe_backward.cu
}


class NativeLibraryUnavailable(RuntimeError):
    """The mok CUDA library is not available on this machine (see the message for why)."""


_lock = threading.Lock()
_state: dict[str, object] = {}


def _candidates() -> list[pathlib.Path]:
    """Where the library may live: $MOK_JAX_LIB alone when set; else the installed package's copy and
    the source tree's build (scripts/build_native.sh), newest first, so a rebuild is never shadowed."""
    if env := os.environ.get("MOK_JAX_LIB"):
        return [pathlib.Path(env)]
    package = sys.modules.get(__package__)  # imported before this module; its path has the installed copy's folder
    out = [pathlib.Path(entry) / "_native" / LIBRARY_NAME for entry in getattr(package, "__path__", [])]
    out.append(pathlib.Path(__file__).resolve().parent.parent / "build" / "native" / LIBRARY_NAME)
    return sorted(out, key=lambda p: p.stat().st_mtime if p.is_file() else 0.0, reverse=True)


def _load() -> None:
    if "lib" in _state or "error" in _state:
        return
    tried = []
    for path in _candidates():
        if not path.is_file():
            tried.append(f"{path} (missing)")
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        missing = [sym for sym in FFI_TARGETS.values() if not hasattr(lib, sym)]
        if missing:
            tried.append(f"{path} (stale build: lacks {', '.join(missing)})")
            continue
        for name, sym in FFI_TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, sym)), platform="CUDA")
        _state["lib"], _state["path"] = lib, path
        return
    _state["error"] = (
        "the mok CUDA library (" + LIBRARY_NAME + ") is not available: it is built by `pip install -e .` "
        "when nvcc is present, or by scripts/build_native.sh. Looked in: " + "; ".join(tried)
    )


def _warn_once() -> None:
    """The one warning that the library is unavailable (stacklevel: the caller of library() or native_status())."""
    if "error" in _state and not _state.get("warned"):
        _state["warned"] = True
        warnings.warn("mok_jax: " + str(_state["error"]) + ". implementation='xla' still works.", stacklevel=3)


def library() -> ctypes.CDLL | None:
    """The loaded native library, or None (after one warning) when it is unavailable."""
    with _lock:
        _load()
        _warn_once()
    return _state.get("lib")  # type: ignore[return-value]


def loaded() -> bool:
    """Whether the native library is loaded (loading it on the first call), without library()'s warning: for code
    that uses a kernel only where there is one and is correct without it (mok_jax.layer.op_layout), so that a caller
    who never asked for the kernels is not told they are missing."""
    with _lock:
        _load()
    return "lib" in _state


def native_status() -> str:
    """One line saying where the native library was loaded from, or why it is unavailable."""
    with _lock:
        _load()
        _warn_once()
    if "lib" in _state:
        return f"loaded from {_state['path']}"
    return str(_state["error"])


def require_native(what: str) -> None:
    """Raise NativeLibraryUnavailable (naming ``what``) unless the library is loaded and a GPU is present."""
    if library() is None:
        raise NativeLibraryUnavailable(f"{what} needs the mok CUDA kernels, but {_state['error']}")
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise NativeLibraryUnavailable(
            f"{what} needs a CUDA GPU; this JAX sees only {sorted({d.platform for d in jax.devices()})}. "
            "Use implementation='xla' on this machine."
        )
