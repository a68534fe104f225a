"""The errors of the link itself, and where each lives in the contract's taxonomy.

Errors an engine raised on the other side travel as :class:`~shard_engine_api.ErrorInfo` and are
raised here as the same class, code and ``retryable``. The failures of the link::

    ShardEngineError
    ├── NotReady
    │   └── RemoteUnavailable   the server could not be reached or did not answer; nothing ran
    ├── OutcomeUnknown          the link broke while a request was in flight: it may have run
    └── Unauthenticated         the server refused the call's credentials; nothing ran

OutcomeUnknown and Unauthenticated are the API's own classes (re-exported here): a worker tells
"may have run" from "did not run" without importing this package, and both keep their class
across another hop's wire. RemoteUnavailable stays here: on the wire and to a worker it *is*
NotReady (code ``not_ready``, retryable, nothing ran), so ``except NotReady`` already handles it;
the subclass only adds, for whoever holds the remote engine, that the cause was the link.

A child process that died is :class:`~shard_engine_api.EngineCrashed` (naming the signal), not
one of these: its sessions are gone whatever the request's outcome was.
"""

from __future__ import annotations

from shard_engine_api import NotReady, OutcomeUnknown, Unauthenticated

__all__ = ["OutcomeUnknown", "RemoteUnavailable", "Unauthenticated"]


class RemoteUnavailable(NotReady):
    """Raised when the server cannot be reached (connection refused, no such socket, TLS
    handshake failure) or a read-only call (capabilities, health, metrics) timed out. The request
    was not executed (or had no effect). Retryable: a restarted server becomes reachable. Its
    code is ``not_ready``, so a worker that handles NotReady handles it."""
