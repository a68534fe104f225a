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
same :class:`~shard_engine_remote._server.EngineServer` dispatch (its public serving surface),
and a call that ends early (the client abandoned it at its deadline, or the connection broke)
ends its context, whose callback is ``engine.cancel(request_id)``. The client reports link
failures as :class:`~shard_engine_remote._link.LinkFailure` (what failed, and whether the
request may have reached the server's engine), raised where the socket fails: the remote
engine's one mapping to OutcomeUnknown, RemoteUnavailable and EngineCrashed serves both
transports.

The package, one side of the protocol per module::

    frames       the protocol: frame kinds and header, the greeting, reading frames off a socket
    arena        the shared memory a client lends its server (a sealed memfd of slots)
    client       FramedLink: the client end, a Link (see shard_engine_remote._link)
    connection   one client's connection as the server serves it
    server       FramedServer: the listener, the watcher of busy connections, the drain
"""

from shard_engine_remote._framed.arena import SHARED_MEMORY
from shard_engine_remote._framed.client import FramedLink
from shard_engine_remote._framed.frames import check_private_socket
from shard_engine_remote._framed.server import FramedServer

__all__ = ["SHARED_MEMORY", "FramedLink", "FramedServer", "check_private_socket"]
