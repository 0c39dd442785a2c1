"""The engine process loop: a DEALER to the orchestrator's engine socket.

Rules:
- The main thread owns the socket (and is the only thread that touches it). Engine work
  (copies, the post-load step, probes) runs on one applier thread fed by a queue, so
  heartbeats keep flowing while a long finalize runs; the applier hands results back
  through a queue and wakes the main thread through a pipe, never through the socket.
- The finalize guard lives here, independent of the orchestrator: a second `finalize`
  for a sync_id is refused with `failed{duplicate: true}` and the post-load step is not
  run again. A resent bucket (same sync_id, sender, seq) is acknowledged, not re-applied.
- A new sync_id starts the engine's `begin` lazily, on the first message of that sync.
- Every received frame is verified against its checksum again (end to end) before use.
"""

from __future__ import annotations

import os
import queue
from collections import deque
import socket as pysocket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from engines.base import Engine
from messages import codec, schema
from messages.buckets import checksum, unpack
from messages.errors import ErrorCode, MessageError, WeightSyncError
from messages.shm import Reader, shm_available
from orchestrator.link import Link

log = structlog.get_logger()

ORCHESTRATOR_TYPES = ("load", "finalize", "abort", "ok", "error")


@dataclass(slots=True)
class SyncTrack:
    """What the main thread knows of one sync (for the guards)."""

    sync_id: str
    version: int
    queued: set[tuple[int, int]] = field(default_factory=set)
    applied: set[tuple[int, int]] = field(default_factory=set)
    finalize_requested: bool = False
    failed: bool = False


class Applier(threading.Thread):
    """Runs engine operations in order on one thread; results go back via `out` + pipe."""

    def __init__(self, engine: Engine, wake_fd: int, failpoints: dict[str, float] | None = None) -> None:
        super().__init__(name="engine-applier", daemon=True)
        self.engine = engine
        self.failpoints = failpoints or {}
        self.jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.out: queue.Queue[schema.Message | tuple[str, Any]] = queue.Queue()
        self.wake_fd = wake_fd
        self.current: str | None = None
        self.failed: set[str] = set()
        self.reader = Reader()  # the trainer's shared-memory slots (shm transport)

    def submit(self, kind: str, arg: Any) -> None:
        self.jobs.put((kind, arg))

    def stop(self) -> None:
        self.jobs.put(None)

    def _emit(self, item: schema.Message | tuple[str, Any]) -> None:
        self.out.put(item)
        os.write(self.wake_fd, b"x")

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            kind, arg = job
            try:
                getattr(self, "_do_" + kind)(arg)
            except WeightSyncError as err:
                self._fail(arg, err.code.value, err.message)
            except Exception as exc:  # an engine bug: report it as a typed failure, loudly
                log.exception("engine_operation_crashed", op=kind)
                self._fail(arg, ErrorCode.ENGINE_FAILED.value, f"{kind}: {type(exc).__name__}: {exc}")

    def _fail(self, arg: Any, code: str, message: str) -> None:
        msg = arg[0] if isinstance(arg, tuple) else arg
        sync_id = getattr(msg, "sync_id", None) or ""
        self.failed.add(sync_id)
        seq = getattr(msg, "seq", None)
        log.warning("engine_operation_failed", sync_id=sync_id, seq=seq, code=code, reason=message)
        self._emit(schema.Failed(sync_id=sync_id, code=code, message=message[:4000], seq=seq,
                                 sender=getattr(msg, "sender", None)))

    def _do_begin(self, msg: schema.Load | schema.Finalize) -> None:
        self.engine.begin(msg.sync_id, msg.version)
        self.current = msg.sync_id
        log.info("sync_begun", sync_id=msg.sync_id, version=msg.version)

    def _do_load(self, arg: tuple[schema.Load, Any]) -> None:
        msg, frame = arg
        if msg.sync_id in self.failed:
            return  # already reported; the orchestrator is aborting this sync
        t0 = time.perf_counter()
        if msg.shm is not None:
            load_shm = getattr(self.engine, "load_shm", None)
            if load_shm is not None:  # the engine's workers read the slot themselves
                load_shm(msg.tensors, msg.shm, msg.checksum)
                self._emit(schema.Loaded(sync_id=msg.sync_id, seq=msg.seq, sender=msg.sender,
                                         seconds=time.perf_counter() - t0))
                return
            try:
                buf = self.reader.view(msg.shm.name, msg.shm.offset, msg.shm.size)
            except MessageError as exc:
                raise WeightSyncError(f"bucket seq {msg.seq}: {exc.reason}", code=exc.code) from None
        else:
            buf = frame.buffer if hasattr(frame, "buffer") else frame
        if checksum(buf) != msg.checksum:
            raise WeightSyncError(f"bucket seq {msg.seq} arrived corrupted", code=ErrorCode.CHECKSUM_MISMATCH)
        load_bucket = getattr(self.engine, "load_bucket", None)
        if load_bucket is not None:
            load_bucket(msg.tensors, buf)
        else:
            tensors = list(unpack(msg.tensors, buf))
            self.engine.load(tensors)
            del tensors  # drop the views before acknowledging (the frame can be freed)
        del buf
        seconds = time.perf_counter() - t0
        self._emit(schema.Loaded(sync_id=msg.sync_id, seq=msg.seq, sender=msg.sender,
                                 seconds=seconds))

    def _do_finalize(self, msg: schema.Finalize) -> None:
        self.reader.close()  # every bucket is in; the trainer may unlink its slots
        if msg.sync_id in self.failed:
            return
        t0 = time.perf_counter()
        if self.failpoints.get("finalize_sleep"):  # fault injection: a slow post-load step
            time.sleep(self.failpoints["finalize_sleep"])
        digest = self.engine.finalize(msg.sync_id)
        probes = self.engine.probe(msg.probes) if msg.probes else ()
        seconds = time.perf_counter() - t0
        self._emit(("finalized", (msg.version, digest)))
        self._emit(schema.Finalized(sync_id=msg.sync_id, version=msg.version, digest=digest,
                                    finalize_count=self.engine.finalize_count, probes=probes,
                                    seconds=seconds))
        log.info("engine_finalized", sync_id=msg.sync_id, version=msg.version, digest=digest,
                 finalize_count=self.engine.finalize_count, seconds=round(seconds, 4))

    def _do_abort(self, msg: schema.Abort) -> None:
        self.reader.close()
        if self.current == msg.sync_id:
            self.engine.abort()
            self.current = None
            self._emit(("aborted", msg.sync_id))
            log.info("sync_aborted", sync_id=msg.sync_id)


class Worker:
    def __init__(self, engine: Engine, connect: str, engine_id: str, *,
                 heartbeat_interval: float = 1.0, ctx: zmq.Context | None = None,
                 close_engine: bool = True, allow_shm: bool = True, keys: Any = None,
                 failpoints: dict[str, float] | None = None) -> None:
        self.engine = engine
        self.failpoints = failpoints or {}  # fault injection for tests (`--failpoint`)
        self.keys = keys  # orchestrator.auth.ClientKeys for a CURVE daemon
        self.allow_shm = allow_shm
        self.close_engine = close_engine
        self.connect = connect
        self.engine_id = engine_id
        self.heartbeat_interval = heartbeat_interval
        self.ctx = ctx or zmq.Context.instance()
        self.info = engine.describe()
        self.version: int | None = None
        self.digest: str | None = engine.digest()
        self.syncs: dict[str, SyncTrack] = {}
        self.current: SyncTrack | None = None
        self.finalized_syncs: set[str] = set()  # the guard: post-load ran (or is running)
        self.duplicates_refused = 0
        self._stop = threading.Event()
        self._next_id = 0
        self.registered = False
        self.refused: str | None = None  # the daemon refused this engine for good (exit 3)
        self._reregister_sent = False
        self._outq: deque[list[Any]] = deque()

    def request_stop(self) -> None:
        self._stop.set()

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _register_msg(self) -> schema.Register:
        return schema.Register(engine_id=self.engine_id, backend=self.info.backend, id=self._id(),
                               model=self.info.model,
                               transports=tuple(t for t in self.info.transports
                                                if t != "shm" or (self.allow_shm and shm_available())),
                               version=self.version, digest=self.digest,
                               finalize_count=self.engine.finalize_count, pid=os.getpid(),
                               host=pysocket.gethostname(), spec=self.info.spec,
                               cast_ok=self.info.cast_ok)

    def run(self) -> None:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        applier = Applier(self.engine, wfd, self.failpoints)
        applier.start()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if self.keys is not None:
            self.keys.apply(sock)
        link = Link(sock, self.connect, connect_timeout=0.0, reconnect_timeout=0.0)
        sock.connect(self.connect)
        self.sock = sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)
        told: str | None = None
        self._send(self._register_msg())
        log.info("engine_started", engine_id=self.engine_id, backend=self.info.backend,
                 connect=self.connect, model=self.info.model, tensors=len(self.info.spec))
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
                if not self.registered and time.monotonic() >= next_wait_note:
                    # ZeroMQ connects silently: say what this engine is waiting for.
                    log.warning("waiting_for_orchestrator", connect=self.connect,
                                engine_id=self.engine_id,
                                waited_s=round(time.monotonic() - started, 1))
                    next_wait_note = time.monotonic() + 10.0
                timeout = max(0.0, next_hb - time.monotonic())
                events = dict(poller.poll(min(timeout, 0.5) * 1000))
                if rfd in events:
                    try:
                        os.read(rfd, 65536)
                    except BlockingIOError:
                        pass
                    self._drain_results(applier)
                if sock in events:
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames, applier)
                if time.monotonic() >= next_hb:
                    if not self._outq:  # a heartbeat queued behind others would say nothing
                        self._send(schema.Heartbeat(engine_id=self.engine_id, id=self._id()))
                    next_hb = time.monotonic() + self.heartbeat_interval
        finally:
            applier.stop()
            applier.join(timeout=30)
            link.close()
            sock.close(linger=1000)
            os.close(rfd)
            os.close(wfd)
            if self.close_engine:
                self.engine.close()
            log.info("engine_stopped", engine_id=self.engine_id, version=self.version,
                     finalize_count=self.engine.finalize_count)

    def _send(self, msg: schema.Message, payload: tuple[Any, ...] = ()) -> None:
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

    def _drain_results(self, applier: Applier) -> None:
        while True:
            try:
                item = applier.out.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                kind, arg = item
                if kind == "finalized":
                    self.version, self.digest = arg
                elif kind == "aborted":
                    self.version, self.digest = None, None
                continue
            if isinstance(item, schema.Loaded):
                t = self.syncs.get(item.sync_id)
                if t is not None:
                    t.applied.add((item.sender, item.seq))
            elif isinstance(item, schema.Failed):
                t = self.syncs.get(item.sync_id)
                if t is not None:
                    t.failed = True
                self.version, self.digest = None, None
            self._send(item)

    def _track(self, msg: schema.Load | schema.Finalize, applier: Applier) -> SyncTrack:
        t = self.syncs.get(msg.sync_id)
        if t is None:
            t = SyncTrack(msg.sync_id, msg.version)
            self.syncs = {msg.sync_id: t}  # only the running sync matters
            self.current = t
            self.version, self.digest = None, None  # weights are about to change
            applier.submit("begin", msg)
        return t

    def _on_message(self, frames: list[Any], applier: Applier) -> None:
        try:
            decoded = codec.decode(frames, allowed=ORCHESTRATOR_TYPES)
        except MessageError as err:
            log.warning("message_refused", code=err.code.value, reason=err.reason, src="orchestrator")
            return
        msg = decoded.msg
        if isinstance(msg, schema.Load):
            t = self._track(msg, applier)
            key = (msg.sender, msg.seq)
            if key in t.applied:
                self._send(schema.Loaded(sync_id=msg.sync_id, seq=msg.seq, sender=msg.sender))
                return
            if key in t.queued or t.failed:
                return
            t.queued.add(key)
            applier.submit("load", (msg, decoded.payload[0] if decoded.payload else None))
        elif isinstance(msg, schema.Finalize):
            if msg.sync_id in self.finalized_syncs:
                self.duplicates_refused += 1
                log.warning("duplicate_finalize_refused", sync_id=msg.sync_id, version=msg.version,
                            engine_id=self.engine_id)
                self._send(schema.Failed(sync_id=msg.sync_id, code=ErrorCode.INVALID_STATE.value,
                                         message="finalize already ran for this sync; refused",
                                         duplicate=True))
                return
            t = self._track(msg, applier)
            self.finalized_syncs.add(msg.sync_id)
            t.finalize_requested = True
            applier.submit("finalize", msg)
        elif isinstance(msg, schema.Abort):
            if msg.sync_id in self.syncs:
                applier.submit("abort", msg)
        elif isinstance(msg, schema.Ok):
            if msg.body.get("known") is False:
                if self._reregister_sent:  # heartbeats queued while the daemon was away
                    return
                self._reregister_sent = True
                log.warning("engine_unknown_to_daemon_reregistering", engine_id=self.engine_id)
                self._send(self._register_msg())
            elif "daemon_state" in msg.body:
                self.registered = True
                self._reregister_sent = False
                log.info("engine_registration_acknowledged", engine_id=self.engine_id,
                         state=msg.body.get("state"), daemon_state=msg.body.get("daemon_state"))
        elif isinstance(msg, schema.Error):
            if msg.code == ErrorCode.DUPLICATE_ENGINE.value:
                log.error("engine_refused", engine_id=self.engine_id, code=msg.code,
                          reason=msg.message)
                self.refused = msg.message
                self._stop.set()
                return
            log.warning("orchestrator_refused", code=msg.code, reason=msg.message)


ENGINE_FACTORIES: dict[str, str] = {
    "torch": "engines.torch_engine:make_engine",
    "vllm": "engines.vllm_engine:make_engine",
    "vllm-server": "engines.vllm_engine:make_server_engine",
    "sink": "engines.sink:make_engine",
}


def make_engine(backend: str, options: dict[str, Any]) -> Engine:
    import importlib

    target = ENGINE_FACTORIES.get(backend)
    if target is None:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(ENGINE_FACTORIES)})")
    module, func = target.split(":")
    factory: Callable[[dict[str, Any]], Engine] = getattr(importlib.import_module(module), func)
    return factory(options)
