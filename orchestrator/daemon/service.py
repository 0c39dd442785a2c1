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
import signal
import socket as pysocket
import time
import uuid
from collections import defaultdict
from typing import Any

import structlog
import zmq
import zmq.asyncio

from messages import schema
from messages.shm import Reader, sweep_stale
from messages.errors import ErrorCode
from orchestrator.core import fsm
from orchestrator.daemon.auth import ServerAuth
from orchestrator.daemon.config import Settings, parse_failpoints
from orchestrator.daemon.journal import Journal
from orchestrator.daemon.locks import lock_state
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.peers import PeerTracker
from orchestrator.daemon.recovery import Recovery
from orchestrator.daemon.spool import Spool
from orchestrator.daemon.storage import Storage
from orchestrator.daemon.transport import Pending, Stats, Transport, Waiter
from orchestrator.daemon.dispatch import DAEMON_VERSION, Dispatch
from orchestrator.daemon.effects import Effects

log = structlog.get_logger()



class Service(Transport, Dispatch, Effects):
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
        self.metrics = Metrics()

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
        if s.metrics_bind:
            self.bound["metrics"] = self.metrics.serve(s.metrics_bind)
            self.metrics.publish(self.status())
        log.info("daemon_started", trainer=self.bound["trainer"], engine=self.bound["engine"],
                 metrics=self.bound.get("metrics"),
                 auth="curve" if self.auth else "none", spool=s.spool or None,
                 state=self.core.state.value, version=self.core.served_version,
                 dirty=self.core.dirty, state_db=self.settings.state_db)

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
        if self.metrics.server is not None:
            self.metrics.publish(self.status())

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
                    await self._execute(self.core.handle_engine_gone(eid, now).commands)
                    await self._execute(self.core.tick(now).commands)

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
            self.metrics.stop()
            log.info("daemon_stopped", state=self.core.state.value, version=self.core.served_version)

    def _set_spooled(self) -> fsm.Result:
        info = self.spool.info if self.spool else None
        return self.core.set_spooled(fsm.Spooled(info.version, info.digest, info.buckets) if info else None)

    def status(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        now_mono = time.monotonic()
        wall_offset = time.time() - now_mono
        # The FSM keeps monotonic time; users read wall-clock Unix seconds.
        for h in [*snap["history"], *([snap["last_sync"]] if snap.get("last_sync") else [])]:
            if isinstance(h.get("at"), (int, float)) and h["at"] < 1e9:
                h["at"] = round(h["at"] + wall_offset, 3)
        snap["spool"] = self.spool.view() if self.spool else None
        for e in snap["engines"]:
            rec = self.core.engines.get(e["engine_id"])
            e["heartbeat_age_s"] = round(now_mono - rec.last_seen, 3) if rec is not None else None
        snap["queues"] = {"pending_buckets": len(self.pending),
                          "unacked_bucket_requests": sum(len(w) for w in self.bucket_waiters.values()),
                          "effect_batches": len(self._effects)}
        snap["daemon"] = {"version": DAEMON_VERSION, "protocol": schema.PROTOCOL_VERSION,
                          "uptime_s": round(time.time() - self.started, 3),
                          "trainer_addr": self.bound.get("trainer"),
                          "engine_addr": self.bound.get("engine"),
                          "metrics_addr": self.bound.get("metrics"),
                          "state_db": self.settings.state_db,
                          "buckets_received": self.stats.buckets,
                          "bytes_received": self.stats.bytes_in,
                          "bytes_announced": self.stats.bytes_announced,
                          "errors": dict(self.stats.errors)}
        return snap
