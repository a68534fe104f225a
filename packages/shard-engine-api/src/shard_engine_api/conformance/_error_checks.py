"""The standard tests of refused requests: every error of the taxonomy (InvalidRequest,
WrongRole, ShardMismatch, ContractVersionMismatch, ChecksumMismatch, UnsupportedFeature,
CacheMiss) raised where the contract says, with its code and retryable flag on every path
(prefill, decode, batch items, export and import), bundles checked on every path and role,
contract versions and reserved values at their edges, and a failed request that changes
nothing. :class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`ERROR_CHECK_TESTS`, part of the standard tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Final

import msgspec

from shard_engine_api import _codec
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    UnsupportedFeature,
    WrongRole,
    error_from_info,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryBundle,
    DecodeBatchRequest,
    DecodeRequest,
    ExportSessionRequest,
    ImportSessionRequest,
    MtpState,
    PrefillRequest,
    SessionRef,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _raises,
    _raises_exactly,
    assert_matches,
    bundle_of,
    logits_array,
    rebuilt_bundle,
    replace_bundle,
    split_ranges,
)

__all__ = ["ERROR_CHECK_TESTS", "ErrorCheckTests"]

ERROR_CHECK_TESTS: Final[tuple[str, ...]] = (
    "test_boundary_checks_on_every_path",
    "test_cache_miss_decode_position",
    "test_cache_miss_prefill_gap",
    "test_cache_miss_unknown_session",
    "test_checksum_mismatch",
    "test_contract_version_at_its_edges",
    "test_contract_version_mismatch",
    "test_empty_reserved_values_refused",
    "test_error_codes_match_taxonomy",
    "test_failed_request_is_atomic",
    "test_invalid_request_bad_token_ids",
    "test_invalid_request_empty_request_id",
    "test_invalid_request_malformed_bundle",
    "test_retryable_on_every_path",
    "test_shard_mismatch",
    "test_unsupported_feature_on_bundles",
    "test_unsupported_feature_on_requests",
    "test_wrong_role_bundle_to_token_shard",
    "test_wrong_role_tokens_to_bundle_shard",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_TAXONOMY: Final[tuple[type[ShardEngineError], ...]] = (
    InvalidRequest,
    WrongRole,
    ShardMismatch,
    ContractVersionMismatch,
    ChecksumMismatch,
    UnsupportedFeature,
    NotReady,
    CacheMiss,
    StaleEpoch,
    ResourceExhausted,
    Cancelled,
    MalformedOutput,
    EngineCrashed,
)
"""The classes an engine may raise (the root is never raised itself)."""
_BY_CODE: Final = {cls.code: cls for cls in _TAXONOMY}


class ErrorCheckTests(SuiteHelpers):
    """The standard tests of refused requests (module docstring)."""

    def test_invalid_request_empty_request_id(self) -> None:
        """An empty request id is refused with InvalidRequest (prefill, decode, batch).

        Fix: validate request_id before doing anything (EngineCore._operation does)."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        _raises(
            InvalidRequest,
            lambda: h.prefill(engine, session, 0, h.tokens(2, seed=1), request_id=""),
            "prefill with request_id ''",
        )
        h.prefill(engine, session, 0, h.tokens(2, seed=1))
        decode = DecodeRequest(
            request_id="", session=session, pos=2, inputs=TokenInput(token_ids=(1,))
        )
        _raises(InvalidRequest, lambda: engine.decode(decode), "decode with request_id ''")
        _raises(
            InvalidRequest,
            lambda: engine.decode_batch(DecodeBatchRequest(request_id="", items=(decode,))),
            "decode_batch with request_id ''",
        )

    def test_invalid_request_bad_token_ids(self) -> None:
        """Token ids outside [0, vocab), an empty token list, and a decode with more than one
        token are refused with InvalidRequest.

        Fix: validate token ids against the vocabulary before running the model."""
        h = self.harness
        engine = h.load()
        vocab = engine.capabilities().vocab_size
        session = h.session("a")
        for bad in ((), (-1,), (vocab,), (0, vocab + 5)):
            _raises(InvalidRequest, partial(h.prefill, engine, session, 0, bad), f"tokens {bad}")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        _raises(InvalidRequest, lambda: h.decode(engine, session, 3, (vocab,)), "decode token")
        _raises(InvalidRequest, lambda: h.decode(engine, session, 3, (1, 2)), "decode 2 tokens")

    def test_invalid_request_malformed_bundle(self) -> None:
        """A bundle whose header disagrees with its payload or its request (row count, session,
        first position, multi-row decode) is refused with InvalidRequest.

        Fix: check n_tokens x hidden_size x dtype size == len(payload), and that the bundle's
        session and first_pos equal the request's."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        other = h.session("b")
        cases: list[tuple[str, BoundaryBundle, SessionRef, int]] = [
            (
                "n_tokens one larger than the payload",
                replace_bundle(bundle, n_tokens=4),
                session,
                0,
            ),
            (
                "payload one value short",
                rebuilt_bundle(bundle, payload=bundle.payload[:-4]),
                session,
                0,
            ),
            ("bundle of another session", bundle, other, 0),
            ("bundle first_pos differs from the request", bundle, session, 1),
        ]
        for what, candidate, ref, start in cases:
            _raises(
                InvalidRequest,
                partial(h.prefill, tail, ref, start, candidate),
                f"prefill with {what}",
            )
        h.prefill(tail, session, 0, bundle)
        three_rows = rebuilt_bundle(bundle, first_pos=3)
        _raises(InvalidRequest, lambda: h.decode(tail, session, 3, three_rows), "decode 3 rows")

    def test_wrong_role_tokens_to_bundle_shard(self) -> None:
        """Token ids sent to a tail (and middle) shard raise WrongRole, for prefill and decode.

        Fix: a shard that does not start at layer 0 takes only boundary bundles; raise
        WrongRole (not a plain InvalidRequest) so the caller knows it routed wrongly."""
        h = self.harness
        self._need_layers(2, "a tail shard")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)[1:]
        for start, end in ranges:
            engine = h.load(start, end)
            session = h.session(f"a{start}")
            tokens = h.tokens(2, seed=1)
            _raises(
                WrongRole,
                partial(h.prefill, engine, session, 0, tokens),
                f"tokens to [{start}, {end})",
            )
            _raises(
                WrongRole,
                partial(h.decode, engine, session, 0, (1,)),
                f"decode tokens to [{start}, {end})",
            )

    def test_wrong_role_bundle_to_token_shard(self) -> None:
        """A boundary bundle sent to a head or full shard raises WrongRole.

        Fix: a shard that starts at layer 0 takes only token ids; raise WrongRole."""
        h = self.harness
        self._need_layers(2, "a head shard producing a bundle")
        (head_range, _tail) = split_ranges(h.n_layers, 2)
        producer = h.load(*head_range)
        session = h.session("a")
        bundle = h.head_bundle(producer, session, 0, h.tokens(2, seed=1))
        for start, end in ((0, h.n_layers), head_range):
            engine = h.load(start, end)
            _raises(
                WrongRole,
                partial(h.prefill, engine, session, 0, bundle),
                f"bundle to [{start}, {end})",
            )

    def test_shard_mismatch(self) -> None:
        """A bundle of another model fingerprint, entering another layer, or of another
        hidden size raises ShardMismatch.

        Fix: compare bundle.model_fingerprint, bundle.layer (== this shard's start) and
        bundle.hidden_size with the loaded shard before using the payload."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        wider = rebuilt_bundle(
            bundle,
            hidden_size=bundle.hidden_size + 1,
            payload=memoryview(bytes(bundle.n_tokens * (bundle.hidden_size + 1) * 4)),
        )
        cases = [
            ("another model fingerprint", replace_bundle(bundle, model_fingerprint="other")),
            ("another layer", replace_bundle(bundle, layer=bundle.layer + 1)),
            ("another hidden size", wider),
        ]
        for what, candidate in cases:
            _raises(ShardMismatch, partial(h.prefill, tail, session, 0, candidate), what)

    def test_contract_version_mismatch(self) -> None:
        """A bundle speaking another contract version raises ContractVersionMismatch.

        Fix: compare bundle.contract_version with CONTRACT_VERSION first."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        for version in (CONTRACT_VERSION + 1, 0):
            candidate = replace_bundle(bundle, contract_version=version)
            _raises(
                ContractVersionMismatch,
                partial(h.prefill, tail, session, 0, candidate),
                f"contract_version {version}",
            )

    def test_checksum_mismatch(self) -> None:
        """A bundle whose payload does not match its checksum raises ChecksumMismatch, and
        the error is retryable (the sender may retransmit).

        Fix: verify payload_checksum(payload) == bundle.checksum before using the payload."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        corrupted = bytearray(bundle.payload)
        corrupted[0] ^= 0x01
        cases = [
            ("checksum off by one bit", replace_bundle(bundle, checksum=bundle.checksum ^ 1)),
            ("payload bit flipped", replace_bundle(bundle, payload=memoryview(bytes(corrupted)))),
        ]
        for what, candidate in cases:
            error = _raises(ChecksumMismatch, partial(h.prefill, tail, session, 0, candidate), what)
            assert error.retryable, "ChecksumMismatch must be retryable"

    def test_unsupported_feature_on_requests(self) -> None:
        """Non-empty reserved fields (mtp, aux) on prefill and decode requests raise
        UnsupportedFeature.

        Fix: reject any non-empty mtp/aux; the hooks are reserved and disabled."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        tokens = TokenInput(token_ids=h.tokens(3, seed=1))
        mtp = (MtpState(n_draft_tokens=1),)
        aux = (AuxState(name="recurrent"),)
        prefills = [
            PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens, mtp=mtp
            ),
            PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens, aux=aux
            ),
        ]
        for prefill in prefills:
            _raises(
                UnsupportedFeature,
                partial(engine.prefill, prefill),
                f"prefill with mtp={prefill.mtp} aux={prefill.aux}",
            )
        h.prefill(engine, session, 0, tokens)
        step = TokenInput(token_ids=(1,))
        decodes = [
            DecodeRequest(request_id=h.request_id(), session=session, pos=3, inputs=step, mtp=mtp),
            DecodeRequest(request_id=h.request_id(), session=session, pos=3, inputs=step, aux=aux),
        ]
        for decode in decodes:
            _raises(
                UnsupportedFeature,
                partial(engine.decode, decode),
                f"decode with mtp={decode.mtp} aux={decode.aux}",
            )
        h.decode(engine, session, 3, step)

    def test_unsupported_feature_on_bundles(self) -> None:
        """Non-empty reserved fields (mtp, aux) on a boundary bundle raise UnsupportedFeature.

        Fix: reject any bundle with non-empty mtp/aux."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("a")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        cases = [
            ("bundle.mtp", replace_bundle(bundle, mtp=(MtpState(n_draft_tokens=1),))),
            ("bundle.aux", replace_bundle(bundle, aux=(AuxState(name="recurrent"),))),
        ]
        for what, candidate in cases:
            _raises(UnsupportedFeature, partial(h.prefill, tail, session, 0, candidate), what)

    def test_cache_miss_unknown_session(self) -> None:
        """Decoding an unknown session, or prefilling it at a position > 0, raises CacheMiss
        with committed_length 0.

        Fix: a session with no state has committed length 0; only a prefill at 0 creates it."""
        h = self.harness
        engine = h.load()
        session = h.session("never-seen")
        miss = _raises(CacheMiss, lambda: h.decode(engine, session, 0, (1,)), "decode unknown")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 0
        miss = _raises(CacheMiss, lambda: h.prefill(engine, session, 2, (1, 2)), "prefill at 2")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 0

    def test_cache_miss_decode_position(self) -> None:
        """A decode at a position other than the committed length raises CacheMiss carrying
        that committed length, and leaves the session usable at it.

        Fix: decode only at pos == committed length; report the length in the error."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(5, seed=1))
        for pos in (3, 6, 0):
            miss = _raises(
                CacheMiss, partial(h.decode, engine, session, pos, (1,)), f"decode at {pos}"
            )
            assert isinstance(miss, CacheMiss)
            assert miss.committed_length == 5, (
                f"CacheMiss must carry committed_length 5, got {miss.committed_length}"
            )
        h.decode(engine, session, 5, (1,))

    def test_cache_miss_prefill_gap(self) -> None:
        """A prefill starting beyond the committed length (a gap) raises CacheMiss with the
        committed length.

        Fix: allow start_pos <= committed length only (equal appends, lower truncates)."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(4, seed=1))
        miss = _raises(CacheMiss, lambda: h.prefill(engine, session, 6, (1, 2)), "prefill gap")
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 4
        h.decode(engine, session, 4, (1,))

    def test_failed_request_is_atomic(self) -> None:
        """Failed requests (bad token mid-truncation, context overflow, KV budget, reserved
        field, wrong decode position, gap) leave the session unchanged: afterwards a decode at
        the old committed length succeeds and equals a clean run.

        Fix: validate and admit everything before touching the cache, and roll back on any
        error after that."""
        h = self.harness
        engine = h.load(max_context=16, kv_budget_tokens=14, max_batch_tokens=16)
        exact, tolerance = self._shape_exactness(engine.capabilities())
        vocab = engine.capabilities().vocab_size
        tokens = h.tokens(8, seed=1)
        session = h.session("a")
        h.prefill(engine, session, 0, tokens)
        failures: list[tuple[str, type[ShardEngineError], Callable[[], object]]] = [
            (
                "truncating prefill with a bad token",
                InvalidRequest,
                lambda: h.prefill(engine, session, 2, (1, vocab)),
            ),
            (
                "truncating prefill past max_context",
                ResourceExhausted,
                lambda: h.prefill(engine, session, 2, h.tokens(15, seed=2)),
            ),
            (
                "truncating prefill past the KV budget",
                ResourceExhausted,
                lambda: h.prefill(engine, session, 2, h.tokens(13, seed=2)),
            ),
            (
                "truncating prefill with a reserved field",
                UnsupportedFeature,
                lambda: engine.prefill(
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=session,
                        start_pos=2,
                        inputs=TokenInput(token_ids=(1, 2)),
                        mtp=(MtpState(n_draft_tokens=1),),
                    )
                ),
            ),
            ("decode at the wrong position", CacheMiss, lambda: h.decode(engine, session, 3, (1,))),
            ("prefill with a gap", CacheMiss, lambda: h.prefill(engine, session, 9, (1,))),
        ]
        for what, error, call in failures:
            _raises(error, call, what)
            health = engine.health()
            assert health.kv_used_tokens == len(tokens), (
                f"after a failed {what} the session holds {health.kv_used_tokens} positions"
            )
        got = logits_array(h.decode(engine, session, len(tokens), (3,)))
        clean = h.load()
        h.prefill(clean, session, 0, tokens)
        want = logits_array(h.decode(clean, session, len(tokens), (3,)))
        assert_matches(
            got,
            want,
            exact=exact,
            tolerance=tolerance,
            what="decode after failed requests vs a clean run",
        )

    def _head_and_tail(self) -> tuple[ShardEngine, ShardEngine]:
        self._need_layers(2, "a bundle-taking shard")
        (head_range, tail_range) = split_ranges(self.harness.n_layers, 2)
        return self.harness.load(*head_range), self.harness.load(*tail_range)

    def test_boundary_checks_on_every_path(self) -> None:
        """Bundles are checked on prefill, decode and batch items alike, on the tail and
        the middle shard: a wrong checksum is ChecksumMismatch; another fingerprint, an
        empty fingerprint, or a layer one below (layer 0 included) or one above the shard's
        start is ShardMismatch (that class exactly, not a plain InvalidRequest). Nothing
        changes.

        Fix: run the same bundle checks (checksum, fingerprint, layer == start, hidden
        size) for every operation that takes a bundle, before any state is touched."""
        h = self.harness
        self._need_layers(2, "a bundle-taking shard")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)[1:]
        for start, end in ranges:
            upstream = h.load(0, start)
            engine = h.load(start, end)
            batched = engine.capabilities().features.batched_decode
            session = h.session(f"checked-{start}")
            tokens = h.tokens(4, seed=1)
            prompt = bundle_of(h.prefill(upstream, session, 0, tokens))
            row = bundle_of(h.decode(upstream, session, 4, (2,)))

            def variants(
                bundle: BoundaryBundle, start: int = start
            ) -> list[tuple[str, type[ShardEngineError], BoundaryBundle]]:
                # A bundle that names no model, or enters no producer's end (layer 0), is not
                # this shard's bundle: ShardMismatch, like any other model or layer.
                return [
                    (
                        "checksum off by one",
                        ChecksumMismatch,
                        replace_bundle(bundle, checksum=bundle.checksum ^ 1),
                    ),
                    (
                        "another fingerprint",
                        ShardMismatch,
                        replace_bundle(bundle, model_fingerprint=bundle.model_fingerprint + "x"),
                    ),
                    (
                        "an empty fingerprint",
                        ShardMismatch,
                        replace_bundle(bundle, model_fingerprint=""),
                    ),
                    (
                        "layer one below the start",
                        ShardMismatch,
                        replace_bundle(bundle, layer=start - 1),
                    ),
                    (
                        "layer one above the start",
                        ShardMismatch,
                        replace_bundle(bundle, layer=start + 1),
                    ),
                ]

            where = f"[{start}, {end})"
            for what, error, candidate in variants(prompt):
                _raises_exactly(
                    error,
                    partial(h.prefill, engine, session, 0, candidate),
                    f"{where} prefill: {what}",
                )
            assert engine.health().sessions == 0, f"{where}: a refused bundle created a session"
            h.prefill(engine, session, 0, prompt)
            for what, error, candidate in variants(row):
                _raises_exactly(
                    error,
                    partial(h.decode, engine, session, 4, candidate),
                    f"{where} decode: {what}",
                )
                if batched:
                    [outcome] = self._batch(engine, [self._item(session, 4, candidate)]).items
                    codes = {error.code}
                    assert isinstance(outcome, ErrorInfo), f"{where} batch item: {what}: served"
                    assert outcome.code in codes, (
                        f"{where} batch item: {what}: expected {error.code}, got {outcome!r}"
                    )
            assert self._committed_length(engine, session) == 4
            h.decode(engine, session, 4, row)

    def test_error_codes_match_taxonomy(self) -> None:
        """Every error raised (and every error item of a batch) is an instance of exactly one
        taxonomy class with that class's code, and its retryable flag is the contract's: the
        class default, except that ResourceExhausted is retryable only for occupancy a release
        or eviction can free (KV budget, session slots), not for positions past max_context,
        and NotReady only while the engine is loading (never before load or after close). The
        wire form rebuilds the same class. A subclass with its own code, or a retryable
        StaleEpoch, violates the contract. Every raised error survives the wire: encoded,
        decoded and rebuilt (``to_info``, the codec, ``error_from_info``) it has the same
        class, code and retryable flag, and a CacheMiss the same committed length and reason.

        Fix: raise the contract's error classes themselves, with their default retryable;
        retryable=False for a context overflow and for an unloaded or closed engine."""
        h = self.harness
        engine = h.load(max_sessions=2, eviction="reject")
        vocab = engine.capabilities().vocab_size
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        h.prefill(engine, h.session("b", epoch=2), 0, h.tokens(3, seed=1))
        full = h.load(max_context=12, max_batch_tokens=16, kv_budget_tokens=64)
        limit = full.capabilities().limits.max_context
        h.prefill(full, session, 0, h.tokens(limit, seed=4))
        calls: list[tuple[str, Callable[[], object]]] = [
            ("cache miss", lambda: h.decode(engine, session, 9, (1,))),
            ("cache miss (unknown session)", lambda: h.decode(engine, h.session("z"), 0, (1,))),
            ("cache miss (prefill gap)", lambda: h.prefill(engine, session, 9, (1,))),
            ("stale epoch (decode)", lambda: h.decode(engine, h.session("b", epoch=1), 3, (1,))),
            ("stale epoch", lambda: h.prefill(engine, h.session("b", epoch=1), 0, (1,))),
            ("resource exhausted (slots)", lambda: h.prefill(engine, h.session("c"), 0, (1,))),
            ("resource exhausted (context)", lambda: h.decode(full, session, limit, (1,))),
            ("invalid token", lambda: h.prefill(engine, session, 3, (vocab,))),
            (
                "reserved field",
                lambda: engine.prefill(
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=session,
                        start_pos=3,
                        inputs=TokenInput(token_ids=(1,)),
                        mtp=(MtpState(n_draft_tokens=1),),
                    )
                ),
            ),
        ]
        if h.n_layers >= 2:
            (head_range, tail_range) = split_ranges(h.n_layers, 2)
            head, tail = h.load(*head_range), h.load(*tail_range)
            bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
            calls += [
                ("wrong role", lambda: h.prefill(tail, session, 0, (1,))),
                (
                    "shard mismatch",
                    lambda: h.prefill(tail, session, 0, replace_bundle(bundle, layer=0)),
                ),
                (
                    "checksum mismatch",
                    lambda: h.prefill(
                        tail, session, 0, replace_bundle(bundle, checksum=bundle.checksum ^ 1)
                    ),
                ),
                (
                    "contract version",
                    lambda: h.prefill(
                        tail, session, 0, replace_bundle(bundle, contract_version=99)
                    ),
                ),
            ]
        closed = h.load()
        closed.close()
        unloaded = h.new_engine()
        calls.append(("not ready (closed)", lambda: h.prefill(closed, session, 0, (1,))))
        calls.append(("not ready (never loaded)", lambda: h.prefill(unloaded, session, 0, (1,))))
        retryable = {
            "resource exhausted (slots)": True,
            "resource exhausted (context)": False,
            "not ready (closed)": False,
            "not ready (never loaded)": False,
        }
        for what, call in calls:
            error = _raises(ShardEngineError, call, what)
            cls = type(error)
            assert cls in _TAXONOMY, (
                f"{what}: raised {cls.__module__}.{cls.__qualname__} (code {error.code!r}), "
                "not a contract error class"
            )
            assert error.code == cls.code, f"{what}: code {error.code!r} != {cls.code!r}"
            wanted = retryable.get(what, cls.default_retryable)
            assert error.retryable == wanted, (
                f"{what}: {cls.__name__}.retryable is {error.retryable}, the contract says {wanted}"
            )
            self._assert_survives_the_wire(error, what)
        if engine.capabilities().features.batched_decode:
            outcomes = self._batch(
                engine,
                [
                    self._item(session, 9, (1,)),
                    self._item(session, 3, (vocab,)),
                    self._item(h.session("b", epoch=1), 0, (1,)),
                ],
            ).items
            for outcome in outcomes:
                assert isinstance(outcome, ErrorInfo), outcome
                known = _BY_CODE.get(outcome.code)
                assert known is not None, (
                    f"batch item error code {outcome.code!r} is not in the taxonomy"
                )
                assert outcome.retryable == known.default_retryable, (
                    f"batch item {outcome.code}: retryable {outcome.retryable}"
                )

    def _assert_survives_the_wire(self, error: ShardEngineError, what: str) -> None:
        """``error`` encoded, decoded and rebuilt as a remote caller receives it is the same
        error: class, code, retryable flag and, for CacheMiss, committed length and reason."""
        try:
            decoded = _codec.decode_message(_codec.encode(error.to_info()))
        except ShardEngineError as failure:
            raise AssertionError(f"{what}: its wire form does not survive the codec") from failure
        assert isinstance(decoded, ErrorInfo), f"{what}: decoded {type(decoded).__name__}"
        rebuilt = error_from_info(decoded)
        have: tuple[object, ...] = (type(rebuilt), rebuilt.code, rebuilt.retryable)
        want: tuple[object, ...] = (type(error), error.code, error.retryable)
        if isinstance(error, CacheMiss):
            want += (error.committed_length, error.reason)
            have += (
                (rebuilt.committed_length, rebuilt.reason)
                if isinstance(rebuilt, CacheMiss)
                else (None, None)
            )
        assert have == want, (
            f"{what}: over the wire it becomes {have} (class, code, retryable"
            f"{', committed_length, reason' if isinstance(error, CacheMiss) else ''}), "
            f"raised as {want}; put every field in the error's details (the constructors of "
            "the contract's classes do)"
        )

    def test_retryable_on_every_path(self) -> None:
        """Every error has the contract's retryable flag on every path it can come from:
        prefill, decode, a batch item, export and import. KV budget and session slots are
        retryable everywhere; positions past max_context and a prefill over max_batch_tokens
        are not; ChecksumMismatch and CacheMiss are (a retransmission, a replay), StaleEpoch,
        ContractVersionMismatch, InvalidRequest and UnsupportedFeature are not.

        Fix: raise the contract's classes with their default retryable everywhere (one
        admission path for every operation), retryable=False only where the request itself
        cannot ever fit."""
        h = self.harness
        engine = h.load(max_context=12, kv_budget_tokens=16, max_sessions=2, eviction="reject")
        caps = engine.capabilities()
        limits = caps.limits
        batched = caps.features.batched_decode
        a, b = h.session("a"), h.session("b")
        h.prefill(engine, a, 0, h.tokens(limits.max_context, seed=1))
        h.prefill(engine, b, 0, h.tokens(limits.kv_budget_tokens - limits.max_context, seed=2))
        checks: list[tuple[str, bool, Callable[[], object]]] = [
            ("KV budget on prefill", True, partial(h.prefill, engine, b, 4, h.tokens(3, seed=3))),
            ("KV budget on decode", True, partial(h.decode, engine, b, 4, (1,))),
            ("slots on a new session", True, partial(h.prefill, engine, h.session("c"), 0, (1,))),
            ("context on decode", False, partial(h.decode, engine, a, limits.max_context, (1,))),
            (
                "context on prefill",
                False,
                partial(h.prefill, engine, a, limits.max_context, (1,)),
            ),
            (
                "a prefill over max_batch_tokens",
                False,
                partial(h.prefill, engine, a, 0, h.tokens(limits.max_batch_tokens + 1, seed=4)),
            ),
            ("cache miss on decode", True, partial(h.decode, engine, a, 3, (1,))),
            ("stale epoch on decode", False, partial(h.decode, engine, h.session("a", 0), 4, (1,))),
            ("stale epoch on release", False, partial(h.release, engine, h.session("a", 0))),
            ("invalid token on decode", False, partial(h.decode, engine, b, 4, (caps.vocab_size,))),
        ]
        items: list[tuple[str, bool, DecodeRequest]] = [
            ("KV budget in a batch", True, self._item(b, 4, (1,))),
            ("context in a batch", False, self._item(a, limits.max_context, (1,))),
            ("cache miss in a batch", True, self._item(a, 3, (1,))),
            ("stale epoch in a batch", False, self._item(h.session("a", 0), 4, (1,))),
        ]
        if caps.features.session_migration:
            checks += [
                (
                    "cache miss on export",
                    True,
                    partial(
                        engine.export_session,
                        ExportSessionRequest(request_id=h.request_id(), session=h.session("x")),
                    ),
                ),
                (
                    "stale epoch on export",
                    False,
                    partial(
                        engine.export_session,
                        ExportSessionRequest(request_id=h.request_id(), session=h.session("a", 0)),
                    ),
                ),
            ]
            snapshot = engine.export_session(
                ExportSessionRequest(request_id=h.request_id(), session=b)
            )
            moved = msgspec.structs.replace(snapshot, session=h.session("moved"))
            corrupted = msgspec.structs.replace(snapshot, checksum=snapshot.checksum ^ 1)
            newer = msgspec.structs.replace(snapshot, contract_version=CONTRACT_VERSION + 1)
            for what, retry, sent, epoch in (
                ("slots on import", True, moved, None),
                ("stale epoch on import", False, snapshot, None),
                ("checksum on import", True, corrupted, 5),
                ("contract version on import", False, newer, 5),
            ):
                request = ImportSessionRequest(
                    request_id=h.request_id(), snapshot=sent, epoch=epoch
                )
                checks.append((what, retry, partial(engine.import_session, request)))
        if h.n_layers >= 2:
            head, tail = self._head_and_tail()
            s = h.session("t")
            h.prefill(tail, s, 0, h.head_bundle(head, s, 0, h.tokens(3, seed=5)))
            row = bundle_of(h.decode(head, s, 3, (1,)))
            broken_row = replace_bundle(row, checksum=row.checksum ^ 1)
            versioned = replace_bundle(row, contract_version=CONTRACT_VERSION + 1)
            checks += [
                ("checksum on decode", True, partial(h.decode, tail, s, 3, broken_row)),
                ("contract version on decode", False, partial(h.decode, tail, s, 3, versioned)),
            ]
            if tail.capabilities().features.batched_decode:
                for what, retry, bad in (
                    ("checksum in a batch", True, broken_row),
                    ("contract version in a batch", False, versioned),
                ):
                    [outcome] = self._batch(tail, [self._item(s, 3, bad)]).items
                    assert isinstance(outcome, ErrorInfo), f"{what}: served"
                    assert outcome.retryable == retry, (
                        f"{what}: {outcome.code} retryable={outcome.retryable}, the contract "
                        f"says {retry}"
                    )
        for what, retry, call in checks:
            error = self._error_of(call, what)
            assert error.retryable == retry, (
                f"{what}: {type(error).__name__} retryable={error.retryable}, the contract "
                f"says {retry}"
            )
        for what, retry, item in items if batched else []:
            # One batch per item: items naming one session twice are refused for that.
            [outcome] = self._batch(engine, [item]).items
            assert isinstance(outcome, ErrorInfo), f"{what}: served"
            assert outcome.retryable == retry, (
                f"{what}: {outcome.code} retryable={outcome.retryable}, the contract says {retry}"
            )

    def test_contract_version_at_its_edges(self) -> None:
        """A bundle of any other contract version is ContractVersionMismatch on prefill,
        decode and in a batch: the previous version, 0, the next one, and versions that
        equal this one modulo 2**8, 2**16 and 2**32; nothing changes.

        Fix: compare the whole 64-bit contract_version with CONTRACT_VERSION for equality
        (not >=, not a narrowed integer) on every path that takes a bundle."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("v")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        row = bundle_of(h.decode(head, session, 3, (1,)))
        versions = sorted(
            {
                CONTRACT_VERSION - 1,
                0,
                CONTRACT_VERSION + 1,
                CONTRACT_VERSION + 2**8,
                CONTRACT_VERSION + 2**16,
                CONTRACT_VERSION + 2**32,
            }
            - {CONTRACT_VERSION}
        )
        versions = [v for v in versions if v >= 0]
        for version in versions:
            _raises_exactly(
                ContractVersionMismatch,
                partial(
                    h.prefill, tail, session, 0, replace_bundle(bundle, contract_version=version)
                ),
                f"prefill with contract_version {version}",
            )
        assert tail.health().sessions == 0, "a refused bundle created a session"
        h.prefill(tail, session, 0, bundle)
        batched = tail.capabilities().features.batched_decode
        for version in versions:
            stepped = replace_bundle(row, contract_version=version)
            _raises_exactly(
                ContractVersionMismatch,
                partial(h.decode, tail, session, 3, stepped),
                f"decode with contract_version {version}",
            )
            if batched:
                [outcome] = self._batch(tail, [self._item(session, 3, stepped)]).items
                assert isinstance(outcome, ErrorInfo), f"batch item of version {version} served"
                assert outcome.code == ContractVersionMismatch.code, (
                    f"batch item of contract_version {version}: {outcome}"
                )
        assert self._committed_length(tail, session) == 3
        h.decode(tail, session, 3, row)

    def test_empty_reserved_values_refused(self) -> None:
        """A reserved field holding an empty value (``MtpState()``, ``AuxState(name="")``)
        is not empty: it is UnsupportedFeature on prefill, decode and batch items, and on a
        bundle's reserved fields; nothing changes.

        Fix: refuse any non-empty mtp or aux tuple, whatever its elements hold."""
        h = self.harness
        engine = h.load()
        session = h.session("r")
        tokens = TokenInput(token_ids=h.tokens(3, seed=1))
        empties: list[tuple[str, dict[str, object]]] = [
            ("mtp=(MtpState(),)", {"mtp": (MtpState(),)}),
            ("aux=(AuxState(name=''),)", {"aux": (AuxState(name=""),)}),
        ]
        for what, fields in empties:
            prefill = PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens
            )
            _raises_exactly(
                UnsupportedFeature,
                partial(engine.prefill, msgspec.structs.replace(prefill, **fields)),
                f"prefill with {what}",
            )
        h.prefill(engine, session, 0, tokens)
        for what, fields in empties:
            _raises_exactly(
                UnsupportedFeature,
                partial(engine.decode, self._item(session, 3, (1,), **fields)),
                f"decode with {what}",
            )
            if engine.capabilities().features.batched_decode:
                [outcome] = self._batch(engine, [self._item(session, 3, (1,), **fields)]).items
                assert isinstance(outcome, ErrorInfo), f"batch item with {what} served"
                assert outcome.code == UnsupportedFeature.code, f"batch item with {what}: {outcome}"
        assert self._committed_length(engine, session) == 3
        if h.n_layers < 2:
            return
        head, tail = self._head_and_tail()
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        for what, fields in empties:
            _raises_exactly(
                UnsupportedFeature,
                partial(h.prefill, tail, session, 0, replace_bundle(bundle, **fields)),
                f"a bundle with {what}",
            )
