"""What trainers import: `TrainerClient(addr).push(named_tensors, version)`.

Rules: one DEALER socket, used only by the thread that created the client. At most
`window` buckets are unacknowledged at a time (the daemon acks a bucket only when every
engine applied it), so memory stays at ~window buckets whatever the model size. A request
that gets no reply in `timeout` is resent with the same sync_id and seq (the daemon acks
duplicates without re-applying them). Every error reply raises the `WeightSyncError`
subclass of its code, carrying the daemon's state and version.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import zmq

from messages import codec, schema
from messages.buckets import DEFAULT_BUCKET_BYTES, Digester, PackedBucket, iter_buckets
from messages.errors import ErrorCode, WeightSyncError, make_error
from messages.shm import ShmFull, shm_available, sweep_stale
from orchestrator.rings import InlineRing, ShmRing
from orchestrator.auth import ClientKeys
from orchestrator.config import DEFAULT_ADDR
from orchestrator.link import RECONNECTED, Link, _Reconnected

log = structlog.get_logger()

REPLY_TYPES = ("ok", "error")


@dataclass(frozen=True, slots=True)
class SyncResult:
    sync_id: str
    version: int
    buckets: int
    bytes: int
    seconds: float
    engines: list[dict[str, Any]]
    digest: str
    state: str = "READY"
    retries: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Bytes per second, end to end (first begin to READY)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def error_from_reply(msg: schema.Error) -> WeightSyncError:
    try:
        code = ErrorCode(msg.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return make_error(code, msg.message, state=msg.state, version=msg.version,
                      sync_id=msg.sync_id, details=msg.details)


@dataclass(slots=True)
class _InFlight:
    bucket: PackedBucket
    sent_at: float
    attempts: int = 1


class TrainerClient:
    def __init__(self, addr: str = DEFAULT_ADDR, *, timeout: float = 30.0, retries: int = 3,
                 finish_timeout: float = 900.0, ctx: zmq.Context | None = None,
                 sender: int = 0, keys: ClientKeys | None = None,
                 connect_timeout: float = 5.0) -> None:
        self.addr = addr
        self.timeout = timeout
        self.retries = retries
        self.finish_timeout = finish_timeout
        self.sender = sender
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            keys.apply(self._sock)
        # Before connect, so the monitor sees the first attempt (tells no daemon from a
        # refused key within connect_timeout instead of after every retry's timeout).
        self._link = Link(self._sock, addr, connect_timeout, reconnect_timeout=max(timeout, connect_timeout))
        try:
            self._sock.connect(addr)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"invalid address {addr!r}: {exc}") from None
        self._next_id = 0
        self._stray: dict[int, schema.Message] = {}

    # -- plumbing -----------------------------------------------------------------------
    def close(self) -> None:
        self._link.close()
        self._sock.close(linger=0)

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _send(self, msg: schema.Message, payload: Sequence[Any] = ()) -> None:
        """Send without ever blocking for good: a DEALER with no live connection (nothing
        listens, or each CURVE handshake fails) has no pipe to queue on, and a plain send
        would wait forever. Wait for room while the socket monitor can still say why not."""
        frames = codec.encode(msg, payload)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._link.check()  # UNREACHABLE / UNAUTHORIZED as soon as the monitor knows
                if time.monotonic() >= deadline:
                    raise make_error(ErrorCode.TIMEOUT, f"could not send to {self.addr} within "
                                     f"{self.timeout}s (no connection)") from None
                self._sock.poll(100, zmq.POLLOUT)

    def _recv(self, timeout: float) -> schema.Message | None | _Reconnected:
        """The next reply; None when `timeout` passes; RECONNECTED when the connection was
        re-established (requests in flight died with the old one: resend them now).
        Raises UNREACHABLE / UNAUTHORIZED as soon as the socket monitor shows it."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._link.monitor, zmq.POLLIN)
        while True:
            self._link.check()
            if self._link.take_reconnect():
                return RECONNECTED
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            events = dict(poller.poll(min(left, 0.5) * 1000))
            if self._sock in events:
                frames = self._sock.recv_multipart()
                return codec.decode(frames, allowed=REPLY_TYPES).msg

    def _request(self, make: Any, timeout: float | None = None, payload: Sequence[Any] = (),
                 retries: int | None = None) -> dict[str, Any]:
        """Send `make(id)`; resend with a new id on timeout; return the ok body or raise."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        ids: set[int] = set()
        for attempt in range(retries + 1):
            rid = self._new_id()
            ids.add(rid)
            self._send(make(rid), payload)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                reply = self._recv(left)
                if reply is None or reply is RECONNECTED:
                    break
                if reply.id not in ids:
                    self._stray[reply.id] = reply
                    continue
                if isinstance(reply, schema.Error):
                    raise error_from_reply(reply)
                return reply.body  # type: ignore[union-attr]
            if attempt < retries:
                log.warning("request_resent", attempt=attempt + 2, timeout=timeout,
                            type=make(0).TYPE)
        raise make_error(ErrorCode.TIMEOUT, f"no reply from {self.addr} after "
                         f"{retries + 1} attempt(s) of {timeout}s")

    # -- requests -----------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        return self._request(lambda i: schema.Hello(id=i, client="weightsync-client"))

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        return self._request(lambda i: schema.Status(id=i), timeout)

    def begin(self, version: int, sync_id: str | None = None, *, senders: int = 1,
              expected_buckets: int | None = None, probes: Sequence[schema.Probe] = (),
              transport: str = "inline") -> dict[str, Any]:
        """Start a sync. `transport` "shm"/"auto" offers shared memory; the reply's
        `transport` says what the daemon chose ("inline", "shm" or "mixed")."""
        sync_id = sync_id or uuid.uuid4().hex
        host = socket.gethostname() if transport != "inline" else ""
        body = self._request(lambda i: schema.Begin(sync_id=sync_id, version=version, id=i,
                                                    senders=senders,
                                                    expected_buckets=expected_buckets,
                                                    probes=tuple(probes), host=host,
                                                    transport=transport))
        return {**body, "sync_id": sync_id}

    def send_bucket(self, sync_id: str, bucket: PackedBucket, *, checksum: int | None = None
                    ) -> dict[str, Any]:
        """Send one bucket and wait until every engine applied it."""
        return self._request(lambda i: self._bucket_msg(sync_id, bucket, i, checksum),
                             payload=[bucket.frame()])

    def finish(self, sync_id: str, buckets: int, *, digest: str | None = None,
               timeout: float | None = None, partial: bool = False) -> dict[str, Any]:
        return self._request(lambda i: schema.Finish(sync_id=sync_id, buckets=buckets, id=i,
                                                     sender=self.sender, digest=digest,
                                                     partial=partial),
                             self.finish_timeout if timeout is None else timeout)

    def abort(self, sync_id: str, reason: str = "", *, timeout: float | None = None,
              retries: int | None = None) -> dict[str, Any]:
        return self._request(lambda i: schema.Abort(sync_id=sync_id, id=i, reason=reason),
                             timeout, retries=retries)

    def _bucket_msg(self, sync_id: str, b: PackedBucket, rid: int,
                    checksum: int | None = None, shm: schema.ShmRef | None = None) -> schema.Bucket:
        return schema.Bucket(sync_id=sync_id, seq=b.seq, tensors=b.tensors,
                             checksum=b.checksum if checksum is None else checksum, id=rid,
                             sender=self.sender, shm=shm)

    # -- the whole sync -----------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, window: int = 2,
             probes: Sequence[schema.Probe] = (), sync_id: str | None = None,
             abort_on_error: bool = True, progress: Any = None,
             transport: str = "auto", rollback_wait: float = 120.0,
             partial: bool = False, engines_wait: float = 0.0) -> SyncResult:
        """Stream `named_tensors` to every engine as `version`; return when READY.

        transport: "auto" uses shared memory for the engines on this host that can read it
        (one write here, one read per engine) and inline frames otherwise; "inline" and
        "shm" force a choice ("shm" still falls back where the daemon says so).
        rollback_wait: seconds to wait, before beginning, for a rollback the daemon is
        running after an earlier failure (0: raise its INVALID_STATE at once).
        partial: the tensors are a subset of the engines' on purpose (otherwise `finish`
        refuses a push that leaves an engine tensor out, with INCOMPLETE_SYNC).
        Whatever ends the push early (an error, a timeout, Ctrl-C, SIGTERM raised as an
        exception) aborts the sync it began, so the daemon is free for the next push."""
        if window < 1:
            raise ValueError("window must be >= 1")
        if transport not in ("inline", "shm", "auto"):
            raise ValueError("transport must be inline, shm or auto")
        t0 = time.perf_counter()
        sync_id = sync_id or uuid.uuid4().hex
        ring = self._reserve_ring(window, bucket_bytes) if transport != "inline" else None
        if ring is None:
            transport = "inline"
        try:
            try:
                started = self._begin_after_rollback(version, sync_id, probes, transport,
                                                     rollback_wait, engines_wait)
            except WeightSyncError as err:
                if abort_on_error and err.code in (ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE):
                    self._abort_quietly(sync_id, err)  # the begin may have landed unanswered
                raise
            except BaseException as exc:  # interrupted while beginning: release what began
                if abort_on_error:
                    self._abort_quietly(sync_id, exc)
                raise
            if started.get("transport") not in ("shm", "mixed") and ring is not None:
                ring.close()
                ring = None
            digester = Digester()
            try:
                count, nbytes, retries = self._stream(sync_id, named_tensors, bucket_bytes, window,
                                                      progress, ring, digester)
                body = self.finish(sync_id, count, digest=digester.hexdigest(), partial=partial)
            except WeightSyncError as err:
                if abort_on_error and err.state in ("LOADING_BUCKETS", "FINALIZING", None):
                    self._abort_quietly(sync_id, err)
                raise
            except BaseException as exc:  # KeyboardInterrupt, a broken iterator: do not wedge
                if abort_on_error:
                    self._abort_quietly(sync_id, exc)
                raise
        finally:
            if ring is not None:
                ring.close()
        seconds = time.perf_counter() - t0
        return SyncResult(sync_id=sync_id, version=version, buckets=count, bytes=nbytes,
                          seconds=seconds, engines=body.get("engines", []),
                          digest=digester.hexdigest(), state=body.get("status", "READY"),
                          retries=retries, detail={**body, "transport": started.get("transport", "inline")})

    @staticmethod
    def _reserve_ring(window: int, bucket_bytes: int) -> ShmRing | None:
        """Shared-memory slots reserved up front, or None: inline for this push."""
        if not shm_available():
            return None
        sweep_stale()  # segments of trainers that crashed earlier on this host
        try:
            return ShmRing(window, bucket_bytes)
        except ShmFull as exc:
            log.warning("shm_full_using_inline", reason=str(exc), window=window,
                        bucket_bytes=bucket_bytes)
            return None

    def _begin_after_rollback(self, version: int, sync_id: str | None,
                              probes: Sequence[schema.Probe], transport: str,
                              wait: float, engines_wait: float = 0.0) -> dict[str, Any]:
        """Begin; wait (and say so every few seconds) for a rollback the daemon runs, or for
        engines still registering, up to `wait` / `engines_wait` seconds."""
        t0 = time.monotonic()
        said = 0.0
        while True:
            try:
                return self.begin(version, sync_id, probes=probes, transport=transport)
            except WeightSyncError as err:
                waited = time.monotonic() - t0
                rolling = err.details.get("rollback_running") and waited < wait
                engines = err.code is ErrorCode.NO_ENGINES and waited < engines_wait
                if not (rolling or engines):
                    raise
                if waited >= said:
                    what = "the daemon's rollback" if rolling else "engines to register"
                    log.warning("waiting", what=what, waited_s=round(waited, 1), reason=err.message)
                    said = waited + 5.0
                time.sleep(0.2)

    def _abort_quietly(self, sync_id: str, cause: BaseException) -> None:
        try:
            self.abort(sync_id, reason=f"trainer error: {cause}"[:500],
                       timeout=min(self.timeout, 5.0), retries=0)
        except WeightSyncError as err:  # already ended on the daemon side: nothing to undo
            log.info("abort_not_needed", sync_id=sync_id, code=err.code.value)

    def _stream(self, sync_id: str, named: Iterable[tuple[str, torch.Tensor]],
                bucket_bytes: int, window: int, progress: Any, ring: ShmRing | None = None,
                digester: Digester | None = None) -> tuple[int, int, int]:
        inflight: dict[int, _InFlight] = {}  # seq -> bucket
        by_id: dict[int, int] = {}  # request id -> seq
        count = nbytes = retries = 0

        def send(f: _InFlight) -> None:
            rid = self._new_id()
            by_id[rid] = f.bucket.seq
            if ring is not None:
                ref = ring.ref(f.bucket.seq, f.bucket.nbytes)
                self._send(self._bucket_msg(sync_id, f.bucket, rid, shm=ref))
            else:
                self._send(self._bucket_msg(sync_id, f.bucket, rid), [f.bucket.frame()])

        def wait_one() -> None:
            nonlocal retries
            oldest = min(inflight.values(), key=lambda f: f.sent_at)
            reply = self._recv(max(0.0, oldest.sent_at + self.timeout - time.monotonic()))
            if reply is RECONNECTED:  # what was in flight died with the old connection
                for f in sorted(inflight.values(), key=lambda f: f.bucket.seq):
                    f.sent_at = time.monotonic()
                    send(f)
                log.warning("buckets_resent_after_reconnect", sync_id=sync_id, buckets=len(inflight))
                return
            if reply is None:  # the oldest timed out: resend it (same sync_id and seq)
                if oldest.attempts > self.retries:
                    raise make_error(ErrorCode.TIMEOUT,
                                     f"bucket seq {oldest.bucket.seq} not acknowledged after "
                                     f"{oldest.attempts} attempt(s) of {self.timeout}s",
                                     sync_id=sync_id, state="LOADING_BUCKETS")
                oldest.attempts += 1
                oldest.sent_at = time.monotonic()
                retries += 1
                log.warning("bucket_resent", sync_id=sync_id, seq=oldest.bucket.seq,
                            attempt=oldest.attempts)
                send(oldest)
                return
            seq = by_id.pop(reply.id, None)
            if seq is None:
                return  # a reply to an earlier attempt already handled
            if isinstance(reply, schema.Error):
                raise error_from_reply(reply)
            f = inflight.pop(seq, None)
            if f is not None and progress is not None:
                progress(f.bucket.nbytes)

        slots = ring if ring is not None else InlineRing(window)

        def alloc(seq: int, n: int) -> torch.Tensor:
            # Room first: slot seq % window belongs to bucket seq - window until that bucket
            # is acknowledged (every engine has copied it out), whatever order acks come in.
            while len(inflight) >= window or (seq - window) in inflight:
                wait_one()
            return slots.slot(seq, n)

        for bucket in iter_buckets(named, bucket_bytes, alloc=alloc, digester=digester):
            f = _InFlight(bucket, time.monotonic())
            inflight[bucket.seq] = f
            send(f)
            count += 1
            nbytes += bucket.nbytes
        while inflight:
            wait_one()
        return count, nbytes, retries
