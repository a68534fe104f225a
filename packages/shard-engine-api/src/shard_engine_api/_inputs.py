"""A request's inputs turned into backend arrays: the role decides tokens or a boundary bundle,
and the bundle must be the one this shard expects (model, layer, session, position, size,
payload: the checks of shard_engine_api._bundle_checks). Reserved hooks (MTP, aux) are refused here.
Field types were checked at the edge (shard_engine_api._typecheck) before anything got here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._bundle_checks import BundleExpectation, check_bundle, violation_error
from shard_engine_api._checksum import payload_immutable, scanned
from shard_engine_api._dtypes import payload_rows
from shard_engine_api._errors import InvalidRequest, ShardEngineError, UnsupportedFeature, WrongRole
from shard_engine_api._types import (
    AuxState,
    BoundaryBundle,
    Capabilities,
    DecodeRequest,
    MtpState,
    SessionRef,
    ShardInput,
    TokenInput,
)

__all__ = ["InputRows", "batch_rows", "check_reserved", "decode_inputs", "n_rows"]

InputRows = tuple[npt.NDArray[np.int32] | None, npt.NDArray[np.float32] | None]
"""Token ids (head/full) or hidden rows (middle/tail): exactly one is set."""


def check_reserved(mtp: tuple[MtpState, ...], aux: tuple[AuxState, ...]) -> None:
    """Refuse the reserved hooks, on a request or on the bundle it carries."""
    if mtp:
        raise UnsupportedFeature("multi-token prediction (mtp) is reserved and not enabled")
    if aux:
        raise UnsupportedFeature("auxiliary state (aux) is reserved and not enabled")


def decode_inputs(
    caps: Capabilities,
    inputs: ShardInput,
    session: SessionRef,
    start_pos: int,
    *,
    single_row: bool,
) -> InputRows:
    """Check the inputs against the role and the request; return tokens or hidden rows."""
    if start_pos < 0:
        raise InvalidRequest(f"position must be >= 0, got {start_pos}")
    shard = caps.shard
    if isinstance(inputs, TokenInput):
        if not shard.takes_tokens:
            raise WrongRole(f"a {shard.role} shard takes a boundary bundle, not token ids")
        n_tokens = len(inputs.token_ids)
        if n_tokens == 0:
            raise InvalidRequest("no token ids")
        if single_row and n_tokens != 1:
            raise InvalidRequest(f"decode takes exactly one token, got {n_tokens}")
        # Checked on the Python ints (before any int32 conversion could wrap them): for the
        # one-token decode hot path this is several numpy calls cheaper.
        token_ids = inputs.token_ids
        vocab_size = caps.vocab_size
        if n_tokens == 1:
            # Every decode step: a shared read-only array per token id, not a new one.
            token_id = token_ids[0]
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(f"token ids must lie in [0, {vocab_size})")
            row = _ONE_TOKEN.get(token_id)
            return (_one_token(token_id) if row is None else row), None
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {vocab_size})")
        return np.array(token_ids, dtype=np.int32), None
    if shard.takes_tokens:
        raise WrongRole(f"a {shard.role} shard takes token ids, not a boundary bundle")
    stable = payload_immutable(inputs.payload) or scanned(inputs)
    bundle = inputs if stable else _private_copy(inputs)
    violation = check_bundle(
        bundle,
        _expectation(caps),
        session=session,
        first_pos=start_pos,
        n_tokens=1 if single_row else None,
    )
    if violation is not None:
        raise violation_error(violation)
    # A bundle the codec (or a ValidatingEngine) already scanned is not scanned again: see
    # shard_engine_api._bundle_checks. The payload length was checked there too, so the rows are a
    # plain view for f32, converted for f16 and bf16 (a bit shift, exact).
    return None, payload_rows(bundle.payload, bundle.dtype, bundle.n_tokens, bundle.hidden_size)


def _private_copy(bundle: BoundaryBundle) -> BoundaryBundle:
    """``bundle`` with its payload copied into immutable bytes. A payload its owner can still
    write (a bytearray, a view of a writable array) could change between the checksum test and
    the forward, from another thread, so the backend would compute on bytes nobody verified;
    the copy is what is verified and what the backend reads. Bundles the library made or
    verified (the codec's, ``from_array``'s, an engine core's results: they carry the scan
    mark, see shard_engine_api._checksum) and immutable payloads are never copied."""
    try:
        data = bytes(bundle.payload)
    except ValueError:  # the view was released since the edge checks
        raise InvalidRequest(
            "bundle payload is a released buffer", details={"field": "inputs.payload"}
        ) from None
    return msgspec.structs.replace(bundle, payload=memoryview(data))


_ONE_TOKEN: dict[int, npt.NDArray[np.int32]] = {}
_ONE_TOKEN_LIMIT = 1 << 16


def _one_token(token_id: int) -> npt.NDArray[np.int32]:
    """The read-only int32 array ``[token_id]`` (kept: building one costs more than the
    rest of the input checks; backends only read their inputs)."""
    row = np.array((token_id,), dtype=np.int32)
    row.setflags(write=False)
    if len(_ONE_TOKEN) >= _ONE_TOKEN_LIMIT:
        _ONE_TOKEN.clear()
    _ONE_TOKEN[token_id] = row
    return row


# One expectation per capabilities object (engines keep theirs for their whole life).
_EXPECTATIONS: dict[int, tuple[Capabilities, BundleExpectation]] = {}


def _expectation(caps: Capabilities) -> BundleExpectation:
    found = _EXPECTATIONS.get(id(caps))
    if found is not None and found[0] is caps:
        return found[1]
    expectation = BundleExpectation(
        fingerprint=caps.model_fingerprint,
        layer=caps.shard.start,
        hidden_size=caps.hidden_size,
        dtypes=frozenset(caps.boundary_dtypes),
        check_finite=True,
    )
    if len(_EXPECTATIONS) > 64:
        _EXPECTATIONS.clear()
    _EXPECTATIONS[id(caps)] = (caps, expectation)
    return expectation


def n_rows(rows: InputRows) -> int:
    tokens, hidden = rows
    if tokens is not None:
        return int(tokens.shape[0])
    assert hidden is not None
    return int(hidden.shape[0])


def batch_rows(
    items: Sequence[DecodeRequest], decode: Callable[[DecodeRequest], InputRows]
) -> tuple[dict[int, InputRows], dict[int, ShardEngineError]]:
    """The rows of each batch item (by index) and the per-item errors: a session named twice,
    a reserved hook, or whatever ``decode`` refuses."""
    rows: dict[int, InputRows] = {}
    errors: dict[int, ShardEngineError] = {}
    seen: set[str] = set()
    for index, item in enumerate(items):
        try:
            if item.session.session_id in seen:
                raise InvalidRequest(
                    f"session {item.session.session_id!r} appears twice in one batch"
                )
            seen.add(item.session.session_id)
            check_reserved(item.mtp, item.aux)
            rows[index] = decode(item)
        except ShardEngineError as error:
            errors[index] = error
    return rows, errors
