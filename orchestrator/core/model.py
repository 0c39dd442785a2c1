"""What the core knows, and the steps every trigger shares.

Rules: `Model` holds the records (engines, the running sync, the served version, the
spool, catch-ups) and the steps several triggers take the same way: moving through the
state table (journaled and logged once), opening a sync, closing it READY or failed,
starting and ending a catch-up. The broadcast groups kept for reuse are
`groups.KeptGroups`'. A step changes records and appends commands to the
outbox; it never raises on input (the trigger checked it first), never reads a clock
(`now` is the input's) and does no I/O. The trigger modules (`sync`, `fleet`, `clock`)
decide which steps an input takes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from messages.bounded import LRU
from messages.checksums import DIGEST_SCHEME
from messages.errors import ErrorCode, WeightSyncError, make_error
from messages.replies import GROUP_KEY, EngineFinal, FinishReply, Json, JsonObject
from messages.replies import body as reply_body
from messages.schema import Begin, ParamSpec, Probe
from orchestrator.core import syncs
from orchestrator.core.commands import (
    CatchUpDone,
    Command,
    CompleteSync,
    EngineLost,
    Journal,
    SendAbort,
    SendServed,
    SendSpooled,
    SpoolCommit,
    SpoolDiscard,
)
from orchestrator.core.groups import KeptGroups
from orchestrator.core.records import CatchUp, EngineRecord, Epoch, GroupRecord, Limits, Spooled, SyncRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Life, Outcome, Refused, StateTable, Trigger

S, E = State, EngineState
# The core's bounded maps (messages.bounded.LRU, least recently used first):
ENDED_KEPT = 4096  # ended sync ids: a late message is answered with its end (minutes of syncs)
MAX_PLANS = 4  # sharded pushes' plans checked against later syncs: one per model served, and spare
SPECS_KEPT = 256  # distinct engine specs shared between records: models served at once, with room


class Model:
    def __init__(
        self,
        limits: Limits | None = None,
        *,
        initial: State = S.IDLE,
        served_version: int | None = None,
        served_digest: str | None = None,
        served_scheme: str = DIGEST_SCHEME,
        dirty: bool = False,
        now: float = 0.0,
        run_id: str = "0",
        history: Iterable[JsonObject] = (),
        ended: Iterable[tuple[str, str | None, str]] = (),
    ) -> None:
        self.limits = limits or Limits()
        self.table = StateTable(initial)
        # Names the daemon's own syncs (rollback, catch-up): an engine outlives a daemon
        # restart and refuses a finalize for a sync_id it already ran.
        self.run_id = run_id
        self.last_ready_version = served_version
        self.served_digest = served_digest
        # What made `served_digest` (the journal's record): a digest of another scheme is
        # never compared with what engines report, so nothing is replayed against it.
        self.served_scheme = served_scheme
        self.dirty = dirty
        self.engines: dict[str, EngineRecord] = {}
        self.epoch = Epoch()  # bumped by its engine records (records.Epoch)
        # one dict per distinct registered spec, shared by the engines that sent it, so a
        # bucket is checked once per model, not once per engine
        self.specs: LRU[tuple[ParamSpec, ...], dict[str, ParamSpec]] = LRU(SPECS_KEPT)
        self.sync: SyncRecord | None = None
        self.last_sync: JsonObject | None = None
        self.history: deque[JsonObject] = deque(history, maxlen=self.limits.history)
        self.outbox: list[Command] = []
        self.reply: JsonObject | None = None  # this input's answer now (Result.reply)
        self.later = False  # its answer comes with a later command (Result.later)
        self.refusal: WeightSyncError | None = None  # refused, having ended the sync (Result.refusal)
        self.now = now
        self.spooled: Spooled | None = None
        self.want_rollback = dirty  # a dirty start is repaired from the spool when it can be
        self.catchups: dict[str, CatchUp] = {}
        # Outcome (code, reason; None for READY) of ended syncs: a late message for one is
        # answered with it, and its id is never begun again.
        self.ended: LRU[str, tuple[str | None, str]] = LRU(ENDED_KEPT)
        for sync_id, code, reason in ended:
            self.remember_ended(sync_id, code, reason)
        self.kept_groups = KeptGroups(run_id)  # the broadcast groups syncs reuse
        # A sharded push's plan as a READY sync carried it out: plan hash -> tensor -> source.
        # A sync commits only when what its sources sent hashes to the plan they declared
        # (messages.shardplan), so this is the declared assignment itself; later syncs with
        # the same plan are checked against it bucket by bucket (refused before the owner sent).
        self.plans: LRU[int, dict[str, int]] = LRU(MAX_PLANS)
        self._own_syncs = 0

    # -- queries ------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.table.state

    @property
    def group(self) -> GroupRecord | None:
        """The group the one source's syncs reuse (`kept_groups`)."""
        return self.kept_groups.shared

    @property
    def served_version(self) -> int | None:
        return None if self.dirty else self.last_ready_version

    def live_engines(self) -> list[EngineRecord]:
        return [x for x in self.engines.values() if x.state != E.LOST]

    def participant(self, engine_id: str, sync_id: str) -> SyncRecord | None:
        """The running sync, if `engine_id` takes part in it (and is not lost)."""
        s = self.sync
        if s is None or s.sync_id != sync_id or engine_id not in s.members:
            return None
        x = self.engines.get(engine_id)
        return None if x is None or x.state == E.LOST else s

    def can_roll_back(self) -> bool:
        """The spool holds exactly the version last served (same digest), and that digest is
        of this daemon's scheme (what its engines will report)."""
        sp = self.spooled
        return (
            sp is not None
            and self.last_ready_version is not None
            and sp.version == self.last_ready_version
            and sp.digest == self.served_digest
            and sp.scheme == self.served_scheme == DIGEST_SCHEME
        )

    def scheme_error(self) -> WeightSyncError | None:
        """DIGEST_SCHEME_MISMATCH when the served digest or the spool's was made by another
        digest scheme than this daemon's (a state database or spool of an older daemon):
        no engine can reproduce it, so no rollback or catch-up runs and no engine is judged
        by it; the next pushed version records this daemon's scheme and clears it."""
        found: dict[str, str] = {}
        if self.served_digest is not None and self.served_scheme != DIGEST_SCHEME:
            found["served"] = self.served_scheme
        sp = self.spooled
        if sp is not None and sp.scheme != DIGEST_SCHEME:
            found["spool"] = sp.scheme
        if not found:
            return None
        where = " and the ".join("state database" if k == "served" else "spool" for k in found)
        schemes = "/".join(sorted(set(found.values())))
        return self.error(
            ErrorCode.DIGEST_SCHEME_MISMATCH,
            f"version {self.last_ready_version}'s digest in the {where} was made by digest scheme "
            f"{schemes!r} (an older daemon's); this daemon's engines compute {DIGEST_SCHEME!r} and "
            f"can never match it, so nothing is rolled back or caught up to it and the engines "
            f"are kept as they are (STALE, unverified). Push a new version: its digest is "
            f"recorded in {DIGEST_SCHEME!r}",
            recorded=found,
            daemon_scheme=DIGEST_SCHEME,
        )

    def untouched_and_was_ready(self) -> bool:
        """A failure now leaves the engines as they were: READY again, not dirty."""
        s = self.sync
        return (
            s is not None
            and self.state == S.LOADING_BUCKETS
            and not s.stream  # its engines began receiving when the sync opened
            and not s.buckets
            and not s.finalize_sent
            and not self.dirty
            and self.last_ready_version is not None
        )

    def error(self, code: ErrorCode, message: str, **details: object) -> WeightSyncError:
        """A typed error that says where the daemon is (state, version, running sync)."""
        return make_error(
            code,
            message,
            state=self.state.value,
            version=self.served_version,
            sync_id=self.sync.sync_id if self.sync else None,
            details=details or None,
        )

    def require_sync(self, sync_id: str, what: str) -> SyncRecord:
        """The running sync `sync_id`, or raise why it is not running: its own failure if it
        ended (the real cause, not the state it left), else UNKNOWN_SYNC."""
        if self.sync is not None and self.sync.sync_id == sync_id:
            return self.sync
        ended = self.ended.get(sync_id)
        if ended is not None:
            code, reason = ended
            if code is None:
                raise self.error(
                    ErrorCode.INVALID_STATE,
                    f"{what} for sync {sync_id!r}, which already completed (READY)",
                    ended=True,
                )
            raise self.error(
                ErrorCode(code), f"{what} for sync {sync_id!r}, which already ended: {reason}", ended=True
            )
        if self.sync is not None:
            raise self.error(
                ErrorCode.UNKNOWN_SYNC,
                f"{what} for sync {sync_id!r}, but sync {self.sync.sync_id!r} is running",
            )
        raise self.error(
            ErrorCode.UNKNOWN_SYNC,
            f"{what} for sync {sync_id!r}, which this daemon does not know (it "
            f"restarted, or the sync never began): begin again",
        )

    def require_own(self, s: SyncRecord, conn: bytes, what: str) -> None:
        """Refuse a trainer's `what` into a sync the daemon runs itself (a rollback: its
        buckets and finish come from the spool, on no connection): a bucket it did not
        plan would change what the rollback restores, and its finish would never match."""
        if conn and s.kind != "sync":
            raise self.error(
                ErrorCode.INVALID_STATE,
                f"{what} for sync {s.sync_id!r}, the daemon's own {s.kind}: only the daemon "
                f"sends into it; wait for READY (a trainer may abort it)",
                kind=s.kind,
            )

    def ended_note(self, sync_id: str) -> str:
        ended = self.ended.get(sync_id)
        if ended is None:
            return ""
        return f" (sync {sync_id!r} " + (
            "already completed (READY))" if ended[0] is None else f"already ended: {ended[1]})"
        )

    @property
    def spooled_probes(self) -> tuple[Probe, ...]:
        """The canaries of the version the spool holds (a rollback or catch-up re-runs them)."""
        return self.spooled.probes if self.spooled is not None else ()

    def snapshot(self, now: float | None = None) -> JsonObject:
        """The status object's core part; with `now`, each engine's heartbeat age."""
        engines: list[Json] = []
        for x in sorted(self.engines.values(), key=lambda x: x.engine_id):
            v = x.view()
            if now is not None:
                v["heartbeat_age_s"] = round(now - x.last_seen, 3)
            engines.append(v)
        return {
            "state": self.state.value,
            "version": self.served_version,
            # how many engines serve that version now (READY at it, their server answering):
            # 0 after a restart whose engines came back without it and no spool to bring them
            "served_by": sum(1 for x in self.engines.values() if x.serves(self.served_version)),
            "last_ready_version": self.last_ready_version,
            "digest": self.served_digest,
            "digest_scheme": self.served_scheme if self.served_digest is not None else None,
            "digest_scheme_error": e.to_fields() if (e := self.scheme_error()) is not None else None,
            "dirty": self.dirty,
            "sync": self.sync.view() if self.sync else None,
            "last_sync": dict(self.last_sync) if self.last_sync else None,
            "engines": engines,
            "history": [dict(h) for h in self.history],
            "min_engines": self.limits.min_engines,
            "rollback_pending": self.want_rollback and self.can_roll_back(),
            GROUP_KEY: self.group.view() if self.group else None,
        }

    # -- steps --------------------------------------------------------------------------
    def remember_ended(self, sync_id: str, code: str | None, reason: str) -> None:
        if code is not None and code not in ErrorCode.__members__:
            code = ErrorCode.INTERNAL.value
        self.ended[sync_id] = (code, reason)

    def admit(self, trigger: Trigger, tail: str = "", **details: object) -> bool:
        """The table's gate for `trigger` in the current state: True taken, False ignored
        (the trigger then changes nothing), else its refusal (code and sentence, then
        `tail`, the facts of the moment) as a typed error; nothing changed."""
        try:
            return self.table.admit(trigger)
        except Refused as r:
            raise self.error(r.code, r.message + tail, **details) from None

    def move(
        self,
        trigger: Trigger,
        outcome: Outcome,
        s: SyncRecord | None,
        error: WeightSyncError | None = None,
        *,
        version: int | None = None,
        sync_id: str | None = None,
    ) -> None:
        """Change state by the table's row for (`trigger`, state, `outcome`) (INTERNAL if
        there is none; nothing changed then) and journal the transition once, naming the
        sync it belongs to (`s`, or `version` and `sync_id` of one about to open) and the
        daemon's dirty flag after it (set by a dirty end, cleared at READY)."""
        src = self.state
        dest = self.table.take(trigger, outcome)
        if outcome is Outcome.DIRTY:
            self.dirty = True
        elif dest is State.READY:
            self.dirty = False
        entry: JsonObject = {
            "from": src.value,
            "to": dest.value,
            "trigger": trigger.value,
            "version": s.version if s else (version if version is not None else self.last_ready_version),
            "sync_id": s.sync_id if s else sync_id,
            "at": self.now,
        }
        if error is not None:
            entry["code"] = error.code.value
            entry["reason"] = error.message
        self.history.append(entry)
        self.outbox.append(Journal("transition", {**entry, "dirty": self.dirty}))

    def open_sync(
        self,
        sync_id: str,
        version: int,
        *,
        sources: int = 1,
        expected: int | None = None,
        probes: tuple[Probe, ...] = (),
        kind: str = "sync",
    ) -> SyncRecord:
        """A sync record with every live engine as a participant; catch-ups are superseded."""
        participants = tuple(sorted(x.engine_id for x in self.live_engines()))
        s = self.sync = SyncRecord(
            sync_id, version, sources, expected, probes, participants, self.now, self.now
        )
        s.kind = kind
        for eid, c in sorted(self.catchups.items()):  # a full sync supersedes any catch-up
            self.outbox.append(SendAbort((eid,), c.sync_id))
            self.outbox.append(CatchUpDone(eid, c.sync_id, False, f"superseded by sync {sync_id}"))
        self.catchups.clear()
        for eid in participants:
            self.engines[eid].move(Life.ENLIST)
        return s

    def close_failed(self, trigger: Trigger, err: WeightSyncError, by: str = "daemon") -> None:
        """End the running sync as failed. READY again when it touched nothing of a READY
        daemon, else IDLE with dirty set (and a rollback wanted when the spool can).
        by: who ended it: the trainer or an operator (an abort), else the daemon."""
        s = self.sync
        if s is None:
            raise make_error(ErrorCode.INTERNAL, "close_failed without a running sync")
        rolled_back = self.untouched_and_was_ready()
        self.move(trigger, Outcome.CLEAN if rolled_back else Outcome.DIRTY, s, err)
        s.error = err
        self.kept_groups.sync_failed(s)
        for eid in s.participants:
            x = self.engines[eid]
            if x.state == E.LOST:
                continue
            if rolled_back and x.version == self.last_ready_version:
                x.move(Life.RESTORE)
            else:
                x.move(Life.DOUBT)
                if not rolled_back:
                    x.version, x.digest = None, None
        touched = tuple(x for x in s.participants if self.engines[x].state != E.LOST)
        if s.buckets or s.finalize_sent or s.stream:  # a stream's engines may be receiving
            self.outbox.append(SendAbort(touched, s.sync_id))
        if s.kind == "sync":
            if self.limits.spool:
                self.outbox.append(SpoolDiscard(s.sync_id))
            self.want_rollback = not rolled_back and self.can_roll_back()
        elif s.kind == "rollback":
            # A rollback that fails at named engines fails those engines, not the fleet:
            # they are counted lost (a live one registers again and catches up, or stays
            # STALE, named) and the others are rolled back again. Each retry has fewer
            # engines, so this ends; a rollback failing with no engine named is not retried.
            blamed = [x for x in _blamed(err) if x in touched]
            for eid in blamed:
                self.lose(eid, f"its rollback failed: {err.code.value}: {err.message}")
            live = any(x.state != E.LOST for x in self.engines.values())
            self.want_rollback = bool(blamed) and live and self.can_roll_back()
        status = "ABORTED" if trigger is Trigger.ABORT else "FAILED"
        self.last_sync = {
            **reply_body(syncs.summary(s, status, self.now)),
            "code": err.code.value,
            "reason": err.message,
            "by": by,
            "dirty": self.dirty,
            "at": self.now,
            "rollback": "pending" if self.want_rollback else ("failed" if s.kind == "rollback" else "none"),
            **({"sources": s.sources_view()} if s.sources > 1 else {}),  # a sharded push: who got how far
        }
        if self.want_rollback:
            err.details = {**(err.details or {}), "rollback_to": self.last_ready_version}
        self.outbox.append(
            Journal(
                "sync",
                {
                    "sync_id": s.sync_id,
                    "version": s.version,
                    "status": status,
                    "code": err.code.value,
                    "reason": err.message,
                    "by": by,
                    "buckets": s.bucket_count,
                    "bytes": s.byte_count,
                    "at": self.now,
                },
            )
        )
        err.state, err.version, err.sync_id = self.state.value, self.served_version, s.sync_id
        self.outbox.append(
            CompleteSync(
                s.sync_id, None, err, summary=self.last_sync, state=self.state.value, dirty=self.dirty
            )
        )
        self.remember_ended(s.sync_id, err.code.value, f"{status}: {err.message}")
        self.sync = None

    def conflict(self, err: WeightSyncError) -> None:
        """A source's seat claimed by another, or sharded sources that disagree: the running
        sync fails for every source at once with `err` (each hears it: its parked requests
        now, its next request with the sync's end), and the input that showed it is refused
        with `err` too (Result.refusal). During FINALIZING the sources are done: only refused."""
        if not self.admit(Trigger.CONFLICT):
            raise err
        self.close_failed(Trigger.CONFLICT, err)
        self.reply, self.later, self.refusal = None, False, err

    def close_ready(self, trigger: Trigger) -> None:
        """End the running sync READY: every participant finalized with the same digest."""
        s = self.sync
        if s is None or not s.finalized:
            raise make_error(ErrorCode.INTERNAL, "close_ready without a finalized sync")
        self.move(trigger, Outcome.ADVANCE, s)
        digest = next(iter(s.finalized.values())).digest
        if s.sources > 1 and s.plan is not None and s.plan not in self.plans:
            self.plans[s.plan] = dict(s.names)  # verified against the plan's hash at the last finish
        if s.kind == "sync" and self.limits.spool:
            self.outbox.append(SpoolCommit(s.sync_id, s.version, digest, s.probes, s.rank_digests()))
        self.last_ready_version, self.served_digest = s.version, digest
        self.served_scheme = DIGEST_SCHEME  # reported by engines of this daemon's protocol
        for eid, fin in s.finalized.items():
            x = self.engines[eid]
            x.version, x.digest, x.finalize_count, x.probes = (
                s.version,
                fin.digest,
                fin.finalize_count,
                fin.probes,
            )
            x.move(Life.SERVE)
        body = reply_body(
            FinishReply(
                **msgspec.structs.asdict(
                    syncs.summary(s, "READY" if s.kind == "sync" else "ROLLED_BACK", self.now)
                ),
                digest=digest,
                # the failed sync's record as it was, its rollback now done (it said pending)
                rolled_back_from={**s.rollback_of, "rollback": "done"} if s.rollback_of else None,
                engines=[
                    EngineFinal(
                        engine_id=eid,
                        digest=f.digest,
                        probes=[list(p) for p in f.probes],
                        finalize_count=f.finalize_count,
                        seconds=f.seconds,
                        phases=dict(f.phases),
                        pass_bytes=dict(f.pass_bytes),
                    )
                    for eid, f in sorted(s.finalized.items())
                ],
            )
        )
        self.last_sync = {**body, "at": self.now}
        self.outbox.append(
            Journal(
                "sync",
                {
                    "sync_id": s.sync_id,
                    "version": s.version,
                    "status": "READY",
                    "digest": digest,
                    "digest_scheme": DIGEST_SCHEME,
                    "buckets": s.bucket_count,
                    "bytes": s.byte_count,
                    "at": self.now,
                },
            )
        )
        self.outbox.append(
            CompleteSync(s.sync_id, body, summary=self.last_sync, state=self.state.value, dirty=self.dirty)
        )
        self.remember_ended(s.sync_id, None, "READY")
        for eid in s.participants:  # after the READY above is persisted (commands' order)
            self.tell_served(eid, s.sync_id)
        self.sync = None
        self.want_rollback = False
        self.catch_up_stale()  # engines that registered during the sync join now

    def tell_served(self, engine_id: str, sync_id: str = "") -> None:
        """An engine that hands versions to readers serves the daemon's served version:
        tell it so (the service sends it after this input's journal rows are durable)."""
        x = self.engines[engine_id]
        v, d = self.served_version, self.served_digest
        if (
            d is not None
            and x.served_notice
            and x.state == E.READY
            and v is not None
            and (x.version, x.digest) == (v, d)
        ):
            self.outbox.append(SendServed(engine_id, sync_id, v, d))

    # -- catch-up: one engine brought to the served version from the spool --------------
    def catch_up_stale(self) -> None:
        for x in sorted(self.engines.values(), key=lambda x: x.engine_id):
            if x.state == E.STALE and x.engine_id not in self.catchups:
                self.start_catchup(x.engine_id)

    def start_catchup(self, engine_id: str) -> None:
        x = self.engines[engine_id]
        sp = self.spooled
        if not self.can_roll_back() or sp is None or self.last_ready_version is None or x.state != E.STALE:
            return
        self._own_syncs += 1
        sync_id = f"catchup-{engine_id}-{self.run_id}-{self._own_syncs}"
        c = CatchUp(sync_id, self.last_ready_version, sp.buckets, self.now)
        self.catchups[engine_id] = c
        x.move(Life.JOIN)
        self.send_spooled(engine_id, c)
        # (its finalize carries the spooled version's canaries: `sync.loaded`)

    def send_spooled(self, engine_id: str, c: CatchUp) -> None:
        """The catch-up's next spooled buckets, keeping `recovery_window` in flight."""
        while c.sent < c.total and c.sent - c.applied < self.limits.recovery_window:
            self.outbox.append(SendSpooled(engine_id, c.sync_id, c.version, c.sent))
            c.sent += 1

    def end_catchup(self, engine_id: str, ok: bool, reason: str = "") -> None:
        c = self.catchups.pop(engine_id, None)
        if c is None:
            return
        x = self.engines.get(engine_id)
        if not ok:
            if x is not None and x.state != E.LOST:
                x.move(Life.DOUBT)
                x.version, x.digest = None, None
            self.outbox.append(SendAbort((engine_id,), c.sync_id))
        self.outbox.append(CatchUpDone(engine_id, c.sync_id, ok, reason))

    def catchup_of(self, engine_id: str, sync_id: str) -> CatchUp | None:
        """The catch-up `sync_id` of `engine_id` (its progress noted now), else None."""
        c = self.catchups.get(engine_id)
        if c is None or c.sync_id != sync_id:
            return None
        c.last_progress = self.now
        self.engines[engine_id].last_seen = self.now
        return c

    def new_own_sync_id(self, kind: str) -> str:
        self._own_syncs += 1
        return f"{kind}-{self.run_id}-{self._own_syncs}"

    def new_group_id(self) -> str:
        return self.kept_groups.new_id()

    def group_chosen(self, group: GroupRecord, shared: bool = True, conn: bytes = b"") -> None:
        self.kept_groups.chosen(group, shared, conn)

    def source_group(self, msg: Begin) -> GroupRecord | None:
        return self.kept_groups.of_source(msg)

    def trainer_closed(self, conn: bytes) -> None:
        """A trainer connection closed: the groups whose store it hosted are gone with it
        (status stops showing their store), except the running sync's own, which that
        sync's end drops (a trainer may come back within --trainer-grace)."""
        self.kept_groups.trainer_closed(conn, self.sync.groups.values() if self.sync is not None else ())

    def lose(self, engine_id: str, cause: str) -> None:
        """Count the engine lost, and say why (logged by the service)."""
        self.outbox.append(EngineLost(engine_id, cause))
        x = self.engines[engine_id]
        x.move(Life.LOSE)
        x.lost_at = self.now
        self.leave_group(engine_id)

    def leave_group(self, engine_id: str) -> None:
        self.kept_groups.leave(engine_id)


def _blamed(err: WeightSyncError) -> list[str]:
    """The engines a failure names (`engine_id`, `engine_ids`)."""
    d = err.details or {}
    one = d.get("engine_id")
    many = d.get("engine_ids") or []
    return sorted({*([one] if isinstance(one, str) else []), *(x for x in many if isinstance(x, str))})
