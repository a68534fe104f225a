"""shard-engine-remote: run a ShardEngine in another process or on another machine, over gRPC
with the project's msgpack codec (or, to the worker's own children, the same codec framed on a
private unix socket), and survive its crashes.

The modules, one line each:

- ``plugin``: the ``remote`` entry point: its one registration hook;
- ``_client``: ``RemoteEngine``, a ShardEngine whose work runs over a link;
- ``_link``: the link seam: what the remote engine needs of a transport, how one fails;
- ``_grpc_link``: the gRPC link, one channel with the codec as its (de)serializer;
- ``_grpc_options``: what both gRPC ends agree on: channel options, refusal reasons;
- ``_framed/``: the framed transport to a worker's own children (its docstring maps it);
- ``_wire``: what travels over gRPC: one unary method whose messages are the codec's;
- ``_errors``: the link's own errors and where each sits in the contract's tree;
- ``_server``: ``EngineServer``, one loaded engine served to remote engines;
- ``_callers``: who calls: the keys a server tells its clients by;
- ``_admission``: the bounded, per-client fair queue of compute calls;
- ``_waiting``: bounded waiting places for calls that hold a server thread;
- ``_ratelimit``: per-client token buckets;
- ``_import_limits``: admission of an import stream from its header;
- ``_idle``: idle expiry of the sessions of clients that went away;
- ``_security``: loopback by default; otherwise TLS and a bearer token;
- ``_grpc_health``: ``grpc.health.v1`` for one server;
- ``_counters``: what a server saw, refused or cut short (``ServerCounters``);
- ``_latency``: how long a server took over its calls, per operation;
- ``_prometheus``: ``serve --metrics-listen``: metrics, health and stats for Prometheus;
- ``_commands``: ``shard-engine serve``;
- ``_signals``: serving until a signal;
- ``_supervisor``: ``ChildProcess``, an engine in a supervised child process;
- ``_child``: the entry point of a spawned engine process.
"""

from shard_engine_remote._client import ENGINE_VERSION, RemoteEngine, RemoteOptions
from shard_engine_remote._counters import ServerCounters
from shard_engine_remote._errors import OutcomeUnknown, RemoteUnavailable, Unauthenticated
from shard_engine_remote._ratelimit import RateLimit
from shard_engine_remote._security import (
    TOKEN_ENV_VAR,
    ClientSecurity,
    ServerSecurity,
    is_loopback,
)
from shard_engine_remote._server import DEFAULT_MAX_MESSAGE_BYTES, EngineServer
from shard_engine_remote._signals import serve_until_signalled
from shard_engine_remote._supervisor import ChildProcess
from shard_engine_remote._wire import CALL_METHOD, SERVICE_NAME, ServerStats

__version__ = ENGINE_VERSION

__all__ = [
    "CALL_METHOD",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENGINE_VERSION",
    "SERVICE_NAME",
    "TOKEN_ENV_VAR",
    "ChildProcess",
    "ClientSecurity",
    "EngineServer",
    "OutcomeUnknown",
    "RateLimit",
    "RemoteEngine",
    "RemoteOptions",
    "RemoteUnavailable",
    "ServerCounters",
    "ServerSecurity",
    "ServerStats",
    "Unauthenticated",
    "__version__",
    "is_loopback",
    "serve_until_signalled",
]
