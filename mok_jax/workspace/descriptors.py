"""Passing a workspace region's POSIX file descriptor to the other processes of its host, over a UNIX socket.

A region of ``memory="vmm"`` without FABRIC handles is exported as a POSIX file descriptor, which only its own
process holds. Another process of the same host can take it with ``pidfd_getfd``, but only with ptrace permission
over the exporter (Yama's ``ptrace_scope`` 0 or ``CAP_SYS_PTRACE``), which the processes of one job launched side by
side (srun, torchrun-like launchers, containers) usually lack. So during ``Workspace.create`` each process that
exports descriptors serves them on a UNIX socket of the abstract namespace (``DescriptorServer``) whose name travels
in its exchange record, and each process that maps such a region asks its exporter for the descriptor
(``fetch_descriptors``) and receives it with ``SCM_RIGHTS``. The native library then duplicates the received
descriptor as its own (``mok_comm_handle_name_local_descriptor``). A socket that cannot be reached (another network
namespace) leaves the handle as it was, for ``pidfd_getfd``.

A request is one line: the JSON list of the keys ("group,rank") it wants. The reply is one message: the JSON object
``{"keys": [...]}`` of the keys whose descriptors ride with it, in that order, or ``{"error": "..."}``. A server
answers each connection once and serves until it is closed (after every process has connected).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping

from mok_jax.workspace.errors import CommError

__all__ = ["DescriptorServer", "fetch_descriptors"]

_MAX_REQUEST = 1 << 16


class DescriptorServer:
    """Serves this process's descriptors ``fds`` ({key: descriptor}) on a fresh abstract UNIX socket, from a
    daemon thread, until :meth:`close`. ``address`` is the socket's name (without the abstract namespace's leading
    NUL), what the peers pass to :func:`fetch_descriptors`. The descriptors stay owned by the caller."""

    def __init__(self, fds: Mapping[str, int], *, label: str = "workspace"):
        self._fds = {str(k): int(v) for k, v in fds.items()}
        self.address = f"mok_jax/{label}/{os.getpid()}/{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + self.address)
            self._sock.listen(64)
            self._sock.settimeout(0.1)
        except OSError:
            self._sock.close()
            raise
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"mok_jax descriptors {label}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass  # the peer went away; it reports its own error

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        data = b""
        while not data.endswith(b"\n") and len(data) < _MAX_REQUEST:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        try:
            keys = json.loads(data.decode())
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError("not a list of keys")
        except (ValueError, UnicodeDecodeError) as e:
            conn.sendall(json.dumps({"error": f"bad request: {e}"}).encode())
            return
        missing = [k for k in keys if k not in self._fds]
        if missing:
            conn.sendall(json.dumps({"error": f"this process serves no descriptor of rank(s) {missing}"}).encode())
            return
        socket.send_fds(conn, [json.dumps({"keys": keys}).encode()], [self._fds[k] for k in keys])

    def close(self) -> None:
        """Stop serving (idempotent); the descriptors stay open."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5.0)
        self._sock.close()

    def __enter__(self) -> "DescriptorServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch_descriptors(address: str, keys: Iterable[str], *, timeout_s: float, peer: str) -> dict[str, int]:
    """The descriptors of ``keys`` from the :class:`DescriptorServer` at ``address``, as new descriptors of this
    process ({key: descriptor}; the caller closes them). ``peer`` names the server's process in errors.

    Raises ConnectionError when the socket cannot be reached (no such socket here: another host or network
    namespace), CommError when the server answers with an error, with too few descriptors, or not within
    ``timeout_s``."""
    keys = [str(k) for k in keys]
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect("\0" + address)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise ConnectionError(f"{peer}'s descriptor socket {address!r} cannot be reached from this process: "
                                  f"{e}") from e
        try:
            sock.sendall((json.dumps(keys) + "\n").encode())
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, max(len(keys), 1))
        except (TimeoutError, socket.timeout) as e:
            raise CommError(f"{peer} did not hand over the descriptors of rank(s) {keys} within {timeout_s:g} s") from e
        try:
            reply = json.loads(msg.decode())
        except (ValueError, UnicodeDecodeError):
            reply = {"error": f"an unreadable reply {msg[:80]!r}"}
        if "error" in reply or reply.get("keys") != keys or len(fds) != len(keys):
            for fd in fds:
                os.close(fd)
            why = reply.get("error") or f"{len(fds)} descriptor(s) for {len(keys)} rank(s)"
            raise CommError(f"{peer} could not hand over the descriptors of rank(s) {keys}: {why}")
        return dict(zip(keys, fds))
    finally:
        sock.close()
