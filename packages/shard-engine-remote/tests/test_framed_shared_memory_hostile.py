"""Hostile peers of the framed transport's shared memory (see ``_framed``'s module docstring).

Clients against a real :class:`~shard_engine_remote._framed.FramedServer`: a greeting that
offers something other than a sealed memory file of the announced size (no descriptor, several,
a file on disk, an unsealed or wrongly sized memfd, absurd slot counts, a pipe) is refused,
counted, closed at once (never mapped, never leaked) and the connection is served over the
socket; an arena the server took is safe from its client (it cannot be shrunk, holes punched
in it read as zeros) and malformed CALL_SLOT frames are answered InvalidRequest.

Servers against the client: a SLOT_REPLY announcing an impossible length, garbage in the slot,
an answer for a call that does not exist, a welcome that does not decode or claims memory that
was never lent: each is a typed ShardEngineError of an exact class, never a success."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import itertools
import mmap
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from conftest import (
    HEALTH,
    RemoteFactory,
    ServeFactory,
    UnixPeer,
    config,
    prefill,
    read_frame,
    ref,
    wait_until,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import (
    EngineServer,
    OutcomeUnknown,
    RemoteEngine,
    RemoteUnavailable,
    ServerSecurity,
)
from shard_engine_remote._framed import SHARED_MEMORY
from shard_engine_remote._framed.arena import ARENA_SLOT_BYTES, ARENA_SLOTS, Arena
from shard_engine_remote._framed.frames import (
    CALL,
    CALL_SLOT,
    HEADER,
    HELLO,
    REPLY,
    SLOT_ANSWER,
    SLOT_CALL,
    SLOT_REPLY,
    Hello,
    Welcome,
    encode_frame,
)
from shard_engine_remote._wire import CapabilitiesQuery, decode_reply, encode_request

pytestmark = pytest.mark.skipif(not SHARED_MEMORY, reason="no sealed memfds on this platform")

TOKEN = "shared-memory-token"
ARENA_BYTES = ARENA_SLOTS * ARENA_SLOT_BYTES
VOCAB = 65536
"""The served fake engine's vocabulary: a logits row (256 KiB) is a reply large enough to
cross in a slot."""
MESSAGE_LIMIT = 1 << 20
"""The served engine's message limit (a slot is larger)."""
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals :meth:`Arena.create` puts on its file."""
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_names = itertools.count()


# ----------------------------------------------------------------- helpers


def _memfd(size: int, seals: int = SEALED, *, sealable: bool = True) -> int:
    """A memfd of ``size`` bytes with ``seals`` (none when not ``sealable``), under a name of
    its own (``hostile-N``) by which /proc/self shows whether it is still open or mapped."""
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0)
    fd = os.memfd_create(f"hostile-{next(_names)}", flags)
    try:
        os.ftruncate(fd, size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_files() -> dict[int, str]:
    """This process's descriptors (the in-process server's among them) and what each names."""
    files: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # (the listing's own descriptor, closed meanwhile)
            files[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return files


def _released(name: str) -> bool:
    """Whether this process neither holds nor maps the file ``name``."""
    return name not in _open_files().values() and not _mapped({name})


def _mapped(names: set[str]) -> list[str]:
    """Lines of /proc/self/maps mapping any of ``names`` (files as /proc/self/fd names them:
    a memfd as ``/memfd:NAME (deleted)``, as the maps do too)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        return [line for line in maps if line.rstrip("\n").endswith(tuple(names))]


PREFILL = encode_request(
    api.PrefillRequest(
        request_id="p", session=ref(), start_pos=0, inputs=api.TokenInput(token_ids=(1, 2, 3))
    )
)
"""A prefill of the served tail: its reply, a logits row, is large enough for a slot."""


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (a reset too: the server closes a connection it
    refuses without reading what else was sent)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _hello(slots: int = ARENA_SLOTS, slot_bytes: int = ARENA_SLOT_BYTES) -> bytes:
    return msgspec.msgpack.encode(
        Hello(token=TOKEN, arena_slots=slots, arena_slot_bytes=slot_bytes)
    )


class _Client:
    """A framed client written by hand: greets with the HELLO body ``hello`` carrying the
    descriptors ``fds`` (``SCM_RIGHTS``), then sends frames of its choosing."""

    def __init__(self, address: str, hello: bytes, fds: Sequence[int] = ()) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ids = itertools.count(1)
        try:
            self.sock.settimeout(10)
            self.sock.connect(address.removeprefix("unix:"))
            frame = encode_frame(HELLO, 0, hello)
            if fds:
                assert socket.send_fds(self.sock, [frame], list(fds)) == len(frame)
            else:
                self.sock.sendall(frame)
        except BaseException:
            self.sock.close()
            raise

    def welcome(self) -> Welcome:
        kind, _, body = read_frame(self.sock)
        assert kind == HELLO, (kind, body)
        return msgspec.msgpack.decode(body, type=Welcome)

    def call(self, kind: int, body: bytes) -> tuple[int, bytes]:
        """(kind, body) of the answer to one frame."""
        call_id = next(self._ids)
        self.sock.sendall(encode_frame(kind, call_id, body))
        answer_kind, answer_id, answer = read_frame(self.sock)
        assert answer_id == call_id, (answer_id, call_id)
        return answer_kind, answer

    def refusal(self, body: bytes) -> api.ShardEngineError:
        """The typed error a CALL_SLOT frame of ``body`` is answered with (as REPLY)."""
        kind, answer = self.call(CALL_SLOT, body)
        assert kind == REPLY, kind
        return wire.decode_error(answer)

    def capabilities(self) -> api.Capabilities:
        """A CapabilitiesQuery over the socket (a CALL frame): the served engine's answer."""
        kind, body = self.call(CALL, encode_request(CapabilitiesQuery()))
        assert kind == REPLY
        reply = decode_reply(body)
        assert isinstance(reply, api.Capabilities), reply
        return reply

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server(serve: ServeFactory) -> EngineServer:
    """A fake engine (vocabulary of 64 Ki) served framed, with a token and a 1 MiB limit."""
    return serve(
        config(vocab_size=VOCAB),
        transport="framed",
        security=ServerSecurity(token=TOKEN),
        max_message_bytes=MESSAGE_LIMIT,
    )


@pytest.fixture
def clients() -> Iterator[Callable[..., _Client]]:
    """Open :class:`_Client` connections; every one is closed after the test."""
    opened: list[_Client] = []

    def factory(address: str | None, hello: bytes, fds: Sequence[int] = ()) -> _Client:
        assert address is not None
        opened.append(_Client(address, hello, fds))
        return opened[-1]

    yield factory
    for client in opened:
        client.close()


def _address(server: EngineServer) -> str:
    assert server.address is not None
    return server.address


# ----------------------------------------------------------------- offers the server refuses

# Each offer: (announced slots, announced slot bytes, the descriptors sent), built in a
# directory of the test's own. Every file is sealed and sized right but for the one flaw the
# case is named after.
Offer = Callable[[Path], tuple[int, int, list[int]]]


def _regular_file(directory: Path) -> tuple[int, int, list[int]]:
    path = directory / f"arena-{next(_names)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, ARENA_BYTES)  # sparse
    return ARENA_SLOTS, ARENA_SLOT_BYTES, [fd]


def _read_only(directory: Path) -> tuple[int, int, list[int]]:
    """The right memfd, reopened read-only: the server cannot map it to write its replies."""
    fd = _memfd(ARENA_BYTES)
    try:
        return ARENA_SLOTS, ARENA_SLOT_BYTES, [os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)]
    finally:
        os.close(fd)


def _pipe(directory: Path) -> tuple[int, int, list[int]]:
    read, write = os.pipe()
    os.close(write)
    return ARENA_SLOTS, ARENA_SLOT_BYTES, [read]


OFFERS: dict[str, Offer] = {
    "no_descriptor": lambda d: (ARENA_SLOTS, ARENA_SLOT_BYTES, []),
    "zero_slots": lambda d: (0, ARENA_SLOT_BYTES, [_memfd(ARENA_BYTES)]),
    "two_descriptors": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES), _memfd(ARENA_BYTES)],
    ),
    "six_descriptors": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES) for _ in range(6)],
    ),
    "regular_file": _regular_file,
    "unsealable_memfd": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES, 0, sealable=False)],
    ),
    "unsealed_memfd": lambda d: (ARENA_SLOTS, ARENA_SLOT_BYTES, [_memfd(ARENA_BYTES, 0)]),
    "shrinkable_memfd": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)],
    ),
    "growable_memfd": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)],
    ),
    "smaller_memfd": lambda d: (ARENA_SLOTS, ARENA_SLOT_BYTES, [_memfd(ARENA_BYTES - 4096)]),
    "larger_memfd": lambda d: (ARENA_SLOTS, ARENA_SLOT_BYTES, [_memfd(ARENA_BYTES + 4096)]),
    "read_only_memfd": _read_only,
    "write_sealed_memfd": lambda d: (
        ARENA_SLOTS,
        ARENA_SLOT_BYTES,
        [_memfd(ARENA_BYTES, SEALED | fcntl.F_SEAL_WRITE)],
    ),
    "a_million_slots": lambda d: (10**6, 1, [_memfd(10**6)]),
    "zero_slot_bytes": lambda d: (ARENA_SLOTS, 0, [_memfd(0)]),
    "over_a_gibibyte": lambda d: (64, 32 << 20, [_memfd(64 * (32 << 20))]),
    "negative_slots": lambda d: (-1, -ARENA_BYTES, [_memfd(ARENA_BYTES)]),
    "slot_bytes_overflowing": lambda d: (64, 1 << 58, [_memfd(ARENA_BYTES)]),
    "pipe": _pipe,
    "directory": lambda d: (ARENA_SLOTS, ARENA_SLOT_BYTES, [os.open(d, os.O_RDONLY)]),
}


@pytest.mark.parametrize("offer", sorted(OFFERS))
def test_offers_other_than_a_sealed_arena_are_refused_and_served_over_the_socket(
    server: EngineServer, clients: Callable[..., _Client], tmp_path: Path, offer: str
) -> None:
    """The server answers the greeting with a welcome without shared memory, counts the
    refusal, has already closed every descriptor the greeting carried and never mapped one
    (so cutting the file short now cannot touch it), serves a CALL, and answers a CALL_SLOT
    on this connection InvalidRequest (it has no shared memory)."""
    slots, slot_bytes, fds = OFFERS[offer](tmp_path)
    try:
        sent = {_open_files()[fd] for fd in fds}
        client = clients(server.address, _hello(slots, slot_bytes), fds)
        assert client.welcome() == Welcome(arena=False)
        assert server.stats().refused_shared_memory == 1
        # The welcome leaves after the server closed what it received: only this side's
        # descriptors still name those files, and no one mapped them.
        left = {fd for fd, name in _open_files().items() if name in sent and fd not in fds}
        assert not left, f"the server kept {left} open"
        assert not _mapped(sent), "a refused file was mapped"
        for fd in fds:  # what a client that lent an unsealed file could do to it now
            with suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        for fd in fds:
            os.close(fd)
    assert client.capabilities().vocab_size == VOCAB
    refused = client.refusal(SLOT_CALL.pack(0, 0) + encode_request(CapabilitiesQuery()))
    assert isinstance(refused, api.InvalidRequest)
    assert "without shared memory" in refused.message
    assert client.capabilities().vocab_size == VOCAB, "the connection keeps serving"
    stats = server.stats()
    assert (stats.refused_shared_memory, stats.shared_memory_calls) == (1, 0)


def test_refused_offers_leak_no_descriptors(
    server: EngineServer, clients: Callable[..., _Client], tmp_path: Path
) -> None:
    """Every refused offer, twice (40 greetings): the in-process server's descriptors come
    back to what they were (a leak of one a greeting would be 40 more), and none of the files
    sent is open or mapped afterwards."""
    address = _address(server)
    warm = clients(address, _hello(0, 0))  # the server's lazily made descriptors, if any
    warm.welcome()
    warm.close()
    before = len(_open_files())
    sent: set[str] = set()
    greetings = 0
    for _ in range(2):
        for name, offer in sorted(OFFERS.items()):
            slots, slot_bytes, fds = offer(tmp_path)
            try:
                files = _open_files()
                sent |= {files[fd] for fd in fds}
                client = clients(address, _hello(slots, slot_bytes), fds)
            finally:
                for fd in fds:
                    os.close(fd)
            assert client.welcome() == Welcome(arena=False), name
            assert client.capabilities().vocab_size == VOCAB
            client.close()
            greetings += 1
    assert greetings >= 30
    assert server.stats().refused_shared_memory == greetings

    def settled() -> bool:
        return len(_open_files()) <= before + 3

    with suppress(AssertionError):
        wait_until(settled, timeout=5.0)
    after = _open_files()
    assert len(after) <= before + 3, f"{len(after) - before} more descriptors: {after}"
    assert not [fd for fd, name in after.items() if name in sent]
    assert not _mapped(sent)


def test_greetings_refused_outright_close_the_descriptors_they_carried(
    server: EngineServer, clients: Callable[..., _Client]
) -> None:
    """A wrong token, an undecodable HELLO and a frame that is not HELLO, each carrying a
    sealed arena: the connection is refused and closed, and the arena was neither kept open
    nor mapped. Descriptors sent with a frame after the greeting are dropped unread."""
    address = _address(server)
    wrong_token = msgspec.msgpack.encode(
        Hello(token="wrong", arena_slots=ARENA_SLOTS, arena_slot_bytes=ARENA_SLOT_BYTES)
    )
    sent: set[str] = set()
    for hello in (wrong_token, b"\xc1\xff", b"\x81\xa5token\x01"):
        fd = _memfd(ARENA_BYTES)
        try:
            sent.add(_open_files()[fd])
            client = clients(address, hello, [fd])
        finally:
            os.close(fd)
        with suppress(EOFError):
            read_frame(client.sock)  # the refusal, if any
        assert _closed(client.sock), "the connection was not closed"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        sock.settimeout(10)
        sock.connect(address.removeprefix("unix:"))
        fd = _memfd(ARENA_BYTES)
        try:
            sent.add(_open_files()[fd])
            socket.send_fds(
                sock, [encode_frame(CALL, 1, encode_request(CapabilitiesQuery()))], [fd]
            )
        finally:
            os.close(fd)
        assert _closed(sock), "the connection was not closed"
    # The server closes a refused connection after the descriptors of its greeting.
    assert not [fd for fd, name in _open_files().items() if name in sent]
    # After the welcome (not before: bytes read ahead with the greeting bring their
    # descriptors into it), descriptors are never taken.
    client = clients(address, _hello(0, 0))
    assert client.welcome() == Welcome(arena=False)
    fd = _memfd(ARENA_BYTES)
    try:
        sent.add(_open_files()[fd])
        socket.send_fds(
            client.sock, [encode_frame(CALL, 1, encode_request(CapabilitiesQuery()))], [fd]
        )
    finally:
        os.close(fd)
    kind, _, body = read_frame(client.sock)
    assert kind == REPLY
    assert isinstance(decode_reply(body), api.Capabilities)
    assert not [fd for fd, name in _open_files().items() if name in sent]
    assert not _mapped(sent)
    stats = server.stats()
    assert (stats.unauthenticated, stats.rejected_frames, stats.refused_shared_memory) == (1, 3, 0)


# ----------------------------------------------------------------- an arena the server took


@pytest.fixture
def lent(
    server: EngineServer, clients: Callable[..., _Client]
) -> Iterator[tuple[_Client, Arena, int]]:
    """A hand-made client that lent the server an arena made as the real client makes one:
    the client, its side of the arena, and its descriptor of the file (kept open)."""
    arena, fd = Arena.create(ARENA_SLOTS, ARENA_SLOT_BYTES)
    try:
        client = clients(server.address, _hello(), [fd])
        assert client.welcome() == Welcome(arena=True)
        yield client, arena, fd
    finally:
        os.close(fd)


def test_malformed_slot_calls_get_invalid_request_and_the_connection_serves_on(
    server: EngineServer, lent: tuple[_Client, Arena, int]
) -> None:
    """A CALL_SLOT shorter than its 8-byte header, naming a slot past the last or more bytes
    than a slot holds, or naming bytes in the slot and carrying some inline too, each gets an
    InvalidRequest REPLY; garbage in the slot (undecodable, nested too deeply) is an
    InvalidRequest too, and a request in the slot over the message limit ResourceExhausted
    (not retryable); none reaches the engine and the connection keeps serving."""
    client, arena, _ = lent
    query = encode_request(CapabilitiesQuery())
    malformed = {
        "empty": b"",
        "short": b"\x00\x00\x00",
        "seven_bytes": SLOT_CALL.pack(0, 0)[:7],
        "slot_past_the_last": SLOT_CALL.pack(ARENA_SLOTS, 0) + query,
        "slot_u32_max": SLOT_CALL.pack(0xFFFFFFFF, len(query)),
        "length_over_the_slot": SLOT_CALL.pack(0, ARENA_SLOT_BYTES + 1),
        "length_u32_max": SLOT_CALL.pack(1, 0xFFFFFFFF),
        "length_and_inline": SLOT_CALL.pack(0, len(query)) + query,
    }
    arena.put(0, query)
    for name, body in malformed.items():
        error = client.refusal(body)
        assert type(error) is api.InvalidRequest, (name, error)
        assert client.capabilities().vocab_size == VOCAB, name
    garbage = {
        "undecodable": b"\xc1\xff\xfe garbage",
        "unknown_type": msgspec.msgpack.encode({"type": "bogus"}),
        "nested": b"\x82\xa4type\xa6decode\xa4junk" + b"\x91" * 100_000 + b"\xc0",
        "zeros": bytes(4096),
    }
    for slot, (name, junk) in enumerate(garbage.items()):
        arena.put(slot % ARENA_SLOTS, junk)
        error = client.refusal(SLOT_CALL.pack(slot % ARENA_SLOTS, len(junk)))
        assert type(error) is api.InvalidRequest, (name, error)
    oversized = MESSAGE_LIMIT + 1
    arena.put(2, query + bytes(oversized - len(query)))
    error = client.refusal(SLOT_CALL.pack(2, oversized))
    assert type(error) is api.ResourceExhausted, error
    assert not error.retryable
    assert client.capabilities().vocab_size == VOCAB
    stats = server.stats()
    assert stats.rejected_frames == len(malformed) + len(garbage)
    assert stats.oversized == 1
    assert stats.refused_shared_memory == 0
    assert server.engine.metrics().errors == {}, "garbage never reached the engine"


def test_slot_calls_are_answered_small_in_a_reply_and_large_in_the_slot(
    server: EngineServer, lent: tuple[_Client, Arena, int]
) -> None:
    """A request inline in a CALL_SLOT, or in its slot, is served; a small reply comes as
    REPLY, a logits row (256 KiB) as SLOT_REPLY announcing its length, read from the slot.
    Calls that moved bytes through the slot are counted."""
    client, arena, _ = lent
    query = encode_request(CapabilitiesQuery())
    kind, body = client.call(CALL_SLOT, SLOT_CALL.pack(1, 0) + query)
    assert kind == REPLY
    assert isinstance(decode_reply(body), api.Capabilities)
    arena.put(2, query)
    kind, body = client.call(CALL_SLOT, SLOT_CALL.pack(2, len(query)))
    assert kind == REPLY
    assert isinstance(decode_reply(body), api.Capabilities)
    request = PREFILL
    kind, body = client.call(CALL_SLOT, SLOT_CALL.pack(3, 0) + request)
    assert kind == SLOT_REPLY
    (length,) = SLOT_ANSWER.unpack(body)
    assert VOCAB * 4 < length <= ARENA_SLOT_BYTES
    result = decode_reply(arena.take(3, length))
    assert isinstance(result, api.LogitsResult)
    assert result.vocab_size == VOCAB
    assert server.stats().shared_memory_calls == 2


def test_the_client_cannot_cut_the_arena_under_the_server(
    server: EngineServer, lent: tuple[_Client, Arena, int]
) -> None:
    """Once the server mapped the arena its client can neither shrink it (which would make
    the server's next touch of the lost pages a SIGBUS), nor grow it, nor unseal it: each is
    PermissionError. Punching holes in it is allowed, and only zeroes the client's own bytes:
    the server reads a zeroed request (InvalidRequest) and writes its replies into the
    punched pages, alive."""
    client, arena, fd = lent
    for size in (ARENA_BYTES - 4096, 0, ARENA_BYTES + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(fd).st_size == ARENA_BYTES
    libc = ctypes.CDLL(None, use_errno=True)
    query = encode_request(CapabilitiesQuery())
    arena.put(0, query)
    punched = libc.fallocate(
        fd,
        _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
        ctypes.c_long(0),
        ctypes.c_long(ARENA_BYTES),
    )
    assert punched == 0, os.strerror(ctypes.get_errno())
    assert arena.take(0, len(query)) == bytes(len(query))
    error = client.refusal(SLOT_CALL.pack(0, len(query)))
    assert type(error) is api.InvalidRequest
    request = PREFILL
    kind, body = client.call(CALL_SLOT, SLOT_CALL.pack(1, 0) + request)
    assert kind == SLOT_REPLY
    assert isinstance(decode_reply(arena.take(1, *SLOT_ANSWER.unpack(body))), api.LogitsResult)


def test_arenas_are_unmapped_when_their_connections_end(
    server: EngineServer, clients: Callable[..., _Client]
) -> None:
    """Ten connections in turn lend the server a sealed arena (one this side never maps),
    use a slot and hang up: the server's mappings of them do not accumulate (a client cannot
    make the server hold its memory by connecting again and again)."""
    address = _address(server)
    lent: set[str] = set()
    for _ in range(10):
        fd = _memfd(ARENA_BYTES)
        try:
            lent.add(_open_files()[fd])
            client = clients(address, _hello(), [fd])
        finally:
            os.close(fd)
        assert client.welcome() == Welcome(arena=True)
        assert _mapped(lent), "the server maps the arena it took"
        kind, _ = client.call(CALL_SLOT, SLOT_CALL.pack(0, 0) + encode_request(CapabilitiesQuery()))
        assert kind == REPLY
        client.close()
    # No server thread keeps an ended connection (nor its mapping) alive.
    wait_until(lambda: not _mapped(lent), timeout=5.0)
    assert server.stats().refused_shared_memory == 0


def test_a_descriptor_sent_with_the_frame_after_hello_is_not_the_greetings(
    server: EngineServer, clients: Callable[..., _Client]
) -> None:
    """A HELLO announcing an arena but carrying no descriptor, followed at once by a frame
    that carries a sealed memfd: the greeting never takes the next frame's descriptor (the
    server reads no byte past HELLO while it collects them), so the offer is refused every
    time and the descriptor is dropped with the frame it came with."""
    address = _address(server)
    for attempt in range(30):
        fd = _memfd(ARENA_BYTES)
        try:
            name = _open_files()[fd]
            client = clients(address, _hello())
            follow = encode_frame(CALL, 1, encode_request(CapabilitiesQuery()))
            assert socket.send_fds(client.sock, [follow], [fd]) == len(follow)
        finally:
            os.close(fd)
        assert client.welcome() == Welcome(arena=False), attempt
        kind, _, body = read_frame(client.sock)
        assert kind == REPLY
        assert isinstance(decode_reply(body), api.Capabilities)
        client.close()
        wait_until(functools.partial(_released, name))
    assert server.stats().refused_shared_memory == 30


def test_a_slot_request_over_the_message_limit_is_refused_before_it_is_copied(
    server: EngineServer,
    clients: Callable[..., _Client],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request in a slot over the server's message limit is refused (ResourceExhausted)
    without the server copying more than the limit out of the shared memory, as one over the
    socket is skipped unread."""
    copied: list[int] = []
    take = Arena.take

    def recording(self: Arena, index: int, length: int) -> bytes:
        copied.append(length)
        return take(self, index, length)

    monkeypatch.setattr(Arena, "take", recording)
    slot_bytes = 8 * MESSAGE_LIMIT
    fd = _memfd(slot_bytes)  # sealed as Arena.create seals
    try:
        client = clients(server.address, _hello(1, slot_bytes), [fd])
    finally:
        os.close(fd)
    assert client.welcome() == Welcome(arena=True)
    error = client.refusal(SLOT_CALL.pack(0, slot_bytes))
    assert type(error) is api.ResourceExhausted
    assert max(copied, default=0) <= MESSAGE_LIMIT, f"the server copied {max(copied)} bytes"
    assert client.capabilities().vocab_size > 0  # and serves on


def test_a_well_behaved_remote_engine_lends_memory_the_server_takes(
    server: EngineServer, remote: RemoteFactory, tmp_path: Path
) -> None:
    """Against the hostile cases above, the control: a remote engine's arena is taken (never
    refused) and its logits rows cross in it."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    engine = remote(config(target=_address(server), transport="framed", token_file=str(token)))
    result = prefill(engine)
    assert isinstance(result, api.LogitsResult)
    assert result.vocab_size == VOCAB
    stats = server.stats()
    assert stats.refused_shared_memory == 0
    assert stats.shared_memory_calls >= 1


# ----------------------------------------------------------------- hostile servers


GARBAGE = b"\xc1\xff garbage in the slot"


@dataclass
class _Call:
    """A call the hostile server received: its id, its slot (None: a CALL frame, or a
    CALL_SLOT on a connection without shared memory) and the lent memory, if any."""

    sock: socket.socket
    call_id: int
    slot: int | None
    memory: mmap.mmap | None
    slot_bytes: int

    def answer(self, kind: int, body: bytes, call_id: int | None = None) -> None:
        self.sock.sendall(encode_frame(kind, self.call_id if call_id is None else call_id, body))

    def in_slot(self, body: bytes) -> None:
        """Write ``body`` at the start of the call's slot."""
        assert self.memory is not None, "no memory was lent"
        assert self.slot is not None, "the call holds no slot"
        start = self.slot * self.slot_bytes
        self.memory[start : start + len(body)] = body

    def slot_reply(self, body: bytes) -> None:
        """Answer as a faithful server does: ``body`` in the slot, its length announced."""
        self.in_slot(body)
        self.answer(SLOT_REPLY, SLOT_ANSWER.pack(len(body)))


Misbehaviour = Callable[[_Call], None]


class _Frames:
    """Frames from a socket, the descriptors sent with them collected when asked."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def _fill(self, size: int, fds: list[int] | None) -> None:
        while len(self._buffer) < size:
            if fds is None:
                chunk = self._sock.recv(1 << 16)
            else:
                chunk, received, _, _ = socket.recv_fds(self._sock, 1 << 16, 8)
                fds += received
            if not chunk:
                raise EOFError
            self._buffer += chunk

    def next(self, fds: list[int] | None = None) -> tuple[int, int, bytes]:
        self._fill(HEADER.size, fds)
        length, kind, call_id = HEADER.unpack_from(self._buffer)
        self._fill(HEADER.size + length, fds)
        body = bytes(self._buffer[HEADER.size : HEADER.size + length])
        del self._buffer[: HEADER.size + length]
        return kind, call_id, body


def _wide_capabilities() -> bytes:
    wide = api.ShardSpec(model="fake:vocab=131072", n_layers=6, start=0, end=6)
    engine = api.load_engine("fake", api.LoadConfig(shard=wide))
    try:
        return wire.encode(engine.capabilities())
    finally:
        engine.close()


WIDE_CAPABILITIES = _wide_capabilities()
"""A fake whose logits row is 512 KiB: the remote engine expects a prefill's reply to need a
slot, so every call to the servers below holds one."""


class _SlotServer(UnixPeer):
    """A framed server written by hand that takes the shared memory a client lends (maps
    it), welcomes with ``welcome``, answers the first call of all (the load's
    CapabilitiesQuery) with the fake engine's capabilities (in the slot when
    ``capabilities_in_slot``) and every later call with ``later``. ``kinds`` records the kind
    of every call frame received."""

    def __init__(
        self,
        later: Misbehaviour,
        *,
        welcome: bytes = msgspec.msgpack.encode(Welcome(arena=True)),
        capabilities_in_slot: bool = False,
        welcome_fd: bool = False,
    ) -> None:
        self._later = later
        self._welcome = welcome
        self._welcome_fd = welcome_fd
        self.sent: set[str] = set()
        """What the descriptors sent to the client name (``welcome_fd``)."""
        self._capabilities_in_slot = capabilities_in_slot
        self._calls = itertools.count()
        self.kinds: list[int] = []
        self.lent: list[bool] = []
        """Per connection: whether its HELLO carried shared memory."""
        self._memories: list[mmap.mmap] = []
        self.directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
        super().__init__(self.directory / "engine.sock")

    def serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                self._serve(sock)
            except (OSError, EOFError, ValueError):
                return  # the client hung up (or the test ended)

    def _serve(self, sock: socket.socket) -> None:
        frames = _Frames(sock)
        fds: list[int] = []
        try:
            kind, _, body = frames.next(fds)
            assert kind == HELLO
            hello = msgspec.msgpack.decode(body, type=Hello)
            memory = None
            if fds and hello.arena_slots:
                memory = mmap.mmap(fds[0], hello.arena_slots * hello.arena_slot_bytes)
                self._memories.append(memory)
        finally:
            for fd in fds:
                os.close(fd)
        self.lent.append(memory is not None)
        welcome = encode_frame(HELLO, 0, self._welcome)
        if self._welcome_fd:
            _send_with_memfd(sock, welcome, self.sent)
        else:
            sock.sendall(welcome)
        while True:
            kind, call_id, body = frames.next()
            if kind not in (CALL, CALL_SLOT):
                continue  # ABANDON of a call the client gave up on
            self.kinds.append(kind)
            slot = None
            if kind == CALL_SLOT:
                slot, _ = SLOT_CALL.unpack_from(body)
            call = _Call(sock, call_id, slot, memory, hello.arena_slot_bytes)
            if next(self._calls) > 0:
                self._later(call)
            elif self._capabilities_in_slot:
                call.slot_reply(WIDE_CAPABILITIES)
            else:
                call.answer(REPLY, WIDE_CAPABILITIES)

    def close(self) -> None:
        super().close()
        for memory in self._memories:
            with suppress(BufferError):
                memory.close()
        self.path.unlink(missing_ok=True)
        self.directory.rmdir()


def _send_with_memfd(sock: socket.socket, frame: bytes, sent: set[str]) -> None:
    """Send ``frame`` carrying a sealed memfd (closed here once sent); its name is added to
    ``sent``."""
    fd = _memfd(ARENA_BYTES)
    try:
        sent.add(_open_files()[fd])
        assert socket.send_fds(sock, [frame], [fd]) == len(frame)
    finally:
        os.close(fd)


@pytest.fixture
def slot_server() -> Iterator[Callable[..., _SlotServer]]:
    servers: list[_SlotServer] = []

    def factory(later: Misbehaviour, **kwargs: bytes | bool) -> _SlotServer:
        servers.append(_SlotServer(later, **kwargs))  # type: ignore[arg-type]
        return servers[-1]

    yield factory
    for server in servers:
        server.close()


def _engine(remote: RemoteFactory, server: _SlotServer, **options: object) -> RemoteEngine:
    return remote(
        config(
            target=f"unix:{server.path}",
            transport="framed",
            timeout_s=0.5,
            control_timeout_s=0.5,
            **options,
        )
    )


def _announcing(body: bytes) -> Misbehaviour:
    def answer(call: _Call) -> None:
        call.answer(SLOT_REPLY, body)

    return answer


def _healthy(call: _Call) -> None:
    """A faithful answer (the served engine's health) in the slot, or in a REPLY."""
    if call.slot is None:
        call.answer(REPLY, HEALTH)
    else:
        call.slot_reply(HEALTH)


def test_a_faithful_slot_server_is_served_from_the_slots(
    slot_server: Callable[..., _SlotServer], remote: RemoteFactory
) -> None:
    """The control for the hostile servers below: a server that answers in the slots of the
    memory it was lent (the load's capabilities, then health) is read from them."""
    server = slot_server(_healthy, capabilities_in_slot=True)
    engine = _engine(remote, server)
    assert engine.health() == api.Health(state="ready", detail="ok")
    assert server.lent == [True]
    assert server.kinds == [CALL_SLOT, CALL_SLOT]


@pytest.mark.parametrize(
    ("answer", "options"),
    [
        pytest.param(_announcing(SLOT_ANSWER.pack(0)), {}, id="zero_bytes"),
        pytest.param(_announcing(SLOT_ANSWER.pack(ARENA_SLOT_BYTES + 1)), {}, id="past_the_slot"),
        pytest.param(_announcing(SLOT_ANSWER.pack(0xFFFFFFFF)), {}, id="u32_max"),
        pytest.param(
            _announcing(SLOT_ANSWER.pack(1 << 20)),
            {"max_message_bytes": 65536},
            id="past_the_reply_limit",
        ),
        pytest.param(_announcing(b""), {}, id="empty_body"),
        pytest.param(_announcing(b"\x10\x00"), {}, id="short_body"),
        pytest.param(_announcing(SLOT_ANSWER.pack(16) * 2), {}, id="long_body"),
    ],
)
def test_slot_replies_of_impossible_lengths_are_data_loss(
    slot_server: Callable[..., _SlotServer],
    remote: RemoteFactory,
    answer: Misbehaviour,
    options: dict[str, object],
) -> None:
    """A SLOT_REPLY announcing 0 bytes, more than a slot (or the reply limit) holds, or whose
    body is not the 4 bytes of a length, fails the connection with DATA_LOSS: a prefill is
    OutcomeUnknown (retryable: the server may have run it), a query RemoteUnavailable;
    never a success, never another exception."""
    server = slot_server(answer)
    engine = _engine(remote, server, **options)
    with pytest.raises(api.ShardEngineError) as raised:
        prefill(engine)
    assert type(raised.value) is OutcomeUnknown, raised.value
    assert raised.value.retryable
    assert raised.value.details["grpc_status"] == "DATA_LOSS"
    assert raised.value.details["reason"] == "transport_error"
    with pytest.raises(api.ShardEngineError) as unavailable:
        engine.server_stats()  # on a new connection: the broken one was dropped
    assert type(unavailable.value) is RemoteUnavailable, unavailable.value
    assert unavailable.value.details["grpc_status"] == "DATA_LOSS"
    assert server.lent == [True, True], "the load's connection, then a new one"
    assert server.kinds == [CALL_SLOT] * 3


def _garbage_in_slot(call: _Call) -> None:
    call.slot_reply(GARBAGE)


def _health_in_slot(call: _Call) -> None:
    call.slot_reply(HEALTH)


def _slot_reply_without_slot(call: _Call) -> None:
    assert call.slot is None
    call.answer(SLOT_REPLY, SLOT_ANSWER.pack(len(HEALTH)))


@pytest.mark.parametrize(
    ("answer", "options"),
    [
        pytest.param(_garbage_in_slot, {}, id="garbage_in_the_slot"),
        pytest.param(_health_in_slot, {}, id="another_type_in_the_slot"),
        pytest.param(
            _slot_reply_without_slot, {"shared_memory": False}, id="slot_reply_without_a_slot"
        ),
    ],
)
def test_slot_replies_that_do_not_decode_are_malformed_output(
    slot_server: Callable[..., _SlotServer],
    remote: RemoteFactory,
    answer: Misbehaviour,
    options: dict[str, object],
) -> None:
    """A SLOT_REPLY of a plausible length over garbage (or a Health for a prefill), or a
    SLOT_REPLY to a call that holds no slot (whose 4 bytes are then read as the reply): the
    bytes do not decode as the call's reply, MalformedOutput, for a prefill and a query."""
    server = slot_server(answer)
    engine = _engine(remote, server, **options)
    with pytest.raises(api.ShardEngineError) as raised:
        prefill(engine)
    assert type(raised.value) is api.MalformedOutput, raised.value
    with pytest.raises(api.ShardEngineError) as query:
        engine.server_stats()
    assert type(query.value) is api.MalformedOutput, query.value
    assert len(server.lent) == 1, "the connection stayed up"


def test_a_slot_reply_for_a_call_that_does_not_exist_is_ignored(
    slot_server: Callable[..., _SlotServer], remote: RemoteFactory
) -> None:
    """A SLOT_REPLY (faithful bytes in the slot) under another call's id is dropped: the
    call's own answer never comes, so a prefill is OutcomeUnknown (deadline_exceeded) and a
    query RemoteUnavailable, at their deadline."""

    def other_call(call: _Call) -> None:
        call.in_slot(HEALTH)
        call.answer(SLOT_REPLY, SLOT_ANSWER.pack(len(HEALTH)), call_id=call.call_id + 1000)

    server = slot_server(other_call)
    engine = _engine(remote, server)
    with pytest.raises(api.ShardEngineError) as raised:
        prefill(engine)
    assert type(raised.value) is OutcomeUnknown, raised.value
    assert raised.value.details["reason"] == "deadline_exceeded"
    with pytest.raises(api.ShardEngineError) as query:
        engine.server_stats()
    assert type(query.value) is RemoteUnavailable, query.value
    assert query.value.details["reason"] == "deadline_exceeded"
    assert server.kinds == [CALL_SLOT] * 3


@pytest.mark.parametrize(
    ("welcome", "options", "lent"),
    [
        pytest.param(b"\xc1\xff", {}, True, id="undecodable"),
        pytest.param(msgspec.msgpack.encode({"arena": "yes"}), {}, True, id="mistyped"),
        pytest.param(
            msgspec.msgpack.encode(Welcome(arena=True)),
            {"shared_memory": False},
            False,
            id="arena_never_lent",
        ),
    ],
)
def test_welcomes_that_do_not_take_lent_memory_leave_the_client_on_the_socket(
    slot_server: Callable[..., _SlotServer],
    remote: RemoteFactory,
    welcome: bytes,
    options: dict[str, object],
    lent: bool,
) -> None:
    """A welcome whose body does not decode (or mistypes ``arena``), or one claiming memory
    the client never lent: the client uses no slot, its calls travel as CALL frames and are
    answered."""
    server = slot_server(_healthy, welcome=welcome)
    engine = _engine(remote, server, **options)
    assert engine.health() == api.Health(state="ready", detail="ok")
    assert server.lent == [lent]
    assert server.kinds == [CALL, CALL]


def test_slots_of_unanswered_calls_stay_held_until_their_answer_comes(
    slot_server: Callable[..., _SlotServer], remote: RemoteFactory
) -> None:
    """A server that leaves slot calls unanswered costs the client those slots only: each
    call is OutcomeUnknown at its deadline, its slot is held (the server may still write it)
    and, all taken, the next call travels as a CALL frame; late answers to the abandoned
    calls free their slots for the calls after."""
    unanswered: list[_Call] = []
    held: list[int] = []

    def late(call: _Call) -> None:
        if call.slot is not None and not held and len(unanswered) < ARENA_SLOTS:
            unanswered.append(call)  # silence, for now
            return
        if not held:
            held.extend(sorted(call.slot for call in unanswered if call.slot is not None))
            for abandoned in unanswered:
                abandoned.slot_reply(HEALTH)
        _healthy(call)

    server = slot_server(late)
    engine = remote(
        config(target=f"unix:{server.path}", transport="framed", timeout_s=0.2, control_timeout_s=2)
    )
    for number in range(ARENA_SLOTS):
        with pytest.raises(api.ShardEngineError) as raised:
            prefill(engine, request_id=f"p{number}")
        assert type(raised.value) is OutcomeUnknown, raised.value
    assert engine.health().state == "ready"
    assert held == list(range(ARENA_SLOTS)), "each unanswered call held a slot of its own"
    assert engine.health().state == "ready"
    assert server.kinds == [CALL_SLOT] * (1 + ARENA_SLOTS) + [CALL, CALL_SLOT]
    assert server.lent == [True], "one connection throughout"


def test_descriptors_a_server_sends_are_dropped_by_the_client(
    slot_server: Callable[..., _SlotServer], remote: RemoteFactory
) -> None:
    """A server whose welcome and replies carry descriptors (a memfd each): the client
    never takes them (nothing of them stays open in its process) and reads the frames as
    usual."""
    sent: set[str] = set()

    def with_memfd(call: _Call) -> None:
        call.in_slot(HEALTH)
        _send_with_memfd(
            call.sock, encode_frame(SLOT_REPLY, call.call_id, SLOT_ANSWER.pack(len(HEALTH))), sent
        )

    server = slot_server(with_memfd, welcome_fd=True)
    engine = _engine(remote, server)
    for _ in range(3):
        assert engine.health() == api.Health(state="ready", detail="ok")
    sent |= server.sent
    assert len(sent) == 4
    # The server's thread closes its copy just after sending it (maybe after the call ended).
    wait_until(lambda: not [fd for fd, name in _open_files().items() if name in sent], 5.0)
    assert not _mapped(sent)
