"""``RemoteEngine``: a ShardEngine whose work runs elsewhere, over gRPC or the framed transport.

Exactly one of three load options says where::

    {"target": "host:port" | "unix:PATH"}  a server started with `shard-engine serve`
    {"spawn": "llama"}                      a supervised child process on a private unix socket
    {"in_process": "fake"}                  a server in this process (tests, transport cost)

``transport`` says how calls travel: ``framed`` (length-prefixed codec frames on a unix socket
in a private directory, :mod:`shard_engine_remote._framed`; the default for ``spawn``) or
``grpc`` (the default otherwise, and the only one beyond this machine). Every other option is
the served engine's (spawn and in_process; a target's engine was loaded by its server, so it
takes none). The remote engine's own options are the fields of
:class:`RemoteOptions`.

Capabilities are the served engine's (evidence class, limits, determinism, fingerprint), with
``engine`` = ``"remote"`` and ``engine_version`` naming both this package and the served engine;
:meth:`RemoteEngine.served_capabilities` returns them unchanged.

A call the server refused before running it, saying when to come back (ResourceExhausted
with ``retry_after_s``: its compute queue full, its snapshot stream slots taken, or its HTTP/2
layer refusing the call's stream over the connection's stream limit), is sent again after
``retry_after_s`` (with jitter, each wait at most :data:`MAX_RETRY_WAIT_S`) for as long as the
call's timeout (``timeout_s``, ``control_timeout_s`` for calls that change nothing) leaves room
for the wait; then the refusal is raised (``retry_busy=False``: at once). Compute calls and
snapshot streams (export, import) are retried alike.
Nothing else is retried: not the client's own rate limit, not a draining server's NotReady.

Failures of the link (see :mod:`shard_engine_remote._errors`): a server that cannot be reached
is RemoteUnavailable (retryable, nothing ran); a state-changing request whose connection broke
or whose deadline passed is OutcomeUnknown (retryable: it may have run, never reported as a
success); a refused token is Unauthenticated; a message over the size limit is
ResourceExhausted (not retryable). A spawned child that died is EngineCrashed naming the signal
for every in-flight and later call, and health says failed, unless ``restart`` is
``"on-crash"``: then the next request starts a fresh child (its sessions are unknown, so they
answer CacheMiss and the worker replays; release fences of the dead child are gone, which
health reports as degraded).
"""

from __future__ import annotations

import math
import random
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar, Final, Literal, TypeVar

import msgspec

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import MAX_ID_CHARS, SNAPSHOT_CHUNK_BYTES, check_snapshot_integrity
from shard_engine_remote._errors import OutcomeUnknown, RemoteUnavailable, Unauthenticated
from shard_engine_remote._framed import FramedLink, FramedServer, check_private_socket
from shard_engine_remote._framed.arena import arena_slots_for
from shard_engine_remote._grpc_link import GrpcLink
from shard_engine_remote._link import Link, LinkFailure
from shard_engine_remote._security import ClientSecurity, read_pem, read_token
from shard_engine_remote._server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    EngineServer,
    Serving,
)
from shard_engine_remote._supervisor import ChildProcess
from shard_engine_remote._wire import (
    CapabilitiesQuery,
    HealthQuery,
    ImportHeader,
    MetricsQuery,
    Rejected,
    RemoteReply,
    RemoteRequest,
    ServerStats,
    ServerStatsQuery,
    decode_export_header,
    encode_header,
    encode_request,
)

__all__ = ["ENGINE_VERSION", "MAX_RETRY_WAIT_S", "RemoteEngine", "RemoteOptions", "split_options"]

ENGINE_VERSION: Final = "0.1.0"
MAX_RETRY_WAIT_S: Final = 5.0
"""The longest a refused call waits before it is sent again, whatever ``retry_after_s`` says."""
_MIN_RETRY_WAIT_S: Final = 0.001
_RETRY_JITTER: Final = 0.5
"""A refused call waits ``retry_after_s`` times a random factor in [1, 1 + this): clients
refused together do not all come back at once."""
_REFUSED_BEFORE_RUNNING: Final = frozenset(("server_queue", "server_calls", "server_threads"))
"""The ``resource`` of a server's refusals that mean nothing of the call ran: its compute
queue, its framed transport's queue, its snapshot stream slots."""
_Reply = TypeVar("_Reply")
_T = TypeVar("_T")

_MAX_SNAPSHOT_BYTES: Final = 1 << 36
"""The largest exported state this side reassembles (the contract's own bound on snapshots)."""


_DEATH_GRACE_S: Final = 2.0
"""How long a failed call waits for a child's exit to be reaped before calling the failure a
transport error: the kernel resets the socket a moment before the parent sees the exit."""


class RemoteOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The remote engine's own load options (all other options go to the served engine)."""

    target: str | None = None
    """Address of a running server: ``host:port`` or ``unix:PATH``."""
    spawn: str | None = None
    """Engine name to run in a supervised child process."""
    in_process: str | None = None
    """Engine name to serve from this process (same transport, no process boundary)."""
    token_file: str | None = None
    """File holding the bearer token (default: ``$SHARD_ENGINE_REMOTE_TOKEN``)."""
    tls_ca: str | None = None
    """PEM of the CA that signed the server's certificate; turns TLS on."""
    tls_cert: str | None = None
    """PEM of this client's certificate chain (mutual TLS)."""
    tls_key: str | None = None
    """PEM of this client's private key (mutual TLS)."""
    tls_server_name: str | None = None
    """Name to verify the server certificate against, when it differs from the target host."""
    timeout_s: float | None = 300.0
    """Deadline of prefill, decode, decode_batch and release calls (None: no deadline)."""
    control_timeout_s: float = 5.0
    """Deadline of capabilities, health, metrics and cancel calls."""
    connect_timeout_s: float = 10.0
    """How long load waits for a target server to accept the connection."""
    startup_timeout_s: float = 300.0
    """How long load waits for a spawned child to serve and load the shard."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent or accepted (the codec's payload limit plus headers)."""
    restart: Literal["never", "on-crash"] = "never"
    """Whether a spawned child that died is replaced by a fresh one on the next request."""
    max_restarts: int = 3
    """How many times a child is replaced at most."""
    env: dict[str, str | None] = msgspec.field(default_factory=dict)
    """Environment overrides of the spawned child (None removes a variable)."""
    inherit_env: bool = True
    """Whether the spawned child inherits this process's environment (else PATH only)."""
    python: str | None = None
    """Interpreter of the spawned child (default: this one)."""
    transport: Literal["auto", "grpc", "framed"] = "auto"
    """How calls travel. ``framed``: length-prefixed frames of the codec on a unix socket in a
    private directory (a fraction of gRPC's per-call cost; see ``_framed``), for a spawned
    child, an in-process server, or a target ``unix:PATH`` served with ``--transport framed``.
    ``grpc``: the network transport (TLS, tokens, health). ``auto``: framed for ``spawn``,
    gRPC otherwise."""
    shared_memory: bool = True
    """Framed transport: lend the server shared memory (a sealed memfd, Linux) in which large
    requests and replies (a tail's logits, a prefill's bundle) cross instead of the socket."""
    retry_busy: bool = True
    """Send a call (a compute call, a snapshot stream, any other) the server refused before
    running it (its queue or its stream slots full, its connection's stream limit reached:
    ResourceExhausted with ``retry_after_s``) again after that long, within the call's
    timeout; False raises the refusal at once."""

    def __post_init__(self) -> None:
        chosen = [name for name in ("target", "spawn", "in_process") if getattr(self, name)]
        if len(chosen) != 1:
            raise api.InvalidRequest(
                "a remote engine needs exactly one of the options 'target' (host:port or "
                f"unix:PATH), 'spawn' or 'in_process' (an engine name); got {chosen or 'none'}"
            )
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise api.InvalidRequest(f"timeout_s must be > 0 or None, got {self.timeout_s}")
        for name in ("control_timeout_s", "connect_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise api.InvalidRequest(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            raise api.InvalidRequest(f"max_message_bytes must be >= 1024: {self.max_message_bytes}")
        if self.max_restarts < 0:
            raise api.InvalidRequest(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.framed and self.target is not None:
            if not self.target.startswith("unix:"):
                raise api.InvalidRequest(
                    "the framed transport reaches only a unix socket (unix:PATH); use gRPC "
                    f"for {self.target}"
                )
            if self.tls_ca or self.tls_cert or self.tls_key:
                raise api.InvalidRequest("TLS options need the gRPC transport")

    @property
    def framed(self) -> bool:
        """Whether calls travel on the framed transport."""
        if self.transport == "auto":
            return self.spawn is not None
        return self.transport == "framed"

    def security(self) -> ClientSecurity:
        """The client credentials these options name. Raises InvalidRequest."""
        return ClientSecurity(
            tls_ca=read_pem(self.tls_ca, "TLS CA"),
            tls_cert=read_pem(self.tls_cert, "TLS client certificate"),
            tls_key=read_pem(self.tls_key, "TLS client key"),
            server_name=self.tls_server_name,
            token=read_token(self.token_file),
        )


_REMOTE_OPTION_NAMES: Final = frozenset(RemoteOptions.__struct_fields__)


def split_options(
    options: dict[str, api.OptionValue],
) -> tuple[RemoteOptions, dict[str, api.OptionValue]]:
    """The remote engine's own options and the served engine's. Raises InvalidRequest."""
    own = {key: value for key, value in options.items() if key in _REMOTE_OPTION_NAMES}
    served = {key: value for key, value in options.items() if key not in _REMOTE_OPTION_NAMES}
    try:
        return msgspec.convert(own, RemoteOptions), served
    except msgspec.ValidationError as error:
        raise api.InvalidRequest(f"bad remote engine option: {error}") from None


_State = Literal["loading", "ready", "crashed", "closed"]


def _served_version(served: api.Capabilities) -> str:
    """This package's version and the served engine's, within the contract's length limit
    (the served engine's own name and version may each take all of it)."""
    version = f"{ENGINE_VERSION} ({served.engine} {served.engine_version})"
    if len(version) <= MAX_ID_CHARS:
        return version
    return version[: MAX_ID_CHARS - 4] + "...)"


class RemoteEngine:
    """A ShardEngine served by another process or machine (see the module docstring)."""

    engine_name: ClassVar[str] = "remote"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state: _State = "loading"
        self._options: RemoteOptions | None = None
        self._served_config: api.LoadConfig | None = None
        self._link: Link | None = None
        self._child: ChildProcess | None = None
        self._local: tuple[Serving, Path] | None = None
        self._capabilities: api.Capabilities | None = None
        self._served: api.Capabilities | None = None
        self._crash: api.EngineCrashed | None = None
        self._engine_failure: api.ShardEngineError | None = None
        """The served engine's own EngineCrashed (its process lives on): permanent, like a
        local engine's failed state."""
        self._restarts = 0
        self._closing = threading.Event()
        self._replaced: weakref.WeakKeyDictionary[Link, ChildProcess] = weakref.WeakKeyDictionary()
        """The child each replaced link reached, while calls on that link may still fail."""
        self._last_metrics = api.Metrics()
        self._busy_retries = 0
        self._retries_lock = threading.Lock()
        self._checked: api.ValidatingEngine = api.ValidatingEngine(_Served(self))

    # ----------------------------------------------------------------- identity

    @property
    def name(self) -> str:
        return self.engine_name

    @property
    def child_pid(self) -> int | None:
        """The pid of the spawned child serving the engine, if any."""
        # One read of the child, then one of its process: a restart swapping either in
        # between must not make this raise (it promises None when no child runs).
        child = self._child
        return None if child is None else child.running_pid

    @property
    def restarts(self) -> int:
        """How many times a dead child was replaced."""
        return self._restarts

    @property
    def busy_retries(self) -> int:
        """How many times a call the server refused before running it was sent again."""
        return self._busy_retries

    def served_capabilities(self) -> api.Capabilities:
        """The served engine's capabilities as it reported them. Raises NotReady before load."""
        if self._served is None:
            raise api.NotReady("remote engine is not loaded", retryable=False)
        return self._served

    # ----------------------------------------------------------------- lifecycle

    def load(self, config: api.LoadConfig) -> api.Capabilities:
        """Connect to (or start) the server and load the shard there. Raises InvalidRequest
        (bad options, second load, a target serving another shard: ShardMismatch),
        RemoteUnavailable, Unauthenticated, EngineCrashed (the child died while loading) and
        whatever the served engine's load raises."""
        with self._lock:
            if self._state != "loading" or self._options is not None or self._closing.is_set():
                raise api.InvalidRequest(
                    f"engine is {self._state}; load() is called once per engine"
                )
            options, served_options = split_options(config.options)
            served_config = msgspec.structs.replace(config, options=served_options)
            self._options = options
            try:
                served = self._open(options, served_config)
                if self._closing.is_set():
                    raise api.NotReady("remote engine was closed while loading", retryable=False)
            except BaseException as error:
                self._release_resources()
                self._options = None
                if self._closing.is_set() and not isinstance(error, api.NotReady):
                    raise api.NotReady(
                        "remote engine was closed while loading", retryable=False
                    ) from error
                raise
            self._served_config = served_config
            self._served = served
            try:
                # The served capabilities are checked once, like a local engine's; every
                # result is then checked against them.
                self._checked.capabilities()
            except BaseException:
                self._served = None
                self._release_resources()
                self._options = None
                raise
            self._capabilities = msgspec.structs.replace(
                served,
                engine=self.engine_name,
                engine_version=_served_version(served),
            )
            self._state = "ready"
            return self._capabilities

    def _open(self, options: RemoteOptions, config: api.LoadConfig) -> api.Capabilities:
        if options.target is not None:
            if config.options:
                raise api.InvalidRequest(
                    f"options {sorted(config.options)} are for a served engine, but a target's "
                    "engine was loaded by its server; set them there"
                )
            link: Link
            if options.framed:
                security = options.security()
                check_private_socket(Path(options.target.removeprefix("unix:")))
                link = FramedLink(
                    Path(options.target.removeprefix("unix:")),
                    token=security.token,
                    max_message_bytes=options.max_message_bytes,
                    shared_memory=options.shared_memory,
                )
            else:
                link = GrpcLink(options.target, options.security(), options.max_message_bytes)
            self._link = link
            if not link.wait_ready(options.connect_timeout_s):
                raise RemoteUnavailable(
                    f"no server answered at {options.target} within {options.connect_timeout_s} s",
                    details={"target": options.target},
                )
            # A server holding as many connections as it serves refuses this one, retryably:
            # wait for a place as for any refused call.
            served = self._expect(
                self._retrying(
                    lambda remaining: self._roundtrip(link, CapabilitiesQuery(), remaining, False),
                    options.control_timeout_s,
                    options.retry_busy,
                ),
                api.Capabilities,
            )
            # The layer range must match; the model reference is the server's to spell (a
            # path there may differ from one here): its fingerprint is in the capabilities.
            wanted, got = config.shard, served.shard
            if (got.n_layers, got.start, got.end) != (wanted.n_layers, wanted.start, wanted.end):
                raise api.ShardMismatch(
                    f"{options.target} serves layers [{got.start}, {got.end}) of {got.n_layers}, "
                    f"not the requested [{wanted.start}, {wanted.end}) of {wanted.n_layers}"
                )
            if config.boundary_dtype not in served.boundary_dtypes:
                raise api.ShardMismatch(
                    f"{options.target} serves boundary dtypes {served.boundary_dtypes}, not "
                    f"{config.boundary_dtype!r}"
                )
            return served
        if options.spawn is not None:
            return self._spawn(options, config)
        assert options.in_process is not None
        directory = Path(tempfile.mkdtemp(prefix="shard-engine-"))
        server = EngineServer(
            api.load_engine(options.in_process),
            max_message_bytes=options.max_message_bytes,
            allow_load=True,
        )
        path = directory / "engine.sock"
        if options.framed:
            framed = FramedServer(server)
            self._local = (framed, directory)
            framed.start(path)
            link = self._link = FramedLink(
                path,
                token=None,
                max_message_bytes=options.max_message_bytes,
                shared_memory=options.shared_memory,
                arena_slots=arena_slots_for(config.max_sessions),
            )
        else:
            self._local = (server, directory)
            address = server.start(f"unix:{path}")
            link = self._link = GrpcLink(address, ClientSecurity(), options.max_message_bytes)
        return self._expect(
            self._roundtrip(link, config, options.startup_timeout_s, False), api.Capabilities
        )

    def _spawn(self, options: RemoteOptions, config: api.LoadConfig) -> api.Capabilities:
        assert options.spawn is not None
        child = self._child = ChildProcess(
            options.spawn,
            env=options.env,
            inherit_env=options.inherit_env,
            python=options.python,
            startup_timeout_s=options.startup_timeout_s,
            max_message_bytes=options.max_message_bytes,
            transport="framed" if options.framed else "grpc",
        )
        if self._closing.is_set():
            child.terminate()  # close() may have looked for a child before this one was set
        address = child.start()
        link: Link
        if options.framed:
            link = FramedLink(
                child.socket_path,
                token=child.token,
                max_message_bytes=options.max_message_bytes,
                shared_memory=options.shared_memory,
                arena_slots=arena_slots_for(config.max_sessions),
            )
        else:
            link = GrpcLink(address, ClientSecurity(token=child.token), options.max_message_bytes)
        self._link = link
        return self._expect(
            self._roundtrip(link, config, options.startup_timeout_s, False), api.Capabilities
        )

    def close(self) -> None:
        """Close the link; stop a spawned child (it drains) or the in-process server. A target
        server keeps running. Idempotent, from any thread; later calls raise NotReady, and a
        load or restart in progress ends with NotReady."""
        # A load or a restart holds the lock for as long as a child takes to start (a stopped
        # one: the whole start-up timeout). End what it waits on first, so close never waits
        # a start-up out.
        self._closing.set()
        child, link = self._child, self._link
        if child is not None:
            child.terminate()
        if link is not None and self._state == "loading":
            link.close()
        with self._lock:
            self._state = "closed"
            self._release_resources()

    def _release_resources(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()
        child, self._child = self._child, None
        if child is not None:
            child.stop()
        local, self._local = self._local, None
        if local is not None:
            server, directory = local
            server.stop(grace=1.0)
            server.engine.close()
            for path in directory.iterdir():
                path.unlink(missing_ok=True)
            directory.rmdir()

    # ----------------------------------------------------------------- the protocol

    def capabilities(self) -> api.Capabilities:
        """The served engine's capabilities (cached at load). Raises NotReady before load and
        after close, EngineCrashed once the child died (unless a restart is due)."""
        if self._state == "closed" or self._capabilities is None:
            state = "not loaded" if self._state == "loading" else self._state
            raise api.NotReady(f"remote engine is {state}", retryable=False)
        options = self._options
        if self._state == "crashed" and not (options and self._can_restart(options)):
            raise self._crash_copy()
        failure = self._engine_failure
        if failure is not None:
            raise api.EngineCrashed(failure.message, details=dict(failure.details))
        return self._capabilities

    def prefill(self, request: api.PrefillRequest) -> api.ShardResult:
        """The served engine's result, checked here (see :class:`_Served`)."""
        return self._checked.prefill(request)

    def decode(self, request: api.DecodeRequest) -> api.ShardResult:
        """The served engine's result, checked here (see :class:`_Served`)."""
        return self._checked.decode(request)

    def decode_batch(self, request: api.DecodeBatchRequest) -> api.DecodeBatchResult:
        """The served engine's batch result, checked here: an item that breaks the contract
        becomes that item's MalformedOutput (see :class:`_Served`)."""
        return self._checked.decode_batch(request)

    def release(self, request: api.ReleaseRequest) -> api.ReleaseResult:
        return self._checked.release(request)

    def export_session(self, request: api.ExportSessionRequest) -> api.SessionSnapshot:
        """The served engine's snapshot, checked here like a local engine's (see
        :class:`_Served` and :meth:`_export_unchecked`)."""
        return self._checked.export_session(request)

    def import_session(self, request: api.ImportSessionRequest) -> api.ImportSessionResult:
        """The snapshot checked (types, integrity) before it leaves, and the served engine's
        answer checked when it comes back (see :meth:`_import_unchecked`)."""
        return self._checked.import_session(request)

    def _export_unchecked(self, request: api.ExportSessionRequest) -> api.SessionSnapshot:
        """The served engine's snapshot, streamed chunk by chunk and verified here (sizes, the
        chunk count its header announced, the checksum). The source is unchanged whatever
        happens, so a broken stream is RemoteUnavailable (retry), not OutcomeUnknown; a stream
        that ends early or carries other bytes is MalformedOutput or ChecksumMismatch."""
        link, options = self._serving_link(restart=True)
        encoded = self._encoded(encode_request(request))
        return self._retrying(
            lambda remaining: self._export_once(link, encoded, remaining),
            options.timeout_s,
            options.retry_busy,
        )

    def _export_once(
        self, link: Link, encoded: bytes, timeout: float | None
    ) -> api.SessionSnapshot:
        """One export stream (see :meth:`_export_unchecked`)."""
        try:
            # Opening the stream fails as its messages do (a link closed or lost meanwhile):
            # the contract's error, never the link's own.
            messages = link.export(encoded, timeout)
        except LinkFailure as error:
            raise self._transport_failure(error, link, False, timeout) from None
        try:
            first = next(messages, None)
            if first is None:
                raise api.MalformedOutput("the export stream ended before its header")
            header = decode_export_header(first)
            if isinstance(header, Rejected):
                raise header.error
            if isinstance(header, api.ErrorInfo):
                raise self._raised(header, link)
            state_bytes = header.snapshot.state_bytes
            if state_bytes > _MAX_SNAPSHOT_BYTES:
                raise api.MalformedOutput(
                    f"the export stream announces {state_bytes} bytes of state, over "
                    f"{_MAX_SNAPSHOT_BYTES}"
                )
            chunks: list[bytes] = []
            total = 0
            for received in range(1, header.n_chunks + 1):
                chunk = next(messages, None)
                if chunk is None:
                    raise api.MalformedOutput(
                        f"the export stream ended after {received - 1} of {header.n_chunks} chunks",
                        details={"received_chunks": received - 1, "n_chunks": header.n_chunks},
                    )
                total += len(chunk)
                # Said as each chunk arrives, not once all are held: a server's stream must
                # not make this process buffer more than the header announced.
                if len(chunk) > SNAPSHOT_CHUNK_BYTES or total > state_bytes:
                    raise api.MalformedOutput(
                        f"export chunk {received - 1} holds {len(chunk)} bytes, past the chunk "
                        f"size of {SNAPSHOT_CHUNK_BYTES} or the {state_bytes} bytes of state "
                        "the header announced",
                        details={"received_bytes": total, "state_bytes": state_bytes},
                    )
                chunks.append(chunk)
            if next(messages, None) is not None:
                raise api.MalformedOutput(
                    f"the export stream carries more than the {header.n_chunks} chunks it announced"
                )
        except LinkFailure as error:
            raise self._transport_failure(error, link, False, timeout) from None
        finally:
            messages.cancel()
        snapshot = msgspec.structs.replace(header.snapshot, chunks=tuple(chunks))
        check_snapshot_integrity(snapshot, max_state_bytes=_MAX_SNAPSHOT_BYTES)
        return snapshot

    def _import_unchecked(self, request: api.ImportSessionRequest) -> api.ImportSessionResult:
        """Stream the snapshot to the served engine, chunk by chunk; it imports once every
        chunk arrived (atomically, checking the checksum). A link that breaks before the last
        chunk left is RemoteUnavailable (nothing was imported); after it, OutcomeUnknown."""
        link, options = self._serving_link(restart=True)
        snapshot = request.snapshot
        header = ImportHeader(
            request=msgspec.structs.replace(
                request, snapshot=msgspec.structs.replace(snapshot, chunks=())
            ),
            n_chunks=len(snapshot.chunks),
        )
        first = self._encoded(encode_header(header))
        for chunk in snapshot.chunks:
            self._encoded(chunk)
        return self._retrying(
            lambda remaining: self._import_once(link, first, snapshot.chunks, remaining),
            options.timeout_s,
            options.retry_busy,
        )

    def _import_once(
        self, link: Link, first: bytes, chunks: tuple[bytes, ...], timeout: float | None
    ) -> api.ImportSessionResult:
        """One import stream: the header ``first``, then ``chunks`` (see
        :meth:`_import_unchecked`)."""
        sent_all = threading.Event()

        def messages() -> Iterator[bytes]:
            yield first
            yield from chunks
            sent_all.set()

        try:
            reply = link.import_(messages(), timeout)
        except LinkFailure as error:
            raise self._transport_failure(error, link, sent_all.is_set(), timeout) from None
        if isinstance(reply, Rejected):
            raise reply.error
        if isinstance(reply, api.ErrorInfo):
            raise self._raised(reply, link)
        return self._expect(reply, api.ImportSessionResult)

    def cancel(self, request: api.CancelRequest) -> api.CancelResult:
        """Forwarded to the served engine. Raises InvalidRequest (neither or both ids) and
        EngineCrashed (the engine or its process failed); answers ``cancelled=False`` when
        nothing is served or the server cannot be reached (nothing confirmed the cancel)."""
        if (request.request_id is None) == (request.session_id is None):
            raise api.InvalidRequest("cancel needs exactly one of request_id and session_id")
        if self._state == "crashed":
            options = self._options
            if options is not None and self._can_restart(options):
                return api.CancelResult(cancelled=False)
            raise self._crash_copy()
        if self._state != "ready":
            return api.CancelResult(cancelled=False)
        try:
            return self._expect(self._invoke(request, mutating=False), api.CancelResult)
        except (api.InvalidRequest, api.EngineCrashed, api.MalformedOutput):
            raise
        except api.ShardEngineError:
            return api.CancelResult(cancelled=False)

    def health(self) -> api.Health:
        """The served engine's health; "failed" with the reason when it cannot be reached or
        its process died. Never raises."""
        state = self._state
        if state == "loading":
            return api.Health(state="unloaded", detail="not loaded")
        if state == "closed":
            return api.Health(state="closed", detail="closed")
        if state == "crashed":
            return self._crashed_health()
        try:
            reply = self._expect(self._invoke(HealthQuery(), mutating=False), api.Health)
        except api.EngineCrashed:
            return self._crashed_health()
        except api.ShardEngineError as error:
            return api.Health(state="failed", detail=f"unreachable: {error.message}")
        if self._restarts and reply.state == "ready":
            return msgspec.structs.replace(reply, state="degraded", detail=self._restart_note())
        return reply

    def metrics(self) -> api.Metrics:
        """The served engine's counters; the last ones seen when it cannot be reached (a
        restarted child counts from zero). Never raises."""
        if self._state != "ready":
            return self._last_metrics
        try:
            reply = self._expect(self._invoke(MetricsQuery(), mutating=False), api.Metrics)
        except api.ShardEngineError:
            return self._last_metrics
        self._last_metrics = reply
        return reply

    def server_stats(self) -> ServerStats:
        """The serving process's own counters (refused frames, unauthenticated and rate-limited
        calls, oversized messages, calls in flight, ...): what a hostile or misconfigured peer
        cost it. Raises NotReady (not loaded, closed), RemoteUnavailable, Unauthenticated,
        EngineCrashed (the child died) and ResourceExhausted (this client's rate limit)."""
        return self._expect(self._invoke(ServerStatsQuery(), mutating=False), ServerStats)

    # ----------------------------------------------------------------- calls

    def _restart_note(self) -> str:
        return (
            f"the engine process was replaced {self._restarts} time(s): sessions and release "
            "fences of the earlier processes are gone"
        )

    def _crashed_health(self) -> api.Health:
        crash = self._crash
        detail = crash.message if crash is not None else "the engine process died"
        options = self._options
        if options is not None and self._can_restart(options):
            return api.Health(
                state="degraded", detail=f"{detail}; a fresh process starts on the next request"
            )
        return api.Health(state="failed", detail=detail)

    def _can_restart(self, options: RemoteOptions) -> bool:
        return options.restart == "on-crash" and self._restarts < options.max_restarts

    def _serving_link(self, *, restart: bool) -> tuple[Link, RemoteOptions]:
        with self._lock:
            options = self._options
            if self._state == "crashed" and options is not None:
                if not (restart and self._can_restart(options)):
                    raise self._crash_copy()
                self._restart(options)
            if self._state != "ready" or self._link is None or options is None:
                if options is None and self._state == "loading":
                    # Never loaded (a load in progress holds the lock): waiting will not help.
                    raise api.NotReady("remote engine is not loaded", retryable=False)
                raise api.NotReady(
                    f"remote engine is {self._state}", retryable=self._state == "loading"
                )
            return self._link, options

    def _restart(self, options: RemoteOptions) -> None:
        assert self._served_config is not None
        assert self._served is not None
        old_link, self._link = self._link, None
        if old_link is not None:
            old_link.close()
        old_child, self._child = self._child, None
        if old_child is not None:
            old_child.stop(grace=1.0)
            if old_link is not None:
                self._replaced[old_link] = old_child
        self._restarts += 1
        try:
            served = self._spawn(options, self._served_config)
        except api.ShardEngineError as error:
            if self._closing.is_set():
                raise api.NotReady("remote engine was closed", retryable=False) from error
            self._crash = api.EngineCrashed(
                f"restarting the engine process failed: {error.message}", details=error.details
            )
            raise self._crash_copy() from error
        if served.model_fingerprint != self._served.model_fingerprint:
            self._crash = api.EngineCrashed("the restarted engine serves another model")
            raise self._crash_copy()
        self._crash = None
        self._engine_failure = None
        self._state = "ready"

    def _crash_copy(self) -> api.EngineCrashed:
        crash = self._crash or api.EngineCrashed("the engine process died")
        return api.EngineCrashed(crash.message, details=dict(crash.details))

    def _invoke(self, message: RemoteRequest, *, mutating: bool) -> RemoteReply:
        link, options = self._serving_link(
            restart=mutating or isinstance(message, CapabilitiesQuery)
        )
        timeout = options.timeout_s if mutating else options.control_timeout_s
        return self._retrying(
            lambda remaining: self._roundtrip(link, message, remaining, mutating),
            timeout,
            options.retry_busy,
        )

    def _retrying(
        self, attempt: Callable[[float | None], _T], timeout: float | None, retry: bool
    ) -> _T:
        """``attempt(timeout left)`` until it is not refused before running, waiting out each
        refusal's ``retry_after_s`` (see :func:`_retry_wait`) while the deadline leaves room
        for the wait; then the refusal is raised. Without ``retry`` (``retry_busy=False``),
        one attempt."""
        if not retry:
            return attempt(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                return attempt(remaining)
            except api.ResourceExhausted as refusal:
                wait = _retry_wait(refusal)
                if wait is None or (deadline is not None and time.monotonic() + wait >= deadline):
                    raise  # the server's estimate does not fit in the deadline: say so now
                # Nothing of the call ran: sending it again is safe. close() ends the wait,
                # and the call with what is true now: the engine was closed.
                if self._closing.wait(min(wait, MAX_RETRY_WAIT_S)):
                    raise api.NotReady("remote engine was closed", retryable=False) from refusal
                with self._retries_lock:
                    self._busy_retries += 1

    def _roundtrip(
        self, link: Link, message: RemoteRequest, timeout: float | None, mutating: bool
    ) -> RemoteReply:
        encoded = self._encoded(encode_request(message))
        try:
            reply = link.call(encoded, timeout, self._reply_bytes(message))
        except LinkFailure as error:
            raise self._transport_failure(error, link, mutating, timeout) from None
        if isinstance(reply, Rejected):
            raise reply.error
        if isinstance(reply, api.ErrorInfo):
            raise self._raised(reply, link)
        return reply

    def _reply_bytes(self, message: RemoteRequest) -> int | None:
        """The payload bytes a reply to ``message`` will carry, as the served capabilities
        tell (at most: f32 rows), or None (unknown: before they are known, and for the rare
        calls other than compute); the framed link lends a shared-memory slot only to calls
        that may need one."""
        capabilities = self._capabilities
        if capabilities is None:
            return None
        tail = capabilities.role in ("tail", "full")
        match message:
            case api.DecodeRequest():
                rows = 1
            case api.DecodeBatchRequest(items=items):
                rows = len(items)
            case api.PrefillRequest(inputs=inputs, logits=logits):
                n = (
                    inputs.n_tokens
                    if isinstance(inputs, api.BoundaryBundle)
                    else len(inputs.token_ids)
                )
                rows = 1 if tail and logits == "last" else n
            case _:
                return None
        return rows * 4 * (capabilities.vocab_size if tail else capabilities.hidden_size)

    def _encoded(self, encoded: bytes) -> bytes:
        """``encoded``, once it fits the message limit (else ResourceExhausted, not sent)."""
        options = self._options
        limit = options.max_message_bytes if options is not None else DEFAULT_MAX_MESSAGE_BYTES
        if len(encoded) > limit:
            raise api.ResourceExhausted(
                f"the request encodes to {len(encoded)} bytes, over the message limit of {limit}",
                retryable=False,
                details={
                    "resource": "message_bytes",
                    "message_bytes": len(encoded),
                    "limit": limit,
                },
            )
        return encoded

    def _raised(self, reply: api.ErrorInfo, link: Link) -> api.ShardEngineError:
        """The typed error a server answered with; the served engine's own EngineCrashed is
        remembered (permanent, like a local engine's failed state)."""
        raised = wire.error_from_info(reply)
        if isinstance(raised, api.EngineCrashed) and link is self._link:
            self._engine_failure = self._engine_failure or raised
        return raised

    def _transport_failure(
        self, failure: LinkFailure, link: Link, mutating: bool, timeout: float | None
    ) -> api.ShardEngineError:
        """The contract's error for a failure of ``link`` (the one mapping for every
        transport): OutcomeUnknown only for a state-changing call the server may have run."""
        target, reason = link.target, failure.reason
        facts: dict[str, api.ErrorDetail] = {"grpc_status": failure.status, "target": target}
        if self._state == "closed" or self._closing.is_set():
            if mutating and failure.sent:
                # A target server lives on after close(): what it received may have run.
                return OutcomeUnknown(
                    f"the remote engine was closed while a request to {target} was in "
                    "flight; it may or may not have been executed",
                    details={**facts, "reason": "closed", "outcome": "unknown"},
                )
            return api.NotReady("remote engine was closed", retryable=False)
        crashed = self._child_crash(link, 0.0 if reason == "deadline_exceeded" else _DEATH_GRACE_S)
        if crashed is not None:
            return crashed
        match reason:
            case "unauthenticated":
                return Unauthenticated(
                    f"{target} refused the call: {failure.message}", details=facts
                )
            case "request_too_large" | "busy":
                too_large = reason == "request_too_large"
                if failure.retry_after_s is not None:
                    facts["retry_after_s"] = failure.retry_after_s
                return api.ResourceExhausted(
                    f"{target} refused the call: {failure.message}",
                    retryable=not too_large,
                    details={**facts, "resource": "message_bytes" if too_large else "server_calls"},
                )
            case "not_served":
                return RemoteUnavailable(
                    f"{target} does not serve the shard-engine service: {failure.message}",
                    retryable=False,
                    details=facts,
                )
            case "deadline_exceeded":
                sentence = f"no answer from {target} within {timeout} s"
            case "cancelled":
                sentence = f"the call to {target} was cancelled"
            case "connection_lost":
                sentence = f"lost the connection to {target}: {failure.message}"
            case _:
                sentence = (
                    f"transport error talking to {target}: {failure.status}: {failure.message}"
                )
        if not mutating or not failure.sent:
            return RemoteUnavailable(sentence, details={**facts, "reason": reason})
        return OutcomeUnknown(
            f"{sentence}; the request may or may not have been executed",
            details={**facts, "reason": reason, "outcome": "unknown"},
        )

    def _child_crash(self, link: Link, wait: float) -> api.EngineCrashed | None:
        """EngineCrashed when the child ``link`` reached has died (waiting up to ``wait`` for
        its exit to be reaped). A call failing after another thread already replaced that
        child still failed because its own child died."""
        child = self._child if link is self._link else self._replaced.get(link)
        if child is None:
            return None
        crashed = child.wait_exit(wait)
        if crashed is None:
            return None
        with self._lock:
            if self._link is link:
                self._state = "crashed"
                self._crash = crashed
        return api.EngineCrashed(crashed.message, details=dict(crashed.details))

    @staticmethod
    def _expect(reply: RemoteReply, kind: type[_Reply]) -> _Reply:
        if not isinstance(reply, kind):
            raise api.MalformedOutput(
                f"the server answered {type(reply).__name__} where {kind.__name__} was expected"
            )
        return reply

    @staticmethod
    def _result(reply: RemoteReply) -> api.ShardResult:
        if not isinstance(reply, api.BoundaryResult | api.LogitsResult):
            raise api.MalformedOutput(
                f"the server answered {type(reply).__name__} where a shard result was expected"
            )
        return reply


def _retry_wait(refusal: api.ResourceExhausted) -> float | None:
    """How long to wait before sending a refused call again, or None when the refusal does
    not say that nothing ran and when to come back (a rate limit, a size limit, a transport's
    refusal)."""
    after = refusal.details.get("retry_after_s")
    if (
        not refusal.retryable
        or refusal.details.get("resource") not in _REFUSED_BEFORE_RUNNING
        or not isinstance(after, int | float)
        or isinstance(after, bool)
        or not math.isfinite(after)
    ):
        return None
    return max(_MIN_RETRY_WAIT_S, float(after)) * random.uniform(1.0, 1.0 + _RETRY_JITTER)


class _Served:
    """The served engine as the link delivers it, before any check: what the remote engine's
    :class:`~shard_engine_api.ValidatingEngine` wraps. A server is a peer, not this process's
    own code: a broken or hostile one may answer a result for another request or session, with
    a wrong checksum, shape, position, evidence class or type. The wrapper turns each such
    reply into MalformedOutput (the request may have run: the session's committed length, which
    a retry learns from CacheMiss, says whether), so unverified data is never returned as a
    success."""

    def __init__(self, remote: RemoteEngine) -> None:
        self._remote = remote

    @property
    def name(self) -> str:
        return self._remote.name

    def load(self, config: api.LoadConfig) -> api.Capabilities:
        raise api.InvalidRequest("the remote engine loads itself")

    def capabilities(self) -> api.Capabilities:
        return self._remote.served_capabilities()

    def prefill(self, request: api.PrefillRequest) -> api.ShardResult:
        remote = self._remote
        return remote._result(remote._invoke(request, mutating=True))

    def decode(self, request: api.DecodeRequest) -> api.ShardResult:
        remote = self._remote
        return remote._result(remote._invoke(request, mutating=True))

    def decode_batch(self, request: api.DecodeBatchRequest) -> api.DecodeBatchResult:
        remote = self._remote
        return remote._expect(remote._invoke(request, mutating=True), api.DecodeBatchResult)

    def cancel(self, request: api.CancelRequest) -> api.CancelResult:
        return self._remote.cancel(request)

    def release(self, request: api.ReleaseRequest) -> api.ReleaseResult:
        remote = self._remote
        return remote._expect(remote._invoke(request, mutating=True), api.ReleaseResult)

    def export_session(self, request: api.ExportSessionRequest) -> api.SessionSnapshot:
        return self._remote._export_unchecked(request)

    def import_session(self, request: api.ImportSessionRequest) -> api.ImportSessionResult:
        return self._remote._import_unchecked(request)

    def health(self) -> api.Health:
        return self._remote.health()

    def metrics(self) -> api.Metrics:
        return self._remote.metrics()

    def close(self) -> None:
        """Nothing: the remote engine owns the link."""
