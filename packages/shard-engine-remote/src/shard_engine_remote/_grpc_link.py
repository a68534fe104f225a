"""The gRPC link: a :class:`~shard_engine_remote._link.Link` over one gRPC channel at a time (a
call that lost its connection retires it: :class:`GrpcLink`), with generic method handlers
whose (de)serializers are the project's codec.

Its failures are mapped once, in :func:`map_grpc_failures`, to a
:class:`~shard_engine_remote._link.LinkFailure`: a refusal of the server's own by the reason in
its trailing metadata (``_grpc_options.REFUSAL_METADATA_KEY``: :data:`_SERVER_REFUSALS`), anything
else by its status code (:data:`_REASONS`), except what only grpcio itself produces and tells
apart in nothing but its own words (no code, no trailer, no exception type): a connection that
was never made, and a message either side's grpcio refused for its size or a grpcio server for
its call limit. Those words are in one table, :data:`_GRPCIO_OWN_WORDS`, read here and nowhere
else.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, cast

import grpc

from shard_engine_remote._callers import CALLER_METADATA_KEY
from shard_engine_remote._errors import RemoteUnavailable
from shard_engine_remote._grpc_options import REFUSAL_METADATA_KEY, channel_options
from shard_engine_remote._link import LinkFailure, Reason, Stream
from shard_engine_remote._security import ClientSecurity, speaks_tls
from shard_engine_remote._wire import (
    CALL_METHOD,
    EXPORT_METHOD,
    IMPORT_METHOD,
    Rejected,
    RemoteReply,
    decode_reply,
)

__all__ = ["GrpcLink", "map_grpc_failures"]

_SERVER_REFUSALS: Final[dict[str, tuple[Reason, bool]]] = {
    "busy": ("busy", False),
    "no_request": ("transport_error", False),
    "too_slow": ("deadline_exceeded", True),
}
"""What the server's own refusal says (its trailing metadata, set where ``_server`` refuses):
why, and whether the call may have reached its engine. The same as the framed transport's
ERROR frames for the same refusal (``RESOURCE_EXHAUSTED`` busy, ``DEADLINE_EXCEEDED`` an export
taken too slowly; ``_framed.client``, pinned by test_grpc_failures.py)."""
_RESOURCE_EXHAUSTED: Final = grpc.StatusCode.RESOURCE_EXHAUSTED
_REFUSED_STREAM: Final = "RST_STREAM with error code 7"
REFUSED_STREAM_RETRY_S: Final = 0.005
"""How long a call whose stream the server's HTTP/2 layer refused waits before it is sent
again (with the remote engine's jitter, within the call's deadline): the server's count of the
connection's streams catches up within a few of its loop turns."""
_GRPCIO_OWN_WORDS: Final[tuple[tuple[grpc.StatusCode, str, Reason, bool], ...]] = (
    # grpcio's message size filter on this side: a reply over this channel's
    # max_receive_message_length ("Stream removed (CLIENT: Received message larger than max
    # (N vs. M))"). The server answered: the call may have run.
    (_RESOURCE_EXHAUSTED, "CLIENT: Received message larger than max", "transport_error", True),
    # grpcio refusing a reply's headers or trailers over grpc.max_metadata_size (this side's own
    # request metadata is a few dozen bytes: never the cause). The call may have run.
    (_RESOURCE_EXHAUSTED, "received metadata size exceeds", "transport_error", True),
    # The same filter, this side's request over its max_send_message_length: it never left.
    (_RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max", "request_too_large", False),
    # The server's grpcio filter, the request over its max_receive_message_length (the server
    # lets twice its limit through to count it; beyond, grpcio refuses it unread). Nothing ran.
    (_RESOURCE_EXHAUSTED, "SERVER: Received message larger than max", "request_too_large", False),
    # grpcio's server at its maximum_concurrent_rpcs: the call never reached a handler.
    (_RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!", "busy", False),
    # The server's HTTP/2 layer refused the call's stream (RST_STREAM REFUSED_STREAM, code 7:
    # "prior to performing any application processing", RFC 9113 8.7), as grpcio's server does
    # for a stream over its connection's max_concurrent_streams: its count of a connection's
    # streams lags the client's, so a client with as many calls in flight as the limit meets
    # it. Nothing ran and the connection is sound: the server was busy.
    (grpc.StatusCode.UNAVAILABLE, _REFUSED_STREAM, "busy", False),
    # grpcio's UNAVAILABLE for a call that found no connection: nothing was sent.
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", "connection_lost", False),
    (grpc.StatusCode.UNAVAILABLE, "Connection refused", "connection_lost", False),
)
"""Failures grpcio itself makes, with no trailer of ours to say why, told apart only by its
words (as grpcio 1.85 writes them): status code, the words, the reason, whether the call may
have run. Any other RESOURCE_EXHAUSTED without the server's reason (grpcio refusing the
server's own reply for its size, a proxy) may have run: ``transport_error``."""
_REASONS: Final[dict[grpc.StatusCode, Reason]] = {
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "unauthenticated",
    grpc.StatusCode.UNIMPLEMENTED: "not_served",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNAVAILABLE: "connection_lost",
}
_REFUSED: Final = frozenset(("unauthenticated", "not_served"))
"""Reasons a status code alone says the server refused the call before running it."""


def _failure(error: grpc.RpcError) -> LinkFailure:
    # The errors of a blocking call are also its grpc.Call (the stubs cannot say so).
    call = cast(grpc.Call, error)
    try:
        code, details = call.code(), call.details() or str(error)
        trailers = call.trailing_metadata() or ()
    except AttributeError:
        code, details, trailers = grpc.StatusCode.UNKNOWN, str(error), ()
    refusal = next((value for key, value in trailers if key == REFUSAL_METADATA_KEY), None)
    if isinstance(refusal, str) and refusal in _SERVER_REFUSALS:
        reason, sent = _SERVER_REFUSALS[refusal]
        return LinkFailure(reason, details, sent=sent, status=code.name)
    for own_code, words, reason, sent in _GRPCIO_OWN_WORDS:
        if code == own_code and words in details:
            refused_stream = words == _REFUSED_STREAM
            return LinkFailure(
                reason,
                details,
                sent=sent,
                status=code.name,
                retry_after_s=REFUSED_STREAM_RETRY_S if refused_stream else None,
            )
    reason = _REASONS.get(code, "transport_error")
    return LinkFailure(reason, details, sent=reason not in _REFUSED, status=code.name)


@contextmanager
def map_grpc_failures() -> Iterator[None]:
    """Raise every gRPC failure of the block as the LinkFailure it is. grpcio raises ValueError
    for a call on a channel closed meanwhile (by close() from another thread): that is the
    link closed, and the call never left."""
    try:
        yield
    except grpc.RpcError as error:
        raise _failure(error) from None
    except ValueError as error:
        raise LinkFailure("cancelled", str(error), sent=False, status="CANCELLED") from None


class _Channel:
    """One gRPC channel, its three methods and how many calls are still using it."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.call: grpc.UnaryUnaryMultiCallable[bytes, RemoteReply | Rejected] = (
            channel.unary_unary(CALL_METHOD, response_deserializer=decode_reply)
        )
        self.export: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            EXPORT_METHOD
        )
        self.import_: grpc.StreamUnaryMultiCallable[bytes, RemoteReply | Rejected] = (
            channel.stream_unary(IMPORT_METHOD, response_deserializer=decode_reply)
        )
        self.calls = 0


class _GrpcStream:
    """An export's messages, failures mapped; the link hears once when the stream ends."""

    def __init__(self, stream: Stream, link: GrpcLink, used: _Channel) -> None:
        self._stream = stream
        self._link = link
        self._used: _Channel | None = used

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            with map_grpc_failures():
                return next(self._stream)
        except LinkFailure as failure:
            self._end(failure)
            raise
        except StopIteration:
            self._end(None)
            raise

    def cancel(self) -> bool:
        cancelled = self._stream.cancel()
        self._end(None)
        return cancelled

    def _end(self, failure: LinkFailure | None) -> None:
        used, self._used = self._used, None
        if used is not None:
            self._link._done(used, failure)


class GrpcLink:
    """One channel to one server and the method every call goes through.

    A call that loses its connection (``connection_lost``, maybe sent) retires the channel:
    later calls go on a new one, which must connect before it sends anything. On the old
    channel gRPC may not yet have noticed the connection is gone (its failure reaches the
    caller before the channel's state changes), and a call sent there fails with "Stream
    removed (sendmsg: Broken pipe)", which cannot say that nothing ran: a worker would see
    OutcomeUnknown for a call made after the server was known dead. On the new channel that
    call finds no server and is RemoteUnavailable (nothing ran). A retired channel is closed
    once the last call using it ends, so no call in flight is cut short by the change.
    """

    def __init__(self, target: str, security: ClientSecurity, max_message_bytes: int) -> None:
        self.target = target
        # A connection of its own (gRPC would share one between channels to the same target):
        # the server's per-client limits and a crash's blast radius are per remote engine.
        self._options = [
            *channel_options(max_message_bytes),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._security = security
        self._plaintext = security.tls_ca is None
        self._metadata = (*security.metadata(), (CALLER_METADATA_KEY, secrets.token_hex(16)))
        self._lock = threading.Lock()
        self._current = _Channel(security.channel(target, self._options))
        self._retired: list[_Channel] = []
        self._closed = False
        self.renewals = 0
        """How many times a lost connection retired the channel."""

    @property
    def channel(self) -> grpc.Channel:
        """The channel new calls go on."""
        return self._current.channel

    def _take(self) -> _Channel:
        with self._lock:
            current = self._current
            current.calls += 1
            return current

    @contextmanager
    def _using(self) -> Iterator[_Channel]:
        """The channel one blocking call (a call, an import) runs on, its failures mapped;
        the link hears how the call ended."""
        used = self._take()
        failure: LinkFailure | None = None
        try:
            with map_grpc_failures():
                yield used
        except LinkFailure as error:
            failure = error
            raise
        finally:
            self._done(used, failure)

    def _done(self, used: _Channel, failure: LinkFailure | None) -> None:
        """A call on ``used`` ended (with ``failure``, if it failed)."""
        with self._lock:
            used.calls -= 1
            lost = failure is not None and failure.reason == "connection_lost" and failure.sent
            if lost and used is self._current and not self._closed:
                self._current = _Channel(self._security.channel(self.target, self._options))
                self._retired.append(used)
                self.renewals += 1
            idle = [retired for retired in self._retired if retired.calls == 0]
            self._retired = [retired for retired in self._retired if retired.calls > 0]
        for retired in idle:
            retired.channel.close()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the channel connects within ``timeout``. A plaintext channel whose first
        connection attempt fails asks whether the server speaks TLS: RemoteUnavailable saying
        to set tls_ca at once, not "no server answered" when the timeout has passed."""
        # The ready future subscribes first and asks to connect. The watcher, subscribed
        # after it, must not ask too: gRPC keeps a later subscriber's request to connect as a
        # flag that its polling thread acts on up to 0.2 s later, and a channel closed
        # meanwhile raises "Channel closed!" in that thread (the first subscriber's request
        # is the thread's argument instead, never left behind).
        channel = self.channel
        ready = grpc.channel_ready_future(channel)
        states: list[grpc.ChannelConnectivity] = []
        watch = states.append
        channel.subscribe(watch, try_to_connect=False)
        try:
            deadline = time.monotonic() + timeout
            probed = not self._plaintext
            while True:
                try:
                    ready.result(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
                except grpc.FutureTimeoutError:
                    if time.monotonic() >= deadline:
                        return False
                else:
                    return True
                if not probed and grpc.ChannelConnectivity.TRANSIENT_FAILURE in states:
                    probed = True
                    if speaks_tls(self.target, max(0.1, min(2.0, deadline - time.monotonic()))):
                        raise RemoteUnavailable(
                            f"the server at {self.target} speaks TLS and this client does not: "
                            "set tls_ca (the PEM of the CA that signed its certificate)",
                            details={"target": self.target},
                        )
        finally:
            channel.unsubscribe(watch)

    def call(
        self, message: bytes, timeout: float | None, reply_bytes: int | None = None
    ) -> RemoteReply | Rejected:
        """``reply_bytes`` (what the reply is expected to carry) is the framed link's hint;
        gRPC has no use for it."""
        with self._using() as used:
            return used.call(message, timeout=timeout, metadata=self._metadata)

    def export(self, message: bytes, timeout: float | None) -> Stream:
        used = self._take()
        try:
            with map_grpc_failures():
                stream = used.export(message, timeout=timeout, metadata=self._metadata)
        except LinkFailure as failure:
            self._done(used, failure)
            raise
        return _GrpcStream(cast(Stream, stream), self, used)

    def import_(self, messages: Iterator[bytes], timeout: float | None) -> RemoteReply | Rejected:
        with self._using() as used:
            return used.import_(messages, timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [self._current, *self._retired]
            self._retired = []
        for each in channels:
            each.channel.close()
