"""Inputs from both sockets, decoded and handed to the core: the daemon's dispatcher.

Rules: mixed into `service.Service`. Each message is decoded once (the schema validates
it), turned into a core event, and the core's commands go to `Effects._execute`. A
refusal is answered with its typed error; nothing else is done for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from messages import codec, schema
from messages.checksums import checksum
from messages.errors import ErrorCode, MessageError, WeightSyncError, make_error
from orchestrator.core import fsm
from orchestrator.daemon.transport import Pending, Waiter

log = structlog.get_logger()

TRAINER_TYPES = ("hello", "begin", "bucket", "finish", "abort", "status")
ENGINE_TYPES = ("register", "heartbeat", "loaded", "finalized", "failed")
DAEMON_VERSION = "0.1.0"


class Dispatch:
    async def _on_trainer(self, ident: bytes, frames: list[Any]) -> None:
        if not frames:
            return
        try:
            decoded = codec.decode(frames, allowed=TRAINER_TYPES,
                                   max_header_bytes=self.settings.max_header_bytes)
        except MessageError as err:
            log.warning("message_refused", code=err.code.value, reason=err.reason, src="trainer")
            self._reply_error(Waiter(ident, codec.peek_id(frames[0])), err)
            return
        msg = decoded.msg
        w = Waiter(ident, msg.id)
        now = time.monotonic()
        self._batch_trigger = msg.TYPE
        sync_id = getattr(msg, "sync_id", None)
        if sync_id is not None and not isinstance(msg, schema.Abort):
            self.sync_owners[sync_id].add(ident)  # dropped with the sync or the connection
        try:
            if isinstance(msg, schema.Status):
                self._reply_ok(w, self.status())
            elif isinstance(msg, schema.Hello):
                self._reply_ok(w, {"protocol": schema.PROTOCOL_VERSION, "daemon": DAEMON_VERSION,
                                   "state": self.core.state.value,
                                   "version": self.core.served_version})
            elif isinstance(msg, schema.Begin):
                res = self.core.handle_begin(msg, now)
                # max_pending: what the trainer's automatic window must stay within
                body = {**(res.reply or {}), "max_pending": self.settings.max_pending}
                # journaled before the trainer hears ok
                await self._execute(res.commands, then=lambda: self._reply_ok(w, body))
            elif isinstance(msg, schema.Bucket):
                self._check_limits(ident, msg, decoded.payload)
                await self._on_bucket(w, msg, decoded.payload, now)
            elif isinstance(msg, schema.Finish):
                res = self.core.handle_finish(msg, now)
                self.finish_waiters[msg.sync_id].append(w)
                await self._execute(res.commands)
            elif isinstance(msg, schema.Abort):
                res = self.core.handle_abort(msg.sync_id, msg.reason, now)
                body = res.reply or {}
                await self._execute(res.commands, then=lambda: self._reply_ok(w, body))
        except WeightSyncError as err:
            log.info("request_refused", type=msg.TYPE, code=err.code.value, reason=err.message,
                     sync_id=getattr(msg, "sync_id", None))
            self._reply_error(w, err)
        except Exception as exc:  # our bug: fail the sync, tell the trainer, keep serving
            log.exception("request_crashed", type=msg.TYPE)
            await self._fail_internal("trainer", exc)
            self._reply_error(w, make_error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                                            state=self.core.state.value,
                                            version=self.core.served_version))

    def _check_limits(self, ident: bytes, msg: schema.Bucket, payload: list[Any]) -> None:
        s = self.settings
        sizes = [msg.shm.size] if msg.shm is not None else (
            [msg.size] if msg.size is not None else [len(f) for f in payload])
        big = [n for n in sizes if n > s.max_frame_bytes]
        if big:
            raise make_error(ErrorCode.TOO_LARGE, f"bucket frame of {big[0]} bytes exceeds "
                             f"max_frame_bytes {s.max_frame_bytes}; use smaller buckets",
                             state=self.core.state.value, version=self.core.served_version)
        pending = sum(1 for ws in self.bucket_waiters.values() for w in ws if w.ident == ident)
        if pending >= s.max_pending:
            raise make_error(ErrorCode.TOO_LARGE, f"{pending} bucket requests already pending on "
                             f"this connection (max_pending {s.max_pending}); lower the window",
                             state=self.core.state.value, version=self.core.served_version)

    async def _on_bucket(self, w: Waiter, msg: schema.Bucket, payload: list[Any], now: float) -> None:
        sync = self.core.require_sync(msg.sync_id, "bucket")  # a typed cause if it is not running
        if msg.size is not None:
            frame, nbytes = self._collective_bucket(sync, msg, payload), msg.size
        elif sync.transport == "collective":
            raise make_error(ErrorCode.BAD_MESSAGE, "this sync's buckets travel by the collective: "
                             "send their size, not their bytes or a shm slot",
                             state=self.core.state.value, sync_id=msg.sync_id)
        elif msg.shm is not None:
            if sync.transport == "inline":
                raise make_error(ErrorCode.BAD_MESSAGE,
                                 "shm bucket, but this sync did not negotiate shared memory "
                                 "(begin with transport=shm|auto from the engines' host)",
                                 state=self.core.state.value, sync_id=msg.sync_id)
            nbytes = msg.shm.size
            frame = None
            try:  # the same check every engine makes (messages.shm.open_segment)
                view = self.shm_reader.view(msg.shm.name, msg.shm.offset, msg.shm.size)
            except MessageError as exc:
                raise make_error(exc.code, f"bucket seq {msg.seq}: {exc.reason}",
                                 state=self.core.state.value, sync_id=msg.sync_id) from None
            if sync.transport == "mixed":  # cut an inline frame for the engines without shm
                frame = bytes(view)
                if checksum(frame) != msg.checksum:
                    raise make_error(ErrorCode.CHECKSUM_MISMATCH,
                                     f"bucket seq {msg.seq}: shm checksum mismatch; nothing applied",
                                     state=self.core.state.value, sync_id=msg.sync_id)
            del view
            # pure shm: the daemon never touches the bytes; every engine verifies the checksum
        else:
            frame = payload[0]
            nbytes = len(frame)
            if checksum(frame.buffer) != msg.checksum:
                raise make_error(ErrorCode.CHECKSUM_MISMATCH,
                                 f"bucket seq {msg.seq}: checksum does not match the frame; nothing applied",
                                 state=self.core.state.value, version=self.core.served_version,
                                 sync_id=msg.sync_id)
        key = (msg.sender, msg.seq)
        pkey = (msg.sync_id, key)
        self.pending[pkey] = Pending(msg, frame)
        try:
            res = self.core.handle_bucket(msg, nbytes, now)
        except WeightSyncError:
            self.pending.pop(pkey, None)
            raise
        if res.reply is not None:
            self.pending.pop(pkey, None)
            self._reply_ok(w, res.reply)
        else:
            self.bucket_waiters[pkey].append(w)
        self.stats.buckets += 1
        self.stats.bytes_announced += nbytes
        if frame is not None:  # bytes that passed through this process (not shm, not broadcast)
            self.stats.bytes_in += nbytes
            self.metrics.received_bytes.inc(nbytes)
        await self._execute(res.commands)  # _forward drops the pending frame once sent

    def _collective_bucket(self, sync: Any, msg: schema.Bucket, payload: list[Any]) -> Any:
        """The frame the daemon keeps of a collective bucket: the spool copy when this daemon
        spools (the trainer sends it along, and the checksum is checked here as for inline),
        else nothing: the bytes reach the engines by broadcast and never pass through here."""
        if sync.transport != "collective":
            raise make_error(ErrorCode.BAD_MESSAGE, "collective bucket, but this sync did not "
                             "negotiate a collective group (begin with transport=collective|auto "
                             "and a collective offer)", state=self.core.state.value, sync_id=msg.sync_id)
        if self.spool is None or sync.kind != "sync":
            return None
        if not payload:
            raise make_error(ErrorCode.BAD_MESSAGE, "this daemon spools: a collective bucket must "
                             "carry a copy of its bytes (begin's reply says spool_copy)",
                             state=self.core.state.value, sync_id=msg.sync_id)
        frame = payload[0]
        if checksum(frame.buffer) != msg.checksum:
            raise make_error(ErrorCode.CHECKSUM_MISMATCH, f"bucket seq {msg.seq}: checksum does not "
                             "match the spool copy; nothing applied",
                             state=self.core.state.value, sync_id=msg.sync_id)
        return frame

    async def _on_engine(self, ident: bytes, frames: list[Any]) -> None:
        try:
            decoded = codec.decode(frames, allowed=ENGINE_TYPES,
                                   max_header_bytes=self.settings.max_header_bytes)
        except MessageError as err:
            log.warning("message_refused", code=err.code.value, reason=err.reason, src="engine")
            self._reply_engine(ident, schema.Error(
                id=codec.peek_id(frames[0]), code=err.code.value, message=err.reason,
                state=self.core.state.value))
            return
        msg = decoded.msg
        now = time.monotonic()
        self._batch_trigger = msg.TYPE
        if isinstance(msg, schema.Register):
            holder = self._live_holder(msg, ident)
            if holder is not None:
                log.error("duplicate_engine_refused", engine_id=msg.engine_id, host=msg.host,
                          pid=msg.pid, holder_host=holder.host, holder_pid=holder.pid)
                self._reply_engine(ident, schema.Error(
                    id=msg.id, code=ErrorCode.DUPLICATE_ENGINE.value,
                    message=f"engine id {msg.engine_id!r} is held by a live engine (pid "
                            f"{holder.pid} on {holder.host or '?'}); give this one another "
                            f"--engine-id, or stop the other",
                    state=self.core.state.value,
                    details={"holder_host": holder.host, "holder_pid": holder.pid}))
                return
            old = self.engine_ident.get(msg.engine_id)
            if old is not None and old != ident:
                self.ident_engine.pop(old, None)
            self.engine_ident[msg.engine_id] = ident
            self.ident_engine[ident] = msg.engine_id
            res = self.core.handle_register(msg, now)
            log.info("engine_registered", engine_id=msg.engine_id, backend=msg.backend,
                     version=msg.version, state=res.reply.get("state") if res.reply else None)
            self._reply_engine(ident, schema.Ok(id=msg.id, body=res.reply or {}))
            await self._execute(res.commands)
            return
        engine_id = self.ident_engine.get(ident)
        if isinstance(msg, schema.Heartbeat):
            known = engine_id == msg.engine_id
            res = self.core.handle_heartbeat(msg.engine_id, now) if known else fsm.Result({"known": False})
            self._reply_engine(ident, schema.Ok(id=msg.id, body=res.reply or {}))
            await self._execute(res.commands)
            return
        if engine_id is None:
            log.warning("unregistered_engine_message", type=msg.TYPE)
            self._reply_engine(ident, schema.Error(
                id=msg.id, code=ErrorCode.INVALID_STATE.value, message="register first",
                state=self.core.state.value))
            return
        if isinstance(msg, schema.Loaded):
            self._failpoint_crash()
            self.metrics.apply_seconds.labels(engine_id).observe(msg.seconds)
            res = self.core.handle_loaded(engine_id, msg.sync_id, (msg.sender, msg.seq), now)
        elif isinstance(msg, schema.Finalized):
            log.info("engine_finalized", engine_id=engine_id, sync_id=msg.sync_id,
                     version=msg.version, finalize_count=msg.finalize_count, seconds=msg.seconds)
            self.metrics.finalize_seconds.labels(engine_id).observe(msg.seconds)
            res = self.core.handle_finalized(engine_id, msg, now)
        elif isinstance(msg, schema.Failed):
            log.warning("engine_reported_failure", engine_id=engine_id, sync_id=msg.sync_id,
                        code=msg.code, reason=msg.message, duplicate=msg.duplicate)
            res = self.core.handle_failed(engine_id, msg, now)
        else:
            return
        await self._execute(res.commands)

    def _live_holder(self, msg: schema.Register, ident: bytes) -> Any:
        """The record of another live process holding `msg.engine_id`, else None. A new
        registration of the same process (same host and pid, e.g. after a reconnect) or of
        a dead one (its connection closed, or it missed its heartbeats) is a rejoin."""
        rec = self.core.engines.get(msg.engine_id)
        old = self.engine_ident.get(msg.engine_id)
        if rec is None or old is None or old == ident or rec.state == "LOST":
            return None
        if (rec.host, rec.pid) == (msg.host, msg.pid):
            return None
        if self.engine_peers is not None and not self.engine_peers.connected(old):
            return None
        return rec

    def _failpoint_crash(self) -> None:
        """Fault injection (tests): a bug inside an engine message's handler."""
        n = self.failpoints.get("crash_on_loaded")
        if n is None:
            return
        self.failpoints["crash_on_loaded"] = n - 1
        if n - 1 <= 0:
            del self.failpoints["crash_on_loaded"]
            raise RuntimeError("failpoint crash_on_loaded")

    async def local_request(self, msg: schema.Bucket | schema.Finish, payload: list[Any],
                            on_reply: Callable[[dict[str, Any] | None, WeightSyncError | None], None]
                            ) -> None:
        w = Waiter(b"", 0, on_reply)
        try:
            if isinstance(msg, schema.Bucket):
                await self._on_bucket(w, msg, payload, time.monotonic())
            else:
                res = self.core.handle_finish(msg, time.monotonic())
                self.finish_waiters[msg.sync_id].append(w)
                await self._execute(res.commands)
        except WeightSyncError as err:
            on_reply(None, err)
