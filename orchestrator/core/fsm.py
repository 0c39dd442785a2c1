"""The orchestrator's core (docs/ARCHITECTURE.md): one pure state machine, h11 style.

Rules: `Core.handle(event, now)` is the only way in; it returns a `Result` (a reply body,
or None when the reply waits for the sync, plus commands for the service). No sockets,
threads, files or clocks here. The behaviour is the two tables below:
- every event fires the trigger of its name; `assess_<trigger>` (the machine's
  `prepare_event`) reads the event and writes what it found into the event's kwargs;
  conditions are pure predicates over those facts; `after` callbacks change records and
  append commands, and never raise or fire triggers;
- when no row of the table takes an event, `refusals.explain` says why with a typed
  error, and nothing changed;
- engines have their own lifecycle machine (ENGINE_TRANSITIONS over EngineRecord);
- recovery is in the table: the timer begins a rollback (`tick` from IDLE), a READY
  daemon brings a stale engine to its version (catch-up, a private sync per engine).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from transitions import EventData, Machine, MachineError

from messages.errors import ErrorCode, WeightSyncError, make_error
from orchestrator.core import events as ev
from orchestrator.core import refusals, syncs
from orchestrator.core.commands import (AckBucket, CatchUpAck, CatchUpDone, Command, CompleteSync,
                                   ForwardBucket, Journal, Result, SendAbort, SendFinalize,
                                   SpoolBegin, SpoolCommit, SpoolDiscard, StartCatchUp,
                                   StartRollback)
from orchestrator.core.records import (CatchUp, EngineRecord, EngineState, GroupPlan, Limits,
                                  Spooled, SyncRecord)
from orchestrator.core.states import ACTIVE, State

__all__ = ["State", "EngineState", "TRANSITIONS", "ENGINE_TRANSITIONS", "Core", "Orchestrator",
           "Limits", "Spooled", "Result", "Command", "AckBucket", "CatchUpAck", "CatchUpDone",
           "CompleteSync", "ForwardBucket", "Journal", "SendAbort", "SendFinalize", "SpoolBegin",
           "SpoolCommit", "SpoolDiscard", "StartCatchUp", "StartRollback", "ACTIVE", "TRIGGERS"]

S, E = State, EngineState
ANY = "*"
FAILS = "close_failed"

TRANSITIONS: list[dict[str, Any]] = [
    # a trainer's sync
    {"trigger": "begin", "source": ACTIVE, "dest": None, "conditions": "repeats_running_sync", "after": "reply_running"},
    {"trigger": "begin", "source": [S.IDLE, S.READY], "dest": S.LOADING_BUCKETS, "conditions": ["fresh_id", "newer_version", "enough_engines"], "after": "open_sync"},
    {"trigger": "bucket", "source": S.LOADING_BUCKETS, "dest": None, "conditions": ["for_running_sync", "resent"], "after": "reply_resent"},
    {"trigger": "bucket", "source": S.LOADING_BUCKETS, "dest": None, "conditions": ["for_running_sync", "acceptable_bucket"], "after": "forward_bucket"},
    {"trigger": "finish", "source": S.LOADING_BUCKETS, "dest": None, "conditions": ["for_running_sync", "sender_ok", "senders_left"], "after": "record_finish"},
    {"trigger": "finish", "source": S.LOADING_BUCKETS, "dest": S.FINALIZING, "conditions": ["for_running_sync", "sender_ok", "complete"], "before": "record_finish", "after": "send_finalize"},
    {"trigger": "abort", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": ["for_running_sync", "untouched_and_was_ready"], "after": FAILS},
    {"trigger": "abort", "source": ACTIVE, "dest": S.IDLE, "conditions": "for_running_sync", "after": FAILS},
    # engines
    {"trigger": "register", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": ["has_error", "untouched_and_was_ready"], "after": [FAILS, "add_engine"]},
    {"trigger": "register", "source": ACTIVE, "dest": S.IDLE, "conditions": "has_error", "after": [FAILS, "add_engine"]},
    {"trigger": "register", "source": S.READY, "dest": None, "after": "add_engine_to_ready"},
    {"trigger": "register", "source": ANY, "dest": None, "after": "add_engine"},
    {"trigger": "heartbeat", "source": ANY, "dest": None, "after": "note_heartbeat"},
    {"trigger": "loaded", "source": ANY, "dest": None, "after": "note_loaded"},
    {"trigger": "finalized", "source": S.FINALIZING, "dest": S.IDLE, "conditions": "has_error", "after": FAILS},
    {"trigger": "finalized", "source": S.FINALIZING, "dest": S.READY, "conditions": "last_to_finalize", "before": "record_finalized", "after": "close_ready"},
    {"trigger": "finalized", "source": S.FINALIZING, "dest": None, "conditions": "valid", "after": "record_finalized"},
    {"trigger": "finalized", "source": ANY, "dest": None, "after": "note_finalized"},
    {"trigger": "failed", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": ["has_error", "untouched_and_was_ready"], "after": FAILS},
    {"trigger": "failed", "source": ACTIVE, "dest": S.IDLE, "conditions": "has_error", "after": FAILS},
    {"trigger": "failed", "source": ANY, "dest": None, "after": "note_failed"},
    # the clock, the daemon's own observations, and recovery
    {"trigger": "tick", "source": S.IDLE, "dest": S.LOADING_BUCKETS, "conditions": "rollback_due", "after": ["mark_lost", "open_rollback"]},
    {"trigger": "tick", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": ["loading_overdue", "untouched_and_was_ready"], "after": ["mark_lost", FAILS]},
    {"trigger": "tick", "source": S.LOADING_BUCKETS, "dest": S.IDLE, "conditions": "loading_overdue", "after": ["mark_lost", FAILS]},
    {"trigger": "tick", "source": S.FINALIZING, "dest": S.IDLE, "conditions": "finalizing_overdue", "after": ["mark_lost", FAILS]},
    {"trigger": "tick", "source": ANY, "dest": None, "after": ["mark_lost", "expire_catchups"]},
    {"trigger": "trainer_gone", "source": S.LOADING_BUCKETS, "dest": None, "conditions": "for_running_sync", "after": "note_trainer_gone"},
    {"trigger": "trainer_gone", "source": ANY, "dest": None},
    {"trigger": "engine_gone", "source": ACTIVE, "dest": None, "conditions": "in_collective_sync", "after": "expire_engine"},
    {"trigger": "engine_gone", "source": ANY, "dest": None},
    {"trigger": "internal", "source": S.LOADING_BUCKETS, "dest": S.READY, "conditions": "untouched_and_was_ready", "after": FAILS},
    {"trigger": "internal", "source": ACTIVE, "dest": S.IDLE, "after": FAILS},
    {"trigger": "internal", "source": [S.IDLE, S.READY], "dest": None},
    {"trigger": "shutdown", "source": ACTIVE, "dest": S.IDLE, "after": FAILS},
    {"trigger": "shutdown", "source": [S.IDLE, S.READY], "dest": None},
    {"trigger": "spool_changed", "source": S.READY, "dest": None, "after": ["note_spooled", "catch_up_stale"]},
    {"trigger": "spool_changed", "source": ANY, "dest": None, "after": "note_spooled"},
]
TRIGGERS = ("begin", "bucket", "finish", "finalized", "failed", "abort")  # the trainer-visible grid

ENGINE_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "enlist", "source": [E.STALE, E.READY, E.JOINING], "dest": E.LOADING},
    {"trigger": "start_finalize", "source": E.LOADING, "dest": E.FINALIZING},
    {"trigger": "serve", "source": [E.FINALIZING, E.JOINING], "dest": E.READY},
    {"trigger": "restore", "source": [E.LOADING, E.FINALIZING], "dest": E.READY},
    {"trigger": "doubt", "source": [E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY], "dest": E.STALE},
    {"trigger": "join", "source": E.STALE, "dest": E.JOINING},
    {"trigger": "lose", "source": [E.STALE, E.JOINING, E.LOADING, E.FINALIZING, E.READY], "dest": E.LOST},
]


class Core(refusals.Explain):
    """The model both machines drive. Public API: `handle(event, now)`, `snapshot()`."""

    state: State  # set by the machine

    def __init__(self, limits: Limits | None = None, *, initial: State = S.IDLE,
                 served_version: int | None = None, served_digest: str | None = None,
                 dirty: bool = False, now: float = 0.0, run_id: str = "0") -> None:
        self.limits = limits or Limits()
        # Names the daemon's own syncs (rollback, catch-up): an engine outlives a daemon
        # restart and refuses a finalize for a sync_id it already ran.
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
        self.reply: dict[str, Any] | None = None
        self.now = now
        self.spooled: Spooled | None = None
        self.want_rollback = dirty  # a dirty start is repaired from the spool when it can be
        self.catchups: dict[str, CatchUp] = {}
        # Outcome (code, reason; None for READY) of ended syncs: a late message for one is
        # answered with it, and its id is never begun again.
        self.ended: OrderedDict[str, tuple[str | None, str]] = OrderedDict()
        self.group: GroupPlan | None = None  # the collective group syncs reuse (records.GroupPlan)
        self._groups = 0
        self._own_syncs = 0
        self.machine = Machine(model=self, states=State, transitions=TRANSITIONS, initial=initial,
                               auto_transitions=False, send_event=True,
                               prepare_event="assess", after_state_change="record_transition")
        self.engine_machine = Machine(model=[], states=EngineState, transitions=ENGINE_TRANSITIONS,
                                      initial=E.STALE, auto_transitions=False)

    # -- the one way in -----------------------------------------------------------------
    def handle(self, event: ev.Event, now: float) -> Result:
        """Apply `event`; raise a typed WeightSyncError (and change nothing) if refused."""
        self.now = now
        self.reply = None
        try:
            taken = self.trigger(event.TRIGGER, ev=event)  # type: ignore[attr-defined]
        except MachineError:
            taken = False
        if not taken:
            self.outbox = []
            raise self.explain(event)
        out, self.outbox = self.outbox, []
        return Result(self.reply, out)

    # -- assess: the facts an event brings, written into its kwargs (prepare_event) ------
    def assess(self, e: EventData) -> None:
        fn = getattr(self, "assess_" + e.event.name, None)
        if fn is not None:
            fn(e, e.kwargs["ev"])

    from orchestrator.core.core_assess import (assess_abort, assess_failed,  # noqa: E402
                                          assess_finalized, assess_internal, assess_register,
                                          assess_shutdown, assess_tick, _loading_deadline)

    # -- conditions (pure) --------------------------------------------------------------
    def has_error(self, e: EventData) -> bool:
        return "error" in e.kwargs

    def loading_overdue(self, e: EventData) -> bool:
        return self._fails_with(e, "loading_error")

    def finalizing_overdue(self, e: EventData) -> bool:
        return self._fails_with(e, "finalizing_error")

    @staticmethod
    def _fails_with(e: EventData, key: str) -> bool:
        """The row fails the sync with the error `assess_tick` found for its state."""
        if key in e.kwargs:
            e.kwargs.setdefault("error", e.kwargs[key])
            return True
        return False

    def valid(self, e: EventData) -> bool:
        return e.kwargs.get("valid", False)

    def for_running_sync(self, e: EventData) -> bool:
        return self.sync is not None and self.sync.sync_id == e.kwargs["ev"].sync_id

    def repeats_running_sync(self, e: EventData) -> bool:
        m = e.kwargs["ev"].msg
        return self.for_running_sync(e) and self.sync.version == m.version and self.sync.kind == "sync"

    def fresh_id(self, e: EventData) -> bool:
        return e.kwargs["ev"].sync_id not in self.ended

    def newer_version(self, e: EventData) -> bool:
        v = e.kwargs["ev"].msg.version
        return self.last_ready_version is None or v > self.last_ready_version

    def enough_engines(self, e: EventData) -> bool:
        return len(self.live_engines()) >= self.limits.min_engines

    def resent(self, e: EventData) -> bool:
        m, rec = e.kwargs["ev"].msg, None
        if m.sender < self.sync.senders:
            rec = self.sync.buckets.get((m.sender, m.seq))
        return rec is not None and rec.nbytes == e.kwargs["ev"].nbytes

    def acceptable_bucket(self, e: EventData) -> bool:
        m, s = e.kwargs["ev"].msg, self.sync
        return (m.sender < s.senders and (m.sender, m.seq) not in s.buckets
                and self.spec_refusal(m) is None)

    def in_collective_sync(self, e: EventData) -> bool:
        """A participant of a collective sync closed its connection: the group is broken."""
        s = self.sync
        return s is not None and s.group is not None and e.kwargs["ev"].engine_id in s.participants

    def sender_ok(self, e: EventData) -> bool:
        return e.kwargs["ev"].msg.sender < self.sync.senders

    def senders_left(self, e: EventData) -> bool:
        return len(self._finished_with(e)) < self.sync.senders

    def complete(self, e: EventData) -> bool:
        m = e.kwargs["ev"].msg
        return (syncs.incomplete_reason(self.sync, self._finished_with(e)) is None
                and (m.partial or syncs.missing_tensors(self.sync, self.engines) is None))

    def last_to_finalize(self, e: EventData) -> bool:
        s, eid = self.sync, e.kwargs["ev"].engine_id
        return e.kwargs.get("valid", False) and all(x in s.finalized or x == eid for x in s.participants)

    def untouched_and_was_ready(self, e: EventData) -> bool:
        s = self.sync
        return s is not None and not s.buckets and not self.dirty and self.last_ready_version is not None

    def rollback_due(self, e: EventData) -> bool:
        live = [x for x in self.engines.values() if x.state != E.LOST and x.engine_id not in e.kwargs["lost"]]
        return (self.want_rollback and self.dirty and self.can_roll_back()
                and len(live) >= max(1, self.limits.min_engines))

    # -- callbacks: change records, append commands; never raise, never trigger --------
    from orchestrator.core.core_callbacks import (add_engine, close_failed, close_ready,  # noqa: E402
                                             expire_catchups, forward_bucket, mark_lost,
                                             note_failed, note_finalized, note_heartbeat,
                                             note_loaded, note_spooled, note_trainer_gone,
                                             expire_engine,
                                             open_rollback, open_sync, record_finalized,
                                             add_engine_to_ready, catch_up_stale,
                                             record_finish, record_transition, reply_resent,
                                             reply_running, send_finalize)

    # -- helpers --------------------------------------------------------------------------
    def _finished_with(self, e: EventData) -> dict[int, int]:
        m = e.kwargs["ev"].msg
        return {**self.sync.finished, m.sender: m.buckets}

    def _participant(self, engine_id: str, sync_id: str) -> SyncRecord | None:
        s = self.sync
        if s is None or s.sync_id != sync_id or engine_id not in s.participants:
            return None
        x = self.engines.get(engine_id)
        return None if x is None or x.state == E.LOST else s

    def can_roll_back(self) -> bool:
        """The spool holds exactly the version last served (same digest)."""
        sp = self.spooled
        return (sp is not None and self.last_ready_version is not None
                and sp.version == self.last_ready_version and sp.digest == self.served_digest)

    @property
    def served_version(self) -> int | None:
        return None if self.dirty else self.last_ready_version

    def live_engines(self) -> list[EngineRecord]:
        return [x for x in self.engines.values() if x.state != E.LOST]

    def remember_ended(self, sync_id: str, code: str | None, reason: str) -> None:
        if code is not None and code not in ErrorCode.__members__:
            code = ErrorCode.INTERNAL.value
        self.ended[sync_id] = (code, reason)
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    def _error(self, code: ErrorCode, message: str, **details: Any) -> WeightSyncError:
        return make_error(code, message, state=self.state.value, version=self.served_version,
                          sync_id=self.sync.sync_id if self.sync else None, details=details or None)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state.value, "version": self.served_version,
                "last_ready_version": self.last_ready_version, "digest": self.served_digest,
                "dirty": self.dirty, "sync": self.sync.view() if self.sync else None,
                "last_sync": dict(self.last_sync) if self.last_sync else None,
                "engines": [x.view() for x in sorted(self.engines.values(), key=lambda x: x.engine_id)],
                "history": [dict(h) for h in self.history], "min_engines": self.limits.min_engines,
                "rollback_pending": self.want_rollback and self.can_roll_back(),
                "collective": self.group.view() if self.group else None}

    # -- named entry points (sugar over handle) ------------------------------------------
    def handle_begin(self, msg: Any, now: float) -> Result:
        return self.handle(ev.BeginSync(msg), now)

    def handle_bucket(self, msg: Any, nbytes: int, now: float) -> Result:
        return self.handle(ev.BucketIn(msg, nbytes), now)

    def handle_finish(self, msg: Any, now: float) -> Result:
        return self.handle(ev.FinishSync(msg), now)

    def handle_abort(self, sync_id: str, reason: str, now: float) -> Result:
        return self.handle(ev.AbortSync(sync_id, reason), now)

    def handle_register(self, msg: Any, now: float) -> Result:
        return self.handle(ev.EngineRegistered(msg), now)

    def handle_heartbeat(self, engine_id: str, now: float) -> Result:
        return self.handle(ev.Heartbeat(engine_id), now)

    def handle_loaded(self, engine_id: str, sync_id: str, key: tuple[int, int], now: float) -> Result:
        return self.handle(ev.Loaded(engine_id, sync_id, key), now)

    def handle_finalized(self, engine_id: str, msg: Any, now: float) -> Result:
        return self.handle(ev.EngineFinalized(engine_id, msg), now)

    def handle_failed(self, engine_id: str, msg: Any, now: float) -> Result:
        return self.handle(ev.EngineFailed(engine_id, msg), now)

    def tick(self, now: float) -> Result:
        return self.handle(ev.Tick(), now)

    maybe_rollback = tick  # the timer begins a due rollback (one row of the table)

    def handle_trainer_gone(self, sync_id: str, now: float) -> Result:
        return self.handle(ev.TrainerGone(sync_id), now)

    def handle_engine_gone(self, engine_id: str, now: float) -> Result:
        return self.handle(ev.EngineGone(engine_id), now)

    def handle_internal(self, reason: str, now: float) -> Result:
        return self.handle(ev.InternalError(reason), now)

    def handle_shutdown(self, now: float) -> Result:
        return self.handle(ev.Shutdown(), now)

    def set_spooled(self, spooled: Spooled | None) -> Result:
        return self.handle(ev.SpoolChanged(spooled), self.now)


Orchestrator = Core  # the name the service and older tests use
