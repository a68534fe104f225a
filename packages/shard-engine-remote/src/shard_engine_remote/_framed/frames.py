"""The framed protocol: frames, the greeting, and reading frames off a socket.

A frame is a 13-byte header (little-endian: body length u32, kind u8, call id u64) and the body.
One connection multiplexes calls by id. The first frame of a connection is HELLO carrying the
token; the server answers HELLO, or ERROR and closes. Client to server: CALL (a request),
EXPORT (an ExportSessionRequest: answered by ITEMs and END), IMPORT (empty) followed by the
stream's messages (an ImportHeader, then the snapshot's chunks) as CHUNKs and an END, ABANDON
(the caller gave up: cancel the engine work). Server to client: REPLY, ITEM, END, GO_AHEAD
(``[chunks u32]``: an import may send that many more chunks), GOAWAY (see below), ERROR (a
transport-level refusal: ``[status name, message]``, the status in gRPC's vocabulary:
``UNAUTHENTICATED`` and ``RESOURCE_EXHAUSTED`` answer a greeting, ``UNAVAILABLE`` a call the
server refused before its engine saw it, ``DEADLINE_EXCEEDED`` an export the client read too
slowly). A body over the message limit is skipped
unread and answered ResourceExhausted, a malformed body InvalidRequest, a frame of an unknown
kind InvalidRequest; each is counted, and the connection keeps serving.

A server that stops drains its connections: it answers every call it has read (the calls that
arrive meanwhile with an ``UNAVAILABLE`` ERROR: nothing of them ran), lets running ones finish
within its grace, then stops reading a connection and sends GOAWAY, after every answer it will
ever send there, and closes. GOAWAY's call id field carries how many frames the server read on
the connection after the greeting: a call whose first frame came later in the stream was never
read, and the client knows it never ran (one read and still unanswered then is one the grace
ended: it may have run). A count, not the highest call id read: a client's calls may take
their ids in one order and reach the socket in another. GOAWAY has no body; it goes only to
clients of protocol version 2 or later (an older client would take it for its call's answer).

An import sends its header, then waits: for GO_AHEAD (the server checked the header against
its engine, reserved its bytes and asks for the body) or for the answer (a refusal). GO_AHEAD
grants chunks: :data:`IMPORT_WINDOW_CHUNKS` when the header is admitted, one more each time the
server has checked a chunk and asks for the next; the client sends no chunk it was not granted
(END needs no grant).
A refused header thus costs no chunk and a refused chunk at most the window, however
busy the server. The client's HELLO says which :data:`PROTOCOL_VERSION` it speaks, the
server's welcome the one the connection speaks, the lower of the two (absent: 0, an end from
before GO_AHEAD, whose chunks follow the header at once): a spawned child runs its parent's
installation, but a target served with ``--transport framed`` may run another.

Large bodies skip the socket. A client connection lends its server shared memory: a sealed
``memfd`` (it can neither shrink nor grow, so neither side can be made to fault on it) of
:data:`ARENA_SLOTS` slots, passed with HELLO (``SCM_RIGHTS``) and announced in it; the server
answers HELLO saying whether it took it (a file that is not a sealed memory file of the announced
size is refused and counted, and the connection is served over the socket alone). A call that
holds a free slot goes as CALL_SLOT, body ``[slot u32, length u32]`` then the request when
``length`` is 0, or ``length`` bytes of request in the slot; the server answers SLOT_REPLY
``[length u32]`` with the reply in the slot when it is large, else REPLY. The slot is the
call's until its answer has come, even after the caller gave up (the server answers every
CALL_SLOT once, abandoned or not): it is never written by both sides at once. Each side copies
what it reads out of the slot before decoding it (decoded payloads are views of their buffer).
On this host a bare round trip of a 1 MiB reply (a 262k-vocabulary logits row; no project
code) takes ~0.17 ms this way and ~0.74 ms through a socket read in 1 MiB chunks; through this
transport's socket path (4 MiB buffers) a gemma3-270m tail's reply costs ~0.15 ms more a token
than through the slot, and a 4 MiB prefill hop 1.4-2.0 ms more (``benchmarks/remote_bench.py``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from contextlib import suppress
from pathlib import Path
from typing import Final

import msgspec

import shard_engine_api as api

__all__ = [
    "ABANDON",
    "CALL",
    "CALL_SLOT",
    "CHUNK",
    "COALESCE_BYTES",
    "END",
    "ERROR",
    "ERROR_DECODER",
    "EXPORT",
    "GOAWAY",
    "GO_AHEAD",
    "GRANT",
    "HEADER",
    "HELLO",
    "HELLO_DECODER",
    "HELLO_ENCODER",
    "HELLO_TIMEOUT_S",
    "IMPORT",
    "IMPORT_WINDOW_CHUNKS",
    "ITEM",
    "LARGE_READ",
    "MAX_GREETING_BYTES",
    "PROTOCOL_VERSION",
    "READ_SIZE",
    "REPLY",
    "SLOT_ANSWER",
    "SLOT_CALL",
    "SLOT_MIN_BYTES",
    "SLOT_REPLY",
    "WELCOME_DECODER",
    "Closed",
    "ExtraDescriptors",
    "Hello",
    "Reader",
    "Welcome",
    "check_private_socket",
    "encode_frame",
    "shut_down",
    "widen_buffers",
]

HELLO: Final = 1
CALL: Final = 2
EXPORT: Final = 3
IMPORT: Final = 4
CHUNK: Final = 5
END: Final = 6
ABANDON: Final = 7
REPLY: Final = 8
ITEM: Final = 9
ERROR: Final = 10
CALL_SLOT: Final = 11
SLOT_REPLY: Final = 12
GO_AHEAD: Final = 13
GOAWAY: Final = 14

GRANT: Final = struct.Struct("<I")
"""GO_AHEAD's body: how many more chunks the import may send."""

IMPORT_WINDOW_CHUNKS: Final = 8
"""Chunks an import may have sent beyond those the server checked: 8 MiB of 1 MiB chunks, what
the connection's two socket buffers hold, so the window rarely waits on a reply in flight."""

PROTOCOL_VERSION: Final = 2
"""The framed protocol's version this end speaks: 1 added GO_AHEAD (0: none, the chunks follow
the header at once), 2 GOAWAY."""

HEADER: Final = struct.Struct("<IBQ")

READ_SIZE: Final = 1 << 16

LARGE_READ: Final = 1 << 20

COALESCE_BYTES: Final = 1 << 16
"""Bodies up to this size are sent in one buffer with their header (one system call)."""

_SOCKET_BUFFER_BYTES: Final = 4 << 20
"""Kernel buffer each way of a greeted connection (the kernel caps it at ``wmem_max`` and
``rmem_max``): a tail's logits row (1 MiB for a 262k vocabulary) then crosses in one send and
one receive instead of a sleep and a wake-up per default-sized (208 KiB) buffer. Only greeted
connections get it: a connection that never authenticated holds the default."""

SLOT_CALL: Final = struct.Struct("<II")

SLOT_ANSWER: Final = struct.Struct("<I")

_CLOSE_ON_EXEC: Final = getattr(socket, "MSG_CMSG_CLOEXEC", 0)

SLOT_MIN_BYTES: Final = COALESCE_BYTES
"""A body up to this size travels in its frame (one system call already)."""

HELLO_TIMEOUT_S: Final = 10.0
"""How long a greeting may take, each way, from the connection's first byte to its last."""

MAX_GREETING_BYTES: Final = 4096

HELLO_ENCODER: Final = msgspec.msgpack.Encoder()


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    token: str | None = None
    arena_slots: int = 0
    """Slots of the shared memory sent with this frame (0: none sent)."""
    arena_slot_bytes: int = 0
    version: int = 0
    """The :data:`PROTOCOL_VERSION` the client speaks."""


class Welcome(msgspec.Struct, frozen=True, kw_only=True):
    """The server's answer to HELLO (an empty body is a welcome without shared memory)."""

    arena: bool = False
    """Whether the server took the shared memory the client sent."""
    version: int = 0
    """The protocol version the connection speaks: the lower of the client's and the
    server's :data:`PROTOCOL_VERSION`."""


HELLO_DECODER: Final = msgspec.msgpack.Decoder(Hello)
WELCOME_DECODER: Final = msgspec.msgpack.Decoder(Welcome)
ERROR_DECODER: Final = msgspec.msgpack.Decoder(tuple[str, str])


class Closed(Exception):
    """The peer closed the connection."""


class ExtraDescriptors(Exception):
    """Descriptors came with a greeting after its first bytes (the kernel closed them)."""


def check_private_socket(path: Path) -> None:
    """Refuse (InvalidRequest) a socket path whose directory other users could enter."""
    try:
        info = path.parent.stat()
    except OSError as error:
        raise api.InvalidRequest(f"cannot serve on {path}: {error}") from error
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise api.InvalidRequest(
            f"the framed transport serves only in a private directory (mode 0700, owned by this "
            f"user); {path.parent} is mode {stat.S_IMODE(info.st_mode):o}: use gRPC (with a "
            "token, and TLS beyond loopback) for anything others can reach"
        )


class Reader:
    """Frames from a socket, through a buffer (one receive usually holds a whole frame).
    With a ``deadline`` (time.monotonic), every read ends by then (TimeoutError): a peer that
    trickles bytes cannot stretch a bounded wait by sending one just before each timeout."""

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self.deadline = deadline
        self.fds: list[int] | None = None
        """When a list: the one descriptor that may arrive with the first bytes received (the
        greeting's shared memory) is put in it. The first receive has room for one descriptor
        (more sent with it are closed, that one too, and ``extra_fds`` set), later ones for
        none: the kernel closes whatever does not fit and says so (MSG_CTRUNC), which then
        raises :class:`ExtraDescriptors`. Else the kernel drops them unseen."""
        self.extra_fds = False
        self._received = False

    def _recv(self, size: int) -> bytes:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer did not send a whole frame in time")
            self._sock.settimeout(remaining)
        if self.fds is not None:
            # Never a descriptor beyond the first one: a peer sending its greeting a byte at a
            # time, descriptors with each, would otherwise fill this process's table.
            if self._received:
                chunk, _, flags, _ = self._sock.recvmsg(size)
                if flags & socket.MSG_CTRUNC:
                    raise ExtraDescriptors
            else:
                chunk, fds, flags, _ = socket.recv_fds(self._sock, size, 1, _CLOSE_ON_EXEC)
                if flags & socket.MSG_CTRUNC:
                    self.extra_fds = True
                    for fd in fds:
                        os.close(fd)
                else:
                    self.fds += fds
            self._received = True
        else:
            chunk = self._sock.recv(size)
        if not chunk:
            raise Closed
        return chunk

    def _fill(self, wanted: int) -> None:
        while len(self._buffer) < wanted:
            missing = wanted - len(self._buffer)
            # Collecting descriptors, read no byte past the frame: what comes with the next
            # frame is not the greeting's.
            self._buffer += self._recv(missing if self.fds is not None else max(READ_SIZE, missing))

    def header(self) -> tuple[int, int, int]:
        """(body length, kind, call id) of the next frame."""
        self._fill(HEADER.size)
        length, kind, call_id = HEADER.unpack_from(self._buffer)
        del self._buffer[: HEADER.size]
        return length, kind, call_id

    def body(self, length: int) -> bytes:
        buffer = self._buffer
        if len(buffer) < length and length - len(buffer) > READ_SIZE:
            # Memory is taken as bytes arrive, never for what a header merely announces: a
            # 13-byte header claiming the message limit, then silence, would otherwise hold
            # that much memory per connection.
            parts = [bytes(buffer)]
            have = len(buffer)
            buffer.clear()
            while have < length:
                chunk = self._recv(min(length - have, LARGE_READ))
                parts.append(chunk)
                have += len(chunk)
            return b"".join(parts)
        self._fill(length)
        data = bytes(buffer[:length])
        del buffer[:length]
        return data

    @property
    def buffered(self) -> bool:
        """Whether bytes already read from the socket wait in the buffer."""
        return bool(self._buffer)

    def skip(self, length: int) -> None:
        """Drop ``length`` bytes without holding them."""
        while length:
            if not self._buffer:
                self._fill(1)
            taken = min(length, len(self._buffer))
            del self._buffer[:taken]
            length -= taken


def widen_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


def shut_down(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def encode_frame(kind: int, call_id: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), kind, call_id) + body
