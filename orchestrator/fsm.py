"""The orchestrator's state machine (docs/ARCHITECTURE.md). Pure: no sockets, no asyncio,
no torch.

Rules (h11 style): the service feeds decoded messages and the clock in; this module
returns `Result`s (a reply body or "deferred", plus commands for the service to execute).
A refused input raises a `WeightSyncError` and changes nothing. `TRANSITIONS` is the spec;
conditions are pure predicates; `after` callbacks only append commands to the outbox.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import Enum
from typing import Any

from transitions import EventData, Machine, MachineError

from messages.errors import ErrorCode, WeightSyncError, make_error
from messages.schema import Begin, Bucket, Failed, Finalized, Finish, Probe, Register
from orchestrator.commands import (AckBucket, CatchUpAck, CatchUpDone, Command, CompleteSync,
                                   ForwardBucket, Journal, Result, SendAbort, SendFinalize,
                                   SpoolBegin, SpoolCommit, SpoolDiscard, StartCatchUp,
                                   StartRollback)
from orchestrator.records import (BucketRecord, CatchUp, EngineRecord, Limits, Spooled,
                                  SyncRecord)

__all__ = ["State", "TRANSITIONS", "TRIGGERS", "Orchestrator", "canary_mismatch", "AckBucket",
           "CatchUpAck", "CatchUpDone", "Command", "CompleteSync", "ForwardBucket", "Journal",
           "Result", "SendAbort", "SendFinalize", "SpoolBegin", "SpoolCommit", "SpoolDiscard",
           "StartCatchUp", "StartRollback", "BucketRecord", "CatchUp", "EngineRecord", "Limits",
           "Spooled", "SyncRecord"]


class State(str, Enum):
    IDLE = "IDLE"
    LOADING_BUCKETS = "LOADING_BUCKETS"
    FINALIZING = "FINALIZING"
    READY = "READY"


S = State
ACTIVE = (S.LOADING_BUCKETS, S.FINALIZING)

TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "begin", "source": [S.IDLE, S.READY], "dest": S.LOADING_BUCKETS, "conditions": ["newer_version", "enough_engines"], "after": "on_begin"},
    {"trigger": "bucket", "source": S.LOADING_BUCKETS, "dest": None, "after": "on_bucket"},
    {"trigger": "finish", "source": S.LOADING_BUCKETS, "dest": S.FINALIZING, "conditions": "complete", "after": "on_finish"},
    {"trigger": "finalized", "source": S.FINALIZING, "dest": S.READY, "conditions": "all_engines_done", "after": "on_ready"},
    # A sync that never touched an engine can go back to the version still being served.
    {"trigger": "fail", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": "untouched_and_was_ready", "after": "on_fail"},
    {"trigger": "fail", "source": ACTIVE, "dest": S.IDLE, "after": "on_fail"},
    {"trigger": "abort", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": "untouched_and_was_ready", "after": "on_fail"},
    {"trigger": "abort", "source": ACTIVE, "dest": S.IDLE, "after": "on_fail"},
]
TRIGGERS = ("begin", "bucket", "finish", "finalized", "fail", "abort")



class Orchestrator:
    """The model the `transitions` Machine drives. All inputs are `handle_*` methods."""

    state: State  # set by Machine

    def __init__(self, limits: Limits | None = None, *, initial: State = S.IDLE,
                 served_version: int | None = None, served_digest: str | None = None,
                 dirty: bool = False, now: float = 0.0, run_id: str = "0") -> None:
        self.limits = limits or Limits()
        # Names the daemon's own syncs (rollback, catch-up): an engine outlives a daemon
        # restart and its worker refuses a finalize for a sync_id it already ran, so ids
        # must not repeat across daemon runs.
        self.run_id = run_id
        self.last_ready_version = served_version
        self.served_digest = served_digest
        self.dirty = dirty
        self.engines: dict[str, EngineRecord] = {}
        self.sync: SyncRecord | None = None
        self._closed: SyncRecord | None = None
        self.last_sync: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=self.limits.history)
        self.outbox: list[Command] = []
        self.now = now
        self.spooled: Spooled | None = None
        self.want_rollback = dirty  # a dirty start is repaired from the spool when it can be
        self.catchups: dict[str, CatchUp] = {}
        # Ids of ended syncs: an engine refuses a second finalize for an id it already
        # ran, so a reused id could never finish; it is refused at begin instead.
        # Their outcome (code and reason, None for READY) answers a late message for them.
        self.ended: OrderedDict[str, tuple[str | None, str]] = OrderedDict()
        self._own_syncs = 0
        self.machine = Machine(model=self, states=State, transitions=TRANSITIONS,
                               initial=initial, auto_transitions=False, send_event=True,
                               after_state_change="record_transition")

    # -- predicates (pure) --------------------------------------------------------------
    def newer_version(self, event: EventData) -> bool:
        v = event.kwargs["msg"].version
        if event.kwargs.get("rollback"):  # the daemon re-applies the version it served
            return v == self.last_ready_version
        return self.last_ready_version is None or v > self.last_ready_version

    def enough_engines(self, event: EventData) -> bool:
        return len(self.live_engines()) >= self.limits.min_engines

    def complete(self, event: EventData) -> bool:
        return self.sync is not None and self.incomplete_reason(self.sync) is None

    def all_engines_done(self, event: EventData) -> bool:
        s = self.sync
        return s is not None and all(e in s.finalized for e in s.participants)

    def untouched_and_was_ready(self, event: EventData) -> bool:
        s = self.sync
        return (s is not None and not s.buckets and not self.dirty
                and self.last_ready_version is not None)

    # -- callbacks (outbox only) ----------------------------------------------------------
    def record_transition(self, event: EventData) -> None:
        src = event.transition.source
        dst = event.transition.dest
        if dst is None:  # internal transition (bucket): not a state change
            return
        # `after` callbacks run first and may have closed the sync; it is still this line's.
        s = self.sync if self.sync is not None else self._closed
        self._closed = None
        entry = {"from": str(src), "to": str(dst), "trigger": event.event.name,
                 "version": s.version if s else self.last_ready_version,
                 "sync_id": s.sync_id if s else None, "at": self.now}
        err = event.kwargs.get("error")
        if err is not None:
            entry["code"] = err.code.value
            entry["reason"] = err.message
        self.history.append(entry)
        self.outbox.append(Journal("transition", entry))

    def on_begin(self, event: EventData) -> None:
        msg: Begin = event.kwargs["msg"]
        participants = tuple(sorted(e.engine_id for e in self.live_engines()))
        self.sync = SyncRecord(msg.sync_id, msg.version, msg.senders, msg.expected_buckets,
                               msg.probes, participants, self.now, self.now)
        self.sync.shm_engines, self.sync.transport = self.plan_transport(msg, participants)
        for eid, c in sorted(self.catchups.items()):  # a full sync supersedes any catch-up
            self.outbox.append(SendAbort((eid,), c.sync_id))
            self.outbox.append(CatchUpDone(eid, c.sync_id, False, f"superseded by sync {msg.sync_id}"))
        self.catchups.clear()
        for eid in participants:
            self.engines[eid].state = "LOADING"
        if event.kwargs.get("rollback"):
            self.sync.kind = "rollback"
            self.sync.rollback_of = self.last_sync
            self.sync.expected_digest = self.served_digest
        elif self.limits.spool:
            self.outbox.append(SpoolBegin(msg.sync_id, msg.version))
        self.outbox.append(Journal("sync", {"sync_id": msg.sync_id, "version": msg.version,
                                            "status": "LOADING_BUCKETS", "kind": self.sync.kind,
                                            "at": self.now}))

    def on_bucket(self, event: EventData) -> None:
        s = self.sync
        if s is None:  # unreachable: the transition's source is LOADING_BUCKETS
            raise make_error(ErrorCode.INTERNAL, "bucket without a sync")
        key = event.kwargs["key"]
        s.buckets[key] = BucketRecord(event.kwargs["nbytes"], self.now)
        s.nbytes += event.kwargs["nbytes"]
        alive = tuple(e for e in s.participants if self.engines[e].state != "LOST")
        self.outbox.append(ForwardBucket(s.sync_id, key, alive))

    def on_finish(self, event: EventData) -> None:
        s = self.sync
        if s is None:
            raise make_error(ErrorCode.INTERNAL, "finish without a sync")
        s.finalize_started = self.now
        for eid in s.participants:
            if eid in s.finalize_sent:  # the guard behind the invariant: once per engine
                continue
            s.finalize_sent.add(eid)
            self.engines[eid].state = "FINALIZING"
            self.outbox.append(SendFinalize(eid, s.sync_id, s.version, s.probes))

    def on_ready(self, event: EventData) -> None:
        s = self.sync
        if s is None:
            raise make_error(ErrorCode.INTERNAL, "ready without a sync")
        digest = next(iter(s.finalized.values())).digest
        if s.kind == "sync" and self.limits.spool:
            self.outbox.append(SpoolCommit(s.sync_id, s.version, digest))
        self.last_ready_version = s.version
        self.served_digest = digest
        self.dirty = False
        for eid, fin in s.finalized.items():
            e = self.engines[eid]
            e.state, e.version, e.digest = "READY", s.version, fin.digest
            e.finalize_count = fin.finalize_count
            e.probes = fin.probes
        body = self._sync_summary(s, "READY" if s.kind == "sync" else "ROLLED_BACK")
        body["digest"] = digest
        if s.rollback_of is not None:
            body["rolled_back_from"] = s.rollback_of
        body["engines"] = [{"engine_id": eid, "digest": f.digest, "probes": [list(p) for p in f.probes],
                            "finalize_count": f.finalize_count, "seconds": f.seconds}
                           for eid, f in sorted(s.finalized.items())]
        self.last_sync = {**body, "at": self.now}
        self.outbox.append(Journal("sync", {"sync_id": s.sync_id, "version": s.version,
                                            "status": "READY", "digest": digest,
                                            "buckets": len(s.buckets), "bytes": s.nbytes,
                                            "at": self.now}))
        self.outbox.append(CompleteSync(s.sync_id, body))
        self.remember_ended(s.sync_id, None, "READY")
        self.sync, self._closed = None, s
        self.want_rollback = False
        self._catch_up_stale()  # engines that registered during the sync join now

    def on_fail(self, event: EventData) -> None:
        s = self.sync
        if s is None:
            raise make_error(ErrorCode.INTERNAL, "fail without a sync")
        err: WeightSyncError = event.kwargs["error"]
        rolled_back = self.state == S.READY
        s.error = err
        if not rolled_back:
            self.dirty = True
        for eid in s.participants:
            e = self.engines[eid]
            if e.state == "LOST":
                continue
            if rolled_back:
                e.state = "READY" if e.version == self.last_ready_version else "STALE"
            else:
                e.state, e.version, e.digest = "STALE", None, None
        touched = tuple(e for e in s.participants if self.engines[e].state != "LOST")
        if s.buckets or s.finalize_sent:
            self.outbox.append(SendAbort(touched, s.sync_id))
        if s.kind == "sync":
            if self.limits.spool:
                self.outbox.append(SpoolDiscard(s.sync_id))
            # A rollback that fails is not retried by itself (no loop); the next sync repairs.
            self.want_rollback = not rolled_back and self.can_roll_back()
        status = "ABORTED" if event.event.name == "abort" else "FAILED"
        self.last_sync = {**self._sync_summary(s, status), "code": err.code.value,
                          "reason": err.message, "dirty": self.dirty, "at": self.now,
                          "rollback": "pending" if self.want_rollback else (
                              "failed" if s.kind == "rollback" else "none")}
        if self.want_rollback:
            err.details = {**(err.details or {}), "rollback_to": self.last_ready_version}
        self.outbox.append(Journal("sync", {"sync_id": s.sync_id, "version": s.version,
                                            "status": status, "code": err.code.value,
                                            "reason": err.message, "buckets": len(s.buckets),
                                            "bytes": s.nbytes, "at": self.now}))
        err.state = self.state.value
        err.version = self.served_version
        err.sync_id = s.sync_id
        self.outbox.append(CompleteSync(s.sync_id, None, err))
        self.remember_ended(s.sync_id, err.code.value, f"{status}: {err.message}")
        self.sync, self._closed = None, s

    # -- helpers ------------------------------------------------------------------------
    def plan_transport(self, msg: Begin, participants: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
        """Which engines read this sync's buckets from the trainer's shared memory.

        shm needs the engine on the trainer's host and advertising "shm". The others get
        inline frames that the daemon cuts from the trainer's segment, so a mixed sync needs
        the daemon on the trainer's host too. Otherwise: inline for all.
        """
        if msg.transport not in ("shm", "auto") or not msg.host:
            return (), "inline"
        able = tuple(e for e in participants
                     if self.engines[e].host == msg.host and "shm" in self.engines[e].transports)
        if not able or (len(able) < len(participants) and self.limits.host != msg.host):
            return (), "inline"
        return able, "shm" if len(able) == len(participants) else "mixed"

    def can_roll_back(self) -> bool:
        """The spool holds exactly the version last served (same digest)."""
        sp = self.spooled
        return (sp is not None and self.last_ready_version is not None
                and sp.version == self.last_ready_version and sp.digest == self.served_digest)

    def set_spooled(self, spooled: Spooled | None) -> Result:
        """The spool now holds `spooled`; stale engines can catch up from it."""
        self.spooled = spooled
        self._catch_up_stale()
        return self._drain(None)

    def _catch_up_stale(self) -> None:
        for e in sorted(self.engines.values(), key=lambda e: e.engine_id):
            if e.state == "STALE" and e.engine_id not in self.catchups:
                self._start_catchup(e.engine_id)

    def _own_sync_id(self, kind: str) -> str:
        self._own_syncs += 1
        return f"{kind}-{self.run_id}-{self._own_syncs}"

    def maybe_rollback(self, now: float) -> Result:
        """Begin replaying the spool if a failed sync left the engines dirty and enough
        engines are here; the service feeds the buckets (`StartRollback`)."""
        self.now = now
        if not (self.want_rollback and self.state == S.IDLE and self.dirty and self.can_roll_back()
                and len(self.live_engines()) >= max(1, self.limits.min_engines)):
            return self._drain(None)
        sp = self.spooled
        sync_id = self._own_sync_id("rollback")
        msg = Begin(sync_id=sync_id, version=sp.version, expected_buckets=sp.buckets)
        if self._fire("begin", msg=msg, rollback=True):
            self.want_rollback = False
            self.outbox.append(StartRollback(sync_id, sp.version))
        return self._drain(None)

    def _start_catchup(self, engine_id: str) -> None:
        """Bring a stale engine to the served version from the spool, privately."""
        e = self.engines[engine_id]
        if self.state != S.READY or not self.can_roll_back() or e.state == "LOST":
            return
        sync_id = self._own_sync_id(f"catchup-{engine_id}")
        self.catchups[engine_id] = CatchUp(sync_id, self.last_ready_version, self.spooled.buckets,
                                           self.now)
        e.state = "JOINING"
        self.outbox.append(StartCatchUp(engine_id, sync_id, self.last_ready_version))

    def _end_catchup(self, engine_id: str, ok: bool, reason: str = "") -> None:
        c = self.catchups.pop(engine_id, None)
        if c is None:
            return
        e = self.engines.get(engine_id)
        if not ok:
            if e is not None and e.state != "LOST":
                e.state, e.version, e.digest = "STALE", None, None
            self.outbox.append(SendAbort((engine_id,), c.sync_id))
        self.outbox.append(CatchUpDone(engine_id, c.sync_id, ok, reason))

    def _catchup_of(self, engine_id: str, sync_id: str) -> CatchUp | None:
        c = self.catchups.get(engine_id)
        if c is None or c.sync_id != sync_id:
            return None
        c.last_progress = self.now
        self.engines[engine_id].last_seen = self.now
        return c

    @property
    def served_version(self) -> int | None:
        return None if self.dirty else self.last_ready_version

    def live_engines(self) -> list[EngineRecord]:
        return [e for e in self.engines.values() if e.state != "LOST"]

    def incomplete_reason(self, s: SyncRecord) -> str | None:
        if len(s.finished) < s.senders:
            return f"{s.senders - len(s.finished)} sender(s) have not finished"
        total = 0
        for sender, count in s.finished.items():
            have = {seq for (snd, seq) in s.buckets if snd == sender}
            missing = sorted(set(range(count)) - have)
            extra = sorted(have - set(range(count)))
            if missing:
                return f"sender {sender}: missing bucket seq {missing[:8]} of {count}"
            if extra:
                return f"sender {sender}: got seq {extra[:8]} beyond the {count} announced"
            total += count
        if s.expected_buckets is not None and total != s.expected_buckets:
            return f"{total} buckets announced, begin expected {s.expected_buckets}"
        pending = [k for k, b in s.buckets.items() if not b.done]
        if pending:
            return f"{len(pending)} bucket(s) not yet applied by every engine"
        return None

    def missing_tensors(self, s: SyncRecord) -> tuple[str, list[str]] | None:
        """The first engine (by id) with tensors this sync never sent, and which."""
        for eid in s.participants:
            names = sorted(n for n in self.engines[eid].spec if n not in s.names)
            if names:
                return eid, names
        return None

    def _sync_summary(self, s: SyncRecord, status: str) -> dict[str, Any]:
        return {"sync_id": s.sync_id, "version": s.version, "status": status, "kind": s.kind,
                "buckets": len(s.buckets), "bytes": s.nbytes,
                "seconds": round(self.now - s.started_at, 6),
                "engine_ids": list(s.participants)}

    def _error(self, code: ErrorCode, message: str, **details: Any) -> WeightSyncError:
        return make_error(code, message, state=self.state.value, version=self.served_version,
                          sync_id=self.sync.sync_id if self.sync else None,
                          details=details or None)

    def _fire(self, trigger: str, **kw: Any) -> bool:
        try:
            return self.trigger(trigger, **kw)  # type: ignore[attr-defined]
        except MachineError:
            s = self.sync
            if trigger == "begin" and s is not None:  # name what blocks the trainer, and the way out
                age = self.now - s.started_at
                raise self._error(ErrorCode.INVALID_STATE,
                                  f"begin is not allowed in state {self.state.value}: sync {s.sync_id!r} "
                                  f"(version {s.version}) has been running for {age:.0f}s; wait for it, "
                                  f"or end it with `weightsync abort --sync-id {s.sync_id}`",
                                  running_sync_id=s.sync_id, running_version=s.version,
                                  running_seconds=round(age, 3)) from None
            raise self._error(ErrorCode.INVALID_STATE,
                              f"{trigger} is not allowed in state {self.state.value}") from None

    def _drain(self, reply: dict[str, Any] | None) -> Result:
        out, self.outbox = self.outbox, []
        return Result(reply, out)

    def _ended_note(self, sync_id: str) -> str:
        ended = self.ended.get(sync_id)
        if ended is None:
            return ""
        return f" (sync {sync_id!r} " + ("already completed (READY))" if ended[0] is None
                                         else f"already ended: {ended[1]})")

    def remember_ended(self, sync_id: str, code: str | None, reason: str) -> None:
        if code is not None and code not in ErrorCode.__members__:
            code = ErrorCode.INTERNAL.value
        self.ended[sync_id] = (code, reason)
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    def require_sync(self, sync_id: str, what: str) -> SyncRecord:
        """The running sync `sync_id`, or the typed error that says why it is not running:
        its own failure if it ended (the real cause, not the state it left), else
        UNKNOWN_SYNC."""
        if self.sync is not None and self.sync.sync_id == sync_id:
            return self.sync
        ended = self.ended.get(sync_id)
        if ended is not None:
            code, reason = ended
            if code is None:
                raise self._error(ErrorCode.INVALID_STATE,
                                  f"{what} for sync {sync_id!r}, which already completed (READY)",
                                  ended=True)
            raise self._error(ErrorCode(code), f"{what} for sync {sync_id!r}, which already ended: "
                                               f"{reason}", ended=True)
        if self.sync is not None:
            raise self._error(ErrorCode.UNKNOWN_SYNC,
                              f"{what} for sync {sync_id!r}, but sync {self.sync.sync_id!r} is running")
        raise self._error(ErrorCode.UNKNOWN_SYNC,
                          f"{what} for sync {sync_id!r}, which this daemon does not know (it "
                          f"restarted, or the sync never began): begin again")

    def _fail(self, error: WeightSyncError, trigger: str = "fail") -> None:
        if self.state in ACTIVE:
            self.trigger(trigger, error=error)  # type: ignore[attr-defined]

    # -- trainer inputs -----------------------------------------------------------------
    def handle_begin(self, msg: Begin, now: float) -> Result:
        self.now = now
        s = self.sync
        if s is not None and s.kind == "rollback":
            raise self._error(ErrorCode.INVALID_STATE,
                              f"the daemon is rolling the engines back to version {s.version} "
                              f"after a failed sync; retry when it is READY",
                              rollback_running=True)
        if s is not None and s.sync_id == msg.sync_id:
            if s.version != msg.version:
                raise self._error(ErrorCode.BAD_MESSAGE,
                                  f"sync {msg.sync_id!r} was begun with version {s.version}")
            s.last_activity, s.trainer_lost_at = now, None
            return self._drain({**s.view(), "state": self.state.value, "repeated": True})
        if msg.sync_id in self.ended:
            raise self._error(ErrorCode.BAD_MESSAGE,
                              f"sync_id {msg.sync_id!r} was used by an earlier sync; "
                              f"every begin needs a new sync_id")
        if not self._fire("begin", msg=msg):
            if not self.newer_version_of(msg.version):
                raise self._error(ErrorCode.STALE_VERSION,
                                  f"version {msg.version} is not newer than served version "
                                  f"{self.last_ready_version}")
            raise self._error(ErrorCode.NO_ENGINES,
                              f"{len(self.live_engines())} engine(s) registered, "
                              f"{self.limits.min_engines} required")
        started = self.sync
        return self._drain({**started.view(), "state": self.state.value} if started else {})

    def newer_version_of(self, v: int) -> bool:
        return self.last_ready_version is None or v > self.last_ready_version

    def handle_bucket(self, msg: Bucket, nbytes: int, now: float) -> Result:
        """`nbytes` is the frame size; the service has verified the checksum already."""
        self.now = now
        s = self.require_sync(msg.sync_id, "bucket")
        if self.state != S.LOADING_BUCKETS:
            raise self._error(ErrorCode.INVALID_STATE,
                              f"bucket is not allowed in state {self.state.value}")
        if msg.sender >= s.senders:
            raise self._error(ErrorCode.BAD_MESSAGE,
                              f"sender {msg.sender} out of range (senders={s.senders})")
        s.last_activity, s.trainer_lost_at = now, None
        key = (msg.sender, msg.seq)
        rec = s.buckets.get(key)
        if rec is not None:
            if rec.nbytes != nbytes:
                raise self._error(ErrorCode.BAD_MESSAGE,
                                  f"seq {msg.seq} resent with {nbytes} bytes, first had {rec.nbytes}")
            # A resend: acknowledged (now or when applied), never applied twice.
            return self._drain({"seq": msg.seq, "duplicate": True} if rec.done else None)
        self.check_spec(msg)
        self._fire("bucket", key=key, nbytes=nbytes)
        s.names.update(t.name for t in msg.tensors)
        return self._drain(None)

    def check_spec(self, msg: Bucket) -> None:
        """Refuse a bucket that some engine would refuse, before any engine sees it."""
        s = self.sync
        for eid in s.participants if s else ():
            e = self.engines[eid]
            if not e.spec:
                continue
            for t in msg.tensors:
                spec = e.spec.get(t.name)
                if spec is None:
                    raise self._error(ErrorCode.UNKNOWN_TENSOR,
                                      f"engine {eid} has no tensor {t.name!r}", engine_id=eid,
                                      tensor=t.name)
                if tuple(spec.shape) != tuple(t.shape) or (not e.cast_ok and spec.dtype != t.dtype):
                    raise self._error(ErrorCode.SHAPE_MISMATCH,
                                      f"{t.name}: engine {eid} expects {spec.dtype}{list(spec.shape)}, "
                                      f"bucket has {t.dtype}{list(t.shape)}", engine_id=eid,
                                      tensor=t.name)

    def handle_finish(self, msg: Finish, now: float) -> Result:
        self.now = now
        if self.state != S.LOADING_BUCKETS and (self.sync is None or self.sync.sync_id == msg.sync_id):
            raise self._error(ErrorCode.INVALID_STATE,
                              f"finish is only allowed in LOADING_BUCKETS, state is {self.state.value}"
                              + self._ended_note(msg.sync_id))
        s = self.require_sync(msg.sync_id, "finish")
        if msg.sender >= s.senders:
            raise self._error(ErrorCode.BAD_MESSAGE,
                              f"sender {msg.sender} out of range (senders={s.senders})")
        s.last_activity, s.trainer_lost_at = now, None
        previous = s.finished.get(msg.sender)
        s.finished[msg.sender] = msg.buckets
        if len(s.finished) < s.senders:
            return self._drain(None)  # answered when the last sender finishes
        reason = self.incomplete_reason(s)
        if reason is not None:
            if previous is None:
                del s.finished[msg.sender]
            else:
                s.finished[msg.sender] = previous
            raise self._error(ErrorCode.INCOMPLETE_SYNC, reason)
        missing = None if msg.partial else self.missing_tensors(s)
        if missing is not None:
            eid, names = missing
            if previous is None:
                del s.finished[msg.sender]
            else:
                s.finished[msg.sender] = previous
            raise self._error(ErrorCode.INCOMPLETE_SYNC,
                              f"engine {eid} would be left with {len(names)} tensor(s) of the old "
                              f"version: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} "
                              f"(send them, or finish with partial=true); nothing was finalized",
                              engine_id=eid, missing=names[:64], missing_count=len(names))
        if msg.digest is not None and s.senders == 1:
            s.expected_digest = msg.digest
        self._fire("finish", msg=msg)
        return self._drain(None)

    def handle_abort(self, sync_id: str, reason: str, now: float) -> Result:
        self.now = now
        self.require_sync(sync_id, "abort")
        err = self._error(ErrorCode.ABORTED, f"sync aborted by trainer: {reason or 'no reason'}")
        self.trigger("abort", error=err)  # type: ignore[attr-defined]
        return self._drain({"state": self.state.value, "version": self.served_version,
                            "dirty": self.dirty})

    # -- engine inputs ------------------------------------------------------------------
    def handle_register(self, msg: Register, now: float) -> Result:
        self.now = now
        old = self.engines.get(msg.engine_id)
        if old is not None and self.sync and msg.engine_id in self.sync.participants \
                and old.state != "LOST":
            # Same id registering again mid-sync: the process restarted and lost its buckets.
            self._fail(self._error(ErrorCode.ENGINE_FAILED,
                                   f"engine {msg.engine_id} re-registered during the sync",
                                   engine_id=msg.engine_id))
        current = (msg.version is not None and msg.version == self.served_version
                   and msg.digest == self.served_digest and self.state == S.READY)
        rec = EngineRecord(msg.engine_id, msg.backend, msg.model, msg.host, msg.pid,
                           tuple(msg.transports), "READY" if current else "STALE",
                           msg.version, msg.digest, msg.finalize_count, now,
                           {p.name: p for p in msg.spec}, msg.cast_ok)
        # A catch-up in flight for this id is over (its process restarted, or it was lost):
        # end it so its feed stops, then start afresh below if the engine is stale.
        self._end_catchup(msg.engine_id, False, "engine registered again")
        self.engines[msg.engine_id] = rec
        if rec.state == "STALE":
            self._start_catchup(msg.engine_id)
        return self._drain({"engine_id": msg.engine_id, "state": rec.state,
                            "daemon_state": self.state.value, "version": self.served_version})

    def handle_heartbeat(self, engine_id: str, now: float) -> Result:
        self.now = now
        e = self.engines.get(engine_id)
        if e is None or e.state == "LOST":
            return self._drain({"known": False})
        e.last_seen = now
        return self._drain({"known": True})

    def _participant(self, engine_id: str, sync_id: str) -> SyncRecord | None:
        s = self.sync
        if s is None or s.sync_id != sync_id or engine_id not in s.participants:
            return None
        e = self.engines.get(engine_id)
        if e is None or e.state == "LOST":
            return None
        e.last_seen = self.now
        return s

    def handle_loaded(self, engine_id: str, sync_id: str, key: tuple[int, int], now: float) -> Result:
        self.now = now
        c = self._catchup_of(engine_id, sync_id)
        if c is not None:
            if key not in c.acked:
                c.acked.add(key)
                self.outbox.append(CatchUpAck(engine_id, sync_id, key))
            if len(c.acked) >= c.total and not c.finalize_sent:
                c.finalize_sent = True
                self.outbox.append(SendFinalize(engine_id, sync_id, c.version, ()))
            return self._drain(None)
        s = self._participant(engine_id, sync_id)
        rec = s.buckets.get(key) if s else None
        if s is None or rec is None or rec.done:
            return self._drain(None)  # late or duplicate: nothing to do
        rec.acked_by.add(engine_id)
        self._maybe_acked(s, key, rec)
        return self._drain(None)

    def _maybe_acked(self, s: SyncRecord, key: tuple[int, int], rec: BucketRecord) -> None:
        alive = {e for e in s.participants if self.engines[e].state != "LOST"}
        if not rec.done and alive <= rec.acked_by:
            rec.done = True
            self.outbox.append(AckBucket(s.sync_id, key))

    def handle_finalized(self, engine_id: str, msg: Finalized, now: float) -> Result:
        self.now = now
        c = self._catchup_of(engine_id, msg.sync_id)
        if c is not None:
            if msg.version == c.version and msg.digest == self.served_digest and c.finalize_sent:
                e = self.engines[engine_id]
                e.state, e.version, e.digest = "READY", msg.version, msg.digest
                e.finalize_count = msg.finalize_count
                self._end_catchup(engine_id, True)
            else:
                self._end_catchup(engine_id, False, f"finalized version {msg.version} digest "
                                                    f"{msg.digest}, expected {c.version} {self.served_digest}")
            return self._drain(None)
        s = self._participant(engine_id, msg.sync_id)
        if s is None or self.state != S.FINALIZING or engine_id in s.finalized:
            return self._drain(None)
        if msg.version != s.version:
            self._fail(self._error(ErrorCode.ENGINE_FAILED,
                                   f"engine {engine_id} finalized version {msg.version}, expected {s.version}",
                                   engine_id=engine_id))
            return self._drain(None)
        want = s.expected_digest or (next(iter(s.finalized.values())).digest if s.finalized else None)
        if want is not None and msg.digest != want:
            self._fail(self._error(ErrorCode.ENGINE_FAILED,
                                   f"engine {engine_id} holds digest {msg.digest}, expected {want}",
                                   engine_id=engine_id, digest=msg.digest, expected=want))
            return self._drain(None)
        mismatch = canary_mismatch(s.probes, msg.probes)
        if mismatch is not None:
            idx, pos, got, exp = mismatch
            self._fail(self._error(ErrorCode.CANARY_MISMATCH,
                                   f"engine {engine_id}: probe {idx} differs at position {pos} "
                                   f"(got {got}, expected {exp})", engine_id=engine_id,
                                   probe=idx, position=pos, got=got, expected=exp))
            return self._drain(None)
        s.finalized[engine_id] = msg
        self.engines[engine_id].finalize_count = msg.finalize_count
        self.trigger("finalized")  # type: ignore[attr-defined]  # conditions decide
        return self._drain(None)

    def handle_failed(self, engine_id: str, msg: Failed, now: float) -> Result:
        self.now = now
        if self._catchup_of(engine_id, msg.sync_id) is not None:
            if not msg.duplicate:
                self._end_catchup(engine_id, False, f"{msg.code}: {msg.message}")
            return self._drain(None)
        s = self._participant(engine_id, msg.sync_id)
        if s is None or msg.duplicate:
            return self._drain(None)  # e.g. a refused duplicate finalize: the guard worked
        try:
            code = ErrorCode(msg.code)
        except ValueError:
            code = ErrorCode.ENGINE_FAILED
        self._fail(self._error(code, f"engine {engine_id} failed: {msg.message}",
                               engine_id=engine_id, seq=msg.seq))
        return self._drain(None)

    def tick(self, now: float) -> Result:
        """Apply every deadline. Called by the service on a timer."""
        self.now = now
        lim = self.limits
        lost: list[str] = []
        for e in self.engines.values():
            if e.state != "LOST" and now - e.last_seen > lim.engine_timeout:
                e.state = "LOST"
                lost.append(e.engine_id)
        for eid, c in sorted(self.catchups.items()):
            if self.engines[eid].state == "LOST":
                self._end_catchup(eid, False, "engine lost")
            elif now - c.last_progress > (lim.finalize_timeout if c.finalize_sent else lim.bucket_timeout):
                self._end_catchup(eid, False, "no progress before the deadline")
        s = self.sync
        if s is not None:
            gone = [e for e in lost if e in s.participants]
            if gone:
                self._fail(self._error(ErrorCode.ENGINE_FAILED,
                                       f"engine(s) {gone} missed heartbeats for {lim.engine_timeout}s",
                                       engine_ids=gone))
            elif self.state == S.LOADING_BUCKETS:
                late = [k for k, b in s.buckets.items()
                        if not b.done and now - b.forwarded_at > lim.bucket_timeout]
                if late:
                    slow = sorted(set(s.participants) - s.buckets[late[0]].acked_by)
                    self._fail(self._error(ErrorCode.TIMEOUT,
                                           f"bucket seq {late[0][1]} not applied within "
                                           f"{lim.bucket_timeout}s by {slow}", engine_ids=slow))
                elif s.trainer_lost_at is not None and now - s.trainer_lost_at >= lim.trainer_grace:
                    self._fail(self._error(ErrorCode.ABORTED,
                                           f"the trainer's connection closed {now - s.trainer_lost_at:.1f}s "
                                           f"ago mid-sync (it exited or was killed); sync abandoned",
                                           trainer_lost=True), "abort")
                elif now - s.last_activity > lim.sync_timeout:
                    self._fail(self._error(ErrorCode.TIMEOUT,
                                           f"no trainer message for {lim.sync_timeout}s"))
            elif self.state == S.FINALIZING and s.finalize_started is not None \
                    and now - s.finalize_started > lim.finalize_timeout:
                slow = sorted(set(s.participants) - set(s.finalized))
                self._fail(self._error(ErrorCode.TIMEOUT,
                                       f"finalize not reported within {lim.finalize_timeout}s by {slow}",
                                       engine_ids=slow))
        return self._drain(None)

    def handle_trainer_gone(self, sync_id: str, now: float) -> Result:
        """The connection(s) that drove `sync_id` closed: unless a trainer comes back to it
        within `trainer_grace`, the sync is abandoned (tick fails it, ABORTED)."""
        self.now = now
        s = self.sync
        if s is not None and s.sync_id == sync_id and self.state == S.LOADING_BUCKETS:
            s.trainer_lost_at = now
        return self._drain(None)

    def handle_internal(self, reason: str, now: float) -> Result:
        """A bug surfaced while handling an input: the running sync fails with INTERNAL."""
        self.now = now
        self._fail(self._error(ErrorCode.INTERNAL, reason))
        return self._drain(None)

    def handle_shutdown(self, now: float) -> Result:
        self.now = now
        self._fail(self._error(ErrorCode.INTERNAL, "daemon shutting down"))
        return self._drain(None)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state.value, "version": self.served_version,
                "last_ready_version": self.last_ready_version, "digest": self.served_digest,
                "dirty": self.dirty, "sync": self.sync.view() if self.sync else None,
                "last_sync": dict(self.last_sync) if self.last_sync else None,
                "engines": [e.view() for e in sorted(self.engines.values(), key=lambda e: e.engine_id)],
                "history": [dict(h) for h in self.history], "min_engines": self.limits.min_engines,
                "rollback_pending": self.want_rollback and self.can_roll_back()}


def canary_mismatch(probes: tuple[Probe, ...], got: tuple[tuple[int, ...], ...]
                    ) -> tuple[int, int, int | None, int | None] | None:
    """(probe index, first differing position, got, expected) or None if all match."""
    checked = [(i, p) for i, p in enumerate(probes) if p.expected is not None]
    if not checked:
        return None
    for i, p in checked:
        out = got[i] if i < len(got) else ()
        exp = p.expected or ()
        for pos in range(max(len(out), len(exp))):
            a = out[pos] if pos < len(out) else None
            b = exp[pos] if pos < len(exp) else None
            if a != b:
                return i, pos, a, b
    return None
