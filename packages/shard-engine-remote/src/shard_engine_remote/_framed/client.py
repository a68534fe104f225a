"""The framed transport's client end: :class:`FramedLink`, a
:class:`~shard_engine_remote._link.Link` over one connection whose callers take turns reading it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Final

import msgspec

from shard_engine_remote._framed.arena import ARENA_SLOT_BYTES, ARENA_SLOTS, SHARED_MEMORY, Arena
from shard_engine_remote._framed.frames import (
    ABANDON,
    CALL,
    CALL_SLOT,
    CHUNK,
    COALESCE_BYTES,
    END,
    ERROR,
    ERROR_DECODER,
    EXPORT,
    GO_AHEAD,
    GOAWAY,
    GRANT,
    HEADER,
    HELLO,
    HELLO_ENCODER,
    HELLO_TIMEOUT_S,
    IMPORT,
    LARGE_READ,
    MAX_GREETING_BYTES,
    PROTOCOL_VERSION,
    READ_SIZE,
    REPLY,
    SLOT_ANSWER,
    SLOT_CALL,
    SLOT_MIN_BYTES,
    SLOT_REPLY,
    WELCOME_DECODER,
    Closed,
    Hello,
    Reader,
    Welcome,
    encode_frame,
    shut_down,
    widen_buffers,
)
from shard_engine_remote._link import LinkFailure, Reason
from shard_engine_remote._wire import (
    Rejected,
    RemoteReply,
    decode_reply,
)

__all__ = ["CONNECTION_RETRY_S", "FramedLink"]

_OPENINGS: Final = frozenset((CALL, CALL_SLOT, EXPORT, IMPORT))
"""The frames that open a call."""

_ANSWERS: Final = frozenset((REPLY, SLOT_REPLY, ERROR))
"""The frames that end a call (what frees a slot the call held)."""

_PEER_CREDENTIALS: Final = struct.Struct("3i")
"""struct ucred (pid, uid, gid), as SO_PEERCRED answers."""

_ABANDON_TIMEOUT_S: Final = 1.0

CONNECTION_RETRY_S: Final = 0.05
"""How long a client waits (as a refused call's ``retry_after_s``) before it connects again
to a server that refused its connection for holding as many as it serves."""

_LOG: Final = logging.getLogger("shard_engine.remote")

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


def _going_away() -> LinkFailure:
    return _lost(
        "connection lost: the server shut down (its grace ended before it answered the call)"
    )


def _never_read() -> LinkFailure:
    return _lost("the server shut down before it read the request; nothing of it ran", sent=False)


def _data_loss(message: str) -> LinkFailure:
    return LinkFailure("transport_error", message, sent=True, status="DATA_LOSS")


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


def _send(
    sock: socket.socket,
    lock: threading.Lock,
    kind: int,
    call_id: int,
    body: bytes,
    deadline: float,
    started: Callable[[], None] | None = None,
) -> None:
    """Send one frame whole by ``deadline`` (time.monotonic). Raises LinkFailure
    (``deadline_exceeded`` or ``connection_lost``; ``sent`` when a byte left, after shutting the
    connection down (a frame cut in two leaves the
    stream unreadable). Sends never block the socket for readers: MSG_DONTWAIT and poll.
    ``started`` is called (under ``lock``) as the frame's first byte leaves."""
    header = HEADER.pack(len(body), kind, call_id)
    parts = [header + body] if len(body) <= COALESCE_BYTES else [header, body]
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
                if not sent_any and started is not None:
                    started()
                sent_any = True
                view = view[sent:]
    except (OSError, ValueError) as error:  # ValueError: closed meanwhile (no descriptor)
        raise _lost(f"connection lost while sending: {error}", sent=sent_any) from None
    except LinkFailure:
        if sent_any:
            shut_down(sock)
        raise
    finally:
        lock.release()


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
                raise Closed from None
            remaining = deadline - time.monotonic()
            if not poller.poll(max(0, math.ceil(remaining * 1000))):
                raise TimeoutError
            try:
                chunk = self._sock.recv(size, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not chunk:
                raise Closed
            return chunk

    def next(self, deadline: float) -> tuple[int, int, bytes]:
        """(kind, call id, body) of the next frame. Raises TimeoutError at ``deadline`` (the
        part read is kept), Closed or OSError when the connection ended, LinkFailure when
        the server announces a reply over the limit."""
        buffer = self._buffer
        if self._header is None:
            while len(buffer) < HEADER.size:
                buffer += self._recv(READ_SIZE, deadline)
            length, kind, call_id = HEADER.unpack_from(buffer)
            if length > self._max_reply_bytes:
                # Not RESOURCE_EXHAUSTED: that says the server refused the request (it did
                # not run); an oversized reply is a broken server whose call may have run.
                raise _data_loss(
                    f"the server announced a {length}-byte reply, larger than max "
                    f"{self._max_reply_bytes}; the connection was dropped",
                )
            del buffer[: HEADER.size]
            self._header = (length, kind, call_id)
        length, kind, call_id = self._header
        while self._have < length:
            needed = length - self._have
            if buffer:
                taken = min(needed, len(buffer))
                self._parts.append(bytes(buffer[:taken]))
                del buffer[:taken]
                self._have += taken
            elif needed <= READ_SIZE:
                buffer += self._recv(READ_SIZE, deadline)
            else:
                # Memory is taken as bytes arrive, never for what a header merely announces.
                chunk = self._recv(min(needed, LARGE_READ), deadline)
                self._parts.append(chunk)
                self._have += len(chunk)
        parts, self._parts, self._have, self._header = self._parts, [], 0, None
        return kind, call_id, b"".join(parts)


class _Connection:
    """One client connection: its socket and the calls waiting on it. It has no thread of its
    own: a waiting caller reads the socket itself (one caller at a time, the *reader*), files
    each frame under its call's id and wakes that call's waiter only; when its own frame has
    come, or its deadline, it stops reading and wakes one waiter still without a frame to take
    over. A lone caller thus reads its own reply, with no thread handing it over (on a 2-core
    machine, a wake-up per hop), and N callers cost one wake-up per frame, not N (waking every
    waiter for every frame cost 8 callers of one child 64 wake-ups per step)."""

    def __init__(
        self,
        sock: socket.socket,
        max_reply_bytes: int,
        arena: Arena | None = None,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        self.sock = sock
        self.go_ahead = version >= 1
        """Whether the server grants an import's chunks (GO_AHEAD) once it admitted its header
        (an older server takes them right after the header, ungranted)."""
        self.send_lock = threading.Lock()
        self._frames = _ReplyFrames(sock, max_reply_bytes)
        self._max_reply_bytes = max_reply_bytes
        self._lock = threading.Lock()
        """Guards the calls' state below; each waiting call's condition is on it."""
        self._waiting: dict[int, threading.Condition] = {}
        """The calls whose callers wait in :meth:`receive`, each woken alone (on ``_lock``)."""
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
        self._sent_frames = 0
        """Frames whose first byte left (under ``send_lock``): a GOAWAY's count is of these."""
        self._first_frame: dict[int, int] = {}
        """For each open call whose first frame left: that frame's number (1, 2, ...)."""
        self._read_by_server: int | None = None
        """The server's GOAWAY: how many frames it read before it closed (None: no GOAWAY
        came). A call whose first frame came later never ran."""

    def open_call(self, slot: bool = False) -> tuple[int, int | None]:
        """A new call's id, and its slot of the shared memory when ``slot`` is asked and one
        is free (never without shared memory: no slot is ever free then)."""
        call_id = next(self._ids)
        with self._lock:
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
        with self._lock:
            self._arrived.pop(call_id, None)
            self._first_frame.pop(call_id, None)
            waiter = self._waiting.get(call_id)
            if waiter is not None:
                waiter.notify()
            if call_id in self._slot_of and (call_id in self._answered or not sent):
                self._answered.discard(call_id)
                self._free_slots.append(self._slot_of.pop(call_id))

    def slot_call(self, slot: int, request: bytes) -> bytes:
        """The body of a CALL_SLOT frame for ``request``: a large one placed in the call's
        slot, a small one inline."""
        assert self.arena is not None
        if not SLOT_MIN_BYTES < len(request) <= self.arena.slot_bytes:
            return SLOT_CALL.pack(slot, 0) + request
        try:
            self.arena.put(slot, request)
        except ValueError:  # the link was closed meanwhile (the mapping is gone)
            raise _link_closed(sent=False) from None
        return SLOT_CALL.pack(slot, len(request))

    def slot_reply(self, slot: int, body: bytes) -> bytes:
        """The reply a SLOT_REPLY frame announces, copied out of the call's slot."""
        assert self.arena is not None
        (length,) = SLOT_ANSWER.unpack(body) if len(body) == SLOT_ANSWER.size else (-1,)
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
        def started() -> None:
            self._sent_frames += 1
            if kind in _OPENINGS:
                self._first_frame[call_id] = self._sent_frames

        try:
            _send(self.sock, self.send_lock, kind, call_id, body, deadline, started)
        except LinkFailure as error:
            if error.reason != "deadline_exceeded" or error.sent:
                # Nothing read this socket while no call waited: a send is where a dead
                # server (or a frame cut in two) shows first. A draining server's GOAWAY
                # may wait in the socket: it says whether this call was read.
                self._take_goaway()
                self.fail(_lost("connection lost while sending"))
                with self._lock:
                    unread = self._unread(call_id)
                if error.sent and unread:
                    raise _never_read() from None
            raise

    def _take_goaway(self) -> None:
        """After a send failed: file the frames the socket still holds (a server that closed
        sent them first), reading them here when no one else reads, else waiting briefly
        for the reader to end."""
        with self._lock:
            reading = self._reading
            if not reading:
                self._reading = True
        if not reading:
            self._read_until(None, time.monotonic())
            return
        waited = time.monotonic() + _ABANDON_TIMEOUT_S
        while time.monotonic() < waited:
            with self._lock:
                if self.broken is not None or not self._reading:
                    return
            time.sleep(0.001)

    def _unread(self, call_id: int) -> bool:
        """Whether the server said (GOAWAY) that it never read the call (under the lock)."""
        read = self._read_by_server
        first = self._first_frame.get(call_id)
        return read is not None and (first is None or first > read)

    def _failure(self, call_id: int) -> LinkFailure:
        """The broken connection's failure as ``call_id`` meets it (under the lock): not sent
        when the server said it never read the call."""
        assert self.broken is not None
        return _never_read() if self._unread(call_id) else self.broken

    def alive(self) -> bool:
        """False once the connection is known to be broken. When no one reads it, what the
        socket holds now is read first (without waiting): a server that closed the connection
        while no call waited is seen here, before a call is sent on it."""
        with self._lock:
            if self.broken is not None:
                return False
            if self._reading:
                return True
            self._reading = True
        self._read_until(None, time.monotonic())
        return self.broken is None

    def call_open(self, call_id: int) -> bool:
        """Whether the call is open (neither closed nor abandoned)."""
        with self._lock:
            return call_id in self._arrived

    def answered(self, call_id: int) -> bool:
        """Whether a frame of the call has arrived, reading what the socket holds now (without
        waiting) when no one else reads it."""
        with self._lock:
            if self._arrived.get(call_id) or self.broken is not None:
                return True
            if self._reading:
                return False
            self._reading = True
        self._read_until(None, time.monotonic())
        with self._lock:
            return bool(self._arrived.get(call_id)) or self.broken is not None

    def receive(self, call_id: int, deadline: float) -> tuple[int, bytes]:
        """The next frame of a call; at its deadline the call is abandoned (the server cancels
        its engine work) and DEADLINE_EXCEEDED raised."""
        waiter: threading.Condition | None = None
        while True:
            with self._lock:
                try:
                    while True:
                        arrived = self._arrived.get(call_id)
                        if arrived:
                            kind, body = arrived.popleft()
                            if kind == ERROR:
                                raise _error_frame(body)
                            return kind, body
                        if self.broken is not None:
                            raise self._failure(call_id)
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
                        if waiter is None:
                            waiter = threading.Condition(self._lock)
                        self._waiting[call_id] = waiter
                        try:
                            waiter.wait(remaining)
                        finally:
                            del self._waiting[call_id]
                finally:
                    # Leaving without reading (answered, failed, late) while the reader's
                    # turn is free: a caller still waiting for a frame must take it.
                    if not self._reading:
                        self._hand_over()
            if remaining <= 0:
                self.abandon(call_id)
                raise _late("deadline exceeded")
            self._read_until(call_id, deadline)

    def _hand_over(self) -> None:
        """With no reader (under the lock): wake one caller still waiting for a frame, to
        read in its turn (the others stay asleep)."""
        for waiting, waiter in self._waiting.items():
            if not self._arrived.get(waiting):
                waiter.notify()
                return

    def _read_until(self, call_id: int | None, deadline: float) -> None:
        """As the reader (``_reading`` set by the caller): file frames until one of
        ``call_id`` came or ``deadline`` passed, then let another waiter read."""
        try:
            while True:
                try:
                    kind, frame_id, body = self._frames.next(deadline)
                except TimeoutError:
                    return
                if kind == GOAWAY:
                    # The server's last frame (every answer it sends came before); its call
                    # id field is how many of this side's frames it read.
                    with self._lock:
                        self._read_by_server = frame_id
                    self.fail(_going_away())
                    return
                with self._lock:
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
                        waiter = self._waiting.get(frame_id)
                        if waiter is not None:
                            waiter.notify()
        except (OSError, Closed) as error:
            reason = str(error) or "the server closed it"
            self.fail(_lost(f"connection lost: {reason}"))
        except LinkFailure as error:
            self.fail(error)
        finally:
            with self._lock:
                self._reading = False
                self._hand_over()

    def abandon(self, call_id: int) -> None:
        self.close_call(call_id)
        with suppress(LinkFailure):
            self.send(ABANDON, call_id, b"", time.monotonic() + _ABANDON_TIMEOUT_S)

    def fail(self, error: LinkFailure) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            for waiter in self._waiting.values():
                waiter.notify()
        # Shut down, not closed: a sender or the reader may still hold the socket (closed
        # when dropped).
        shut_down(self.sock)

    def close(self) -> None:
        shut_down(self.sock)
        self.sock.close()
        if self.arena is not None:
            # Now, not when the connection is collected: a broken connection's error holds
            # a traceback that refers back to it, and the mapping holds a descriptor.
            self.arena.close()


def _error_frame(body: bytes) -> LinkFailure:
    """The failure an ERROR frame announces (see the module docstring for its statuses)."""
    try:
        status, message = ERROR_DECODER.decode(body)
        reason, sent = _ERROR_REASONS[status]
    except (msgspec.MsgspecError, KeyError):
        return LinkFailure(
            "transport_error", "the server sent an undecodable error", sent=True, status="UNKNOWN"
        )
    return LinkFailure(reason, message, sent=sent, status=status)


def _answer(kind: int, body: bytes) -> bytes | int:
    """The chunks a GO_AHEAD frame grants, else the body of the import's answer (any other
    frame than a reply, or a GO_AHEAD of the wrong size, decodes as the malformed reply it is).
    A server granting what it did not ask for gets those chunks, nothing worse."""
    if kind == GO_AHEAD and len(body) == GRANT.size:
        (granted,) = GRANT.unpack(body)
        return int(granted)
    return body


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
        arena_slots: int = ARENA_SLOTS,
    ) -> None:
        self.target = f"unix:{path}"
        self._arena_slots = arena_slots
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
            greeting_deadline = min(deadline, time.monotonic() + HELLO_TIMEOUT_S)
            sock.settimeout(max(0.001, greeting_deadline - time.monotonic()))
            sock.connect(self._path)
            _check_peer(sock, self.target)
            arena = self._lend(sock)
            reader = Reader(sock, deadline=greeting_deadline)
            length, kind, _ = reader.header()
            body = reader.body(length) if length <= MAX_GREETING_BYTES else b""
            sock.settimeout(None)
        except LinkFailure:
            sock.close()
            raise
        except TimeoutError:
            sock.close()
            raise _late(f"no answer from {self.target}", sent=False) from None
        except (OSError, Closed) as error:
            sock.close()
            raise _lost(
                f"failed to connect to {self.target}: {error or 'closed'}", sent=False
            ) from None
        if kind != HELLO or length > MAX_GREETING_BYTES:
            sock.close()
            if kind == ERROR and body:
                refusal = _error_frame(body).unsent()
                if refusal.reason == "busy":
                    # The server holds as many connections as it serves: one frees when a
                    # client leaves or idles out. Nothing was sent: come back shortly.
                    refusal.retry_after_s = CONNECTION_RETRY_S
                raise refusal
            raise _lost("unexpected answer to HELLO", sent=False)
        try:
            welcome = WELCOME_DECODER.decode(body) if body else Welcome()
        except msgspec.MsgspecError:
            welcome = Welcome()
        widen_buffers(sock)
        return _Connection(
            sock, self._max_reply_bytes, arena if welcome.arena else None, welcome.version
        )

    def _lend(self, sock: socket.socket) -> Arena | None:
        """Send HELLO, with the connection's shared memory when there is to be one."""
        arena: Arena | None = None
        fds: list[int] = []
        hello = Hello(token=self._token, version=PROTOCOL_VERSION)
        if self._shared_memory:
            try:
                arena, fd = Arena.create(self._arena_slots, ARENA_SLOT_BYTES)
            except OSError as error:  # no memfd here, or no memory: the socket alone
                _LOG.debug("no shared memory for %s: %s", self.target, error)
            else:
                fds.append(fd)
                hello = Hello(
                    token=self._token,
                    arena_slots=self._arena_slots,
                    arena_slot_bytes=ARENA_SLOT_BYTES,
                    version=PROTOCOL_VERSION,
                )
        frame = encode_frame(HELLO, 0, HELLO_ENCODER.encode(hello))
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
        large = len(message) > SLOT_MIN_BYTES or reply_bytes is None or reply_bytes > SLOT_MIN_BYTES
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
        """The header (the first of ``messages``), then, once the server admitted it, the
        chunks it grants (GO_AHEAD; see the frames module): a refused header costs no chunk.
        A wait for a grant is a wait for the call's answer: by the deadline (then abandoned),
        failing as any call's when the connection does."""
        deadline = _deadline(timeout)
        connection = self._connected(deadline)
        call_id, _ = connection.open_call()
        try:
            connection.send(IMPORT, call_id, b"", deadline)
            body: bytes | None = None
            try:
                body = self._stream(connection, call_id, iter(messages), deadline)
            except BaseException:
                if connection.call_open(call_id):  # else the wait for an answer abandoned it
                    connection.abandon(call_id)  # the server must not wait for the rest
                raise
            while body is None:
                answer = _answer(*connection.receive(call_id, deadline))
                body = answer if isinstance(answer, bytes) else None
        finally:
            connection.close_call(call_id)
        return decode_reply(body)

    @staticmethod
    def _stream(
        connection: _Connection, call_id: int, messages: Iterator[bytes], deadline: float
    ) -> bytes | None:
        """Send an import's messages, each chunk once granted (a server that grants none takes
        them all at once); the server's answer when it came before they all left (a refusal:
        the rest is not needed), else None (END sent). No message is taken from ``messages``
        before it may leave."""
        header = next(messages, None)
        if header is not None:
            connection.send(CHUNK, call_id, header, deadline)
            granted = 0 if connection.go_ahead else -1
            while True:
                while granted == 0 or connection.answered(call_id):
                    answer = _answer(*connection.receive(call_id, deadline))
                    if isinstance(answer, bytes):
                        return answer
                    if granted >= 0:
                        granted += answer
                message = next(messages, None)
                if message is None:
                    break
                connection.send(CHUNK, call_id, message, deadline)
                if granted > 0:
                    granted -= 1
        connection.send(END, call_id, b"", deadline)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
