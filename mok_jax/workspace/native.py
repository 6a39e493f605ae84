"""The native library's workspace functions, declared for ctypes, and what it says about an error word or an id."""

from __future__ import annotations

import ctypes
import threading

from mok_jax import _native

__all__ = ["describe_error", "lookup_error"]

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
        lib.mok_comm_handle_bytes.argtypes = []
        lib.mok_comm_handle_bytes.restype = i32
        lib.mok_comm_handle_descriptor.argtypes = [p, p]
        lib.mok_comm_handle_descriptor.restype = i32
        lib.mok_comm_handle_name_local_descriptor.argtypes = [p, i32]
        lib.mok_comm_handle_name_local_descriptor.restype = i32
        lib.mok_comm_alloc.argtypes = [i64, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_double, i32, i32, p, p,
                                       i32]
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
        lib.mok_comm_alloc_emulated.argtypes = [i64, i32, i32, i32, i32, i32, i32, ctypes.c_double, i32, p, i32]
        lib.mok_comm_alloc_emulated.restype = i32
        lib.mok_comm_memory_info.argtypes = [i64, i32, p, i32]
        lib.mok_comm_memory_info.restype = i32
        lib.mok_moe_error_words.argtypes = [i64, i32, i32, p]
        lib.mok_moe_error_words.restype = i32
        lib.mok_moe_clear_call_error.argtypes = [i64, i32]
        lib.mok_moe_clear_call_error.restype = i32
        lib.mok_moe_scratch_bytes.argtypes = [i32] * 12
        lib.mok_moe_scratch_bytes.restype = i64
        lib.mok_moe_item_times_offset.argtypes = [i32] * 12
        lib.mok_moe_item_times_offset.restype = i64
        lib.mok_moe_unsupported.argtypes = [i32] * 11 + [p, i32]
        lib.mok_moe_unsupported.restype = i32
        lib.mok_moe_item_list.argtypes = [i32] * 12 + [p, p, i32]
        lib.mok_moe_item_list.restype = i32
        lib.mok_experts_backward_ep_counter_words.argtypes = [i64] * 3
        lib.mok_experts_backward_ep_counter_words.restype = i64
        lib.mok_experts_backward_item_list.argtypes = [ctypes.c_void_p] + [i32] * 9 + [ctypes.c_void_p, i32]
        lib.mok_experts_backward_item_list.restype = i32
        _declared = True




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

