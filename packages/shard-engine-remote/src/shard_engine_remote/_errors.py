"""The errors a remote engine adds to the contract's taxonomy: what a transport can fail with.

Errors an engine raised on the other side travel as :class:`~shard_engine_api.ErrorInfo` and are
raised here as the same class, code and ``retryable``. These are the failures of the link itself::

    ShardEngineError
    ├── NotReady
    │   └── RemoteUnavailable   the server could not be reached or did not answer; nothing ran
    ├── OutcomeUnknown          the link broke while a request was in flight: it may have run
    └── Unauthenticated         the server refused the call's credentials; nothing ran

A child process that died is :class:`~shard_engine_api.EngineCrashed` (naming the signal), not
one of these: its sessions are gone whatever the request's outcome was.
"""

from __future__ import annotations

from shard_engine_api import NotReady, ShardEngineError

__all__ = ["OutcomeUnknown", "RemoteUnavailable", "Unauthenticated"]


class RemoteUnavailable(NotReady):
    """Raised when the server cannot be reached (connection refused, no such socket, TLS
    handshake failure) or a read-only call (capabilities, health, metrics) timed out. The request
    was not executed (or had no effect). Retryable: a restarted server becomes reachable. Its
    code is ``not_ready``, so a worker that handles NotReady handles it."""


class OutcomeUnknown(ShardEngineError):
    """Raised when the connection broke or the deadline passed while a state-changing request
    (prefill, decode, decode_batch, release) was in flight: the server may or may not have
    committed it. ``details["reason"]`` says which (``connection_lost``, ``deadline_exceeded``,
    ``cancelled``, ``transport_error``). Retryable: re-issue the request; a decode that did
    commit is answered with CacheMiss carrying the committed length, from which to resume."""

    code = "outcome_unknown"
    default_retryable = True


class Unauthenticated(ShardEngineError):
    """Raised when the server refused the call: no bearer token, a wrong token, or a TLS client
    certificate it does not accept. Nothing ran. Not retryable with the same credentials."""

    code = "unauthenticated"
