"""Who may talk to a server: loopback by default; anything else needs TLS and a bearer token.

- A server binds a loopback address or a unix socket unless told otherwise; binding any other
  address is refused unless it has both a TLS certificate and a bearer token.
- Tokens are compared in constant time (``hmac.compare_digest``); a call without the right
  ``authorization: Bearer <token>`` metadata is refused with UNAUTHENTICATED before its message
  is decoded, and counted.
- Mutual TLS: give the server the CA that signs client certificates; clients without one are
  refused during the handshake.
- The standard ``grpc.health.v1`` service answers without a token (it says only SERVING or
  NOT_SERVING), so load balancers and probes can use it.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import grpc

from shard_engine_api import InvalidRequest

__all__ = [
    "TOKEN_ENV_VAR",
    "BearerTokenInterceptor",
    "ClientSecurity",
    "ServerSecurity",
    "check_port_free",
    "check_token",
    "is_loopback",
    "read_pem",
    "read_token",
    "speaks_tls",
]

TOKEN_ENV_VAR: Final = "SHARD_ENGINE_REMOTE_TOKEN"
"""Environment variable a server and a client read the bearer token from (when no file is
named), so tokens stay out of command lines and configs."""

_HEALTH_SERVICE_PREFIX: Final = "/grpc.health.v1.Health/"
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def check_address(address: str, *, listening: bool) -> None:
    """Refuse a ``host:port`` address whose port is not a number in range (InvalidRequest):
    gRPC takes a port past 65535 modulo 65536, so ``127.0.0.1:99999`` would bind or dial port
    34463 instead of failing. Port 0 (any free port) is for listening only. ``unix:`` and
    ``unix-abstract:`` addresses pass."""
    if address.startswith(("unix:", "unix-abstract:")):
        return
    host, separator, port = address.rpartition(":")
    if not separator or not host.strip("[]") or host.startswith("[") != host.endswith("]"):
        raise InvalidRequest(f"address {address!r} is not HOST:PORT, [IPv6]:PORT or unix:PATH")
    lowest = 0 if listening else 1
    if not (port.isascii() and port.isdigit() and lowest <= int(port) <= 65535):
        raise InvalidRequest(
            f"address {address!r}: the port must be a number from {lowest} to 65535"
        )


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` or ``[v6]:port`` address; None for anything else."""
    host, separator, port = address.rpartition(":")
    if not separator or not port.isascii() or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_port_free(listen: str) -> None:
    """Raise InvalidRequest, in one line, when ``listen`` (``host:port``) is a port another
    socket already holds, or one this user may not bind: said before gRPC tries, whose own
    failure comes with a line of its C core's log. Binds nothing (a probe socket is closed at
    once); port 0 and unix sockets pass."""
    found = _host_port(listen)
    if found is None or found[1] == 0:
        return
    try:
        addresses = socket.getaddrinfo(*found, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # gRPC says what is wrong with the name
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise InvalidRequest(
                        f"cannot listen on {listen}: the port is in use (another server listens "
                        "there); choose another --listen port or stop that server"
                    ) from None
                if error.errno == errno.EACCES:
                    raise InvalidRequest(
                        f"cannot listen on {listen}: permission denied (ports below 1024 need "
                        "privileges)"
                    ) from None


def speaks_tls(target: str, timeout: float) -> bool:
    """Whether the server at ``target`` (``host:port`` or ``unix:PATH``) completes a TLS
    handshake (certificate unchecked: only the protocol is asked). A plaintext client whose
    connections fail asks this to say "set tls_ca" instead of "no server answered"."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        if target.startswith("unix:"):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(timeout)
            try:
                raw.connect(target.removeprefix("unix:"))
            except OSError:
                raw.close()
                raise
        else:
            found = _host_port(target)
            if found is None:
                return False
            raw = socket.create_connection(found, timeout=timeout)
        with raw, context.wrap_socket(raw):
            return True
    except (OSError, ValueError):  # (ssl.SSLError is an OSError: not TLS, or refused)
        return False


def is_loopback(address: str) -> bool:
    """Whether ``address`` (``host:port``, ``[v6]:port`` or ``unix:PATH``) is reachable only
    from this machine. Host names other than ``localhost`` are not resolved: they count as
    remote."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(token: str | None) -> None:
    """Refuse (InvalidRequest) a token that cannot travel as a header value (printable ASCII
    only): gRPC would refuse every call carrying it, which a client could only see as an
    unreachable server and retry for ever."""
    if token and not all(" " <= character <= "~" for character in token):
        raise InvalidRequest(
            "a bearer token holds printable ASCII characters only (it travels as a header value)"
        )


def read_token(path: str | os.PathLike[str] | None) -> str | None:
    """The token in the file ``path`` (whitespace stripped), else ``$SHARD_ENGINE_REMOTE_TOKEN``,
    else None. Raises InvalidRequest for an unreadable or empty file."""
    if path is None:
        token = os.environ.get(TOKEN_ENV_VAR) or None
        check_token(token)
        return token
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"cannot read token file {path}: {error}") from error
    if not token:
        raise InvalidRequest(f"token file {path} is empty")
    check_token(token)
    return token


def read_pem(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    """The bytes of a PEM file, or None. Raises InvalidRequest when it cannot be read."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InvalidRequest(f"cannot read {what} {path}: {error}") from error


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """A server's credentials: TLS certificate chain and key (PEM), the CA of accepted client
    certificates (mutual TLS when given) and the bearer token calls must carry."""

    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    client_ca: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        check_token(self.token)

    def check_listen(self, address: str) -> None:
        """Refuse a malformed address, and an address beyond loopback without TLS and a token
        (InvalidRequest)."""
        check_address(address, listening=True)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidRequest("TLS needs both a certificate chain and its private key")
        if self.client_ca is not None and self.tls_cert is None:
            raise InvalidRequest("mutual TLS (a client CA) needs the server's own certificate")
        if is_loopback(address):
            return
        if self.tls_cert is None or not self.token:
            raise InvalidRequest(
                f"refusing to serve on {address}: beyond loopback a server needs TLS "
                "(--tls-cert, --tls-key) and a bearer token (--token-file or "
                f"${TOKEN_ENV_VAR}); mutual TLS (--tls-client-ca) is available"
            )

    def credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials to bind with, or None for a plaintext (loopback) port."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """A client's credentials: the CA that signed the server (TLS when given), its own
    certificate and key (mutual TLS), the name to verify the server certificate against, and the
    bearer token."""

    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    server_name: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        check_token(self.token)

    def channel(self, target: str, options: list[tuple[str, object]]) -> grpc.Channel:
        """A channel to ``target``: TLS when a CA is given, plaintext otherwise (which a server
        beyond loopback refuses). Raises InvalidRequest for a token over plaintext beyond
        loopback (it would travel in the clear), and for a malformed target."""
        check_address(target, listening=False)
        if self.tls_ca is None:
            if self.tls_cert is not None:
                raise InvalidRequest("a client certificate needs tls_ca (TLS is off without it)")
            if self.token and not is_loopback(target):
                raise InvalidRequest(
                    f"refusing to send a bearer token in the clear to {target}: set tls_ca"
                )
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca,
            private_key=self.tls_key,
            certificate_chain=self.tls_cert,
        )
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(target, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def _refuse(requests: object, context: grpc.ServicerContext) -> object:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses, before any decoding, calls whose bearer token is missing or wrong; counts them
    through ``on_refused``."""

    def __init__(self, token: str, on_refused: Callable[[], None]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused
        # Request-streaming, so the refusal is sent at once without reading: gRPC's sync
        # server waits for a unary request's message on a pool thread, with no timeout, so a
        # caller without the token would otherwise hold a thread per call by never sending it.
        self._refusal: grpc.RpcMethodHandler[object, object] = grpc.stream_unary_rpc_method_handler(
            _refuse
        )

    def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Request, _Response] | None
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        method = handler_call_details.method
        if method.startswith(_HEALTH_SERVICE_PREFIX):
            return continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        self._on_refused()
        return self._refusal  # type: ignore[return-value]
