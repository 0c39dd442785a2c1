"""How a sync completes: the engines' reports (loaded: acknowledgements to the trainer),
finish, prepared, finalized and committed (the commit), and how it is given up (abort, an
engine's failure).

Theory of operation: `finish` moves to FINALIZING only when every source finished and
every announced bucket is applied everywhere (the participants are prepared); then each
participant is told to finalize exactly once (the commit), and the last valid `finalized`
makes the daemon READY (after the labelling engines' `committed`, where they label).
Anything else that goes wrong before READY fails the sync (`Model.close_failed`).

Rules: as in `sync`: find the facts and refuse first, then act.
"""

from __future__ import annotations

from messages import coverage
from messages.checksums import add_digests
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Finalized
from messages.shardplan import plan_key
from orchestrator.core import seats, syncs
from orchestrator.core.commands import (
    AckBucket,
    SendCommit,
    SendFinalize,
)
from orchestrator.core.events import (
    AbortSync,
    EngineCommitted,
    EngineFailed,
    EngineFinalized,
    EnginePrepared,
    FinishSync,
    Loaded,
)
from orchestrator.core.model import Model
from orchestrator.core.records import SyncRecord
from orchestrator.core.states import EngineState, State
from orchestrator.core.table import Life, Outcome, Trigger

S, E = State, EngineState


def loaded(m: Model, event: Loaded) -> None:
    """`loaded {seq: k, also}` is cumulative: every bucket of that source up to seq k is
    applied, and so are those in `also` (ahead of a gap). Engines coalesce their reports;
    the daemon keeps a high-water mark per engine and source, and how many live engines
    stand at each mark (`SyncRecord.marks`): a bucket is done once the lowest mark passes
    it, so a report costs O(1) plus the buckets it completes, whatever the fleet's size
    (only a seq in `also` is compared with every live participant). Acknowledgements to
    the trainer are cumulative too (`AckBucket.through`)."""
    _loaded(m, event.engine_id, event.sync_id, event.key, event.also)
    for key in event.more:  # a sharded push: the other sources' marks of the same report
        _loaded(m, event.engine_id, event.sync_id, key, ())


def _loaded(m: Model, eid: str, sync_id: str, key: tuple[int, int], also: tuple[int, ...]) -> None:
    source, through = key
    c = m.catchup_of(eid, sync_id)
    if c is not None:  # a catch-up's buckets (clock.py runs the catch-up)
        # Clamped as a sync's marks are: never past what was sent (the spool's source is
        # 0), so a report cannot pull the whole spool at once or finalize early.
        through = min(through, c.sent - 1) if source == 0 else -1
        if through > c.through.get(source, -1):
            c.through[source] = through
            m.send_spooled(eid, c)
        if c.applied >= c.total and not c.finalize_sent:
            c.finalize_sent = True
            m.outbox.append(SendFinalize(eid, sync_id, c.version, m.spooled_probes, m.served_digest))
        return
    s = m.participant(eid, sync_id)
    if s is None:
        return  # late: nothing to do
    mark = (eid, source)
    prev = s.through.get(mark, -1)
    new = min(through, s.forwarded.get(source, -1))  # never forwarded: the mark stops before it
    if new <= prev and not also:
        return  # a repeated report
    m.engines[eid].last_seen = m.now
    alive = s.alive(m.engines, m.epoch)[1]
    counts, low = s.marks(source, alive, m.epoch)
    if new > prev:
        s.through[mark] = new
        counts[prev] -= 1
        if not counts[prev]:
            del counts[prev]
        counts[new] = counts.get(new, 0) + 1
    cur = max(new, prev)
    ahead: list[int] = []
    for q in also:
        rec = s.buckets.get((source, q))
        if q <= cur or rec is None or rec.done or eid in rec.acked_by:
            continue
        rec.acked_by.add(eid)
        if all(s.through.get((x, source), -1) >= q or x in rec.acked_by for x in alive):
            ahead.append(q)
    lowest = low
    while lowest < cur and lowest not in counts:  # up to the next mark someone stands at
        lowest += 1
    s.low[source] = lowest
    for seq in [*range(low + 1, lowest + 1), *ahead]:
        rec = s.buckets[(source, seq)]
        if not rec.done:
            rec.done = True
            m.outbox.append(AckBucket(s.sync_id, (source, seq), advance_acked(s, source)))


def advance_acked(s: SyncRecord, source: int) -> int:
    """Move `source`'s cumulative acknowledgement past every bucket done in a row."""
    acked = s.acked_through.get(source, -1)
    while (r := s.buckets.get((source, acked + 1))) is not None and r.done:
        acked += 1
    s.acked_through[source] = acked
    return acked


# -- finish: prepared everywhere, then the commit (finalize once per participant) ------------
def finish(m: Model, event: FinishSync) -> None:
    msg = event.msg
    if m.sync is None or m.sync.sync_id == msg.sync_id:
        ended = m.ended.get(msg.sync_id)
        cause = {"ended_code": ended[0], "ended_reason": ended[1]} if ended and ended[0] else {}
        m.admit(Trigger.FINISH, m.ended_note(msg.sync_id), **cause)
    s = m.require_sync(msg.sync_id, "finish")
    m.require_own(s, event.conn, "finish")
    seats.check_source(m, s, msg.source)
    if not seats.seat_holder(m, s, msg.source, seats.claim(msg.seat, event.conn), "finish"):
        return
    m.later = True  # answered when the sync completes (CompleteSync), unless refused below
    finished = {**s.finished, msg.source: msg.buckets}
    if len(finished) < s.sources:  # another source still streams: wait for its finish
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
            f"version: {coverage.listed(names)} "
            + (f"(the plan gives them to source(s) {owed[:16]}) " if owed else "")
            + "(send them, or push with --partial); nothing was finalized",
            engine_id=eid,
            missing=names[:64],
            missing_count=len(names),
            **({"sources": owed[:64]} if owed else {}),
        )
    lost = None if msg.partial or s.stream else syncs.missing_slices(s, m.engines)
    if lost is not None:
        eid, rank, parts = lost
        raise m.error(
            ErrorCode.INCOMPLETE_SYNC,
            f"engine {eid} rank {rank} would be left with {len(parts)} slice(s) of the old version: "
            f"{coverage.listed(parts)} (send each rank its box, or the whole tensor); nothing was finalized",
            engine_id=eid,
            rank=rank,
            missing=parts[:64],
            missing_count=len(parts),
        )
    if s.sources > 1 and s.plan is not None and plan_key(s.sources, s.names) != s.plan:
        _plan_not_carried_out(m, s, msg.source)
        return
    _record_finish(m, s, event)
    _commit(m, s, Trigger.FINISH)


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
    sent = {k: sum(1 for v in s.names.values() if v == k) for k in range(s.sources)}
    seats.conflict(
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


def _commit(m: Model, s: SyncRecord, trigger: Trigger) -> None:
    """Phase two: every participant is prepared; each is told to finalize, once."""
    m.move(trigger, Outcome.ADVANCE, s)
    s.finalize_started = m.now
    for eid in s.participants:
        if eid in s.finalize_sent:  # the guard behind the invariant: once per engine
            continue
        s.finalize_sent.add(eid)
        m.engines[eid].move(Life.START_FINALIZE)
        m.outbox.append(SendFinalize(eid, s.sync_id, s.version, s.probes, s.expected_digest))


def _finish_stream(m: Model, s: SyncRecord, event: FinishSync) -> None:
    """The trainer finished a group's stream: the engines' `prepared` say whether
    they hold it all (each compared with the trainer's count and chain); commit when the
    last has prepared. A finish that cannot be compared is refused, changing nothing."""
    msg = event.msg
    if msg.chain is None:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            "this sync travels on the group's stream: finish must carry the chain over "
            "the buckets' checksums",
        )
    wrong = syncs.count_mismatch(s, msg.buckets)
    if wrong is not None:
        raise m.error(ErrorCode.INCOMPLETE_SYNC, wrong)
    if m.limits.spool:  # the spool copies must all be in (the spool replays them)
        reason = syncs.incomplete_reason(s, {msg.source: msg.buckets})
        if reason is not None:
            raise m.error(ErrorCode.INCOMPLETE_SYNC, f"spool copies: {reason}")
    _record_finish(m, s, event)
    s.chain, s.finished_at = msg.chain, m.now
    _commit_if_prepared(m, s, Trigger.FINISH)


def prepared(m: Model, event: EnginePrepared) -> None:
    """Phase one of the commit on the group's stream: an engine holds every bucket."""
    eid, msg = event.engine_id, event.msg
    if not m.admit(Trigger.PREPARED):
        return
    s = m.participant(eid, msg.sync_id)
    if s is None or not s.stream or eid in s.prepared:
        return  # late, stray or repeated: changes nothing
    m.engines[eid].last_seen = m.now
    s.prepared[eid] = msg
    s.last_activity = m.now
    _commit_if_prepared(m, s, Trigger.PREPARED)


def _commit_if_prepared(m: Model, s: SyncRecord, trigger: Trigger) -> None:
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
    s.heard(msg.source, m.now)
    s.finished[msg.source] = msg.buckets
    if msg.slice_digests:
        s.slice_digests[msg.source] = dict(msg.slice_digests)
    if msg.digest is None:
        return
    if s.sources == 1:
        s.expected_digest = msg.digest
        return
    # a sharded push: each source's digest covers its own tensors; they add up to the version's
    s.digests[msg.source] = msg.digest
    if len(s.digests) == s.sources:
        s.expected_digest = add_digests(s.digests.values())


def finalized(m: Model, event: EngineFinalized) -> None:
    eid, msg, s = event.engine_id, event.msg, m.sync
    x = m.engines.get(eid)
    if x is not None and msg.delta is not None:
        x.delta = msg.delta  # what it holds now decides whether the next delta may begin
    if x is not None and x.slices is not None and msg.rank_received:
        x.slices = {**x.slices, "received": list(msg.rank_received)}  # per rank, this sync (status)
    if not m.admit(Trigger.FINALIZED):
        return
    c = m.catchup_of(eid, msg.sync_id)
    if c is not None:  # a catch-up's finalize
        mismatch = syncs.canary_mismatch(m.spooled_probes, msg.probes)
        ranks = _rank_refusal(m, eid, msg, m.spooled.slice_digests if m.spooled is not None else {})
        if mismatch is not None:
            m.end_catchup(eid, False, f"CANARY_MISMATCH: {syncs.mismatch_text(mismatch)}")
        elif ranks is not None:
            m.end_catchup(eid, False, ranks.message)
        elif msg.version == c.version and msg.digest == m.served_digest and c.finalize_sent:
            x = m.engines[eid]
            x.version, x.digest, x.finalize_count = msg.version, msg.digest, msg.finalize_count
            x.move(Life.SERVE)
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
    if s is None or m.participant(eid, msg.sync_id) is None or eid in s.finalized:
        return  # late, stray or repeated: changes nothing
    if msg.version != s.version:
        _wrong_version(m, Trigger.FINALIZED, eid, msg.version, s.version)
        return
    want = s.expected_digest or (next(iter(s.finalized.values())).digest if s.finalized else None)
    rank = _rank_refusal(m, eid, msg, s.rank_digests())
    if rank is not None:
        m.close_failed(Trigger.FINALIZED, rank)
        return
    if want is not None and msg.digest != want:
        m.close_failed(
            Trigger.FINALIZED,
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
            Trigger.FINALIZED,
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
            m.close_ready(Trigger.FINALIZED)
            return
        # Committed fleet-wide: now (not at each finalize, which a later failure could
        # undo) the engines label their outputs with the version; READY once they have.
        s.commit_sent = True
        for p in labellers:
            m.outbox.append(SendCommit(p, s.sync_id, s.version))


def _wrong_version(m: Model, trigger: Trigger, eid: str, got: int, want: int) -> None:
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
    if not m.admit(Trigger.COMMITTED) or not s.commit_sent or m.participant(eid, msg.sync_id) is None:
        return  # late, stray or repeated: changes nothing
    if msg.version != s.version:
        _wrong_version(m, Trigger.COMMITTED, eid, msg.version, s.version)
        return
    s.committed.add(eid)
    x.label = msg.label
    if all(y in s.committed for y in s.participants if m.engines[y].labels):
        m.close_ready(Trigger.COMMITTED)


# -- a sync given up: abort, an engine's failure --------------------------------------------
def abort(m: Model, event: AbortSync) -> None:
    if event.by == "daemon" and (m.sync is None or m.sync.sync_id != event.sync_id):
        # The daemon's own abort (its rollback feed gives up) of a sync that ended before
        # the feed heard of it: nothing to abort. Refusing it would count as a bug and
        # fail whatever sync runs now (found by tests/faults/test_fuzz_states.py).
        return
    m.require_sync(event.sync_id, "abort")  # a running sync (a rollback too) can be aborted
    code = event.code if event.code not in (None, ErrorCode.INTERNAL) else ErrorCode.ABORTED
    who = {"operator": "an operator", "daemon": "the daemon"}.get(event.by, "the trainer")
    m.close_failed(
        Trigger.ABORT,
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
    if msg.peer and s is not None:
        # Its group lost another member (a closed connection: a neighbour in the chain, or
        # the trainer). That member's own loss names the culprit once it is counted (within
        # engine_grace of its connection closing); the clock names the reporters only if
        # none is counted lost by then (clock.Due.PEER_FAULT).
        s.peer_faults.setdefault(eid, (m.now, msg.message))
        return
    if s is not None and s.sources > 1 and msg.seq is not None:  # whose bucket: a source may have died
        m.close_failed(
            Trigger.FAILED,
            m.error(
                code,
                f"engine {eid} failed on source {msg.source}'s bucket: {msg.message}",
                engine_id=eid,
                seq=msg.seq,
                source=msg.source,
            ),
        )
        return
    m.close_failed(
        Trigger.FAILED, m.error(code, f"engine {eid} failed: {msg.message}", engine_id=eid, seq=msg.seq)
    )


def _rank_refusal(
    m: Model, eid: str, msg: Finalized, expected: dict[str, tuple[str, ...]]
) -> WeightSyncError | None:
    """An engine that takes slices: each rank's digest against what the sender computed for
    that rank of its layout (`expected`: per layout key; a sync's sources added up, or the
    spool's for a replay), naming the first that differs. None when it holds what it was
    sent, or when there is nothing to compare (a push that was not cut: its digest alone
    is checked)."""
    x = m.engines.get(eid)
    want = None if x is None or x.slices is None else expected.get(str(x.slices["key"]))
    if want is None:
        return None
    if len(msg.rank_digests) != len(want):
        return m.error(
            ErrorCode.ENGINE_FAILED,
            f"engine {eid} reported {len(msg.rank_digests)} rank digests for a layout of {len(want)} ranks",
            engine_id=eid,
        )
    for r, (got, exp) in enumerate(zip(msg.rank_digests, want, strict=True)):
        if got != exp:
            return m.error(
                ErrorCode.ENGINE_FAILED,
                f"engine {eid} rank {r} holds slices with digest {got}, its sender computed {exp}",
                engine_id=eid,
                rank=r,
                digest=got,
                expected=exp,
            )
    return None
