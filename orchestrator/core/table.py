"""The daemon's state table: every allowed change of state, and nothing else.

Rules: a trigger is spelled once, as a `Trigger` (an engine's lifecycle move as a `Life`).
`ROWS` is the specification, one row per (trigger, source states, outcome, destination),
each with the condition a reader needs; `GATES` says, for every input in every state,
whether it is taken, ignored (changes nothing: a late or stray report), or refused (a
missing pair is the refusal, with the gate's code and sentence); `ENGINE_ROWS` is one
engine's lifecycle. A trigger function computes facts only: the core asks the gate before
it acts (`StateTable.admit`) and, once the trigger found its outcome (the sync advanced,
ended clean, ended dirty), the `transitions` machine built from the rows executes the row
(`StateTable.take`): it is the only executor. An outcome no row of the state takes is our
bug (INTERNAL), raised before anything changed. Rows never overlap (no first-match order
to know); adding a trigger is one `Trigger`, one gate, its rows and one function.
docs/ARCHITECTURE.md's table is generated from here (`render`), and a test keeps the two
equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum

from transitions import EventData, Machine, MachineError

from messages.errors import ErrorCode, make_error
from orchestrator.core.states import ACTIVE, EngineState, State

S, E = State, EngineState


class Outcome(str, Enum):
    """What a trigger function found: the one fact the table needs to choose a row."""

    ADVANCE = "advance"  # the sync moves on (or one opens)
    CLEAN = "clean"  # the sync ended having touched no engine of a READY daemon
    DIRTY = "dirty"  # the sync ended having touched an engine (or the daemon served none)


class Trigger(StrEnum):
    """Every input the core takes (an event's `TRIGGER`) and the rows' own `conflict`."""

    BEGIN = "begin"
    BUCKET = "bucket"
    FINISH = "finish"
    ABORT = "abort"
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    LOADED = "loaded"
    PREPARED = "prepared"
    FINALIZED = "finalized"
    COMMITTED = "committed"
    FAILED = "failed"
    TICK = "tick"
    TRAINER_GONE = "trainer_gone"
    ENGINE_GONE = "engine_gone"
    INTERNAL = "internal"
    SHUTDOWN = "shutdown"
    SPOOL_CHANGED = "spool_changed"
    # not an input: what begin, bucket or finish found (a source's seat claimed twice, or
    # sharded sources that disagree); its gate says where it fails the running sync
    CONFLICT = "conflict"


class Life(StrEnum):
    """An engine's lifecycle moves (ENGINE_ROWS)."""

    ENLIST = "enlist"
    START_FINALIZE = "start_finalize"
    SERVE = "serve"
    RESTORE = "restore"
    DOUBT = "doubt"
    JOIN = "join"
    LOSE = "lose"


@dataclass(frozen=True, slots=True)
class Row:
    trigger: Trigger
    sources: tuple[State, ...]
    outcome: Outcome
    dest: State
    when: str


@dataclass(frozen=True, slots=True)
class Gate:
    """Where an input is taken, where it is ignored, and the refusal it gets in any other
    state (h11's way: the lookup is the rule; the trigger adds only the facts of the
    moment). `why`: what an ignored input is, for a reader."""

    take: tuple[State, ...]
    ignore: tuple[State, ...] = ()
    why: str = ""
    code: ErrorCode = ErrorCode.INVALID_STATE
    refusal: str = ""  # formatted with {state}


ROWS: tuple[Row, ...] = (
    # a trainer's sync: stream the buckets, prepare, commit (finalize once per engine)
    Row(
        Trigger.BEGIN,
        (S.IDLE, S.READY),
        Outcome.ADVANCE,
        S.LOADING_BUCKETS,
        "a new sync_id, a version newer than the one served, at least `min_engines` live "
        "engines; every live engine takes part",
    ),
    Row(
        Trigger.FINISH,
        (S.LOADING_BUCKETS,),
        Outcome.ADVANCE,
        S.FINALIZING,
        "every source finished; every announced bucket is applied by every participant "
        "(prepared); no engine tensor left unsent unless partial: finalize is sent once "
        "to each participant",
    ),
    Row(
        Trigger.FINISH,
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "group stream, every participant prepared: one prepared something else than "
        "the trainer finished with (bucket count, chain, digest); nothing finalized, dirty",
    ),
    Row(
        Trigger.PREPARED,
        (S.LOADING_BUCKETS,),
        Outcome.ADVANCE,
        S.FINALIZING,
        "group stream, after the trainer's finish: the last participant prepared "
        "exactly what the trainer finished with (bucket count, chain over the bucket "
        "checksums, digest): finalize is sent once to each participant (the commit)",
    ),
    Row(
        Trigger.PREPARED,
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "group stream: a participant prepared something else than the trainer "
        "finished with, or than the others prepared; nothing finalized, dirty",
    ),
    Row(
        Trigger.FINALIZED,
        (S.FINALIZING,),
        Outcome.ADVANCE,
        S.READY,
        "the last participant reported the expected version, digest and canary tokens, "
        "and no participant labels its outputs",
    ),
    Row(
        Trigger.COMMITTED,
        (S.FINALIZING,),
        Outcome.ADVANCE,
        S.READY,
        "every participant finalized (the version is committed fleet-wide) and the last "
        "labelling engine (vLLM: its weight version) reported the version as its label",
    ),
    Row(
        Trigger.COMMITTED,
        (S.FINALIZING,),
        Outcome.DIRTY,
        S.IDLE,
        "a labelling engine labelled another version: dirty",
    ),
    Row(
        Trigger.FINALIZED,
        (S.FINALIZING,),
        Outcome.DIRTY,
        S.IDLE,
        "a participant reported another version, digest or canary: dirty",
    ),
    # a sync given up
    Row(
        Trigger.ABORT,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "the trainer or an operator aborted a sync that touched no engine of a READY daemon",
    ),
    Row(
        Trigger.ABORT,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "the trainer or an operator aborted a sync that touched an engine: dirty",
    ),
    Row(
        Trigger.CONFLICT,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a source's seat was claimed by another token or connection, or a sharded begin "
        "disagreed with the running sync (version, sources, plan, sync_id), before any engine "
        "was touched: the sync fails for every source",
    ),
    Row(
        Trigger.CONFLICT,
        (S.LOADING_BUCKETS,),
        Outcome.DIRTY,
        S.IDLE,
        "the same, after an engine was touched: the sync fails for every source, dirty",
    ),
    Row(
        Trigger.FAILED,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a participant failed before any engine was touched (READY daemon)",
    ),
    Row(
        Trigger.FAILED,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant failed (checksum, shape, its load or post-load step): dirty",
    ),
    Row(
        Trigger.REGISTER,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a participant registered again (its process restarted) before anything was touched",
    ),
    Row(
        Trigger.REGISTER,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant registered again (its process restarted and lost its buckets): dirty",
    ),
    Row(
        Trigger.INTERNAL,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a bug surfaced while handling an input, before any engine was touched",
    ),
    Row(
        Trigger.INTERNAL,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a bug surfaced while handling an input: the running sync fails INTERNAL, dirty",
    ),
    Row(
        Trigger.SHUTDOWN,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "the daemon stops during a sync that touched no engine of a READY daemon",
    ),
    Row(
        Trigger.SHUTDOWN,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "the daemon stops mid-sync: dirty (the journal says so at the next start)",
    ),
    # the clock
    Row(
        Trigger.TICK,
        (S.LOADING_BUCKETS,),
        Outcome.CLEAN,
        S.READY,
        "a deadline passed or a participant was lost before any engine was touched",
    ),
    Row(
        Trigger.TICK,
        (S.LOADING_BUCKETS, S.FINALIZING),
        Outcome.DIRTY,
        S.IDLE,
        "a participant lost (disconnected, or silent past --engine-timeout), a bucket not "
        "applied in --bucket-timeout, the trainer gone past its grace or silent past "
        "--sync-timeout, a participant not prepared --bucket-timeout after the trainer's "
        "finish (group stream), finalize not reported in --finalize-timeout: dirty",
    ),
    Row(
        Trigger.TICK,
        (S.IDLE,),
        Outcome.ADVANCE,
        S.LOADING_BUCKETS,
        "recovery: dirty, and the spool holds the version last served: the daemon replays "
        "it to every live engine as a rollback sync (its own sync_id)",
    ),
)

ENGINE_ROWS: dict[Life, tuple[tuple[EngineState, ...], EngineState]] = {
    Life.ENLIST: ((E.STALE, E.READY, E.JOINING), E.LOADING),  # a participant of a new sync
    Life.START_FINALIZE: ((E.LOADING,), E.FINALIZING),  # told to run its post-load step
    Life.SERVE: ((E.FINALIZING, E.JOINING), E.READY),  # verified at the served version
    Life.RESTORE: ((E.LOADING, E.FINALIZING), E.READY),  # its sync ended, nothing changed
    Life.DOUBT: ((E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY), E.STALE),
    Life.JOIN: ((E.STALE,), E.JOINING),  # a catch-up from the spool begins
    Life.LOSE: ((E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY), E.LOST),
}

ALL = tuple(State)
_LATE = "a late, stray or repeated report: changes nothing"
# Every input in every state: taken, ignored, or (in a state it names neither) refused.
GATES: dict[Trigger, Gate] = {
    Trigger.BEGIN: Gate((S.IDLE, S.READY), refusal="begin is not allowed in state {state}"),
    Trigger.BUCKET: Gate((S.LOADING_BUCKETS,), refusal="bucket is not allowed in state {state}"),
    Trigger.FINISH: Gate(
        (S.LOADING_BUCKETS,), refusal="finish is only allowed in LOADING_BUCKETS, state is {state}"
    ),
    # the trigger refuses an abort that names no running sync (with how that sync ended)
    Trigger.ABORT: Gate(ALL),
    Trigger.REGISTER: Gate(ALL),
    Trigger.HEARTBEAT: Gate(ALL),
    Trigger.LOADED: Gate(ALL),  # the running sync's buckets, or a catch-up's (READY)
    Trigger.PREPARED: Gate((S.LOADING_BUCKETS,), (S.IDLE, S.FINALIZING, S.READY), _LATE),
    # the running sync's commit (FINALIZING) or a catch-up's (READY, IDLE: no sync runs)
    Trigger.FINALIZED: Gate((S.FINALIZING, S.READY, S.IDLE), (S.LOADING_BUCKETS,), _LATE),
    Trigger.COMMITTED: Gate((S.FINALIZING, S.READY, S.IDLE), (S.LOADING_BUCKETS,), _LATE),
    Trigger.FAILED: Gate(ALL),  # the running sync's participant, or a catch-up's engine
    Trigger.TICK: Gate(ALL),
    # in every state the group whose store it hosted is forgotten (before the gate)
    Trigger.TRAINER_GONE: Gate(
        (S.LOADING_BUCKETS,),
        (S.IDLE, S.FINALIZING, S.READY),
        "no source streams: nothing to wait for (its group is forgotten in every state)",
    ),
    Trigger.ENGINE_GONE: Gate(ALL),
    Trigger.INTERNAL: Gate((S.LOADING_BUCKETS, S.FINALIZING), (S.IDLE, S.READY), "no sync runs to fail"),
    Trigger.SHUTDOWN: Gate((S.LOADING_BUCKETS, S.FINALIZING), (S.IDLE, S.READY), "no sync runs to fail"),
    # in every state the spool's record is kept (before the gate); READY catches up the stale
    Trigger.SPOOL_CHANGED: Gate(
        (S.READY,),
        (S.IDLE, S.LOADING_BUCKETS, S.FINALIZING),
        "engines catch up only to a READY fleet's version (the spool's record is kept in every state)",
    ),
    # every source has finished once FINALIZING: the input that found it is only refused
    Trigger.CONFLICT: Gate(
        (S.LOADING_BUCKETS,),
        (S.FINALIZING,),
        "only the input is refused",
        refusal="no sync runs in state {state}",
    ),
}
INPUTS = tuple(t for t in Trigger if t is not Trigger.CONFLICT)


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
                "trigger": r.trigger.value,
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

    def admit(self, trigger: Trigger) -> bool:
        """True when the current state takes `trigger`, False when it ignores it; raise
        `Refused` (the gate's code and sentence) anywhere else."""
        gate = GATES[trigger]
        if self.state in gate.take:
            return True
        if self.state in gate.ignore:
            return False
        raise Refused(gate.code, gate.refusal.format(state=self.state.value))

    def take(self, trigger: Trigger, outcome: Outcome) -> State:
        """Move by the row for (`trigger`, current state, `outcome`), executed by the
        machine built from ROWS; return the new state. No such row: INTERNAL, nothing
        changed (the machine moves only when a row's condition holds)."""
        src = self.state
        try:
            taken = self._machine.events[trigger.value].trigger(self._phase, outcome=outcome)
        except (MachineError, KeyError):
            taken = False
        if not taken:
            raise make_error(
                ErrorCode.INTERNAL,
                f"no row of the state table takes {trigger.value} ({outcome.value}) from {src.value}",
                state=src.value,
            )
        return self.state


def engine_move(state: EngineState, move: Life) -> EngineState:
    sources, dest = ENGINE_ROWS[move]
    if state not in sources:
        raise make_error(
            ErrorCode.INTERNAL, f"engine lifecycle: {move.value} is not allowed from {state.value}"
        )
    return dest


BEGIN = "<!-- state table: generated from orchestrator/core/table.py; do not edit -->"
END = "<!-- end of state table -->"


def render() -> str:
    """The Markdown tables of docs/ARCHITECTURE.md (generated; a test compares)."""
    out = [BEGIN, "", "| trigger | from | found | to | when |", "|---|---|---|---|---|"]
    for r in ROWS:
        src = ", ".join(s.value for s in r.sources)
        out.append(f"| {r.trigger.value} | {src} | {r.outcome.value} | {r.dest.value} | {r.when} |")
    quiet = [t for t in INPUTS if not any(r.trigger is t for r in ROWS)]
    out.append("")
    out.append(
        "Inputs that never change the daemon's state: "
        + ", ".join(f"`{t.value}`" for t in quiet)
        + ". A trigger finding something no row of its state takes is INTERNAL (our bug), "
        "raised before anything changed."
    )
    out.append("")
    out.append(
        "Every input in every state (`conflict` is what begin, bucket or finish found): "
        "taken, ignored (the state part of it changes nothing), or refused with a code:"
    )
    out.append("")
    out.append("| input | " + " | ".join(st.value for st in ALL) + " |")
    out.append("|---|" + "---|" * len(ALL))
    notes = []
    for name, g in GATES.items():
        cells = [
            "taken" if st in g.take else "ignored" if st in g.ignore else f"refused: {g.code.value}"
            for st in ALL
        ]
        out.append(f"| {name.value} | " + " | ".join(cells) + " |")
        if g.ignore:
            notes.append(f"- `{name.value}` ignored: {g.why}")
        if set(g.take) | set(g.ignore) != set(ALL):
            notes.append(f"- `{name.value}` refused: {g.refusal.format(state='<state>')}")
    out += ["", *notes]
    out.append("")
    out.append("| engine trigger | from | to |")
    out.append("|---|---|---|")
    for move, (sources, dest) in ENGINE_ROWS.items():
        out.append(f"| {move.value} | {', '.join(s.value for s in sources)} | {dest.value} |")
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
    "INPUTS",
    "GATES",
    "Life",
    "Trigger",
    "Gate",
    "Outcome",
    "Refused",
    "Row",
    "StateTable",
    "engine_move",
    "render",
]
