"""Security defaults and hostile peers: loopback unless TLS + token, constant-time token
checks, TLS and mutual TLS with certificates made here, garbage frames, oversized messages and
session floods answered with typed errors while the server keeps serving everyone else."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import typing
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgspec
import pytest
from conftest import Background, RemoteFactory, ServeFactory, config, decode, prefill
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import (
    CALL_METHOD,
    RateLimit,
    RemoteUnavailable,
    ServerSecurity,
    ServerStats,
    Unauthenticated,
)
from shard_engine_remote._ratelimit import RateLimiter

# ----------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, signer = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    stranger: Pem
    """A client certificate signed by another CA."""

    def write(self, directory: Path) -> dict[str, str]:
        paths: dict[str, str] = {}
        for name in ("ca", "server", "client", "stranger"):
            pem: Pem = getattr(self, name)
            (directory / f"{name}.pem").write_bytes(pem.cert)
            (directory / f"{name}.key").write_bytes(pem.key)
            paths[name] = str(directory / f"{name}.pem")
            paths[f"{name}_key"] = str(directory / f"{name}.key")
        return paths


def _issue(
    name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey], *, server: bool = False
) -> Pem:
    key = _key()
    cert = _certificate(name, key, issuer, server=server)
    return Pem(cert=cert.public_bytes(serialization.Encoding.PEM), key=_pem_key(key))


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca_key, other_key = _key(), _key()
    ca_cert = _certificate("test CA", ca_key, None, ca=True)
    other_cert = _certificate("other CA", other_key, None, ca=True)
    ca = (ca_cert.subject, ca_key)
    return Pki(
        ca=Pem(cert=ca_cert.public_bytes(serialization.Encoding.PEM), key=_pem_key(ca_key)),
        server=_issue("localhost", ca, server=True),
        client=_issue("worker", ca),
        stranger=_issue("stranger", (other_cert.subject, other_key)),
    )


TOKEN = "s3cret-token-for-tests"


def _token_file(directory: Path, token: str) -> str:
    path = directory / f"token-{abs(hash(token))}"
    path.write_text(token + "\n", encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------- the defaults


def test_beyond_loopback_needs_tls_and_token(pki: Pki) -> None:
    """Serving 0.0.0.0 (or any non-loopback address) is refused without TLS and a token; with
    both it is allowed (checked without binding anything)."""
    with pytest.raises(api.InvalidRequest, match="needs TLS"):
        ServerSecurity().check_listen("0.0.0.0:7450")
    with pytest.raises(api.InvalidRequest, match="needs TLS"):
        ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key).check_listen("[::]:1")
    with pytest.raises(api.InvalidRequest, match="needs TLS"):
        ServerSecurity(token=TOKEN).check_listen("10.1.2.3:1")
    ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, token=TOKEN).check_listen(
        "0.0.0.0:7450"
    )
    ServerSecurity().check_listen("127.0.0.1:7450")
    ServerSecurity().check_listen("unix:/tmp/engine.sock")
    with pytest.raises(api.InvalidRequest, match="private key"):
        ServerSecurity(tls_cert=pki.server.cert).check_listen("127.0.0.1:1")


def test_token_is_required_and_compared(
    serve: ServeFactory, remote: RemoteFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token or a wrong one: Unauthenticated at load, counted by the server; the right
    token works. The health service answers without one."""
    monkeypatch.delenv("SHARD_ENGINE_REMOTE_TOKEN", raising=False)
    server = serve(security=ServerSecurity(token=TOKEN))
    assert server.address is not None
    with pytest.raises(Unauthenticated) as caught:
        remote(config(target=server.address))
    assert not caught.value.retryable
    with pytest.raises(Unauthenticated):
        remote(config(target=server.address, token_file=_token_file(tmp_path, "wrong")))
    with pytest.raises(Unauthenticated):
        remote(config(target=server.address, token_file=_token_file(tmp_path, TOKEN + "x")))
    assert server.counters.snapshot()["unauthenticated"] == 3
    engine = remote(config(target=server.address, token_file=_token_file(tmp_path, TOKEN)))
    prefill(engine)
    monkeypatch.setenv("SHARD_ENGINE_REMOTE_TOKEN", TOKEN)
    decode(remote(config(target=server.address)), 3)
    assert server.counters.snapshot()["unauthenticated"] == 3
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_with_token(
    serve: ServeFactory, remote: RemoteFactory, pki: Pki, tmp_path: Path
) -> None:
    """TLS + token: a client trusting the CA works; a plaintext client cannot connect and is
    told to set tls_ca (at its first failed attempt, not when its connect timeout has passed:
    the timeout here is far beyond the test's); a client trusting another CA fails the
    handshake (RemoteUnavailable, nothing ran)."""
    paths = pki.write(tmp_path)
    server = serve(
        security=ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, token=TOKEN)
    )
    assert server.address is not None
    token_file = _token_file(tmp_path, TOKEN)
    engine = remote(config(target=server.address, tls_ca=paths["ca"], token_file=token_file))
    prefill(engine)
    decode(engine, 3)
    with pytest.raises(RemoteUnavailable, match="speaks TLS and this client does not: set tls_ca"):
        remote(config(target=server.address, token_file=token_file, connect_timeout_s=600.0))
    with pytest.raises(RemoteUnavailable):
        remote(
            config(
                target=server.address,
                tls_ca=paths["stranger"],
                token_file=token_file,
                connect_timeout_s=1.0,
            )
        )


def test_mutual_tls(serve: ServeFactory, remote: RemoteFactory, pki: Pki, tmp_path: Path) -> None:
    """Mutual TLS: a client certificate signed by the client CA works; none, or one signed by
    another CA, is refused."""
    paths = pki.write(tmp_path)
    server = serve(
        security=ServerSecurity(
            tls_cert=pki.server.cert, tls_key=pki.server.key, client_ca=pki.ca.cert, token=TOKEN
        )
    )
    assert server.address is not None
    token_file = _token_file(tmp_path, TOKEN)
    base: dict[str, object] = {
        "target": server.address,
        "tls_ca": paths["ca"],
        "token_file": token_file,
    }
    engine = remote(config(**base, tls_cert=paths["client"], tls_key=paths["client_key"]))
    prefill(engine)
    with pytest.raises(RemoteUnavailable, match="speaks TLS"):
        remote(config(target=server.address, token_file=token_file, connect_timeout_s=600.0))
    with pytest.raises(RemoteUnavailable):
        remote(config(**base, connect_timeout_s=1.0))
    with pytest.raises(RemoteUnavailable):
        remote(
            config(
                **base,
                tls_cert=paths["stranger"],
                tls_key=paths["stranger_key"],
                connect_timeout_s=1.0,
            )
        )
    decode(engine, 3)


def test_no_token_in_the_clear(remote: RemoteFactory, tmp_path: Path) -> None:
    """A client refuses to send a bearer token over plaintext beyond loopback."""
    with pytest.raises(api.InvalidRequest, match="in the clear"):
        remote(config(target="192.0.2.1:7450", token_file=_token_file(tmp_path, TOKEN)))


# ----------------------------------------------------------------- hostile peers


def test_garbage_frames_get_typed_errors(serve: ServeFactory, remote: RemoteFactory) -> None:
    """Undecodable messages get InvalidRequest as an ErrorInfo; junk bytes on the TCP port
    are dropped; the server serves a well-behaved client throughout."""
    server = serve()
    assert server.address is not None
    engine = remote(config(target=server.address))
    prefill(engine)
    host, port = server.address.rsplit(":", 1)
    with grpc.insecure_channel(server.address) as channel:
        raw: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CALL_METHOD)
        bomb = b"\x82\xa4type\xa6decode\xa4junk" + b"\x91" * 100_000 + b"\xc0"
        load_bomb = (
            b"\x83\xa4type\xa4load\xa5shard\x84\xa5model\xa1m\xa8n_layers\x01\xa5start"
            b"\x00\xa3end\x01\xa7options\x81\xa1k" + b"\x91" * 100_000 + b"\xc0"
        )
        for garbage in (
            b"",
            b"\x00",
            b"\xc1\xff\xfe",
            b"\x81\xa4type\xa5bogus",
            b"x" * 5000,
            bomb,
            load_bomb,
        ):
            reply = raw(garbage, timeout=5)
            error = wire.decode_error(reply)
            assert isinstance(error, api.InvalidRequest), (garbage, error)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 8):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(junk)
            sock.settimeout(5)
            try:
                while sock.recv(4096):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    assert server.counters.snapshot()["rejected_frames"] == 7
    decode(engine, 3)
    assert server.engine.metrics().errors == {}, "garbage never reached the engine"


def test_oversized_messages_are_refused(serve: ServeFactory, remote: RemoteFactory) -> None:
    """A message over the server's limit is refused before decoding (ResourceExhausted, not
    retryable); the client refuses to send one over its own limit; others keep being served."""
    server = serve(max_message_bytes=64 * 1024)
    assert server.address is not None
    engine = remote(config(target=server.address))
    huge = tuple(range(1000, 1000 + 40_000))
    with pytest.raises(api.ResourceExhausted) as caught:
        prefill(engine, huge, session="big")
    assert not caught.value.retryable
    small = remote(config(target=server.address, max_message_bytes=4096))
    with pytest.raises(api.ResourceExhausted, match="message limit"):
        prefill(small, tuple(range(2000)), session="big")
    prefill(engine)
    decode(engine, 3)


def test_session_floods_get_resource_exhausted(serve: ServeFactory, remote: RemoteFactory) -> None:
    """A client opening more sessions than the engine admits gets ResourceExhausted for the
    excess; sessions already admitted keep decoding, for every client."""
    server = serve(api.LoadConfig(shard=config().shard, max_sessions=4))
    assert server.address is not None
    worker = remote(config(target=server.address))
    prefill(worker, session="worker")
    flooder = remote(config(target=server.address))
    refused = 0
    for index in range(12):
        try:
            prefill(flooder, (1, 2), session=f"flood-{index}")
        except api.ResourceExhausted as error:
            refused += 1 if error.retryable else 1000
    assert refused == 12 - 3
    decode(worker, 3, session="worker")
    assert worker.health().sessions == 4


# ----------------------------------------------------------------- counters and rate limits


def test_server_stats_reach_the_client(
    serve: ServeFactory, remote: RemoteFactory, tmp_path: Path
) -> None:
    """What hostile peers cost the server is typed on the wire: refused tokens, garbage frames
    and oversized messages are counted, and a client reads them with ``server_stats()``."""
    limit = 64 * 1024
    server = serve(security=ServerSecurity(token=TOKEN), max_message_bytes=limit)
    assert server.address is not None
    with pytest.raises(Unauthenticated):
        remote(config(target=server.address, token_file=_token_file(tmp_path, "wrong")))
    engine = remote(config(target=server.address, token_file=_token_file(tmp_path, TOKEN)))
    with grpc.insecure_channel(server.address) as channel:
        raw: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CALL_METHOD)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        reply = raw(b"\xc1", timeout=5, metadata=metadata)
        assert isinstance(wire.decode_error(reply), api.InvalidRequest)
        # Over the limit but within what gRPC lets through: refused by the server, typed.
        over = raw(b"\x00" * (limit + 10), timeout=5, metadata=metadata)
        error = wire.decode_error(over)
        assert isinstance(error, api.ResourceExhausted)
        assert not error.retryable
        assert error.details["resource"] == "message_bytes"
    stats = engine.server_stats()
    assert isinstance(stats, ServerStats)
    assert (stats.unauthenticated, stats.rejected_frames, stats.oversized) == (1, 1, 1)
    assert stats.in_flight == 1, "the stats query itself"
    assert stats.rate_limited == 0
    assert msgspec.structs.replace(server.stats(), in_flight=1) == stats
    assert server.engine.metrics().errors == {}, "nothing reached the engine"


class FrozenClock:
    """A clock that moves only when told (rate limits without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limit_is_per_client(serve: ServeFactory, remote: RemoteFactory) -> None:
    """A client over its rate limit gets a retryable ResourceExhausted with ``retry_after_s``
    (counted); another client's budget is untouched, so the flood starves nobody; cancel is
    never limited; the bucket refills with time."""
    clock = FrozenClock()
    server = serve(rate_limit=RateLimit(calls_per_s=2.0, burst=5), clock=clock)
    assert server.address is not None
    flooder = remote(config(target=server.address))  # 1 call: capabilities
    worker_started = threading.Event()

    def flood() -> tuple[int, list[api.ResourceExhausted]]:
        admitted, refused = 0, []
        worker_started.wait(10)
        for index in range(200):
            try:
                prefill(flooder, session=f"flood-{index % 12}")
                admitted += 1
            except api.ResourceExhausted as error:
                refused.append(error)
        return admitted, refused

    flooding = Background(flood)
    worker = remote(config(target=server.address))
    worker_started.set()
    prefill(worker, session="worker")
    for position in range(3, 6):
        decode(worker, position, session="worker")  # 5 calls: the worker's whole burst
    admitted, refused = typing.cast(tuple[int, list[api.ResourceExhausted]], flooding.result())
    assert admitted == 4
    assert len(refused) == 196
    assert all(error.retryable for error in refused)
    assert {error.details["resource"] for error in refused} == {"rate_limit"}
    assert all(error.details["retry_after_s"] == pytest.approx(0.5) for error in refused)
    assert not flooder.cancel(api.CancelRequest(request_id="nothing")).cancelled
    stats = server.stats()
    assert stats.rate_limited == 196, "the cancel was not limited"
    assert stats.rate_limited_clients == 2
    clock.now += 0.5
    prefill(flooder, session="again")
    with pytest.raises(api.ResourceExhausted):
        prefill(flooder, session="again")
    assert server.engine.health().sessions == 6


def test_rate_limits_are_bounded_in_clients() -> None:
    """The limiter forgets the idlest client first, so a flood of new connections cannot grow
    it without bound; a forgotten client starts with a full bucket."""
    clock = FrozenClock()
    limiter = RateLimiter(RateLimit(calls_per_s=1.0, burst=1, max_clients=3), clock)
    assert limiter.take("a") is None
    assert limiter.take("a") == pytest.approx(1.0)
    for name in ("b", "c", "d"):
        assert limiter.take(name) is None
    assert len(limiter) == 3
    assert limiter.take("a") is None, "forgotten, so a full bucket again"
    with pytest.raises(api.InvalidRequest):
        RateLimit(calls_per_s=0.0, burst=1)
    with pytest.raises(api.InvalidRequest):
        RateLimit(calls_per_s=1.0, burst=0)


@pytest.mark.parametrize("token", ["tök", "a\nb", "a\x00b"])
def test_a_token_that_cannot_travel_is_refused_where_it_is_read(
    serve: ServeFactory, remote: RemoteFactory, tmp_path: Path, token: str
) -> None:
    """A token gRPC cannot send as a header value (non-ASCII, control characters) is an
    InvalidRequest where it is read (file, environment, or given to a server), not a server
    that seems unreachable (a retryable RemoteUnavailable) on every call."""
    server = serve(config(), security=ServerSecurity(token="fine"))
    assert server.address is not None
    token_file = tmp_path / "token"
    token_file.write_text(token, encoding="utf-8")
    with pytest.raises(api.InvalidRequest, match="printable ASCII"):
        remote(config(target=server.address, token_file=str(token_file)))
    with pytest.raises(api.InvalidRequest, match="printable ASCII"):
        ServerSecurity(token=token)
