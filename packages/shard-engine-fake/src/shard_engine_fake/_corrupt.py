"""Malformed-output faults: each defect turns a correct result into one that breaks the contract
in exactly one way, so a test can check the validation wrapper catches each defect on its own.
Header fields stay self-consistent (checksums are recomputed) unless the defect is about them.
"""

from __future__ import annotations

from typing import Final, assert_never

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import BoundaryBundle, BoundaryDtype, LogitsResult, ShardResult
from shard_engine_api.wire import payload_checksum
from shard_engine_fake._faults import Defect

__all__ = ["corrupt_result"]

_OTHER_DTYPE: Final[dict[str, BoundaryDtype]] = {"f32": "f16", "f16": "f32", "bf16": "f32"}


def _frozen(array: npt.NDArray[np.generic]) -> memoryview:
    data = np.ascontiguousarray(array).copy()
    data.setflags(write=False)
    return data.data.cast("B")


def _with_payload(payload: memoryview) -> dict[str, object]:
    return {"payload": payload, "checksum": payload_checksum(payload)}


def _encoded(
    bundle: BoundaryBundle, hidden: npt.NDArray[np.float32], dtype: BoundaryDtype
) -> dict[str, object]:
    """The payload and checksum of ``hidden`` in ``dtype`` (bf16 has no numpy type, so the
    contract's own conversion makes it)."""
    rebuilt = BoundaryBundle.from_array(
        hidden,
        session=bundle.session,
        first_pos=bundle.first_pos,
        layer=bundle.layer,
        model_fingerprint=bundle.model_fingerprint,
        dtype=dtype,
    )
    return {"payload": rebuilt.payload, "checksum": rebuilt.checksum}


def _corrupt_bundle(bundle: BoundaryBundle, defect: Defect) -> BoundaryBundle:
    hidden = np.array(bundle.array(), dtype=np.float32)
    match defect:
        case "nan":
            hidden[0, 0] = np.nan
            return msgspec.structs.replace(bundle, **_encoded(bundle, hidden, bundle.dtype))
        case "wrong_shape":
            # One column short, header agreeing with the payload: only a comparison with the
            # shard's hidden size can catch it.
            narrow = hidden[:, :-1] if bundle.hidden_size > 1 else np.zeros((bundle.n_tokens, 2))
            narrow = narrow.astype(np.float32)
            return msgspec.structs.replace(
                bundle, hidden_size=int(narrow.shape[1]), **_encoded(bundle, narrow, bundle.dtype)
            )
        case "wrong_dtype":
            # Correctly encoded in the other dtype: only a comparison with the configured
            # boundary dtype can catch it.
            other = _OTHER_DTYPE[bundle.dtype]
            return msgspec.structs.replace(bundle, dtype=other, **_encoded(bundle, hidden, other))
        case "truncated":
            short = bundle.payload[: max(0, len(bundle.payload) - 2)]
            return msgspec.structs.replace(bundle, **_with_payload(short))
        case "bad_checksum":
            return msgspec.structs.replace(bundle, checksum=bundle.checksum ^ 1)
        case "wrong_positions":
            return msgspec.structs.replace(bundle, first_pos=bundle.first_pos + 1)
        case "wrong_evidence":
            return bundle
        case _:
            assert_never(defect)


def _corrupt_logits(result: LogitsResult, defect: Defect) -> LogitsResult:
    logits = np.array(result.array())
    match defect:
        case "nan":
            logits[0, 0] = np.nan
            return msgspec.structs.replace(result, **_with_payload(_frozen(logits)))
        case "wrong_shape":
            narrow = logits[:, :-1] if result.vocab_size > 1 else np.zeros((result.n_rows, 2))
            narrow = narrow.astype(np.float32)
            return msgspec.structs.replace(
                result, vocab_size=int(narrow.shape[1]), **_with_payload(_frozen(narrow))
            )
        case "wrong_dtype":
            # Logits are f32 by contract; f16 bytes under an unchanged header.
            return msgspec.structs.replace(result, **_with_payload(_frozen(logits.astype("<f2"))))
        case "truncated":
            short = result.payload[: max(0, len(result.payload) - 2)]
            return msgspec.structs.replace(result, **_with_payload(short))
        case "bad_checksum":
            return msgspec.structs.replace(result, checksum=result.checksum ^ 1)
        case "wrong_positions":
            return msgspec.structs.replace(result, first_pos=result.first_pos + 1)
        case "wrong_evidence":
            return msgspec.structs.replace(result, evidence="real")
        case _:
            assert_never(defect)


def corrupt_result(result: ShardResult, defect: Defect) -> ShardResult:
    """``result`` with ``defect`` injected (a new Struct; the original is untouched)."""
    if isinstance(result, LogitsResult):
        return _corrupt_logits(result, defect)
    bundle = _corrupt_bundle(result.bundle, defect)
    match defect:
        case "wrong_positions":
            return msgspec.structs.replace(result, first_pos=result.first_pos + 1, bundle=bundle)
        case "wrong_evidence":
            return msgspec.structs.replace(result, evidence="real")
        case _:
            return msgspec.structs.replace(result, bundle=bundle)
