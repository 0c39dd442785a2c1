"""Inputs from both sockets, decoded and handed to the core: the daemon's dispatcher.

Rules: each message is decoded once (the schema validates it; a refusal is answered with
the request's id whenever it can be read), turned into a core event with the facts only
this process can find (what a bucket's bytes hash to, whether a connection is still
open, how many requests a connection has pending), and fed to the core; its commands
go to the effects runner. Deciding what those facts mean is the core's job, never this
module's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import structlog
import zmq

from messages import codec, schema, transports
from messages.checksums import bucket_checksum
from messages.errors import ErrorCode, MessageError, WeightSyncError, make_error, wrong_socket_line
from messages.replies import JsonObject
from orchestrator import __version__
from orchestrator.core import Core
from orchestrator.core import events as ev
from orchestrator.core.commands import Result, SyncOpened
from orchestrator.daemon.config import Settings
from orchestrator.daemon.effects import Effects
from orchestrator.daemon.inflight import Inflight, Pending
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.transport import OnReply, Stats, Transport, Waiter, error_message

log = structlog.get_logger()

DAEMON_VERSION = __version__


@dataclass(frozen=True, slots=True)
class Answer:
    """Where an input's answer goes: `send(body)` when the core answers now (`first`: before
    the commands the input caused, as a bucket's ack or an engine's registration must go;
    else once they persisted), `park()` when it answers later, `fail(err)` when it gave no
    answer to an input that expects one."""

    send: Callable[[JsonObject], None]
    park: Callable[[], None] | None = None
    fail: Callable[[WeightSyncError], None] | None = None
    first: bool = False


class Dispatcher:
    def __init__(
        self,
        core: Core,
        effects: Effects,
        transport: Transport,
        inflight: Inflight,
        settings: Settings,
        metrics: Metrics,
        stats: Stats,
        readers: dict[str, transports.Reader],
        status: Callable[[], JsonObject],
        failpoints: dict[str, Any],
        fail_internal: Callable[[str, BaseException], Awaitable[None]],
    ) -> None:
        self.core = core
        self.effects = effects
        self.transport = transport
        self.inflight = inflight
        self.settings = settings
        self.metrics = metrics
        self.stats = stats
        self.readers = readers  # each "ref" transport's reader (this loop's task only)
        self.status = status
        self.failpoints = failpoints
        self.fail_internal = fail_internal

    def decide(
        self, event: ev.Event, answer: Answer | None = None
    ) -> tuple[Result, Callable[[], None] | None]:
        """The one way into the core: the event in (a refusal raises, having changed nothing),
        and its answer routed as the core said: now (`first`: before the commands the input
        caused; else returned, to be sent once they persisted), later (parked until a later
        command answers it), or not at all (our bug when the input expected one: said)."""
        res = self.core.handle(event, time.monotonic())
        if answer is None:
            return res, None
        if res.refusal is not None and answer.fail is not None:  # refused, having ended the sync
            fail, err = answer.fail, res.refusal
            return res, lambda: fail(err)
        if res.reply is not None:
            body = res.reply
            if answer.first:
                answer.send(body)
                return res, None
            return res, lambda: answer.send(body)
        if res.later and answer.park is not None:
            answer.park()
        elif answer.fail is not None:
            answer.fail(self.core.error(ErrorCode.INTERNAL, f"{event.TRIGGER}: no answer"))
        return res, None

    async def feed(self, event: ev.Event, answer: Answer | None = None) -> Result:
        """`decide`, then the commands, in the effects runner's order (journal and spool,
        engines, replies)."""
        res, then = self.decide(event, answer)
        await self.effects.execute(res.commands, then, event.TRIGGER)
        return res

    def _trainer(self, w: Waiter, park: Callable[[], None] | None = None, first: bool = False) -> Answer:
        return Answer(
            lambda body: self.transport.reply_ok(w, body),
            park,
            lambda err: self.transport.reply_error(w, err),
            first,
        )

    def _error(self, err: MessageError, socket: str, header: zmq.Frame) -> WeightSyncError:
        """A decode refusal, saying where the daemon is; a message type of the other socket
        (`register` here, `begin` at the engine socket) is WRONG_SOCKET, saying which socket
        this is and both addresses, so the peer can name the one it needs."""
        other = schema.FROM_ENGINE if socket == "trainer" else schema.FROM_TRAINER
        mtype = codec.peek_type(header) if err.code is ErrorCode.BAD_MESSAGE else None
        if mtype is None or mtype not in other:
            return self.core.error(err.code, err.reason)
        bound = self.transport.bound
        details = {
            "socket": socket,
            "type": mtype,
            "trainer_addr": bound.get("trainer", ""),
            "engine_addr": bound.get("engine", ""),
        }
        line = wrong_socket_line(bound.get(socket, f"this {socket} socket"), details)
        return self.core.error(ErrorCode.WRONG_SOCKET, f"type {mtype!r}: {line}", **details)

    # -- the trainer socket ---------------------------------------------------------------
    async def on_trainer(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        if not frames:
            return
        try:
            decoded = codec.decode(
                frames, allowed=schema.FROM_TRAINER, max_header_bytes=self.settings.max_header_bytes
            )
        except MessageError as err:
            refusal = self._error(err, "trainer", frames[0])
            log.warning("message_refused", code=refusal.code.value, reason=refusal.message, src="trainer")
            self.transport.reply_error(Waiter(ident, codec.peek_id(frames[0])), refusal)
            return
        msg = decoded.msg
        w = Waiter(ident, getattr(msg, "id", 0))
        sync_id = getattr(msg, "sync_id", None)
        try:
            if isinstance(msg, schema.Status):
                self.transport.reply_ok(w, self.status())
            elif isinstance(msg, schema.Hello):
                self.transport.reply_ok(
                    w,
                    {
                        "protocol": schema.PROTOCOL_VERSION,
                        "daemon": DAEMON_VERSION,
                        "state": self.core.state.value,
                        "version": self.core.served_version,
                    },
                )
            elif isinstance(msg, schema.Begin):
                await self.begin(w, ident, msg)
            elif isinstance(msg, schema.Bucket):
                # the frames as received (copy=False), passed through by the decoder untouched
                await self.bucket(w, msg, cast(list[zmq.Frame], decoded.payload))
                self.inflight.own(msg.sync_id, ident, msg.source)
            elif isinstance(msg, schema.Finish):
                await self.finish(w, msg)
                self.inflight.own(msg.sync_id, ident, msg.source)
            elif isinstance(msg, schema.Abort):
                await self.feed(ev.AbortSync(msg.sync_id, msg.reason, msg.code, msg.by), self._trainer(w))
        except WeightSyncError as err:
            log.info(
                "request_refused", type=msg.TYPE, code=err.code.value, reason=err.message, sync_id=sync_id
            )
            self.transport.reply_error(w, err)
        except Exception as exc:  # our bug: fail the sync, tell the trainer, keep serving
            log.exception("request_crashed", type=msg.TYPE)
            await self.fail_internal("trainer", exc)
            self.transport.reply_error(w, self.core.error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    async def begin(self, w: Waiter, ident: bytes, msg: schema.Begin) -> None:
        """A begin; what it leaves here (the sync's bucket size and sources, from the reply
        of the begin that opened it; its connection as the owner of the source) is recorded
        only once it opened or joined the running sync: a refused begin leaves nothing."""
        res = await self.feed(ev.BeginSync(msg, conn=ident), self._trainer(w))
        if res.refusal is not None:  # refused, and the running sync failed with it
            return
        reply = res.reply or {}
        named = str(reply.get("sync_id", msg.sync_id))
        size = reply.get("bucket_bytes")
        opened = any(isinstance(c, SyncOpened) and c.sync_id == named for c in res.commands)
        if opened and isinstance(size, int):  # read at the sync's first bucket (its fan-out queue)
            self.inflight.bucket_bytes[named] = (size, msg.sources)
        self.inflight.owners[named][ident] = msg.source  # taken: the sync runs under `named`

    async def bucket(self, w: Waiter, msg: schema.Bucket, payload: list[zmq.Frame]) -> None:
        """A bucket, with the facts about its bytes that only this process can find."""
        route = self.inflight.routes.get(msg.sync_id)
        carries = route.carries if route is not None else ""
        frame: zmq.Frame | bytes | None
        frame, checksum_ok, ref_error = None, None, None
        ref = msg.ref
        if msg.size is not None:  # a broadcast: a copy rides along only to be spooled
            nbytes = msg.size
            if payload and carries == "group" and route is not None and route.spool:
                frame = payload[0]
                checksum_ok = bucket_checksum(frame.buffer, msg.tensors) == msg.checksum
        elif ref is not None:
            nbytes = ref.size
            if carries == "ref" and route is not None:
                reader = transports.reader_of(ref.via, self.readers)
                try:  # the same checks every engine's reader makes
                    if reader is None:
                        ref_error = f"no transport {transports.ref_name(ref.via)!r} carries references here"
                    elif route.mixed:  # cut frames for the engines that cannot read the reference
                        frame = bytes(reader.view(ref.name, ref.offset, ref.size))
                        checksum_ok = bucket_checksum(frame, msg.tensors) == msg.checksum
                    else:  # references only: the daemon never touches the bytes; engines verify
                        reader.check(ref.name, ref.offset, ref.size)
                except MessageError as exc:
                    ref_error = exc.reason
        else:
            frame = payload[0]
            nbytes = len(frame)
            if carries in ("frame", "ref"):
                checksum_ok = bucket_checksum(frame.buffer, msg.tensors) == msg.checksum
        held = Pending(msg, frame)
        self.inflight.held.add(held)
        event = ev.BucketIn(
            msg,
            nbytes,
            has_payload=bool(payload),
            checksum_ok=checksum_ok,
            ref_error=ref_error,
            pending=self.inflight.pending_on(w.ident),
            handle=held,  # the bytes ride with the event and its ForwardBucket, nowhere else
            conn=w.ident,
        )
        del held
        key = (msg.sync_id, (msg.source, msg.seq))
        # The ack goes before the forwarding it causes, or waits for the engines (cumulative).
        answer = self._trainer(w, lambda: self.inflight.bucket_waiters[key].append(w), first=True)
        res, then = self.decide(event, answer)  # a refused bucket is not counted below
        self.stats.buckets += 1
        self.stats.bytes_announced += nbytes
        if frame is not None:  # bytes that passed through this process (not by reference or broadcast)
            self.stats.bytes_in += nbytes
            self.metrics.received_bytes.inc(nbytes)
        del event, frame
        await self.effects.execute(res.commands, then, "bucket")  # forwarding drops the frame

    async def finish(self, w: Waiter, msg: schema.Finish) -> None:
        # answered when its sync completes
        await self.feed(
            ev.FinishSync(msg, conn=w.ident),
            self._trainer(w, lambda: self.inflight.finish_waiters[msg.sync_id].append(w)),
        )

    async def local_request(
        self,
        msg: schema.Bucket | schema.Finish,
        payload: list[zmq.Frame],
        on_reply: OnReply,
    ) -> None:
        """The daemon's own request (a rollback's), answered through `on_reply`."""
        w = Waiter(b"", 0, on_reply)
        try:
            if isinstance(msg, schema.Bucket):
                await self.bucket(w, msg, payload)
            else:
                await self.finish(w, msg)
        except WeightSyncError as err:
            on_reply(None, err)

    async def trainer_disconnected(self, ident: bytes) -> None:
        for sync_id, source in self.inflight.connection_closed(ident):
            log.warning("trainer_disconnected", sync_id=sync_id, source=source)
            await self.feed(ev.TrainerGone(sync_id, source))
        await self.feed(ev.TrainerGone("", conn=ident))  # the groups whose store it hosted go

    # -- the engine socket ----------------------------------------------------------------
    async def on_engine(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        try:
            decoded = codec.decode(
                frames, allowed=schema.FROM_ENGINE, max_header_bytes=self.settings.max_header_bytes
            )
        except MessageError as err:
            refusal = self._error(err, "engine", frames[0])
            log.warning("message_refused", code=refusal.code.value, reason=refusal.message, src="engine")
            # the served version too, as on the trainer socket
            self.transport.reply_engine(ident, error_message(refusal, codec.peek_id(frames[0])))
            return
        msg = decoded.msg
        if isinstance(msg, schema.Register):
            await self.register(ident, msg)
            return
        engine_id = self.transport.engine_of(ident)
        if isinstance(msg, schema.Heartbeat):
            self.transport.stats.heartbeats += 1
            # only an unknown engine is answered (it registers again)
            hb = ev.Heartbeat(
                msg.engine_id, registered_here=engine_id == msg.engine_id, server_error=msg.server_error
            )
            await self.feed(hb, self._engine(ident, msg.id))
            return
        if isinstance(msg, schema.Goodbye):
            if engine_id == msg.engine_id:  # only from the connection that registered it
                log.info("engine_goodbye", engine_id=engine_id)
                await self.feed(ev.EngineGone(engine_id, goodbye=True))
                await self.feed(ev.Tick())
            return
        if engine_id is None:
            log.warning("unregistered_engine_message", type=msg.TYPE)
            self.transport.reply_engine(
                ident,
                schema.Error(
                    id=getattr(msg, "id", 0),
                    code=ErrorCode.INVALID_STATE.value,
                    message="register first",
                    state=self.core.state.value,
                ),
            )
            return
        if isinstance(msg, schema.Loaded):
            self._failpoint_crash()
            self._count_applied(engine_id, msg.count, msg.seconds)
            await self.feed(ev.Loaded(engine_id, msg.sync_id, (msg.source, msg.seq), msg.also, msg.more))
        elif isinstance(msg, schema.Prepared):
            log.info(
                "engine_prepared",
                engine_id=engine_id,
                sync_id=msg.sync_id,
                buckets=msg.buckets,
                nbytes=msg.nbytes,
                seconds=msg.seconds,
            )
            self._count_applied(engine_id, msg.buckets, msg.seconds)
            await self.feed(ev.EnginePrepared(engine_id, msg))
        elif isinstance(msg, schema.Finalized):
            log.info(
                "engine_finalized",
                engine_id=engine_id,
                sync_id=msg.sync_id,
                version=msg.version,
                finalize_count=msg.finalize_count,
                seconds=msg.seconds,
            )
            self.metrics.finalize_seconds.labels(engine_id).observe(msg.seconds)
            await self.feed(ev.EngineFinalized(engine_id, msg))
        elif isinstance(msg, schema.Committed):
            log.info("engine_committed", engine_id=engine_id, sync_id=msg.sync_id, label=msg.label)
            await self.feed(ev.EngineCommitted(engine_id, msg))
        elif isinstance(msg, schema.Failed):
            log.warning(
                "engine_reported_failure",
                engine_id=engine_id,
                sync_id=msg.sync_id,
                code=msg.code,
                reason=msg.message,
                duplicate=msg.duplicate,
            )
            await self.feed(ev.EngineFailed(engine_id, msg))

    def _count_applied(self, engine_id: str, buckets: int, seconds: float) -> None:
        """Buckets an engine reports applied (coalesced `loaded`, or a stream's `prepared`)."""
        if buckets:
            seconds_c, buckets_c = self.metrics.applied(engine_id)
            seconds_c.inc(seconds)
            buckets_c.inc(buckets)

    def _engine(self, ident: bytes, req_id: int, extra: JsonObject | None = None) -> Answer:
        """An engine's answer: always before the commands its input caused (a registration
        precedes the catch-up buckets it starts)."""
        return Answer(
            lambda body: self.transport.reply_engine(
                ident, schema.Ok(id=req_id, body={**body, **(extra or {})})
            ),
            first=True,
        )

    async def register(self, ident: bytes, msg: schema.Register) -> None:
        event = ev.EngineRegistered(
            msg, other_connection=self.transport.other_connection(msg.engine_id, ident)
        )
        extra: JsonObject | None = None
        if msg.fanout and "fanout" in self.transport.bound:  # v4: where to take published buckets
            extra = {"fanout": self.transport.bound["fanout"]}

        def registered(body: JsonObject) -> None:
            self.transport.registered(msg.engine_id, ident)
            log.info(
                "engine_registered",
                engine_id=msg.engine_id,
                backend=msg.backend,
                version=msg.version,
                state=body.get("state"),
            )
            self._engine(ident, msg.id, extra).send(body)

        try:
            await self.feed(event, Answer(registered, first=True))
        except WeightSyncError as err:
            log.error(
                "engine_refused",
                engine_id=msg.engine_id,
                host=msg.host,
                pid=msg.pid,
                code=err.code.value,
                reason=err.message,
            )
            self.transport.reply_engine(
                ident,
                schema.Error(
                    id=msg.id,
                    code=err.code.value,
                    message=err.message,
                    state=self.core.state.value,
                    details=err.details or None,
                ),
            )

    async def engine_disconnected(self, ident: bytes) -> None:
        eid = self.transport.engine_of(ident)
        if eid is not None:
            log.info("engine_disconnected", engine_id=eid)
            await self.feed(ev.EngineGone(eid))
            await self.feed(ev.Tick())

    def _failpoint_crash(self) -> None:
        """Fault injection (tests): a bug inside an engine message's handler."""
        n = self.failpoints.get("crash_on_loaded")
        if n is None:
            return
        self.failpoints["crash_on_loaded"] = n - 1
        if n - 1 <= 0:
            del self.failpoints["crash_on_loaded"]
            raise RuntimeError("failpoint crash_on_loaded")


__all__ = ["DAEMON_VERSION", "Answer", "Dispatcher", "make_error"]
