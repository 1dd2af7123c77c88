"""Reach a server inside an activation's network namespace from the host, without veth.

A worker thread ``setns``-es into ``/proc/PID/ns/net`` (only that thread moves) and opens
sockets there on request; a socket keeps its namespace whatever thread later uses it. The
:class:`Publisher` relays a host loopback port to the inside address through such sockets.
The thread holds the namespace alive, so it must be stopped with the activation.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from snapctl.namespaces.publish import bind_listener

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_Request = tuple[Callable[[], Any], Future[Any]]
T = TypeVar("T")


class NetnsConnector:
    """Opens TCP connections from inside the network namespace of ``pid``."""

    def __init__(self, pid: int) -> None:
        self._ns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name=f"netns-{pid}", daemon=True
        )
        self._thread.start()
        try:
            ready.result(timeout=5)
        except BaseException:
            self._requests.put(None)  # a thread that gets this far late ends at once
            raise

    def _serve(self, ready: Future[None]) -> None:
        failed = _libc.setns(self._ns_fd, CLONE_NEWNET) != 0
        errno = ctypes.get_errno()
        os.close(self._ns_fd)
        if failed:
            ready.set_exception(OSError(errno, f"setns into netns: {os.strerror(errno)}"))
            return
        ready.set_result(None)
        while (item := self._requests.get()) is not None:
            make, future = item
            try:
                future.set_result(make())
            except BaseException as error:
                future.set_exception(error)

    def connect(self, host: str, port: int, timeout_s: float = 2.0) -> socket.socket:
        return self._inside(lambda: socket.create_connection((host, port), timeout_s), timeout_s)

    def listen(self, address: str, port: int) -> socket.socket:
        """A listening socket on ``address:port`` inside (the errors of ``bind_listener``)."""
        return self._inside(lambda: bind_listener(address, port), 5.0)

    def call(self, function: Callable[[], T], timeout_s: float = 5.0) -> T:
        """``function()`` run inside (its sockets, its address lookups); what it raises."""
        return self._inside(function, timeout_s)

    def _inside(self, make: Callable[[], T], timeout_s: float) -> T:
        future: Future[T] = Future()
        self._requests.put((make, future))
        return future.result(timeout=timeout_s + 1)

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=5)

    def __enter__(self) -> NetnsConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


class Publisher:
    """Forwards ``host_address:host_port`` on the host to ``inner_host:inner_port`` inside."""

    def __init__(
        self, connector: NetnsConnector, host_address: str, host_port: int, inner: tuple[str, int]
    ) -> None:
        self._connector = connector
        self._inner = inner
        self._listener = bind_listener(host_address, host_port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="publish", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = self._connector.connect(*self._inner)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
