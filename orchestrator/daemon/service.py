"""The daemon: startup -> loop -> shutdown around the pure core.

Rules: one asyncio task owns both ROUTER sockets (`Transport`), reads them, hands each
message to the `Dispatcher` (which feeds the core) and lets the `Effects` runner carry
out the commands. The task awaits readiness through asyncio shadows of the sockets but
receives and sends synchronously (NOBLOCK): zmq.asyncio's per-call futures end up in
reference cycles that keep received bucket frames alive until the cyclic GC runs. Tensor
frames are received with copy=False and the same zmq.Frame is relayed to every engine
with copy=False: ZeroMQ refcounts the message, so fan-out to N engines costs no copy.
Every input runs inside one exception boundary: a bug fails the running sync with
INTERNAL and the daemon serves on.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import signal
import socket as pysocket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ParamSpec, overload

import structlog
import zmq
import zmq.asyncio

from messages import fanout, schema, transports
from messages.checksums import DIGEST_SCHEME
from messages.errors import ErrorCode
from messages.replies import Json, JsonObject
from orchestrator.core import Core, Limits, State
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.daemon.auth import ServerAuth
from orchestrator.daemon.config import Settings, parse_failpoints
from orchestrator.daemon.dispatch import DAEMON_VERSION, Dispatcher
from orchestrator.daemon.effects import Effects
from orchestrator.daemon.inflight import Inflight
from orchestrator.daemon.journal import Journal
from orchestrator.daemon.locks import StateLock, lock_state
from orchestrator.daemon.metrics import Metrics
from orchestrator.daemon.peers import PeerTracker
from orchestrator.daemon.recovery import Recovery
from orchestrator.daemon.spool import Spool
from orchestrator.daemon.storage import Storage
from orchestrator.daemon.transport import Stats, Transport

log = structlog.get_logger()
_P = ParamSpec("_P")

IDLE_COALESCE = 0.05  # seconds an idle daemon lets engine messages gather between two reads
# seconds: after an input, the metrics' state snapshot is at most this old (published with
# each tick and sync end, else at most this often while inputs come; nothing when idle)
METRICS_REFRESH = 0.2
STUCK_RETRY = 0.01  # seconds: a wake-up the core's tick then finds nothing due at is retried


def _ended(journal: Journal) -> list[tuple[str, str | None, str]]:
    """Sync ids a new begin may not reuse, with how each ended (oldest first)."""
    out: list[tuple[str, str | None, str]] = []
    for r in reversed(journal.syncs(4096)):
        if r["status"] == "READY":
            out.append((r["sync_id"], None, "READY"))
        elif r["status"] in ("INTERRUPTED", "LOADING_BUCKETS", "FINALIZING"):
            out.append(
                (
                    r["sync_id"],
                    ErrorCode.UNKNOWN_SYNC.value,
                    "interrupted: the daemon restarted during this sync; begin again with a new sync_id",
                )
            )
        else:
            out.append(
                (
                    r["sync_id"],
                    r["code"] or ErrorCode.INTERNAL.value,
                    f"{r['status']}: {r['reason'] or 'no reason recorded'}",
                )
            )
    return out


def _state_paths(s: Settings) -> list[Path]:
    """Files and directories a daemon creates for its state (journal, locks, spool)."""
    out = []
    if s.state_db != ":memory:":
        out += [Path(s.state_db + x) for x in ("", ".lock", "-wal", "-shm")]
    if s.spool:
        out += [Path(s.spool)]
    return out


@overload
def _wall_clock(obj: JsonObject, offset: float) -> JsonObject: ...
@overload
def _wall_clock(obj: Json, offset: float) -> Json: ...
def _wall_clock(obj: Json, offset: float) -> Json:
    """A copy of a status object whose monotonic times (`at`, `*_at`) are Unix seconds;
    the journal's history is already wall-clock."""
    if isinstance(obj, dict):
        return {
            k: round(v + offset, 3)
            if (k == "at" or k.endswith("_at")) and isinstance(v, float | int) and v < 1e9
            else _wall_clock(v, offset)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_wall_clock(v, offset) for v in obj]
    return obj


class Service:
    def __init__(self, settings: Settings, ctx: zmq.SyncContext | None = None) -> None:
        self.settings = settings
        self.ctx = ctx or zmq.Context.instance()
        # What this daemon is about to create: removed again if it never starts (a port in use).
        self.new_paths = [p for p in _state_paths(settings) if not p.exists()]
        self.locks: list[StateLock] = []
        try:
            self.locks = lock_state(settings.state_db, settings.spool)  # one daemon per state
            self.journal = Journal(settings.state_db)
        except BaseException:
            # e.g. the spool is another daemon's: the journal's lock file made a moment ago goes too
            self._release_locks()
            self._remove_new_paths()
            raise
        rec = self.journal.recover()
        limits = Limits(
            min_engines=settings.min_engines,
            engine_timeout=settings.engine_timeout,
            lost_expiry=settings.lost_expiry,
            sync_timeout=settings.sync_timeout,
            bucket_timeout=settings.bucket_timeout,
            finalize_timeout=settings.finalize_timeout,
            host=pysocket.gethostname(),
            spool=bool(settings.spool),
            trainer_grace=settings.trainer_grace,
            engine_grace=settings.engine_grace,
            max_frame_bytes=settings.max_frame_bytes,
            max_pending=settings.max_pending,
            fanout_bytes=settings.fanout_queue_bytes if settings.fanout_bind != "off" else None,
        )
        self.core = Core(
            limits,
            initial=State(rec.state),
            served_version=rec.version,
            served_digest=rec.digest,
            served_scheme=rec.digest_scheme or DIGEST_SCHEME,
            dirty=rec.dirty,
            now=time.monotonic(),
            run_id=uuid.uuid4().hex[:8],
            history=rec.history,
            ended=_ended(self.journal),
        )
        if rec.interrupted:
            log.warning("sync_interrupted_recovered", sync_id=rec.interrupted, version=rec.version)
        self.stats = Stats()
        self.started = time.time()
        self._stop = asyncio.Event()
        self.failpoints = parse_failpoints(settings.failpoints)
        self.metrics = Metrics()
        self.storage = Storage()
        self.spool = Spool(settings.spool) if settings.spool else None
        self.readers: dict[str, transports.Reader] = {}  # per "ref" transport (the loop's task only)
        self.inflight = Inflight()
        self.transport = Transport(self.ctx, self.stats)
        self.effects = Effects(
            self.transport,
            self.inflight,
            self.storage,
            self.journal,
            self.spool,
            self.metrics,
            self.readers,
            self.failpoints,
        )
        self.dispatch = Dispatcher(
            self.core,
            self.effects,
            self.transport,
            self.inflight,
            settings,
            self.metrics,
            self.stats,
            self.readers,
            self.status,
            self.failpoints,
            self.fail_internal,
        )
        self.recovery = Recovery(self.spool, self.dispatch, self.transport, self.feed) if self.spool else None
        self.effects.recovery = self.recovery
        self.effects.feed = self.feed
        self.effects.fail_internal = self.fail_internal
        self.effects.publish = self._publish
        self.effects.settled = self._nudge
        # The loop's wake-up call: a socket pair, written by `_nudge` and polled with the
        # ZeroMQ sockets (both ends used by the loop's thread only).
        self._nudge_w, self._nudged = pysocket.socketpair()
        for end in (self._nudge_w, self._nudged):
            end.setblocking(False)
        self._nudge_pending = False
        self._changed = False  # an input was handled since the metrics' last snapshot
        self._published_at = 0.0
        self._stuck_at: float | None = None
        self.wakeups = self.ticks = 0  # the loop's wake-ups and timer ticks (debug log)
        # before any engine is connected: what the spool holds, nothing to send yet
        self.dispatch.decide(ev.SpoolChanged(self.effects.spooled()))
        scheme = self.core.scheme_error()
        if scheme is not None:  # an older daemon's state: said once, nothing replayed against it
            log.error(
                "digest_scheme_mismatch",
                code=scheme.code.value,
                reason=scheme.message,
                version=self.core.last_ready_version,
                **scheme.details,
            )

    async def feed(self, event: ev.Event) -> None:
        await self.dispatch.feed(event)

    # -- lifecycle ----------------------------------------------------------------------
    def startup(self) -> None:
        transports.sweep()  # slots left by crashed trainers or engines (each transport's own)
        s = self.settings
        if s.keys:
            self.transport.auth = ServerAuth(self.ctx, s.keys)
        # ZeroMQ disconnects a peer whose frame passes MAXMSGSIZE before buffering it; below
        # that, an oversized frame gets a typed TOO_LARGE (engines only ever send headers).
        self.transport.bind(
            s.bind, s.engine_bind, 2 * max(s.max_frame_bytes, s.max_header_bytes), 2 * s.max_header_bytes
        )
        if s.fanout_bind != "off":
            self.transport.bind_fanout(
                s.fanout_bind or fanout.bind_address(s.engine_bind),
                bool(s.fanout_bind),
                s.fanout_queue_bytes,
                s.max_pending,
                # a cut link's connection is dropped (and its queue with it) within the
                # time an engine's silence takes to count it lost, never sooner than 3 s
                max(3.0, min(s.engine_timeout, fanout.LINK_TIMEOUT_S)),
            )
        if s.metrics_bind:
            self.transport.bound["metrics"] = self.metrics.serve(s.metrics_bind)
            self.metrics.publish(self.status())
        log.info(
            "daemon_started",
            trainer=self.transport.bound["trainer"],
            engine=self.transport.bound["engine"],
            fanout=self.transport.bound.get("fanout"),
            metrics=self.transport.bound.get("metrics"),
            auth="curve" if self.transport.auth else "none",
            spool=s.spool or None,
            state=self.core.state.value,
            version=self.core.served_version,
            state_db=self.settings.state_db,
        )

    @property
    def bound(self) -> dict[str, str]:
        return self.transport.bound

    def _release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def request_stop(self) -> None:
        """Stop at the loop's next turn (a signal handler, run on the loop's thread): the
        nudge wakes a loop that waits for a far deadline or none at all."""
        self._stop.set()
        try:
            self._nudge()
        except OSError:  # the loop has ended and closed its nudge already
            pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        if self.transport.trainer is None:
            self.startup()
        try:
            await self._loop()
        finally:
            self.shutdown()

    async def _loop(self) -> None:
        """Wait for an input or the next time something is due, whichever comes first;
        handle it; ask again. No fixed tick: the wait ends at the earliest of the core's
        next deadline (`Core.next_wake`), the quiet fleet's batch, the metrics' refresh,
        and a nudge from a batch of effects that ended off the loop's own turn."""
        t = self.transport
        if t.trainer is None or t.engine is None or t.trainer_peers is None or t.engine_peers is None:
            raise RuntimeError("the daemon's sockets are not bound (startup first)")
        poller = zmq.asyncio.Poller()
        trainer_wait = zmq.asyncio.Socket.from_socket(t.trainer)
        engine_wait = zmq.asyncio.Socket.from_socket(t.engine)
        poller.register(trainer_wait, zmq.POLLIN)
        poller.register(engine_wait, zmq.POLLIN)
        monitors = [zmq.asyncio.Socket.from_socket(p.monitor) for p in (t.trainer_peers, t.engine_peers)]
        for m in monitors:
            poller.register(m, zmq.POLLIN)
        subs = zmq.asyncio.Socket.from_socket(t.fanout) if t.fanout is not None else None
        subs_of = t.fanout  # the fan-out socket `subs` wraps (bound anew when its queue shrinks)
        if subs is not None:
            poller.register(subs, zmq.POLLIN)
        # Quiet (no sync, no recovery): the trainer socket wakes the loop at once; engine
        # messages (a fleet's heartbeats) that arrive less than IDLE_COALESCE after the last
        # read wait for the rest of it, polled without the engine socket, and are read in
        # one batch, so an idle daemon does not wake once per engine message.
        quiet_poller = zmq.asyncio.Poller()
        quiet_poller.register(trainer_wait, zmq.POLLIN)
        for m in monitors:
            quiet_poller.register(m, zmq.POLLIN)
        if subs is not None:
            quiet_poller.register(subs, zmq.POLLIN)
        for pl in (poller, quiet_poller):
            pl.register(self._nudged, zmq.POLLIN)
        last_engines = time.monotonic()
        engines_at: float | None = None  # quiet: engine messages wait to be read at this time
        while not self._stop.is_set():
            if t.fanout is not subs_of:  # the fan-out was bound anew: poll the new socket
                for pl in (poller, quiet_poller):
                    if subs is not None:
                        pl.unregister(subs)
                t.close_retired()  # no poller holds them now
                subs_of = t.fanout
                subs = zmq.asyncio.Socket.from_socket(t.fanout) if t.fanout is not None else None
                for pl in (poller, quiet_poller):
                    if subs is not None:
                        pl.register(subs, zmq.POLLIN)
            quiet = self._quiet()
            if not quiet:
                engines_at = None  # a sync or a recovery reads every engine message at once
            wait = self._wait_ms(time.monotonic(), engines_at)
            events = dict(await (quiet_poller if engines_at is not None else poller).poll(wait))
            self.wakeups += 1
            if self._nudged.fileno() in events:  # a plain socket is reported by its fd
                self._clear_nudge()
            now = time.monotonic()
            if engine_wait in events and quiet and trainer_wait not in events:
                if now < last_engines + IDLE_COALESCE:
                    del events[engine_wait]  # the batch is not due: they wait for it
                    engines_at = last_engines + IDLE_COALESCE
            if engines_at is not None and (now >= engines_at or trainer_wait in events):
                # the batch is due, or a trainer's request must not overtake what the
                # engines sent before it (a registration before a begin)
                events[engine_wait] = zmq.POLLIN
                engines_at = None
            if subs is not None and subs in events:  # engines' fan-out subscriptions
                t.fanout_subscriptions()
            # Engines first: their acks free window slots the trainer is waiting on.
            if engine_wait in events:
                last_engines = time.monotonic()
                await self._drain(t.engine, self.dispatch.on_engine, "engine")
            # Engines' closed connections before a trainer's request (a begin that follows
            # an engine's exit must not count it in); trainers' after their own messages.
            closed = any(m in events for m in monitors) or t.trainer_peers.pending or t.engine_peers.pending
            if closed or trainer_wait in events:
                await self._guarded("connections", self._on_disconnects, t.engine_peers)
            if trainer_wait in events:
                await self._drain(t.trainer, self.dispatch.on_trainer, "trainer")
            if closed:
                await self._guarded("connections", self._on_disconnects, t.trainer_peers)
            if events:
                self._changed = True
            wake = self.core.next_wake()
            now = time.monotonic()
            if wake is not None and now >= wake:
                await self._guarded("timer", self._on_tick)
            if self.recovery is not None:
                await self._guarded("recovery", self.recovery.pump)
            if self._changed and now >= self._published_at + METRICS_REFRESH:
                self._publish()

    def _wait_ms(self, now: float, engines_at: float | None) -> int:
        """How long the loop may wait for an input (ms; -1: until one comes): until the
        core's next deadline, the quiet fleet's batch, or the metrics' refresh when an
        input changed what they show. Rounded up: a wake-up never comes before its time."""
        due = [x for x in (self.core.next_wake(), engines_at) if x is not None]
        if self._changed and self.metrics.server is not None:
            due.append(self._published_at + METRICS_REFRESH)
        if self._stuck_at is not None and due and min(due) <= self._stuck_at:
            # The core named a time its own tick then found nothing due at: a bug in the
            # clock. Retried every STUCK_RETRY (logged), never a busy loop.
            log.error("clock_wake_not_due", wake=self._stuck_at, now=now)
            due, self._stuck_at = [now + STUCK_RETRY], None
        if not due:
            return -1
        return max(0, math.ceil((min(due) - now) * 1000))

    def _nudge(self) -> None:
        """A batch of effects ended off the loop's turn (in its task, once its journal and
        spool writes were durable): the loop looks again, for what it may have changed (a
        deadline, a rollback to pump, a reply that freed the rollback's window)."""
        if not self._nudge_pending:
            self._nudge_pending = True
            self._nudge_w.send(b"\0")

    def _clear_nudge(self) -> None:
        try:
            while self._nudged.recv(4096):
                pass
        except BlockingIOError:
            pass
        self._nudge_pending = False

    def _quiet(self) -> bool:
        r = self.recovery
        return (
            self.core.state in (State.IDLE, State.READY)
            and self.effects.batches == 0
            and (r is None or r.rollback is None)
            and not self.core.catchups  # its engine's reports pace it: no coalescing
        )

    async def _drain(
        self,
        sock: zmq.SyncSocket,
        handler: Callable[[bytes, list[zmq.Frame]], Awaitable[None]],
        src: str,
        budget: int = 256,
    ) -> None:
        for _ in range(budget):
            frames = self.transport.recv(sock)
            if frames is None:
                return
            await self._guarded(src, handler, frames[0].bytes, frames[1:])

    async def _on_tick(self) -> None:
        self.ticks += 1
        log.debug("timer_tick", ticks=self.ticks, wakeups=self.wakeups)
        res = await self.dispatch.feed(ev.Tick())  # deadlines, lost engines, rollback
        wake = self.core.next_wake()
        if not res.commands and wake is not None and wake <= self.core.now:
            self._stuck_at = wake  # the tick found nothing due at the core's own wake
        self._publish()

    def _publish(self) -> None:
        self._changed, self._published_at = False, time.monotonic()
        if self.metrics.server is not None:
            self.metrics.publish(self.status())

    async def _on_disconnects(self, peers: PeerTracker) -> None:
        on_closed = (
            self.dispatch.engine_disconnected
            if peers is self.transport.engine_peers
            else self.dispatch.trainer_disconnected
        )
        for ident in peers.drain():
            await on_closed(ident)

    async def _guarded(
        self, src: str, handler: Callable[_P, Awaitable[None]], *args: _P.args, **kwargs: _P.kwargs
    ) -> None:
        """The exception boundary of one input (a message or a timer): a bug fails the
        running sync with INTERNAL, logged once with its traceback; the daemon serves on."""
        try:
            await handler(*args, **kwargs)
        except Exception as exc:
            log.exception("input_crashed", src=src)
            await self.fail_internal(src, exc)

    async def fail_internal(self, src: str, exc: BaseException) -> None:
        try:
            await self.feed(ev.InternalError(f"{src} input: {type(exc).__name__}: {exc}"))
        except Exception:  # failing the sync failed too: the state stays, the loop goes on
            log.exception("internal_failure_unhandled", src=src)

    def abandon(self) -> None:
        """Startup failed: stop, and remove the state files this daemon created (an empty
        journal and its locks), leaving whatever was there before untouched."""
        self.shutdown()
        self._remove_new_paths()

    def _remove_new_paths(self) -> None:
        for p in self.new_paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def shutdown(self) -> None:
        try:
            self.storage.close()  # what was submitted is written; then the journal is ours
            res, _ = self.dispatch.decide(ev.Shutdown())
            for c in res.commands:
                if isinstance(c, cmd.Journal):
                    self.effects.persist_now(c)  # the same write the storage thread makes
            # Best effort: tell waiting trainers and engines before the sockets close.
            for c in res.commands:
                if isinstance(c, cmd.CompleteSync):
                    self.effects.complete_sync(c)
        finally:
            self.transport.close()
            self._nudge_w.close()
            self._nudged.close()
            self.journal.close()
            self._release_locks()
            if self.transport.auth is not None:
                self.transport.auth.stop()
            self.metrics.stop()
            log.info("daemon_stopped", state=self.core.state.value, version=self.core.served_version)

    def status(self) -> JsonObject:
        now_mono = time.monotonic()
        # The core keeps monotonic time; users read wall-clock Unix seconds everywhere.
        snap = _wall_clock(self.core.snapshot(now_mono), time.time() - now_mono)
        snap["spool"] = self.spool.view() if self.spool else None
        snap["queues"] = self.inflight.view(self.effects.batches)
        bound = self.transport.bound
        snap["daemon"] = {
            "version": DAEMON_VERSION,
            "protocol": schema.PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "trainer_addr": bound.get("trainer"),
            "engine_addr": bound.get("engine"),
            "fanout_addr": bound.get("fanout"),
            # engines whose fan-out subscription is in place (they take published buckets)
            "fanout_subscribers": len(self.transport.fanout_subs),
            "metrics_addr": bound.get("metrics"),
            "state_db": self.settings.state_db,
            "buckets_received": self.stats.buckets,
            "bytes_received": self.stats.bytes_in,
            "bytes_announced": self.stats.bytes_announced,
            "messages_received": self.stats.received,
            "messages_sent": self.stats.sent,
            # of those, published once on the fan-out for every subscribed engine
            "messages_published": self.stats.published,
            "heartbeats_received": self.stats.heartbeats,
            "errors": dict(self.stats.errors),
        }
        return snap
