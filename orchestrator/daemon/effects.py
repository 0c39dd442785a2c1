"""Running the core's commands in the trust boundary's order: persist, tell engines, reply.

Rules: mixed into `service.Service`. Journal rows and spool writes go to the storage
thread; engine sends and replies follow once they are durable. A batch with something to
persist continues in its own task, so the loop keeps serving meanwhile; batches keep
their order (each waits for the one before), and a batch nested in a running one runs
inline. Failpoints `kill_after_persisted` / `kill_after_told` stop the daemon between
the steps (tests).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from messages import codec, schema
from messages.errors import ErrorCode, MessageError, make_error
from messages.shm import sweep_stale
from orchestrator.core import fsm

log = structlog.get_logger()

# Set inside a batch's continuation task (a ContextVar is per task): a batch nested in it
# runs inline instead of queueing behind the batch it is part of.
IN_EFFECTS: contextvars.ContextVar[bool] = contextvars.ContextVar("in_effects", default=False)
PERSIST = (fsm.Journal, fsm.SpoolBegin, fsm.SpoolCommit, fsm.SpoolDiscard)
REPLY = (fsm.AckBucket, fsm.CompleteSync)


class Effects:
    async def execute(self, commands: list[fsm.Command]) -> None:
        await self._execute(commands)

    async def _execute(self, commands: list[fsm.Command],
                       then: Callable[[], None] | None = None) -> None:
        """Run one input's commands in the order of the trust boundary: journal and spool
        writes first (on the storage thread, durable), then the engines, then the replies
        (`then` is this input's own reply). A batch with something to persist continues
        in a task once the storage thread is done, so the loop serves on meanwhile; batches
        keep their order (each waits for the one before)."""
        persist = [self._persist_job(c) for c in commands if isinstance(c, PERSIST)]
        persist += [job for c in commands if isinstance(c, fsm.ForwardBucket)
                    for job in self._spool_job(c)]
        rest = [c for c in commands if not isinstance(c, PERSIST)]
        trigger = self._batch_trigger
        if IN_EFFECTS.get() or (not persist and self._tail is None):
            if persist:  # nested in a running batch: persist, in order, then go on
                await self.storage.submit(persist)
            await self._tell_and_reply(rest, commands, then, trigger)
            return
        prev, done = self._tail, asyncio.get_running_loop().create_future()
        self._tail = done
        job = self.storage.submit(persist) if persist else None
        self._effects.add(asyncio.create_task(
            self._continue(prev, job, rest, commands, then, done, trigger)))

    async def _continue(self, prev: asyncio.Future | None, job: asyncio.Future | None,
                        rest: list[fsm.Command], commands: list[fsm.Command],
                        then: Callable[[], None] | None, done: asyncio.Future,
                        trigger: str) -> None:
        try:
            if prev is not None:
                await asyncio.shield(prev)
            IN_EFFECTS.set(True)  # this task's context only: nested batches run inline
            if job is not None:
                await job
                self._failpoint_kill("persisted", trigger)
            await self._tell_and_reply(rest, commands, then, trigger)
        except Exception as exc:
            log.exception("effects_failed")
            await self._fail_internal("effects", exc)
        finally:
            done.set_result(None)
            if self._tail is done:
                self._tail = None
            self._effects.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _tell_and_reply(self, rest: list[fsm.Command], commands: list[fsm.Command],
                              then: Callable[[], None] | None, trigger: str = "") -> None:
        if any(isinstance(c, fsm.SpoolCommit) for c in commands):
            await self._execute(self._set_spooled().commands)  # stale engines catch up now
        for cmd in rest:
            if not isinstance(cmd, REPLY):
                await self._tell(cmd)
        if rest:
            self._failpoint_kill("told", trigger)
        for cmd in rest:
            if isinstance(cmd, fsm.AckBucket):
                for w in self.bucket_waiters.pop((cmd.sync_id, cmd.key), []):
                    self._reply_ok(w, {"seq": cmd.key[1], "sender": cmd.key[0]})
            elif isinstance(cmd, fsm.CompleteSync):
                self._complete_sync_nowait(cmd)
        if then is not None:
            then()

    def _persist_job(self, cmd: fsm.Command) -> Callable[[], None]:
        """A closure for the storage thread: it captures now what it needs from the loop."""
        if isinstance(cmd, fsm.Journal):
            dirty = self.core.dirty
            if cmd.kind == "transition":
                d = cmd.data
                log.info("state_changed", src=d["from"], dst=d["to"], trigger=d["trigger"],
                         version=d.get("version"), sync_id=d.get("sync_id"), code=d.get("code"))
                return lambda: self.journal.transition(d, dirty)
            return lambda: self.journal.sync(cmd.data)
        spool = self.spool
        if spool is None:  # the FSM only asks for these with a spool
            raise make_error(ErrorCode.INTERNAL, f"{type(cmd).__name__} without a spool")
        if isinstance(cmd, fsm.SpoolBegin):
            return lambda: spool.begin(cmd.sync_id, cmd.version)
        if isinstance(cmd, fsm.SpoolCommit):
            return lambda: spool.commit(cmd.sync_id, cmd.version, cmd.digest)
        if isinstance(cmd, fsm.SpoolDiscard):
            return lambda: spool.discard(cmd.sync_id)
        raise make_error(ErrorCode.INTERNAL, f"not a storage command: {cmd!r}")

    def _spool_job(self, cmd: fsm.ForwardBucket) -> list[Callable[[], None]]:
        """The spool write of a bucket, before any engine is told of it."""
        sync, spool = self.core.sync, self.spool
        p = self.pending.get((cmd.sync_id, cmd.key))
        if spool is None or sync is None or sync.kind != "sync" or p is None:
            return []
        m, data = p.msg, p.frame
        if data is None and m.shm is None:  # a collective bucket the FSM asked no copy of
            return []
        if data is None:  # pure shm: the bytes are in the trainer's slot, valid until acked
            try:
                data = self.shm_reader.view(m.shm.name, m.shm.offset, m.shm.size)
            except MessageError as exc:
                reason = f"shm slot unreadable: {exc.reason}"
                return [lambda: spool.fail(reason)]
        buf = getattr(data, "buffer", data)
        metas = [t.to_wire() for t in m.tensors]
        return [lambda: spool.add(m.sync_id, m.sender, m.seq, metas, m.checksum, buf)]

    async def _tell(self, cmd: fsm.Command) -> None:
        if isinstance(cmd, fsm.ForwardBucket):
            self._forward(cmd)
        elif isinstance(cmd, fsm.SendFinalize):
            header = codec.encode_header(schema.Finalize(sync_id=cmd.sync_id, version=cmd.version,
                                                         probes=cmd.probes))
            if not self._send_engine(cmd.engine_id, [header]):
                await self._execute(self.core.tick(time.monotonic()).commands)
            elif self.failpoints.get("duplicate_finalize"):  # fault injection (tests)
                self._send_engine(cmd.engine_id, [header])
        elif isinstance(cmd, fsm.SendAbort):
            header = codec.encode_header(schema.Abort(sync_id=cmd.sync_id))
            for eid in cmd.engine_ids:
                self._send_engine(eid, [header])
        else:
            self._recovery_command(cmd)

    def _recovery_command(self, cmd: fsm.Command) -> None:
        rec = self.recovery
        if rec is None:  # the FSM only asks for these with a spool
            raise make_error(ErrorCode.INTERNAL, f"{type(cmd).__name__} without a spool")
        if isinstance(cmd, fsm.StartRollback):
            rec.start_rollback(cmd)
        elif isinstance(cmd, fsm.StartCatchUp):
            rec.start_catchup(cmd)
        elif isinstance(cmd, fsm.CatchUpAck):
            rec.catchup_acked(cmd)
        elif isinstance(cmd, fsm.CatchUpDone):
            self.metrics.catchups.labels("ok" if cmd.ok else "failed").inc()
            rec.catchup_done(cmd)
        else:
            raise make_error(ErrorCode.INTERNAL, f"unknown command {cmd!r}")

    def _failpoint_kill(self, step: str, trigger: str) -> None:
        """Fault injection (tests): SIGKILL this daemon right after a batch's `step`
        ("persisted" or "told") when the batch is the one named by `kill_after_STEP`."""
        want = self.failpoints.get(f"kill_after_{step}")
        if want is not None and trigger == want:
            os.kill(os.getpid(), signal.SIGKILL)

    def _forward(self, cmd: fsm.ForwardBucket) -> None:
        p = self.pending.get((cmd.sync_id, cmd.key))
        if p is None:
            raise make_error(ErrorCode.INTERNAL, f"no frame for bucket {cmd.key}")
        m = p.msg
        sync = self.core.sync
        if m.size is not None and sync is not None and sync.group is not None:
            self._forward_collective(cmd, m, sync.group, sync.version)
            return
        shm_engines = set(sync.shm_engines) if sync and m.shm is not None else set()
        load = schema.Load(sync_id=m.sync_id, version=sync.version if sync else 0, seq=m.seq,
                           tensors=m.tensors, checksum=m.checksum, sender=m.sender)
        inline = codec.encode_header(load)
        by_ref = codec.encode_header(msgspec.structs.replace(load, shm=m.shm)) if shm_engines else b""
        for eid in cmd.engine_ids:
            if eid in shm_engines:
                self._send_engine(eid, [by_ref])
            else:
                self._send_engine(eid, [inline, p.frame])
        self.pending.pop((cmd.sync_id, cmd.key), None)  # ZeroMQ holds its own reference now
        log.debug("bucket_forwarded", sync_id=m.sync_id, seq=m.seq,
                  nbytes=m.shm.size if m.shm else len(p.frame), engines=len(cmd.engine_ids),
                  shm_engines=len(shm_engines))

    def _forward_collective(self, cmd: fsm.ForwardBucket, m: schema.Bucket, g: Any, version: int) -> None:
        """Each engine hears of the bucket (its metadata and its own rank); the bytes come
        to it from the trainer by broadcast, never through this process."""
        for eid in cmd.engine_ids:
            ref = schema.GroupRef(id=g.id, host=g.host, port=g.port, rank=g.rank_of(eid),
                                  world_size=g.world_size, backend=g.backend, timeout=g.timeout)
            load = schema.Load(sync_id=m.sync_id, version=version, seq=m.seq, tensors=m.tensors,
                               checksum=m.checksum, sender=m.sender, group=ref, size=m.size)
            self._send_engine(eid, [codec.encode_header(load)])
        self.pending.pop((cmd.sync_id, cmd.key), None)
        log.debug("bucket_announced", sync_id=m.sync_id, seq=m.seq, nbytes=m.size,
                  engines=len(cmd.engine_ids), group=g.id)

    def _complete_sync_nowait(self, cmd: fsm.CompleteSync) -> None:
        self.sync_owners.pop(cmd.sync_id, None)
        self.metrics.sync_ended(cmd.summary)
        if self.recovery is not None:
            self.recovery.sync_closed(cmd.sync_id)
        self.shm_reader.close()  # drop mappings of the trainer's segments (they may be unlinked)
        swept = sweep_stale()
        if swept:
            log.info("shm_segments_swept", segments=len(swept))
        if self.metrics.server is not None:
            self.metrics.publish(self.status())
        waiters = self.finish_waiters.pop(cmd.sync_id, [])
        for key in [k for k in self.bucket_waiters if k[0] == cmd.sync_id]:
            ws = self.bucket_waiters.pop(key)
            if cmd.error is not None:
                for w in ws:
                    self._reply_error(w, cmd.error)
        for key in [k for k in self.pending if k[0] == cmd.sync_id]:
            self.pending.pop(key, None)
        for w in waiters:
            if cmd.error is not None:
                self._reply_error(w, cmd.error)
            else:
                self._reply_ok(w, cmd.body or {})
        if cmd.error is not None:
            log.warning("sync_failed", sync_id=cmd.sync_id, code=cmd.error.code.value,
                        reason=cmd.error.message, state=self.core.state.value,
                        dirty=self.core.dirty)
        else:
            body = cmd.body or {}
            log.info("sync_completed", sync_id=cmd.sync_id, version=body.get("version"),
                     buckets=body.get("buckets"), nbytes=body.get("bytes"),
                     seconds=body.get("seconds"), engines=len(body.get("engines", [])))
