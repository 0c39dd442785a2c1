"""One engine's syncs as a state machine: the engine side's own table, like the daemon's.

`Session.feed(msg) -> list[Action]` takes what arrives from the daemon (a bucket, a stream's
opening, finalize, commit, abort) and `Session.result(msg)` what the applier thread reports
back (a bucket loaded, a stream prepared, a finalize done, a failure); both return what to
do: a job for the applier, a message for the daemon, a stream to stop. It does no I/O and
reads no clock: the worker's main thread is its I/O (it alone owns the socket), the applier
thread runs its jobs. Every backend (torch, sink, holding, vLLM) and the simulated engines
of `bench.simengine` go through it.

Theory of operation (h11's way): an input is named once (`Input`, classified from the
message by `input_of`); the phase it meets is that of the sync it names (`NEW` when this
engine holds no record of it, `PAST` when it was superseded after its finalize came);
`TABLE[(phase, input)]` is a `Go` (the phase after it and the effects, run in order), an
`Ignore` (taken, nothing done, with its reason), or missing, and a missing pair is the
refusal: `failed` with INVALID_STATE (`duplicate: true` for a second `finalize`), and
nothing of the engine changes. The lookup is the only executor and there are no phase
checks beside it. `transitions` is not used here: its machine would be a second executor
of the same rows, and a row here carries effects a `Machine` cannot order or type.

Rules, kept here and nowhere else:
- One sync at a time: the first message of a new sync_id starts it (`OPEN`: a `Begin` job)
  and supersedes the one before (its stream stops; a restarted daemon never aborts it).
- The finalize guard: the post-load step runs at most once per sync_id, whatever the
  order of inputs; a second `finalize`, even of a sync long superseded, is refused with
  `failed{duplicate: true}`; a `finalize` of an aborted sync is refused.
- A resent bucket (same sync_id, source, seq) is acknowledged again, never re-applied; a
  bucket of a failed or aborted sync is dropped (the failure was reported); a new bucket
  or stream of a sync whose finalize came is refused: the post-load step has the weights.
- The engine's served version and digest are what its sync's finalize reported; they are
  cleared when a sync starts (the weights are about to change), fails or is aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from messages import schema
from messages.errors import ErrorCode, WeightSyncError
from messages.progress import Progress

if TYPE_CHECKING:
    from messages.codec import Frame


class Phase(Enum):
    NEW = "NEW"  # no record here: a sync_id never seen, or superseded before its finalize
    PAST = "PAST"  # superseded after its finalize came (only the guard remembers it)
    LOADING = "LOADING"  # buckets arrive (sent to this engine or published to all)
    STREAMING = "STREAMING"  # a group's stream runs on the applier
    FINALIZING = "FINALIZING"  # the post-load step was asked for (once)
    FINALIZED = "FINALIZED"  # it ran; the digest went to the daemon
    FAILED = "FAILED"  # a step failed before its finalize came; reported
    SPENT = "SPENT"  # its finalize came, and it failed or was aborted: it serves nothing
    ABORTED = "ABORTED"  # the daemon aborted it before its finalize; what it loaded is dropped


class Input(Enum):
    """Every input of the table, named once; `input_of` says which one a message is."""

    LOAD = "load"  # a bucket not seen before in this sync
    RESENT = "resent"  # a bucket already applied in this sync
    QUEUED = "queued"  # a bucket already queued for the applier in this sync
    STREAM = "stream"
    FINALIZE = "finalize"
    COMMIT = "commit"
    SERVED = "served"
    ABORT = "abort"
    # the applier's reports
    LOADED = "loaded"
    PREPARED = "prepared"
    FINALIZED = "finalized"
    COMMITTED = "committed"
    FAILED = "failed"


FROM_DAEMON: dict[type[schema.Message], Input] = {
    schema.Load: Input.LOAD,
    schema.OpenStream: Input.STREAM,
    schema.Finalize: Input.FINALIZE,
    schema.Commit: Input.COMMIT,
    schema.Served: Input.SERVED,
    schema.Abort: Input.ABORT,
}
FROM_APPLIER: dict[type[schema.Message], Input] = {
    schema.Loaded: Input.LOADED,
    schema.Prepared: Input.PREPARED,
    schema.Finalized: Input.FINALIZED,
    schema.Committed: Input.COMMITTED,
    schema.Failed: Input.FAILED,
}


class Do(Enum):
    """An effect of a row; `Session._effect` carries each out."""

    OPEN = "open"  # a record for the sync: supersede the running one, `Begin` it
    APPLY = "apply"  # queue the bucket for the applier
    ACK = "ack"  # say again that the bucket is applied
    RUN = "run"  # hand the message to the applier as it is
    GUARD = "guard"  # remember that finalize came (the guard), then hand it to the applier
    ABORT = "abort"  # stop its stream and published buckets, forget the version, applier
    UNPUBLISH = "unpublish"  # stop only its published buckets (no record here)
    PROGRESS = "progress"  # keep the applied bucket (the worker reports it coalesced)
    REPORT = "report"  # send the report to the daemon
    SERVE = "serve"  # the engine holds the version finalize reported; send the report
    CLEAR = "clear"  # the engine holds no version (a failure); send the report


@dataclass(frozen=True, slots=True)
class Go:
    """The input is taken: its effects run in order, then the phase is `to` (None: the
    phase stays; there may be no record)."""

    to: Phase | None
    do: tuple[Do, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Ignore:
    """The input is taken here and does nothing, for `why`."""

    why: str


Row = Go | Ignore


@dataclass(frozen=True, slots=True)
class Refusal:
    """A (phase, input) pair with no row: the engine answers `failed` and nothing changes."""

    phase: Phase
    input: Input
    code: ErrorCode = ErrorCode.INVALID_STATE

    @property
    def duplicate(self) -> bool:
        return self.input is Input.FINALIZE and self.phase in FINALIZE_CAME

    @property
    def reason(self) -> str:
        return f"{self.input.value} refused in {self.phase.value}: {REFUSED_BECAUSE[self.phase]}"

    def failed(self, msg: schema.Message, sync_id: str) -> schema.Failed:
        seq, source = (msg.seq, msg.source) if isinstance(msg, schema.Load) else (None, None)
        where = f"bucket seq {seq}: " if seq is not None else ""
        return schema.Failed(
            sync_id=sync_id,
            code=self.code.value,
            message=where + self.reason,
            seq=seq,
            source=source,
            duplicate=self.duplicate,
        )


P, In = Phase, Input
FINALIZE_CAME = (P.FINALIZING, P.FINALIZED, P.SPENT, P.PAST)
RECORDED = (P.LOADING, P.STREAMING, P.FINALIZING, P.FINALIZED, P.FAILED, P.SPENT, P.ABORTED)
REFUSED_BECAUSE: dict[Phase, str] = {
    P.NEW: "no record of this sync here",
    P.PAST: "after finalize (the post-load step ran)",
    P.LOADING: "its buckets are loading",
    P.STREAMING: "its stream runs",
    P.FINALIZING: "after finalize (the post-load step has the weights)",
    P.FINALIZED: "after finalize (the post-load step ran)",
    P.FAILED: "it failed",
    P.SPENT: "after finalize (it failed or was aborted)",
    P.ABORTED: "it was aborted",
}


def _every(phases: tuple[Phase, ...], inp: Input, row: Row) -> dict[tuple[Phase, Input], Row]:
    return {(p, inp): row for p in phases}


_RUN = Go(None, (Do.RUN,), "the applier decides (it labels, or offers the version, if it can)")
_REPORT = Go(None, (Do.REPORT,), "reported to the daemon; the engine's version is not touched")
_SUPERSEDED = "no record (superseded, or never begun): nothing of it is reported"

# (phase, input) -> row. A pair that is not here is the refusal (`Refusal`).
TABLE: dict[tuple[Phase, Input], Row] = {
    # -- from the daemon ------------------------------------------------------------------
    (P.NEW, In.LOAD): Go(P.LOADING, (Do.OPEN, Do.APPLY), "the first bucket begins the sync"),
    (P.LOADING, In.LOAD): Go(None, (Do.APPLY,), "applied in order"),
    (P.STREAMING, In.LOAD): Go(None, (Do.APPLY,), "an announced bucket beside the stream"),
    (P.FAILED, In.LOAD): Ignore("dropped: the failure was reported"),
    (P.SPENT, In.LOAD): Ignore("dropped: the failure was reported"),
    (P.ABORTED, In.LOAD): Ignore("dropped: the sync was aborted"),
    # (FINALIZING | FINALIZED | PAST, load): refused, nothing is copied into the weights
    **_every(RECORDED, In.RESENT, Go(None, (Do.ACK,), "acknowledged again, never re-applied")),
    **_every(RECORDED, In.QUEUED, Ignore("queued already: applied once, acknowledged then")),
    (P.NEW, In.STREAM): Go(P.STREAMING, (Do.OPEN, Do.RUN), "the stream begins the sync"),
    **_every(RECORDED, In.STREAM, Ignore("a repeated open: the sync runs already")),
    # (PAST, stream): refused
    (P.NEW, In.FINALIZE): Go(P.FINALIZING, (Do.OPEN, Do.GUARD), "finalize begins the sync"),
    (P.LOADING, In.FINALIZE): Go(P.FINALIZING, (Do.GUARD,), "the post-load step runs, once"),
    (P.STREAMING, In.FINALIZE): Go(P.FINALIZING, (Do.GUARD,), "the post-load step runs, once"),
    (P.FAILED, In.FINALIZE): Go(
        P.SPENT, (Do.GUARD,), "the applier only releases its maps of the trainer's slots"
    ),
    # (FINALIZING | FINALIZED | SPENT | PAST, finalize): refused, duplicate; (ABORTED, finalize): refused
    **_every(tuple(Phase), In.COMMIT, _RUN),
    **_every(tuple(Phase), In.SERVED, _RUN),
    (P.NEW, In.ABORT): Go(None, (Do.UNPUBLISH,), "its late published buckets start nothing"),
    (P.PAST, In.ABORT): Go(None, (Do.UNPUBLISH,), "its late published buckets start nothing"),
    **_every(
        (P.LOADING, P.STREAMING, P.FAILED, P.ABORTED),
        In.ABORT,
        Go(P.ABORTED, (Do.ABORT,), "the engine drops what it loaded"),
    ),
    **_every(
        (P.FINALIZING, P.FINALIZED, P.SPENT),
        In.ABORT,
        Go(P.SPENT, (Do.ABORT,), "the engine drops what it loaded; the guard still holds"),
    ),
    # -- from the applier -----------------------------------------------------------------
    **_every(RECORDED, In.LOADED, Go(None, (Do.PROGRESS,), "kept; reported coalesced")),
    (P.NEW, In.LOADED): Ignore(_SUPERSEDED),
    (P.PAST, In.LOADED): Ignore(_SUPERSEDED),
    **_every(tuple(Phase), In.PREPARED, _REPORT),
    **_every(tuple(Phase), In.COMMITTED, _REPORT),
    **_every(tuple(p for p in Phase if p is not P.FINALIZING), In.FINALIZED, _REPORT),
    (P.FINALIZING, In.FINALIZED): Go(P.FINALIZED, (Do.SERVE,), "the engine holds the version"),
    **_every(
        (P.LOADING, P.STREAMING, P.FAILED), In.FAILED, Go(P.FAILED, (Do.CLEAR,), "nothing more is applied")
    ),
    **_every(
        (P.FINALIZING, P.FINALIZED, P.SPENT),
        In.FAILED,
        Go(P.SPENT, (Do.CLEAR,), "the engine serves nothing; the guard still holds"),
    ),
    **_every((P.ABORTED, P.NEW, P.PAST), In.FAILED, Go(None, (Do.CLEAR,), "the engine serves nothing")),
}


def decide(phase: Phase, inp: Input) -> Row | Refusal:
    """The table's answer for `inp` met in `phase`: a row, or the refusal."""
    row = TABLE.get((phase, inp))
    return row if row is not None else Refusal(phase, inp)


@dataclass(frozen=True, slots=True)
class Begin:
    """The applier's job that starts a sync on the engine (`Engine.begin`)."""

    sync_id: str
    version: int


Job = Begin | schema.Load | schema.OpenStream | schema.Finalize | schema.Commit | schema.Served | schema.Abort


@dataclass(frozen=True, slots=True)
class Submit:
    """Give `job` to the applier (a `schema.Load` goes through `Applier.accept`)."""

    job: Job
    payload: Frame | None = None  # a bucket's payload frame (a `schema.Load` sent as a frame)


@dataclass(frozen=True, slots=True)
class Send:
    msg: schema.Message


@dataclass(frozen=True, slots=True)
class Stop:
    """What of `sync_id` stops now: its group stream (`stream`: receiving ends, or
    never starts), and its published buckets (`published`: the fan-out drops them)."""

    sync_id: str
    stream: bool = True
    published: bool = True


Action = Submit | Send | Stop


@dataclass(slots=True)
class Sync:
    """One sync as this engine knows it."""

    sync_id: str
    version: int
    phase: Phase
    progress: Progress
    queued: set[tuple[int, int]] = field(default_factory=set)


class Session:
    def __init__(self, version: int | None = None, digest: str | None = None) -> None:
        self.current: Sync | None = None
        self.finalized: set[str] = set()  # the guard: finalize came for these
        self.duplicates_refused = 0
        self.version, self.digest = version, digest

    @property
    def phase(self) -> Phase | None:
        return self.current.phase if self.current is not None else None

    def _of(self, sync_id: str) -> Sync | None:
        c = self.current
        return c if c is not None and c.sync_id == sync_id else None

    def phase_of(self, sync_id: str) -> Phase:
        """The phase an input naming `sync_id` meets."""
        s = self._of(sync_id)
        if s is not None:
            return s.phase
        return P.PAST if sync_id in self.finalized else P.NEW

    def input_of(self, msg: schema.Message) -> Input:
        """Which input `msg` is (a bucket's by what this sync has done with it already)."""
        inp = FROM_DAEMON.get(type(msg)) or FROM_APPLIER.get(type(msg))
        if inp is None:  # the worker feeds only these messages: our bug
            raise WeightSyncError(f"{type(msg).__name__} is no input of the engine's table")
        if isinstance(msg, schema.Load):
            s = self._of(msg.sync_id)
            key = (msg.source, msg.seq)
            if s is not None and key in s.progress.applied:
                return In.RESENT
            if s is not None and key in s.queued:
                return In.QUEUED
        return inp

    def feed(self, msg: schema.Message, payload: Frame | None = None) -> list[Action]:
        """A message from the daemon (a `schema.Load`'s first frame is `payload`)."""
        return self._take(msg, payload)

    def result(self, msg: schema.Message) -> list[Action]:
        """What the applier reports: progress is kept (the worker reports it coalesced);
        a prepare, a finalize, a label and a failure go to the daemon."""
        return self._take(msg, None)

    def _take(self, msg: schema.Message, payload: Frame | None) -> list[Action]:
        sync_id: str = getattr(msg, "sync_id", "")
        inp = self.input_of(msg)
        row = decide(self.phase_of(sync_id), inp)
        if isinstance(row, Refusal):  # nothing changes but the count of duplicates
            if row.duplicate:
                self.duplicates_refused += 1
            return [Send(row.failed(msg, sync_id))]
        if isinstance(row, Ignore):
            return []
        out: list[Action] = []
        for do in row.do:
            self._effect(do, msg, sync_id, payload, out)
        s = self._of(sync_id)
        if row.to is not None and s is not None:
            s.phase = row.to
        return out

    def _effect(
        self, do: Do, msg: schema.Message, sync_id: str, payload: Frame | None, out: list[Action]
    ) -> None:
        s = self._of(sync_id)
        if do is Do.OPEN:
            if self.current is not None:
                out.append(Stop(self.current.sync_id))
            version: int = getattr(msg, "version", 0)
            self.current = Sync(sync_id, version, P.NEW, Progress(sync_id))
            self.version, self.digest = None, None  # the weights are about to change
            out.append(Submit(Begin(sync_id, version)))
        elif do is Do.APPLY and isinstance(msg, schema.Load) and s is not None:
            s.queued.add((msg.source, msg.seq))
            out.append(Submit(msg, payload))
        elif do is Do.ACK and isinstance(msg, schema.Load) and s is not None:
            out.append(Send(s.progress.again(msg.source, msg.seq)))
        elif do is Do.GUARD and isinstance(msg, schema.Finalize):
            self.finalized.add(sync_id)
            out.append(Submit(msg))
        elif do is Do.RUN and isinstance(msg, (schema.OpenStream, schema.Commit, schema.Served)):
            out.append(Submit(msg))
        elif do is Do.ABORT and isinstance(msg, schema.Abort):
            out.append(Stop(sync_id))
            self.version, self.digest = None, None  # the engine drops what it loaded
            out.append(Submit(msg))
        elif do is Do.UNPUBLISH:
            out.append(Stop(sync_id, stream=False))
        elif do is Do.PROGRESS and isinstance(msg, schema.Loaded) and s is not None:
            s.progress.apply(msg.source, msg.seq, msg.seconds)
        elif do is Do.REPORT:
            out.append(Send(msg))
        elif do is Do.SERVE and isinstance(msg, schema.Finalized):
            self.version, self.digest = msg.version, msg.digest
            out.append(Send(msg))
        elif do is Do.CLEAR:
            self.version, self.digest = None, None
            out.append(Send(msg))
        else:  # a row whose effect does not fit its input: our bug, caught by the table test
            raise TypeError(f"effect {do.value} cannot take {type(msg).__name__}")

    # -- what the worker reports ----------------------------------------------------------
    def reporting(self) -> Sync | None:
        """The sync whose progress is reported (none once it failed)."""
        s = self.current
        return s if s is not None and s.phase not in (P.FAILED, P.SPENT) else None

    def restarted_daemon(self) -> list[Action]:
        """The daemon lost this engine (it restarted): the running sync is over."""
        c = self.current
        return [Stop(c.sync_id, published=False)] if c is not None else []


def render() -> str:
    """docs/ARCHITECTURE.md's engine table: for each input, the phases that answer it alike
    (every phase appears once per input: a row, ignored, or refused)."""
    lines = ["| input | in phase | to | does | why |", "|---|---|---|---|---|"]
    for inp in Input:
        answers: dict[tuple[str, str, str], list[str]] = {}
        for phase in Phase:
            row = decide(phase, inp)
            if isinstance(row, Go):
                to = row.to.value if row.to is not None else "(stays)"
                cell = (to, ", ".join(d.value for d in row.do), row.why)
            elif isinstance(row, Ignore):
                cell = ("(stays)", "ignored", row.why)
            else:
                dup = ", duplicate" if row.duplicate else ""
                cell = ("(stays)", f"refused: {row.code.value}{dup}", REFUSED_BECAUSE[phase])
            answers.setdefault(cell, []).append(phase.value)
        for (to, does, why), phases in answers.items():
            lines.append(f"| {inp.value} | {', '.join(phases)} | {to} | {does} | {why} |")
    return "\n".join(lines)
