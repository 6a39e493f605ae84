"""Descriptor passing for memory="vmm" regions exported as POSIX descriptors (mok_jax/workspace/descriptors.py), on
the CPU: a process serves descriptors over an abstract UNIX socket and another receives them with SCM_RIGHTS, with the
failure cases (a rank it does not serve, a socket that is not there, a server that never answers); and the native
handle calls that name a received descriptor (mok_comm_handle_descriptor, mok_comm_handle_name_local_descriptor)."""

import ctypes
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mok_jax.workspace.descriptors import DescriptorServer, fetch_descriptors
from mok_jax.workspace.errors import CommError


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("mok-test")
    os.write(fd, content)
    return fd


def _read(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


def test_another_process_receives_the_served_descriptors():
    """The server runs in a child process that holds two memfds with known bytes; this process receives both and
    reads those bytes through its own new descriptors."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys
        from mok_jax.workspace.descriptors import DescriptorServer
        fds = {}
        for key in ("0,1", "0,3"):
            fd = os.memfd_create(key)
            os.write(fd, f"region {key}".encode())
            fds[key] = fd
        with DescriptorServer(fds, label="test") as s:
            print(s.address, flush=True)
            sys.stdin.readline()  # serve until the parent is done
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        assert address.startswith("mok_jax/test/"), address
        got = fetch_descriptors(address, ["0,3", "0,1"], timeout_s=30, peer="the child")
        try:
            assert sorted(got) == ["0,1", "0,3"]
            for key, fd in got.items():
                assert _read(fd) == f"region {key}".encode()
        finally:
            for fd in got.values():
                os.close(fd)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0


def test_a_rank_the_server_does_not_hold_is_an_error_naming_it():
    fd = _memfd(b"x")
    try:
        with DescriptorServer({"0,0": fd}) as s:
            with pytest.raises(CommError, match=r"serves no descriptor of rank\(s\) \['1,0'\]"):
                fetch_descriptors(s.address, ["0,0", "1,0"], timeout_s=10, peer="process 3")
            got = fetch_descriptors(s.address, ["0,0"], timeout_s=10, peer="process 3")  # it still serves
            assert _read(got["0,0"]) == b"x"
            os.close(got["0,0"])
    finally:
        os.close(fd)


def test_a_socket_that_is_not_there_is_a_connection_error():
    """What another host or network namespace looks like: the caller leaves that rank to pidfd_getfd."""
    with pytest.raises(ConnectionError, match="cannot be reached"):
        fetch_descriptors("mok_jax/test/no-such-socket", ["0,0"], timeout_s=5, peer="process 1")


def test_a_server_that_never_answers_times_out_naming_the_peer():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0mok_jax/test/silent-" + str(os.getpid()))
    sock.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(CommError, match=r"process 2 did not hand over the descriptors of rank\(s\) \['0,0'\] "
                                             r"within 0.5 s"):
            fetch_descriptors("mok_jax/test/silent-" + str(os.getpid()), ["0,0"], timeout_s=0.5, peer="process 2")
        assert time.monotonic() - t0 < 5
    finally:
        sock.close()


def test_a_closed_server_is_no_longer_there():
    fd = _memfd(b"y")
    try:
        s = DescriptorServer({"0,0": fd})
        s.close()
        s.close()  # idempotent
        with pytest.raises(ConnectionError):
            fetch_descriptors(s.address, ["0,0"], timeout_s=5, peer="process 1")
        assert _read(fd) == b"y"  # the server leaves its descriptors open
    finally:
        os.close(fd)


# --- the native handle calls ----------------------------------------------------------------------------------

# memory::WireHandle (ffi/src/workspace_memory.h): type, pid, fd, reserved (u32, i32, i32, u32), host, process, bytes
# (u64 each), data[64].
_WIRE = struct.Struct("<IiiIQQQ64s")
_POSIX_FD, _IPC = 2, 1


def _lib_or_skip():
    from mok_jax import _native
    from mok_jax.workspace import native

    if _native.library() is None:
        pytest.skip(f"native library unavailable (not a pass): {_native.native_status()}")
    lib = native._host_lib()
    assert lib.mok_comm_handle_bytes() == _WIRE.size
    return lib


def _handle(kind: int, pid: int, fd: int, process: int) -> np.ndarray:
    return np.frombuffer(bytearray(_WIRE.pack(kind, pid, fd, 0, 7, process, 1 << 21, b"\0" * 64)), np.uint8).copy()


def test_native_handle_calls_name_a_received_descriptor_as_this_processs():
    lib = _lib_or_skip()
    fd = ctypes.c_int32(-1)
    h = _handle(_POSIX_FD, 4242, 17, process=0x1234)  # another process's descriptor 17
    assert lib.mok_comm_handle_descriptor(h.ctypes.data, ctypes.byref(fd)) == 2 and fd.value == 17
    assert lib.mok_comm_handle_name_local_descriptor(h.ctypes.data, 5) == 0
    assert lib.mok_comm_handle_descriptor(h.ctypes.data, ctypes.byref(fd)) == 1 and fd.value == 5
    kind, pid, got_fd, _, _, _, nbytes, _ = _WIRE.unpack(h.tobytes())
    assert (kind, pid, got_fd, nbytes) == (_POSIX_FD, os.getpid(), 5, 1 << 21)  # the rest of the handle kept


def test_native_handle_calls_leave_other_handles_alone():
    lib = _lib_or_skip()
    fd = ctypes.c_int32(-1)
    h = _handle(_IPC, 4242, 17, process=0x1234)
    before = h.copy()
    assert lib.mok_comm_handle_descriptor(h.ctypes.data, ctypes.byref(fd)) == 0
    assert lib.mok_comm_handle_name_local_descriptor(h.ctypes.data, 5) == -1
    p = _handle(_POSIX_FD, 4242, 17, process=0x1234)
    assert lib.mok_comm_handle_name_local_descriptor(p.ctypes.data, -1) == -1  # no descriptor
    np.testing.assert_array_equal(h, before)
