"""The daemon's state table: every allowed change of state, and nothing else.

Rules: `ROWS` is the specification, one row per (trigger, source states, outcome,
destination), each with the condition a reader needs; `GATES` says where an input is
taken at all and the refusal it gets anywhere else; `ENGINE_ROWS` is one engine's
lifecycle. A trigger function computes facts only: the core asks the gate before it acts
(`StateTable.admit`) and, once the trigger found its outcome (the sync advanced, ended
clean, ended dirty), the table chooses the row (`StateTable.take`) and the `transitions`
machine built from the rows executes it. An outcome no row of the state takes is our bug
(INTERNAL), raised before anything changed. Rows never overlap (no first-match order to
know); adding a trigger is one row (or gate) plus one function. docs/ARCHITECTURE.md's table is generated from here (`render`), and a
test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from transitions import EventData, Machine, MachineError

from messages.errors import ErrorCode, make_error
from orchestrator.core.states import ACTIVE, EngineState, State

S, E = State, EngineState


class Outcome(str, Enum):
    """What a trigger function found: the one fact the table needs to choose a row."""

    ADVANCE = "advance"  # the sync moves on (or one opens)
    CLEAN = "clean"  # the sync ended having touched no engine of a READY daemon
    DIRTY = "dirty"  # the sync ended having touched an engine (or the daemon served none)


@dataclass(frozen=True, slots=True)
class Row:
    trigger: str
    sources: tuple[State, ...]
    outcome: Outcome
    dest: State
    when: str


@dataclass(frozen=True, slots=True)
class Gate:
    """Where an input is taken at all, and the refusal it gets in any other state (h11's
    way: the lookup is the rule; the trigger adds only the facts of the moment)."""

    states: tuple[State, ...]
    code: ErrorCode
    refusal: str  # formatted with {state}


ROWS: tuple[Row, ...] = (
    # a trainer's sync: stream the buckets, prepare, commit (finalize once per engine)
    Row(
        "begin",
        (S.IDLE, S.READY),
        Outcome.ADVANCE,
        S.LOADING_BUCKETS,
        "a new sync_id, a version newer than the one served, at least `min_engines` live "
        "engines; every live engine takes part",
    ),
    Row(
        "finish",
        (S.LOADING_BUCKETS,),
        Outcome.ADVANCE,
        S.FINALIZING,
        "every sender finished; every announced bucket is applied by every participant "
        "(prepared); no engine tensor left unsent unless partial: finalize is sent once "
        "to each participant",
    ),
    Row(
        "finish",
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "group stream, every participant prepared: one prepared something else than "
        "the trainer finished with (bucket count, chain, digest); nothing finalized, dirty",
    ),
    Row(
        "prepared",
        (S.LOADING_BUCKETS,),
        Outcome.ADVANCE,
        S.FINALIZING,
        "group stream, after the trainer's finish: the last participant prepared "
        "exactly what the trainer finished with (bucket count, chain over the bucket "
        "checksums, digest): finalize is sent once to each participant (the commit)",
    ),
    Row(
        "prepared",
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "group stream: a participant prepared something else than the trainer "
        "finished with, or than the others prepared; nothing finalized, dirty",
    ),
    Row(
        "finalized",
        (S.FINALIZING,),
        Outcome.ADVANCE,
        S.READY,
        "the last participant reported the expected version, digest and canary tokens, "
        "and no participant labels its outputs",
    ),
    Row(
        "committed",
        (S.FINALIZING,),
        Outcome.ADVANCE,
        S.READY,
        "every participant finalized (the version is committed fleet-wide) and the last "
        "labelling engine (vLLM: its weight version) reported the version as its label",
    ),
    Row(
        "committed",
        (S.FINALIZING,),
        Outcome.DIRTY,
        S.IDLE,
        "a labelling engine labelled another version: dirty",
    ),
    Row(
        "finalized",
        (S.FINALIZING,),
        Outcome.DIRTY,
        S.IDLE,
        "a participant reported another version, digest or canary: dirty",
    ),
    # a sync given up
    Row(
        "abort",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "the trainer or an operator aborted a sync that touched no engine of a READY daemon",
    ),
    Row(
        "abort",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "the trainer or an operator aborted a sync that touched an engine: dirty",
    ),
    Row(
        "conflict",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a source's seat was claimed by another token or connection, or a sharded begin "
        "disagreed with the running sync (version, sources, plan, sync_id), before any engine "
        "was touched: the sync fails for every source",
    ),
    Row(
        "conflict",
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "the same, after an engine was touched: the sync fails for every source, dirty",
    ),
    Row(
        "failed",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a participant failed before any engine was touched (READY daemon)",
    ),
    Row(
        "failed",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant failed (checksum, shape, its load or post-load step): dirty",
    ),
    Row(
        "register",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a participant registered again (its process restarted) before anything was touched",
    ),
    Row(
        "register",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant registered again (its process restarted and lost its buckets): dirty",
    ),
    Row(
        "internal",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a bug surfaced while handling an input, before any engine was touched",
    ),
    Row(
        "internal",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a bug surfaced while handling an input: the running sync fails INTERNAL, dirty",
    ),
    Row(
        "shutdown",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "the daemon stops during a sync that touched no engine of a READY daemon",
    ),
    Row(
        "shutdown",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "the daemon stops mid-sync: dirty (the journal says so at the next start)",
    ),
    # the clock
    Row(
        "tick",
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a deadline passed or a participant was lost before any engine was touched",
    ),
    Row(
        "tick",
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant lost (disconnected, or silent past --engine-timeout), a bucket not "
        "applied in --bucket-timeout, the trainer gone past its grace or silent past "
        "--sync-timeout, a participant not prepared --bucket-timeout after the trainer's "
        "finish (group stream), finalize not reported in --finalize-timeout: dirty",
    ),
    Row(
        "tick",
        (S.IDLE,),
        Outcome.ADVANCE,
        S.LOADING_BUCKETS,
        "recovery: dirty, and the spool holds the version last served: the daemon replays "
        "it to every live engine as a rollback sync (its own sync_id)",
    ),
)

ENGINE_ROWS: dict[str, tuple[tuple[EngineState, ...], EngineState]] = {
    "enlist": ((E.STALE, E.READY, E.JOINING), E.LOADING),  # a participant of a new sync
    "start_finalize": ((E.LOADING,), E.FINALIZING),  # told to run its post-load step
    "serve": ((E.FINALIZING, E.JOINING), E.READY),  # verified at the served version
    "restore": ((E.LOADING, E.FINALIZING), E.READY),  # its sync ended, nothing changed
    "doubt": ((E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY), E.STALE),
    "join": ((E.STALE,), E.JOINING),  # a catch-up from the spool begins
    "lose": ((E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY), E.LOST),
}

# Every input the core takes; those not in a row never change the daemon's state.
TRIGGERS = (
    "begin",
    "bucket",
    "finish",
    "abort",
    "register",
    "heartbeat",
    "loaded",
    "prepared",
    "finalized",
    "committed",
    "failed",
    "tick",
    "trainer_gone",
    "engine_gone",
    "internal",
    "shutdown",
    "spool_changed",
)
# Where an input is taken at all; an input without a gate is taken in every state (a
# trigger that finds nothing to do changes nothing). The refusal is the table's.
GATES: dict[str, Gate] = {
    "begin": Gate(
        (S.IDLE, S.READY),
        ErrorCode.INVALID_STATE,
        "begin is not allowed in state {state}",
    ),
    "bucket": Gate(
        (S.LOADING_BUCKETS,),
        ErrorCode.INVALID_STATE,
        "bucket is not allowed in state {state}",
    ),
    "finish": Gate(
        (S.LOADING_BUCKETS,),
        ErrorCode.INVALID_STATE,
        "finish is only allowed in LOADING_BUCKETS, state is {state}",
    ),
}


def _outcome_is(outcome: Outcome) -> Callable[[EventData], bool]:
    def cond(e: EventData) -> bool:
        return bool(e.kwargs.get("outcome") is outcome)

    return cond


class _Phase:
    """The machine's model: the daemon's state, nothing else."""

    state: State


class Refused(Exception):
    """A gate's refusal: the table's code and sentence, which the core dresses with the
    daemon's position and the facts of the moment."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class StateTable:
    """The daemon's state, moved only by the table: `admit` says whether an input is
    taken in the current state (its gate), `take` chooses the row for what the trigger
    found (its outcome) and moves through the `transitions` machine built from ROWS, whose
    only condition per row is that outcome. No row: INTERNAL, nothing changed."""

    def __init__(self, initial: State) -> None:
        self._phase = _Phase()
        rows = [
            {
                "trigger": r.trigger,
                "source": list(r.sources),
                "dest": r.dest,
                "conditions": _outcome_is(r.outcome),
            }
            for r in ROWS
        ]
        self._machine = Machine(
            model=self._phase,
            states=State,
            transitions=rows,
            initial=initial,
            auto_transitions=False,
            send_event=True,
        )

    @property
    def state(self) -> State:
        return self._phase.state

    def admit(self, trigger: str) -> None:
        """Raise `Refused` (the gate's code and sentence) when `trigger` is not taken in
        the current state; INTERNAL for a trigger the table does not know."""
        if trigger not in TRIGGERS:
            raise make_error(ErrorCode.INTERNAL, f"{trigger!r} is not a trigger of the state table")
        gate = GATES.get(trigger)
        if gate is not None and self.state not in gate.states:
            raise Refused(gate.code, gate.refusal.format(state=self.state.value))

    def dest(self, trigger: str, outcome: Outcome) -> State:
        """The destination of the row for (`trigger`, current state, `outcome`);
        INTERNAL if there is none."""
        src = self.state
        for r in ROWS:
            if r.trigger == trigger and r.outcome is outcome and src in r.sources:
                return r.dest
        raise make_error(
            ErrorCode.INTERNAL,
            f"no row of the state table takes {trigger} ({outcome.value}) from {src.value}",
            state=src.value,
        )

    def take(self, trigger: str, outcome: Outcome) -> State:
        """Move by the row for (`trigger`, current state, `outcome`); return its dest."""
        dest = self.dest(trigger, outcome)
        try:
            taken = self._machine.events[trigger].trigger(self._phase, outcome=outcome)
        except (MachineError, KeyError):
            taken = False
        if not taken or self.state is not dest:  # the executor disagrees with ROWS: our bug
            raise make_error(ErrorCode.INTERNAL, f"the state machine did not take {trigger} to {dest.value}")
        return dest


def engine_move(state: EngineState, trigger: str) -> EngineState:
    sources, dest = ENGINE_ROWS[trigger]
    if state not in sources:
        raise make_error(ErrorCode.INTERNAL, f"engine lifecycle: {trigger} is not allowed from {state.value}")
    return dest


BEGIN = "<!-- state table: generated from orchestrator/core/table.py; do not edit -->"
END = "<!-- end of state table -->"


def render() -> str:
    """The Markdown tables of docs/ARCHITECTURE.md (generated; a test compares)."""
    out = [BEGIN, "", "| trigger | from | found | to | when |", "|---|---|---|---|---|"]
    for r in ROWS:
        src = ", ".join(s.value for s in r.sources)
        out.append(f"| {r.trigger} | {src} | {r.outcome.value} | {r.dest.value} | {r.when} |")
    quiet = [t for t in TRIGGERS if not any(r.trigger == t for r in ROWS)]
    out.append("")
    out.append(
        "Inputs that never change the daemon's state: "
        + ", ".join(f"`{t}`" for t in quiet)
        + ". A trigger finding something no row of its state takes is INTERNAL (our bug), "
        "raised before anything changed."
    )
    out.append("")
    out.append("Where an input is taken at all (any other input is taken in every state):")
    out.append("")
    out.append("| input | taken in | refused elsewhere with |")
    out.append("|---|---|---|")
    for name, g in GATES.items():
        states = ", ".join(s.value for s in g.states)
        out.append(f"| {name} | {states} | {g.code.value}: {g.refusal.format(state='X')} |")
    out.append("")
    out.append("| engine trigger | from | to |")
    out.append("|---|---|---|")
    for name, (sources, dest) in ENGINE_ROWS.items():
        out.append(f"| {name} | {', '.join(s.value for s in sources)} | {dest.value} |")
    out += ["", END]
    return "\n".join(out)


def splice(doc: str) -> str:
    """`doc` with its state table replaced by the one generated now."""
    if BEGIN not in doc or END not in doc:
        return doc.rstrip("\n") + "\n\n" + render() + "\n"
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


__all__ = [
    "ACTIVE",
    "ROWS",
    "ENGINE_ROWS",
    "TRIGGERS",
    "GATES",
    "Gate",
    "Outcome",
    "Refused",
    "Row",
    "StateTable",
    "engine_move",
    "render",
]
