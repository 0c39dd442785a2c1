"""A trainer's sync opened and fed: begin (a source joins, or the sync opens) and bucket
(checked, recorded, forwarded to every participant). How it completes (the engines'
reports, finish, the commit, abort) is `completion`; who may speak for a source, `seats`.

Theory of operation: a sync streams buckets to every participant (LOADING_BUCKETS); a
bucket is acknowledged to the trainer once every live participant applied it
(`completion.loaded`). The first begin opens the sync; a sharded push's other sources join
it with the same version, source count and plan, each holding its own seat.

Rules: each function first finds the facts and refuses (raises a typed error, having
changed nothing), then acts: records, commands, reply. Read top to bottom per trigger.
"""

from __future__ import annotations

from typing import Any

from messages import transports
from messages.errors import ErrorCode
from messages.fanout import max_bucket
from messages.replies import BeginReply, BucketAck, JsonObject
from messages.replies import body as reply_body
from messages.schema import DEFAULT_BUCKET_BYTES, MAX_COLLECTIVE_SOURCES, Begin, Bucket
from messages.specs import spec_refusal
from orchestrator.core import completion, seats, syncs
from orchestrator.core.commands import (
    AckBucket,
    ForwardBucket,
    Journal,
    OpenStreams,
    SpoolBegin,
    SyncOpened,
)
from orchestrator.core.events import (
    BeginSync,
    BucketIn,
)
from orchestrator.core.model import Model
from orchestrator.core.records import BucketRecord, SyncRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Outcome, Trigger

S, E = State, EngineState


# -- begin ----------------------------------------------------------------------------------
def begin(m: Model, event: BeginSync) -> None:
    msg, s = event.msg, m.sync
    claim = seats.claim(msg.seat, event.conn)
    if msg.source >= msg.sources:
        raise m.error(ErrorCode.BAD_MESSAGE, f"source {msg.source} out of range (sources={msg.sources})")
    if msg.transport != transports.AUTO and transports.get(msg.transport) is None:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"transport {msg.transport!r} is not one this daemon has "
            f"(auto, {', '.join(transports.names())}; --transport-modules adds others)",
        )
    if msg.sources > 1 and msg.sync_id in m.ended and (s is None or s.sync_id != msg.sync_id):
        # a source that comes to its sharded sync after it ended hears how it ended, at once
        # (not a new sync it would wait in alone until --sync-timeout)
        m.require_sync(msg.sync_id, f"source {msg.source}'s begin")
    if s is not None and s.kind == "sync" and msg.sources > 1 and s.sources > 1:
        if s.version != msg.version:  # the sources of one push disagree on what they push
            seats.conflict(
                m,
                s,
                msg.source,
                f"began version {msg.version}"
                + (f" under the same sync_id {s.sync_id!r}" if msg.sync_id == s.sync_id else ""),
                f"version {s.version}",
                "version",
            )
            return
        _join(m, s, msg, claim)  # another source of a sharded push: the sync is named for it
        return
    if s is not None and s.sync_id == msg.sync_id and s.version == msg.version and s.kind == "sync":
        if not seats.seat_holder(m, s, msg.source, claim, "begin"):
            return
        _reply_running(m, s, msg.source)  # a repeated begin (its reply was lost): answered again
        return
    # the facts the gate's refusal carries when a sync runs (begin is taken only without one)
    tail: str = ""
    details: dict[str, object] = {}
    if s is not None and s.kind == "rollback":
        tail = (
            f": the daemon is rolling the engines back to version {s.version} after a failed "
            f"sync; retry when it is READY"
        )
        details = {"rollback_running": True}
    elif s is not None:
        if s.sync_id == msg.sync_id:
            raise m.error(ErrorCode.BAD_MESSAGE, f"sync {msg.sync_id!r} was begun with version {s.version}")
        age = m.now - s.started_at
        tail = (
            f": sync {s.sync_id!r} (version {s.version}) has been running for {age:.0f}s; wait "
            f"for it, or end it with `weightsync abort --sync-id {s.sync_id}`"
        )
        details = {
            "running_sync_id": s.sync_id,
            "running_version": s.version,
            "running_seconds": round(age, 3),
        }
    m.admit(Trigger.BEGIN, tail, **details)
    if msg.sync_id in m.ended:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"sync_id {msg.sync_id!r} was used by an earlier sync; every begin needs a new sync_id",
        )
    if m.last_ready_version is not None and msg.version <= m.last_ready_version:
        raise m.error(
            ErrorCode.STALE_VERSION,
            f"version {msg.version} is not newer than served version {m.last_ready_version}",
        )
    live = len(m.live_engines())
    if live < m.limits.min_engines:
        lost = sorted(x.engine_id for x in m.engines.values() if x.state == E.LOST)
        raise m.error(
            ErrorCode.NO_ENGINES,
            f"{live} live engine(s) of {len(m.engines)} registered, {m.limits.min_engines} required"
            + (f" (lost: {', '.join(lost[:8])}{', ...' if len(lost) > 8 else ''})" if lost else ""),
            live=live,
            registered=len(m.engines),
        )
    if msg.base is not None:
        _check_base(m, msg)
    # taken: every live engine takes part; the transport is planned for all of them
    m.move(Trigger.BEGIN, Outcome.ADVANCE, None, version=msg.version, sync_id=msg.sync_id)
    s = m.open_sync(
        msg.sync_id, msg.version, sources=msg.sources, expected=msg.expected_buckets, probes=msg.probes
    )
    s.begun[msg.source], s.plan, s.host = m.now, msg.plan, msg.host
    s.seats[msg.source] = claim
    s.heard(msg.source, m.now)
    # A sharded push's sources each broadcast from a group of their own (rank 0 the source,
    # the engines after it): a group's broadcast needs every rank in every call, so one group
    # holds one source. The engines take the groups' buckets in the order announced here.
    current = m.group if msg.sources == 1 else m.source_group(msg)
    group = (
        syncs.choose_group(msg, s.participants, m.engines, current, m.new_group_id(), m.limits.bucket_timeout)
        if msg.sources <= MAX_COLLECTIVE_SOURCES
        else None
    )
    if group is not None:
        m.group_chosen(group, shared=msg.sources == 1, conn=event.conn)
        s.group, s.carries = group, "group"
        s.transport = next(t.name for t in transports.of_kind("group"))
        s.groups[msg.source] = group
        s.stream = syncs.can_stream(msg, s.participants, m.engines)
    else:
        via, s.ref_engines, s.mixed = syncs.choose_refs(msg, s.participants, m.engines, m.limits.host)
        if via:
            s.transport, s.via, s.carries = via, via, "ref"
    s.bucket_bytes = _bucket_size(m, msg, s)
    m.outbox.append(SyncOpened(s.sync_id, s.version, "sync", s.carries, s.mixed, m.limits.spool, s.stream))
    if s.stream and s.group is not None:  # engines hear of this sync once, not per bucket
        m.outbox.append(OpenStreams(s.sync_id, s.version, s.participants, s.group))
    if m.limits.spool:
        m.outbox.append(SpoolBegin(msg.sync_id, msg.version, msg.base))
    m.outbox.append(
        Journal(
            "sync",
            {
                "sync_id": msg.sync_id,
                "version": msg.version,
                "status": "LOADING_BUCKETS",
                "kind": "sync",
                "at": m.now,
            },
        )
    )
    m.reply = _begin_reply(m, s)


def _bucket_size(m: Model, msg: Begin, s: SyncRecord) -> int | None:
    """The sync's largest bucket frame: the opener's size (or the default) within what the
    fan-out's per-connection queue holds for the sync's sources, so that what a frozen
    engine's queue holds is bounded in bytes (messages.fanout.max_bucket). Every source
    cuts at most this (the begin reply says it; a larger tensor is split); a larger frame
    is refused. None for a group: no byte of it queues in the daemon."""
    if s.carries == "group":
        return None
    size = msg.bucket_bytes or DEFAULT_BUCKET_BYTES
    if m.limits.fanout_bytes is not None:
        size = min(size, max_bucket(m.limits.fanout_bytes, s.sources))
    return size


def _check_base(m: Model, msg: Begin) -> None:
    """A delta sync needs the fleet at its base: every live engine serving it with a base
    copy, each able to rebuild on the transport, and a spool that can replay base + deltas."""
    served = m.last_ready_version
    if m.state != S.READY or served != msg.base:
        raise m.error(
            ErrorCode.STALE_BASE,
            f"the delta applies to version {msg.base}, the fleet serves "
            f"{'no verified version' if m.state != S.READY else served}; push dense",
            served_version=served if m.state == S.READY else None,
        )
    for x in m.live_engines():
        why = None
        if not x.delta:
            why = (
                "keeps no base copy (start it with --delta-base; a sync its own workers "
                "received by broadcast leaves none until a sync it sees)"
            )
        elif x.state != E.READY or x.version != served:
            why = f"is {x.state.value} at version {x.version}"
        elif msg.offer is not None and not x.collective_stream:  # may be planned a group
            why = "receives broadcast buckets in its own workers, which rebuild no patch"
        if why is not None:
            raise m.error(
                ErrorCode.STALE_BASE, f"engine {x.engine_id} {why}; push dense", engine_id=x.engine_id
            )
    sp = m.spooled
    if m.limits.spool and not m.can_roll_back():
        scheme = m.scheme_error()
        why = (
            f"the spool does not hold version {served}"
            if scheme is None
            else f"version {served}'s digest is of another digest scheme ({scheme.code.value})"
        )
        raise m.error(ErrorCode.STALE_BASE, f"{why}; push dense")
    if m.limits.spool and sp is not None and sp.chain >= m.limits.max_delta_chain:
        raise m.error(
            ErrorCode.STALE_BASE,
            f"the spool holds {sp.chain} deltas on top of its last dense version "
            f"(max_delta_chain {m.limits.max_delta_chain}); push dense",
        )


def _reply_running(m: Model, s: SyncRecord, source: int) -> None:
    s.heard(source, m.now)
    m.reply = _begin_reply(m, s, repeated=True, source=source)


def _join(m: Model, s: SyncRecord, msg: Begin, claim: tuple[str, object]) -> None:
    """A source of a sharded push begins the version another source opened: it takes part
    in that sync (its reply names the sync_id), once its count and plan agree and its seat
    is free or its own. Every disagreement fails the sync for every source (`seats.conflict`)."""
    if msg.sources != s.sources:
        seats.conflict(
            m, s, msg.source, f"began with {msg.sources} sources", f"{s.sources} sources", "sources"
        )
        return
    if msg.plan != s.plan:
        seats.conflict(
            m,
            s,
            msg.source,
            f"planned the assignment {msg.plan} (every source must assign the tensors the same way)",
            f"plan {s.plan}",
            "plan",
        )
        return
    if msg.source in s.seats:
        if seats.seat_holder(m, s, msg.source, claim, "begin"):
            _reply_running(m, s, msg.source)  # this source's repeated begin (its reply was lost)
        return
    if m.state != S.LOADING_BUCKETS:
        _reply_running(m, s, msg.source)
        return
    group = None
    if s.carries == "group":  # this source broadcasts from a group of its own
        group = syncs.choose_group(
            msg, s.participants, m.engines, m.source_group(msg), m.new_group_id(), m.limits.bucket_timeout
        )
        if group is None:
            raise m.error(
                ErrorCode.BAD_MESSAGE,
                f"sync {s.sync_id!r} goes by {s.transport}: source {msg.source} must offer its store "
                f"(transport={s.transport}) with a backend every engine speaks",
                sync_id_running=s.sync_id,
            )
        m.group_chosen(group, shared=False)
        s.groups[msg.source] = group
    s.begun[msg.source] = m.now
    s.seats[msg.source] = claim
    s.heard(msg.source, m.now)
    m.reply = _begin_reply(m, s, host=msg.host, source=msg.source)


def _begin_reply(
    m: Model, s: SyncRecord, repeated: bool = False, host: str | None = None, source: int = 0
) -> JsonObject:
    """The begin reply (messages.replies.BeginReply), built here only: the sync as opened
    and the limits each source's window keeps within (its share of max_pending and, with a
    fan-out, of the fan-out's per-connection budget: messages.fanout.window_cap)."""
    sources = max(1, s.sources)
    lim = m.limits
    # a joining source on another host than the one the transport was planned for cannot
    # lend the engines its references: its buckets go as frames
    away = host is not None and host != s.host and s.carries == "ref"
    return reply_body(
        BeginReply(
            sync_id=s.sync_id,
            version=s.version,
            state=m.state.value,
            kind=s.kind,
            transport=transports.FRAMES if away else s.shown,
            engines=tuple(s.participants),
            ref_engines=() if away else tuple(s.ref_engines),
            via="" if away else s.via,
            group=g.view() if (g := s.groups.get(source, s.group)) else None,
            stream=s.stream,
            # a group: the trainer sends the daemon a copy of each bucket to spool
            spool_copy=lim.spool if s.group is not None else False,
            repeated=repeated,
            buckets=s.bucket_count,
            bytes=s.byte_count,
            acked=sum(1 for b in s.buckets.values() if b.done),
            started_at=s.started_at,
            trainer_connected=s.trainer_lost_at is None,
            prepared=len(s.prepared),
            max_pending=lim.pending_per_source(sources),
            fanout_bytes=lim.fanout_bytes // sources if lim.fanout_bytes is not None else None,
            bucket_bytes=s.bucket_bytes,
            layouts=_layouts(m, s),
        )
    )


def _layouts(m: Model, s: SyncRecord) -> dict[str, tuple[dict[str, Any], ...]]:
    """The participants' layouts by key when every one takes slices (else none: an engine
    that takes whole tensors needs every tensor whole, and the others cut theirs from it)."""
    out: dict[str, tuple[dict[str, Any], ...]] = {}
    for eid in s.participants:
        x = m.engines.get(eid)
        if x is None or not x.layout or x.slices is None:
            return {}
        out[str(x.slices["key"])] = x.layout
    return out


# -- bucket ---------------------------------------------------------------------------------
def bucket(m: Model, event: BucketIn) -> None:
    msg, lim = event.msg, m.limits
    if event.nbytes > lim.max_frame_bytes:
        raise m.error(
            ErrorCode.TOO_LARGE,
            f"bucket frame of {event.nbytes} bytes exceeds "
            f"max_frame_bytes {lim.max_frame_bytes}; use smaller buckets",
        )
    s = m.require_sync(msg.sync_id, "bucket")
    m.require_own(s, event.conn, f"bucket (seq {msg.seq})")
    if s.bucket_bytes is not None and msg.size is None and event.nbytes > s.bucket_bytes:
        raise m.error(
            ErrorCode.TOO_LARGE,
            f"bucket seq {msg.seq} of source {msg.source} is {event.nbytes} bytes; this sync's buckets "
            f"are at most {s.bucket_bytes} (the begin reply's bucket_bytes: split larger tensors, "
            f"as TrainerClient.push does)",
            bucket_bytes=s.bucket_bytes,
        )
    limit = lim.pending_per_source(s.sources)
    if event.pending >= limit:
        raise m.error(
            ErrorCode.TOO_LARGE,
            f"{event.pending} bucket requests already pending on "
            f"this connection (max_pending {limit}); lower the window",
        )
    m.admit(Trigger.BUCKET)
    seats.check_source(m, s, msg.source)
    if not seats.seat_holder(m, s, msg.source, seats.claim(msg.seat, event.conn), f"bucket (seq {msg.seq})"):
        return
    _check_route(m, s, event)
    key = (msg.source, msg.seq)
    rec = s.buckets.get(key)
    if rec is not None and (rec.checksum != msg.checksum or rec.nbytes != event.nbytes):
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"source {msg.source} resent bucket seq {msg.seq} with other bytes (checksum "
            f"{msg.checksum:#018x}, {event.nbytes} bytes) than it first sent (checksum "
            f"{rec.checksum:#018x}, {rec.nbytes} bytes): a resend must repeat its bucket; the "
            f"first stands",
            source=msg.source,
            seq=msg.seq,
        )
    if rec is not None:  # a resend: acknowledged now if every engine applied it, else when they have
        s.heard(msg.source, m.now)
        if rec.done:
            m.reply = reply_body(BucketAck(seq=msg.seq, source=msg.source, duplicate=True))
        else:
            m.later = True
        return
    _check_spec(m, s, msg)
    if s.sources > 1:
        seats.check_owner(m, s, msg)
    m.later = True  # acknowledged once every engine applied it (AckBucket)
    s.heard(msg.source, m.now)
    s.buckets[key] = BucketRecord(event.nbytes, m.now, msg.checksum)
    k = s.forwarded.get(msg.source, -1)
    while (msg.source, k + 1) in s.buckets:
        k += 1
    s.forwarded[msg.source] = k
    s.nbytes += event.nbytes
    s.names.update((t.name, msg.source) for t in msg.tensors)
    for t in msg.tensors:
        s.parts.setdefault(t.name, set()).add(t.box)
    if s.stream:  # a spool copy: the engines have the bytes from the stream
        s.buckets[key].done = True
        m.outbox.append(
            ForwardBucket(
                s.sync_id,
                key,
                s.version,
                (),
                group=s.groups.get(msg.source, s.group),
                spool=True,
                handle=event.handle,
            )
        )
        m.outbox.append(AckBucket(s.sync_id, key, completion.advance_acked(s, msg.source)))
        return
    alive = s.alive(m.engines, m.epoch)[0]
    m.outbox.append(
        ForwardBucket(
            s.sync_id,
            key,
            s.version,
            alive,
            ref_engines=s.ref_engines if msg.ref is not None else (),
            group=s.groups.get(msg.source, s.group),  # a sharded push: the bucket's source's group
            spool=m.limits.spool and s.kind == "sync",
            handle=event.handle,
        )
    )


def _check_route(m: Model, s: SyncRecord, event: BucketIn) -> None:
    """The bucket travels the way its sync negotiated (messages.transports: what each
    transport carries), and its bytes hashed right."""
    msg, grouped = event.msg, s.carries == "group"
    if msg.size is not None and not grouped:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"a bucket announced by its size (a broadcast), but this sync did not negotiate a "
            f"group: it goes by {s.shown} (begin with a transport that needs one, or auto, and an offer)",
        )
    if msg.size is None and grouped:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"this sync's buckets travel by {s.transport}'s broadcast: send their size, "
            f"not their bytes or a reference",
        )
    if msg.ref is not None and (s.carries != "ref" or transports.ref_name(msg.ref.via) != s.via):
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"a bucket by reference ({transports.ref_name(msg.ref.via)}), but this sync did not "
            f"negotiate it: it goes by {s.shown} (begin with that transport, or auto, from the engines' host)",
        )
    if event.ref_error is not None:
        raise m.error(ErrorCode.BAD_MESSAGE, f"bucket seq {msg.seq}: {event.ref_error}")
    if s.stream and not m.limits.spool:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this sync's buckets travel on the group's stream, framed by the trainer: "
            "the daemon takes no bucket of it (it does not spool)",
        )
    if msg.size is not None and m.limits.spool and s.kind == "sync" and not event.has_payload:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this daemon spools: a broadcast bucket must carry "
            "a copy of its bytes (begin's reply says spool_copy)",
        )
    if event.checksum_ok is False:
        where = (
            "the spool copy" if grouped else "the reference's bytes" if msg.ref is not None else "the frame"
        )
        raise m.error(
            ErrorCode.CHECKSUM_MISMATCH,
            f"bucket seq {msg.seq}: checksum does not match {where}; nothing applied",
        )


def _check_spec(m: Model, s: SyncRecord, msg: Bucket) -> None:
    """Refuse a bucket some participant would refuse, before any engine sees it (once
    per distinct spec and cast rule: a fleet of one model costs one check)."""
    seen: set[tuple[int, bool]] = set()
    for eid in s.participants:
        x = m.engines[eid]
        if not x.spec or (id(x.spec), x.cast_ok) in seen:
            continue
        seen.add((id(x.spec), x.cast_ok))
        for t in msg.tensors:
            refused = spec_refusal(x.spec, t.name, t.dtype, tuple(t.shape), x.cast_ok)
            if refused is not None:
                code, why = refused
                raise m.error(code, f"engine {eid}: {why}", engine_id=eid, tensor=t.name)
