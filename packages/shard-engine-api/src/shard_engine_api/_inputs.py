"""A request's inputs turned into backend arrays: the role decides tokens or a boundary bundle,
and the bundle must be the one this shard expects (model, layer, session, position, size,
payload). Reserved hooks (MTP, aux) are refused here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import (
    ChecksumMismatch,
    ContractVersionMismatch,
    InvalidRequest,
    ShardEngineError,
    ShardMismatch,
    UnsupportedFeature,
    WrongRole,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
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
    if isinstance(inputs, BoundaryBundle):
        check_reserved(inputs.mtp, inputs.aux)
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
        if min(token_ids) < 0 or max(token_ids) >= caps.vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {caps.vocab_size})")
        return np.array(token_ids, dtype=np.int32), None
    if shard.takes_tokens:
        raise WrongRole(f"a {shard.role} shard takes token ids, not a boundary bundle")
    bundle = inputs
    if bundle.contract_version != CONTRACT_VERSION:
        raise ContractVersionMismatch(
            f"bundle speaks contract version {bundle.contract_version}; "
            f"this engine speaks {CONTRACT_VERSION}"
        )
    if bundle.model_fingerprint != caps.model_fingerprint:
        raise ShardMismatch(
            f"bundle is for model {bundle.model_fingerprint!r}; "
            f"this shard runs {caps.model_fingerprint!r}"
        )
    if bundle.layer != shard.start:
        raise ShardMismatch(
            f"bundle enters layer {bundle.layer}; this shard starts at layer {shard.start}"
        )
    if bundle.hidden_size != caps.hidden_size:
        raise ShardMismatch(
            f"bundle hidden size {bundle.hidden_size} != shard hidden size {caps.hidden_size}"
        )
    if bundle.dtype not in caps.boundary_dtypes:
        raise InvalidRequest(f"bundle dtype {bundle.dtype} is not accepted")
    if bundle.session != session:
        raise InvalidRequest(
            f"bundle belongs to session {bundle.session.session_id!r} epoch "
            f"{bundle.session.epoch}; request names {session.session_id!r} "
            f"epoch {session.epoch}"
        )
    if bundle.first_pos != start_pos:
        raise InvalidRequest(
            f"bundle starts at position {bundle.first_pos}, request at {start_pos}"
        )
    if bundle.n_tokens < 1:
        raise InvalidRequest("bundle carries no rows")
    if single_row and bundle.n_tokens != 1:
        raise InvalidRequest(f"decode takes exactly one row, bundle has {bundle.n_tokens}")
    if len(bundle.payload) != bundle.expected_payload_bytes:
        raise InvalidRequest(
            f"bundle payload has {len(bundle.payload)} bytes; header promises "
            f"{bundle.expected_payload_bytes}"
        )
    if payload_checksum(bundle.payload) != bundle.checksum:
        raise ChecksumMismatch("bundle payload does not match its checksum")
    hidden = np.asarray(bundle.array(), dtype=np.float32)
    if not np.isfinite(hidden).all():
        raise InvalidRequest("bundle hidden states contain NaN or Inf")
    return None, hidden


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
