"""One framed client's connection as its server serves it: the greeting, two threads taking
turns at reading and serving, calls handed to the server's pool, replies that wait to leave
without holding a thread.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import math
import os
import queue
import select
import socket
import threading
import time
import typing
from collections.abc import Callable, Generator, Iterator
from typing import Final

import msgspec

import shard_engine_api as api
from shard_engine_remote._framed.arena import Arena
from shard_engine_remote._framed.frames import (
    ABANDON,
    CALL,
    CALL_SLOT,
    CHUNK,
    COALESCE_BYTES,
    END,
    ERROR,
    EXPORT,
    GO_AHEAD,
    GOAWAY,
    GRANT,
    HEADER,
    HELLO,
    HELLO_DECODER,
    HELLO_ENCODER,
    HELLO_TIMEOUT_S,
    IMPORT,
    IMPORT_WINDOW_CHUNKS,
    ITEM,
    MAX_GREETING_BYTES,
    PROTOCOL_VERSION,
    REPLY,
    SLOT_ANSWER,
    SLOT_CALL,
    SLOT_MIN_BYTES,
    SLOT_REPLY,
    Closed,
    ExtraDescriptors,
    Reader,
    Welcome,
    shut_down,
    widen_buffers,
)
from shard_engine_remote._server import StreamBroken
from shard_engine_remote._wire import (
    CapabilitiesQuery,
    HealthQuery,
    MetricsQuery,
    Rejected,
    RemoteRequest,
    ServerStatsQuery,
    SnapshotHeader,
    decode_export_header,
    decode_request,
    encode_reply,
    encode_reply_into,
    oversized_error,
    payload_bytes,
)

if typing.TYPE_CHECKING:
    from shard_engine_remote._framed.server import FramedServer

__all__ = ["ServerConnection"]

_SERVER_SEND_TIMEOUT_S: Final = 30.0
"""A client that stops reading its replies for this long (one frame) loses its connection."""

_SEND_PATIENCE_S: Final = 0.02
"""How long a serving thread waits for a connection's socket to take more of its frames before
it hands the rest to a writer thread of the connection's own: no thread of the shared pool
(nor a connection's reading thread) waits on a client that does not read."""

_MAX_OUTGOING_BYTES: Final = 8 << 20
"""Frame bytes a connection may have waiting to leave: beyond, the server reads none of its
new calls until they have left (or the connection is dropped)."""

_SEAL_WAIT_S: Final = 10.0
"""How long a reading thread that met a frame after the drain sealed the connection waits for
the GOAWAY to leave before it closes the connection (the drain's own wait is bounded by its
grace: this only guards against a drain that never ends)."""

_LOG: Final = logging.getLogger("shard_engine.remote")


class _CallContext:
    """What the server's dispatch needs of a call (what gRPC's ServicerContext gives it): who
    calls, and callbacks run when the call ends, whether it completed, was abandoned or lost
    its connection."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.ended = False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self.lock:
            if self.ended:
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        with self.lock:
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


def _header_first(messages: Iterator[bytes]) -> Iterator[bytes]:
    """``messages``, their first (an import's header) waited for now, before the stream takes
    its slots, as over gRPC: a stream that never sends one holds no stream slot nor a place in
    the streams' queue (it waits ``stream_idle_s``, then fails as a broken stream)."""
    try:
        first = next(messages, None)
    except (StreamBroken, api.ShardEngineError) as error:
        return _Raising(error)
    return messages if first is None else itertools.chain((first,), messages)


class _Raising:
    """Messages that raise ``error`` when the first is asked for."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __iter__(self) -> _Raising:
        return self

    def __next__(self) -> bytes:
        raise self._error


class ServerConnection:
    """One client's connection, served by two threads taking turns (see :meth:`_lead` and
    :meth:`_serve_here`); calls that overlap on the connection run on the server's pool."""

    def __init__(self, owner: FramedServer, sock: socket.socket, peer: str) -> None:
        self._owner = owner
        self._server = owner.server
        self.sock = sock
        self._peer = peer
        self._calls: dict[int, _CallContext] = {}
        self._streams: dict[int, queue.SimpleQueue[_ImportItem]] = {}
        self.lock = threading.Lock()
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
        self.arena: Arena | None = None
        """The shared memory the client lent (see the module docstring)."""
        self._version = 0
        """The protocol version the connection speaks: the lower of the client's and this
        server's (1: the client waits for GO_AHEAD after an import's header)."""
        self._outgoing = threading.Condition(threading.Lock())
        self._out: collections.deque[_Outgoing] = collections.deque()
        """Frames waiting to leave, in order (the first may be leaving)."""
        self._out_bytes = 0
        self._writing = False
        """Whether a thread sends the waiting frames (the others only queue theirs)."""
        self._send_failed = False
        self._quiet_since = time.monotonic()
        """When the connection's last call ended (or it greeted)."""
        self._frames_read = 0
        """How many frames were read after the greeting (see :meth:`seal`)."""
        self._sealed = False
        """Whether the drain sealed the connection: no frame is read after."""
        self._settling = False
        """Whether the reading thread acts on a frame it read (neither answered nor its call
        registered yet)."""
        self._sealed_done = threading.Event()

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
        header = HEADER.pack(len(body), kind, call_id)
        frame = _Outgoing([header + body] if len(body) <= COALESCE_BYTES else [header, body])
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
                shut_down(self.sock)
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
        except (OSError, Closed):
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
        with self.lock:
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
        reader = Reader(self.sock, deadline=time.monotonic() + HELLO_TIMEOUT_S)
        fds: list[int] = []
        reader.fds = fds
        try:
            try:
                length, kind, _ = reader.header()
                if kind != HELLO or length > MAX_GREETING_BYTES:
                    counters.add("rejected_frames")
                    return False
                hello = HELLO_DECODER.decode(reader.body(length))
            except (msgspec.MsgspecError, ExtraDescriptors):
                counters.add("rejected_frames")
                return False
            reader.fds = None
            self._version = max(0, min(hello.version, PROTOCOL_VERSION))
            expected = self._server.security.token
            if expected and not hmac.compare_digest(
                (hello.token or "").encode(), expected.encode()
            ):
                counters.add("unauthenticated")
                self.send(
                    ERROR, 0, HELLO_ENCODER.encode(("UNAUTHENTICATED", "missing or wrong token"))
                )
                return False
            if hello.arena_slots or fds or reader.extra_fds:
                self.arena = (
                    Arena.adopt(fds.pop(0), hello.arena_slots, hello.arena_slot_bytes)
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
        widen_buffers(self.sock)
        welcome = Welcome(arena=self.arena is not None, version=self._version)
        self.send(HELLO, 0, HELLO_ENCODER.encode(welcome))
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
        except (OSError, Closed):
            self._close_down()
            return False

    def _read_frames(self) -> bool:
        reader = self._reader
        while True:
            if not self._await_frame():
                raise Closed  # no call for connection_idle_s: closed (its client reconnects)
            length, kind, call_id = reader.header()
            if not self._begin_frame():
                # The drain sealed the connection: this frame was not read (the GOAWAY did
                # not count it). Close once the GOAWAY has left.
                self._sealed_done.wait(_SEAL_WAIT_S)
                raise Closed
            try:
                handed = self._take_frame(length, kind, call_id)
            finally:
                with self.lock:
                    self._settling = False
            if handed is not None:
                return handed

    def _take_frame(self, length: int, kind: int, call_id: int) -> bool | None:
        """Read a frame's body and act on it: None to read on, else what :meth:`_lead`
        returns."""
        reader = self._reader
        limit = self._server.max_message_bytes
        pool = self._owner.pool
        if length > limit:
            reader.skip(length)
            self._refuse(call_id, oversized_error(length, limit))
            return None
        body = reader.body(length)
        if kind in (CHUNK, END):
            overrun = False
            with self.lock:
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
            return None
        if kind == ABANDON:
            with self.lock:
                context = self._calls.get(call_id)
                stream = self._streams.pop(call_id, None)
            if stream is not None:
                stream.put(_BROKEN)
            if context is not None:
                context.end()
            return None
        if kind not in (CALL, CALL_SLOT, EXPORT, IMPORT):
            self._refuse(call_id, api.InvalidRequest(f"unknown frame kind {kind}"))
            return None
        with self.lock:
            reused = call_id in self._calls
        if reused:
            # One context per id: a second would hide the first from the connection's end,
            # whose engine work would then outlive it uncancelled.
            self._refuse(call_id, api.InvalidRequest(f"call id {call_id} is already in flight"))
            return None
        if self._owner.draining:
            self._draining_error(call_id)
            return None
        # Frames the client has not taken hold no thread, only memory: past a bound, this
        # connection's next call waits (and nothing more of it is read) until they left.
        self._await_outgoing()
        request = decode_request(body, max_bytes=limit) if kind == CALL else None
        quick = isinstance(request, _QUICK_CALLS)
        with self.lock:
            hand_over, self._other_idle = self._other_idle, False
            # A connection's own call (served on its own thread) is always admitted; only
            # calls overlapping on one connection queue for the pool, each connection up to
            # a share of what the server queues, so no client's flood (nor its stalled
            # streams) leaves the others nothing. Quick control calls (cancel, health,
            # capabilities, metrics, stats) never queue: served on this thread at once.
            pooled = not hand_over and not quick and self._pooled < self._owner.calls_per_connection
            if pooled:
                self._pooled += 1
        if pooled and not self._owner.admit():
            with self.lock:
                self._pooled -= 1
            pooled = False
        here = not hand_over and not pooled
        if here and not (quick or isinstance(request, api.ReleaseRequest)):
            self._server.counters.add("busy")
            self._refuse_busy(call_id)
            return None
        context = _CallContext(self._peer)
        with self.lock:
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
            return None
        if hand_over:
            with self.lock:
                self._settling = False  # the call is in _calls: a drain waits for it there
            return None if self._serve_here(call_id, context, serve, argument) else True
        try:
            pool.submit(self._run, call_id, context, serve, argument, pooled=True)
        except RuntimeError:  # the pool shut down: the server is stopping
            self._unpool()
            self._draining_error(call_id)
        return None

    def _begin_frame(self) -> bool:
        """A frame's header was read: False when the drain sealed the connection (the frame
        is not to be read), else it counts as read (see :meth:`seal`)."""
        with self.lock:
            if self._sealed:
                return False
            self._settling = True
            self._frames_read += 1
            return True

    def seal(self, deadline: float) -> None:
        """The drain's end: read no more of this connection, and tell the client (GOAWAY, after
        every answer queued before it) how many of its frames were read: a call whose first
        frame came later never ran.
        Waits until the frame being acted on (if any) was answered or its call registered,
        and the GOAWAY left, each no longer than ``deadline`` (time.monotonic). The caller
        then shuts the socket down and calls :meth:`sealed`."""
        with self.lock:
            self._sealed = True
        while True:
            with self.lock:
                settling, read = self._settling, self._frames_read
            if not settling or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        if self._version >= 2:
            self.send(GOAWAY, read, b"", deadline=deadline)

    def sealed(self) -> None:
        """The socket is shut down after :meth:`seal`: a reading thread that met a frame
        after the seal may close the connection."""
        self._sealed_done.set()

    def busy(self) -> bool:
        """Whether a call read on this connection has not ended (queued, running, streaming)."""
        with self.lock:
            return bool(self._calls)

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
        with self.lock:
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
        with self.lock:
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
            with self.lock:
                busy = bool(self._calls)
                quiet_since = self._quiet_since
            timeout = idle if busy else quiet_since + idle - time.monotonic()
            if timeout <= 0:
                return False
        return True

    def hand_over_reading(self) -> None:
        """Bytes arrived while the reading thread serves a call: let the other thread read."""
        with self.lock:
            if not self.watched:
                return  # the call ended first: its thread reads them
            self.watched = False
        self._turn.release()

    def _draining_error(self, call_id: int) -> None:
        message = "the server is shutting down; the request was not sent to its engine"
        self.send(ERROR, call_id, HELLO_ENCODER.encode(("UNAVAILABLE", message)))

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
        self.send(REPLY, call_id, encode_reply(self._server.refused_frame(error)))

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
            with self.lock:
                self._calls.pop(call_id, None)
                stream = self._streams.pop(call_id, None)
                self._quiet_since = time.monotonic()
            if stream is not None:
                self._discard(stream)  # what the call did not take (it answered early)
            context.end()

    def _taken(self, chunk: bytes) -> None:
        with self.lock:
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
        with self.lock:
            self._pooled -= 1

    def _call(self, call_id: int, context: _CallContext, request: RemoteRequest | Rejected) -> None:
        reply = self._server.serve_call(request, context)
        if not context.ended:
            self.send(REPLY, call_id, encode_reply(reply))

    def _call_slot(self, call_id: int, context: _CallContext, body: bytes) -> None:
        """A call holding a slot of the shared memory: its request may be there, its reply
        goes there when large. Answered even when abandoned: the answer frees the slot."""
        arena = self.arena
        limit = self._server.max_message_bytes
        if arena is None or len(body) < SLOT_CALL.size:
            self._refuse(
                call_id,
                api.InvalidRequest(
                    "a CALL_SLOT frame on a connection without shared memory, or shorter than "
                    "its slot header"
                ),
            )
            return
        slot, length = SLOT_CALL.unpack_from(body)
        inline = len(body) > SLOT_CALL.size
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
            request = arena.take(slot, length) if length else body[SLOT_CALL.size :]
        except ValueError:
            return  # the connection ended: its shared memory is unmapped, no one listens
        reply = self._server.serve_call(decode_request(request, max_bytes=limit), context)
        # A large reply straight into the slot (its payload copied once), unless it does not
        # fit; a small one in its frame.
        try:
            written = (
                encode_reply_into(reply, arena.slot(slot))
                if payload_bytes(reply) > SLOT_MIN_BYTES
                else None
            )
        except ValueError:
            return  # as above
        if length or written is not None:
            self._server.counters.add("shared_memory_calls")
        if written is None:
            self.send(REPLY, call_id, encode_reply(reply))
        else:
            self.send(SLOT_REPLY, call_id, SLOT_ANSWER.pack(written))

    def _export(self, call_id: int, context: _CallContext, body: bytes) -> None:
        """The export stream, under the gRPC export's rules: each message must leave within
        ``stream_idle_s`` and the whole stream by ``stream_idle_s + size /
        min_stream_bytes_per_s`` (``EngineServer.stream_due``); else it ends with
        DEADLINE_EXCEEDED, counted as ``stalled``, and frees its slots at once."""
        server = self._server
        request = decode_request(body, max_bytes=server.max_message_bytes)
        messages = server.serve_export(request, context)
        idle = server.stream_idle_s
        due: float | None = None
        try:
            for message in messages:
                if context.ended:
                    return
                if due is None:  # the header: the stream's size
                    header = decode_export_header(message)
                    size = header.snapshot.state_bytes if isinstance(header, SnapshotHeader) else 0
                    due = server.stream_due(size)
                if not self.send(ITEM, call_id, message, min(due, time.monotonic() + idle)):
                    if not context.ended:
                        server.counters.add("stalled")
                        why = (
                            f"slower than {server.stream_rate_words()}"
                            if time.monotonic() >= due
                            else f"without taking a message for {idle:g} s"
                        )
                        words = f"the client takes the export {why}"
                        self.send(
                            ERROR, call_id, HELLO_ENCODER.encode(("DEADLINE_EXCEEDED", words))
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

        stream_messages = _header_first(messages())
        if self._version >= 1:
            stream_messages = self._admitted(call_id, context, stream_messages)
        reply = self._server.serve_import(stream_messages, context)
        if not context.ended:
            self.send(REPLY, call_id, encode_reply(reply))

    def _admitted(
        self, call_id: int, context: _CallContext, messages: Iterator[bytes]
    ) -> Iterator[bytes]:
        """An import's ``messages``, granting the client chunks (GO_AHEAD) as the server asks for
        them: :data:`IMPORT_WINDOW_CHUNKS` when it asks for the message after the header (it
        checked the header and reserved its bytes), one more each time it asks for another
        (it checked the one before). Until then the client sends nothing more, so a refused
        header costs no chunk and a refused chunk at most the window."""
        granted = IMPORT_WINDOW_CHUNKS
        for message in messages:
            yield message
            if not context.ended:
                self.send(GO_AHEAD, call_id, GRANT.pack(granted))
            granted = 1
