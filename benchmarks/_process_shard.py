"""One shard engine in its own process behind two pipes, speaking the project's wire codec.

The parent holds a :class:`ProcessShard` (prefill, decode, decode_batch, release, export_session,
import_session, close, like an engine); the child (``python _process_shard.py ENGINE``) loads the
engine named on its command line and answers one framed message at a time: an 8-byte little-endian
length, then the msgpack message (``Codec.encode``). Requests are decoded with
``Codec.decode_request`` and replies with ``Codec.decode_reply``, both with their default checks
(checksums verified, non-finite values rejected), as a worker behind a transport would. Health and
metrics, which have no request type, are asked for with the frames ``health`` and ``metrics``; an
empty frame ends the child. This is the in-repo measurement of process-per-shard (a served
transport measures its own)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import IO, Final

from shard_engine_api import (
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ErrorInfo,
    ExportSessionRequest,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    LoadConfig,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionSnapshot,
    ShardEngineError,
    ShardResult,
    load_engine,
)
from shard_engine_api.wire import Codec, WireReply, WireRequest, error_from_info

_LENGTH_BYTES: Final = 8
_CODEC: Final = Codec()
_HEALTH: Final = b"health"
_METRICS: Final = b"metrics"


def _write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(_LENGTH_BYTES, "little"))
    stream.write(payload)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes | None:
    header = stream.read(_LENGTH_BYTES)
    if len(header) < _LENGTH_BYTES:
        return None
    length = int.from_bytes(header, "little")
    if length == 0:
        return None
    payload = stream.read(length)
    if len(payload) != length:
        raise EOFError(f"frame of {length} bytes ended after {len(payload)}")
    return payload


class ProcessShard:
    """The parent's handle on one engine in a child process."""

    def __init__(
        self, engine: str, config: LoadConfig, *, env: Mapping[str, str | None] | None = None
    ) -> None:
        """Start the child and load ``config`` in it. ``env`` entries override the parent's
        environment, None removes one (e.g. ``GOMP_SPINCOUNT``, which the child reads when it
        first loads libgomp)."""
        child_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                child_env.pop(key, None)
            else:
                child_env[key] = value
        self._process = subprocess.Popen(
            [sys.executable, __file__, engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env,
        )
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._to_child: IO[bytes] = self._process.stdin
        self._from_child: IO[bytes] = self._process.stdout
        try:
            reply = self._call(config)
        except BaseException:
            self.close()
            raise
        if not isinstance(reply, Capabilities):
            raise TypeError(f"load answered {type(reply).__name__}")
        self._engine = engine
        self._capabilities = reply

    @property
    def name(self) -> str:
        return self._engine

    def load(self, config: LoadConfig) -> Capabilities:
        raise InvalidRequest("a process shard is loaded when it starts")

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _call(self, request: WireRequest | bytes) -> WireReply:
        frame = request if isinstance(request, bytes) else _CODEC.encode(request)
        _write_frame(self._to_child, frame)
        payload = _read_frame(self._from_child)
        if payload is None:
            raise EOFError(f"shard process exited (status {self._process.poll()})")
        reply = _CODEC.decode_reply(payload)
        if isinstance(reply, ErrorInfo):
            raise error_from_info(reply)
        return reply

    def prefill(self, request: PrefillRequest) -> ShardResult:
        reply = self._call(request)
        if not isinstance(reply, ShardResult):
            raise TypeError(f"prefill answered {type(reply).__name__}")
        return reply

    def decode(self, request: DecodeRequest) -> ShardResult:
        reply = self._call(request)
        if not isinstance(reply, ShardResult):
            raise TypeError(f"decode answered {type(reply).__name__}")
        return reply

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        reply = self._call(request)
        if not isinstance(reply, DecodeBatchResult):
            raise TypeError(f"decode_batch answered {type(reply).__name__}")
        return reply

    def cancel(self, request: CancelRequest) -> CancelResult:
        reply = self._call(request)
        if not isinstance(reply, CancelResult):
            raise TypeError(f"cancel answered {type(reply).__name__}")
        return reply

    def health(self) -> Health:
        reply = self._call(_HEALTH)
        if not isinstance(reply, Health):
            raise TypeError(f"health answered {type(reply).__name__}")
        return reply

    def metrics(self) -> Metrics:
        reply = self._call(_METRICS)
        if not isinstance(reply, Metrics):
            raise TypeError(f"metrics answered {type(reply).__name__}")
        return reply

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        reply = self._call(request)
        if not isinstance(reply, ReleaseResult):
            raise TypeError(f"release answered {type(reply).__name__}")
        return reply

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        reply = self._call(request)
        if not isinstance(reply, SessionSnapshot):
            raise TypeError(f"export_session answered {type(reply).__name__}")
        return reply

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        reply = self._call(request)
        if not isinstance(reply, ImportSessionResult):
            raise TypeError(f"import_session answered {type(reply).__name__}")
        return reply

    def close(self) -> None:
        """End the child (it closes its engine) and wait for it. Idempotent."""
        if self._process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                _write_frame(self._to_child, b"")
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._to_child.close()
        self._from_child.close()


def serve(engine_name: str, source: IO[bytes], sink: IO[bytes]) -> int:
    """The child: load on the first message, then answer requests until an empty frame."""
    payload = _read_frame(source)
    if payload is None:
        return 0
    config = _CODEC.decode_request(payload)
    if not isinstance(config, LoadConfig):
        raise TypeError(f"the first message must be a LoadConfig, got {type(config).__name__}")
    engine = load_engine(engine_name, config)
    _write_frame(sink, _CODEC.encode(engine.capabilities()))
    try:
        while (payload := _read_frame(source)) is not None:
            try:
                reply: WireReply
                if payload == _HEALTH:
                    _write_frame(sink, _CODEC.encode(engine.health()))
                    continue
                if payload == _METRICS:
                    _write_frame(sink, _CODEC.encode(engine.metrics()))
                    continue
                request = _CODEC.decode_request(payload)
                if isinstance(request, PrefillRequest):
                    reply = engine.prefill(request)
                elif isinstance(request, DecodeRequest):
                    reply = engine.decode(request)
                elif isinstance(request, DecodeBatchRequest):
                    reply = engine.decode_batch(request)
                elif isinstance(request, ReleaseRequest):
                    reply = engine.release(request)
                elif isinstance(request, CancelRequest):
                    reply = engine.cancel(request)
                elif isinstance(request, ExportSessionRequest):
                    reply = engine.export_session(request)
                elif isinstance(request, ImportSessionRequest):
                    reply = engine.import_session(request)
                else:
                    raise TypeError(f"unexpected {type(request).__name__}")
                _write_frame(sink, _CODEC.encode(reply))
            except ShardEngineError as error:
                _write_frame(sink, _CODEC.encode_error(error))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    # Frames own the real stdout; anything the engine prints goes to stderr instead.
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    raise SystemExit(serve(sys.argv[1], sys.stdin.buffer, frames))
