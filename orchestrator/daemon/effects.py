"""Running the core's commands in the trust boundary's order: persist, tell engines, reply.

Rules: journal rows and spool writes go to the storage thread; engine sends and replies
follow once they are durable. A batch with something to persist continues in its own
task, so the loop keeps serving meanwhile; batches keep their order (each waits for the
one before), and a batch nested in a running one runs at once, in place. Failpoints
`kill_after_persisted` / `kill_after_told` stop the daemon between the steps (tests).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from messages import codec, replies, schema, transports
from messages.bounded import LRU
from messages.errors import ErrorCode, MessageError, make_error
from messages.schema import MAX_COLLECTIVE_SOURCES
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.core.records import GroupRecord, Spooled
from orchestrator.daemon import fanout
from orchestrator.daemon.inflight import Inflight, Pending
from orchestrator.daemon.journal import Journal
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.recovery import RECOVERY_WINDOW, Recovery
from orchestrator.daemon.spool import Spool
from orchestrator.daemon.storage import Storage
from orchestrator.daemon.transport import Transport, Waiter

log = structlog.get_logger()

# Set inside a batch's continuation task (a ContextVar is per task): a batch nested in it
# runs at once instead of queueing behind the batch it is part of.
IN_EFFECTS: contextvars.ContextVar[bool] = contextvars.ContextVar("in_effects", default=False)
REPLY = (cmd.AckBucket, cmd.CompleteSync)
# The effects runner's bounded maps (messages.bounded.LRU, least recently used first):
FANOUT_AUDIENCES_KEPT = 16  # syncs' fan-out audiences: the running one, and syncs that never completed here
GROUP_REFS_KEPT = MAX_COLLECTIVE_SOURCES + 1  # groups' refs: the shared group and one per source

Feed = Callable[[ev.Event], Awaitable[None]]


class Effects:
    def __init__(
        self,
        transport: Transport,
        inflight: Inflight,
        storage: Storage,
        journal: Journal,
        spool: Spool | None,
        metrics: Metrics,
        readers: dict[str, transports.Reader],
        failpoints: dict[str, float | str],
    ) -> None:
        self.transport = transport
        self.inflight = inflight
        self.storage = storage
        self.journal = journal
        self.spool = spool
        self.metrics = metrics
        self.readers = readers  # each "ref" transport's reader (this loop's task only)
        self.failpoints = failpoints
        self.recovery: Recovery | None = None  # set by the service (it feeds requests back)
        self.feed: Feed | None = None  # the service's: an event into the core, its commands run
        self.fail_internal: Callable[[str, BaseException], Awaitable[None]] | None = None
        self.publish: Callable[[], None] | None = None  # metrics' status snapshot
        self.settled: Callable[[], None] | None = None  # a batch's task ended: the loop looks again
        self._tail: asyncio.Future[None] | None = None  # the last batch whose effects are pending
        self._tasks: set[asyncio.Task[None]] = set()
        # group id -> each engine's GroupRef in it (the latest groups; a sharded push's
        # sync has one per source)
        self._refs: LRU[str, dict[str, schema.GroupRef]] = LRU(GROUP_REFS_KEPT)
        # sync id -> who takes its buckets published
        self._fanout: LRU[str, fanout.Audience] = LRU(FANOUT_AUDIENCES_KEPT)

    @property
    def batches(self) -> int:
        return len(self._tasks)

    async def execute(
        self, commands: list[cmd.Command], then: Callable[[], None] | None = None, trigger: str = ""
    ) -> None:
        """Run one input's commands in the order of the trust boundary: journal and spool
        writes first (on the storage thread, durable), then the engines, then the replies
        (`then` is this input's own reply). A batch with something to persist continues
        in a task once the storage thread is done, so the loop serves on meanwhile; batches
        keep their order (each waits for the one before)."""
        if not commands and then is None:  # most progress reports: nothing to do
            return
        persist = [self._persist_job(c) for c in commands if isinstance(c, cmd.PERSIST)]
        persist += [job for c in commands if isinstance(c, cmd.ForwardBucket) for job in self._spool_job(c)]
        rest: list[cmd.Command] = [c for c in commands if not isinstance(c, cmd.PERSIST)]
        if IN_EFFECTS.get() or (not persist and self._tail is None):
            if persist:  # nested in a running batch: persist, in order, then go on
                await self.storage.submit(persist)
            await self._tell_and_reply(rest, commands, then, trigger)
            return
        prev, done = self._tail, asyncio.get_running_loop().create_future()
        self._tail = done
        job = self.storage.submit(persist) if persist else None
        self._tasks.add(asyncio.create_task(self._continue(prev, job, rest, commands, then, done, trigger)))

    async def _continue(
        self,
        prev: asyncio.Future[None] | None,
        job: asyncio.Future[None] | None,
        rest: list[cmd.Command],
        commands: list[cmd.Command],
        then: Callable[[], None] | None,
        done: asyncio.Future[None],
        trigger: str,
    ) -> None:
        try:
            if prev is not None:
                await asyncio.shield(prev)
            IN_EFFECTS.set(True)  # this task's context only: nested batches run at once
            if job is not None:
                await job
                self._failpoint_kill("persisted", trigger)
            await self._tell_and_reply(rest, commands, then, trigger)
        except Exception as exc:
            log.exception("effects_failed")
            if self.fail_internal is not None:
                await self.fail_internal("effects", exc)
        finally:
            done.set_result(None)
            if self._tail is done:
                self._tail = None
            task = asyncio.current_task()
            if task is not None:
                self._tasks.discard(task)
            if self.settled is not None:
                self.settled()

    async def _tell_and_reply(
        self,
        rest: list[cmd.Command],
        commands: list[cmd.Command],
        then: Callable[[], None] | None,
        trigger: str = "",
    ) -> None:
        if any(isinstance(c, cmd.SpoolCommit) for c in commands) and self.feed is not None:
            await self.feed(ev.SpoolChanged(self.spooled()))  # stale engines catch up now
        for c in rest:
            if not isinstance(c, REPLY):
                await self._tell(c)
        if rest:
            self._failpoint_kill("told", trigger)
        self._ack_buckets([c for c in rest if isinstance(c, cmd.AckBucket)])
        for c in rest:
            if isinstance(c, cmd.CompleteSync):
                self.complete_sync(c)
        if then is not None:
            then()

    def _ack_buckets(self, acks: list[cmd.AckBucket]) -> None:
        """Acknowledgements are cumulative: `ok {through: k}` answers every bucket of that
        source up to seq k, so a trainer connection gets one reply per source per batch
        for its buckets up to the batch's `through` (on its highest one); a bucket acked
        ahead of a gap is answered alone. The daemon's own requests (a rollback's replay)
        are answered one by one."""
        through: dict[tuple[str, int], int] = {}
        for c in acks:
            k = (c.sync_id, c.key[0])
            through[k] = max(through.get(k, -1), c.through)
        last: dict[tuple[str, int, bytes], tuple[int, Waiter]] = {}
        for c in acks:
            source, seq = c.key
            for w in self.inflight.bucket_waiters.pop((c.sync_id, c.key), []):
                if w.on_reply is not None or seq > through[(c.sync_id, source)]:
                    self.transport.reply_ok(w, replies.body(replies.BucketAck(seq=seq, source=source)))
                    continue
                k3 = (c.sync_id, source, w.ident)
                if k3 not in last or last[k3][0] < seq:
                    last[k3] = (seq, w)
        for (sync_id, source, _ident), (seq, w) in last.items():
            ack = replies.BucketAck(seq=seq, source=source, through=through[(sync_id, source)])
            self.transport.reply_ok(w, replies.body(ack))

    def spooled(self) -> Spooled | None:
        info = self.spool.info if self.spool else None
        if info is None:
            return None
        return Spooled(
            info.version, info.digest, info.buckets, info.probes, info.chain, info.scheme, info.slice_digests
        )

    # -- persisting (closures for the storage thread) ----------------------------------
    def persist_now(self, c: cmd.Journal) -> None:
        """Write a journal entry on this thread (shutdown: the storage thread has stopped)."""
        self._persist_job(c)()

    def _persist_job(self, c: cmd.Command) -> Callable[[], object]:
        """A closure for the storage thread: it captures now what it needs from the loop."""
        if isinstance(c, cmd.Journal):
            if c.kind == "transition":
                d = c.data
                log.info(
                    "state_changed",
                    src=d["from"],
                    dst=d["to"],
                    trigger=d["trigger"],
                    version=d.get("version"),
                    sync_id=d.get("sync_id"),
                    code=d.get("code"),
                )
                return lambda: self.journal.transition(d, bool(d.get("dirty")))
            return lambda: self.journal.sync(c.data)
        spool = self.spool
        if spool is None:  # the core only asks for these with a spool
            raise make_error(ErrorCode.INTERNAL, f"{type(c).__name__} without a spool")
        if isinstance(c, cmd.SpoolBegin):
            return lambda: spool.begin(c.sync_id, c.version, c.base)
        if isinstance(c, cmd.SpoolCommit):
            return lambda: spool.commit(c.sync_id, c.version, c.digest, c.probes, c.slice_digests)
        if isinstance(c, cmd.SpoolDiscard):
            return lambda: spool.discard(c.sync_id)
        raise make_error(ErrorCode.INTERNAL, f"not a storage command: {c!r}")

    def _spool_job(self, c: cmd.ForwardBucket) -> list[Callable[[], object]]:
        """The spool write of a bucket, before any engine is told of it."""
        spool = self.spool
        p = c.handle
        if spool is None or not c.spool or not isinstance(p, Pending):
            return []
        m, data = p.msg, p.frame
        ref = m.ref
        if data is None and ref is None:  # a broadcast bucket with no copy
            return []
        if data is None and ref is not None:  # by reference: the trainer's slot, valid until acked
            try:
                data = transports.view(ref, self.readers)
            except MessageError as exc:
                reason = f"reference unreadable: {exc.reason}"
                return [lambda: spool.fail(reason)]
        buf = getattr(data, "buffer", data)
        metas = [t.to_wire() for t in m.tensors]
        return [lambda: spool.add(m.sync_id, m.source, m.seq, metas, m.checksum, buf)]

    # -- telling engines ----------------------------------------------------------------
    async def _tell(self, c: cmd.Command) -> None:
        if isinstance(c, cmd.ForwardBucket):
            self._forward(c)
        elif isinstance(c, cmd.SyncOpened):
            self.inflight.routes[c.sync_id] = c
        elif isinstance(c, cmd.OpenStreams):
            self._open_streams(c)
        elif isinstance(c, cmd.SendFinalize):
            header = codec.encode_header(
                schema.Finalize(sync_id=c.sync_id, version=c.version, probes=c.probes, digest=c.digest)
            )
            if not self.transport.send_engine(c.engine_id, [header]):
                if self.feed is not None:  # unreachable: lost at once
                    await self.feed(ev.Tick())
            elif self.failpoints.get("duplicate_finalize"):  # fault injection (tests)
                self.transport.send_engine(c.engine_id, [header])
        elif isinstance(c, cmd.SendCommit):
            header = codec.encode_header(schema.Commit(sync_id=c.sync_id, version=c.version))
            if not self.transport.send_engine(c.engine_id, [header]) and self.feed is not None:
                await self.feed(ev.Tick())  # unreachable: lost at its deadline
        elif isinstance(c, cmd.SendServed):
            # a notice: one that does not arrive is made good when the engine registers again
            header = codec.encode_header(schema.Served(version=c.version, digest=c.digest, sync_id=c.sync_id))
            self.transport.send_engine(c.engine_id, [header])
        elif isinstance(c, cmd.SendAbort):
            header = codec.encode_header(schema.Abort(sync_id=c.sync_id))
            for eid in c.engine_ids:
                self.transport.send_engine(eid, [header])
        elif isinstance(c, cmd.EngineLost):
            log.warning("engine_lost", engine_id=c.engine_id, cause=c.cause)
        elif isinstance(c, cmd.EngineForgotten):
            self.transport.forget_engine(c.engine_id)
            self.metrics.forget_engine(c.engine_id)
            log.info("engine_forgotten", engine_id=c.engine_id)
        elif isinstance(c, cmd.SendSpooled):
            failure = self._recovery_of(c).send_spooled(c)
            if failure is not None and self.feed is not None:
                await self.feed(failure)
        else:
            self._recovery_command(c)

    def _recovery_of(self, c: cmd.Command) -> Recovery:
        if self.recovery is None:  # the core only asks for these with a spool
            raise make_error(ErrorCode.INTERNAL, f"{type(c).__name__} without a spool")
        return self.recovery

    def _recovery_command(self, c: cmd.Command) -> None:
        rec = self._recovery_of(c)
        if isinstance(c, cmd.StartRollback):
            rec.start_rollback(c)
        elif isinstance(c, cmd.CatchUpDone):
            self.metrics.catchups.labels("ok" if c.ok else "failed").inc()
            rec.catchup_done(c)
        else:
            raise make_error(ErrorCode.INTERNAL, f"unknown command {c!r}")

    def _failpoint_kill(self, step: str, trigger: str) -> None:
        """Fault injection (tests): SIGKILL this daemon right after a batch's `step`
        ("persisted" or "told") when the batch is the one named by `kill_after_STEP`."""
        want = self.failpoints.get(f"kill_after_{step}")
        if want is not None and trigger == want:
            os.kill(os.getpid(), signal.SIGKILL)

    def _forward(self, c: cmd.ForwardBucket) -> None:
        p = c.handle
        if not isinstance(p, Pending):
            raise make_error(ErrorCode.INTERNAL, f"no frame for bucket {c.key}")
        m = p.msg
        load = schema.Load(
            sync_id=m.sync_id,
            version=c.version,
            seq=m.seq,
            tensors=m.tensors,
            checksum=m.checksum,
            source=m.source,
            mac=m.mac,
            hold=self.recovery is not None and self.recovery.holds(m.sync_id),
            cut_for=self.recovery.cut_for(m.sync_id) if self.recovery is not None else (),
        )
        if m.size is not None and c.group is not None:
            self._forward_collective(c, msgspec.structs.replace(load, size=m.size))
            return
        ref_engines = set(c.ref_engines)
        framed = codec.encode_header(load)
        by_ref = codec.encode_header(msgspec.structs.replace(load, ref=m.ref)) if ref_engines else b""
        frame_bytes = len(p.frame) if p.frame is not None else (m.ref.size if m.ref else 0)
        pub_frames, pub_refs, rest = self._fanout_audience(c, ref_engines, frame_bytes).route(
            c.engine_ids, ref_engines
        )
        t = self.transport
        if (pub_frames and not t.publish([framed, p.frame])) or (pub_refs and not t.publish([by_ref])):
            self._fanout[m.sync_id].broken = True  # the socket failed: one send each from now
            rest = list(c.engine_ids)  # (a bucket taken twice is applied once)
        for eid in rest:
            if eid in ref_engines:
                self.transport.send_engine(eid, [by_ref])
            else:
                self.transport.send_engine(eid, [framed, p.frame])
        log.debug(
            "bucket_forwarded",
            sync_id=m.sync_id,
            seq=m.seq,
            source=m.source,
            nbytes=m.ref.size if m.ref else len(p.frame),
            engines=len(c.engine_ids),
            ref_engines=len(ref_engines),
            published=pub_frames or pub_refs,
        )

    def _fanout_audience(
        self, c: cmd.ForwardBucket, ref_engines: set[str], frame_bytes: int
    ) -> fanout.Audience:
        """The sync's fan-out audience, made (and its open published) at its first bucket,
        after each connection's queue is sized for the sync's bucket size: the trainer's
        (its window follows from it; a first bucket may be one oversized tensor), else
        this first frame's."""
        fan = self._fanout.get(c.sync_id)
        if fan is not None:
            return fan
        sized = self.inflight.bucket_bytes.get(c.sync_id)
        if sized is not None:
            self.transport.fanout_queue(sized[0], sources=sized[1])  # bound anew: none live yet
        else:  # the daemon's own replay (or an old trainer): grown for this frame if need be
            self.transport.fanout_queue(frame_bytes, floor=RECOVERY_WINDOW, shrink=False)
        fan = self._fanout[c.sync_id] = fanout.audience(c.engine_ids, ref_engines, self.transport.fanout_live)
        if fan.used:
            opening = fan.opening(c.sync_id, c.version, len(c.engine_ids))
            fan.broken = not self.transport.publish([codec.encode_header(opening)])
            log.info("fanout_opened", sync_id=c.sync_id, frames=len(fan.frames), refs=len(fan.refs))
        return fan

    def _ref(self, g: GroupRecord, eid: str) -> schema.GroupRef:
        """Engine `eid`'s GroupRef in `g` (made once per group and engine)."""
        refs = self._refs.get(g.id)
        if refs is None:  # a new group (a sharded push has one per source)
            refs = self._refs[g.id] = {}
        ref = refs.get(eid)
        if ref is None:
            ref = refs[eid] = schema.GroupRef(
                id=g.id,
                host=g.host,
                port=g.port,
                rank=g.rank_of(eid),
                world_size=g.world_size,
                backend=g.backend,
                timeout=g.timeout,
                token=g.token,
                store_key=g.store_key,
            )
        return ref

    def _open_streams(self, c: cmd.OpenStreams) -> None:
        """Each engine hears of the sync once; the trainer's framed broadcasts do the rest."""
        for eid in c.engine_ids:
            msg = schema.OpenStream(sync_id=c.sync_id, version=c.version, group=self._ref(c.group, eid))
            self.transport.send_engine(eid, [codec.encode_header(msg)])
        log.info("stream_opened", sync_id=c.sync_id, engines=len(c.engine_ids), group=c.group.id)

    def _forward_collective(self, c: cmd.ForwardBucket, load: schema.Load) -> None:
        """Each engine hears of the bucket (its metadata and its own rank); the bytes come
        to it from the trainer by broadcast, never through this process."""
        g = c.group
        if g is None:
            return
        for eid in c.engine_ids:
            ref = self._ref(g, eid)
            header = codec.encode_header(msgspec.structs.replace(load, group=ref))
            self.transport.send_engine(eid, [header])
        log.debug(
            "bucket_announced",
            sync_id=load.sync_id,
            seq=load.seq,
            nbytes=load.size,
            engines=len(c.engine_ids),
            group=g.id,
        )

    # -- replies ------------------------------------------------------------------------
    def complete_sync(self, c: cmd.CompleteSync) -> None:
        """Answer every request still waiting on the sync; forget it."""
        self.metrics.sync_ended(c.summary)
        if self.recovery is not None:
            self.recovery.sync_closed(c.sync_id)
        transports.close_readers(self.readers)  # drop mappings of the trainer's slots (they may be unlinked)
        swept = transports.sweep()
        if swept:
            log.info("stale_slots_swept", segments=len(swept))
        if self.publish is not None:
            self.publish()
        self._fanout.pop(c.sync_id, None)
        route = self.inflight.routes.get(c.sync_id)
        owners = set(self.inflight.owners.get(c.sync_id, {}))
        buckets, finishes = self.inflight.close(c.sync_id)
        if c.error is not None:
            for w in buckets:
                self.transport.reply_error(w, c.error)
            if route is not None and route.stream:  # a trainer mid-stream asked nothing: tell it
                answered = {w.ident for w in buckets + finishes}
                for ident in sorted(owners - answered):
                    self.transport.reply_error(Waiter(ident, 0), c.error)
        for w in finishes:
            if c.error is not None:
                self.transport.reply_error(w, c.error)
            else:
                self.transport.reply_ok(w, c.body or {})
        if c.error is not None:
            log.warning(
                "sync_failed",
                sync_id=c.sync_id,
                code=c.error.code.value,
                reason=c.error.message,
                state=c.state,
                dirty=c.dirty,
            )
        else:
            body = c.body or {}
            log.info(
                "sync_completed",
                sync_id=c.sync_id,
                version=body.get("version"),
                buckets=body.get("buckets"),
                nbytes=body.get("bytes"),
                seconds=body.get("seconds"),
                engines=len(body.get("engines", [])),
            )
