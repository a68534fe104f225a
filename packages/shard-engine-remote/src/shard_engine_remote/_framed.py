"""The framed transport: length-prefixed frames of the project's msgpack codec on a private
unix socket, for a worker and the engine processes it started itself.

Why not gRPC here: on a 2-core machine a bare grpcio unary echo of a decode row's bytes costs
~514 us a call, the same bytes in length-prefixed frames on a unix socket ~59 us; no gRPC
option moved the former by more than ~7 %, and grpc.aio was slower. grpcio's Python call path
(HTTP/2 framing, completion queues, thread handoffs) is the floor, and it is several times the
0.3 ms a decode hop may add. Between a worker and its own child none of what gRPC brings is
needed: no TLS (the socket sits in a ``0700`` directory, and the child's random token is still
checked), no load balancers, no foreign clients. gRPC stays the network transport; this one is
never offered beyond a unix socket in a private directory.

Semantics are the gRPC path's, by construction: the server hands every decoded request to the
same :class:`~shard_engine_remote._server.EngineServer` dispatch, and a call that ends early
(the client abandoned it at its deadline, or the connection broke) ends its context, whose
callback is ``engine.cancel(request_id)``. The client reports link failures as
:class:`~shard_engine_remote._link.LinkFailure` (what failed, and whether the request may have
reached the server's engine), raised where the socket fails: the remote engine's one mapping to
OutcomeUnknown, RemoteUnavailable and EngineCrashed serves both transports.

A frame is a 13-byte header (little-endian: body length u32, kind u8, call id u64) and the body.
One connection multiplexes calls by id. The first frame of a connection is HELLO carrying the
token; the server answers HELLO, or ERROR and closes. Client to server: CALL (a request),
EXPORT (an ExportSessionRequest: answered by ITEMs and END), IMPORT (empty) followed by the
stream's messages (an ImportHeader, then the snapshot's chunks) as CHUNKs and an END, ABANDON
(the caller gave up: cancel the engine work). Server to client: REPLY, ITEM, END, ERROR (a
transport-level refusal: ``[status name, message]``, the status in gRPC's vocabulary:
``UNAUTHENTICATED`` and ``RESOURCE_EXHAUSTED`` answer a greeting, ``UNAVAILABLE`` a call the
server refused before its engine saw it, ``DEADLINE_EXCEEDED`` an export the client read too
slowly). A body over the message limit is skipped
unread and answered ResourceExhausted, a malformed body InvalidRequest, a frame of an unknown
kind InvalidRequest; each is counted, and the connection keeps serving.

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

import collections
import fcntl
import hmac
import itertools
import logging
import math
import mmap
import os
import queue
import select
import socket
import stat
import struct
import threading
import time
import typing
from collections.abc import Callable, Generator, Iterator
from concurrent import futures
from contextlib import suppress
from pathlib import Path
from typing import Final

import msgspec

import shard_engine_api as api
from shard_engine_remote._link import LinkFailure, Reason
from shard_engine_remote._server import (
    DEFAULT_CONNECTION_IDLE_S,
    EngineServer,
    StreamBroken,
    drain_margin_s,
)
from shard_engine_remote._wire import (
    CapabilitiesQuery,
    HealthQuery,
    MetricsQuery,
    Rejected,
    RemoteReply,
    RemoteRequest,
    ServerStatsQuery,
    SnapshotHeader,
    decode_export_header,
    decode_reply,
    decode_request,
    encode_reply,
    encode_reply_into,
    oversized_error,
    payload_bytes,
)

__all__ = ["FramedLink", "FramedServer", "check_private_socket"]

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
_ANSWERS: Final = frozenset((REPLY, SLOT_REPLY, ERROR))
"""The frames that end a call (what frees a slot the call held)."""

_HEADER: Final = struct.Struct("<IBQ")
_PEER_CREDENTIALS: Final = struct.Struct("3i")
"""struct ucred (pid, uid, gid), as SO_PEERCRED answers."""
_READ_SIZE: Final = 1 << 16
_LARGE_READ: Final = 1 << 20
_COALESCE_BYTES: Final = 1 << 16
"""Bodies up to this size are sent in one buffer with their header (one system call)."""
_SOCKET_BUFFER_BYTES: Final = 4 << 20
"""Kernel buffer each way of a greeted connection (the kernel caps it at ``wmem_max`` and
``rmem_max``): a tail's logits row (1 MiB for a 262k vocabulary) then crosses in one send and
one receive instead of a sleep and a wake-up per default-sized (208 KiB) buffer. Only greeted
connections get it: a connection that never authenticated holds the default."""
_WATCH: Final = select.EPOLLIN | select.EPOLLONESHOT
_UNWATCHED: Final = select.EPOLLONESHOT
"""Registered, reporting nothing (but a hang-up, once)."""
_SLOT_CALL: Final = struct.Struct("<II")
_SLOT_ANSWER: Final = struct.Struct("<I")
ARENA_SLOTS: Final = 4
"""Calls of one connection that may use its shared memory at once (more travel the socket)."""
ARENA_SLOT_BYTES: Final = 16 << 20
"""Largest body that crosses in a slot: 8 rows of a 262k-vocabulary tail's f32 logits, or a
512-row f32 bundle of 4096-wide hidden states (pages are taken as slots are first used)."""
_MAX_ARENA_BYTES: Final = 1 << 30
_CLOSE_ON_EXEC: Final = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_SLOT_MIN_BYTES: Final = _COALESCE_BYTES
"""A body up to this size travels in its frame (one system call already)."""
_HELLO_TIMEOUT_S: Final = 10.0
"""How long a greeting may take, each way, from the connection's first byte to its last."""
_MAX_GREETING_BYTES: Final = 4096
_SERVER_SEND_TIMEOUT_S: Final = 30.0
"""A client that stops reading its replies for this long (one frame) loses its connection."""
_SEND_PATIENCE_S: Final = 0.02
"""How long a serving thread waits for a connection's socket to take more of its frames before
it hands the rest to a writer thread of the connection's own: no thread of the shared pool
(nor a connection's reading thread) waits on a client that does not read."""
_MAX_OUTGOING_BYTES: Final = 8 << 20
"""Frame bytes a connection may have waiting to leave: beyond, the server reads none of its
new calls until they have left (or the connection is dropped)."""
_ABANDON_TIMEOUT_S: Final = 1.0
_ACCEPT_RETRY_S: Final = 0.05
_HELLO_ENCODER: Final = msgspec.msgpack.Encoder()
_LOG: Final = logging.getLogger("shard_engine.remote")


class _Hello(msgspec.Struct, frozen=True, kw_only=True):
    token: str | None = None
    arena_slots: int = 0
    """Slots of the shared memory sent with this frame (0: none sent)."""
    arena_slot_bytes: int = 0


class _Welcome(msgspec.Struct, frozen=True, kw_only=True):
    """The server's answer to HELLO (an empty body is a welcome without shared memory)."""

    arena: bool = False
    """Whether the server took the shared memory the client sent."""


_HELLO_DECODER: Final = msgspec.msgpack.Decoder(_Hello)
_WELCOME_DECODER: Final = msgspec.msgpack.Decoder(_Welcome)
_ERROR_DECODER: Final = msgspec.msgpack.Decoder(tuple[str, str])


_ERROR_REASONS: Final[dict[str, tuple[Reason, bool]]] = {
    "UNAUTHENTICATED": ("unauthenticated", False),
    "PERMISSION_DENIED": ("unauthenticated", False),
    "RESOURCE_EXHAUSTED": ("busy", False),
    "UNAVAILABLE": ("connection_lost", False),
    "DEADLINE_EXCEEDED": ("deadline_exceeded", True),
    "CANCELLED": ("cancelled", True),
}
"""What an ERROR frame's status says: why, and whether the call may have reached the engine."""


def _lost(message: str, *, sent: bool = True) -> LinkFailure:
    return LinkFailure("connection_lost", message, sent=sent, status="UNAVAILABLE")


def _late(message: str, *, sent: bool = True) -> LinkFailure:
    return LinkFailure("deadline_exceeded", message, sent=sent, status="DEADLINE_EXCEEDED")


def _link_closed(*, sent: bool) -> LinkFailure:
    return LinkFailure("cancelled", "link closed", sent=sent, status="CANCELLED")


def _data_loss(message: str) -> LinkFailure:
    return LinkFailure("transport_error", message, sent=True, status="DATA_LOSS")


class _Closed(Exception):
    """The peer closed the connection."""


class _ExtraDescriptors(Exception):
    """Descriptors came with a greeting after its first bytes (the kernel closed them)."""


def _check_peer(sock: socket.socket, target: str) -> None:
    """Refuse (PERMISSION_DENIED, before the token leaves) a server run by another user: a
    socket in a private directory cannot be one, but a directory swapped after it was checked,
    or a path someone else could write, can."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    _, uid, _ = _PEER_CREDENTIALS.unpack(credentials)
    if uid != os.getuid():
        raise LinkFailure(
            "unauthenticated",
            f"{target} is served by user {uid}, not this user ({os.getuid()}): the token was "
            "not offered",
            sent=False,
            status="PERMISSION_DENIED",
        )


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


# ----------------------------------------------------------------- frames on a socket


class _Reader:
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
        raises :class:`_ExtraDescriptors`. Else the kernel drops them unseen."""
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
                    raise _ExtraDescriptors
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
            raise _Closed
        return chunk

    def _fill(self, wanted: int) -> None:
        while len(self._buffer) < wanted:
            missing = wanted - len(self._buffer)
            # Collecting descriptors, read no byte past the frame: what comes with the next
            # frame is not the greeting's.
            self._buffer += self._recv(
                missing if self.fds is not None else max(_READ_SIZE, missing)
            )

    def header(self) -> tuple[int, int, int]:
        """(body length, kind, call id) of the next frame."""
        self._fill(_HEADER.size)
        length, kind, call_id = _HEADER.unpack_from(self._buffer)
        del self._buffer[: _HEADER.size]
        return length, kind, call_id

    def body(self, length: int) -> bytes:
        buffer = self._buffer
        if len(buffer) < length and length - len(buffer) > _READ_SIZE:
            # Memory is taken as bytes arrive, never for what a header merely announces: a
            # 13-byte header claiming the message limit, then silence, would otherwise hold
            # that much memory per connection.
            parts = [bytes(buffer)]
            have = len(buffer)
            buffer.clear()
            while have < length:
                chunk = self._recv(min(length - have, _LARGE_READ))
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


def _send(
    sock: socket.socket, lock: threading.Lock, kind: int, call_id: int, body: bytes, deadline: float
) -> None:
    """Send one frame whole by ``deadline`` (time.monotonic). Raises LinkFailure
    (``deadline_exceeded`` or ``connection_lost``; ``sent`` when a byte left, after shutting the
    connection down (a frame cut in two leaves the
    stream unreadable). Sends never block the socket for readers: MSG_DONTWAIT and poll."""
    header = _HEADER.pack(len(body), kind, call_id)
    parts = [header + body] if len(body) <= _COALESCE_BYTES else [header, body]
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise _late("deadline passed waiting to send", sent=False)
    sent_any = False
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                try:
                    sent = sock.send(view, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise _late("deadline passed while sending", sent=sent_any) from None
                    poller = select.poll()
                    poller.register(sock, select.POLLOUT)
                    poller.poll(min(remaining, 60.0) * 1000)
                    continue
                sent_any = True
                view = view[sent:]
    except (OSError, ValueError) as error:  # ValueError: closed meanwhile (no descriptor)
        raise _lost(f"connection lost while sending: {error}", sent=sent_any) from None
    except LinkFailure:
        if sent_any:
            _shutdown(sock)
        raise
    finally:
        lock.release()


def _widen_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)


def _refuse_connection(sock: socket.socket, message: str) -> None:
    """Answer a connection the server will not serve with a retryable refusal (the client
    reads it as its greeting's answer) and close it, without ever blocking the caller."""
    body = _HELLO_ENCODER.encode(("RESOURCE_EXHAUSTED", f"{message}; retry"))
    with suppress(OSError):
        sock.send(_HEADER.pack(len(body), ERROR, 0) + body, socket.MSG_DONTWAIT)
    sock.close()


def _shutdown(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# ----------------------------------------------------------------- shared memory


_ARENA_SEALS: Final = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
SHARED_MEMORY: Final = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
"""Whether this platform can lend a server shared memory (Linux: sealed memfds)."""


class _Arena:
    """A connection's shared memory: ``slots`` slots of ``slot_bytes``, mapped by both ends."""

    def __init__(self, memory: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self._memory = memory
        self._view = memoryview(memory)
        self.slots = slots
        self.slot_bytes = slot_bytes

    def close(self) -> None:
        """Unmap now, closing the descriptor the mapping holds, unless another thread is
        copying (then when the last reference goes). Later reads and writes raise
        ValueError."""
        with suppress(BufferError):
            self._view.release()
            self._memory.close()

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> tuple[_Arena, int]:
        """A new arena and its file (the caller sends, then closes it). Raises OSError."""
        size = slots * slot_bytes
        fd = os.memfd_create("shard-engine-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _ARENA_SEALS | fcntl.F_SEAL_SEAL)
            return cls(mmap.mmap(fd, size), slots, slot_bytes), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, slots: int, slot_bytes: int) -> _Arena | None:
        """The arena a client sent (``fd`` is closed here), or None when it is not one: a
        regular memory file of exactly the announced size that can neither shrink nor grow.
        An unsealed file could be cut short under the mapping, and touching the lost pages
        would kill this process (SIGBUS)."""
        try:
            if not (0 < slots <= 64 and slot_bytes > 0 and slots * slot_bytes <= _MAX_ARENA_BYTES):
                return None
            status = os.fstat(fd)
            size = slots * slot_bytes
            if not stat.S_ISREG(status.st_mode) or status.st_size != size:
                return None
            if status.st_blksize != mmap.PAGESIZE:
                # Not an ordinary memory file: hugetlbfs, say, whose pages a hole punched by
                # the client may leave impossible to fault back in (SIGBUS).
                return None
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _ARENA_SEALS != _ARENA_SEALS:
                return None
            return cls(mmap.mmap(fd, size), slots, slot_bytes)
        except (OSError, ValueError, OverflowError):  # not sealable (no memory file), not mappable
            return None
        finally:
            os.close(fd)

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def put(self, index: int, body: bytes) -> None:
        self.slot(index)[: len(body)] = body

    def take(self, index: int, length: int) -> bytes:
        """A copy of the first ``length`` bytes of a slot (what decodes from it must not see
        the slot written again)."""
        return bytes(self.slot(index)[:length])


# ----------------------------------------------------------------- client


class _ReplyFrames:
    """The server's frames on a client connection, read by whichever caller is the reader at
    the time (:class:`_Connection`). A read that reaches its caller's deadline mid-frame keeps
    what it has for the next reader: the stream stays whole."""

    def __init__(self, sock: socket.socket, max_reply_bytes: int) -> None:
        self._sock = sock
        self._max_reply_bytes = max_reply_bytes
        self._buffer = bytearray()
        self._header: tuple[int, int, int] | None = None
        self._parts: list[bytes] = []
        self._have = 0

    def _recv(self, size: int, deadline: float) -> bytes:
        """Some bytes, waiting no later than ``deadline`` (TimeoutError)."""
        while True:
            poller = select.poll()
            try:
                poller.register(self._sock, select.POLLIN)
            except ValueError:  # the link was closed (the socket has no descriptor)
                raise _Closed from None
            remaining = deadline - time.monotonic()
            if not poller.poll(max(0, math.ceil(remaining * 1000))):
                raise TimeoutError
            try:
                chunk = self._sock.recv(size, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not chunk:
                raise _Closed
            return chunk

    def next(self, deadline: float) -> tuple[int, int, bytes]:
        """(kind, call id, body) of the next frame. Raises TimeoutError at ``deadline`` (the
        part read is kept), _Closed or OSError when the connection ended, LinkFailure when
        the server announces a reply over the limit."""
        buffer = self._buffer
        if self._header is None:
            while len(buffer) < _HEADER.size:
                buffer += self._recv(_READ_SIZE, deadline)
            length, kind, call_id = _HEADER.unpack_from(buffer)
            if length > self._max_reply_bytes:
                # Not RESOURCE_EXHAUSTED: that says the server refused the request (it did
                # not run); an oversized reply is a broken server whose call may have run.
                raise _data_loss(
                    f"the server announced a {length}-byte reply, larger than max "
                    f"{self._max_reply_bytes}; the connection was dropped",
                )
            del buffer[: _HEADER.size]
            self._header = (length, kind, call_id)
        length, kind, call_id = self._header
        while self._have < length:
            needed = length - self._have
            if buffer:
                taken = min(needed, len(buffer))
                self._parts.append(bytes(buffer[:taken]))
                del buffer[:taken]
                self._have += taken
            elif needed <= _READ_SIZE:
                buffer += self._recv(_READ_SIZE, deadline)
            else:
                # Memory is taken as bytes arrive, never for what a header merely announces.
                chunk = self._recv(min(needed, _LARGE_READ), deadline)
                self._parts.append(chunk)
                self._have += len(chunk)
        parts, self._parts, self._have, self._header = self._parts, [], 0, None
        return kind, call_id, b"".join(parts)


class _Connection:
    """One client connection: its socket and the calls waiting on it. It has no thread of its
    own: a waiting caller reads the socket itself (one caller at a time, the *reader*), files
    each frame under its call's id and wakes the other waiters; when its own frame has come, or
    its deadline, it stops reading and one of the others takes over. A lone caller thus reads
    its own reply, with no thread handing it over (on a 2-core machine, a wake-up per hop)."""

    def __init__(
        self, sock: socket.socket, max_reply_bytes: int, arena: _Arena | None = None
    ) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self._frames = _ReplyFrames(sock, max_reply_bytes)
        self._max_reply_bytes = max_reply_bytes
        self._condition = threading.Condition(threading.Lock())
        self._arrived: dict[int, collections.deque[tuple[int, bytes]]] = {}
        self._reading = False
        self._ids = itertools.count(1)
        self.broken: LinkFailure | None = None
        self.arena = arena
        self._free_slots = list(range(arena.slots)) if arena is not None else []
        self._slot_of: dict[int, int] = {}
        """Slot of each call holding one: open calls, and closed ones whose answer has not
        come (the server may still write their slot)."""
        self._answered: set[int] = set()
        """Open calls holding a slot whose answer has come (their slot is freed on close)."""

    def open_call(self, slot: bool = False) -> tuple[int, int | None]:
        """A new call's id, and its slot of the shared memory when ``slot`` is asked and one
        is free (never without shared memory: no slot is ever free then)."""
        call_id = next(self._ids)
        with self._condition:
            if self.broken is not None:
                raise self.broken.unsent()
            self._arrived[call_id] = collections.deque()
            index = self._free_slots.pop() if slot and self._free_slots else None
            if index is not None:
                self._slot_of[call_id] = index
        return call_id, index

    def close_call(self, call_id: int, sent: bool = True) -> None:
        """The caller is done with the call. Its slot is free again when its answer came or
        its request never left; else when the answer comes."""
        with self._condition:
            self._arrived.pop(call_id, None)
            if call_id in self._slot_of and (call_id in self._answered or not sent):
                self._answered.discard(call_id)
                self._free_slots.append(self._slot_of.pop(call_id))

    def slot_call(self, slot: int, request: bytes) -> bytes:
        """The body of a CALL_SLOT frame for ``request``: a large one placed in the call's
        slot, a small one inline."""
        assert self.arena is not None
        if not _SLOT_MIN_BYTES < len(request) <= self.arena.slot_bytes:
            return _SLOT_CALL.pack(slot, 0) + request
        try:
            self.arena.put(slot, request)
        except ValueError:  # the link was closed meanwhile (the mapping is gone)
            raise _link_closed(sent=False) from None
        return _SLOT_CALL.pack(slot, len(request))

    def slot_reply(self, slot: int, body: bytes) -> bytes:
        """The reply a SLOT_REPLY frame announces, copied out of the call's slot."""
        assert self.arena is not None
        (length,) = _SLOT_ANSWER.unpack(body) if len(body) == _SLOT_ANSWER.size else (-1,)
        if not 0 < length <= min(self.arena.slot_bytes, self._max_reply_bytes):
            error = _data_loss(
                f"the server announced a reply of {length} bytes in a shared-memory slot of "
                f"{self.arena.slot_bytes}; the connection was dropped",
            )
            self.fail(error)
            raise error
        try:
            return self.arena.take(slot, length)
        except ValueError:  # the link was closed meanwhile (the mapping is gone)
            raise _link_closed(sent=True) from None

    def send(self, kind: int, call_id: int, body: bytes, deadline: float) -> None:
        try:
            _send(self.sock, self.send_lock, kind, call_id, body, deadline)
        except LinkFailure as error:
            if error.reason != "deadline_exceeded" or error.sent:
                # Nothing read this socket while no call waited: a send is where a dead
                # server (or a frame cut in two) shows first.
                self.fail(_lost("connection lost while sending"))
            raise

    def alive(self) -> bool:
        """False once the connection is known to be broken. When no one reads it, what the
        socket holds now is read first (without waiting): a server that closed the connection
        while no call waited is seen here, before a call is sent on it."""
        with self._condition:
            if self.broken is not None:
                return False
            if self._reading:
                return True
            self._reading = True
        self._read_until(None, time.monotonic())
        return self.broken is None

    def answered(self, call_id: int) -> bool:
        """Whether a frame of the call has arrived, reading what the socket holds now (without
        waiting) when no one else reads it."""
        with self._condition:
            if self._arrived.get(call_id) or self.broken is not None:
                return True
            if self._reading:
                return False
            self._reading = True
        self._read_until(None, time.monotonic())
        with self._condition:
            return bool(self._arrived.get(call_id)) or self.broken is not None

    def receive(self, call_id: int, deadline: float) -> tuple[int, bytes]:
        """The next frame of a call; at its deadline the call is abandoned (the server cancels
        its engine work) and DEADLINE_EXCEEDED raised."""
        while True:
            with self._condition:
                while True:
                    arrived = self._arrived.get(call_id)
                    if arrived:
                        kind, body = arrived.popleft()
                        if kind == ERROR:
                            raise _error_frame(body)
                        return kind, body
                    if self.broken is not None:
                        raise self.broken
                    if arrived is None:
                        raise LinkFailure(
                            "cancelled", "the call was closed", sent=True, status="CANCELLED"
                        )
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    if not self._reading:
                        self._reading = True
                        break
                    self._condition.wait(remaining)
            if remaining <= 0:
                self.abandon(call_id)
                raise _late("deadline exceeded")
            self._read_until(call_id, deadline)

    def _read_until(self, call_id: int | None, deadline: float) -> None:
        """As the reader (``_reading`` set by the caller): file frames until one of
        ``call_id`` came or ``deadline`` passed, then let another waiter read."""
        try:
            while True:
                try:
                    kind, frame_id, body = self._frames.next(deadline)
                except TimeoutError:
                    return
                with self._condition:
                    arrived = self._arrived.get(frame_id)
                    if kind in _ANSWERS and frame_id in self._slot_of:
                        if arrived is not None:
                            self._answered.add(frame_id)
                        else:  # its caller gave up: the slot is free only now
                            self._free_slots.append(self._slot_of.pop(frame_id))
                    if arrived is not None:
                        arrived.append((kind, body))
                        if frame_id == call_id:
                            return
                        self._condition.notify_all()
        except (OSError, _Closed) as error:
            reason = str(error) or "the server closed it"
            self.fail(_lost(f"connection lost: {reason}"))
        except LinkFailure as error:
            self.fail(error)
        finally:
            with self._condition:
                self._reading = False
                self._condition.notify_all()

    def abandon(self, call_id: int) -> None:
        self.close_call(call_id)
        with suppress(LinkFailure):
            self.send(ABANDON, call_id, b"", time.monotonic() + _ABANDON_TIMEOUT_S)

    def fail(self, error: LinkFailure) -> None:
        with self._condition:
            if self.broken is None:
                self.broken = error
            self._condition.notify_all()
        # Shut down, not closed: a sender or the reader may still hold the socket (closed
        # when dropped).
        _shutdown(self.sock)

    def close(self) -> None:
        _shutdown(self.sock)
        self.sock.close()
        if self.arena is not None:
            # Now, not when the connection is collected: a broken connection's error holds
            # a traceback that refers back to it, and the mapping holds a descriptor.
            self.arena.close()


def _error_frame(body: bytes) -> LinkFailure:
    """The failure an ERROR frame announces (see the module docstring for its statuses)."""
    try:
        status, message = _ERROR_DECODER.decode(body)
        reason, sent = _ERROR_REASONS[status]
    except (msgspec.MsgspecError, KeyError):
        return LinkFailure(
            "transport_error", "the server sent an undecodable error", sent=True, status="UNKNOWN"
        )
    return LinkFailure(reason, message, sent=sent, status=status)


def _deadline(timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else 1e9)


class _FramedStream:
    """An export: the server's ITEM frames until END."""

    def __init__(
        self,
        connection: _Connection,
        call_id: int,
        deadline: float,
    ) -> None:
        self._connection = connection
        self._call_id = call_id
        self._deadline = deadline
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            kind, body = self._connection.receive(self._call_id, self._deadline)
        except LinkFailure:
            self._done = True
            raise
        if kind == END:
            self._done = True
            self._connection.close_call(self._call_id)
            raise StopIteration
        if kind == REPLY:
            # A refusal of the request as a whole comes as a single reply.
            self._done = True
            self._connection.close_call(self._call_id)
        return body

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        self._connection.abandon(self._call_id)
        return True


class FramedLink:
    """The framed transport's client end, with the gRPC link's methods (see the module
    docstring). One connection, opened on first use and again after it broke."""

    def __init__(
        self,
        path: Path,
        *,
        token: str | None,
        max_message_bytes: int,
        shared_memory: bool = True,
    ) -> None:
        self.target = f"unix:{path}"
        self._shared_memory = shared_memory and SHARED_MEMORY
        self._path = str(path)
        self._token = token
        self._max_reply_bytes = 2 * max_message_bytes
        self._lock = threading.Lock()
        self._connection: _Connection | None = None
        self._refusal: LinkFailure | None = None
        self._closed = False

    def _connected(self, deadline: float) -> _Connection:
        connection = self._connection
        if connection is not None and connection.alive():
            return connection
        # Another caller may be connecting (a greeting may take its whole deadline): wait
        # for it no longer than this call's own deadline.
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _late(f"deadline passed waiting for a connection to {self.target}", sent=False)
        try:
            connection = self._connection
            if connection is not None and connection.broken is None:
                return connection
            if self._closed:
                raise _link_closed(sent=False)
            refusal, self._refusal = self._refusal, None
            if refusal is not None:
                raise refusal
            if connection is not None:
                # Broken: its reader has ended and it is shut down, so closing it wakes no
                # one; a late sender gets EBADF (the socket object forgets its descriptor).
                connection.close()
                self._connection = None
            self._connection = self._connect(deadline)
            return self._connection
        finally:
            self._lock.release()

    def _connect(self, deadline: float) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            greeting_deadline = min(deadline, time.monotonic() + _HELLO_TIMEOUT_S)
            sock.settimeout(max(0.001, greeting_deadline - time.monotonic()))
            sock.connect(self._path)
            _check_peer(sock, self.target)
            arena = self._lend(sock)
            reader = _Reader(sock, deadline=greeting_deadline)
            length, kind, _ = reader.header()
            body = reader.body(length) if length <= _MAX_GREETING_BYTES else b""
            sock.settimeout(None)
        except LinkFailure:
            sock.close()
            raise
        except TimeoutError:
            sock.close()
            raise _late(f"no answer from {self.target}", sent=False) from None
        except (OSError, _Closed) as error:
            sock.close()
            raise _lost(
                f"failed to connect to {self.target}: {error or 'closed'}", sent=False
            ) from None
        if kind != HELLO or length > _MAX_GREETING_BYTES:
            sock.close()
            if kind == ERROR and body:
                raise _error_frame(body).unsent()
            raise _lost("unexpected answer to HELLO", sent=False)
        try:
            welcome = _WELCOME_DECODER.decode(body) if body else _Welcome()
        except msgspec.MsgspecError:
            welcome = _Welcome()
        _widen_buffers(sock)
        return _Connection(sock, self._max_reply_bytes, arena if welcome.arena else None)

    def _lend(self, sock: socket.socket) -> _Arena | None:
        """Send HELLO, with the connection's shared memory when there is to be one."""
        arena: _Arena | None = None
        fds: list[int] = []
        hello = _Hello(token=self._token)
        if self._shared_memory:
            try:
                arena, fd = _Arena.create(ARENA_SLOTS, ARENA_SLOT_BYTES)
            except OSError as error:  # no memfd here, or no memory: the socket alone
                _LOG.debug("no shared memory for %s: %s", self.target, error)
            else:
                fds.append(fd)
                hello = _Hello(
                    token=self._token, arena_slots=ARENA_SLOTS, arena_slot_bytes=ARENA_SLOT_BYTES
                )
        frame = _frame(HELLO, 0, _HELLO_ENCODER.encode(hello))
        try:
            # A server that refuses the connection may close first: read its answer anyway.
            with suppress(BrokenPipeError, ConnectionResetError):
                sent = socket.send_fds(sock, [frame], fds) if fds else 0
                sock.sendall(frame[sent:])
        finally:
            for fd in fds:
                os.close(fd)
        return arena

    def wait_ready(self, timeout: float) -> bool:
        """Whether a server answered within ``timeout``; a refusal (a wrong token) counts as an
        answer, raised by the next call."""
        try:
            self._connected(_deadline(timeout))
        except LinkFailure as error:
            if error.reason in ("connection_lost", "deadline_exceeded"):
                return False
            self._refusal = error
        return True

    def call(
        self, message: bytes, timeout: float | None, reply_bytes: int | None = None
    ) -> RemoteReply | Rejected:
        """One call. It holds a slot of the shared memory when its request or its reply
        (``reply_bytes``, the payload bytes the caller expects; None: unknown) is large."""
        deadline = _deadline(timeout)
        connection = self._connected(deadline)
        large = (
            len(message) > _SLOT_MIN_BYTES or reply_bytes is None or reply_bytes > _SLOT_MIN_BYTES
        )
        call_id, slot = connection.open_call(slot=large)
        sent = False
        try:
            if slot is None:
                connection.send(CALL, call_id, message, deadline)
            else:
                connection.send(CALL_SLOT, call_id, connection.slot_call(slot, message), deadline)
            sent = True
            kind, body = connection.receive(call_id, deadline)
            if kind == SLOT_REPLY and slot is not None:
                body = connection.slot_reply(slot, body)
            # Any other frame than a reply decodes as the malformed reply it is.
        except LinkFailure as error:
            sent = sent or error.sent
            raise
        finally:
            connection.close_call(call_id, sent=sent)
        return decode_reply(body)

    def export(self, message: bytes, timeout: float | None) -> _FramedStream:
        deadline = _deadline(timeout)
        connection = self._connected(deadline)
        call_id, _ = connection.open_call()
        try:
            connection.send(EXPORT, call_id, message, deadline)
        except LinkFailure:
            connection.close_call(call_id)
            raise
        return _FramedStream(connection, call_id, deadline)

    def import_(self, messages: Iterator[bytes], timeout: float | None) -> RemoteReply | Rejected:
        deadline = _deadline(timeout)
        connection = self._connected(deadline)
        call_id, _ = connection.open_call()
        try:
            connection.send(IMPORT, call_id, b"", deadline)
            try:
                for message in messages:
                    if connection.answered(call_id):
                        break  # the server answered early (a refusal): the rest is not needed
                    connection.send(CHUNK, call_id, message, deadline)
                else:
                    connection.send(END, call_id, b"", deadline)
            except BaseException:
                connection.abandon(call_id)  # the server must not wait for the rest
                raise
            _, body = connection.receive(call_id, deadline)
        finally:
            connection.close_call(call_id)
        return decode_reply(body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


def _frame(kind: int, call_id: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body), kind, call_id) + body


# ----------------------------------------------------------------- server


class _CallContext:
    """What the server's dispatch needs of a call (what gRPC's ServicerContext gives it): who
    calls, and callbacks run when the call ends, whether it completed, was abandoned or lost
    its connection."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.ended = False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self.ended:
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> None:
        return None

    def invocation_metadata(self) -> None:
        return None  # the connection is the caller


_QUICK_CALLS: Final = (
    api.CancelRequest,
    HealthQuery,
    CapabilitiesQuery,
    MetricsQuery,
    ServerStatsQuery,
)
"""Calls that never wait for the pool: a connection's reading thread serves them when its
other thread is busy (a release, which waits for the engine's compute lock, does so only
when the pool has no place for it)."""
_BROKEN: Final = object()
_OVERRUN: Final = object()
_ImportItem = bytes | None | object
_MAX_QUEUED_CHUNK_BYTES: Final = 64 << 20
"""Import stream bytes one connection may have sent ahead of the calls taking them (an import
waiting for a pool thread takes none): beyond, the stream is refused with a retryable
ResourceExhausted instead of buffering whatever the client sends."""


class _Outgoing:
    """A frame waiting to leave a server connection."""

    __slots__ = ("deadline", "done", "parts", "size", "started")

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = collections.deque(memoryview(part) for part in parts)
        self.size = sum(len(part) for part in parts)
        self.started = False
        """Whether a writer took it (bytes of it may have left)."""
        self.done = False
        self.deadline: float | None = None
        """When it must have left, once a writer took it."""


class _ServerConnection:
    """One client's connection, served by two threads taking turns (see :meth:`_lead` and
    :meth:`_serve_here`); calls that overlap on the connection run on the server's pool."""

    def __init__(self, owner: FramedServer, sock: socket.socket, peer: str) -> None:
        self._owner = owner
        self._server = owner.server
        self.sock = sock
        self._peer = peer
        self._calls: dict[int, _CallContext] = {}
        self._streams: dict[int, queue.SimpleQueue[_ImportItem]] = {}
        self._lock = threading.Lock()
        self._turn = threading.Semaphore(0)
        """Released to let the thread that is not reading read."""
        self._other_idle = True
        """Whether the thread that is not reading waits for its turn (else it serves a call)."""
        self.watched = False
        """While the reading thread serves a call: whether the server's watcher is to hand
        the reading to the other thread when bytes arrive (see :meth:`_serve_here`)."""
        self._inline: int | None = None
        """The id of the call the reading thread serves, if any."""
        self._kept_reading = False
        """Whether that call's thread stopped watching as its answer left (it reads next)."""
        self._pooled = 0
        self._queued_bytes = 0
        """Import chunk bytes received on this connection and not yet taken (or dropped)."""
        """This connection's calls queued for or running on the server's pool."""
        self._closing = False
        self.arena: _Arena | None = None
        """The shared memory the client lent (see the module docstring)."""
        self._outgoing = threading.Condition(threading.Lock())
        self._out: collections.deque[_Outgoing] = collections.deque()
        """Frames waiting to leave, in order (the first may be leaving)."""
        self._out_bytes = 0
        self._writing = False
        """Whether a thread sends the waiting frames (the others only queue theirs)."""
        self._send_failed = False
        self._quiet_since = time.monotonic()
        """When the connection's last call ended (or it greeted)."""

    def send(self, kind: int, call_id: int, body: bytes, deadline: float | None = None) -> bool:
        """Queue a frame to leave in order. The caller's thread sends it (and those queued
        meanwhile) while the socket takes them; one that stops taking them for
        :data:`_SEND_PATIENCE_S` is left to a writer thread of the connection's own, which
        drops the connection when a frame takes longer than :data:`_SERVER_SEND_TIMEOUT_S` to
        leave. Without ``deadline`` (time.monotonic) the caller never waits longer than that
        patience; with one, it waits until its frame has left, and False says it had not by
        then (then withdrawn when no byte of it had left, else still leaving) or the connection
        broke."""
        if call_id == self._inline and kind in (REPLY, SLOT_REPLY, END):
            self._keep_reading()
        header = _HEADER.pack(len(body), kind, call_id)
        frame = _Outgoing([header + body] if len(body) <= _COALESCE_BYTES else [header, body])
        with self._outgoing:
            if self._send_failed:
                return False
            self._out.append(frame)
            self._out_bytes += frame.size
            write = not self._writing
            self._writing = True
        if write:
            self._write(_SEND_PATIENCE_S)
        if deadline is None:
            return True
        with self._outgoing:
            while not frame.done and not self._send_failed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if not frame.started:
                        self._out.remove(frame)
                        self._out_bytes -= frame.size
                    return False
                self._outgoing.wait(remaining)
            return frame.done

    def _write(self, patience: float | None) -> None:
        """As the connection's writer (``_writing`` set by the caller): send the waiting frames
        until none is left. With ``patience`` (a serving thread), hand the rest to a writer
        thread of its own once the socket has taken nothing for that long."""
        while True:
            with self._outgoing:
                if self._send_failed or not self._out:
                    self._writing = False
                    self._outgoing.notify_all()
                    return
                frame = self._out[0]
                frame.started = True
            outcome = self._write_frame(frame, patience)
            with self._outgoing:
                if outcome is None:  # it left
                    if self._out and self._out[0] is frame:
                        self._out.popleft()
                        self._out_bytes -= frame.size
                    frame.done = True
                    self._outgoing.notify_all()
                    continue
                if not outcome:  # the connection broke, or the frame took too long
                    self._send_failed = True
                    self._out.clear()
                    self._out_bytes = 0
                    self._writing = False
                    self._outgoing.notify_all()
            if not outcome:
                _shutdown(self.sock)
                return
            threading.Thread(
                target=self._write, args=(None,), daemon=True, name="framed-write"
            ).start()
            return

    def _write_frame(self, frame: _Outgoing, patience: float | None) -> bool | None:
        """Send what is left of ``frame``: None once it left, True when the socket took nothing
        for ``patience`` seconds, False when the connection broke or the frame took longer
        than :data:`_SERVER_SEND_TIMEOUT_S`."""
        if frame.deadline is None:
            frame.deadline = time.monotonic() + _SERVER_SEND_TIMEOUT_S
        sock = self.sock
        try:
            while frame.parts:
                view = frame.parts[0]
                try:
                    sent = sock.send(view, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    remaining = frame.deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    wait = remaining if patience is None else min(remaining, patience)
                    poller = select.poll()
                    poller.register(sock, select.POLLOUT)
                    if not poller.poll(math.ceil(wait * 1000)) and patience is not None:
                        return True
                    continue
                if sent == len(view):
                    frame.parts.popleft()
                else:
                    frame.parts[0] = view[sent:]
        except (OSError, ValueError):  # ValueError: closed meanwhile (no descriptor)
            return False
        return None

    def serve(self) -> None:
        """The connection's first thread: the greeting, then turns at reading."""
        try:
            greeted = self._greet()
        except (OSError, _Closed):
            greeted = False
        finally:
            self._owner.greeted()
        if not greeted:
            self._close_down()
            return
        threading.Thread(target=self._take_turns, daemon=True, name="framed-turn").start()
        self._take_turns(leading=True)

    def _take_turns(self, leading: bool = False) -> None:
        while True:
            if not leading:
                self._turn.acquire()
                if self._closing:
                    return
            leading = False
            if not self._lead():
                return

    def _close_down(self) -> None:
        """The connection ended: end its calls (which cancels their engine work), let the other
        thread go, close."""
        self._owner.forget_socket(self)
        with self._lock:
            self._closing = True
            calls, self._calls = dict(self._calls), {}
            streams, self._streams = dict(self._streams), {}
        self._turn.release()
        with self._outgoing:
            self._send_failed = True
            self._out.clear()
            self._out_bytes = 0
            self._outgoing.notify_all()
        for stream in streams.values():
            stream.put(_BROKEN)
        for context in calls.values():
            context.end()
        self.sock.close()
        if self.arena is not None:
            self.arena.close()
        self._owner.forget(self)

    def _greet(self) -> bool:
        counters = self._server.counters
        # The whole greeting by one deadline, not each read: a connection trickling its HELLO
        # a byte at a time would otherwise hold a greeting place for hours.
        reader = _Reader(self.sock, deadline=time.monotonic() + _HELLO_TIMEOUT_S)
        fds: list[int] = []
        reader.fds = fds
        try:
            try:
                length, kind, _ = reader.header()
                if kind != HELLO or length > _MAX_GREETING_BYTES:
                    counters.add("rejected_frames")
                    return False
                hello = _HELLO_DECODER.decode(reader.body(length))
            except (msgspec.MsgspecError, _ExtraDescriptors):
                counters.add("rejected_frames")
                return False
            reader.fds = None
            expected = self._server.security.token
            if expected and not hmac.compare_digest(
                (hello.token or "").encode(), expected.encode()
            ):
                counters.add("unauthenticated")
                self.send(
                    ERROR, 0, _HELLO_ENCODER.encode(("UNAUTHENTICATED", "missing or wrong token"))
                )
                return False
            if hello.arena_slots or fds or reader.extra_fds:
                self.arena = (
                    _Arena.adopt(fds.pop(0), hello.arena_slots, hello.arena_slot_bytes)
                    if hello.arena_slots and len(fds) == 1 and not reader.extra_fds
                    else None
                )
                if self.arena is None:
                    counters.add("refused_shared_memory")
        finally:
            for fd in fds:
                os.close(fd)
        self.sock.settimeout(None)
        reader.deadline = None
        _widen_buffers(self.sock)
        self.send(HELLO, 0, _HELLO_ENCODER.encode(_Welcome(arena=self.arena is not None)))
        self._reader = reader
        return True

    def _lead(self) -> bool:
        """Read frames until a call arrives; then, when the other thread is idle, serve the
        call here (:meth:`_serve_here`): the request reaches the engine and the reply leaves
        without a thread handoff, which on a 2-core machine is a visible share of a decode
        hop, while the other thread still sees the call's ABANDON and other calls. True when
        the other thread took over the reading. A call arriving while both threads are busy
        goes to the pool. False when the connection ended."""
        try:
            return self._read_frames()
        except (OSError, _Closed):
            self._close_down()
            return False

    def _read_frames(self) -> bool:
        reader = self._reader
        limit = self._server.max_message_bytes
        pool = self._owner.pool
        while True:
            if not self._await_frame():
                raise _Closed  # no call for connection_idle_s: closed (its client reconnects)
            length, kind, call_id = reader.header()
            if length > limit:
                reader.skip(length)
                self._refuse(call_id, oversized_error(length, limit))
                continue
            body = reader.body(length)
            if kind in (CHUNK, END):
                overrun = False
                with self._lock:
                    stream = (
                        self._streams.get(call_id)
                        if kind == CHUNK
                        else self._streams.pop(call_id, None)
                    )
                    if stream is not None and kind == CHUNK:
                        overrun = self._queued_bytes + len(body) > _MAX_QUEUED_CHUNK_BYTES
                        if overrun:
                            del self._streams[call_id]
                        else:
                            self._queued_bytes += len(body)
                if stream is not None:
                    if overrun:
                        self._discard(stream)
                        stream.put(_OVERRUN)
                    else:
                        stream.put(body if kind == CHUNK else None)
                continue
            if kind == ABANDON:
                with self._lock:
                    context = self._calls.get(call_id)
                    stream = self._streams.pop(call_id, None)
                if stream is not None:
                    stream.put(_BROKEN)
                if context is not None:
                    context.end()
                continue
            if kind not in (CALL, CALL_SLOT, EXPORT, IMPORT):
                self._refuse(call_id, api.InvalidRequest(f"unknown frame kind {kind}"))
                continue
            with self._lock:
                reused = call_id in self._calls
            if reused:
                # One context per id: a second would hide the first from the connection's end,
                # whose engine work would then outlive it uncancelled.
                self._refuse(call_id, api.InvalidRequest(f"call id {call_id} is already in flight"))
                continue
            if self._owner.draining:
                self._draining_error(call_id)
                continue
            # Frames the client has not taken hold no thread, only memory: past a bound, this
            # connection's next call waits (and nothing more of it is read) until they left.
            self._await_outgoing()
            request = decode_request(body, max_bytes=limit) if kind == CALL else None
            quick = isinstance(request, _QUICK_CALLS)
            with self._lock:
                hand_over, self._other_idle = self._other_idle, False
                # A connection's own call (served on its own thread) is always admitted; only
                # calls overlapping on one connection queue for the pool, each connection up to
                # a share of what the server queues, so no client's flood (nor its stalled
                # streams) leaves the others nothing. Quick control calls (cancel, health,
                # capabilities, metrics, stats) never queue: served on this thread at once.
                pooled = (
                    not hand_over and not quick and self._pooled < self._owner.calls_per_connection
                )
                if pooled:
                    self._pooled += 1
            if pooled and not self._owner.admit():
                with self._lock:
                    self._pooled -= 1
                pooled = False
            here = not hand_over and not pooled
            if here and not (quick or isinstance(request, api.ReleaseRequest)):
                self._server.counters.add("busy")
                self._refuse_busy(call_id)
                continue
            context = _CallContext(self._peer)
            with self._lock:
                self._calls[call_id] = context
                if kind == IMPORT:
                    stream = self._streams[call_id] = queue.SimpleQueue()
            serve: Callable[[int, _CallContext, typing.Any], None] = (
                self._call
                if kind == CALL
                else self._call_slot
                if kind == CALL_SLOT
                else self._export
                if kind == EXPORT
                else self._import
            )
            argument = stream if kind == IMPORT else request if kind == CALL else body
            if here:
                # A control call without a pool place (a release when the pool is full): it
                # has a thread whatever the other connections do, this one.
                self._run(call_id, context, serve, argument, pooled=False)
                continue
            if hand_over:
                if self._serve_here(call_id, context, serve, argument):
                    continue
                return True
            try:
                pool.submit(self._run, call_id, context, serve, argument, pooled=True)
            except RuntimeError:  # the pool shut down: the server is stopping
                self._unpool()
                self._draining_error(call_id)

    def _serve_here(
        self,
        call_id: int,
        context: _CallContext,
        serve: Callable[[int, _CallContext, typing.Any], None],
        argument: object,
    ) -> bool:
        """Serve a call on the reading thread. Meanwhile the other thread reads only once bytes
        arrive (the server's watcher wakes it): a lone caller's call then wakes no thread but
        this one, while a call's ABANDON or another call is still read at once. True when
        this thread is still the reader afterwards (nothing arrived while it served), False
        when the other thread took over (this one then waits for its turn)."""
        watched = not self._reader.buffered and self._owner.watch(self)
        if not watched:
            self._turn.release()
        self._inline, self._kept_reading = call_id, False
        try:
            self._run(call_id, context, serve, argument, pooled=False)
        finally:
            self._inline = None
        with self._lock:
            self._other_idle = True
            armed, self.watched = self.watched, False
            still_reading = armed or self._kept_reading
        if armed:
            self._owner.unwatch(self)
        return still_reading

    def _keep_reading(self) -> None:
        """The call served on the reading thread is answering: stop watching, so the caller's
        next call (which may arrive before this thread is back at reading) waits for this
        thread instead of waking the other one."""
        with self._lock:
            if not self.watched:
                return  # bytes came meanwhile: the other thread reads now
            self.watched = False
            self._kept_reading = True
        self._owner.unwatch(self)

    def _await_outgoing(self) -> None:
        """Wait while more than :data:`_MAX_OUTGOING_BYTES` of this connection's frames wait
        to leave (its writer drops the connection when one takes too long)."""
        with self._outgoing:
            while self._out_bytes > _MAX_OUTGOING_BYTES and not self._send_failed:
                self._outgoing.wait(1.0)

    def _await_frame(self) -> bool:
        """Wait for the next frame's bytes; False when the connection has had no call in
        flight for the server's ``connection_idle_s``."""
        idle = self._owner.connection_idle_s
        if self._reader.buffered or math.isinf(idle):
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        timeout = idle
        while not poller.poll(math.ceil(timeout * 1000)):
            with self._lock:
                busy = bool(self._calls)
                quiet_since = self._quiet_since
            timeout = idle if busy else quiet_since + idle - time.monotonic()
            if timeout <= 0:
                return False
        return True

    def hand_over_reading(self) -> None:
        """Bytes arrived while the reading thread serves a call: let the other thread read."""
        with self._lock:
            if not self.watched:
                return  # the call ended first: its thread reads them
            self.watched = False
        self._turn.release()

    def _draining_error(self, call_id: int) -> None:
        message = "the server is shutting down; the request was not sent to its engine"
        self.send(ERROR, call_id, _HELLO_ENCODER.encode(("UNAVAILABLE", message)))

    def _refuse_busy(self, call_id: int) -> None:
        retry_after = self._server.retry_after_s()
        error = api.ResourceExhausted(
            "the server holds as many of this connection's overlapping calls (or of all "
            f"connections') as it queues; nothing ran; retry in {retry_after:.3f} s",
            details={"resource": "server_calls", "retry_after_s": retry_after},
        )
        self.send(REPLY, call_id, encode_reply(error.to_info()))

    def _refuse(self, call_id: int, error: api.ShardEngineError) -> None:
        self._server.counters.add("calls")
        self.send(REPLY, call_id, encode_reply(self._server._refused_frame(error)))

    def _run(
        self,
        call_id: int,
        context: _CallContext,
        serve: Callable[[int, _CallContext, typing.Any], None],
        argument: object,
        *,
        pooled: bool,
    ) -> None:
        try:
            serve(call_id, context, argument)
        except Exception as error:  # noqa: BLE001 - a bug here must not leave the caller waiting
            _LOG.exception("serving a framed call failed")
            failure = api.ShardEngineError(f"the server failed: {type(error).__name__}: {error}")
            self.send(REPLY, call_id, encode_reply(failure.to_info()))
        finally:
            if pooled:
                self._unpool()
            with self._lock:
                self._calls.pop(call_id, None)
                stream = self._streams.pop(call_id, None)
                self._quiet_since = time.monotonic()
            if stream is not None:
                self._discard(stream)  # what the call did not take (it answered early)
            context.end()

    def _taken(self, chunk: bytes) -> None:
        with self._lock:
            self._queued_bytes -= len(chunk)

    def _discard(self, stream: queue.SimpleQueue[_ImportItem]) -> None:
        """Drop the chunks waiting in ``stream``."""
        while True:
            try:
                item = stream.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, bytes):
                self._taken(item)

    def _unpool(self) -> None:
        self._owner.release()
        with self._lock:
            self._pooled -= 1

    def _call(self, call_id: int, context: _CallContext, request: RemoteRequest | Rejected) -> None:
        reply = self._server._call(request, context)
        if not context.ended:
            self.send(REPLY, call_id, encode_reply(reply))

    def _call_slot(self, call_id: int, context: _CallContext, body: bytes) -> None:
        """A call holding a slot of the shared memory: its request may be there, its reply
        goes there when large. Answered even when abandoned: the answer frees the slot."""
        arena = self.arena
        limit = self._server.max_message_bytes
        if arena is None or len(body) < _SLOT_CALL.size:
            self._refuse(
                call_id,
                api.InvalidRequest(
                    "a CALL_SLOT frame on a connection without shared memory, or shorter than "
                    "its slot header"
                ),
            )
            return
        slot, length = _SLOT_CALL.unpack_from(body)
        inline = len(body) > _SLOT_CALL.size
        if slot >= arena.slots or length > arena.slot_bytes or (length and inline):
            self._refuse(
                call_id,
                api.InvalidRequest(
                    f"a CALL_SLOT frame naming {length} bytes in slot {slot}: the connection's "
                    f"shared memory has {arena.slots} slots of {arena.slot_bytes} bytes"
                ),
            )
            return
        if length > limit:  # refused before a byte is copied, as a socket's body is skipped
            self._refuse(call_id, oversized_error(length, limit))
            return
        try:
            request = arena.take(slot, length) if length else body[_SLOT_CALL.size :]
        except ValueError:
            return  # the connection ended: its shared memory is unmapped, no one listens
        reply = self._server._call(decode_request(request, max_bytes=limit), context)
        # A large reply straight into the slot (its payload copied once), unless it does not
        # fit; a small one in its frame.
        try:
            written = (
                encode_reply_into(reply, arena.slot(slot))
                if payload_bytes(reply) > _SLOT_MIN_BYTES
                else None
            )
        except ValueError:
            return  # as above
        if length or written is not None:
            self._server.counters.add("shared_memory_calls")
        if written is None:
            self.send(REPLY, call_id, encode_reply(reply))
        else:
            self.send(SLOT_REPLY, call_id, _SLOT_ANSWER.pack(written))

    def _export(self, call_id: int, context: _CallContext, body: bytes) -> None:
        """The export stream, under the gRPC export's rules: each message must leave within
        ``stream_idle_s`` and the whole stream by ``stream_idle_s + size /
        min_stream_bytes_per_s`` (``EngineServer._stream_due``); else it ends with
        DEADLINE_EXCEEDED, counted as ``stalled``, and frees its slots at once."""
        server = self._server
        request = decode_request(body, max_bytes=server.max_message_bytes)
        messages = server._export(request, context)
        idle = server.stream_idle_s
        due: float | None = None
        try:
            for message in messages:
                if context.ended:
                    return
                if due is None:  # the header: the stream's size
                    header = decode_export_header(message)
                    size = header.snapshot.state_bytes if isinstance(header, SnapshotHeader) else 0
                    due = server._stream_due(size)
                if not self.send(ITEM, call_id, message, min(due, time.monotonic() + idle)):
                    if not context.ended:
                        server.counters.add("stalled")
                        why = (
                            f"slower than {server._rate_words()}"
                            if time.monotonic() >= due
                            else f"without taking a message for {idle:g} s"
                        )
                        words = f"the client takes the export {why}"
                        self.send(
                            ERROR, call_id, _HELLO_ENCODER.encode(("DEADLINE_EXCEEDED", words))
                        )
                    return
        finally:
            if isinstance(messages, Generator):
                messages.close()  # its bookkeeping (calls in flight, slots) ends now
        self.send(END, call_id, b"")

    def _import(
        self, call_id: int, context: _CallContext, stream: queue.SimpleQueue[_ImportItem]
    ) -> None:
        idle = self._server.stream_idle_s

        def messages() -> Iterator[bytes]:
            while True:
                try:
                    item = stream.get(timeout=idle)
                except queue.Empty:
                    raise StreamBroken(f"no message arrived within {idle} s") from None
                if item is None:
                    return
                if item is _OVERRUN:
                    raise api.ResourceExhausted(
                        f"the import stream got more than {_MAX_QUEUED_CHUNK_BYTES} bytes ahead "
                        "of the server, whose threads are busy; nothing was imported; retry",
                        retryable=True,
                        details={"resource": "import_queue_bytes"},
                    )
                if not isinstance(item, bytes):
                    raise StreamBroken("the client abandoned the stream or lost its connection")
                self._taken(item)
                yield item

        reply = self._server._import(messages(), context)
        if not context.ended:
            self.send(REPLY, call_id, encode_reply(reply))


class FramedServer:
    """Serves an :class:`EngineServer`'s dispatch over the framed transport on a unix socket in
    a private directory. Threads: one accepting; two per connection, taking turns at reading
    and serving the call just read; one watching the sockets of connections whose reading
    thread serves a call; and a pool for calls that overlap on a connection, a thread for each
    call it admits (so compute calls reach the engine in the order of the server's fair queue,
    never the pool's: they are bounded by the server's slots and queue, as over gRPC)."""

    def __init__(
        self,
        server: EngineServer,
        *,
        max_connections: int = 64,
        connection_idle_s: float = DEFAULT_CONNECTION_IDLE_S,
    ) -> None:
        if not connection_idle_s > 0:
            raise api.InvalidRequest(f"connection_idle_s must be > 0, got {connection_idle_s}")
        self.connection_idle_s = connection_idle_s
        """A greeted connection with no call in flight for this long is closed (its client
        reconnects when it next calls); ``math.inf``: never."""
        self.server = server
        self.engine = server.engine
        self.address: str | None = None
        self.draining = False
        admitted = server.max_workers * 8
        # A thread for every call admitted (started as needed): a call never waits in the
        # pool's own first-come queue, only in the server's queue, which is fair per client.
        self.pool = futures.ThreadPoolExecutor(
            max_workers=admitted, thread_name_prefix="engine-framed"
        )
        self._max_connections = max_connections
        self._listener: socket.socket | None = None
        self._path: Path | None = None
        self._connections: set[_ServerConnection] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._calls = threading.BoundedSemaphore(admitted)
        """Calls queued for or running on the pool, all connections together (gRPC's
        maximum_concurrent_rpcs on the other transport): beyond, a retryable
        ResourceExhausted."""
        self.calls_per_connection = max(1, server.max_workers * 2)
        """How many of those one connection may hold."""
        self._greeting = 0
        """Connections accepted that have not greeted yet: bounded apart from the greeted
        ones, so connections that never greet cannot crowd out clients that did."""
        self._watcher: select.epoll | None = None
        self._watching: dict[int, _ServerConnection] = {}
        self._stop_watching: int | None = None
        """The write end of the pipe that ends the watcher thread."""

    def watch(self, connection: _ServerConnection) -> bool:
        """Arm the watcher for ``connection``'s socket (one event, then disarmed); False when
        it cannot watch (the server is stopping: the caller hands the reading over itself)."""
        fd = connection.sock.fileno()
        with connection._lock:
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
            with connection._lock:
                connection.watched = False
            return False
        return True

    def unwatch(self, connection: _ServerConnection) -> None:
        fd = connection.sock.fileno()
        with self._lock, suppress(OSError, ValueError):
            if self._watcher is not None and self._watching.get(fd) is connection:
                self._watcher.modify(fd, _UNWATCHED)

    def forget_socket(self, connection: _ServerConnection) -> None:
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
        self.server._refresh_health()
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
                refused = (
                    self.draining
                    or greeted >= self._max_connections
                    or self._greeting >= self._max_connections
                )
                if not refused:
                    connection = _ServerConnection(self, sock, f"unix:connection-{number}")
                    self._connections.add(connection)
                    self._greeting += 1
            if refused:
                self.server.counters.add("busy")
                _refuse_connection(sock, "the server holds as many connections as it serves")
                continue
            threading.Thread(target=connection.serve, daemon=True, name=f"framed-{number}").start()
            del connection  # its thread holds it; held here, its end would wait for the next

    def greeted(self) -> None:
        """A connection's greeting ended (either way)."""
        with self._lock:
            self._greeting -= 1

    def forget(self, connection: _ServerConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop taking calls, let in-flight ones finish for up to ``grace`` seconds, then end
        the rest (which cancels their engine work) and close every connection."""
        self.draining = True
        self.server.refuse_new_calls()
        listener, self._listener = self._listener, None
        if listener is not None:
            _shutdown(listener)
            listener.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        deadline = time.monotonic() + (grace if grace is not None else 1e9)
        # Calls waiting for a compute slot are served in turn until near the grace's end,
        # then refused (naming the drain; nothing of them ran) while their replies can leave.
        refuse_queued = deadline - (drain_margin_s(grace) if grace is not None else 0.0)
        while self.server.counters.in_flight > 0 and time.monotonic() < refuse_queued:
            time.sleep(0.01)
        self.server.refuse_queued_calls()
        while self.server.counters.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _shutdown(connection.sock)
        self.pool.shutdown(wait=True, cancel_futures=True)
        stop_watching, self._stop_watching = self._stop_watching, None
        if stop_watching is not None:
            os.write(stop_watching, b"x")
            os.close(stop_watching)
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stopped; False on timeout."""
        return self._stopped.wait(timeout)
