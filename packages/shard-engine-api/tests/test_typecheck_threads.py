"""Shared state that is built lazily is safe when several threads use it first at once: the
edge checkers are compiled once and no thread sees one half-built."""

from __future__ import annotations

import threading
import time
from typing import Final

import msgspec
import pytest

from shard_engine_api import (
    DecodeBatchRequest,
    DecodeRequest,
    InvalidRequest,
    LoadConfig,
    PrefillRequest,
    SessionRef,
    ShardSpec,
    TokenInput,
    _typecheck,
)
from shard_engine_api._typecheck import check_fields, check_request

THREADS: Final = 8


def _fresh_checkers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget every compiled checker and make compiling slow, so that every thread of a test
    makes its first call while another is still compiling (the window a fresh worker process
    opens when its threads all send their first request)."""
    monkeypatch.setattr(_typecheck, "_STRUCT_CHECKERS", {})
    monkeypatch.setattr(_typecheck, "_FIELD_CHECKERS", {})
    type_info = msgspec.inspect.type_info

    def slow_type_info(cls: object) -> msgspec.inspect.Type:
        time.sleep(0.002)
        return type_info(cls)

    monkeypatch.setattr(msgspec.inspect, "type_info", slow_type_info)


def _all_at_once(call: object, n: int = THREADS) -> list[BaseException]:
    """Run ``call`` on ``n`` threads released together; the exceptions they raised."""
    assert callable(call)
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (collected and asserted on)
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


SESSION: Final = SessionRef(session_id="s", epoch=1)


def test_first_checks_on_many_threads_at_once_all_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_checkers(monkeypatch)
    request = PrefillRequest(
        request_id="p", session=SESSION, start_pos=0, inputs=TokenInput(token_ids=(1, 2))
    )
    assert _all_at_once(lambda: check_request(request, PrefillRequest)) == []


def test_first_checks_on_many_threads_at_once_still_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fresh_checkers(monkeypatch)
    bad = DecodeBatchRequest(
        request_id="b",
        items=(
            DecodeRequest(
                request_id="d",
                session=SESSION,
                pos="0",  # type: ignore[arg-type]
                inputs=TokenInput(token_ids=(1,)),
            ),
        ),
    )
    errors = _all_at_once(lambda: check_request(bad, DecodeBatchRequest))
    assert len(errors) == THREADS
    for error in errors:
        assert isinstance(error, InvalidRequest)
        assert error.details["field"] == "DecodeBatchRequest.items[0].pos"


def test_first_field_checks_on_many_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_checkers(monkeypatch)
    config = LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2))
    assert _all_at_once(lambda: check_fields(config)) == []
    assert _all_at_once(lambda: check_request(config, LoadConfig)) == []
