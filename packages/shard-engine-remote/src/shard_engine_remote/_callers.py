"""Who calls, and whose work is which: the keys a server tells its clients by, and the
compute calls each has in flight under ids of the server's own (see :class:`InFlight`).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias, TypeVar

import msgspec

import shard_engine_api as api
from shard_engine_api.wire import MAX_ID_CHARS
from shard_engine_remote._admission import Ticket

__all__ = [
    "CALLER_METADATA_KEY",
    "CallContext",
    "Compute",
    "InFlight",
    "answer_as_callers",
    "as_callers",
    "caller_key",
    "client_key",
]

Compute: TypeAlias = (
    api.PrefillRequest
    | api.DecodeRequest
    | api.DecodeBatchRequest
    | api.ExportSessionRequest
    | api.ImportSessionRequest
)
_Answer = TypeVar(
    "_Answer",
    api.BoundaryResult | api.LogitsResult,
    api.DecodeBatchResult,
    api.SessionSnapshot,
    api.ImportSessionResult,
)


class CallContext(typing.Protocol):
    """What dispatch needs of a call: who makes it, and callbacks run when it ends (completed,
    cancelled, past its deadline or its connection lost). gRPC's ServicerContext is one; the
    framed transport has its own."""

    def add_callback(self, callback: Callable[[], None]) -> bool: ...

    def peer(self) -> str: ...

    def peer_identities(self) -> Iterable[bytes] | None: ...

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


def client_key(context: CallContext) -> str:
    """Who is calling, for the rate limiter: the mutual-TLS identity when the peer presented a
    certificate, else its connection (``ipv4:127.0.0.1:PORT``, ``unix:...``)."""
    identities = context.peer_identities()
    if identities:
        return "tls:" + b",".join(identities).decode("utf-8", "replace")
    return context.peer()


CALLER_METADATA_KEY: Final = "shard-engine-caller"
"""Metadata naming the remote engine a gRPC call comes from (a random id it draws once):
every gRPC client on a unix socket has the same peer, ``unix:``."""


def caller_key(context: CallContext) -> str:
    """Whose work a call is, for cancels: :func:`client_key` and, over gRPC, the caller's
    random id (unguessable, so naming it proves nothing to anyone else; never used for rate
    limits, which a client could dodge by drawing new ids)."""
    key = client_key(context)
    for name, value in context.invocation_metadata() or ():
        if name == CALLER_METADATA_KEY:
            caller = value if isinstance(value, str) else value.hex()
            if len(caller) > _MAX_CALLER_CHARS:
                # Held for as long as the call runs: a long id costs its digest's size only.
                caller = "sha256:" + hashlib.sha256(caller.encode("utf-8", "replace")).hexdigest()
            return f"{key}/{caller}"
    return key


_MAX_CALLER_CHARS: Final = 128
"""The longest caller id kept as sent (a client draws 32 hex digits); longer ones are hashed."""


def answer_as_callers(answer: _Answer, engine_id: str, request_id: str) -> _Answer:
    """``answer`` with the caller's request id where the engine put the server's. An answer
    carrying any other id is left as it is: the client's checks refuse it (MalformedOutput)."""
    if isinstance(answer, api.SessionSnapshot) or answer.request_id != engine_id:
        return answer
    return msgspec.structs.replace(answer, request_id=request_id)


def as_callers(
    error: api.ShardEngineError, engine_id: str, request_id: str
) -> api.ShardEngineError:
    """``error`` saying the caller's request id where it says the server's (its message and
    details), so the server's ids never reach a client."""
    message = error.message
    if isinstance(message, str) and engine_id in message:
        message = message.replace(repr(engine_id), repr(request_id))
        error.message = message.replace(engine_id, request_id)
        error.args = (error.message,)
    for name, value in list(error.details.items()):
        if isinstance(value, str) and engine_id in value:
            error.details[name] = value.replace(engine_id, request_id)
    return error


def _names(request: Compute) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What else a cancel may name to reach ``request`` besides its id: its batch items' ids,
    and its session(s)."""
    match request:
        case api.DecodeBatchRequest():
            return (
                tuple(item.request_id for item in request.items),
                tuple(item.session.session_id for item in request.items),
            )
        case api.ImportSessionRequest():
            return (), (request.snapshot.session.session_id,)
        case _:
            return (), (request.session.session_id,)


@dataclass(slots=True, eq=False)
class _Call:
    """One compute call in flight: the caller's request id, the id the engine knows it by, and
    what else a cancel may name to reach it (its batch items' ids, its sessions)."""

    request_id: str
    engine_id: str
    item_ids: tuple[str, ...]
    session_ids: tuple[str, ...]
    ticket: Ticket | None = None
    """Its place in the compute queue (None: a stream's call, which holds its slot)."""


class InFlight:
    """Each caller's (see :func:`caller_key`) compute calls in flight, by the caller's request
    id.

    Request ids are the caller's own: the engine runs each call under an id the server makes,
    unique among all clients' requests, so two clients using the same id never collide, and a
    caller's second call with an id it has in flight is refused (as the engine refuses one).
    A cancel reaches only the caller's own work, as a local engine's cancel reaches only
    requests made through that engine: the server cancels in the engine exactly the caller's
    calls the cancel names; one client guessing (or sharing) another's request id or session
    id cannot stop the other's work, and learns nothing (the answer is the one for a request
    that is not in flight: ``cancelled=False``). Sessions themselves are the served engine's,
    shared by every client holding the server's token (see the package README)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, dict[str, _Call]] = {}
        self._serial = itertools.count(1)

    def begin(self, client: str, request: Compute) -> _Call:
        """Register ``request`` as ``client``'s; InvalidRequest when the client has a call
        with its request id in flight."""
        request_id = request.request_id
        item_ids, session_ids = _names(request)
        with self._lock:
            calls = self._calls.get(client)
            if calls is None:
                calls = self._calls[client] = {}
            elif request_id in calls:
                raise api.InvalidRequest(f"request_id {request_id!r} is already in flight")
            # The serial makes it unique; the caller's id (cut to fit) makes the engine's
            # logs readable.
            engine_id = f"{next(self._serial)}:{request_id}"[:MAX_ID_CHARS]
            call = calls[request_id] = _Call(request_id, engine_id, item_ids, session_ids)
        return call

    def end(self, client: str, call: _Call) -> None:
        with self._lock:
            calls = self._calls.get(client)
            if calls is not None and calls.get(call.request_id) is call:
                del calls[call.request_id]
                if not calls:
                    del self._calls[client]

    def matching(self, client: str, request: api.CancelRequest) -> list[_Call]:
        """``client``'s calls in flight that ``request`` (naming exactly one of a request id
        and a session) names."""
        with self._lock:
            calls = self._calls.get(client)
            if not calls:
                return []
            request_id = request.request_id
            if request_id is not None:
                return [
                    call
                    for call in calls.values()
                    if call.request_id == request_id or request_id in call.item_ids
                ]
            session_id = request.session_id
            return [call for call in calls.values() if session_id in call.session_ids]

    def unused_id(self) -> str:
        """An engine request id no call was or will be given."""
        with self._lock:
            return f"{next(self._serial)}:"
