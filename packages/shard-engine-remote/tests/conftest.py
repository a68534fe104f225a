"""Shared helpers of the remote engine's tests: servers in this process, remote engines, and
request builders. Everything binds loopback or private unix sockets."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import msgspec
import pytest

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.engine import TEST_OPTIONS_ENV
from shard_engine_remote import EngineServer, RemoteEngine, ServerSecurity
from shard_engine_remote._framed import FramedLink, FramedServer, frames

# These tests load engines with test-only options (injected crashes, aborts and delays), as the
# conformance suite does; spawned engine processes inherit the setting (test_llama_abort.py checks
# the refusal without it).
os.environ[TEST_OPTIONS_ENV] = "1"

TRANSPORTS = ("framed", "grpc")
N_LAYERS = 6
FAKE_MODEL = "fake"


def shard(start: int = 0, end: int = N_LAYERS) -> api.ShardSpec:
    return api.ShardSpec(model=FAKE_MODEL, n_layers=N_LAYERS, start=start, end=end)


def config(start: int = 0, end: int = N_LAYERS, /, **options: object) -> api.LoadConfig:
    return api.LoadConfig(shard=shard(start, end), options=dict(options))


def delay(operation: str, milliseconds: int, **rule: object) -> dict[str, object]:
    """A fake-engine fault plan delaying every ``operation`` (cancellable); ``rule`` adds the
    rule's other fields (``limit``, ``session_id``, ...)."""
    action = {"kind": "delay", "milliseconds": milliseconds}
    return {"rules": [{"action": action, "operations": [operation], **rule}]}


def ref(session_id: str = "s", epoch: int = 1) -> api.SessionRef:
    return api.SessionRef(session_id=session_id, epoch=epoch)


def prefill(
    engine: api.ShardEngine, tokens: tuple[int, ...] = (1, 2, 3), *, session: str = "s", **kw: str
) -> api.ShardResult:
    return engine.prefill(
        api.PrefillRequest(
            request_id=kw.get("request_id", f"prefill-{session}"),
            session=ref(session),
            start_pos=0,
            inputs=api.TokenInput(token_ids=tokens),
        )
    )


def fill(engine: api.ShardEngine, session: api.SessionRef, positions: int) -> None:
    """Prefill ``session`` with ``positions`` positions, 499 a request (a session whose
    snapshot spans several chunks)."""
    for start in range(0, positions, 499):
        engine.prefill(
            api.PrefillRequest(
                request_id=f"p{start}",
                session=session,
                start_pos=start,
                inputs=api.TokenInput(token_ids=tuple(i % 500 for i in range(499))),
            )
        )


def slow_reader_channel(address: str) -> grpc.Channel:
    """A gRPC channel that grants almost no flow-control window: a client that barely reads
    what the server streams."""
    return grpc.insecure_channel(
        address, options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    )


def decode(
    engine: api.ShardEngine, pos: int, token: int = 1, *, session: str = "s", request_id: str = "d"
) -> api.ShardResult:
    return engine.decode(
        api.DecodeRequest(
            request_id=request_id,
            session=ref(session),
            pos=pos,
            inputs=api.TokenInput(token_ids=(token,)),
        )
    )


def sessions_at_once(engines: Sequence[api.ShardEngine], steps: int) -> None:
    """One thread per entry of ``engines`` (an engine may be several entries), all started
    together: thread ``n`` prefills session ``s{n}`` with 3 tokens, then decodes it ``steps``
    times. Every call must succeed and no thread may hang."""
    start = threading.Barrier(len(engines))
    failures: list[BaseException] = []

    def client(n: int, engine: api.ShardEngine) -> None:
        try:
            start.wait(30)
            prefill(engine, session=f"s{n}", request_id=f"p{n}")
            for position in range(3, 3 + steps):
                decode(engine, position, session=f"s{n}", request_id=f"d{n}")
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [
        threading.Thread(target=client, args=(n, engine)) for n, engine in enumerate(engines)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def free_port() -> int:
    """A loopback TCP port nothing listens on (bound, read and released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Background:
    """Run a call in a thread; ``result()`` re-raises what it raised."""

    def __init__(self, call: Callable[[], object]) -> None:
        self._outcome: list[object] = []
        self._error: list[BaseException] = []

        def run() -> None:
            try:
                self._outcome.append(call())
            except BaseException as error:  # noqa: BLE001 - re-raised in result()
                self._error.append(error)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = 30.0) -> object:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the background call did not finish"
        if self._error:
            raise self._error[0]
        return self._outcome[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A conformance suite class naming ``standard_tests_run`` runs only those standard tests,
    one naming ``standard_tests_left_out`` all but those (test_conformance.py says why); the
    others are deselected."""
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        cls = getattr(item, "cls", None)
        only = getattr(cls, "standard_tests_run", None)
        left_out: frozenset[str] = getattr(cls, "standard_tests_left_out", frozenset())
        name = getattr(item, "originalname", None) or item.name
        run = (only is None or name in only) and name not in left_out
        (kept if run else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport in turn: the framed one (spawn's default) and gRPC."""
    return str(request.param)


ServeFactory = Callable[..., EngineServer]


@pytest.fixture
def serve() -> Iterator[ServeFactory]:
    """Start in-process servers of loaded fake engines on 127.0.0.1 (a free port), or with
    ``transport="framed"`` on a unix socket in a fresh private directory; stopped and closed
    after the test. The server's ``address`` is the one a remote engine's ``target`` takes."""
    servers: list[tuple[EngineServer | FramedServer, EngineServer]] = []
    directories: list[Path] = []

    def factory(
        load: api.LoadConfig | None = None,
        *,
        security: ServerSecurity | None = None,
        listen: str = "127.0.0.1:0",
        transport: str = "grpc",
        server_type: type[EngineServer] = EngineServer,
        **kwargs: object,
    ) -> EngineServer:
        engine = api.load_engine("fake", load or config())
        server = server_type(engine, security=security, **kwargs)  # type: ignore[arg-type]
        if transport == "framed":
            directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
            directories.append(directory)
            framed = FramedServer(server)
            servers.append((framed, server))
            server.address = framed.start(directory / "engine.sock")
        else:
            servers.append((server, server))
            server.start(listen)
        return server

    yield factory
    for serving, server in servers:
        serving.stop(grace=0.5)
        server.engine.close()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


RemoteFactory = Callable[..., RemoteEngine]


@pytest.fixture
def remote() -> Iterator[RemoteFactory]:
    """Load remote engines; every one is closed after the test."""
    engines: list[RemoteEngine] = []

    def factory(load: api.LoadConfig) -> RemoteEngine:
        engine = RemoteEngine()
        engines.append(engine)
        engine.load(load)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def _fake_capabilities() -> bytes:
    engine = api.load_engine("fake", config())
    try:
        return wire.encode(engine.capabilities())
    finally:
        engine.close()


CAPABILITIES = _fake_capabilities()
"""The encoded capabilities of the built-in fake engine (what a scripted server answers a
load with)."""
HEALTH = wire.encode(api.Health(state="ready", detail="ok"))


def read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    """(kind, call id, body) of the next frame a framed peer sends on ``sock``, read with the
    transport's own header layout."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    length, kind, call_id = frames.HEADER.unpack(exactly(frames.HEADER.size))
    return kind, call_id, exactly(length)


class FramedPeer:
    """A unix socket speaking the framed transport by hand, greeted with ``token`` (None:
    not greeted). Like the framed client, it never reuses a call id on its connection: the
    server forgets an id only after the reply to it has left, so a reused id can still be
    in flight when the next call carrying it arrives."""

    def __init__(self, address: str, token: str | None) -> None:
        self._ids = itertools.count(1)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(10)
            self.sock.connect(address.removeprefix("unix:"))
            if token is not None:
                hello = msgspec.msgpack.encode({"token": token})
                self.sock.sendall(frames.encode_frame(frames.HELLO, 0, hello))
        except OSError:  # (refused: closed here, not left to the garbage collector)
            self.sock.close()
            raise

    def greeting(self) -> tuple[int, int, bytes]:
        return read_frame(self.sock)

    def fresh_id(self) -> int:
        """A call id this connection has not used."""
        return next(self._ids)

    def exchange(self, body: bytes, kind: int = frames.CALL, call_id: int | None = None) -> bytes:
        """Send one frame (under a fresh call id unless ``call_id`` is given) and return the
        body of the REPLY to it."""
        call_id = self.fresh_id() if call_id is None else call_id
        self.sock.sendall(frames.encode_frame(kind, call_id, body))
        answer_kind, answer_id, answer = read_frame(self.sock)
        assert (answer_kind, answer_id) == (frames.REPLY, call_id)
        return answer

    def close(self) -> None:
        self.sock.close()


class UnixPeer:
    """A hand-written server on a unix socket at ``path``: accepts every connection and serves
    each on its own thread with :meth:`serve` (what a test's scripted peer does)."""

    def __init__(self, path: Path, backlog: int = 8) -> None:
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(backlog)
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections.append(sock)
            threading.Thread(target=self.serve, args=(sock,), daemon=True).start()

    def serve(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
        for sock in self.connections:
            sock.close()


PeerT = TypeVar("PeerT", bound=UnixPeer)


class ScriptedLinks:
    """Scripted framed servers, each on a socket in a fresh private directory under ``root``,
    and a framed link to each; :meth:`close` closes them all."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._made: list[tuple[UnixPeer, FramedLink]] = []

    def open(self, make: Callable[[Path], PeerT]) -> tuple[PeerT, FramedLink]:
        """A server ``make(socket path)`` and a link to it."""
        directory = self._root / f"private{len(self._made)}"
        directory.mkdir(mode=0o700)
        peer = make(directory / "engine.sock")
        link = FramedLink(peer.path, token=None, max_message_bytes=8 << 20)
        self._made.append((peer, link))
        return peer, link

    def close(self) -> None:
        for peer, link in self._made:
            link.close()
            peer.close()


PARENT_SCRIPT = """
import sys, time
import shard_engine_api as api
from shard_engine_remote import RemoteEngine
engine = RemoteEngine()
engine.load(api.LoadConfig(
    shard=api.ShardSpec(model="fake", n_layers=6, start=0, end=6),
    options={"spawn": "fake", "transport": sys.argv[1]},
))
print(engine.child_pid, engine._child.directory, flush=True)
time.sleep(120)
"""
"""A worker process holding a spawned fake child: prints the child's pid and directory, then
sleeps (argv[1]: the transport). Tests kill or stop it and watch what the child does."""


def process_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (reaped, or a zombie its new parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped while being read
        return True
