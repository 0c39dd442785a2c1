"""One engine's syncs as a state machine: the engine side's own table, like the daemon's.

`Syncs.feed(msg) -> list[Action]` takes what arrives from the daemon (a bucket, a stream's
opening, finalize, commit, abort) and what the applier thread reports back (a bucket loaded,
a finalize done, a failure), and returns what to do: a job for the applier, a message for
the daemon, a stream to stop. It does no I/O and reads no clock: the worker's main thread is
its I/O (it alone owns the socket), the applier thread runs its jobs. Every backend (torch,
sink, holding, vLLM) goes through it.

Rules, kept here and nowhere else:
- One sync at a time: the first message of a new sync_id starts it (a `Begin` job) and
  supersedes the one before (its stream stops; a restarted daemon never aborts it).
- The finalize guard: a second `finalize` for a sync_id, even of a sync long superseded, is
  refused with `failed{duplicate: true}` and the post-load step is not run again.
- A resent bucket (same sync_id, sender, seq) is acknowledged again, never re-applied; a
  bucket of a failed sync is dropped (the failure was reported); a new bucket of a sync
  whose finalize came is refused by its row of the table (`failed`, INVALID_STATE): the
  post-load step has the weights, and nothing more is copied into them.
- The engine's served version and digest are what its last finalize reported; they are
  cleared when a sync starts (the weights are about to change) or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from messages import schema
from messages.errors import ErrorCode
from messages.progress import Progress


class Phase(Enum):
    LOADING = "LOADING"  # buckets arrive (sent to this engine or published to all)
    STREAMING = "STREAMING"  # the collective stream runs on the applier
    FINALIZING = "FINALIZING"  # the post-load step was asked for (once)
    FINALIZED = "FINALIZED"  # it ran; the digest went to the daemon
    FAILED = "FAILED"  # a step failed; reported, nothing more is applied
    ABORTED = "ABORTED"  # the daemon aborted it; the engine dropped what it loaded


@dataclass(frozen=True, slots=True)
class Refuse:
    """A table row that refuses its input: the engine answers `failed` with `reason` and
    neither its phase nor its weights change."""

    reason: str


_AFTER_FINALIZE = Refuse("a bucket after finalize; refused (the post-load step ran)")

# (phase, input) -> the phase after it, or the refusal it gets. The inputs are the daemon's
# messages and the applier's reports. A "load" in a pair not in the table is dropped (a
# bucket of a failed or aborted sync: the failure was reported); any other input in a pair
# not in the table changes no phase (one the guards below answer, or about a sync that is
# over).
TABLE: dict[tuple[Phase, str], Phase | Refuse] = {
    (Phase.LOADING, "load"): Phase.LOADING,
    (Phase.LOADING, "finalize"): Phase.FINALIZING,
    (Phase.STREAMING, "load"): Phase.STREAMING,
    (Phase.STREAMING, "finalize"): Phase.FINALIZING,
    # the weights were handed to the post-load step: nothing more is copied into them
    (Phase.FINALIZING, "load"): _AFTER_FINALIZE,
    (Phase.FINALIZED, "load"): _AFTER_FINALIZE,
    (Phase.FINALIZING, "finalized"): Phase.FINALIZED,
    (Phase.FINALIZED, "commit"): Phase.FINALIZED,
    **{(p, "failed"): Phase.FAILED for p in (Phase.LOADING, Phase.STREAMING, Phase.FINALIZING)},
    **{(p, "abort"): Phase.ABORTED for p in Phase if p is not Phase.ABORTED},
}
# What a phase reached by a new sync_id's first message is.
OPENS: dict[str, Phase] = {"load": Phase.LOADING, "stream": Phase.STREAMING, "finalize": Phase.FINALIZING}


def duplicate_finalize(sync_id: str) -> schema.Failed:
    """What an engine answers a second `finalize` of `sync_id` (its post-load step ran)."""
    return schema.Failed(
        sync_id=sync_id,
        code=ErrorCode.INVALID_STATE.value,
        message="finalize already ran for this sync; refused",
        duplicate=True,
    )


def refused(msg: schema.Load, row: Refuse) -> schema.Failed:
    """What an engine answers a bucket its table refuses (nothing of it is applied)."""
    return schema.Failed(
        sync_id=msg.sync_id,
        code=ErrorCode.INVALID_STATE.value,
        message=f"bucket seq {msg.seq}: {row.reason}",
        seq=msg.seq,
        sender=msg.sender,
    )


@dataclass(frozen=True, slots=True)
class Begin:
    """The applier's job that starts a sync on the engine (`Engine.begin`)."""

    sync_id: str
    version: int


@dataclass(frozen=True, slots=True)
class LoadJob:
    """A bucket for the applier, with what `Applier.accept` started for it."""

    msg: schema.Load
    payload: Any


Job = Begin | schema.Load | schema.OpenStream | schema.Finalize | schema.Commit | schema.Served | schema.Abort


@dataclass(frozen=True, slots=True)
class Submit:
    """Give `job` to the applier (a `schema.Load` goes through `Applier.accept`)."""

    job: Job
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Send:
    msg: schema.Message


@dataclass(frozen=True, slots=True)
class Stop:
    """What of `sync_id` stops now: its collective stream (`stream`: receiving ends, or
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


class Syncs:
    def __init__(self, version: int | None = None, digest: str | None = None) -> None:
        self.current: Sync | None = None
        self.finalized: set[str] = set()  # the guard: post-load ran (or is running) for these
        self.duplicates_refused = 0
        self.version, self.digest = version, digest

    @property
    def phase(self) -> Phase | None:
        return self.current.phase if self.current is not None else None

    def _of(self, sync_id: str) -> Sync | None:
        c = self.current
        return c if c is not None and c.sync_id == sync_id else None

    def _move(self, s: Sync, trigger: str) -> None:
        """`s`'s phase after `trigger`, if the table has the pair (else unchanged)."""
        row = TABLE.get((s.phase, trigger), s.phase)
        if isinstance(row, Phase):
            s.phase = row

    def _open(self, sync_id: str, version: int, trigger: str, out: list[Action]) -> Sync:
        """`sync_id`'s record; its first message starts it, superseding the running one."""
        s = self._of(sync_id)
        if s is not None:
            return s
        if self.current is not None:
            out.append(Stop(self.current.sync_id))
        s = Sync(sync_id, version, OPENS[trigger], Progress(sync_id))
        self.current = s
        self.version, self.digest = None, None  # the weights are about to change
        out.append(Submit(Begin(sync_id, version)))
        return s

    # -- from the daemon ----------------------------------------------------------------
    def feed(self, msg: schema.Message, payload: Any = None) -> list[Action]:
        out: list[Action] = []
        if isinstance(msg, schema.Load):
            self._load(msg, payload, out)
        elif isinstance(msg, schema.OpenStream):
            if self._of(msg.sync_id) is None:  # a repeated open: the stream runs already
                self._open(msg.sync_id, msg.version, "stream", out)
                out.append(Submit(msg))
        elif isinstance(msg, schema.Finalize):
            self._finalize(msg, out)
        elif isinstance(msg, schema.Commit):
            s = self._of(msg.sync_id)
            if s is not None:
                self._move(s, "commit")
            out.append(Submit(msg))  # the applier says whether this engine labels outputs
        elif isinstance(msg, schema.Served):
            # after the sync's end (or none): the engine offers it only if it holds exactly
            # that version and digest, and the applier runs it after any begin queued before
            out.append(Submit(msg))
        elif isinstance(msg, schema.Abort):
            s = self._of(msg.sync_id)
            # a published bucket arriving late starts nothing; a stream stops receiving now
            out.append(Stop(msg.sync_id, stream=s is not None))
            if s is not None:
                self._move(s, "abort")
                self.version, self.digest = None, None  # the engine drops what it loaded
                out.append(Submit(msg))
        return out

    def _load(self, msg: schema.Load, payload: Any, out: list[Action]) -> None:
        s = self._open(msg.sync_id, msg.version, "load", out)
        key = (msg.sender, msg.seq)
        if key in s.progress.applied:  # a resend: say again that it is applied
            out.append(Send(s.progress.again(msg.sender, msg.seq)))
            return
        if key in s.queued:
            return
        row = TABLE.get((s.phase, "load"))
        if isinstance(row, Refuse):
            out.append(Send(refused(msg, row)))
            return
        if row is None:
            return
        s.queued.add(key)
        s.phase = row
        out.append(Submit(msg, payload))

    def _finalize(self, msg: schema.Finalize, out: list[Action]) -> None:
        if msg.sync_id in self.finalized:
            self.duplicates_refused += 1
            out.append(Send(duplicate_finalize(msg.sync_id)))
            return
        s = self._open(msg.sync_id, msg.version, "finalize", out)
        self.finalized.add(msg.sync_id)
        self._move(s, "finalize")
        out.append(Submit(msg))  # a failed sync's finalize only releases its shm maps

    # -- from the applier -----------------------------------------------------------------
    def result(self, msg: schema.Message) -> list[Action]:
        """What the applier reports: progress is kept (the worker reports it coalesced);
        a finalize, a failure and a label go to the daemon."""
        if isinstance(msg, schema.Loaded):
            s = self._of(msg.sync_id)
            if s is not None:
                s.progress.apply(msg.sender, msg.seq, msg.seconds)
            return []
        if isinstance(msg, schema.Failed):
            s = self._of(msg.sync_id)
            if s is not None:
                self._move(s, "failed")
            self.version, self.digest = None, None
        elif isinstance(msg, schema.Finalized):
            s = self._of(msg.sync_id)
            if s is not None:
                self._move(s, "finalized")
            self.version, self.digest = msg.version, msg.digest
        return [Send(msg)]

    # -- what the worker reports ----------------------------------------------------------
    def reporting(self) -> Sync | None:
        """The sync whose progress is reported (none once it failed)."""
        s = self.current
        return s if s is not None and s.phase is not Phase.FAILED else None

    def restarted_daemon(self) -> list[Action]:
        """The daemon lost this engine (it restarted): the running sync is over."""
        c = self.current
        return [Stop(c.sync_id, published=False)] if c is not None else []
