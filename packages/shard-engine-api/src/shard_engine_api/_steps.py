"""The steps every request takes on the backend, for :class:`~._core.EngineCore`: admit, run,
check and commit (or roll back), in the turn the scheduler gives (``_scheduler``).

Three ways through, one set of guarantees:

* ``_run_one``: one prefill or a lone decode, without lists (every decode on an idle engine);
* ``_admit_run_commit`` / ``_run_and_commit``: a ``decode_batch`` (per-item admission and errors);
* ``_decode_step`` -> ``_run_group`` -> ``_forward_group``: single decodes of different sessions
  that waited together, run as one batched forward by the caller that reached the front
  (continuous batching); ``_forward_chunks`` runs a long prefill in chunks with the waiting
  decodes between them (``_between_chunks``).

Each ends at the commit point under the state lock (``_seal``: a cancel from then on answers
False), where ledger and backend commit together; any failure or cancel before it rolls every
admitted item back and leaves the ledger as it was. The backend steps an engine implements
(``_forward``, ``_forward_batch``, ``_rollback``, ``_commit``, ``_drop``) are declared here,
with the row digests (``_record_digest``) that spare a second pass over a backend's private rows.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import ClassVar, Final, Literal

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import ForwardItem, OutputMode
from shard_engine_api._cancel import CancelToken
from shard_engine_api._errors import (
    Cancelled,
    EngineCrashed,
    MalformedOutput,
    NotReady,
    ShardEngineError,
)
from shard_engine_api._inputs import InputRows
from shard_engine_api._ledger import Admission, LedgerLimits, SessionLedger
from shard_engine_api._metrics import Counters
from shard_engine_api._results import check_rows, scan_rows
from shard_engine_api._scheduler import Scheduler
from shard_engine_api._types import Capabilities, LoadConfig, SessionRef, Timings

_log = logging.getLogger("shard_engine.core")

Rows = npt.NDArray[np.float32]


@dataclasses.dataclass(slots=True)
class _Work:
    """A checked operation ready for the admit-run-commit step: the input rows of each item
    and how the ledger admits them (single operations raise, a batch returns per-item errors).
    """

    kind: Literal["prefill", "decode"]
    output: OutputMode
    rows: Sequence[InputRows]
    admit: Callable[[], Sequence[Admission | ShardEngineError]]
    batched: bool = False


@dataclasses.dataclass(slots=True)
class _DecodeJob:
    """A single decode waiting to run, possibly in another caller's coalesced forward; the
    leader that runs it sets ``outcome`` (rows and timings, or the error its caller raises)."""

    token: CancelToken
    output: OutputMode
    tokens: npt.NDArray[np.int32] | None
    hidden: Rows | None
    session: SessionRef
    pos: int
    started: float
    outcome: tuple[Rows, Timings] | BaseException | None = None


_DIGEST_ENTRIES: Final = 1024
"""How many recorded row digests :meth:`EngineCore._record_digest` keeps before it first drops
those of rows that no longer exist."""


class CoreSteps(abc.ABC):
    """The backend steps an engine implements and the admit-run-commit steps built on them;
    :class:`~._core.EngineCore` (lifecycle, entry points, state) is the class engines extend."""

    engine_name: ClassVar[str] = "unnamed"
    prefill_chunk_tokens: int = 0
    rows_private: ClassVar[bool] = False
    _scheduler: Scheduler[_DecodeJob]
    _ledger: SessionLedger
    _counters: Counters
    _state_lock: threading.Lock
    _in_flight: dict[str, CancelToken]
    _digests: dict[int, tuple[weakref.ref[Rows], int, bool]]
    _digest_limit: int
    _kv_budget: int
    _admission_limits: LedgerLimits | None

    # What EngineCore supplies.

    @property
    @abc.abstractmethod
    def config(self) -> LoadConfig:
        """The loaded configuration (NotReady before load)."""

    @abc.abstractmethod
    def _require_serving(self) -> Capabilities:
        """The capabilities while ready or degraded, else the lifecycle's error."""

    @abc.abstractmethod
    def _fail(self, detail: str) -> None:
        """Enter the failed state."""

    # ----------------------------------------------------------------- backend steps

    @abc.abstractmethod
    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Rows:
        """Run the shard over ``item`` and return hidden states ``(n, hidden)`` or logits
        (``(1, vocab)`` for "last", ``(n, vocab)`` for "all"). Poll ``token`` at safe points.
        Must keep enough to undo itself until ``_commit`` or ``_rollback`` is called."""

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[Rows]:
        """Run one decode row for each item (distinct slots). The default runs them one by
        one; engines with a real batched step override it. Results are in item order."""
        return [self._forward(item, output, token) for item in items]

    @abc.abstractmethod
    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        """Restore ``slot`` to exactly its state before the last uncommitted forward, which
        started at ``start_pos`` while ``committed_length`` positions were cached."""

    @abc.abstractmethod
    def _commit(self, slot: int) -> None:
        """Make the last forward on ``slot`` final (drop whatever was kept to undo it)."""

    @abc.abstractmethod
    def _drop(self, slot: int) -> None:
        """Free everything cached for ``slot`` (release, eviction)."""

    def _record_digest(self, rows: Rows, checksum: int, finite: bool) -> None:
        """Say that ``rows``, an array ``_forward`` or ``_forward_batch`` returns, hash to
        ``checksum`` (payload_checksum of its bytes) and are all finite or not, as computed when
        the backend wrote them. Used only with ``rows_private`` (the rows cannot change after);
        the entry is consumed by the result built from them (an entry whose rows died first is
        never used: the lookup checks identity; such entries are swept out in bulk)."""
        if self.rows_private:
            if len(self._digests) >= self._digest_limit:
                self._sweep_digests()
            self._digests[id(rows)] = (weakref.ref(rows), checksum, finite)

    def _scanned_rows(self, rows: Rows) -> tuple[Rows, bool]:
        """The rows a result will be built from and whether every value is finite, known
        before the commit point: what the backend recorded while writing them, else one pass
        that is recorded in turn, so the result is not scanned again. Rows a backend may still
        change (``rows_private`` False) are copied first, as the result would copy them
        anyway: the copy is what is scanned and what the result carries."""
        if self._digests:
            entry = self._digests.get(id(rows))
            if entry is not None and entry[0]() is rows:
                return rows, entry[2]
        if not self.rows_private:
            rows = np.array(rows, order="C")  # a copy that is the core's own
        checksum, finite = scan_rows(rows)
        if checksum is not None:
            if len(self._digests) >= self._digest_limit:
                self._sweep_digests()
            self._digests[id(rows)] = (weakref.ref(rows), checksum, finite)
        return rows, finite

    def _sweep_digests(self) -> None:
        """Drop the digests of rows that died unconsumed (a failed step): swept here rather
        than by a weakref callback, a closure on every row of every step. The next sweep waits
        until the table has doubled, so a batch of many live rows costs one sweep per
        doubling, not one per row."""
        digests = self._digests
        for key, (ref, _, _) in list(digests.items()):
            if ref() is None:
                digests.pop(key, None)
        self._digest_limit = max(_DIGEST_ENTRIES, 2 * len(digests))

    def _seal(self, token: CancelToken) -> None:
        """The commit point (under the state lock): raise Cancelled if the request was
        cancelled, else refuse every later cancel and end its registration, so the request's
        ``finally`` need not take the lock again."""
        token.seal()
        if self._in_flight.get(token.request_id) is token:
            del self._in_flight[token.request_id]

    def _limits(self) -> LedgerLimits:
        """What admission may use now (read under the state lock: the budget may change)."""
        limits = self._admission_limits
        if limits is None:
            raise NotReady(f"{self.engine_name} engine is not loaded", retryable=False)
        if limits.kv_budget != self._kv_budget:  # memory pressure changed the budget
            limits = self._admission_limits = dataclasses.replace(limits, kv_budget=self._kv_budget)
        return limits

    def _plan_prefill(
        self, caps: Capabilities, session: SessionRef, start_pos: int, n_tokens: int
    ) -> Admission:
        return self._ledger.admit_prefill(
            session.session_id, session.epoch, start_pos, n_tokens, self._limits()
        )

    def _plan_decode(self, caps: Capabilities, session: SessionRef, pos: int) -> Admission:
        return self._ledger.admit_decode(session.session_id, session.epoch, pos, self._limits())

    # ----------------------------------------------------------------- admit, run, commit

    def _admit_run_commit(
        self, caps: Capabilities, token: CancelToken, work: _Work, session_ids: Collection[str]
    ) -> tuple[list[Rows | ShardEngineError], Timings]:
        """Admit, run, check and commit in the backend's turn; any failure or cancel before
        the commit point rolls every admitted item back and changes nothing in the ledger."""
        started = time.perf_counter()
        scheduler = self._scheduler
        scheduler.enter(token, session_ids)
        try:
            compute_started = time.perf_counter()
            token.check()
            self._require_serving()
            decisions = work.admit()  # reads the ledger only (see _admit_run_commit_one)
            admitted = [d for d in decisions if isinstance(d, Admission)]
            if len(admitted) == len(decisions):
                outputs = self._run_and_commit(caps, token, work, admitted, work.rows)
                results: list[Rows | ShardEngineError] = list(outputs)
            else:
                rows = [
                    r for d, r in zip(decisions, work.rows, strict=True) if isinstance(d, Admission)
                ]
                ran = iter(self._run_and_commit(caps, token, work, admitted, rows))
                results = [d if isinstance(d, ShardEngineError) else next(ran) for d in decisions]
            finished = time.perf_counter()
        finally:
            scheduler.leave()
        timings = Timings(
            queue_ms=(compute_started - started) * 1000.0,
            compute_ms=(finished - compute_started) * 1000.0,
            total_ms=(time.perf_counter() - started) * 1000.0,
        )
        return results, timings

    def _run_and_commit(
        self,
        caps: Capabilities,
        token: CancelToken,
        work: _Work,
        admitted: Sequence[Admission],
        rows: Sequence[InputRows],
    ) -> list[Rows | ShardEngineError]:
        if not admitted:
            return []
        for admission in admitted:
            if admission.evict_first is not None:
                self._hand_over(admission, token)
        items = [
            ForwardItem(
                slot=admission.slot,
                start_pos=admission.start_pos,
                committed_length=admission.committed_length,
                tokens=tokens,
                hidden=hidden,
            )
            for admission, (tokens, hidden) in zip(admitted, rows, strict=True)
        ]
        started = time.perf_counter()
        try:
            if work.batched:
                outputs = self._forward_batch(items, work.output, token)
            else:
                outputs = [self._forward(items[0], work.output, token)]
            if len(outputs) != len(items):
                raise EngineCrashed(f"backend returned {len(outputs)} results for {len(items)}")
            outputs = list(outputs)
            dtype = self.config.boundary_dtype
            rows_each = 1 if work.batched else items[0].n_tokens
            # An item whose rows are not finite is that item's error (MalformedOutput, rolled
            # back below); the others commit as usual.
            refused: dict[int, ShardEngineError] = {}
            for index, output_rows in enumerate(outputs):
                outputs[index], finite = self._scanned_rows(output_rows)
                try:
                    check_rows(caps, dtype, outputs[index], work.output, rows_each, finite=finite)
                except MalformedOutput as error:
                    refused[index] = error
            committing = (
                [a for index, a in enumerate(admitted) if index not in refused]
                if refused
                else admitted
            )
            compute_ms = (time.perf_counter() - started) * 1000.0
            with self._state_lock:
                self._seal(token)  # the commit point: a cancel from now on answers False
                dropped = self._ledger.commit(committing)
                counters = self._counters
                if work.kind == "prefill":
                    counters.prefill_tokens += rows_each
                else:
                    counters.decode_tokens += rows_each * len(committing)
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            self._rollback_all(admitted)
            raise
        if refused:
            self._rollback_all([admitted[index] for index in sorted(refused)])
        for admission in committing:
            self._commit(admission.slot)
        self._drop_evicted(dropped)
        return [refused.get(index, rows) for index, rows in enumerate(outputs)]

    def _hand_over(self, admission: Admission, token: CancelToken) -> None:
        """The one eviction that precedes the forward: every slot is in use and the backend
        has no spare slot, so the LRU victim's slot goes to the new session now (not after a
        cancel)."""
        token.check()
        with self._state_lock:
            slot = self._ledger.hand_over(admission)
            self._counters.evictions += 1
        if slot is not None:
            self._drop(slot)
            _log.info("%s evicted 1 idle session (LRU) for a slot", self.engine_name)

    def _prefill_step(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        start_pos: int,
        n_prefill: int,
    ) -> tuple[Rows, Timings]:
        """One prefill, in its turn (a prefill is never coalesced)."""
        started = time.perf_counter()
        scheduler = self._scheduler
        scheduler.enter(token, (session.session_id,))
        try:
            return self._run_one(
                caps, token, output, tokens, hidden, session, start_pos, n_prefill, started
            )
        finally:
            scheduler.leave()

    def _decode_step(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        pos: int,
    ) -> tuple[Rows, Timings]:
        """One decode row, run alone when the backend is idle, else queued: a decode that
        waits may be run by the leader of a coalesced forward (continuous batching: the
        thread whose request reaches the front runs every waiting single decode of other
        sessions as one ``_forward_batch``, see ``_scheduler``), and its outcome handed back.
        Alone or coalesced, a request keeps its own admission, result or error, timings,
        cancel and rollback (:meth:`_run_group`)."""
        started = time.perf_counter()
        scheduler = self._scheduler
        if scheduler.try_enter_alone():  # idle: at once, alone
            try:
                return self._run_one(
                    caps, token, output, tokens, hidden, session, pos, None, started
                )
            finally:
                scheduler.leave()
        job = _DecodeJob(token, output, tokens, hidden, session, pos, started)
        ticket = scheduler.enter_decode(token, session.session_id, job)
        if scheduler.leads(ticket):
            try:
                group = scheduler.gather(ticket, caps.limits.max_batch_tokens)
                forward_started = time.perf_counter()
                try:
                    if len(group) == 1:
                        job.outcome = self._run_one(
                            caps, token, output, tokens, hidden, session, pos, None, started
                        )
                    else:
                        self._run_group(caps, [member.payload for member in group])
                finally:
                    scheduler.finish_group(group, time.perf_counter() - forward_started)
            finally:
                scheduler.leave()
        return _job_outcome(job)

    def _run_group(
        self,
        caps: Capabilities,
        payloads: Sequence[_DecodeJob | None],
        *,
        protect: Collection[str] = (),
        reserved: int = 0,
    ) -> None:
        """Run coalesced single decodes as one batched forward and set each job's outcome.
        Each job is admitted on its own (an item the ledger refuses gets its own error). The
        forward runs under a token of its own that a cancel of any member also sets: the
        forward then stops, is rolled back whole, and the members not cancelled run again
        without the cancelled ones, so a cancel never fails or changes another request. A
        member cancelled too late to stop the forward is rolled back alone at the commit
        point. A backend failure is every member's error. ``protect`` and ``reserved``: what a
        chunked prefill running between its chunks holds (see ``SessionLedger.admit_batch``)."""
        jobs = [job for job in payloads if job is not None]
        try:
            self._run_group_until_done(caps, jobs, protect, reserved)
        except BaseException as error:
            for job in jobs:
                if job.outcome is None:
                    job.outcome = error
            if not isinstance(error, Exception):
                raise

    def _run_group_until_done(
        self, caps: Capabilities, jobs: list[_DecodeJob], protect: Collection[str], reserved: int
    ) -> None:
        pending = jobs
        while pending:
            compute_started = time.perf_counter()
            live: list[_DecodeJob] = []
            for job in pending:
                if job.token.cancelled:
                    job.outcome = Cancelled(f"request {job.token.request_id!r} was cancelled")
                else:
                    live.append(job)
            if not live:
                return
            self._require_serving()
            decisions = self._ledger.admit_batch(
                [(job.session.session_id, job.session.epoch, job.pos) for job in live],
                self._limits(),
                protect=protect,
                reserved=reserved,
            )
            running: list[_DecodeJob] = []
            admitted: list[Admission] = []
            for job, decision in zip(live, decisions, strict=True):
                if isinstance(decision, ShardEngineError):
                    job.outcome = decision
                else:
                    running.append(job)
                    admitted.append(decision)
            if not running:
                return
            pending = self._forward_group(caps, running, admitted, compute_started)

    def _forward_group(
        self,
        caps: Capabilities,
        jobs: list[_DecodeJob],
        admitted: list[Admission],
        compute_started: float,
    ) -> list[_DecodeJob]:
        """One batched forward of admitted jobs; returns the jobs to run again (a member's
        cancel stopped the forward), else sets every outcome and returns []."""
        output = jobs[0].output
        forward_token = CancelToken(
            f"coalesced decode of {len(jobs)} requests", [job.session.session_id for job in jobs]
        )
        with self._state_lock:
            for job in jobs:
                job.token.linked = forward_token
                if job.token.cancelled:
                    forward_token.cancel()
        items = [
            ForwardItem(
                slot=admission.slot,
                start_pos=admission.start_pos,
                committed_length=admission.committed_length,
                tokens=job.tokens,
                hidden=job.hidden,
            )
            for job, admission in zip(jobs, admitted, strict=True)
        ]
        forward_started = time.perf_counter()
        try:
            try:
                outputs = list(self._forward_batch(items, output, forward_token))
            except Cancelled:
                if not any(job.token.cancelled for job in jobs):
                    raise  # the engine is closing: every member's error
                self._rollback_all(admitted)
                return jobs  # without the cancelled ones, which hear Cancelled
            if len(outputs) != len(items):
                raise EngineCrashed(f"backend returned {len(outputs)} results for {len(items)}")
            dtype = self.config.boundary_dtype
            refused: dict[int, ShardEngineError] = {}
            for index, output_rows in enumerate(outputs):
                outputs[index], finite = self._scanned_rows(output_rows)
                try:
                    check_rows(caps, dtype, outputs[index], output, 1, finite=finite)
                except MalformedOutput as error:
                    refused[index] = error
            compute_ms = (time.perf_counter() - forward_started) * 1000.0
            with self._state_lock:
                committing: list[int] = []
                for index, job in enumerate(jobs):
                    job.token.linked = None
                    if index in refused:
                        continue
                    if job.token.cancelled:  # too late to stop the forward: rolled back alone
                        refused[index] = Cancelled(
                            f"request {job.token.request_id!r} was cancelled"
                        )
                        continue
                    self._seal(job.token)  # the commit point: a cancel from now on answers False
                    committing.append(index)
                dropped = self._ledger.commit([admitted[index] for index in committing])
                counters = self._counters
                counters.decode_tokens += len(committing)
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            with self._state_lock:
                for job in jobs:
                    job.token.linked = None
            self._rollback_all(admitted)
            raise
        if refused:
            self._rollback_all([admitted[index] for index in sorted(refused)])
        for index in committing:
            self._commit(admitted[index].slot)
        self._drop_evicted(dropped)
        finished = time.perf_counter()
        for index, job in enumerate(jobs):
            failed = refused.get(index)
            if failed is not None:
                job.outcome = failed
                continue
            job.outcome = (
                outputs[index],
                Timings(
                    queue_ms=(compute_started - job.started) * 1000.0,
                    compute_ms=(finished - compute_started) * 1000.0,
                    total_ms=(finished - job.started) * 1000.0,
                ),
            )
        return []

    def _run_one(
        self,
        caps: Capabilities,
        token: CancelToken,
        output: OutputMode,
        tokens: npt.NDArray[np.int32] | None,
        hidden: Rows | None,
        session: SessionRef,
        start_pos: int,
        n_prefill: int | None,
        started: float,
    ) -> tuple[Rows, Timings]:
        """One prefill of ``n_prefill`` rows (a decode when None), in the backend's turn,
        through exactly the steps of :meth:`_admit_run_commit` and :meth:`_run_and_commit`,
        without their lists: every lone decode step goes this way, and the lists cost more
        than the checks."""
        compute_started = time.perf_counter()
        token.check()
        self._require_serving()
        # Admission only reads the ledger, and every change to it happens in the backend's
        # turn too: no state lock needed.
        admission = (
            self._plan_decode(caps, session, start_pos)
            if n_prefill is None
            else self._plan_prefill(caps, session, start_pos, n_prefill)
        )
        if admission.evict_first is not None:
            self._hand_over(admission, token)
        admitted = (admission,)
        item = ForwardItem(
            slot=admission.slot,
            start_pos=admission.start_pos,
            committed_length=admission.committed_length,
            tokens=tokens,
            hidden=hidden,
        )
        forward_started = time.perf_counter()
        try:
            chunk = self.prefill_chunk_tokens
            if (
                n_prefill is not None
                and 0 < chunk < n_prefill
                and not admission.evict
                and admission.evict_first is None
            ):
                rows = self._forward_chunks(caps, token, item, output, admission, chunk)
            else:
                rows = self._forward(item, output, token)
            rows, finite = self._scanned_rows(rows)
            n_rows = 1 if n_prefill is None else n_prefill
            check_rows(caps, self.config.boundary_dtype, rows, output, n_rows, finite=finite)
            compute_ms = (time.perf_counter() - forward_started) * 1000.0
            with self._state_lock:
                self._seal(token)  # the commit point: a cancel from now on answers False
                dropped = self._ledger.commit(admitted)
                counters = self._counters
                if n_prefill is None:
                    counters.decode_tokens += n_rows
                else:
                    counters.prefill_tokens += n_rows
                counters.compute_ms += compute_ms
                counters.evictions += len(dropped)
        except BaseException:
            self._rollback_all(admitted)
            raise
        self._commit(admission.slot)
        self._drop_evicted(dropped)
        finished = time.perf_counter()
        timings = Timings(
            queue_ms=(compute_started - started) * 1000.0,
            compute_ms=(finished - compute_started) * 1000.0,
            total_ms=(time.perf_counter() - started) * 1000.0,
        )
        return rows, timings

    def _forward_chunks(
        self,
        caps: Capabilities,
        token: CancelToken,
        item: ForwardItem,
        output: OutputMode,
        admission: Admission,
        chunk: int,
    ) -> Rows:
        """A long prefill as forwards of ``chunk`` rows (see ``prefill_chunk_tokens``), the
        waiting single decodes of other sessions run between two chunks; returns the rows the
        whole prefill returns. A prefill that evicts runs whole (its victims could otherwise be
        decoded meanwhile), as does anything else (:meth:`_run_one` decides)."""
        start, end = item.start_pos, item.start_pos + item.n_tokens
        parts: list[Rows] = []
        session_id = admission.session_id
        growth = max(0, admission.new_length - admission.committed_length)
        for first in range(start, end, chunk):
            last = min(first + chunk, end)
            part = ForwardItem(
                slot=item.slot,
                start_pos=first,
                committed_length=item.committed_length if first == start else first,
                tokens=None if item.tokens is None else item.tokens[first - start : last - start],
                hidden=None if item.hidden is None else item.hidden[first - start : last - start],
            )
            rows = self._forward(part, output, token)
            if output != "last" or last == end:
                parts.append(rows if self.rows_private else np.array(rows))
            if last < end:
                token.check()
                self._between_chunks(caps, session_id, growth)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _between_chunks(self, caps: Capabilities, session_id: str, reserved: int) -> None:
        """Run the single decodes of other sessions that wait as one forward, while a chunked
        prefill of ``session_id`` holds the backend and ``reserved`` positions of the budget."""
        scheduler = self._scheduler
        members = scheduler.take_decodes(caps.limits.max_batch_tokens, session_id)
        if not members:
            return
        try:
            self._run_group(
                caps,
                [member.payload for member in members],
                protect=(session_id,),
                reserved=reserved,
            )
        finally:
            scheduler.finish_members(members)

    def _drop_evicted(self, dropped: Sequence[int]) -> None:
        """Free the slots of the sessions a commit evicted (after the commit point)."""
        for slot in dropped:
            self._drop(slot)
        if dropped:
            _log.info("%s evicted %d idle session(s) (LRU)", self.engine_name, len(dropped))

    def _rollback_all(self, admitted: Sequence[Admission]) -> None:
        for admission in admitted:
            try:
                self._rollback(admission.slot, admission.start_pos, admission.committed_length)
            except Exception as error:
                self._fail(f"rollback failed: {error}")
                raise EngineCrashed(f"rollback of slot {admission.slot} failed: {error}") from error


def _job_outcome(job: _DecodeJob) -> tuple[Rows, Timings]:
    """What the leader that ran ``job`` handed back: its rows and timings, or its error."""
    outcome = job.outcome
    if isinstance(outcome, BaseException):
        raise outcome
    if outcome is None:  # every leader path sets it; a lost outcome is the engine's failure
        raise EngineCrashed(f"decode {job.token.request_id!r} ran without an outcome")
    return outcome
