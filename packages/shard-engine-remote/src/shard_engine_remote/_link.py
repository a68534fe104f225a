"""The link seam: what the remote engine needs of a transport, and how a transport fails.

A :class:`Link` carries encoded messages to one server and its replies back; the remote engine
holds one and never knows which transport it is. Two implement it (as httpx's transports
implement ``handle_request``):

    GrpcLink     (_grpc_link)       gRPC; everything beyond this machine
    FramedLink   (_framed.client)   codec frames on a private unix socket; a worker's children

Every failure of a link, whatever its transport, is one :class:`LinkFailure` carrying what the
remote engine decides on: whether the request may have reached the server's engine (``sent``)
and why the call failed (``reason``). Each transport maps its own failures to it exactly once,
where they arise (the gRPC link in one ``map_grpc_failures`` block, the framed link where its
socket fails); the remote engine maps a LinkFailure to the contract's errors once
(``RemoteEngine._transport_failure``), deciding nothing on message text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol

from shard_engine_remote._wire import Rejected, RemoteReply

__all__ = ["Link", "LinkFailure", "Reason", "Stream"]

Reason = Literal[
    "unreachable",
    "deadline_exceeded",
    "cancelled",
    "connection_lost",
    "unauthenticated",
    "request_too_large",
    "busy",
    "not_served",
    "transport_error",
]
"""Why a call failed on its link:

- ``unreachable``: no connection to the server could be made (never ``sent``);
- ``deadline_exceeded``: the call's deadline passed (waiting to send, or for the reply);
- ``cancelled``: the link was closed, or the call ended, on this side;
- ``connection_lost``: the connection broke, or the server's transport refused the call;
- ``unauthenticated``: the server refused the credentials, or is not this user's (never sent);
- ``request_too_large``: the server's transport refused the request's size (not retryable);
- ``busy``: the server's transport refused the call for load (retryable; nothing ran);
- ``not_served``: the server does not serve the shard-engine service;
- ``transport_error``: anything else, such as a reply this side refused (too large, broken):
  the call may have run.
"""


class LinkFailure(Exception):
    """A call failed on its link. Raised by every :class:`Link` method for every failure of the
    transport (never the transport's own exceptions); engine errors are replies, not this."""

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        sent: bool,
        status: str,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason: Reason = reason
        self.message = message
        self.sent = sent
        """Whether the request may have reached the server's engine. False only when it surely
        did not: no byte of it left, or the server's transport refused it before its engine
        saw it."""
        self.status = status
        """The failure in gRPC's status vocabulary (``UNAVAILABLE``, ``DATA_LOSS``, ...), which
        both transports speak on the wire: a fact for the error's details, never decided on."""
        self.retry_after_s = retry_after_s
        """For a ``busy`` refusal that surely ran nothing and passes at once (a stream the
        server's HTTP/2 layer refused): how long to wait before sending the call again."""

    def unsent(self) -> LinkFailure:
        """This failure, known not to have carried its request."""
        return LinkFailure(
            self.reason,
            self.message,
            sent=False,
            status=self.status,
            retry_after_s=self.retry_after_s,
        )


class Stream(Protocol):
    """A server-streaming call (an export): its messages, and a way to stop it. Iterating
    raises LinkFailure."""

    def __iter__(self) -> Iterator[bytes]: ...

    def __next__(self) -> bytes: ...

    def cancel(self) -> bool: ...


class Link(Protocol):
    """One transport's client end to one server. Every method raises :class:`LinkFailure` for
    the link's own failures and nothing else of the transport's."""

    @property
    def target(self) -> str:
        """The server's address, as errors name it."""
        ...

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server answers within ``timeout``. Raises RemoteUnavailable when the
        server is known to be unusable as configured (the gRPC link: it speaks TLS)."""
        ...

    def call(
        self, message: bytes, timeout: float | None, reply_bytes: int | None = None
    ) -> RemoteReply | Rejected:
        """One unary call: the encoded request, its decoded reply. ``reply_bytes`` is the
        payload the reply is expected to carry (None: unknown), a hint a link may use."""
        ...

    def export(self, message: bytes, timeout: float | None) -> Stream:
        """An export stream: a header message, then the snapshot's chunks."""
        ...

    def import_(self, messages: Iterator[bytes], timeout: float | None) -> RemoteReply | Rejected:
        """An import stream: ``messages`` (a header, then chunks), then the server's reply."""
        ...

    def close(self) -> None:
        """End the link; calls in flight fail with LinkFailure (``cancelled``)."""
        ...
