"""The gRPC link: a :class:`~shard_engine_remote._link.Link` over one gRPC channel, with generic
method handlers whose (de)serializers are the project's codec.

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
            return LinkFailure(reason, details, sent=sent, status=code.name)
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


class _GrpcStream:
    """An export's messages, failures mapped."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        with map_grpc_failures():
            return next(self._stream)

    def cancel(self) -> bool:
        return self._stream.cancel()


class GrpcLink:
    """One channel to one server and the method every call goes through."""

    def __init__(self, target: str, security: ClientSecurity, max_message_bytes: int) -> None:
        self.target = target
        # A connection of its own (gRPC would share one between channels to the same target):
        # the server's per-client limits and a crash's blast radius are per remote engine.
        options = [*channel_options(max_message_bytes), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = security.channel(target, options)
        self._plaintext = security.tls_ca is None
        self._metadata = (*security.metadata(), (CALLER_METADATA_KEY, secrets.token_hex(16)))
        self._call: grpc.UnaryUnaryMultiCallable[bytes, RemoteReply | Rejected] = (
            self.channel.unary_unary(CALL_METHOD, response_deserializer=decode_reply)
        )
        self._export: grpc.UnaryStreamMultiCallable[bytes, bytes] = self.channel.unary_stream(
            EXPORT_METHOD
        )
        self._import: grpc.StreamUnaryMultiCallable[bytes, RemoteReply | Rejected] = (
            self.channel.stream_unary(IMPORT_METHOD, response_deserializer=decode_reply)
        )

    def wait_ready(self, timeout: float) -> bool:
        """Whether the channel connects within ``timeout``. A plaintext channel whose first
        connection attempt fails asks whether the server speaks TLS: RemoteUnavailable saying
        to set tls_ca at once, not "no server answered" when the timeout has passed."""
        # The ready future subscribes first and asks to connect. The watcher, subscribed
        # after it, must not ask too: gRPC keeps a later subscriber's request to connect as a
        # flag that its polling thread acts on up to 0.2 s later, and a channel closed
        # meanwhile raises "Channel closed!" in that thread (the first subscriber's request
        # is the thread's argument instead, never left behind).
        ready = grpc.channel_ready_future(self.channel)
        states: list[grpc.ChannelConnectivity] = []
        watch = states.append
        self.channel.subscribe(watch, try_to_connect=False)
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
            self.channel.unsubscribe(watch)

    def call(
        self, message: bytes, timeout: float | None, reply_bytes: int | None = None
    ) -> RemoteReply | Rejected:
        """``reply_bytes`` (what the reply is expected to carry) is the framed link's hint;
        gRPC has no use for it."""
        with map_grpc_failures():
            return self._call(message, timeout=timeout, metadata=self._metadata)

    def export(self, message: bytes, timeout: float | None) -> Stream:
        with map_grpc_failures():
            stream = self._export(message, timeout=timeout, metadata=self._metadata)
        return _GrpcStream(cast(Stream, stream))

    def import_(self, messages: Iterator[bytes], timeout: float | None) -> RemoteReply | Rejected:
        with map_grpc_failures():
            return self._import(messages, timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self.channel.close()
