"""A gRPC connection lost under a call: that call may have run (OutcomeUnknown), but a call made
after it must not land on the dead connection gRPC has not yet noticed. The link retires the
channel, later calls connect afresh (RemoteUnavailable when no server answers: nothing ran), and
the retired channel closes only once the last call using it has ended."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from conftest import (
    Background,
    RemoteFactory,
    ServeFactory,
    config,
    decode,
    delay,
    free_port,
    prefill,
    wait_until,
)

import shard_engine_api as api
from shard_engine_remote import ClientSecurity, OutcomeUnknown, RemoteUnavailable
from shard_engine_remote._grpc_link import GrpcLink
from shard_engine_remote._link import LinkFailure


class _Failed(grpc.RpcError):
    """What a blocking gRPC call raises, with the status a test chooses."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


_LOST = _Failed(grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Broken pipe (32))")
_NEVER_CONNECTED = _Failed(
    grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: refused"
)
_DEADLINE = _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class _Closes:
    """Counts the closes of one channel (and closes it)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.count = 0
        self._close = channel.close

    def __call__(self) -> None:
        self.count += 1
        self._close()


def _stub_calls(
    monkeypatch: pytest.MonkeyPatch, link: GrpcLink, answer: Callable[[], Any]
) -> _Closes:
    """Make the link's current channel answer every call with ``answer()``; count its closes."""
    current = link._current
    closes = _Closes(current.channel)
    monkeypatch.setattr(current.channel, "close", closes)
    monkeypatch.setattr(current, "call", lambda *args, **kwargs: answer())
    monkeypatch.setattr(current, "import_", lambda *args, **kwargs: answer())
    return closes


def _raise(error: grpc.RpcError) -> Callable[[], Any]:
    def answer() -> Any:
        raise error

    return answer


def _link() -> GrpcLink:
    return GrpcLink(f"127.0.0.1:{free_port()}", ClientSecurity(), 1 << 20)


@pytest.mark.parametrize("method", ["call", "import_"])
def test_a_lost_connection_retires_the_channel(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A call or an import that lost its connection (maybe sent): the next call goes on a new
    channel, and the old one, with no call left on it, is closed once."""
    link = _link()
    try:
        first = link.channel
        closes = _stub_calls(monkeypatch, link, _raise(_LOST))
        send: Callable[[], object] = (
            (lambda: link.call(b"", timeout=5))
            if method == "call"
            else (lambda: link.import_(iter(()), timeout=5))
        )
        with pytest.raises(LinkFailure) as caught:
            send()
        assert (caught.value.reason, caught.value.sent) == ("connection_lost", True)
        assert link.channel is not first
        assert link.renewals == 1
        assert closes.count == 1
    finally:
        link.close()
    assert closes.count == 1, "close() closed the retired channel again"


@pytest.mark.parametrize(
    "error", [_NEVER_CONNECTED, _DEADLINE], ids=["never_connected", "deadline"]
)
def test_other_failures_keep_the_channel(
    monkeypatch: pytest.MonkeyPatch, error: grpc.RpcError
) -> None:
    """A connection never made (gRPC reconnects by itself; nothing was sent on a dead one) or
    a deadline (the connection is fine) leaves the channel as it is."""
    link = _link()
    try:
        first = link.channel
        closes = _stub_calls(monkeypatch, link, _raise(error))
        for _ in range(3):
            with pytest.raises(LinkFailure):
                link.call(b"", timeout=5)
        assert link.channel is first
        assert (link.renewals, closes.count) == (0, 0)
    finally:
        link.close()
    assert closes.count == 1


def test_a_retired_channel_closes_after_its_last_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls still running on a channel when another call on it lost its connection are not
    cut short: the channel closes when the last of them ends, not before. Several calls that
    lose the same connection retire it once."""
    link = _link()
    release = threading.Event()
    entered = threading.Semaphore(0)
    held = 0

    def answer() -> Any:
        nonlocal held
        held += 1
        if held <= 2:
            entered.release()
            assert release.wait(30)
            return api.Health(state="ready")
        raise _LOST

    try:
        closes = _stub_calls(monkeypatch, link, answer)
        running = [Background(lambda: link.call(b"", timeout=30)) for _ in range(2)]
        for _ in running:
            assert entered.acquire(timeout=30)
        for _ in range(3):
            with pytest.raises(LinkFailure):
                link.call(b"", timeout=5)
        assert link.renewals == 1
        assert closes.count == 0, "the channel closed under two running calls"
        release.set()
        for each in running:
            assert each.result() == api.Health(state="ready")
        assert closes.count == 1
    finally:
        release.set()
        link.close()


def test_an_export_stream_holds_its_channel_until_it_ends(serve: ServeFactory) -> None:
    """An export still being read keeps its channel open after another call retired it; the
    channel closes when the stream is cancelled."""
    server = serve()
    assert server.address is not None
    link = GrpcLink(server.address, ClientSecurity(), 1 << 20)
    try:
        first = link._current
        closes = _Closes(first.channel)
        first.channel.close = closes  # type: ignore[method-assign]
        stream = link.export(b"not an export request", timeout=30)
        # Another call on the same channel loses its connection.
        assert link._take() is first
        link._done(first, LinkFailure("connection_lost", "lost", sent=True, status="UNAVAILABLE"))
        assert link.channel is not first.channel
        assert closes.count == 0
        stream.cancel()
        assert closes.count == 1
        stream.cancel()
        assert closes.count == 1
    finally:
        link.close()


class _Proxy:
    """A loopback TCP proxy to ``upstream`` that can cut every connection and stop listening
    (the server's machine gone), then listen again on the same port (it came back)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._listener: socket.socket | None = None
        self.listen()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for each in (source, sink):
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Stop listening and reset every connection."""
        if self._listener is not None:
            # shutdown wakes the thread blocked in accept(); close alone would not.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)
            each.close()


def test_after_a_lost_connection_no_call_has_an_unknown_outcome(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """The server's connection is reset under a decode and nothing listens any more: that
    decode is OutcomeUnknown (it may have run); every call after it is RemoteUnavailable
    (nothing ran), whatever gRPC had noticed. Once a server listens there again, calls work;
    and again, for several losses in a row on one remote engine. (Before the link retired the
    channel, about one loss in ten on a loaded machine made the next call OutcomeUnknown:
    "Stream removed (Socket closed)" or "(sendmsg: Broken pipe)".)"""
    server = serve(config(faults=delay("decode", 2000)))
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    proxy = _Proxy((host, int(port)))
    try:
        engine = remote(config(target=proxy.address, transport="grpc", control_timeout_s=2.0))
        for loss in range(3):
            session = f"s{loss}"
            prefill(engine, session=session)
            pending = Background(lambda: decode(engine, 3, session=session))  # noqa: B023
            wait_until(lambda: engine.health().in_flight >= 1)
            proxy.cut()
            with pytest.raises(OutcomeUnknown) as caught:
                pending.result()
            assert caught.value.details["reason"] == "connection_lost"
            for _ in range(3):
                with pytest.raises(RemoteUnavailable):
                    decode(engine, 3, session=session)
            proxy.listen()
            wait_until(lambda: engine.health().state == "ready")
    finally:
        proxy.cut()
