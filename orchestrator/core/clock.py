"""The clock and the daemon's own observations: deadlines, lost engines, recovery (a
rollback of every engine, a catch-up of one), a trainer's closed connection, a bug, a
shutdown, the spool's contents.

Theory of operation: `deadlines(m)` lists, from the model's facts, every time-driven
thing that can fall due (an engine silent past `engine_timeout`, the running sync's
bucket, source, trainer and finalize deadlines, a rollback or a catch-up to start or
end, a LOST record to forget), each with the first instant at which it is due
(`Deadline.at`). `tick` reads that one list to find what is due now and acts on it: the
lost engines first, then the running sync's first overdue deadline (a lost participant
before any), failing the sync with it; with no sync running, a dirty daemon whose spool
holds the version it last served replays that version to every live engine as a
rollback sync (its own sync_id; the service feeds it like a trainer would), and
catch-ups that stopped making progress end. `next_wake` reads the same list and returns
its earliest `at`: a tick before it finds nothing due, a tick at it acts, so the daemon
sleeps until then or the next input.

Rules: as in `sync`: find the facts first, then act. A deadline is stated once, here in
`deadlines`; a strict rule ("past N seconds") is due at the next float after its bound
(`math.nextafter`), so `now >= at` is the only comparison, in `tick` and `next_wake` alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from messages.errors import ErrorCode, WeightSyncError
from orchestrator.core.commands import EngineForgotten, Journal, StartRollback, SyncOpened
from orchestrator.core.events import InternalError, Shutdown, SpoolChanged, Tick, TrainerGone
from orchestrator.core.model import Model
from orchestrator.core.records import SyncRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Outcome, Trigger

S, E = State, EngineState


class Due(str, Enum):
    """What falls due, in the order `tick` acts on it."""

    ENGINE_SILENT = "engine_silent"  # key: engine id; LOST once past engine_timeout
    PEER_FAULT = "peer_fault"  # engines saw a group member fail; no participant lost since
    BUCKET = "bucket"  # key: (source, seq) of a bucket not applied by every participant
    TRAINER_GONE = "trainer_gone"  # the trainer's connection closed; trainer_grace ran out
    NEVER_BEGAN = "never_began"  # a sharded push: a source never began within sync_timeout
    SOURCE_QUIET = "source_quiet"  # key: a source that began, silent past sync_timeout
    NOT_PREPARED = "not_prepared"  # a group's stream: prepares after the trainer's finish
    TRAINER_SILENT = "trainer_silent"  # one source: no trainer message for sync_timeout
    FINALIZE = "finalize"  # finalize (or the commit) not reported within finalize_timeout
    ROLLBACK = "rollback"  # a dirty IDLE daemon replays the served version: due at once
    CATCHUP = "catchup"  # key: engine id; its catch-up made no progress (or it was lost)
    FORGET = "forget"  # key: engine id; a LOST record older than lost_expiry


@dataclass(frozen=True, slots=True)
class Deadline:
    """`what` (about `key`) is due at any time >= `at`."""

    at: float
    what: Due
    key: str | int | tuple[int, int] | None = None  # an engine id, a source, a bucket


def _ids(due: list[Deadline], what: Due) -> list[str]:
    """The engine ids of the `due` deadlines of kind `what`, in list order."""
    return [d.key for d in due if d.what == what and isinstance(d.key, str)]


def _past(bound: float) -> float:
    """The first instant strictly past `bound` (a "more than N seconds" rule)."""
    return math.nextafter(bound, math.inf)


def deadlines(m: Model) -> list[Deadline]:
    """Every deadline the model's facts set, read at `m.now` (a thing due at once has
    `at == m.now`). The only place a deadline is stated."""
    lim, s = m.limits, m.sync
    out: list[Deadline] = []
    for x in m.engines.values():
        if x.state != E.LOST:
            out.append(Deadline(_past(x.last_seen + lim.engine_timeout), Due.ENGINE_SILENT, x.engine_id))
        elif (
            x.lost_at is not None
            and (s is None or x.engine_id not in s.participants)
            and x.engine_id not in m.catchups
        ):
            # never one the running sync or a catch-up still names
            out.append(Deadline(x.lost_at + lim.lost_expiry, Due.FORGET, x.engine_id))
    if s is not None:
        out.extend(_sync_deadlines(m, s))
        return out
    if m.state == S.IDLE and _rollback_due(m, []):
        out.append(Deadline(m.now, Due.ROLLBACK))
    for eid, c in m.catchups.items():
        if m.engines[eid].state == E.LOST:
            out.append(Deadline(m.now, Due.CATCHUP, eid))
        else:
            limit = lim.finalize_timeout if c.finalize_sent else lim.bucket_timeout
            out.append(Deadline(_past(c.last_progress + limit), Due.CATCHUP, eid))
    return out


def _sync_deadlines(m: Model, s: SyncRecord) -> list[Deadline]:
    """The running sync's deadlines, in its state."""
    lim = m.limits
    if s.peer_faults:  # whatever the state: the reports wait for a culprit, then name themselves
        first = min(t for t, _ in s.peer_faults.values())
        peer = [Deadline(_past(first + lim.engine_grace + lim.peer_fault_slack), Due.PEER_FAULT)]
        return peer + _state_deadlines(m, s)
    return _state_deadlines(m, s)


def _state_deadlines(m: Model, s: SyncRecord) -> list[Deadline]:
    lim = m.limits
    if m.state == S.FINALIZING:
        if s.finalize_started is None:
            return []
        return [Deadline(_past(s.finalize_started + lim.finalize_timeout), Due.FINALIZE)]
    if m.state != S.LOADING_BUCKETS:
        return []
    out = [
        Deadline(_past(b.forwarded_at + lim.bucket_timeout), Due.BUCKET, k)
        for k, b in s.buckets.items()
        if not b.done
    ]
    if s.trainer_lost_at is not None:
        out.append(Deadline(s.trainer_lost_at + lim.trainer_grace, Due.TRAINER_GONE))
    if s.sources > 1:
        if any(k not in s.begun for k in range(s.sources)):
            out.append(Deadline(_past(s.started_at + lim.sync_timeout), Due.NEVER_BEGAN))
        out.extend(
            Deadline(_past(t + lim.sync_timeout), Due.SOURCE_QUIET, k)
            for k, t in s.seen.items()
            if k not in s.finished
        )
    if s.stream and s.finished_at is not None:
        out.append(Deadline(_past(s.finished_at + lim.bucket_timeout), Due.NOT_PREPARED))
    # On a group's stream the trainer says nothing to the daemon until its finish:
    # a stalled stream is bounded by the group's deadline in every engine instead.
    if s.sources == 1 and not (s.stream and s.finished_at is None):
        out.append(Deadline(_past(s.last_activity + lim.sync_timeout), Due.TRAINER_SILENT))
    return out


def tick(m: Model, event: Tick) -> None:
    due = [d for d in deadlines(m) if m.now >= d.at]
    s = m.sync
    lost = _ids(due, Due.ENGINE_SILENT)
    overdue = _overdue(m, s, lost, due) if s is not None else None
    rollback = any(d.what == Due.ROLLBACK for d in due) and _rollback_due(m, lost)
    for eid in lost:
        m.lose(eid, _lost_cause(m, eid))
    _forget_lost(m, _ids(due, Due.FORGET))
    if overdue is not None:
        m.close_failed(Trigger.TICK, overdue)
    elif rollback:
        _open_rollback(m)
    elif s is None:
        _expire_catchups(m, _ids(due, Due.CATCHUP))


def next_wake(m: Model) -> float | None:
    """The first instant at which a tick changes something (None: no deadline runs): the
    earliest `at` of `deadlines(m)`, the same list `tick` judges, so a tick before it
    finds nothing due and one at it acts; `m.now` when something is due already (a
    rollback to open, a lost engine's catch-up to end)."""
    return min((d.at for d in deadlines(m)), default=None)


def _forget_lost(m: Model, old: list[str]) -> None:
    """LOST records older than `lost_expiry` go (engines that never came back: the fleet's
    record does not grow with every id that ever registered)."""
    for eid in old:
        del m.engines[eid]
        m.outbox.append(EngineForgotten(eid))
    if old:
        m.epoch.value += 1  # the fleet changed: live sets are made again


def _lost_cause(m: Model, eid: str) -> str:
    x = m.engines[eid]
    if x.goodbye:
        return "it stopped (it said goodbye)"
    if x.closed:
        return f"its connection closed (--engine-grace {m.limits.engine_grace}s)"
    return f"no heartbeat for {m.now - x.last_seen:.1f}s (--engine-timeout {m.limits.engine_timeout}s)"


def _overdue(m: Model, s: SyncRecord, lost: list[str], due: list[Deadline]) -> WeightSyncError | None:
    """Why the running sync must fail now (the first of its `due` deadlines, a lost
    participant before any), or None."""
    lim, now = m.limits, m.now
    gone = [x for x in lost if x in s.participants]
    if gone:  # whatever the state: a participant is gone
        why = [f"{x}: {_lost_cause(m, x)}" for x in gone]
        return m.error(ErrorCode.ENGINE_FAILED, f"engine(s) lost: {'; '.join(why)}", engine_ids=gone)
    what = {d.what for d in due}
    if Due.PEER_FAULT in what:
        saw = sorted(s.peer_faults)
        first = min(s.peer_faults.values())[1]
        return m.error(
            ErrorCode.ENGINE_FAILED,
            f"engine(s) {saw} lost a member of their group mid-broadcast and no participant "
            f"was counted lost within {lim.engine_grace + lim.peer_fault_slack}s "
            f"(--engine-grace + {lim.peer_fault_slack}s): {first}",
            engine_ids=saw,
        )
    late = [d.key for d in due if d.what == Due.BUCKET and isinstance(d.key, tuple)]
    if late:  # the first in the sync's order of buckets
        (source, seq), rec = late[0], s.buckets[late[0]]
        slow = sorted(
            x for x in s.participants if s.through.get((x, source), -1) < seq and x not in rec.acked_by
        )
        return m.error(
            ErrorCode.TIMEOUT,
            f"bucket seq {seq} not applied within {lim.bucket_timeout}s by {slow}",
            engine_ids=slow,
        )
    gone_at = s.trainer_lost_at
    if Due.TRAINER_GONE in what and gone_at is not None:
        if s.sources == 1:
            return m.error(
                ErrorCode.ABORTED,
                f"the trainer's connection closed "
                f"{now - gone_at:.1f}s ago mid-sync (it exited or was "
                f"killed); sync abandoned",
                trainer_lost=True,
            )
        dead = sorted(k for k, t in s.lost.items() if now >= t + lim.trainer_grace)
        return m.error(
            ErrorCode.ABORTED,
            f"source(s) {dead} of {s.sources}: connection closed {now - gone_at:.1f}s ago "
            f"mid-sync (exited or killed); the sync is abandoned for every source",
            trainer_lost=True,
            sources=dead,
        )
    if Due.NEVER_BEGAN in what:
        never = [k for k in range(s.sources) if k not in s.begun]
        return m.error(
            ErrorCode.TIMEOUT,
            f"source(s) {never[:16]}{' ...' if len(never) > 16 else ''} of {s.sources} never began "
            f"within {lim.sync_timeout}s (--sync-timeout); the sync is abandoned for every source",
            sources=never[:64],
        )
    quiet = sorted(d.key for d in due if d.what == Due.SOURCE_QUIET and isinstance(d.key, int))
    if quiet:
        return m.error(
            ErrorCode.TIMEOUT,
            f"no message from source(s) {quiet[:16]} for {lim.sync_timeout}s (--sync-timeout); "
            f"the sync is abandoned for every source",
            sources=quiet[:64],
        )
    if Due.NOT_PREPARED in what:
        slow = sorted(set(s.participants) - set(s.prepared))
        return m.error(
            ErrorCode.TIMEOUT,
            f"engine(s) {slow} not prepared within {lim.bucket_timeout}s of the trainer's "
            f"finish; nothing was finalized",
            engine_ids=slow,
        )
    if Due.TRAINER_SILENT in what:
        return m.error(ErrorCode.TIMEOUT, f"no trainer message for {lim.sync_timeout}s")
    if Due.FINALIZE in what:
        slow = sorted(set(s.participants) - set(s.finalized))
        if slow or not s.commit_sent:
            return m.error(
                ErrorCode.TIMEOUT,
                f"finalize not reported within {lim.finalize_timeout}s by {slow}",
                engine_ids=slow,
            )
        # every participant finalized: the commit phase waits for the labelling engines
        unlabelled = sorted(x for x in s.participants if m.engines[x].labels and x not in s.committed)
        return m.error(
            ErrorCode.TIMEOUT,
            f"every engine finalized version {s.version}, but the commit (its label) was not "
            f"reported within {lim.finalize_timeout}s (--finalize-timeout) by {unlabelled}; "
            f"version {s.version} was not made the served version",
            engine_ids=unlabelled,
            phase="commit",
        )
    return None


def _rollback_due(m: Model, lost: list[str]) -> bool:
    """Survivors are rolled back whatever `min_engines` says: it gates new syncs, not
    recovery (an engine that comes back later catches up from the spool)."""
    live = [x for x in m.engines.values() if x.state != E.LOST and x.engine_id not in lost]
    return m.want_rollback and m.dirty and m.can_roll_back() and len(live) >= 1


def _open_rollback(m: Model) -> None:
    sp = m.spooled
    if sp is None or m.served_digest is None:  # can_roll_back() held: for the type checker
        return
    sync_id = m.new_own_sync_id("rollback")
    m.move(Trigger.TICK, Outcome.ADVANCE, None, version=sp.version, sync_id=sync_id)
    s = m.open_sync(sync_id, sp.version, expected=sp.buckets, probes=sp.probes, kind="rollback")
    s.rollback_of = m.last_sync
    s.expected_digest = m.served_digest
    s.slice_digests = {0: dict(sp.slice_digests)} if sp.slice_digests else {}  # each rank's, replayed
    m.want_rollback = False
    m.outbox.append(SyncOpened(sync_id, sp.version, "rollback", s.carries, False, False))
    m.outbox.append(
        Journal(
            "sync",
            {
                "sync_id": sync_id,
                "version": sp.version,
                "status": "LOADING_BUCKETS",
                "kind": "rollback",
                "at": m.now,
            },
        )
    )
    m.outbox.append(StartRollback(sync_id, sp.version, m.served_digest))


def _expire_catchups(m: Model, late: list[str]) -> None:
    """End the catch-ups of lost engines (this tick's included) and the `late` ones."""
    for eid in sorted(m.catchups):
        if m.engines[eid].state == E.LOST:
            m.end_catchup(eid, False, "engine lost")
        elif eid in late:
            m.end_catchup(eid, False, "no progress before the deadline")


def trainer_gone(m: Model, event: TrainerGone) -> None:
    """A trainer's connection closed. Mid-sync: the sync fails after `trainer_grace`
    unless the trainer comes back (any message of it clears this). In every state: the
    group whose store that trainer hosted is forgotten (the next push by a group plans one)."""
    s = m.sync
    if m.admit(Trigger.TRAINER_GONE) and s is not None and s.sync_id == event.sync_id:
        s.lost.setdefault(event.source, m.now)
    if event.conn:
        m.trainer_closed(event.conn)


def internal(m: Model, event: InternalError) -> None:
    if m.admit(Trigger.INTERNAL):
        m.close_failed(Trigger.INTERNAL, m.error(ErrorCode.INTERNAL, event.reason))


def shutdown(m: Model, event: Shutdown) -> None:
    if m.admit(Trigger.SHUTDOWN):
        m.close_failed(Trigger.SHUTDOWN, m.error(ErrorCode.INTERNAL, "daemon shutting down"))


def spool_changed(m: Model, event: SpoolChanged) -> None:
    m.spooled = event.spooled
    if m.admit(Trigger.SPOOL_CHANGED):
        m.catch_up_stale()
