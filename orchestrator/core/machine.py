"""The core: `Core.handle(event, now)` is the only way in (h11 style: no I/O, no clocks).

Rules: each event type goes to its trigger function (`sync`, `fleet`, `clock`), which
refuses with a typed error having changed nothing, or acts: records, commands, a reply.
State changes go through the table (`core.table`), checked before they happen. A refused
event leaves the core exactly as it was, outbox included, with one exception: an input
that fails the running sync for everyone it belongs to (a second claim on a source's seat)
is refused in `Result.refusal` along with the commands that end the sync. A bug inside a trigger is
raised to the service, which fails the running sync with INTERNAL (`InternalError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Never, cast

from messages.errors import WeightSyncError
from orchestrator.core import clock, completion, fleet, sync
from orchestrator.core import events as ev
from orchestrator.core.commands import Result
from orchestrator.core.model import Model

# Each event type's trigger function, which takes that type only: as a value of this table
# it accepts no event the type checker could prove right (`Never`); `handle` looks one up by
# the event's own type, the table's one invariant, and calls it with that event.
HANDLERS: dict[type[ev.Event], Callable[[Model, Never], None]] = {
    ev.BeginSync: sync.begin,
    ev.BucketIn: sync.bucket,
    ev.FinishSync: completion.finish,
    ev.AbortSync: completion.abort,
    ev.Loaded: completion.loaded,
    ev.EnginePrepared: completion.prepared,
    ev.EngineFinalized: completion.finalized,
    ev.EngineCommitted: completion.committed,
    ev.EngineFailed: completion.failed,
    ev.EngineRegistered: fleet.register,
    ev.Heartbeat: fleet.heartbeat,
    ev.EngineGone: fleet.engine_gone,
    ev.Tick: clock.tick,
    ev.TrainerGone: clock.trainer_gone,
    ev.InternalError: clock.internal,
    ev.Shutdown: clock.shutdown,
    ev.SpoolChanged: clock.spool_changed,
}


class Core(Model):
    """The records (`Model`) and the one entry point. Public queries: `state`,
    `served_version`, `snapshot(now)`, `error(code, message)`."""

    def next_wake(self) -> float | None:
        """The first instant at which a tick acts (`clock.next_wake`, the earliest of
        `clock.deadlines`): before it, and without an input, a tick changes nothing; the
        daemon sleeps until it or the next input. None: no deadline runs. Ask again after
        every `handle`: an input may move it."""
        return clock.next_wake(self)

    def handle(self, event: ev.Event, now: float) -> Result:
        """Apply `event` at time `now`; raise a typed WeightSyncError (and change
        nothing) if it is refused."""
        self.now = now
        self.reply, self.later, self.refusal = None, False, None
        self.outbox = []
        try:
            handler = cast("Callable[[Model, ev.Event], None]", HANDLERS[type(event)])
            handler(self, event)
        except WeightSyncError:
            self.outbox = []
            raise
        out, self.outbox = self.outbox, []
        return Result(self.reply, out, self.later, self.refusal)
