# The optional C extension of _native.c (see shard_engine_api._checksum.NativeScan).
import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import Buffer

VECTOR: str

def checksum(buffer: Buffer, /) -> int: ...
def finite(buffer: Buffer | npt.NDArray[np.generic], kind: int, /) -> bool: ...
def verify(buffer: Buffer, checksum: int, kind: int, /) -> int: ...
def checksum_and_finite(
    buffer: Buffer | npt.NDArray[np.generic], kind: int, /
) -> tuple[int, bool]: ...
def copy_checksum_and_finite(
    destination: Buffer | npt.NDArray[np.generic],
    source: Buffer | npt.NDArray[np.generic],
    kind: int,
    /,
) -> tuple[int, bool]: ...
def _select_scan(name: str, /) -> str: ...
