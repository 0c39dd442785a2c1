"""The clock and the daemon's own observations: deadlines, lost engines, recovery (a
rollback of every engine, a catch-up of one), a trainer's closed connection, a bug, a
shutdown, the spool's contents.

Theory of operation: every tick finds the engines silent past `engine_timeout` (lost),
then the running sync's overdue deadline, if any, and fails the sync with it (a lost
participant first). With no sync running, a dirty daemon whose spool holds the version
it last served replays that version to every live engine as a rollback sync (its own
sync_id; the service feeds it like a trainer would); a READY daemon brings each stale
engine to its version with a private catch-up. Catch-ups that stop making progress end.

Rules: as in `sync`: find the facts first, then act.
"""

from __future__ import annotations

from messages.errors import ErrorCode, WeightSyncError
from orchestrator.core.commands import EngineForgotten, Journal, StartRollback, SyncOpened
from orchestrator.core.events import InternalError, Shutdown, SpoolChanged, Tick, TrainerGone
from orchestrator.core.model import Model
from orchestrator.core.records import SyncRecord
from orchestrator.core.states import ACTIVE, EngineState, State
from orchestrator.core.table import Outcome

S, E = State, EngineState


def tick(m: Model, event: Tick) -> None:
    lim, now, s = m.limits, m.now, m.sync
    lost = [
        x.engine_id
        for x in m.engines.values()
        if x.state != E.LOST and now - x.last_seen > lim.engine_timeout
    ]
    overdue = _overdue(m, s, lost) if s is not None else None
    rollback = s is None and m.state == S.IDLE and _rollback_due(m, lost)
    for eid in lost:
        m.lose(eid, _lost_cause(m, eid))
    _forget_lost(m)
    if overdue is not None:
        m.close_failed("tick", overdue)
    elif rollback:
        _open_rollback(m)
    elif s is None:
        _expire_catchups(m)


def next_wake(m: Model) -> float | None:
    """The earliest time at which a tick could change something (None: no deadline runs),
    read from the same facts `tick` judges: a tick before it finds nothing due, so the
    daemon may sleep until it or the next input. `m.now` when something is due already (a
    rollback to open, a lost engine's catch-up to end). Each deadline is the boundary of
    its rule (strict rules act just past it)."""
    lim, s = m.limits, m.sync
    due: list[float] = []
    for x in m.engines.values():
        if x.state != E.LOST:
            due.append(x.last_seen + lim.engine_timeout)
        elif x.lost_at is not None:
            due.append(x.lost_at + lim.lost_expiry)
    if s is not None:
        due.extend(_sync_deadlines(m, s))
    elif m.state == S.IDLE and _rollback_due(m, []):
        return m.now
    else:
        for eid, c in m.catchups.items():
            if m.engines[eid].state == E.LOST:
                return m.now
            due.append(c.last_progress + (lim.finalize_timeout if c.finalize_sent else lim.bucket_timeout))
    return min(due) if due else None


def _sync_deadlines(m: Model, s: SyncRecord) -> list[float]:
    """The deadlines `_overdue` judges the running sync by, in its state."""
    lim = m.limits
    if m.state == S.FINALIZING:
        return [s.finalize_started + lim.finalize_timeout] if s.finalize_started is not None else []
    if m.state != S.LOADING_BUCKETS:
        return []
    due = [b.forwarded_at + lim.bucket_timeout for b in s.buckets.values() if not b.done]
    gone_at = s.trainer_lost_at
    if gone_at is not None:
        due.append(gone_at + lim.trainer_grace)
    if s.senders > 1:
        if any(k not in s.begun for k in range(s.senders)):
            due.append(s.started_at + lim.sync_timeout)
        due.extend(t + lim.sync_timeout for k, t in s.seen.items() if k not in s.finished)
    if s.stream and s.finished_at is not None:
        due.append(s.finished_at + lim.bucket_timeout)
    if s.senders == 1 and not (s.stream and s.finished_at is None):
        due.append(s.last_activity + lim.sync_timeout)
    return due


def _forget_lost(m: Model) -> None:
    """LOST records older than `lost_expiry` go (engines that never came back: the fleet's
    record does not grow with every id that ever registered), but never one the running
    sync or a catch-up still names."""
    s, expiry = m.sync, m.limits.lost_expiry
    old = [
        eid
        for eid, x in m.engines.items()
        if x.state == E.LOST
        and x.lost_at is not None
        and m.now - x.lost_at >= expiry
        and (s is None or eid not in s.participants)
        and eid not in m.catchups
    ]
    for eid in old:
        del m.engines[eid]
        m.outbox.append(EngineForgotten(eid))
    if old:
        m.epoch.value += 1  # the fleet changed: live sets are made again


def _lost_cause(m: Model, eid: str) -> str:
    x = m.engines[eid]
    if x.closed:
        return "its connection closed"
    return f"no heartbeat for {m.now - x.last_seen:.1f}s (--engine-timeout {m.limits.engine_timeout}s)"


def _overdue(m: Model, s: SyncRecord, lost: list[str]) -> WeightSyncError | None:
    """Why the running sync must fail now, or None."""
    lim, now = m.limits, m.now
    gone = [x for x in lost if x in s.participants]
    if gone:  # whatever the state: a participant is gone
        why = [f"{x}: {_lost_cause(m, x)}" for x in gone]
        return m.error(ErrorCode.ENGINE_FAILED, f"engine(s) lost: {'; '.join(why)}", engine_ids=gone)
    if m.state == S.LOADING_BUCKETS:
        late = [k for k, b in s.buckets.items() if not b.done and now - b.forwarded_at > lim.bucket_timeout]
        if late:
            (sender, seq), rec = late[0], s.buckets[late[0]]
            slow = sorted(
                x for x in s.participants if s.through.get((x, sender), -1) < seq and x not in rec.acked_by
            )
            return m.error(
                ErrorCode.TIMEOUT,
                f"bucket seq {late[0][1]} not applied within {lim.bucket_timeout}s by {slow}",
                engine_ids=slow,
            )
        gone_at = s.trainer_lost_at
        if gone_at is not None and now - gone_at >= lim.trainer_grace:
            if s.senders == 1:
                return m.error(
                    ErrorCode.ABORTED,
                    f"the trainer's connection closed "
                    f"{now - gone_at:.1f}s ago mid-sync (it exited or was "
                    f"killed); sync abandoned",
                    trainer_lost=True,
                )
            dead = sorted(k for k, t in s.lost.items() if now - t >= lim.trainer_grace)
            return m.error(
                ErrorCode.ABORTED,
                f"source(s) {dead} of {s.senders}: connection closed {now - gone_at:.1f}s ago "
                f"mid-sync (exited or killed); the sync is abandoned for every source",
                trainer_lost=True,
                sources=dead,
            )
        if s.senders > 1:
            overdue = _sources_overdue(m, s)
            if overdue is not None:
                return overdue
        if s.stream and s.finished_at is not None and now - s.finished_at > lim.bucket_timeout:
            slow = sorted(set(s.participants) - set(s.prepared))
            return m.error(
                ErrorCode.TIMEOUT,
                f"engine(s) {slow} not prepared within {lim.bucket_timeout}s of the trainer's "
                f"finish; nothing was finalized",
                engine_ids=slow,
            )
        # On a group's stream the trainer says nothing to the daemon until its finish:
        # a stalled stream is bounded by the group's deadline in every engine instead.
        if (
            s.senders == 1
            and not (s.stream and s.finished_at is None)
            and now - s.last_activity > lim.sync_timeout
        ):
            return m.error(ErrorCode.TIMEOUT, f"no trainer message for {lim.sync_timeout}s")
    if (
        m.state == S.FINALIZING
        and s.finalize_started is not None
        and now - s.finalize_started > lim.finalize_timeout
    ):
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


def _sources_overdue(m: Model, s: SyncRecord) -> WeightSyncError | None:
    """A sharded push fails, named, when a source never began, or one that began and has
    not finished went silent, past --sync-timeout."""
    lim, now = m.limits, m.now
    if now - s.started_at > lim.sync_timeout:
        never = [k for k in range(s.senders) if k not in s.begun]
        if never:
            return m.error(
                ErrorCode.TIMEOUT,
                f"source(s) {never[:16]}{' ...' if len(never) > 16 else ''} of {s.senders} never began "
                f"within {lim.sync_timeout}s (--sync-timeout); the sync is abandoned for every source",
                sources=never[:64],
            )
    quiet = sorted(k for k, t in s.seen.items() if k not in s.finished and now - t > lim.sync_timeout)
    if quiet:
        return m.error(
            ErrorCode.TIMEOUT,
            f"no message from source(s) {quiet[:16]} for {lim.sync_timeout}s (--sync-timeout); "
            f"the sync is abandoned for every source",
            sources=quiet[:64],
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
    m.move("tick", Outcome.ADVANCE, None, version=sp.version, sync_id=sync_id)
    s = m.open_sync(sync_id, sp.version, expected=sp.buckets, probes=sp.probes, kind="rollback")
    s.rollback_of = m.last_sync
    s.expected_digest = m.served_digest
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


def _expire_catchups(m: Model) -> None:
    lim = m.limits
    for eid, c in sorted(m.catchups.items()):
        if m.engines[eid].state == E.LOST:
            m.end_catchup(eid, False, "engine lost")
        elif m.now - c.last_progress > (lim.finalize_timeout if c.finalize_sent else lim.bucket_timeout):
            m.end_catchup(eid, False, "no progress before the deadline")


def trainer_gone(m: Model, event: TrainerGone) -> None:
    """A trainer's connection closed. Mid-sync: the sync fails after `trainer_grace`
    unless the trainer comes back (any message of it clears this). Any time: the group
    whose store that trainer hosted is forgotten (the next push by a group plans one)."""
    s = m.sync
    if s is not None and s.sync_id == event.sync_id and m.state == S.LOADING_BUCKETS:
        s.lost.setdefault(event.sender, m.now)
    if event.conn:
        m.trainer_closed(event.conn)


def internal(m: Model, event: InternalError) -> None:
    if m.state in ACTIVE:
        m.close_failed("internal", m.error(ErrorCode.INTERNAL, event.reason))


def shutdown(m: Model, event: Shutdown) -> None:
    if m.state in ACTIVE:
        m.close_failed("shutdown", m.error(ErrorCode.INTERNAL, "daemon shutting down"))


def spool_changed(m: Model, event: SpoolChanged) -> None:
    m.spooled = event.spooled
    if m.state == S.READY:
        m.catch_up_stale()
