"""The `after`/`before` callbacks of the core's table (fsm.TRANSITIONS).

Rules: each runs only when its row was taken; it changes the core's records, drives the
engine machine, appends commands to the outbox and sets the reply. It never raises on
input (the table and `assess_*` vetted that already), never fires a daemon trigger, and
does no I/O. Defined here and bound into `fsm.Core`'s class body.
"""

from __future__ import annotations

from typing import Any

from transitions import EventData

from messages.errors import WeightSyncError
from orchestrator.core import syncs
from orchestrator.core.commands import (AckBucket, CatchUpAck, CatchUpDone, CompleteSync,
                                   ForwardBucket, Journal, SendAbort, SendFinalize, SpoolBegin,
                                   SpoolCommit, SpoolDiscard, StartCatchUp, StartRollback)
from orchestrator.core.records import (BucketRecord, CatchUp, EngineRecord, EngineState, SyncRecord)
from orchestrator.core.states import State

E = EngineState


# -- the journal of transitions (after_state_change) -----------------------------------
def record_transition(self: Any, e: EventData) -> None:
    if e.transition.dest is None:  # an internal row: not a state change
        return
    # `after` callbacks ran first and may have closed the sync; it is still this line's.
    s = self.sync if self.sync is not None else self._closed
    self._closed = None
    entry = {"from": str(e.transition.source), "to": str(e.transition.dest),
             "trigger": e.event.name, "version": s.version if s else self.last_ready_version,
             "sync_id": s.sync_id if s else None, "at": self.now}
    err = e.kwargs.get("error")
    if err is not None:
        entry["code"] = err.code.value
        entry["reason"] = err.message
    self.history.append(entry)
    self.outbox.append(Journal("transition", entry))


# -- opening a sync ---------------------------------------------------------------------
def _open(self: Any, sync_id: str, version: int, *, senders: int = 1, expected: int | None = None,
          probes: tuple = (), kind: str = "sync") -> SyncRecord:
    participants = tuple(sorted(x.engine_id for x in self.live_engines()))
    s = self.sync = SyncRecord(sync_id, version, senders, expected, probes, participants,
                               self.now, self.now)
    s.kind = kind
    for eid, c in sorted(self.catchups.items()):  # a full sync supersedes any catch-up
        self.outbox.append(SendAbort((eid,), c.sync_id))
        self.outbox.append(CatchUpDone(eid, c.sync_id, False, f"superseded by sync {sync_id}"))
    self.catchups.clear()
    for eid in participants:
        self.engines[eid].enlist()
    return s


def open_sync(self: Any, e: EventData) -> None:
    m = e.kwargs["ev"].msg
    s = _open(self, m.sync_id, m.version, senders=m.senders, expected=m.expected_buckets, probes=m.probes)
    group = syncs.plan_group(m, s.participants, self.engines, self.group,
                             f"g{self._groups + 1}.{self.run_id}"[:128],
                             self.limits.bucket_timeout)
    if group is not None:
        if group is not self.group:
            self._groups += 1
        self.group = s.group = group
        s.transport = "collective"
    else:
        s.shm_engines, s.transport = syncs.plan_transport(m, s.participants, self.engines, self.limits.host)
    if self.limits.spool:
        self.outbox.append(SpoolBegin(m.sync_id, m.version))
    self.outbox.append(Journal("sync", {"sync_id": m.sync_id, "version": m.version,
                                        "status": "LOADING_BUCKETS", "kind": "sync", "at": self.now}))
    self.reply = {**s.view(), "state": State.LOADING_BUCKETS.value}
    if s.group is not None:  # the trainer sends the daemon a copy of each bucket to spool
        self.reply["spool_copy"] = self.limits.spool


def open_rollback(self: Any, e: EventData) -> None:
    sp = self.spooled
    self._own_syncs += 1
    sync_id = f"rollback-{self.run_id}-{self._own_syncs}"
    s = _open(self, sync_id, sp.version, expected=sp.buckets, kind="rollback")
    s.rollback_of = self.last_sync
    s.expected_digest = self.served_digest
    self.want_rollback = False
    self.outbox.append(Journal("sync", {"sync_id": sync_id, "version": sp.version,
                                        "status": "LOADING_BUCKETS", "kind": "rollback", "at": self.now}))
    self.outbox.append(StartRollback(sync_id, sp.version))


def reply_running(self: Any, e: EventData) -> None:
    s = self.sync
    s.last_activity, s.trainer_lost_at = self.now, None
    self.reply = {**s.view(), "state": self.state.value, "repeated": True}
    if s.group is not None:
        self.reply["spool_copy"] = self.limits.spool


# -- buckets ----------------------------------------------------------------------------
def reply_resent(self: Any, e: EventData) -> None:
    """A resend: acknowledged now if every engine applied it, else when they have."""
    m, s = e.kwargs["ev"].msg, self.sync
    s.last_activity, s.trainer_lost_at = self.now, None
    if s.buckets[(m.sender, m.seq)].done:
        self.reply = {"seq": m.seq, "duplicate": True}


def forward_bucket(self: Any, e: EventData) -> None:
    event, s = e.kwargs["ev"], self.sync
    m, key = event.msg, (event.msg.sender, event.msg.seq)
    s.last_activity, s.trainer_lost_at = self.now, None
    s.buckets[key] = BucketRecord(event.nbytes, self.now)
    s.nbytes += event.nbytes
    s.names.update(t.name for t in m.tensors)
    alive = tuple(x for x in s.participants if self.engines[x].state != E.LOST)
    self.outbox.append(ForwardBucket(s.sync_id, key, alive))


def note_loaded(self: Any, e: EventData) -> None:
    event = e.kwargs["ev"]
    c = _catchup_of(self, event.engine_id, event.sync_id)
    if c is not None:
        if event.key not in c.acked:
            c.acked.add(event.key)
            self.outbox.append(CatchUpAck(event.engine_id, event.sync_id, event.key))
        if len(c.acked) >= c.total and not c.finalize_sent:
            c.finalize_sent = True
            self.outbox.append(SendFinalize(event.engine_id, event.sync_id, c.version, ()))
        return
    s = self._participant(event.engine_id, event.sync_id)
    rec = s.buckets.get(event.key) if s else None
    if s is None or rec is None or rec.done:
        return  # late or duplicate: nothing to do
    self.engines[event.engine_id].last_seen = self.now
    rec.acked_by.add(event.engine_id)
    _maybe_acked(self, s, event.key, rec)


def _maybe_acked(self: Any, s: SyncRecord, key: tuple[int, int], rec: BucketRecord) -> None:
    alive = {x for x in s.participants if self.engines[x].state != E.LOST}
    if not rec.done and alive <= rec.acked_by:
        rec.done = True
        self.outbox.append(AckBucket(s.sync_id, key))


# -- finishing --------------------------------------------------------------------------
def record_finish(self: Any, e: EventData) -> None:
    m, s = e.kwargs["ev"].msg, self.sync
    s.last_activity, s.trainer_lost_at = self.now, None
    s.finished[m.sender] = m.buckets
    if m.digest is not None and s.senders == 1:
        s.expected_digest = m.digest


def send_finalize(self: Any, e: EventData) -> None:
    s = self.sync
    s.finalize_started = self.now
    for eid in s.participants:
        if eid in s.finalize_sent:  # the guard behind the invariant: once per engine
            continue
        s.finalize_sent.add(eid)
        self.engines[eid].start_finalize()
        self.outbox.append(SendFinalize(eid, s.sync_id, s.version, s.probes))


def record_finalized(self: Any, e: EventData) -> None:
    event = e.kwargs["ev"]
    self.sync.finalized[event.engine_id] = event.msg
    self.engines[event.engine_id].finalize_count = event.msg.finalize_count


def note_finalized(self: Any, e: EventData) -> None:
    """A catch-up's finalize (late and stray ones change nothing)."""
    event = e.kwargs["ev"]
    eid, m = event.engine_id, event.msg
    c = _catchup_of(self, eid, m.sync_id)
    if c is not None:
        if m.version == c.version and m.digest == self.served_digest and c.finalize_sent:
            x = self.engines[eid]
            x.version, x.digest, x.finalize_count = m.version, m.digest, m.finalize_count
            x.serve()
            _end_catchup(self, eid, True)
        else:
            _end_catchup(self, eid, False, f"finalized version {m.version} digest {m.digest}, "
                                           f"expected {c.version} {self.served_digest}")
        return


def close_ready(self: Any, e: EventData) -> None:
    s = self.sync
    digest = next(iter(s.finalized.values())).digest
    if s.kind == "sync" and self.limits.spool:
        self.outbox.append(SpoolCommit(s.sync_id, s.version, digest))
    self.last_ready_version, self.served_digest, self.dirty = s.version, digest, False
    for eid, fin in s.finalized.items():
        x = self.engines[eid]
        x.version, x.digest, x.finalize_count, x.probes = s.version, fin.digest, fin.finalize_count, fin.probes
        x.serve()
    body = syncs.summary(s, "READY" if s.kind == "sync" else "ROLLED_BACK", self.now)
    body["digest"] = digest
    if s.rollback_of is not None:
        body["rolled_back_from"] = s.rollback_of
    body["engines"] = [{"engine_id": eid, "digest": f.digest, "probes": [list(p) for p in f.probes],
                        "finalize_count": f.finalize_count, "seconds": f.seconds,
                        "phases": dict(f.phases)}
                       for eid, f in sorted(s.finalized.items())]
    self.last_sync = {**body, "at": self.now}
    self.outbox.append(Journal("sync", {"sync_id": s.sync_id, "version": s.version, "status": "READY",
                                        "digest": digest, "buckets": len(s.buckets), "bytes": s.nbytes,
                                        "at": self.now}))
    self.outbox.append(CompleteSync(s.sync_id, body, summary=self.last_sync))
    self.remember_ended(s.sync_id, None, "READY")
    self.sync, self._closed = None, s
    self.want_rollback = False
    _catch_up_stale(self)  # engines that registered during the sync join now


def close_failed(self: Any, e: EventData) -> None:
    s, err = self.sync, e.kwargs["error"]
    rolled_back = e.transition.dest == State.READY  # this row goes back to the version served
    s.error = err
    if s.group is not None:
        self.group = None  # members may have died or hold a half-done broadcast: a new group next time
    if not rolled_back:
        self.dirty = True
    for eid in s.participants:
        x = self.engines[eid]
        if x.state == E.LOST:
            continue
        if rolled_back and x.version == self.last_ready_version:
            x.restore()
        else:
            x.doubt()
            if not rolled_back:
                x.version, x.digest = None, None
    touched = tuple(x for x in s.participants if self.engines[x].state != E.LOST)
    if s.buckets or s.finalize_sent:
        self.outbox.append(SendAbort(touched, s.sync_id))
    if s.kind == "sync":
        if self.limits.spool:
            self.outbox.append(SpoolDiscard(s.sync_id))
        # A rollback that fails is not retried by itself (no loop); the next sync repairs.
        self.want_rollback = not rolled_back and self.can_roll_back()
    status = "ABORTED" if e.event.name == "abort" else "FAILED"
    self.last_sync = {**syncs.summary(s, status, self.now), "code": err.code.value,
                      "reason": err.message, "dirty": self.dirty, "at": self.now,
                      "rollback": "pending" if self.want_rollback else (
                          "failed" if s.kind == "rollback" else "none")}
    if self.want_rollback:
        err.details = {**(err.details or {}), "rollback_to": self.last_ready_version}
    self.outbox.append(Journal("sync", {"sync_id": s.sync_id, "version": s.version, "status": status,
                                        "code": err.code.value, "reason": err.message,
                                        "buckets": len(s.buckets), "bytes": s.nbytes, "at": self.now}))
    err.state, err.version, err.sync_id = self.state.value, self.served_version, s.sync_id
    self.outbox.append(CompleteSync(s.sync_id, None, err, summary=self.last_sync))
    self.remember_ended(s.sync_id, err.code.value, f"{status}: {err.message}")
    self.sync, self._closed = None, s
    self.reply = {"state": self.state.value, "version": self.served_version, "dirty": self.dirty}


# -- engines ------------------------------------------------------------------------------
def add_engine(self: Any, e: EventData, ready: bool = False) -> None:
    """A (re)registered engine; with `ready` (the READY row) it may already serve the
    daemon's version, else it is stale and catches up from the spool."""
    m = e.kwargs["ev"].msg
    current = (ready and m.version is not None and m.version == self.served_version
               and m.digest == self.served_digest)
    rec = EngineRecord(m.engine_id, m.backend, m.model, m.host, m.pid, tuple(m.transports),
                       version=m.version, digest=m.digest, finalize_count=m.finalize_count,
                       last_seen=self.now, spec={p.name: p for p in m.spec}, cast_ok=m.cast_ok,
                       collective_ranks=m.collective_ranks,
                       collective_backends=tuple(m.collective_backends))
    # A catch-up in flight for this id is over (its process restarted, or it was lost):
    # end it so its feed stops, then start afresh below if the engine is stale.
    _end_catchup(self, m.engine_id, False, "engine registered again")
    _leave_group(self, m.engine_id)  # a new process: the group's ranks for it are gone
    old = self.engines.get(m.engine_id)
    if old is not None:
        self.engine_machine.remove_model(old)
    self.engine_machine.add_model(rec, initial=E.READY if current else E.STALE)
    self.engines[m.engine_id] = rec
    if ready and rec.state == E.STALE:
        _start_catchup(self, m.engine_id)
    self.reply = {"engine_id": m.engine_id, "state": rec.state.value, "daemon_state": self.state.value,
                  "version": self.served_version}


def add_engine_to_ready(self: Any, e: EventData) -> None:
    add_engine(self, e, ready=True)


def note_heartbeat(self: Any, e: EventData) -> None:
    x = self.engines.get(e.kwargs["ev"].engine_id)
    if x is None or x.state == E.LOST:
        self.reply = {"known": False}
        return
    x.last_seen = self.now
    self.reply = {"known": True}


def note_failed(self: Any, e: EventData) -> None:
    event = e.kwargs["ev"]
    if _catchup_of(self, event.engine_id, event.msg.sync_id) is not None and not event.msg.duplicate:
        _end_catchup(self, event.engine_id, False, f"{event.msg.code}: {event.msg.message}")


def mark_lost(self: Any, e: EventData) -> None:
    for eid in e.kwargs.get("lost", ()):
        self.engines[eid].lose()
        _leave_group(self, eid)


def _leave_group(self: Any, engine_id: str) -> None:
    g = self.group
    if g is not None and any(eid == engine_id for eid, _, _ in g.members):
        self.group = None  # the next collective sync plans a new group without stale ranks


def expire_catchups(self: Any, e: EventData) -> None:
    lim = self.limits
    for eid, c in sorted(self.catchups.items()):
        if self.engines[eid].state == E.LOST:
            _end_catchup(self, eid, False, "engine lost")
        elif self.now - c.last_progress > (lim.finalize_timeout if c.finalize_sent else lim.bucket_timeout):
            _end_catchup(self, eid, False, "no progress before the deadline")


def expire_engine(self: Any, e: EventData) -> None:
    """Counted lost at the next tick, without waiting out its heartbeats: a collective
    group cannot go on without a member. A live process re-registers and catches up."""
    x = self.engines.get(e.kwargs["ev"].engine_id)
    if x is not None:
        x.last_seen = float("-inf")


def note_trainer_gone(self: Any, e: EventData) -> None:
    self.sync.trainer_lost_at = self.now


def note_spooled(self: Any, e: EventData) -> None:
    self.spooled = e.kwargs["ev"].spooled


def catch_up_stale(self: Any, e: EventData) -> None:
    _catch_up_stale(self)


# -- catch-up: one engine brought to the served version from the spool -----------------
def _catch_up_stale(self: Any) -> None:
    for x in sorted(self.engines.values(), key=lambda x: x.engine_id):
        if x.state == E.STALE and x.engine_id not in self.catchups:
            _start_catchup(self, x.engine_id)


def _start_catchup(self: Any, engine_id: str) -> None:
    x = self.engines[engine_id]
    if not self.can_roll_back() or x.state != E.STALE:  # called from READY rows only
        return
    self._own_syncs += 1
    sync_id = f"catchup-{engine_id}-{self.run_id}-{self._own_syncs}"
    self.catchups[engine_id] = CatchUp(sync_id, self.last_ready_version, self.spooled.buckets, self.now)
    x.join()
    self.outbox.append(StartCatchUp(engine_id, sync_id, self.last_ready_version))


def _end_catchup(self: Any, engine_id: str, ok: bool, reason: str = "") -> None:
    c = self.catchups.pop(engine_id, None)
    if c is None:
        return
    x = self.engines.get(engine_id)
    if not ok:
        if x is not None and x.state != E.LOST:
            x.doubt()
            x.version, x.digest = None, None
        self.outbox.append(SendAbort((engine_id,), c.sync_id))
    self.outbox.append(CatchUpDone(engine_id, c.sync_id, ok, reason))


def _catchup_of(self: Any, engine_id: str, sync_id: str) -> CatchUp | None:
    c = self.catchups.get(engine_id)
    if c is None or c.sync_id != sync_id:
        return None
    c.last_progress = self.now
    self.engines[engine_id].last_seen = self.now
    return c


__all__ = ["WeightSyncError"]  # re-exported for callers that type the error of close_failed
