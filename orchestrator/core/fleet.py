"""The engines, trigger by trigger: register, heartbeat, and a closed connection.

Theory of operation: an engine registers (again after a restart or a reconnect) and
heartbeats; the daemon keeps one record per engine id. One registering while READY
either already serves the daemon's version (same version and digest) or is brought to it
from the spool (a catch-up, `Model.start_catchup`). A participant that registers again
mid-sync restarted and lost its buckets: the sync fails. An engine id held by another
live process on an open connection is refused (DUPLICATE_ENGINE); one whose holder's
connection closed (its grace running) is taken by the new process at once. Lost engines are found
by the clock (`clock.tick`); an engine that says goodbye is lost at the next tick, one
whose connection closed without it `engine_grace` seconds later unless it is heard from
again meanwhile (a reconnect), in both cases without waiting out its heartbeats.

Rules: as in `sync`: refuse first (changing nothing), then act.
"""

from __future__ import annotations

from messages.errors import ErrorCode
from messages.replies import HeartbeatReply, RegisterReply
from messages.replies import body as reply_body
from messages.schema import ParamSpec
from messages.slices import layout_refusal
from orchestrator.core.events import EngineGone, EngineRegistered, Heartbeat
from orchestrator.core.model import Model
from orchestrator.core.records import EngineRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Trigger

S, E = State, EngineState


def register(m: Model, event: EngineRegistered) -> None:
    msg = event.msg
    old, s = m.engines.get(msg.engine_id), m.sync
    refused = None if msg.slices is None else layout_refusal(msg.slices, {p.name: p for p in msg.spec})
    if refused is not None:  # a sender would cut by it: refused before anything changes
        raise m.error(ErrorCode.BAD_MESSAGE, f"register.slices: {refused}")
    if (
        old is not None
        and event.other_connection
        and old.state != E.LOST
        and not old.closed  # its connection closed (the grace runs): the id is free
        and (old.host, old.pid) != (msg.host, msg.pid)
    ):
        raise m.error(
            ErrorCode.DUPLICATE_ENGINE,
            f"engine id {msg.engine_id!r} is held by a live engine (pid {old.pid} on "
            f"{old.host or '?'}); give this one another --engine-id, or stop the other",
            holder_host=old.host,
            holder_pid=old.pid,
        )
    if old is not None and s is not None and msg.engine_id in s.participants and old.state != E.LOST:
        # The same id registering mid-sync: the process restarted and lost its buckets.
        m.close_failed(
            Trigger.REGISTER,
            m.error(
                ErrorCode.ENGINE_FAILED,
                f"engine {msg.engine_id} re-registered during the sync",
                engine_id=msg.engine_id,
            ),
        )
    ready = m.state == S.READY
    current = (
        ready
        and msg.version is not None
        and msg.version == m.served_version
        and msg.digest == m.served_digest
    )
    rec = EngineRecord(
        msg.engine_id,
        msg.backend,
        msg.model,
        msg.host,
        msg.pid,
        tuple(msg.transports),
        state=E.READY if current else E.STALE,
        version=msg.version,
        digest=msg.digest,
        finalize_count=msg.finalize_count,
        last_seen=m.now,
        epoch=m.epoch,
        spec=_shared_spec(m, msg.spec),
        cast_ok=msg.cast_ok,
        collective_ranks=msg.collective_ranks,
        collective_backends=tuple(msg.collective_backends),
        collective_stream=msg.collective_stream,
        labels=msg.labels,
        delta=msg.delta,
        served_notice=msg.served_notice,
        slices=None
        if msg.slices is None
        else {"key": msg.slices.key, "rank_bytes": list(msg.slices.rank_bytes)},
        layout=tuple(dict(r) for r in msg.slices.ranks) if msg.slices is not None else (),
    )
    # A catch-up in flight for this id is over (its process restarted, or it was lost):
    # end it so its feed stops, then start afresh below if the engine is stale.
    m.end_catchup(msg.engine_id, False, "engine registered again")
    m.leave_group(msg.engine_id)  # a new process: the group's ranks for it are gone
    m.engines[msg.engine_id] = rec
    if ready and rec.state == E.STALE:
        m.start_catchup(msg.engine_id)
    elif current:  # it holds the served version (the daemon restarted, or it reconnected)
        m.tell_served(msg.engine_id)
    m.reply = reply_body(
        RegisterReply(
            engine_id=msg.engine_id,
            state=rec.state.value,
            daemon_state=m.state.value,
            version=m.served_version,
        )
    )


def _shared_spec(m: Model, spec: tuple[ParamSpec, ...]) -> dict[str, ParamSpec]:
    """The spec as a dict, the same object for every engine that sent the same spec."""
    return m.specs.setdefault(tuple(spec), {p.name: p for p in spec})  # an LRU of SPECS_KEPT


def heartbeat(m: Model, event: Heartbeat) -> None:
    x = m.engines.get(event.engine_id)
    if not event.registered_here or x is None or x.state == E.LOST:
        m.reply = reply_body(HeartbeatReply(known=False))  # the engine registers again
        return
    x.last_seen, x.closed = m.now, False  # known: no answer (silence means known)
    x.server_error = event.server_error  # status shows it; it no longer counts as serving


def engine_gone(m: Model, event: EngineGone) -> None:
    """An engine that said goodbye is counted lost at the next tick (the service ticks
    right after this input); one whose connection closed without it (a killed process, a
    reset link), `engine_grace` seconds later unless heard from meanwhile: either way
    without waiting out its heartbeats. A closed connection lost whatever was queued on
    it, so a running sync fails for it then, and a sync that begins after it does not wait
    for it. A live process (a reconnect) is told it is unknown at its next heartbeat,
    registers again and catches up (or serves at once if it holds the served version)."""
    x = m.engines.get(event.engine_id)
    if x is None or x.state == E.LOST:
        return
    x.closed = True  # said when it is counted lost
    if event.goodbye:
        x.goodbye, x.last_seen = True, float("-inf")
    else:  # the clock's ENGINE_SILENT deadline (last_seen + engine_timeout) comes in engine_grace
        x.last_seen = min(x.last_seen, m.now - m.limits.engine_timeout + m.limits.engine_grace)
