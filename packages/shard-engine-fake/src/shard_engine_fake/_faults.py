"""The declarative fault plan and the injector that decides, per call, which faults fire.

A plan is data (msgspec Structs, actions tagged by ``kind``) so it can travel in
``LoadConfig.options["faults"]`` or in a JSON file named by ``SHARD_ENGINE_FAKE_FAULTS`` to
engines started in other processes. Firing depends only on the plan and on the sequence of
calls the engine sees, so the same plan and the same calls give the same faults every run.
"""

from __future__ import annotations

import os
import random
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from shard_engine_api import InvalidRequest, OptionValue, Role

__all__ = [
    "FAULTS_ENV_VAR",
    "Crash",
    "Defect",
    "Delay",
    "FaultAction",
    "FaultEvent",
    "FaultInjector",
    "FaultPlan",
    "FaultRule",
    "Malformed",
    "MemoryPressure",
    "MemoryRelief",
    "Operation",
    "StateFailure",
    "fault_plan_from_options",
    "load_fault_plan",
]

FAULTS_ENV_VAR: Final = "SHARD_ENGINE_FAKE_FAULTS"
"""Names a JSON fault plan file, read at load when ``options`` carries no ``faults``."""

Operation = Literal[
    "prefill", "decode", "decode_batch", "release", "export_session", "import_session"
]
Defect = Literal[
    "nan",
    "wrong_shape",
    "wrong_dtype",
    "truncated",
    "bad_checksum",
    "wrong_positions",
    "wrong_evidence",
]
_RESULT_OPERATIONS: Final[frozenset[str]] = frozenset({"prefill", "decode", "decode_batch"})
_STATE_OPERATIONS: Final[frozenset[str]] = frozenset({"export_session", "import_session"})


MAX_DELAY_MILLISECONDS: Final = 86_400_000.0
"""The longest delay a rule may hold an operation (one day): a longer wait overflows the
platform's timeout type and would fail the engine at its first request instead of at load."""


class Delay(msgspec.Struct, frozen=True, kw_only=True, tag="delay", tag_field="kind"):
    """Hold the operation for ``milliseconds`` (at most MAX_DELAY_MILLISECONDS) after its
    compute, inside the request, so a cancel during the delay ends it at once with Cancelled
    and rolls the session back."""

    milliseconds: float

    def __post_init__(self) -> None:
        if not (0 <= self.milliseconds <= MAX_DELAY_MILLISECONDS):  # false for NaN too
            raise InvalidRequest(
                f"delay milliseconds must lie in [0, {MAX_DELAY_MILLISECONDS:.0f}]: "
                f"{self.milliseconds}"
            )


class MemoryPressure(
    msgspec.Struct, frozen=True, kw_only=True, tag="memory_pressure", tag_field="kind"
):
    """Shrink the KV budget to ``kv_budget_tokens`` before the operation and mark the engine
    degraded. New work that does not fit gets ResourceExhausted, or, with
    ``LoadConfig.eviction == "lru"``, idle sessions are evicted (their next decode gets
    CacheMiss reason "evicted")."""

    kv_budget_tokens: int

    def __post_init__(self) -> None:
        if self.kv_budget_tokens < 0:
            raise InvalidRequest(f"kv_budget_tokens must be >= 0: {self.kv_budget_tokens}")


class MemoryRelief(
    msgspec.Struct, frozen=True, kw_only=True, tag="memory_relief", tag_field="kind"
):
    """Restore the configured KV budget and clear the memory-pressure degradation."""


class Malformed(msgspec.Struct, frozen=True, kw_only=True, tag="malformed", tag_field="kind"):
    """Corrupt the result the operation returns (after the session state was committed, like a
    buggy engine would) with ``defect``; for decode_batch, the items of the rule's session (all
    items when the rule names none). Release results are never corrupted."""

    defect: Defect


class Crash(msgspec.Struct, frozen=True, kw_only=True, tag="crash", tag_field="kind"):
    """Enter the failed state before the operation: it and every later call raise
    EngineCrashed. With ``exit_code`` the process exits at once instead (``os._exit``), with
    ``abort`` it aborts (``os.abort()``: SIGABRT, as a failed native assertion does), for
    supervisor tests."""

    detail: str = "injected crash"
    exit_code: int | None = None
    abort: bool = False

    def __post_init__(self) -> None:
        if self.exit_code is not None and not 0 <= self.exit_code <= 255:
            raise InvalidRequest(f"exit_code must lie in [0, 255]: {self.exit_code}")


class StateFailure(
    msgspec.Struct, frozen=True, kw_only=True, tag="state_failure", tag_field="kind"
):
    """Make the backend's state step of an export or import fail as an allocation failure
    would (ResourceExhausted): an import fails after it has written the state into its slot
    (so the core must drop it), an export after reading the state. Only export_session and
    import_session match."""

    detail: str = "injected state failure"


FaultAction = Delay | MemoryPressure | MemoryRelief | Malformed | Crash | StateFailure


class FaultRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When to apply ``action``.

    A call *matches* when its operation is in ``operations`` (any operation when empty), the
    engine's role is in ``roles`` (any when empty) and, when ``session_id`` is set, the call
    concerns that session (any item, for decode_batch). Each rule counts its own matching calls
    from 1. A matching call fires the rule when every given trigger holds: ``nth`` (this is the
    nth matching call), ``every`` (the count is a multiple of it), ``probability`` (a draw from
    the rule's own generator, seeded by the plan seed and the rule's index, taken on every
    matching call so the stream never depends on other triggers); and ``limit`` caps how many
    times the rule fires. A rule with no trigger fires on every matching call.
    """

    action: FaultAction
    operations: tuple[Operation, ...] = ()
    session_id: str | None = None
    roles: tuple[Role, ...] = ()
    nth: int | None = None
    every: int | None = None
    probability: float | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("nth", "every", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequest(f"fault rule {name} must be >= 1, got {value}")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise InvalidRequest(f"fault rule probability must lie in [0, 1]: {self.probability}")
        if isinstance(self.action, Malformed) and "release" in self.operations:
            raise InvalidRequest("a malformed-output rule cannot target release (no result)")


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A seed for probabilistic rules and the rules, applied in order."""

    seed: int = 0
    rules: tuple[FaultRule, ...] = ()


class FaultEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One fired rule: which (index in the plan), on which call, doing what."""

    rule: int
    kind: str
    operation: Operation
    request_id: str
    match: int


def load_fault_plan(source: FaultPlan | Mapping[str, object] | str | bytes) -> FaultPlan:
    """A validated plan from a plan, its JSON-compatible form, or JSON text.

    Raises InvalidRequest for anything that is not a valid plan.
    """
    try:
        if isinstance(source, FaultPlan):
            # Built in process, possibly past its constructors' checks (a Struct's fields can be
            # set from C or through its slot descriptors): checked again as if it had travelled.
            source = msgspec.to_builtins(source)
        if isinstance(source, str | bytes):
            return msgspec.json.decode(source, type=FaultPlan)
        return msgspec.convert(source, FaultPlan)
    except msgspec.ValidationError as error:
        raise InvalidRequest(f"invalid fault plan: {error}") from error
    except msgspec.DecodeError as error:
        raise InvalidRequest(f"fault plan is not valid JSON: {error}") from error
    except (TypeError, ValueError) as error:  # a field holding something no plan can
        raise InvalidRequest(f"invalid fault plan: {error}") from error


def fault_plan_from_options(
    options: Mapping[str, OptionValue], environ: Mapping[str, str] | None = None
) -> FaultPlan:
    """The plan of ``options["faults"]``, else of the JSON file named by the environment
    variable ``SHARD_ENGINE_FAKE_FAULTS``, else the empty plan. Raises InvalidRequest."""
    if "faults" in options:
        source = options["faults"]
        if not isinstance(source, FaultPlan | Mapping | str | bytes):
            raise InvalidRequest(f"option 'faults' must be a fault plan, got {source!r}")
        return load_fault_plan(source)
    path = (os.environ if environ is None else environ).get(FAULTS_ENV_VAR)
    if not path:
        return FaultPlan()
    return load_fault_plan(_read_plan_file(path))


MAX_PLAN_FILE_BYTES: Final = 1 << 20
"""The largest fault plan file read (a plan is a few rules: 1 MiB is far beyond any)."""


def _read_plan_file(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_PLAN_FILE_BYTES: a FIFO would block the
    load forever and ``/dev/zero`` would be read until memory runs out. Raises
    InvalidRequest."""
    where = f"fault plan {path!r} ({FAULTS_ENV_VAR})"
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not wait for one.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise InvalidRequest(f"cannot read {where}: {error}") from error
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise InvalidRequest(f"{where} is not a regular file")
        text = os.read(descriptor, MAX_PLAN_FILE_BYTES + 1)
    except OSError as error:
        raise InvalidRequest(f"cannot read {where}: {error}") from error
    finally:
        os.close(descriptor)
    if len(text) > MAX_PLAN_FILE_BYTES:
        raise InvalidRequest(f"{where} is larger than {MAX_PLAN_FILE_BYTES} bytes")
    return text


@dataclass(slots=True)
class _RuleState:
    index: int
    rule: FaultRule
    random: random.Random
    matches: int = 0
    fired: int = 0

    def matches_call(self, operation: Operation, session_ids: Sequence[str]) -> bool:
        rule = self.rule
        if rule.operations and operation not in rule.operations:
            return False
        if isinstance(rule.action, Malformed) and operation not in _RESULT_OPERATIONS:
            return False
        if isinstance(rule.action, StateFailure) and operation not in _STATE_OPERATIONS:
            return False
        return rule.session_id is None or rule.session_id in session_ids

    def fires(self) -> bool:
        self.matches += 1
        rule = self.rule
        draw = self.random.random() if rule.probability is not None else None
        if rule.nth is not None and self.matches != rule.nth:
            return False
        if rule.every is not None and self.matches % rule.every != 0:
            return False
        if draw is not None and rule.probability is not None and draw >= rule.probability:
            return False
        if rule.limit is not None and self.fired >= rule.limit:
            return False
        self.fired += 1
        return True


@dataclass(slots=True)
class FaultInjector:
    """Evaluates a plan's rules for one engine (of one role); thread-safe."""

    plan: FaultPlan
    role: Role
    _rules: list[_RuleState] = field(default_factory=list)
    _events: list[FaultEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rules = [
            _RuleState(index, rule, random.Random(f"{self.plan.seed}:{index}"))
            for index, rule in enumerate(self.plan.rules)
            if not rule.roles or self.role in rule.roles
        ]

    @property
    def active(self) -> bool:
        """Whether any rule can fire on this engine."""
        return bool(self._rules)

    def fire(
        self, operation: Operation, session_ids: Sequence[str], request_id: str
    ) -> list[FaultRule]:
        """The rules that fire for this call, in plan order, recording each as an event."""
        fired: list[FaultRule] = []
        with self._lock:
            for state in self._rules:
                if state.matches_call(operation, session_ids) and state.fires():
                    fired.append(state.rule)
                    self._events.append(
                        FaultEvent(
                            rule=state.index,
                            kind=str(type(state.rule.action).__struct_config__.tag),
                            operation=operation,
                            request_id=request_id,
                            match=state.matches,
                        )
                    )
        return fired

    def events(self) -> tuple[FaultEvent, ...]:
        """Every fault fired so far, in firing order."""
        with self._lock:
            return tuple(self._events)
