"""shard-engine-remote: run a ShardEngine in another process or on another machine, over gRPC
with the project's msgpack codec (or, to the worker's own children, the same codec framed on a
private unix socket), and survive its crashes.

The client: ``_client`` (RemoteEngine) over a ``_link.Link``, ``_grpc_link`` or ``_framed``
(``frames``, ``arena``, ``client``, ``connection``, ``server``). The server: ``_server``
(EngineServer), with ``_callers``, ``_admission``, ``_import_limits``, ``_idle``,
``_ratelimit``, ``_waiting``, ``_grpc_health``, ``_counters``, ``_latency``, ``_security`` and
``_wire``.
Processes: ``_supervisor``, ``_child``, ``_signals``, ``_commands`` (``serve``),
``_prometheus``. Errors: ``_errors``. The entry point: ``plugin``. The package README maps
them.
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
