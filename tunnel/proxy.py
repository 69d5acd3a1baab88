"""A TCP proxy: the gateway's API server address inside the tunnel (``<gateway tunnel IP>:443``) forwarded to the
real API server. Bytes are copied as they are (TLS end to end between the node and the API server).

``listen_netns`` makes the listening socket in a named network namespace, ``upstream_netns`` the upstream
connections (default: the caller's): a socket stays in the namespace it was created in (setns(2) applies to the
calling thread only, so each socket is made in a short-lived thread of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import threading
from pathlib import Path

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in_netns(netns: str | None, host: str, listen_port: int | None = None) -> socket.socket:
    """A TCP socket made in ``netns`` (``/run/netns/<name>``), or in this namespace; listening on
    ``host:listen_port`` when that is given, else unconnected (connect it from any thread)."""
    result: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            if netns:
                with open(Path("/run/netns") / netns) as ns:
                    _setns(ns.fileno())
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            if listen_port is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, listen_port))
                sock.listen(128)
            result.append(sock)
        except BaseException as exc:  # handed to the caller's thread
            result.append(exc)

    if netns is None:
        make()
    else:  # a thread of its own: it ends in the other namespace and is discarded
        worker = threading.Thread(target=make, name=f"netns-{netns}")
        worker.start()
        worker.join()
    got = result[0]
    if isinstance(got, BaseException):
        raise got
    return got


def listen_in_netns(netns: str | None, host: str, port: int) -> socket.socket:
    return socket_in_netns(netns, host, port)


class TcpProxy:
    """``max_per_peer`` connections at once from one source address and ``max_connections`` in all (each costs
    two threads and an upstream connection); more are closed as soon as they are accepted, so one tunnel peer
    cannot run the gateway out of threads or memory (issue 21, finding 9)."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], *, listen_netns: str | None = None,
                 upstream_netns: str | None = None, connect_timeout: float = 10.0, max_per_peer: int = 64,
                 max_connections: int = 1024) -> None:
        self.upstream = upstream
        self._upstream_netns = upstream_netns
        self._sock = listen_in_netns(listen_netns, *listen)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._timeout = connect_timeout
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.max_per_peer = max_per_peer
        self.max_connections = max_connections
        self._by_peer: dict[str, int] = {}
        self._active = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name=f"proxy-{self.address[1]}", daemon=True)

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            source = str(peer[0])
            with self._lock:
                if self._active >= self.max_connections or self._by_peer.get(source, 0) >= self.max_per_peer:
                    self.refused += 1
                    refuse = True
                else:
                    refuse = False
                    self._active += 1
                    self._by_peer[source] = self._by_peer.get(source, 0) + 1
            if refuse:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # a reset: the peer learns at once
                continue
            threading.Thread(target=self._serve_counted, args=(conn, source), daemon=True).start()

    def _serve_counted(self, conn: socket.socket, source: str) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self._active -= 1
                left = self._by_peer.get(source, 1) - 1
                if left > 0:
                    self._by_peer[source] = left
                else:
                    self._by_peer.pop(source, None)

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._upstream_netns:
                up = socket_in_netns(self._upstream_netns, self.upstream[0])
                up.settimeout(self._timeout)
                up.connect(self.upstream)
            else:
                up = socket.create_connection(self.upstream, timeout=self._timeout)
        except OSError:
            conn.close()
            return
        up.settimeout(None)
        with self._lock:
            self._conns.update((conn, up))
        done = threading.Event()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                if done.is_set():
                    for s in (conn, up):
                        s.close()
                        with self._lock:
                            self._conns.discard(s)
                done.set()

        back = threading.Thread(target=pump, args=(up, conn), daemon=True)
        back.start()
        pump(conn, up)
        back.join()  # counted until both directions are done

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(timeout=5)
