"""The daemon: the only code that owns orchestrator sockets. startup -> loop -> shutdown.

Rules: one asyncio task owns both ROUTER sockets (pyzmq sockets are not thread-safe), reads
them, feeds the pure FSM and executes the commands it returns. The task awaits readiness
through asyncio shadows of the sockets but receives and sends synchronously (NOBLOCK):
zmq.asyncio's per-call futures end up in reference cycles that keep received bucket
frames alive until the cyclic GC runs, which let the daemon's memory climb to several
buckets past the window. Tensor frames are received
with copy=False and the same zmq.Frame is relayed to every engine with copy=False: ZeroMQ
refcounts the message, so fan-out to N engines costs no copy, and its I/O thread moves the
bytes to all engines at once while this task goes on (that is the concurrent fan-out;
`asyncio.gather` over one socket would break the one-owner rule). Bad input is answered
with a typed `error`; the FSM raised before changing anything.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import socket as pysocket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from messages import codec, schema
from messages.checksums import checksum
from messages.shm import Reader, sweep_stale
from messages.errors import ErrorCode, MessageError, WeightSyncError, make_error
from orchestrator import fsm
from orchestrator.auth import ServerAuth
from orchestrator.config import Settings, parse_failpoints
from orchestrator.journal import Journal
from orchestrator.locks import lock_state
from orchestrator.peers import PeerTracker
from orchestrator.recovery import Recovery
from orchestrator.spool import Spool
from orchestrator.storage import Storage

log = structlog.get_logger()

# Set inside a batch's continuation task (a ContextVar is per task): a batch nested in it
# runs inline instead of queueing behind the batch it is part of.
IN_EFFECTS: contextvars.ContextVar[bool] = contextvars.ContextVar("in_effects", default=False)
PERSIST = (fsm.Journal, fsm.SpoolBegin, fsm.SpoolCommit, fsm.SpoolDiscard)
REPLY = (fsm.AckBucket, fsm.CompleteSync)

TRAINER_TYPES = ("hello", "begin", "bucket", "finish", "abort", "status")
ENGINE_TYPES = ("register", "heartbeat", "loaded", "finalized", "failed")
DAEMON_VERSION = "0.1.0"


@dataclass(slots=True)
class Waiter:
    ident: bytes
    req_id: int
    # Set for the daemon's own requests (rollback): the reply goes here, not to a socket.
    on_reply: Callable[[dict[str, Any] | None, WeightSyncError | None], None] | None = None


@dataclass(slots=True)
class Pending:
    """Frames of a bucket between its arrival and its forwarding."""

    msg: schema.Bucket
    frame: Any


@dataclass(slots=True)
class Stats:
    buckets: int = 0
    bytes_in: int = 0
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def refuse_live_ipc(addr: str) -> None:
    """ZeroMQ silently takes over an ipc:// path another process is bound to (it unlinks
    the file), which would split engines between two daemons. Refuse if someone answers."""
    if not addr.startswith("ipc://"):
        return
    path = addr[len("ipc://"):]
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return  # nobody there (or a stale file ZeroMQ will replace)
    except OSError:
        return
    finally:
        probe.close()
    raise OSError(f"{addr} is in use by another process")


class Service:
    def __init__(self, settings: Settings, ctx: zmq.Context | None = None) -> None:
        self.settings = settings
        self.ctx = ctx or zmq.Context.instance()
        self.locks = lock_state(settings.state_db, settings.spool)  # one daemon per state
        try:
            self.journal = Journal(settings.state_db)
        except BaseException:
            self._release_locks()
            raise
        rec = self.journal.recover()
        limits = fsm.Limits(min_engines=settings.min_engines, engine_timeout=settings.engine_timeout,
                            sync_timeout=settings.sync_timeout, bucket_timeout=settings.bucket_timeout,
                            finalize_timeout=settings.finalize_timeout, host=pysocket.gethostname(),
                            spool=bool(settings.spool), trainer_grace=settings.trainer_grace)
        self.shm_reader = Reader()
        self.core = fsm.Orchestrator(limits, initial=fsm.State(rec.state),
                                     served_version=rec.version, served_digest=rec.digest,
                                     dirty=rec.dirty, now=time.monotonic(),
                                     run_id=uuid.uuid4().hex[:8])
        self.core.history.extend(rec.history)
        for r in reversed(self.journal.syncs(4096)):  # ids a new begin may not reuse
            if r["status"] == "READY":
                self.core.remember_ended(r["sync_id"], None, "READY")
            elif r["status"] in ("INTERRUPTED", "LOADING_BUCKETS", "FINALIZING"):
                self.core.remember_ended(r["sync_id"], ErrorCode.UNKNOWN_SYNC.value,
                                         "interrupted: the daemon restarted during this sync; "
                                         "begin again with a new sync_id")
            else:
                self.core.remember_ended(r["sync_id"], r["code"] or ErrorCode.INTERNAL.value,
                                         f"{r['status']}: {r['reason'] or 'no reason recorded'}")
        self.spool = Spool(settings.spool) if settings.spool else None
        self.recovery = Recovery(self, self.spool) if self.spool else None
        self._set_spooled()
        if rec.interrupted:
            log.warning("sync_interrupted_recovered", sync_id=rec.interrupted, version=rec.version)
        self.trainer_sock: zmq.Socket | None = None
        self.engine_sock: zmq.Socket | None = None
        self.engine_ident: dict[str, bytes] = {}
        self.ident_engine: dict[bytes, str] = {}
        self.pending: dict[tuple[str, tuple[int, int]], Pending] = {}
        self.bucket_waiters: dict[tuple[str, tuple[int, int]], list[Waiter]] = defaultdict(list)
        self.finish_waiters: dict[str, list[Waiter]] = defaultdict(list)
        self.stats = Stats()
        self.started = time.time()
        self._stop = asyncio.Event()
        self.bound: dict[str, str] = {}
        self.auth: ServerAuth | None = None
        self.trainer_peers: PeerTracker | None = None
        self.engine_peers: PeerTracker | None = None
        self.sync_owners: dict[str, set[bytes]] = defaultdict(set)  # trainer connections per sync
        self.storage = Storage()
        self._tail: asyncio.Future | None = None  # the last batch whose effects are pending
        self._effects: set[asyncio.Task] = set()
        self._batch_trigger = ""
        self.failpoints = parse_failpoints(settings.failpoints)

    # -- lifecycle ----------------------------------------------------------------------
    def startup(self) -> None:
        sweep_stale()  # shared-memory segments left by crashed trainers or engines
        # ZeroMQ disconnects a peer whose frame passes MAXMSGSIZE before buffering it; below
        # that, an oversized frame gets a typed TOO_LARGE (engines only ever send headers).
        s = self.settings
        if s.keys:
            self.auth = ServerAuth(self.ctx, s.keys)
        self.trainer_sock = self._router(s.bind, 2 * max(s.max_frame_bytes, s.max_header_bytes),
                                         "trainer")
        self.engine_sock = self._router(s.engine_bind, 2 * s.max_header_bytes, "engine")
        self.trainer_peers = PeerTracker(self.trainer_sock)
        self.engine_peers = PeerTracker(self.engine_sock)
        self.bound = {
            "trainer": self.trainer_sock.getsockopt_string(zmq.LAST_ENDPOINT),
            "engine": self.engine_sock.getsockopt_string(zmq.LAST_ENDPOINT),
        }
        log.info("daemon_started", trainer=self.bound["trainer"], engine=self.bound["engine"],
                 auth="curve" if self.auth else "none", spool=s.spool or None,
                 state=self.core.state.value, version=self.core.served_version,
                 dirty=self.core.dirty, state_db=self.settings.state_db)

    def _router(self, addr: str, max_msg: int, role: str) -> zmq.Socket:
        refuse_live_ipc(addr)
        sock = self.ctx.socket(zmq.ROUTER)
        if self.auth is not None:
            self.auth.apply(sock, role)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a drop
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the window, not by a silent drop
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(addr)
        return sock

    def _release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        if self.trainer_sock is None:
            self.startup()
        try:
            await self._loop()
        finally:
            self.shutdown()

    async def _loop(self) -> None:
        poller = zmq.asyncio.Poller()
        trainer_wait = zmq.asyncio.Socket.from_socket(self.trainer_sock)
        engine_wait = zmq.asyncio.Socket.from_socket(self.engine_sock)
        poller.register(trainer_wait, zmq.POLLIN)
        poller.register(engine_wait, zmq.POLLIN)
        monitors = [zmq.asyncio.Socket.from_socket(p.monitor)
                    for p in (self.trainer_peers, self.engine_peers) if p is not None]
        for m in monitors:
            poller.register(m, zmq.POLLIN)
        tick_ms = int(self.settings.tick_interval * 1000)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            events = dict(await poller.poll(tick_ms))
            # Engines first: their acks free window slots the trainer is waiting on.
            if engine_wait in events:
                await self._drain_socket(self.engine_sock, self._on_engine)
            if trainer_wait in events:
                await self._drain_socket(self.trainer_sock, self._on_trainer)
            if any(m in events for m in monitors):
                await self._guarded("connections", self._on_disconnects)
            now = time.monotonic()
            if now - last_tick >= self.settings.tick_interval:
                last_tick = now
                await self._guarded("timer", self._on_tick, now)
            if self.recovery is not None:
                await self._guarded("recovery", self.recovery.pump)

    async def _on_tick(self, now: float) -> None:
        await self._execute(self.core.tick(now).commands)  # deadlines, lost engines, rollback

    async def _drain_socket(self, sock: zmq.Socket, handler: Any, budget: int = 256) -> None:
        src = "engine" if sock is self.engine_sock else "trainer"
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peers = self.engine_peers if src == "engine" else self.trainer_peers
            if peers is not None:
                peers.seen(frames[0].bytes, frames[0])
            await self._guarded(src, handler, frames[0].bytes, frames[1:])

    async def _on_disconnects(self) -> None:
        now = time.monotonic()
        if self.trainer_peers is not None:
            for ident in self.trainer_peers.drain():
                for sync_id, owners in list(self.sync_owners.items()):
                    owners.discard(ident)
                    if not owners:
                        del self.sync_owners[sync_id]
                        log.warning("trainer_disconnected", sync_id=sync_id)
                        await self._execute(self.core.handle_trainer_gone(sync_id, now).commands)
        if self.engine_peers is not None:
            for ident in self.engine_peers.drain():
                eid = self.ident_engine.get(ident)
                if eid is not None:
                    log.info("engine_disconnected", engine_id=eid)

    async def _guarded(self, src: str, handler: Any, *args: Any) -> None:
        """The exception boundary of one input (a message or a timer): a bug fails the
        running sync with INTERNAL, logged once with its traceback; the daemon serves on."""
        try:
            await handler(*args)
        except Exception as exc:
            log.exception("input_crashed", src=src)
            await self._fail_internal(src, exc)

    async def _fail_internal(self, src: str, exc: BaseException) -> None:
        try:
            res = self.core.handle_internal(f"{src} input: {type(exc).__name__}: {exc}",
                                            time.monotonic())
            await self._execute(res.commands)
        except Exception:  # failing the sync failed too: the state stays, the loop goes on
            log.exception("internal_failure_unhandled", src=src)

    def shutdown(self) -> None:
        try:
            self.storage.close()  # what was submitted is written; then the journal is ours
            res = self.core.handle_shutdown(time.monotonic())
            for cmd in res.commands:
                if isinstance(cmd, fsm.Journal):
                    self._persist_job(cmd)()
            # Best effort: tell waiting trainers and engines before the sockets close.
            for cmd in res.commands:
                if isinstance(cmd, fsm.CompleteSync):
                    self._complete_sync_nowait(cmd)
        finally:
            for peers in (self.trainer_peers, self.engine_peers):
                if peers is not None:
                    peers.close()
            for sock in (self.trainer_sock, self.engine_sock):
                if sock is not None:
                    sock.close(linger=500)
            self.journal.close()
            self._release_locks()
            if self.auth is not None:
                self.auth.stop()
            log.info("daemon_stopped", state=self.core.state.value, version=self.core.served_version)

    # -- sending ------------------------------------------------------------------------
    @staticmethod
    def _send_now(sock: zmq.Socket, frames: list[Any]) -> None:
        """Send without blocking; a send error is raised here, to the caller.

        HWMs are 0 and messages are bounded by the client's window, so a send completes
        at once; ROUTER_MANDATORY makes an unknown peer an error (EHOSTUNREACH).
        """
        sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)

    def _send_trainer(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.trainer_sock, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the trainer went away; its sync's deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE)

    def _reply_engine(self, ident: bytes, msg: schema.Message) -> None:
        try:
            self._send_now(self.engine_sock, [ident, codec.encode_header(msg)])
        except zmq.ZMQError as exc:  # the engine went away; its heartbeat deadline handles it
            log.warning("reply_undeliverable", error=str(exc), type=msg.TYPE, src="engine")

    def _reply_ok(self, w: Waiter, body: dict[str, Any]) -> None:
        if w.on_reply is not None:
            w.on_reply(body, None)
            return
        self._send_trainer(w.ident, schema.Ok(id=w.req_id, body=body))

    def _reply_error(self, w: Waiter, err: WeightSyncError | MessageError) -> None:
        if isinstance(err, MessageError):
            err = make_error(err.code, err.reason, state=self.core.state.value,
                             version=self.core.served_version,
                             sync_id=self.core.sync.sync_id if self.core.sync else None)
        if w.on_reply is not None:
            w.on_reply(None, err)
            return
        self.stats.errors[err.code.value] += 1
        f = err.to_fields()
        self._send_trainer(w.ident, schema.Error(id=w.req_id, code=f["code"], message=f["message"],
                                                 state=f["state"], version=f["version"],
                                                 sync_id=f["sync_id"], details=f.get("details")))

    def _send_engine(self, engine_id: str, frames: list[Any]) -> bool:
        ident = self.engine_ident.get(engine_id)
        if ident is None:
            return False
        try:
            self._send_now(self.engine_sock, [ident, *frames])
            return True
        except zmq.ZMQError as exc:
            log.warning("engine_unreachable", engine_id=engine_id, error=str(exc))
            return False

    # -- trainer side -------------------------------------------------------------------
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
                body = res.reply or {}
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
        sizes = [msg.shm.size] if msg.shm is not None else [len(f) for f in payload]
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
        if msg.shm is not None:
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
        self.stats.bytes_in += nbytes
        await self._execute(res.commands)  # _forward drops the pending frame once sent

    # -- engine side --------------------------------------------------------------------
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
            res = self.core.handle_loaded(engine_id, msg.sync_id, (msg.sender, msg.seq), now)
        elif isinstance(msg, schema.Finalized):
            log.info("engine_finalized", engine_id=engine_id, sync_id=msg.sync_id,
                     version=msg.version, finalize_count=msg.finalize_count, seconds=msg.seconds)
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

    # -- the daemon's own requests (rollback), answered through Waiter.on_reply -----------
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

    def send_engine(self, engine_id: str, frames: list[Any]) -> bool:
        return self._send_engine(engine_id, frames)

    async def execute(self, commands: list[fsm.Command]) -> None:
        await self._execute(commands)

    def _set_spooled(self) -> fsm.Result:
        info = self.spool.info if self.spool else None
        return self.core.set_spooled(fsm.Spooled(info.version, info.digest, info.buckets) if info else None)

    # -- commands -----------------------------------------------------------------------
    # -- effects: persist -> tell engines -> reply ------------------------------------------
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

    async def drain_effects(self) -> None:
        """Wait until every pending batch has run (shutdown, tests)."""
        while self._tail is not None:
            await asyncio.shield(self._tail)

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

    def _complete_sync_nowait(self, cmd: fsm.CompleteSync) -> None:
        self.sync_owners.pop(cmd.sync_id, None)
        if self.recovery is not None:
            self.recovery.sync_closed(cmd.sync_id)
        self.shm_reader.close()  # drop mappings of the trainer's segments (they may be unlinked)
        swept = sweep_stale()
        if swept:
            log.info("shm_segments_swept", segments=len(swept))
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

    def status(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        now_mono = time.monotonic()
        wall_offset = time.time() - now_mono
        # The FSM keeps monotonic time; users read wall-clock Unix seconds.
        for h in [*snap["history"], *([snap["last_sync"]] if snap.get("last_sync") else [])]:
            if isinstance(h.get("at"), (int, float)) and h["at"] < 1e9:
                h["at"] = round(h["at"] + wall_offset, 3)
        snap["spool"] = self.spool.view() if self.spool else None
        snap["daemon"] = {"version": DAEMON_VERSION, "protocol": schema.PROTOCOL_VERSION,
                          "uptime_s": round(time.time() - self.started, 3),
                          "trainer_addr": self.bound.get("trainer"),
                          "engine_addr": self.bound.get("engine"),
                          "state_db": self.settings.state_db,
                          "buckets_received": self.stats.buckets,
                          "bytes_received": self.stats.bytes_in,
                          "errors": dict(self.stats.errors)}
        return snap
