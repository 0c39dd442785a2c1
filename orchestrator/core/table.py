"""The daemon's state table: every allowed change of state, and nothing else.

Rules: `ROWS` is the specification, one row per (trigger, source states, destination),
each with the condition a reader needs; `ENGINE_ROWS` is the same for one engine's
lifecycle. The core's trigger modules decide which row an input takes (plain code, read
top to bottom) and move through `StateTable.move`, which asks a `transitions` machine
built from these rows whether that exact move exists: a move outside the table is our
bug (INTERNAL), raised before anything changed. Rows never overlap (no first-match
order to know). docs/ARCHITECTURE.md's table is generated from here (`render`), and a
test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transitions import EventData, Machine, MachineError

from messages.errors import ErrorCode, make_error
from orchestrator.core.states import ACTIVE, EngineState, State

S, E = State, EngineState


@dataclass(frozen=True, slots=True)
class Row:
    trigger: str
    sources: tuple[State, ...]
    dest: State
    when: str


ROWS: tuple[Row, ...] = (
    # a trainer's sync: stream the buckets, prepare, commit (finalize once per engine)
    Row(
        "begin",
        (S.IDLE, S.READY),
        S.LOADING_BUCKETS,
        "a new sync_id, a version newer than the one served, at least `min_engines` live "
        "engines; every live engine takes part",
    ),
    Row(
        "finish",
        (S.LOADING_BUCKETS,),
        S.FINALIZING,
        "every sender finished; every announced bucket is applied by every participant "
        "(prepared); no engine tensor left unsent unless partial: finalize is sent once "
        "to each participant",
    ),
    Row(
        "finish",
        (S.LOADING_BUCKETS,),
        S.IDLE,
        "collective stream, every participant prepared: one prepared something else than "
        "the trainer finished with (bucket count, chain, digest); nothing finalized, dirty",
    ),
    Row(
        "prepared",
        (S.LOADING_BUCKETS,),
        S.FINALIZING,
        "collective stream, after the trainer's finish: the last participant prepared "
        "exactly what the trainer finished with (bucket count, chain over the bucket "
        "checksums, digest): finalize is sent once to each participant (the commit)",
    ),
    Row(
        "prepared",
        (S.LOADING_BUCKETS,),
        S.IDLE,
        "collective stream: a participant prepared something else than the trainer "
        "finished with, or than the others prepared; nothing finalized, dirty",
    ),
    Row(
        "finalized",
        (S.FINALIZING,),
        S.READY,
        "the last participant reported the expected version, digest and canary tokens, "
        "and no participant labels its outputs",
    ),
    Row(
        "committed",
        (S.FINALIZING,),
        S.READY,
        "every participant finalized (the version is committed fleet-wide) and the last "
        "labelling engine (vLLM: its weight version) reported the version as its label",
    ),
    Row(
        "committed",
        (S.FINALIZING,),
        S.IDLE,
        "a labelling engine labelled another version: dirty",
    ),
    Row(
        "finalized",
        (S.FINALIZING,),
        S.IDLE,
        "a participant reported another version, digest or canary: dirty",
    ),
    # a sync given up
    Row(
        "abort",
        (S.LOADING_BUCKETS,),
        S.READY,
        "the trainer or an operator aborted a sync that touched no engine of a READY daemon",
    ),
    Row(
        "abort",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "the trainer or an operator aborted a sync that touched an engine: dirty",
    ),
    Row(
        "failed",
        (S.LOADING_BUCKETS,),
        S.READY,
        "a participant failed before any engine was touched (READY daemon)",
    ),
    Row(
        "failed",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "a participant failed (checksum, shape, its load or post-load step): dirty",
    ),
    Row(
        "register",
        (S.LOADING_BUCKETS,),
        S.READY,
        "a participant registered again (its process restarted) before anything was touched",
    ),
    Row(
        "register",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "a participant registered again (its process restarted and lost its buckets): dirty",
    ),
    Row(
        "internal",
        (S.LOADING_BUCKETS,),
        S.READY,
        "a bug surfaced while handling an input, before any engine was touched",
    ),
    Row(
        "internal",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "a bug surfaced while handling an input: the running sync fails INTERNAL, dirty",
    ),
    Row(
        "shutdown",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "the daemon stops mid-sync: dirty (the journal says so at the next start)",
    ),
    # the clock
    Row(
        "tick",
        (S.LOADING_BUCKETS,),
        S.READY,
        "a deadline passed or a participant was lost before any engine was touched",
    ),
    Row(
        "tick",
        (S.LOADING_BUCKETS, S.FINALIZING),
        S.IDLE,
        "a participant lost (disconnected, or silent past --engine-timeout), a bucket not "
        "applied in --bucket-timeout, the trainer gone past its grace or silent past "
        "--sync-timeout, a participant not prepared --bucket-timeout after the trainer's "
        "finish (collective stream), finalize not reported in --finalize-timeout: dirty",
    ),
    Row(
        "tick",
        (S.IDLE,),
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
TRAINER_TRIGGERS = ("begin", "bucket", "finish", "prepared", "finalized", "committed", "failed", "abort")


def _goes_to(dest: State) -> Any:
    def cond(e: EventData) -> bool:
        return bool(e.kwargs.get("dest") is dest)

    return cond


class _Phase:
    """The machine's model: the daemon's state, nothing else."""

    state: State


class StateTable:
    """A `transitions` machine over ROWS that the core moves through. Each row's only
    condition is that the core asked for its destination, so a move is exactly a row."""

    def __init__(self, initial: State) -> None:
        self._phase = _Phase()
        rows = [
            {"trigger": r.trigger, "source": list(r.sources), "dest": r.dest, "conditions": _goes_to(r.dest)}
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

    def move(self, trigger: str, dest: State) -> None:
        """Take the row (trigger, current state, dest); INTERNAL if there is none."""
        src = self._phase.state
        try:
            taken = self._machine.events[trigger].trigger(self._phase, dest=dest)
        except (MachineError, KeyError):
            taken = False
        if not taken:
            raise make_error(
                ErrorCode.INTERNAL,
                f"no row of the state table moves {trigger} from {src.value} to {dest.value}",
                state=src.value,
            )

    def allows(self, trigger: str, state: State | None = None) -> bool:
        return any(trigger == r.trigger and (state or self.state) in r.sources for r in ROWS)


def engine_move(state: EngineState, trigger: str) -> EngineState:
    sources, dest = ENGINE_ROWS[trigger]
    if state not in sources:
        raise make_error(ErrorCode.INTERNAL, f"engine lifecycle: {trigger} is not allowed from {state.value}")
    return dest


BEGIN = "<!-- state table: generated from orchestrator/core/table.py; do not edit -->"
END = "<!-- end of state table -->"


def render() -> str:
    """The Markdown tables of docs/ARCHITECTURE.md (generated; a test compares)."""
    out = [BEGIN, "", "| trigger | from | to | when |", "|---|---|---|---|"]
    for r in ROWS:
        src = ", ".join(s.value for s in r.sources)
        out.append(f"| {r.trigger} | {src} | {r.dest.value} | {r.when} |")
    quiet = [t for t in TRIGGERS if not any(r.trigger == t for r in ROWS)]
    out.append("")
    out.append(
        "Inputs that never change the daemon's state: "
        + ", ".join(f"`{t}`" for t in quiet)
        + ". Any other input in a state without its row is refused with a typed error "
        "and changes nothing."
    )
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
    "TRAINER_TRIGGERS",
    "Row",
    "StateTable",
    "engine_move",
    "render",
]
