"""The framed transport's server end: :class:`FramedServer`, serving an
:class:`~shard_engine_remote._server.EngineServer`'s calls to framed clients (each connection
served by :class:`~shard_engine_remote._framed.connection.ServerConnection`).
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import threading
import time
from concurrent import futures
from contextlib import suppress
from pathlib import Path
from typing import Final

import shard_engine_api as api
from shard_engine_remote._framed.connection import ServerConnection
from shard_engine_remote._framed.frames import (
    ERROR,
    HEADER,
    HELLO_ENCODER,
    check_private_socket,
    shut_down,
)
from shard_engine_remote._grpc_options import connection_limit
from shard_engine_remote._server import (
    DEFAULT_CONNECTION_IDLE_S,
    EngineServer,
    drain_margin_s,
)

__all__ = ["DEFAULT_FRAMED_CONNECTIONS", "FramedServer"]

_ACCEPT_RETRY_S: Final = 0.05

_WATCH: Final = select.EPOLLIN | select.EPOLLONESHOT

_UNWATCHED: Final = select.EPOLLONESHOT
"""Registered, reporting nothing (but a hang-up, once)."""

DEFAULT_FRAMED_CONNECTIONS: Final = 256
"""Connections a framed server holds at once by default (two threads each), as many local
clients as a worker machine runs."""

_GOAWAY_FLUSH_S: Final = 0.25
"""How long past its grace a drain waits for its last answers and GOAWAYs to leave."""

_LOG: Final = logging.getLogger("shard_engine.remote")


def _refuse_connection(sock: socket.socket, status: str, message: str) -> None:
    """Answer a connection the server will not serve with a refusal (the client reads it as
    its greeting's answer) and close it, without ever blocking the caller."""
    body = HELLO_ENCODER.encode((status, message))
    with suppress(OSError):
        sock.send(HEADER.pack(len(body), ERROR, 0) + body, socket.MSG_DONTWAIT)
    sock.close()


class FramedServer:
    """Serves an :class:`EngineServer`'s dispatch over the framed transport on a unix socket in
    a private directory. Threads: one accepting; two per connection, taking turns at reading
    and serving the call just read; one watching the sockets of connections whose reading
    thread serves a call; and a pool for calls that overlap on a connection, a thread for each
    call it admits (so compute calls reach the engine in the order of the server's fair queue,
    never the pool's: they are bounded by the server's slots and queue, as over gRPC).

    At most ``max_connections`` connections at once (never more than half the descriptors the
    process may open); one beyond is refused, retryably (RESOURCE_EXHAUSTED), and its client
    connects again shortly (``CONNECTION_RETRY_S``) for as long as its call's deadline allows."""

    def __init__(
        self,
        server: EngineServer,
        *,
        max_connections: int = DEFAULT_FRAMED_CONNECTIONS,
        connection_idle_s: float = DEFAULT_CONNECTION_IDLE_S,
    ) -> None:
        if not connection_idle_s > 0:
            raise api.InvalidRequest(f"connection_idle_s must be > 0, got {connection_idle_s}")
        if max_connections < 1:
            raise api.InvalidRequest(f"max_connections must be >= 1, got {max_connections}")
        self.connection_idle_s = connection_idle_s
        """A greeted connection with no call in flight for this long is closed (its client
        reconnects when it next calls); ``math.inf``: never."""
        self.server = server
        self.engine = server.engine
        self.address: str | None = None
        self.draining = False
        admitted = self._admitted = server.max_workers * 8
        # A thread for every call admitted (started as needed): a call never waits in the
        # pool's own first-come queue, only in the server's queue, which is fair per client.
        self.pool = futures.ThreadPoolExecutor(
            max_workers=admitted, thread_name_prefix="engine-framed"
        )
        self._max_connections = connection_limit(max_connections)
        self._listener: socket.socket | None = None
        self._path: Path | None = None
        self._connections: set[ServerConnection] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._calls = threading.BoundedSemaphore(admitted)
        """Calls queued for or running on the pool, all connections together (gRPC's
        maximum_concurrent_rpcs on the other transport): beyond, a retryable
        ResourceExhausted."""
        self._greeting = 0
        """Connections accepted that have not greeted yet: bounded apart from the greeted
        ones, so connections that never greet cannot crowd out clients that did."""
        self._watcher: select.epoll | None = None
        self._watching: dict[int, ServerConnection] = {}
        self._stop_watching: int | None = None
        """The write end of the pipe that ends the watcher thread."""

    @property
    def calls_per_connection(self) -> int:
        """How many of the pool's calls one connection may hold: twice the server's threads,
        and at least as many as the engine is given compute calls at once (the decodes one
        worker's callers send at once must all reach the engine to run as one forward)."""
        server = self.server
        return min(self._admitted, max(1, server.max_workers * 2, server.compute_slots))

    def watch(self, connection: ServerConnection) -> bool:
        """Arm the watcher for ``connection``'s socket (one event, then disarmed); False when
        it cannot watch (the server is stopping: the caller hands the reading over itself)."""
        fd = connection.sock.fileno()
        with connection.lock:
            connection.watched = True
        try:
            with self._lock:
                if self._watcher is None or fd < 0:
                    raise OSError("not watching")
                if self._watching.get(fd) is not connection:
                    self._watcher.register(fd, _WATCH)
                    self._watching[fd] = connection
                else:
                    self._watcher.modify(fd, _WATCH)
        except (OSError, ValueError):
            with connection.lock:
                connection.watched = False
            return False
        return True

    def unwatch(self, connection: ServerConnection) -> None:
        fd = connection.sock.fileno()
        with self._lock, suppress(OSError, ValueError):
            if self._watcher is not None and self._watching.get(fd) is connection:
                self._watcher.modify(fd, _UNWATCHED)

    def forget_socket(self, connection: ServerConnection) -> None:
        """Before ``connection``'s socket closes (its descriptor may then be reused)."""
        with self._lock:
            fd = connection.sock.fileno()
            if fd >= 0 and self._watching.get(fd) is connection:
                del self._watching[fd]
                with suppress(OSError, ValueError):
                    if self._watcher is not None:
                        self._watcher.unregister(fd)

    def _watch(self, watcher: select.epoll, wake: int) -> None:
        """The watcher thread: hands a connection's reading to its other thread when bytes
        arrive while its reading thread serves a call."""
        try:
            while True:
                events = watcher.poll()
                for fd, _ in events:
                    if fd == wake:
                        return
                    with self._lock:
                        connection = self._watching.get(fd)
                    if connection is not None:
                        connection.hand_over_reading()
                    # Hold no closed connection (nor the shared memory it maps) until the
                    # next event.
                    connection = None
        finally:
            with self._lock:
                self._watcher = None
                self._watching.clear()
            watcher.close()
            os.close(wake)

    def admit(self) -> bool:
        return self._calls.acquire(blocking=False)

    def release(self) -> None:
        self._calls.release()

    def start(self, path: Path) -> str:
        """Bind ``path`` (its directory must be private) and serve; returns ``unix:PATH``.
        Raises InvalidRequest."""
        check_private_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            os.chmod(path, 0o600)
            listener.listen(64)
        except OSError as error:
            listener.close()
            raise api.InvalidRequest(f"cannot listen on unix:{path}: {error}") from error
        self._listener, self._path = listener, path
        self.address = f"unix:{path}"
        self.server.refresh_health()
        watcher = select.epoll()
        wake, self._stop_watching = os.pipe()
        watcher.register(wake, select.EPOLLIN)
        self._watcher = watcher
        threading.Thread(
            target=self._watch, args=(watcher, wake), daemon=True, name="framed-watch"
        ).start()
        threading.Thread(target=self._accept, daemon=True, name="framed-accept").start()
        return self.address

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        for number in itertools.count(1):
            try:
                sock, _ = listener.accept()
            except OSError:
                if self._listener is None:
                    return  # stop() closed it
                # Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the connection waits
                # in the backlog. Accept again shortly instead of never again.
                self.server.counters.add("busy")
                time.sleep(_ACCEPT_RETRY_S)
                continue
            with self._lock:
                greeted = len(self._connections) - self._greeting
                draining = self.draining
                refused = (
                    draining
                    or greeted >= self._max_connections
                    or self._greeting >= self._max_connections
                )
                if not refused:
                    connection = ServerConnection(self, sock, f"unix:connection-{number}")
                    self._connections.add(connection)
                    self._greeting += 1
            if draining:
                _refuse_connection(sock, "UNAVAILABLE", "the server is shutting down")
                continue
            if refused:
                self.server.counters.add("busy")
                _refuse_connection(
                    sock,
                    "RESOURCE_EXHAUSTED",
                    "the server holds as many connections as it serves; retry",
                )
                continue
            threading.Thread(target=connection.serve, daemon=True, name=f"framed-{number}").start()
            del connection  # its thread holds it; held here, its end would wait for the next

    def greeted(self) -> None:
        """A connection's greeting ended (either way)."""
        with self._lock:
            self._greeting -= 1

    def forget(self, connection: ServerConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop taking calls, let in-flight ones finish for up to ``grace`` seconds, then end
        the rest (which cancels their engine work) and close every connection."""
        self.draining = True
        self.server.refuse_new_calls()
        listener, self._listener = self._listener, None
        if listener is not None:
            shut_down(listener)
            listener.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        deadline = time.monotonic() + (grace if grace is not None else 1e9)
        # Calls waiting for a compute slot are served in turn until near the grace's end,
        # then refused (naming the drain; nothing of them ran) while their replies can leave.
        refuse_queued = deadline - (drain_margin_s(grace) if grace is not None else 0.0)
        while self._busy() and time.monotonic() < refuse_queued:
            time.sleep(0.01)
        self.server.refuse_queued_calls()
        while self._busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            connections = list(self._connections)
        # Every call read has been answered (or outlived the grace): tell each client how many
        # of its frames were read, after those answers, so that it knows the calls it sent
        # meanwhile never ran, then close. The answers and GOAWAYs get a moment past the grace
        # to leave.
        flushed = max(deadline, time.monotonic()) + _GOAWAY_FLUSH_S
        for connection in connections:
            connection.seal(flushed)
        for connection in connections:
            shut_down(connection.sock)
            connection.sealed()
        self.pool.shutdown(wait=True, cancel_futures=True)
        stop_watching, self._stop_watching = self._stop_watching, None
        if stop_watching is not None:
            os.write(stop_watching, b"x")
            os.close(stop_watching)
        self._stopped.set()

    def _busy(self) -> bool:
        """Whether a call runs on the engine or a call read on a connection has not ended."""
        with self._lock:
            connections = list(self._connections)
        return self.server.counters.in_flight > 0 or any(c.busy() for c in connections)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stopped; False on timeout."""
        return self._stopped.wait(timeout)
