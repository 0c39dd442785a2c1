"""A trainer's sync, trigger by trigger: begin, bucket, finish, abort, and the engines'
answers about it (loaded, finalized, failed).

Theory of operation: a sync streams buckets to every participant (LOADING_BUCKETS); a
bucket is acknowledged to the trainer once every live participant applied it. `finish`
moves to FINALIZING only when every sender finished and every announced bucket is
applied everywhere (the participants are prepared); then each participant is told to
finalize exactly once (the commit), and the last valid `finalized` makes the daemon
READY. Anything else that goes wrong before READY fails the sync (`Model.close_failed`).

Rules: each function first finds the facts and refuses (raises a typed error, having
changed nothing), then acts: records, commands, reply. Read top to bottom per trigger.
"""

from __future__ import annotations

from typing import Any

from messages.checksums import add_digests
from messages.errors import ErrorCode
from messages.fanout import max_bucket
from messages.replies import BeginReply, BucketAck
from messages.replies import body as reply_body
from messages.schema import DEFAULT_BUCKET_BYTES, MAX_COLLECTIVE_SOURCES, Begin, Bucket, spec_refusal
from messages.shardplan import plan_key
from orchestrator.core import syncs
from orchestrator.core.commands import (
    AckBucket,
    ForwardBucket,
    Journal,
    OpenStreams,
    SendCommit,
    SendFinalize,
    SpoolBegin,
    SyncOpened,
)
from orchestrator.core.events import (
    AbortSync,
    BeginSync,
    BucketIn,
    EngineCommitted,
    EngineFailed,
    EngineFinalized,
    EnginePrepared,
    FinishSync,
    Loaded,
)
from orchestrator.core.model import Model
from orchestrator.core.records import BucketRecord, SyncRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Outcome

S, E = State, EngineState


# -- begin ----------------------------------------------------------------------------------
def begin(m: Model, event: BeginSync) -> None:
    msg, s = event.msg, m.sync
    claim = _claim(msg.seat, event.conn)
    if msg.sender >= msg.senders:
        raise m.error(ErrorCode.BAD_MESSAGE, f"sender {msg.sender} out of range (senders={msg.senders})")
    if msg.senders > 1 and msg.sync_id in m.ended and (s is None or s.sync_id != msg.sync_id):
        # a source that comes to its sharded sync after it ended hears how it ended, at once
        # (not a new sync it would wait in alone until --sync-timeout)
        m.require_sync(msg.sync_id, f"source {msg.sender}'s begin")
    if s is not None and s.kind == "sync" and msg.senders > 1 and s.senders > 1:
        if s.version != msg.version:  # the sources of one push disagree on what they push
            _conflict(
                m,
                s,
                msg.sender,
                f"began version {msg.version}"
                + (f" under the same sync_id {s.sync_id!r}" if msg.sync_id == s.sync_id else ""),
                f"version {s.version}",
                "version",
            )
            return
        _join(m, s, msg, claim)  # another source of a sharded push: the sync is named for it
        return
    if s is not None and s.sync_id == msg.sync_id and s.version == msg.version and s.kind == "sync":
        if not _seat_holder(m, s, msg.sender, claim, "begin"):
            return
        _reply_running(m, s, msg.sender)  # a repeated begin (its reply was lost): answered again
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
    m.admit("begin", tail, **details)
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
    m.move("begin", Outcome.ADVANCE, None, version=msg.version, sync_id=msg.sync_id)
    s = m.open_sync(
        msg.sync_id, msg.version, senders=msg.senders, expected=msg.expected_buckets, probes=msg.probes
    )
    s.begun[msg.sender], s.plan, s.host = m.now, msg.plan, msg.host
    s.seats[msg.sender] = claim
    s.heard(msg.sender, m.now)
    # A sharded push's sources each broadcast from a group of their own (rank 0 the source,
    # the engines after it): a group's broadcast needs every rank in every call, so one group
    # holds one sender. The engines take the groups' buckets in the order announced here.
    current = m.group if msg.senders == 1 else m.source_group(msg)
    group = (
        syncs.plan_group(msg, s.participants, m.engines, current, m.new_group_id(), m.limits.bucket_timeout)
        if msg.senders <= MAX_COLLECTIVE_SOURCES
        else None
    )
    if group is not None:
        m.group_planned(group, shared=msg.senders == 1, conn=event.conn)
        s.group, s.transport = group, "collective"
        s.groups[msg.sender] = group
        s.stream = syncs.can_stream(msg, s.participants, m.engines)
    else:
        s.shm_engines, s.transport = syncs.plan_transport(msg, s.participants, m.engines, m.limits.host)
    s.bucket_bytes = _bucket_size(m, msg, s)
    m.outbox.append(SyncOpened(s.sync_id, s.version, "sync", s.transport, m.limits.spool, s.stream))
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
    is refused. None on the collective: no byte of it queues in the daemon."""
    if s.transport == "collective":
        return None
    size = msg.bucket_bytes or DEFAULT_BUCKET_BYTES
    if m.limits.fanout_bytes is not None:
        size = min(size, max_bucket(m.limits.fanout_bytes, s.senders))
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
                "keeps no base copy (start it with --delta-base; a collective sync its own "
                "workers received leaves none until a sync it sees)"
            )
        elif x.state != E.READY or x.version != served:
            why = f"is {x.state.value} at version {x.version}"
        elif msg.collective is not None and not x.collective_stream:  # may be planned collective
            why = "receives collective buckets in its own workers, which rebuild no patch"
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


def _reply_running(m: Model, s: SyncRecord, sender: int) -> None:
    s.heard(sender, m.now)
    m.reply = _begin_reply(m, s, repeated=True, sender=sender)


def _join(m: Model, s: SyncRecord, msg: Begin, claim: tuple[str, object]) -> None:
    """A source of a sharded push begins the version another source opened: it takes part
    in that sync (its reply names the sync_id), once its count and plan agree and its seat
    is free or its own. Any disagreement fails the sync for every source (`_conflict`)."""
    if msg.senders != s.senders:
        _conflict(m, s, msg.sender, f"began with {msg.senders} sources", f"{s.senders} sources", "senders")
        return
    if msg.plan != s.plan:
        _conflict(
            m,
            s,
            msg.sender,
            f"planned the assignment {msg.plan} (every source must assign the tensors the same way)",
            f"plan {s.plan}",
            "plan",
        )
        return
    if msg.sender in s.seats:
        if _seat_holder(m, s, msg.sender, claim, "begin"):
            _reply_running(m, s, msg.sender)  # this source's repeated begin (its reply was lost)
        return
    if m.state != S.LOADING_BUCKETS:
        _reply_running(m, s, msg.sender)
        return
    group = None
    if s.transport == "collective":  # this source broadcasts from a group of its own
        group = syncs.plan_group(
            msg, s.participants, m.engines, m.source_group(msg), m.new_group_id(), m.limits.bucket_timeout
        )
        if group is None:
            raise m.error(
                ErrorCode.BAD_MESSAGE,
                f"sync {s.sync_id!r} goes by the collective: source {msg.sender} must offer its store "
                f"(transport=collective) with a backend every engine speaks",
                sync_id_running=s.sync_id,
            )
        m.group_planned(group, shared=False)
        s.groups[msg.sender] = group
    s.begun[msg.sender] = m.now
    s.seats[msg.sender] = claim
    s.heard(msg.sender, m.now)
    m.reply = _begin_reply(m, s, host=msg.host, sender=msg.sender)


# -- a source's seat ------------------------------------------------------------------------
# Theory of operation: a source's seat (its index in a sync, 0 for a plain push) belongs to
# whoever began it: the begin's `seat` token (a random number the trainer chooses once and
# carries in its buckets and finish), or without one the trainer connection it came on. A
# token survives a reconnect (ZeroMQ gives a reconnected DEALER a new routing identity) and
# a begin resent after a lost reply; a second process does not know it. A begin, bucket or
# finish for a held seat from anyone else is a second claim: it could not be told apart
# from the holder's resend (same seq, same size) and would mix two trainers' bytes, so the
# sync fails for every source at once (nothing of it is committed), and the claimant is
# refused with the same error. A sharded begin that disagrees with the running sharded sync
# (version, sources, plan, or a sync_id begun with another version) ends it the same way:
# its sources could only ever time out waiting for each other.
def _claim(seat: int | None, conn: bytes) -> tuple[str, object]:
    return ("seat", seat) if seat is not None else ("conn", conn)


def _seat_holder(m: Model, s: SyncRecord, sender: int, claim: tuple[str, object], what: str) -> bool:
    """Whether `claim` holds `sender`'s seat of `s` (or nobody does: a rollback's own
    requests); otherwise the sync fails for every source (False)."""
    held = s.seats.get(sender)
    if held is None or held == claim:
        return True
    by = "a token" if claim[0] == "seat" else "a connection"
    _conflict(
        m,
        s,
        sender,
        f"was claimed by a second {what} from {by} other than the one that began it (two "
        f"processes push as source {sender}: check each rank's source index)",
        None,
        "seat",
    )
    return False


def _conflict(m: Model, s: SyncRecord, sender: int, what: str, running: str | None, field: str) -> None:
    """The sync fails for every source, each told what disagreed; the input is refused."""
    where = f"sync {s.sync_id!r} (version {s.version}, {s.senders} source(s))"
    sentence = (
        f"source {sender} {what}, but {where} runs with {running}"
        if running is not None
        else f"source {sender} of {where} {what}"
    )
    tail = (
        "the sync failed for every source and nothing of it was committed"
        if m.state == S.LOADING_BUCKETS
        else "refused (every source has finished: the sync goes on)"
    )
    m.conflict(
        m.error(
            ErrorCode.SOURCE_CONFLICT,
            f"{sentence}; {tail}",
            source=sender,
            disagreed=field,
            sync_id_running=s.sync_id,
        )
    )


def _begin_reply(
    m: Model, s: SyncRecord, repeated: bool = False, host: str | None = None, sender: int = 0
) -> dict[str, Any]:
    """The begin reply (messages.replies.BeginReply), built here only: the sync as opened
    and the limits each sender's window keeps within (its share of max_pending and, with a
    fan-out, of the fan-out's per-connection budget: messages.fanout.window_cap)."""
    senders = max(1, s.senders)
    lim = m.limits
    # a joining source on another host than the one the transport was planned for cannot
    # lend the engines its shared memory: its buckets go inline
    away = host is not None and host != s.host and s.transport in ("shm", "mixed")
    return reply_body(
        BeginReply(
            sync_id=s.sync_id,
            version=s.version,
            state=m.state.value,
            kind=s.kind,
            transport="inline" if away else s.transport,
            engines=tuple(s.participants),
            shm_engines=() if away else tuple(s.shm_engines),
            collective=g.view() if (g := s.groups.get(sender, s.group)) else None,
            stream=s.stream,
            # collective: the trainer sends the daemon a copy of each bucket to spool
            spool_copy=lim.spool if s.group is not None else False,
            repeated=repeated,
            buckets=s.bucket_count,
            bytes=s.byte_count,
            acked=sum(1 for b in s.buckets.values() if b.done),
            started_at=s.started_at,
            trainer_connected=s.trainer_lost_at is None,
            prepared=len(s.prepared),
            max_pending=lim.pending_per_sender(senders),
            fanout_bytes=lim.fanout_bytes // senders if lim.fanout_bytes is not None else None,
            bucket_bytes=s.bucket_bytes,
        )
    )


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
    if s.bucket_bytes is not None and msg.size is None and event.nbytes > s.bucket_bytes:
        raise m.error(
            ErrorCode.TOO_LARGE,
            f"bucket seq {msg.seq} of source {msg.sender} is {event.nbytes} bytes; this sync's buckets "
            f"are at most {s.bucket_bytes} (the begin reply's bucket_bytes: split larger tensors, "
            f"as TrainerClient.push does)",
            bucket_bytes=s.bucket_bytes,
        )
    limit = lim.pending_per_sender(s.senders)
    if event.pending >= limit:
        raise m.error(
            ErrorCode.TOO_LARGE,
            f"{event.pending} bucket requests already pending on "
            f"this connection (max_pending {limit}); lower the window",
        )
    m.admit("bucket")
    _check_sender(m, s, msg.sender)
    if not _seat_holder(m, s, msg.sender, _claim(msg.seat, event.conn), f"bucket (seq {msg.seq})"):
        return
    _check_route(m, s, event)
    key = (msg.sender, msg.seq)
    rec = s.buckets.get(key)
    if rec is not None and (rec.checksum != msg.checksum or rec.nbytes != event.nbytes):
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"source {msg.sender} resent bucket seq {msg.seq} with other bytes (checksum "
            f"{msg.checksum:#018x}, {event.nbytes} bytes) than it first sent (checksum "
            f"{rec.checksum:#018x}, {rec.nbytes} bytes): a resend must repeat its bucket; the "
            f"first stands",
            source=msg.sender,
            seq=msg.seq,
        )
    if rec is not None:  # a resend: acknowledged now if every engine applied it, else when they have
        s.heard(msg.sender, m.now)
        if rec.done:
            m.reply = reply_body(BucketAck(seq=msg.seq, sender=msg.sender, duplicate=True))
        else:
            m.later = True
        return
    _check_spec(m, s, msg)
    if s.senders > 1:
        _check_owner(m, s, msg)
    m.later = True  # acknowledged once every engine applied it (AckBucket)
    s.heard(msg.sender, m.now)
    s.buckets[key] = BucketRecord(event.nbytes, m.now, msg.checksum)
    k = s.forwarded.get(msg.sender, -1)
    while (msg.sender, k + 1) in s.buckets:
        k += 1
    s.forwarded[msg.sender] = k
    s.nbytes += event.nbytes
    s.names.update((t.name, msg.sender) for t in msg.tensors)
    if s.stream:  # a spool copy: the engines have the bytes from the stream
        s.buckets[key].done = True
        m.outbox.append(
            ForwardBucket(
                s.sync_id,
                key,
                s.version,
                (),
                group=s.groups.get(msg.sender, s.group),
                spool=True,
                handle=event.handle,
            )
        )
        m.outbox.append(AckBucket(s.sync_id, key, _advance_acked(s, msg.sender)))
        return
    alive = s.alive(m.engines, m.epoch)[0]
    m.outbox.append(
        ForwardBucket(
            s.sync_id,
            key,
            s.version,
            alive,
            shm_engines=s.shm_engines if msg.shm is not None else (),
            group=s.groups.get(msg.sender, s.group),  # a sharded push: the bucket's source's group
            spool=m.limits.spool and s.kind == "sync",
            handle=event.handle,
        )
    )


def _check_route(m: Model, s: SyncRecord, event: BucketIn) -> None:
    """The bucket travels the way its sync negotiated, and its bytes hashed right."""
    msg = event.msg
    if msg.size is not None and s.transport != "collective":
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "collective bucket, but this sync did not negotiate "
            "a collective group (begin with transport=collective|auto and a collective offer)",
        )
    if msg.size is None and s.transport == "collective":
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this sync's buckets travel by the collective: send their size, not their bytes or a shm slot",
        )
    if msg.shm is not None and s.transport == "inline":
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "shm bucket, but this sync did not negotiate shared "
            "memory (begin with transport=shm|auto from the engines' host)",
        )
    if event.shm_error is not None:
        raise m.error(ErrorCode.BAD_MESSAGE, f"bucket seq {msg.seq}: {event.shm_error}")
    if s.stream and not m.limits.spool:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this sync's buckets travel on the collective stream, framed by the trainer: "
            "the daemon takes no bucket of it (it does not spool)",
        )
    if msg.size is not None and m.limits.spool and s.kind == "sync" and not event.has_payload:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this daemon spools: a collective bucket must carry "
            "a copy of its bytes (begin's reply says spool_copy)",
        )
    if event.checksum_ok is False:
        where = {"collective": "the spool copy", "mixed": "the shm slot"}.get(s.transport, "the frame")
        raise m.error(
            ErrorCode.CHECKSUM_MISMATCH,
            f"bucket seq {msg.seq}: checksum does not match {where}; nothing applied",
        )


def _check_sender(m: Model, s: SyncRecord, sender: int) -> None:
    """A bucket or finish comes from one of the sync's sources, once that source began."""
    if sender >= s.senders:
        raise m.error(ErrorCode.BAD_MESSAGE, f"sender {sender} out of range (senders={s.senders})")
    if s.senders > 1 and sender not in s.begun:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"source {sender} has not begun sync {s.sync_id!r}: begin (version {s.version}, "
            f"senders {s.senders}) first",
        )


def _check_owner(m: Model, s: SyncRecord, msg: Bucket) -> None:
    """A sharded push's sources send disjoint parts: a tensor another source already sent
    is refused before any engine sees this bucket (the first source's copy stands). With a
    plan the daemon has seen carried out, a tensor its plan gives another source is refused
    the same way, whether or not that source sent it yet."""
    planned = m.plans.get(s.plan) if s.plan is not None else None
    for t in msg.tensors:
        owner = planned.get(t.name) if planned is not None else None
        if owner is not None and owner != msg.sender:
            raise m.error(
                ErrorCode.DUPLICATE_TENSOR,
                f"source {msg.sender} sent tensor {t.name!r} (bucket seq {msg.seq}), which plan "
                f"{s.plan} gives source {owner}: every source must send only its own part",
                tensor=t.name,
                source=msg.sender,
                other_source=owner,
                plan=s.plan,
            )
        other = s.names.get(t.name)
        if other is not None and other != msg.sender:
            raise m.error(
                ErrorCode.DUPLICATE_TENSOR,
                f"source {msg.sender} sent tensor {t.name!r} (bucket seq {msg.seq}), which source "
                f"{other} already sent: the sources' parts must be disjoint (the same assignment on "
                f"every rank)",
                tensor=t.name,
                source=msg.sender,
                other_source=other,
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


def loaded(m: Model, event: Loaded) -> None:
    """`loaded {seq: k, also}` is cumulative: every bucket of that sender up to seq k is
    applied, and so are those in `also` (ahead of a gap). Engines coalesce their reports;
    the daemon keeps a high-water mark per engine and sender, and how many live engines
    stand at each mark (`SyncRecord.marks`): a bucket is done once the lowest mark passes
    it, so a report costs O(1) plus the buckets it completes, whatever the fleet's size
    (only a seq in `also` is compared with every live participant). Acknowledgements to
    the trainer are cumulative too (`AckBucket.through`)."""
    _loaded(m, event.engine_id, event.sync_id, event.key, event.also)
    for key in event.more:  # a sharded push: the other senders' marks of the same report
        _loaded(m, event.engine_id, event.sync_id, key, ())


def _loaded(m: Model, eid: str, sync_id: str, key: tuple[int, int], also: tuple[int, ...]) -> None:
    sender, through = key
    c = m.catchup_of(eid, sync_id)
    if c is not None:  # a catch-up's buckets (clock.py runs the catch-up)
        # Clamped as a sync's marks are: never past what was sent (the spool's sender is
        # 0), so a report cannot pull the whole spool at once or finalize early.
        through = min(through, c.sent - 1) if sender == 0 else -1
        if through > c.through.get(sender, -1):
            c.through[sender] = through
            m.send_spooled(eid, c)
        if c.applied >= c.total and not c.finalize_sent:
            c.finalize_sent = True
            m.outbox.append(SendFinalize(eid, sync_id, c.version, m.spooled_probes))
        return
    s = m.participant(eid, sync_id)
    if s is None:
        return  # late: nothing to do
    mark = (eid, sender)
    prev = s.through.get(mark, -1)
    new = min(through, s.forwarded.get(sender, -1))  # never forwarded: the mark stops before it
    if new <= prev and not also:
        return  # a repeated report
    m.engines[eid].last_seen = m.now
    alive = s.alive(m.engines, m.epoch)[1]
    counts, low = s.marks(sender, alive, m.epoch)
    if new > prev:
        s.through[mark] = new
        counts[prev] -= 1
        if not counts[prev]:
            del counts[prev]
        counts[new] = counts.get(new, 0) + 1
    cur = max(new, prev)
    ahead: list[int] = []
    for q in also:
        rec = s.buckets.get((sender, q))
        if q <= cur or rec is None or rec.done or eid in rec.acked_by:
            continue
        rec.acked_by.add(eid)
        if all(s.through.get((x, sender), -1) >= q or x in rec.acked_by for x in alive):
            ahead.append(q)
    lowest = low
    while lowest < cur and lowest not in counts:  # up to the next mark someone stands at
        lowest += 1
    s.low[sender] = lowest
    for seq in [*range(low + 1, lowest + 1), *ahead]:
        rec = s.buckets[(sender, seq)]
        if not rec.done:
            rec.done = True
            m.outbox.append(AckBucket(s.sync_id, (sender, seq), _advance_acked(s, sender)))


def _advance_acked(s: SyncRecord, sender: int) -> int:
    """Move `sender`'s cumulative acknowledgement past every bucket done in a row."""
    acked = s.acked_through.get(sender, -1)
    while (r := s.buckets.get((sender, acked + 1))) is not None and r.done:
        acked += 1
    s.acked_through[sender] = acked
    return acked


# -- finish: prepared everywhere, then the commit (finalize once per participant) ------------
def finish(m: Model, event: FinishSync) -> None:
    msg = event.msg
    if m.sync is None or m.sync.sync_id == msg.sync_id:
        ended = m.ended.get(msg.sync_id)
        cause = {"ended_code": ended[0], "ended_reason": ended[1]} if ended and ended[0] else {}
        m.admit("finish", m.ended_note(msg.sync_id), **cause)
    s = m.require_sync(msg.sync_id, "finish")
    _check_sender(m, s, msg.sender)
    if not _seat_holder(m, s, msg.sender, _claim(msg.seat, event.conn), "finish"):
        return
    m.later = True  # answered when the sync completes (CompleteSync), unless refused below
    finished = {**s.finished, msg.sender: msg.buckets}
    if len(finished) < s.senders:  # another sender still streams: wait for its finish
        _record_finish(m, s, event)
        return
    if s.stream:
        _finish_stream(m, s, event)
        return
    reason = syncs.incomplete_reason(s, finished)
    if reason is not None:
        raise m.error(ErrorCode.INCOMPLETE_SYNC, reason)
    missing = None if msg.partial else syncs.missing_tensors(s, m.engines)
    if missing is not None:
        eid, names = missing
        planned = m.plans.get(s.plan) if s.plan is not None else None
        owed = sorted({planned[n] for n in names if n in planned}) if planned is not None else []
        raise m.error(
            ErrorCode.INCOMPLETE_SYNC,
            f"engine {eid} would be left with {len(names)} tensor(s) of the old "
            f"version: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} "
            + (f"(the plan gives them to source(s) {owed[:16]}) " if owed else "")
            + "(send them, or push with --partial); nothing was finalized",
            engine_id=eid,
            missing=names[:64],
            missing_count=len(names),
            **({"sources": owed[:64]} if owed else {}),
        )
    if s.senders > 1 and s.plan is not None and plan_key(s.senders, s.names) != s.plan:
        _plan_not_carried_out(m, s, msg.sender)
        return
    _record_finish(m, s, event)
    _commit(m, s, "finish")


def _plan_not_carried_out(m: Model, s: SyncRecord, last: int) -> None:
    """The sources declared `s.plan` (a hash of which source sends which tensor:
    messages.shardplan) and sent something else: a tensor from a source the plan does not
    give it, or a planned tensor nobody sent. Fails the sync for every source, before any
    finalize, naming the tensors where the daemon knows the plan (a READY sync carried it
    out before)."""
    planned = m.plans.get(s.plan) if s.plan is not None else None
    wrong: list[str] = []
    if planned is not None:
        wrong = sorted(n for n in {*planned, *s.names} if planned.get(n) != s.names.get(n))
    sent = {k: sum(1 for v in s.names.values() if v == k) for k in range(s.senders)}
    _conflict(
        m,
        s,
        last,
        f"finished last, and the tensors the sources sent (per source: {sent}) are not the "
        f"assignment their plan {s.plan} declares"
        + (f": {', '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''} differ" if wrong else "")
        + " (every source must send exactly the tensors the plan gives it)",
        None,
        "plan",
    )


def _commit(m: Model, s: SyncRecord, trigger: str) -> None:
    """Phase two: every participant is prepared; each is told to finalize, once."""
    m.move(trigger, Outcome.ADVANCE, s)
    s.finalize_started = m.now
    for eid in s.participants:
        if eid in s.finalize_sent:  # the guard behind the invariant: once per engine
            continue
        s.finalize_sent.add(eid)
        m.engines[eid].move("start_finalize")
        m.outbox.append(SendFinalize(eid, s.sync_id, s.version, s.probes))


def _finish_stream(m: Model, s: SyncRecord, event: FinishSync) -> None:
    """The trainer finished a collective stream: the engines' `prepared` say whether
    they hold it all (each compared with the trainer's count and chain); commit when the
    last has prepared. A finish that cannot be compared is refused, changing nothing."""
    msg = event.msg
    if msg.chain is None:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this sync travels on the collective stream: finish must carry the chain over "
            "the buckets' checksums",
        )
    wrong = syncs.count_mismatch(s, msg.buckets)
    if wrong is not None:
        raise m.error(ErrorCode.INCOMPLETE_SYNC, wrong)
    if m.limits.spool:  # the spool copies must all be in (the spool replays them)
        reason = syncs.incomplete_reason(s, {msg.sender: msg.buckets})
        if reason is not None:
            raise m.error(ErrorCode.INCOMPLETE_SYNC, f"spool copies: {reason}")
    _record_finish(m, s, event)
    s.chain, s.finished_at = msg.chain, m.now
    _commit_if_prepared(m, s, "finish")


def prepared(m: Model, event: EnginePrepared) -> None:
    """Phase one of the commit on the collective stream: an engine holds every bucket."""
    eid, msg = event.engine_id, event.msg
    s = m.participant(eid, msg.sync_id)
    if s is None or not s.stream or m.state != S.LOADING_BUCKETS or eid in s.prepared:
        return  # late, stray or repeated: changes nothing
    m.engines[eid].last_seen = m.now
    s.prepared[eid] = msg
    s.last_activity = m.now
    _commit_if_prepared(m, s, "prepared")


def _commit_if_prepared(m: Model, s: SyncRecord, trigger: str) -> None:
    """Compare each `prepared` with the trainer's finish and with the others', failing the
    sync on the first that differs (nothing finalized); commit when all have prepared."""
    if s.chain is None:
        return  # the trainer has not finished: prepared answers wait for its finish
    want_buckets = sum(s.finished.values())
    digests = {p.digest for p in s.prepared.values() if p.digest is not None}
    want_digest = s.expected_digest or (next(iter(digests)) if len(digests) == 1 else None)
    for eid, p in sorted(s.prepared.items()):
        why = None
        if p.buckets != want_buckets:
            why = f"prepared {p.buckets} buckets, the trainer sent {want_buckets}"
        elif p.chain != s.chain:
            why = (
                f"prepared buckets whose checksums chain to {p.chain:#018x}, the trainer's to {s.chain:#018x}"
            )
        elif len(digests) > 1 and s.expected_digest is None:
            why = f"prepared digest {p.digest}, other engines {sorted(digests - {p.digest})}"
        elif p.digest is not None and want_digest is not None and p.digest != want_digest:
            why = f"holds digest {p.digest}, expected {want_digest}"
        if why is not None:
            m.close_failed(
                trigger,
                m.error(ErrorCode.ENGINE_FAILED, f"engine {eid} {why}; nothing was finalized", engine_id=eid),
            )
            return
    if all(x in s.prepared and m.engines[x].state != E.LOST for x in s.participants):
        _commit(m, s, trigger)


def _record_finish(m: Model, s: SyncRecord, event: FinishSync) -> None:
    msg = event.msg
    s.heard(msg.sender, m.now)
    s.finished[msg.sender] = msg.buckets
    if msg.digest is None:
        return
    if s.senders == 1:
        s.expected_digest = msg.digest
        return
    # a sharded push: each source's digest covers its own tensors; they add up to the version's
    s.digests[msg.sender] = msg.digest
    if len(s.digests) == s.senders:
        s.expected_digest = add_digests(s.digests.values())


def finalized(m: Model, event: EngineFinalized) -> None:
    eid, msg, s = event.engine_id, event.msg, m.sync
    x = m.engines.get(eid)
    if x is not None and msg.delta is not None:
        x.delta = msg.delta  # what it holds now decides whether the next delta may begin
    c = m.catchup_of(eid, msg.sync_id)
    if c is not None:  # a catch-up's finalize
        mismatch = syncs.canary_mismatch(m.spooled_probes, msg.probes)
        if mismatch is not None:
            m.end_catchup(eid, False, f"CANARY_MISMATCH: {syncs.mismatch_text(mismatch)}")
        elif msg.version == c.version and msg.digest == m.served_digest and c.finalize_sent:
            x = m.engines[eid]
            x.version, x.digest, x.finalize_count = msg.version, msg.digest, msg.finalize_count
            x.move("serve")
            m.end_catchup(eid, True)
            if x.labels:  # it serves the committed version: label it so
                m.outbox.append(SendCommit(eid, msg.sync_id, msg.version))
            m.tell_served(eid, msg.sync_id)
        else:
            m.end_catchup(
                eid,
                False,
                f"finalized version {msg.version} digest {msg.digest}, "
                f"expected {c.version} {m.served_digest}",
            )
        return
    if s is None or m.state != S.FINALIZING or m.participant(eid, msg.sync_id) is None or eid in s.finalized:
        return  # late, stray or repeated: changes nothing
    if msg.version != s.version:
        _wrong_version(m, "finalized", eid, msg.version, s.version)
        return
    want = s.expected_digest or (next(iter(s.finalized.values())).digest if s.finalized else None)
    if want is not None and msg.digest != want:
        m.close_failed(
            "finalized",
            m.error(
                ErrorCode.ENGINE_FAILED,
                f"engine {eid} holds digest {msg.digest}, expected {want}",
                engine_id=eid,
                digest=msg.digest,
                expected=want,
            ),
        )
        return
    mismatch = syncs.canary_mismatch(s.probes, msg.probes)
    if mismatch is not None:
        idx, pos, got, exp = mismatch
        m.close_failed(
            "finalized",
            m.error(
                ErrorCode.CANARY_MISMATCH,
                f"engine {eid}: {syncs.mismatch_text(mismatch)}",
                engine_id=eid,
                probe=idx,
                position=pos,
                got=got,
                expected=exp,
            ),
        )
        return
    s.finalized[eid] = msg
    m.engines[eid].finalize_count = msg.finalize_count
    if all(x in s.finalized for x in s.participants):
        labellers = [p for p in s.participants if m.engines[p].labels]
        if not labellers:
            m.close_ready("finalized")
            return
        # Committed fleet-wide: now (not at each finalize, which a later failure could
        # undo) the engines label their outputs with the version; READY once they have.
        s.commit_sent = True
        for p in labellers:
            m.outbox.append(SendCommit(p, s.sync_id, s.version))


def _wrong_version(m: Model, trigger: str, eid: str, got: int, want: int) -> None:
    """An engine finalized (or labelled) another version than the sync's: it fails."""
    what = "finalized" if trigger == "finalized" else "labelled"
    m.close_failed(
        trigger,
        m.error(
            ErrorCode.ENGINE_FAILED, f"engine {eid} {what} version {got}, expected {want}", engine_id=eid
        ),
    )


def committed(m: Model, event: EngineCommitted) -> None:
    """A labelling engine set its label: READY once every one of them has."""
    eid, msg, s = event.engine_id, event.msg, m.sync
    x = m.engines.get(eid)
    if x is None or not x.labels:
        return
    if s is None or msg.sync_id != s.sync_id:
        if x.version == msg.version:  # a catch-up's label, set once it serves the version
            x.label = msg.label
        return
    if m.state != S.FINALIZING or not s.commit_sent or m.participant(eid, msg.sync_id) is None:
        return  # late, stray or repeated: changes nothing
    if msg.version != s.version:
        _wrong_version(m, "committed", eid, msg.version, s.version)
        return
    s.committed.add(eid)
    x.label = msg.label
    if all(y in s.committed for y in s.participants if m.engines[y].labels):
        m.close_ready("committed")


# -- a sync given up: abort, an engine's failure --------------------------------------------
def abort(m: Model, event: AbortSync) -> None:
    m.require_sync(event.sync_id, "abort")  # a running sync (a rollback too) can be aborted
    code = event.code if event.code not in (None, ErrorCode.INTERNAL) else ErrorCode.ABORTED
    who = {"operator": "an operator", "daemon": "the daemon"}.get(event.by, "the trainer")
    m.close_failed(
        "abort",
        m.error(code, f"sync aborted by {who}: {event.reason or 'no reason given'}", aborted_by=event.by),
        by=event.by,
    )
    m.reply = {"state": m.state.value, "version": m.served_version, "dirty": m.dirty}  # the abort's answer


def failed(m: Model, event: EngineFailed) -> None:
    eid, msg = event.engine_id, event.msg
    if m.catchups.get(eid) is not None:
        if m.catchup_of(eid, msg.sync_id) is not None and not msg.duplicate:
            m.end_catchup(eid, False, f"{msg.code}: {msg.message}")
        return
    if msg.duplicate or m.participant(eid, msg.sync_id) is None:
        return  # the engine's finalize guard speaking, or about a sync that is over
    code = ErrorCode(msg.code) if msg.code in ErrorCode.__members__ else ErrorCode.ENGINE_FAILED
    s = m.sync
    if s is not None and s.senders > 1 and msg.seq is not None:  # whose bucket: a source may have died
        m.close_failed(
            "failed",
            m.error(
                code,
                f"engine {eid} failed on source {msg.sender}'s bucket: {msg.message}",
                engine_id=eid,
                seq=msg.seq,
                source=msg.sender,
            ),
        )
        return
    m.close_failed("failed", m.error(code, f"engine {eid} failed: {msg.message}", engine_id=eid, seq=msg.seq))
