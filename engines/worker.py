"""The engine process loop: a DEALER to the orchestrator's engine socket.

Rules:
- The main thread owns the socket (and is the only thread that touches it). Engine work
  (copies, the post-load step, probes) runs on one applier thread fed by a queue, so
  heartbeats keep flowing while a long finalize runs; the applier hands results back
  through a queue and wakes the main thread through a pipe, never through the socket.
- What a message means for the engine's syncs (which starts, supersedes or ends one; the
  finalize guard; resent buckets) is decided by `engines.session.Session`, the engine's
  own state machine; this loop carries out its actions (applier jobs, messages, stopped
  streams) and feeds it the applier's reports.
- Progress is cumulative and coalesced: `loaded {source, seq: k}` says every bucket of
  that source up to seq k is applied, sent at most once per report interval (a failure
  goes at once), so the daemon reads a few reports per window, not one per bucket.
- Every received frame is verified against its checksum again (end to end) before use.
- An engine that serves through a server of its own (`ChecksHealth`: vllm-server) has
  that server probed on a thread of its own every heartbeat interval (each probe bounded
  by the engine, e.g. 5 s); each heartbeat carries the latest answer (`server_error`), so
  the daemon shows a dead server between syncs. The loop never waits on a probe.
- A rehash request (`request_digest`, SIGUSR1 in `weightsync engine`) queues a job on the
  applier, after every job before it; its answer (the digest of the weights held, read
  again) is logged and, with `digest_file`, written there whole (replaced atomically).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import socket as pysocket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import structlog
import zmq

from engines.applier import Applier
from engines.base import (
    ChecksHealth,
    Engine,
    EngineInfo,
    EngineOptions,
    HandsToReaders,
    LabelsOutputs,
    ReceivesGroup,
)
from engines.postload import Rehashed
from engines.session import Action, Send, Session, Submit
from messages import codec, fanout, replies, schema, transports
from messages.distgroup import Backend, available_backends
from messages.errors import ErrorCode, MessageError, WeightSyncError, wrong_socket_line
from messages.link import Link

if TYPE_CHECKING:
    from messages.codec import Frame
    from messages.keys import ClientKeys

log = structlog.get_logger()

REFUSED_GRACE = 2.0  # seconds of refused CURVE handshakes before an engine gives up


class HealthProbe(threading.Thread):
    """Asks a `ChecksHealth` engine's server how it is, every `interval` seconds, off the
    worker's loop; `error` is the latest answer (None: it answers). A change is logged."""

    def __init__(self, engine: ChecksHealth, interval: float, engine_id: str) -> None:
        super().__init__(name="weightsync-health", daemon=True)
        self.engine, self.interval, self.engine_id = engine, interval, engine_id
        self.error: str | None = None  # read by the loop: one reference, swapped whole
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                got = self.engine.health()
            except Exception as exc:  # a probe's own bug must not end the probing
                got = f"health probe failed: {type(exc).__name__}: {exc}"
            got = got[:4096] if got is not None else None  # the heartbeat's field holds 4096
            if got != self.error:
                if got is None:
                    log.info("server_healthy_again", engine_id=self.engine_id, was=self.error)
                else:
                    log.warning("server_unhealthy", engine_id=self.engine_id, reason=got)
            self.error = got
            self.stopped.wait(self.interval)


class WorkerOptions(TypedDict, total=False):
    """`Worker`'s keyword options, for those who pass them through (engines.holding)."""

    heartbeat_interval: float
    ctx: zmq.Context[zmq.SyncSocket] | None
    close_engine: bool
    allow_refs: bool
    keys: ClientKeys | None
    failpoints: dict[str, float] | None
    groups: bool
    collective_bind: str
    key_label: str
    delta_base: bool
    digest_file: Path | None


class Worker:
    def __init__(
        self,
        engine: Engine,
        connect: str,
        engine_id: str,
        *,
        heartbeat_interval: float = 1.0,
        ctx: zmq.Context[zmq.SyncSocket] | None = None,
        close_engine: bool = True,
        allow_refs: bool = True,  # offer the transports that carry references
        keys: ClientKeys | None = None,
        failpoints: dict[str, float] | None = None,
        groups: bool = True,  # offer the transports that need a group
        collective_bind: str = "",
        key_label: str = "",
        delta_base: bool = False,
        digest_file: Path | None = None,
    ) -> None:
        self.engine = engine
        self.delta_base = delta_base  # keep a base copy for delta syncs (engines/delta.py)
        self.groups = groups and any(t.needs_group for t in self._kinds(engine.describe()))
        self.collective_bind = collective_bind  # this host's address for the group's sockets
        self.failpoints = failpoints or {}  # fault injection for tests (`--failpoint`)
        self.keys = keys  # for a CURVE daemon
        self.key_label = key_label  # which key that is, for the refusal message
        self.allow_refs = allow_refs
        self.close_engine = close_engine
        self.connect = connect
        self.engine_id = engine_id
        self.heartbeat_interval = heartbeat_interval
        self.ctx = ctx or zmq.Context.instance()
        self.info = engine.describe()
        # the engine's syncs, their guards and its served version (engines/session.py)
        self.state = Session(None, engine.digest())
        self._stop = threading.Event()
        self._next_id = 0
        self._register_ids: set[int] = set()
        self.registered = False
        self.refused: str | None = None  # the daemon refused this engine for good (exit 3)
        self._reregister_sent = False
        self._outq: deque[list[Frame]] = deque()
        self._last_report = 0.0
        self.fanout = fanout.Receiver(self.ctx, self.engine_id, self.keys)
        self.poller = zmq.Poller()
        self.digest_file = digest_file  # where a rehash's answer is written
        self._rehash_asked = 0  # rehash requests taken (a signal handler counts them)
        self._rehash_sent = 0  # and handed to the applier
        self._wake_fd: int | None = None

    def request_stop(self) -> None:
        self._stop.set()

    def request_digest(self) -> None:
        """Ask for the digest of the weights held, read again (safe in a signal handler:
        it counts the request and wakes the loop, which queues the job)."""
        self._rehash_asked += 1
        if self._wake_fd is not None:
            try:
                os.write(self._wake_fd, b"r")
            except OSError:
                pass  # the pipe is full: the loop wakes anyway

    @staticmethod
    def _kinds(info: EngineInfo) -> tuple[transports.Transport, ...]:
        """The transports the engine can take: those it names, or every registered one."""
        names = info.transports if info.transports is not None else transports.names()
        return tuple(t for n in names if (t := transports.get(n)) is not None)

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _register_msg(self) -> schema.Register:
        rid = self._id()
        self._register_ids.add(rid)  # its Ok is a RegisterReply; any other Ok a HeartbeatReply
        return schema.Register(
            engine_id=self.engine_id,
            backend=self.info.backend,
            id=rid,
            model=self.info.model,
            transports=tuple(
                t.name
                for t in self._kinds(self.info)
                if t.available()
                and (t.carries != "ref" or self.allow_refs)
                and (t.carries != "group" or self.groups)
            ),
            version=self.version,
            digest=self.digest,
            finalize_count=self.engine.finalize_count,
            pid=os.getpid(),
            host=pysocket.gethostname(),
            spec=self.info.spec,
            cast_ok=self.info.cast_ok,
            collective_ranks=self.info.collective_ranks if self.groups else 0,
            collective_backends=self._backends(),
            # the framed stream is received by this process (vLLM's workers receive per bucket)
            collective_stream=self.groups and not isinstance(self.engine, ReceivesGroup),
            labels=isinstance(self.engine, LabelsOutputs),
            delta=self.delta_base,
            served_notice=isinstance(self.engine, HandsToReaders),
            fanout=True,
            slices=self.info.slices,
        )

    def _backends(self) -> tuple[Backend, ...]:
        if not self.groups:
            return ()
        return available_backends()

    def run(self) -> None:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._wake_fd = wfd
        applier = Applier(self.engine, wfd, self.failpoints, self.collective_bind, delta_base=self.delta_base)
        applier.start()
        health: HealthProbe | None = None
        if isinstance(self.engine, ChecksHealth):
            health = HealthProbe(self.engine, self.heartbeat_interval, self.engine_id)
            health.start()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if self.keys is not None:
            self.keys.apply(sock)
        link = Link(sock, self.connect, connect_timeout=0.0, reconnect_timeout=0.0)
        sock.connect(self.connect)
        self.sock = sock
        poller = self.poller
        poller.register(sock, zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)
        told: str | None = None
        refused_since: float | None = None
        self._send(self._register_msg())
        log.info(
            "engine_started",
            engine_id=self.engine_id,
            backend=self.info.backend,
            connect=self.connect,
            model=self.info.model,
            tensors=len(self.info.spec),
        )
        next_hb = time.monotonic() + self.heartbeat_interval
        started = time.monotonic()
        next_wait_note = started + 5.0
        try:
            while not self._stop.is_set():
                link.pump()
                self._flush()
                if link.failure is not None and link.failure != told:
                    told = link.failure  # a CURVE refusal is final until the keys change
                    log.error("handshake_refused", connect=self.connect, reason=link.failure)
                if link.failure is None or self.registered:
                    refused_since = None
                elif refused_since is None:
                    refused_since = time.monotonic()
                elif time.monotonic() - refused_since >= REFUSED_GRACE:
                    # the daemon is up and said no: waiting would never end (exit 3)
                    self.refused = (
                        f"the daemon at {self.connect} refused the security handshake of key "
                        f"{self.key_label or '(this engine key)'}: {link.failure}"
                    )
                    log.error("engine_refused", engine_id=self.engine_id, reason=self.refused)
                    break
                if not self.registered and time.monotonic() >= next_wait_note:
                    # ZeroMQ connects silently: say what this engine is waiting for.
                    log.warning(
                        "waiting_for_orchestrator",
                        connect=self.connect,
                        engine_id=self.engine_id,
                        waited_s=round(time.monotonic() - started, 1),
                    )
                    next_wait_note = time.monotonic() + 10.0
                timeout = max(0.0, next_hb - time.monotonic())
                if self._unreported():
                    due = self._last_report + self._report_interval() - time.monotonic()
                    timeout = min(timeout, max(0.0, due))
                events = dict(poller.poll(int(min(timeout, 0.5) * 1000)))
                if rfd in events:
                    try:
                        os.read(rfd, 65536)
                    except BlockingIOError:
                        pass
                    self._drain_results(applier)
                if self._rehash_sent < self._rehash_asked:
                    self._rehash_sent = self._rehash_asked
                    applier.rehash(self._rehash_sent)
                if self.fanout.sock is not None and self.fanout.sock in events:
                    dropped = self.fanout.dropped
                    for load, payload in self.fanout.recv_all():
                        self._on_load(load, payload, applier)
                    if self.fanout.dropped != dropped and self.fanout.last_dropped is not None:
                        sync_id, source, seq, why = self.fanout.last_dropped
                        log.info(
                            "published_buckets_not_taken",
                            count=self.fanout.dropped - dropped,
                            total=self.fanout.dropped,
                            sync_id=sync_id,
                            source=source,
                            seq=seq,
                            reason=why,
                        )
                if sock in events:
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames, applier)
                self._report()
                if time.monotonic() >= next_hb:
                    if not self._outq:  # a heartbeat queued behind others would say nothing
                        self._send(
                            schema.Heartbeat(
                                engine_id=self.engine_id,
                                id=self._id(),
                                server_error=health.error if health is not None else None,
                            )
                        )
                    next_hb = time.monotonic() + self.heartbeat_interval
        finally:
            if self.registered and self.refused is None:
                # out of the fleet at once: a closed connection alone gets the daemon's grace
                self._send(schema.Goodbye(engine_id=self.engine_id, id=self._id()))
            if health is not None:
                health.stopped.set()  # a daemon thread: a probe in flight ends with the process
            applier.stop()
            applier.join(timeout=30)
            applier.shutdown_group()
            link.close()
            self.fanout.close()
            sock.close(linger=1000)
            self._wake_fd = None
            os.close(rfd)
            os.close(wfd)
            if self.close_engine:
                self.engine.close()
            log.info(
                "engine_stopped",
                engine_id=self.engine_id,
                version=self.version,
                finalize_count=self.engine.finalize_count,
            )

    def _send(self, msg: schema.Message, payload: tuple[Frame, ...] = ()) -> None:
        """Queue and send without blocking: with no live connection (no daemon yet, a
        refused CURVE key) a DEALER has nowhere to put a message, and a blocking send would
        stop heartbeats, logs and SIGTERM handling. The loop flushes what is queued."""
        self._outq.append(codec.encode(msg, payload))
        self._flush()

    def _flush(self) -> None:
        while self._outq:
            try:
                self.sock.send_multipart(self._outq[0], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outq.popleft()

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def digest(self) -> str | None:
        return self.state.digest

    @property
    def duplicates_refused(self) -> int:
        return self.state.duplicates_refused

    def _do(self, actions: list[Action], applier: Applier) -> None:
        """Carry out what the engine's `Session` decided: this thread's I/O."""
        for a in actions:
            if isinstance(a, Submit):
                applier.submit(a.job, a.payload)
            elif isinstance(a, Send):
                if isinstance(a.msg, schema.Failed) and a.msg.duplicate:
                    log.warning("duplicate_finalize_refused", sync_id=a.msg.sync_id, engine_id=self.engine_id)
                self._send(a.msg)
            else:
                applier.cancel_stream(a.sync_id)  # its receives (a stream's, or announced buckets') stop
                if a.published:
                    self.fanout.end(a.sync_id)

    def _drain_results(self, applier: Applier) -> None:
        while True:
            try:
                item = applier.out.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Rehashed):
                self._rehashed(item)
                continue
            self._do(self.state.result(item), applier)

    def _rehashed(self, r: Rehashed) -> None:
        """Say what the rehash found, beside the version and digest this engine reports."""
        answer = {
            "engine_id": self.engine_id,
            "pid": os.getpid(),
            "asked": r.asked,
            "version": self.version,
            "reported_digest": self.digest,
            "digest": r.digest,
            "seconds": round(r.seconds, 6),
            "error": r.error,
        }
        log.info("weights_rehashed", **answer)
        if self.digest_file is not None:
            tmp = self.digest_file.with_name(self.digest_file.name + ".tmp")
            tmp.write_text(json.dumps(answer))
            os.replace(tmp, self.digest_file)

    def _unreported(self) -> bool:
        c = self.state.current
        return c is not None and c.progress.unreported()

    def _report_interval(self) -> float:
        c = self.state.current
        return self.fanout.report_interval(c.sync_id) if c is not None else 0.0

    def _report(self) -> None:
        """Send how far each source's buckets are applied, if that moved and the last
        report is a report interval old (REPORT_INTERVAL, or the fan-out's for a fleet)."""
        t = self.state.reporting()
        if t is None:
            return
        now = time.monotonic()
        if now - self._last_report < self._report_interval():
            return
        for loaded in t.progress.reports():
            self._last_report = now
            self._send(loaded)

    def _on_load(self, msg: schema.Load, payload: list[Frame], applier: Applier) -> None:
        """A bucket, sent to this engine or published to all."""
        log.debug("bucket_received", sync_id=msg.sync_id, source=msg.source, seq=msg.seq)
        self._do(self.state.feed(msg, payload[0] if payload else None), applier)

    def _on_message(self, frames: list[zmq.Frame], applier: Applier) -> None:
        try:
            decoded = codec.decode(frames, allowed=schema.TO_ENGINE)
        except MessageError as err:
            log.warning("message_refused", code=err.code.value, reason=err.reason, src="orchestrator")
            return
        msg = decoded.msg
        if isinstance(msg, schema.Load):
            self._on_load(msg, decoded.payload, applier)
        elif isinstance(
            msg, (schema.OpenStream, schema.Finalize, schema.Commit, schema.Served, schema.Abort)
        ):
            self._do(self.state.feed(msg), applier)
        elif isinstance(msg, schema.Ok):
            try:
                if msg.id in self._register_ids:
                    self._on_registered(replies.decode(msg.body, replies.RegisterReply))
                elif not replies.decode(msg.body, replies.HeartbeatReply).known:
                    self._on_unknown(applier)
            except WeightSyncError as err:  # a body that does not match its type
                log.warning("message_refused", code=err.code.value, reason=err.message, src="orchestrator")
        elif isinstance(msg, schema.Error):
            if msg.code in (ErrorCode.DUPLICATE_ENGINE.value, ErrorCode.WRONG_SOCKET.value):
                # refused for good (exit 3): another engine holds the id, or --connect names
                # the daemon's trainer socket (the line names the engine socket to use)
                why = msg.message
                if msg.code == ErrorCode.WRONG_SOCKET.value:
                    why = wrong_socket_line(self.connect, msg.details or {})
                log.error("engine_refused", engine_id=self.engine_id, code=msg.code, reason=why)
                self.refused = why
                self._stop.set()
                return
            log.warning("orchestrator_refused", code=msg.code, reason=msg.message)

    def _on_registered(self, r: replies.RegisterReply) -> None:
        if r.fanout is not None:
            if self.fanout.open(r.fanout, self.connect, self.poller) is not None:
                log.info("fanout_subscribed", engine_id=self.engine_id, addr=self.fanout.addr)
        self.registered = True
        self._reregister_sent = False
        log.info(
            "engine_registration_acknowledged",
            engine_id=self.engine_id,
            state=r.state,
            daemon_state=r.daemon_state,
        )

    def _on_unknown(self, applier: Applier) -> None:
        """The daemon does not know this engine (it restarted, or lost it): register again."""
        if self._reregister_sent:  # heartbeats queued while the daemon was away
            return
        self._reregister_sent = True
        log.warning("engine_unknown_to_daemon_reregistering", engine_id=self.engine_id)
        self._do(self.state.restarted_daemon(), applier)  # a restarted daemon: that sync is over
        self._send(self._register_msg())


ENGINE_FACTORIES: dict[str, str] = {
    "torch": "engines.torch_engine:make_engine",
    "vllm": "engines.vllm.engine:make_engine",
    "vllm-server": "engines.vllm.server:make_engine",
    "sink": "engines.sink:make_engine",
}


def make_engine(backend: str, options: EngineOptions) -> Engine:
    target = ENGINE_FACTORIES.get(backend)
    if target is None:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(ENGINE_FACTORIES)})")
    module, func = target.split(":")
    factory: Callable[[EngineOptions], Engine] = getattr(importlib.import_module(module), func)
    return factory(options)
